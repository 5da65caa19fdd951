"""The divergence guard: notice a run going bad, roll it back, escalate precision, or stop and say why.

Lightning's ``SpikeDetection`` (a running mean of the loss over a window, a relative tolerance,
then ``TrainingSpikeException``) and Keras' ``TerminateOnNaN`` stop the run; DeepSpeed exits
when the loss scale is at its minimum; torch's GradScaler halves the scale towards zero. The
guard rolls back to an in-memory snapshot and keeps training, changes precision when the same
place keeps failing, and gives up only with a :class:`~mixprec.engine.divergence.DivergenceError` that
names the cause, the step, the module and what was tried.

The engine never imports this module: ``MixedPrecision(..., guard=Guard(...))`` hands the guard
each :class:`~mixprec.engine.mixed_precision.StepResult` through ``guard.after_step(mp, result)``, and the
guard acts through the engine's public surface (``state_dict``/``load_state_dict``,
``set_policy``, ``boundary_loss``, ``step_batches``, ``events``). Its knobs and counts
(:mod:`mixprec.safety.config`) and its escalation ladder (:mod:`mixprec.safety.escalation`) live in
:mod:`mixprec.safety`; every public name is importable from here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from mixprec.machine.capability import probe
from mixprec.engine.divergence import DivergenceError
from mixprec.engine.mixed_precision import StepResult
from mixprec.engine.records import Event
from mixprec.numerics.localise import NonFiniteReport, locate_nonfinite
from mixprec.numerics.localise_sharded import locate_on_every_rank
from mixprec.safety.config import CAUSES, GuardConfig, GuardState
from mixprec.safety.dropping import drop_reason
from mixprec.safety.escalation import next_policy
from mixprec.policy.tree import map_tensors

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["Guard", "GuardConfig", "GuardState", "next_policy"]

log = logging.getLogger("mixprec")
_ADDED_SINCE = frozenset({"nonfinite_streak"})   # GuardState fields an older run's saved state lacks (their defaults)

@dataclass(frozen=True)
class _Snapshot:
    """The engine's full state deep-copied to CPU after a healthy applied step."""

    applied_steps: int
    boundary: int
    policy: str
    state: dict
    losses: tuple[float, ...]


def _copy_to_cpu(tree: Any) -> Any:
    """Deep copy with every tensor cloned to the CPU (containers rebuilt, other leaves deep-copied)."""
    return map_tensors(tree, lambda t: t.detach().to("cpu", copy=True), leaf=copy.deepcopy)


class Guard:
    """Watch every optimizer step; roll back, escalate precision or raise with a diagnosis.

    Pass it to the engine: ``MixedPrecision(model, opt, policy, guard=Guard(loss_fn=loss_fn))``.

    Detects, at each step boundary:

    * ``"nonfinite"``: a non-finite loss or non-finite gradients that are not a loss-scale
      overflow: every skipped step without loss scaling (bf16, fp32), a non-finite loss under
      any policy, and a non-finite loss read on a check step even when the gradients were finite;
    * ``"overflow"``: under loss scaling (fp16), a skipped step after which the scale has backed
      off ``overflow_backoffs`` times in a row or sits at its floor (a static scale always does);
    * ``"spike"``: on a check step after ``spike_warmup`` healthy applied steps, the loss is above
      ``spike_factor`` × the mean of the last ``spike_window`` healthy losses (assumes positive
      losses; 3 is about Lightning's default ``rtol=2``), or more than ``spike_zscore`` standard
      deviations above that mean (the loss read is ``mp.boundary_loss``: with gradient
      accumulation, the mean over the step's micro-batches);
    * ``"skips"``: ``max_consecutive_skips`` skipped steps in a row, for any reason.

    Acts by a ladder; a failure is counted against the current snapshot (the "place"):

    1. **drop** the batch of the first non-finite step in a row that the engine skipped (nothing applied, the
       state as it was): a ``"skip"`` event, no rollback, counted against the place like any failure, so the
       rungs below still come (:mod:`mixprec.safety.dropping`); otherwise **roll back**: restore the last snapshot (params, masters, optimizer, loss scale,
       scheduler, applied-step counter) with ``mp.load_state_dict``. The offending batch is
       dropped: the caller's next batch continues. The data position (``mp.boundaries``) never
       moves back, and the applied steps undone count as skipped (``skipped_total``), so
       ``boundaries == applied_steps + skipped_total`` still holds. Snapshots are deep copies on
       the CPU, taken after the first healthy applied step and then every ``snapshot_every``
       applied steps, on a step whose loss was read and judged healthy.
    2. **escalate** every ``escalate_after``-th failure at the same place, on top of the
       rollback: re-run the bad micro-batch with :func:`mixprec.locate_nonfinite` (needs
       ``loss_fn`` and batches passed through ``mp.cast_inputs``) and keep the first non-finite
       module in fp32; else move fp16 → bf16 (where :func:`mixprec.probe` says the device runs
       bf16) → fp32 (:func:`next_policy`). Done by ``mp.set_policy``, which records an
       ``"escalate"`` event; a fresh snapshot follows under the new policy. A batch that holds
       non-finite values itself is not escalated (precision cannot fix data).
    3. **give up** at failure ``max_rollbacks + 1`` at the same place: record a ``"diverged"``
       event and raise :class:`~mixprec.engine.divergence.DivergenceError` naming the cause, the step, the
       first non-finite module and what was tried.

    The failure count at a place resets when a new regular snapshot is taken. Each action is
    appended to ``mp.events`` as ``{"step": boundary count, "kind": "rollback" | "skip" (no
    snapshot yet: the skipped step left the state as it was) | "escalate" | "diverged",
    "cause", "module", "detail", ...}``, and the returned :class:`StepResult` has
    ``rolled_back`` / ``escalated`` set, ``applied=False`` after a rollback, and the counters as
    restored.

    Args:
        snapshot_every: applied steps between snapshots.
        check_every: read the loss every this many boundaries (spike and non-finite-loss checks).
        spike_factor, spike_zscore: spike thresholds (None turns one off).
        spike_window: losses in the running statistic. spike_warmup: healthy losses needed first.
        overflow_backoffs: consecutive loss-scale back-offs that count as an overflow failure.
        max_consecutive_skips: consecutive skipped steps that count as a failure.
        escalate_after: failures at one place between escalations.
        max_rollbacks: rollbacks allowed at one place before raising.
        loss_fn: ``loss_fn(model, batch) -> loss``, as used in training, for localisation.

    Several processes (``MixedPrecision(..., strategy="ddp" | "fsdp2")``): each rank judges its
    own step, then the engine's ``agree_on`` makes every rank act on the first cause any rank
    found (one all-reduce per boundary), so all ranks roll back, escalate or give up together.
    Under DDP the bad batch is not localised (re-running it on one rank would run collectives on that rank
    only), so escalation skips the keep-a-module rung. Under FSDP2 every rank re-runs its batches forward only
    and the ranks agree on the module (:mod:`mixprec.numerics.localise_sharded`); the keep-a-module rung
    reshards its FSDP2 unit in place and the optimizer-state rung runs (8-bit state → fp32 state); a dtype
    change of every param would re-run ``fully_shard``: skipped, named.

    Host syncs: skipped steps are known from ``StepResult.applied`` (already synced by the
    engine); reading the loss costs one sync every ``check_every`` boundaries; a skipped step
    under loss scaling costs one more (the scale before/after and the floor flag, read together);
    snapshots, rollbacks and localisation copy and sync, but only every ``snapshot_every``
    steps or on a failure. Memory: one snapshot (params, masters and optimizer state) on the CPU.

    Raises:
        ValueError: a knob out of range (naming it, its value, what is allowed and an example).
        TypeError: ``loss_fn`` is not callable.
    """

    def __init__(self, *, snapshot_every: int = 50, check_every: int = 1, spike_factor: float | None = 3.0,
                 spike_zscore: float | None = None, spike_window: int = 50, spike_warmup: int = 20,
                 overflow_backoffs: int = 16, max_consecutive_skips: int = 20, escalate_after: int = 2,
                 max_rollbacks: int = 8, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> None:
        self.config = GuardConfig(snapshot_every=snapshot_every, check_every=check_every,
                                  spike_factor=spike_factor, spike_zscore=spike_zscore, spike_window=spike_window,
                                  spike_warmup=spike_warmup, overflow_backoffs=overflow_backoffs,
                                  max_consecutive_skips=max_consecutive_skips, escalate_after=escalate_after,
                                  max_rollbacks=max_rollbacks)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Guard loss_fn={loss_fn!r} must be callable as loss_fn(model, batch) -> loss, or None")
        self.loss_fn = loss_fn
        self.state = GuardState()
        self.snapshot: _Snapshot | None = None
        self.last_report: NonFiniteReport | None = None
        self._engine: weakref.ref | None = None   # weakly: the engine holds its guard

    @property
    def counts(self) -> dict[str, int]:
        """Detections per cause and actions taken (a view of ``state.counts``)."""
        return self.state.counts

    # ------------------------------------------------------------------ the engine's entry point
    def after_step(self, mp: MixedPrecision, result: StepResult) -> StepResult:
        """Judge the step ``mp`` just finished; act on a failure; return the (updated) result.

        Raises:
            RuntimeError: the guard is already attached to another engine.
            DivergenceError: past ``max_rollbacks`` failures at one place.
        """
        if self._engine is None:
            self._engine = weakref.ref(mp)
        elif self._engine() is not mp:
            gone = " (since deleted)" if self._engine() is None else ""
            raise RuntimeError(f"this Guard already watched another MixedPrecision engine{gone}; give each engine its "
                               "own Guard (it holds that engine's snapshot and counts)")
        cause, detail, loss = self._detect(mp, result)
        agree_on = getattr(mp, "agree_on", None)
        if agree_on is not None:  # a distributed engine: the first cause any rank saw, on every rank
            agreed = agree_on(cause, CAUSES)
            if agreed != cause:
                if cause is None and loss is not None:
                    self.state.losses.pop()  # judged healthy here, but the step failed elsewhere
                cause, detail, loss = agreed, f"{agreed} detected on another rank", None
        if cause is not None:
            return self._fail(mp, result, cause, detail)
        if loss is not None and self._snapshot_due(mp):
            self.take_snapshot(mp)
            self.state.failures_here = 0
        return result

    # ------------------------------------------------------------------ detection
    def _snapshot_due(self, mp: MixedPrecision) -> bool:
        snap = self.snapshot
        return (snap is None or snap.policy != str(mp.policy)
                or mp.applied_steps - snap.applied_steps >= self.config.snapshot_every)

    def _detect(self, mp: MixedPrecision, result: StepResult) -> tuple[str | None, str, float | None]:
        """(cause or None, detail, the loss if it was read and found healthy)."""
        c, s = self.config, self.state
        if not result.applied:
            s.skip_streak += 1
            if result.skipped_reason == "nonfinite":
                s.nonfinite_streak += 1
                why = ("the loss itself is non-finite" if mp.loss_scale.enabled else
                       "the loss or gradients are non-finite and no loss scaling is in play")
                return "nonfinite", why, None
            # an overflow under loss scaling: normal, unless the scale keeps backing off
            before, after, at_floor = torch.stack([   # one sync, on skipped steps only
                result.loss_scale_t.float(), mp.loss_scale.scale.float(),
                mp.loss_scale.at_floor().float().to(mp.loss_scale.scale.device)]).tolist()
            s.backoff_streak += after < before
            if at_floor or s.backoff_streak >= c.overflow_backoffs:
                where = (f"at its floor {after:g}" if at_floor else
                         f"at {after:g} after {s.backoff_streak} consecutive back-offs")
                return "overflow", f"gradients overflow with the loss scale {where}", None
            if s.skip_streak >= c.max_consecutive_skips:
                return "skips", f"{s.skip_streak} consecutive skipped steps (loss scale {after:g})", None
            return None, "", None
        s.skip_streak = s.backoff_streak = s.nonfinite_streak = 0
        if mp.boundaries % c.check_every != 0 and not self._snapshot_due(mp):
            return None, "", None
        loss = float(mp.boundary_loss)  # the guard's one sync per check
        if not math.isfinite(loss):
            return "nonfinite", f"the loss is {loss} although the gradients were finite", None
        spike = self._spike(loss)
        if spike:
            return "spike", spike, None
        s.losses.append(loss)
        del s.losses[:-c.spike_window]
        return None, "", loss

    def _spike(self, loss: float) -> str:
        c, window = self.config, self.state.losses
        if len(window) < c.spike_warmup:
            return ""
        mean = statistics.fmean(window)
        if c.spike_factor is not None and mean > 0 and loss > c.spike_factor * mean:
            return f"loss {loss:.4g} > {c.spike_factor:g} x the running mean {mean:.4g} of {len(window)} steps"
        std = statistics.pstdev(window)
        if c.spike_zscore is not None and std > 0 and (loss - mean) / std > c.spike_zscore:
            return (f"loss {loss:.4g} is {(loss - mean) / std:.1f} standard deviations above the running mean "
                    f"{mean:.4g} of {len(window)} steps (limit {c.spike_zscore:g})")
        return ""

    # ------------------------------------------------------------------ acting
    def _fail(self, mp: MixedPrecision, result: StepResult, cause: str, detail: str) -> StepResult:
        c, s = self.config, self.state
        s.counts[cause] += 1
        # a re-run of one rank's batch would run collectives on that rank only: under FSDP2 every rank re-runs
        local = getattr(mp, "strategy", None) in (None, "fsdp2")
        report = self._localise(mp, result) if cause != "spike" and local else None
        self.last_report = report
        module = None if report is None else report.module
        dropped = drop_reason(result, cause, report, s.nonfinite_streak)
        s.failures_here += 1   # a drop counts too: failures that come and go still escalate and end in the diagnosis
        if s.failures_here > c.max_rollbacks:
            self._give_up(mp, cause, detail, report)
        rolled_back, to_step = (False, None) if dropped else self._roll_back(mp)
        kind = "rollback" if rolled_back else "skip"
        s.counts[kind] += 1
        where = f"; {report}" if report is not None else ""
        back = (f"rolled back to applied step {to_step}" if rolled_back else dropped or
                "no snapshot yet: the skipped step left the state as it was")
        mp.record(Event(step=mp.boundaries, kind=kind, cause=cause, module=module,
                        detail=f"{detail}{where}; {back}; failure {s.failures_here} here", to_step=to_step))
        log.warning("mixprec guard: step %d: %s (%s)%s; %s", mp.boundaries, cause, detail, where, back)
        escalated = False
        if s.failures_here % c.escalate_after == 0:
            escalated = self._escalate(mp, cause, report)
        s.skip_streak = s.backoff_streak = 0
        if not rolled_back:
            return dataclasses.replace(result, escalated=escalated)
        return dataclasses.replace(result, applied=False, skipped_reason=result.skipped_reason or cause,
                                   step=mp.applied_steps, skipped_total=mp.skipped_total, rolled_back=True,
                                   escalated=escalated)

    def _localise(self, mp: MixedPrecision, result: StepResult) -> NonFiniteReport | None:
        if self.loss_fn is None or not mp.step_batches:
            return None
        if getattr(mp, "strategy", None) == "fsdp2":   # every rank, forward only, one agreed report
            try:
                return locate_on_every_rank(mp.model, list(mp.step_batches), self.loss_fn, mp.policy, mp.device,
                                            mp.agree_on)
            except (RuntimeError, ValueError, TypeError) as err:   # as below (a loss_fn failing on every rank)
                log.warning("mixprec guard: could not localise the bad batch: %s", err)
                return None
        scale = (float(result.loss_scale_t) if mp.loss_scale.enabled else 1.0) / mp.accumulation_steps
        for batch in mp.step_batches:
            try:
                report = locate_nonfinite(mp.model, batch, self.loss_fn, mp.policy, mp.device, loss_scale=scale)
            except (RuntimeError, ValueError, TypeError) as err:  # a diagnostic must not end the run
                log.warning("mixprec guard: could not localise the bad batch: %s", err)
                return None
            if report is not None:
                return report
        return None

    def _roll_back(self, mp: MixedPrecision) -> tuple[bool, int | None]:
        snap = self.snapshot
        if snap is None or snap.policy != str(mp.policy):
            return False, None
        state = _copy_to_cpu(snap.state)  # a fresh copy: loading may alias it (optimizer, scheduler)
        undone = mp.applied_steps - snap.applied_steps
        state["counters"] = {**state["counters"], "boundaries": mp.boundaries,
                             "skipped_total": mp.skipped_total + undone}
        mp.load_state_dict(state)
        self.state.losses = list(snap.losses)
        return True, snap.applied_steps

    def _escalate(self, mp: MixedPrecision, cause: str, report: NonFiniteReport | None) -> bool:
        if report is not None and report.where == "input":
            self._note("none: the batch itself holds non-finite values")
            return False
        module = report.module if report is not None and report.where in ("forward", "backward") else None
        new, why = next_policy(mp.policy, module, bf16_ok=probe(mp.device).bf16,
                               sharded=getattr(mp, "strategy", None) == "fsdp2")
        if new is None:
            self._note(f"none: {why}")
            return False
        old = str(mp.policy)
        try:
            event = mp.set_policy(new, cause=cause, module=module, kind="escalate", record=False)
        except ValueError as err:  # e.g. an optimizer built for one rounding: say so, keep going
            self._note(f"{why}: refused ({err})")
            log.warning("mixprec guard: escalation %s → %s refused: %s", old, new, err)
            return False
        mp.record(dataclasses.replace(event, detail=f"{why}; {event.detail}"))
        self.state.escalations.append(why)
        self.state.counts["escalate"] += 1
        self.take_snapshot(mp)  # the same place, under the new policy: failures_here is kept
        return True

    def _note(self, text: str) -> None:
        """Record why an escalation did not happen (once in a row)."""
        if not self.state.escalations or self.state.escalations[-1] != text:
            self.state.escalations.append(text)

    def _give_up(self, mp: MixedPrecision, cause: str, detail: str, report: NonFiniteReport | None) -> None:
        s, snap = self.state, self.snapshot
        first = (f"first non-finite: {report}" if report is not None else
                 "first non-finite module: unknown (give Guard(loss_fn=...) and pass batches through "
                 "mp.cast_inputs to localise it)" if cause != "spike" else "no module to blame for a spike")
        place = (f"rollback(s) or dropped batch(es) at the snapshot of applied step {snap.applied_steps}" if snap
                 is not None else "skipped step(s), no snapshot yet")
        tried = "; ".join(s.escalations) if s.escalations else "no precision escalation"
        fix = {"spike": "lower the learning rate, clip gradients, or raise spike_factor",
               "nonfinite": "check the data at this position and the module named above",
               "overflow": "keep the module named above in fp32 (policy keep_fp32=...) or train in bf16",
               "skips": "inspect the loss scale and gradients (mixprec.locate_nonfinite)"}[cause]
        message = (f"mixprec.Guard gave up at step {mp.boundaries} ({mp.applied_steps} applied): {cause}: {detail}; "
                   f"{first}. Tried: {s.failures_here - 1} {place}; escalations: {tried}. "
                   f"Fix: {fix}")
        mp.record(Event(step=mp.boundaries, kind="diverged", cause=cause,
                        module=None if report is None else report.module, detail=message))
        raise DivergenceError(message)

    def take_snapshot(self, mp: MixedPrecision) -> None:
        """Deep-copy ``mp``'s state to the CPU now, as the guard does every ``snapshot_every``
        applied steps (a device→host copy: syncs). Rollbacks restore the latest snapshot."""
        self.snapshot = _Snapshot(applied_steps=mp.applied_steps, boundary=mp.boundaries, policy=str(mp.policy),
                                  state=_copy_to_cpu(mp.state_dict()), losses=tuple(self.state.losses))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The config and :class:`GuardState` as plain data (the snapshot is not included)."""
        return {"config": dataclasses.asdict(self.config),
                "state": {f.name: copy.deepcopy(getattr(self.state, f.name)) for f in dataclasses.fields(self.state)}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (config validated again; the snapshot is cleared).

        Raises:
            ValueError: unknown or missing keys (a key added since, such as ``nonfinite_streak``, may be missing
            from an older run's state: it starts at its default).
        """
        self.config = self.check_state_dict(state_dict)
        self.state = GuardState(**copy.deepcopy(state_dict["state"]))
        self.snapshot = None

    @staticmethod
    def check_state_dict(state_dict: dict[str, Any]) -> GuardConfig:
        """The config of a :meth:`state_dict` output, after checking its keys (what :meth:`load_state_dict` refuses,
        refused here without loading: a checkpoint load calls it before anything of the engine changes)."""
        want = {f.name for f in dataclasses.fields(GuardState)}
        got = set(state_dict.get("state", {}))
        if not got <= want or want - got - _ADDED_SINCE:
            raise ValueError(f"Guard.load_state_dict: state keys {sorted(got)} do not match {sorted(want)}; "
                             "pass the output of Guard.state_dict()")
        return GuardConfig(**state_dict["config"])

    def __repr__(self) -> str:
        return f"Guard({self.config})"
