"""What the bench measures: step time, throughput, peak memory and training-state bytes.

* **Step time**: wall time of one training step (inputs cast → forward under autocast →
  backward → ``mp.step()``), with a device sync before starting and before stopping the clock;
  the bench reports the median over the steps after a warm-up (first calls initialise kernels
  and allocators and are much slower; under ``--compile`` the first step compiles the model: that
  time is reported apart, :func:`warmup_excess_s`).
* **Peak memory** (MiB): on CPU the process's own peak resident set size, so it includes the interpreter
  and torch's libraries (a few hundred MiB): ``VmHWM`` of ``/proc/self/status`` on Linux (per address space,
  reset by ``exec``: a worker's own peak), psutil's ``peak_wset`` on Windows, else ``resource.getrusage``'s
  ``ru_maxrss``, which Linux and other systems carry across fork+exec: a worker launched by the bench would read
  its parent's peak as a floor, so that source says so (:attr:`MemoryMeter.source`, each row's
  ``memory_source`` in results.json, and report.md); on CUDA ``torch.cuda.max_memory_allocated``; on MPS the maximum
  of ``torch.mps.driver_allocated_memory`` sampled after every step.
* **Training-state bytes** (:func:`state_bytes`, re-exported from :mod:`mixprec.memory.state`, the
  one count ``mixprec train`` reports per rank too): read from the actual tensors, never from the
  policy: parameters, gradients, fp32 masters, every tensor in ``optimizer.state``, each storage once,
  a tensor subclass by the tensors it holds, a DTensor (FSDP2) by its local shard.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch

from mixprec.machine.timing import time_calls
from mixprec.memory.state import StateBytes, state_bytes

__all__ = ["StateBytes", "state_bytes", "time_steps", "median_step_ms", "percentile", "warmup_excess_s", "MemoryMeter"]


def time_steps(step: Callable[[], None], device: torch.device, n: int) -> list[float]:
    """Wall time of ``n`` calls of ``step()`` in ms, each bracketed by a device sync on CUDA and MPS
    (:func:`mixprec.machine.timing.time_call`: a host sync per call there; none on the CPU)."""
    return [seconds * 1e3 for seconds in time_calls(step, device, n)]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_step_ms(step_times_ms: list[float], warmup_steps: int) -> float:
    """Median of ``step_times_ms`` after dropping the first ``warmup_steps`` (all if too few)."""
    timed = step_times_ms[warmup_steps:] or step_times_ms
    if not timed:
        raise ValueError("median_step_ms: no step times were recorded; run at least one step")
    return statistics.median(timed)


def warmup_excess_s(step_times_ms: list[float], warmup_steps: int, median: float | None = None) -> float:
    """Seconds the first ``warmup_steps`` steps took beyond ``median`` (ms; default: the median of the steps
    after them), never negative: under ``torch.compile`` the compilation (the first step, and any recompilation
    in the warm-up), reported apart from the step time; in eager the first calls' kernel and allocator set-up."""
    median = median_step_ms(step_times_ms, warmup_steps) if median is None else median
    return sum(max(0.0, t - median) for t in step_times_ms[:warmup_steps]) / 1e3


class MemoryMeter:
    """Peak memory of this process on ``device`` in MiB (see the module docstring for the source).

    Call :meth:`sample` after each step (it matters on MPS only, where the driver reports current,
    not peak, memory; it syncs nothing). :attr:`source` names what :meth:`peak_mb` reads.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._mps_peak_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.source = "torch.cuda.max_memory_allocated"
        elif self.device.type == "mps":
            self.source = "max of torch.mps.driver_allocated_memory"
        else:
            self.source = _peak_rss()[1]

    def sample(self) -> None:
        if self.device.type == "mps":
            self._mps_peak_bytes = max(self._mps_peak_bytes, torch.mps.driver_allocated_memory())

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "mps":
            self.sample()
            return self._mps_peak_bytes / 2**20
        return _peak_rss()[0] / 2**20


PROC_SELF_STATUS = "/proc/self/status"   # Linux: VmHWM, this address space's peak RSS (reset by exec)
RU_MAXRSS_SOURCE = ("process peak RSS (getrusage ru_maxrss: no VmHWM here; floored at the peak of the process "
                    "that launched this one, which Linux and other systems carry across fork+exec)")


def _vm_hwm_bytes() -> int | None:
    """``VmHWM`` of :data:`PROC_SELF_STATUS` in bytes; None where the file or the line is missing."""
    try:
        with open(PROC_SELF_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024}[unit]
    except (OSError, ValueError, KeyError):
        return None
    return None


def _peak_rss() -> tuple[int, str]:
    """(this process's peak RSS in bytes, where it was read): the module docstring's order of sources."""
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm, "process peak RSS (VmHWM of /proc/self/status: this process's own)"
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return int(psutil.Process().memory_info().peak_wset), "process peak RSS (psutil peak_wset: this process's own)"
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (max_rss if sys.platform == "darwin" else max_rss * 1024), RU_MAXRSS_SOURCE   # bytes on macOS, else KiB
