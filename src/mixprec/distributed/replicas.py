"""What the replicas of a multi-process run must share to stay equal, and the check that they are.

Under DDP every rank steps its own replica; averaged gradients keep them equal only if each rank rounds the same
way. :func:`check_same_sr_seeds` compares the optimizers' ``sr_seed`` (the counter-based stream of
:mod:`mixprec.optim.sr_stream`), :func:`check_same_rng` torch's global RNG state for an optimizer that still draws
from it (a torch optimizer: it has no ``sr_seed``). Each is a broadcast and an all-reduce, and every
rank raises together, so none waits in a later collective. :func:`agree_sr_seeds` instead gives every rank rank
0's seeds (what the trainer integrations do: a trainer seeds per rank on purpose, ``seed_everything(seed + rank)``).

:func:`check_replicas_equal` verifies the replicas bit for bit after the fact: one int64 fingerprint per tensor
(:func:`fingerprints`, exact integer arithmetic, so it does not depend on a reduction order), one all-gather, and
every rank raises together naming the first rank and tensor that differ from rank 0's.

Block-scaled linears round ``dy`` with one stochastic-rounding stream per linear, the same on every rank
(:mod:`mixprec.blockscale.streams`), whose state is the count of backward calls it served: equal on every rank as
long as every rank runs backward through the linear as often. A checkpoint holds one count per linear;
:func:`block_stream_mismatch` says (before a save) when the ranks' counts differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch import nn

from mixprec.distributed.process import any_across_ranks, from_main_process, gather_from_ranks, world_size

__all__ = ["check_same_rng", "check_same_sr_seeds", "SeedAgreement", "agree_sr_seeds", "fingerprints",
           "check_replicas_equal", "block_stream_mismatch"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # element size -> same-size int dtype
_CHUNK = 1 << 22   # elements fingerprinted at once: bounds the int64 temporaries (32 MiB each)


def check_same_rng(device: torch.device, what: str) -> None:
    """Raise ValueError on every rank unless each rank's torch RNG state for ``device`` equals rank 0's.

    ``what`` names the policy and what in it draws from that RNG (stochastic rounding): replicas that draw
    other noise round their params or state differently, and DDP's averaged gradients never bring them
    back together. A broadcast and an all-reduce (every rank raises, none waits in a later collective)."""
    state = (torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()).cpu()
    differs = not torch.equal(from_main_process(state), state)
    if bool(any_across_ranks(torch.tensor([float(differs)], device=device)).item()):   # syncs
        raise ValueError(f"{what} draws its rounding noise from torch's global RNG, whose state differs between "
                         "ranks (e.g. torch.manual_seed(seed + rank)), so the replicas would drift apart; call "
                         "torch.manual_seed(seed) with one seed on every rank before building MixedPrecision, or "
                         "use a policy without stochastic rounding (e.g. bf16-pure)")


def check_same_sr_seeds(seeds: list[int], device: torch.device, what: str) -> None:
    """Raise ValueError on every rank unless this rank's optimizer ``sr_seed`` per param group equals rank 0's.

    Stochastic rounding draws from the counter-based stream keyed by that seed (:mod:`mixprec.optim.sr_stream`;
    by default ``torch.initial_seed()`` when the optimizer was built): replicas with other seeds round their
    params or state differently, and DDP's averaged gradients never bring them back together. A broadcast and
    an all-reduce (every rank raises, none waits in a later collective)."""
    main = from_main_process(list(seeds))
    differs = main != list(seeds)
    if bool(any_across_ranks(torch.tensor([float(differs)], device=device)).item()):   # syncs
        raise ValueError(f"{what}: the optimizer's stochastic-rounding seeds (param_groups[i]['sr_seed'], by default "
                         f"torch.initial_seed() when the optimizer was built) differ between ranks (rank 0: {main}, "
                         f"this rank: {list(seeds)}), so the replicas would drift apart; call torch.manual_seed(seed) "
                         "with one seed on every rank before building the optimizer, or pass the same "
                         "sr_seed=<int> to the optimizer on every rank")



@dataclass(frozen=True)
class SeedAgreement:
    """What :func:`agree_sr_seeds` did: ``mine`` this rank's ``sr_seed`` per param group before, ``agreed`` rank 0's
    (now every rank's), ``ranks_differed`` whether any rank's seeds differed from rank 0's."""

    mine: tuple[int, ...]
    agreed: tuple[int, ...]
    ranks_differed: bool


def agree_sr_seeds(optimizer: torch.optim.Optimizer) -> SeedAgreement | None:
    """Set every param group's ``sr_seed`` on every rank to rank 0's, so stochastic rounding draws one stream on
    every replica (:mod:`mixprec.optim.sr_stream`); returns what changed. None, with nothing changed, when the
    optimizer has no ``sr_seed`` on some rank (a torch optimizer: torch's global
    RNG, see :func:`check_same_rng`) or the ranks' optimizers have different numbers of param groups. One
    ``all_gather_object`` every rank calls at the same point (every rank then decides alike); no collective and
    nothing changed with one process."""
    seeds = [group.get("sr_seed") for group in optimizer.param_groups]
    if world_size() == 1:
        return None
    every = gather_from_ranks(seeds)
    if any(None in s or len(s) != len(every[0]) for s in every):
        return None
    for group, seed in zip(optimizer.param_groups, every[0]):
        group["sr_seed"] = int(seed)
    return SeedAgreement(mine=tuple(int(s) for s in seeds), agreed=tuple(int(s) for s in every[0]),
                         ranks_differed=any(s != every[0] for s in every))


def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor of ``tensors`` (any dtype, on one device; returned there, shape ``(len(tensors),)``):
    the sum over its elements of ``bits(x_i) * (2 i + 1)`` wrapping modulo 2**64, with ``bits`` the element's
    bit pattern as a same-size integer. Two tensors with equal bits give equal fingerprints on any machine
    (integer sums do not depend on their order); one element that differs always changes it. Reads each tensor
    once (in chunks of 4M elements), no host sync."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        bits = flat.view(_BITS[flat.element_size()])
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, bits.numel(), _CHUNK):
            chunk = bits[start:start + _CHUNK].to(torch.int64)
            odd = torch.arange(2 * start + 1, 2 * (start + chunk.numel()), 2, dtype=torch.int64, device=flat.device)
            total += (chunk * odd).sum()
        out.append(total)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def check_replicas_equal(named: list[tuple[str, torch.Tensor]], *, step: int, what: str) -> None:
    """Raise RuntimeError on every rank unless each rank's ``named`` tensors (the same names in the same order on
    every rank) equal rank 0's bit for bit, by :func:`fingerprints`. ``step``: the boundary it runs after, ``what``:
    the run's words for the message (e.g. ``"MixprecPrecision under strategy='ddp'"``). One all-gather of
    ``len(named)`` int64 per rank and one host read; nothing with one process."""
    if world_size() == 1 or not named:
        return
    mine = fingerprints([t for _, t in named])
    gathered = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered)   # (W, T)
    differs = table != table[0]
    if not bool(differs.any()):   # syncs
        return
    rows = differs.any(dim=1).nonzero().flatten().tolist()
    rank = rows[0]
    names = [named[i][0] for i in differs[rank].nonzero().flatten().tolist()]
    raise RuntimeError(f"{what}: the replicas differ after step {step}: rank {rank}'s {names[0]!r} is not rank 0's "
                       f"({len(names)} of {len(named)} tensors differ on rank {rank}: {names[:4]}; ranks differing "
                       f"from rank 0: {rows}). Something changed one rank's weights or gradients alone: a callback "
                       "or hook that edits params or gradients on one rank, a rank-local gradient step, or rounding "
                       "noise seeded per rank; training on would average gradients over replicas that no longer "
                       "agree. Find what runs on that rank only; lower verify_replicas_every to find the step")


def block_stream_mismatch(model: nn.Module) -> str | None:
    """None when every rank's block-scaled linears of ``model`` (the unwrapped module) have served as many backward
    calls as rank 0's (module docstring); else the words naming the first linear and rank that differ, and what a
    checkpoint then holds. One ``all_gather_object`` every rank calls at the same point (none with one process or
    without block-scaled linears, the same on every rank); no host sync (the counts are host ints)."""
    from mixprec.blockscale import BlockScaledLinear

    mine = {name: int(m.get_extra_state()[1]) for name, m in model.named_modules() if isinstance(m, BlockScaledLinear)}
    if world_size() == 1 or not mine:
        return None
    every = gather_from_ranks(mine)
    for rank, counts in enumerate(every):
        differ = [name for name in every[0] if counts.get(name) != every[0][name]]
        if differ:
            name = differ[0]
            return (f"the stochastic-rounding streams of the block-scaled linears differ between ranks: rank {rank}'s "
                    f"{name!r} has served {counts.get(name)} backward call(s), rank 0's {every[0][name]} ({len(differ)} "
                    "linear(s) differ): a rank ran backward through them another number of times (a branch or layer "
                    "skipped on some ranks). A checkpoint holds one count per linear, so a resume continues every "
                    "rank from one rank's: valid stochastic rounding, not bit for bit on the ranks that differed")
    return None
