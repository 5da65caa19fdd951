"""A policy switch mid-run under FSDP2 (the guard's escalation, :meth:`mixprec.MixedPrecision.set_policy`).

``fully_shard`` fixed each sharded module's storage and cast (its ``MixedPrecisionPolicy``), so a switch may
change the optimizer state's precision (``state``, ``state_rounding``: the escalation ladder's "8-bit optimizer
state → fp32 state") and keep more modules in fp32 (``keep_fp32`` patterns added: the ladder's first rung; the
FSDP2 units holding them are resharded in place, :mod:`mixprec.distributed.sharded_units`); one that changes how
the other params are stored or computed (bf16 → fp32, a module moved out of fp32) would re-run ``fully_shard`` and
is refused, named (:func:`check_switch`).

8-bit state is held as codes placed as the param (a ``DTensor``) and the param's scales whole on every rank
(:mod:`mixprec.optim.sharded_blocks`); :func:`dequantize_sharded_state_` turns it into fp32 moments placed as the
param, each element read against its global block's scale, so the values are one process's dequantized state
bit for bit (:func:`mixprec.optim.quantized_state.dequantize`, elementwise) at any world size.

The engine's re-preparation writes each param's new value through ``p.data = ...``, which on a ``DTensor``
param changes its metadata, never its local shard (FSDP2's storage): the values stay. The one value it changes,
a Kahan param's compensation folded in, is therefore folded here first, on the local shards, with the bits one
process's re-preparation gives (:func:`fold_compensation_`); the re-preparation then finds nothing left to fold.
"""

from __future__ import annotations

import torch

from mixprec.optim import quantized_state as qs
from mixprec.optim import sharded
from mixprec.optim.sharded_blocks import pieces
from mixprec.policy.policy import QUANTIZED_STATE_DTYPES, Policy

__all__ = ["check_switch", "dequantize_sharded_state_", "fold_compensation_"]

_NONNEGATIVE = ("exp_avg_sq",)   # AdamW's second moment: its 8-bit code is unsigned (the one sharded 8-bit step)


def check_switch(built: Policy, old: Policy, new: Policy) -> None:
    """Raise ValueError unless ``new`` differs from ``built`` (the policy the shards are laid out for) in the
    optimizer state's precision and in keep_fp32 patterns added (never dropped) alone, and keeps ``old``'s 8-bit
    state format or leaves 8-bit state (quantizing sharded moments anew is not done mid-run)."""
    if new.state_dtype in QUANTIZED_STATE_DTYPES and new.state_dtype != old.state_dtype:
        raise ValueError(f"set_policy: under strategy='fsdp2' {old} → {new} would quantize the sharded optimizer "
                         "state anew, which is not done mid-run (8-bit state can only be left, for fp32 or bf16 "
                         "state). Save a checkpoint and resume under the new policy")
    dropped = [pat for pat in built.keep_fp32 if pat not in new.keep_fp32]
    if dropped:
        raise ValueError(f"set_policy: under strategy='fsdp2' {new} no longer keeps {dropped} in fp32 (the shards "
                         f"were laid out for {built}): moving a module out of fp32 would re-run fully_shard, which "
                         "is not done mid-run. Save a checkpoint and resume under the new policy")
    if new.replace(state_dtype=built.state_dtype, state_rounding=built.state_rounding,
                   keep_fp32=built.keep_fp32) != built:
        raise ValueError(f"set_policy: under strategy='fsdp2' {new} changes how params are stored or computed "
                         f"(fully_shard was built for {built}): it would re-run fully_shard, which is not done "
                         "mid-run; only the optimizer state's precision can change (e.g. 8-bit state → fp32 state) "
                         "and modules can be kept in fp32 (keep_fp32 += (name,): their FSDP2 units are resharded, "
                         "mixprec.distributed.sharded_units). Save a checkpoint and resume under the new policy")


def dequantize_sharded_state_(optimizer: torch.optim.Optimizer, new: Policy) -> int:
    """When ``new`` keeps no 8-bit state: replace every 8-bit moment of a sharded param in ``optimizer.state``
    (codes a ``DTensor``, scales whole) by its fp32 values placed as the param, its ``*_absmax`` entry dropped, in
    place. Returns the moments converted. No comm, no host sync."""
    if new.state_dtype in QUANTIZED_STATE_DTYPES:
        return 0
    converted = 0
    for p, state in optimizer.state.items():
        if not sharded.is_sharded(p):
            continue
        for key in [k for k in state if isinstance(k, str) and k + qs.ABSMAX_SUFFIX in state]:
            absmax = state.pop(key + qs.ABSMAX_SUFFIX)
            state[key] = sharded.like_param(_dequantized(p, sharded.local(state[key]), absmax, key), p)
            converted += 1
    return converted


def _dequantized(p: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, key: str) -> torch.Tensor:
    """The fp32 values of this rank's ``codes`` (local shard of ``p``'s moment ``key``) under the whole ``absmax``."""
    flat = codes.reshape(-1)
    code = qs.code_of(codes, nonnegative=key in _NONNEGATIVE)
    cut = pieces(sharded.global_offset(p), flat.numel(), p.numel())
    out = torch.empty(flat.shape, dtype=torch.float32, device=codes.device)
    start, stop = cut.interior
    if stop > start:
        first, last = cut.interior_blocks
        out[start:stop] = qs.dequantize(flat[start:stop], absmax[first:last], code)
    for start, stop in cut.edges():
        out[start:stop] = qs.dequantize_piece(flat[start:stop], absmax[cut.block_of(start)], code)
    return out.view(codes.shape)


def fold_compensation_(optimizer: torch.optim.Optimizer, new: Policy) -> int:
    """Under a Kahan ``new``: fold each sharded 16-bit param's compensation into it as one process's re-preparation
    does, in place on the local shards (FSDP2's storage): ``v = p + c`` in fp32, ``p = v`` rounded to nearest,
    ``c = v - p`` in ``c``'s dtype. Returns the params folded. No comm, no host sync."""
    if new.rounding != "kahan":
        return 0
    folded = 0
    with torch.no_grad():
        for p, state in optimizer.state.items():
            comp = state.get("kahan_comp")
            if not sharded.is_sharded(p) or comp is None:
                continue
            p_local, comp_local = sharded.local(p), sharded.local(comp)
            value_fp32 = p_local.float() + comp_local.float()
            p_local.copy_(value_fp32)
            comp_local.copy_(value_fp32 - p_local.float())
            folded += 1
    return folded
