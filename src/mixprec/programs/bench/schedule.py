"""How a bench run's steps are laid out: the warm-up, the eval points, the turns of the one pass, and where the
run's wall time went.

Source: the choices measured when the default was set (docs/bench.md, "Why 300 steps") and the one pass.
"""

from __future__ import annotations

import time

__all__ = ["QUICK_STEPS", "QUICK_ROUNDS", "warmup_steps_for", "eval_every_for", "block_steps_for", "PhaseClock"]

QUICK_STEPS = 30      # --quick: a smoke test's steps (the unigram plateau is behind it; training has not settled)
QUICK_ROUNDS = 3      # --quick: turns per row and eval points (each eval costs about 3 steps: ten would double the run)


def warmup_steps_for(steps: int) -> int:
    """Untimed warm-up steps: 10 % of the run, at least 2, at most 20."""
    return min(20, max(2, steps // 10))


def eval_every_for(steps: int, *, quick: bool = False) -> int:
    """Steps between eval points when ``--eval-every`` is not given: ``steps // 10`` (at least 1), so each run
    has about ten points. An eval is a forward over the fixed validation batches (8 for gpt, about 3
    training steps' time), so the ten cost about 10 % of a run's training time, not its step time. ``quick``
    (``--quick``): ``steps // 3``, :data:`QUICK_ROUNDS` points (ten would cost as much as a 30-step run's training)."""
    return max(1, steps // (QUICK_ROUNDS if quick else 10))


def block_steps_for(steps: int, *, quick: bool = False) -> int:
    """Steps per turn in the one pass: a tenth of the run, at least 3, at most 10 (each turn's first step is not
    timed, so shorter turns time fewer steps; longer ones interleave less often). ``quick``: a third of the run
    (:data:`QUICK_ROUNDS` turns per row, so a 30-step smoke test times 25 of its steps, not 18)."""
    if quick:
        return max(3, -(-steps // QUICK_ROUNDS))
    return max(3, min(10, steps // 10))


class PhaseClock:
    """Wall seconds per phase of a run (results.json's ``timing.phases_s``: where a run's time went); :meth:`lap`
    closes the phase that ran since the last lap (or construction)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = round(self.laps.get(phase, 0.0) + now - self._last, 2)
        self._last = now
