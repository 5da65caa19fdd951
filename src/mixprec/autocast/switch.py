"""The on/off switch of an autocast extension (:mod:`~mixprec.autocast.portable`'s ops,
:mod:`~mixprec.autocast.op_plan`'s kernels): per thread, per backward pass, per traced graph.

Each extension registers its kernels once per device type, on the device's autocast key, and the kernels ask
the switch whether they are on (autocast itself is per thread); off, they do what torch's own kernel does. A
:class:`Switch` is on for a device type in three cases:

* **this thread** turned it on: :meth:`Switch.turned_on` adds a device type (and installs its kernels first),
  :meth:`Switch.exactly` sets the whole set (what :func:`mixprec.ops.checkpoint` restores for a recompute,
  and then only that set counts), leaving either restores what was there;
* **this backward pass** holds it: :func:`hold_in_backward` registers, on a tensor's ``grad_fn``, a pre-hook
  that marks the autograd graph task reaching it (``torch._C._current_graph_task_id()``) with the switches
  on when the hold was taken, and queues (``Variable._execution_engine.queue_callback``) the unmarking at
  the end of that pass. So a ``torch.utils.checkpoint`` recompute during any gradient call through the
  held tensor (``torch.autograd.grad`` included, and on CUDA in autograd's device thread, which the caller's
  thread-local state does not reach) casts as the forward did;
* **a graph being traced** says so: :func:`traced_annotation` gives the ``torch.fx.traceback.annotate``
  dict that ``mp.autocast()`` enters while torch.compile traces it; dynamo and AOTAutograd run each node's
  ops with that node's annotation current, so the kernels that run while the graph is traced (the only
  time they run for a compiled graph) see it, with no graph break.

No host sync anywhere.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch
import torch.fx.traceback as fx_traceback

__all__ = ["Switch", "SwitchState", "captured", "hold_in_backward", "traced_annotation"]

_ANNOTATION = "mixprec.switches"   # the key of the fx annotation: {switch name: device types}

#: Switches and the device types each is on for, as :func:`captured` takes them.
SwitchState = tuple[tuple["Switch", tuple[str, ...]], ...]


class Switch:
    """The device types an extension is on for (module docstring). ``devices``: the device types it can be
    on for (for any other, :meth:`turned_on` is a no-op and :meth:`exactly` leaves it out);
    ``install(device_type)``: registers the extension's kernels for a device type, called before it is
    turned on (it must return at once when they are registered already). The switch's :attr:`name` is
    ``install``'s module. No host sync anywhere."""

    _every: weakref.WeakSet[Switch] = weakref.WeakSet()   # every switch (what :func:`captured` reads)

    def __init__(self, devices: Collection[str], install: Callable[[str], None]) -> None:
        self._devices = frozenset(devices)
        self._install = install
        self.name = getattr(install, "__module__", None) or repr(install)
        self._local = threading.local()    # .devices: the tuple on in this thread; .exact: set by exactly()
        self._tasks: dict[int, tuple[str, ...]] = {}   # autograd graph task id -> device types held on in it
        Switch._every.add(self)

    def on(self) -> tuple[str, ...]:
        """The device types the extension is on for here now (this thread, its backward pass, a traced graph),
        in the order they were turned on."""
        devices = getattr(self._local, "devices", ())
        if getattr(self._local, "exact", False):
            return devices
        extra = self._held() + self._traced()
        return devices + tuple(dict.fromkeys(d for d in extra if d not in devices))

    def is_on(self, device_type: str) -> bool:
        """Whether the extension is on for ``device_type`` here now (what its kernels ask)."""
        if device_type in getattr(self._local, "devices", ()):
            return True
        if getattr(self._local, "exact", False):
            return False
        return device_type in self._held() or device_type in self._traced()

    def _held(self) -> tuple[str, ...]:
        if not self._tasks:
            return ()
        return self._tasks.get(torch._C._current_graph_task_id(), ())

    def _traced(self) -> tuple[str, ...]:
        custom = fx_traceback.current_meta.get("custom")
        return () if not custom else tuple(custom.get(_ANNOTATION, {}).get(self.name, ()))

    @contextmanager
    def turned_on(self, device_type: str, *, enabled: bool = True) -> Iterator[None]:
        """Inside, the extension is on for ``device_type`` too in this thread (a no-op with ``enabled=False``
        or for a device type it cannot be on for); restores the previous state on exit."""
        if not enabled or device_type not in self._devices:
            yield
            return
        self._install(device_type)
        previous = getattr(self._local, "devices", ())
        self._local.devices = previous + (device_type,)
        try:
            yield
        finally:
            self._local.devices = previous

    @contextmanager
    def exactly(self, devices: tuple[str, ...]) -> Iterator[None]:
        """Inside, the extension is on for exactly ``devices`` (those it can be on for; :meth:`on` of an earlier
        moment) in this thread, and off for every other (a held backward pass or a traced graph included);
        restores the previous state on exit."""
        devices = tuple(d for d in devices if d in self._devices)
        for device_type in devices:
            self._install(device_type)
        previous = getattr(self._local, "devices", ()), getattr(self._local, "exact", False)
        self._local.devices, self._local.exact = devices, True
        try:
            yield
        finally:
            self._local.devices, self._local.exact = previous

    def _mark(self, task: int, devices: tuple[str, ...]) -> None:
        held = self._tasks.get(task, ())
        self._tasks[task] = held + tuple(d for d in devices if d not in held)

    def _unmark(self, task: int) -> None:
        self._tasks.pop(task, None)


def captured() -> SwitchState:
    """Every switch that is on here now, with its device types (:meth:`Switch.on`): what
    :func:`hold_in_backward` carries into a backward pass. No host sync."""
    return tuple((s, s.on()) for s in list(Switch._every) if s.on())


_queued: set[int] = set()   # graph tasks whose unmarking is queued
_queued_lock = threading.Lock()


def _unmark_all(task: int) -> None:
    for switch in list(Switch._every):
        switch._unmark(task)
    with _queued_lock:
        _queued.discard(task)


class _HoldInBackward:
    """The ``grad_fn`` pre-hook of :func:`hold_in_backward` (holds switches, never an engine)."""

    __slots__ = ("state",)

    def __init__(self, state: SwitchState) -> None:
        self.state = state

    def __call__(self, grad_outputs: tuple) -> None:
        task = torch._C._current_graph_task_id()
        if task < 0:
            return
        for switch, devices in self.state:
            switch._mark(task, devices)
        with _queued_lock:
            first = task not in _queued
            _queued.add(task)
        if first:   # the end of this backward pass unmarks it (a failed pass leaves an id that never recurs)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _unmark_all(task))


def hold_in_backward(state: SwitchState, tensors: list[torch.Tensor]) -> int:
    """In every backward pass that reaches one of ``tensors`` (``backward()``, ``torch.autograd.grad``, in
    whatever thread autograd runs it), the switches of ``state`` are on from that tensor's ``grad_fn`` to
    the end of the pass (module docstring). Tensors without a ``grad_fn`` are skipped; returns how many
    hooks were registered. No host sync."""
    if not state:
        return 0
    hook, seen = _HoldInBackward(state), set()
    for t in tensors:
        node = getattr(t, "grad_fn", None)
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            node.register_prehook(hook)
    return len(seen)


def traced_annotation(state: SwitchState) -> dict[str, dict[str, tuple[str, ...]]]:
    """The ``torch.fx.traceback.annotate`` dict under which a traced graph's kernels see the switches of
    ``state`` on (module docstring)."""
    return {_ANNOTATION: {switch.name: devices for switch, devices in state}}
