"""A run's state changed mid-way through the engine's public methods: loading a state (of this policy or
another one) and unfreezing parameters. Each re-prepares the model through
:meth:`mixprec.MixedPrecision.set_policy` (:mod:`mixprec.engine.preparation.prepare`); every check runs before
anything changes, and a refusal undoes what was done.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.engine.loss_scale import from_state_dict as loss_scale_from_state
from mixprec.engine.masters import MasterWeights
from mixprec.engine.open_group import check_group
from mixprec.optim import contract
from mixprec.auto.pending import pending_note
from mixprec.engine.records import Event
from mixprec.engine.storage import FrozenParams, check_held, check_new_group, dtype_text, held_by
from mixprec.engine.protocol import Engine

if TYPE_CHECKING:
    from mixprec.auto.pending import PendingAuto

__all__ = ["load_engine_state", "load_across_policies", "load_state", "frozen_to_match",
           "unfreeze_params"]


def load_engine_state(mp: Engine, state: dict[str, Any], auto: PendingAuto, *, convert: bool,
                      adopt_policy: bool) -> str | None:
    """:meth:`mixprec.MixedPrecision.load_state_dict` for the engine ``mp`` and its pending ``auto``: ``state``
    of ``mp``'s policy loads exactly (:func:`load_state`), another policy's through :func:`load_across_policies`,
    adopted without ``adopt_policy`` where ``auto`` is still pending and the saved run took its auto decision
    (:meth:`~mixprec.auto.pending.PendingAuto.adopts`). Returns ``mp``'s new decision line, or None (keep it)."""
    if state["policy"] == str(mp.policy):
        load_state(mp, state)
        return auto.after_load(mp.policy, state.get("events"))
    adopted = auto.adopts(mp.policy, state, convert=convert)
    load_across_policies(mp, state, convert=convert, adopt_policy=adopt_policy or adopted is not None)
    return adopted


def load_across_policies(mp: Engine, state: dict[str, Any], *, convert: bool, adopt_policy: bool) -> None:
    """Load ``state``, saved under another policy, into the engine ``mp`` through its public methods: switch
    to the saved policy (with the saved loss scale), load exactly, and with ``convert`` switch back to
    ``mp``'s policy, whose rules then apply (a ``"convert"`` event). A refused load switches back and
    re-raises: ``mp`` is left as given (its loss scale object included).

    Raises:
        ValueError: neither ``convert`` nor ``adopt_policy``, or both; ``convert`` of a state saved mid-accumulation;
            whatever the loads refuse.
    """
    saved, target, target_scale = state["policy"], str(mp.policy), mp.loss_scale
    if convert == adopt_policy:
        raise ValueError(f"state was saved under policy {saved!r}, this engine runs {target}"
                         f"{pending_note(mp.decision)}; pass convert=True (to {target!r}) or adopt_policy=True "
                         f"(to {saved!r}), one of them")
    if state.get("open_group") and convert:
        raise ValueError(f"the state was saved mid-accumulation ({state['open_group']['micro_step']} micro-batch(es) "
                         f"of an open window) under {saved!r}: its gradients are {saved!r}'s, so it cannot be "
                         f"converted to {target!r} before that window's step; pass adopt_policy=True (finish the "
                         "window, then mp.set_policy(...)), or convert a state saved at an optimizer-step boundary")
    loss_scale = loss_scale_from_state(state["loss_scale"])   # validates before anything changes
    mp.set_policy(saved, cause="load_checkpoint", loss_scale=loss_scale, record=False)
    try:
        mp.load_state_dict(state)
    except (ValueError, TypeError):
        mp.set_policy(target, cause="load_checkpoint refused", loss_scale=target_scale, record=False)
        raise
    if convert:
        mp.set_policy(target, cause=f"load_checkpoint(convert=True) from {saved}", kind="convert")


def load_state(mp: Engine, state: dict[str, Any]) -> None:
    """Load ``state`` (a :meth:`mixprec.MixedPrecision.state_dict` of ``mp``'s policy) into ``mp`` exactly,
    through its public methods; an unfinished accumulation is discarded, a saved open window restored
    (:mod:`mixprec.engine.open_group`). Every check runs first.

    Raises:
        ValueError: another loss-scale type, a frozen set that cannot be matched, unfit fp16 values,
            masters other than this policy's, an open window's gradients that do not fit, an optimizer state
            the optimizer would refuse (:func:`mixprec.optim.contract.check_loadable`). Nothing has changed then.
    """
    if state["loss_scale"].get("type") != type(mp.loss_scale).__name__:
        raise ValueError(f"the run used {state['loss_scale'].get('type')}, the engine has "
                         f"{type(mp.loss_scale).__name__}; build the engine with the run's loss_scale")
    if state.get("frozen") is not None:
        mp.match_frozen(state["frozen"], check_only=True)
    mp.check_frozen_values(dict(state["model"]))
    check_group(mp, state.get("open_group"))
    contract.check_loadable(mp.optimizer, state["optimizer"])   # before any weight moves
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
    mp.restore_progress(state["counters"], state.get("events"), state.get("open_group"))


def unfreeze_params(mp: Engine, frozen: FrozenParams, patterns: tuple[str, ...], group_options: dict) -> Event:
    """:meth:`mixprec.MixedPrecision.unfreeze` after its boundary checks, through ``mp``'s public methods: thaw
    the matching members of ``frozen`` (the engine's), add a param group for those the optimizer lacks,
    re-prepare under the same policy (:meth:`~mixprec.MixedPrecision.set_policy`) and record the
    ``"unfreeze"`` event; a refusal undoes all of it. Returns the event."""
    chosen = frozen.select(patterns)
    new_params = check_new_group(chosen, held_by(mp.optimizer, mp.masters, [p for _, p in chosen]),
                                 group_options, mp.scheduler)
    groups_before = len(mp.optimizer.param_groups)
    frozen.thaw([p for _, p in chosen])
    try:
        if new_params:   # torch's own add, not the engine's route (engine/param_groups.py): re-prepared below
            type(mp.optimizer).add_param_group(mp.optimizer, {"params": new_params, **group_options})
        event = mp.set_policy(mp.policy, cause=f"unfreeze {', '.join(patterns)}", record=False)
    except (ValueError, TypeError):   # refused before anything changed: undo ours too
        frozen.refreeze([p for _, p in chosen])
        del mp.optimizer.param_groups[groups_before:]
        raise
    event = replace(event, kind="unfreeze", detail=(
        f"{len(chosen)} parameter(s) unfrozen ({sum(p.numel() for _, p in chosen)} elements), stored as "
        f"{dtype_text(mp.policy.param_dtype)}{' with fp32 masters' if mp.policy.has_masters else ''}; {event.detail}"))
    mp.record(event)
    if mp.guard is not None and hasattr(mp.guard, "take_snapshot"):
        mp.guard.take_snapshot(mp)   # the old snapshot holds the frozen layout: no rollback into it
    return event


def frozen_to_match(frozen: FrozenParams, saved: list[str], module: nn.Module, optimizer: torch.optim.Optimizer | None,
                    masters: MasterWeights) -> list[str]:
    """:meth:`mixprec.MixedPrecision.match_frozen`'s check: the patterns (exact names, ``fnmatch``-escaped) that
    unfreeze in this engine what the saved run (frozen names ``saved``) had unfrozen; [] when none. Raises
    ValueError when ``saved`` keeps frozen a param trained here, names an unknown one, or unfroze one into a
    param group ``optimizer`` lacks."""
    to_unfreeze = frozen.to_unfreeze(saved)
    if not to_unfreeze:
        return []
    named = dict(module.named_parameters())
    check_held(to_unfreeze, held_by(optimizer, masters, [named[n] for n in to_unfreeze]), named)
    return [re.sub(r"([\[\]*?])", r"[\1]", n) for n in to_unfreeze]
