"""Quantize a tensor to a block format along its last dim, and back: :func:`quantize`, :class:`BlockQuantized`.

The algorithms, stated once (formats in :mod:`mixprec.formats`, scales in :mod:`mixprec.blockscale.scales`,
element rounding in :mod:`mixprec.blockscale.elements`). ``x`` is cast to fp32 (exact from fp32/bf16/fp16) and
cut into blocks of ``block_size`` consecutive elements along its last dim; ``amax`` is each block's ``max |x|``
(NaN if the block holds a NaN)::

    MX    (OCP MX v1.0 section 6.3)  scale = 2**e, e from amax by scale_rounding (E8M0 code 255 for NaN/inf)
                                     element = round(x / scale)                  (exact division: a power of two)
                                     x_hat   = element * scale                   (exact)
    NVFP4 (TE / torchao, scales.py)  scale = e4m3(fp32(amax / 6) / tensor_scale) (RNE, saturating at 448)
                                     element = round(fp32(x / fp32(scale * tensor_scale)))
                                     x_hat   = fp32(fp32(element * scale) * tensor_scale)

``round`` is the element format's round to nearest, ties to even (or stochastic rounding), then saturation to
``±max_normal`` (or, for FP8 elements with ``saturate=False``, OFP8's overflow to inf / NaN). Special blocks:

* a block holding a NaN, +inf or -inf: NaN scale (E8M0 code 255 / E4M3 code ``0x7F``), element codes 0,
  dequantized as all NaN. The OCP spec makes a block with a NaN scale all NaN whatever its elements; an inf has
  no E8M0 exponent (E8M0 has no infinity), so it makes its block NaN too rather than saturating silently.
* an all-zero block: the smallest scale (E8M0 code 0, ``2**-127``; NVFP4: block scale 0) and zero elements, of
  the inputs' signs (``-0.0`` stays ``-0.0``).
* fp32 subnormal inputs: exact inputs like any other; with MX the shared exponent clamps at -127, so values
  below the element format's subnormals times ``2**-127`` round to zero.
* near fp32's max: a block format can hold values fp32 cannot. With ``rceil`` a block whose amax is close to
  fp32's max (above ``1.75 * 2**127`` for E2M1, ``1.9375 * 2**127`` for E4M3) can round its largest element up
  to ``2**128``, and NVFP4's fp32 products can round past fp32's max: such values dequantize to ``±inf``.
  (``floor`` cannot: its elements saturate at ``max_normal`` under a scale of at most ``2**(127 - emax)``.)

Shapes: ``x`` is ``(..., K)`` with ``K % block_size == 0`` (refused otherwise: pad the last dim yourself, with
zeros, which change no block's amax); codes ``(..., K)``, block scales ``(..., K // block_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.blockscale.elements import decode, encode, round_to_element
from mixprec.blockscale.scales import E4M3, e4m3_block_scales, e8m0_codes, e8m0_values, nvfp4_tensor_scale
from mixprec.formats import BlockFormat, get_block_format

__all__ = ["BlockQuantized", "quantize", "dequantize"]

_ROUNDINGS = ("nearest", "stochastic")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockQuantized:
    """A tensor in a block format: element codes, block scale codes, and NVFP4's tensor scale.

    Fields:
        format: the :class:`~mixprec.formats.BlockFormat`.
        codes: uint8 ``(..., K)``, one element code per byte (unpacked; the element format's bit pattern in the
            low ``format.element.bits`` bits; FP8 codes ``.view(torch.float8_e4m3fn)`` / ``float8_e5m2``).
        scale_codes: uint8 ``(..., K // block_size)``: E8M0 biased exponents (MX; 255 = NaN; ``.view(
            torch.float8_e8m0fnu)`` is torch's dtype for them) or E4M3 bit patterns (NVFP4).
        tensor_scale: NVFP4's fp32 per-tensor scale, shape ``()``; None for MX.

    Module docstring for the algorithms. Construct it with :func:`quantize`.
    """

    format: BlockFormat
    codes: torch.Tensor
    scale_codes: torch.Tensor
    tensor_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """The quantized tensor's shape, ``(..., K)``."""
        return self.codes.shape

    def element_values(self) -> torch.Tensor:
        """The elements as fp32 values of the element format, ``(..., K)``, before any scale. No host sync."""
        return decode(self.codes, self.format.element)

    def scale_values(self) -> torch.Tensor:
        """The block scales in fp32, ``(..., K // block_size)`` (NaN for a NaN block), without the tensor scale."""
        if self.format.scale_format == "e8m0":
            return e8m0_values(self.scale_codes)
        return decode(self.scale_codes, E4M3)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``(..., K)``: elements times block scale (times the tensor scale, NVFP4), as the module docstring
        states; exact for MX. No host sync."""
        size = self.format.block_size
        elements = self.element_values().unflatten(-1, (-1, size))
        products = elements * self.scale_values().unsqueeze(-1)
        if self.tensor_scale is not None:
            products = products * self.tensor_scale
        return products.flatten(-2)


def _check(x: torch.Tensor, fmt: BlockFormat, rounding: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize: x is {got}; allowed: a tensor of dtype {', '.join(map(str, _INPUT_DTYPES))} "
                        f"(cast float64 with .float() first: the formats are defined on fp32 inputs)")
    if x.dim() == 0 or x.shape[-1] % fmt.block_size:
        raise ValueError(f"quantize: x has shape {tuple(x.shape)}; {fmt.name} needs a last dim divisible by its "
                         f"block size {fmt.block_size} (pad it with zeros to a multiple first)")
    if rounding not in _ROUNDINGS:
        raise ValueError(f"quantize: rounding={rounding!r} is not one of {_ROUNDINGS}")


def _random_bits(x: torch.Tensor, rounding: str, random_bits: torch.Tensor | None,
                 generator: torch.Generator | None) -> torch.Tensor | None:
    """The uint32 bits stochastic rounding draws, shaped like ``x`` (None for round to nearest)."""
    if rounding == "nearest":
        if random_bits is not None or generator is not None:
            raise ValueError("quantize: random_bits and generator are for rounding='stochastic' only")
        return None
    if (random_bits is None) == (generator is None):
        raise ValueError("quantize: rounding='stochastic' needs exactly one of random_bits (x's shape) or generator")
    if random_bits is not None:
        if random_bits.shape != x.shape:
            raise ValueError(f"quantize: random_bits has shape {tuple(random_bits.shape)}; it must be x's "
                             f"{tuple(x.shape)}")
        return random_bits.to(x.device)
    return torch.randint(0, 2 ** 32, x.shape, dtype=torch.int64, device=x.device, generator=generator)


def _tensor_amax(blocks_fp32: torch.Tensor, tensor_amax: torch.Tensor | None) -> torch.Tensor:
    """NVFP4's tensor amax: the given one (on the blocks' device, fp32) or the blocks' over their finite values."""
    if tensor_amax is not None:
        return tensor_amax.to(device=blocks_fp32.device, dtype=torch.float32)
    if blocks_fp32.numel() == 0:
        return torch.zeros((), device=blocks_fp32.device)
    return torch.where(torch.isfinite(blocks_fp32), blocks_fp32.abs(), 0.0).amax()


@torch.no_grad()
def quantize(x: torch.Tensor, fmt: BlockFormat | str, *, rounding: str = "nearest",
             random_bits: torch.Tensor | None = None, generator: torch.Generator | None = None,
             tensor_amax: torch.Tensor | None = None) -> BlockQuantized:
    """``x`` in block format ``fmt`` along its last dim (module docstring: the algorithms, special blocks).

    Args:
        x: fp32, bf16 or fp16, shape ``(..., K)`` with ``K`` a multiple of ``fmt.block_size``.
        fmt: a :class:`~mixprec.formats.BlockFormat` or its name (``"mxfp8_e4m3"``, ``"nvfp4"``, ...).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (elements only, for gradients; the scales are
            always computed as above): round up with probability equal to the fraction of the gap (to 2**-32),
            unbiased for values inside the element range, from ``random_bits`` (``x``'s shape: int32 bit
            patterns, uint32, or int64 in ``[0, 2**32)``) or drawn from ``generator`` (on ``x``'s device).
        tensor_amax: NVFP4 only: the amax the tensor scale comes from (fp32 ``()``, e.g. agreed across shards or
            kept from an earlier step); default ``x``'s amax over its finite values. Blocks above it saturate.

    Returns:
        A :class:`BlockQuantized`.

    Raises:
        TypeError: ``x`` not a fp32/bf16/fp16 tensor; ``random_bits`` of another integer dtype.
        ValueError: a 0-d ``x`` or a last dim not divisible by the block size; an unknown ``fmt`` or
            ``rounding``; random bits or generator without ``rounding="stochastic"`` or neither with it;
            ``random_bits`` not of ``x``'s shape; ``tensor_amax`` for an MX format.

    No host sync; fp32 arithmetic throughout; works under ``torch.compile``.
    """
    fmt = get_block_format(fmt)
    _check(x, fmt, rounding)
    bits = _random_bits(x, rounding, random_bits, generator)
    if tensor_amax is not None and not fmt.tensor_scale:
        raise ValueError(f"quantize: tensor_amax is for formats with a tensor scale (nvfp4), not {fmt.name}")
    blocks = x.detach().to(torch.float32).unflatten(-1, (-1, fmt.block_size))
    block_bits = None if bits is None else bits.unflatten(-1, (-1, fmt.block_size))
    block_amax = blocks.abs().amax(dim=-1)
    if fmt.scale_format == "e8m0":
        scale_codes, tensor_scale = e8m0_codes(block_amax, fmt), None
        divisor = e8m0_values(scale_codes)
    else:
        tensor_scale = (nvfp4_tensor_scale(_tensor_amax(blocks, tensor_amax), fmt) if fmt.tensor_scale
                        else None)
        units = torch.ones((), device=x.device) if tensor_scale is None else tensor_scale
        scale_codes, scale_fp32 = e4m3_block_scales(block_amax, units, fmt)
        divisor = scale_fp32 * units
    scaled = blocks / divisor.unsqueeze(-1)
    scaled = torch.where((divisor == 0).unsqueeze(-1), blocks * 0.0, scaled)  # a zero scale: signed zeros
    values = round_to_element(scaled, fmt.element, saturate=fmt.saturate, random_bits=block_bits)
    values = torch.where(torch.isnan(divisor).unsqueeze(-1), 0.0, values)  # the scale carries the NaN
    codes = encode(values, fmt.element).flatten(-2)
    return BlockQuantized(fmt, codes, scale_codes, tensor_scale)


def dequantize(q: BlockQuantized) -> torch.Tensor:
    """fp32 ``(..., K)`` from a :class:`BlockQuantized` (its :meth:`BlockQuantized.dequantize`). No host sync."""
    return q.dequantize()
