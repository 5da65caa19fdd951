"""Training-state bytes this rank holds, from its tensors: what ``mixprec train`` reports per rank.

Counted as the bench counts them (:mod:`mixprec.programs.bench.measure`, ``state_bytes``): each storage once
(:class:`mixprec.memory.storages.StorageCounter`), a tensor subclass by the tensors it wraps, so a DTensor counts
its local shard as allocated (FSDP2 holds params and gradients padded to ``ceil(d0 / W)`` rows on every rank),
and a plain tensor every rank holds whole (8-bit state's fp32 scales) counts whole. ``per_param`` divides by the
global parameter count (a DTensor's ``numel()``): bytes per parameter per rank (half of one process's, plus what
is held whole, at 2 ranks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from mixprec.memory.storages import StorageCounter

__all__ = ["RankState", "rank_state_bytes"]


@dataclass(frozen=True)
class RankState:
    """Bytes of training state on this rank by role (``scalars``: 0-dim ``step`` counters, outside
    ``per_param``); ``whole``: the part of ``optimizer_state`` held in plain (unsharded) tensors when others are
    DTensors (8-bit scales under FSDP2; 0 in one process); ``n_params``: global parameter count."""

    params: int
    grads: int
    masters: int
    optimizer_state: int
    compensation: int
    scalars: int
    whole: int
    n_params: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.masters + self.optimizer_state + self.compensation

    @property
    def per_param(self) -> float:
        """Bytes per parameter on this rank (``total / n_params``)."""
        return self.total / self.n_params if self.n_params else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "per_param": self.per_param}


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
    """Measure ``model``'s params and grads and ``optimizer``'s params (masters when not the model's) and state on
    this rank (no host sync, no collective). Call it after a backward that follows an optimizer step, so
    gradients and state both exist."""
    counter = StorageCounter()
    model_params = list(model.parameters())
    params = sum(counter.add(p) for p in model_params)
    grads = sum(counter.add(p.grad) for p in model_params)
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    masters = sum(counter.add(p) for p in opt_params)
    grads += sum(counter.add(p.grad) for p in opt_params)
    sharded = any(_is_dtensor(p) for p in model_params)
    state = compensation = scalars = whole = 0
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                continue
            size = counter.add(value)
            if value.dim() == 0:
                scalars += size
            elif key == "kahan_comp":
                compensation += size
            else:
                state += size
                whole += size if sharded and not _is_dtensor(value) else 0
    return RankState(params=params, grads=grads, masters=masters, optimizer_state=state, compensation=compensation,
                     scalars=scalars, whole=whole, n_params=sum(p.numel() for p in model_params))
