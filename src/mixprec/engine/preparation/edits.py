"""A model edited after the engine was built: detected before the next forward or backward, adopted.

Edits seen: a parameter replaced (``module.weight = nn.Parameter(...)``), a layer replaced or added
(transformers' ``resize_token_embeddings`` builds a new embedding; a new head), a parameter removed,
and a parameter whose ``.data`` changed shape. :meth:`ModelLayout.rebind` points the optimizer at the
model's current parameters — a new parameter takes the optimizer slot (param group, no state) of the
removed one of the same name; a new name joins the optimizer's only param group, or the one group the
removed parameters shared — and returns masters for that layout, so the engine can re-prepare every
parameter under its policy (:func:`mixprec.engine.preparation.prepare.prepare`: casts, fresh fp32 masters from the new
values, regions for new modules). Without it, a 16-bit parameter with no master silently never trains,
or a master of the old shape crashes the copy back.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from mixprec.engine.masters import MasterWeights
from mixprec.engine.storage import FrozenParams
from mixprec.policy.policy import Policy
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event
from mixprec.messages.location import user_stacklevel

__all__ = ["ModelEdit", "ModelLayout", "adopt_edited_params", "adopt_model_edits", "finish_model_edit",
           "edited_params_event"]


@dataclass(frozen=True)
class ModelEdit:
    """What changed since the layout was recorded, by parameter name."""

    removed: tuple[str, ...]
    added: tuple[str, ...]
    resized: tuple[str, ...]

    def text(self) -> str:
        parts = [f"{label} {list(names[:4])}{' ...' if len(names) > 4 else ''}"
                 for label, names in (("replaced or added", self.added), ("removed", self.removed),
                                      ("resized in place", self.resized)) if names]
        return "; ".join(parts)


_registrations = [0]   # parameters and modules registered anywhere in this process (torch's global hooks)


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    if getattr(_watch_registrations, "installed", False):
        return
    from torch.nn.modules import module as module_mod
    module_mod.register_module_parameter_registration_hook(_count_registration)
    module_mod.register_module_module_registration_hook(_count_registration)
    _watch_registrations.installed = True


class ModelLayout:
    """The parameters of ``model`` as the engine prepared them (objects and shapes), to tell an edit.

    :meth:`changed` is cheap: a parameter or module assigned anywhere goes through torch's global
    registration hooks (``register_module_parameter_registration_hook``, ``..._module_...``), which
    count; the model is walked only when the count moved, and the recorded params' shapes are compared
    (a ``.data`` of another shape). Removing a module with ``del`` is not a registration: it is seen at
    the next registration anywhere, or reported as a missing gradient meanwhile."""

    def __init__(self, model: nn.Module) -> None:
        _watch_registrations()
        self.model = model
        self.record()

    def record(self) -> None:
        self.named = list(self.model.named_parameters())
        self.params = [p for _, p in self.named]
        self.shapes = [p.shape for p in self.params]
        self.seen = _registrations[0]

    def changed(self) -> bool:
        """True when the model's parameters are not the recorded ones (no host sync)."""
        if [p.shape for p in self.params] != self.shapes:
            return True
        if self.seen == _registrations[0]:
            return False
        current = list(self.model.parameters())
        if len(current) == len(self.params) and all(p is q for p, q in zip(current, self.params)):
            self.seen = _registrations[0]   # something else was registered: this model is as it was
            return False
        return True

    def zero_grad(self) -> None:
        """``model.zero_grad(set_to_none=True)`` without walking the module tree, while no parameter or module
        was registered anywhere since the model was last seen holding the recorded params (they are its params
        then; a module removed with ``del`` alone is not seen, as in :meth:`changed`). No host sync."""
        if self.seen != _registrations[0]:
            self.model.zero_grad(set_to_none=True)
            return
        for p in self.params:
            if p.grad is not None:
                p.grad = None

    def edit(self) -> ModelEdit:
        """The edit, by name (an unchanged model gives an empty one)."""
        old = {id(p): n for n, p in self.named}
        now = {id(p) for p in self.model.parameters()}
        shape_of = {id(p): s for (_, p), s in zip(self.named, self.shapes)}
        current = list(self.model.named_parameters())
        return ModelEdit(removed=tuple(n for n, p in self.named if id(p) not in now),
                         added=tuple(n for n, p in current if id(p) not in old),
                         resized=tuple(n for n, p in current if id(p) in old and p.shape != shape_of[id(p)]))

    @torch.no_grad()
    def rebind(self, optimizer: torch.optim.Optimizer | None, masters: MasterWeights) -> MasterWeights:
        """Point ``optimizer`` at the model's current params (module docstring) and return masters for
        them: the kept pairs keep their fp32 masters, new and resized params are their own masters until
        the engine re-prepares. Optimizer state of removed and resized params is dropped (``optimizer``
        None: an evaluation engine, nothing to rebind).

        Raises:
            ValueError: a new parameter name, and the optimizer has several param groups none of which
                the removed params shared (nothing has changed then).
        """
        current = list(self.model.named_parameters())
        named_now = dict(current)
        edit = self.edit()
        stepped_of = {id(p): t for p, t in zip(masters.params, masters.masters)}
        param_groups = [] if optimizer is None else optimizer.param_groups
        where = {id(t): (gi, i) for gi, g in enumerate(param_groups) for i, t in enumerate(g["params"])}
        name_at = {where[id(stepped_of.get(id(p), p))]: n for n, p in self.named
                   if id(stepped_of.get(id(p), p)) in where}
        held = set(name_at.values())
        gone = set(edit.removed) | set(edit.resized)
        fresh = [n for n in edit.added if n not in held and named_now[n].requires_grad]
        groups = {gi for (gi, _), n in name_at.items() if n in gone}
        target = 0 if len(param_groups) == 1 else (groups.pop() if len(groups) == 1 else None)
        if fresh and target is None and optimizer is not None:
            raise ValueError(f"the model gained parameter(s) {fresh[:4]} after MixedPrecision was built, and the "
                             f"optimizer has {len(optimizer.param_groups)} param groups: which one trains them is "
                             "not clear. Add the layer before building MixedPrecision, or freeze it "
                             "(requires_grad_(False))")
        for gi, group in enumerate(param_groups):
            params = []
            for i, t in enumerate(group["params"]):
                n = name_at.get((gi, i))
                if n not in gone:
                    params.append(t)
                    continue
                optimizer.state.pop(t, None)         # the old tensor's moments do not fit the new one
                if n in named_now:                   # replaced or resized: the new one takes the slot
                    params.append(named_now[n])
            group["params"] = params + ([named_now[n] for n in fresh] if gi == target else [])
        resized = {id(named_now[n]) for n in edit.resized}
        return masters.with_params([p for _, p in current], {id(p) for p, _ in masters.pairs} - resized)



def adopt_model_edits(layout: ModelLayout | None, policy: Policy, strategy: str | None, micro_step: int,
                      optimizer: torch.optim.Optimizer | None, masters: MasterWeights, frozen: FrozenParams,
                      module: nn.Module) -> tuple[ModelEdit, MasterWeights] | None:
    """The first half of adopting an edit of ``module`` since ``layout`` was recorded (module docstring):
    the checks, ``optimizer`` rebound to the current params, ``frozen`` (the engine's) following the new
    ones. Returns the edit and the masters for the new layout, for the engine to assign and finish with
    :func:`finish_model_edit`; None for an unedited model (a Python walk over the params, no host sync)
    or without a ``layout`` (FSDP2, which swaps sharded and unsharded params around every forward).

    Raises:
        RuntimeError: the edit came mid-accumulation, under a multi-process strategy or an fp8 or block-scaled
            policy.
        ValueError: new parameter names and several param groups (:meth:`ModelLayout.rebind`).
    """
    if layout is None or not layout.changed():
        return None
    edit = layout.edit()
    if policy.fp8 is not None or policy.block is not None:
        kind = "an fp8" if policy.fp8 is not None else f"a block-scaled ({policy.block})"
        raise RuntimeError(f"the model was edited after MixedPrecision was built ({edit.text()}) under {kind} "
                           f"policy ({policy}): its linears were converted at build and a new layer would run in "
                           f"{str(policy.compute_dtype)[6:]} while the decision says otherwise; edit the model "
                           "before building MixedPrecision")
    if strategy is not None or micro_step != 0:
        raise RuntimeError(f"the model was edited after MixedPrecision was built ({edit.text()}) "
                           f"{'under strategy=' + repr(strategy) if strategy else 'mid-accumulation'}, "
                           "which the engine cannot adopt; edit it before building MixedPrecision")
    new_masters = layout.rebind(optimizer, masters)
    named = dict(module.named_parameters())
    frozen.follow([named[n] for n in edit.added])
    return edit, new_masters


def finish_model_edit(mp: Engine, edit: ModelEdit, layout: ModelLayout) -> None:
    """The second half, through ``mp``'s public methods once it holds the new masters: every param
    re-prepared under its policy (:meth:`mixprec.MixedPrecision.set_policy`), one ``model-edit`` event
    and one warning, the layout recorded, a guard re-snapshotted."""
    event = mp.set_policy(mp.policy, cause=f"model edited after build: {edit.text()}", record=False)
    mp.record(replace(event, kind="model-edit", detail=f"{edit.text()}; {event.detail}"))
    layout.record()
    if mp.guard is not None and hasattr(mp.guard, "take_snapshot"):
        mp.guard.take_snapshot(mp)   # the old snapshot holds the old layout: no rollback into it
    masters = ", with fresh fp32 masters from their values" if mp.policy.has_masters else ""
    warnings.warn(f"mixprec: the model was edited after MixedPrecision was built ({edit.text()}); adopted: new "
                  f"parameters are stored as {mp.policy} says{masters}, without optimizer state",
                  stacklevel=user_stacklevel())


def edited_params_event(step: int, detail: str) -> Event:
    """The ``adopt`` event of params written outside the engine whose masters adopted the new values
    (``detail``: :meth:`mixprec.engine.masters.MasterWeights.adopt_edits`' words), with its one warning."""
    warnings.warn(f"{detail}. To keep full fp32 precision, load weights before building MixedPrecision, "
                  "or with mixprec.load_checkpoint / mp.load_state_dict", stacklevel=user_stacklevel())
    return Event(step=step, kind="adopt", cause="params edited outside the optimizer", module=None, detail=detail)


def adopt_edited_params(mp: Engine) -> None:
    """Params of ``mp`` written outside the engine (16-bit ones with fp32 masters) keep the edit: their masters
    adopt the new value, with one warning and an ``adopt`` event (:meth:`Engine.record`), instead of being
    overwritten. Host syncs: :meth:`mixprec.engine.masters.MasterWeights.adopt_edits`' (one per param edited)."""
    detail = mp.masters.adopt_edits(lambda: {id(p): n for n, p in mp.module.named_parameters()})
    if detail:
        mp.record(edited_params_event(mp.boundaries, detail))
