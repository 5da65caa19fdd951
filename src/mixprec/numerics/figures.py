"""Numbers as the numerics advice and report write them in text.

Shared by :mod:`mixprec.numerics.advice` (the reasons of a recommendation, the flags) and
:mod:`mixprec.numerics.report` (the markdown tables), so both print a value the same way.
"""

from __future__ import annotations

import math

__all__ = ["count", "num", "pct", "pow2"]


def num(x: float | None, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits; ``"inf"``/``"nan"`` as such, ``"-"`` for None."""
    if x is None:
        return "-"
    return str(x) if not math.isfinite(x) else f"{x:.{digits}g}"


def count(n: int, noun: str) -> str:
    """``"1 module"``, ``"3 modules"``: ``n`` and ``noun``, plural unless ``n == 1``."""
    return f"{n} {noun}{'s' * (n != 1)}"


def pct(x: float) -> str:
    """A fraction in [0, 1] as a percentage to 3 significant digits (``"0"`` for exactly zero)."""
    return "0" if x == 0 else f"{100 * x:.3g}%"


def pow2(x: float | None) -> str:
    """A positive power of two as ``"2^k"`` (``2^-3`` too); any other value as :func:`num` writes it."""
    if x is not None and x > 0 and math.isfinite(x) and math.log2(x) == int(math.log2(x)):
        return f"2^{int(math.log2(x))}"
    return num(x)
