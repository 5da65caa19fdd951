"""What the bench measures: step time, throughput, peak memory and training-state bytes.

* **Step time**: wall time of one training step (inputs cast → forward under autocast →
  backward → ``mp.step()``), with a device sync before starting and before stopping the clock;
  the bench reports the median over the steps after a warm-up (first calls initialise kernels
  and allocators and are much slower; under ``--compile`` the first step compiles the model: that
  time is reported apart, :func:`warmup_excess_s`).
* **Peak memory** (MiB): on CPU the process's peak resident set size (``resource.getrusage``
  ``ru_maxrss``; psutil's ``peak_wset`` on Windows), so it includes the interpreter and torch's
  libraries (a few hundred MiB); on CUDA ``torch.cuda.max_memory_allocated``; on MPS the maximum
  of ``torch.mps.driver_allocated_memory`` sampled after every step.
* **Training-state bytes** (:func:`state_bytes`): read from the actual tensors, never from the
  policy: parameters, gradients, fp32 master copies, every tensor in ``optimizer.state``
  (moments, Kahan compensation buffers; 8-bit state's codes and their fp32 absmax scales, which
  :mod:`mixprec.optim.quantized_state` keeps as plain tensors there), each storage counted once (tied
  weights share one; a code book shared by every param's state, as bitsandbytes' ``qmap``, once). A
  tensor subclass that wraps other tensors (torchao's ``OptimState8bit`` reports dtype float32 but holds
  uint8 ``codes``, fp32 ``scale`` and ``qmap``; a DTensor its local shard) is counted by the tensors it
  holds (``__tensor_flatten__``, recursively), never by its nominal dtype.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from mixprec.machine.timing import time_calls
from mixprec.memory.storages import StorageCounter
from mixprec.optim.quantized_state import ABSMAX_SUFFIX

__all__ = ["StateBytes", "state_bytes", "time_steps", "median_step_ms", "percentile", "warmup_excess_s", "MemoryMeter"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state by role, counted once per storage.

    ``grads`` holds every gradient (the params' and the masters'); ``optimizer_state`` every
    per-element tensor in ``optimizer.state`` except ``compensation`` (Kahan ``kahan_comp``), of which
    ``quantized_state`` is 8-bit state (codes, one byte per element, and their fp32 ``*_absmax`` scales,
    one per 256 elements) and ``quantized_elements`` the elements those codes hold (per moment);
    ``scalars`` the 0-dim tensors there (``step`` counters: a few bytes per tensor, not per
    parameter, so outside :attr:`per_param`). ``n_params`` counts model parameters once, of which
    ``n_frozen`` are frozen (``requires_grad=False``: e.g. a LoRA base); ``frozen_bytes`` is what
    their storage takes (part of ``params``). Everything else is the trainable part's state.
    """

    params: int
    grads: int
    masters: int
    optimizer_state: int
    compensation: int
    scalars: int
    n_params: int
    n_frozen: int = 0
    frozen_bytes: int = 0
    quantized_state: int = 0
    quantized_elements: int = 0

    @property
    def total(self) -> int:
        """Per-element training-state bytes (everything but ``scalars``)."""
        return self.params + self.grads + self.masters + self.optimizer_state + self.compensation

    @property
    def per_param(self) -> float:
        """``total / n_params``: 16.0 for fp32 AdamW (4 param + 4 grad + 4 + 4 moments)."""
        return self.total / self.n_params if self.n_params else 0.0

    @property
    def n_trainable(self) -> int:
        return self.n_params - self.n_frozen

    @property
    def per_trainable_param(self) -> float:
        """Bytes per trainable parameter: its storage, gradient, master and optimizer state."""
        return (self.total - self.frozen_bytes) / self.n_trainable if self.n_trainable else 0.0

    @property
    def per_frozen_param(self) -> float | None:
        """Bytes per frozen parameter (2.0 when stored in bf16); None without frozen params."""
        return self.frozen_bytes / self.n_frozen if self.n_frozen else None

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "per_param": self.per_param,
                "n_trainable": self.n_trainable, "per_trainable_param": self.per_trainable_param,
                "per_frozen_param": self.per_frozen_param}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    """Measure the training state of ``model`` and ``optimizer`` from their tensors (no sync).

    Call it right after ``backward`` and before the optimizer step that follows at least one
    earlier step, so gradients and optimizer state both exist. Optimizer params that are not
    model params are counted as masters (the engine rebinds the optimizer to fp32 masters).
    """
    counter = StorageCounter()
    model_params = list(model.parameters())  # unique: tied weights appear once
    frozen = [p for p in model_params if not p.requires_grad]
    frozen_bytes = sum(counter.add(p) for p in frozen)
    params = frozen_bytes + sum(counter.add(p) for p in model_params if p.requires_grad)
    grads = sum(counter.add(p.grad) for p in model_params)
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    masters = sum(counter.add(p) for p in opt_params)
    grads += sum(counter.add(p.grad) for p in opt_params)
    optimizer_state = compensation = scalars = quantized = quantized_elements = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            size = counter.add(value)
            if value.dim() == 0:
                scalars += size
            elif key == "kahan_comp":
                compensation += size
            else:
                optimizer_state += size
                codes = isinstance(key, str) and key + ABSMAX_SUFFIX in state   # the codes of an 8-bit moment
                quantized += size if codes or (isinstance(key, str) and key.endswith(ABSMAX_SUFFIX)) else 0
                quantized_elements += value.numel() if codes else 0
    return StateBytes(params=params, grads=grads, masters=masters, optimizer_state=optimizer_state,
                      compensation=compensation, scalars=scalars,
                      n_params=sum(p.numel() for p in model_params),
                      n_frozen=sum(p.numel() for p in frozen), frozen_bytes=frozen_bytes,
                      quantized_state=quantized, quantized_elements=quantized_elements)


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


def warmup_excess_s(step_times_ms: list[float], warmup_steps: int) -> float:
    """Seconds the first ``warmup_steps`` steps took beyond the median of the timed ones (never
    negative): under ``torch.compile`` the compilation (the first step, and any recompilation in
    the warm-up), reported apart from the step time; in eager the first calls' kernel and
    allocator set-up."""
    median = median_step_ms(step_times_ms, warmup_steps)
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
            self.source = "process peak RSS"

    def sample(self) -> None:
        if self.device.type == "mps":
            self._mps_peak_bytes = max(self._mps_peak_bytes, torch.mps.driver_allocated_memory())

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "mps":
            self.sample()
            return self._mps_peak_bytes / 2**20
        return _peak_rss_bytes() / 2**20


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return int(psutil.Process().memory_info().peak_wset)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, KiB elsewhere
