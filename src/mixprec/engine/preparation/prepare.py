"""Preparing a model under a policy: the one path of the first build and of a new policy mid-run.

:func:`prepare` decides which dtype each parameter is stored in (:mod:`mixprec.engine.storage`), which
modules stay fp32 (:mod:`mixprec.engine.regions`), builds the fp32 masters (:mod:`mixprec.engine.masters`)
and casts the params in place. At the first build it also checks the model's dtypes, moves it to the
device, swaps fp8 or block-scaled linears and lets the strategy prepare (FSDP2 shards here); mid-run
(:meth:`mixprec.MixedPrecision.set_policy`) it starts from each param's best fp32 value and moves the
attached optimizer's state to the tensors it steps now. What carries over mid-run, per parameter: its best
fp32 value (:meth:`mixprec.engine.masters.MasterWeights.fp32_values`) becomes the param, stored as the
new plan says, and the new master where the new policy has masters (moving to a wider format loses
nothing, moving down rounds once to nearest); optimizer state moves from the tensor the optimizer stepped
to the one it steps now (:func:`mixprec.optim.contract.move_state`), and frozen params keep none; block-scaled
linears are swapped as a build under the new policy would have them (:func:`switch_block_linears`, called by
:mod:`mixprec.engine.preparation.switch` once every check passed). Every check runs before anything changes. The engine assigns what :class:`Prepared` holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.engine.masters import MasterWeights, best_fp32_values
from mixprec.engine.misuse.outside import check_model_not_wrapped
from mixprec.engine.preparation.swaps import check_prebuilt_linears, tag_swapped, zero_converted_note
from mixprec.engine.regions import keep_fp32_modules
from mixprec.engine.storage import FrozenParams, StoragePlan, dtype_text, plan_storage
from mixprec.optim import contract
from mixprec.policy.policy import Policy

__all__ = ["Prepared", "prepare"]

_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Prepared:
    """The outcome of :func:`prepare`: the storage ``plan``, the fp32 ``masters``, the fp32 regions
    ``keep`` (name → module), the ``frozen`` set (the engine's, or a new one at the first build),
    ``kahan_from`` ((param, fp32 value before its cast) pairs a Kahan policy's compensation starts
    from; empty otherwise), the fp8 report and the decision's fp8 and upcast clauses, the block-scaled conversion's
    report and clause (:func:`convert_block`; first build only, "" else) and how many optimizer-state entries were
    carried over (mid-run)."""

    plan: StoragePlan
    masters: MasterWeights
    keep: dict[str, nn.Module]
    frozen: FrozenParams
    kahan_from: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    fp8_report: Any = None
    fp8_note: str = ""
    upcast_note: str = ""
    block_report: Any = None
    block_note: str = ""
    carried: int = 0


def prepare(model: nn.Module, policy: Policy, device: torch.device, strategy: Any, *,
            optimizer: torch.optim.Optimizer | None = None, masters: MasterWeights | None = None,
            frozen: FrozenParams | None = None) -> Prepared:
    """Prepare ``model`` (fp32 params at the first build) under ``policy``, casting params in place.

    First build (``masters`` None): check dtypes and the linears already swapped, move to ``device``, fp8 or
    block-scaled swaps, the strategy's ``before_casts`` (``optimizer``: the one to rebind when FSDP2 swaps params;
    None without one). Mid-run (``masters``: the current ones, ``frozen``: the engine's set): start from the best
    fp32 values and move ``optimizer``'s state (None: an evaluation engine, nothing to move). The caller removes
    its hooks before and installs the new regions after. No host sync (one per frozen param checked against fp16).

    Raises:
        ValueError: a param in a dtype the policy does not store; linears another engine swapped in under a
            policy that swaps linears; ``policy``'s keep_fp32 patterns match no module; a frozen value does not
            fit a pure fp16 policy; the strategy cannot re-cast; unfrozen params the optimizer does not hold; the
            optimizer cannot run ``policy``. Mid-run, nothing has changed then.
    """
    first = masters is None
    swapped, upcast = {}, ""
    if first:
        check_model_not_wrapped(model, policy, strategy.name)
        check_param_dtypes(model, policy)
        prebuilt = check_prebuilt_linears(model, policy)   # fp8 / block-scaled linears found: run as built
        model.to(device)
    keep = keep_fp32_modules(model, policy)
    if first:
        swapped = convert_linears(model, policy, device, keep, strategy, prebuilt)
        strategy.before_casts(model, policy, device, keep, optimizer)
        frozen, params = FrozenParams(model, watch_casts=not strategy.shards_params), list(model.parameters())
        upcast = upcast_note(model, policy)
    else:
        params = masters.params
    plan = plan_storage(model, policy, params, keep, frozen.ids(), sharded=strategy.shards_params)
    if not first:
        strategy.check_restore({id(p): p.dtype for p in params if p.is_floating_point()},
                               {id(p): plan.dtype_of(p) for p in params if p.is_floating_point()}, policy)
        if optimizer is not None:
            _check_optimizer(model, optimizer, masters, frozen, plan, policy)
    kahan = not policy.has_masters and policy.rounding == "kahan"
    values_fp32, new_masters = _fp32_start(params, plan, policy, strategy, masters, optimizer)
    kahan_from = tuple((p, v) for p, v in zip(params, values_fp32) if kahan and id(p) in plan.half)
    plan.apply(params)
    carried = 0
    if not first and optimizer is not None:
        carried = _move_optimizer(optimizer, masters, new_masters, plan, policy)
        held = {id(t) for g in optimizer.param_groups for t in g["params"]}   # state only for what it steps
        contract.start_compensation(optimizer, policy, [(p, v) for p, v in kahan_from if id(p) in held])
    new_masters.record_versions()
    return Prepared(plan=plan, masters=new_masters, keep=keep, frozen=frozen, kahan_from=kahan_from,
                    upcast_note=upcast, carried=carried, **swapped)


def _fp32_start(params: list[nn.Parameter], plan: StoragePlan, policy: Policy, strategy: Any,
                masters: MasterWeights | None, optimizer: torch.optim.Optimizer | None
                ) -> tuple[list[torch.Tensor | None], MasterWeights]:
    """Each param's fp32 value its new storage starts from, and the new masters (built before the params are
    cast). First build (``masters`` None): the params are their own values; only a Kahan policy's 16-bit ones
    get theirs (``strategy.fp32_value``), the start of their compensation (None for the others). Mid-run: each
    param's best fp32 value (master, else param plus ``optimizer``'s Kahan compensation) becomes the param."""
    kahan = not policy.has_masters and policy.rounding == "kahan"
    if masters is None:
        values_fp32 = [strategy.fp32_value(p) if kahan and id(p) in plan.half else None for p in params]
        return values_fp32, MasterWeights(params, set(plan.half) if policy.has_masters else set())
    values_fp32 = best_fp32_values(masters, optimizer)
    with torch.no_grad():
        for p, value_fp32 in zip(params, values_fp32):
            if p.is_floating_point():
                p.data = value_fp32
        return values_fp32, MasterWeights(params, set(plan.half) if policy.has_masters else set())


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, masters: MasterWeights, frozen: FrozenParams,
                     plan: StoragePlan, new: Policy) -> None:
    """Mid-run, before anything changes: ValueError for unfrozen params ``optimizer`` does not hold, or an
    ``optimizer`` that cannot step the tensors ``plan`` gives it under ``new``."""
    params, old_stepped = masters.params, list(masters.masters)   # per param: the tensor the optimizer steps now
    index = {id(t): i for i, t in enumerate(old_stepped)}
    stepped = [t for g in optimizer.param_groups for t in g["params"]]
    stepped_ids = {id(t) for t in stepped}
    was_frozen = {id(p) for p in frozen.members}
    orphans = [n for n, p in model.named_parameters()
               if id(p) in was_frozen and p.requires_grad and id(old_stepped[index[id(p)]]) not in stepped_ids]
    if orphans:
        raise ValueError(f"set_policy: parameter(s) {orphans[:5]} were unfrozen but the optimizer does not hold "
                         "them, so they would never train; add them first (optimizer.add_param_group"
                         "({'params': [...]})) or use mp.unfreeze(pattern), which does both")

    def stepped_dtype(t: torch.Tensor) -> torch.dtype:
        if id(t) not in index:          # not a model param: left as it is
            return t.dtype
        half = id(params[index[id(t)]]) in plan.half
        return new.param_dtype if half and not new.has_masters else torch.float32
    contract.check(optimizer, new, {stepped_dtype(t) for t in stepped
                                    if id(t) not in index or id(params[index[id(t)]]) not in plan.frozen16})


def _move_optimizer(optimizer: torch.optim.Optimizer, old: MasterWeights, new: MasterWeights, plan: StoragePlan,
                    policy: Policy) -> int:
    """Point ``optimizer``'s groups at ``new``'s stepped tensors and move their state (a frozen param keeps
    none). Returns how many state entries were carried over."""
    old_stepped = list(old.masters)
    index = {id(t): i for i, t in enumerate(old_stepped)}
    for group in optimizer.param_groups:
        group["params"] = [new.masters[index[id(t)]] if id(t) in index else t for t in group["params"]]
    moves = [(t_old, None if id(p) in plan.frozen16 else t_new)
             for p, t_old, t_new in zip(old.params, old_stepped, new.masters)]
    carried = sum(1 for (t_old, t_new) in moves if t_new is not None and optimizer.state.get(t_old))
    contract.move_state(optimizer, moves, policy)
    return carried


def check_param_dtypes(model: nn.Module, policy: Policy) -> None:
    """Raise ValueError for a param or buffer in a dtype the policy does not store (named, with the fix).
    Complex params are kept as they are (complex64 is two fp32 numbers: :mod:`mixprec.engine.storage`), except
    16-bit complex32, which has no fp32 master and no 16-bit-aware optimizer."""
    chalf = [n for n, p in model.named_parameters() if p.dtype == torch.complex32]
    if chalf:
        raise ValueError(f"parameter(s) {chalf[:5]} are complex32 (16-bit complex), which no policy can train (no "
                         "fp32 master, optimizer state in 16 bits); make them complex64 (p.data = p.data.to("
                         "torch.complex64)) before building MixedPrecision: complex64 params are kept as they are")
    allowed = {torch.float32, policy.param_dtype}
    frozen_ok = allowed | {policy.compute_dtype}   # a frozen param may come in the compute dtype
    if policy.param_dtype == torch.float32:        # fp32 params: trainable 16-bit ones are upcast (recorded)
        allowed = allowed | {torch.bfloat16, torch.float16}
    wrong = [(n, p.dtype) for n, p in model.named_parameters()
             if p.is_floating_point() and p.dtype not in (allowed if p.requires_grad else frozen_ok)]
    wrong += [(n, b.dtype) for n, b in model.named_buffers()   # e.g. an fp16 mask under bf16
              if b.is_floating_point() and b.dtype in (torch.float16, torch.bfloat16) and b.dtype not in frozen_ok]
    if wrong:
        names = ", ".join(f"{n} ({dtype_text(d)})" for n, d in wrong[:5])
        more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        other = sorted({dtype_text(d) for _, d in wrong})
        own = (f", or pick the policy of the model's own format ({_SHORT[other[0]]}-pure for a model held in "
               f"{other[0]})" if other[0] in _SHORT else f"; no policy stores {other[0]} (policy 'fp32' trains the "
               "model all in fp32 after model.float())")
        raise ValueError(f"policy {policy} stores parameters in {dtype_text(policy.param_dtype)} and casts them "
                         f"itself, but the model holds {names}{more} in {', '.join(other)}. Fix: call model.float() "
                         f"before building MixedPrecision (the policy then stores each tensor as it says){own}")


def upcast_note(model: nn.Module, policy: Policy) -> str:
    """The decision's words on trainable 16-bit params a policy with fp32 params stores in fp32 (LoRA
    adapters cast with their base before wrapping: peft's ``get_peft_model`` upcasts them too)."""
    names = [n for n, p in model.named_parameters()
             if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) and policy.param_dtype == torch.float32]
    if not names:
        return ""
    return (f"; {len(names)} trainable 16-bit param(s) stored in fp32, as {policy} trains them "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")


def convert_linears(model: nn.Module, policy: Policy, device: torch.device, keep: dict[str, nn.Module],
                    strategy: Any, prebuilt: str = "") -> dict[str, Any]:
    """The first build's swaps of linears (fp8: :func:`convert_fp8`; block-scaled: :func:`convert_block`, with the
    ``strategy``'s words on them; fp32 regions ``keep`` never), as :class:`Prepared`'s fields ``fp8_report``,
    ``fp8_note`` (after ``prebuilt``: the words on the fp8 and block-scaled linears found, run as built),
    ``block_report``, ``block_note``."""
    fp8_report, fp8_note = convert_fp8(model, policy, device, keep)
    fp8_note = prebuilt + fp8_note
    block_report, block_note = convert_block(model, policy, device, keep)
    block_note += strategy.block_note(policy) if block_note else ""
    return {"fp8_report": fp8_report, "fp8_note": fp8_note, "block_report": block_report, "block_note": block_note}


def convert_fp8(model: nn.Module, policy: Policy, device: torch.device, keep: dict[str, nn.Module]
                ) -> tuple[Any, str]:
    """Swap eligible linears for :class:`mixprec.fp8.Float8Linear` (the same Parameter objects); fp32
    regions are never converted. Returns the report and the decision's note ("" without fp8)."""
    if policy.fp8 is None:
        return None, ""
    from mixprec.fp8 import convert_to_float8, fp8_available

    report = convert_to_float8(
        model, recipe=policy.fp8, fp8_format=policy.fp8_format, keep_first_last=policy.fp8_keep_ends,
        module_filter=outside_regions(keep))
    tag_swapped(model, report.converted, policy)
    fast, why = fp8_available(device)
    built = sum(r.endswith("left as built") for _, r in report.skipped)   # named by check_prebuilt_linears
    zero = "" if report.converted else zero_converted_note(policy, f"fp8 ({policy.fp8})",
                                                           (r for _, r in report.skipped), built)
    return report, zero + (f"; fp8 linears ({policy.fp8}, {policy.fp8_format}): {len(report.converted)} converted, "
                           f"{len(report.skipped) - built} kept in {str(policy.compute_dtype)[6:]}"
                           + (f", {built} left as built; " if built else "; ")
                           + ("torch._scaled_mm" if fast else "emulated: " + why))


def outside_regions(keep: dict[str, nn.Module]):
    """A conversion's ``module_filter``: False for a module in an fp32 region (``keep``'s names or under them)."""
    return lambda module, name: not any(name == k or name.startswith(k + ".") for k in keep)


def _kept_words(report: Any) -> str:
    """The kept linears grouped by reason, e.g. ``"first Linear: fc_in; last Linear: head; bf16 tail, the last 1 of
    4 blocks of 'blocks': blocks.3.fc1, blocks.3.fc2"`` (at most 4 names per reason)."""
    groups: dict[str, list[str]] = {}
    for name, reasons in report.kept:
        for reason in reasons.split("; "):
            tag = ("fp32 region (keep_fp32)" if reason == "rejected by module_filter" else
                   "block_keep" if reason.startswith("kept by block_keep") else
                   reason.split(" (")[0] if reason.startswith(("first Linear", "last Linear")) else
                   reason.split(" stay in")[0].replace("in the bf16 tail: the", "bf16 tail, the")
                   if reason.startswith("in the bf16 tail") else reason)
            groups.setdefault(tag, []).append(name)
    return "; ".join(f"{tag}: {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                     for tag, names in groups.items())


def emulation_words(device: torch.device, recipe: Any, compute_dtype: torch.dtype) -> str:
    """How ``recipe``'s block-scaled GEMMs run on ``device`` (:func:`mixprec.blockscale.native.recipe_support`: on
    CUDA its probe runs here, once): natively, or emulated and why; and, emulated on CUDA with NVFP4 operands while
    fp32 matmuls run in TF32 (:func:`mixprec.blockscale.gemm.tf32_matmuls`), that the emulation is then inexact."""
    from mixprec.blockscale.gemm import tf32_matmuls
    from mixprec.blockscale.native import recipe_support

    support = recipe_support(device, recipe, compute_dtype)
    if support.available:
        return support.reason
    tf32 = ""
    if device.type == "cuda" and any(recipe.operand_format(o).tensor_scale for o in ("x", "W", "dy")) \
            and tf32_matmuls():
        tf32 = ("; fp32 matmuls run in TF32 here (torch's float32 matmul precision), which rounds the emulated NVFP4 "
                "operands to 10 mantissa bits: set torch.set_float32_matmul_precision('highest') (or "
                "torch.backends.cuda.matmul.fp32_precision = 'ieee') for the exact emulation")
    return (f"emulated on {device.type} (each GEMM: exact dequantize of the block-scaled operands + an fp32 GEMM; "
            f"{support.reason}), so its speed is not representative of a native GEMM{tf32}")


def convert_block(model: nn.Module, policy: Policy, device: torch.device, keep: dict[str, nn.Module]
                  ) -> tuple[Any, str]:
    """Swap eligible linears for :class:`mixprec.blockscale.BlockScaledLinear` under ``policy.block``'s recipe (the
    same Parameter objects; :func:`mixprec.blockscale.convert_to_block_scaled`); fp32 regions (``keep``) are never
    converted, nor are the linears ``policy.block_keep`` names (ValueError for a pattern that matches none, before any
    swap). Returns the :class:`~mixprec.blockscale.BlockConversionReport` and the decision's clause: the recipe,
    how many linears converted, which kept and why, and how the GEMMs run (natively or emulated, and why; None, ""
    without ``block``). Each converted (or found block-scaled) linear caches whether its GEMMs run natively on
    ``device`` in the compute dtype (:meth:`~mixprec.blockscale.BlockScaledLinear.gemm_support`), so a compiled
    forward reads it instead of probing. No host sync (on CUDA, the probe's one read, once per process)."""
    if policy.block is None:
        return None, ""
    from mixprec.blockscale import convert_to_block_scaled, get_block_recipe

    recipe = get_block_recipe(policy.block, disable=policy.block_disable)
    report = convert_to_block_scaled(model, recipe, module_filter=outside_regions(keep), keep=policy.block_keep)
    tag_swapped(model, report.converted, policy)
    named = dict(model.named_modules())
    for name in (*report.converted, *(n for n, _ in report.as_built)):   # the forward reads it, compiled too
        if hasattr(named[name], "gemm_support"):
            named[name].gemm_support(device, policy.compute_dtype)
    kept = f" ({_kept_words(report)})" if report.kept else ""
    built = f", {len(report.as_built)} left as built ({', '.join(n for n, _ in report.as_built[:4])})" \
        if report.as_built else ""
    zero = "" if report.converted else zero_converted_note(
        policy, f"block-scaled {report.recipe.name}", (r for _, r in report.kept + report.as_built),
        len(report.as_built))
    compute = _SHORT.get(dtype_text(policy.compute_dtype), dtype_text(policy.compute_dtype))
    return report, zero + (f"; block-scaled linears {report.recipe}: {len(report.converted)} converted, "
                           f"{len(report.kept)} kept in {compute}{kept}{built}; "
                           f"{emulation_words(device, report.recipe, policy.compute_dtype)}")


def switch_block_linears(model: nn.Module, old: Policy, new: Policy, device: torch.device,
                         keep: dict[str, nn.Module]) -> str:
    """Mid-run (:meth:`mixprec.MixedPrecision.set_policy`), after every check: make ``model``'s block-scaled linears
    those a build under ``new`` converts (``keep``: ``new``'s fp32 regions). Nothing changes, and "" is returned,
    when ``block``, ``block_keep``, ``block_disable`` and ``keep_fp32`` are ``old``'s; else every block-scaled
    linear is swapped back to ``nn.Linear`` and, under a ``new.block``, the model converted as at a build, each
    linear converted again under the same stream (recipe seed and index: a ``block_disable`` change keeps it)
    continuing its stochastic rounding. Returns the decision's clause. No host sync."""
    fields = ("block", "block_keep", "block_disable", "keep_fp32")
    if all(getattr(old, f) == getattr(new, f) for f in fields):
        return ""
    from mixprec.blockscale import revert_block_scaled

    before = revert_block_scaled(model, lambda module, name: module.built_by is not None)   # the caller's stay
    report, note = convert_block(model, new, device, keep)
    named = dict(model.named_modules())
    for name in () if report is None else report.converted:
        was, now = before.get(name), named[name]
        if was is not None and was.sr_seed == now.sr_seed:   # the same stream (recipe seed + index), parts aside
            now.set_extra_state(was.get_extra_state())
    if note or not before:
        return note
    return f"; block-scaled linears: {len(before)} back to nn.Linear, in the compute dtype as bf16-mixed runs them"
