"""The frozen set as the caller changes and reads it: :class:`FrozenControl`, a base class of
:class:`mixprec.MixedPrecision` with ``unfreeze``, ``refreeze``, ``match_frozen`` (a saved run's frozen set before
its state is loaded), ``frozen_names`` and ``check_frozen_values``.

The frozen params themselves (which they are, their storage, thawing) are
:class:`~mixprec.engine.storage.FrozenParams`; an unfreeze re-prepares the model through the engine's public
``set_policy`` (:func:`mixprec.engine.preparation.reprepare.unfreeze_params`). These methods assign no engine
attribute (the engine assigns its state in ``engine/mixed_precision.py`` alone: tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.engine.masters import MasterWeights
from mixprec.engine.preparation.reprepare import frozen_to_match, unfreeze_params
from mixprec.engine.records import Event
from mixprec.engine.storage import FrozenParams
from mixprec.policy.policy import Policy

__all__ = ["FrozenControl"]


class FrozenControl:
    """The frozen-set methods of :class:`mixprec.MixedPrecision`, on the engine state and calls annotated here
    (``_frozen``: the frozen params; ``_strategy``: what refuses an unfreeze across processes; ``_check``: the
    step's state table, :mod:`mixprec.engine.step_state`)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    masters: MasterWeights
    policy: Policy
    events: list[Event]
    _frozen: FrozenParams
    _strategy: Any
    _check: Callable[[str], None]
    set_policy: Callable[..., Event]

    def unfreeze(self, *patterns: str, **group_options: Any) -> Event:
        """Train the frozen params whose names match a pattern (``fnmatch``) from this boundary on, stored as
        the policy stores trainable ones, masters **from the stored 16-bit values**; those the optimizer lacks
        get a new group with ``group_options`` (e.g. ``lr=1e-5``; refused under a scheduler). Returns the
        ``"unfreeze"`` event. ValueError (nothing changed: :mod:`mixprec.engine.storage`), RuntimeError mid-step."""
        if not patterns:
            raise ValueError("unfreeze() needs at least one parameter-name pattern, e.g. mp.unfreeze('encoder.layer.5.*')")
        self._check("unfreeze()")
        self._strategy.refuse("unfreeze")
        return unfreeze_params(self, self._frozen, patterns, group_options)

    def refreeze(self, names: list[str]) -> None:
        """Undo an :meth:`unfreeze` of ``names`` that added no param group (a refused load), exactly when
        no step ran in between; the events of both are removed."""
        if not names:
            return
        named = dict(self.module.named_parameters())
        self._frozen.refreeze([named[n] for n in names])
        self.set_policy(self.policy, cause="refreeze after a refused load", record=False)
        if self.events and self.events[-1].get("kind") == "unfreeze":
            self.events.pop()

    def match_frozen(self, saved: list[str], *, check_only: bool = False) -> None:
        """Make the frozen set equal ``saved`` (a run's :meth:`frozen_names`) before its state is loaded, by
        :meth:`unfreeze`. ValueError when ``saved`` keeps frozen a param trained here, names an unknown one, or
        unfroze one into a param group this optimizer lacks; ``check_only``: raise, change nothing."""
        patterns = frozen_to_match(self._frozen, saved, self.module, self.optimizer, self.masters)
        if patterns and not check_only:
            self.unfreeze(*patterns)

    def frozen_names(self) -> list[str]:
        """Names of the frozen parameters (``requires_grad=False`` at build and not unfrozen since), in order."""
        return self._frozen.names()

    def check_frozen_values(self, values: dict[str, torch.Tensor]) -> None:
        """Raise ValueError if a value about to be loaded into a frozen param stored in fp16 does not fit
        fp16 (``values``: name → tensor; others ignored). One sync per checked tensor."""
        self._frozen.check_values(values)
