"""Candidate kernels timed against each other, and the speed rule that picks one.

:func:`time_candidates` times zero-argument callables, interleaved, and picks by :func:`speed_choice`: the
default unless another candidate is at least :data:`MARGIN` faster, ties within :data:`MARGIN` of the fastest
going to the first of a preference order (the more exact). A measurement whose rounds spread over
:data:`NOISY_SPREAD` is :attr:`Timing.noisy` (a busy machine). :attr:`Timing.rounds_ms` keeps every interleaved
round, so a caller can ask whether the rounds, each a comparison of its own, agree on the choice
(:func:`round_times`; the op plan's cache verdict: :mod:`mixprec.autocast.plan_verdict`); :func:`from_rounds`
is the arithmetic after the clock, on samples given. The op plan (:mod:`mixprec.autocast.op_plan`) times its
attention candidates with it. Host syncs: a device sync around each timed call
(:func:`mixprec.machine.timing.time_call`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mixprec.machine.timing import time_call

__all__ = ["MARGIN", "REPEATS", "NOISY_SPREAD", "HOPELESS", "Timing", "time_candidates", "from_rounds", "round_times",
           "speed_choice"]

MARGIN = 0.05                     # another candidate replaces the default only when ≥ 5 % faster
REPEATS = 5                       # timed runs per candidate after one warm-up (best of)
NOISY_SPREAD = 1.5                # a candidate's slowest round over its fastest: above it, not cached
HOPELESS = 3.0                    # a warm-up over 3x the fastest one's, in two passes: not repeated


@dataclass(frozen=True)
class Timing:
    """What :func:`time_candidates` found: ``chosen``, each candidate's best time in ms (None: not offered), and
    ``spread``: the median over candidates of each one's slowest over its fastest timed round (1.0 on a quiet
    machine); ``rounds_ms``: each repeated candidate's timed rounds in order (round ``r`` of every candidate ran
    back to back; a candidate dropped after its warm-ups has none). The plan's measurement adds ``saved_bytes``
    (candidate → bytes saved for backward per call) and ``memory`` (the memory rule's words), and its ``chosen``
    is the memory rule's (:mod:`mixprec.autocast.op_plan`)."""

    chosen: str
    times_ms: dict[str, float | None]
    spread: float
    saved_bytes: dict[str, int | None] = field(default_factory=dict)
    memory: str = ""
    rounds_ms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def noisy(self) -> bool:
        """True when ``spread`` exceeds :data:`NOISY_SPREAD`: the machine was busy; the choice is not cached."""
        return self.spread > NOISY_SPREAD


def time_candidates(runs: dict[str, Callable[[], Any] | None], *, default: str,
                    device: torch.device | str = "cpu", prefer: tuple[str, ...] = (),
                    keep: tuple[str, ...] = ()) -> Timing:
    """Time each zero-argument callable of ``runs`` (None: not offered) and pick one: one warm-up call each, then
    :data:`REPEATS` interleaved rounds (A B C A B C ...: drift hits every candidate alike), each candidate's best
    call in ms. A candidate whose warm-up took over :data:`HOPELESS` times the fastest warm-up is warmed up again,
    beside the fastest one (interleaved, a comparison of its own), and has lost only when over :data:`HOPELESS`
    times there too: it is not repeated (its better warm-up is reported), so one slow sample (a load spike) drops
    nothing. ``default`` and ``keep`` (the op plan's cached choice) are never dropped. ``default`` is chosen
    unless another candidate is at least :data:`MARGIN` faster; among the candidates within :data:`MARGIN` of
    the fastest, the first of ``prefer`` (most exact first; else ``runs``' order) wins, so noise cannot trade
    exactness for nothing. ``spread`` is the median over candidates of each one's slowest/fastest round. Raises
    ValueError when ``default`` is not offered. Host syncs: a device sync around each call
    (:func:`mixprec.machine.timing.time_call`)."""
    device = torch.device(device)
    if runs.get(default) is None:
        raise ValueError(f"time_candidates(default={default!r}): the default must be one of the offered "
                         f"candidates {[n for n, r in runs.items() if r is not None]}")

    def once(run: Callable[[], Any]) -> float:
        return time_call(run, device) * 1e3
    warm = {name: once(run) for name, run in runs.items() if run is not None}
    doubtful = _hopeless(warm, spared=(default, *keep))
    dropped: set[str] = set()
    if doubtful:   # a second warm-up of each, with the fastest's again: dropped when over HOPELESS there too
        fastest = min(warm, key=lambda name: warm[name])
        again = {name: once(runs[name]) for name in warm if name in doubtful or name == fastest}
        dropped = doubtful & _hopeless(again, spared=(default, *keep))
        warm.update({name: min(warm[name], t) for name, t in again.items()})
    live = [name for name in warm if name not in dropped]
    rounds: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(REPEATS):
        for name in live:
            rounds[name].append(once(runs[name]))
    return from_rounds(rounds, {name: warm.get(name) for name in runs}, default=default, prefer=prefer)


def _hopeless(warm: dict[str, float], *, spared: tuple[str, ...]) -> set[str]:
    """The candidates of ``warm`` (one pass of warm-ups, ms) over :data:`HOPELESS` times its fastest, but
    ``spared``."""
    fastest = min(warm.values())
    return {name for name, t in warm.items() if t > HOPELESS * fastest and name not in spared}


def from_rounds(rounds_ms: dict[str, list[float]], warm_ms: dict[str, float | None], *, default: str,
                prefer: tuple[str, ...] = ()) -> Timing:
    """The :class:`Timing` of :func:`time_candidates` from its samples: ``rounds_ms`` (each repeated candidate's
    interleaved rounds, ms) and ``warm_ms`` (every candidate's warm-up in ms, in the candidates' order; None:
    not offered). Times: each candidate's best round, its warm-up where it has no rounds; ``spread``: the median
    over candidates of slowest/fastest round; ``chosen``: :func:`speed_choice`. No clock is read."""
    times = {name: None if w is None else round(min(rounds_ms[name]) if rounds_ms.get(name) else w, 3)
             for name, w in warm_ms.items()}
    ratios = [max(r) / min(r) for r in rounds_ms.values() if r]
    spread = statistics.median(ratios) if ratios else 1.0   # one candidate's outlier is not load
    return Timing(speed_choice(times, default, prefer or tuple(warm_ms)), times, round(spread, 3),
                  rounds_ms={name: list(r) for name, r in rounds_ms.items()})


def round_times(timing: Timing) -> list[dict[str, float | None]]:
    """Each interleaved round of ``timing`` as the times a rule reads (candidate → ms): the round's own time for a
    repeated candidate, its reported time (warm-up, or None: not offered) for one without rounds."""
    count = min((len(r) for r in timing.rounds_ms.values()), default=0)
    return [{name: timing.rounds_ms[name][i] if timing.rounds_ms.get(name) else t
             for name, t in timing.times_ms.items()} for i in range(count)]


def speed_choice(times: dict[str, float | None], default: str, prefer: tuple[str, ...]) -> str:
    """``default`` unless another candidate (time not None) is at least :data:`MARGIN` faster; then the first of
    ``prefer`` within :data:`MARGIN` of the fastest."""
    best = min(t for t in times.values() if t is not None)
    if times[default] <= best / (1 - MARGIN):
        return default
    return next(n for n in prefer if times.get(n) is not None and times[n] <= best / (1 - MARGIN))
