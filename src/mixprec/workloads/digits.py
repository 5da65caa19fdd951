"""Handwritten-digit classification with a small ResNet on scikit-learn's 8x8 digits.

Data: ``sklearn.datasets.load_digits`` (1,797 real 8x8 grey-scale images with values 0..16,
bundled with scikit-learn, no download), scaled to [0, 1] float32 of shape ``(N, 1, 8, 8)``,
labels int64 in 0..9. Fixed split: a permutation from ``torch.Generator`` seeded with
:data:`SPLIT_SEED`; its first ``N * 8 // 10`` = 1,437 indices train, the other 360 validate.
Training batches: each epoch a fresh permutation drawn from a generator seeded with ``seed``,
cut into full batches (the remainder is dropped). Validation: the 360 images in order, in
batches of ``batch_size`` (the last may be smaller).

Model: stem ``conv3x3(1 -> w) -> norm -> ReLU``, then ``n_blocks`` residual blocks (block
``i`` has ``w * 2**i`` channels and stride 2 for ``i > 0``: 8x8 -> 4x4 -> 2x2), global
average pooling and a linear head to 10 logits. ``norm`` is BatchNorm or GroupNorm.

scikit-learn is an optional extra: ``pip install 'mixprec[digits]'``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mixprec.workloads.base import Batch, OptimizerConfig, Workload, check_split, model_device, move_batch

__all__ = ["DigitsConfig", "DigitsNet", "DigitsWorkload", "DIGITS_CONFIGS", "load_digits_tensors", "SPLIT_SEED"]

SPLIT_SEED = 0
NORMS = ("batch", "group")
_DIGITS_OPTIM = OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.05, max_grad_norm=None)


@dataclass(frozen=True)
class DigitsConfig:
    """Model width ``w`` (stem channels), residual blocks, norm type and batch size."""

    width: int
    n_blocks: int
    batch_size: int
    norm: str = "batch"
    optim: OptimizerConfig = _DIGITS_OPTIM

    def __post_init__(self) -> None:
        for name in ("width", "n_blocks", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DigitsConfig: {name}={value!r} must be a positive int.")
        if self.norm not in NORMS:
            raise ValueError(f"DigitsConfig: norm={self.norm!r} is unknown; use one of {NORMS}.")


DIGITS_CONFIGS: dict[str, DigitsConfig] = {
    "tiny": DigitsConfig(width=8, n_blocks=2, batch_size=16),
    "default": DigitsConfig(width=32, n_blocks=3, batch_size=64),
}


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(min(8, channels), channels)


class ResidualBlock(nn.Module):
    """``x + F(x)`` with ``F = conv3x3 -> norm -> ReLU -> conv3x3 -> norm``; 1x1 projection
    shortcut when the shape changes; ReLU after the sum."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(norm, c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))  # (B, c_out, H', W')
        return F.relu(self.shortcut(x) + self.norm2(self.conv2(h)))  # (B, c_out, H', W')


class DigitsNet(nn.Module):
    """float32 images ``(B, 1, 8, 8)`` in [0, 1] -> logits ``(B, 10)`` (compute dtype)."""

    def __init__(self, config: DigitsConfig):
        super().__init__()
        w = config.width
        self.stem = nn.Sequential(nn.Conv2d(1, w, 3, padding=1, bias=False), _norm(config.norm, w), nn.ReLU())
        widths = [w * 2**i for i in range(config.n_blocks)]
        self.blocks = nn.Sequential(
            *(ResidualBlock(c_in, c_out, stride=1 if i == 0 else 2, norm=config.norm)
              for i, (c_in, c_out) in enumerate(zip([w] + widths[:-1], widths)))
        )
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))  # (B, C, H', W')
        return self.head(h.mean(dim=(2, 3)))  # (B, 10)


@functools.lru_cache(maxsize=1)
def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: images float32 ``(N, 1, 8, 8)`` in [0, 1], labels int64 ``(N,)``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            f"the digits workload needs scikit-learn ({err}); install it with "
            "pip install 'mixprec[digits]'"
        ) from err
    data = load_digits()
    images = torch.from_numpy(data.images).float().div(16.0).unsqueeze(1)  # (N, 1, 8, 8)
    labels = torch.from_numpy(data.target).long()  # (N,)
    return images, labels


class DigitsWorkload(Workload):
    """Classify 8x8 digits; batches ``{"images": float32 (B, 1, 8, 8), "labels": int64 (B,)}``."""

    name = "digits"
    item_unit = "samples"
    loss_unit = "nats/image"

    def __init__(self, config: str | DigitsConfig = "default"):
        if isinstance(config, DigitsConfig):
            self.config_name, self.config = "custom", config
        elif config in DIGITS_CONFIGS:
            self.config_name, self.config = config, DIGITS_CONFIGS[config]
        else:
            raise ValueError(
                f"digits workload: config={config!r} is unknown; choose one of "
                f"{sorted(DIGITS_CONFIGS)} or pass a DigitsConfig."
            )
        self.optim = self.config.optim
        self.items_per_batch = self.config.batch_size
        images, labels = load_digits_tensors()
        perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
        n_train = len(labels) * 8 // 10
        self.train_images, self.train_labels = images[perm[:n_train]], labels[perm[:n_train]]
        self.val_images, self.val_labels = images[perm[n_train:]], labels[perm[n_train:]]
        if self.config.batch_size > n_train:
            raise ValueError(
                f"digits workload: batch_size={self.config.batch_size} exceeds the {n_train} "
                "training images; use a smaller batch_size."
            )

    def build_model(self) -> DigitsNet:
        return DigitsNet(self.config)

    def batches(self, split: str, seed: int = 0) -> Iterator[Batch]:
        check_split(split)
        return self._val_batches() if split == "val" else self._train_batches(seed)

    def _train_batches(self, seed: int) -> Iterator[Batch]:
        B, n = self.config.batch_size, len(self.train_labels)
        gen = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(n, generator=gen)  # one epoch
            for i in range(0, n - B + 1, B):
                ix = perm[i : i + B]  # (B,)
                yield {"images": self.train_images[ix], "labels": self.train_labels[ix]}

    def _val_batches(self) -> Iterator[Batch]:
        B = self.config.batch_size
        for i in range(0, len(self.val_labels), B):
            yield {"images": self.val_images[i : i + B], "labels": self.val_labels[i : i + B]}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch["images"])  # (B, 10), compute dtype
        return F.cross_entropy(logits.float(), batch["labels"])

    def evaluate(self, model: nn.Module, batches: Iterable[Batch] | None = None) -> dict[str, float]:
        """``{"loss": mean cross-entropy per image (nats), "accuracy": fraction correct}``.

        Eval mode (BatchNorm running statistics), restored afterwards; one sync at the end.
        """
        batches = self.batches("val") if batches is None else batches
        device = model_device(model)
        was_training = model.training
        model.eval()
        loss_sum, correct, count = torch.zeros((), device=device), torch.zeros((), device=device), 0
        try:
            with torch.no_grad():
                for batch in batches:
                    batch = move_batch(batch, device)
                    logits_fp32 = model(batch["images"]).float()  # (B, 10)
                    loss_sum += F.cross_entropy(logits_fp32, batch["labels"], reduction="sum")
                    correct += (logits_fp32.argmax(dim=1) == batch["labels"]).sum()
                    count += len(batch["labels"])
        finally:
            model.train(was_training)
        if count == 0:
            raise ValueError("evaluate: got no batches; pass at least one batch (or None).")
        return {"loss": loss_sum.item() / count, "accuracy": correct.item() / count}

    def flops_per_step(self) -> float:
        """Training FLOPs per step: 3x the forward FLOPs of conv and linear layers (forward 1x,
        backward 2x) counted by ``torch.utils.flop_counter`` on a meta-device batch of 1,
        times ``batch_size``. Norms, ReLUs and pooling are not counted."""
        with torch.device("meta"):
            model, x = self.build_model().eval(), torch.zeros(1, 1, 8, 8)
        counter = FlopCounterMode(display=False)
        with counter:
            model(x)
        return float(3 * counter.get_total_flops() * self.config.batch_size)

    def describe(self) -> dict:
        model = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "optim"}
        with torch.device("meta"):
            n_params = sum(p.numel() for p in self.build_model().parameters())
        return {
            "workload": self.name,
            "config": self.config_name,
            "model": {**model, "n_params": n_params},
            "optimizer": dataclasses.asdict(self.optim),
            "data": {
                "source": "sklearn.datasets.load_digits",
                "train_samples": len(self.train_labels),
                "val_samples": len(self.val_labels),
                "split": f"randperm(seed={SPLIT_SEED}): first 80% train, rest val",
                "classes": list(range(10)),
            },
            "items_per_batch": self.items_per_batch,
            "item_unit": self.item_unit,
            "flops_per_step": self.flops_per_step(),
        }
