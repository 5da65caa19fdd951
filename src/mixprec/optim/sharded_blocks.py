"""8-bit optimizer state of a sharded (FSDP2) param: blocks by global element index, the same codes and scales
at any world size.

One process quantizes a moment in blocks of 256 consecutive elements of the flattened param, each with one fp32
absmax (:mod:`mixprec.optim.quantized_state`). FSDP2 shards dim 0 in ``torch.chunk``'s split, so a rank's local
shard holds global elements ``[offset, offset + n)`` (:func:`mixprec.optim.sharded.global_offset`), and
``offset`` is a multiple of 256 only when the rows fall that way. The blocks stay the global ones: the shard is
cut at the global block boundaries (:func:`pieces`) into a *head* (the end of a block that starts on the rank
before), an *interior* of whole blocks and a *tail* (the start of a block that ends on the next rank); a shard
inside one block is a head or a tail alone.

* The interior steps as one process steps those blocks: the fused C kernel (or its torch-op reference) on the
  interior's flat view, with the scales of its blocks, stochastic rounding keyed at its global offset.
* A head or tail is stepped element-wise in fp32 (:func:`mixprec.optim.quantized_adamw.update_fp32_`, the
  same bits as the kernel) and its partial absmax taken; then **one all-reduce (MAX) per quantized param and
  step** of the param's scales (``2 x ceil(numel / 256)`` fp32: the interiors' scales from their rank, each
  cut block's partial absmaxes from every rank holding a piece, ``-inf`` elsewhere; NaN sent as ``+inf``, read
  back NaN) gives every rank every block's absmax, which is one process's (a max over pieces is the max over
  the block; the short last block's zero padding changes no absmax). The pieces are then coded against it,
  drawing their stochastic-rounding bits at their global indices.

State layout: the codes are a ``DTensor`` placed as the param (saved sharded by DCP); the scales are one plain
fp32 tensor of all ``ceil(numel / 256)`` blocks, the same on every rank after every step (4 bytes per 256
elements per moment, not sharded: 0.03 B/param on every rank), which DCP saves once as a replicated tensor and
loads whole at any world size. Comm: the all-reduce above, ``8 / 256`` bytes per param element per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.optim import quantized_adamw
from mixprec.optim import quantized_state as qs
from mixprec.optim import sharded
from mixprec.optim.precision_optimizer import PrecisionOptimizer
from mixprec.optim.state_codec import as_fp32
from mixprec.optim.sr_stream import SRKey

__all__ = ["Pieces", "pieces", "step_adamw_"]

_BLOCK = qs.BLOCK_SIZE


@dataclass(frozen=True)
class Pieces:
    """A local shard cut at the global block boundaries: local flat ``[start, stop)`` ranges (empty when
    ``start == stop``). ``offset``: the global index of local element 0; ``nblocks``: the param's blocks."""

    offset: int
    head: tuple[int, int]
    interior: tuple[int, int]
    tail: tuple[int, int]
    nblocks: int

    @property
    def interior_blocks(self) -> tuple[int, int]:
        """The global block indices ``[first, stop)`` of the interior."""
        start, stop = self.interior
        first = (self.offset + start) // _BLOCK
        return first, first + math.ceil((stop - start) / _BLOCK)

    def edges(self) -> list[tuple[int, int]]:
        """The non-empty head and tail: each a piece of one block cut by a shard boundary."""
        return [r for r in (self.head, self.tail) if r[1] > r[0]]

    def block_of(self, start: int) -> int:
        """The global block holding local element ``start``."""
        return (self.offset + start) // _BLOCK


def pieces(offset: int, local_numel: int, numel: int) -> Pieces:
    """Cut the local shard ``[offset, offset + local_numel)`` of a param of ``numel`` elements at the global
    256-element block boundaries (module docstring)."""
    lo, hi = offset, offset + local_numel
    first_whole = -(-lo // _BLOCK) * _BLOCK                       # the first block starting at or after lo
    whole_end = hi if hi == numel else (hi // _BLOCK) * _BLOCK    # the global short last block is whole
    head_stop = min(first_whole, hi)
    interior = (first_whole, whole_end) if whole_end > first_whole else (head_stop, head_stop)
    tail_start = max(interior[1], head_stop)
    return Pieces(offset, (0, head_stop - lo), (interior[0] - lo, interior[1] - lo), (tail_start - lo, hi - lo),
                  -(-numel // _BLOCK))


@dataclass(frozen=True)
class _Views:
    """Flat views of one step's local tensors (they share storage: writes land in the shard and its state)."""

    param: torch.Tensor
    grad: torch.Tensor
    m_codes: torch.Tensor
    v_codes: torch.Tensor
    comp: torch.Tensor | None


def step_adamw_(opt: PrecisionOptimizer, p: torch.Tensor, state: dict[str, Any], hyper: dict[str, float],
                lost_counts: list) -> None:
    """One AdamW step of the sharded param ``p`` whose moments are 8-bit codes (module docstring): in place on
    its local shard, codes and the whole scales. Collective: one all-reduce on ``p``'s mesh (every rank calls
    it for the same params in the same order, as every rank steps every param FSDP2 gave a gradient).
    """
    shard, grad, local_state = opt.state_codec.local_view(p, state)
    cut = pieces(sharded.global_offset(p), shard.numel(), p.numel())
    comp = local_state.get("kahan_comp")
    views = _Views(shard.reshape(-1), grad.reshape(-1), local_state["exp_avg"].reshape(-1),
                   local_state["exp_avg_sq"].reshape(-1), None if comp is None else comp.reshape(-1))
    m_abs, v_abs = state["exp_avg" + qs.ABSMAX_SUFFIX], state["exp_avg_sq" + qs.ABSMAX_SUFFIX]
    edges = [_edge_update(opt, p, state, views, cut, span, (m_abs, v_abs), hyper, lost_counts) for span in cut.edges()]
    _interior_step(opt, p, state, views, cut, (m_abs, v_abs), hyper, lost_counts)
    _agree(p, cut, (m_abs, v_abs), edges, views)
    for (start, stop), m_fp32, v_fp32 in edges:
        block = cut.block_of(start)
        for codes, absmax, value, key in ((views.m_codes, m_abs, m_fp32, "exp_avg"),
                                          (views.v_codes, v_abs, v_fp32, "exp_avg_sq")):
            code = qs.code_of(codes, nonnegative=key == "exp_avg_sq")
            piece = views.param[start:stop]
            codes[start:stop].copy_(qs.quantize_piece(value, absmax[block], code, rounding=opt.state_rounding,
                                                      generator=_key(opt, p, state, piece, cut.offset + start, key)))


def _key(opt: PrecisionOptimizer, p: torch.Tensor, state: dict[str, Any], piece: torch.Tensor, offset: int,
         purpose: str) -> SRKey:
    """The stream key of ``piece`` (a flat view of ``p``'s shard from global index ``offset``) for ``purpose``: the
    bits of the whole param's elements there, whatever the sharding."""
    opt.stream_keys.add_piece(piece, p, offset)
    return opt.stream_keys.key(piece, state, purpose)


def _piece_state(state: dict[str, Any], views: _Views, start: int, stop: int) -> dict[str, Any]:
    return {"step": state["step"], **({} if views.comp is None else {"kahan_comp": views.comp[start:stop]})}


def _edge_update(opt: PrecisionOptimizer, p: torch.Tensor, state: dict[str, Any], views: _Views, cut: Pieces,
                 span: tuple[int, int], scales: tuple[torch.Tensor, torch.Tensor], hyper: dict[str, float],
                 lost_counts: list) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
    """Step a head or tail piece: decode its moments with the block's scales, the fp32 update, the write-back
    into the param; returns ``(span, m_fp32, v_fp32)`` (coded once the block's absmax is agreed)."""
    start, stop = span
    block = cut.block_of(start)
    m_fp32 = qs.dequantize_piece(views.m_codes[start:stop], scales[0][block],
                                 qs.code_of(views.m_codes, nonnegative=False))
    v_fp32 = qs.dequantize_piece(views.v_codes[start:stop], scales[1][block],
                                 qs.code_of(views.v_codes, nonnegative=True))
    piece = views.param[start:stop]
    _key(opt, p, state, piece, cut.offset + start, "param")   # registers the piece's global offset
    param_fp32 = as_fp32(piece)
    quantized_adamw.update_fp32_(param_fp32, as_fp32(views.grad[start:stop]), m_fp32, v_fp32, **hyper)
    opt.write_back.write(piece, param_fp32, _piece_state(state, views, start, stop), lost_counts)
    return span, m_fp32, v_fp32


def _interior_step(opt: PrecisionOptimizer, p: torch.Tensor, state: dict[str, Any], views: _Views, cut: Pieces,
                   scales: tuple[torch.Tensor, torch.Tensor], hyper: dict[str, float], lost_counts: list) -> None:
    """Step the interior's whole blocks as one process steps them: the fused kernel where it applies, else its
    torch-op reference and the write-back (the same bits)."""
    start, stop = cut.interior
    if stop <= start:
        return
    first, end = cut.interior_blocks
    piece, grad = views.param[start:stop], views.grad[start:stop]
    m = (views.m_codes[start:stop], scales[0][first:end])
    v = (views.v_codes[start:stop], scales[1][first:end])
    key = _key(opt, p, state, piece, cut.offset + start, "param")
    piece_state = _piece_state(state, views, start, stop)
    if not opt.write_back.checks_lost_updates(piece, piece_state) and quantized_adamw.fusable(
            piece, grad, m[0], v[0], rounding=opt.rounding):
        quantized_adamw.fused_step_(piece, grad, m, v, rounding=opt.rounding, state_rounding=opt.state_rounding,
                                    generator=key, **hyper)
        return
    param_fp32 = as_fp32(piece)
    quantized_adamw.reference_update_(param_fp32, as_fp32(grad), m, v, state_rounding=opt.state_rounding,
                                      generator=key, **hyper)
    opt.write_back.write(piece, param_fp32, piece_state, lost_counts)


def _agree(p: torch.Tensor, cut: Pieces, scales: tuple[torch.Tensor, torch.Tensor],
           edges: list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]], views: _Views) -> None:
    """Every block's absmax on every rank: one all-reduce (MAX) on ``p``'s mesh of this rank's interior scales
    and edge pieces' partial absmaxes (``-inf`` for blocks it does not hold; NaN sent as ``+inf``, read back NaN,
    as one process stores a non-finite block's absmax). Writes both moments' whole scales in place."""
    m_code, v_code = qs.code_of(views.m_codes, nonnegative=False), qs.code_of(views.v_codes, nonnegative=True)
    buf = torch.full((2, cut.nblocks), -math.inf, dtype=torch.float32, device=scales[0].device)
    first, end = cut.interior_blocks
    buf[0, first:end], buf[1, first:end] = scales[0][first:end], scales[1][first:end]
    for (start, _), m_fp32, v_fp32 in edges:
        block = cut.block_of(start)
        buf[0, block], buf[1, block] = qs.piece_absmax(m_fp32, m_code), qs.piece_absmax(v_fp32, v_code)
    buf = buf.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=p.device_mesh.get_group())
    buf = torch.where(torch.isfinite(buf), buf, torch.nan)
    scales[0].copy_(buf[0])
    scales[1].copy_(buf[1])
