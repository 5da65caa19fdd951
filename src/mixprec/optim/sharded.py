"""A sharded parameter as the optimizer steps it: its local shard and the shard's global offset.

Under FSDP2 every parameter is a ``DTensor`` sharded on dim 0 (``Shard(0)`` on a 1-D mesh): rank ``r`` of
``W`` holds rows ``[r * c, min((r + 1) * c, rows))`` with ``c = ceil(rows / W)`` (``torch.chunk``'s split, as
``fully_shard`` splits; the last shards may be short or empty: FSDP2 pads them in its own buffers only).
The optimizer steps the local tensor (``DTensor.to_local()``: the same storage, so in-place math writes
through) and keys stochastic rounding by the element's **global** flat index: the local shard's first
element is global element ``first_row * row_numel`` (:func:`global_offset`), and the shard's rows are
contiguous there, so :meth:`mixprec.optim.sr_stream.SRKey.at` makes a rank draw exactly the bits one
process draws for those elements. Element-wise state (moments, Kahan compensation) is a ``DTensor`` of the
parameter's placements, so ``torch.distributed.checkpoint`` saves it sharded, as FSDP2's fp32 AdamW state.
"""

from __future__ import annotations

import torch

__all__ = ["is_sharded", "global_offset", "local", "like_param"]


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter, gradient or state sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard (a ``DTensor``'s ``to_local()``, sharing storage); a plain tensor itself. No comm."""
    return t.to_local() if is_sharded(t) else t


def global_offset(p: torch.Tensor) -> int:
    """The global flat (row-major) index of the first element of ``p``'s local shard: 0 for a plain tensor,
    ``first_row * row_numel`` for a ``DTensor`` sharded on dim 0 of a 1-D mesh (module docstring).

    Raises:
        ValueError: another placement (replicated, sharded on another dim, a multi-dimensional mesh), or a local
            shard that is not the ``torch.chunk`` split (the offset would key other elements' bits).
    """
    if not is_sharded(p):
        return 0
    from torch.distributed.tensor import Shard

    placements, mesh = tuple(p.placements), p.device_mesh
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"a sharded param of shape {tuple(p.shape)} has placements {placements} on a "
                         f"{mesh.ndim}-D mesh; the optimizer steps FSDP2's Shard(0) on a 1-D mesh only (the global "
                         "index of stochastic rounding's stream is defined for it); shard with fully_shard defaults")
    rows, size, rank = p.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-rows // size)
    first = min(rank * chunk, rows)
    local_rows = p.to_local().shape[0] if p.dim() else 0
    if local_rows != min(chunk, rows - first):
        raise ValueError(f"a sharded param of shape {tuple(p.shape)} holds {local_rows} rows on rank {rank} of "
                         f"{size}, not torch.chunk's {min(chunk, rows - first)}; the optimizer steps FSDP2's even "
                         "chunks only (shard with fully_shard defaults)")
    return first * (p.numel() // rows if rows else 0)


def like_param(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor of ``p``'s local shape) as a ``DTensor`` placed as ``p`` (no comm); ``value``
    itself when ``p`` is a plain tensor."""
    if not is_sharded(p):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
