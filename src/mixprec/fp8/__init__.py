"""fp8 training: scaled float8 linears with current (tensorwise, rowwise) or delayed scaling.

The scale convention is stated once, on :class:`ScaledFloat8`: multiply to reach fp8,
``scale = fmt.max / max(amax, AMAX_FLOOR) / 2**margin`` in fp32, shape ``()`` per tensor or
``(M, 1)`` per row. Pipeline: :func:`amax` -> :func:`scale_from_amax` -> :func:`to_fp8`
(saturating) / :func:`from_fp8`. :class:`Float8Linear` runs its three GEMMs on fp8 operands,
through ``torch._scaled_mm`` where fp8 hardware runs it (:func:`fp8_available`) and an exact
emulation elsewhere; :func:`convert_to_float8` swaps a model's eligible linears in place,
:func:`revert_float8` swaps them back.
"""

from mixprec.fp8.convert import ConversionReport, convert_to_float8, revert_float8
from mixprec.fp8.linear import Float8Linear, clamped_scales, fp8_available
from mixprec.fp8.recipes import Float8Recipe
from mixprec.fp8.scaling import AMAX_FLOOR, ScaledFloat8, amax, from_fp8, scale_from_amax, to_fp8

__all__ = [
    "AMAX_FLOOR",
    "ConversionReport",
    "Float8Linear",
    "Float8Recipe",
    "ScaledFloat8",
    "amax",
    "clamped_scales",
    "convert_to_float8",
    "fp8_available",
    "from_fp8",
    "revert_float8",
    "scale_from_amax",
    "to_fp8",
]
