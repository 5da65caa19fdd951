"""``inspect``: a few real fp32 training steps with hooks, measuring how each layer would fare in
each candidate format.

What runs: a deep copy of the model (and of the optimizer, when one is given) trains for
``steps`` batches in fp32 with autocast off; the user's model, its hooks and its optimizer are
never touched. Hooks on the copy's leaf modules record every forward output and, through a
tensor hook on that output, its gradient; after each backward the parameters' gradients and
values are recorded, and the optimizer step's fp32 delta gives the lost updates. All hooks are
removed before ``inspect`` returns, whatever happens.

How a tensor is measured (conventions in :mod:`mixprec.numerics.report`): its magnitudes are
compared with every format's limits at every scale of interest in one pass (``torch.bucketize``
against the sorted thresholds ``{fmt.max, fmt.smallest_normal, fmt.smallest_subnormal / 2} /
scale``), so gradient statistics are exact at every power-of-two loss scale from the dynamic loss
scale's ``min_scale`` to its ``max_scale``; fp8 formats are also measured at the best per-tensor
scale ``fmt.max / amax``.

How a module is run "in a format" (the error measurement, on the last step, inside the module's
forward hook, on the exact inputs it just received): its floating inputs and parameters are
rounded to the format, the module's ``forward`` runs in fp32 math (the fp32 accumulation of
GPU 16-bit matmuls; no slow fp16 kernels on CPUs) and its floating outputs are rounded to the
format. fp8: floating inputs and matrix parameters (``dim >= 2``) are quantised and dequantised
at their best per-tensor scale with a saturating cast, vectors (biases, norm gains) and the
output stay fp32, as in tensorwise fp8 training recipes. Intermediate values inside one leaf
module are not rounded. Buffers (BatchNorm statistics) are swapped for copies and the RNG
state of the original call is replayed (dropout draws the same mask), so the re-run changes
nothing and compares like with like.

Block formats (``"nvfp4"``, ``"mxfp8"``, ...): every ``nn.Linear``'s input, weight and output gradient are quantized
as the recipe's three GEMMs read them, on every step (:mod:`mixprec.numerics.block_measure`; what is counted:
:mod:`mixprec.numerics.block_stats`).

Host syncs: one per step (is the reference loss finite, and are its gradients?) and the
reading of all statistics after the last step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.formats import BLOCK_FORMATS, FORMATS, BlockFormat, Format, get_block_format, get_format
from mixprec.engine.loss_scale import DynamicConfig
from mixprec.numerics.advice import LOSS_SCALE_MARGIN, check_policy_formats, safe_loss_scale
from mixprec.numerics.block_measure import BlockRecorder
from mixprec.numerics.counts import _HostCounts
from mixprec.numerics.localise import locate_nonfinite
from mixprec.numerics.recorder import _map_floating, _Recorder
from mixprec.numerics.report import NumericsReport
from mixprec.numerics.stats import ModuleError, ModuleStats, ParamStats, RangeStats
from mixprec.policy.policy import Policy

__all__ = ["inspect", "DEFAULT_FORMATS", "DEFAULT_LR"]

DEFAULT_FORMATS = ("fp16", "bf16", "e4m3", "e5m2")
DEFAULT_LR = 1e-3  # AdamW when no optimizer is given (the built-in workloads' peak lr)



# ---------------------------------------------------------------------- inspect
def _policy_loss_scale(policy: Policy) -> float:
    if policy.loss_scale == "dynamic":
        return float(DynamicConfig().init_scale)
    if policy.loss_scale == "none":
        return 1.0
    return float(policy.loss_scale)


def _reference_copy(model: nn.Module, optimizer: Any, lr: float | None
                    ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A deep copy of the model and an optimizer on it (the user's objects stay untouched)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        ref_model, ref_opt = copy.deepcopy((model, optimizer))  # one memo: the copy's params are its params
    elif optimizer is None or callable(optimizer):
        ref_model = copy.deepcopy(model)
        ref_opt = (torch.optim.AdamW(ref_model.parameters(), lr=DEFAULT_LR if lr is None else lr)
                   if optimizer is None else optimizer(ref_model))
        if not isinstance(ref_opt, torch.optim.Optimizer):
            raise TypeError(f"inspect optimizer factory returned {type(ref_opt).__name__}, not a "
                            "torch.optim.Optimizer; pass e.g. optimizer=workload.make_optimizer")
    else:
        raise TypeError(f"inspect optimizer={optimizer!r} must be None (AdamW), a torch.optim.Optimizer over the "
                        "model's parameters, or a callable model -> Optimizer")
    if lr is not None:
        for group in ref_opt.param_groups:
            group["lr"] = lr
    return ref_model, ref_opt


def _check_args(model: nn.Module, steps: int, lr: float | None) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"inspect model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"inspect steps={steps!r} must be an int >= 1, e.g. steps=4")
    if lr is not None and not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
        raise ValueError(f"inspect lr={lr!r} must be a finite number > 0, or None")
    wrong = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if wrong:
        raise ValueError(f"inspect needs an fp32 model (the reference); parameters {wrong[:3]} are not fp32. "
                         "Inspect the model before MixedPrecision casts it, or pass a fp32 copy")


_SPELLED = {"e4m3fn": "e4m3", "mxfp8_e4m3": "mxfp8", "mxfp4_e2m1": "mxfp4"}   # as DEFAULT_FORMATS and --help write them


def _spelled(names: Iterable[str]) -> list[str]:
    """Format names as ``mixprec inspect --help`` writes them (``e4m3``, ``mxfp8``, ``mxfp4``; the long names are
    accepted too), sorted."""
    return sorted(_SPELLED.get(n, n) for n in names)


def _resolve_formats(formats: Iterable[str | Format | BlockFormat],
                     policy: Policy) -> tuple[list[Format], list[BlockFormat]]:
    """The elementwise and the block formats named in ``formats`` (each once, in order), checked to hold what
    ``policy`` computes in (:func:`~mixprec.numerics.advice.check_policy_formats`: before any training step)."""
    if isinstance(formats, (str, Format, BlockFormat)):
        formats = (formats,)
    elementwise: list[Format] = []
    block: list[BlockFormat] = []
    for spec in formats:
        if isinstance(spec, BlockFormat):
            block.append(spec)
            continue
        try:
            elementwise.append(get_format(spec))
        except ValueError:
            try:
                block.append(get_block_format(spec))
            except (TypeError, ValueError):
                raise ValueError(f"inspect formats: {spec!r} is neither a format ({_spelled(FORMATS)}) nor a block "
                                 f"format ({_spelled(BLOCK_FORMATS)})") from None
    if not elementwise and not block:
        raise ValueError(f"inspect formats={formats!r} is empty; e.g. formats={DEFAULT_FORMATS}")
    elementwise, block = list(dict.fromkeys(elementwise)), list(dict.fromkeys(block))
    check_policy_formats(policy, [f.name for f in elementwise] + [b.name for b in block])
    return elementwise, block


def _loss_of(loss_fn: Callable, model: nn.Module, batch: Any) -> torch.Tensor:
    loss = loss_fn(model, batch)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()
            and loss.requires_grad):
        raise ValueError(f"inspect loss_fn(model, batch) must return a scalar floating tensor that requires grad, "
                         f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    return loss


def inspect(model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
            policy: str | Policy = "fp32", formats: Iterable[str | Format | BlockFormat] = DEFAULT_FORMATS,
            steps: int = 4, lr: float | None = None, optimizer: Any = None,
            device: str | torch.device | None = None) -> NumericsReport:
    """Train a copy of ``model`` for ``steps`` fp32 steps and measure its numerics in ``formats``.

    Args:
        model: an fp32 ``nn.Module``; it is deep-copied and left untouched (no hook, no step). Hooks it
            already has are copied with it (they can be part of what it computes).
        batches: iterable of batches; the first ``steps`` are used. Floating and integer tensors in
            dicts/lists/tuples are moved to ``device``.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        policy: the policy under study (text or :class:`~mixprec.Policy`): it sets the loss scale
            gradients are also judged at, and the advice starts from it (``"fp32"``: no preference).
        formats: formats to measure (names or :class:`~mixprec.Format`; ``"e4m3"`` is reported as
            ``"e4m3fn"``), and block formats (names such as ``"nvfp4"``, ``"mxfp8"``, or
            :class:`~mixprec.formats.BlockFormat`): every ``nn.Linear`` measured in them under the recipe of
            :func:`mixprec.numerics.block_measure.recipe_for_format` (the report's ``block``).
        steps: training steps (the error measurement runs on the last one). lr: learning rate of every parameter
            group (``None``: the optimizer's own, or 1e-3).
        optimizer: ``None`` (``torch.optim.AdamW``), an optimizer over ``model``'s parameters (copied
            with the model, state included), or a factory ``model -> Optimizer`` such as
            ``workload.make_optimizer``.
        device: where the copy trains (``None``: the model's device).

    Returns:
        A :class:`~mixprec.numerics.NumericsReport`. The learning rate is held constant (no
        scheduler): lost updates are measured at the given, peak, rate.

    Raises:
        ValueError / TypeError: bad arguments (``formats`` without ``policy``'s compute format, checked before any
            step: e.g. ``bf16`` for ``nvfp4-mixed``); fewer than ``steps`` batches; a non-fp32 model; or
            a reference step that went non-finite in fp32 (the message names where, via
            :func:`mixprec.numerics.locate_nonfinite`).
    """
    _check_args(model, steps, lr)
    policy = Policy.parse(policy)
    fmts, block_fmts = _resolve_formats(formats, policy)
    first = next(model.parameters(), None)
    device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
    ref_model, opt = _reference_copy(model, optimizer, lr)
    ref_model.to(device).train()
    cfg = DynamicConfig()
    ladder = [2.0 ** k for k in range(math.ceil(math.log2(cfg.min_scale)), math.floor(math.log2(cfg.max_scale)) + 1)]
    policy_scale = _policy_loss_scale(policy)
    recorder = _Recorder(ref_model, fmts, sorted({1.0, policy_scale, *ladder}))
    blocks = BlockRecorder(ref_model, block_fmts, policy)
    losses = _train(recorder, blocks, ref_model, opt, batches, loss_fn, steps, device)
    report = _build_report(recorder, policy, fmts, steps, opt, losses, policy_scale, cfg)
    return dataclasses.replace(report, block=blocks.to_stats())


def _train(recorder: _Recorder, blocks: BlockRecorder, model: nn.Module, opt: torch.optim.Optimizer,
           batches: Iterable[Any], loss_fn: Callable, steps: int, device: torch.device) -> list[torch.Tensor]:
    """The ``steps`` fp32 reference steps with ``recorder``'s and ``blocks``' hooks installed (removed whatever
    happens); the losses as 0-d device tensors. One host sync per step (:func:`_check_finite`)."""
    losses: list[torch.Tensor] = []
    iterator = iter(batches)
    handles = recorder.install() + blocks.install()
    try:
        with torch.autocast(device.type, enabled=False):
            for step in range(steps):
                try:
                    batch = _map_floating(next(iterator), lambda t: t.to(device), floating_only=False)
                except StopIteration:
                    raise ValueError(f"inspect steps={steps} but batches ran out after {step}; pass more batches "
                                     "or fewer steps") from None
                recorder.measure_error = step == steps - 1
                opt.zero_grad(set_to_none=True)
                loss = _loss_of(loss_fn, model, batch)
                loss.backward()
                w_fp32, grad_fp32 = recorder.flat_params(), recorder.flat_grads()
                _check_finite(model, loss, grad_fp32, batch, loss_fn, step, handles)
                recorder.record_params(w_fp32, grad_fp32)
                opt.step()
                recorder.record_updates(w_fp32, grad_fp32)
                losses.append(loss.detach())
    finally:
        for handle in handles:
            handle.remove()
    return losses


def _check_finite(model: nn.Module, loss: torch.Tensor, grad_fp32: torch.Tensor, batch: Any, loss_fn: Callable,
                  step: int, handles: list[Any]) -> None:
    """One host sync: raise when the fp32 reference loss or a gradient (flat) is non-finite."""
    if bool(torch.isfinite(loss).all() & torch.isfinite(grad_fp32).all()):
        return
    for handle in handles:  # the diagnosis re-runs the batch without our hooks
        handle.remove()
    model.zero_grad(set_to_none=True)
    where = locate_nonfinite(model, batch, loss_fn, "fp32")
    raise ValueError(f"inspect: the fp32 reference went non-finite at step {step}: "
                     f"{where if where is not None else 'not reproduced on a re-run'}. Inspection measures "
                     "precision risk on a healthy fp32 run; fix the model or data first")


def _build_report(rec: _Recorder, policy: Policy, fmts: list[Format], steps: int, opt: torch.optim.Optimizer,
                  losses: list[torch.Tensor], policy_scale: float, cfg: DynamicConfig) -> NumericsReport:
    """Read every counter (the host syncs after the last step) into plain data."""
    acts = {n: c.to_host()[0] for n, c in rec.acts.items() if c.calls}
    gouts = {n: rec.grad_outs[n].to_host()[0] for n in acts}
    weights = dict(zip(rec.params, rec.weights.to_host()))
    pgrads = dict(zip(rec.params, rec.param_grads.to_host()))
    grad_amax = max([g.amax for g in [*gouts.values(), *pgrads.values()]], default=0.0)
    safe = safe_loss_scale(grad_amax, "fp16", LOSS_SCALE_MARGIN)
    recommended = min(max(safe, cfg.min_scale), cfg.max_scale)
    scales = tuple(sorted({1.0, policy_scale, float(cfg.init_scale), recommended}))
    lr = opt.param_groups[0].get("lr") if opt.param_groups else None
    return NumericsReport(
        formats=tuple(f.name for f in fmts),
        storage_formats=tuple(f.name for f in rec.storage),
        policy=policy, steps=steps, optimizer=type(opt).__name__,
        lr=None if lr is None else float(lr),
        losses=tuple(torch.stack(losses).tolist()) if losses else (),
        loss_scales=scales, policy_loss_scale=policy_scale, grad_amax=grad_amax,
        loss_scale_margin=LOSS_SCALE_MARGIN, max_safe_loss_scale=safe, recommended_loss_scale=recommended,
        module_names=rec.module_names,
        modules=_module_stats(rec, acts, gouts, fmts, scales),
        params=_param_stats(rec, weights, pgrads, fmts, scales),
    )


def _at_scales(h: _HostCounts, fmts: list[Format], scales: tuple[float, ...]) -> dict[str, tuple[RangeStats, ...]]:
    return {f.name: tuple(h.at(f, s) for s in scales) for f in fmts}


def _module_error(signal_t: Any, noise_t: Any) -> ModuleError:
    """SQNR (dB) and relative error from the summed squared norms (fp64 device tensors; a host read each)."""
    signal, noise = float(signal_t), float(noise_t)
    noise = math.inf if math.isnan(noise) else noise  # NaN output: as bad as an inf one
    sqnr = math.inf if noise == 0 else (-math.inf if signal == 0 or math.isinf(noise)
                                        else 10 * math.log10(signal / noise))
    rel = 0.0 if noise == 0 else (math.inf if signal == 0 else math.sqrt(noise / signal))
    return ModuleError(sqnr, rel)


def _module_stats(rec: _Recorder, acts: dict[str, _HostCounts], gouts: dict[str, _HostCounts], fmts: list[Format],
                  scales: tuple[float, ...]) -> dict[str, ModuleStats]:
    """Each measured leaf module's statistics (``acts``: the ones called at least once)."""
    fp8 = [f for f in fmts if f.bits == 8]
    names = {id(p): n for n, p in rec.params.items()}
    modules = {}
    for name, h in acts.items():
        module = rec.leaves[name]
        modules[name] = ModuleStats(
            name=name, kind=type(module).__name__, calls=h.calls, numel=h.numel,
            activation={f.name: h.at(f, 1.0) for f in fmts},
            activation_scaled={f.name: h.best(f) for f in fp8},
            grad_output=_at_scales(gouts[name], fmts, scales),
            grad_output_scaled={f.name: gouts[name].best(f) for f in fp8},
            error={fmt_name: _module_error(signal_t, noise_t)
                   for fmt_name, (signal_t, noise_t) in rec.errors[name].items()},
            params=tuple(names[id(p)] for p in module.parameters(recurse=False) if id(p) in names
                         and names[id(p)].rpartition(".")[0] == name),
        )
    return modules


def _param_stats(rec: _Recorder, weights: dict[str, _HostCounts], pgrads: dict[str, _HostCounts],
                 fmts: list[Format], scales: tuple[float, ...]) -> dict[str, ParamStats]:
    """Each trainable parameter's statistics, lost updates included (a host read of the counts)."""
    fp8 = [f for f in fmts if f.bits == 8]
    lost = {f: dict(zip(rec.params, v.tolist())) for f, v in rec.lost.items()}
    updated = dict(zip(rec.params, rec.updated.tolist()))
    params = {}
    for name, p in rec.params.items():
        params[name] = ParamStats(
            name=name, module=name.rpartition(".")[0], shape=tuple(p.shape),
            weight={f.name: weights[name].at(f, 1.0) for f in fmts},
            weight_scaled={f.name: weights[name].best(f) for f in fp8},
            grad=_at_scales(pgrads[name], fmts, scales),
            grad_scaled={f.name: pgrads[name].best(f) for f in fp8},
            lost={f: int(v[name]) for f, v in lost.items()},
            updated=int(updated[name]),
        )
    return params
