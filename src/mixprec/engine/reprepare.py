"""Re-preparing a model under a new policy mid-run, keeping the training state.

What carries over, per parameter (:meth:`mixprec.MixedPrecision.set_policy` documents it for users):
its best fp32 value (:meth:`mixprec.engine.masters.MasterWeights.fp32_values`) becomes the param, stored as
the new plan says, and the new master where the new policy has masters (moving to a wider format
loses nothing, moving down rounds once to nearest); optimizer state moves from the tensor the
optimizer stepped to the one it steps now (:func:`mixprec.optim.contract.move_state`), and frozen
params keep none. Every check runs before anything changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.engine.loss_scale import from_state_dict as loss_scale_from_state
from mixprec.engine.masters import MasterWeights
from mixprec.optim import contract
from mixprec.policy.policy import Policy
from mixprec.engine.regions import keep_fp32_modules
from mixprec.engine.storage import FrozenSet, StoragePlan, check_held, check_new_group, dtype_text, held_by, plan_storage

__all__ = ["Prepared", "check_fp8_unchanged", "reprepare", "load_across_policies", "load_state", "match_frozen", "unfreeze_params"]


@dataclass(frozen=True)
class Prepared:
    """The outcome of :func:`reprepare`: the new plan, masters and fp32 regions, and how many
    optimizer-state entries were carried over."""

    plan: StoragePlan
    masters: MasterWeights
    keep: dict[str, nn.Module]
    carried: int


def check_fp8_unchanged(old: Policy, new: Policy) -> None:
    """Raise ValueError if ``new`` changes the fp8 linears (they cannot be swapped mid-run)."""
    if (new.fp8, new.fp8_format, new.fp8_keep_ends) != (old.fp8, old.fp8_format, old.fp8_keep_ends):
        raise ValueError(f"set_policy: {old} → {new} changes the fp8 linears (fp8={new.fp8!r}, fp8_format="
                         f"{new.fp8_format!r}, fp8_ends={'keep' if new.fp8_keep_ends else 'fp8'!r}), which cannot "
                         "be swapped mid-run; keep fp8/fp8_format/fp8_ends as they are, or build a new "
                         "MixedPrecision from a checkpoint")


def reprepare(model: nn.Module, optimizer: torch.optim.Optimizer, masters: MasterWeights, frozen: FrozenSet,
              new: Policy, strategy: Any) -> Prepared:
    """Move ``model``'s params, ``masters`` and ``optimizer`` state to ``new``'s storage (module docstring).

    ``masters``: the current ones (their ``params`` are the model's, in order). The caller removes
    its hooks before and installs the new regions after. No host sync (one per frozen param checked
    against fp16).

    Raises:
        ValueError: ``new``'s keep_fp32 patterns match no module; a frozen value does not fit a pure
            fp16 policy; the strategy cannot re-cast; unfrozen params the optimizer does not hold;
            the optimizer cannot run ``new``. Nothing has changed then.
    """
    keep = keep_fp32_modules(model, new)
    params = masters.params
    plan = plan_storage(model, new, params, keep, frozen.ids(), sharded=strategy.shards_params)
    strategy.check_restore({id(p): p.dtype for p in params if p.is_floating_point()},
                           {id(p): plan.dtype_of(p) for p in params if p.is_floating_point()}, new)
    old_stepped = list(masters.masters)   # per param: the tensor the optimizer steps now
    index = {id(t): i for i, t in enumerate(old_stepped)}
    stepped = [t for g in optimizer.param_groups for t in g["params"]]
    stepped_ids = {id(t) for t in stepped}
    was_frozen = {id(p) for p in frozen.members}
    orphans = [n for n, p in model.named_parameters()
               if id(p) in was_frozen and p.requires_grad and id(old_stepped[index[id(p)]]) not in stepped_ids]
    if orphans:
        raise ValueError(f"set_policy: parameter(s) {orphans[:5]} were unfrozen but the optimizer does not hold "
                         "them, so they would never train; add them first (optimizer.add_param_group"
                         "({'params': [...]})) or use mp.unfreeze(pattern), which does both")

    def stepped_dtype(t: torch.Tensor) -> torch.dtype:
        if id(t) not in index:          # not a model param: left as it is
            return t.dtype
        half = id(params[index[id(t)]]) in plan.half
        return new.param_dtype if half and not new.has_masters else torch.float32
    contract.check(optimizer, new, {stepped_dtype(t) for t in stepped
                                    if id(t) not in index or id(params[index[id(t)]]) not in plan.frozen16})

    values_fp32 = masters.fp32_values(lambda p: contract.compensation(optimizer, p))
    with torch.no_grad():
        for p, value_fp32 in zip(params, values_fp32):
            if p.is_floating_point():
                p.data = value_fp32
        new_masters = MasterWeights(params, set(plan.half) if new.has_masters else set())
        plan.apply(params)
    for group in optimizer.param_groups:
        group["params"] = [new_masters.masters[index[id(t)]] if id(t) in index else t for t in group["params"]]
    moves = [(t_old, None if id(p) in plan.frozen16 else t_new)   # a frozen param keeps no optimizer state
             for p, t_old, t_new in zip(params, old_stepped, new_masters.masters)]
    carried = sum(1 for (t_old, t_new) in moves if t_new is not None and optimizer.state.get(t_old))
    contract.move_state(optimizer, moves, new)
    if not new.has_masters:   # Kahan: the compensation restarts with what this cast lost, not at zero
        contract.start_compensation(optimizer, new, [(p, v) for p, v in zip(params, values_fp32) if id(p) in plan.half])
    new_masters.record_versions()
    return Prepared(plan=plan, masters=new_masters, keep=keep, carried=carried)


def load_across_policies(mp: Any, state: dict[str, Any], *, convert: bool, adopt_policy: bool) -> None:
    """Load ``state``, saved under another policy, into the engine ``mp`` through its public methods: switch
    to the saved policy (with the saved loss scale), load exactly, and with ``convert`` switch back to
    ``mp``'s policy, whose rules then apply (a ``"convert"`` event). A refused load switches back and
    re-raises: ``mp`` is left as given (its loss scale object included).

    Raises:
        ValueError: neither ``convert`` nor ``adopt_policy``, or both; whatever the loads refuse.
    """
    saved, target, target_scale = state["policy"], str(mp.policy), mp.loss_scale
    if convert == adopt_policy:
        raise ValueError(f"state was saved under policy {saved!r}, this engine runs {target}; pass "
                         f"convert=True (to {target!r}) or adopt_policy=True (to {saved!r}), one of them")
    loss_scale = loss_scale_from_state(state["loss_scale"])   # validates before anything changes
    mp.set_policy(saved, cause="load_checkpoint", loss_scale=loss_scale, record=False)
    try:
        mp.load_state_dict(state)
    except (ValueError, TypeError):
        mp.set_policy(target, cause="load_checkpoint refused", loss_scale=target_scale, record=False)
        raise
    if convert:
        event = mp.set_policy(target, cause=f"load_checkpoint(convert=True) from {saved}")
        event["kind"] = "convert"   # the event the engine recorded


def load_state(mp: Any, state: dict[str, Any]) -> None:
    """Load ``state`` (a :meth:`mixprec.MixedPrecision.state_dict` of ``mp``'s policy) into ``mp`` exactly,
    through its public methods; an unfinished accumulation is discarded. Every check runs first.

    Raises:
        ValueError: another loss-scale type, a frozen set that cannot be matched, unfit fp16 values,
            masters other than this policy's. Nothing has changed then.
    """
    if state["loss_scale"].get("type") != type(mp.loss_scale).__name__:
        raise ValueError(f"the run used {state['loss_scale'].get('type')}, the engine has "
                         f"{type(mp.loss_scale).__name__}; build the engine with the run's loss_scale")
    if state.get("frozen") is not None:
        mp.match_frozen(state["frozen"], check_only=True)
    mp.check_frozen_values(dict(state["model"]))
    if state.get("frozen") is not None:
        mp.match_frozen(state["frozen"])
    masters = mp.masters.by_name(state["masters"], dict(mp.module.named_parameters()))
    mp.discard_gradients()   # an unfinished accumulation belongs to the replaced run
    mp.module.load_state_dict(state["model"])
    with torch.no_grad():
        for (_, m), saved in zip(mp.masters.pairs, masters):
            m.copy_(saved)
    mp.masters.record_versions()
    mp.optimizer.load_state_dict(state["optimizer"])
    if mp.scheduler is not None and state["scheduler"] is not None:
        mp.scheduler.load_state_dict(state["scheduler"])
    mp.loss_scale.load_state_dict(state["loss_scale"])
    mp.restore_progress(state["counters"], state.get("events"))


def unfreeze_params(mp: Any, frozen: FrozenSet, patterns: tuple[str, ...], group_options: dict) -> dict:
    """:meth:`mixprec.MixedPrecision.unfreeze` after its boundary checks: thaw the matching members of
    ``frozen`` (the engine's), add a param group for those the optimizer lacks, re-prepare under the same
    policy; a refusal undoes all of it. Returns the ``"unfreeze"`` event."""
    chosen = frozen.select(patterns)
    new_params = check_new_group(chosen, held_by(mp.optimizer, mp.masters, [p for _, p in chosen]),
                                 group_options, mp.scheduler)
    groups_before = len(mp.optimizer.param_groups)
    frozen.thaw([p for _, p in chosen])
    try:
        if new_params:
            mp.optimizer.add_param_group({"params": new_params, **group_options})
        event = mp.set_policy(mp.policy, cause=f"unfreeze {', '.join(patterns)}")
    except (ValueError, TypeError):   # refused before anything changed: undo ours too
        frozen.refreeze([p for _, p in chosen])
        del mp.optimizer.param_groups[groups_before:]
        raise
    event["kind"] = "unfreeze"
    event["detail"] = (f"{len(chosen)} parameter(s) unfrozen ({sum(p.numel() for _, p in chosen)} elements), "
                       f"stored as {dtype_text(mp.policy.param_dtype)}"
                       f"{' with fp32 masters' if mp.policy.has_masters else ''}; " + event["detail"])
    if mp.guard is not None and hasattr(mp.guard, "take_snapshot"):
        mp.guard.take_snapshot(mp)   # the old snapshot holds the frozen layout: no rollback into it
    return event


def match_frozen(mp: Any, frozen: FrozenSet, saved: list[str], *, check_only: bool) -> None:
    """:meth:`mixprec.MixedPrecision.match_frozen`: unfreeze in ``mp`` what the saved run had unfrozen."""
    to_unfreeze = frozen.to_unfreeze(saved)
    if not to_unfreeze:
        return
    named = dict(mp.module.named_parameters())
    check_held(to_unfreeze, held_by(mp.optimizer, mp.masters, [named[n] for n in to_unfreeze]), named)
    if not check_only:
        mp.unfreeze(*(re.sub(r"([\[\]*?])", r"[\1]", n) for n in to_unfreeze))
