"""One live engine per model: a second :class:`~mixprec.MixedPrecision` on a model another one prepared is refused.

An engine changes the model it is built on (casts, hooks, swapped linears) and the optimizer (rebound to fp32
masters under ``-pure`` policies); a second engine built on top would see the first one's changes as the user's
(its checks then blame a cast the user never made, or an optimizer "holding none of the model's parameters") and
both engines' hooks would run. So the build checks, before anything changes, that no live engine owns the model,
a module inside it or a module holding it, and names the way out: ``mp.set_policy(...)`` to change the policy,
``mp.unwrap()`` to release the model, or a fresh model and optimizer. An engine owns its model from its build to
its ``unwrap()``; the registry holds it weakly (an engine nothing refers to owns nothing; its hooks refer to it, so
one whose model still carries them stays alive, as it should: it is still changing the model).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from torch import nn

from mixprec.engine.masters import claim, release

__all__ = ["check_unowned", "own", "disown"]

_owners: list[weakref.ref] = []   # engines from build to unwrap()


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


def own(owner: Any, model: nn.Module, stored16: set[int]) -> None:
    """Record that ``owner`` prepared ``model`` and stores the params ``stored16`` (ids) in 16 bits
    (:func:`~mixprec.engine.masters.claim`, whose ValueError for a parameter another engine stores comes first)."""
    claim(owner, list(model.named_parameters()), stored16)
    _live()
    _owners.append(weakref.ref(owner))


def disown(owner: Any) -> None:
    """Forget ``owner``'s model and params (:meth:`mixprec.MixedPrecision.unwrap`)."""
    release(owner)
    _owners[:] = [ref for ref in _owners if ref() not in (None, owner)]
