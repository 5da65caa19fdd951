"""Checks on the user's training loop: the silent mistakes a loop makes around the engine, made loud.

Each check is cheap (Python loops over the parameters, no host sync) and speaks once:

* **foreign gradients**: gradients on the engine's parameters that its own ``backward()`` did not
  leave there (another engine's backward through this model, as a GAN's generator step leaves on the
  discriminator, or a ``loss.backward()`` called directly). Each ``backward()`` and ``step()`` compares
  the gradients with what its last ``backward()`` left (tensor and version counter): gradients on params
  it left without one are discarded, as ``optimizer.zero_grad()`` would (torch.amp's recipe zeroes at
  the top of each step), with a one-time warning and an event; at a boundary's first ``backward()``
  every gradient is foreign. Its own gradients that were *added to* between micro-batches (another
  engine's backward mid-accumulation, or an in-place edit) cannot be separated: RuntimeError naming the
  params and fixes; changed between the last ``backward()`` and ``step()`` (an in-place edit is a known
  practice there): one warning and an event.
* **gradients gone before the step**: a gradient the last ``backward()`` left is None at ``step()``:
  ``optimizer.zero_grad()``/``model.zero_grad()`` ran in between: RuntimeError (the step would apply
  part of the gradient).
* **a direct ``optimizer.step()``** between ``backward()`` and ``step()`` would apply scaled,
  unclipped gradients: RuntimeError from an optimizer step pre-hook.
* **missing gradients**: trainable parameters that got no gradient at a boundary are named once.
* **a training forward outside ``mp.autocast()``** under a ``-mixed`` policy runs in fp32: one warning.
* **a forward outside ``mp.autocast()`` with an fp32 input** under 16-bit params (``-pure``, ``-kahan``,
  ``-sr``, ``-lean``; evaluation included): one warning naming the fix before torch's dtype error.
* **a model cast after build** (``model.half()``, ``model.to(torch.bfloat16)``, ``model.float()`` under
  ``-pure``; an evaluation callback's line): the params' dtypes are compared with the ones the storage plan
  left (one Python pass over dtypes, no host sync). A training forward, ``backward()`` or the boundary
  refuses it by name (RuntimeError: the params, the dtype found and the one stored, the fix); an evaluation
  forward (no grad) runs on, with one warning. It is not restored: a 16-bit cast of fp32 values already
  dropped their low bits, so casting back could only upcast the rounded values.
* **a float field rounded by ``cast_inputs``** under 16-bit params (a regression target, say): one
  warning naming the field and the ``keep=`` fix.

The hooks drop their engine when copied or pickled (a deep copy of the model, as an EMA or a teacher
is made, must not report to the engine of the original).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
from torch import nn

from mixprec.engine.autocast_scope import AutocastScope
from mixprec.engine.misuse.cast_targets import TARGET_NAMES, keep_fields, suspected_targets
from mixprec.engine.feature import Feature, HeldEngine, held_method
from mixprec.engine.misuse.foreign_loops import at_backward
from mixprec.engine.misuse.outside import before_optimizer_step, stray_step_text, watch_autocast
from mixprec.engine.misuse.outside_autocast import outside_autocast
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event
from mixprec.engine.storage import FrozenParams
from mixprec.messages.location import user_stacklevel

__all__ = ["LoopChecks", "TARGET_NAMES"]


class _Hook:
    """A hook holding its checks weakly: the model and the optimizer never keep a dropped engine alive
    (nor its masters); a copied or pickled hook holds none."""

    def __init__(self, checks: LoopChecks | None) -> None:
        self._ref = None if checks is None else weakref.ref(checks)

    def __getstate__(self):
        return {"_ref": None}

    def checks(self) -> LoopChecks | None:
        return None if self._ref is None else self._ref()


class _ForwardHook(_Hook):
    """The root module's forward pre-hook: the engine's checks before each eager forward."""

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():   # first: dynamo then traces nothing else of it
            return
        checks = self.checks()
        if checks is not None:
            checks.before_forward(module, args)


class _OutputHook(_Hook):
    """The root module's forward hook: the outputs of each eager forward hold its op lists in their backward
    passes (:meth:`mixprec.engine.autocast_scope.AutocastScope.after_forward`)."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        checks = self.checks()
        if checks is not None and checks.scope is not None and module is checks.owner.module:
            checks.scope.after_forward(output)


class _StepHook(_Hook):
    """The optimizer's step pre-hook: refuses an ``optimizer.step()`` inside the engine's step."""

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        checks = self.checks()
        if checks is not None:
            checks.before_optimizer_step()


class LoopChecks(Feature):
    """The checks of one engine (module docstring): ``owner``, the engine (its public face); ``on_forward``
    is called before each eager forward of ``owner.module`` (model-edit detection); ``scope``, the engine's
    :class:`~mixprec.engine.autocast_scope.AutocastScope`, refreshes the cast cache before each eager forward
    and holds the op lists in the outputs' backward passes after it."""

    owner = HeldEngine()   # weakly: the engine owns this

    def __init__(self, owner: Engine, on_forward: Callable[[], None], frozen: FrozenParams,
                 scope: AutocastScope | None = None) -> None:
        self.owner, self.on_forward = owner, held_method(on_forward)
        self.frozen = frozen   # the stored dtypes too
        self.scope = scope
        self.applying = False          # True while the engine itself steps the optimizer
        self.marks: dict[int, tuple[int, int]] = {}
        self.reported_missing: set[int] = set()
        self.spoken: set[str] = set()
        self._handles: list[Any] = []
        self._tensors_key: tuple[int, ...] = ()
        self._tensors_list: list[torch.Tensor] = []

    def install(self, mp: Engine) -> None:
        """The model's forward pre-hook and forward hook, unless the policy is plain fp32 (no hook on the model
        then: no autocast, and an edit is found at ``backward()``)."""
        policy = self.owner.policy
        if policy.is_mixed or policy.param_dtype != torch.float32:
            self._add(self.owner.module.register_forward_pre_hook(_ForwardHook(self)))
            self._add(self.owner.module.register_forward_hook(_OutputHook(self)))
            for handle in watch_autocast(mp):   # someone else's autocast (engine/misuse/outside.py)
                self._add(handle)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """The step pre-hook of ``optimizer`` (the engine's, at ``mp.attach``)."""
        self._add(optimizer.register_step_pre_hook(_StepHook(self)))

    def _add(self, handle: Any) -> None:
        self._handles.append(handle)
        weakref.finalize(self, _remove_all, [handle])   # a dropped engine takes its hooks along

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Around the engine's own ``optimizer.step()``, which the step pre-hook lets through."""
        self.applying = True
        try:
            yield
        finally:
            self.applying = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---------------------------------------------------------------- hooks
    def before_forward(self, module: nn.Module, args: tuple = ()) -> None:
        if module is not self.owner.module:
            return
        self.on_forward()
        self.check_storage(training=torch.is_grad_enabled())
        if self.scope is not None:
            self.scope.refresh_casts()
        mp = self.owner
        if torch.is_autocast_enabled(mp.device.type):
            return
        said = outside_autocast(mp.policy, len(self.frozen.stored16), args, torch.is_grad_enabled())
        if said is not None:
            self._once(*said)

    def before_optimizer_step(self) -> None:
        mp = self.owner
        if not self.applying and mp.micro_step:
            raise RuntimeError(stray_step_text(mp))   # what the gradients are under this policy (engine/misuse/outside.py)
        before_optimizer_step(mp, engine_step=self.applying)   # someone else's loop or autocast (engine/misuse/outside.py)

    # ---------------------------------------------------------------- the step
    def _tensors(self) -> list[torch.Tensor]:
        """The engine's params and the tensors its optimizer steps, each once (params first). Rebuilt only
        when one of them is another object than last time (the key is their ids: one C-level pass)."""
        mp = self.owner
        every = [*mp.masters.params, *chain.from_iterable(g["params"] for g in mp.optimizer.param_groups)]
        key = tuple(map(id, every))
        if key != self._tensors_key:
            self._tensors_key, self._tensors_list = key, list({id(t): t for t in every}.values())
        return self._tensors_list

    def before_backward(self, first: bool) -> None:
        """Before each of the engine's ``backward()`` calls: at a boundary's first (``first``), discard every
        gradient on its params (none is its own); later, discard gradients on params it left without one,
        and refuse gradients it produced that changed since (another engine's backward added to them), or a
        model cast since it was stored."""
        at_backward(self.owner)   # a framework's accumulation, clipping or scheduler steps (engine/misuse/foreign_loops.py)
        self.check_storage(training=True)
        foreign, changed = self._foreign(everything=first)
        self._discard(foreign)
        if changed:
            self._refuse_changed(changed, "before the next micro-batch's backward()")

    def after_backward(self) -> None:
        """Remember each gradient this engine's backward left: the tensor and its version counter."""
        self.marks = {id(t): (id(g), getattr(g, "_version", 0)) for t in self._tensors() if (g := t.grad) is not None}

    def boundary_grads(self, close: Callable[[], Any] = lambda: None) -> list[torch.Tensor]:
        """The engine's gradients (``mp.gradients()``), after discarding foreign ones, raising if some it
        produced were zeroed or changed since its last backward(), then ``close`` (the window's fp32 sums
        rounded into the 16-bit grads: :mod:`mixprec.engine.grad_sums`), and naming (once) the trainable params
        that have none."""
        mp = self.owner
        self.check_storage(training=True)
        foreign, changed = self._foreign(everything=False)
        self._discard(foreign)
        marks = self.marks
        zeroed = [t for t in self._tensors() if t.grad is None and id(t) in marks]
        self.marks = {}
        if zeroed:
            names = self._names(zeroed)[:4]
            mp.discard_gradients()   # what is left of this step is discarded: the next backward() starts afresh
            raise RuntimeError(f"the gradients of {names} that mp.backward() produced are gone at mp.step(): "
                               "optimizer.zero_grad() or model.zero_grad() ran between them (this step's remaining "
                               "gradients were discarded). The engine zeroes gradients itself after every step; "
                               "remove that call")
        if changed:   # an in-place edit between backward() and step() is a known practice: said, not refused
            self._once("changed-grads", "changed-gradients",
                       f"the gradients of {self._names(changed)[:4]} changed between mp.backward() and mp.step() "
                       "outside this engine's backward(): edited in place (they are still multiplied by the loss "
                       "scale there), or another engine's backward() through this model added its gradients, "
                       "which this step now includes. Kept as they are; to keep another engine's backward off "
                       "these parameters, step this engine first or pass other_mp.backward(loss, inputs=...)")
        close()
        grads = mp.gradients()
        missing = [t for g in mp.optimizer.param_groups for t in g["params"] if t.grad is None and t.requires_grad
                   and id(t) not in self.reported_missing]
        if missing:   # the masters of params frozen by hand since are not missing
            frozen_masters = {id(m) for p, m in mp.masters.pairs if not p.requires_grad}
            missing = [t for t in missing if id(t) not in frozen_masters]
        if not missing:
            return grads
        self.reported_missing.update(id(t) for t in missing)   # named once (ids: no name walk per step)
        new = self._names(missing)
        detail = (f"{len(new)} trainable parameter(s) received no gradient at boundary {mp.boundaries} "
                  f"({', '.join(new[:5])}{', ...' if len(new) > 5 else ''}), so this step does not train them: "
                  "unused in the forward, detached (.detach(), .data, torch.no_grad()), or cut off by reentrant "
                  "activation checkpointing whose inputs do not require grad (use_reentrant=False fixes that). "
                  "Freeze them (requires_grad_(False) before building) if that is intended")
        self._event("missing-gradients", detail)
        warnings.warn(f"mixprec: {detail}", stacklevel=user_stacklevel())
        return grads

    def _foreign(self, *, everything: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(gradients this engine did not produce, its own gradients changed since) on its params."""
        marks = {} if everything else self.marks
        foreign, changed = [], []
        for t in self._tensors():
            g = t.grad
            if g is None:
                continue
            mark = marks.get(id(t))
            if mark is None:
                foreign.append(t)
            elif mark != (id(g), getattr(g, "_version", 0)):
                changed.append(t)
        return foreign, changed

    def _discard(self, foreign: list[torch.Tensor]) -> None:
        if not foreign:
            return
        names = self._names(foreign)
        for t in foreign:
            t.grad = None
        self._once("foreign-grads", "foreign-gradients",
                   f"gradients on {len(names)} parameter(s) of this engine ({', '.join(names[:4])}"
                   f"{', ...' if len(names) > 4 else ''}) were not produced by its backward(): another engine's "
                   "backward() through this model (a GAN's generator step reaches the discriminator), or a "
                   "loss.backward() called directly. They were discarded, as optimizer.zero_grad() at the top of "
                   "the step would; this engine's step uses only the gradients of its own backward() calls. To keep "
                   "them off (and save the work), pass the other engine's params: "
                   "other_mp.backward(loss, inputs=list(other_model.parameters()))")

    def _refuse_changed(self, changed: list[torch.Tensor], where: str) -> None:
        names = self._names(changed)[:4]
        self.marks = {}
        self.owner.discard_gradients()   # the accumulation cannot be separated: it is discarded
        raise RuntimeError(
            f"the gradients of {names} changed {where} outside this engine's backward() (this step's gradients were "
            "discarded): another "
            "engine's backward() through this model added to them mid-accumulation (a GAN generator's backward "
            "between two of the discriminator's micro-batches), or they were edited in place. The two cannot be "
            "told apart, so the step would be wrong. Step this engine's boundary before the other's backward(), or "
            "keep the other backward off these parameters: other_mp.backward(loss, inputs=list(other_model."
            "parameters())), or detach this model's output where the other loss uses it")

    def check_storage(self, *, training: bool) -> None:
        """Params cast since the engine stored them (module docstring): RuntimeError when ``training`` (the
        step's gradients discarded, so casting back and going on is clean), else one warning and an event."""
        recast = self.frozen.recast()
        if not recast:
            return
        mp = self.owner
        text = _cast_text(self._names([p for p, _ in recast]), recast, str(mp.policy), set(self.frozen.stored_dtypes))
        if training:
            mp.discard_gradients()
            raise RuntimeError(f"{text}. Refused (this step's gradients discarded): training on would step the cast "
                               "values with no fp32 copy under '-mixed' policies, or apart from their fp32 masters "
                               "under '-pure' ones")
        self._once("model-cast", "model-cast", f"{text}. This evaluation forward runs on the cast params; the next "
                   "training forward, backward() or step() refuses them until they are cast back")

    def check_cast(self, batch: Any, dtype: torch.dtype, keep: tuple) -> None:
        """Warn once when ``cast_inputs`` rounds a float field that may be a target (:mod:`mixprec.engine.misuse.
        cast_targets`) to a 16-bit ``dtype``."""
        if dtype == torch.float32:
            return
        suspects = suspected_targets(batch, keep_fields(keep))
        said = f"cast-target:{suspects!r}"   # once per set of fields: another field rounded later is said too
        if suspects and said not in self.spoken:
            self._once(said, "cast-target",
                       f"cast_inputs rounded the floating field(s) {suspects} to {str(dtype)[6:]} with the inputs "
                       f"(policy {self.owner.policy} stores parameters in 16 bits). If one is a target or a label "
                       f"that the loss compares in fp32, keep it: mp.cast_inputs(batch, keep={tuple(suspects)!r})")

    # ---------------------------------------------------------------- helpers
    def _names(self, tensors: list[torch.Tensor]) -> list[str]:
        mp = self.owner
        by_id = {}
        stepped_of = {id(p): t for p, t in zip(mp.masters.params, mp.masters.masters)}
        for n, p in mp.module.named_parameters():
            by_id.setdefault(id(p), n)
            by_id.setdefault(id(stepped_of.get(id(p), p)), n)
        return list(dict.fromkeys(by_id.get(id(t), "?") for t in tensors))

    def _event(self, kind: str, detail: str) -> None:
        mp = self.owner
        mp.record(Event(step=mp.boundaries, kind=kind, cause="training loop", module=None, detail=detail))

    def _once(self, key: str, kind: str, detail: str) -> None:
        if key in self.spoken:
            return
        self.spoken.add(key)
        self._event(kind, detail)
        warnings.warn(f"mixprec: {detail} (said once)", stacklevel=user_stacklevel())


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast_text(names: list[str], recast: list[tuple[torch.Tensor, torch.dtype]], policy: str,
               every: set[torch.dtype]) -> str:
    """What a cast model is told: the params, the dtypes found and stored, what was lost, the fix (a cast of
    the whole model when ``every`` param is stored in one dtype, else one per param)."""
    found = "/".join(sorted({_dtype(p.dtype) for p, _ in recast}))
    stored = sorted({d for _, d in recast}, key=str)
    back = ("model.float()" if every == {torch.float32} else f"model.to(torch.{_dtype(stored[0])})"
            if len(every) == 1 else "each param back to the dtype named here (p.data = p.data.to(dtype)); "
            "model-wide casts would break the params the policy stores in another dtype")
    lost = any(d == torch.float32 and p.dtype.itemsize < 4 for p, d in recast)
    return (f"{len(names)} parameter(s) of the model ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) are "
            f"{found} but {policy} stores them in {'/'.join(map(_dtype, stored))}: the model was cast after "
            "MixedPrecision was built (model.half(), model.to(dtype), model.float(): an evaluation callback's line?). "
            f"Cast them back before the next training step: {back}"
            + ("; the 16-bit cast already rounded their fp32 values, and casting back restores the dtype, not the "
               "lost low bits (training goes on from the rounded values)" if lost else "")
            + ". Do evaluation casts on a copy (copy.deepcopy(model).half()), or evaluate under mp.autocast() "
            "without casting")


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
