"""Whether a bench's step times can carry a speed verdict: the one "noisy" decision.

results.json's ``timing.spread`` and ``timing.noisy`` are decided here, once, after the timing: the console,
report.md, ``speed_memory.png`` and the verdicts (no speed verdict on noisy timings) all read ``timing.noisy``
and never decide again. A row's spread is the p90/p10 of the steps its table step time came from: the
interleaved timing's (:mod:`mixprec.programs.bench.interleaved`) for a re-timed row, its quality run's for a
row timed sequentially (``--timing sequential``, a strategy, a row the interleaved timing could not time).
The timing is noisy when any row's spread exceeds :data:`SPREAD_LIMIT`, whichever way it was timed (the
interleaved timing also re-times its rounds once while :func:`is_noisy` says so).

In the one pass (rows taking turns, round by round) with three rows or more, a row's spread is taken after the
drift common to every row is divided out (:func:`drift_corrected_spreads`): a machine that slows or speeds up over
minutes moves every row's steps alike, which the interleaving already cancels in the speed ratios, so only what
differs between the rows within a round (a neighbour's burst during one row's turn, a row's own jitter) counts
as noise. The raw p90/p10 stays in results.json as ``timing.spread_raw``. A corrected spread above the raw one
(bursts that slow most rows in some rounds but not a steady one) is noise in the ratios too, and counts.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.programs.bench.measure import percentile
from mixprec.programs.bench.results import PolicyRun

__all__ = ["SPREAD_LIMIT", "MIN_ROWS_FOR_DRIFT", "drift_corrected_spreads", "is_noisy", "row_spreads", "settle_noise"]

SPREAD_LIMIT = 1.5   # p90/p10 of a row's timed steps above which its step time (and a speedup) is unreliable
MIN_ROWS_FOR_DRIFT = 3   # rows a round needs for its drift factor (a median of two would absorb one row's noise)


def is_noisy(spread: Mapping[str, float]) -> bool:
    """Whether any spread (row -> p90/p10) exceeds :data:`SPREAD_LIMIT` (read at call time)."""
    return any(value > SPREAD_LIMIT for value in spread.values())


def row_spreads(rows: Mapping[str, PolicyRun]) -> dict[str, float]:
    """Row -> p90/p10 (3 decimals) of the steps behind its ``step_time_ms_median``, for the rows that have one."""
    return {name: round(row.step_time_ms_p90 / row.step_time_ms_p10, 3) for name, row in rows.items()
            if row.step_time_ms_median is not None and row.step_time_ms_p10 and row.step_time_ms_p90}


def drift_corrected_spreads(tagged: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, float] | None:
    """Row -> p90/p10 (3 decimals) of its timed steps after the drift common to every row is divided out, from
    ``tagged`` (row -> ``[(round, ms), ...]``, the steps behind its step time and the round each ran in). Round r's
    drift factor is the median over the rows that ran in it of (the row's median in round r / its overall median);
    each step is divided by its round's factor. None when fewer than :data:`MIN_ROWS_FOR_DRIFT` rows have steps
    (a median of two ratios would take half of one row's own noise away)."""
    rows = {name: list(points) for name, points in tagged.items() if points}
    if len(rows) < MIN_ROWS_FOR_DRIFT:
        return None
    overall = {name: statistics.median(ms for _, ms in points) for name, points in rows.items()}
    ratios: dict[int, list[float]] = {}
    for name, points in rows.items():
        for r in sorted({r for r, _ in points}):
            ratios.setdefault(r, []).append(statistics.median(ms for rr, ms in points if rr == r) / overall[name])
    factor = {r: statistics.median(values) if len(values) >= MIN_ROWS_FOR_DRIFT else 1.0 for r, values in ratios.items()}
    spreads = {}
    for name, points in rows.items():
        corrected = [ms / factor[r] for r, ms in points]
        spreads[name] = round(percentile(corrected, 0.9) / percentile(corrected, 0.1), 3)
    return spreads


def settle_noise(timing: Mapping[str, Any], rows: Mapping[str, PolicyRun], *,
                 tagged: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> dict[str, Any]:
    """``timing`` (results.json's, either method) with ``spread``, ``noisy`` and ``spread_limit`` decided from
    ``rows`` as they stand after the timing (their step times are the table's). ``tagged`` (the one pass: row ->
    ``[(round, ms), ...]`` of the same steps): the spread is :func:`drift_corrected_spreads`' where it applies,
    the raw one kept as ``spread_raw``."""
    raw = row_spreads(rows)
    corrected = drift_corrected_spreads({n: t for n, t in tagged.items() if n in raw}) if tagged else None
    if corrected is None:
        timing = {k: v for k, v in timing.items() if k not in ("spread_raw", "drift_corrected")}
        return {**timing, "spread": raw, "noisy": is_noisy(raw), "spread_limit": SPREAD_LIMIT}
    spread = {n: corrected.get(n, v) for n, v in raw.items()}
    return {**timing, "spread": spread, "spread_raw": raw, "drift_corrected": True, "noisy": is_noisy(spread),
            "spread_limit": SPREAD_LIMIT}
