"""Quantized GEMMs are first-order only: a second derivative through one is refused, loudly, where it is taken.

The fp8 and block-scaled linears (:class:`~mixprec.fp8.linear.Float8Linear`,
:class:`~mixprec.blockscale.linear.BlockScaledLinear`) compute their gradients from quantized operands in a custom
``torch.autograd.Function`` whose backward autograd cannot differentiate. Left alone, ``torch.autograd.grad(...,
create_graph=True)`` through one returns a gradient with no graph behind it, so a gradient penalty built from it
(WGAN-GP, R1, input-gradient regularisers) adds **nothing** to the weights' gradients, silently; and with a
transform computed in place (NVFP4's Hadamard) the backward itself fails with torch's ``out=`` error.

:func:`first_order_backward` runs a backward without recording (``torch.no_grad``) and, when autograd records it
(``create_graph=True``), ties each gradient to the backward's inputs through a node whose own backward raises
:class:`RuntimeError` naming the module and the fixes: the penalty's ``backward()`` fails instead of training on a
wrong gradient. A gradient of the first order (``create_graph=False``) is unchanged, bit for bit. Torch's
``@once_differentiable`` does the same with a message that names neither the layer nor the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["first_order_backward", "SECOND_ORDER_FIX"]

SECOND_ORDER_FIX = ("keep the layers a second derivative passes through out of the quantized format "
                    "(policy block_keep=<their names> for block-scaled linears, keep_fp32=<their names> or fp8=none "
                    "for fp8 linears), or compute the penalty under a policy without quantized linears")


class _Refused(torch.autograd.Function):
    """The gradient ``g`` as it is, tied to ``inputs``; differentiating it raises (module docstring)."""

    @staticmethod
    def forward(ctx: Any, what: str, name: str | None, g: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.what, ctx.name = what, name
        return g.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        this = f" (this one: {ctx.name})" if ctx.name else ""
        raise RuntimeError(f"mixprec: a second derivative through {ctx.what} (a gradient taken with "
                           "create_graph=True, e.g. a gradient penalty, then differentiated): its quantized backward "
                           f"is first-order only and would give a wrong gradient; {SECOND_ORDER_FIX}{this}")


def first_order_backward(what: str, backward: Callable[[], tuple[torch.Tensor | None, ...]],
                         inputs: tuple[torch.Tensor, ...], name: str | None = None) -> tuple[torch.Tensor | None, ...]:
    """``backward()``'s gradients, computed without recording; when grad mode is on (a ``create_graph=True``
    backward), each gradient tensor comes back tied to ``inputs`` (the incoming gradient and the saved tensors
    autograd would differentiate through) by a node that raises on differentiation (module docstring).
    ``what``: the module in words, and ``name`` its qualified name in the model where known, for the message. No
    host sync; shapes, dtypes and values unchanged."""
    recording = torch.is_grad_enabled()
    with torch.no_grad():
        grads = backward()
    live = tuple(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)
    if not recording or not live:
        return grads
    return tuple(g if g is None else _Refused.apply(what, name, g, *live) for g in grads)
