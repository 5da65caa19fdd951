"""Gradients that are not plain dense real tensors, as the step's elementwise work sees them.

The step unscales, checks, measures and clips gradients with fused dense ops (``torch._foreach_*``,
``_amp_foreach_non_finite_check_and_unscale_``), which take neither sparse COO tensors
(``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) nor complex ones. Two views fix that,
the way ``torch.amp.GradScaler`` does for sparse gradients:

* :func:`value_views` — the dense real tensors holding a gradient's values, aliasing its storage:
  a sparse COO gradient's ``_values()`` (duplicate indices included: unscaling or clipping is a
  multiplication, so scaling each duplicate scales their sum), a complex one's ``view_as_real``.
  In-place ops on them change the gradient itself.
* :func:`summed_values` — the values the optimizer will add into the parameter: a sparse gradient
  coalesced (duplicates summed, in the gradient's dtype, as every consumer sums them), as a real view.
  The norm and the fp16 overflow check read these (a sum of finite fp16 values can overflow).

No function here syncs the host with the device.
"""

from __future__ import annotations

import torch

__all__ = ["value_views", "summed_values", "grouped_values", "plain"]


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def value_views(grad: torch.Tensor) -> torch.Tensor:
    """The dense real tensor holding ``grad``'s values (an alias: in-place ops write into ``grad``).
    Dense real: ``grad`` itself; sparse COO: its uncoalesced ``_values()``; complex: ``view_as_real``
    (its real dtype, trailing dimension 2)."""
    return _real(grad._values() if grad.is_sparse else grad)


def summed_values(grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s values with duplicate sparse indices summed (a coalesced copy for an uncoalesced sparse
    gradient, else an alias), as a dense real tensor: the values an optimizer adds into the parameter."""
    if grad.is_sparse:
        return _real(grad.coalesce()._values())
    return _real(grad)


def plain(grads: list[torch.Tensor]) -> bool:
    """True when every one of ``grads`` is a dense real tensor (its own value view and summed values),
    so the fused ops take the list as it is."""
    return not any(g.is_sparse or g.is_complex() for g in grads)


def grouped_values(grads: list[torch.Tensor | None]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The :func:`value_views` of the non-None ``grads``, grouped by (device, dtype) for the fused ops, in
    the order the groups are first met (and, in each, the order of ``grads``). One pass, no host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g is None:
            continue
        if g.is_sparse or g.is_complex():
            g = value_views(g)
        group = groups.get(key := (g.device, g.dtype))
        if group is None:
            groups[key] = [g]
        else:
            group.append(g)
    return groups
