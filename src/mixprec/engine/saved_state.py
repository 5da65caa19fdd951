"""What an engine saves: ``mp.state_dict()``, everything a run needs to continue bit-exactly, and
``mp.trainable_state_dict()``, the trainable params alone in fp32 (a LoRA run's small file).

``mp.state_dict()`` holds, by key: ``"policy"`` (its text), ``"frozen"`` (the frozen params' names), each
feature's entry under its :attr:`~mixprec.engine.feature.Feature.key` (the recompute plan, the memory budget's
decision), ``"model"`` (``module.state_dict()``: the params as stored), ``"masters"`` (the fp32 masters by param
name), ``"optimizer"``, ``"scheduler"`` (None without one), ``"loss_scale"``
(:meth:`~mixprec.engine.loss_scale.LossScale.state_dict`), ``"counters"`` (``micro_step``, ``applied_steps``,
``skipped_total``, ``boundaries``) and ``"open_group"`` (the accumulation window saved open, None at a boundary:
:mod:`mixprec.engine.open_group`). The values are references (the caller copies); nothing here syncs but
``trainable_fp32``'s copies to the CPU. It is loaded back by
:func:`mixprec.engine.preparation.reprepare.load_engine_state`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.engine.boundary import BoundaryLosses
from mixprec.engine.feature import Features
from mixprec.engine.grad_sums import GradSums
from mixprec.engine.masters import MasterWeights, best_fp32_values
from mixprec.engine.open_group import capture_group
from mixprec.engine.protocol import Engine
from mixprec.engine.step_state import Phase

__all__ = ["check_engine_state", "engine_state", "trainable_fp32"]

_REQUIRED = ("policy", "model", "loss_scale", "counters")


def check_engine_state(state: Any) -> dict[str, Any]:
    """``state`` itself when it has the shape of an ``mp.state_dict()`` (a dict with the module docstring's keys);
    TypeError / ValueError naming what it is and what loads it instead. No host sync."""
    fix = ("pass what mp.state_dict() returned; a model's own state_dict loads with mp.module.load_state_dict(...), "
           "a checkpoint directory with mixprec.load_checkpoint(path, mp)")
    if not isinstance(state, dict):
        raise TypeError(f"mp.load_state_dict(state): state is a {type(state).__name__}, not a dict; {fix}")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"mp.load_state_dict(state): state lacks {missing} (it holds {sorted(state)[:8]}), so it is "
                         f"not an engine's state; {fix}")
    return state


def engine_state(mp: Engine, features: Features, phase: Phase, end_next: bool, losses: BoundaryLosses,
                 sums: GradSums) -> dict[str, Any]:
    """``mp.state_dict()`` (module docstring) of the engine ``mp`` with its ``features``; ``phase``, ``end_next``,
    ``losses`` and ``sums`` (the engine's) give the open window. RuntimeError mid-window under a strategy
    (:func:`~mixprec.engine.open_group.capture_group`)."""
    return {
        "policy": str(mp.policy),
        "frozen": mp.frozen_names(), **features.states(),
        "model": mp.module.state_dict(), "masters": mp.masters.named(mp.module.named_parameters()),
        "optimizer": mp.optimizer.state_dict(),
        "scheduler": None if mp.scheduler is None else mp.scheduler.state_dict(),
        "loss_scale": mp.loss_scale.state_dict(),
        "counters": dict(micro_step=mp.micro_step, applied_steps=mp.applied_steps,
                         skipped_total=mp.skipped_total, boundaries=mp.boundaries),
        "open_group": capture_group(mp, phase, end_next, losses, sums)}


def trainable_fp32(module: nn.Module, masters: MasterWeights,
                   optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """``module``'s trainable params by name as fp32 CPU copies of their best values (``masters``' and
    ``optimizer``'s Kahan compensation: :func:`~mixprec.engine.masters.best_fp32_values`). One copy (a sync) each."""
    values = dict(zip(map(id, masters.params), best_fp32_values(masters, optimizer)))
    return {name: values[id(p)].to("cpu", copy=True).contiguous()
            for name, p in module.named_parameters() if p.requires_grad}
