"""How many more bytes a planned attention kernel may save for backward than the default (``fused``): the
allowance, and the op plan's memory rule.

The fastest kernel can erase what mixed precision saves: ``matmul`` keeps fp32 and bf16 probabilities (144 MiB
per layer more than ``fused`` at the ``small`` GPT's shape; 0.94× fp32's saved activations against 0.58×), and
``fused-fp32`` keeps fp32 copies of q, k, v and of its output. So a candidate that saves more than ``fused``
per call is chosen only within the allowance: +0 MiB by default (never more than ``fused``), else what
:func:`allow_extra_saved` (process-wide) or ``$MIXPREC_ATTENTION_EXTRA_SAVED_MIB`` (a number of MiB, or
``inf``: speed alone, the kernel choice before saved bytes counted) allows. The choice says what it costs: ``"matmul: 1.31x faster than
fused, +144 MiB saved per call"`` or ``"matmul skipped: 1.31x faster than fused, +144 MiB saved per call over
fused (allowed +0 MiB ...)"``.

An engine's own allowance (``MixedPrecision(..., memory_budget=...)``, :mod:`mixprec.engine.memory_budget`) is
per thread: :func:`scoped_allowance`, entered by the engine around its forwards and backward passes, wins over
the process-wide one there and nowhere else, so one engine's budget does not leak into another engine's lookups.
:class:`CallCounter` counts the planned attention calls of a step (what a per-step budget is shared among).
No host sync anywhere here.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

__all__ = ["ENV", "CallCounter", "allow_extra_saved", "count_call", "extra_saved_allowed", "memory_choice",
           "mib_words", "scoped_allowance"]

ENV = "MIXPREC_ATTENTION_EXTRA_SAVED_MIB"
_HOW = f"mixprec.autocast.op_plan.allow_extra_saved(mib) or ${ENV}"
_allowed: list[float | None] = []   # the innermost allow_extra_saved() block's allowance last (process-wide)
_scoped = threading.local()         # .stack: the innermost scoped_allowance() of this thread last
_counters: list[Counter] = []       # the running CallCounters' counts (process-wide)


def _checked(mib: object) -> float | None:
    """``mib`` as an allowance in MiB (None: unlimited); TypeError/ValueError naming the argument otherwise."""
    name = "allow_extra_saved(mib"
    if mib is None or (isinstance(mib, float) and math.isinf(mib) and mib > 0):
        return None
    if isinstance(mib, bool) or not isinstance(mib, (int, float)):
        raise TypeError(f"{name}={mib!r}): mib must be a number of MiB (int or float, >= 0) or None for no "
                        f"limit; e.g. {name}=144)")
    if not mib >= 0:
        raise ValueError(f"{name}={mib!r}) is not allowed: extra bytes saved per call are a number of MiB >= 0 "
                         f"(0: never more than fused), or None / inf for no limit; e.g. {name}=144)")
    return float(mib)


@contextmanager
def allow_extra_saved(mib: float | None) -> Iterator[None]:
    """Inside, the op plan may choose an attention kernel saving up to ``mib`` MiB per call more for backward
    than ``fused`` (None or ``math.inf``: any, speed alone). Process-wide (every thread), nestable; keys already
    planned in this process are chosen again from their measurement at their next call. Raises TypeError for a
    non-number, ValueError for a negative or NaN ``mib``."""
    _allowed.append(_checked(mib))
    try:
        yield
    finally:
        _allowed.pop()


@contextmanager
def scoped_allowance(mib: float | None, *, enabled: bool = True) -> Iterator[None]:
    """Inside, in this thread only, the allowance is ``mib`` (MiB per call over ``fused``; None: no limit), whatever
    :func:`allow_extra_saved` or the environment say: an engine's own (its ``memory_budget``). A no-op with
    ``enabled=False``. Nestable; the innermost wins. Raises as :func:`allow_extra_saved` for a bad ``mib``."""
    if not enabled:
        yield
        return
    stack = getattr(_scoped, "stack", None) or []
    _scoped.stack = [*stack, _checked(mib)]
    try:
        yield
    finally:
        _scoped.stack = stack


def extra_saved_allowed() -> float | None:
    """The allowance in force, MiB per call (None: no limit): this thread's innermost :func:`scoped_allowance`,
    else the innermost :func:`allow_extra_saved`, else ``$MIXPREC_ATTENTION_EXTRA_SAVED_MIB`` (``inf`` or
    ``none``: no limit), else 0. Raises ValueError naming the variable when it holds something else."""
    if getattr(_scoped, "stack", None):
        return _scoped.stack[-1]
    if _allowed:
        return _allowed[-1]
    text = os.environ.get(ENV, "").strip()
    if not text:
        return 0.0
    if text.lower() in ("inf", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ValueError(f"${ENV}={text!r} is not allowed: a number of MiB >= 0, or 'inf' for no limit; "
                         f"e.g. {ENV}=144, or unset it (0: never more than fused)")
    return None if math.isinf(value) else value


class CallCounter:
    """Counts the planned calls of each key (:func:`count_call`, which the op plan calls at each lookup of a key
    a backward follows) between :meth:`start` and :meth:`stop`, in every thread; ``counts``: key → calls."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def start(self) -> None:
        _counters.append(self.counts)

    def stop(self) -> None:
        if any(c is self.counts for c in _counters):
            _counters[:] = [c for c in _counters if c is not self.counts]


def count_call(key: str) -> None:
    """One planned call of ``key`` for every running :class:`CallCounter`."""
    for counts in _counters:
        counts[key] += 1


def mib_words(n_bytes: int | None, *, signed: bool = False) -> str:
    """``n_bytes`` in MiB for a sentence: ``"144 MiB"``, ``"0.504 MiB"``, ``"+48 MiB"`` (``signed``); "unknown"."""
    if n_bytes is None:
        return "unknown"
    value = n_bytes / 2**20
    text = f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{'+' if signed and value >= 0 else ''}{text} MiB"


def _allowance_words(allowed_mib: float | None) -> str:
    return "no limit" if allowed_mib is None else f"+{allowed_mib:g} MiB: {_HOW}"


def memory_choice(times_ms: dict[str, float | None], saved: dict[str, int | None], *, default: str,
                  allowed_mib: float | None, pick: Callable[[dict[str, float | None]], str]) -> tuple[str, str]:
    """The candidate chosen under the memory rule and its words. ``times_ms``: candidate → best time (None: not
    offered); ``saved``: candidate → bytes saved per call (None: unknown); ``pick``: the speed rule over times
    (a candidate left out by it is given None). A candidate saving more than ``default`` by over
    ``allowed_mib`` MiB (or an unknown amount) is left out; ``default`` never is. The words name every
    candidate faster than the chosen one that was left out (fastest first) and the chosen one when it is not ``default``, each with its speed-up over
    ``default`` and its extra MiB per call; "" when nothing is saved (no backward follows)."""
    base = saved.get(default)
    offered = [n for n, t in times_ms.items() if t is not None]

    def extra(name: str) -> int | None:
        return None if saved.get(name) is None or base is None else saved[name] - base

    def fits(name: str) -> bool:
        more = extra(name)
        return name == default or (more is not None and (allowed_mib is None or more <= allowed_mib * 2**20))

    fastest = pick(times_ms)
    if all(saved.get(n) == 0 for n in offered):
        return fastest, ""
    chosen = pick({n: (t if fits(n) else None) for n, t in times_ms.items()})

    def faster(name: str) -> str:
        return f"{times_ms[default] / times_ms[name]:.2f}x faster than {default}"
    words = []
    skipped = [n for n in offered if n != chosen and not fits(n) and times_ms[n] < times_ms[chosen]]
    for name in sorted(skipped, key=lambda n: times_ms[n]):   # every faster candidate left out, fastest first
        words.append(f"{name} skipped: {faster(name)}, {mib_words(extra(name), signed=True)} saved per "
                     f"call over {default} (allowed {_allowance_words(allowed_mib)})")
    if chosen != default:
        words.append(f"{chosen}: {faster(chosen)}, {mib_words(extra(chosen), signed=True)} saved per call "
                     f"(allowed {_allowance_words(allowed_mib)})")
    elif not words:
        words.append(f"{default}: {mib_words(base)} saved per call")
    return chosen, "; ".join(words)
