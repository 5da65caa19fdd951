"""The engine as its collaborators see it: :class:`Engine`, the public face of :class:`mixprec.MixedPrecision`
as a Protocol.

The engine imports its collaborators (:mod:`mixprec.engine.preparation.edits`, :mod:`mixprec.auto.pending`,
:mod:`mixprec.engine.preparation.reprepare`, :mod:`mixprec.engine.divergence`); those that must call back into it
(re-prepare through ``set_policy``, record an event) take an :class:`Engine` and use only what it lists,
without importing the engine (no import cycle). Nothing here runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from mixprec.engine.masters import MasterWeights
from mixprec.engine.records import Event
from mixprec.policy.policy import Policy

__all__ = ["Engine"]


class Engine(Protocol):
    """The public attributes and methods of :class:`mixprec.MixedPrecision` its collaborators use."""

    policy: Policy
    device: torch.device
    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    masters: MasterWeights
    loss_scale: Any
    guard: Any
    strategy: str | None
    decision: str
    events: list[Event]
    boundaries: int
    applied_steps: int
    skipped_total: int
    micro_step: int
    accumulation_steps: int
    max_stuck_skips: int

    @property
    def step_gradients(self) -> tuple[torch.Tensor, ...]: ...

    def set_policy(self, policy: str | Policy, *, cause: str = ..., module: str | None = ..., loss_scale: Any = ...,
                   record: bool = ..., kind: str = ...) -> Event: ...

    def record(self, event: Event | dict, *, decision: str | None = None) -> None: ...

    def agree_on(self, choice: str | None, choices: tuple[str, ...]) -> str | None: ...

    def load_state_dict(self, state: dict[str, Any], *, convert: bool = ..., adopt_policy: bool = ...) -> None: ...

    def match_frozen(self, saved: list[str], *, check_only: bool = ...) -> None: ...

    def check_frozen_values(self, values: dict[str, torch.Tensor]) -> None: ...

    def frozen_names(self) -> list[str]: ...

    def discard_gradients(self) -> None: ...

    def gradients(self) -> list[torch.Tensor]: ...

    def restore_progress(self, counters: dict[str, int], events: list[dict] | None, open_group: Any = ...) -> None: ...
