"""Several processes under a trainer: what keeps the replicas equal when the trainer, not the engine, runs them.

The engine's own ``strategy=`` refuses per-rank rounding seeds and owns its accumulation count; under a trainer
(Lightning's DDP, Fabric, the Hugging Face Trainer under torchrun) the trainer seeds, wraps and accumulates. Each
integration holds one :class:`ReplicaChecks`:

* :meth:`ReplicaChecks.agree_seeds`, when the optimizer is attached (and again after a checkpoint load): every
  rank takes rank 0's ``sr_seed`` (:func:`mixprec.distributed.replicas.agree_sr_seeds`; trainers seed per rank on
  purpose, ``seed_everything(seed + rank)``, which gave every replica its own stochastic-rounding stream), said in
  a ``"replicas"`` event and the decision.
* :meth:`ReplicaChecks.at_boundary`, after every ``every``-th boundary: the replicas' params and fp32 masters
  compared bit for bit by fingerprint (one all-gather; :func:`mixprec.distributed.replicas.check_replicas_equal`),
  RuntimeError on every rank naming the rank and tensor that differ.
* :func:`gather_windows` / :func:`own_window`, at a checkpoint taken inside an accumulation window: each rank's
  gradients of an open window are its own (the trainer's ``no_sync`` reduces them at the window's last
  micro-batch), so the checkpoint (written by rank 0) holds every rank's window, and each rank takes its own back.
* :func:`check_accumulation`, at every micro-batch (Lightning: a ``GradientAccumulationScheduler`` changes the
  count mid-run): fp32 masters need every micro-batch reduced, which a trainer's ``no_sync`` prevents; under the
  engine's FSDP2, 16-bit params without masters need the micro-batches summed before the reduction.

One process: nothing runs, no collective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from mixprec.distributed.process import gather_from_ranks, rank, world_size
from mixprec.distributed.replicas import agree_sr_seeds, check_replicas_equal, check_same_rng
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.records import Event
from mixprec.policy.policy import Policy

__all__ = ["DEFAULT_EVERY", "check_every", "ReplicaChecks", "check_accumulation", "follow_accumulation",
           "gather_windows", "own_window"]

#: Boundaries between two fingerprint checks by default: every 100 steps one read of the weights (and fp32
#: masters), one all-gather of one int64 per tensor and one host read.
DEFAULT_EVERY = 100


def check_every(every: Any, owner: str) -> int:
    """``every`` as an int >= 0 (0: no check); TypeError/ValueError naming ``owner(verify_replicas_every=...)``."""
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"{owner}(verify_replicas_every={every!r}): pass an int, the boundaries between two checks "
                        f"that the replicas are equal (default {DEFAULT_EVERY}; 0 turns the check off)")
    if every < 0:
        raise ValueError(f"{owner}(verify_replicas_every={every!r}) is not allowed; pass an int >= 0 (default "
                         f"{DEFAULT_EVERY}; 0 turns the check off)")
    return every


def _stochastic(policy: Policy) -> list[str]:
    return [f"{key}=stochastic" for key in ("rounding", "state_rounding") if getattr(policy, key) == "stochastic"]


class ReplicaChecks:
    """The replica checks of one integration (module docstring): ``every`` boundaries between fingerprint checks
    (0: off), ``owner`` the integration's name in messages and events."""

    def __init__(self, every: int, owner: str) -> None:
        self.every, self.owner = check_every(every, owner), owner

    def agree_seeds(self, engine: MixedPrecision, optimizer: Any = None, *, when: str = "at attach") -> None:
        """Every rank's ``optimizer`` (default the engine's; pass it before ``engine.attach`` where the engine's
        own ``strategy=`` refuses per-rank seeds there) takes rank 0's ``sr_seed`` (a collective every rank calls
        at the same point), recorded as a ``"replicas"`` event with a decision clause (``when``: the event's words
        for the moment). An optimizer drawing from torch's global RNG under a stochastic policy: ValueError on
        every rank unless the ranks' RNG states are equal. One process: nothing."""
        ranks, optimizer = world_size(), optimizer if optimizer is not None else engine.optimizer
        if ranks == 1 or optimizer is None:
            return
        agreement = agree_sr_seeds(optimizer)
        stochastic = _stochastic(engine.policy)
        if agreement is None and stochastic:
            check_same_rng(engine.device, f"{self.owner} on {ranks} processes with policy {engine.policy} "
                                          f"({' and '.join(stochastic)})")
        checks = (f"replicas compared by fingerprint every {self.every} step(s)" if self.every
                  else "replicas not compared (verify_replicas_every=0)")
        if agreement is None:
            seeds = "the optimizer has no sr_seed (torch's global RNG, checked equal on every rank)" if stochastic \
                else "no stochastic rounding"
            clause = f"{ranks} processes: {checks}"
        else:
            seeds = (f"sr_seed {list(agreement.agreed)} from rank 0 on every rank "
                     + (f"(this rank had {list(agreement.mine)}; seeded per rank)" if agreement.mine != agreement.agreed
                        else "(the ranks differed: seeded per rank)" if agreement.ranks_differed
                        else "(the ranks agreed already)"))
            clause = (f"{ranks} processes: rank 0's sr_seed on every rank, {checks}" if stochastic
                      else f"{ranks} processes: {checks}")
        detail = f"{self.owner} on {ranks} processes {when}: {seeds}; {checks}"
        engine.record(Event(step=engine.boundaries, kind="replicas", cause=self.owner, module=None, detail=detail),
                      decision=engine.decision if clause in engine.decision else f"{engine.decision}; {clause}")

    def at_boundary(self, engine: MixedPrecision) -> None:
        """After a boundary: every ``every``-th one, the replicas' params (as stored) and fp32 masters compared by
        fingerprint across ranks (one all-gather, one host read); RuntimeError on every rank, recorded as a
        ``"replicas"`` event first, when they differ. Nothing with one process or ``every=0``."""
        if self.every == 0 or world_size() == 1 or engine.boundaries % self.every:
            return
        named = list(engine.module.named_parameters())
        masters = engine.masters.named(named)
        tensors = [(name, p) for name, p in named] + [(f"{name} (fp32 master)", m) for name, m in masters.items()]
        try:
            check_replicas_equal(tensors, step=engine.boundaries, what=f"{self.owner} on {world_size()} processes")
        except RuntimeError as err:
            engine.record(Event(step=engine.boundaries, kind="replicas", cause=self.owner, module=None,
                                detail=str(err)))
            raise


def check_accumulation(count: int, ranks: int, policy: Policy, *, was: int | None = None, where: str = "",
                       sharded: bool = False) -> None:
    """ValueError when ``count`` micro-batches per step on ``ranks`` processes meet fp32 masters (``policy``): a
    trainer's ``no_sync`` reduces only the last micro-batch's gradients, while the masters take each one's, so every
    rank would step its own. ``sharded`` (the engine's FSDP2 under the trainer): also 16-bit params without masters
    (``-kahan``, ``-sr``, ``-lean``), whose every micro-batch would be reduce-scattered and rounded into the bf16
    gradient shard, summed there in bf16 (the engine's own ``strategy="fsdp2"`` sums the unsharded micro-batches in
    fp32 and rounds once). ``was``: the count before a change mid-run (a ``GradientAccumulationScheduler``),
    ``where``: when it changed (``"at epoch 1"``); both only for the message."""
    if ranks < 2 or count < 2:
        return
    changed = "" if was is None or was == count else \
        (f" (changed from {was} {where}: a GradientAccumulationScheduler or a callback setting "
         "trainer.accumulate_grad_batches)")
    if policy.has_masters:
        raise ValueError(f"accumulate_grad_batches={count} on {ranks} processes with {policy} (fp32 masters){changed}: "
                         "Lightning's no_sync would reduce only the last micro-batch's gradients (the masters take "
                         "each one's), and the ranks would drift; use accumulate_grad_batches=1 (a larger batch) or a "
                         "-mixed policy")
    if sharded and policy.param_dtype != torch.float32:
        raise ValueError(f"accumulate_grad_batches={count} on {ranks} processes under ModelParallelStrategy with "
                         f"{policy} (16-bit params without fp32 masters){changed}: every micro-batch's gradients "
                         "would be reduce-scattered and summed into the 16-bit gradient shard, rounding at each "
                         "micro-batch (the engine's own strategy='fsdp2' sums them in fp32 and rounds once); use "
                         "accumulate_grad_batches=1 (a larger batch), a -mixed policy, or MixedPrecision(..., "
                         f"{str(policy)!r}, strategy='fsdp2', accumulation_steps={count}) under torchrun")


def follow_accumulation(engine: MixedPrecision, count: int, ranks: int, *, was: int | None, where: str) -> int:
    """A trainer's accumulation ``count`` at a micro-batch (``was``: at the one before, None at the first;
    ``where``: when, e.g. ``"at epoch 1"``): refused with fp32 masters on several processes
    (:func:`check_accumulation`), a change recorded as an ``"accumulation"`` event. Returns ``count`` (the next
    call's ``was``). No host sync, no collective."""
    check_accumulation(count, ranks, engine.policy, was=was, where=where, sharded=engine.strategy == "fsdp2")
    if was is not None and was != count:
        engine.record(Event(step=engine.boundaries, kind="accumulation", cause="MixprecPrecision", module=None,
                            detail=f"Lightning's accumulate_grad_batches {was} -> {count} {where}: followed (each "
                                   "micro-batch's loss divided by Lightning joins the window its optimizer_step "
                                   "closes)"))
    return count


def gather_windows(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an integration's checkpoint state on this rank, with the engine's ``"open_group"``) plus, on
    several processes inside an accumulation window, ``"open_group_ranks"``: every rank's open window by rank
    (gradients moved to the CPU; one ``all_gather_object``, which every rank calls: the ranks are at the same
    micro-batch, so all of them or none are inside a window). One process, or at a boundary: ``state`` itself."""
    if world_size() == 1 or state.get("open_group") is None:
        return state
    mine = tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, state["open_group"])
    return {**state, "open_group_ranks": gather_from_ranks(mine)}


def own_window(state: dict[str, Any], owner: str) -> dict[str, Any]:
    """``state`` (a checkpoint's, from :func:`gather_windows`) with this rank's open window as ``"open_group"``.
    ValueError when it was saved inside a window by another number of processes (the windows are per rank), or
    by several processes without every rank's window (an older checkpoint: rank 0's only). No collective."""
    ranks, saved = world_size(), state.get("open_group_ranks")
    if saved is None:
        if ranks > 1 and state.get("open_group"):
            raise ValueError(f"{owner}: this checkpoint was saved inside an accumulation window and holds one rank's "
                             f"gradients of it; on {ranks} processes each rank's window is its own and not yet "
                             "reduced. Resume from a checkpoint taken at an optimizer step (" + (
                                 "fabric.save after optimizer.step()" if "Fabric" in owner else
                                 "ModelCheckpoint(every_n_train_steps=...), or val_check_interval a multiple of "
                                 "accumulate_grad_batches") + ")")
        return state
    if len(saved) != ranks:
        raise ValueError(f"{owner}: this checkpoint was saved inside an accumulation window by {len(saved)} "
                         f"processes, each with its own gradients of the window; resume it on {len(saved)} processes "
                         f"(not {ranks}), or from a checkpoint taken at an optimizer step")
    return {**{k: v for k, v in state.items() if k != "open_group_ranks"}, "open_group": saved[rank()]}
