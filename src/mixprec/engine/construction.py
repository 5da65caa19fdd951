"""How ``MixedPrecision(...)`` is put together, in the parts it assigns from typed values.

:func:`resolve_arguments` settles what comes before anything changes: the memory budget and the optimizer
checked, the ``compile`` request read, the strategy built, the policy resolved on the device (``"auto"``: its
pending decision, :mod:`mixprec.auto.pending`) and agreed by every rank; the model and the optimizer are untouched
until the engine prepares the model (:mod:`mixprec.engine.preparation.prepare`). :func:`first_decision` is the
decision line the build reads out, :func:`built_in_features` the engine's features in their call order
(docs/architecture.md "Features").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from mixprec.auto.pending import PendingAuto, resolve_for_engine
from mixprec.autocast.compiled import CompileRequest, compile_request
from mixprec.autocast.op_plan import describe as describe_kernels
from mixprec.distributed.strategy import make_strategy
from mixprec.engine.autocast_scope import AutocastScope
from mixprec.engine.feature import Feature, Features
from mixprec.engine.grad_sums import GradSums
from mixprec.engine.kernel_agreement import KernelAgreement
from mixprec.engine.masters import check_claim
from mixprec.engine.memory_budget import MemoryBudget
from mixprec.engine.misuse.arguments import check_optimizer
from mixprec.engine.misuse.loop_checks import LoopChecks
from mixprec.engine.param_groups import GroupWatch
from mixprec.engine.preparation.prepare import Prepared
from mixprec.engine.protocol import Engine
from mixprec.engine.recompute_setup import RecomputeSetup
from mixprec.engine.records import Decision
from mixprec.engine.regions import Regions
from mixprec.optim import contract
from mixprec.policy.policy import Policy
from mixprec.policy.resolve import Resolution

__all__ = ["Resolved", "resolve_arguments", "first_decision", "built_in_features"]


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
    resolved on ``device`` (``allow_fallback``; ``loss_scale``: the engine's override, which auto's decision keeps)
    and, with an ``optimizer``, its rounding stream checked on every rank and its precision contract
    (:func:`mixprec.optim.contract.check`, on the dtypes it will step). No host sync but the probe's
    (:func:`mixprec.auto.pending.resolve_for_engine`).

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
    if optimizer is not None:   # every rank rounds with one stream; the optimizer can run the policy
        built.check_attached(optimizer, resolution.policy, resolution.device)
        stepped = resolution.policy.param_dtype if not resolution.policy.has_masters else torch.float32
        contract.check(optimizer, resolution.policy, {stepped})   # before the casts (attach checks it again after)
    if resolution.policy.param_dtype != torch.float32:   # a param another engine stores in 16 bits: refused now
        check_claim(mp, list(model.named_parameters()), {id(p) for p in model.parameters()})
    return Resolved(model, budget, request, built, resolution, auto)


def first_decision(head: str, prepared: Prepared, compiled: CompileRequest, policy: Policy, device_type: str,
                   state_note: str, regions: str) -> str:
    """The decision line at build, before the features' clauses: ``head`` (the resolution's words), then in
    reading order the fp8 or block-scaled linears, the storage plan, the ``compiled`` request, loss scaling, the params upcast,
    the kernels on ``device_type``, the optimizer's state (``state_note``; "" without one) and the fp32 regions'
    words (``regions``)."""
    return str(Decision(head, (prepared.fp8_note + prepared.block_note, prepared.plan.note(), compiled.note(policy), policy.scaling_note(),
                               prepared.upcast_note, describe_kernels(policy, device_type), state_note, regions)))


def built_in_features(mp: Engine, recompute: Any, strategy: Any, scope: AutocastScope, checks: LoopChecks,
                      auto: PendingAuto, budget: MemoryBudget, regions: Regions, groups: GroupWatch,
                      own: Sequence[Callable[[Engine], Feature]] = ()) -> tuple[GradSums, Features]:
    """The engine ``mp``'s fp32 gradient sums and its features in call order (docs/architecture.md "Features"):
    loop checks, gradient sums, pending ``auto``, kernel agreement, recompute, memory budget, fp32 regions,
    param-group watch, then one per factory of ``own`` (``MixedPrecision.feature_types``, each built as
    ``factory(mp)``). Three are built here first, in this order: the ``recompute`` plan (with ``scope``'s saved
    rebuilds; a named plan's event recorded at boundary 0), the ranks' kernel agreement and the sums.
    ValueError/TypeError for a bad ``recompute``, or ``"auto"`` where ``strategy`` cannot measure the blocks."""
    recomputed = RecomputeSetup(mp, recompute, strategy, scope.rebuilds)   # blocks recomputed in backward
    kernels = KernelAgreement(strategy, mp.policy)   # every rank: rank 0's measured kernels
    sums = GradSums(mp)   # 16-bit params without masters: a window's grads summed in fp32
    built_in = (checks, sums, auto, kernels, recomputed, budget, regions, groups)
    return sums, Features((*built_in, *(make(mp) for make in own)))
