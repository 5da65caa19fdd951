"""When training cannot go on: :class:`DivergenceError` and the engine's default guard.

Loss scaling fixes an fp16 overflow by backing off; it cannot fix a loss that is itself non-finite
(bad data, a forward beyond the format's range) nor gradients that overflow at the smallest scale.
:class:`StopWhenStuck` is what ``MixedPrecision`` does about that when no :class:`mixprec.Guard`
is attached: count such skipped steps and, at ``max_stuck_skips`` in a row, raise a
:class:`DivergenceError` saying whether the gradients held inf or NaN and whether the loss was
finite (DeepSpeed exits when its scale is at the minimum; torch's GradScaler halves it towards 0).
A ``Guard`` replaces it (rollback, escalation, then its own ``DivergenceError``). :class:`Judging` is the
engine's call of either at a boundary, with what a guard is shown there.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from mixprec.engine.protocol import Engine

__all__ = ["DivergenceError", "Judging", "StopWhenStuck", "stuck_if_skipped"]


def stuck_if_skipped(loss_scale: Any) -> torch.Tensor:
    """The stuck-skip count the current step makes if it is skipped, as a (1,) fp32 device tensor (no
    sync): consecutive skips at the scale's floor (dynamic), or consecutive skips (fixed/none), this one
    included."""
    if loss_scale.dynamic:
        stuck = loss_scale.floor_skips.float() + loss_scale.at_floor().float()
    else:
        stuck = loss_scale.consecutive_skips.float() + 1
    return stuck.reshape(1)


class DivergenceError(RuntimeError):
    """Training cannot continue: non-finite values that loss scaling cannot fix, or a guard gave up."""


class StopWhenStuck:
    """The default guard: raise :class:`DivergenceError` after ``max_stuck_skips`` stuck steps.

    A step is *stuck* when it was skipped and loss scaling cannot help: the loss itself was
    non-finite (counted in a row here), or the gradients overflowed with the dynamic scale at its
    floor / with a fixed or no scale (``StepResult.stuck_skips``, counted by the loss scale).
    ``after_step(mp, result)`` is the guard interface; it returns ``result`` unchanged. Host syncs:
    none, but when it raises it reads the gradients once to say whether they held inf or NaN.

    Raises:
        ValueError: ``max_stuck_skips`` is not an int >= 1.
    """

    def __init__(self, max_stuck_skips: int = 20) -> None:
        if isinstance(max_stuck_skips, bool) or not isinstance(max_stuck_skips, int) or max_stuck_skips < 1:
            raise ValueError(f"max_stuck_skips={max_stuck_skips!r} must be an int >= 1")
        self.max_stuck_skips = max_stuck_skips
        self.nonfinite_streak = 0   # consecutive boundaries whose loss itself was non-finite

    def after_step(self, mp: Engine, result: Any) -> Any:
        self.nonfinite_streak = 0 if result.loss_finite else self.nonfinite_streak + 1
        stuck = result.stuck_skips if result.loss_finite else self.nonfinite_streak
        if result.applied or stuck < self.max_stuck_skips:
            return result
        raise DivergenceError(_message(stuck, result, mp, _grad_kinds(list(mp.step_gradients))))


class Judging:
    """An engine's judge at each boundary: its guard's ``after_step(mp, result)``, or :class:`StopWhenStuck`'s
    (``max_stuck_skips``) while it has no guard; and what a guard is shown there: ``batches``, the micro-batches
    ``mp.cast_inputs`` cast since the last boundary (kept only while a guard is attached; at most
    ``accumulation_steps``: ``mp.step_batches``) and ``grads``, the boundary's unscaled gradients (set by the engine
    before its features' boundary; ``mp.step_gradients``). Both are dropped once the judge returns or raises.

    Raises:
        ValueError: ``max_stuck_skips`` is not an int >= 1.
    """

    def __init__(self, accumulation_steps: int, max_stuck_skips: int) -> None:
        self.stop_when_stuck = StopWhenStuck(max_stuck_skips)   # the guard while the engine's ``guard`` is None
        self.batches: deque[Any] = deque(maxlen=accumulation_steps)
        self.grads: list[torch.Tensor] = []

    def keep(self, batch: Any, guard: Any) -> None:
        """Keep ``batch`` for ``guard`` (nothing is kept without one)."""
        if guard is not None:
            self.batches.append(batch)

    def judge(self, mp: Engine, guard: Any, result: Any) -> Any:
        """What ``guard`` (None: :attr:`stop_when_stuck`) makes of the boundary's ``result`` on ``mp``; then the
        kept batches and gradients are dropped. Raises what the guard raises (:class:`DivergenceError`)."""
        try:
            return (guard if guard is not None else self.stop_when_stuck).after_step(mp, result)
        finally:
            self.batches.clear()
            self.grads = []


def _grad_kinds(grads: list[torch.Tensor]) -> str:
    """``"NaN"``, ``"inf"``, ``"NaN and inf"`` or ``"no non-finite values"`` (one sync per check)."""
    has_nan = any(bool(torch.isnan(g).any()) for g in grads)
    has_inf = any(bool(torch.isinf(g).any()) for g in grads)
    return " and ".join(k for k, v in (("NaN", has_nan), ("inf", has_inf)) if v) or "no non-finite values"


def _message(stuck: int, result: Any, mp: Engine, kinds: str) -> str:
    ls = mp.loss_scale
    scale = result.loss_scale
    if not result.loss_finite:
        return (f"{stuck} consecutive steps with a non-finite loss (after {result.step} applied steps; gradients "
                f"hold {kinds}; the loss scale was left at {scale:g}, since scaling cannot fix this): the fault is "
                "in the data or the forward pass (bad input values, or an activation beyond the compute format's "
                "range, which loss scaling cannot fix). Check the batch and the model (mixprec.locate_nonfinite "
                "names the first bad module), or attach mixprec.Guard to roll back and skip bad batches")
    if ls.enabled:
        where = f"at its floor {scale:g}" if ls.dynamic else f"fixed at {scale:g}"
        cause = ("the loss is finite but gradients overflow even at the smallest scale: some layer's gradients "
                 "exceed the format's range; keep it in fp32 (policy keep_fp32=...), lower min_scale, or use bf16")
        head = f"{stuck} consecutive skipped steps with the loss scale {where}"
    else:
        cause = ("the loss is finite but the backward pass produced non-finite gradients (e.g. sqrt or log of "
                 "0, a division by 0, or an op overflowing even fp32/bf16 range): mixprec.locate_nonfinite "
                 "names where the backward first went non-finite")
        head = f"{stuck} consecutive skipped steps without loss scaling"
    return f"{head} (after {result.step} applied steps): gradients hold {kinds}; {cause}"
