"""The training-step engine: ``MixedPrecision`` and ``StepResult``.

One object owns the whole mixed-precision step lifecycle so that no call can come twice or
be forgotten (the classic ``unscale_``/``update`` misuse of torch.amp.GradScaler)::

    mp = mixprec.MixedPrecision(model, optimizer, policy="auto")
    for batch in loader:
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = loss_fn(mp.model(batch), batch)
        mp.backward(loss)
        result = mp.step()          # None between accumulation boundaries

``step()`` at an accumulation boundary: unscale once → global grad norm in fp32 on unscaled
grads → clip → finite check (on device) → optimizer step or skip → loss-scale update →
scheduler stepped only on applied steps → grads zeroed → masters rounded into params.
Host syncs: exactly one per boundary (reading the found-inf flag to decide whether the
optimizer and scheduler step, as torch.amp.GradScaler.step does), plus one more on a skipped
step (to tell an overflow from a non-finite loss). ``StepResult.loss_scale`` and
``.grad_norm`` are device tensors read lazily: reading them syncs.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import logging
import re
import warnings
from collections import UserDict, defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec import distributed
from mixprec.devices import Resolution, resolve
from mixprec.loss_scale import from_spec as loss_scale_from_spec
from mixprec.masters import MasterWeights
from mixprec.policy import Policy, cast_floating

__all__ = ["MixedPrecision", "StepResult", "DivergenceError", "cast_floating"]

log = logging.getLogger("mixprec")


class DivergenceError(RuntimeError):
    """Training cannot continue: non-finite values that loss scaling cannot fix, or a guard gave up."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer-step boundary did.

    ``applied`` is a host bool (already synced by ``step()``). ``loss_scale`` and ``grad_norm``
    (fp32, of the unscaled gradients, before clipping) are read from device tensors on access:
    **reading them syncs the host with the device**.
    """

    applied: bool
    skipped_reason: str | None      # None, "overflow" (loss scaling backs off) or "nonfinite"
    step: int                       # applied optimizer steps so far
    skipped_total: int
    loss_scale_t: torch.Tensor = field(repr=False)
    grad_norm_t: torch.Tensor = field(repr=False)
    rolled_back: bool = False
    escalated: bool = False

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scale_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)


_AUTOCAST_MODULES = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)   # not EmbeddingBag: it reduces in its dtype


def _autocast_casts(module: nn.Module) -> bool:
    """Storing this module's frozen parameters in the compute dtype changes only their rounding: autocast
    casts a matmul/conv weight to it anyway (transformers' GPT-2 ``Conv1D`` is an ``addmm``), and an
    embedding table's lookups are returned in fp32 by an engine hook. (Bilinear is not on CPU
    autocast's list: not included.)"""
    return isinstance(module, _AUTOCAST_MODULES) or type(module).__name__ == "Conv1D"


class _Fp32Region:
    """Forward pre/post hooks that run one module with autocast off and fp32 inputs.

    A picklable object (no closures), so a prepared model still pickles and deep-copies.
    """

    def __init__(self, device_type: str, out_dtype: torch.dtype | None) -> None:
        self.device_type = device_type
        self.out_dtype = out_dtype
        self._stack: list[torch.autocast] = []

    def __getstate__(self):
        return {"device_type": self.device_type, "out_dtype": self.out_dtype, "_stack": []}

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        ctx = torch.autocast(self.device_type, enabled=False)
        ctx.__enter__()
        self._stack.append(ctx)
        return cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        self._stack.pop().__exit__(None, None, None)
        return cast_floating(output, self.out_dtype) if self.out_dtype is not None else output


class _OutputCast:
    """Forward hook on the root module casting floating outputs to the policy's output dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        return cast_floating(output, self.dtype)


class MixedPrecision:
    """Train ``model`` with ``optimizer`` under a precision policy on a device.

    Args:
        model: any ``nn.Module`` with fp32 parameters (moved to ``device``; 16-bit policies cast
            its parameters in place — the same ``Parameter`` objects, so the optimizer stays valid).
        optimizer: built on ``model.parameters()`` before any step. Under policies with fp32
            masters it is rebound to the masters. Under ``kahan``/``stochastic`` rounding it must
            be a :mod:`mixprec.optim` optimizer.
        policy: ``"auto"``, a preset name, ``key=value`` text or a :class:`~mixprec.Policy`.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, a ``torch.device`` or None (best).
        scheduler: an LR scheduler stepped once per *applied* optimizer step.
        max_grad_norm: clip the global gradient norm (computed in fp32 on unscaled grads).
        accumulation_steps: micro-batches per optimizer step; the loss is divided by it.
        loss_scale: override the policy's loss scaling: ``"dynamic"``, ``"none"``, a number or a
            loss-scale object from :mod:`mixprec.loss_scale`.
        allow_fallback: let an unrunnable policy fall back (recorded in ``decision``).
        max_stuck_skips: consecutive skipped steps with the loss scale at its floor (or, without
            dynamic scaling, consecutive non-finite steps) after which ``step()`` raises
            :class:`DivergenceError` explaining whether grads held inf or NaN and whether the
            loss itself was non-finite.
        guard: an object with ``after_step(mp, result) -> StepResult`` (see :class:`mixprec.Guard`).
        strategy: None (one process), ``"ddp"`` or ``"fsdp2"``: join the torchrun process group
            (device ``cuda:LOCAL_RANK`` or the CPU), start every rank from rank 0's weights and
            wrap the prepared model (:func:`mixprec.distributed.wrap_model`: DDP, or FSDP2
            ``fully_shard`` with params stored sharded in fp32 and cast by FSDP). Gradients are
            reduced in fp32 on every path; the found-inf and non-finite-loss flags are ORed across
            ranks before the step's one host sync (one all-reduce per boundary, on every rank; under
            FSDP2 one more for the global grad norm over the shards), so all ranks skip or step
            together. Each rank feeds its own batches (:func:`mixprec.distributed.shard_batches`).

    Frozen parameters (``requires_grad=False`` when the engine is built: a pretrained base, a LoRA
    base) get no master, gradient or optimizer state; under 16-bit policies they are stored in the
    policy's *compute* dtype (bf16 under bf16 and fp8 policies: 2 bytes/param, rounded to nearest once),
    while trainable parameters follow the policy. Exceptions (fp32 kept; rules in
    :meth:`_storage_plan`): params of keep_fp32 modules (and BatchNorm); under ``-mixed`` policies
    frozen params autocast does not cast itself (norm gains: only Linear/Conv/Embedding weights go
    16-bit); under fp16, values that do not fit fp16 (recorded in :attr:`decision`); under
    ``strategy="fsdp2"`` every param. A frozen param may also arrive already in the compute dtype
    (e.g. a model loaded in bf16). Setting ``requires_grad`` on one afterwards makes :meth:`backward`
    raise naming it; :meth:`unfreeze` is the supported route (builds its fp32 master on the spot).
    The optimizer checks ignore frozen params (they never get a gradient); :meth:`state_dict` records
    which are frozen, and loading a state unfreezes what its run had unfrozen (:meth:`match_frozen`).

    Attributes:
        model (what to call: the DDP wrapper under ``"ddp"``), module (the user's model, unwrapped),
        optimizer, scheduler, policy, device, strategy, decision (one line: how the policy was chosen),
        events (dicts with at least ``step``, ``kind``, ``cause``, ``module``, ``detail``: what a
        guard or :meth:`set_policy` did; ``step`` is the boundary count when it happened).

    Raises:
        ValueError / TypeError: bad arguments; a parameter in an unexpected dtype (named);
            an optimizer that would keep 16-bit state.
        RuntimeError: the optimizer already stepped.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: str | Policy = "auto",
                 device: str | torch.device | None = None, scheduler: Any = None,
                 max_grad_norm: float | None = None, accumulation_steps: int = 1,
                 loss_scale: Any = None, *, allow_fallback: bool = False, max_stuck_skips: int = 20,
                 guard: Any = None, strategy: str | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an int >= 1")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 or None (no clipping)")
        if not isinstance(max_stuck_skips, int) or max_stuck_skips < 1:
            raise ValueError(f"max_stuck_skips={max_stuck_skips!r} must be an int >= 1")
        distributed.check_strategy(strategy)
        if strategy is not None:
            device = distributed.init_process_group_from_env(device)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("scheduler=ReduceLROnPlateau needs a metric at each step, which the engine does not "
                            "have; pass scheduler=None and call it yourself: `if result and result.applied: "
                            "plateau.step(val_loss)`")
        model_params = {id(p) for p in model.parameters()}
        if model_params and not any(id(p) in model_params for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("optimizer holds none of the model's parameters; build it on model.parameters() "
                             "(before MixedPrecision) so the engine can step and, where needed, rebind it")
        resolution: Resolution = resolve(policy, device, allow_fallback=allow_fallback)
        if strategy is not None:  # every rank runs rank 0's policy ("auto" may measure differently)
            chosen = distributed.from_main_process(str(resolution.policy))
            if chosen != str(resolution.policy):
                resolution = resolve(chosen, device)
                resolution = dataclasses.replace(resolution, decision=f"{resolution.decision} (rank 0's choice)")
        self.policy: Policy = resolution.policy
        self.device: torch.device = resolution.device
        self.decision: str = resolution.decision
        self.model = model
        self.module = model
        self.strategy = strategy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulation_steps = accumulation_steps
        self.max_stuck_skips = max_stuck_skips
        self.guard = guard
        self.events: list[dict] = []
        self._hooks: list[Any] = []
        # this boundary's micro-batches, kept (references) only when a guard may need to localise them
        self._step_batches: deque = deque(maxlen=accumulation_steps)

        self.loss_scale = self._make_loss_scale(loss_scale)
        self._check_param_dtypes()
        model.to(self.device)
        keep = self._keep_fp32_modules()
        self.fp8_report = self._convert_fp8(keep)
        if strategy is not None:
            distributed.sync_module_states(model)
        if strategy == "fsdp2":  # params stay fp32, sharded: they are the masters; FSDP casts them
            distributed.wrap_model(model, self.policy, strategy, self.device, keep_fp32=tuple(keep),
                                   optimizer=optimizer, sharded_found_inf=True)
        params = list(model.parameters())
        # frozen: requires_grad=False at build, whatever their storage; unfreeze() removes from it
        self._frozen_all = [p for p in params if p.is_floating_point() and not p.requires_grad]
        half, frozen = self._storage_plan(self.policy, params, keep, {id(p) for p in self._frozen_all})
        if self._unfit_frozen:
            self.decision += (f"; {len(self._unfit_frozen)} frozen param(s) kept in fp32, their values do not fit "
                              f"{_dtype_text(self.policy.compute_dtype)} ({', '.join(self._unfit_frozen[:3])}"
                              f"{', ...' if len(self._unfit_frozen) > 3 else ''})")
        self.masters = MasterWeights(params, half if self.policy.has_masters else set())
        self._frozen = [p for p in params if id(p) in frozen]   # the frozen ones stored in 16 bits
        with torch.no_grad():
            for p in params:
                if id(p) in half:
                    p.data = p.data.to(self.policy.param_dtype)
                elif id(p) in frozen:
                    p.data = p.data.to(self.policy.compute_dtype)
                elif p.is_floating_point() and p.dtype != torch.float32:   # arrived 16-bit, planned fp32
                    p.data = p.data.float()
        self.masters.record_versions()
        if self.policy.has_masters:
            self.masters.rebind(optimizer)
        self._configure_optimizer()
        if self.policy.state_dtype == torch.float16:
            warnings.warn(f"policy {self.policy} keeps optimizer state in fp16: Adam's second moment (grad**2) "
                          "underflows fp16 below 6e-8, i.e. for gradients under ~2e-4, and the update then "
                          "blows up; prefer state=bf16 (fp32's range) or fp32", stacklevel=2)
        self._install_hooks(keep)
        if strategy == "ddp":  # after the casts: DDP builds its buckets from the params' dtypes
            self.model = distributed.wrap_model(model, self.policy, strategy, self.device)
            self.masters.record_versions()  # DDP's broadcast of rank 0's params is not a user edit

        self.micro_step = 0          # backward() calls since the last boundary
        self.applied_steps = 0
        self.skipped_total = 0
        self.boundaries = 0          # step() boundaries reached (applied + skipped)
        self._last_loss: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None       # over this boundary's micro-batches (device)
        self._boundary_loss: torch.Tensor | None = None
        self._step_pending = False   # a backward() awaits its step()
        self._nonfinite_streak = 0   # consecutive boundaries whose loss itself was non-finite
        self._loss_finite = torch.ones((), dtype=torch.bool)  # over this boundary's micro-batches (device)
        self._set_gradient_sync()
        log.info("mixprec: %s", self.decision)

    # ------------------------------------------------------------------ setup
    def _make_loss_scale(self, override: Any):
        spec = self.policy.loss_scale if override is None else override
        ls = spec if hasattr(spec, "unscale_") else loss_scale_from_spec(spec)
        if ls.enabled and self.policy.compute_dtype == torch.bfloat16 and self.policy.param_dtype != torch.float16:
            warnings.warn(f"loss scaling is on ({type(ls).__name__}) under a bf16 policy ({self.policy}): bf16 has "
                          "fp32's exponent range, so scaling does nothing useful; drop loss_scale=...",
                          stacklevel=3)
        return ls.to(self.device)

    def _check_param_dtypes(self) -> None:
        allowed = {torch.float32, self.policy.param_dtype}
        frozen_ok = allowed | {self.policy.compute_dtype}   # a frozen param may come in the compute dtype
        wrong = [(n, p.dtype) for n, p in self.module.named_parameters()
                 if p.is_floating_point() and p.dtype not in (allowed if p.requires_grad else frozen_ok)]
        wrong += [(n, b.dtype) for n, b in self.module.named_buffers()   # e.g. an fp16 mask under bf16
                  if b.is_floating_point() and b.dtype in (torch.float16, torch.bfloat16) and b.dtype not in frozen_ok]
        if wrong:
            names = ", ".join(f"{n} ({str(d).replace('torch.', '')})" for n, d in wrong[:5])
            more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
            raise ValueError(f"policy {self.policy} keeps parameters in {str(self.policy.param_dtype).replace('torch.', '')}"
                             f" and casts them itself, but the model already holds {names}{more} (a stray tensor "
                             "in another dtype). Fix: call model.float() before building MixedPrecision; the "
                             "policy decides what is stored in 16 bits (use a '-pure' policy for 16-bit params "
                             "with fp32 masters)")

    def _storage_plan(self, policy: Policy, params: list[nn.Parameter], keep: dict[str, nn.Module],
                      frozen_now: set[int]) -> tuple[set[int], set[int]]:
        """Which params (ids) are stored in the policy's 16-bit ``param_dtype`` (trainable ones) and which
        are *frozen*, stored in the compute dtype (bf16 under bf16 policies: 2 bytes/param, no master, no
        gradient, no optimizer state).

        ``frozen_now``: the engine's frozen set (``requires_grad=False`` at build, less what
        :meth:`unfreeze` thawed; a param frozen by hand after the build keeps its trainable storage).
        A frozen param stays fp32 when: it belongs to a keep_fp32 module (or BatchNorm under 16-bit
        params); under a *mixed* policy (fp32 params, autocast), it is not owned only by modules whose
        ops autocast casts or whose output the engine returns in fp32 (Linear, Conv, transformers'
        Conv1D; Embedding, whose lookups a hook returns in fp32; a LayerNorm/BatchNorm weight in bf16
        meeting fp32 activations is an error on CPU); or, under a mixed policy, its values do not fit
        the compute format (fp16: a value beyond 65504, or over 1 % of its nonzero values flushed to
        zero) — a logged decision. Under FSDP2 every param stays fp32 (sharded, cast by FSDP).

        Raises:
            ValueError: under a *pure* fp16 policy, a frozen param whose values do not fit fp16 (fp32
                storage would break the pure dtype flow): name it, suggest bf16 or keep_fp32.
        """
        self._unfit_frozen: list[str] = []
        if self.strategy == "fsdp2":
            return set(), set()
        keep_params = {id(p) for m in keep.values() for p in m.parameters()}
        free = [p for p in params if id(p) not in keep_params and p.is_floating_point()]
        half = {id(p) for p in free if id(p) not in frozen_now and policy.param_dtype != torch.float32}
        candidates = [p for p in free if id(p) in frozen_now and policy.compute_dtype != torch.float32]
        if policy.param_dtype == torch.float32:   # mixed: only where autocast casts the op's operands
            owners: dict[int, list[nn.Module]] = defaultdict(list)
            for m in self.module.modules():
                for q in m.parameters(recurse=False):
                    owners[id(q)].append(m)
            candidates = [p for p in candidates if owners[id(p)] and all(_autocast_casts(m) for m in owners[id(p)])]
        frozen, unfit = set(), []
        for p in candidates:
            if self._fits(p, policy.compute_dtype):
                frozen.add(id(p))
            else:
                unfit.append(p)
        if unfit:
            names = {id(q): n for n, q in self.module.named_parameters()}
            self._unfit_frozen = [names.get(id(q), "?") for q in unfit]
            if policy.param_dtype != torch.float32:
                raise ValueError(f"policy {policy} stores every param in {_dtype_text(policy.param_dtype)}, but frozen "
                                 f"parameter(s) {self._unfit_frozen[:3]} hold values that do not fit it (beyond its "
                                 "range, or mostly flushed to zero); use a bf16 policy, or keep their modules in "
                                 "fp32 (policy keep_fp32=<module>)")
            log.warning("mixprec: frozen parameter(s) %s kept in fp32: their values do not fit %s",
                        ", ".join(self._unfit_frozen[:5]), policy.compute_dtype)
        return half, frozen

    @staticmethod
    @torch.no_grad()
    def _fits(p: torch.Tensor, dtype: torch.dtype) -> bool:
        """``p`` survives rounding to ``dtype``: nothing finite overflows, and at most 1 % of its nonzero
        values flush to zero (one host sync per param, at build or re-preparation only)."""
        if dtype != torch.float16 or p.dtype == dtype:
            return True
        rounded = p.detach().to(dtype)
        nonzero = p.ne(0)
        overflow, flushed, n_nonzero = torch.stack([(torch.isinf(rounded) & torch.isfinite(p)).sum(),
                                                    (rounded.eq(0) & nonzero).sum(), nonzero.sum()]).tolist()
        return overflow == 0 and flushed <= 0.01 * max(1, n_nonzero)

    def _adopt_edited_params(self) -> None:
        """Params written outside the engine (16-bit ones with fp32 masters) keep the edit: their masters
        adopt the new value, with one warning naming them, instead of overwriting it after the step."""
        edited = self.masters.adopt_edited_params()
        if not edited:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        listed = [names.get(id(self.masters.pairs[i][0]), "?") for i in edited]
        dtype = str(self.policy.param_dtype).replace("torch.", "")
        detail = (f"{len(listed)} parameter(s) ({', '.join(listed[:5])}{', ...' if len(listed) > 5 else ''}) were "
                  f"written outside the engine (e.g. model.load_state_dict after MixedPrecision was built); their "
                  f"fp32 masters now take those values, as stored in {dtype}")
        self.events.append({"step": self.boundaries, "kind": "adopt", "cause": "params edited outside the optimizer",
                            "module": None, "detail": detail})
        warnings.warn(f"{detail}. To keep full fp32 precision, load weights before building MixedPrecision, "
                      "or with mixprec.load_checkpoint / mp.load_state_dict", stacklevel=3)

    def _check_frozen(self) -> None:
        """Raise if a param stored frozen (16-bit, no master) was unfrozen behind the engine's back."""
        thawed = [p for p in self._frozen if p.requires_grad]
        if thawed:
            names = {id(p): n for n, p in self.module.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in thawed[:5])
            dtype = str(thawed[0].dtype).replace("torch.", "")
            raise RuntimeError(
                f"parameter(s) {listed}{' and more' if len(thawed) > 5 else ''} had requires_grad=False when "
                f"MixedPrecision was built, so they are stored in {dtype} with no fp32 master, gradient or optimizer "
                "state, but they now require grad; training them as they are would step a 16-bit tensor. Fix: "
                "mp.unfreeze('<name pattern>') (sets requires_grad, builds the fp32 masters from the stored values "
                "and adds them to the optimizer), or set requires_grad before building MixedPrecision")

    def _keep_fp32_modules(self, policy: Policy | None = None) -> dict[str, nn.Module]:
        """Modules that run in fp32 with autocast off: the policy's ``keep_fp32`` matches, plus every
        BatchNorm when params are 16-bit (its running statistics stay fp32, as Apex O2's
        keep_batchnorm_fp32). A matched container that is never called (ModuleList/ModuleDict)
        stands for its children."""
        policy = self.policy if policy is None else policy
        found = {name: m for name, m in self.module.named_modules()
                 if name and any(fnmatch.fnmatchcase(name, pat) for pat in policy.keep_fp32)}
        unmatched = [pat for pat in policy.keep_fp32
                     if not any(fnmatch.fnmatchcase(n, pat) for n in found)]
        if unmatched:
            raise ValueError(f"policy keep_fp32 patterns {unmatched} match no module of the model; module names "
                             f"look like {[n for n, _ in self.module.named_modules() if n][:8]}")
        if policy.param_dtype != torch.float32:
            found.update({name: m for name, m in self.module.named_modules()
                          if isinstance(m, nn.modules.batchnorm._BatchNorm)})
        containers = (nn.ModuleList, nn.ModuleDict)
        while any(isinstance(m, containers) for m in found.values()):
            for name in [n for n, m in found.items() if isinstance(m, containers)]:
                container = found.pop(name)
                found.update({f"{name}.{child}": m for child, m in container.named_children()})
        # drop modules nested in another kept module: the outer region already covers them
        return {n: m for n, m in found.items() if not any(n.startswith(o + ".") for o in found if o != n)}

    def _convert_fp8(self, keep: dict[str, nn.Module]):
        """Swap eligible linears for :class:`mixprec.fp8.Float8Linear` (same Parameter objects, so the
        optimizer stays valid); modules kept in fp32 are never converted. Records the outcome."""
        if self.policy.fp8 is None:
            return None
        from mixprec.fp8 import convert_to_float8, fp8_available

        report = convert_to_float8(
            self.model, recipe=self.policy.fp8, fp8_format=self.policy.fp8_format,
            keep_first_last=self.policy.fp8_keep_ends,
            module_filter=lambda module, name: not any(name == k or name.startswith(k + ".") for k in keep))
        fast, why = fp8_available(self.device)
        self.decision += (f"; fp8 linears ({self.policy.fp8}, {self.policy.fp8_format}): {len(report.converted)} "
                          f"converted, {len(report.skipped)} kept in {str(self.policy.compute_dtype)[6:]}; "
                          + ("torch._scaled_mm" if fast else "emulated: " + why))
        return report

    def _configure_optimizer(self) -> None:
        opt = self.optimizer
        frozen = {id(p) for p in self._frozen}   # never get a gradient, so the optimizer never steps them
        self._check_optimizer(self.policy, {p.dtype for g in opt.param_groups for p in g["params"]
                                            if id(p) not in frozen})
        if hasattr(opt, "set_precision") and not getattr(opt, "precision_explicit", False):
            opt.set_precision(rounding=self.policy.rounding, state_dtype=self.policy.state_dtype)

    def _check_optimizer(self, policy: Policy, stepped_dtypes: set[torch.dtype]) -> None:
        """Raise ValueError if the optimizer cannot run ``policy`` stepping tensors of ``stepped_dtypes``."""
        opt = self.optimizer
        if hasattr(opt, "set_precision"):      # a mixprec.optim optimizer
            if getattr(opt, "precision_explicit", False):
                if opt.rounding != policy.rounding or opt.state_dtype != policy.state_dtype:
                    raise ValueError(f"optimizer was built with rounding={opt.rounding!r}, state_dtype={opt.state_dtype} "
                                     f"but the policy {policy} says rounding={policy.rounding!r}, state_dtype="
                                     f"{policy.state_dtype}; drop the optimizer's explicit arguments or change the policy")
            return
        # a stock torch optimizer keeps state in its params' dtype and rounds to nearest
        if policy.rounding != "nearest":
            raise ValueError(f"policy {policy} writes updates with rounding={policy.rounding!r}, which "
                             f"{type(opt).__name__} cannot do; use mixprec.optim.AdamW / mixprec.optim.SGD")
        if stepped_dtypes - {torch.float32}:
            raise ValueError(f"{type(opt).__name__} would keep its state in {sorted(map(str, stepped_dtypes))} "
                             f"under policy {policy} (16-bit params, no master weights): small moments round away. "
                             "Fix: use mixprec.optim.AdamW (fp32 state and math), or master=fp32 (e.g. bf16-pure)")
        if policy.state_dtype != torch.float32:
            raise ValueError(f"policy {policy} asks for state={policy.state_dtype}, which "
                             f"{type(opt).__name__} cannot do; use mixprec.optim.AdamW / SGD")

    def _install_hooks(self, keep: dict[str, nn.Module]) -> None:
        region_out = self.policy.param_dtype if self.policy.param_dtype != torch.float32 else None
        for module in keep.values():
            region = _Fp32Region(self.device.type, region_out)
            self._hooks.append(module.register_forward_pre_hook(region.pre, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(region.post, with_kwargs=True, always_call=True))
        if self.policy.is_mixed or self.policy.param_dtype != torch.float32:
            self._hooks.append(self.module.register_forward_hook(_OutputCast(self.policy.output_dtype)))
        if self.policy.param_dtype == torch.float32:
            # a frozen embedding table stored in 16 bits: autocast leaves lookups alone, so return them in
            # fp32 as an fp32 table would (only the table's values are rounded, as autocast rounds weights)
            frozen = {id(p) for p in self._frozen}
            for module in self.module.modules():
                if isinstance(module, nn.Embedding) and id(module.weight) in frozen:
                    self._hooks.append(module.register_forward_hook(_OutputCast(torch.float32)))

    def unwrap(self, *, to_fp32: bool = False) -> nn.Module:
        """Remove every hook the engine installed and return the user's model (under a strategy: without
        the DDP wrapper, or still sharded by FSDP2). The engine is finished afterwards: :meth:`autocast`,
        :meth:`backward` and :meth:`step` raise RuntimeError (build a new MixedPrecision to train on).

        ``to_fp32=False``: params as stored (16-bit ones stay 16-bit). ``to_fp32=True``: every floating
        param becomes fp32 in place (same Parameter objects) holding its best value: the fp32 master
        where one exists (full precision, not the rounded 16-bit copy), under Kahan rounding the param
        plus its compensation, else the param upcast (exact) -- ready for fp32 inference or export.
        Host syncs: none, but one per param written outside the engine since the last step (those are
        adopted first, see :meth:`step`).

        Raises:
            ValueError: ``to_fp32=True`` under a strategy (sharded or wrapped params).
            RuntimeError: called between ``backward()`` and the accumulation boundary with ``to_fp32``.
        """
        if to_fp32:
            if self.strategy is not None:
                raise ValueError(f"unwrap(to_fp32=True) under strategy={self.strategy!r}: the params are wrapped or "
                                 "sharded; save a checkpoint and load it into a plain model instead")
            if self.micro_step != 0:
                raise RuntimeError("unwrap(to_fp32=True) mid-accumulation; call it after mp.step() returns a result")
            self._adopt_edited_params()
            master_of = {id(p): m for p, m in self.masters.pairs}
            with torch.no_grad():
                for p in self.masters.params:
                    if not p.is_floating_point():
                        continue
                    if id(p) in master_of:
                        p.data = master_of[id(p)].detach().clone()
                        continue
                    comp = self.optimizer.state[p].get("kahan_comp") if p in self.optimizer.state else None
                    p.data = p.data.float() + comp.float() if comp is not None else p.data.float()
        self._remove_hooks()
        self._unwrapped = True
        return self.module

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _check_wrapped(self, call: str) -> None:
        if getattr(self, "_unwrapped", False):
            raise RuntimeError(f"{call} after mp.unwrap(): the engine's hooks (output cast, keep_fp32 regions, fp32 "
                               "embedding lookups) are gone, so it would train with other numerics; build a new "
                               "MixedPrecision on the model to go on")

    def _set_gradient_sync(self) -> None:
        """Before the next micro-batch: reduce its gradients across ranks only at the boundary, and
        on every micro-batch under DDP with masters (their fp32 grads accumulate outside DDP)."""
        if self.strategy is not None:
            last = self.micro_step == self.accumulation_steps - 1
            every = self.strategy == "ddp" and bool(self.masters.pairs)
            distributed.set_gradient_sync(self.model, self.strategy, last or every)

    def agree_on(self, choice: str | None, choices: tuple[str, ...]) -> str | None:
        """The decision every rank takes: the first of ``choices`` that any rank chose (None when
        no rank chose one). With ``strategy=None``: ``choice`` itself, no collective. Else one
        all-reduce, which every rank must call at the same point, and one host sync to read it.
        :class:`mixprec.Guard` calls it at every boundary, so rollbacks happen on all ranks or none.

        Raises:
            ValueError: ``choice`` is not None and not in ``choices``.
        """
        if choice is not None and choice not in choices:
            raise ValueError(f"agree_on: choice={choice!r} is not one of {choices}")
        if self.strategy is None:
            return choice
        flags = torch.tensor([c == choice for c in choices], dtype=torch.float32, device=self.device)
        agreed = distributed.any_across_ranks(flags).tolist()  # syncs
        return next((c for c, flag in zip(choices, agreed) if flag), None)

    # ------------------------------------------------------------------ the step
    @contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` for this device type and the policy's compute dtype (off for fp32).

        Calling the prepared model (``mp.model(x)``) also casts its floating outputs to the
        policy's ``output_dtype`` (fp32 in every preset), so losses see fp32 logits; submodules
        called directly return what autocast produced.
        """
        self._check_wrapped("mp.autocast()")
        with torch.autocast(self.device.type, dtype=self.policy.compute_dtype, enabled=self.policy.is_mixed):
            yield

    def cast_inputs(self, batch: Any, *, keep: tuple[str, ...] = ()) -> Any:
        """Move ``batch`` to the device; cast its floating tensors to the param dtype.

        Integer/bool tensors are unchanged; nested dicts, lists, tuples and dataclasses are walked.
        ``keep`` names top-level dict keys (or dataclass / namedtuple fields) whose floating tensors are moved
        but not cast, e.g. ``keep=("target",)`` so a regression target keeps full precision under
        a 16-bit-param policy (the loss is computed in fp32 anyway).
        With a guard attached, the engine keeps a reference to each cast micro-batch until the
        boundary (:attr:`step_batches`), so the guard can re-run a bad one to localise it.

        Raises:
            ValueError: a ``keep`` name that is not a key of ``batch``.
        """
        if keep:
            mapping = isinstance(batch, (dict, UserDict))   # UserDict: a tokenizer's BatchEncoding
            named_tuple = isinstance(batch, tuple) and hasattr(batch, "_fields")
            names = set(batch) if mapping else set(batch._fields) if named_tuple else (
                {f.name for f in dataclasses.fields(batch)} if dataclasses.is_dataclass(batch) else set())
            missing = [k for k in keep if k not in names]
            if missing:
                raise ValueError(f"cast_inputs(keep={keep!r}): {missing} not found; batch keys are {sorted(names)}")
            fields = list(batch) if mapping else list(batch._fields) if named_tuple else \
                [f.name for f in dataclasses.fields(batch)]
            get = (lambda k: batch[k]) if mapping else (lambda k: getattr(batch, k))  # noqa: E731
            values = {k: cast_floating(get(k), None if k in keep else self.policy.param_dtype, self.device)
                      for k in fields}   # kept ones moved, not cast
            if named_tuple:
                batch = batch._replace(**values)
            else:
                cast = copy.copy(batch)   # the caller's batch is not modified
                for k, v in values.items():
                    if mapping:
                        cast[k] = v
                    else:
                        object.__setattr__(cast, k, v)   # works on frozen dataclasses too
                batch = cast
        else:
            batch = cast_floating(batch, self.policy.param_dtype, self.device)
        if self.guard is not None:
            self._step_batches.append(batch)
        return batch

    def backward(self, loss: torch.Tensor) -> None:
        """Scale ``loss``, divide by ``accumulation_steps`` and backpropagate; no host sync.

        Raises:
            RuntimeError: more ``backward()`` calls than ``accumulation_steps`` without ``step()``.
            ValueError: ``loss`` is not a scalar floating tensor that requires grad.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise ValueError(f"loss must be a scalar floating tensor, got {type(loss).__name__} "
                             f"{getattr(loss, 'shape', '')}")
        if not loss.requires_grad:
            raise ValueError("loss does not require grad (computed under torch.no_grad(), or from detached "
                             "tensors); compute it from mp.model's output with autograd enabled")
        self._check_wrapped("mp.backward()")
        self._check_frozen()
        if self.micro_step >= self.accumulation_steps:
            raise RuntimeError(f"backward() called {self.micro_step + 1} times since the last step() with "
                               f"accumulation_steps={self.accumulation_steps}; call mp.step() after each backward() "
                               "(it returns None until the accumulation boundary)")
        self._last_loss = loss.detach()
        self._loss_sum = self._last_loss.float() if self.micro_step == 0 else self._loss_sum + self._last_loss.float()
        finite = torch.isfinite(self._last_loss).all()
        self._loss_finite = finite if self.micro_step == 0 else self._loss_finite & finite
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        self.loss_scale.scale_loss(loss).backward()
        self.micro_step += 1
        self._step_pending = True
        self.masters.accumulate_grads()
        self._set_gradient_sync()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def step(self) -> StepResult | None:
        """Finish a micro-batch; at an accumulation boundary, update (or skip) and return a result.

        Host syncs: one per boundary (found-inf flag), one more on a skipped step.

        Raises:
            RuntimeError: no ``backward()`` since the last step.
            DivergenceError: ``max_stuck_skips`` consecutive skips at the loss-scale floor.
        """
        self._check_wrapped("mp.step()")
        if not self._step_pending:
            raise RuntimeError("step() called without backward() since the last step; call mp.backward(loss) first")
        self._step_pending = False
        if self.micro_step < self.accumulation_steps:
            return None
        self._adopt_edited_params()
        self._boundary_loss = self._loss_sum / self.accumulation_steps
        grads = self._grads()
        if self.strategy == "fsdp2":
            grads = distributed.local_tensors(grads)  # this rank's shards; checks and norms combined below
        found_inf = self.loss_scale.unscale_(grads)
        grad_norm = _global_norm_fp32(grads, self.device)
        if self.strategy == "fsdp2":  # the norm over every shard: sqrt of the summed squares
            grad_norm = distributed.sum_across_ranks(grad_norm.square()).sqrt()
        if self.max_grad_norm is not None:
            _clip_(grads, grad_norm, self.max_grad_norm)
        if self.strategy is not None:  # every rank takes the same branch (case 28): OR both flags
            flags = torch.stack([found_inf, (~self._loss_finite).to(found_inf.device, torch.float32)])
            found_inf, loss_nonfinite = distributed.any_across_ranks(flags).unbind()
            self._loss_finite = loss_nonfinite == 0
        scale_before = self.loss_scale.scale.detach().clone()
        applied = not bool(found_inf.item())  # the one host sync of the step
        reason = None
        if applied:
            self.optimizer.step()
            self.applied_steps += 1
            if self.scheduler is not None:
                self.scheduler.step()
        loss_finite = True
        if not applied:
            self.skipped_total += 1
            loss_finite = bool(self._loss_finite)  # second sync, on skipped steps only
            reason = "overflow" if (self.loss_scale.enabled and loss_finite) else "nonfinite"
        self._nonfinite_streak = 0 if loss_finite else self._nonfinite_streak + 1
        if not applied:
            self._check_stuck(grads, loss_finite)
        if loss_finite:  # a non-finite *loss* is a data/forward fault: the scale is not to blame (case 1)
            self.loss_scale.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if applied:
            self.masters.copy_to_params()
            # autocast caches 16-bit casts of the fp32 weights for the whole region: drop them, or a
            # forward later in the same `with mp.autocast():` would use the pre-update weights
            torch.clear_autocast_cache()
        self.micro_step = 0
        self.boundaries += 1
        self._set_gradient_sync()
        result = StepResult(applied=applied, skipped_reason=reason, step=self.applied_steps,
                            skipped_total=self.skipped_total, loss_scale_t=scale_before, grad_norm_t=grad_norm)
        if self.guard is not None:
            result = self.guard.after_step(self, result)
            self._step_batches.clear()
        return result

    def _check_stuck(self, grads: list[torch.Tensor], loss_finite: bool) -> None:
        ls = self.loss_scale
        if not loss_finite:
            stuck = self._nonfinite_streak
        else:
            stuck_t = ls.floor_skips if ls.dynamic else ls.consecutive_skips
            stuck = int(stuck_t) + (1 if (not ls.dynamic or bool(ls.at_floor())) else 0)  # counts this skip too
        if stuck < self.max_stuck_skips or self.guard is not None:
            return
        has_nan = any(bool(torch.isnan(g).any()) for g in grads)
        has_inf = any(bool(torch.isinf(g).any()) for g in grads)
        kinds = " and ".join(k for k, v in (("NaN", has_nan), ("inf", has_inf)) if v) or "no non-finite values"
        if not loss_finite:
            raise DivergenceError(
                f"{stuck} consecutive steps with a non-finite loss (after {self.applied_steps} applied steps; "
                f"gradients hold {kinds}; the loss scale was left at {float(ls.scale):g}, since scaling cannot "
                "fix this): the fault is in the data or the forward pass (bad input values, or an activation "
                "beyond the compute format's range, which loss scaling cannot fix). Check the batch and the model (mixprec.locate_nonfinite names the first bad module), or attach mixprec.Guard "
                "to roll back and skip bad batches")
        if ls.enabled:
            where = ("at its floor " + f"{float(ls.scale):g}") if ls.dynamic else f"fixed at {float(ls.scale):g}"
            cause = ("the loss is finite but gradients overflow even at the smallest scale: some layer's gradients "
                     "exceed the format's range; keep it in fp32 (policy keep_fp32=...), lower min_scale, or use bf16")
            head = f"{stuck} consecutive skipped steps with the loss scale {where}"
        else:
            cause = ("the loss is finite but the backward pass produced non-finite gradients (e.g. sqrt or log of "
                     "0, a division by 0, or an op overflowing even fp32/bf16 range): mixprec.locate_nonfinite "
                     "names where the backward first went non-finite")
            head = f"{stuck} consecutive skipped steps without loss scaling"
        raise DivergenceError(f"{head} (after {self.applied_steps} applied steps): gradients hold {kinds}; {cause}")

    # ------------------------------------------------------------------ changing the policy mid-run
    def set_policy(self, policy: str | Policy, *, cause: str = "requested", module: str | None = None) -> dict:
        """Re-prepare the model under ``policy`` between steps, keeping the training state; record it.

        :class:`mixprec.Guard` calls it to escalate precision (keep one module in fp32, or
        fp16 → bf16 → fp32); it can be called directly. What carries over, per parameter:

        * value: its fp32 value (the master where one exists, else the param; under Kahan the
          16-bit param plus its compensation) becomes the param, cast to the new param dtype, and
          the new master (where the new policy has masters) is that fp32 value: moving up to a
          wider format loses nothing, moving down rounds once to nearest;
        * optimizer state: each entry moves, values unchanged, from the tensor the optimizer
          stepped (master or param) to the one it steps now; ``param_groups`` keep their order and
          hyperparameters, so the scheduler is unaffected. A torch optimizer holds fp32 state
          under every policy the engine accepts; a :mod:`mixprec.optim` optimizer gets its moments
          cast to the new ``state_dtype`` and its Kahan compensation folded into the params (it
          restarts at zero where the new policy still uses Kahan);
        * loss scale: kept, state included, when the new policy names the same loss scaling; else
          built from the new policy's ``loss_scale``;
        * counters, scheduler, events: unchanged. keep_fp32 hooks are reinstalled.

        Returns the event appended to :attr:`events`: ``{"step", "kind": "escalate", "cause",
        "module", "detail", "from", "to"}``. No host sync.

        Raises:
            RuntimeError: called between ``backward()`` and the accumulation boundary.
            ValueError: the device cannot run ``policy``, it changes the fp8 linears, its keep_fp32 patterns
                match no module, or the optimizer cannot run it; nothing has changed then.
        """
        if self.micro_step != 0:
            raise RuntimeError(f"set_policy() called after {self.micro_step} backward() call(s) without step(); "
                               "change the policy at an accumulation boundary (after mp.step() returns a result)")
        new = resolve(policy, self.device).policy
        if (new.fp8, new.fp8_format, new.fp8_keep_ends) != (self.policy.fp8, self.policy.fp8_format,
                                                             self.policy.fp8_keep_ends):
            raise ValueError(f"set_policy: {self.policy} → {new} changes the fp8 linears (fp8={new.fp8!r}, fp8_format="
                             f"{new.fp8_format!r}, fp8_ends={'keep' if new.fp8_keep_ends else 'fp8'!r}), which cannot "
                             "be swapped mid-run; keep fp8/fp8_format/fp8_ends as they are, or build a new "
                             "MixedPrecision from a checkpoint")
        if self.strategy == "fsdp2":
            raise ValueError(f"set_policy: under strategy='fsdp2' the MixedPrecisionPolicy of each sharded module "
                             f"is fixed by fully_shard; to run {new}, save a checkpoint and resume under it")
        keep = self._keep_fp32_modules(new)
        params = self.masters.params
        half, frozen = self._storage_plan(new, params, keep,
                                          {id(p) for p in self._frozen_all if not p.requires_grad})
        stored = lambda p: (new.param_dtype if id(p) in half  # noqa: E731
                            else new.compute_dtype if id(p) in frozen else torch.float32)
        if self.strategy == "ddp" and any(stored(p) != p.dtype for p in params if p.is_floating_point()):
            raise ValueError(f"set_policy: {new} stores parameters in other dtypes than {self.policy}, but DDP built "
                             "its gradient buckets for the current ones; save a checkpoint and resume under it")
        old_stepped = list(self.masters.masters)   # per param: the tensor the optimizer steps now
        index = {id(t): i for i, t in enumerate(old_stepped)}
        opt = self.optimizer
        stepped = [t for g in opt.param_groups for t in g["params"]]
        was_frozen = {id(p) for p in self._frozen_all}
        stepped_ids = {id(t) for t in stepped}
        orphans = [n for n, p in self.module.named_parameters()
                   if id(p) in was_frozen and p.requires_grad and id(old_stepped[index[id(p)]]) not in stepped_ids]
        if orphans:
            raise ValueError(f"set_policy: parameter(s) {orphans[:5]} were unfrozen but the optimizer does not hold "
                             "them, so they would never train; add them first (optimizer.add_param_group"
                             "({'params': [...]})) or use mp.unfreeze(pattern), which does both")
        self._check_optimizer(new, {t.dtype if id(t) not in index  # not a model param: left as it is
                                    else new.param_dtype if (id(params[index[id(t)]]) in half and not new.has_masters)
                                    else torch.float32 for t in stepped
                                    if id(t) not in index or id(params[index[id(t)]]) not in frozen})

        mixprec_opt = hasattr(opt, "set_precision")
        with torch.no_grad():
            values_fp32 = []
            for p, t in zip(params, old_stepped):
                value_fp32 = t.detach().to(torch.float32, copy=True)
                comp = opt.state[t].get("kahan_comp") if (t is p and t in opt.state) else None
                if comp is not None:
                    value_fp32 += comp.float()
                values_fp32.append(value_fp32)
        states = [opt.state.pop(t) if t in opt.state else None for t in old_stepped]
        self._remove_hooks()
        with torch.no_grad():
            for p, value_fp32 in zip(params, values_fp32):
                p.data = value_fp32
            masters = MasterWeights(params, half if new.has_masters else set())
            for p in params:
                if id(p) in half or id(p) in frozen:
                    p.data = p.data.to(stored(p))
        for group in opt.param_groups:
            group["params"] = [masters.masters[index[id(t)]] if id(t) in index else t for t in group["params"]]
        for p, t_new, state in zip(params, masters.masters, states):
            if not state or id(p) in frozen:   # a frozen param keeps no optimizer state
                continue
            if mixprec_opt:
                state.pop("kahan_comp", None)
                state = {k: v.to(new.state_dtype) if (k != "step" and torch.is_tensor(v) and v.is_floating_point()
                                                      and v.shape == t_new.shape) else v
                         for k, v in state.items()}
            opt.state[t_new] = state
        if mixprec_opt and not getattr(opt, "precision_explicit", False):
            # set_precision refuses once state exists, because it cannot convert it; the state
            # was converted above, so adopt the new settings with the state set aside
            state_by_param, opt.state = opt.state, defaultdict(dict)
            try:
                opt.set_precision(rounding=new.rounding, state_dtype=new.state_dtype)
            finally:
                opt.state = state_by_param
        old = self.policy
        self.policy = new
        self.masters = masters
        self.masters.record_versions()
        self._frozen = [p for p in params if id(p) in frozen]
        scale_note = "loss scale kept"
        if new.loss_scale != old.loss_scale:
            self.loss_scale = self._make_loss_scale(None)
            scale_note = f"loss scale now {type(self.loss_scale).__name__}"
        self._install_hooks(keep)
        self.model.zero_grad(set_to_none=True)
        self.decision = f"{new} on {self.device} (set_policy at boundary {self.boundaries}: {cause}; was {old})"
        carried = sum(1 for p, st in zip(params, states) if st and id(p) not in frozen)
        event = {"step": self.boundaries, "kind": "escalate", "cause": cause, "module": module,
                 "detail": f"{old} → {new}: params re-cast from their fp32 values (frozen and just-unfrozen ones from "
                           f"their stored values), optimizer state of "
                           f"{carried} tensor(s) carried over, {scale_note}",
                 "from": str(old), "to": str(new)}
        self.events.append(event)
        (log.warning if new != old else log.info)("mixprec: policy %s → %s at boundary %d (%s)", old, new,
                                                   self.boundaries, cause)
        return event

    def unfreeze(self, *patterns: str, **group_options: Any) -> dict:
        """Start training frozen parameters mid-run (gradual unfreezing), at an accumulation boundary.

        Frozen params (``requires_grad=False`` when the engine was built) are stored in the compute
        dtype with no master, gradient or optimizer state. Setting ``requires_grad`` on one by hand makes
        the next :meth:`backward` raise, naming it; this method is the supported route: every frozen
        parameter whose name matches a pattern (``fnmatch``, e.g. ``"bert.encoder.layer.5.*"``) gets
        ``requires_grad=True`` and is re-prepared under the same policy (:meth:`set_policy`): stored as
        the policy stores trainable params, with fp32 masters built **from the stored 16-bit values**
        (the precision dropped when they were frozen does not come back).

        The optimizer: if it already holds them (built on ``model.parameters()``, frozen ones
        included: they cost nothing while frozen), they train in their group; pass no
        ``group_options`` then. Otherwise they are added as one new param group with
        ``group_options`` (e.g. ``lr=1e-5``; the optimizer's defaults otherwise) — refused when a
        scheduler is attached, since schedulers size their per-group state when built (``LambdaLR``
        would crash at its next step). An attached guard takes a fresh snapshot (its older one holds
        the frozen layout). Under ``bf16-kahan`` the compensation buffers are folded into the params.

        Returns the event appended to :attr:`events` (``kind="unfreeze"``). Host syncs: those of a
        guard snapshot, if a guard is attached.

        Raises:
            ValueError: a pattern matches no frozen parameter (the frozen names are listed);
                ``group_options`` for params the optimizer already holds; params it does not hold while
                a scheduler is attached; a strategy (DDP/FSDP2 wrappers are built for the trainable
                params they saw); :meth:`set_policy` refusing the re-preparation (e.g. the optimizer
                cannot run it). Nothing has changed then (a set_policy refusal is undone).
            RuntimeError: called between ``backward()`` and the accumulation boundary.
        """
        if not patterns:
            raise ValueError("unfreeze() needs at least one parameter-name pattern, e.g. mp.unfreeze('encoder.layer.5.*')")
        if self.micro_step != 0:
            raise RuntimeError(f"unfreeze() called after {self.micro_step} backward() call(s) without step(); "
                               "unfreeze at an accumulation boundary (after mp.step() returns a result)")
        if self.strategy is not None:
            raise ValueError(f"unfreeze under strategy={self.strategy!r}: the {self.strategy.upper()} wrapper was built "
                             "for the trainable params it saw (it would not reduce the new ones' gradients); save a "
                             "checkpoint, set requires_grad before building MixedPrecision, and resume")
        frozen_ids = {id(p) for p in self._frozen_all}
        named = [(n, p) for n, p in self.module.named_parameters() if id(p) in frozen_ids and not p.requires_grad]
        chosen = [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
        unmatched = [pat for pat in patterns if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named)]
        if unmatched:
            raise ValueError(f"unfreeze: patterns {unmatched} match no frozen parameter; frozen parameters look "
                             f"like {[n for n, _ in named][:8]}")
        stepped_of = {id(p): t for p, t in zip(self.masters.params, self.masters.masters)}
        held = {id(t) for g in self.optimizer.param_groups for t in g["params"]}
        held_names = [n for n, p in chosen if id(stepped_of.get(id(p), p)) in held]
        new_params = [p for _, p in chosen if id(stepped_of.get(id(p), p)) not in held]
        if held_names and group_options:
            raise ValueError(f"unfreeze(..., {', '.join(f'{k}={v!r}' for k, v in group_options.items())}): the "
                             f"optimizer already holds {held_names[:3]}, so they train with their group's settings; "
                             "drop the options, or build the optimizer on the trainable params only so unfreeze adds "
                             "them as a new group with these options")
        if new_params and self.scheduler is not None:
            new_ids = {id(p) for p in new_params}
            raise ValueError(f"unfreeze: the optimizer does not hold {[n for n, p in chosen if id(p) in new_ids][:3]}, "
                             f"and adding a param group under the attached scheduler {type(self.scheduler).__name__} "
                             "breaks it (its per-group state was sized when it was built). Build the optimizer on "
                             "model.parameters() (frozen params included: they get no state while frozen) before "
                             "MixedPrecision")
        chosen_ids = {id(p) for _, p in chosen}
        frozen_before, groups_before = list(self._frozen_all), len(self.optimizer.param_groups)
        for _, p in chosen:
            p.requires_grad_(True)
        self._frozen_all = [p for p in self._frozen_all if id(p) not in chosen_ids]
        try:
            if new_params:
                self.optimizer.add_param_group({"params": new_params, **group_options})
            event = self.set_policy(self.policy, cause=f"unfreeze {', '.join(patterns)}")
        except (ValueError, TypeError):   # set_policy refused before changing anything: undo ours too
            for _, p in chosen:
                p.requires_grad_(False)
            self._frozen_all = frozen_before
            del self.optimizer.param_groups[groups_before:]
            raise
        event["kind"] = "unfreeze"
        event["detail"] = (f"{len(chosen)} parameter(s) unfrozen ({sum(p.numel() for _, p in chosen)} elements), "
                           f"stored as {_dtype_text(self.policy.param_dtype)}"
                           f"{' with fp32 masters' if self.policy.has_masters else ''}; " + event["detail"])
        if self.guard is not None and hasattr(self.guard, "take_snapshot"):
            self.guard.take_snapshot(self)   # the old snapshot holds the frozen layout: no rollback into it
        return event

    # ------------------------------------------------------------------ views and state
    @property
    def boundary_loss(self) -> torch.Tensor | None:
        """Mean fp32 loss over the micro-batches of the last accumulation boundary (the loss of the
        optimizer step; equals :attr:`last_loss` without accumulation); a device tensor, None before
        the first boundary. Non-finite if any micro-batch loss was. Reading its value syncs."""
        return self._boundary_loss

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The loss of the last ``backward()`` (detached, unscaled, on the device; None before
        the first). Reading its value (``float(mp.last_loss)``) syncs the host with the device."""
        return self._last_loss

    @property
    def step_batches(self) -> tuple:
        """The micro-batches cast by :meth:`cast_inputs` since the last boundary, kept only when
        a guard is attached (else empty)."""
        return tuple(self._step_batches)

    def _refreeze(self, names: list[str]) -> None:
        """Undo an :meth:`unfreeze` of ``names`` that added no param group (a refused load): freeze them
        again and re-prepare, dropping the masters built from their stored values (an exact round trip
        when no step ran in between); the two events are removed."""
        if not names:
            return
        named = dict(self.module.named_parameters())
        events_before = len(self.events)
        for n in names:
            named[n].requires_grad_(False)
            self._frozen_all.append(named[n])
        self.set_policy(self.policy, cause="refreeze after a refused load")
        del self.events[events_before:]
        if self.events and self.events[-1].get("kind") == "unfreeze":
            self.events.pop()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable parameters only, by name, as fp32 CPU copies of their best values: the fp32
        master where one exists, under Kahan rounding the param plus its compensation, else the param
        upcast. For a LoRA or partly frozen run this is the small file to keep (the frozen base comes
        from the pretrained weights): ``model.load_state_dict(state, strict=False)`` restores it.
        Device→host copies: syncs. Does not change the engine."""
        master_of = {id(p): m for p, m in self.masters.pairs}
        state = {}
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    continue
                if id(p) in master_of:
                    value = master_of[id(p)].detach().float()
                else:
                    comp = self.optimizer.state[p].get("kahan_comp") if p in self.optimizer.state else None
                    value = p.detach().float() + comp.float() if comp is not None else p.detach().float()
                state[name] = value.to("cpu", copy=True).contiguous()
        return state

    def frozen_names(self) -> list[str]:
        """Names of the frozen parameters (``requires_grad=False`` when the engine was built and not
        unfrozen since; no master, grad or optimizer state, whatever their storage), in model order."""
        frozen = {id(p) for p in self._frozen_all if not p.requires_grad}
        return [n for n, p in self.module.named_parameters() if id(p) in frozen]

    def check_frozen_values(self, values: dict[str, torch.Tensor]) -> None:
        """Raise ValueError if a value about to be loaded into a frozen param stored in fp16 does not fit
        fp16 (the storage was chosen from the values at build; loading must not turn them into inf or
        zeros). ``values``: parameter name → incoming tensor (others are ignored). One sync per checked
        tensor; nothing to check unless the compute dtype is fp16."""
        stored = {id(p) for p in self._frozen if p.dtype == torch.float16}
        if not stored:
            return
        names = {n: p for n, p in self.module.named_parameters() if id(p) in stored}
        unfit = [n for n, v in values.items() if n in names and not self._fits(v.float(), torch.float16)]
        if unfit:
            raise ValueError(f"values for frozen parameter(s) {unfit[:3]} do not fit fp16, where this engine stores "
                             "them (chosen from the values it was built with); load these weights into the model "
                             "before building MixedPrecision (they then stay fp32), or use a bf16 policy")

    def match_frozen(self, saved: list[str], *, check_only: bool = False) -> None:
        """Make this engine's frozen set equal ``saved`` (a run's :meth:`frozen_names`) before its state is
        loaded: parameters that run had unfrozen (:meth:`unfreeze`) are unfrozen here too, so a resume
        neither re-freezes them silently nor mismatches the optimizer's groups. Called by
        :meth:`load_state_dict` and :func:`mixprec.load_checkpoint`.

        Raises:
            ValueError: ``saved`` keeps frozen a parameter this engine trains (freeze it with
                ``requires_grad_(False)`` before building the engine), names an unknown one, or unfroze
                one into a param group this optimizer lacks. ``check_only``: raise, change nothing.
        """
        current = self.frozen_names()
        known = {n for n, _ in self.module.named_parameters()}
        unknown = [n for n in saved if n not in known]
        to_freeze = [n for n in saved if n not in current and n in known]
        if unknown or to_freeze:
            what = (f"unknown parameter(s) {unknown[:3]}" if unknown else
                    f"{to_freeze[:3]} frozen, which this engine trains; call requires_grad_(False) on them before "
                    "building MixedPrecision")
            raise ValueError(f"the saved run kept {what}")
        to_unfreeze = [n for n in current if n not in set(saved)]
        if not to_unfreeze:
            return
        named = dict(self.module.named_parameters())
        stepped_of = {id(p): t for p, t in zip(self.masters.params, self.masters.masters)}
        held = {id(t) for g in self.optimizer.param_groups for t in g["params"]}
        missing = [n for n in to_unfreeze if id(stepped_of.get(id(named[n]), named[n])) not in held]
        if missing:
            raise ValueError(f"the saved run unfroze {missing[:3]} into a param group this optimizer lacks; call "
                             f"mp.unfreeze(...) with the run's group options (e.g. lr=) before loading, as the run did, "
                             "or build the optimizer on model.parameters() (frozen params included)")
        if check_only:
            return
        self.unfreeze(*(re.sub(r"([\[\]*?])", r"[\1]", n) for n in to_unfreeze))

    def master_parameters(self) -> Iterator[torch.Tensor]:
        """fp32 masters in ``model.parameters()`` order (the params themselves where no master exists)."""
        yield from self.masters.masters

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: policy text, model params, masters, optimizer,
        scheduler, loss-scale state (every field) and counters. Tensors are references, not copies.

        Raises:
            RuntimeError: called between ``backward()`` and the accumulation boundary (the
                accumulated gradients are not part of the state).
        """
        if self.micro_step != 0:
            raise RuntimeError(f"state_dict() called after {self.micro_step} backward() call(s) without step(); "
                               "take it at an accumulation boundary (after mp.step() returns a result)")
        self._adopt_edited_params()
        return {
            "policy": str(self.policy),
            "frozen": self.frozen_names(),
            "model": self.module.state_dict(),
            "masters": [m.detach() for _, m in self.masters.pairs],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
            "counters": {"micro_step": self.micro_step, "applied_steps": self.applied_steps,
                         "skipped_total": self.skipped_total, "boundaries": self.boundaries},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same policy; continuing equals an uninterrupted run.

        Raises:
            ValueError: the state was saved under another policy (convert with
                :func:`mixprec.load_checkpoint`), or its master count differs; its frozen set cannot be
                matched (:meth:`match_frozen`); its frozen values do not fit an fp16 storage
                (:meth:`check_frozen_values`). The frozen-set and value checks run before anything changes.
        """
        if state["policy"] != str(self.policy):
            raise ValueError(f"state was saved under policy {state['policy']!r}, this engine runs {self.policy}; "
                             "load it through mixprec.load_checkpoint(..., convert=True) to convert")
        if state.get("frozen") is not None:
            self.match_frozen(state["frozen"], check_only=True)
        self.check_frozen_values(dict(state["model"]))
        if state.get("frozen") is not None:
            self.match_frozen(state["frozen"])
        if len(state["masters"]) != len(self.masters.pairs):
            raise ValueError(f"state holds {len(state['masters'])} master tensors, this model needs "
                             f"{len(self.masters.pairs)}")
        # gradients of an unfinished accumulation belong to the run being replaced: drop them
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        self._step_pending = False
        self.module.load_state_dict(state["model"])
        with torch.no_grad():
            for (_, m), saved in zip(self.masters.pairs, state["masters"]):
                m.copy_(saved)
        self.masters.record_versions()
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.loss_scale.load_state_dict(state["loss_scale"])
        counters = state["counters"]
        self.micro_step = counters["micro_step"]
        self.applied_steps = counters["applied_steps"]
        self.skipped_total = counters["skipped_total"]
        self.boundaries = counters["boundaries"]
        self._set_gradient_sync()


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _global_norm_fp32(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Global L2 norm of ``grads`` as an fp32 device tensor (torch's clip_grad_norm_ op order)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms: list[torch.Tensor] = []
    fp32 = [g for g in grads if g.dtype == torch.float32]
    if fp32:
        norms.extend(torch._foreach_norm(fp32, 2.0))
    norms.extend(torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads if g.dtype != torch.float32)
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), 2.0)


def _clip_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (as torch's clip_grad_norm_)."""
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, clip_coef.to(device=group[0].device, dtype=dtype))
