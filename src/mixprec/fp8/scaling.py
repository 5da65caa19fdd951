"""Scaled fp8 casts as a chain of small pure functions: ``amax -> scale_from_amax -> to_fp8``.

The scale convention (direction, formula, shapes) is stated once, on :class:`ScaledFloat8`.
Every limit comes from :mod:`mixprec.formats` (``Format.max`` is ``torch.finfo(dtype).max``:
448 for e4m3fn, 240 for e4m3fnuz, 57344 for e5m2/e5m2fnuz); no literal format limit appears
here. All functions run under ``no_grad``, compute in fp32 and cause no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.formats import Format, get_format

__all__ = ["AMAX_FLOOR", "ScaledFloat8", "amax", "scale_from_amax", "to_fp8", "from_fp8"]

# amax is clamped to at least this before dividing, so a block of zeros (padding, dead rows) or
# of fp32 subnormals (1e-40) gets a finite scale instead of fmt.max / 0 = inf. With
# it the largest possible scale is 57344 / 1e-12 ~ 6e16, far inside fp32; inputs that small
# quantise to exact zeros. Same value as torchao's float8 EPS.
AMAX_FLOOR = 1e-12

_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ScaledFloat8:
    """An fp8 tensor and the scale that produced it. **The scale convention of mixprec.fp8.**

    *Multiply to reach fp8, divide to come back*::

        data  = saturate(x_hp * scale)            # stored in an fp8 dtype
        x_hp ~= data / scale                      # from_fp8(data, scale)
        scale = fmt.max / max(amax, AMAX_FLOOR) / 2**margin      # fp32; finite and > 0 for finite amax

    so the largest ``|x_hp|`` lands on ``fmt.max / 2**margin``. ``data`` is 2-D ``(R, C)``;
    ``scale`` is an fp32 tensor that broadcasts against it:

    ===========================================  =========
    granularity                                   ``scale``
    ===========================================  =========
    tensorwise, delayed (one amax per tensor)     ``()``
    rowwise, amax over ``dim=-1`` (each row)      ``(R, 1)``
    column-wise, amax over ``dim=0`` (each col)   ``(1, C)``
    ===========================================  =========

    A GEMM contracts along the axis each scale was taken over (``scale`` is constant along the
    contraction), which is why rowwise recipes cast each operand again, along the other axis,
    for the backward GEMMs. ``torch._scaled_mm`` wants the inverse (its ``scale_a`` multiplies
    the fp8 operand back to high precision); only ``fp8/linear.py`` calls it and passes
    ``1 / scale``.
    """

    data: torch.Tensor   # (R, C), an fp8 dtype
    scale: torch.Tensor  # (), (R, 1) or (1, C), fp32

    def t(self) -> "ScaledFloat8":
        """Transpose data and scale together: ``(R, C)`` -> ``(C, R)`` (a view; no copy)."""
        return ScaledFloat8(self.data.t(), self.scale.t())

    def dequantize(self) -> torch.Tensor:
        """``data / scale`` in fp32 (same shape as ``data``)."""
        return from_fp8(self.data, self.scale)


@torch.no_grad()
def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Largest ``|x|`` in fp32: shape ``()`` for ``dim=None``, else reduced along ``dim`` with
    ``keepdim`` (``(M, 1)`` for ``dim=-1`` of an ``(M, K)`` tensor). NaN in, NaN out.

    Exact: the max of a 16/32-bit tensor is one of its values, representable in fp32. One pass
    (``aminmax``) instead of ``abs`` then ``amax``.
    """
    x_min, x_max = torch.aminmax(x.detach()) if dim is None else torch.aminmax(x.detach(), dim=dim, keepdim=True)
    return torch.maximum(x_min.neg(), x_max).to(torch.float32)


@torch.no_grad()
def scale_from_amax(amax: torch.Tensor, fmt: Format | torch.dtype | str, margin: int = 0) -> torch.Tensor:
    """``fmt.max / max(amax, AMAX_FLOOR) / 2**margin`` in fp32 (see :class:`ScaledFloat8`).

    Computed in fp32 because the scale multiplies fp32 values in :func:`to_fp8` and every
    amax of a 16/32-bit tensor is exact there; the floor keeps ``0`` and subnormal amax finite
    and the final clamp to the fp32 max guards any future floor change. A non-finite amax
    (an overflow upstream) gives a zero or NaN scale, so the cast yields NaN and the
    engine's finite check sees it, rather than hiding the overflow.
    """
    fmt = get_format(fmt)
    if margin < 0:
        raise ValueError(f"scale_from_amax: {margin=} must be >= 0 (powers of two of headroom)")
    amax_floored = amax.to(torch.float32).clamp(min=AMAX_FLOOR)
    scale = (fmt.max / 2.0 ** margin) / amax_floored
    return scale.clamp(max=_FP32_MAX)


@torch.no_grad()
def to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: Format | torch.dtype | str) -> torch.Tensor:
    """Saturating cast of ``x * scale`` to ``fmt`` (see :class:`ScaledFloat8` for the convention).

    Every value beyond ``±fmt.max`` (a stale delayed scale, rounding at the top, ``±inf``)
    clamps to ``±fmt.max`` in every format; NaN stays NaN. torch's own cast is not uniform
    (torch 2.13 CPU: e4m3fnuz overflows to NaN, e5m2 to inf, e4m3fn saturates), so the clamp
    is explicit. An overflow upstream is still not disguised: it is in the amax, and an
    infinite amax makes the scale 0 (:func:`scale_from_amax`; ``inf * 0 = NaN``) or, in delayed
    scaling, NaN -- checked once per tensor on the scale, not per element here.
    """
    fmt = get_format(fmt)
    x_fp32 = x.detach().to(torch.float32)
    x_clamped = (x_fp32 * scale).clamp(min=-fmt.max, max=fmt.max)
    return x_clamped.to(fmt.dtype)


@torch.no_grad()
def from_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x_fp8 / scale`` in fp32: the inverse of :func:`to_fp8` up to its rounding.

    Division (not multiplication by ``1 / scale``) so each value is correctly rounded once.
    """
    return x_fp8.to(torch.float32) / scale
