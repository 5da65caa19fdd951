"""Whether a bench's step times can carry a speed verdict: the one "noisy" decision.

results.json's ``timing.spread`` and ``timing.noisy`` are decided here, once, after the timing: the console,
report.md, ``speed_memory.png`` and the verdicts (no speed verdict on noisy timings) all read ``timing.noisy``
and never decide again. A row's spread is the p90/p10 of the steps its table step time came from: the
interleaved timing's (:mod:`mixprec.programs.bench.interleaved`) for a re-timed row, its quality run's for a
row timed sequentially (``--timing sequential``, a strategy, a row the interleaved timing could not time).
The timing is noisy when any row's spread exceeds :data:`SPREAD_LIMIT`, whichever way it was timed (the
interleaved timing also re-times its rounds once while :func:`is_noisy` says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixprec.programs.bench.results import PolicyRun

__all__ = ["SPREAD_LIMIT", "is_noisy", "row_spreads", "settle_noise"]

SPREAD_LIMIT = 1.5   # p90/p10 of a row's timed steps above which its step time (and a speedup) is unreliable


def is_noisy(spread: Mapping[str, float]) -> bool:
    """Whether any spread (row -> p90/p10) exceeds :data:`SPREAD_LIMIT` (read at call time)."""
    return any(value > SPREAD_LIMIT for value in spread.values())


def row_spreads(rows: Mapping[str, PolicyRun]) -> dict[str, float]:
    """Row -> p90/p10 (3 decimals) of the steps behind its ``step_time_ms_median``, for the rows that have one."""
    return {name: round(row.step_time_ms_p90 / row.step_time_ms_p10, 3) for name, row in rows.items()
            if row.step_time_ms_median is not None and row.step_time_ms_p10 and row.step_time_ms_p90}


def settle_noise(timing: Mapping[str, Any], rows: Mapping[str, PolicyRun]) -> dict[str, Any]:
    """``timing`` (results.json's, either method) with ``spread``, ``noisy`` and ``spread_limit`` decided from
    ``rows`` as they stand after the timing (their step times are the table's)."""
    spread = row_spreads(rows)
    return {**timing, "spread": spread, "noisy": is_noisy(spread), "spread_limit": SPREAD_LIMIT}
