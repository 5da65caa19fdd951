"""The largest batch that fits a memory budget, from a line fitted to measured peaks.

A step's peak live tensor bytes (:mod:`mixprec.memory.live`) measured at two or more batch sizes are fitted by
least squares to ``peak = fixed + per_sample × batch`` (exact rational arithmetic: exact points give an exact
line and zero residuals); the answer is the largest integer batch whose predicted peak is at most the budget.
The line is a model: a peak that moves to another phase of the step (the optimizer step at small batches,
the backward at large ones) bends it, which the residuals show. Budgets are written ``"4GiB"``, ``"512MiB"``,
``"2.5GB"`` (:func:`parse_bytes`: binary KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB, B).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["BatchBudget", "fit_batch_budget", "largest_batch", "parse_bytes"]

_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_TEXT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)?\s*$")


def parse_bytes(text: str | int, *, name: str = "memory_budget") -> int:
    """Bytes in ``text``: ``"4GiB"`` (4 × 2**30), ``"512MiB"``, ``"2.5GB"`` (2.5 × 10**9), ``"100kB"``, ``"123B"`` or
    a bare integer of bytes; units are case-insensitive, a fraction of a byte rounds down. ``name`` is the
    argument named in the error.

    Raises:
        ValueError: ``text`` is not a positive size in those units.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _TEXT.match(text.lower()) if isinstance(text, str) else None
    unit = match and (match.group(2) or "b")
    if not match or unit not in _UNITS or Fraction(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"{name}={text!r} is not a memory size; write a positive number with a unit: "
                         "B, KiB, MiB, GiB, TiB (powers of 2) or kB, MB, GB, TB (powers of 10), e.g. '4GiB', "
                         "'512MiB', '2.5GB'")
    return math.floor(Fraction(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class BatchBudget:
    """The fit and its answer. ``points``: ``(batch, peak bytes)`` measured; ``fixed_bytes`` and
    ``per_sample_bytes``: the least-squares line ``peak = fixed + per_sample × batch``; ``residuals``: measured
    minus predicted bytes per point; ``budget_bytes``; ``largest_batch``: the largest integer batch whose
    predicted peak ≤ the budget (0: not even batch 1 fits; None: the peak does not grow with the batch, so the
    line sets no limit); ``predicted_bytes``: the line at ``largest_batch``."""

    points: tuple[tuple[int, int], ...]
    fixed_bytes: float
    per_sample_bytes: float
    residuals: tuple[float, ...]
    budget_bytes: int
    largest_batch: int | None

    def predict(self, batch: int) -> float:
        """The line's peak bytes at ``batch``."""
        return self.fixed_bytes + self.per_sample_bytes * batch

    @property
    def predicted_bytes(self) -> float | None:
        return None if self.largest_batch is None else self.predict(self.largest_batch)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, and ``predicted_bytes``."""
        return {"budget_bytes": self.budget_bytes, "largest_batch": self.largest_batch,
                "fixed_bytes": self.fixed_bytes, "per_sample_bytes": self.per_sample_bytes,
                "points": [list(p) for p in self.points], "residuals": list(self.residuals),
                "predicted_bytes": self.predicted_bytes}


def largest_batch(points: Iterable[tuple[int, int]], budget_bytes: int) -> BatchBudget:
    """Fits ``points`` (``(batch, peak bytes)``, at least two distinct batch sizes ≥ 1) and answers for
    ``budget_bytes`` (see :class:`BatchBudget`). Pure arithmetic, exact (fractions) until the fields' floats.

    Raises:
        ValueError: fewer than two distinct batch sizes, a batch < 1, or a budget < 1.
    """
    pts = tuple((int(b), int(p)) for b, p in points)
    if len({b for b, _ in pts}) < 2 or any(b < 1 for b, _ in pts):
        raise ValueError(f"points={pts!r}: the fit needs peaks at two or more distinct batch sizes >= 1")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive int (parse_bytes('4GiB'))")
    n = len(pts)
    mean_b, mean_p = Fraction(sum(b for b, _ in pts), n), Fraction(sum(p for _, p in pts), n)
    slope = sum((b - mean_b) * (p - mean_p) for b, p in pts) / sum((b - mean_b) ** 2 for b, _ in pts)
    fixed = mean_p - slope * mean_b
    if slope <= 0:
        batch = None
    else:
        batch = max(0, math.floor((budget_bytes - fixed) / slope))
    return BatchBudget(points=pts, fixed_bytes=float(fixed), per_sample_bytes=float(slope),
                       residuals=tuple(float(p - fixed - slope * b) for b, p in pts),
                       budget_bytes=budget_bytes, largest_batch=batch)


def fit_batch_budget(measure: Callable[[int], int], batches: Iterable[int], budget: str | int) -> BatchBudget:
    """Calls ``measure(batch)`` (a step's peak live bytes at that batch size, e.g.
    :attr:`mixprec.memory.live.PeakLive.total`) at each of ``batches`` (two or three sizes) and fits them
    against ``budget`` (bytes, or text for :func:`parse_bytes`). No host sync of its own (``measure``'s).

    Raises:
        ValueError: ``budget`` is not a size, or ``batches`` has fewer than two distinct sizes >= 1.
    """
    budget_bytes = parse_bytes(budget, name="budget")
    return largest_batch([(b, measure(b)) for b in batches], budget_bytes)
