"""What a loop, a guard or a save reads of the engine between its calls: :class:`EngineViews`, a base class of
:class:`mixprec.MixedPrecision` with its read-only views (the boundary's losses, gradients and micro-batches, the
fp32 masters, the trainable params' best values).

Each view returns what the engine's state holds and changes nothing; the engine assigns its state in
``engine/mixed_precision.py`` alone (tests/test_architecture.py checks that its base classes assign no attribute).
The host syncs are each view's own, said in its docstring.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from mixprec.engine.boundary import BoundaryLosses
from mixprec.engine.divergence import Judging
from mixprec.engine.masters import MasterWeights
from mixprec.engine.preparation.edits import adopt_edited_params
from mixprec.engine.saved_state import trainable_fp32

__all__ = ["EngineViews"]


class EngineViews:
    """The read-only views of :class:`mixprec.MixedPrecision`, on the engine state annotated here (the engine
    builds it: ``_losses`` the boundary's losses, ``_judging`` what the guard is shown)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    masters: MasterWeights
    _losses: BoundaryLosses
    _judging: Judging

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps (fp32 master grads under ``-pure`` policies), in ``model.parameters()``
        order (tensors the model does not hold after, in group order): the global norm then sums as
        ``clip_grad_norm_(model.parameters())`` does, bit for bit in fp32 whatever the param groups' order."""
        stepped = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        rank = {id(t): i for i, t in enumerate(self.master_parameters())}
        return [p.grad for p in sorted(stepped, key=lambda p: rank.get(id(p), len(rank)))]

    @property
    def step_gradients(self) -> tuple[torch.Tensor, ...]:
        """Inside ``guard.after_step``: the boundary's unscaled gradients (this rank's shards); else empty."""
        return tuple(self._judging.grads)

    @property
    def boundary_loss(self) -> torch.Tensor | None:
        """Mean fp32 loss over the last boundary's micro-batches (a device tensor; None before the first
        boundary; non-finite if any micro-batch loss was). Reading its value syncs."""
        return self._losses.mean

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The loss of the last ``backward()`` (detached, unscaled, on the device). Reading it syncs."""
        return self._losses.last

    @property
    def step_batches(self) -> tuple:
        """The micro-batches cast since the last boundary, kept only when a guard is attached."""
        return tuple(self._judging.batches)

    def master_parameters(self) -> Iterator[torch.Tensor]:
        """fp32 masters in ``model.parameters()`` order (the params themselves where no master exists)."""
        yield from self.masters.masters

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable params by name as fp32 CPU copies of their best values (master, else param plus
        Kahan compensation): a LoRA run's small file, for ``model.load_state_dict(state, strict=False)``. Params
        written outside the engine since its last step (a weight average, a best checkpoint loaded into the model)
        are adopted by their masters first, as :meth:`state_dict` does. Syncs."""
        adopt_edited_params(self)
        return trainable_fp32(self.module, self.masters, self.optimizer)
