"""Fake quantization: a tensor's block-format values in fp32 directly, for GEMM operands.

:func:`fake_quantize` returns ``quantize(x, fmt, ...).dequantize()`` bit for bit (NaN where it is NaN) without
the codes: no encode / decode, the scales computed once per block as values, and the elements rounded by a short
chain of in-place fp32 passes. It draws the same random bits from a ``generator`` as :func:`~mixprec.blockscale.
quantize` (one ``randint(0, 2**32, x.shape, dtype=int64)``), so a stochastic-rounding stream continues bitwise
whichever of the two a caller runs. The algorithms are :mod:`mixprec.blockscale.quantize`'s; what differs is
only the arithmetic that reaches the same values, each step exact or the same fp32 operation:

* block amax ``max |x|`` in the input's dtype (abs and max are exact), divided into the scale as the reference
  divides; magnitudes ``|x| / divisor`` are ``|x / divisor|``, and the sign is put back once at the end
  (``copysign``: ``-0.0`` and negatives rounding to zero stay negative, as the reference's ``copysign``);
* saturation *before* rounding (``clamp`` to ``max_normal``): rounding is monotone and ``max_normal`` is on the
  grid, so values above it round to it either way, and ``inf`` clamps as it saturates (no clamp under
  ``rceil``, whose scale puts every element at or below ``max_normal``, the division by a power of two exact);
* round to nearest even with the "magic number" ``c = max(2**floor(log2 a), 2**emin) * 2**(23 - m)`` (``m``
  mantissa bits): ``a + c`` lies in ``[c, 2c)``, whose fp32 spacing is the element's ulp at ``a`` (its subnormal
  spacing below ``2**emin``) and ``c`` is an even multiple of it, so fp32's own ties-to-even addition rounds ``a``
  onto the grid and ``(a + c) - c`` is exact;
* stochastic rounding as the reference: ``t = a / ulp`` (exact), up iff the bits ``r < floor(frac(t) * 2**32)``;
* NVFP4's zero-divisor blocks divide by ``inf`` (``|x| / inf = 0``, the sign restored as ``x * 0.0`` gives it),
  and its dequantization keeps the reference's two fp32 products ``(element * block_scale) * tensor_scale``;
  its tensor amax over the finite values is, on CPU, the blocks' amax when that is finite (no masking pass).

A NaN/inf block comes out all NaN. Formats that overflow instead of saturating (``saturate=False``) go through
``quantize(...).dequantize()`` itself. Same arguments and errors as :func:`~mixprec.blockscale.quantize`; fp32
``(..., K)`` out; no host sync. :func:`fake_quantize_blocks` is the same on blocks laid out any way (down the
columns of a transposed GEMM operand, 2D weight tiles), so no operand is copied to put its blocks last. It is
:func:`block_parts` (the signed elements, the block scales, NVFP4's tensor scale) then :func:`scale_elements_`
(the two products), so a caller can keep the parts, packed (:mod:`mixprec.blockscale.packing`), and compute the
same values from them later; :class:`BlockView` is the blocks' layout :func:`fake_quantize` works in.

Why this arithmetic (measured on a 2-core EPYC, torch 2.13, 2 threads; docs/results-history.md): torch's own
FP8 cast rounds to nearest even, but its CPU conversion back from ``float8_e4m3fn`` to fp32 costs some 20 fp32
passes' time (3 ms per 2M elements), so the magic number, one rounding for every element format, is cheaper; a
CPU ``torch.where`` costs some 25 passes' time, so there is none on a full tensor here. ``torch.compile``
(inductor) of these passes saves 10-20 % on round-to-nearest and is slower on stochastic rounding (its int64
compare), for 2-3 s of compilation per shape: eager is the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.blockscale.elements import _unsigned_bits
from mixprec.blockscale.quantize import _check, _random_bits, quantize
from mixprec.blockscale.scales import E4M3, _divide, nvfp4_tensor_scale
from mixprec.formats import BlockFormat, ElementFormat, get_block_format

__all__ = ["BlockView", "block_parts", "fake_quantize", "fake_quantize_blocks", "scale_elements_",
           "stored_transposed"]

_EXPONENT_MASK = 0x7F800000
_TWO_POW_32 = 2.0 ** 32


def _power_of_two_floor(a_fp32: torch.Tensor, emin: int) -> torch.Tensor:
    """``max(2**floor(log2 a), 2**emin)`` for ``a >= 0`` (``inf`` for NaN/inf ``a``): fp32, a new tensor."""
    return torch.bitwise_and(a_fp32.view(torch.int32), _EXPONENT_MASK).view(torch.float32).clamp_min_(2.0 ** emin)


def _round_nearest_(a_fp32: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """``a`` (fp32 magnitudes ``<= fmt.max_normal`` or NaN) rounded to nearest even on ``fmt``'s grid, in place."""
    magic = _power_of_two_floor(a_fp32, fmt.emin).mul_(2.0 ** (23 - fmt.mantissa_bits))
    return a_fp32.add_(magic).sub_(magic)


def _round_stochastic(a_fp32: torch.Tensor, fmt: ElementFormat, bits: torch.Tensor) -> torch.Tensor:
    """``a`` (fp32 magnitudes ``<= fmt.max_normal`` or NaN) rounded up iff ``bits < floor(frac(a / ulp) * 2**32)``
    (:func:`~mixprec.blockscale.round_to_element`'s rule), as a new tensor."""
    ulp = _power_of_two_floor(a_fp32, fmt.emin).mul_(2.0 ** -fmt.mantissa_bits)
    t = a_fp32.div_(ulp)
    whole = t.floor()
    threshold = t.sub_(whole).mul_(_TWO_POW_32).to(torch.int64)   # floor: the fraction is >= 0
    up = torch.lt(bits, threshold).view(torch.uint8).to(torch.float32)   # via uint8: bool casts are slow on CPU
    return whole.add_(up).mul_(ulp)


def _mx_scales(amax_fp32: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """E8M0 scale values ``2**e`` as :func:`~mixprec.blockscale.scales.e8m0_codes` then ``e8m0_values`` give them:
    ``floor`` ``e = floor(log2 amax) - emax`` clamped below at -127 (it cannot pass 127 for fp32 amaxes),
    ``rceil`` one more where ``amax > max_normal * 2**e``. A NaN or inf amax gives ``inf`` where the reference's
    scale is NaN: the block still comes out all NaN (``|x| / inf`` is 0 or NaN, and ``0 * inf`` is NaN)."""
    element = fmt.element
    scale = _power_of_two_floor(amax_fp32, -126).mul_(2.0 ** -element.emax).clamp_min_(2.0 ** -127)
    if fmt.scale_rounding == "rceil":
        scale = scale.mul_(torch.gt(amax_fp32, element.max_normal * scale).to(torch.float32).add_(1.0))
    return scale


def _e4m3_scales(amax_fp32: torch.Tensor, units_fp32: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """NVFP4's block scale values, :func:`~mixprec.blockscale.scales.e4m3_block_scales`'s: ``fp32(fp32(amax /
    max_normal) / units)`` rounded to E4M3 (nearest even, saturating at 448), NaN for a NaN/inf amax."""
    in_units = (_divide(amax_fp32, fmt.element.max_normal) / units_fp32).clamp_max_(E4M3.max_normal)
    return _round_nearest_(in_units, E4M3).add_(amax_fp32 - amax_fp32)


def _finite_amax(a: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the finite values of ``a = |x|`` (fp32 ``()``; 0 for an empty tensor). On CPU, outside
    ``torch.compile``, the blocks' amax when that is finite (reading a CPU value waits on no device), saving the
    pass that masks NaN and inf; else that pass."""
    if a.numel() == 0:
        return torch.zeros((), device=a.device)
    if a.device.type == "cpu" and not torch.compiler.is_compiling():
        candidate = block_amax.amax()
        if bool(torch.isfinite(candidate)):
            return candidate
    return torch.nan_to_num(a, nan=0.0, posinf=0.0).amax()


def block_parts(blocks: torch.Tensor, fmt: BlockFormat, dims: tuple[int, ...], *, bits: torch.Tensor | None = None,
                tensor_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The parts of :func:`fake_quantize_blocks`'s values before its two products: ``(elements_fp32,
    block_scale_fp32, tensor_scale_fp32)``, which :func:`scale_elements_` turns into those values.

    ``elements_fp32``: the signed element values (on ``fmt.element``'s grid, ``-0.0`` kept), a new fp32 tensor of
    ``blocks``' shape (dense); in a block holding a NaN or inf they are 0 or NaN and its scale is not finite.
    ``block_scale_fp32``: one per block, ``blocks``' shape with ``dims`` of size 1: MX ``2**e`` (``inf`` for a
    NaN/inf block), NVFP4 the E4M3 value (NaN for a NaN/inf block). ``tensor_scale_fp32``: NVFP4's ``()``, None
    for MX. Arguments as :func:`fake_quantize_blocks`; no host sync.
    """
    x_fp32 = blocks.detach().to(torch.float32)
    a = x_fp32.abs()
    block_amax = a.amax(dim=dims, keepdim=True)
    tensor_scale = None
    if fmt.scale_format == "e8m0":
        scale = divisor = _mx_scales(block_amax, fmt)
    else:
        if fmt.tensor_scale:
            amax = _finite_amax(a, block_amax) if tensor_amax is None else tensor_amax.to(a.device, torch.float32)
            tensor_scale = nvfp4_tensor_scale(amax, fmt)
        units = torch.ones((), device=a.device) if tensor_scale is None else tensor_scale
        scale = _e4m3_scales(block_amax, units, fmt)
        divisor = scale * units
        divisor = divisor.masked_fill_(divisor == 0, float("inf"))   # |x| / inf = 0: the reference's x * 0.0
    a = a.div_(divisor)
    if fmt.scale_rounding != "rceil":   # rceil's 2**e >= amax / max_normal: no element can pass max_normal
        a = a.clamp_max_(fmt.element.max_normal)
    values = _round_nearest_(a, fmt.element) if bits is None else _round_stochastic(a, fmt.element, bits)
    return values.copysign_(x_fp32), scale, tensor_scale


def scale_elements_(elements_fp32: torch.Tensor, block_scale_fp32: torch.Tensor,
                    tensor_scale_fp32: torch.Tensor | None) -> torch.Tensor:
    """The dequantization's fp32 products, ``(element * block_scale) * tensor_scale`` (the second only with a
    tensor scale), written into ``elements_fp32`` and returned; ``block_scale_fp32`` broadcasts against it. The
    one arithmetic of :func:`fake_quantize_blocks` and of a packed operand's unpacking
    (:mod:`mixprec.blockscale.packing`). No host sync."""
    values = elements_fp32.mul_(block_scale_fp32)
    return values if tensor_scale_fp32 is None else values.mul_(tensor_scale_fp32)


def fake_quantize_blocks(blocks: torch.Tensor, fmt: BlockFormat, dims: tuple[int, ...], *,
                         bits: torch.Tensor | None = None, tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
    """The fake-quantized values of ``blocks``, a view of any layout whose dims ``dims`` hold one block's elements
    (``(..., K // b, b)`` with ``dims=(-1,)``; ``(C // b, b, R)`` with ``(1,)`` for blocks down the columns;
    ``(N // s, s, K // s, s)`` with ``(1, 3)`` for 2D tiles): fp32 of ``blocks``' shape, in its layout.

    ``bits`` (int64 in ``[0, 2**32)``, broadcastable to ``blocks``) rounds stochastically; ``tensor_amax`` as in
    :func:`fake_quantize`. No argument checks (callers check, as :func:`fake_quantize` does); ``fmt.saturate``
    must be True. Working on the caller's layout saves the transposing copies a last-dim-only quantizer needs
    for a GEMM operand stored the other way round; the values are the same, element by element.
    :func:`block_parts` then :func:`scale_elements_`.
    """
    return scale_elements_(*block_parts(blocks, fmt, dims, bits=bits, tensor_amax=tensor_amax))


def stored_transposed(t: torch.Tensor) -> bool:
    """True for a 2-D view of a contiguous tensor's transpose (``W.t()``, ``dy.t()``, ``x.t()``)."""
    return t.dim() == 2 and t.stride(-1) != 1 and t.t().is_contiguous()


@dataclass(frozen=True)
class BlockView:
    """How :func:`fake_quantize` views a tensor ``x (..., C)`` as blocks of ``size`` along ``C``, without a copy.

    ``columns=False``: ``x``'s last dim cut, ``(..., C // size, size)``, block dims ``(-1,)``. ``columns=True``, for
    a 2-D ``x`` stored transposed (``x.t()`` contiguous, as ``W.t()``, ``dy.t()`` or ``x.t()`` of a GEMM): the
    blocks down the columns of ``x.t()``, ``(C // size, size, R)``, block dim ``(1,)``. :meth:`of` picks one;
    :meth:`restore` maps values computed on the blocks back to ``x``'s shape and layout.
    """

    size: int
    columns: bool

    @classmethod
    def of(cls, x: torch.Tensor, size: int) -> "BlockView":
        """The view :func:`fake_quantize` works on for ``x``: columns for a 2-D ``x`` stored transposed."""
        return cls(size, stored_transposed(x))

    @property
    def dims(self) -> tuple[int, ...]:
        """The dims of :meth:`blocks` that hold one block's elements."""
        return (1,) if self.columns else (-1,)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., C)`` (or bits of its shape) as blocks: a view."""
        return x.t().unflatten(0, (-1, self.size)) if self.columns else x.unflatten(-1, (-1, self.size))

    def restore(self, blocks: torch.Tensor) -> torch.Tensor:
        """Values of :meth:`blocks`' shape back in ``x``'s shape (``x.t()``'s layout for columns)."""
        return blocks.flatten(0, 1).t() if self.columns else blocks.flatten(-2)


@torch.no_grad()
def fake_quantize(x: torch.Tensor, fmt: BlockFormat | str, *, rounding: str = "nearest",
                  random_bits: torch.Tensor | None = None, generator: torch.Generator | None = None,
                  tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize(x, fmt, ...).dequantize()`` bit for bit, fast: fp32 ``(..., K)`` (module docstring).

    Arguments, random-bit draws, errors and host syncs (none) as :func:`~mixprec.blockscale.quantize`. A 2-D ``x``
    stored transposed (``x.t()`` contiguous, as ``W.t()`` or ``dy.t()`` of a GEMM) is worked on in that layout
    and the result comes back in it.
    """
    fmt = get_block_format(fmt)
    _check(x, fmt, rounding)
    bits = _random_bits(x, rounding, random_bits, generator)
    if tensor_amax is not None and not fmt.tensor_scale:
        raise ValueError(f"quantize: tensor_amax is for formats with a tensor scale (nvfp4), not {fmt.name}")
    if not fmt.saturate:
        return quantize(x, fmt, rounding=rounding, random_bits=bits, tensor_amax=tensor_amax).dequantize()
    view = BlockView.of(x, fmt.block_size)
    block_bits = None if bits is None else view.blocks(_unsigned_bits(bits))
    values = fake_quantize_blocks(view.blocks(x), fmt, view.dims, bits=block_bits, tensor_amax=tensor_amax)
    return view.restore(values)
