"""Numerics diagnostics: where values leave a format's range, and what policy follows.

:func:`locate_nonfinite` names the first module whose output went non-finite (the one place
that does; :class:`mixprec.Guard` and the inspector call it). :func:`inspect` measures every
module and parameter against each format and :meth:`NumericsReport.recommend` turns the
measurements into a :class:`Recommendation`; block formats (``formats=("nvfp4",)``) are measured per linear and
GEMM operand, and the recommendation names the linears to keep in bf16 under each (``Recommendation.block``).
"""

from mixprec.numerics.advice import Flag, Recommendation
from mixprec.numerics.inspect import inspect
from mixprec.numerics.localise import NonFiniteReport, locate_nonfinite
from mixprec.numerics.report import NumericsReport

__all__ = ["Flag", "NonFiniteReport", "NumericsReport", "Recommendation", "inspect", "locate_nonfinite"]
