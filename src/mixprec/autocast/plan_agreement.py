"""Every rank runs the same measured kernel per key: rank 0's choice, agreed at an accumulation boundary.

Under a multi-process strategy each rank measures its own op plan (:mod:`mixprec.autocast.op_plan`), and timings
differ per rank (noise), so ranks could run different attention kernels at one key: different rounding per rank,
eval losses that differ in the last digit, a result that depends on who measured what. Once an engine under
``strategy="ddp"``/``"fsdp2"`` marks this process as one of N ranks (:func:`require`), a key this rank measured
itself (source ``measured``, ``cache`` or noisy) is **pending**: :func:`running` runs ``fused`` (the default, the
same on every rank) for it, whatever this rank measured. At the next accumulation boundary every rank calls the
same collectives (:mod:`mixprec.engine.kernel_agreement`: one all-reduce of a flag, and when any rank has a
pending key one ``all_gather_object`` of each rank's pending keys and choices); :func:`settle` turns what was
gathered into the same pins on every rank: rank 0's choice, or ``fused`` where rank 0 had not met the key (so
rank 0 cannot later measure it differently: the pin holds there too). From then on every rank runs the pinned
kernel (source ``"rank 0's choice, agreed by N ranks"``). No collective runs inside a forward, so eval or
rank-dependent code cannot hang on it. Pins (a checkpoint's, the bench's, an earlier agreement's) and traced
defaults are settled already. One process (no strategy, a group of one rank, or once the process group is
destroyed): nothing here applies. No host sync.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from mixprec.autocast.plan_entry import PlanEntry

__all__ = ["require", "ranks", "pending", "running", "settle", "AGREED"]

AGREED = "rank 0's choice"                 # the prefix of an agreed entry's source
_DEFAULT = "fused"                         # what a pending key runs on every rank (op_plan's default)
_OWN = ("measured", "cache")               # sources of this rank's own measurement (noisy ones start "measured")
_world: list[int] = [0]                    # 0: one process, nothing to agree; N: this process is one of N ranks


def require(world: int) -> None:
    """Mark this process as one of ``world`` ranks (0: one process; the rule off). Process-wide. ValueError for
    a negative ``world``."""
    if not isinstance(world, int) or world < 0:
        raise ValueError(f"require(world={world!r}): the number of ranks, an int >= 0 (0: one process)")
    _world[0] = world


def ranks() -> int:
    """The number of ranks this process agrees with (0: one process, or its process group is gone: nothing is
    agreed)."""
    return _world[0] if dist.is_available() and dist.is_initialized() else 0


def pending(entry: PlanEntry) -> bool:
    """Whether ``entry`` is this rank's own measurement not yet agreed (False in one process)."""
    return bool(ranks()) and entry.source.startswith(_OWN)


def running(entry: PlanEntry) -> PlanEntry:
    """The entry that runs: ``entry`` itself, or for a pending one (:func:`pending`) the same entry running
    ``fused``, its note saying what this rank measured and that the ranks agree at the next boundary."""
    if not pending(entry) or entry.chosen == _DEFAULT:
        return entry
    note = (f"this rank measured {entry.chosen}; runs {_DEFAULT} (every rank) until the {_world[0]} ranks agree on "
            "rank 0's choice at the next accumulation boundary")
    return dataclasses.replace(entry, chosen=_DEFAULT, note="; ".join(filter(None, [entry.note, note])))


def settle(gathered: list[dict[str, str]]) -> dict[str, tuple[str, str]]:
    """key → (chosen, source) for every key any rank has pending, from ``gathered`` (each rank's pending key →
    its own choice, rank order: what ``all_gather_object`` returns): rank 0's choice, or ``fused`` where rank 0
    had not met the key. The same result on every rank (it depends on ``gathered`` alone). ValueError when
    ``gathered`` is empty."""
    if not gathered:
        raise ValueError("settle(gathered=[]): one dict per rank (key -> choice), rank 0's first")
    world, rank0 = len(gathered), gathered[0]
    out: dict[str, tuple[str, str]] = {}
    for own in gathered:
        for key in own:
            if key not in out:
                out[key] = ((rank0[key], f"{AGREED}, agreed by {world} ranks") if key in rank0 else
                            (_DEFAULT, f"{AGREED} ({_DEFAULT}: rank 0 had not met this key), agreed by {world} ranks"))
    return out
