"""A new policy at a boundary (:meth:`mixprec.MixedPrecision.set_policy`): the model re-prepared under it through
:func:`~mixprec.engine.preparation.prepare.prepare`, keeping the training state (best fp32 values, optimizer state,
the loss scale where both policies name the same scaling), the fp32 regions re-wrapped, and what the engine assigns
from it: :class:`PolicySwitch`. Every check runs before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.auto.pending import PendingAuto
from mixprec.autocast.compiled import CompileRequest
from mixprec.engine.loss_scale import LossScale, for_switch as loss_scale_for_switch
from mixprec.engine.masters import MasterWeights
from mixprec.engine.preparation.prepare import prepare, switch_block_linears
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Decision, Event, policy_event
from mixprec.engine.regions import Regions
from mixprec.engine.storage import FrozenParams
from mixprec.optim import contract
from mixprec.policy.policy import Policy
from mixprec.policy.resolve import resolve

__all__ = ["PolicySwitch", "switch_policy", "check_fp8_unchanged", "check_block_switch"]


@dataclass(frozen=True)
class PolicySwitch:
    """What :func:`switch_policy` did, for the engine to assign: the ``old`` and the new ``policy``; ``masters``
    and ``kahan_from`` as :class:`~mixprec.engine.preparation.prepare.Prepared` holds them; the ``loss_scale`` it
    trains with now; ``decision``, the new decision line but for the features' clauses (the engine appends them
    once it runs ``policy``); ``event``, the switch's :class:`~mixprec.engine.records.Event`."""

    old: Policy
    policy: Policy
    masters: MasterWeights
    kahan_from: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    loss_scale: LossScale
    decision: str
    event: Event


def switch_policy(mp: Engine, policy: str | Policy, *, cause: str, module: str | None, loss_scale: Any, kind: str,
                  strategy: Any, frozen: FrozenParams, auto: PendingAuto, regions: Regions,
                  compiled: CompileRequest) -> PolicySwitch:
    """Re-prepare ``mp``'s model under ``policy`` (resolved on ``mp.device``) with ``mp``'s collaborators:
    ``strategy`` (it may reshard the optimizer state), ``frozen`` (its stored dtypes, updated), ``auto`` (another
    policy cancels a pending decision), ``regions`` (removed, then wrapped for the new policy) and ``compiled`` (the
    decision's compile clause). The loss scale is ``loss_scale`` if given, else ``mp.loss_scale`` when both policies
    name the same scaling, else the new policy's; the gradients are zeroed. ``cause``, ``module``, ``kind``: the
    event's (:func:`~mixprec.engine.records.policy_event`). No host sync.

    Raises:
        ValueError: (nothing changed) the device, optimizer or strategy cannot run ``policy``, it changes fp8,
            it changes the block-scaled linears under a strategy that shards params, or its ``block_keep`` names no
            linear.
    """
    new = resolve(policy, mp.device).policy
    check_fp8_unchanged(mp.policy, new)
    check_block_switch(mp.policy, new, strategy, mp.module)
    resharded = strategy.before_set_policy(mp.policy, new, mp.optimizer)
    prepared = prepare(mp.module, new, mp.device, strategy, optimizer=mp.optimizer, masters=mp.masters, frozen=frozen)
    block_note = switch_block_linears(mp.module, mp.policy, new, mp.device, prepared.keep)   # cannot fail
    strategy.after_swap(mp.model)
    auto.cancel(mp.policy, new)   # another policy asked for while auto is pending: it wins
    regions.remove()
    old = mp.policy
    frozen.store(prepared.plan)
    scale, scale_note = loss_scale_for_switch(old, new, loss_scale, mp.loss_scale, mp.device)
    wrapped = regions.wrap(mp.module, new, mp.device.type, prepared.keep, set(prepared.plan.frozen16))
    mp.model.zero_grad(set_to_none=True)
    decision = Decision(f"{new} on {mp.device} ({new.summary()}; set_policy at boundary {mp.boundaries}: {cause}; "
                        f"was {old})", (block_note, compiled.note(new), wrapped, contract.state_note(mp.optimizer)))
    event = policy_event(mp.boundaries, kind, cause, module, old, new, prepared.carried, scale_note + resharded)
    return PolicySwitch(old, new, prepared.masters, prepared.kahan_from, scale, str(decision), event)


def check_fp8_unchanged(old: Policy, new: Policy) -> None:
    """Raise ValueError if ``new`` changes the fp8 linears (they cannot be swapped mid-run)."""
    if (new.fp8, new.fp8_format, new.fp8_keep_ends) != (old.fp8, old.fp8_format, old.fp8_keep_ends):
        raise ValueError(f"set_policy: {old} → {new} changes the fp8 linears (fp8={new.fp8!r}, fp8_format="
                         f"{new.fp8_format!r}, fp8_ends={'keep' if new.fp8_keep_ends else 'fp8'!r}), which cannot "
                         "be swapped mid-run; keep fp8/fp8_format/fp8_ends as they are, or build a new "
                         "MixedPrecision from a checkpoint")


def check_block_switch(old: Policy, new: Policy, strategy: Any, model: torch.nn.Module) -> None:
    """Raise ValueError if ``new`` changes which linears are block-scaled or how (``block``, ``block_disable`` or,
    under a block policy, ``keep_fp32`` or ``block_keep``) under a ``strategy`` that shards params: FSDP2 holds the
    modules it sharded, which a swap would leave behind; or if a ``new.block_keep`` pattern matches no linear of
    ``model``. Elsewhere the swap is a build's conversion (mixprec.engine.preparation.prepare)."""
    if new.block is not None and new.block_keep:
        from mixprec.blockscale import check_keep_patterns

        check_keep_patterns(model, new.block_keep)
    changes = (old.block, old.block_disable) != (new.block, new.block_disable) or (
        (old.keep_fp32, old.block_keep) != (new.keep_fp32, new.block_keep) and None not in (old.block, new.block))
    if changes and strategy.shards_params:
        raise ValueError(f"set_policy: {old} → {new} changes the block-scaled linears (block={old.block or 'none'} → "
                         f"{new.block or 'none'}, block_disable={'|'.join(new.block_disable) or 'none'}, keep_fp32="
                         f"{'|'.join(new.keep_fp32) or 'none'}, block_keep={'|'.join(new.block_keep) or 'none'}), "
                         f"which cannot be swapped under strategy={strategy.name!r} (it sharded the modules); keep "
                         "block, block_disable, block_keep and keep_fp32 as they are, or build a new MixedPrecision "
                         "from a checkpoint")
