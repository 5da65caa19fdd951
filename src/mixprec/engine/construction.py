"""What ``MixedPrecision(...)`` settles before anything changes: the memory budget and the optimizer checked, the
``compile`` request read, the strategy built, the policy resolved on the device (``"auto"``: its pending decision,
:mod:`mixprec.auto.pending`) and agreed by every rank. The engine assigns what :class:`Resolved` holds; the model
and the optimizer are untouched until it prepares the model (:mod:`mixprec.engine.preparation.prepare`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from mixprec.auto.pending import PendingAuto, resolve_for_engine
from mixprec.autocast.compiled import CompileRequest, compile_request
from mixprec.distributed.strategy import make_strategy
from mixprec.engine.memory_budget import MemoryBudget
from mixprec.engine.misuse.arguments import check_optimizer
from mixprec.engine.protocol import Engine
from mixprec.policy.policy import Policy
from mixprec.policy.resolve import Resolution

__all__ = ["Resolved", "resolve_arguments"]


class Resolved(NamedTuple):
    """What :func:`resolve_arguments` settled, in the order the engine assigns it: ``model``, the module to prepare
    (a compiled model's ``_orig_mod``); the engine's ``budget``, ``compile`` request and ``strategy``; the policy's
    ``resolution`` on the device (policy, device, the decision's head) and the ``auto`` decision pending."""

    model: nn.Module
    budget: MemoryBudget
    compile: CompileRequest
    strategy: Any
    resolution: Resolution
    auto: PendingAuto


def resolve_arguments(mp: Engine, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                      policy: str | Policy, *, device: str | torch.device | None, strategy: str | None,
                      compile: bool | dict[str, Any], allow_fallback: bool, loss_scale: Any,
                      memory_budget: str | int | None) -> Resolved:
    """The constructor's arguments of the engine ``mp`` settled, in this order: ``memory_budget`` parsed, the
    ``optimizer`` and ``scheduler`` checked (when either is given), ``compile`` read, ``strategy`` built, ``policy``
    resolved on ``device`` (``allow_fallback``; ``loss_scale``: the override auto's candidates keep) and, with an
    ``optimizer``, its rounding stream checked on every rank. No host sync but auto's probe and the ranks' agreement.

    Raises:
        ValueError, TypeError: a bad argument (named, with the fix); nothing has changed then.
    """
    budget = MemoryBudget(mp, memory_budget)
    if optimizer is not None or scheduler is not None:
        check_optimizer(model, optimizer, scheduler)
    model, request = compile_request(model, compile, strategy)
    built = make_strategy(strategy)
    resolution, auto = resolve_for_engine(policy, built.device(device), built, strategy_name=strategy,
                                          allow_fallback=allow_fallback, compiled_in_place=request.compiled_in_place,
                                          loss_scale=loss_scale)
    if optimizer is not None:   # every rank rounds with one stream
        built.check_attached(optimizer, resolution.policy, resolution.device)
    return Resolved(model, budget, request, built, resolution, auto)
