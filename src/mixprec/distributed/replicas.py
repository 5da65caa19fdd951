"""What the replicas of a multi-process run must share to stay equal: the stream stochastic rounding draws from.

Under DDP every rank steps its own replica; averaged gradients keep them equal only if each rank rounds the same
way. :func:`check_same_sr_seeds` compares the optimizers' ``sr_seed`` (the counter-based stream of
:mod:`mixprec.optim.sr_stream`), :func:`check_same_rng` torch's global RNG state for an optimizer that still draws
from it (a torch optimizer, or state from before the stream). Each is a broadcast and an all-reduce, and every
rank raises together, so none waits in a later collective.
"""

from __future__ import annotations

import torch

from mixprec.distributed.process import any_across_ranks, from_main_process

__all__ = ["check_same_rng", "check_same_sr_seeds"]


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

