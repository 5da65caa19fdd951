"""fp32 values onto an element format's grid, and element codes to and from their values.

:func:`round_to_element` rounds fp32 tensors to the values an :class:`~mixprec.formats.ElementFormat` holds
(round to nearest, ties to even, or stochastically), returned as fp32; :func:`encode` turns such values into
the format's bit patterns (uint8, one code per byte, unpacked) and :func:`decode` back. All three are
elementwise fp32 / int32 tensor arithmetic: no table, no host sync, traceable by ``torch.compile``.

How a value is rounded (OCP MX v1.0 section 5.3's element formats; IEEE 754 rounding): ``a = |x|`` lies in the
binade ``e = floor(log2(a))``, clamped below to the format's ``emin`` (the subnormals share its spacing) and
above to its ``emax`` (larger values round past ``max_normal`` and then saturate or overflow); the grid spacing
there is ``ulp = 2**(e - mantissa_bits)``; ``a / ulp`` is exact in fp32 and rounds to an integer ``n``: to
nearest with ties to even (``torch.round``; an even ``n`` is an even mantissa) or, stochastically, up with
probability equal to the fraction of the gap. ``n * ulp`` is exact. The sign is restored afterwards (``-0.0``
stays ``-0.0``; a negative value rounding to zero gives ``-0.0``), and NaN stays NaN.
"""

from __future__ import annotations

import torch

from mixprec.formats import ElementFormat

__all__ = ["round_to_element", "encode", "decode", "pow2"]

_TWO_POW_32 = 2.0 ** 32


def pow2(exponent_int32: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` in fp32, exactly, built from the bits: int32 exponents in ``[-126, 127]``.

    Exponents outside that range are the caller's bug (no check: a check would be a host sync).
    """
    return torch.bitwise_left_shift(exponent_int32.to(torch.int32) + 127, 23).view(torch.float32)


def _binade(a_fp32: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` for normal fp32 ``a >= 0`` from its exponent field (int32; -127 for 0 and subnormals)."""
    return torch.bitwise_and(torch.bitwise_right_shift(a_fp32.view(torch.int32), 23), 0xFF) - 127


def _unsigned_bits(random_bits: torch.Tensor) -> torch.Tensor:
    """uint32 random bits as int64 in ``[0, 2**32)``: int32 bit patterns (mixprec's SR streams), uint32 or int64."""
    if random_bits.dtype == torch.int32:
        return random_bits.to(torch.int64).bitwise_and(0xFFFFFFFF)
    if random_bits.dtype in (torch.uint32, torch.int64):
        return random_bits.to(torch.int64)
    raise TypeError(f"random_bits has dtype {random_bits.dtype}; allowed: torch.int32 (uint32 bit patterns), "
                    f"torch.uint32 or torch.int64 holding values in [0, 2**32)")


def round_to_element(x_fp32: torch.Tensor, fmt: ElementFormat, *, saturate: bool = True,
                     random_bits: torch.Tensor | None = None) -> torch.Tensor:
    """``x_fp32`` rounded to the values of ``fmt``, as fp32 (same shape). See the module docstring.

    Args:
        x_fp32: a float32 tensor, any shape.
        fmt: the element format.
        saturate: values whose rounding lies beyond ``±fmt.max_normal`` (and ``±inf``) become ``±max_normal``;
            with False they become ``±inf`` (E5M2) or NaN (E4M3), OFP8's non-saturating conversion (refused
            for formats without inf or NaN).
        random_bits: None rounds to nearest, ties to even. A tensor of ``x_fp32``'s shape (int32 bit patterns,
            uint32, or int64 in ``[0, 2**32)``) rounds stochastically: ``a / ulp = n + f`` rounds up to ``n + 1``
            iff ``r < floor(f * 2**32)`` for that element's bits ``r``, i.e. with probability ``f`` (to 2**-32), so
            the expected value is the input for inputs within ``±max_normal`` (saturation is not unbiased).

    Raises:
        TypeError: ``x_fp32`` not float32, or ``random_bits`` of another dtype.
        ValueError: ``random_bits`` of another shape, or ``saturate=False`` for a format without inf/NaN.

    No host sync.
    """
    if x_fp32.dtype != torch.float32:
        raise TypeError(f"round_to_element: x_fp32 has dtype {x_fp32.dtype}; allowed: torch.float32")
    if not saturate and not fmt.has_nan:
        raise ValueError(f"round_to_element: saturate=False with {fmt.name}, which has no inf or NaN; "
                         f"use saturate=True")
    a = x_fp32.abs()
    exponent = _binade(a).clamp(min=fmt.emin, max=fmt.emax)
    ulp = pow2(exponent - fmt.mantissa_bits)
    t = a / ulp
    if random_bits is None:
        n = torch.round(t)
    else:
        if random_bits.shape != x_fp32.shape:
            raise ValueError(f"round_to_element: random_bits has shape {tuple(random_bits.shape)}; it must be "
                             f"x_fp32's {tuple(x_fp32.shape)}")
        whole = torch.floor(t)
        fraction = torch.where(torch.isfinite(t), t - whole, torch.zeros_like(t))
        threshold = torch.floor(fraction * _TWO_POW_32).to(torch.int64)
        n = whole + (_unsigned_bits(random_bits) < threshold).to(torch.float32)
    rounded = n * ulp
    beyond = rounded > fmt.max_normal
    if saturate:
        rounded = torch.where(beyond, torch.full_like(rounded, fmt.max_normal), rounded)
    else:
        overflow = float("inf") if fmt.has_inf else float("nan")
        rounded = torch.where(beyond, torch.full_like(rounded, overflow), rounded)
    return torch.where(torch.isnan(x_fp32), x_fp32, torch.copysign(rounded, x_fp32))


def encode(values_fp32: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """The codes (uint8 bit patterns ``s e..e m..m``, low ``fmt.bits`` bits) of values ``fmt`` holds exactly.

    ``values_fp32``: fp32, any shape, each value one :func:`round_to_element` returns for ``fmt`` (another
    value gives a meaningless code; not checked, a check would sync). ``-0.0`` encodes with the sign bit set.
    NaN encodes as ``fmt``'s NaN (all ones but the sign; E5M2: ``0x7F``) and ``±inf`` as E5M2's infinities;
    for a format without them (FP4/FP6) they encode as ``0`` (callers keep such blocks NaN through their scale).
    Same shape; no host sync.

    Raises:
        TypeError: ``values_fp32`` not float32.
    """
    if values_fp32.dtype != torch.float32:
        raise TypeError(f"encode: values_fp32 has dtype {values_fp32.dtype}; allowed: torch.float32")
    a = values_fp32.abs()
    normal = a >= fmt.min_normal
    exponent = _binade(a).clamp(min=fmt.emin)
    significand = torch.where(torch.isfinite(a), a / pow2(exponent - fmt.mantissa_bits), torch.zeros_like(a))
    implicit = torch.where(normal, float(2 ** fmt.mantissa_bits), 0.0)
    mantissa = (significand - implicit).to(torch.int32)
    field = torch.where(normal, exponent + fmt.bias, torch.zeros_like(exponent))
    code = torch.bitwise_or(torch.bitwise_left_shift(field, fmt.mantissa_bits), mantissa)
    all_ones = 2 ** (fmt.exponent_bits + fmt.mantissa_bits) - 1
    inf_code = (2 ** fmt.exponent_bits - 1) << fmt.mantissa_bits if fmt.has_inf else 0
    code = torch.where(torch.isinf(a), torch.full_like(code, inf_code), code)
    code = torch.where(torch.isnan(a), torch.full_like(code, all_ones if fmt.has_nan else 0), code)
    sign = torch.signbit(values_fp32) & ~torch.isnan(values_fp32)
    code = torch.where(sign, torch.bitwise_or(code, 1 << (fmt.bits - 1)), code)
    return code.to(torch.uint8)


def decode(codes_uint8: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """fp32 values of ``fmt`` codes (uint8, low ``fmt.bits`` bits used): the bit-field formula of
    :class:`~mixprec.formats.ElementFormat`, exact in fp32. NaN and inf codes decode to NaN and ±inf.
    Same shape; no host sync.
    """
    if codes_uint8.dtype != torch.uint8:
        raise TypeError(f"decode: codes_uint8 has dtype {codes_uint8.dtype}; allowed: torch.uint8")
    code = codes_uint8.to(torch.int32)
    m = fmt.mantissa_bits
    mantissa = torch.bitwise_and(code, 2 ** m - 1).to(torch.float32)
    field = torch.bitwise_and(torch.bitwise_right_shift(code, m), 2 ** fmt.exponent_bits - 1)
    normal = field > 0
    implicit = torch.where(normal, float(2 ** m), 0.0)
    exponent = torch.where(normal, field - fmt.bias, torch.full_like(field, fmt.emin))
    magnitude = (implicit + mantissa) * pow2(exponent - m)
    top = field == 2 ** fmt.exponent_bits - 1
    if fmt.specials == "nan":
        magnitude = torch.where(top & (mantissa == 2 ** m - 1), float("nan"), magnitude)
    elif fmt.specials == "inf_nan":
        magnitude = torch.where(top, torch.where(mantissa == 0, float("inf"), float("nan")), magnitude)
    negative = torch.bitwise_and(code, 1 << (fmt.bits - 1)) != 0
    return torch.where(negative, -magnitude, magnitude)
