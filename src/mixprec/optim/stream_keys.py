"""Which stream a stochastic rounding of an optimizer draws from: the :class:`~mixprec.optim.sr_stream.SRKey` of a
param (its index in the optimizer's param order, its group's ``sr_seed``, the state's ``step``, the purpose), and the
global offset of an FSDP2 shard being stepped. Shared by the state codec (8-bit and bf16 state) and the write-back
(bf16 params). No host sync (``step`` is on the CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.optim.sr_stream import SRKey

__all__ = ["StreamKeys"]


class StreamKeys:
    """The stream keys of ``optimizer``'s params (its ``param_groups`` read when used: a load replaces the list,
    and the engine may swap the tensors it steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._param_index: dict[int, int] = {}   # id(param) -> its index in the param order (the stream's key)
        self._flat_params: list[torch.Tensor] = []
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}   # id(local shard) -> (it, param, offset)
        self.adopted_seed: int | None = None   # within mixprec.optim.adopt_sr_seed: saved groups' missing sr_seed

    def stepping_shard(self, p_local: torch.Tensor, p: torch.Tensor, offset: int) -> None:
        """``p_local``, the local shard of the sharded ``p`` at global flat ``offset``, is the tensor stepped now: its
        keys are ``p``'s at that offset (the param being stepped only)."""
        self._shards = {id(p_local): (p_local, p, offset)}

    def add_piece(self, piece: torch.Tensor, p: torch.Tensor, offset: int) -> None:
        """``piece`` (a flat view of ``p``'s local shard from global flat ``offset``) is stepped too: its keys are
        ``p``'s at that offset (:mod:`mixprec.optim.sharded_blocks`)."""
        self._shards[id(piece)] = (piece, p, offset)

    def key(self, p: torch.Tensor, state: dict[str, Any], purpose: str) -> SRKey:
        """Where stochastic rounding of ``p``'s ``purpose`` (``"param"`` or a state key) at this step draws its
        bits: the counter-based stream of ``(group's sr_seed, p's index in the optimizer's param order, state
        step, purpose)`` (:mod:`mixprec.optim.sr_stream`). ``p`` a sharded param's local shard
        (:meth:`stepping_shard`) or a piece of it (:meth:`add_piece`): the param's key at that global offset.
        Every group has an ``sr_seed`` (:mod:`mixprec.optim.sr_seed`)."""
        offset = 0
        shard = self._shards.get(id(p))
        if shard is not None and shard[0] is p:
            p, offset = shard[1], shard[2]
        index = self._param_index.get(id(p))
        if index is None or self._flat_params[index] is not p:   # first use, or the engine swapped tensors
            self._flat_params = [q for g in self._optimizer.param_groups for q in g["params"]]
            self._param_index = {id(q): i for i, q in enumerate(self._flat_params)}
            index = self._param_index[id(p)]
        return SRKey(self._group_of(index)["sr_seed"], index, int(state.get("step", 0)), purpose, offset)

    def words(self) -> str:
        """Where stochastic rounding draws its bits, in words: the counter-based stream and its seed(s)."""
        seeds = sorted({g["sr_seed"] for g in self._optimizer.param_groups})
        return f"counter-based stream, sr_seed={seeds[0] if len(seeds) == 1 else seeds}"

    def _group_of(self, index: int) -> dict[str, Any]:
        for group in self._optimizer.param_groups:
            if index < len(group["params"]):
                return group
            index -= len(group["params"])
        raise IndexError(index)
