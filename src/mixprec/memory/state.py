"""Training-state bytes, counted from the tensors: parameters, gradients, fp32 masters, optimizer state.

The one count both ``mixprec bench`` (each row's ``state_bytes``) and ``mixprec train`` (each rank's ``"state"``
record, :mod:`mixprec.distributed.rank_state`) report. Read from the actual tensors, never from the policy: every
tensor in ``optimizer.state`` (moments, Kahan compensation buffers; 8-bit state's codes and their fp32 absmax
scales, which :mod:`mixprec.optim.quantized_state` keeps as plain tensors there), each storage counted once
(:class:`mixprec.memory.storages.StorageCounter`: tied weights share one; a code book shared by every param's
state, as bitsandbytes' ``qmap``, once). A tensor subclass that wraps other tensors (torchao's ``OptimState8bit``
reports dtype float32 but holds uint8 ``codes``, fp32 ``scale`` and ``qmap``) is counted by the tensors it holds,
never by its nominal dtype.

**Under FSDP2** (a DTensor param, gradient or state) this process holds its *local shard* only: it is counted by
``to_local()`` as allocated (FSDP2 holds params and gradients padded to ``ceil(d0 / W)`` rows on every rank, the
optimizer state on the rank's own rows) and ``quantized_elements`` counts the shard's elements, not the global
ones; a plain tensor every rank holds whole (8-bit state's fp32 scales) counts whole, and is also reported in
``whole``. ``n_params`` stays the *global* parameter count, so ``per_param`` is bytes per parameter **per rank**
(at 2 ranks, half of one process's plus what is held whole). Source: the bench's count, made shard-aware
(every rank counts its own shards).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from mixprec.memory.storages import StorageCounter
from mixprec.optim.quantized_state import ABSMAX_SUFFIX

__all__ = ["StateBytes", "state_bytes", "is_sharded"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state by role on this process, counted once per storage.

    ``grads`` holds every gradient (the params' and the masters'); ``optimizer_state`` every
    per-element tensor in ``optimizer.state`` except ``compensation`` (Kahan ``kahan_comp``), of which
    ``quantized_state`` is 8-bit state (codes, one byte per element, and their fp32 ``*_absmax`` scales,
    one per 256 elements) and ``quantized_elements`` the elements those codes hold here (per moment; a
    shard's own under FSDP2); ``whole`` the part of ``optimizer_state`` in plain tensors when params are
    sharded (8-bit scales under FSDP2: every rank holds them whole; 0 in one process). ``scalars`` the 0-dim
    tensors there (``step`` counters: a few bytes per tensor, not per parameter, so outside :attr:`per_param`).
    ``n_params`` counts model parameters once (globally, under FSDP2), of which ``n_frozen`` are frozen
    (``requires_grad=False``: e.g. a LoRA base); ``frozen_bytes`` is what their storage takes (part of
    ``params``). Everything else is the trainable part's state.
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
    whole: int = 0

    @property
    def total(self) -> int:
        """Per-element training-state bytes (everything but ``scalars``)."""
        return self.params + self.grads + self.masters + self.optimizer_state + self.compensation

    @property
    def per_param(self) -> float:
        """``total / n_params``: 16.0 for fp32 AdamW (4 param + 4 grad + 4 + 4 moments); per rank under FSDP2."""
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


def is_sharded(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a global tensor: it has ``to_local`` and a ``device_mesh``)."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This process's part of ``tensor``: a DTensor's local shard (sharing its storage), else ``tensor``."""
    if not is_sharded(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    """Measure the training state of ``model`` and ``optimizer`` from this process's tensors (no host sync, no
    collective; see the module docstring for what counts, and for DTensors).

    Call it right after ``backward`` and before the optimizer step that follows at least one
    earlier step, so gradients and optimizer state both exist. Optimizer params that are not
    model params are counted as masters (the engine rebinds the optimizer to fp32 masters).
    """
    counter = StorageCounter()

    def add(tensor: torch.Tensor | None) -> int:
        return counter.add(_local(tensor))

    model_params = list(model.parameters())  # unique: tied weights appear once
    frozen = [p for p in model_params if not p.requires_grad]
    frozen_bytes = sum(add(p) for p in frozen)
    params = frozen_bytes + sum(add(p) for p in model_params if p.requires_grad)
    grads = sum(add(p.grad) for p in model_params)
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    masters = sum(add(p) for p in opt_params)
    grads += sum(add(p.grad) for p in opt_params)
    sharded = any(is_sharded(p) for p in model_params)
    optimizer_state = compensation = scalars = quantized = quantized_elements = whole = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            size = add(value)
            if value.dim() == 0:
                scalars += size
            elif key == "kahan_comp":
                compensation += size
            else:
                optimizer_state += size
                whole += size if sharded and not is_sharded(value) else 0
                codes = isinstance(key, str) and key + ABSMAX_SUFFIX in state   # the codes of an 8-bit moment
                quantized += size if codes or (isinstance(key, str) and key.endswith(ABSMAX_SUFFIX)) else 0
                quantized_elements += _local(value).numel() if codes else 0
    return StateBytes(params=params, grads=grads, masters=masters, optimizer_state=optimizer_state,
                      compensation=compensation, scalars=scalars,
                      n_params=sum(p.numel() for p in model_params),
                      n_frozen=sum(p.numel() for p in frozen), frozen_bytes=frozen_bytes,
                      quantized_state=quantized, quantized_elements=quantized_elements, whole=whole)
