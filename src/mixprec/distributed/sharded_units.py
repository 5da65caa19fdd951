"""A module kept in fp32 mid-run under FSDP2: the FSDP2 unit that holds its params all-gathers (and stores) fp32.

``fully_shard`` gives each unit (a block, a ``keep_fp32`` module at build, the root) one
``MixedPrecisionPolicy`` and one storage dtype for its trainable params (:mod:`mixprec.distributed.process`).
``set_policy(policy.replace(keep_fp32=(..., name)))`` (the guard's rung 1) changes, for every unit that holds a
param of the newly kept modules, what ``fully_shard`` would have set at build for a ``keep_fp32`` unit:

* the all-gather dtype: the unit's ``param_dtype`` becomes None (its params are all-gathered as stored, fp32;
  torch's ``FSDPParam.init_dtype_attrs`` re-derives ``orig_dtype`` / ``param_dtype`` / ``reduce_dtype``) and
  its all-gather buffers are dropped, so the next all-gather allocates them in fp32;
* the storage, where the policy stores params in 16 bits without masters (``bf16-sr`` / ``-kahan`` / ``-lean``):
  each param's local shard is re-stored in fp32 from its best value (the bf16 value plus its Kahan
  compensation, folded in fp32 as one process's re-preparation does: :meth:`~mixprec.engine.masters.
  MasterWeights.fp32_values`), the same ``Parameter`` object (the ``DTensor``'s dtype, local shard and spec replaced, then FSDP2's
  ``reset_sharded_param``: optimizer state and the engine's records stay keyed by it), its compensation dropped (fp32 params carry none);
* a unit that is kept whole loses its hidden-state cast (:class:`~mixprec.distributed.wrapping.CastHiddenState`),
  as a ``keep_fp32`` unit never had one.

A unit is escalated whole: a module that is not its own unit shares its unit's all-gather dtype, so the other
modules of that unit then all-gather fp32 too (their ops still run in the compute dtype under autocast; the
note names the unit). FSDP2 stores one dtype per unit's trainable params, so under 16-bit storage a unit that
also holds trainable params outside the kept modules is refused, named (:func:`plan_keep`): keep the whole unit,
or wrap the module as its own unit at build. A module is never moved out of fp32 mid-run.

Source: torch 2.13 ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` / ``_fsdp_param_group.py``. The
torch-internal access is :func:`param_group` alone (tests/distributed/test_fsdp2_keep_fp32.py checks what it relies on).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.distributed.wrapping import CastHiddenState
from mixprec.optim import sharded
from mixprec.policy.policy import Policy

__all__ = ["KeepPlan", "param_group", "reshard", "fsdp_units", "plan_keep", "apply_keep"]


def param_group(module: nn.Module) -> Any:
    """The ``FSDPParamGroup`` of ``module`` (a module ``fully_shard`` was applied to), or None (no params of its
    own). Relies on torch 2.13's FSDP2 internals: ``FSDPModule._get_fsdp_state()._fsdp_param_group`` with
    ``mp_policy`` (a frozen ``MixedPrecisionPolicy``), ``fsdp_params`` and ``_init_mp_dtypes()``; each
    ``FSDPParam`` with ``sharded_param``, ``mp_policy``, ``orig_dtype``, ``param_dtype``, ``all_gather_outputs``,
    ``_unsharded_param`` (made at the first all-gather) and ``reset_sharded_param()``.

    Raises:
        RuntimeError: ``module`` is not an FSDP2 module, or torch no longer has these attributes (named).
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise RuntimeError(f"{type(module).__name__} is not an FSDP2 module (no _get_fsdp_state)")
    group = getattr(get_state(), "_fsdp_param_group", None)
    if group is None:
        return None
    missing = [a for a in ("mp_policy", "fsdp_params", "_init_mp_dtypes") if not hasattr(group, a)]
    missing += [f"FSDPParam.{a}" for p in group.fsdp_params[:1] for a in
                ("sharded_param", "mp_policy", "orig_dtype", "param_dtype", "all_gather_outputs",
                 "init_dtype_attrs", "reset_sharded_param") if not hasattr(p, a)]
    if missing:
        raise RuntimeError(f"mixprec: this torch ({torch.__version__}) FSDP2 lacks {missing}, which keeping a module "
                           "in fp32 mid-run relies on (mixprec.distributed.sharded_units); report this")
    return group


def reshard(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of ``model`` (``FSDPModule.reshard``, public; a no-op for a sharded unit): after a
    forward without backward FSDP2 leaves the root unsharded, its modules holding the unsharded params."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_units(model: nn.Module) -> dict[str, Any]:
    """``{unit name ("" for the root): its FSDPParamGroup}`` for every FSDP2 unit of ``model`` with params."""
    units = {}
    for name, m in model.named_modules():
        if hasattr(m, "_get_fsdp_state"):
            group = param_group(m)
            if group is not None:
                units[name] = group
    return units


@dataclass(frozen=True)
class KeepPlan:
    """What keeping ``modules`` in fp32 changes: ``units`` (names, "" the root) that all-gather fp32 from now,
    ``restore`` (the 16-bit stored unit names among them, re-stored in fp32) and ``whole`` (units kept whole)."""

    modules: tuple[str, ...]
    units: tuple[str, ...]
    restore: tuple[str, ...]
    whole: tuple[str, ...]

    def note(self) -> str:
        """The event's words on what was resharded ("" when nothing changes)."""
        if not self.modules:
            return ""
        if not self.units:
            return f"; kept {', '.join(self.modules)} in fp32 (no params of its own: no FSDP2 unit resharded)"
        units = ", ".join(u or "the root" for u in self.units)
        how = "all-gathered and stored in fp32 from now" if self.restore else "all-gathered in fp32 from now"
        shared = [u or "the root" for u in self.units if u not in self.whole]
        also = f"; its other modules' params ({', '.join(shared)}) all-gather fp32 too" if shared else ""
        return (f"; kept {', '.join(self.modules)} in fp32 (its FSDP2 unit: {units}, {how}{also})")


def _kept(model: nn.Module, patterns: tuple[str, ...]) -> set[str]:
    """Names of the modules ``patterns`` match (``fnmatch``, as :func:`mixprec.engine.regions.keep_fp32_modules`)."""
    return {n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, pat) for pat in patterns)}


def plan_keep(model: nn.Module, built: Policy, new: Policy) -> KeepPlan:
    """The :class:`KeepPlan` for the modules ``new.keep_fp32`` matches and ``built``'s (the sharded layout's
    policy) does not. Nothing changes but every unit resharded (:func:`reshard`: the values stay).

    Raises:
        ValueError: a pattern matches no module; under 16-bit storage, a unit that holds trainable params outside
            the kept modules (FSDP2 stores one dtype per unit), named with the fix.
    """
    from mixprec.distributed.sharded_storage import stores_16bit

    unmatched = [pat for pat in new.keep_fp32 if not _kept(model, (pat,))]
    if unmatched:
        raise ValueError(f"set_policy: keep_fp32 patterns {unmatched} match no module of the model; module names look "
                         f"like {[n for n, _ in model.named_modules() if n][:8]}")
    added = sorted(_kept(model, new.keep_fp32) - _kept(model, built.keep_fp32))
    added = [n for n in added if not any(n.startswith(o + ".") for o in added if o != n)]   # the outer covers
    reshard(model)   # the modules hold their sharded params again (not the unsharded ones of an eval forward)
    owner = {id(fp.sharded_param): unit for unit, g in fsdp_units(model).items() for fp in g.fsdp_params}
    kept_ids = {id(p) for n in added for p in model.get_submodule(n).parameters()}
    if kept_ids - owner.keys():
        raise RuntimeError(f"mixprec: {len(kept_ids - owner.keys())} param(s) of {added} are held by no FSDP2 unit "
                           "of the model; report this with the model")
    units = sorted({owner[pid] for pid in kept_ids if pid in owner})
    groups = fsdp_units(model)
    restore, whole = [], []
    for unit in units:
        trainable = [fp.sharded_param for fp in groups[unit].fsdp_params if fp.sharded_param.requires_grad]
        outside = [p for p in trainable if id(p) not in kept_ids]
        if not outside:
            whole.append(unit)
        if stores_16bit(built) and any(fp.orig_dtype != torch.float32 for fp in groups[unit].fsdp_params):
            if outside:
                names = {id(p): n for n, p in model.named_parameters()}
                raise ValueError(
                    f"set_policy: under strategy='fsdp2' keeping {added} in fp32 would store FSDP2 unit "
                    f"{unit or 'the root'!r} in two dtypes: it also holds {len(outside)} trainable param(s) of other "
                    f"modules stored in {str(built.param_dtype)[6:]} ({[names.get(id(p), '?') for p in outside][:3]}), "
                    "and FSDP2 stores one dtype per unit. Keep the whole unit instead (keep_fp32="
                    f"{unit!r}), or make the module its own unit at build (keep_fp32 or block_filter)")
            restore.append(unit)
    return KeepPlan(tuple(added), tuple(units), tuple(restore), tuple(whole))


@torch.no_grad()
def _restore_fp32(fsdp_param: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Re-store one 16-bit sharded param's local shard in fp32 from its bf16 value plus its Kahan compensation
    (popped from ``optimizer``'s state), the same Parameter object. No comm, no host sync."""
    p = fsdp_param.sharded_param
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    value_fp32 = sharded.local(p).to(torch.float32, copy=True)
    comp = state.pop("kahan_comp", None)
    if comp is not None:
        value_fp32 += sharded.local(comp).float()
    value = sharded.like_param(value_fp32, p)
    p.data = value                      # the outer DTensor's dtype (its local shard is not reached: below)
    p._local_tensor, p._spec = value._local_tensor, value._spec
    fsdp_param.reset_sharded_param()    # FSDP2 pads the new shard and takes it as its storage


def apply_keep(model: nn.Module, plan: KeepPlan, optimizer: torch.optim.Optimizer | None) -> str:
    """Carry out ``plan`` (:func:`plan_keep`, which resharded every unit) on ``model``'s units in place, between
    steps. Returns :meth:`KeepPlan.note`. No comm, no host sync."""
    groups = fsdp_units(model)
    for unit in plan.units:
        group = groups[unit]
        for fsdp_param in group.fsdp_params:
            if unit in plan.restore and fsdp_param.orig_dtype != torch.float32 and fsdp_param.orig_dtype.is_floating_point:
                _restore_fp32(fsdp_param, optimizer)
            fsdp_param.mp_policy = dataclasses.replace(fsdp_param.mp_policy, param_dtype=None)
            fsdp_param.all_gather_outputs = []          # re-made in the new dtype at the next all-gather
            if hasattr(fsdp_param, "_unsharded_param"):
                del fsdp_param._unsharded_param
        group.mp_policy = dataclasses.replace(group.mp_policy, param_dtype=None)
        group._init_mp_dtypes()
        if unit in plan.whole:
            module = model.get_submodule(unit)
            for key in [k for k, hook in module._forward_pre_hooks.items() if isinstance(hook, CastHiddenState)]:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
    return plan.note()
