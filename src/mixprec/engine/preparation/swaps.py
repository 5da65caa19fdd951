"""The engine's own linear swaps, told apart from the ones it found: tagged at build, reverted by ``unwrap``.

An engine swaps eligible ``nn.Linear`` for :class:`mixprec.fp8.Float8Linear` or
:class:`mixprec.blockscale.BlockScaledLinear` (:mod:`mixprec.engine.preparation.prepare`) and tags each with
``built_by`` (its policy text, :func:`tag_swapped`); :meth:`mixprec.MixedPrecision.unwrap` swaps the tagged ones back
to plain ``nn.Linear`` holding the same Parameters and hooks (:func:`revert_engine_swaps`), so the model it returns
is the user's again (fp32 inference, export, a strict ``load_state_dict`` into a plain model). A linear of those
classes the engine finds at build runs as built and is named in the decision (:func:`check_prebuilt_linears`): one
the user built (untagged, e.g. with a custom recipe) silently otherwise never; one left by another engine that was
not unwrapped warns with the fix and is refused under a policy that swaps linears itself (its conversion would
stack on the other's choice of linears, recipe and stream indices).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable

from torch import nn

from mixprec.messages.location import user_stacklevel
from mixprec.policy.policy import Policy

__all__ = ["check_prebuilt_linears", "revert_engine_swaps", "tag_swapped", "zero_converted_note", "FIX"]

#: How to give a model its plain linears back (named in the warning and the error).
FIX = ("call the old engine's unwrap() before building a new one on its model (old_mp.unwrap(); it swaps its linears "
       "back to nn.Linear), or mixprec.blockscale.revert_block_scaled(model) / mixprec.fp8.revert_float8(model)")


def tag_swapped(model: nn.Module, names: Iterable[str], policy: Policy) -> None:
    """Mark the linears ``names`` of ``model`` (just swapped in) as built by an engine under ``policy``."""
    named = dict(model.named_modules())
    for name in names:
        named[name].built_by = str(policy)


def _prebuilt(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linears of ``model`` that run their own GEMMs (a ``linear_kind``), in registration order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and type(m) is not nn.Linear and isinstance(getattr(m, "linear_kind", None), str)]


def check_prebuilt_linears(model: nn.Module, policy: Policy) -> str:
    """At the first build, before anything changes: the decision's clause naming ``model``'s fp8 and block-scaled
    linears, which run as built ("" without any). Those another engine swapped in (``built_by`` set) warn with the
    fix; ValueError (the fix named) for them under a ``policy`` that swaps linears (``fp8`` or ``block``)."""
    found = _prebuilt(model)
    if not found:
        return ""
    left = [(name, m) for name, m in found if getattr(m, "built_by", None) is not None]
    words = [f"{name} ({m.linear_kind}" + (f", left by an engine under {m.built_by} that was not unwrapped)"
                                           if m.built_by is not None else ", built by the caller)")
             for name, m in found]
    listed = ", ".join(words[:4]) + (f" and {len(words) - 4} more" if len(words) > 4 else "")
    if left and (policy.fp8 is not None or policy.block is not None):
        raise ValueError(f"policy {policy} swaps linears itself, but the model still holds {len(left)} linear(s) "
                         f"another MixedPrecision swapped in: {listed}. Fix: {FIX}")
    if left:
        warnings.warn(f"mixprec: the model still holds {len(left)} linear(s) another MixedPrecision swapped in, which "
                      f"{policy} runs as built (not in its own precision): {listed}. Fix: {FIX}",
                      stacklevel=user_stacklevel())
    return f"; {len(found)} linear(s) already fp8 or block-scaled, run as built: {listed}"


def zero_converted_note(policy: Policy, what: str, reasons: Iterable[str], as_built: int = 0) -> str:
    """Warn that ``policy``'s ``what`` (e.g. ``"block-scaled nvfp4"``) converted no linear, with the kept linears'
    ``reasons`` (each ``"; "``-joined, as the reports give them; ``as_built`` of them left as built); returns the
    decision's words on it."""
    plain = dataclasses.replace(policy, block=None, block_keep=(), block_disable=(), fp8=None)
    why = sorted({r.split(" (")[0] for joined in reasons for r in _top_level(joined)}) or ["the model has no nn.Linear"]
    but = f", but for the {as_built} linear(s) left as built" if as_built else ""
    note = f"{policy} converted 0 linears to {what} ({'; '.join(why[:5])}); the run is {plain}{but}"
    warnings.warn(f"mixprec: {note}", stacklevel=user_stacklevel())
    return f"; {note}"


def _top_level(joined: str) -> list[str]:
    """``joined`` split at its ``"; "`` outside parentheses: ``"a (x; y); b"`` -> ``["a (x; y)", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(joined):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and joined.startswith("; ", i):
            parts.append(joined[start:i])
            start = i + 2
    return parts + [joined[start:]]


def revert_engine_swaps(model: nn.Module, *, sharded: bool = False, spare: set[int] = frozenset()) -> int:
    """Swap every fp8 and block-scaled linear of ``model`` an engine swapped in (``built_by`` set) back to a plain
    ``nn.Linear`` holding the same Parameters and hooks (:meth:`mixprec.MixedPrecision.unwrap`); those the caller built
    stay, and all stay when ``sharded`` (FSDP2 holds the modules it sharded, which a swap would leave behind). The
    returned model's ``state_dict`` then loads strictly into the plain model. ``spare``: ids of modules left as they
    are (a failed build's undo spares what an earlier engine left). Returns how many. No host sync."""
    if sharded:
        return 0
    from mixprec.blockscale import revert_block_scaled
    from mixprec.fp8 import revert_float8

    def engine_made(module: nn.Module, name: str) -> bool:
        return getattr(module, "built_by", None) is not None and id(module) not in spare

    return len(revert_block_scaled(model, engine_made)) + len(revert_float8(model, engine_made))
