"""Numerics diagnostics: where values leave a format's range.

:func:`locate_nonfinite` names the first module whose output went non-finite (the one place
that does; :class:`mixprec.Guard` calls it).
"""

from mixprec.numerics.localise import NonFiniteReport, locate_nonfinite

__all__ = ["NonFiniteReport", "locate_nonfinite"]

# The inspector and precision advisor: per-layer numerics in each format, and a policy from them.
from mixprec.numerics.advice import Flag, Recommendation  # noqa: E402
from mixprec.numerics.inspect import inspect  # noqa: E402
from mixprec.numerics.report import NumericsReport  # noqa: E402

__all__ += ["Flag", "NumericsReport", "Recommendation", "inspect"]
