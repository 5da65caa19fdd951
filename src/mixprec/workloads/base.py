"""The :class:`Workload` contract: a model, its data, its loss, its evaluation and its recipe.

A workload knows nothing of the mixprec training engine. It builds an fp32 model, yields
batches of CPU tensors, computes an fp32 loss from the model's output and evaluates a model
on fixed validation batches. The bench runner later brings a workload and the engine
together: it moves each batch to the device (:func:`move_batch`), runs ``loss`` under the
precision policy it is testing, and steps the optimizer from :meth:`Workload.make_optimizer`.

The default optimization recipe is AdamW with weight decay on tensors of two or more
dimensions only (matrices, conv kernels, embedding tables; never biases or norm gains,
as in nanoGPT's ``configure_optimizers``), a linear warm-up and a cosine decay to
``min_lr`` (:class:`WarmupCosine`). Its numbers live in a frozen :class:`OptimizerConfig`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Batch", "OptimizerConfig", "WarmupCosine", "Workload", "check_split", "model_device", "move_batch"]

Batch = dict[str, torch.Tensor]
SPLITS = ("train", "val")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up and cosine decay; learning rates are per optimizer step.

    ``warmup_steps(total) = min(max_warmup_steps, round(warmup_fraction * total))``.
    ``max_grad_norm`` is the global L2 clipping threshold (``None``: no clipping).
    """

    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    max_warmup_steps: int = 100
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig: {self.lr=} must be > 0.")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"OptimizerConfig: {self.min_lr=} must lie in [0, lr={self.lr}].")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"OptimizerConfig: {self.betas=} must be two values in [0, 1).")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig: {self.weight_decay=} must be >= 0.")
        if not 0 <= self.warmup_fraction < 1 or self.max_warmup_steps < 0:
            raise ValueError(
                f"OptimizerConfig: {self.warmup_fraction=} must lie in [0, 1) and "
                f"{self.max_warmup_steps=} must be >= 0."
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"OptimizerConfig: {self.max_grad_norm=} must be > 0, or None for no clipping."
            )

    def warmup_steps(self, total_steps: int) -> int:
        return min(self.max_warmup_steps, round(self.warmup_fraction * total_steps))


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier for ``torch.optim.lr_scheduler.LambdaLR`` (a picklable callable).

    For optimizer step ``s`` (0-based), with ``W = warmup_steps``, ``S = total_steps`` and
    ``r = min_lr / lr``::

        s < W:      (s + 1) / W                                   linear warm-up
        W <= s < S: r + (1 - r) * 0.5 * (1 + cos(pi * (s - W) / (S - W)))
        s >= S:     r
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_ratio
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def move_batch(batch: Batch, device: torch.device | str, non_blocking: bool = False) -> Batch:
    """Return a new batch dict with every tensor on ``device`` (dtypes unchanged)."""
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def model_device(model: nn.Module) -> torch.device:
    """Device of the first parameter (CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def check_split(split: str) -> None:
    """Raise ``ValueError`` unless ``split`` is ``"train"`` or ``"val"``."""
    if split not in SPLITS:
        raise ValueError(f"{split=} is not a data split; use one of {SPLITS}.")


class Workload(abc.ABC):
    """Base class for training workloads. Subclasses set these attributes in ``__init__``:

    - ``name``: workload name (``"gpt"``, ``"digits"``, ...);
    - ``config_name``: the named configuration (``"baby"``, ``"tiny"``, ...);
    - ``items_per_batch`` / ``item_unit``: throughput unit per training batch, e.g.
      ``B * T`` ``"tokens"`` or ``B`` ``"samples"``;
    - ``optim``: the :class:`OptimizerConfig` used by the default recipe hooks;
    - ``loss_unit`` (optional): the unit of :meth:`loss` and of ``evaluate``'s ``"loss"``, shown on the
      bench's plots and eval table (e.g. ``"nats/char"``); unset (None), they say "unit not set" (a loss
      may be a cross-entropy in nats or an MSE, so no unit is assumed);
    - ``default_steps`` (optional, default 300): optimizer steps ``mixprec bench`` runs per
      policy when ``--steps`` is not given;
    - ``keep_fp32_inputs`` (optional, default none): batch keys that ``mp.cast_inputs`` moves to the
      device but does not cast (a float regression target, which a ``-pure`` policy would round).

    Contract: ``build_model`` returns an fp32 module whose initial weights depend only on
    ``torch``'s global seed, set by the caller; ``batches("train", seed)`` is an endless,
    deterministic stream (same seed, same batches); ``batches("val", seed)`` is a fixed,
    finite list of batches that ignores ``seed``. Batches are dicts of CPU tensors.
    """

    name: str
    config_name: str
    items_per_batch: int
    item_unit: str
    optim: OptimizerConfig = OptimizerConfig()
    default_steps: int = 300
    loss_unit: str | None = None
    keep_fp32_inputs: tuple[str, ...] = ()

    @property
    def max_grad_norm(self) -> float | None:
        """Global gradient-norm clipping threshold (L2), or ``None`` for no clipping."""
        return self.optim.max_grad_norm

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised fp32 model (uses torch's global RNG)."""

    @abc.abstractmethod
    def batches(self, split: str, seed: int = 0) -> Iterator[Batch]:
        """Endless seeded stream for ``"train"``; fixed finite set for ``"val"``."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar fp32 loss of ``model`` on ``batch`` (already on the model's device)."""

    @abc.abstractmethod
    def flops_per_step(self) -> float:
        """Estimated training FLOPs (forward + backward) of one optimizer step."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """JSON-serialisable description of the configuration and data."""

    def evaluate(self, model: nn.Module, batches: Iterable[Batch] | None = None) -> dict[str, float]:
        """Mean loss over ``batches`` (default: the val batches) under ``torch.no_grad``.

        Puts the model in eval mode and restores its previous mode afterwards; moves each
        batch to the model's device. One host-device sync (``.item()``) at the end.
        """
        batches = self.batches("val") if batches is None else batches
        device = model_device(model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                losses = [self.loss(model, move_batch(b, device)).float() for b in batches]
        finally:
            model.train(was_training)
        if not losses:
            raise ValueError("evaluate: got no batches; pass at least one batch (or None).")
        return {"loss": torch.stack(losses).mean().item()}

    def param_groups(self, model: nn.Module) -> list[dict]:
        """AdamW parameter groups: weight decay on tensors with ``dim >= 2`` only."""
        params = [p for p in model.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.optim.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """``torch.optim.AdamW`` over :meth:`param_groups` with ``self.optim``'s lr and betas."""
        return torch.optim.AdamW(self.param_groups(model), lr=self.optim.lr, betas=self.optim.betas)

    def make_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        """``LambdaLR`` with :class:`WarmupCosine`; call ``scheduler.step()`` once per step."""
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"make_scheduler: {total_steps=} must be a positive int.")
        schedule = WarmupCosine(
            warmup_steps=self.optim.warmup_steps(total_steps),
            total_steps=total_steps,
            min_ratio=self.optim.min_lr / self.optim.lr,
        )
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
