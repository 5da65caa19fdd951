"""A build that fails leaves the model and the optimizer as they were: :func:`undone_on_failure`.

``MixedPrecision(model, optimizer, ...)`` changes the model in place (params cast, fp8 / block-scaled linears
swapped in, hooks registered) and rebinds the optimizer to fp32 masters before its last checks run (the
optimizer-precision contract, a parameter another engine stores, ``torch.compile``'s options, a strategy's
wrap). When one of them raises, the error must not leave a half-prepared model behind (bf16-rounded weights, hooks
that a next engine would stack with its own, an optimizer stepping orphaned masters). The context manager around
the build remembers what it changes, cheaply (each param's dtype, each module's hook keys, the optimizer's param
lists and state keys; no tensor copied), and on an exception puts it back before re-raising:

* the engine's claims are released (:func:`mixprec.engine.ownership.disown`);
* the linears this build swapped go back to ``nn.Linear``
  (:func:`~mixprec.engine.preparation.swaps.revert_engine_swaps`; an earlier engine's leftovers stay);
* hooks registered since are removed from every module's hook dicts;
* params with an fp32 master take the master's values (exact copies of the originals: nothing stepped yet), as do a
  Kahan policy's params (the build holds their fp32 values to start the compensation: :meth:`BuildUndo.track`);
  other params and buffers cast since go back to their dtype from their 16-bit value (a ``-sr`` policy's params,
  a 16-bit frozen param or buffer): their low bits are not kept, to keep a large model's build from holding a
  second fp32 copy, and the re-raised error says so in a note naming them (reload them before building again);
* the optimizer's param groups and state get their tensors back.

No host sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mixprec.blockscale.swap import HOOK_DICTS
from mixprec.engine.ownership import disown
from mixprec.engine.preparation.swaps import revert_engine_swaps

__all__ = ["BuildUndo", "undone_on_failure"]


def _hook_keys(model: nn.Module) -> dict[int, dict[str, set]]:
    return {id(m): {attr: set(getattr(m, attr, {}) or {}) for attr in HOOK_DICTS} for m in model.modules()}


def _remove_new_hooks(model: nn.Module, before: dict[int, dict[str, set]]) -> None:
    for m in model.modules():
        old = before.get(id(m), {})
        for attr in HOOK_DICTS:
            hooks = getattr(m, attr, None)
            if hooks:
                for key in [k for k in hooks if k not in old.get(attr, set())]:
                    del hooks[key]


class BuildUndo:
    """What :func:`undone_on_failure` yields: :meth:`track` hands it the fp32 values the build holds anyway."""

    def __init__(self) -> None:
        self.exact: dict[int, torch.Tensor] = {}

    def track(self, prepared: Any) -> Any:
        """Remember ``prepared.kahan_from``'s (param, fp32 value before its cast) pairs as exact restore values;
        returns ``prepared``. No copy: the build holds them until the optimizer's compensation starts."""
        self.exact.update((id(p), v) for p, v in prepared.kahan_from)
        return prepared


def _restore_tensors(engine: Any, model: nn.Module, dtypes: dict[int, torch.dtype],
                     exact: dict[int, torch.Tensor]) -> list[str]:
    masters = getattr(engine, "masters", None)
    exact = {**exact, **{id(p): m for p, m in (masters.pairs if masters is not None else [])}}
    rounded = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if id(t) in exact:
                t.data = exact[id(t)].detach().to(dtypes.get(id(t), torch.float32))
            elif id(t) in dtypes and t.dtype != dtypes[id(t)]:
                if t.dtype.itemsize < dtypes[id(t)].itemsize:
                    rounded.append(name)
                t.data = t.data.to(dtypes[id(t)])
    return rounded


@contextmanager
def undone_on_failure(engine: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[BuildUndo]:
    """Around an engine's build: on an exception, ``model`` and ``optimizer`` are put back (module docstring)
    and the exception re-raised, with a note naming the tensors that came back from a 16-bit rounding; nothing
    happens on success. Yields a :class:`BuildUndo` for the build's exact fp32 values."""
    dtypes = {id(t): t.dtype for t in [*model.parameters(), *model.buffers()]}
    hooks = _hook_keys(model)
    modules = {id(m) for m in model.modules()}
    groups = [list(g["params"]) for g in optimizer.param_groups] if optimizer is not None else []
    state = dict(optimizer.state) if optimizer is not None else {}
    undo = BuildUndo()
    try:
        yield undo
    except BaseException as err:
        disown(engine)
        revert_engine_swaps(model, spare=modules)   # this build's swaps only
        _remove_new_hooks(model, hooks)
        rounded = _restore_tensors(engine, model, dtypes, undo.exact)
        if optimizer is not None:
            for group, params in zip(optimizer.param_groups, groups):
                group["params"] = params
            optimizer.state.clear()
            optimizer.state.update(state)
        if rounded:
            shown = ", ".join(rounded[:5]) + (f" and {len(rounded) - 5} more" if len(rounded) > 5 else "")
            err.add_note(f"mixprec: the failed build was undone, but {len(rounded)} tensor(s) it had cast to 16 bits "
                         f"came back from their 16-bit values (dtype restored, low bits lost): {shown}. Reload them "
                         "(your checkpoint or the model's construction) before building again.")
        raise
