"""The training-step engine: ``MixedPrecision`` and ``StepResult``.

One object owns the whole mixed-precision step so that no call can come twice or be forgotten (the
classic ``unscale_``/``update`` misuse of torch.amp.GradScaler). What it needs lives in collaborators
named for their concept: :mod:`mixprec.engine.storage` (which dtype each parameter is stored in, the frozen
set), :mod:`mixprec.engine.regions` (fp32 regions, the output cast), :mod:`mixprec.engine.masters` (fp32 masters),
:mod:`mixprec.engine.reprepare` (a new policy mid-run), :mod:`mixprec.distributed.strategy` (one process, DDP, FSDP2),
:mod:`mixprec.optim.contract` (what the optimizer must do) and :mod:`mixprec.engine.divergence` (the default
guard). docs/architecture.md draws the map.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.engine.clipping import clip_ as _clip_
from mixprec.engine.clipping import global_norm_fp32 as _global_norm_fp32
from mixprec.autocast.compiled import compile_request, eager_dtypes
from mixprec.policy.resolve import resolve
from mixprec.engine.divergence import DivergenceError, StopWhenStuck, stuck_if_skipped
from mixprec.engine.edits import ModelLayout, adopt_model_edits
from mixprec.engine.loop_checks import LoopChecks
from mixprec.engine.loss_scale import from_spec as loss_scale_from_spec
from mixprec.engine.masters import MasterWeights, claim, release
from mixprec.optim import contract
from mixprec.engine.pending_auto import PendingAuto, pending_resolution
from mixprec.policy.policy import Policy, cast_floating, state_name
from mixprec.autocast.op_plan import describe as describe_kernels
from mixprec.autocast.op_plan import planned_kernels
from mixprec.autocast.portable import portable_ops
from mixprec.engine.regions import Regions, keep_fp32_modules
from mixprec.engine.reprepare import (check_fp8_unchanged, load_across_policies, load_state, match_frozen, reprepare,
                               unfreeze_params)
from mixprec.engine.storage import FrozenSet, dtype_text, plan_storage
from mixprec.distributed.strategy import make_strategy
from mixprec.policy.tree import field_names, map_fields, map_tensors

__all__ = ["MixedPrecision", "StepResult", "DivergenceError", "cast_floating"]

log = logging.getLogger("mixprec")

_RETAINED = 2   # ``_step_pending`` after a backward(retain_graph=True): a further backward() joins its micro-batch
_TOO_MANY = ("backward() called for micro-batch {n} since the last step() with accumulation_steps={a}; call mp.step() "
             "after each micro-batch's backward() (it returns None until the boundary). Two losses of one micro-batch: "
             "pass retain_graph=True to the first backward(), or backpropagate their sum")
_MID_ACCUMULATION = ("{call} called after {n} micro-batch(es) of backward() without reaching the step boundary; "
                     "{what} at an accumulation boundary (after mp.step() returns a result)")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer-step boundary did.

    ``applied``, ``loss_finite`` and ``stuck_skips`` are host values (read by ``step()``'s one sync).
    ``stuck_skips``: consecutive skipped steps that loss scaling can no longer help (scale at its floor,
    or fixed/none), this one included; 0 when applied. ``loss_scale`` (the scale this step used) and
    ``grad_norm`` (fp32, of the unscaled gradients, before clipping) are read from device tensors on
    access: **reading them syncs the host with the device**.
    """

    applied: bool
    skipped_reason: str | None      # None, "overflow" (loss scaling backs off) or "nonfinite"
    step: int                       # applied optimizer steps so far
    skipped_total: int
    loss_scale_t: torch.Tensor = field(repr=False)
    grad_norm_t: torch.Tensor = field(repr=False)
    rolled_back: bool = False
    escalated: bool = False
    loss_finite: bool = True
    stuck_skips: int = 0

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scale_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)


def _check_args(model: Any, optimizer: Any, scheduler: Any, max_grad_norm: Any, accumulation_steps: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an int >= 1")
    if max_grad_norm is not None and not (float(max_grad_norm) > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 or None (no clipping)")
    if _needs_closure(optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__} needs a closure in step() (it re-evaluates the loss, "
                        "as LBFGS does), which the engine's one-backward step cannot give; use a first-order "
                        "optimizer (mixprec.optim.AdamW, torch.optim.SGD/Adam), or train it without MixedPrecision")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("scheduler=ReduceLROnPlateau needs a metric at each step, which the engine does not "
                        "have; pass scheduler=None and call it yourself: `if result and result.applied: "
                        "plateau.step(val_loss)`")
    model_params = {id(p) for p in model.parameters()}
    if model_params and not any(id(p) in model_params for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("optimizer holds none of the model's parameters; build it on model.parameters() "
                         "(before MixedPrecision) so the engine can step and, where needed, rebind it")


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` has a required ``closure`` argument (LBFGS)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def _check_param_dtypes(model: nn.Module, policy: Policy) -> None:
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
        raise ValueError(f"policy {policy} stores parameters in {dtype_text(policy.param_dtype)} and casts them "
                         f"itself, but the model holds {names}{more} in {', '.join(other)}. Fix: call model.float() "
                         "before building MixedPrecision (the policy then stores each tensor as it says), or pick "
                         f"the policy of the model's own format (e.g. {_SHORT.get(other[0], 'fp32')}-pure for a model held "
                         f"in {other[0]})")


def _upcast_note(model: nn.Module, policy: Policy) -> str:
    """The decision's words on trainable 16-bit params a policy with fp32 params stores in fp32 (LoRA
    adapters cast with their base before wrapping: peft's ``get_peft_model`` upcasts them too)."""
    names = [n for n, p in model.named_parameters()
             if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) and policy.param_dtype == torch.float32]
    if not names:
        return ""
    return (f"; {len(names)} trainable 16-bit param(s) stored in fp32, as {policy} trains them "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"loss must be a scalar floating tensor, got {type(loss).__name__} of shape "
                         f"{tuple(getattr(loss, 'shape', ()))} and dtype {getattr(loss, 'dtype', None)}; reduce it "
                         "(.mean()) and compute it in floating point")
    if not loss.requires_grad:
        raise ValueError("loss does not require grad, so nothing can be trained from it. Likely causes: it was "
                         "computed under torch.no_grad() or torch.inference_mode(); from detached tensors "
                         "(.detach(), .item(), .data, numpy); every parameter it depends on is frozen "
                         "(requires_grad=False); or reentrant activation checkpointing (use_reentrant=True) "
                         "whose inputs do not require grad cut the graph (pass use_reentrant=False). Compute it "
                         "from mp.model's output with autograd enabled")


def _from_numpy(leaf: Any) -> Any:
    """A numpy array or scalar as a tensor (``torch.as_tensor``); any other leaf unchanged."""
    if type(leaf).__module__ == "numpy" and hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return torch.as_tensor(leaf)
    return leaf


def _make_loss_scale(policy: Policy, override: Any, device: torch.device) -> Any:
    spec = policy.loss_scale if override is None else override
    ls = spec if hasattr(spec, "unscale_") else loss_scale_from_spec(spec)
    if ls.enabled and policy.compute_dtype == torch.bfloat16 and policy.param_dtype != torch.float16:
        warnings.warn(f"loss scaling is on ({type(ls).__name__}) under a bf16 policy ({policy}): bf16 has "
                      "fp32's exponent range, so scaling does nothing useful; drop loss_scale=...", stacklevel=3)
    return ls.to(device)


def _host_read(flags: torch.Tensor, loss_scale: Any, grad_norm: torch.Tensor) -> list[float]:
    """The step's one host read: ``flags`` (skip, loss non-finite), the stuck count and whether
    ``grad_norm`` is finite, read together (one sync)."""
    return torch.cat([flags, stuck_if_skipped(loss_scale).to(flags), grad_norm.isfinite().reshape(1).to(flags)]).tolist()


def _convert_fp8(model: nn.Module, policy: Policy, device: torch.device, keep: dict[str, nn.Module]):
    """Swap eligible linears for :class:`mixprec.fp8.Float8Linear` (the same Parameter objects); fp32
    regions are never converted. Returns the report and the decision's note ("" without fp8)."""
    if policy.fp8 is None:
        return None, ""
    from mixprec.fp8 import convert_to_float8, fp8_available

    report = convert_to_float8(
        model, recipe=policy.fp8, fp8_format=policy.fp8_format, keep_first_last=policy.fp8_keep_ends,
        module_filter=lambda module, name: not any(name == k or name.startswith(k + ".") for k in keep))
    fast, why = fp8_available(device)
    return report, (f"; fp8 linears ({policy.fp8}, {policy.fp8_format}): {len(report.converted)} converted, "
                    f"{len(report.skipped)} kept in {str(policy.compute_dtype)[6:]}; "
                    + ("torch._scaled_mm" if fast else "emulated: " + why))


class MixedPrecision:
    """Train ``model`` with ``optimizer`` under a precision policy: one object owns autocast, loss
    scaling, fp32 masters, the optimizer-precision contract and the step lifecycle. ``model`` (fp32
    params, cast in place) and ``optimizer`` (built on ``model.parameters()``, rebound to fp32 masters
    under ``-pure`` policies) are prepared once; ``policy`` is ``"auto"`` (timed on the model at its first
    training forward: :mod:`mixprec.engine.pending_auto`), a preset, ``key=value`` text or a :class:`~mixprec.Policy`;
    ``scheduler`` steps once per *applied* step; ``max_grad_norm`` clips the fp32 norm of the unscaled grads;
    ``guard`` has ``after_step(mp, result)`` (:class:`mixprec.Guard`; default
    :class:`~mixprec.engine.divergence.StopWhenStuck`); ``strategy``: None, ``"ddp"``, ``"fsdp2"``;
    ``compile``: True or a dict of ``torch.compile`` kwargs compiles the prepared model (a model already
    compiled is prepared inside its wrapper; :mod:`mixprec.autocast.compiled`). Public attributes: ``model`` (what
    to call, compiled if asked), ``module`` (the user's model), ``optimizer``, ``scheduler``, ``policy``,
    ``device``, ``strategy``, ``decision``, ``events``, ``masters``, ``loss_scale``, ``applied_steps``,
    ``skipped_total``, ``boundaries``, ``micro_step``. Errors: ValueError/TypeError for bad arguments
    (named, with the fix), RuntimeError for an optimizer that already stepped; docs/engine.md explains more.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: str | Policy = "auto", *,
                 device: str | torch.device | None = None, scheduler: Any = None,
                 max_grad_norm: float | None = None, accumulation_steps: int = 1, loss_scale: Any = None,
                 allow_fallback: bool = False, max_stuck_skips: int = 20, guard: Any = None,
                 strategy: str | None = None, compile: bool | dict[str, Any] = False) -> None:
        _check_args(model, optimizer, scheduler, max_grad_norm, accumulation_steps)
        model, self._compile = compile_request(model, compile, strategy)
        stop_when_stuck = StopWhenStuck(max_stuck_skips)
        self._strategy = make_strategy(strategy)
        device = self._strategy.device(device)
        resolution = resolve(policy, device, allow_fallback=allow_fallback)
        resolution = self._strategy.agree_resolution(resolution, resolution.device)
        probe_resolution, (resolution, candidates) = resolution, pending_resolution(
            policy, resolution, strategy=strategy, compiled_in_place=self._compile.compiled_in_place)
        self._auto = PendingAuto(candidates, probe_resolution, loss_scale)   # auto timed at the first forward
        self.policy: Policy = resolution.policy
        self.device: torch.device = resolution.device
        self.decision: str = resolution.decision
        self.model = self.module = model
        self.strategy, self.optimizer, self.scheduler, self.guard = strategy, optimizer, scheduler, guard
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulation_steps, self.max_stuck_skips = accumulation_steps, max_stuck_skips
        self._stop_when_stuck = stop_when_stuck   # the guard while ``guard`` is None (it may be set later)
        self.events: list[dict] = []
        self._step_batches: deque = deque(maxlen=accumulation_steps)   # kept only for a guard
        self._step_grads: list[torch.Tensor] = []
        self._regions, self._unwrapped = Regions(), False

        self.loss_scale = _make_loss_scale(self.policy, loss_scale, self.device)
        _check_param_dtypes(model, self.policy)
        model.to(self.device)
        keep = keep_fp32_modules(model, self.policy)
        self.fp8_report, note = _convert_fp8(model, self.policy, self.device, keep)
        self._strategy.before_casts(model, self.policy, self.device, keep, optimizer)
        params = list(model.parameters())
        self._frozen = FrozenSet(model)
        plan = plan_storage(model, self.policy, params, keep, self._frozen.ids(),
                            sharded=self._strategy.shards_params)
        self.decision += (note + plan.note() + self._compile.note(self.policy) + self.policy.scaling_note()
                          + _upcast_note(model, self.policy) + describe_kernels(self.policy, self.device.type))
        self.masters = MasterWeights(params, set(plan.half) if self.policy.has_masters else set())
        self._frozen.store(plan)
        kahan_from = [(p, p.detach().float().clone()) for p in params if id(p) in plan.half and not self.policy.has_masters
                      and self.policy.rounding == "kahan"]   # fp32 values before the cast: the compensation's start
        plan.apply(params)
        self.masters.record_versions()
        if self.policy.has_masters:
            self.masters.rebind(optimizer)
        contract.check(optimizer, self.policy, {p.dtype for g in optimizer.param_groups for p in g["params"]
                                                if id(p) not in plan.frozen16})
        self.decision += contract.configure(optimizer, self.policy)   # how 8-bit state lays out ("" else)
        contract.start_compensation(optimizer, self.policy, kahan_from)
        claim(self, list(model.named_parameters()), set(plan.half))
        self.decision += self._regions.install(model, self.policy, self.device.type, keep, set(plan.frozen16))
        self.model = self._compile.apply(self._strategy.after_casts(model, self.policy, self.device))
        self.masters.record_versions()   # DDP's broadcast of rank 0's params is not a user edit

        self.micro_step = 0          # backward() calls since the last boundary
        self.applied_steps = self.skipped_total = 0
        self.boundaries = 0          # step() boundaries reached (applied + skipped)
        self._last_loss: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None       # over this boundary's micro-batches (device)
        self._boundary_loss: torch.Tensor | None = None
        self._loss_finite = torch.ones((), dtype=torch.bool)
        self._step_pending = False   # a backward() awaits its step()
        self._extra_inf: torch.Tensor | None = None   # non-finite gradients met by unscale() this boundary
        self._layout = None if self._strategy.shards_params else ModelLayout(model)   # FSDP2 swaps params itself
        self._checks = LoopChecks(self, self._adopt_model_edits)
        self._checks.install()
        self._set_gradient_sync()
        self._auto.install(self)
        log.info("mixprec: %s", self.decision)

    # ------------------------------------------------------------------ the step
    @contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` for this device type and the policy's compute dtype (off for fp32), the op lists and
        kernels its ``ops`` and ``kernels`` keys name (:mod:`mixprec.autocast.portable`, :mod:`mixprec.autocast.op_plan`) and
        compile settings giving a compiled forward eager's dtypes. ``mp.model(x)`` returns ``output_dtype``."""
        self._check_usable("mp.autocast()")
        with torch.autocast(self.device.type, dtype=self.policy.compute_dtype, enabled=self.policy.is_mixed), \
                portable_ops(self.device.type, enabled=self.policy.ops == "portable"), eager_dtypes(self.policy), \
                planned_kernels(self.device.type, enabled=self.policy.kernels == "measured"), \
                self._auto.block():   # auto pending: its decision at the first forward may switch autocast on
            yield

    def cast_inputs(self, batch: Any, *, keep: tuple[str, ...] = ()) -> Any:
        """Move ``batch`` to the device and cast its floating tensors to the param dtype (ints and bools
        unchanged; numpy arrays become tensors; containers as :mod:`mixprec.policy.tree`; the caller's batch is not
        modified). ``keep``: top-level keys, fields or (tuples, lists) indices moved but not cast (e.g. a float
        target; ValueError if absent); a float field that looks like a target, rounded to 16 bits, is warned
        about once. With a guard the cast micro-batches are kept until the boundary (:attr:`step_batches`).
        No host sync."""
        dtype = self.policy.param_dtype
        batch = map_tensors(batch, lambda t: t, leaf=_from_numpy)
        self._checks.check_cast(batch, dtype, keep)
        if keep:
            names = field_names(batch) or []
            missing = [k for k in keep if k not in names]
            if missing:
                raise ValueError(f"cast_inputs(keep={keep!r}): {missing} not found; batch keys are {sorted(names)}")
            batch = map_fields(batch, lambda k, v: cast_floating(v, None if k in keep else dtype, self.device))
        else:
            batch = cast_floating(batch, dtype, self.device)
        if self.guard is not None:
            self._step_batches.append(batch)
        return batch

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, inputs: Any = None) -> None:
        """Scale ``loss``, divide by ``accumulation_steps`` and backpropagate (``retain_graph``, ``inputs`` as
        ``Tensor.backward``); no host sync. A call after one with ``retain_graph=True``, before ``step()``, is the
        same micro-batch (two losses through one graph add up); any other call is a new micro-batch. Under
        ``-pure`` the 16-bit grads go into the fp32 masters' grads. Foreign gradients and model edits are handled
        first (:mod:`mixprec.engine.loop_checks`, :mod:`mixprec.engine.edits`). Raises ValueError for a loss that is not a
        scalar floating tensor requiring grad; RuntimeError for more micro-batches than ``accumulation_steps``
        without ``step()``, or a frozen param made trainable by hand (:meth:`unfreeze`). Inputs' ``.grad`` keep
        the loss scale (docs/loops.md)."""
        _check_loss(loss)
        self._check_usable("mp.backward()")
        self._frozen.check_not_thawed()
        self._auto.before_backward()
        new_micro_batch = self._step_pending != _RETAINED   # a retained graph's next loss: the same micro-batch
        if new_micro_batch and self.micro_step >= self.accumulation_steps:
            raise RuntimeError(_TOO_MANY.format(n=self.micro_step + 1, a=self.accumulation_steps))
        if new_micro_batch and self.micro_step == 0:
            self._adopt_model_edits()
        self._checks.before_backward(first=new_micro_batch and self.micro_step == 0)
        self.micro_step += new_micro_batch
        self._last_loss = loss.detach()
        first = new_micro_batch and self.micro_step == 1
        self._loss_sum = self._last_loss.float() if first else self._loss_sum + self._last_loss.float()
        finite = torch.isfinite(self._last_loss).all()
        self._loss_finite = finite if first else self._loss_finite & finite
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        with portable_ops(self.device.type, enabled=self.policy.ops == "portable"), \
                planned_kernels(self.device.type, enabled=self.policy.kernels == "measured"):   # torch.utils.checkpoint
            self.loss_scale.scale_loss(loss).backward(retain_graph=retain_graph, inputs=inputs)   # recomputes as fwd
        self._step_pending = _RETAINED if retain_graph else True
        self.masters.accumulate_grads()
        self._checks.after_backward()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (differentiable), for ``torch.autograd.grad`` on a loss the engine
        does not backpropagate (a gradient penalty); pair with :meth:`unscale` (docs/loops.md recipe). No host sync."""
        return self.loss_scale.scale_loss(loss)

    def unscale(self, grads: Any) -> list[torch.Tensor | None]:
        """The true gradients of ``grads`` (``torch.autograd.grad`` of :meth:`scale_loss`), as fp32 tensors
        ``g.float() * (1/scale)``: differentiable, so with ``create_graph=True`` a penalty built from them
        trains. A non-finite value counts as an overflow at this step's boundary (the step is skipped, the
        scale backs off), as for the parameters' gradients. None entries stay None. No host sync. Source:
        torch.amp's gradient-penalty recipe (``scaler.scale(loss)``, then ``grads / scaler.get_scale()``)."""
        inv_scale = self.loss_scale.scale.detach().reciprocal()
        out = [None if g is None else g.float() * inv_scale.to(g.device) for g in grads]
        checked = [torch.isfinite(g).all().to(inv_scale.device) for g in out if g is not None]
        if checked:
            found = (~torch.stack(checked).all()).float()
            self._extra_inf = found if self._extra_inf is None else torch.maximum(self._extra_inf, found)
        return out

    def step(self) -> StepResult | None:
        """Finish a micro-batch; at a boundary: unscale → fp32 norm → agree across ranks → one host read →
        clip (by the scaled norm if it overflowed: :mod:`mixprec.engine.clipping`) → optimizer and scheduler step,
        or skip → loss-scale update → masters into the params → grads zeroed → guard. None between boundaries.
        Host syncs: one per boundary (flags, stuck count, norm finite), one per param edited outside (adopted).
        Raises RuntimeError without a ``backward()``; the guard may raise :class:`DivergenceError`."""
        self._check_usable("mp.step()")
        if not self._step_pending:
            raise RuntimeError("step() called without backward() since the last step; call mp.backward(loss) first")
        self._step_pending = False
        if self.micro_step < self.accumulation_steps:
            self._set_gradient_sync()
            return None
        self._adopt_edited_params()
        self._boundary_loss = self._loss_sum / self.accumulation_steps
        grads = self._strategy.local(self._checks.at_boundary())
        found_inf = self._unscale_(grads)
        grad_norm = self._strategy.global_norm(_global_norm_fp32(grads, self.device))
        flags = self._strategy.agree_flags(torch.stack([found_inf, (~self._loss_finite).to(found_inf)]))
        scale_before = self.loss_scale.scale.detach().clone()
        skipped, loss_nonfinite, stuck, norm_finite = _host_read(flags, self.loss_scale, grad_norm)
        if not (norm_finite or skipped):   # finite grads whose squares overflow fp32: the scaled norm (mixprec.engine.clipping)
            grad_norm = self._strategy.global_norm(_global_norm_fp32(grads, self.device, scaled=True), scaled=True)
        _clip_(grads, grad_norm, self.max_grad_norm)   # None: no clipping
        applied, loss_finite = not skipped, not (skipped and loss_nonfinite)
        if applied:
            self._apply_update()
        self.skipped_total += not applied
        if loss_finite:  # a non-finite *loss* is a data/forward fault: the scale is not to blame
            self.loss_scale.update(flags[0])
        self.micro_step, self.boundaries = 0, self.boundaries + 1
        self._set_gradient_sync()
        reason = None if applied else "overflow" if (self.loss_scale.enabled and loss_finite) else "nonfinite"
        result = StepResult(applied=applied, skipped_reason=reason, step=self.applied_steps,
                            skipped_total=self.skipped_total, loss_scale_t=scale_before, grad_norm_t=grad_norm,
                            loss_finite=loss_finite, stuck_skips=0 if applied or not loss_finite else int(stuck))
        self._step_grads = grads
        self.discard_gradients()
        self._auto.at_boundary(self)
        try:
            return (self.guard if self.guard is not None else self._stop_when_stuck).after_step(self, result)
        finally:
            self._step_batches.clear()
            self._step_grads = []

    def _unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        found_inf = self.loss_scale.unscale_(grads)
        extra, self._extra_inf = self._extra_inf, None
        if extra is None:
            return found_inf
        self._loss_finite = self._loss_finite | extra.bool().to(self._loss_finite.device)  # NaN from an overflowed
        return torch.maximum(found_inf, extra.to(found_inf.device))                      # penalty: an overflow

    def _apply_update(self) -> None:
        self._checks.applying = True
        try:
            self.optimizer.step()
        finally:
            self._checks.applying = False
        self.applied_steps += 1
        if self.scheduler is not None:
            self.scheduler.step()
        self.masters.copy_to_params()
        torch.clear_autocast_cache()   # else a later forward in the same autocast region uses stale casts

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps (fp32 master grads under ``-pure`` policies), in group order."""
        return [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    @property
    def step_gradients(self) -> tuple[torch.Tensor, ...]:
        """Inside ``guard.after_step``: the unscaled gradients of the boundary being judged (this rank's
        shards), already detached from the params; empty at any other time."""
        return tuple(self._step_grads)

    def agree_on(self, choice: str | None, choices: tuple[str, ...]) -> str | None:
        """The decision every rank takes: the first of ``choices`` any rank chose (None if none; ValueError
        for a ``choice`` not in ``choices``). One process: ``choice``, no collective; else one all-reduce
        every rank must call at the same point, and one sync. :class:`mixprec.Guard` calls it each boundary."""
        return self._strategy.agree_on(choice, choices, self.device)

    # ------------------------------------------------------------------ changing the policy or the frozen set
    def set_policy(self, policy: str | Policy, *, cause: str = "requested", module: str | None = None,
                   loss_scale: Any = None, record: bool = True, kind: str = "set_policy") -> dict:
        """Re-prepare the model under ``policy`` at a boundary, keeping the training state (what carries
        over: :mod:`mixprec.engine.reprepare`; the loss scale is ``loss_scale`` if given, else kept when both
        policies name the same scaling). :class:`mixprec.Guard` calls it to escalate (``kind="escalate"``).
        Returns the event (``kind``: ``"set_policy"`` when asked for, ``"escalate"`` from the guard),
        appended to :attr:`events` when ``record``. No host sync. Raises RuntimeError
        mid-accumulation; ValueError (nothing changed) when the device, optimizer or strategy cannot run
        ``policy`` or it changes the fp8 linears."""
        return _set_policy(self, policy, cause=cause, module=module, loss_scale=loss_scale, record=record, kind=kind)

    def unfreeze(self, *patterns: str, **group_options: Any) -> dict:
        """Train the frozen params whose names match a pattern (``fnmatch``) from this boundary on, stored
        as the policy stores trainable ones, masters built **from the stored 16-bit values**. Params the
        optimizer holds train in their group; others get a new group with ``group_options`` (e.g.
        ``lr=1e-5``; refused under a scheduler). A guard re-snapshots. Returns the ``"unfreeze"`` event.
        Raises ValueError (nothing changed: see :mod:`mixprec.engine.storage`), RuntimeError mid-accumulation."""
        if not patterns:
            raise ValueError("unfreeze() needs at least one parameter-name pattern, e.g. mp.unfreeze('encoder.layer.5.*')")
        self._check_boundary("unfreeze()", "unfreeze")
        self._strategy.refuse("unfreeze")
        return unfreeze_params(self, self._frozen, patterns, group_options)

    def refreeze(self, names: list[str]) -> None:
        """Undo an :meth:`unfreeze` of ``names`` that added no param group (a refused load), exactly when
        no step ran in between; the events of both are removed."""
        if not names:
            return
        named = dict(self.module.named_parameters())
        events_before = len(self.events)
        self._frozen.refreeze([named[n] for n in names])
        self.set_policy(self.policy, cause="refreeze after a refused load")
        del self.events[events_before:]
        if self.events and self.events[-1].get("kind") == "unfreeze":
            self.events.pop()

    def match_frozen(self, saved: list[str], *, check_only: bool = False) -> None:
        """Make this engine's frozen set equal ``saved`` (a run's :meth:`frozen_names`) before its state is
        loaded: what that run unfroze is unfrozen here too (:meth:`unfreeze`). Raises ValueError when
        ``saved`` keeps frozen a param trained here, names an unknown one, or unfroze one into a param
        group this optimizer lacks; ``check_only``: raise, change nothing."""
        match_frozen(self, self._frozen, saved, check_only=check_only)

    def frozen_names(self) -> list[str]:
        """Names of the frozen parameters (``requires_grad=False`` at build and not unfrozen since), in order."""
        return self._frozen.names()

    def check_frozen_values(self, values: dict[str, torch.Tensor]) -> None:
        """Raise ValueError if a value about to be loaded into a frozen param stored in fp16 does not fit
        fp16 (``values``: name → tensor; others ignored). One sync per checked tensor."""
        self._frozen.check_values(values)

    def unwrap(self, *, to_fp32: bool = False) -> nn.Module:
        """Remove the engine's hooks and return the user's model; the engine is finished (autocast,
        backward and step raise RuntimeError). ``to_fp32=True``: every floating param becomes fp32 in
        place with its best value (master, else param plus Kahan compensation), for inference or export;
        ValueError under a strategy, RuntimeError mid-accumulation. No host sync but adoptions'."""
        return _unwrap(self, to_fp32)

    # ------------------------------------------------------------------ views and state
    @property
    def boundary_loss(self) -> torch.Tensor | None:
        """Mean fp32 loss over the last boundary's micro-batches (a device tensor; None before the first
        boundary; non-finite if any micro-batch loss was). Reading its value syncs."""
        return self._boundary_loss

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The loss of the last ``backward()`` (detached, unscaled, on the device). Reading it syncs."""
        return self._last_loss

    @property
    def step_batches(self) -> tuple:
        """The micro-batches cast since the last boundary, kept only when a guard is attached."""
        return tuple(self._step_batches)

    def master_parameters(self) -> Iterator[torch.Tensor]:
        """fp32 masters in ``model.parameters()`` order (the params themselves where no master exists)."""
        yield from self.masters.masters

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable params by name as fp32 CPU copies of their best values (master, else param plus
        Kahan compensation): a LoRA run's small file, for ``model.load_state_dict(state, strict=False)``. Syncs."""
        values = dict(zip(map(id, self.masters.params), self._fp32_values()))
        return {name: values[id(p)].to("cpu", copy=True).contiguous()
                for name, p in self.module.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: policy text, frozen set, model params, masters,
        optimizer, scheduler, loss-scale state (every field) and counters; tensors are references.
        RuntimeError mid-accumulation (the accumulated gradients are not part of the state)."""
        self._check_boundary("state_dict()", "take it")
        self._adopt_model_edits()
        self._adopt_edited_params()
        return {
            "policy": str(self.policy),
            "frozen": self.frozen_names(),
            "model": self.module.state_dict(),
            "masters": self.masters.named(self.module.named_parameters()),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
            "counters": {"micro_step": self.micro_step, "applied_steps": self.applied_steps,
                         "skipped_total": self.skipped_total, "boundaries": self.boundaries},
        }

    def load_state_dict(self, state: dict[str, Any], *, convert: bool = False, adopt_policy: bool = False) -> None:
        """Restore a :meth:`state_dict`; continuing equals an uninterrupted run (an ``"events"`` list, as
        checkpoints carry, replaces :attr:`events`). A state of another policy needs ``convert=True`` (to
        this policy, a ``"convert"`` event) or ``adopt_policy=True`` (switch to it): :func:`mixprec.engine.reprepare.
        load_across_policies`. Raises ValueError, before anything changes, for another policy without
        either, other masters or loss-scale type, a frozen set that cannot be matched or unfit fp16 values."""
        if state["policy"] != str(self.policy):
            return load_across_policies(self, state, convert=convert, adopt_policy=adopt_policy)
        load_state(self, state)
        self._auto.after_load(self, state.get("events"))

    def discard_gradients(self) -> None:
        """Drop an unfinished accumulation: every gradient (params and masters) and the pending micro-batches;
        the next ``backward()`` starts a boundary. No host sync."""
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True) if self._layout is None else self._layout.zero_grad()
        self._step_pending, self.micro_step, self._extra_inf = False, 0, None
        self._set_gradient_sync()

    def restore_progress(self, counters: dict[str, int], events: list[dict] | None) -> None:
        """Set the counters and event log (None: keep it) of a saved run, for loaders that restore the model,
        optimizer, scheduler and loss scale themselves (:func:`mixprec.engine.reprepare.load_state`,
        :func:`mixprec.distributed.process.load_distributed_checkpoint`)."""
        self._check_boundary("restore_progress()", "restore")
        self.applied_steps, self.skipped_total = counters["applied_steps"], counters["skipped_total"]
        self.boundaries = counters["boundaries"]
        if events is not None:
            self.events[:] = list(events)

    # ------------------------------------------------------------------ internals
    def _fp32_values(self) -> list[torch.Tensor]:
        return self.masters.fp32_values(lambda p: contract.compensation(self.optimizer, p))

    def _set_gradient_sync(self) -> None:
        self._strategy.set_gradient_sync(self.model, last_micro_batch=self.micro_step == self.accumulation_steps - 1,
                                         has_masters=bool(self.masters.pairs))

    def _adopt_edited_params(self) -> None:
        """Params written outside the engine (16-bit ones with fp32 masters) keep the edit: their masters
        adopt the new value, with one warning and an ``adopt`` event, instead of being overwritten."""
        detail = self.masters.adopt_edits(lambda: {id(p): n for n, p in self.module.named_parameters()})
        if not detail:
            return
        self.events.append({"step": self.boundaries, "kind": "adopt", "cause": "params edited outside the optimizer",
                            "module": None, "detail": detail})
        warnings.warn(f"{detail}. To keep full fp32 precision, load weights before building MixedPrecision, "
                      "or with mixprec.load_checkpoint / mp.load_state_dict", stacklevel=3)

    def _adopt_model_edits(self) -> None:
        adopt_model_edits(self, self._layout, self._frozen)

    def _check_boundary(self, call: str, what: str) -> None:
        if self.micro_step != 0:
            raise RuntimeError(_MID_ACCUMULATION.format(call=call, n=self.micro_step, what=what))

    def _check_usable(self, call: str) -> None:
        if self._unwrapped:
            raise RuntimeError(f"{call} after mp.unwrap(): the engine's hooks (output cast, keep_fp32 regions, fp32 "
                               "embedding lookups) are gone, so it would train with other numerics; build a new "
                               "MixedPrecision on the model to go on")


def _set_policy(mp: MixedPrecision, policy: str | Policy, *, cause: str, module: str | None, loss_scale: Any,
                record: bool, kind: str) -> dict:
    """:meth:`MixedPrecision.set_policy`'s body (out of the class to keep it short)."""
    mp._check_boundary("set_policy()", "change the policy")
    new = resolve(policy, mp.device).policy
    check_fp8_unchanged(mp.policy, new)
    mp._strategy.refuse("set_policy")
    prepared = reprepare(mp.module, mp.optimizer, mp.masters, mp._frozen, new, mp._strategy)
    mp._auto.cancel(mp, new)   # another policy asked for while auto is pending: it wins
    mp._regions.remove()
    old, mp.policy, mp.masters = mp.policy, new, prepared.masters
    mp._frozen.store(prepared.plan)
    scale_note = "loss scale kept"
    if loss_scale is not None or new.loss_scale != old.loss_scale:
        mp.loss_scale = _make_loss_scale(new, loss_scale, mp.device)
        scale_note = f"loss scale now {type(mp.loss_scale).__name__}"
    note = mp._regions.install(mp.module, new, mp.device.type, prepared.keep, set(prepared.plan.frozen16))
    mp.model.zero_grad(set_to_none=True)
    mp.decision = (f"{new} on {mp.device} ({new.summary()}; set_policy at boundary {mp.boundaries}: {cause}; was {old})"
                   + mp._compile.note(new) + note + contract.state_note(mp.optimizer))
    formats = (state_name(old.state_dtype), state_name(new.state_dtype))
    state_move = f" (converted {formats[0]} → {formats[1]})" if formats[0] != formats[1] else ""
    event = {"step": mp.boundaries, "kind": kind, "cause": cause, "module": module,
             "detail": f"{old} → {new}: params re-cast from their fp32 values (frozen and just-unfrozen ones from "
                       f"their stored values), optimizer state of {prepared.carried} tensor(s) carried over"
                       f"{state_move}, {scale_note}", "from": str(old), "to": str(new)}
    mp.events.extend([event] if record else [])
    (log.warning if new != old else log.info)("mixprec: policy %s → %s at boundary %d (%s)", old, new,
                                               mp.boundaries, cause)
    return event


def _unwrap(mp: MixedPrecision, to_fp32: bool) -> nn.Module:
    """:meth:`MixedPrecision.unwrap`'s body."""
    if to_fp32:
        mp._strategy.refuse("to_fp32")
        if mp.micro_step != 0:
            raise RuntimeError("unwrap(to_fp32=True) mid-accumulation; call it after mp.step() returns a result")
        mp._adopt_edited_params()
        has_master = {id(p) for p, _ in mp.masters.pairs}
        for p, value_fp32 in zip(mp.masters.params, mp._fp32_values()):
            if p.is_floating_point() and (p.dtype != torch.float32 or id(p) in has_master):
                p.data = value_fp32
    mp._regions.remove()
    mp._checks.remove()
    mp._auto.remove()
    release(mp)
    mp._unwrapped = True
    return mp.module
