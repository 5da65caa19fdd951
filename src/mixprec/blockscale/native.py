"""Native block-scaled GEMMs: the operands in the bytes torch's ``scaled_mm`` takes, and whether a device runs them.

On NVIDIA Blackwell (CUDA capability 10.0 and up: B200, GB200) cuBLAS runs MXFP8, MXFP4 and NVFP4 GEMMs itself,
reached through ``torch.nn.functional.scaled_mm`` with block scales. A :class:`NativeOperand` is one GEMM operand
``A (R, C)`` (the contraction ``C`` last, as every GEMM of :mod:`mixprec.blockscale.gemm`) quantized exactly as the
emulation quantizes it (:func:`~mixprec.blockscale.quantize`, the same round to nearest or the same stochastic
bits from the same generator, the same padding, Hadamard transform and 2D weight tiles), laid out for the hardware:

* elements row-major ``(R', C'')``: FP8 as ``torch.float8_e4m3fn`` / ``float8_e5m2``, FP4 E2M1 two a byte as
  ``torch.float4_e2m1fn_x2`` ``(R', C'' / 2)``, the element first in memory in the low nibble (torchao's
  ``pack_uint4``; :mod:`mixprec.blockscale.packing` packs the same way);
* block scales ``(R', C'' / block)`` as ``torch.float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (NVFP4), in cuBLAS's
  "1D block scaling factors layout" (:func:`swizzle_scales`); NVFP4's fp32 tensor scale ``()`` beside them
  (``ScalingType.TensorWise``);
* padding, after quantization so no amax and no random draw changes: rows ``R`` to ``R'``, a multiple of 16, and the
  contraction to ``C''``, a multiple of four blocks (one scale tile's width), with zero codes and zero scales (E8M0
  code 0: ``2**-127`` times zero elements), which add nothing to any product.

:func:`native_gemm` is ``A @ B^T`` from two such operands, accumulated in fp32 by the hardware and rounded once to
the output dtype: the emulation's values (:func:`~mixprec.blockscale.gemm.block_gemm`) up to the order of the
fp32 accumulation (and, for NVFP4, the tensor scales applied to the sum rather than to each element).

:func:`native_support` says whether a device runs a pair of formats natively, and why not: CUDA only (torch's
CPU ``scaled_mm`` takes tensorwise and rowwise float8 scales, no block scales), capability 10.0+, a torch with
the block scaling types; then, once per device, format pair and output dtype, a probe GEMM (:func:`probe_gemm`)
whose native result must equal the exact product of the emulation's operands within the fp32 accumulation bound
(a layout this module got wrong, or a kernel that rounds otherwise, is then never used: the GEMMs are emulated and
the reason says why). The probe's reference GEMM runs in fp64, so torch's float32 matmul precision (TF32) cannot
make it inexact; the emulation itself (:func:`~mixprec.blockscale.gemm.block_gemm`) is exact only with fp32
matmuls in fp32 (:func:`~mixprec.blockscale.gemm.tf32_matmuls`). The probe reads its result on the host once (at
first use) and runs eagerly, outside ``torch.compile``'s tracing (``torch.compiler.disable``): under
``fullgraph=True`` ask for the support before compiling
(:meth:`~mixprec.blockscale.linear.BlockScaledLinear.gemm_support`; the engine does it at build). Nothing else
here syncs. Sources: cuBLAS's documentation ("1D Block Scaling Factors Layout"), torch's
``test_scaled_matmul_cuda.py`` and torchao's MX/NVFP4 GEMM calls.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.blockscale.gemm import gemm_operand, operand_blocks, tile_blocks, untile
from mixprec.blockscale.quantize import BlockQuantized, quantize
from mixprec.blockscale.recipe import GEMMS
from mixprec.formats import BlockFormat, get_block_format

__all__ = ["NativeOperand", "NativeSupport", "native_operand", "native_weight_tiles", "native_gemm",
           "native_support", "probe_gemm", "recipe_support", "swizzle_scales", "MIN_CAPABILITY"]

MIN_CAPABILITY = (10, 0)
ROW_ALIGN = 16
_TILE_ROWS, _TILE_COLS = 128, 4


def swizzle_scales(scale_codes: torch.Tensor) -> torch.Tensor:
    """Block scale codes ``(R, G)`` (row ``r`` holds the scales of operand row ``r``, ``G`` blocks along the
    contraction) in cuBLAS's 1D block scaling factors layout, flat: padded with zeros to ``(ceil(R / 128) * 128,
    ceil(G / 4) * 4)``, cut into tiles of 128 rows x 4 scales stored one after another, the tiles of a row band
    consecutive (tile ``(i, j)`` at ``(i * ceil(G / 4) + j) * 512``), and within a tile scale ``(r, c)`` at ``(r % 32)
    * 16 + (r // 32) * 4 + c``. Same dtype; a new tensor; no host sync."""
    rows, groups = scale_codes.shape
    bands, tiles = -(-rows // _TILE_ROWS), -(-groups // _TILE_COLS)
    padded = scale_codes.new_zeros(bands * _TILE_ROWS, tiles * _TILE_COLS)
    padded[:rows, :groups] = scale_codes
    # (band, r // 32, r % 32, tile, c) -> (band, tile, r % 32, r // 32, c)
    return padded.view(bands, 4, 32, tiles, _TILE_COLS).permute(0, 3, 2, 1, 4).reshape(-1)


@dataclass(frozen=True)
class NativeOperand:
    """One GEMM operand as ``scaled_mm`` takes it (module docstring): ``data`` row-major ``(R', C'')`` FP8 or
    ``(R', C'' / 2)`` ``float4_e2m1fn_x2``, ``scales`` flat in the swizzled layout, ``tensor_scale`` NVFP4's fp32
    ``()`` (None for MX), ``rows`` the operand's own row count ``R`` (the rest is padding)."""

    format: BlockFormat
    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    rows: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(data, scales, tensor_scale)``, for ``ctx.save_for_backward``."""
        return self.data, self.scales, self.tensor_scale


def _element_dtype(fmt: BlockFormat) -> torch.dtype:
    """The torch dtype of ``fmt``'s elements in a native GEMM (FP4: two a byte)."""
    return fmt.element.dtype if fmt.element.dtype is not None else torch.float4_e2m1fn_x2


def _scale_dtype(fmt: BlockFormat) -> torch.dtype:
    return torch.float8_e8m0fnu if fmt.scale_format == "e8m0" else torch.float8_e4m3fn


def _from_codes(fmt: BlockFormat, codes_u8: torch.Tensor, scale_u8: torch.Tensor,
                tensor_scale: torch.Tensor | None) -> NativeOperand:
    """A :class:`NativeOperand` from unpacked element codes ``(R, C')`` and scale codes ``(R, C' / block)`` (uint8,
    :class:`~mixprec.blockscale.quantize.BlockQuantized`'s), padded as the module docstring says."""
    rows, width = codes_u8.shape
    span = fmt.block_size * _TILE_COLS
    codes_u8 = F.pad(codes_u8, (0, -width % span, 0, -rows % ROW_ALIGN))
    scale_u8 = F.pad(scale_u8, (0, -scale_u8.shape[1] % _TILE_COLS, 0, -rows % ROW_ALIGN))
    if fmt.element.bits == 4:
        codes_u8 = codes_u8[:, 0::2].bitwise_or(codes_u8[:, 1::2].bitwise_left_shift(4))
    data = codes_u8.contiguous().view(_element_dtype(fmt))
    scales = swizzle_scales(scale_u8).view(_scale_dtype(fmt))
    return NativeOperand(fmt, data, scales, tensor_scale, rows)


_NATIVE_KINDS = {(8, "e8m0", 32, False): "MXFP8", (4, "e8m0", 32, False): "MXFP4", (4, "e4m3", 16, True): "NVFP4"}


def _check_format(fmt: BlockFormat) -> None:
    """ValueError unless torch's ``scaled_mm`` takes ``fmt``'s operands: MXFP8, MXFP4 or NVFP4."""
    kind = (fmt.element.bits, fmt.scale_format, fmt.block_size, fmt.tensor_scale)
    if kind not in _NATIVE_KINDS:
        raise ValueError(f"native block-scaled GEMM: {fmt.name} ({fmt.element.bits}-bit elements, "
                         f"{fmt.scale_format} scales per {fmt.block_size}) is none of {sorted(_NATIVE_KINDS.values())}, "
                         "the formats torch's scaled_mm takes")


@torch.no_grad()
def native_operand(t: torch.Tensor, fmt: BlockFormat | str, *, rounding: str = "nearest",
                   generator: torch.Generator | None = None, signs: torch.Tensor | None = None) -> NativeOperand:
    """``t (R, C)`` quantized along ``C`` as :func:`~mixprec.blockscale.gemm.gemm_operand` quantizes it (padded,
    transformed with ``signs``, the same bits drawn from ``generator`` with ``rounding="stochastic"``), as a
    :class:`NativeOperand`. ValueError for a format torch's ``scaled_mm`` cannot take (FP6). No host sync."""
    fmt = get_block_format(fmt)
    _check_format(fmt)
    q = quantize(operand_blocks(t.contiguous(), fmt.block_size, signs), fmt, rounding=rounding, generator=generator)
    return _from_codes(fmt, q.codes, q.scale_codes, q.tensor_scale)


@torch.no_grad()
def native_weight_tiles(w: torch.Tensor, tile_fmt: BlockFormat, side: int, *, transposed: bool) -> NativeOperand:
    """``W (N, K)`` quantized with one scale per ``side x side`` tile (round to nearest, as
    :func:`~mixprec.blockscale.gemm.weight_tiles`), as the native operand along K (``W``, ``transposed=False``)
    or along N (``W^T``): the tile's scale repeated for each of its ``side`` rows, blocks of ``side`` along the
    contraction (``ScalingType.BlockWise1x16`` for NVFP4's 16x16 tiles). No host sync."""
    q: BlockQuantized = quantize(tile_blocks(w, side), tile_fmt)     # codes (N/s, K/s, s*s), scales (N/s, K/s, 1)
    codes = untile(q.codes, side)                                    # (N, K)
    scales = q.scale_codes.squeeze(-1)                               # (N/s, K/s)
    if transposed:
        codes, scales = codes.t(), scales.t()
    row_fmt = dataclasses.replace(tile_fmt, block_size=side)   # each row of a tile: a block of ``side``
    _check_format(row_fmt)
    return _from_codes(row_fmt, codes, scales.repeat_interleave(side, dim=0), q.tensor_scale)


def _recipe(fmt: BlockFormat) -> list:
    """``scaled_mm``'s scale recipe for an operand of ``fmt``."""
    if fmt.tensor_scale:
        return [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    return [F.ScalingType.BlockWise1x32]


def native_gemm(a: NativeOperand, b: NativeOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (R, C) @ b (S, C)^T`` on the device's block-scaled tensor cores: ``(R, S)`` in ``out_dtype`` (fp32
    accumulation, one rounding). Both operands' contraction padded alike (the same format block size). Raises
    what torch raises where the device has no such GEMM (:func:`native_support` says beforehand). No host sync."""
    def scales(op: NativeOperand):
        return [op.scales, op.tensor_scale] if op.tensor_scale is not None else [op.scales]

    def swizzles(op: NativeOperand):
        return [F.SwizzleType.SWIZZLE_32_4_4] + ([F.SwizzleType.NO_SWIZZLE] if op.tensor_scale is not None else [])

    out = F.scaled_mm(a.data, b.data.t(), scales(a), _recipe(a.format), scales(b), _recipe(b.format),
                      swizzle_a=swizzles(a), swizzle_b=swizzles(b), output_dtype=out_dtype)
    return out[:a.rows, :b.rows]


@dataclass(frozen=True)
class NativeSupport:
    """Whether block-scaled GEMMs of a format pair run natively on a device (``available``) and, in words, how
    they run there (``reason``: what was probed, or why they are emulated)."""

    available: bool
    reason: str

_NOT_TRACED = ("mixprec probes a device's native block-scaled GEMMs once, eagerly (a GEMM and a host read); under "
               "torch.compile(fullgraph=True) call gemm_support(device, compute_dtype) on each BlockScaledLinear "
               "before compiling (MixedPrecision does it at build), or run one forward eagerly first")


def native_support(device: torch.device | str, fmt_a: BlockFormat | str, fmt_b: BlockFormat | str | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> NativeSupport:
    """Whether ``A (fmt_a) @ B (fmt_b)^T`` GEMMs producing ``out_dtype`` run natively on ``device`` (module
    docstring for the checks and the probe). Cached per device, formats and dtype: the probe, and its one host
    read, run once per process."""
    device = torch.device(device)
    fmt_a = get_block_format(fmt_a)
    fmt_b = fmt_a if fmt_b is None else get_block_format(fmt_b)
    if device.type != "cuda":
        return NativeSupport(False, f"no native block-scaled GEMM on {device.type}: torch's scaled_mm takes block "
                                    "scales on CUDA only (capability 10.0+, NVIDIA Blackwell)")
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_support(index, fmt_a, fmt_b, out_dtype)   # the formats themselves: variants share a name


@torch.compiler.disable(reason=_NOT_TRACED)
@functools.lru_cache(maxsize=None)
def _cuda_support(index: int, fmt_a: BlockFormat, fmt_b: BlockFormat, out_dtype: torch.dtype) -> NativeSupport:
    device = torch.device("cuda", index)
    if not torch.cuda.is_available():
        return NativeSupport(False, f"{device}: CUDA is not available in this process")
    name, cap = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
    where = f"{device} ({name}, sm_{cap[0]}{cap[1]})"
    if cap < MIN_CAPABILITY:
        return NativeSupport(False, f"{where}: native MX/NVFP4 GEMMs need CUDA capability "
                                    f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (NVIDIA Blackwell, e.g. B200)")
    missing = [n for n in ("scaled_mm", "ScalingType", "SwizzleType") if not hasattr(F, n)]
    missing += [n for n in ("float4_e2m1fn_x2", "float8_e8m0fnu") if not hasattr(torch, n)]
    if missing:
        return NativeSupport(False, f"{where}: torch {torch.__version__} lacks {', '.join(missing)}")
    problem = [f"{f.name}: {e}" for f in (fmt_a, fmt_b) for e in _format_problem(f)]
    if fmt_a.block_size != fmt_b.block_size or fmt_a.tensor_scale != fmt_b.tensor_scale:
        problem.append(f"{fmt_a.name} and {fmt_b.name} scale differently")
    if problem:
        return NativeSupport(False, f"{where}: " + "; ".join(problem))
    return _probe(device, where, fmt_a, fmt_b, out_dtype)


def _format_problem(fmt: BlockFormat) -> list[str]:
    try:
        _check_format(fmt)
    except ValueError as error:
        return [str(error).split(": ", 1)[1]]
    return []


def _probe(device: torch.device, where: str, fmt_a: BlockFormat, fmt_b: BlockFormat,
           out_dtype: torch.dtype) -> NativeSupport:
    """:func:`probe_gemm` on ``device``, in words; not native where it fails or torch refuses it."""
    try:
        worst = probe_gemm(device, fmt_a, fmt_b, out_dtype)
    except Exception as error:   # noqa: BLE001 - whatever torch raises, the GEMMs are then emulated
        return NativeSupport(False, f"{where}: torch's scaled_mm refused a probe GEMM "
                                    f"({type(error).__name__}: {str(error)[:200]})")
    if not worst <= 1.0:
        return NativeSupport(False, f"{where}: a probe GEMM through torch's scaled_mm differed from the exact "
                                    f"emulation by {worst:.3g}x the fp32 accumulation bound; emulating instead")
    recipe = "+".join(s.name for s in _recipe(fmt_a))
    return NativeSupport(True, f"{where}: native block-scaled GEMMs (torch.nn.functional.scaled_mm, {recipe} "
                               f"scales; a probe GEMM matched the exact emulation within fp32 accumulation)")


def _probe_operand(rows: int, width: int, block: int, g: torch.Generator) -> torch.Tensor:
    """``(rows, width)`` uniform in ``[-1, 1]`` times ``2**e`` per block (``e`` in ``-8..0``, drawn per row and
    block): every block scale of a tile its own, so a scale read from another place changes the product."""
    blocks = -(-width // block)
    magnitude = torch.exp2(torch.randint(-8, 1, (rows, blocks), generator=g).float())
    return (torch.rand(rows, width, generator=g) * 2 - 1) * magnitude.repeat_interleave(block, 1)[:, :width]


@torch.no_grad()
def probe_gemm(device: torch.device | str, fmt_a: BlockFormat | str, fmt_b: BlockFormat | str,
               out_dtype: torch.dtype) -> float:
    """One GEMM of awkward shape through torch's ``scaled_mm`` (:func:`native_gemm`) on ``device``, against the exact
    product of the emulation's operands: the worst ``|native - exact|`` over ``2 C u |A| @ |B|^T`` (the fp32
    accumulation bound, ``u = 2**-24``) plus one unit of ``out_dtype`` in the last place; at most 1 where the
    kernel computes what the emulation computes. Raises what torch raises. One host read.

    Shapes: 200 and 136 rows (two 128-row scale bands each, the second ragged) and a contraction of 9.5 blocks
    (three 4-scale tiles, the last ragged, and a ragged block), so a misplaced tile, band, scale or element
    changes the result. Magnitudes: every input is at most 1 and each quantized value at most twice its block's
    largest input (the formats round at most to the next representable value or saturate), so every product is at
    most 4 and a sum of ``C <= 304`` of them at most ~1.2e3, well inside fp16's 65504 (bf16's and fp32's range
    is wider): no output dtype overflows. The reference runs in fp64, which no float32 matmul precision (TF32)
    touches."""
    device = torch.device(device)
    fmt_a, fmt_b = get_block_format(fmt_a), get_block_format(fmt_b)
    g = torch.Generator(device="cpu").manual_seed(0)
    block = fmt_a.block_size
    width = 9 * block + block // 2
    a = _probe_operand(200, width, block, g).to(device)
    b = _probe_operand(136, width, block, g).to(device)
    got = native_gemm(native_operand(a, fmt_a), native_operand(b, fmt_b), out_dtype).double()
    qa, qb = gemm_operand(a, fmt_a).double(), gemm_operand(b, fmt_b).double()
    with torch.autocast(device.type, enabled=False):
        want = qa @ qb.t()
        bound = 2 * width * 2.0 ** -24 * (qa.abs() @ qb.abs().t()) + _ulp(want, out_dtype) + 2.0 ** -126
    return ((got - want).abs() / bound).max().item()   # the probe's one host read


def recipe_support(device: torch.device | str, recipe, out_dtype: torch.dtype = torch.bfloat16) -> NativeSupport:
    """Whether every quantized GEMM of ``recipe`` (a :class:`~mixprec.blockscale.recipe.BlockRecipe`) runs natively
    on ``device`` with ``out_dtype`` outputs: :func:`native_support` of each GEMM's format pair (forward ``x, W``,
    dgrad ``dy, W``, wgrad ``dy, x``); the first pair that does not says why. ``recipe.gemm="emulated"``: never."""
    if recipe.gemm == "emulated":
        return NativeSupport(False, "emulated as the recipe asks (gemm='emulated')")
    support = NativeSupport(False, "no GEMM of the recipe is quantized")
    for gemm in recipe.quantized_gemms:
        a, b = (recipe.operand_format(operand) for operand, _ in GEMMS[gemm])
        support = native_support(device, a, b, out_dtype)
        if not support.available:
            return support
    return support


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each of ``t``'s magnitudes (``t``'s dtype); below ``dtype``'s
    smallest normal, its subnormals' spacing."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)
    tiny = torch.finfo(dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32).tiny
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(tiny))) - mantissa)
