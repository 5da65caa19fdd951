"""The training-step engine ``MixedPrecision``: one object owns the step, in phases (docs/engine.md), with its features
behind one interface (:mod:`mixprec.engine.feature`); collaborators return what it assigns (docs/architecture.md).
Its base classes hold the public methods that assign nothing: the read-only views (:mod:`mixprec.engine.views`),
the frozen set's (:mod:`mixprec.engine.frozen_control`), the gradient-penalty pair (:mod:`mixprec.engine.penalty`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from mixprec.engine.autocast_scope import AutocastScope
from mixprec.engine.boundary import AccumulationGroup, BoundaryLosses, StepCheck, StepResult, check_grads
from mixprec.engine.clipping import clip_ as _clip_
from mixprec.engine.construction import built_in_features, first_decision, resolve_arguments
from mixprec.engine.divergence import DivergenceError, Judging
from mixprec.engine.feature import Feature
from mixprec.engine.frozen_control import FrozenControl
from mixprec.engine.loss_scale import for_policy as loss_scale_for_policy
from mixprec.engine.masters import best_fp32_values
from mixprec.engine.misuse.arguments import as_tensors, cast_batch, check_args, check_loss
from mixprec.engine.misuse.loop_checks import LoopChecks
from mixprec.engine.open_group import restore_group
from mixprec.engine.ownership import disown, handed_over, own
from mixprec.engine.param_groups import GroupWatch
from mixprec.engine.penalty import PenaltyGradients
from mixprec.engine.preparation.attach import bind_optimizer
from mixprec.engine.preparation.edits import ModelLayout, adopt_edited_params, adopt_model_edits, finish_model_edit
from mixprec.engine.preparation.prepare import prepare
from mixprec.engine.preparation.swaps import revert_engine_swaps
from mixprec.engine.preparation.undo import undone_on_failure
from mixprec.engine.preparation.reprepare import load_engine_state
from mixprec.engine.preparation.switch import switch_policy
from mixprec.engine.records import Event
from mixprec.engine.regions import Regions
from mixprec.engine.saved_state import check_engine_state, engine_state
from mixprec.engine.step_state import Phase, check_attach, check_call, check_open
from mixprec.engine.views import EngineViews
from mixprec.optim import contract
from mixprec.policy.policy import Policy, cast_floating

__all__ = ["MixedPrecision", "StepCheck", "StepResult", "DivergenceError", "cast_floating"]

log = logging.getLogger("mixprec")


class MixedPrecision(EngineViews, FrozenControl, PenaltyGradients):
    """Train ``model`` with ``optimizer`` under a precision policy: one object owns autocast, loss scaling, fp32
    masters, the optimizer-precision contract and the step lifecycle, in phases (docs/engine.md): prepare
    ``model`` (fp32 params, cast in place), :meth:`attach` ``optimizer`` (None: an evaluation engine) and
    ``scheduler`` (steps once per *applied* step), then per boundary :meth:`unscale_and_check` and
    :meth:`apply_or_skip` (:meth:`step` does both). ``policy``: ``"auto"`` (:mod:`mixprec.auto.pending`),
    a preset, ``key=value`` text or a :class:`~mixprec.Policy`; ``max_grad_norm`` clips the unscaled fp32 norm;
    ``guard`` has ``after_step(mp, result)`` (:class:`mixprec.Guard`; default :class:`~mixprec.engine.divergence.
    StopWhenStuck`); ``strategy``: None, ``"ddp"``, ``"fsdp2"``; ``compile``: True or ``torch.compile`` kwargs;
    ``recompute``: blocks recomputed in backward, ``"auto"`` or names (:mod:`mixprec.memory.recompute`; old name
    ``checkpoint``, deprecated); ``memory_budget``: ``"4GiB"`` or bytes the measured attention may spend on speed
    (:mod:`mixprec.engine.memory_budget`). Public attributes: ``model`` (what to call), ``module`` (the user's
    model), ``optimizer``, ``scheduler``, ``policy``, ``device``, ``strategy``, ``decision``, ``events``,
    ``masters``, ``loss_scale``, ``applied_steps``, ``skipped_total``, ``boundaries``, ``micro_step``. Errors:
    ValueError/TypeError for bad arguments (named, with the fix), RuntimeError for a call out of order."""

    #: A subclass's own features: each ``make(mp)`` a :class:`~mixprec.engine.feature.Feature`, after the built-in ones.
    feature_types: ClassVar[tuple[Callable[[Any], Feature], ...]] = ()

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, policy: str | Policy = "auto", *,
                 device: str | torch.device | None = None, scheduler: Any = None,
                 max_grad_norm: float | None = None, accumulation_steps: int = 1, loss_scale: Any = None,
                 allow_fallback: bool = False, max_stuck_skips: int = 20, guard: Any = None,
                 strategy: str | None = None, compile: bool | dict[str, Any] = False, recompute: Any = None,
                 memory_budget: str | int | None = None, checkpoint: Any = None) -> None:
        recompute = check_args(model, max_grad_norm, accumulation_steps, recompute, checkpoint, guard)
        model, budget, self._compile, self._strategy, resolution, self._auto = resolve_arguments(
            self, model, optimizer, scheduler, policy, device=device, strategy=strategy, compile=compile,
            allow_fallback=allow_fallback, loss_scale=loss_scale, memory_budget=memory_budget)   # before any change
        self.policy, self.device = resolution.policy, resolution.device   # Policy, torch.device
        self.model = self.module = model
        self.strategy, self.guard, self.optimizer, self.scheduler = strategy, guard, None, None   # attach(): the last two
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulation_steps, self.max_stuck_skips = accumulation_steps, max_stuck_skips
        self._judging = Judging(accumulation_steps, max_stuck_skips)   # the guard's call, what it is shown
        self.events: list[Event] = []
        self._regions, self._unwrapped, self._groups = Regions(), False, GroupWatch()
        self.loss_scale = loss_scale_for_policy(self.policy, loss_scale, self.device)
        with undone_on_failure(self, model, optimizer) as undo:   # a failed build leaves model, optimizer as they were
            prepared = undo.track(prepare(model, self.policy, self.device, self._strategy, optimizer=optimizer))
            self.fp8_report, self.block_report = prepared.fp8_report, prepared.block_report   # the linears swapped at build
            self._frozen, self.masters = prepared.frozen, prepared.masters
            self._frozen.store(prepared.plan)
            self._kahan_from = prepared.kahan_from   # for attach()
            self._scope = AutocastScope(self)   # mp.autocast()'s settings in backward passes and traced graphs
            self._checks = LoopChecks(self, self._adopt_model_edits, self._frozen, self._scope)
            state_note = "" if optimizer is None else self._attach(optimizer, scheduler)
            own(self, model, set(prepared.plan.half))   # one live engine per model (engine/ownership.py)
            regions = self._regions.wrap(model, self.policy, self.device.type, prepared.keep, set(prepared.plan.frozen16))
            self.decision = first_decision(resolution.decision, prepared, self._compile, self.policy, self.device.type,
                                           state_note, regions)
            self._sums, self._features = built_in_features(self, recompute, self._strategy, self._scope, self._checks,
                                                           self._auto, budget, self._regions, self._groups,
                                                           self.feature_types)
            self.decision += self._features.note
            self.model = self._compile.apply(self._strategy.after_casts(model, self.policy, self.device))
            self.masters.record_versions()   # DDP's broadcast of rank 0's params is not a user edit
            # micro_step: backward() calls since the last boundary; boundaries: step() boundaries (applied + skipped)
            self.micro_step = self.applied_steps = self.skipped_total = self.boundaries = 0
            self._losses, self._group = BoundaryLosses(), AccumulationGroup(accumulation_steps)
            self._phase, self._open_check = Phase.IDLE, None   # engine/step_state.py; the StepCheck apply_or_skip() takes
            self._layout = None if self._strategy.shards_params else ModelLayout(model)   # FSDP2 swaps params itself
            self._set_gradient_sync()
            self._features.install(self)
        log.info("mixprec: %s", self.decision)

    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Attach ``optimizer`` (built on ``model.parameters()``, before or after the engine; rebound to the fp32
        masters under ``-pure``) and ``scheduler`` (steps once per applied step) to an engine built with
        ``optimizer=None`` (``MixedPrecision(model, optimizer)`` calls it); checks its precision contract, lays out
        its state. No host sync. TypeError/ValueError as the constructor; RuntimeError if one is attached."""
        check_attach(self.optimizer)
        self.decision += self._attach(optimizer, scheduler)

    def _attach(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> str:
        bind_optimizer(self, optimizer, scheduler, self._strategy, self._frozen)   # checked; rebound to the masters
        state_note = contract.configure(optimizer, self.policy)   # how 8-bit state lays out ("" else)
        state_note += self._groups.attach(self, optimizer, list(self._kahan_from), self._frozen, self._regions)
        self._kahan_from, self.optimizer, self.scheduler = (), optimizer, scheduler
        self._checks.watch(optimizer)
        return state_note

    # ------------------------------------------------------------------ the step
    @contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` in the compute dtype (off for fp32), the ``ops`` and ``kernels`` the policy names
        (:mod:`mixprec.autocast`; held in every backward pass of its outputs) and eager dtypes for a compiled
        forward; traced by torch.compile with no graph break (:mod:`mixprec.engine.autocast_scope`)."""
        self._check("mp.autocast()")   # auto pending: may switch autocast on
        block = self._auto.block() if self._auto.state == "pending" else None   # auto's first training forward
        with self._scope.autocast(block), self._features.scope():
            yield

    def cast_inputs(self, batch: Any, *, keep: tuple[str, ...] = ()) -> Any:
        """``batch`` moved to the device, floating tensors cast to the param dtype (numpy becomes tensors;
        containers as :mod:`mixprec.policy.tree`; the caller's batch unchanged). ``keep``: top-level keys, fields
        or indices moved only (ValueError if absent); a float field that looks like a target is warned about
        once. Kept until the boundary with a guard (:attr:`step_batches`). No host sync."""
        batch = as_tensors(batch)
        self._checks.check_cast(batch, self.policy.param_dtype, keep)
        batch = cast_batch(batch, self.policy.param_dtype, self.device, keep)
        self._judging.keep(batch, self.guard)
        return batch

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, inputs: Any = None, join: bool = False) -> None:
        """Scale ``loss``, divide by ``accumulation_steps``, backpropagate (``retain_graph``, ``inputs`` as ``Tensor.
        backward``); the call after ``retain_graph=True``, or with ``join=True`` (a trainer dividing the loss by its own
        accumulation count: Lightning), adds into the micro-batch in progress; ``-pure``: grads into the masters';
        inputs' ``.grad`` keep the scale (docs/loops.md). No host sync. ValueError for a loss not a scalar floating
        tensor requiring grad; RuntimeError: more micro-batches than ``accumulation_steps``, a frozen param thawed."""
        check_loss(loss)
        self._check("mp.backward()")
        self._frozen.check_not_thawed()
        new_micro_batch = self._group.opens(self._phase, self.micro_step, join=join, strategy=self.strategy)
        first = new_micro_batch and self.micro_step == 0   # the accumulation group's first micro-batch
        if first:
            self._adopt_model_edits()
        self._features.before_backward(first)   # loop checks; 16-bit grads so far into fp32 sums; a pending auto
        self.micro_step += new_micro_batch   # a group's first: BETWEEN until the backward returns (then PENDING)
        self._phase = Phase.BETWEEN if new_micro_batch and self._phase is Phase.IDLE else self._phase
        self._losses.add(loss.detach(), first=first)
        loss = self._group.per_micro_batch(loss)
        with self._scope.op_lists(), self._features.scope():   # a checkpoint's recompute casts as the forward did
            self._scope.hold(self.loss_scale.scale_loss(loss)).backward(retain_graph=retain_graph, inputs=inputs)
        self._phase = Phase.RETAINED if retain_graph else Phase.PENDING
        self.masters.accumulate_grads()
        self._features.after_backward()

    def step(self, *, end_group: bool = False) -> StepResult | None:
        """Finish a micro-batch: None between boundaries, at one ``apply_or_skip(unscale_and_check())``;
        ``end_group=True`` ends a short group here (an epoch's last; :class:`~mixprec.engine.boundary.
        AccumulationGroup`). Host syncs: one per boundary, one per param edited outside. Raises RuntimeError
        without a ``backward()``; the guard may raise :class:`DivergenceError`."""
        self._check("mp.step()")
        if not self._group.closes("step()", self._phase.awaits_step, self.micro_step, end_group=end_group,
                                  strategy=self.strategy):
            self._phase = Phase.BETWEEN
            self._set_gradient_sync()
            return None
        return self.apply_or_skip(self.unscale_and_check(end_group=True))

    def end_group_next(self) -> None:
        """The next micro-batch ends the accumulation group: call after the previous ``mp.step()``, before its
        forward (under ``strategy="ddp"``/``"fsdp2"`` its backward then reduces gradients); ``mp.step()`` after
        it returns the group's result. No host sync. RuntimeError while a ``backward()`` awaits its step."""
        self._check("mp.end_group_next()")
        self._group.end_after_next()
        self._set_gradient_sync()

    def unscale_and_check(self, *, end_group: bool = False) -> StepCheck:
        """A boundary's first phase: adopt params edited outside, unscale the grads in place (fp32 on the params
        or ``-pure``'s masters, for the caller to log or clip from here on; a group of k < ``accumulation_steps``
        ended by ``end_group=True`` or :meth:`end_group_next`: their mean), their fp32 norm (by the scaled norm
        if it overflowed), the ranks' agreement, the one host read. Returns the :class:`StepCheck` for
        :meth:`apply_or_skip`. RuntimeError without ``backward()``, before the boundary or twice."""
        self._check("mp.unscale_and_check()")
        self._group.check_closes(self._phase.awaits_step, self.micro_step, end_group=end_group, strategy=self.strategy)
        self._phase = Phase.BETWEEN
        adopt_edited_params(self)
        self._losses.close(self.micro_step)
        grads = self._strategy.local(self._checks.boundary_grads(self._sums.close))   # fp32 sums rounded into grads
        found_inf = self._losses.unscale_(self.loss_scale, grads, self._group.factor(self.micro_step))
        self._open_check = check_grads(grads, found_inf, self._losses.finite, self.loss_scale, self._strategy,
                                       self.device)
        self._phase = Phase.CHECKED
        return self._open_check

    def apply_or_skip(self, check: StepCheck) -> StepResult:
        """The second phase, on what :meth:`unscale_and_check` just returned: clip (``max_grad_norm``), step the
        optimizer and scheduler or skip, update the loss scale, masters into the params, grads zeroed, guard.
        No host sync (but the guard's). RuntimeError for any other ``check``."""
        check_open(check, self._open_check)
        self._open_check, self._phase, grads, applied = None, Phase.BETWEEN, list(check.grads), not check.skipped
        _clip_(grads, check.grad_norm_t, self.max_grad_norm)   # None: no clipping
        if applied:
            self._apply_update()
        self.skipped_total += not applied
        if check.loss_finite:  # a non-finite *loss* is a data/forward fault: the scale is not to blame
            self.loss_scale.update(check.found_inf_t)
        self.micro_step, self.boundaries = 0, self.boundaries + 1
        self._set_gradient_sync()
        result = StepResult.of(check, step=self.applied_steps, skipped_total=self.skipped_total,
                               scaling=self.loss_scale.enabled)
        self._judging.grads = grads
        self.discard_gradients()
        self._features.at_boundary(self)   # auto decided; kernels agreed; recompute, budget measured
        return self._judging.judge(self, self.guard, result)

    def _apply_update(self) -> None:
        with self._checks.stepping():
            self.optimizer.step()
        self.applied_steps += 1
        if self.scheduler is not None:
            self.scheduler.step()
        self.masters.copy_to_params()
        torch.clear_autocast_cache()   # else a later forward in the same autocast region uses stale casts

    def agree_on(self, choice: str | None, choices: tuple[str, ...]) -> str | None:
        """The first of ``choices`` any rank chose (None if none; ValueError for another ``choice``): one process,
        ``choice``; else one all-reduce every rank calls at the same point, one sync (the guard's, each boundary)."""
        return self._strategy.agree_on(choice, choices, self.device)

    # ------------------------------------------------------------ changing the policy (the frozen set: frozen_control.py)
    def set_policy(self, policy: str | Policy, *, cause: str = "requested", module: str | None = None,
                   loss_scale: Any = None, record: bool = True, kind: str = "set_policy") -> Event:
        """Re-prepare the model under ``policy`` at a boundary through :func:`~mixprec.engine.preparation.prepare.prepare`,
        keeping the training state (the loss scale is ``loss_scale`` if given, else kept when both policies
        name the same scaling). Returns the :class:`~mixprec.engine.records.Event` of ``kind`` (the guard's:
        ``"escalate"``), recorded when ``record``. No host sync. RuntimeError mid-accumulation; ValueError
        (nothing changed) when the device, optimizer or strategy cannot run ``policy``, or it changes fp8."""
        self._check("set_policy()")
        self._groups.refresh(self)   # params unfrozen or a group added since: adopted first
        switch = switch_policy(self, policy, cause=cause, module=module, loss_scale=loss_scale, kind=kind,
                               strategy=self._strategy, frozen=self._frozen, auto=self._auto, regions=self._regions,
                               compiled=self._compile)
        self.policy, self.masters, self._kahan_from = switch.policy, switch.masters, switch.kahan_from
        self.loss_scale = switch.loss_scale
        self.decision = switch.decision + self._features.note   # the features' clauses now
        self.events.extend([switch.event] if record else [])
        (log.warning if switch.policy != switch.old else log.info)("mixprec: policy %s → %s at boundary %d (%s)",
                                                                   switch.old, switch.policy, self.boundaries, cause)
        return switch.event

    def unwrap(self, *, to_fp32: bool = False) -> nn.Module:
        """Remove the engine's hooks and swaps (:func:`revert_engine_swaps`), return the user's model; the engine is finished.
        ``to_fp32=True``: each floating param becomes fp32 in place with its best value (master, else param + Kahan sum), for
        fp32 inference or export; ValueError under a strategy, RuntimeError mid-accumulation. No host sync but adoptions'."""
        if to_fp32:
            self._strategy.refuse("to_fp32")
            self._check("unwrap(to_fp32=True)")
            adopt_edited_params(self)
            self.masters.write_fp32(best_fp32_values(self.masters, self.optimizer))
        self._features.remove()
        revert_engine_swaps(self.module, sharded=self._strategy.shards_params)
        disown(self)
        self._unwrapped = True
        return self.module

    # ------------------------------------------------------------ state (the read-only views: views.py)
    def state_dict(self) -> dict[str, Any]:
        """Everything to continue bit-exactly: policy, frozen set, model, masters, optimizer, scheduler, loss scale,
        counters (references), the open window mid-accumulation (:mod:`mixprec.engine.open_group`). RuntimeError mid-step."""
        self._check("mp.state_dict()")
        self._adopt_model_edits()
        adopt_edited_params(self)
        return engine_state(self, self._features, self._phase, self._group.end_next, self._losses, self._sums)

    def load_state_dict(self, state: dict[str, Any], *, convert: bool = False, adopt_policy: bool = False) -> None:
        """Restore a :meth:`state_dict` exactly (its ``"events"``, as checkpoints carry, replace :attr:`events`).
        Another policy's needs ``convert=True`` (to this policy, a ``"convert"`` event) or ``adopt_policy=True``
        (:func:`mixprec.engine.preparation.reprepare.load_engine_state`); ``auto`` still pending adopts a run that took its
        auto decision. ValueError, before anything changes, without either, for other masters or loss-scale type,
        an unmatched frozen set or unfit fp16 values."""
        self._features.check(check_engine_state(state))   # before anything changes
        self.decision = load_engine_state(self, state, self._auto, convert=convert, adopt_policy=adopt_policy) or self.decision
        self._features.load(state)   # the saved recompute plan, budget decision, as they were: not re-measured

    def discard_gradients(self) -> None:
        """Drop an unfinished accumulation: every gradient (params and masters) and the pending micro-batches;
        the next ``backward()`` starts a boundary. No host sync."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True) if self._layout is None else self._layout.zero_grad()
        self._phase, self.micro_step, self._losses.extra_inf, self._group.end_next = Phase.IDLE, 0, None, False
        self._open_check = None   # a step checked and then discarded: apply_or_skip(check) refuses it
        self._set_gradient_sync()

    def restore_progress(self, counters: dict[str, int], events: list[dict] | None, open_group: Any = None) -> None:
        """Set a saved run's counters, event log (None: keep it) and open window (checked by ``check_group``)."""
        self._check("restore_progress()")
        self.applied_steps, self.skipped_total = counters["applied_steps"], counters["skipped_total"]
        self.boundaries = counters["boundaries"]
        if events is not None:   # with a DCP checkpoint's recompute plan and budget decision, as they were
            self.events[:] = [Event.of(e) for e in events]
            self._features.load({"events": events})
        if open_group:   # saved mid-accumulation: the window goes on; its gradients are this engine's own
            self.micro_step, self._phase, self._group.end_next = restore_group(self, open_group, self._losses, self._sums)
            self._checks.after_backward()

    def record(self, event: Event | dict, *, decision: str | None = None) -> None:
        """Append ``event`` (an :class:`~mixprec.engine.records.Event` or its JSON dict) to :attr:`events`: what a
        guard, a loop check or auto did to the run; ``decision``: the new :attr:`decision` (auto's). No host sync."""
        self.events.append(Event.of(event))
        self.decision = self.decision if decision is None else decision

    # ------------------------------------------------------------------ internals
    def _set_gradient_sync(self) -> None:
        self._strategy.set_gradient_sync(self.model, last_micro_batch=self._group.last_micro_batch(self.micro_step),
                                         has_masters=bool(self.masters.pairs) or self._sums.reduces_each())

    def _adopt_model_edits(self) -> None:
        self._groups.refresh(self)   # params unfrozen or a group added mid-run (engine/param_groups.py)
        adopted = adopt_model_edits(self._layout, self.policy, self.strategy, self.micro_step, self.optimizer,
                                    self.masters, self._frozen, self.module)
        if adopted is not None:
            self.masters = adopted[1]
            finish_model_edit(self, adopted[0], self._layout)

    def _check(self, call: str) -> None:   # the step's state table (engine/step_state.py): RuntimeError out of order
        check_call(call, self._phase, self.micro_step, evaluation=self.optimizer is None, unwrapped=handed_over(self, self._unwrapped))
