"""Block scales: MX's E8M0 shared exponents, NVFP4's per-tensor fp32 scale and E4M3 block scales.

Each function takes fp32 amaxes (``max |x|`` of a block or a tensor; NaN if the block holds a NaN, inf if it
holds an inf) and returns codes and/or fp32 values; all elementwise tensor arithmetic, no host sync.

**E8M0** (OCP MX v1.0 section 5.4.1): a code ``c`` in ``0..254`` is worth ``2**(c - 127)`` (code 0 is
``2**-127``, an fp32 subnormal, exact), code 255 is NaN; there is no zero and no infinity. The shared exponent
(section 6.3, "Conversion from scalar format to MX format")::

    floor: e = floor(log2(amax)) - element.emax            (amax = 0: the smallest exponent, -127)
    rceil: e = the smallest integer with amax <= element.max_normal * 2**e
    both : e clamped to [-127, 127]; a block whose amax is NaN or inf gets code 255 (NaN)

``floor`` is the spec's Algorithm 1; ``rceil`` is NVIDIA cuBLAS's "round up" E8M0 conversion of
``amax / max_normal`` (cuBLAS documentation, "1D block quantization", computing the UE8M0 scale) and torchao's
``ScaleCalculationMode.RCEIL`` (torchao/prototype/mx_formats/mx_tensor.py, ``_to_mx_rceil``). Here it is
computed exactly (a comparison with ``max_normal * 2**e``, both exact in fp32), where those compute
``amax * (1 / max_normal)`` in fp32 first: they can differ only when that product rounds onto a power of two
from above (then theirs saturates the block's largest element by less than one fp32 ulp). An inf maps to NaN
because ``log2(inf)`` is beyond E8M0, which has no infinity (torchao maps both to 255 the same way).

**NVFP4** (two-level scaling: NVIDIA Transformer Engine, transformer_engine/common/cast/nvfp4/core_nvfp4.cuh,
``compute_global_encode_scaling_factor_FP4`` / ``compute_decoding_scaling_factor``; torchao
torchao/prototype/mx_formats/nvfp4_tensor.py, ``per_tensor_amax_to_scale`` / ``nvfp4_quantize``)::

    tensor_scale = fp32(amax_tensor / (6 * 448))           (decode direction: x ~= e2m1 * block * tensor)
                   1.0 when that is not finite and > 0     (an all-zero tensor; TE returns 1 the same way)
    block_scale  = e4m3_rne_saturating(fp32(fp32(block_amax / 6) / tensor_scale))

so the tensor's largest block gets a block scale near 448, E4M3's max. ``amax_tensor`` is taken over the finite
values (one inf or NaN does not zero every other block); a block holding a NaN or inf gets a NaN block scale
(E4M3 code ``0x7F``). TE and torchao leave those cases undefined or clamp them; torchao also clamps the block
scale below at E4M3's smallest normal (2**-6), TE does not, nor does this module: a block far below the
tensor's amax gets a subnormal or zero block scale and, with zero, zero elements.
"""

from __future__ import annotations

import math

import torch

from mixprec.blockscale.elements import encode, pow2, round_to_element
from mixprec.formats import ELEMENT_FORMATS, BlockFormat

__all__ = ["E8M0_BIAS", "E8M0_NAN", "E4M3", "e8m0_codes", "e8m0_values", "nvfp4_tensor_scale", "e4m3_block_scales"]

E8M0_BIAS = 127
E8M0_NAN = 255
E4M3 = ELEMENT_FORMATS["e4m3"]


def _divide(x_fp32: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded in fp32 on every device: the divisor as a tensor on ``x``'s device, since
    CUDA computes a division by a host scalar as a multiplication by its rounded reciprocal."""
    return x_fp32 / torch.full((), divisor, dtype=torch.float32, device=x_fp32.device)


def e8m0_codes(amax_fp32: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """E8M0 shared-exponent codes (uint8, biased by 127, 255 = NaN) for block amaxes ``amax_fp32`` (fp32, >= 0 or
    NaN/inf), by ``fmt.scale_rounding`` (module docstring). Same shape; no host sync."""
    if fmt.scale_format != "e8m0":
        raise ValueError(f"e8m0_codes: {fmt.name} has {fmt.scale_format} scales, not e8m0")
    element = fmt.element
    binade = torch.bitwise_and(torch.bitwise_right_shift(amax_fp32.view(torch.int32), 23), 0xFF) - 127
    exponent = (binade - element.emax).clamp(min=-E8M0_BIAS, max=E8M0_BIAS)  # -127 also for 0 and subnormals
    if fmt.scale_rounding == "rceil":
        limit = element.max_normal * e8m0_values((exponent + E8M0_BIAS).to(torch.uint8))
        exponent = (exponent + (amax_fp32 > limit).to(torch.int32)).clamp(max=E8M0_BIAS)
    codes = exponent + E8M0_BIAS
    return torch.where(torch.isfinite(amax_fp32), codes, torch.full_like(codes, E8M0_NAN)).to(torch.uint8)


def e8m0_values(codes_uint8: torch.Tensor) -> torch.Tensor:
    """``2**(code - 127)`` in fp32 (exact; code 0 is the subnormal ``2**-127``), NaN for code 255. No host sync."""
    code = codes_uint8.to(torch.int32)
    values = pow2(code.clamp(min=1, max=254) - E8M0_BIAS)
    values = torch.where(code == 0, math.ldexp(1.0, -E8M0_BIAS), values)
    return torch.where(code == E8M0_NAN, float("nan"), values)


def nvfp4_tensor_scale(amax_fp32: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """NVFP4's per-tensor scale from the tensor's amax over finite values (fp32, any shape; usually ``()``):
    ``amax / (element.max_normal * 448)`` in fp32, or 1.0 where that is not finite and > 0. No host sync."""
    scale = _divide(amax_fp32.to(torch.float32), fmt.element.max_normal * E4M3.max_normal)
    usable = torch.isfinite(scale) & (scale > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def e4m3_block_scales(block_amax_fp32: torch.Tensor, tensor_scale_fp32: torch.Tensor,
                      fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's block scales: ``(codes, values)``, E4M3 bit patterns (uint8) and their fp32 values, shaped like
    ``block_amax_fp32``; ``tensor_scale_fp32`` broadcasts against it. A NaN or inf block amax gives a NaN scale
    (code ``0x7F``). Module docstring for the formula; no host sync."""
    in_tensor_units = _divide(block_amax_fp32, fmt.element.max_normal) / tensor_scale_fp32
    values = round_to_element(in_tensor_units, E4M3, saturate=True)
    values = torch.where(torch.isfinite(block_amax_fp32), values, float("nan"))
    return encode(values, E4M3), values
