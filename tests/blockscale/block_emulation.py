"""An independent emulation of a block-scaled linear, written from the text of recipe.py and linear.py.

It uses mixprec's slice-1 quantizer (``quantize`` / ``dequantize``, tested against the specs' reference in
test_block_quantize.py) and nothing else of the code under test: the padding, the random Hadamard transform (the
butterflies hadamard.py states, written here as index pairs), the 2D weight tiles (cut one by one, quantized with
the tensor's amax) and the GEMMs are all spelled out again.

The text it follows: each GEMM is ``A @ B^T`` with the contraction last in both; an operand is padded with zeros
along the contraction to a multiple of the block size, transformed (wgrad only, same signs on both operands),
quantized along the contraction (``dy`` stochastically from the linear's generator when the recipe says so: dgrad's
``dy`` first, then wgrad's ``dy^T``) and dequantized; the fp32 product is rounded to the compute dtype, then cast to
the input's / weight's dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mixprec.blockscale import quantize


def butterfly_rht(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``H_n diag(signs) / sqrt(n)`` on each block of ``n`` along the last dim: signs, then for h = 1, 2, ...
    the pair (i, i + h) with bit h of i clear becomes (v_i + v_{i+h}, v_i - v_{i+h}), then the scale."""
    n = signs.numel()
    blocks = t.to(torch.float32).reshape(*t.shape[:-1], -1, n) * signs.to(torch.float32)
    columns = list(blocks.unbind(-1))
    h = 1
    while h < n:
        for i in range(n):
            if not i & h:
                a, b = columns[i], columns[i + h]
                columns[i], columns[i + h] = a + b, a - b
        h *= 2
    return (torch.stack(columns, dim=-1) * (1.0 / math.sqrt(n))).reshape(t.shape)


def operand(t: torch.Tensor, fmt, *, rounding: str = "nearest", generator=None, signs=None) -> torch.Tensor:
    """``t (R, C)`` padded along C to a multiple of the block size, [transformed], quantized, dequantized."""
    rows, c = t.shape
    padded = math.ceil(c / fmt.block_size) * fmt.block_size
    t = torch.cat([t, torch.zeros(rows, padded - c, dtype=t.dtype)], dim=1)
    if signs is not None:
        t = butterfly_rht(t, signs)
    return quantize(t, fmt, rounding=rounding, generator=generator).dequantize()


def weight_tiles(w: torch.Tensor, fmt) -> torch.Tensor:
    """``W (N, K)`` with one scale per ``b x b`` tile: each tile flattened to one block of ``b*b`` and quantized
    on its own, NVFP4's tensor scale from all of ``W``'s amax."""
    b = fmt.block_size
    tile_fmt = dataclasses.replace(fmt, block_size=b * b)
    amax = w.float().abs().amax() if fmt.tensor_scale else None
    out = torch.empty(w.shape)
    for i in range(0, w.shape[0], b):
        for j in range(0, w.shape[1], b):
            tile = w[i:i + b, j:j + b].reshape(1, b * b)
            out[i:i + b, j:j + b] = quantize(tile, tile_fmt, tensor_amax=amax).dequantize().reshape(b, b)
    return out


def emulate(recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype, *,
            signs=None, generator=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, dx, dW)`` for ``x (M, K)``, ``w (N, K)``, ``dy (M, N)``, as the recipe's text says."""
    fx, fw, fdy = (recipe.operand_format(o) for o in ("x", "W", "dy"))
    sr = "stochastic" if recipe.stochastic_rounding else "nearest"
    two_d = recipe.weight_blocks == "2d"
    gemms = recipe.quantized_gemms

    def gemm(a, b):
        return torch.matmul(a.float(), b.float().t()).to(out_dtype)

    if "forward" in gemms:
        y = gemm(operand(x, fx), weight_tiles(w, fw) if two_d else operand(w, fw))
    else:
        y = gemm(x, w)
    if "dgrad" in gemms:
        dy_q = operand(dy, fdy, rounding=sr, generator=generator if recipe.stochastic_rounding else None)
        dx = gemm(dy_q, weight_tiles(w, fw).t() if two_d else operand(w.t(), fw))
    else:
        dx = gemm(dy, w.t())
    rht = signs if recipe.hadamard else None
    if "wgrad" in gemms:
        a = operand(dy.t(), fdy, rounding=sr, generator=generator if recipe.stochastic_rounding else None, signs=rht)
        dw = gemm(a, operand(x.t(), fx, signs=rht))
    else:
        dw = gemm(dy.t(), x.t())
    return y, dx.to(x.dtype), dw.to(w.dtype)
