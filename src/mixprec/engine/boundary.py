"""One step boundary: :class:`AccumulationGroup` (where the group of micro-batches ends: after
``accumulation_steps`` of them, or earlier when the loop ends it), :class:`BoundaryLosses` (its micro-batches'
losses and penalty overflows), :class:`StepCheck` (what ``mp.unscale_and_check()`` found), :class:`StepResult`
(what ``mp.apply_or_skip(check)`` did) and :func:`check_grads`, the unscaled grads' fp32 norm, the ranks'
agreement and the step's one host read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.engine.clipping import global_norm_fp32
from mixprec.engine.divergence import stuck_if_skipped
from mixprec.engine.step_state import BEFORE_BOUNDARY, NO_BACKWARD, STEP_SKIPPED, TOO_MANY, UNSYNCED_END, Phase

__all__ = ["AccumulationGroup", "BoundaryLosses", "StepCheck", "StepResult", "check_grads"]


class AccumulationGroup:
    """Where the engine's accumulation group ends: after ``accumulation_steps`` (N) micro-batches, or after
    k < N when the loop ends it early (``mp.step(end_group=True)``, or :attr:`end_next`, set by
    ``mp.end_group_next()`` before the closing micro-batch's forward so that its backward reduces gradients
    across ranks). ``backward()`` divided each loss by N, so a group of k is unscaled by :meth:`factor`
    N/k: its gradients are the mean over its k micro-batches (the weighting of Accelerate's and Lightning's
    end-of-epoch step). Host values only; nothing here syncs."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.end_next = False   # the micro-batch after the last step() ends the group

    def closes(self, call: str, pending: Any, micro_step: int, *, end_group: bool, strategy: str | None) -> bool:
        """Whether the micro-batch just backpropagated (the ``micro_step``-th) ends the group. RuntimeError
        naming ``call`` when no ``backward()`` is ``pending`` since the last step (nothing to end), or when a
        short group ends under ``strategy`` without :attr:`end_next` (its last backward did not sync)."""
        if not pending:
            raise RuntimeError(NO_BACKWARD.format(call=call, note=(
                " (end_group=True ends a group after its last micro-batch's backward; none is open)"
                if end_group else "")))
        short = micro_step < self.accumulation_steps
        if end_group and short and strategy is not None and not self.end_next:
            raise RuntimeError(UNSYNCED_END.format(call=call, strategy=strategy))
        return not short or end_group or self.end_next

    def opens(self, phase: Phase, micro_step: int, *, join: bool, strategy: str | None) -> bool:
        """Whether a ``backward()`` in ``phase`` starts a new micro-batch: not after ``backward(retain_graph=True)``
        (RETAINED), nor when it is to ``join`` the PENDING one; a new one is checked first (:meth:`check_new`)."""
        new_micro_batch = not (phase is Phase.RETAINED or join and phase is Phase.PENDING)
        if new_micro_batch:   # not past accumulation_steps; under a strategy, not without the last one's step()
            self.check_new(phase is Phase.PENDING, micro_step, strategy)
        return new_micro_batch

    def per_micro_batch(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by N, each micro-batch's share of the group's mean (``loss`` itself when N is 1)."""
        return loss / self.accumulation_steps if self.accumulation_steps > 1 else loss

    def check_new(self, pending: Any, micro_step: int, strategy: str | None) -> None:
        """Before a new micro-batch's backward (the ``micro_step + 1``-th): RuntimeError past ``accumulation_steps``,
        or under ``strategy`` while the last micro-batch's backward is ``pending`` (its ``mp.step()`` sets whether
        this one reduces across ranks; in one process nothing depends on it)."""
        if micro_step >= self.accumulation_steps:
            raise RuntimeError(TOO_MANY.format(n=micro_step + 1, a=self.accumulation_steps))
        if pending and strategy is not None:
            raise RuntimeError(STEP_SKIPPED.format(strategy=strategy))

    def check_closes(self, pending: Any, micro_step: int, *, end_group: bool, strategy: str | None) -> None:
        """``mp.unscale_and_check()``'s check: RuntimeError unless the group ends here (:meth:`closes`)."""
        if not self.closes("unscale_and_check()", pending, micro_step, end_group=end_group, strategy=strategy):
            raise RuntimeError(BEFORE_BOUNDARY.format(k=micro_step, n=self.accumulation_steps))

    def end_after_next(self) -> None:
        """Set :attr:`end_next` (``mp.end_group_next()``, checked by :mod:`mixprec.engine.step_state`)."""
        self.end_next = True

    def last_micro_batch(self, micro_step: int) -> bool:
        """Whether the next micro-batch (after ``micro_step``) ends the group: the one whose backward syncs."""
        return micro_step == self.accumulation_steps - 1 or self.end_next

    def factor(self, micro_step: int) -> float:
        """N/k for a group ended after k = ``micro_step`` micro-batches (1.0 for a full group)."""
        return self.accumulation_steps / micro_step


class BoundaryLosses:
    """The engine's tally of the current boundary (device tensors; no method syncs): ``last``, the last
    micro-batch's loss (detached); ``total`` (fp32) and ``finite`` (bool 0-dim) over the boundary's
    micro-batches; ``mean``, the last closed boundary's fp32 mean loss (None before one); ``extra_inf``,
    the overflow flag of gradients ``mp.unscale()`` met this boundary (fp32 0-dim, None when none)."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.mean: torch.Tensor | None = None
        self.finite = torch.ones((), dtype=torch.bool)
        self.extra_inf: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, *, first: bool) -> None:
        """Count ``loss`` (detached); ``first``: it starts the boundary."""
        self.last = loss
        self.total = loss.float() if first else self.total + loss.float()
        finite = torch.isfinite(loss).all()
        self.finite = finite if first else self.finite & finite

    def add_overflow(self, found: torch.Tensor) -> None:
        """Join ``found`` (fp32 0-dim, 1.0: a non-finite unscaled penalty gradient) into :attr:`extra_inf`."""
        self.extra_inf = found if self.extra_inf is None else torch.maximum(self.extra_inf, found)

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """The open boundary's tally (``last``, ``total``, ``finite``, ``extra_inf``) as copies, for a state
        saved mid-accumulation (:mod:`mixprec.engine.open_group`). No host sync."""
        return {key: None if (t := getattr(self, key)) is None else t.detach().clone()
                for key in ("last", "total", "finite", "extra_inf")}

    def load_state_dict(self, state: dict[str, torch.Tensor | None], device: torch.device) -> None:
        """Take a :meth:`state_dict`'s tally (copies on ``device``) as the open boundary's. No host sync."""
        for key in ("last", "total", "finite", "extra_inf"):
            setattr(self, key, None if state[key] is None else state[key].to(device, copy=True))

    def close(self, micro_batches: int) -> None:
        """The boundary is reached: :attr:`mean` over its ``micro_batches`` (k of a group ended early)."""
        self.mean = self.total / micro_batches

    def unscale_(self, loss_scale: Any, grads: list[torch.Tensor], factor: float = 1.0) -> torch.Tensor:
        """Unscale ``grads`` in place, times ``factor`` in the same multiply (:meth:`AccumulationGroup.factor`);
        the overflow flag, with :attr:`extra_inf`'s joined (a NaN from an overflowed penalty also marks the loss
        non-finite) and reset."""
        found_inf = loss_scale.unscale_(grads) if factor == 1.0 else loss_scale.unscale_(grads, factor)
        extra, self.extra_inf = self.extra_inf, None
        if extra is None:
            return found_inf
        self.finite = self.finite | extra.bool().to(self.finite.device)
        return torch.maximum(found_inf, extra.to(found_inf.device))


@dataclass(frozen=True)
class StepCheck:
    """What :meth:`MixedPrecision.unscale_and_check` found at a boundary, for :meth:`~MixedPrecision.apply_or_skip`.

    ``skipped``, ``loss_finite`` and ``stuck_skips`` are host values (the step's one sync): ``skipped``,
    the step will be skipped (non-finite grads, or a non-finite loss); ``loss_finite``, False when it
    is skipped for a non-finite loss; ``stuck_skips`` as :class:`StepResult`'s. ``grad_norm_t``: fp32
    norm of the unscaled grads (0-dim, device); ``loss_scale_t``: the scale this step used;
    ``found_inf_t``: the agreed overflow flag the loss scale updates from; ``grads``: the unscaled fp32
    grads (this rank's shards) the optimizer steps. Reading the tensors' values syncs.
    """

    skipped: bool
    loss_finite: bool
    stuck_skips: int
    grad_norm_t: torch.Tensor = field(repr=False)
    loss_scale_t: torch.Tensor = field(repr=False)
    found_inf_t: torch.Tensor = field(repr=False)
    grads: tuple[torch.Tensor, ...] = field(repr=False)


@dataclass(frozen=True, repr=False)
class StepResult:
    """What one optimizer-step boundary did.

    ``applied``, ``loss_finite`` and ``stuck_skips`` are host values (read by ``step()``'s one sync).
    ``stuck_skips``: consecutive skipped steps that loss scaling can no longer help (scale at its floor,
    or fixed/none), this one included; 0 when applied. ``loss_scale`` (the scale this step used) and
    ``grad_norm`` (fp32, of the unscaled gradients, before clipping) are read from device tensors on
    access: **reading them syncs the host with the device** (so does ``repr``, which shows both).
    """

    applied: bool
    skipped_reason: str | None      # None, "overflow" (loss scaling backs off) or "nonfinite"
    step: int                       # applied optimizer steps so far
    skipped_total: int
    loss_scale_t: torch.Tensor = field(repr=False)
    grad_norm_t: torch.Tensor = field(repr=False)
    rolled_back: bool = False
    escalated: bool = False
    loss_finite: bool = True
    stuck_skips: int = 0

    @classmethod
    def of(cls, check: StepCheck, *, step: int, skipped_total: int, scaling: bool) -> StepResult:
        """What a boundary did after ``check``: applied unless it is skipped, then "overflow" where loss
        ``scaling`` backs off from a finite loss, else "nonfinite"; ``step``/``skipped_total``: the counts after it."""
        applied = not check.skipped
        reason = None if applied else "overflow" if (scaling and check.loss_finite) else "nonfinite"
        return cls(applied=applied, skipped_reason=reason, step=step, skipped_total=skipped_total,
                   loss_scale_t=check.loss_scale_t, grad_norm_t=check.grad_norm_t, loss_finite=check.loss_finite,
                   stuck_skips=check.stuck_skips)

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scale_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)

    def __repr__(self) -> str:   # the fields, with loss_scale and grad_norm read (a host sync, as printing a tensor)
        shown = {"applied": self.applied, "skipped_reason": self.skipped_reason, "step": self.step,
                 "skipped_total": self.skipped_total, "loss_scale": self.loss_scale, "grad_norm": self.grad_norm,
                 "rolled_back": self.rolled_back, "escalated": self.escalated, "loss_finite": self.loss_finite,
                 "stuck_skips": self.stuck_skips}
        return f"StepResult({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def check_grads(grads: list[torch.Tensor], found_inf: torch.Tensor, loss_finite: torch.Tensor, loss_scale: Any,
                strategy: Any, device: torch.device) -> StepCheck:
    """The check of a boundary's unscaled fp32 ``grads`` (this rank's shards): their global fp32 norm, the
    flags (``found_inf``: the unscale's overflow flag; ``loss_finite``: every micro-batch's loss finite,
    bool 0-dim) agreed across ranks by ``strategy``, and one host read of flags, stuck count and whether
    the norm is finite; a norm whose squares overflow fp32 is taken again scaled (:mod:`mixprec.engine.
    clipping`). ``loss_scale``: the scale the grads were unscaled from. One host sync."""
    grad_norm = strategy.global_norm(global_norm_fp32(grads, device))
    flags = strategy.agree_flags(torch.stack([found_inf, (~loss_finite).to(found_inf)]))
    scale_before = loss_scale.scale.detach().clone()
    skipped, loss_nonfinite, stuck, norm_finite = _host_read(flags, loss_scale, grad_norm)
    if not (norm_finite or skipped):   # finite grads whose squares overflow fp32: the scaled norm
        grad_norm = strategy.global_norm(global_norm_fp32(grads, device, scaled=True), scaled=True)
    loss_finite_host = not (skipped and loss_nonfinite)
    return StepCheck(skipped=bool(skipped), loss_finite=loss_finite_host,
                     stuck_skips=0 if not skipped or not loss_finite_host else int(stuck),
                     grad_norm_t=grad_norm, loss_scale_t=scale_before, found_inf_t=flags[0], grads=tuple(grads))


def _host_read(flags: torch.Tensor, loss_scale: Any, grad_norm: torch.Tensor) -> list[float]:
    """The step's one host read: ``flags`` (skip, loss non-finite), the stuck count and whether
    ``grad_norm`` is finite, read together (one sync)."""
    return torch.cat([flags, stuck_if_skipped(loss_scale).to(flags), grad_norm.isfinite().reshape(1).to(flags)]).tolist()
