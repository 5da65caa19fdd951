"""Localising a bad step under FSDP2: every rank re-runs its own micro-batches, forward only, and the ranks agree.

:func:`~mixprec.numerics.localise.locate_nonfinite` re-runs one batch with hooks on every module. Under FSDP2
each unit's forward all-gathers its params and its backward reduce-scatters, so a re-run on the one rank that
saw the failure would wait forever for its peers. Here every rank re-runs every micro-batch of its step at the
same point (the same all-gathers in the same order), forward only (the loss detached: no backward, so no
reduce-scatter; a non-finite gradient with a finite forward is not localised), without the culprit's fp32
recompute (re-calling a unit would all-gather on one rank), then re-shards every unit (``FSDPModule.reshard``:
after a forward without backward FSDP2 keeps the root unsharded) and agrees on one answer through ``agree``
(the engine's :meth:`~mixprec.MixedPrecision.agree_on`: one all-reduce): a non-finite batch on any rank first,
else the first module (in ``named_modules`` order) any rank found. Every rank gets the same report, so every
rank takes the same escalation.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from mixprec.distributed.sharded_units import reshard
from mixprec.numerics.localise import NonFiniteReport, locate_nonfinite
from mixprec.policy.policy import Policy

__all__ = ["locate_on_every_rank"]

Agree = Callable[[str | None, tuple[str, ...]], str | None]


def locate_on_every_rank(model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         policy: Policy, device: torch.device, agree: Agree) -> NonFiniteReport | None:
    """The report every rank agrees on for its ``batches`` (this rank's micro-batches of the bad step), or None.

    A collective: every rank must call it at the same point with as many batches (the re-run forwards all-gather,
    ``agree`` all-reduces). Host syncs: the re-runs' (one per module call). A ``loss_fn`` that raises on one rank
    raises there (its peers then wait in their next collective until the group's timeout)."""
    found = None
    for batch in batches:   # every batch on every rank: the same all-gathers
        report = locate_nonfinite(model, batch, lambda m, b: loss_fn(m, b).detach(), policy, device,
                                  fp32_figure=False)
        if found is None and report is not None and report.where in ("input", "forward"):
            found = report
    reshard(model)   # the root (left unsharded by a forward without backward) as after a training step
    names = tuple(name for name, _ in model.named_modules())
    choice = None if found is None else "input" if found.where == "input" else found.module
    agreed = agree(choice, ("input", *names))
    if agreed is None:
        return None
    if found is not None and agreed == choice:
        return found
    if agreed == "input":
        return NonFiniteReport("input", None)
    return NonFiniteReport("forward", agreed, type(model.get_submodule(agreed)).__name__)
