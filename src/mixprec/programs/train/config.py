"""What :func:`mixprec.programs.train.run_training` is asked to do (:class:`TrainConfig`) and what it did
(:class:`TrainOutcome`), with the names of what it writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["AUTO", "CHECKPOINTS", "TRAINABLE_FILE", "TrainConfig", "TrainOutcome"]

AUTO = "auto"
CHECKPOINTS = "checkpoints"
TRAINABLE_FILE = "trainable.safetensors"


@dataclass(frozen=True)
class TrainOutcome:
    """What :func:`~mixprec.programs.train.run_training` did.

    ``status``: 0 when all ``steps`` ran, ``128 + signum`` when a signal stopped the run (after
    saving a checkpoint). ``step``: steps done (the data position). ``checkpoint``: the last one saved.
    ``state_bytes``: this rank's training state measured from its tensors after the backward of the first step
    that has optimizer state (:func:`mixprec.distributed.rank_state.rank_state_bytes` as a dict, with ``step``,
    ``rank`` and ``world_size``; ``per_param``: bytes per parameter per rank); None when no step had optimizer
    state (``steps`` 1 from scratch). Also in ``metrics.jsonl`` (a ``"state"`` record) and the checkpoints' extra.
    """

    status: int
    step: int
    final_eval: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    stopped_by: str | None = None
    state_bytes: dict | None = None


@dataclass(frozen=True)
class TrainConfig:
    """:func:`~mixprec.programs.train.run_training`'s arguments after the workload (documented there); :meth:`check`
    validates them."""

    steps: int
    out: Path
    policy: str = "auto"
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 0
    keep: int | None = None
    resume: bool = False
    device: str | None = None
    guard: bool = False
    command: str = ""
    workload_spec: str | None = None
    progress: bool = True
    on_step: Callable[[int, dict], None] | None = None
    strategy: str | None = None
    ema: float | None = None
    compile: bool = False
    recompute: Any = None

    def check(self) -> None:
        """Raise ValueError for a bad argument (naming it, the value and what is allowed)."""
        for name, value in (("eval_every", self.eval_every), ("checkpoint_every", self.checkpoint_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"run_training {name}={value!r} is not allowed; pass an int >= 0 (0: off)")
        keep = self.keep
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"run_training keep={keep!r} is not allowed; pass an int >= 1 or None (keep all)")
        if self.ema is not None and self.strategy is not None:
            raise ValueError(f"run_training ema={self.ema!r} with strategy={self.strategy!r} is not supported (the "
                             "distributed checkpoints do not carry an EMA yet); drop --ema or --strategy")

    @property
    def root(self) -> Path:
        """The run's checkpoint root."""
        return self.out / CHECKPOINTS
