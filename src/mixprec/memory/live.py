"""Peak live tensor bytes of a training step: the most tensor memory alive at once while a step runs.

Measured on the device's own accounting, per device:

* **CUDA**: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``, minus
  ``torch.cuda.memory_allocated`` before the step (the caching allocator's count: block sizes rounded up to
  512 bytes; its cache and fragmentation are not counted). Two device syncs. The reset cannot be undone (torch
  has no setter for the peak): a ``max_memory_allocated()`` of the caller's read later counts from the step's
  start, and :attr:`PeakLive.source` says so (the engine's ``"memory-budget"`` event carries it).
* **CPU**: the profiler's memory events (the autograd profiler with ``profile_memory``, in its legacy
  thread-local mode: no libkineto session): every allocation and free of the CPU allocator in the step, in time
  order; the peak is the maximum of their running sum above the level at the start (bytes *requested*, no
  allocator rounding). The profiler costs time: never inside a timed step. Never inside another profiler session
  either (torch 2.13: a kineto session of the meter's own, nested in the caller's, ended the caller's trace; one
  opened while a caller's scheduled session warmed up made that session's start crash; the legacy mode leaves
  libkineto alone, and refuses to nest): while one records, or while a caller holds the meter (:func:`held`: a
  trainer whose profiler opens its session inside a step), :func:`blocked` says why and the meter refuses to
  start (the engine's ``memory_budget=`` waits for a step without one). A session opened *inside* the window is
  refused by torch ("Profiler is already enabled on this thread"): hold the meter around such a step.
* **MPS**: ``torch.mps.current_allocated_memory`` *sampled*: before and after the step, at the end of every
  module's forward and at every parameter's gradient accumulation (when ``model`` is given). A lower bound of
  the true peak (a peak between two samples is missed).

The baseline is what is alive when the step starts: on CUDA and MPS the allocator's count (every tensor on the
device), on CPU a census of the ``resident`` tensors the caller names (:func:`resident_tensors`: parameters,
buffers, gradients, the optimizer's parameters and state), each storage once. Validated against a tensor
census in tests/memory/test_memory_live.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.memory.storages import StorageCounter

__all__ = ["LiveMeter", "PeakLive", "blocked", "held", "peak_live_bytes", "resident_tensors", "running_peak"]

_SOURCES = {
    "cuda": ("torch.cuda.max_memory_allocated - memory_allocated before (the allocator's peak statistics reset at "
             "the step's start: a max_memory_allocated() read later counts from there)"),
    "cpu": "profiler memory events (requested bytes)",
    "mps": "torch.mps.current_allocated_memory sampled (lower bound)",
}


@dataclass(frozen=True)
class PeakLive:
    """Peak live tensor bytes of one step. ``bytes``: the most the step added above its start (activations,
    gradients, temporaries, new optimizer state); ``baseline``: bytes alive at the start (see the module
    docstring: the allocator's count, or on CPU the census of the resident tensors); ``source``: how it was
    measured. ``total`` = ``baseline + bytes``, the peak of tensor memory during the step."""

    bytes: int
    baseline: int
    source: str

    @property
    def total(self) -> int:
        """``baseline + bytes``: the step's peak of live tensor bytes."""
        return self.baseline + self.bytes

    @property
    def total_mib(self) -> float:
        """``total`` in MiB (2**20 bytes)."""
        return self.total / 2**20

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"bytes", "baseline", "total", "total_mib", "source"}``."""
        return {"bytes": self.bytes, "baseline": self.baseline, "total": self.total, "total_mib": self.total_mib,
                "source": self.source}


def resident_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[torch.Tensor]:
    """The tensors a training step starts with: ``model``'s parameters, buffers and gradients, and the
    ``optimizer``'s parameters (an engine's fp32 masters), their gradients and every tensor in its state.
    For :func:`peak_live_bytes`'s CPU baseline (count them with a ``StorageCounter``: storages once)."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


_HELD: list[str] = []   # why callers hold the CPU meter now (innermost last)


@contextmanager
def held(why: str) -> Iterator[None]:
    """Inside, :func:`blocked` returns ``why`` on the CPU: the caller knows a profiler session of someone else's
    may open inside the window (Lightning's ``PyTorchProfiler`` steps its schedule inside a training step), where
    the meter's own would make it fail. No host sync."""
    _HELD.append(why)
    try:
        yield
    finally:
        _HELD.remove(why)


def blocked(device: torch.device | str) -> str | None:
    """Why a :class:`LiveMeter` on ``device`` cannot run now without disturbing the caller's own measurement, in
    words; None when it can. On the CPU: a profiler session is recording (``torch.profiler``,
    ``torch.autograd.profiler``, Lightning's ``PyTorchProfiler``: torch refuses a second one on the thread), or a
    caller :func:`held` the meter. No host sync."""
    if torch.device(device).type != "cpu":
        return None
    if _HELD:
        return _HELD[-1]
    if torch.autograd._profiler_enabled():
        return ("a profiler session was recording, and the CPU measurement runs the profiler itself (torch allows one "
                "session per thread)")
    return None


def peak_live_bytes(step: Callable[[], Any], device: torch.device | str, *,
                    resident: Iterable[torch.Tensor] = (), model: nn.Module | None = None) -> tuple[Any, PeakLive]:
    """Runs ``step()`` (one whole training step: forward, backward, optimizer step) and returns its output with
    its :class:`PeakLive` on ``device`` (``"cpu"``, ``"cuda"``, ``"mps"``; see the module docstring for each
    source). ``resident``: the CPU baseline's tensors (:func:`resident_tensors`; ignored on CUDA and MPS);
    ``model``: MPS samples during its forward and backward. Host syncs: a device sync before and after on CUDA
    and MPS, one per sample on MPS.

    Raises:
        ValueError: ``device`` is not cpu, cuda or mps.
        RuntimeError: a profiler session is recording on the CPU (:func:`blocked`).
    """
    meter = LiveMeter(device, resident=resident, model=model)
    meter.start()
    try:
        out = step()
    finally:
        live = meter.stop()
    return out, live


class LiveMeter:
    """:func:`peak_live_bytes` for a step that is not one call (an engine's step: the caller's forward, then
    ``backward()`` and ``step()``): :meth:`start` before it, :meth:`stop` after it (same thread) returns its
    :class:`PeakLive`. Arguments, sources and host syncs as :func:`peak_live_bytes`; the resident tensors are
    counted at :meth:`start`. ValueError: ``device`` is not cpu, cuda or mps; RuntimeError: :meth:`stop` before
    :meth:`start`, or :meth:`start` while a profiler session records on the CPU (:func:`blocked`)."""

    def __init__(self, device: torch.device | str, *, resident: Iterable[torch.Tensor] = (),
                 model: nn.Module | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type not in _SOURCES:
            raise ValueError(f"peak_live_bytes: device={str(device)!r} is not measured; allowed: cpu, cuda, mps")
        self._resident, self._model = resident, model
        self._baseline: int | None = None
        self._running: Any = None   # the CPU profiler, or MPS's sampler

    def start(self) -> None:
        """Take the baseline and start counting (the module docstring says how, per device)."""
        kind = self.device.type
        if kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        elif kind == "cpu":
            why = blocked(self.device)
            if why is not None:
                raise RuntimeError(f"peak_live_bytes on the CPU: {why}; measure outside the session (after its "
                                   "stop()), or on a step it does not profile")
            counter = StorageCounter()
            self._baseline = sum(counter.add(t) for t in self._resident if t.device.type == "cpu")
            self._running = _CpuAllocations()
            self._running.start()
        else:
            self._running = _MpsSampler(self._model)
            self._baseline = self._running.peak

    def stop(self) -> PeakLive:
        """Stop counting and return the step's :class:`PeakLive`."""
        if self._baseline is None:
            raise RuntimeError("LiveMeter.stop() before LiveMeter.start()")
        baseline, running, self._baseline, self._running = self._baseline, self._running, None, None
        kind = self.device.type
        if kind == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - baseline
        elif kind == "cpu":
            peak = running_peak(running.stop())
        else:
            peak = running.stop() - baseline
        return PeakLive(bytes=max(0, peak), baseline=baseline, source=_SOURCES[kind])


class _CpuAllocations:
    """The CPU allocator's events of one window, from the autograd profiler's legacy thread-local mode (module
    docstring: no libkineto session of its own)."""

    def start(self) -> None:
        config = torch.autograd.ProfilerConfig(torch.autograd.ProfilerState.CPU, False, True, False, False, False,
                                               torch._C._profiler._ExperimentalConfig())   # memory events only
        torch.autograd._enable_profiler_legacy(config)

    def stop(self) -> list[list[tuple[float, int]]]:
        """Per recording thread, ``(time µs, signed bytes)`` of each allocation (+) and free (-) in recorded order.
        RuntimeError when the session is no longer the meter's (another profiler ended it or took the thread's
        slot: the events are not the window's)."""
        if torch._C._autograd._profiler_type() != torch._C._profiler.ActiveProfilerType.LEGACY:
            raise RuntimeError("the CPU measurement's profiler session was ended from outside during the window (a "
                               "profiler session opened inside it); its memory events are not the window's")
        threads = [list(thread) for thread in torch.autograd._disable_profiler_legacy()]
        start = next((thread[0] for thread in threads if thread), None)
        return [[(start.cpu_elapsed_us(e), e.cpu_memory_usage()) for e in thread if e.kind() == "memory_alloc"]
                for thread in threads]


def running_peak(threads: Iterable[Iterable[tuple[float, int]]]) -> int:
    """The maximum of the running sum of signed byte counts above the level at the start (0 if nothing was
    allocated beyond what was freed). ``threads``: per recording thread, ``(time, signed bytes)`` events in recorded
    order; threads are interleaved by time (``heapq.merge``), a thread's own events never reordered: the profiler
    stamps them with the wall clock (``CLOCK_REALTIME``), which a clock step (NTP) moves backwards mid-window, and
    a sort by stamp would then move frees before the allocations they free."""
    level = peak = 0
    for _, nbytes in heapq.merge(*threads, key=lambda e: e[0]):
        level += nbytes
        peak = max(peak, level)
    return peak


class _MpsSampler:
    """MPS's running peak: sampled now, at the end of every module's forward and at every parameter's gradient
    accumulation of ``model`` (when given), and at :meth:`stop`."""

    def __init__(self, model: nn.Module | None) -> None:
        torch.mps.synchronize()
        self.peak = torch.mps.current_allocated_memory()
        self._handles: list[Any] = []
        if model is not None:
            self._handles += [m.register_forward_hook(self.sample) for m in model.modules()]
            self._handles += [p.register_post_accumulate_grad_hook(self.sample) for p in model.parameters()
                              if p.requires_grad]

    def sample(self, *_: Any) -> None:
        torch.mps.synchronize()
        self.peak = max(self.peak, torch.mps.current_allocated_memory())

    def stop(self) -> int:
        for handle in self._handles:
            handle.remove()
        self.sample()
        return self.peak
