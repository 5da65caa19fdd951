"""Whether one key's measurement may be cached: a verdict that machine noise cannot fake.

The op plan (:mod:`mixprec.autocast.op_plan`) caches a key's choice on disk, and every later process on the machine
runs it. A measurement taken on a busy machine must therefore neither be cached nor replace a cached choice, and
a candidate's own rounds cannot tell: on a 2-core machine under 4x load a forward + backward of ~90 ms averages the
load inside each run, so every candidate's rounds agree with each other (spread under :data:`NOISY_SPREAD`)
while the candidates' ratios swing round to round; the short forward key of the same run spread over 1.5x and was
caught, the long one was cached. :func:`verdict` asks three things of a measurement, each within one run or
against the entry it would replace:

* its rounds did not spread over :data:`NOISY_SPREAD` (:attr:`Timing.noisy`, as before);
* its interleaved rounds separate the candidates: each round (every candidate run back to back, so load common
  to the round divides out) is a comparison of its own, and the plan's rule applied to each round alone chooses
  what the measurement chose in at least :data:`AGREEMENT` of the rounds;
* where the cache holds an entry for the key, the machine is not busier than when that entry was measured: the
  default's time is at most :data:`NOISY_SPREAD` times the cached one's (the same kernel, key and machine key);
  and the entry's choice was timed in every round: a candidate dropped after its warm-ups
  (:func:`mixprec.autocast.kernel_timing.time_candidates`, which the plan tells never to drop the cached choice)
  was not compared in the rounds, so its warm-ups, which one load spike can slow, cannot overturn a cached choice.

A measurement passing all three is cached (and replaces a cached entry, saying so when its choice differs);
otherwise it is not written, and where the cache holds an entry the process keeps that entry's choice. The words
say which test failed, with the numbers.

The rounds are checked under the allowance in force at measurement. A cache entry keeps them (``rounds_ms``), so
a later re-choice under another allowance (:func:`mixprec.autocast.op_plan.rechosen`, or the entry read from the
cache under another one) asks the same of its own choice: :func:`agreed_times` gives the rule all the times
where the rounds agree on what it chooses from them, else only the measured (cached) choice's and the
default's. Pure: no clock, no file; tests feed it samples.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from mixprec.autocast import kernel_timing
from mixprec.autocast.kernel_timing import Timing, round_times

__all__ = ["AGREEMENT", "Verdict", "verdict", "round_choices", "agreed_times"]

AGREEMENT = 1.0   # the share of interleaved rounds that must choose as the measurement did for it to be cached


@dataclass(frozen=True)
class Verdict:
    """``cache``: write the measurement to the cache file; ``keep_cached``: this process runs the cached entry
    (there is one and the measurement is not written); ``why``: the words for the entry's note ("" for a
    measurement cached over nothing or over the same choice)."""

    cache: bool
    keep_cached: bool
    why: str


def round_choices(timing: Timing, rule: Callable[[dict[str, float | None]], str]) -> list[str]:
    """``rule`` (times → chosen candidate) applied to each interleaved round of ``timing`` alone."""
    return [rule(times) for times in round_times(timing)]


def _disagreement(timing: Timing, chosen: str, rule: Callable[[dict[str, float | None]], str]) -> str:
    """Words when fewer than :data:`AGREEMENT` of the rounds choose ``chosen`` ("" when enough do)."""
    picks = round_choices(timing, rule)
    agree = picks.count(chosen)
    if not picks or agree >= math.ceil(AGREEMENT * len(picks)):
        return ""
    others = ", ".join(f"{name} {count}" for name, count in Counter(p for p in picks if p != chosen).most_common())
    return (f"the interleaved rounds do not separate the candidates: {agree} of {len(picks)} chose {chosen} "
            f"({others})")


def _busier(timing: Timing, cached: dict[str, Any] | None, default: str) -> str:
    """Words when ``default`` took over :data:`NOISY_SPREAD` times its time in ``cached`` ("" otherwise)."""
    was = ((cached or {}).get("times_ms") or {}).get(default)
    now = timing.times_ms.get(default)
    if not was or now is None or now <= kernel_timing.NOISY_SPREAD * was:
        return ""
    return (f"the machine is busier than when {cached['chosen']} was cached ({default} {now:.2f} ms against "
            f"{was:.2f} ms, {now / was:.1f}x)")


def _untimed(timing: Timing, cached: dict[str, Any] | None) -> str:
    """Words when ``cached``'s choice was offered but dropped after its warm-ups, not timed in the rounds."""
    name = (cached or {}).get("chosen")
    if name is None or name == timing.chosen or timing.times_ms.get(name) is None or timing.rounds_ms.get(name):
        return ""
    return (f"the cached {name} was dropped after its warm-ups ({timing.times_ms[name]:.2f} ms), not timed in "
            "the rounds")


def agreed_times(timing: Timing, rule: Callable[[dict[str, float | None]], str], anchor: str, *,
                 default: str) -> tuple[dict[str, float | None], str]:
    """The times a re-choice by ``rule`` (another allowance's) reads, and words: ``timing``'s own where what
    ``rule`` chooses from them is ``anchor`` (the choice the measurement made: the cached one) or is what its
    interleaved rounds choose (:data:`AGREEMENT`, as :func:`verdict` asks); else only ``anchor``'s and
    ``default``'s (anchor where it is allowed and faster by the margin: the rule decides), the words saying why.
    A timing without rounds (an older cache entry) reads its own."""
    chosen = rule(timing.times_ms)
    why = "" if chosen == anchor else _disagreement(timing, chosen, rule)
    if not why:
        return dict(timing.times_ms), ""
    times = {name: t if name in (anchor, default) else None for name, t in timing.times_ms.items()}
    fallback = rule(times)
    return times, (f"not {chosen} under this allowance ({why}): {fallback}, "
                   f"{'the measured choice' if fallback == anchor else 'the default'}")


def verdict(timing: Timing, rule: Callable[[dict[str, float | None]], str], cached: dict[str, Any] | None, *,
            default: str) -> Verdict:
    """Whether ``timing`` (one key measured; ``timing.chosen`` the plan's choice) may be cached, ``rule`` being
    the plan's rule over one set of times (candidate → ms, None: not offered) and ``cached`` the usable cache
    entry it would replace (``chosen``, ``times_ms``) or None. See the module docstring."""
    reasons = [f"its rounds spread {timing.spread:.2f}x (a busy machine)" if timing.noisy else "",
               _disagreement(timing, timing.chosen, rule), _busier(timing, cached, default), _untimed(timing, cached)]
    reasons = [r for r in reasons if r]
    if not reasons:
        replaced = cached is not None and cached.get("chosen") != timing.chosen
        return Verdict(True, False, f"replaces the cached {cached['chosen']}" if replaced else "")
    if cached is not None:
        return Verdict(False, True, f"measured again, not cached ({'; '.join(reasons)}): {timing.chosen} measured, "
                                    f"the cached {cached['chosen']} kept")
    return Verdict(False, False, f"not cached ({'; '.join(reasons)}): {timing.chosen} for this process only")
