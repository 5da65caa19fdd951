"""Gradient clipping by the global L2 norm, computed in fp32 whatever the gradients' dtypes and layouts.

Dense fp32 gradients take torch's ``clip_grad_norm_`` op order (``_foreach_norm`` per tensor, then the
norm of the norms); 16-bit ones are reduced in fp32 (``vector_norm(..., dtype=float32)``: squares of
fp16 values overflow fp16). Sparse COO gradients count by their *summed* values (duplicate indices
added first, as the optimizer will add them) and complex ones by their real view (``|z|² = re² + im²``,
as torch): :mod:`mixprec.gradients`. No host sync.
"""

from __future__ import annotations

import torch

from mixprec.gradients import summed_values, value_views

__all__ = ["global_norm_fp32", "clip_"]


def global_norm_fp32(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Global L2 norm of ``grads`` (dense, sparse COO or complex; any float dtype) as an fp32 ``()``
    tensor on ``grads[0]``'s device (on ``device`` when there are none). No host sync."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    values = [summed_values(g) for g in grads]
    norms: list[torch.Tensor] = []
    fp32 = [v for v in values if v.dtype == torch.float32]
    if fp32:
        norms.extend(torch._foreach_norm(fp32, 2.0))
    norms.extend(torch.linalg.vector_norm(v.float(), 2.0) if v.dtype == torch.float64 else
                 torch.linalg.vector_norm(v, 2.0, dtype=torch.float32)
                 for v in values if v.dtype != torch.float32)
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), 2.0)


def clip_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (as torch's
    ``clip_grad_norm_``); sparse and complex gradients through their value views. No host sync."""
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        v = value_views(g)
        by_dtype.setdefault((v.device, v.dtype), []).append(v)
    for (device, dtype), group in by_dtype.items():
        torch._foreach_mul_(group, clip_coef.to(device=device, dtype=dtype))
