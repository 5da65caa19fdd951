"""The forward a recompute region runs (:mod:`mixprec.memory.recompute`): module buffers written once per forward,
and a second backward through a selective region explained.

A recompute re-runs the block's forward in backward; torch's checkpoint lets it update the block's buffers again
(BatchNorm's running stats and ``num_batches_tracked`` twice per step, pytorch/pytorch#96136). Here a recompute
reads the buffer values its forward read and writes into copies (chainer-compiler's fix: the recompute's in-place
updates land on copies), and auto's measuring forwards run on copies of the buffers: every buffer ends as without
recompute, bit for bit. Eager only: a traced graph runs torch's own checkpoint as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["scratch_buffers", "region_forward"]


def _buffers(block: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Each buffer of ``block`` (submodules included, each module once) with its owner and attribute name."""
    return [(m, n, b) for m in block.modules() for n, b in m.named_buffers(recurse=False) if b is not None]


@contextlib.contextmanager
def scratch_buffers(block: nn.Module, values: list[torch.Tensor] | None = None) -> Any:
    """Inside, each buffer of ``block`` is replaced by a copy (of ``values[i]`` where given, else of itself): what a
    forward writes there (BatchNorm's running stats and ``num_batches_tracked``) is thrown away on exit, when the
    module's own buffer tensors are put back untouched (values and version counters). Device copies, no sync."""
    owned = _buffers(block)
    copies = values if values is not None else [b for _, _, b in owned]
    for (module, attr, _), value in zip(owned, copies):
        setattr(module, attr, value.detach().clone())
    try:
        yield
    finally:
        for module, attr, buffer in owned:
            setattr(module, attr, buffer)


def region_forward(forward: Callable[..., Any], block: nn.Module, name: str, mode: str) -> Callable[..., Any]:
    """``forward`` for block ``name``'s recompute region. Its first call (the forward) updates the block's buffers
    as usual; each later call (a recompute in backward) reads the buffer values the forward read and writes into
    copies, so running statistics are updated once per forward, as without recompute (torch's checkpoint updates
    them again in each recompute, pytorch/pytorch#96136; the recompute writing into copies is chainer-compiler's
    fix). Keeps a copy of only the buffers the forward wrote. A second backward through a selective region (a
    gradient penalty) raises a RuntimeError naming ``recompute=``, the block and the fix."""
    owned = _buffers(block)
    read: list[torch.Tensor] = []
    forwarded = False

    def region(*args: Any, **kwargs: Any) -> Any:
        nonlocal forwarded
        if forwarded:
            try:
                with scratch_buffers(block, read):
                    return forward(*args, **kwargs)
            except RuntimeError as err:
                if mode == "selective" and "selective activation checkpoint" in str(err):
                    raise RuntimeError(_twice(name)) from err
                raise
        versions = [b._version for _, _, b in owned]
        before = [b.detach().clone() for _, _, b in owned]
        out = forward(*args, **kwargs)
        read.extend(old if b._version != v else b for (_, _, b), v, old in zip(owned, versions, before))
        forwarded = True
        return out
    return region


def _twice(name: str) -> str:
    group = f"{name.rsplit('.', 1)[0]}.*" if "." in name else name
    return (f"recompute: block {name!r} recomputes selectively ('selective', named or chosen by 'auto'), and a "
            "second backward reached it (a gradient penalty: torch.autograd.grad(..., create_graph=True), then "
            "backward through that gradient); torch's selective activation checkpoint allows one backward per forward. "
            f"Fix: recompute={group!r} (whole-block recompute supports double backward) or recompute=None")
