"""The attention kernels the op plan (:mod:`mixprec.autocast.op_plan`) chooses among: what each computes, where
it is offered, and what it saves for backward.

Each candidate is ``fn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype)`` (the arguments of
``scaled_dot_product_attention``, ``dtype`` the autocast dtype, run with autocast off) and returns ``dtype``:

* ``fused``: torch's kernel on inputs cast to ``dtype`` (what ``torch.autocast`` runs).
* ``fused-fp32``: torch's kernel on fp32 copies, the output rounded once to ``dtype``; it saves the fp32 copies
  and the fp32 output for backward (twice ``fused``'s bytes).
* ``matmul``: ``q·kᵀ`` in ``dtype`` (scores rounded once), scale, causal mask and softmax in fp32,
  probabilities cast to ``dtype``, then ``·v`` (Hugging Face's "eager" attention); it saves the fp32 and the
  ``dtype`` probabilities (B·H·T·S·6 bytes in bf16: 144 MiB per layer at the ``small`` GPT's B64·H6·T256).
* ``blockwise``: torch's fused CPU forward, saving what ``fused`` saves (q, k, v, the output, the logsumexp),
  and a backward that recomputes the probabilities block by block over queries with ``dtype`` GEMMs
  (:mod:`mixprec.autocast.blockwise_attention`); CPU, bf16, no dropout, 4-D inputs.

:func:`saved_per_call` measures what each saves (:func:`mixprec.memory.saved.saved_bytes`: one forward on the
planned shapes, no backward).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mixprec.autocast.blockwise_attention import offered_here, run as _blockwise_run
from mixprec.memory.saved import SavedTensorCounter

__all__ = ["CANDIDATES", "MATMUL_SCORES_LIMIT", "NOT_FP16", "offered", "saved_per_call"]

MATMUL_SCORES_LIMIT = 256 << 20   # bytes of fp32 scores above which the matmul form is not offered
NOT_FP16 = "not offered under fp16 (its fp16 scores could overflow at 65504)"
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _cast(t: Any, dtype: torch.dtype) -> Any:
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t


def _fused(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype):
    return _SDPA(_cast(q, dtype), _cast(k, dtype), _cast(v, dtype), _cast(attn_mask, dtype), dropout_p, is_causal,
                 scale=scale, enable_gqa=enable_gqa)


def _fused_fp32(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype):
    f32 = torch.float32
    out = _SDPA(_cast(q, f32), _cast(k, f32), _cast(v, f32), _cast(attn_mask, f32), dropout_p, is_causal,
                scale=scale, enable_gqa=enable_gqa)
    return out.to(dtype)


def _matmul(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype):
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    exact = math.frexp(scale)[0] == 0.5          # a power of two scales q exactly in any float format
    scores = torch.matmul(q * scale if exact else q, k.transpose(-2, -1))   # rounded once to ``dtype``
    if not exact:
        scores = scores.float() * scale
    if is_causal:
        length, source = q.size(-2), k.size(-2)
        keep = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()   # top-left, as torch's sdpa
        scores = scores.masked_fill_(~keep, float("-inf"))
    probs_fp32 = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if dropout_p > 0:
        probs_fp32 = F.dropout(probs_fp32, dropout_p, training=True)
    return torch.matmul(probs_fp32.to(dtype), v)


def _blockwise(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype):
    if dropout_p > 0:
        raise ValueError(f"blockwise attention: dropout_p={dropout_p} is not supported (offered without dropout)")
    return _blockwise_run(_cast(q, dtype), _cast(k, dtype), _cast(v, dtype),
                          attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else _cast(attn_mask, dtype),
                          is_causal, scale)


#: candidate name -> ``fn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype)`` (autocast off)
CANDIDATES: dict[str, Callable] = {"fused": _fused, "fused-fp32": _fused_fp32, "matmul": _matmul,
                                   "blockwise": _blockwise}


def offered(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, dtype: torch.dtype, *,
            dropout_p: float = 0.0, scale: float | None = None) -> dict[str, str]:
    """Candidate → why it is not offered at this key ("" when it is): ``matmul`` not under fp16, not with
    ``attn_mask`` (a fully masked row is NaN there, 0 in a fused kernel), not when its fp32 scores would exceed
    :data:`MATMUL_SCORES_LIMIT` bytes; ``blockwise`` on the CPU only, not under fp16, not with dropout
    (:func:`mixprec.autocast.blockwise_attention.offered_here`). No host sync."""
    scores = 4 * math.prod(q.shape[:-1]) * k.size(-2)
    why_not = {name: "" for name in CANDIDATES}
    why_not["blockwise"] = offered_here(q, k, dtype, dropout_p, scale)
    if dtype == torch.float16:
        why_not["matmul"] = NOT_FP16
    elif attn_mask is not None:
        why_not["matmul"] = "not offered with attn_mask"
    elif scores > MATMUL_SCORES_LIMIT:
        why_not["matmul"] = f"not offered: its fp32 scores would take {scores / 2**20:.0f} MiB"
    return why_not


def saved_per_call(forwards: dict[str, Callable[[], Any] | None]) -> dict[str, int | None]:
    """Bytes each zero-argument forward (None: not offered) saves for backward, each storage once
    (:class:`mixprec.memory.saved.SavedTensorCounter`; the graph is dropped, no backward runs). 0 under no_grad;
    None for every candidate where saved-tensor hooks are disabled (inside a torch.func transform: unknown).
    Host syncs: none of its own (the forwards')."""
    if torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
        return dict.fromkeys(forwards)
    saved: dict[str, int | None] = {}
    for name, forward in forwards.items():
        if forward is None:
            saved[name] = None
            continue
        with SavedTensorCounter() as counter:
            out = forward()
        saved[name] = counter.result().total
        del out
    return saved
