"""One block-scaled GEMM by emulation: its operands quantized along the contraction, dequantized, an fp32 matmul.

Every GEMM of :class:`~mixprec.blockscale.linear.BlockScaledLinear` is ``A @ B^T`` for ``A (R, C)`` and
``B (S, C)``, both laid out with the contraction ``C`` last, which is the dim the block formats scale along
(:func:`~mixprec.blockscale.quantize` cuts the last dim into blocks). Each operand goes through
:func:`gemm_operand`:

1. ``C`` is padded with zeros to ``C'``, a multiple of the block size (only the token dim ``M`` of the wgrad
   GEMM, and ``N`` of dgrad with 1D weight blocks, can need it; zeros change no block's amax, no NVFP4 tensor
   amax, and add nothing to the product);
2. with random Hadamard signs, the transform along ``C`` in blocks of ``len(signs)``
   (:func:`~mixprec.blockscale.hadamard.hadamard_transform`), the same signs on both operands;
3. :func:`~mixprec.blockscale.quantize` along ``C``: round to nearest even, or stochastically from a
   ``torch.Generator`` (which draws ``randint(0, 2**32, (R, C'), dtype=int64)``, one draw per quantized operand);
4. dequantized to fp32 (exact for MX; NVFP4's fp32 products as :mod:`mixprec.blockscale.quantize` states).

Steps 3 and 4 run as one, :func:`~mixprec.blockscale.fakequant.fake_quantize`: the same values bit for bit and
the same random draws as ``quantize(...).dequantize()``, without the codes (13 to 22 operations on full-size
tensors where the path through the codes runs over 100, 15 of them ``torch.where``).

Then :func:`block_gemm`: ``torch.matmul(A, B.t())`` in fp32 with autocast off (the values are the format's, so
an fp32 GEMM accumulates them as the hardware's fp32 accumulators do, in another order), rounded once to the
output dtype. :func:`weight_tiles` is the 2D variant for weights: one scale per ``b x b`` tile of ``W (N, K)``,
so the same dequantized ``W`` is valid along K (forward) and along N (dgrad).

On CUDA the fp32 matmul must run in fp32 for the emulation to mean what it says: torch's default, which
``torch.set_float32_matmul_precision("high")`` (or ``torch.backends.cuda.matmul.allow_tf32 = True``, or
``fp32_precision = "tf32"``) changes to TF32, rounding each operand to 10 mantissa bits. MX operands (at most 4
significant bits times a power of two) pass through TF32 unchanged; NVFP4's (an E2M1 value times an E4M3 scale
times an fp32 tensor scale) do not, and their emulated GEMMs are then off by up to ``2**-11`` of each product. Nothing
here changes the user's setting; :func:`tf32_matmuls` tells whether it is on, and ``MixedPrecision``'s decision says so
for an emulated NVFP4 recipe on CUDA. No host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.blockscale.fakequant import fake_quantize, fake_quantize_blocks, stored_transposed
from mixprec.blockscale.hadamard import hadamard_transform
from mixprec.formats import BlockFormat

__all__ = ["operand_blocks", "gemm_operand", "tile_blocks", "untile", "weight_tiles", "block_gemm", "plain_gemm",
           "tf32_matmuls"]


def operand_blocks(t: torch.Tensor, block_size: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``t (R, C)`` as the quantizer of a GEMM contracting ``C`` sees it (steps 1 and 2 of the module docstring):
    padded with zeros to ``C'``, a multiple of ``block_size``, and transformed with ``signs`` if given: ``(R, C')``
    in ``t``'s dtype (fp32 after a transform). A ``t`` stored transposed (``W.t()``) stays so: no transposing copy."""
    pad = -t.shape[-1] % block_size
    if pad:
        t = F.pad(t.t(), (0, 0, 0, pad)).t() if stored_transposed(t) else F.pad(t, (0, pad))
    if signs is not None:
        t = hadamard_transform(t, signs, dim=-1)
    return t


def gemm_operand(t: torch.Tensor, fmt: BlockFormat, *, rounding: str = "nearest",
                 generator: torch.Generator | None = None, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``t (R, C)`` as a GEMM contracting ``C`` reads it: padded, transformed (with ``signs``), quantized in
    ``fmt`` along ``C`` (stochastically from ``generator`` if ``rounding="stochastic"``) and dequantized: fp32
    ``(R, C')`` (module docstring), by :func:`operand_blocks` and
    :func:`~mixprec.blockscale.fakequant.fake_quantize`.

    A ``t`` stored transposed stays so through every step (no transposing copy; the GEMM reads either layout),
    except with stochastic rounding, whose bits are drawn in ``(R, C')`` order: then ``t`` is made contiguous
    first, so the bits and the values line up element for element in memory.
    """
    if rounding == "stochastic" and stored_transposed(t):
        t = t.contiguous()
    return fake_quantize(operand_blocks(t, fmt.block_size, signs), fmt, rounding=rounding, generator=generator)


def tile_blocks(w: torch.Tensor, side: int) -> torch.Tensor:
    """``W (N, K)`` cut into ``side x side`` tiles, each flattened into one block: ``(N // side, K // side,
    side * side)`` (a copy). ``N`` and ``K`` must be multiples of ``side`` (ValueError naming the shape)."""
    n, k = w.shape
    if n % side or k % side:
        raise ValueError(f"weight_tiles: W has shape {(n, k)}; 2D blocks of {side}x{side} need both dims "
                         f"multiples of {side}")
    return w.reshape(n // side, side, k // side, side).transpose(1, 2).reshape(n // side, k // side, side * side)


def untile(tiles: torch.Tensor, side: int) -> torch.Tensor:
    """The inverse of :func:`tile_blocks`: ``(N // side, K // side, side * side)`` back to ``(N, K)``."""
    rows, cols, _ = tiles.shape
    return tiles.reshape(rows, cols, side, side).transpose(1, 2).reshape(rows * side, cols * side)


def weight_tiles(w: torch.Tensor, tile_fmt: BlockFormat, side: int) -> torch.Tensor:
    """``W (N, K)`` quantized with one scale per ``side x side`` tile and dequantized: fp32 ``(N, K)``.

    ``tile_fmt`` is the weight's block format with ``block_size = side**2``
    (:meth:`~mixprec.blockscale.recipe.BlockRecipe.weight_tile_format`): each tile's elements, flattened, are one
    block, so the tile's amax sets its scale (NVFP4: the tensor scale is all of ``W``'s, as for 1D blocks).
    Round to nearest even. ``N`` and ``K`` must be multiples of ``side``. The tiles are a view of ``W``
    (:func:`~mixprec.blockscale.fakequant.fake_quantize_blocks` over its dims 1 and 3): no copy.
    """
    if not tile_fmt.saturate:   # the overflowing variants go through quantize() itself
        return untile(fake_quantize(tile_blocks(w, side), tile_fmt), side)
    n, k = w.shape
    if n % side or k % side:
        raise ValueError(f"weight_tiles: W has shape {(n, k)}; 2D blocks of {side}x{side} need both dims "
                         f"multiples of {side}")
    tiles = w.unflatten(0, (n // side, side)).unflatten(-1, (k // side, side))   # (N/s, s, K/s, s)
    return fake_quantize_blocks(tiles, tile_fmt, (1, 3)).reshape(n, k)


def block_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (R, C) @ b (S, C)^T``: fp32 operands, an fp32 matmul with autocast off, the result rounded once to
    ``out_dtype``: ``(R, S)``."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.matmul(a, b.t()).to(out_dtype)


def plain_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A GEMM the recipe leaves unquantized: :func:`block_gemm` of the operands cast to fp32, unpadded."""
    return block_gemm(a.to(torch.float32), b.to(torch.float32), out_dtype)


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may run in TF32 now (torch's float32 matmul precision, set by either of its APIs),
    which makes :func:`block_gemm` of NVFP4 operands inexact (module docstring)."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)   # torch 2.9+: "none", "ieee", "tf32"
    if precision is not None:
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"
