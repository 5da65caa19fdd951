"""The per-thread on/off switch of an autocast extension (:mod:`~mixprec.autocast.portable`'s ops,
:mod:`~mixprec.autocast.op_plan`'s kernels).

Each extension registers its kernels once per device type, on the device's autocast key, and the kernels ask
the switch whether they are on in the calling thread (autocast itself is per thread); off, they do what
torch's own kernel does. A :class:`Switch` holds, per thread, the device types it is on for: entering
:meth:`Switch.turned_on` adds one (and installs its kernels first), :meth:`Switch.exactly` sets the whole set
(what :func:`mixprec.ops.checkpoint` restores for a recompute), and leaving either restores what was there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

__all__ = ["Switch"]


class Switch:
    """The device types an extension is on for, per thread. ``devices``: the device types it can be on for
    (for any other, :meth:`turned_on` is a no-op and :meth:`exactly` leaves it out); ``install(device_type)``:
    registers the extension's kernels for a device type, called before it is turned on (it must return at
    once when they are registered already). No host sync anywhere."""

    def __init__(self, devices: Collection[str], install: Callable[[str], None]) -> None:
        self._devices = frozenset(devices)
        self._install = install
        self._local = threading.local()    # .devices: the tuple of device types on in this thread

    def on(self) -> tuple[str, ...]:
        """The device types the extension is on for in this thread now, in the order they were turned on."""
        return tuple(getattr(self._local, "devices", ()))

    def is_on(self, device_type: str) -> bool:
        """Whether the extension is on for ``device_type`` in this thread (what its kernels ask)."""
        return device_type in getattr(self._local, "devices", ())

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
        moment) in this thread, and off for every other; restores the previous state on exit."""
        devices = tuple(d for d in devices if d in self._devices)
        for device_type in devices:
            self._install(device_type)
        previous = getattr(self._local, "devices", ())
        self._local.devices = devices
        try:
            yield
        finally:
            self._local.devices = previous
