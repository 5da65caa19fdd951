"""One live engine per model: a second :class:`~mixprec.MixedPrecision` on a model another one prepared is refused.

An engine changes the model it is built on (casts, hooks, swapped linears) and the optimizer (rebound to fp32
masters under ``-pure`` policies); a second engine built on top would see the first one's changes as the user's
(its checks then blame a cast the user never made, or an optimizer "holding none of the model's parameters") and
both engines' hooks would run. So the build checks, before anything changes, that no live engine owns the model,
a module inside it or a module holding it, and names the way out: ``mp.set_policy(...)`` to change the policy,
``mp.unwrap()`` to release the model, or a fresh model and optimizer. An engine owns its model from its build to
its ``unwrap()``; the registry holds it weakly, so an engine dropped without ``unwrap()`` owns nothing once it is
collected: the next build removes the hooks it left (with a warning), but its params stay as it left them (16-bit
under ``-pure``): call ``unwrap()`` before dropping an engine whose model lives on. A ``copy.deepcopy`` of a
prepared model copies those changes too; build on a copy of the plain model instead.

The trainer integrations build their engine from a plugin or a Trainer object the user makes anew for each run
(``L.Trainer(plugins=[MixprecPrecision(...)]).test(model)`` after another Trainer's ``fit``): the earlier engine is
out of the user's reach there, so :func:`hand_over` unwraps it first (its fp32 values restored where it stored
16-bit params), with a warning, and returns the note the new engine records.
"""

from __future__ import annotations

import gc
import types
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from mixprec.blockscale.swap import HOOK_DICTS
from mixprec.engine.masters import best_fp32_values, claim, release
from mixprec.engine.records import Event

__all__ = ["check_unowned", "own", "disown", "hand_over", "handed_over", "record_hand_over"]

_owners: list[weakref.ref] = []   # engines from build to unwrap()
_handed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # engine unwrapped by hand_over -> who took it


def _live() -> list[Any]:
    alive = [ref() for ref in _owners]
    _owners[:] = [ref for ref, engine in zip(_owners, alive) if engine is not None]
    return [engine for engine in alive if engine is not None]


def _overlapping(model: nn.Module) -> list[Any]:
    """The live engines whose model is ``model``, holds it, or is inside it."""
    inside = {id(m) for m in model.modules()}
    return [e for e in _live() if id(e.module) in inside or any(m is model for m in e.module.modules())]


def check_unowned(model: nn.Module) -> None:
    """ValueError if a live engine owns ``model``, a module of it or a module holding it (module docstring); one
    garbage collection first, so an engine dropped in a reference cycle does not count."""
    owners = _overlapping(model)
    if owners:
        gc.collect()
        owners = _overlapping(model)
    if not owners:
        _clear_leftovers(model)
        return
    other = owners[0]
    where = ("this model" if other.module is model else
             f"a module inside this model ({type(other.module).__name__})" if any(m is other.module for m in
                                                                                 model.modules())
             else f"a model holding this one ({type(other.module).__name__})")
    raise ValueError(f"MixedPrecision: {where} is already prepared by a live MixedPrecision engine (policy "
                     f"{other.policy}), whose casts, hooks and optimizer rebinding are on it; a second engine would "
                     f"take them for yours. To change the policy call mp.set_policy(...) on that engine; to start "
                     f"over call mp.unwrap() on it first (or build on a fresh model and optimizer)")


def _clear_leftovers(model: nn.Module) -> None:
    """Remove, with a warning, the hooks an engine dropped without ``unwrap()`` left on ``model`` (callables from
    the engine's modules on a model no live engine owns: an output cast, fp32 regions), which a new engine would
    otherwise run beside its own; the params stay as that engine left them (the warning says their dtypes)."""
    removed = 0
    for m in model.modules():
        for attr in HOOK_DICTS:
            hooks = m.__dict__.get(attr)
            for key in [k for k, h in (hooks or {}).items() if _from_mixprec(h)]:
                del hooks[key]
                removed += 1
    if removed:
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
        warnings.warn(f"MixedPrecision: removed {removed} hook(s) left on this model by an engine that no longer "
                      "runs it (one dropped without mp.unwrap(), or the engine of a model this one is a copy of: "
                      "copy.deepcopy and pickle carry its hooks, inert); its params are as that engine left them ("
                      f"{', '.join(dtypes)}). Call mp.unwrap() (to_fp32=True for the fp32 values) before dropping an "
                      "engine whose model lives on; a copy needs nothing", stacklevel=4)


_ENGINE_HOOKS = ("mixprec.engine.", "mixprec.auto.", "mixprec.distributed.")   # where an engine's hooks come from


def _from_mixprec(hook: Any) -> bool:
    """Whether a hook callable is one an engine installs: its function's module (a function or a bound method) or
    its class's module (a callable object) is one of :data:`_ENGINE_HOOKS` (not a trainer integration's own)."""
    function = getattr(hook, "__func__", hook)
    module = function.__module__ if isinstance(function, types.FunctionType) else type(function).__module__
    return str(module).startswith(_ENGINE_HOOKS)


def own(owner: Any, model: nn.Module, stored16: set[int]) -> None:
    """Record that ``owner`` prepared ``model`` and stores the params ``stored16`` (ids) in 16 bits
    (:func:`~mixprec.engine.masters.claim`, whose ValueError for a parameter another engine stores comes first)."""
    claim(owner, list(model.named_parameters()), stored16)
    _live()
    _owners.append(weakref.ref(owner))


def disown(owner: Any) -> None:
    """Forget ``owner``'s model and params, and give its optimizer back the params it rebound to fp32 masters
    (:meth:`mixprec.engine.masters.MasterWeights.unbind`; :meth:`mixprec.MixedPrecision.unwrap`)."""
    masters, optimizer = getattr(owner, "masters", None), getattr(owner, "optimizer", None)
    if masters is not None and optimizer is not None:
        masters.unbind(optimizer)
    release(owner)
    _owners[:] = [ref for ref in _owners if ref() not in (None, owner)]


def hand_over(model: nn.Module, who: str) -> str | None:
    """Unwrap the live engine that prepared ``model`` itself (an earlier trainer's), restoring its params' fp32
    values where it stored them in 16 bits (``unwrap(to_fp32=True)``; stopped mid-accumulation, its open window
    is dropped and the values restored all the same; under a strategy a plain ``unwrap()``, said in the note);
    warn and return the note (None: no such engine).
    ``who``: the integration, for the words. An engine on a module inside or around ``model`` is left to
    :func:`check_unowned`'s refusal."""
    if not any(e.module is model for e in _live()):
        return None
    gc.collect()   # an engine dropped in a reference cycle does not count
    previous = next((e for e in _live() if e.module is model), None)
    if previous is None:
        return None
    restored = previous.policy.param_dtype != torch.float32
    try:
        previous.unwrap(to_fp32=restored)
    except RuntimeError:   # stopped inside an accumulation window: the window is the earlier run's, dropped
        previous.masters.write_fp32(best_fp32_values(previous.masters, previous.optimizer))
        previous.unwrap()
        kept = " (its open accumulation window dropped, its fp32 values restored from the masters)"
    except ValueError as why:   # under a strategy: the params stay as the strategy holds them
        previous.unwrap()
        restored, kept = False, f" (its 16-bit params kept as they are: {why})"
    else:
        kept = " (its fp32 values restored from the masters)" if restored else ""
    note = (f"{who}: this model was still prepared by an earlier MixedPrecision engine (policy {previous.policy}, "
            f"an earlier run's); it was unwrapped{kept} before this run's engine was built")
    _handed[previous] = who
    warnings.warn(note, stacklevel=3)
    return note


def handed_over(engine: Any, unwrapped: bool) -> bool | str:
    """``unwrapped``, or the integration's name when :func:`hand_over` unwrapped ``engine`` (for its refusals)."""
    return (_handed.get(engine) or True) if unwrapped else False


def record_hand_over(engine: Any, note: str | None) -> Any:
    """Record :func:`hand_over`'s note as a ``"handover"`` event of the new ``engine`` (nothing for None); returns
    ``engine``."""
    if note:
        engine.record(Event(step=engine.boundaries, kind="handover", cause="an earlier engine on this model",
                            module=None, detail=note))
    return engine
