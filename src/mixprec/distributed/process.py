"""Multi-process training on torch.distributed: process group, DDP / FSDP2 wrapping, agreed decisions.

``MixedPrecision(model, optimizer, policy, strategy="ddp" | "fsdp2")`` uses this module; the
functions are public for training loops that need them (data sharding, rank-0 logging,
checkpoints). Launch with ``torchrun --nproc-per-node N`` (one process per device).

**Process group.** :func:`init_process_group_from_env` joins the group torchrun describes
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) unless one is
already initialised: ``nccl`` on CUDA (device ``cuda:LOCAL_RANK``), ``gloo`` on the CPU. Without
torchrun's variables it makes a group of one process, so a strategy also runs (and resumes a
checkpoint) in a plain ``python`` process.

**Data.** Every rank builds the same seeded batch stream and keeps its own share of it
(:func:`shard_batches`): rank ``r`` of ``W`` takes batches ``r, r + W, r + 2W, ...``. With
``A`` accumulation steps, micro-batch ``j`` of optimizer step ``k`` on rank ``r`` is batch
``(k * A + j) * W + r``, and the **global batch** is per-rank batch × ``W`` × ``A``. Every
gradient reduction averages over ranks, so a run on ``W`` ranks equals a one-process run on
the concatenated global batch (up to the order of floating-point sums).

**Policy → strategy mapping**: :mod:`mixprec.distributed.wrapping` (DDP's fp32 comm hook, FSDP2's sharded
blocks and ``MixedPrecisionPolicy`` per policy); its public names are importable from here too.

**Agreed decisions.** Every precision decision is the OR over ranks of the local decisions
(:func:`any_across_ranks`, an all-reduce MAX on a device flag): the engine's found-inf flag
(computed on the local shard under FSDP2) and non-finite-loss flag, and the guard's cause
(:meth:`mixprec.MixedPrecision.agree_on`). All ranks call the same collectives at every
accumulation boundary, whatever they saw, so none can wait for another that took another
branch (a rank that skipped while another stepped would deadlock the next collective).

Cost per accumulation boundary, besides the gradient reductions: one all-reduce of two flags
(engine), one more of the guard's causes when a guard is attached, and under FSDP2 one of the
squared gradient norm (the global norm over all shards, for clipping and ``StepResult``).
With ``kernels=measured`` at 2+ ranks: one flag's all-reduce and host read, and a :func:`gather_from_ranks` after
new attention keys (every rank runs rank 0's kernel: :mod:`mixprec.engine.kernel_agreement`).

**Checkpoints.** :func:`mixprec.save_checkpoint` writes what the strategy needs (:mod:`mixprec.checkpoint`:
the one-process format from rank 0 under DDP, DCP shards under FSDP2) and records the strategy and world size.

**Limits.** ``set_policy`` (and so the guard's escalation) is refused under FSDP2 unless it changes the
optimizer state's precision or keeps more modules in fp32 (:mod:`~mixprec.distributed.sharded_switch`,
:mod:`~mixprec.distributed.sharded_units`), and under DDP when it would change a parameter's stored dtype
(DDP's buckets are built for them): the guard then notes the refusal and keeps rolling back. The guard does
not localise a bad batch under DDP (under FSDP2 every rank re-runs its batches forward only). fp8 policies are not tested under a strategy. Only 1-D data parallelism
(no tensor/pipeline parallel meshes).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.wrapping import (STRATEGIES, CastHiddenState, check_fsdp_policy, check_strategy,
                                          gradient_reduce_dtypes, local_tensors, set_gradient_sync, wrap_model)

__all__ = ["STRATEGIES", "check_strategy", "init_process_group_from_env", "leave_process_group", "is_main_process", "rank", "world_size",
           "any_across_ranks", "sum_across_ranks", "from_main_process", "gather_from_ranks", "shard_batches", "sync_module_states", "wrap_model",
           "set_gradient_sync", "local_tensors", "gradient_reduce_dtypes", "check_fsdp_policy", "CastHiddenState"]

log = logging.getLogger("mixprec")


# ---------------------------------------------------------------------- the process group
def _rank_device(device: str | torch.device | None) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} cannot run torch.distributed (no backend for it); "
                         "use cpu (gloo) or cuda (nccl)")
    return device


def leave_process_group(*, wait_for_all: bool = False) -> None:
    """Destroy the default process group if one exists (the CLI's last act under torchrun: a gloo group
    left alive at interpreter exit can abort a rank with ``terminate called without an active exception``).

    ``wait_for_all`` (a rank that finished cleanly): first a barrier (gloo: ``monitored_barrier``, 60 s), so no
    rank tears its group down while a peer's last collective still talks to it — the same abort, seen under
    load. A barrier that fails or times out (a peer crashed) is ignored: the group is destroyed regardless."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_all and dist.get_world_size() > 1:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            else:
                dist.barrier()
        except RuntimeError:
            pass
    dist.destroy_process_group()


def init_process_group_from_env(device: str | torch.device | None = None, *,
                                timeout: timedelta | None = None) -> torch.device:
    """Join the process group of this torchrun worker (once) and return this rank's device.

    ``device``: None picks ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU;
    ``"cuda"`` without an index means ``cuda:LOCAL_RANK``. Backend: nccl on CUDA, gloo on the
    CPU. An already initialised default group is used as it is. Without ``WORLD_SIZE`` and
    ``RANK`` in the environment (no torchrun) a group of one process is made.

    Raises:
        ValueError: a device torch.distributed has no backend for (e.g. mps).
        RuntimeError: torch.distributed is not available in this build.
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; strategy=None runs in one process")
    device = _rank_device(device)
    if dist.is_initialized():
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend, **kwargs)  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    log.info("mixprec: joined process group: rank %d of %d (%s) on %s", dist.get_rank(), dist.get_world_size(),
             backend, device)
    return device


def world_size() -> int:
    """Processes in the default group (1 when none is initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 when none is initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_group_rank, _group_size = rank, world_size  # for functions whose arguments shadow the names


def is_main_process() -> bool:
    """True on rank 0, and in a process without a group: the one that logs and writes files."""
    return rank() == 0


def any_across_ranks(flag: torch.Tensor) -> torch.Tensor:
    """Elementwise logical OR over ranks of ``flag`` (nonzero = True): every rank gets the same.

    ``flag``: a device tensor of any shape (bool, or a number where nonzero means True).
    Returns a new tensor of ``flag``'s dtype (bool: the OR; a number: the max over ranks, so
    0/1 flags stay 0/1). A collective (all-reduce MAX), no host sync: every rank must call it
    at the same point. Without a group, or with one rank, returns ``flag`` itself.
    """
    if world_size() == 1:
        return flag
    flag_fp32 = flag.to(torch.float32, copy=True)  # gloo and nccl both reduce fp32 with MAX
    dist.all_reduce(flag_fp32, op=dist.ReduceOp.MAX)
    return flag_fp32 > 0 if flag.dtype == torch.bool else flag_fp32.to(flag.dtype)


def sum_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``value`` (a new tensor; an all-reduce SUM, no host sync)."""
    if world_size() == 1:
        return value
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def shard_batches(batches: Iterable[Any], *, rank: int | None = None, world_size: int | None = None) -> Iterator[Any]:
    """This rank's share of a deterministic batch stream: batches ``rank, rank + W, ...``.

    Every rank must iterate the same stream (same seed); the global batch is per-rank batch ×
    ``W`` × accumulation steps. ``rank``/``world_size`` default to the process group's.
    """
    r = _group_rank() if rank is None else rank
    w = _group_size() if world_size is None else world_size
    if not (0 <= r < w):
        raise ValueError(f"shard_batches: rank={r!r} must lie in [0, world_size={w!r})")
    return itertools.islice(batches, r, None, w)


def sync_module_states(module: nn.Module) -> None:
    """Broadcast ``module``'s parameters and buffers from rank 0 (in place), so every rank
    starts from rank 0's weights, as DDP does at construction. Collective; no-op on one rank."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor.data, src=0)



def from_main_process(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a collective broadcast; ``obj`` must pickle). Without a
    group, or with one rank, ``obj`` itself."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_from_ranks(obj: Any) -> list[Any]:
    """Every rank's ``obj``, rank order, on every rank (a collective ``all_gather_object``; ``obj`` must pickle).
    Without a group, or with one rank, ``[obj]``."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
