"""A GEMM operand kept quantized and packed, in the bytes a block format takes: :func:`pack_operand`,
:func:`unpack_operand`.

A :class:`~mixprec.blockscale.linear.BlockScaledLinear` needs ``x`` again in backward only as the wgrad GEMM's
operand, ``gemm_operand(x.t(), fmt, signs=signs)``, which rounds to nearest and draws no random bits: the same
value in forward as in backward. So forward computes it and keeps it packed, as a native MXFP8 / NVFP4 linear keeps
its quantized wgrad operand (Transformer Engine's columnwise copy), and backward unpacks it. The bytes:

* elements: FP8 (E4M3, E5M2) one byte each, viewed as ``torch.float8_e4m3fn`` / ``float8_e5m2`` (the same bits);
  FP4 (E2M1) two per byte, uint8, the element first in memory in the low nibble and the next in the high one,
  bit 3 of a nibble the sign; FP6 (E2M3, E3M2) one per byte, uint8, the low 6 bits (packing four into three
  bytes would save a quarter byte an element, and no preset recipe uses FP6);
* block scales: E8M0 as its uint8 code (255 NaN), E4M3 as ``torch.float8_e4m3fn``;
* NVFP4's tensor scale: fp32 ``()``.

Bytes per element of the operand (padded to whole blocks): MXFP8 ``1 + 1/32``, MXFP6 ``1 + 1/32``, MXFP4
``1/2 + 1/32``, NVFP4 ``1/2 + 1/16`` (and 4 bytes a tensor), where the unquantized input takes 4 (fp32) or 2
(bf16).

Codes, exactly: FP8 packs by torch's own cast (the same bits for values on the grid); otherwise an element value
``v`` of a format with exponent bias ``b`` and ``m`` mantissa bits, times ``2**(b - 127)``, has the element's exponent
field in fp32's (the element's subnormals land on fp32 subnormals), so the fp32 bits of ``|v| * 2**(b - 127)``
shifted right by ``23 - m`` are ``v``'s magnitude code. Unpacking (every format: torch's CPU cast from FP8 is slow)
shifts the code back and multiplies by ``2**(127 - b)``. Both products are by powers of two and exact (fp32
subnormals must not be flushed: torch's default, as :mod:`mixprec.blockscale.fakequant`'s ``2**-127`` scales need). An
element of a block holding a NaN or inf (its elements 0 or NaN) gets an arbitrary code, and its block scale is NaN
(E8M0 code 255, E4M3 NaN): the block unpacks all NaN, as it fake-quantizes.

Unpacking ends in :func:`~mixprec.blockscale.fakequant.scale_elements_`, the products ``(element * block_scale) *
tensor_scale`` that :func:`~mixprec.blockscale.fakequant.fake_quantize` ends in, on the same values in the same
layout: ``unpack_operand(pack_operand(t, fmt, signs=s))`` is ``gemm_operand(t, fmt, signs=s)`` bit for bit (NaN
where it is NaN), with its shape and strides. No host sync (NVFP4's tensor amax as in ``fake_quantize``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.blockscale.fakequant import BlockView, block_parts, scale_elements_
from mixprec.blockscale.gemm import operand_blocks
from mixprec.blockscale.scales import e8m0_values
from mixprec.formats import BlockFormat, ElementFormat, get_block_format

__all__ = ["PackedLayout", "PackedOperand", "pack_operand", "unpack_operand", "pack_elements", "unpack_elements",
           "pack_scales", "unpack_scales"]


@dataclass(frozen=True)
class PackedLayout:
    """What :func:`unpack_operand` needs besides the tensors: plain data, kept on an autograd ``ctx``.

    Fields:
        format: the operand's :class:`~mixprec.formats.BlockFormat`.
        view: the :class:`~mixprec.blockscale.fakequant.BlockView` the operand was quantized in.
        shape: the elements' shape in memory order (outermost dim first), as packed.
        order: the dims of the blocks' view in that order (``elements.permute(order)`` was contiguous).
    """

    format: BlockFormat
    view: BlockView
    shape: tuple[int, ...]
    order: tuple[int, ...]


@dataclass(frozen=True)
class PackedOperand:
    """A quantized GEMM operand in its packed bytes (module docstring for the encodings).

    Fields:
        layout: a :class:`PackedLayout`.
        element_codes: FP8 ``float8_e4m3fn`` / ``float8_e5m2`` of ``layout.shape``; FP4 uint8 ``(ceil(n / 2),)``,
            two codes a byte; FP6 uint8 of ``layout.shape``.
        scale_codes: E8M0 uint8 or E4M3 ``float8_e4m3fn``, one per block, the blocks' view's shape with the
            block dims of size 1.
        tensor_scale_fp32: NVFP4's fp32 ``()``; None for MX.

    :meth:`tensors` gives the three for ``ctx.save_for_backward`` (None allowed there), ``PackedOperand(layout,
    *tensors)`` rebuilds it.
    """

    layout: PackedLayout
    element_codes: torch.Tensor
    scale_codes: torch.Tensor
    tensor_scale_fp32: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(element_codes, scale_codes, tensor_scale_fp32)``."""
        return self.element_codes, self.scale_codes, self.tensor_scale_fp32

    @property
    def nbytes(self) -> int:
        """Bytes of the three tensors' storages."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors() if t is not None)


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims from the outermost in memory to the innermost: ``t.permute(order)`` is contiguous for a dense
    ``t`` (a stable sort: dims of size 1 keep their place)."""
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def pack_elements(elements_fp32: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """Element values (fp32 on ``element``'s grid, ``-0.0`` kept; NaN only where the block scale is NaN) as codes
    (module docstring): FP8 by torch's cast to ``element.dtype`` (exact on the grid), FP4 two a byte (flat, in
    ``elements_fp32``'s row-major order), FP6 one a byte. No host sync."""
    if element.dtype is not None:
        return elements_fp32.to(element.dtype)
    m, top = element.mantissa_bits, element.bits - 1
    magnitude = elements_fp32.abs().mul_(2.0 ** (element.bias - 127)).view(torch.int32)
    magnitude = magnitude.bitwise_right_shift_(23 - m).bitwise_and_((1 << top) - 1)   # a NaN's code: any
    sign = elements_fp32.view(torch.int32).bitwise_right_shift(31).bitwise_and_(1 << top)   # 0 or the sign bit
    codes_u8 = magnitude.bitwise_or_(sign).to(torch.uint8)
    if element.bits == 4:
        flat = codes_u8.reshape(-1)
        flat = F.pad(flat, (0, 1)) if flat.numel() % 2 else flat
        return flat[0::2].bitwise_or(flat[1::2].bitwise_left_shift(4))
    return codes_u8


def unpack_elements(codes: torch.Tensor, element: ElementFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 element values of ``shape`` (contiguous) from :func:`pack_elements`' codes: exact for every code of a
    finite value; a NaN or inf code (FP8) gives a finite value (pack writes them only where the block scale is
    NaN). No host sync."""
    m, top = element.mantissa_bits, element.bits - 1
    codes_u8 = codes.view(torch.uint8)
    if element.bits == 4:
        pairs = torch.stack((codes_u8.bitwise_and(0x0F), codes_u8.bitwise_right_shift(4)), dim=-1)
        codes_u8 = pairs.reshape(-1)[:math.prod(shape)].reshape(shape)
    code = codes_u8.to(torch.int32)
    bits = code.bitwise_and((1 << top) - 1).bitwise_left_shift_(23 - m)
    bits = bits.bitwise_or_(code.bitwise_right_shift_(top).bitwise_left_shift_(31))
    return bits.view(torch.float32).mul_(2.0 ** (127 - element.bias)).reshape(shape)


def pack_scales(block_scale_fp32: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Block scale values (fp32: MX ``2**e`` for ``e`` in ``[-127, 127]`` or not finite; NVFP4 E4M3 values or NaN)
    as E8M0 codes (uint8: the fp32 exponent field, ``2**-127`` code 0, inf and NaN 255) or ``float8_e4m3fn``.
    Same shape; no host sync."""
    if fmt.scale_format == "e8m0":
        field = block_scale_fp32.view(torch.int32).bitwise_right_shift(23).bitwise_and_(0xFF)
        return field.to(torch.uint8)
    return block_scale_fp32.to(torch.float8_e4m3fn)


def unpack_scales(scale_codes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """fp32 block scales from :func:`pack_scales`' codes: exact, NaN for E8M0 code 255 and E4M3 NaN. No host
    sync."""
    if fmt.scale_format == "e8m0":
        return e8m0_values(scale_codes)
    return scale_codes.to(torch.float32)


@torch.no_grad()
def pack_operand(t: torch.Tensor, fmt: BlockFormat | str, *, signs: torch.Tensor | None = None) -> PackedOperand:
    """``gemm_operand(t, fmt, signs=signs)`` (round to nearest) kept packed: ``t (R, C)`` fp32/bf16/fp16 padded
    along ``C``, transformed with ``signs`` if given, quantized along ``C`` by
    :func:`~mixprec.blockscale.fakequant.block_parts`, and its parts packed (module docstring).

    Raises:
        ValueError: a format that overflows instead of saturating (``saturate=False``; its elements can be NaN or
            inf outside a NaN block, which the codes here do not keep).

    No host sync (NVFP4's tensor amax as in ``fake_quantize``).
    """
    fmt = get_block_format(fmt)
    if not fmt.saturate:
        raise ValueError(f"pack_operand: {fmt.name} overflows to inf/NaN (saturate=False); packing needs a "
                         f"saturating format: keep the unquantized tensor instead")
    operand = operand_blocks(t, fmt.block_size, signs)   # (R, C')
    view = BlockView.of(operand, fmt.block_size)
    elements_fp32, block_scale_fp32, tensor_scale_fp32 = block_parts(view.blocks(operand), fmt, view.dims)
    order = _memory_order(elements_fp32)
    dense_fp32 = elements_fp32.permute(order)
    layout = PackedLayout(fmt, view, tuple(dense_fp32.shape), order)
    return PackedOperand(layout, pack_elements(dense_fp32, fmt.element), pack_scales(block_scale_fp32, fmt),
                         tensor_scale_fp32)


def unpack_operand(packed: PackedOperand) -> torch.Tensor:
    """The operand :func:`pack_operand` packed, as ``gemm_operand`` gives it: fp32 ``(R, C')`` in its layout, bit
    for bit (module docstring). No host sync."""
    layout = packed.layout
    fmt = layout.format
    dense_fp32 = unpack_elements(packed.element_codes, fmt.element, layout.shape)
    inverse = sorted(range(len(layout.order)), key=layout.order.__getitem__)
    elements_fp32 = dense_fp32.permute(inverse)
    values = scale_elements_(elements_fp32, unpack_scales(packed.scale_codes, fmt), packed.tensor_scale_fp32)
    return layout.view.restore(values)
