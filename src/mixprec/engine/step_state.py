"""The training step's states, the calls each allows, and the messages a call out of order raises: one table.

An engine with an optimizer is always in one :class:`Phase` (``mp.phase``)::

    IDLE ──backward()──▶ PENDING ──step(), not the boundary──▶ BETWEEN ──backward()──▶ PENDING ...
    PENDING ──unscale_and_check() (or step() at the boundary)──▶ CHECKED ──apply_or_skip()──▶ IDLE
    backward(retain_graph=True) ──▶ RETAINED ──backward()──▶ PENDING (the same micro-batch)
    discard_gradients() ──▶ IDLE from any phase but CHECKED

Beside the phase, the engine's mode: an evaluation engine (built with ``optimizer=None``) refuses the training
calls until ``mp.attach``; after ``mp.unwrap()`` the calls that would train with other numerics are refused.
:data:`CALLS` says, for each public call, the phases it runs in and the message otherwise; the engine checks
every call there (:func:`check_call`) before it changes anything; ``mp.apply_or_skip(check)`` takes only the check
``mp.unscale_and_check()`` just returned (:func:`check_open`), ``mp.attach`` only on an engine without an optimizer
(:func:`check_attach`). Host values only; nothing here syncs.
The counted limits (micro-batches beyond ``accumulation_steps``, a boundary's end) stay with
:class:`mixprec.engine.boundary.AccumulationGroup`, which raises the messages below.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Phase", "CALLS", "check_call", "check_open", "check_attach", "MID_ACCUMULATION", "TOO_MANY",
           "NO_BACKWARD", "BEFORE_BOUNDARY", "UNSYNCED_END", "STEP_SKIPPED", "OTHER_CHECK", "ATTACHED"]


class Phase(Enum):
    """Where the engine is in its step."""

    IDLE = "at a boundary: no backward() since the last step's result"
    BETWEEN = "inside an accumulation group: the last mp.step() returned None"
    PENDING = "a backward() awaits its mp.step()"
    RETAINED = "a backward(retain_graph=True) awaits its mp.step(); the next backward() joins its micro-batch"
    CHECKED = "mp.unscale_and_check() ran; mp.apply_or_skip(check) has not"

    @property
    def awaits_step(self) -> bool:
        """A ``backward()`` awaits its ``mp.step()`` (PENDING or RETAINED)."""
        return self in (Phase.PENDING, Phase.RETAINED)


TOO_MANY = ("backward() called for micro-batch {n} since the last step() with accumulation_steps={a}; call mp.step() "
             "after each micro-batch's backward() (it returns None until the boundary). Two losses of one micro-batch: "
             "pass retain_graph=True to the first backward(), or backpropagate their sum")
MID_ACCUMULATION = ("{call} called after {n} micro-batch(es) of backward() without reaching the step boundary; "
                     "{what} at an accumulation boundary (after mp.step() returns a result; to end a short group, "
                     "the last one of an epoch, call mp.step(end_group=True) after its last backward())")
NO_BACKWARD = ("{call} called without backward() since the last step{note}; call mp.backward(loss) first: a plain "
               "loss.backward() bypasses the engine (its loss scaling, accumulation division and micro-batch "
               "count), so call mp.backward(loss) instead of loss.backward()")
BEFORE_BOUNDARY = ("unscale_and_check() after micro-batch {k} of accumulation_steps={n}: it runs at the boundary "
                   "only; call mp.step() after each earlier micro-batch (it returns None), or mp.step() for the "
                   "whole step; to end a short group here (the last one of an epoch), pass end_group=True")
UNSYNCED_END = ("{call} with end_group=True ends a short group under strategy={strategy!r}, but its last micro-batch's "
                "backward did not reduce gradients across ranks (the wrapper decides that at the forward); call "
                "mp.end_group_next() after the previous micro-batch's mp.step() and before the closing micro-batch's "
                "forward (then mp.step() ends the group by itself)")
STEP_SKIPPED = ("mp.backward() for a new micro-batch under strategy={strategy!r} while the last one's mp.step() has not "
                "run: mp.step() sets whether the next micro-batch's backward reduces gradients across ranks (the "
                "wrapper reads it at the forward), so without it the group's gradients would never be reduced and the "
                "replicas would drift apart. Call mp.step() after each micro-batch's backward() (it returns None until "
                "the boundary); two losses of one micro-batch: pass retain_graph=True to the first backward(), or "
                "backpropagate their sum")
END_NEXT_PENDING = ("end_group_next() called after a backward() whose mp.step() has not run; call it after that "
                    "mp.step() and before the forward of the micro-batch that ends the group")
OPEN_CHECK = ("{call} after mp.unscale_and_check() at this boundary; call mp.apply_or_skip(check) first to finish "
              "the step")
EVALUATION = ("{call} on an evaluation engine (built with optimizer=None): attach one first with "
              "mp.attach(optimizer, scheduler=None)")
UNWRAPPED = ("{call} after mp.unwrap(): the engine's hooks (output cast, keep_fp32 regions, fp32 embedding lookups) "
             "are gone, so it would train with other numerics; build a new MixedPrecision on the model to go on")
HANDED_OVER = ("{call} on an engine whose model a newer {who} took over (it unwrapped this one: one live engine per "
               "model); go on with that one (the new trainer), or build a new MixedPrecision on the model")
UNWRAP_MID = "unwrap(to_fp32=True) mid-accumulation; call it after mp.step() returns a result"
ATTACHED = ("mp.attach(...) on an engine that has an optimizer already (MixedPrecision(model, optimizer, ...) or an "
            "earlier mp.attach); build a new MixedPrecision for another one")
OTHER_CHECK = ("apply_or_skip(check) takes the StepCheck that mp.unscale_and_check() just returned at this boundary; "
               "call mp.unscale_and_check() first, then mp.apply_or_skip(check) once")

_ALL = frozenset(Phase)
_STEPPING = frozenset({Phase.IDLE, Phase.BETWEEN, Phase.PENDING, Phase.RETAINED})
_BOUNDARY = frozenset({Phase.IDLE})


@dataclass(frozen=True)
class Call:
    """One public call's rule: the ``phases`` it runs in, the ``refusal`` outside them (formatted with ``call``,
    ``n``: the micro-batches so far, ``what``), whether it ``trains`` (refused on an evaluation engine) and whether
    it is refused after ``mp.unwrap()``."""

    phases: frozenset[Phase]
    refusal: str = ""
    what: str = ""
    trains: bool = False
    unwrapped_refused: bool = False


#: Every public call the step's state constrains, by the name its messages use.
CALLS: dict[str, Call] = {
    "mp.autocast()": Call(_ALL, unwrapped_refused=True),
    "mp.backward()": Call(_STEPPING, OPEN_CHECK, trains=True, unwrapped_refused=True),
    "mp.step()": Call(_STEPPING, OPEN_CHECK, trains=True, unwrapped_refused=True),
    "mp.unscale_and_check()": Call(_STEPPING, OPEN_CHECK, trains=True, unwrapped_refused=True),
    "mp.end_group_next()": Call(frozenset({Phase.IDLE, Phase.BETWEEN, Phase.CHECKED}), END_NEXT_PENDING),
    "mp.state_dict()": Call(_ALL - {Phase.CHECKED}, OPEN_CHECK),
    "set_policy()": Call(_BOUNDARY, MID_ACCUMULATION, "change the policy"),
    "unfreeze()": Call(_BOUNDARY, MID_ACCUMULATION, "unfreeze"),
    "restore_progress()": Call(_BOUNDARY, MID_ACCUMULATION, "restore"),
    "unwrap(to_fp32=True)": Call(_BOUNDARY, UNWRAP_MID),
}


def check_call(call: str, phase: Phase, micro_step: int, *, evaluation: bool = False,
               unwrapped: bool | str = False) -> None:
    """RuntimeError, naming ``call`` and what to do, when :data:`CALLS` refuses it in ``phase`` (``micro_step``
    micro-batches since the boundary), on an ``evaluation`` engine or an ``unwrapped`` one (a string: the trainer
    integration that took its model over, :func:`mixprec.engine.ownership.hand_over`). Nothing changes."""
    rule = CALLS[call]
    if evaluation and rule.trains:
        raise RuntimeError(EVALUATION.format(call=call))
    if unwrapped and rule.unwrapped_refused:
        raise RuntimeError(HANDED_OVER.format(call=call, who=unwrapped) if isinstance(unwrapped, str) else
                           UNWRAPPED.format(call=call))
    if phase not in rule.phases:
        raise RuntimeError(rule.refusal.format(call=call, n=micro_step, what=rule.what))


def check_open(check: object, open_check: object) -> None:
    """``mp.apply_or_skip(check)``'s rule: RuntimeError (:data:`OTHER_CHECK`) unless ``check`` is ``open_check``, the
    StepCheck ``mp.unscale_and_check()`` returned at this boundary (None when none is open). Nothing changes."""
    if check is None or check is not open_check:
        raise RuntimeError(OTHER_CHECK)


def check_attach(optimizer: object) -> None:
    """``mp.attach``'s rule: RuntimeError (:data:`ATTACHED`) when the engine has an ``optimizer`` already."""
    if optimizer is not None:
        raise RuntimeError(ATTACHED)
