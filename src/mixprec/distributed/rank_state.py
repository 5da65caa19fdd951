"""Training-state bytes this rank holds, and the figures of every rank: what ``mixprec train`` and
``mixprec bench --strategy ...`` report per rank.

The count is the one the bench and train share (:func:`mixprec.memory.state.state_bytes`): each storage once, a
DTensor by its local shard as allocated (FSDP2 holds params and gradients padded to ``ceil(d0 / W)`` rows on every
rank, the optimizer state on the rank's own rows), a plain tensor every rank holds whole (8-bit state's fp32
scales) whole, also in ``whole``. ``per_param`` divides by the global parameter count: bytes per parameter per rank
(half of one process's, plus what is held whole, at 2 ranks). :func:`gather_per_rank` brings one value of every
rank to every rank (rank order), e.g. each rank's ``per_param`` and peak live tensor bytes for the bench's row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.process import world_size
from mixprec.memory.state import StateBytes, state_bytes

__all__ = ["rank_state_bytes", "gather_per_rank"]


def rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    """Measure ``model``'s params and grads and ``optimizer``'s params (masters when not the model's) and state on
    this rank (no host sync, no collective). Call it after a backward that follows an optimizer step, so
    gradients and state both exist."""
    return state_bytes(model, optimizer)


def gather_per_rank(value: Any) -> list[Any]:
    """Every rank's ``value`` on every rank, in rank order (``value`` must pickle): a collective
    (``all_gather_object``; every rank calls it at the same point). Without a group, or with one rank,
    ``[value]``."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered
