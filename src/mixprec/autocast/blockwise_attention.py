"""Attention with torch's fused CPU forward and a blockwise backward that recomputes the probabilities.

The forward is torch's flash kernel for the CPU (``aten::_scaled_dot_product_flash_attention_for_cpu``); it
keeps for backward exactly what ``fused`` keeps: q, k, v, the output and the per-row logsumexp ``L`` (fp32,
``(B, H, T)``), plus the mask when one is given (a boolean one as it is). The backward (FlashAttention-2's,
Dao 2023, §3.1.2, blocked over queries) recomputes the probabilities from them, ``rows`` queries at a time, with
five GEMMs in the input dtype per block (fp32 accumulation inside each):

1. ``X = [q, h, l] · [k, 1, 1]ᵀ`` where ``h + l = -L/scale`` (a bf16 hi/lo pair, exact to u²): the scores
   minus the logsumexp in one GEMM, so its one rounding is relative to ``|S - L|``, small where ``P`` is not,
   whatever the logits' magnitude (rounding ``S`` itself costs ``u·|S|`` per score: the ``matmul`` candidate's
   dq at 24 dB SQNR where this one has 42, at q and k of standard deviation 6).
2. ``P = exp(scale·X + mask)`` (two elementwise ops, each computed in fp32 and rounded to the input dtype;
   causal: ``-inf`` above the diagonal, and keys past the block's last query are not computed at all).
3. ``Y = [dO, d_h, d_l] · [v, 1, 1]ᵀ`` where ``d_h + d_l = -D``, ``D = rowsum(dO ∘ O)`` in fp32: ``dP - D`` in
   one rounding relative to itself (the softmax backward's cancellation happens before the rounding).
4. ``dS = P ∘ Y``; ``dQ = scale·dS·k`` per block; ``dK += scale·dSᵀ·q`` and ``dV += Pᵀ·dO``, accumulated in fp32
   over blocks (each block's partial rounded once).

Rows per block (:func:`block_rows`): the largest power of two whose two temporaries (``P`` and ``dS``:
``2·B·H·rows·S·itemsize`` bytes) fit :data:`BLOCK_BYTES` (4 MiB) or 1/16 of the T×S fp32 probabilities where that
is more (every query at once when they fit), so the probabilities' part of the transient stays bounded for long
sequences: 1/8 of the T×S fp32 probabilities at B2·H4·T1024. Besides, the backward holds O(T·D) buffers: k and
v with their two columns (``2·B·H·S·(D+2)·itemsize``), and, with several blocks, fp32 sums of dK and dV. GQA
(fewer key/value heads) is handled by expanding k and v inside the backward and summing their gradients per group. Not computed here:
dropout (its mask would have to be replayed), fp16 (``X`` and ``Y`` could overflow at 65504), non-CPU devices
(no CPU flash forward there; their fused backward is the fast one): :func:`offered_here` says so. The error
bound of the gradients is derived in ``tests/autocast/test_blockwise_attention.py``. The backward is not differentiable
again (``once_differentiable``, as torch's fused backward). Host syncs: none (one read of a CPU tensor when a
mask is given).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["blockwise_attention", "block_rows", "offered_here", "BLOCK_BYTES"]

BLOCK_BYTES = 4 << 20   # a block's two (rows x keys) temporaries fit in this many bytes (or 1/16 of T×S fp32)
_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def block_rows(batch_heads: int, q_len: int, k_len: int, itemsize: int) -> int:
    """Queries per block of the backward for ``batch_heads`` = B·H attention matrices of ``q_len`` x ``k_len``
    in a dtype of ``itemsize`` bytes: the largest power of two (or ``q_len`` itself) whose two block temporaries
    (``P`` and ``dS``: ``2·B·H·rows·k_len·itemsize`` bytes) fit the larger of :data:`BLOCK_BYTES` and 1/16 of the
    T×S fp32 probabilities; at least 16 rows (or ``q_len``). No host sync."""
    limit = max(BLOCK_BYTES, batch_heads * q_len * k_len * 4 // 16)
    per_row = 2 * batch_heads * k_len * itemsize
    if q_len * per_row <= limit:
        return q_len
    rows = 1 << max(0, (limit // per_row).bit_length() - 1)
    return min(q_len, max(16, rows))


def offered_here(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype, dropout_p: float,
                 scale: float | None) -> str:
    """Why the blockwise kernel is not offered for this call of ``scaled_dot_product_attention`` ("" when it
    is); ``dtype`` is the autocast dtype. No host sync."""
    device_type = q.device.type
    if q.dim() != 4 or k.dim() != 4:
        return f"not offered for {q.dim()}-D inputs (B, H, T, D only)"
    if scale == 0:
        return "not offered with scale=0"
    if device_type != "cpu":
        return f"not offered on {device_type} (its forward is torch's CPU flash kernel)"
    if dtype == torch.float16:
        return "not offered under fp16 (its scores minus logsumexp and dP - D could overflow at 65504)"
    if dropout_p > 0:
        return "not offered with dropout"
    return ""


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive one torch's kernels use (0 / -inf), in ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _hi_lo(x_fp32: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as two ``dtype`` numbers whose sum is ``x`` to within u² (one column each in an augmented GEMM)."""
    hi = x_fp32.to(dtype)
    return hi, (x_fp32 - hi.to(x_fp32.dtype)).to(dtype)


def _augment(x: torch.Tensor, *columns: torch.Tensor) -> torch.Tensor:
    """``x`` (..., n, d) with one more column per ``columns`` entry (each (..., n) or a scalar 1)."""
    ones = [c.expand(*x.shape[:-1], 1) if c.dim() == 0 else c.unsqueeze(-1) for c in columns]
    return torch.cat([x, *(o.to(x.dtype) for o in ones)], dim=-1)


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, mask, is_causal, scale):   # torch.autograd.Function protocol (setup_context below)
        return _FORWARD(q, k, v, 0.0, is_causal, attn_mask=_additive(mask, q.dtype), scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, is_causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.mark_non_differentiable(lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        scale = ctx.scale if ctx.scale is not None else 1.0 / math.sqrt(q.size(-1))
        grads = _backward(d_out, q, k, v, out, lse, mask, ctx.is_causal, scale, mask_grad=ctx.needs_input_grad[3])
        return (*grads, None, None)


def _keys_and_offsets(q, k, v, lse, mask_add):
    """k and v with two columns of ones (``(B, H, S, D+2)``), the per-row offset ``L - c`` (fp32 ``(B, H, T)``;
    ``c``: the row's largest finite mask value, so a row masked by a large finite number keeps a small offset)
    and the additive bias less ``c``, as a ``(..., T, S)`` view (or None)."""
    dtype, acc = q.dtype, (torch.float32 if q.dtype != torch.float64 else q.dtype)
    offset = lse.to(acc)
    if mask_add is not None:
        mask_add = mask_add.expand(*mask_add.shape[:-2], q.size(-2), k.size(-2))   # a view: rows to slice
        top = mask_add.amax(-1).to(acc)                                  # (..., T): 0 unless the row is all masked
        top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=acc, device=top.device))
        if torch.compiler.is_compiling() or bool(top.any()):   # CPU only: no device sync; traced: no data branch
            offset, mask_add = offset - top, mask_add - top.to(dtype).unsqueeze(-1)
    one = torch.ones((), dtype=dtype, device=q.device)
    return _augment(k, one, one), _augment(v, one, one), offset, mask_add


def _backward(d_out, q, k, v, out, lse, mask, is_causal: bool, scale: float, *, mask_grad: bool):
    dtype, (B, H, T, D), S = q.dtype, q.shape, k.size(-2)
    groups = H // k.size(-3)
    if groups > 1:   # GQA: query head h reads key/value head h // groups
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    k = k.contiguous()   # a view of a qkv projection: copied once here, not by every block's GEMM
    acc = torch.float32 if dtype != torch.float64 else dtype
    k_aug, v_aug, offset, bias_all = _keys_and_offsets(q, k, v, lse, _additive(mask, dtype))
    d_out, rows = d_out.to(dtype), block_rows(B * H, T, S, q.element_size())
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + mask.shape)   # (B|1, H|1, T|1, S|1)
    d_mask = torch.zeros(mask4.shape, dtype=acc, device=q.device) if mask_grad else None
    q_cols = torch.stack(_hi_lo(-offset / scale, dtype), dim=-1)           # (B, H, T, 2): q's extra columns
    do_cols = torch.stack(_hi_lo(-_delta(d_out, out, rows), dtype), dim=-1)   # (B, H, T, 2): dO's
    causal = _causal_bias(rows, T, dtype, q.device) if is_causal and bias_all is None else None
    dq = torch.empty_like(q)
    dk_acc = dv_acc = None   # several blocks: fp32 sums of each block's partial (one rounding per block)
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        keys = min(S, stop) if is_causal else S   # causal (top-left): no query of this block sees a later key
        k_blk, v_blk, k_plain = ((t if keys == S else t[..., :keys, :].contiguous()) for t in (k_aug, v_aug, k))
        bias = (bias_all[..., start:stop, :keys] if bias_all is not None else
                None if causal is None else causal[: stop - start, T - start: T - start + keys])
        q_blk, do_blk = (t[..., start:stop, :].contiguous() for t in (q, d_out))   # standard strides: bmm copies none
        ds, p = _block(q_blk, do_blk, q_cols[..., start:stop, :], do_cols[..., start:stop, :], k_blk, v_blk, bias,
                       scale)
        dq[..., start:stop, :] = torch.matmul(ds, k_plain).mul_(scale)   # D-wide outputs: a D+2-wide GEMM is slower
        dk_blk = torch.matmul(ds.transpose(-2, -1), q_blk)                # (B, H, keys, D), unscaled
        dv_blk = torch.matmul(p.transpose(-2, -1), do_blk)
        if rows == T and keys == S:
            dk, dv = dk_blk.mul_(scale), dv_blk
        else:
            if dk_acc is None:
                dk_acc, dv_acc = (torch.zeros((B, H, S, D), dtype=acc, device=q.device) for _ in range(2))
            dk_acc[..., :keys, :] += dk_blk
            dv_acc[..., :keys, :] += dv_blk
        if d_mask is not None:   # d(exponent)/d(mask) = 1: dS unscaled, summed over the mask's broadcast dims
            target = d_mask if d_mask.size(2) == 1 else d_mask[:, :, start:stop]
            target += _reduced(ds, target.shape)
        del p, ds
    if dk_acc is not None:
        dk, dv = dk_acc.mul_(scale).to(dtype), dv_acc.to(dtype)
    if groups > 1:
        dk, dv = (g.reshape(B, H // groups, groups, S, D).sum(2) for g in (dk, dv))
    return dq, dk, dv, (None if d_mask is None else d_mask.to(mask.dtype).view(mask.shape))


def _block(q_blk, do_blk, q_cols, do_cols, k_blk, v_blk, bias, scale):
    """One block of queries: ``dS = P ∘ (dP - D)`` and ``P`` (``(B, H, rows, keys)``, the input dtype), from the
    two augmented GEMMs (module docstring)."""
    x = torch.matmul(torch.cat([q_blk, q_cols], -1), k_blk.transpose(-2, -1))   # (B, H, rows, keys): qkᵀ-(L-c)/scale
    p = (x.mul_(scale) if bias is None else torch.add(bias, x, alpha=scale, out=x)).exp_()   # P, in place
    ds = torch.matmul(torch.cat([do_blk, do_cols], -1), v_blk.transpose(-2, -1)).mul_(p)   # P ∘ (dP - D)
    return ds, p


def _delta(d_out, out, rows):
    """``D = rowsum(dO ∘ O)`` in fp32 (``(B, H, T)``), ``rows`` rows at a time (the fp32 copies stay small)."""
    acc = torch.float32 if d_out.dtype != torch.float64 else d_out.dtype
    return torch.cat([(d_out[..., i:i + rows, :].to(acc) * out[..., i:i + rows, :].to(acc)).sum(-1)
                      for i in range(0, d_out.size(-2), rows)], dim=-1)


def _causal_bias(rows, q_len, dtype, device):
    """``(rows, q_len + rows)``: 0, or ``-inf`` where ``column - row > q_len``; the block of queries starting at
    ``start`` takes columns ``q_len - start`` on, so key ``j`` is masked for query ``start + r`` iff ``j > start + r``
    (top-left causal) — one small tensor for every block."""
    return torch.full((rows, q_len + rows), float("-inf"), dtype=dtype, device=device).triu_(q_len + 1)


def _reduced(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` (4-D) summed down to ``shape`` (4-D, broadcastable to it: broadcasting's adjoint), in fp32."""
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.size(i) != 1)
    return grad.sum(dims, keepdim=True, dtype=torch.float32) if dims else grad


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                        is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale)`` on the CPU with the
    blockwise backward above (module docstring). q ``(B, H, T, D)``, k and v ``(B, H_kv, S, D)`` with ``H_kv``
    dividing ``H`` (GQA), all of one dtype (bf16, fp32 or fp64); ``attn_mask`` boolean (True: attend) or
    additive, broadcastable to ``(B, H, T, S)``; returns ``(B, H, T, D)`` in q's dtype. Raises what torch's
    kernel raises for shapes it refuses. Host syncs: none."""
    if is_causal and attn_mask is not None:
        raise ValueError("blockwise_attention: pass attn_mask or is_causal=True, not both "
                         "(as scaled_dot_product_attention)")
    if scale == 0:
        raise ValueError("blockwise_attention: scale=0 is not supported (every row would be uniform); use "
                         "scaled_dot_product_attention")
    out, _ = _Blockwise.apply(q, k, v, attn_mask, is_causal, scale)
    return out


def run(q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool, scale: float | None) -> torch.Tensor:
    """The op plan's entry point (inputs already in the autocast dtype)."""
    return blockwise_attention(q, k, v, attn_mask, is_causal, scale)
