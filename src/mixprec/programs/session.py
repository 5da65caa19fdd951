"""A workload trained under an engine: build it, step it, evaluate it.

Shared by ``mixprec bench`` (its workers and resident timing workers) and ``mixprec train``, so both
build the model, optimizer and schedule the same way from a seed and run the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from mixprec.engine.mixed_precision import MixedPrecision, StepResult
from mixprec.engine.records import Event
from mixprec.optim import SGD, AdamW
from mixprec.policy.policy import Policy, state_name
from mixprec.policy.resolve import resolve_policy
from mixprec.workloads import Workload

__all__ = ["StepCalls", "build_engine", "precision_optimizer", "train_step", "evaluate", "world_change_words"]


class StepCalls(Protocol):
    """What :func:`train_step`, :func:`evaluate` and the bench's memory step call: the engine's four calls and
    the model, optimizer and device they act on. :class:`~mixprec.MixedPrecision` is one; the bench's plain
    ``torch.autocast`` peer (:class:`mixprec.programs.bench.peer.AutocastPeer`) is another."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device

    def cast_inputs(self, batch: Any, *, keep: tuple[str, ...] = ()) -> Any: ...

    def autocast(self) -> AbstractContextManager[None]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> Any: ...


def precision_optimizer(optimizer: torch.optim.Optimizer, policy: Policy) -> torch.optim.Optimizer:
    """``optimizer``, or its :mod:`mixprec.optim` twin (same groups and hyperparameters) when
    ``policy`` rounds updates (kahan / stochastic) or keeps 16-bit or 8-bit state, which stock
    ``torch.optim`` optimizers cannot do. Call before any step.

    Raises:
        ValueError: the policy needs a precision optimizer and ``optimizer`` is neither
            ``torch.optim.AdamW`` nor ``torch.optim.SGD`` (or uses amsgrad/maximize).
    """
    if hasattr(optimizer, "set_precision") or (policy.rounding == "nearest" and policy.state_dtype == torch.float32):
        return optimizer
    groups = optimizer.param_groups
    if type(optimizer) is torch.optim.AdamW and not any(g["amsgrad"] or g["maximize"] for g in groups):
        keys = ("params", "lr", "betas", "eps", "weight_decay")
        return AdamW([{k: g[k] for k in keys} for g in groups])
    if type(optimizer) is torch.optim.SGD and not any(g["maximize"] for g in groups):
        keys = ("params", "lr", "momentum", "dampening", "weight_decay", "nesterov")
        return SGD([{k: g[k] for k in keys} for g in groups])
    raise ValueError(f"policy {policy} writes updates with rounding={policy.rounding!r} and state="
                     f"{state_name(policy.state_dtype)}, which {type(optimizer).__name__} cannot do; "
                     "return a mixprec.optim.AdamW or mixprec.optim.SGD from Workload.make_optimizer")


def build_engine(workload: Workload, policy: str, *, steps: int, seed: int, device: str | None = None,
                 strategy: str | None = None, compile: bool = False, guard: Any = None,
                 recompute: Any = None) -> MixedPrecision:
    """Seed torch, build the workload's model, optimizer and schedule, and wrap them in the engine.

    ``policy`` is passed to :class:`~mixprec.MixedPrecision` as given (``"auto"`` keeps its
    reason in ``mp.decision``); nothing falls back: a policy the device cannot run raises.
    ``strategy`` (None, ``"ddp"``, ``"fsdp2"``), ``compile``, ``guard`` (a :class:`mixprec.Guard` or None) and
    ``checkpoint`` (the recompute plan, :mod:`mixprec.memory.recompute`) too; every rank seeds alike.
    """
    torch.manual_seed(seed)
    model = workload.build_model()
    optimizer = precision_optimizer(workload.make_optimizer(model), resolve_policy(policy, device))
    scheduler = workload.make_scheduler(optimizer, steps)
    return MixedPrecision(model, optimizer, policy=policy, device=device, scheduler=scheduler,
                          max_grad_norm=workload.max_grad_norm, guard=guard, strategy=strategy, compile=compile,
                          recompute=recompute)


def train_step(mp: StepCalls, workload: Workload, batch: dict,
               after_backward: Callable[[], None] | None = None) -> tuple[torch.Tensor, StepResult | Any]:
    """One step: cast inputs, loss under autocast, backward, (``after_backward()``), ``mp.step()``.

    Returns the detached loss (a device tensor: no sync here) and the step's result (an engine's
    :class:`~mixprec.engine.boundary.StepResult` or None between boundaries; the peer's ``PeerStep``).
    """
    batch = mp.cast_inputs(batch, keep=workload.keep_fp32_inputs)
    with mp.autocast():
        loss = workload.loss(mp.model, batch)
    mp.backward(loss)
    if after_backward is not None:
        after_backward()
    return loss.detach(), mp.step()


def evaluate(mp: StepCalls, workload: Workload) -> dict[str, float]:
    """``workload.evaluate`` on its fixed validation batches under the policy's autocast (one sync)."""
    with mp.autocast():
        return workload.evaluate(mp.model, (mp.cast_inputs(b, keep=workload.keep_fp32_inputs)
                                             for b in workload.batches("val")))


def world_change_words(saved_world: int, world: int, workload: Workload, events: list) -> str | None:
    """What a resume at another number of ranks changes, for the console: the global batch (one workload batch
    per rank and step, ``items_per_batch`` ``item_unit`` each) before and after, the data position kept, and
    the engine's ``"reshard"`` event's words (a DCP checkpoint resharded) when ``events`` hold one. None when
    ``saved_world == world``."""
    if saved_world == world:
        return None
    per = workload.items_per_batch
    unit = workload.item_unit
    reshard = [Event.of(e).detail for e in events if Event.of(e).kind == "reshard"]
    return (f"the checkpoint was saved at {saved_world} rank(s), this run has {world}: the global batch changes from "
            f"{saved_world} x {per} = {saved_world * per} {unit} per step to {world} x {per} = {world * per} {unit} "
            f"(the data position is kept: the next batches are the ones the {saved_world}-rank run would have drawn); "
            f"for the same global batch resume on {saved_world} rank(s)"
            + (f"; {reshard[-1]}" if reshard else ""))
