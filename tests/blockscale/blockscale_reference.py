"""An independent reference for the block formats, written from the specs' text in plain Python.

Nothing here imports mixprec. Each element format is its bit fields (OCP Microscaling Formats (MX) v1.0,
section 5.3, and OCP 8-bit floating point (OFP8) v1.0 for E4M3 / E5M2); every code is enumerated and its value
computed with ``fractions.Fraction``; rounding picks the nearest enumerated value, a tie going to the one with
the even mantissa (the code's lowest bit 0), IEEE 754's roundTiesToEven. MX's conversion is the spec's
Algorithm 1 (section 6.3) on exact rationals; NVFP4's fp32 steps (the tensor scale, the block scale in units of
it, the element division) are numpy float32 operations, which IEEE 754 rounds correctly; the conversions to
E4M3 and E2M1 are again the enumeration.

Values are returned as Python floats (exact: every result is an fp32 value), which keep the sign of zero.
"""

from __future__ import annotations

import bisect
import functools
import math
from fractions import Fraction

import numpy as np

NAN = float("nan")
INF = float("inf")

# name: (exponent bits, mantissa bits, bias, which codes are special), from the specs' tables
SPECS = {
    "e2m1": (2, 1, 1, "none"),      # MX v1.0 FP4: no inf, no NaN
    "e2m3": (2, 3, 1, "none"),      # MX v1.0 FP6 E2M3
    "e3m2": (3, 2, 3, "none"),      # MX v1.0 FP6 E3M2
    "e4m3": (4, 3, 7, "nan"),       # OFP8 E4M3: S.1111.111 is NaN, no inf
    "e5m2": (5, 2, 15, "inf_nan"),  # OFP8 E5M2: IEEE-like, exponent 11111 is inf / NaN
}
# the MX spec's emax_elem and max normal per element format (its table of element formats), as literals
EMAX = {"e2m1": 2, "e2m3": 2, "e3m2": 4, "e4m3": 8, "e5m2": 15}
MAX_NORMAL = {"e2m1": 6.0, "e2m3": 7.5, "e3m2": 28.0, "e4m3": 448.0, "e5m2": 57344.0}


def code_value(name: str, code: int) -> Fraction | float:
    """The value of one code: a Fraction (zeros unsigned), or NaN / ±inf as floats."""
    e_bits, m_bits, bias, specials = SPECS[name]
    sign = -1 if code >> (e_bits + m_bits) & 1 else 1
    field = code >> m_bits & (2 ** e_bits - 1)
    mantissa = code & (2 ** m_bits - 1)
    if specials == "nan" and field == 2 ** e_bits - 1 and mantissa == 2 ** m_bits - 1:
        return NAN
    if specials == "inf_nan" and field == 2 ** e_bits - 1:
        return sign * INF if mantissa == 0 else NAN
    if field == 0:
        return sign * Fraction(2) ** (1 - bias) * Fraction(mantissa, 2 ** m_bits)
    return sign * Fraction(2) ** (field - bias) * (1 + Fraction(mantissa, 2 ** m_bits))


@functools.cache
def grid(name: str) -> tuple[list[Fraction], list[int]]:
    """The non-negative finite values (ascending) and their codes (sign bit clear)."""
    e_bits, m_bits, _, _ = SPECS[name]
    pairs = [(code_value(name, c), c) for c in range(2 ** (e_bits + m_bits))]
    pairs = sorted((v, c) for v, c in pairs if isinstance(v, Fraction))
    return [v for v, _ in pairs], [c for _, c in pairs]


def _overflow(name: str) -> float:
    return INF if SPECS[name][3] == "inf_nan" else NAN


def _neighbours(name: str, a: Fraction) -> tuple[Fraction, int, Fraction, int]:
    """(lo, lo's code, hi, hi's code) around ``a >= 0``; above the largest value, hi is the value the grid would
    have next (largest + its binade's spacing), with the code parity that value would have."""
    values, codes = grid(name)
    top, top_code = values[-1], codes[-1]
    if a >= top:
        spacing = Fraction(2) ** (EMAX[name] - SPECS[name][1])
        return top, top_code, top + spacing, top_code + 1
    i = bisect.bisect_right(values, a)
    return values[i - 1], codes[i - 1], values[i], codes[i]


def _finish(name: str, magnitude: Fraction | float, negative: bool, saturate: bool) -> float:
    top = grid(name)[0][-1]
    if magnitude > top:
        magnitude = top if saturate else _overflow(name)
    value = float(magnitude)
    return -value if negative else value


def round_nearest(x: float | Fraction, name: str, saturate: bool = True) -> float:
    """``x`` rounded to nearest, ties to the even code; beyond the largest value: saturate or overflow (OFP8)."""
    if isinstance(x, float) and math.isnan(x):
        return NAN
    negative = (math.copysign(1.0, x) < 0) if isinstance(x, float) else x < 0
    if isinstance(x, float) and math.isinf(x):
        return _finish(name, INF, negative, saturate)
    a = abs(Fraction(x))
    lo, lo_code, hi, hi_code = _neighbours(name, a)
    if a >= hi:
        return _finish(name, hi + 1, negative, saturate)      # beyond even the next grid value: overflows
    below, above = a - lo, hi - a
    pick_hi = above < below or (above == below and hi_code % 2 == 0)
    return _finish(name, hi if pick_hi else lo, negative, saturate)


def round_stochastic(x: float, name: str, r: int, saturate: bool = True) -> float:
    """``x`` rounded down or up to its neighbours: up iff ``r < floor(f * 2**32)``, ``f`` the exact fraction of
    the gap (``r`` an unsigned 32-bit integer)."""
    if math.isnan(x):
        return NAN
    negative = math.copysign(1.0, x) < 0
    if math.isinf(x):
        return _finish(name, INF, negative, saturate)
    a = Fraction(abs(x))
    lo, _, hi, _ = _neighbours(name, a)
    if a >= hi:
        return _finish(name, hi + 1, negative, saturate)
    fraction = (a - lo) / (hi - lo)
    up = r < math.floor(fraction * 2 ** 32)
    return _finish(name, hi if up else lo, negative, saturate)


def code_of(value: float, name: str) -> int:
    """The code of a value of the format (NaN: the positive all-ones NaN code; FP4/FP6 have none: 0)."""
    e_bits, m_bits, _, specials = SPECS[name]
    sign_bit = 1 << (e_bits + m_bits)
    if math.isnan(value):
        return sign_bit - 1 if specials != "none" else 0
    if math.isinf(value):
        code = (2 ** e_bits - 1) << m_bits
    else:
        values, codes = grid(name)
        code = codes[values.index(Fraction(abs(value)))]
    return code | sign_bit if math.copysign(1.0, value) < 0 else code


# ---------------------------------------------------------------------- MX (OCP MX v1.0 section 6.3)
def _floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def mx_shared_exponent(block: list[float], element: str, rounding: str) -> int | None:
    """Algorithm 1's shared exponent, clamped to E8M0's [-127, 127]; None (the NaN scale) for a NaN / inf block.
    floor: floor(log2(amax)) - emax_elem. rceil: the smallest e with amax <= max_normal * 2**e."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return None
    amax = max(abs(Fraction(v)) for v in block)
    if amax == 0:
        return -127
    if rounding == "floor":
        e = _floor_log2(amax) - EMAX[element]
    else:
        e = _floor_log2(amax / Fraction(MAX_NORMAL[element]))
        if Fraction(MAX_NORMAL[element]) * Fraction(2) ** e < amax:
            e += 1
    return max(-127, min(127, e))


def mx_block(block: list[float], element: str, rounding: str = "floor", saturate: bool = True,
             bits: list[int] | None = None) -> tuple[int, list[int], list[float]]:
    """(E8M0 code, element codes, dequantized values) of one block; ``bits``: stochastic rounding's uint32s."""
    e = mx_shared_exponent(block, element, rounding)
    if e is None:
        return 255, [0] * len(block), [NAN] * len(block)
    codes, out = [], []
    for i, v in enumerate(block):
        scaled = math.ldexp(v, -e)   # exact in double: v is an fp32 value and |e| <= 127
        if bits is None:
            p = round_nearest(scaled, element, saturate)
        else:
            p = round_stochastic(scaled, element, bits[i], saturate)
        codes.append(code_of(p, element))
        out.append(math.ldexp(p, e))
    return e + 127, codes, out


# ---------------------------------------------------------------------- NVFP4
def nvfp4(x_rows: list[list[float]], block_size: int = 16, amax: float | None = None,
          bits: list[list[int]] | None = None) -> tuple[float, list[list[int]], list[list[int]], list[list[float]]]:
    """(tensor scale, block scale codes per row, element codes per row, dequantized per row) of a 2-D tensor.

    tensor scale s = fp32(amax / 2688), 1 if that is not finite and > 0, amax over finite |x| unless given; per block:
    q = fp32(fp32(amax / 6) / s), block scale b = E4M3(q) to nearest even, saturating; d = fp32(b * s);
    element = E2M1(fp32(x / d)) to nearest even, saturating (d == 0: a zero of x's sign);
    dequantized = fp32(fp32(element * b) * s). A block with a NaN or inf: NaN scale, codes 0, NaN values.
    ``bits``: stochastic rounding's uint32s per element (rows like ``x_rows``), for the elements only.
    """
    f32 = np.float32
    with np.errstate(all="ignore"):
        finite = [abs(v) for row in x_rows for v in row if math.isfinite(v)]
        s = f32(max(finite, default=0.0) if amax is None else amax) / f32(2688.0)
        s = s if (np.isfinite(s) and s > 0) else f32(1.0)
        scale_rows, code_rows, out_rows = [], [], []
        for r, row in enumerate(x_rows):
            scale_codes, codes, out = [], [], []
            for start in range(0, len(row), block_size):
                block = row[start:start + block_size]
                if not all(math.isfinite(v) for v in block):
                    scale_codes.append(0x7F)
                    codes += [0] * len(block)
                    out += [NAN] * len(block)
                    continue
                q = (f32(max(abs(v) for v in block)) / f32(6.0)) / s
                b = round_nearest(float(q), "e4m3", saturate=True)
                scale_codes.append(code_of(b, "e4m3"))
                d = f32(b) * s
                for i, v in enumerate(block, start):
                    scaled = float(f32(v) / d)
                    p = (math.copysign(0.0, v) if d == 0 else round_nearest(scaled, "e2m1") if bits is None
                         else round_stochastic(scaled, "e2m1", bits[r][i]))
                    codes.append(code_of(p, "e2m1"))
                    out.append(float((f32(p) * f32(b)) * s))
            scale_rows.append(scale_codes)
            code_rows.append(codes)
            out_rows.append(out)
    return float(s), scale_rows, code_rows, out_rows
