"""Gradients the caller takes itself with ``torch.autograd.grad`` (a gradient penalty, input gradients):
:class:`PenaltyGradients`, a base class of :class:`mixprec.MixedPrecision` with ``scale_loss`` and ``unscale``
(docs/loops.md "Gradient penalties"; torch.amp's recipe: ``scaler.scale(loss)``, then ``grads / scale``).

The scaled loss's backward passes hold the policy's op lists as ``mp.backward``'s do
(:meth:`mixprec.engine.autocast_scope.AutocastScope.hold`); a non-finite unscaled gradient counts as an overflow
at this boundary (:meth:`mixprec.engine.boundary.BoundaryLosses.add_overflow`). These methods assign no engine
attribute (the engine assigns its state in ``engine/mixed_precision.py`` alone: tests/test_architecture.py).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.engine.autocast_scope import AutocastScope
from mixprec.engine.boundary import BoundaryLosses
from mixprec.engine.loss_scale import unscale_grads

__all__ = ["PenaltyGradients"]


class PenaltyGradients:
    """``scale_loss`` and ``unscale`` of :class:`mixprec.MixedPrecision`, on the engine state annotated here
    (``_scope``: ``mp.autocast()``'s settings in backward passes; ``_losses``: the boundary's losses and overflow)."""

    loss_scale: Any
    _scope: AutocastScope
    _losses: BoundaryLosses

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (differentiable), for ``torch.autograd.grad`` on a loss the engine
        does not backpropagate (a gradient penalty; its checkpoint recomputes keep the policy's op lists); pair
        with :meth:`unscale` (docs/loops.md recipe). No host sync."""
        return self._scope.hold(self.loss_scale.scale_loss(loss))

    def unscale(self, grads: Any) -> list[torch.Tensor | None]:
        """The true gradients of ``grads`` (``torch.autograd.grad`` of :meth:`scale_loss`; None stays None) as
        fp32 ``g.float() * (1/scale)``, differentiable (a penalty built from them trains); a non-finite one is an
        overflow at this boundary, as for the params' grads. No host sync (torch.amp's penalty recipe)."""
        out, found = unscale_grads(grads, self.loss_scale.scale)
        if found is not None:
            self._losses.add_overflow(found)
        return out
