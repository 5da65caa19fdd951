"""Peak live tensor bytes of a training step: the most tensor memory alive at once while a step runs.

Measured on the device's own accounting, per device:

* **CUDA**: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``, minus
  ``torch.cuda.memory_allocated`` before the step (the caching allocator's count: block sizes rounded up to
  512 bytes; its cache and fragmentation are not counted). Two device syncs.
* **CPU**: the profiler's memory events (``torch.profiler.profile(profile_memory=True)``): every allocation and
  free of the CPU allocator in the step, in time order; the peak is the maximum of their running sum above the
  level at the start (bytes *requested*, no allocator rounding). The profiler costs time: never inside a timed step.
* **MPS**: ``torch.mps.current_allocated_memory`` *sampled*: before and after the step, at the end of every
  module's forward and at every parameter's gradient accumulation (when ``model`` is given). A lower bound of
  the true peak (a peak between two samples is missed).

The baseline is what is alive when the step starts: on CUDA and MPS the allocator's count (every tensor on the
device), on CPU a census of the ``resident`` tensors the caller names (:func:`resident_tensors`: parameters,
buffers, gradients, the optimizer's parameters and state), each storage once. Source: the method of the
issue-27 measurement (validated against a tensor census in tests/test_memory_live.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.memory.storages import StorageCounter

__all__ = ["LiveMeter", "PeakLive", "peak_live_bytes", "resident_tensors", "running_peak"]

_SOURCES = {
    "cuda": "torch.cuda.max_memory_allocated - memory_allocated before",
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


def peak_live_bytes(step: Callable[[], Any], device: torch.device | str, *,
                    resident: Iterable[torch.Tensor] = (), model: nn.Module | None = None) -> tuple[Any, PeakLive]:
    """Runs ``step()`` (one whole training step: forward, backward, optimizer step) and returns its output with
    its :class:`PeakLive` on ``device`` (``"cpu"``, ``"cuda"``, ``"mps"``; see the module docstring for each
    source). ``resident``: the CPU baseline's tensors (:func:`resident_tensors`; ignored on CUDA and MPS);
    ``model``: MPS samples during its forward and backward. Host syncs: a device sync before and after on CUDA
    and MPS, one per sample on MPS.

    Raises:
        ValueError: ``device`` is not cpu, cuda or mps.
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
    :meth:`start`."""

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
            counter = StorageCounter()
            self._baseline = sum(counter.add(t) for t in self._resident if t.device.type == "cpu")
            self._running = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True, record_shapes=False)
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
            running.stop()
            peak = running_peak(_cpu_memory_events(running))
        else:
            peak = running.stop() - baseline
        return PeakLive(bytes=max(0, peak), baseline=baseline, source=_SOURCES[kind])


def _cpu_memory_events(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    """``(time ns, signed bytes)`` of the CPU allocator's events (+ allocation, - free), in recorded order."""
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    return [(e.start_ns(), e.nbytes()) for e in events
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]


def running_peak(events: Iterable[tuple[int, int]]) -> int:
    """The maximum of the running sum of ``(time, signed bytes)`` events taken in time order (ties in the given
    order) above the level at the start: 0 if nothing was allocated beyond what was freed."""
    level = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
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
