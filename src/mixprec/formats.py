"""Floating-point formats as data: torch dtypes, element formats from their bit fields, block formats.

Three kinds of format live here, as frozen data (the code that quantizes to the block formats is
:mod:`mixprec.blockscale`):

* :class:`Format`: a torch dtype and its limits (``torch.finfo``), below;
* :class:`ElementFormat`: a small float defined by its bit fields (sign, exponent, mantissa, bias and which
  encodings are special), for the elements of block-scaled formats: FP4 E2M1, FP6 E2M3 / E3M2 (no torch
  dtype) and FP8 E4M3 / E5M2 (torch's ``float8_e4m3fn`` / ``float8_e5m2``); limits are computed from the
  fields (OCP Microscaling Formats (MX) v1.0, section 5.3, tables of the FP8/FP6/FP4 element formats);
* :class:`BlockFormat`: blocks of elements along the last dim sharing one scale: MXFP8/MXFP6/MXFP4 (OCP MX v1.0,
  32 elements, an E8M0 power-of-two scale) and NVFP4 (16 E2M1 elements, an E4M3 scale, and an fp32 scale per
  tensor); presets in :data:`BLOCK_FORMATS`, looked up by :func:`get_block_format`.

A :class:`Format` exposes its limits:

===================  ==========================================================
``max``              largest finite value (``torch.finfo(dtype).max``)
``smallest_normal``  smallest positive normal (``torch.finfo(dtype).smallest_normal``)
``eps``              spacing between 1.0 and the next value, ``2**-mantissa_bits``
``smallest_subnormal``  ``smallest_normal * eps`` (the spacing of the subnormal range)
===================  ==========================================================

``eps`` comes from ``torch.finfo`` for the 16- and 32-bit formats. For the 8-bit
formats it is read off the format itself (the next representable value above 1.0,
found by enumerating all 256 bit patterns), because ``torch.finfo(float8_e5m2fnuz).eps``
reports 0.125 while the format's real spacing at 1.0 is 0.25 (2 mantissa bits); the
tests pin both facts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["Format", "FORMATS", "get_format", "ElementFormat", "ELEMENT_FORMATS", "BlockFormat", "BLOCK_FORMATS",
           "get_block_format"]


@functools.cache
def _fp8_spacing_at_one(dtype: torch.dtype) -> float:
    """Exact ``next_above(1.0) - 1.0`` for an 8-bit float dtype, by enumeration."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    above_one = values[torch.isfinite(values) & (values > 1.0)]
    return float(above_one.min().item()) - 1.0


@dataclass(frozen=True)
class Format:
    """A floating-point format: a short name and the torch dtype that stores it.

    All limits are Python floats derived from the dtype (see the module docstring).
    """

    name: str
    dtype: torch.dtype

    @property
    def bits(self) -> int:
        return torch.finfo(self.dtype).bits

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def smallest_normal(self) -> float:
        return float(torch.finfo(self.dtype).smallest_normal)

    @property
    def eps(self) -> float:
        if self.bits == 8:
            return _fp8_spacing_at_one(self.dtype)
        return float(torch.finfo(self.dtype).eps)

    @property
    def mantissa_bits(self) -> int:
        return int(round(-math.log2(self.eps)))

    @property
    def smallest_subnormal(self) -> float:
        return self.smallest_normal * self.eps

    def ulp(self, x: torch.Tensor) -> torch.Tensor:
        """Spacing of this format at each element of ``x`` (elementwise, fp32 tensor).

        For ``|x|`` in ``[2**e, 2**(e+1))`` with ``2**e >= smallest_normal`` the spacing is
        ``2**e * eps``; below the normal range it is ``smallest_subnormal``. The result is a
        power of two, exact in fp32 for every format here (fp32 subnormals included).
        Shape and device of ``x``; no host sync.
        """
        x_fp32 = x.detach().to(torch.float32).abs()
        _, exponent = torch.frexp(x_fp32)  # x = m * 2**exponent, m in [0.5, 1)
        spacing = torch.ldexp(torch.full_like(x_fp32, self.eps), exponent - 1)
        return torch.clamp(spacing, min=self.smallest_subnormal).where(
            x_fp32 >= self.smallest_normal, torch.full_like(x_fp32, self.smallest_subnormal)
        )

    def __str__(self) -> str:
        return self.name


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp32", torch.float32),
        Format("bf16", torch.bfloat16),
        Format("fp16", torch.float16),
        Format("e4m3fn", torch.float8_e4m3fn),
        Format("e4m3fnuz", torch.float8_e4m3fnuz),
        Format("e5m2", torch.float8_e5m2),
        Format("e5m2fnuz", torch.float8_e5m2fnuz),
    )
}

_ALIASES = {
    "float32": "fp32", "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "e4m3": "e4m3fn", "float8_e4m3fn": "e4m3fn", "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2": "e5m2", "float8_e5m2fnuz": "e5m2fnuz",
}


def get_format(spec: str | torch.dtype | Format) -> Format:
    """Look a format up by name (``"bf16"``, ``"e4m3"``, ``"float16"``...) or torch dtype.

    Raises:
        ValueError: unknown name or dtype; the message lists the known formats.
    """
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype):
        for fmt in FORMATS.values():
            if fmt.dtype == spec:
                return fmt
        raise ValueError(f"format {spec!r} is not supported; known dtypes: "
                         f"{[str(f.dtype) for f in FORMATS.values()]}")
    if isinstance(spec, str):
        key = spec.strip().lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"format {spec!r} is not known; choose one of {sorted(FORMATS)} "
                     f"(aliases: {sorted(_ALIASES)})")


# ---------------------------------------------------------------------- element formats (bit fields)
_SPECIALS = ("none", "nan", "inf_nan")


@dataclass(frozen=True)
class ElementFormat:
    """A sign / exponent / mantissa float of at most 8 bits, defined by its bit fields.

    A code ``s eee mmm`` (``exponent_bits`` e's, ``mantissa_bits`` m's) is worth
    ``(-1)**s * 2**(E - bias) * (1 + M / 2**m)`` for an exponent field ``E > 0`` and
    ``(-1)**s * 2**(1 - bias) * (M / 2**m)`` for ``E == 0`` (subnormals, zeros of both signs). ``specials``
    says which codes are not numbers (OCP MX v1.0 section 5.3; OCP 8-bit floating point (OFP8) v1.0):

    ============  ====================================================  ==================
    ``specials``  special codes                                         formats
    ============  ====================================================  ==================
    ``"none"``    none: every code is a finite number                   FP4 E2M1, FP6 E2M3, FP6 E3M2
    ``"nan"``     ``s 1111 111`` is NaN; no infinity                    FP8 E4M3 (``float8_e4m3fn``)
    ``"inf_nan"`` exponent field all ones: infinity (M = 0) or NaN      FP8 E5M2 (``float8_e5m2``)
    ============  ====================================================  ==================

    All limits are exact powers of two or short sums of them (Python floats, exact in fp32); ``dtype`` is
    torch's dtype for the format where torch has one (None for FP4/FP6), which the tests check the limits
    against (``torch.finfo``).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.specials not in _SPECIALS:
            raise ValueError(f"ElementFormat {self.name!r}: specials={self.specials!r} is not one of {_SPECIALS}")
        if not (1 <= self.exponent_bits <= 5 and 0 <= self.mantissa_bits <= 3 and self.bits <= 8):
            raise ValueError(f"ElementFormat {self.name!r}: exponent_bits={self.exponent_bits}, mantissa_bits="
                             f"{self.mantissa_bits}: allowed are 1..5 exponent and 0..3 mantissa bits, 8 bits in all")

    @property
    def bits(self) -> int:
        """Bits per code: sign, exponent and mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def emax(self) -> int:
        """Exponent of the largest normal binade (the MX spec's ``emax_elem``: 2 for E2M1, 8 for E4M3)."""
        top_field = 2 ** self.exponent_bits - 1 - (1 if self.specials == "inf_nan" else 0)
        return top_field - self.bias

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade, ``1 - bias`` (subnormals share its spacing)."""
        return 1 - self.bias

    @property
    def max_normal(self) -> float:
        """Largest finite value: the top binade's largest mantissa (E4M3: ``1.110b * 2**8 = 448``, its ``111``
        mantissa being NaN)."""
        top_mantissa = 2 ** self.mantissa_bits - (2 if self.specials == "nan" else 1)
        return math.ldexp(1.0 + top_mantissa / 2 ** self.mantissa_bits, self.emax)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2**emin``."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, ``2**(emin - mantissa_bits)``: the spacing of the subnormals."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        """Whether codes for ±infinity exist (E5M2 only)."""
        return self.specials == "inf_nan"

    @property
    def has_nan(self) -> bool:
        """Whether NaN codes exist (the FP8 formats; FP4/FP6 have none)."""
        return self.specials != "none"

    def __str__(self) -> str:
        return self.name


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        ElementFormat("e2m1", 2, 1, 1, "none"),
        ElementFormat("e2m3", 2, 3, 1, "none"),
        ElementFormat("e3m2", 3, 2, 3, "none"),
        ElementFormat("e4m3", 4, 3, 7, "nan", torch.float8_e4m3fn),
        ElementFormat("e5m2", 5, 2, 15, "inf_nan", torch.float8_e5m2),
    )
}


# ---------------------------------------------------------------------- block formats
_SCALE_ROUNDINGS = {"e8m0": ("floor", "rceil"), "e4m3": ("nearest",)}


@dataclass(frozen=True)
class BlockFormat:
    """Blocks of ``block_size`` consecutive elements along the last dim, each block sharing one scale.

    ``x ~= element * scale`` (times ``tensor_scale`` where there is one). The fields:

    * ``element``: the :class:`ElementFormat` of the elements.
    * ``scale_format``: ``"e8m0"`` (MX: a power of two ``2**(code - 127)``, code 0..254, code 255 NaN; OCP MX
      v1.0 section 5.4.1) or ``"e4m3"`` (NVFP4: an unsigned E4M3 value).
    * ``scale_rounding``: how the block scale is chosen from the block's ``amax = max |x|``:

      - ``"floor"`` (E8M0; the OCP spec's conversion, MX v1.0 section 6.3):
        ``2**(floor(log2(amax)) - element.emax)``, so the largest element lands in the top binade; values in
        ``(element.max_normal, 2**(element.emax + 1))`` times the scale saturate.
      - ``"rceil"`` (E8M0; NVIDIA cuBLAS's "round up" of ``amax / max_normal`` to a power of two, torchao's
        ``ScaleCalculationMode.RCEIL``): the smallest ``2**e >= amax / element.max_normal``, so no element
        saturates, at the cost of a binade of resolution in some blocks.
      - ``"nearest"`` (E4M3): ``amax / element.max_normal`` in units of the tensor scale, rounded to nearest
        (ties to even) in E4M3, saturating at 448.

      Both E8M0 modes clamp the exponent to E8M0's range ``[-127, 127]``.
    * ``tensor_scale``: True for NVFP4: an fp32 scale per tensor, ``amax(tensor) / (element.max_normal * 448)``,
      which the E4M3 block scales are in units of.
    * ``saturate``: elements beyond ``±element.max_normal`` clamp to it (the MX spec's conversion "clamping normal
      numbers"; the only mode for FP4/FP6, which have no inf or NaN). False (FP8 elements only) overflows to
      inf (E5M2) or NaN (E4M3) as OFP8's non-saturating conversion does.

    The exact algorithms, NaN and inf rules are :func:`mixprec.blockscale.quantize`'s.

    Raises:
        ValueError: a block size below 1, an unknown scale format or scale rounding for it, ``tensor_scale``
            with E8M0 scales, or ``saturate=False`` for an element format without inf or NaN.
    """

    name: str
    element: ElementFormat
    block_size: int
    scale_format: str
    scale_rounding: str
    tensor_scale: bool = False
    saturate: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"BlockFormat {self.name!r}: block_size={self.block_size!r} must be an int >= 1")
        if self.scale_format not in _SCALE_ROUNDINGS:
            raise ValueError(f"BlockFormat {self.name!r}: scale_format={self.scale_format!r} is not one of "
                             f"{sorted(_SCALE_ROUNDINGS)}")
        allowed = _SCALE_ROUNDINGS[self.scale_format]
        if self.scale_rounding not in allowed:
            raise ValueError(f"BlockFormat {self.name!r}: scale_rounding={self.scale_rounding!r} is not allowed "
                             f"with {self.scale_format} scales; allowed: {allowed}")
        if self.tensor_scale and self.scale_format == "e8m0":
            raise ValueError(f"BlockFormat {self.name!r}: tensor_scale=True needs e4m3 block scales, not e8m0")
        if not self.saturate and not self.element.has_nan:
            raise ValueError(f"BlockFormat {self.name!r}: saturate=False with {self.element.name} elements, which "
                             f"have no inf or NaN to overflow to; allowed only for e4m3 and e5m2")

    @property
    def is_mx(self) -> bool:
        """True for the OCP MX formats (E8M0 scales)."""
        return self.scale_format == "e8m0"

    def __str__(self) -> str:
        return self.name


def _mx(name: str, element: str) -> BlockFormat:
    return BlockFormat(name, ELEMENT_FORMATS[element], 32, "e8m0", "floor")


BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        _mx("mxfp8_e4m3", "e4m3"),
        _mx("mxfp8_e5m2", "e5m2"),
        _mx("mxfp6_e2m3", "e2m3"),
        _mx("mxfp6_e3m2", "e3m2"),
        _mx("mxfp4_e2m1", "e2m1"),
        BlockFormat("nvfp4", ELEMENT_FORMATS["e2m1"], 16, "e4m3", "nearest", tensor_scale=True),
    )
}

_BLOCK_ALIASES = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1"}


def get_block_format(spec: str | BlockFormat) -> BlockFormat:
    """A block format by name (``"mxfp8_e4m3"``, ``"nvfp4"``; ``-`` for ``_`` and ``"mxfp8"``/``"mxfp4"`` accepted),
    or the :class:`BlockFormat` itself. Variants are ``dataclasses.replace(get_block_format("mxfp8_e4m3"),
    scale_rounding="rceil")``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
        TypeError: ``spec`` neither a string nor a BlockFormat.
    """
    if isinstance(spec, BlockFormat):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"get_block_format: spec={spec!r} must be a block format's name or a BlockFormat")
    key = spec.strip().lower().replace("-", "_")
    key = _BLOCK_ALIASES.get(key, key)
    if key not in BLOCK_FORMATS:
        raise ValueError(f"block format {spec!r} is not known; choose one of {sorted(BLOCK_FORMATS)} "
                         f"(aliases: {sorted(_BLOCK_ALIASES)})")
    return BLOCK_FORMATS[key]
