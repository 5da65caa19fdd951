"""``MixedPrecision(policy="auto")`` decided on the model, at its first training forward.

The engine has the model at build but no batch. Where ``auto`` has more than one candidate
(:func:`mixprec.policy.resolve.auto_candidates`: fp32 and bf16-mixed, or fp16-mixed on CUDA/MPS without
native bf16), the engine builds as **fp32**, the storage of every candidate (``-mixed`` policies keep
fp32 params; only frozen params' storage differs, which ``set_policy`` re-prepares), with the decision
``auto: pending — timed on this model at its first forward``. A forward pre-hook on ``mp.model`` then,
at the first forward with grad enabled (not under ``torch.no_grad()``/``inference_mode``):

1. times the candidates on that forward's own arguments (:func:`mixprec.auto.trial.choose`, on
   ``mp.module``: eager, with the engine's hooks; the model is left as found, the result cached);
2. when a 16-bit candidate wins, calls ``mp.set_policy(...)`` before that forward runs, so the first
   step already runs the chosen policy; an ``mp.autocast()`` block entered while pending turns autocast
   on (and portable ops, and the compile settings) for the rest of the block: the hook enters them into
   the block's :class:`contextlib.ExitStack`, which the block's exit closes;
3. records the decision: ``mp.decision`` says what was measured, and an ``"auto"`` event is appended
   to ``mp.events``.

If ``mp.backward()`` comes while still pending (no training forward went through ``mp.model``), the
matmul probe's rule decides instead, applied at the next step boundary (``set_policy``), with one warning.
An explicit ``set_policy`` to another policy (a loaded checkpoint's, say) ends the pending decision.
A state loaded while pending (``mp.load_state_dict``, ``mixprec.load_checkpoint``) whose run took its own
``auto`` decision (an ``"auto"`` event) ends it too: the engine continues under the saved policy, adopted
(as ``mixprec train --resume`` does), and ``mp.decision`` says so; a state of another policy without that
event is refused naming the pending decision (:func:`pending_note`), unless ``convert``/``adopt_policy``.

Decided at build by the matmul probe instead (the decision says why): under ``strategy="ddp"``/
``"fsdp2"`` (every rank runs rank 0's probe choice; FSDP2 cannot re-prepare at all; to decide on the
model, pass ``mixprec.resolve_policy("auto", device, model=..., example_batch=...)`` as the policy)
and for a model compiled in place with ``model.compile()`` (its hooks run inside the compiled call).
Under ``compile=True`` (or a ``torch.compile``'d model) the hook is on the compiled wrapper and runs
eagerly: the trial times the eager model, and the first compilation happens after the decision, under
the chosen policy. Not supported: the first training forward calling ``mp.model`` *inside* an activation
checkpoint (``mixprec.ops.checkpoint(mp.model, x)``) where a 16-bit candidate wins: the recompute runs under the
autocast state captured before the switch (fp32), so its backward raises ``CheckpointError``; checkpoint blocks
inside the model instead (the hook then runs before them), or decide first (``resolve_policy``).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from mixprec.auto.trial import TrialFailed, choose
from mixprec.autocast.compiled import eager_dtypes
from mixprec.machine.capability import probe
from mixprec.policy.resolve import Resolution, auto_candidates, resolve
from mixprec.autocast.op_plan import describe as describe_kernels
from mixprec.autocast.op_plan import planned_kernels
from mixprec.engine.records import Decision, Event
from mixprec.engine.feature import Feature
from mixprec.policy.policy import PRESETS, Policy
from mixprec.autocast.portable import describe as describe_ops
from mixprec.autocast.saved_dtype import describe as describe_saved
from mixprec.autocast.saved_dtype import saved_in_compute
from mixprec.autocast.portable import portable_ops
from mixprec.engine.protocol import Engine
from mixprec.messages.location import user_stacklevel

__all__ = ["resolve_for_engine", "PENDING", "PendingAuto", "pending_resolution", "adopted_decision", "pending_note"]

log = logging.getLogger("mixprec")

PENDING = "auto: pending — timed on this model at its first forward"


def pending_resolution(spec: Any, resolution: Resolution, *, strategy: str | None,
                       compiled_in_place: bool) -> tuple[Resolution, tuple[str, ...]]:
    """(the resolution to build with, the candidates to time at the first forward). No candidates: the
    decision is taken now (``spec`` is not ``"auto"``, one candidate only, or a case the module docstring
    names, whose reason is added to the decision)."""
    if not (isinstance(spec, str) and spec.strip().lower() == "auto"):
        return resolution, ()
    candidates = auto_candidates(probe(resolution.device))
    if len(candidates) < 2:
        return resolution, ()
    why = (f"under strategy={strategy!r} every rank runs rank 0's matmul-probe choice" if strategy is not None else
           "the model was compiled in place (model.compile()), so the engine cannot time it eagerly"
           if compiled_in_place else None)
    if why is not None:
        note = (f" ({why}; to decide on the model, pass policy=mixprec.resolve_policy('auto', device, model=..., "
                "example_batch=...))")
        return dataclasses.replace(resolution, decision=resolution.decision + note), ()
    decision = f"{PENDING} ({' vs '.join(candidates)}); fp32 until then"
    return Resolution(PRESETS["fp32"], resolution.device, decision), candidates


def adopted_decision(decision: str, policy: Policy | str, saved_policy: str, events: list | None, *,
                     convert: bool = False) -> str | None:
    """The decision line of an engine whose ``decision`` is still :data:`PENDING` (``policy``: its fp32 build) after
    it loads a state saved under ``saved_policy`` by a run that took its ``auto`` decision (an ``"auto"`` event
    in ``events``): it adopts the saved policy. None where it does not: not pending, the same policy, no such
    event, or ``convert`` (the caller asked for this engine's own policy)."""
    return _adopted(policy, saved_policy, events, convert=convert) if decision.startswith(PENDING) else None


def _adopted(policy: Policy | str, saved_policy: str, events: list | None, *, convert: bool) -> str | None:
    return None if convert or saved_policy == str(policy) else _as_loaded(saved_policy, events)


def pending_note(decision: str) -> str:
    """What a refusal adds after "the engine runs <policy>" where its ``decision`` is still :data:`PENDING`
    (else "")."""
    if not decision.startswith(PENDING):
        return ""
    return (" only until its policy='auto' decides (still pending: the candidates are timed at the first training "
            "forward; a state whose run took its auto decision is adopted)")


def _as_loaded(policy: str, events: list | None) -> str | None:
    """``policy as loaded: the saved run's decision (...)``, from the last ``"auto"`` event of ``events``; None
    without one."""
    decided = [e for e in events or [] if e.get("kind") == "auto"]
    if not decided:
        return None
    after = "" if decided[-1].get("to") in (None, policy) else f"; then the run switched to {policy}"
    return f"{policy} as loaded: the saved run's decision ({decided[-1].get('detail')}{after})"


def resolve_for_engine(spec: Any, device: Any, strategy: Any, *, strategy_name: str | None, allow_fallback: bool,
                       compiled_in_place: bool, loss_scale: Any) -> tuple[Resolution, PendingAuto]:
    """The engine's policy resolution: ``spec`` resolved on ``device``, agreed across ranks by ``strategy``
    (:mod:`mixprec.distributed.strategy`), and its :class:`PendingAuto` (``loss_scale``: the engine's
    override). Returns (the resolution to build with, the pending decision). No host sync but the probe's."""
    resolution = resolve(spec, device, allow_fallback=allow_fallback)
    resolution = strategy.agree_resolution(resolution, resolution.device)
    chosen, candidates = pending_resolution(spec, resolution, strategy=strategy_name,
                                            compiled_in_place=compiled_in_place)
    return chosen, PendingAuto(candidates, resolution, loss_scale)   # auto timed at the first forward


class PendingAuto(Feature):
    """The engine's pending ``auto`` (module docstring): ``state`` is ``"off"`` (nothing pending),
    ``"pending"``, ``"probe-at-boundary"`` (backward came first), ``"decided"`` or ``"cancelled"``.
    ``probe``: the matmul probe's resolution, the fallback. ``loss_scale``: the engine's override, if any.
    Holds the engine weakly; a copied model's hook (an EMA's deep copy) holds none."""

    def __init__(self, candidates: tuple[str, ...], probe: Resolution, loss_scale: Any = None) -> None:
        self.candidates, self.probe, self.loss_scale = candidates, probe, loss_scale
        self.state = "pending" if candidates else "off"
        self._ref: Any = None
        self._handle: Any = None
        self._blocks: list[ExitStack] = []
        self._running = False
        self._notes = ""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ref": None, "_handle": None, "_blocks": [], "state": "off"}

    def install(self, mp: Engine) -> None:
        """Register the pre-hook on ``mp.model`` (after the engine is built; nothing when not pending)."""
        if self.state != "pending":
            return
        self._ref = weakref.ref(mp)
        self._notes = mp.decision.split("fp32 until then", 1)[-1]   # the fp32 build's notes (storage, regions)
        self._handle = mp.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def remove(self) -> None:
        """Remove the hook (the engine is unwrapped, or the decision is taken)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @contextmanager
    def block(self) -> Iterator[None]:
        """Entered by ``mp.autocast()``: while pending, a stack the first forward's decision enters the
        chosen policy's autocast into, closed at the block's exit. No host sync."""
        if self.state != "pending":
            yield
            return
        with ExitStack() as stack:
            self._blocks.append(stack)
            try:
                yield
            finally:
                self._blocks.remove(stack)

    def _engine(self) -> Any:
        return None if self._ref is None else self._ref()

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        mp = self._engine()
        if (mp is None or self.state != "pending" or self._running or torch.compiler.is_compiling()
                or not torch.is_grad_enabled() or torch.is_inference_mode_enabled()):
            return
        self._running = True
        try:
            trial = choose(mp.module, args, kwargs, mp.device, self.candidates)
            choice, text = trial.choice, trial.decision(mp.device.type)
        except ValueError as err:   # an output with nothing to backpropagate: the probe decides
            choice, text = str(self.probe.policy), f"{self.probe.decision} (auto could not time the model: {err})"
        except (TrialFailed, RuntimeError) as err:   # a candidate failed on this model (a kernel missing in 16 bits,
            # a dtype check of the model's own, any exception type): fp32
            what = str(err) if isinstance(err, TrialFailed) else f"{type(err).__name__}: {err}"
            choice, text = "fp32", (f"auto → fp32: the trial failed on this model ({what[:200]}); "
                                    "fp32 is what it runs as built")
        finally:
            self._running = False
        choice = mp.agree_on(choice, self.candidates)
        self._decide(mp, choice, text, "auto: timed on this model at its first forward")

    def before_backward(self, first: bool) -> None:
        """Called by ``mp.backward()``: still pending means no training forward went through ``mp.model``;
        the probe's choice then applies from the next boundary (one warning)."""
        if self.state != "pending":
            return
        self.state = "probe-at-boundary"
        self.remove()
        warnings.warn(f"mixprec: policy='auto' was still pending at mp.backward(): no training forward went through "
                      f"mp.model, whose first one times the candidates on the model. This boundary trains in fp32; "
                      f"from the next one the matmul probe's choice applies ({self.probe.policy}). Call the model as "
                      "mp.model(...) for auto to decide on it", stacklevel=user_stacklevel())

    def at_boundary(self, mp: Engine) -> None:
        """Called at the end of each step boundary: applies the probe's choice after :meth:`before_backward`."""
        if self.state == "probe-at-boundary":
            self._decide(mp, str(self.probe.policy), f"{self.probe.decision} (auto fell back to the matmul probe: "
                         "mp.backward() came before any training forward of mp.model)",
                         "auto: matmul probe (no forward through mp.model before backward)")

    def cancel(self, current: Policy, new: Policy) -> None:
        """Called by ``set_policy`` from ``current``: switching to another policy than the pending fp32 ends the
        decision."""
        if self.state in ("pending", "probe-at-boundary") and new != current:
            self.state = "cancelled"
            self.remove()

    def adopts(self, policy: Policy, state: dict[str, Any], *, convert: bool) -> str | None:
        """Called before a ``state`` is loaded into the engine of ``policy``: while pending, a state of another
        policy whose run took its ``auto`` decision continues under that policy, adopted (the load's
        ``set_policy`` ends the pending decision); :func:`adopted_decision`. Returns the engine's decision line
        for after the load then, else None."""
        if self.state not in ("pending", "probe-at-boundary"):
            return None
        return _adopted(policy, state["policy"], state.get("events"), convert=convert)

    def after_load(self, policy: Policy, events: list[Event] | list[dict] | None) -> str | None:
        """Called after a state of the pending ``policy`` (fp32) was loaded: when the saved run had taken its
        ``auto`` decision (an ``"auto"`` event), the continued run keeps it instead of timing again. Returns
        the engine's new decision line then, else None."""
        line = _as_loaded(str(policy), events)
        if not (self.state in ("pending", "probe-at-boundary") and line):
            return None
        self.state = "cancelled"
        self.remove()
        return line

    def _decide(self, mp: Engine, choice: str, text: str, cause: str) -> None:
        self.state = "decided"
        self.remove()
        before = str(mp.policy)
        if PRESETS[choice] != mp.policy:
            mp.set_policy(choice, cause=cause, loss_scale=self.loss_scale, record=False)
            notes = mp.decision.split(f"; was {before})", 1)[-1]   # set_policy's notes: compile, regions
            policy = mp.policy
            for stack in self._blocks[-1:]:   # the innermost mp.autocast() block around this forward
                stack.enter_context(torch.autocast(mp.device.type, dtype=policy.compute_dtype, enabled=policy.is_mixed))
                stack.enter_context(portable_ops(mp.device.type, enabled=policy.ops == "portable"))
                stack.enter_context(eager_dtypes(policy))
                stack.enter_context(planned_kernels(mp.device.type, enabled=policy.kernels == "measured"))
                stack.enter_context(saved_in_compute(mp.device.type, enabled=policy.saved in ("compute", "rebuild")))
            if mp.guard is not None and hasattr(mp.guard, "take_snapshot"):
                mp.guard.take_snapshot(mp)   # its snapshot holds the fp32 build
            decision = Decision(text, (describe_ops(policy.ops, mp.device.type, mixed=policy.is_mixed),
                                       describe_saved(policy.saved, mp.device.type, compute_dtype=policy.compute_dtype,
                                                      ops=policy.ops),
                                       describe_kernels(policy, mp.device.type),
                                       f"; the fp32 build re-prepared as {choice} (set_policy) before the first step",
                                       notes))
        else:
            decision = Decision(text, (self._notes,))
        mp.record(Event(step=mp.boundaries, kind="auto", cause=cause, module=None, detail=text, from_policy=before,
                        to_policy=choice), decision=str(decision))
        log.info("mixprec: %s", mp.decision)
