"""``recompute="auto"``'s choice: every block's mode at once, the fewest bytes at the step's peak within the time bound.

:func:`choose_modes` takes each repeated block's measured bytes kept for backward and forward+backward seconds in
each of :data:`~mixprec.memory.recompute_plan.MODES` (:func:`mixprec.memory.recompute.measure_block`), identical
blocks' times pooled first (:func:`pooled_seconds`), and finds the plan of least
:func:`~mixprec.memory.recompute_plan.block_peak_bytes` whose total extra time stays within the bound: a bisection
on the peak, each target checked by a dynamic programme over the time budget cut into a grid of units. On the
CPU, no host sync.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from mixprec.memory.recompute_plan import MODES, block_peak_bytes

__all__ = ["choose_modes", "pooled_seconds"]

_UNITS_PER_BLOCK = 64   # choose_modes: the time budget in 64 units per block (each extra time rounded up)


def choose_modes(saved_bytes: Sequence[tuple[int, int, int]], seconds: Sequence[tuple[float, float, float]],
                 max_ratio: float) -> tuple[str, ...]:
    """Each block's mode (:data:`MODES`), chosen jointly: the fewest :func:`block_peak_bytes` whose total extra
    time, the sum over blocks of ``seconds[i][mode] - seconds[i][0]``, is at most ``(max_ratio - 1)`` times the
    blocks' time without recompute ``sum(seconds[i][0])`` (the step takes at least that: its recompute overhead is
    then within ``max_ratio`` too); of those, the least extra time. Exact up to the time budget's grid (64 units
    per block, each extra time rounded up, a recompute at least one unit: the bound always holds; at most 1/64 of
    the budget left unused); identical blocks' times pooled first (:func:`pooled_seconds`). The last of identical blocks runs ``"none"`` (recomputing it lowers no peak of this
    model; measured at GPT small, batch 64: it costs the head's bytes at the start of backward, 6 %). On the
    CPU, no host sync."""
    seconds = pooled_seconds(saved_bytes, seconds)
    grid = _UNITS_PER_BLOCK * max(len(seconds), 4)
    budget = (max_ratio - 1.0) * sum(s[0] for s in seconds)
    units = [(0, *(_units(t - s[0], budget, grid) for t in s[1:])) for s in seconds]
    low, high = 0, block_peak_bytes(saved_bytes, ["none"] * len(saved_bytes))   # all none: within any bound
    for i, saved in enumerate(saved_bytes):   # no plan beats every earlier block keeping its fewest bytes
        low = max(low, sum(min(b) for b in saved_bytes[:i]) + saved[0])
    best = ("none",) * len(saved_bytes)
    while low < high:   # bisect the least peak some plan within the budget reaches
        target = (low + high) // 2
        fit = _fit(saved_bytes, units, target, grid)
        low, high, best = (low, target, fit) if fit is not None else (target + 1, high, best)
    return best


def pooled_seconds(saved_bytes: Sequence[tuple[int, int, int]], seconds: Sequence[tuple[float, float, float]]
                   ) -> list[tuple[float, float, float]]:
    """Each block's seconds per mode, replaced by the median over the blocks keeping the same bytes in every mode
    when there are 3 or more of them (identical blocks on the same input: a transformer's layers), so one timing
    hit by a neighbour's load cannot change one block's mode (measured at GPT small under load: one block timed
    1.5x its five peers went selective, the step's peak 0.20x fp32's instead of 0.148x). Others unchanged."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, saved in enumerate(saved_bytes):
        groups.setdefault(tuple(saved), []).append(i)
    out = [tuple(s) for s in seconds]
    for members in groups.values():
        if len(members) >= 3:
            pooled = tuple(statistics.median(seconds[i][m] for i in members) for m in range(len(MODES)))
            for i in members:
                out[i] = pooled
    return out


def _units(extra_s: float, budget_s: float, grid: int) -> int:
    """``extra_s`` in units of ``budget_s / grid``, rounded up, at least one (a recompute is never free, even where
    noise timed it faster); ``grid + 1``: never fits."""
    return grid + 1 if budget_s <= 0 else min(grid + 1, max(1, math.ceil(extra_s * grid / budget_s)))


def _fit(saved_bytes: Sequence[tuple[int, int, int]], units: list[tuple[int, ...]], target: int,
         grid: int) -> tuple[str, ...] | None:
    """Modes whose :func:`block_peak_bytes` is at most ``target`` in at most ``grid`` time units: the fewest units
    (then the fewest kept bytes); None if there are none. Dynamic programming over the units used so far: for each
    count, the fewest bytes the blocks so far keep (fewer is never worse for the blocks after)."""
    never = torch.iinfo(torch.int64).max // 4
    kept = torch.full((grid + 1,), never, dtype=torch.int64)   # kept[t]: fewest bytes kept so far, in t units
    kept[0] = 0
    picks = []
    for saved, cost in zip(saved_bytes, units):
        within = kept + saved[0] <= target   # this block's backward stays within the target
        after, origin, mode = torch.full_like(kept, never), torch.zeros_like(kept), torch.zeros_like(kept)
        for m, u in enumerate(cost):
            if u > grid:
                continue
            reach = torch.where(within, kept + saved[m], never)[:grid + 1 - u]
            better = reach < after[u:]
            after[u:] = torch.where(better, reach, after[u:])
            origin[u:] = torch.where(better, torch.arange(grid + 1 - u), origin[u:])
            mode[u:] = torch.where(better, m, mode[u:])
        kept = after
        picks.append((origin.tolist(), mode.tolist()))
    ends = (kept < never).nonzero()
    if not len(ends):
        return None
    t, modes = int(ends[0]), []
    for origin, mode in reversed(picks):
        t, m = origin[t], mode[t]
        modes.append(MODES[m])
    return tuple(reversed(modes))
