"""Floating-point formats as data: limits derived from ``torch.finfo``, never literals.

A :class:`Format` names a torch dtype and exposes its limits:

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

__all__ = ["Format", "FORMATS", "get_format"]


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
