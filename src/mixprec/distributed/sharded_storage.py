"""16-bit parameter storage under FSDP2: policies without fp32 masters (``bf16-sr``, ``bf16-kahan``, ``bf16-lean``).

Under such a policy one process stores each trainable parameter in the policy's 16-bit ``param_dtype`` and
the optimizer rounds its fp32 result into it (stochastic rounding, Kahan compensation). Under FSDP2 the same
parameters are cast **before** ``fully_shard`` (:func:`cast_for_sharding`), so FSDP2 stores the 16-bit
values sharded, all-gathers them as they are (``MixedPrecisionPolicy(param_dtype=None)``) and reduce-scatters
their gradients in fp32 (``reduce_dtype=fp32``); it rounds the fp32 reduced shard into the parameter's dtype
in ``foreach_reduce`` (``_to_dtype_if_needed(reduce_output, orig_dtype)``), so the optimizer sees a bf16
gradient shard, as one process sees the bf16 gradient autograd leaves on a bf16 parameter. The optimizer
steps each rank's local shard (:mod:`mixprec.optim.sharded`). The same modules as in one process keep fp32
(``keep_fp32`` regions); parametrized and frozen parameters stay fp32 (FSDP2 needs one dtype per group of
trainable parameters, so a parametrization inside a sharded block is refused there by FSDP2).

Kahan compensation starts, as in one process, at what the cast lost (``value_fp32 - bf16(value_fp32)``): the
fp32 values are kept by name through the cast and handed out as ``DTensor`` shards placed as the new
parameters (:func:`shard_like_params`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mixprec.optim import sharded
from mixprec.policy.policy import Policy

__all__ = ["stores_16bit", "cast_for_sharding", "shard_like_params"]


def stores_16bit(policy: Policy) -> bool:
    """Whether ``policy`` stores trainable params in 16 bits without fp32 masters (the optimizer rounds into them)."""
    return not policy.has_masters and policy.param_dtype != torch.float32


def _in_modules(model: nn.Module, names: Iterable[str]) -> set[int]:
    return {id(p) for name in names for p in model.get_submodule(name).parameters()}


@torch.no_grad()
def cast_for_sharding(model: nn.Module, policy: Policy, keep: Iterable[str], *, keep_values: bool
                      ) -> dict[str, torch.Tensor]:
    """Cast ``model``'s trainable real floating params, but those of the ``keep`` modules (names) and of
    parametrizations, to ``policy.param_dtype`` in place (the same Parameter objects), before ``fully_shard``.
    Returns ``{name: fp32 value before the cast}`` when ``keep_values`` (Kahan's start), else ``{}``. No sync."""
    from torch.nn.utils import parametrize

    skip = _in_modules(model, keep) | {id(q) for m in model.modules() if parametrize.is_parametrized(m)
                                       for q in m.parametrizations.parameters()}
    values: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if id(p) in skip or not p.requires_grad or not p.is_floating_point() or p.dtype == policy.param_dtype:
            continue
        if keep_values:
            values[name] = p.detach().float().clone()
        p.data = p.data.to(policy.param_dtype)
    return values


def shard_like_params(model: nn.Module, values_fp32: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``{id(param): this rank's rows of values_fp32[name]}`` for the (sharded) params of ``model``, each a
    ``DTensor`` placed as its param (:func:`mixprec.optim.sharded.like_param`; a plain tensor for a plain
    param). No comm."""
    out: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters():
        value = values_fp32.get(name)
        if value is None:
            continue
        if sharded.is_sharded(p):
            rows = p.to_local().shape[0] if p.dim() else 0
            row_numel = p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1
            first = sharded.global_offset(p) // row_numel
            value = sharded.like_param(value[first:first + rows].contiguous(), p)
        out[id(p)] = value
    return out
