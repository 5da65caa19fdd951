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

Host syncs: one per step (is the reference loss finite, and are its gradients?) and the
reading of all statistics after the last step.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mixprec.formats import Format, get_format
from mixprec.engine.loss_scale import DynamicConfig
from mixprec.numerics.advice import LOSS_SCALE_MARGIN, safe_loss_scale
from mixprec.numerics.localise import locate_nonfinite
from mixprec.numerics.report import NumericsReport
from mixprec.numerics.stats import ModuleError, ModuleStats, ParamStats, RangeStats
from mixprec.policy.policy import Policy
from mixprec.policy.tree import map_tensors, tensors

__all__ = ["inspect", "DEFAULT_FORMATS", "DEFAULT_LR"]

DEFAULT_FORMATS = ("fp16", "bf16", "e4m3", "e5m2")
DEFAULT_LR = 1e-3  # AdamW when no optimizer is given (the built-in workloads' peak lr)
_LIMITS = ("max", "normal", "flush")


# ---------------------------------------------------------------------- pure pieces
def _limit(fmt: Format, kind: str) -> float:
    return {"max": fmt.max, "normal": fmt.smallest_normal, "flush": fmt.smallest_subnormal / 2}[kind]


def round_to_format(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``x`` rounded to nearest in a 16/32-bit ``fmt`` and returned in ``x``'s dtype (a new tensor;
    values above the format's range become inf, as a real cast makes them)."""
    return x.to(fmt.dtype).to(x.dtype) if x.dtype != fmt.dtype else x.clone()


def fake_quantise_fp8(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Quantise ``x`` to the fp8 ``fmt`` at its best per-tensor scale and dequantise (fp32 result).

    ``amax = max|x|`` → ``scale = fmt.max / amax`` (fp32, multiply to reach fp8) → saturating
    cast ``clamp(x * scale, -max, max).to(fp8)`` → ``/ scale``. An all-zero or non-finite ``x``
    is returned unchanged (as fp32). No host sync.
    """
    x_fp32 = x.float()
    amax = x_fp32.abs().amax()
    usable = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(usable, fmt.max / torch.where(usable, amax, 1.0), 1.0)
    x_fp8 = (x_fp32 * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return torch.where(usable, x_fp8.float() / scale, x_fp32)


def _floating(tree: Any) -> list[torch.Tensor]:
    return [t for t in tensors(tree) if t.is_floating_point()]


def _map_floating(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor], *, floating_only: bool = True) -> Any:
    """``fn`` applied to the (floating) tensors of ``tree`` (containers as :mod:`mixprec.policy.tree`)."""
    return map_tensors(tree, lambda t: fn(t) if t.is_floating_point() or not floating_only else t)


class _Thresholds:
    """Sorted unique fp32 thresholds ``t`` such that ``count(|x| < t)`` gives every count we need.

    For each (format, scale): ``smallest_normal / scale`` (subnormal), ``smallest_subnormal / 2 /
    scale`` (flushed) and ``nextafter(max / scale, inf)`` (so ``count(|x| < t) = count(|x| <= max /
    scale)`` and overflow is the rest); plus the smallest positive fp32 (so zeros are counted).
    Limits below fp32's range become 0 (a count of 0, which is exact: no fp32 value is below them).
    """

    def __init__(self, formats: list[Format], scales: list[float]) -> None:
        keys = [(f.name, kind, s) for f in formats for kind in _LIMITS for s in scales] + [("", "zero", 1.0)]
        raw = torch.tensor([_limit(get_format(f), kind) / s if kind != "zero" else 0.0 for f, kind, s in keys],
                           dtype=torch.float32)
        is_max = torch.tensor([kind in ("max", "zero") for _, kind, _ in keys])
        raw = torch.where(is_max, torch.nextafter(raw, torch.tensor(math.inf)), raw)
        self.values = torch.unique(raw)  # sorted ascending
        self.index = dict(zip(keys, torch.searchsorted(self.values, raw).tolist()))
        # fp8 at the best per-tensor scale: limits relative to amax, compared with |x| / amax
        fp8 = [f for f in formats if f.bits == 8]
        keys8 = [(f.name, kind) for f in fp8 for kind in ("normal", "flush")]
        raw8 = torch.tensor([_limit(get_format(f), kind) / get_format(f).max for f, kind in keys8],
                            dtype=torch.float32)
        self.values8 = torch.unique(raw8)
        self.index8 = dict(zip(keys8, torch.searchsorted(self.values8, raw8).tolist()))
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self.values.to(device), self.values8.to(device))
        return self._on[device]


def _histogram(x: torch.Tensor, thresholds: torch.Tensor, weights: torch.Tensor, key_offset: torch.Tensor | None,
               segments: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment and sorted threshold ``t_j``: the count of ``x < t_j`` (int64) and the sum of
    ``weights`` over those elements, both ``(segments, len(thresholds))``, and each segment's total
    weight ``(segments,)``. Element ``i`` falls in segment ``key_offset[i] // (len(thresholds) + 1)``.

    One bucketize over ``x``; the histograms are ``scatter_add_`` into a few bins (no ``bincount``:
    its parallel passes are costly on a busy CPU). No host sync.
    """
    bins = len(thresholds) + 1
    idx = torch.bucketize(x, thresholds, right=True)  # number of thresholds <= x (NaN sorts above all)
    key = idx if key_offset is None else idx + key_offset
    ones = torch.ones((), dtype=torch.int64, device=x.device).expand(key.shape)
    count = torch.zeros(segments * bins, dtype=torch.int64, device=x.device).scatter_add_(0, key, ones)
    total = torch.zeros(segments * bins, dtype=weights.dtype, device=x.device).scatter_add_(0, key, weights)
    count, total = count.reshape(segments, bins), total.reshape(segments, bins)
    return count.cumsum(1)[:, :-1], total.cumsum(1)[:, :-1], total.sum(1)


class _RangeCounter:
    """Counts for one tensor role (``segments`` tensors at once, e.g. every parameter), summed over
    calls and steps; device tensors, no host sync.

    ``below[s, j]`` counts elements of segment ``s`` with ``|x| < thresholds.values[j]`` (a
    non-finite element sorts above every threshold: it counts as an overflow) and ``below_sq``
    sums their squares; ``sq`` is each segment's total sum of squares (fp64). ``scaled`` /
    ``scaled_sq`` do the same at each call's best fp8 scale ``fmt.max / amax``, compared as
    ``|x| < (limit / fmt.max) * amax``; no element overflows at that scale (``|x| <= amax``).
    Squares are taken of ``|x| / amax`` in fp32 (no overflow) and rescaled by ``amax**2`` in fp64.
    Each call costs a handful of passes over ``x`` (abs, amax, scale, square, bucketize).
    """

    def __init__(self, thresholds: _Thresholds, fp8: list[Format], segments: int = 1) -> None:
        self.thresholds = thresholds
        self.fp8 = fp8
        self.segments = segments
        self.numel = [0] * segments
        self.calls = 0
        self.amax: torch.Tensor | None = None  # (S,)
        self.below: torch.Tensor | None = None  # (S, K)
        self.below_sq: torch.Tensor | None = None
        self.sq: torch.Tensor | None = None  # (S,)
        self.scaled: torch.Tensor | None = None  # (S, K8)
        self.scaled_sq: torch.Tensor | None = None
        self._offsets: tuple[torch.Tensor, torch.Tensor] | None = None  # seg * bins, for both histograms

    def add(self, x: torch.Tensor, seg: torch.Tensor | None = None, numels: list[int] | None = None) -> None:
        """Count ``x`` (flattened); with ``seg``, element ``i`` belongs to segment ``seg[i]`` and
        ``numels`` gives each segment's size."""
        x_abs = x.detach().float().abs().flatten()
        static, static8 = self.thresholds.on(x_abs.device)
        k = len(static)
        if seg is None:
            amax = x_abs.amax().reshape(1) if x_abs.numel() else torch.zeros(1, device=x_abs.device)
            amax_safe = torch.where(amax > 0, amax, 1.0)  # an all-zero x: its zeros still count as zeros
            y = x_abs * amax_safe.reciprocal()  # |x| / amax in [0, 1]
            # the fp8 limits scale with this call's amax: merge them into the one sorted threshold list
            merged, order = torch.sort(torch.cat([static, static8 * amax_safe]))
            count, energy, sq = _histogram(x_abs, merged, y.square(), None, 1)
            count = torch.empty_like(count).scatter_(1, order[None], count)
            energy = torch.empty_like(energy).scatter_(1, order[None], energy)
            below, below_sq, scaled, scaled_sq = count[:, :k], energy[:, :k], count[:, k:], energy[:, k:]
        else:
            if self._offsets is None:
                self._offsets = (seg * (k + 1), seg * (len(static8) + 1))
            amax = torch.zeros(self.segments, device=x_abs.device).scatter_reduce_(0, seg, x_abs, "amax")
            y = x_abs * torch.where(amax > 0, amax, 1.0).reciprocal()[seg]
            y_sq = y.square()
            below, below_sq, sq = _histogram(x_abs, static, y_sq, self._offsets[0], self.segments)
            scaled, scaled_sq, _ = _histogram(y, static8, y_sq, self._offsets[1], self.segments)
        amax_sq = amax.double().square()  # (S,)
        below_sq, scaled_sq = below_sq.double() * amax_sq[:, None], scaled_sq.double() * amax_sq[:, None]
        sq = sq.double() * amax_sq
        if self.below is None:
            self.amax, self.below, self.below_sq, self.sq, self.scaled, self.scaled_sq = (
                amax, below, below_sq, sq, scaled, scaled_sq)
        else:
            self.amax = torch.maximum(self.amax, amax)
            self.below += below
            self.below_sq += below_sq
            self.sq += sq
            self.scaled += scaled
            self.scaled_sq += scaled_sq
        for s, n in enumerate(numels if numels is not None else [x_abs.numel()]):
            self.numel[s] += n
        self.calls += 1

    def to_host(self) -> list["_HostCounts"]:
        """Read the counts as Python numbers, one set per segment (a host sync)."""
        if self.below is None:
            return [_HostCounts(self.thresholds, self.fp8, 0, 0, 0.0, [], [], 0.0, [], [])] * self.segments
        amax, below, below_sq, sq = self.amax.tolist(), self.below.tolist(), self.below_sq.tolist(), self.sq.tolist()
        scaled, scaled_sq = self.scaled.tolist(), self.scaled_sq.tolist()
        return [_HostCounts(self.thresholds, self.fp8, self.numel[s], self.calls, amax[s], below[s], below_sq[s],
                            sq[s], scaled[s], scaled_sq[s]) for s in range(self.segments)]


class _HostCounts:
    """One segment's counts as Python numbers, and the :class:`RangeStats` they give."""

    def __init__(self, thresholds: _Thresholds, fp8: list[Format], numel: int, calls: int, amax: float,
                 below: list[int], below_sq: list[float], sq: float, scaled: list[int], scaled_sq: list[float]) -> None:
        self.t, self.fp8 = thresholds, fp8
        self.numel, self.calls, self.amax, self.sq = numel, calls, amax, sq
        self.below, self.below_sq, self.scaled, self.scaled_sq = below, below_sq, scaled, scaled_sq
        self.zeros = below[thresholds.index[("", "zero", 1.0)]] if below else 0

    def _fractions(self, count: int, energy: float) -> tuple[float, float]:
        nonzero = self.numel - self.zeros
        return ((count - self.zeros) / nonzero if nonzero else 0.0), (energy / self.sq if self.sq > 0 else 0.0)

    def at(self, fmt: Format, scale: float) -> RangeStats:
        if not self.numel:
            return RangeStats(scale, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        over = self.numel - self.below[self.t.index[(fmt.name, "max", scale)]]
        i, j = self.t.index[(fmt.name, "normal", scale)], self.t.index[(fmt.name, "flush", scale)]
        sub, sub_energy = self._fractions(self.below[i], self.below_sq[i])
        flushed, flushed_energy = self._fractions(self.below[j], self.below_sq[j])
        return RangeStats(scale, self.amax, over / self.numel, sub, flushed, sub_energy, flushed_energy)

    def best(self, fmt: Format) -> RangeStats:
        """fp8 at the best per-tensor scale (``scale`` reported from the amax over all calls)."""
        scale = fmt.max / self.amax if 0 < self.amax < math.inf else 1.0
        if not self.numel:
            return RangeStats(scale, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        i, j = self.t.index8[(fmt.name, "normal")], self.t.index8[(fmt.name, "flush")]
        sub, sub_energy = self._fractions(self.scaled[i], self.scaled_sq[i])
        flushed, flushed_energy = self._fractions(self.scaled[j], self.scaled_sq[j])
        return RangeStats(scale, self.amax, 0.0, sub, flushed, sub_energy, flushed_energy)


# ---------------------------------------------------------------------- module error
@contextmanager
def _swapped(module: nn.Module, values: dict[str, torch.Tensor]):
    """Temporarily replace the ``.data`` of the module's own parameters and buffers by ``values``
    (no version bump, so the autograd graph of the real call stays valid)."""
    own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
    saved = {name: own[name].data for name in values}
    try:
        for name, value in values.items():
            own[name].data = value
        yield
    finally:
        for name, data in saved.items():
            own[name].data = data


def _rerun_in_format(module: nn.Module, args: tuple, kwargs: dict, fmt: Format,
                     rng_state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The module's floating outputs when run in ``fmt`` (module docstring). No autograd."""
    eight = fmt.bits == 8
    cast = functools.partial(fake_quantise_fp8, fmt=fmt) if eight else functools.partial(round_to_format, fmt=fmt)
    values = {n: (cast(p.detach()) if (not eight or p.dim() >= 2) else p.detach().clone())
              for n, p in module.named_parameters(recurse=False) if p.is_floating_point()}
    values |= {n: b.detach().clone() for n, b in module.named_buffers(recurse=False)}
    cuda = [d for d in rng_state if d != "cpu"]
    with torch.no_grad(), _swapped(module, values), torch.random.fork_rng(devices=[torch.device(d) for d in cuda]):
        torch.set_rng_state(rng_state["cpu"])
        for d in cuda:
            torch.cuda.set_rng_state(rng_state[d], d)
        out = module.forward(*_map_floating(args, cast), **_map_floating(kwargs, cast))
    outs = _floating(out)
    return outs if eight else [round_to_format(o, fmt) for o in outs]


def _rng_state(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    for t in tensors:
        if t.device.type == "cuda" and str(t.device) not in state:
            state[str(t.device)] = torch.cuda.get_rng_state(t.device)
    return state


# ---------------------------------------------------------------------- the recorder
class _Recorder:
    """Hooks and counters for one inspection (on the private copy of the model)."""

    def __init__(self, model: nn.Module, formats: list[Format], grad_scales: list[float]) -> None:
        fp8 = [f for f in formats if f.bits == 8]
        self.formats = formats
        self.storage = [f for f in formats if f.bits >= 16]
        if get_format("fp32") not in self.storage:
            self.storage.append(get_format("fp32"))
        self.one = _Thresholds(formats, [1.0])
        self.grad = _Thresholds(formats, grad_scales)
        self.module_names = tuple(n for n, _ in model.named_modules())
        self.leaves = {n: m for n, m in model.named_modules() if not any(True for _ in m.children())}
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.acts = {n: _RangeCounter(self.one, fp8) for n in self.leaves}
        self.grad_outs = {n: _RangeCounter(self.grad, fp8) for n in self.leaves}
        # all parameters are measured at once, as one flat fp32 vector cut into segments
        self.numels = [p.numel() for p in self.params.values()]
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        self.seg = torch.repeat_interleave(torch.arange(len(self.numels), device=device),
                                           torch.tensor(self.numels, dtype=torch.int64, device=device))
        self.weights = _RangeCounter(self.one, fp8, len(self.numels))
        self.param_grads = _RangeCounter(self.grad, fp8, len(self.numels))
        self.lost = {f.name: torch.zeros(len(self.numels), dtype=torch.int64, device=device) for f in self.storage}
        self.updated = torch.zeros(len(self.numels), dtype=torch.int64, device=device)
        self.errors: dict[str, dict[str, list[torch.Tensor]]] = {n: {} for n in self.leaves}
        self.measure_error = False
        self._rng: dict[str, dict[str, torch.Tensor]] = {}

    def install(self) -> list[Any]:
        handles = []
        for name, module in self.leaves.items():
            handles.append(module.register_forward_pre_hook(functools.partial(self._pre, name)))
            handles.append(module.register_forward_hook(functools.partial(self._post, name), with_kwargs=True))
        return handles

    def _pre(self, name: str, module: nn.Module, args: tuple) -> None:
        if self.measure_error:
            self._rng[name] = _rng_state(_floating(args) + list(module.parameters(recurse=False)))

    def _post(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        outs = _floating(output)
        for t in outs:
            self.acts[name].add(t)
            if t.grad_fn is not None:  # never hook a leaf (a parameter would keep the hook)
                t.register_hook(functools.partial(self._grad_out, name))
        if self.measure_error and outs:
            self._measure_error(name, module, args, kwargs, outs)

    def _grad_out(self, name: str, grad: torch.Tensor) -> None:
        self.grad_outs[name].add(grad)

    def _measure_error(self, name: str, module: nn.Module, args: tuple, kwargs: dict,
                       ref: list[torch.Tensor]) -> None:
        for fmt in self.formats:
            outs = _rerun_in_format(module, args, kwargs, fmt, self._rng[name])
            if len(outs) != len(ref):
                continue
            # squared L2 norms in fp64 (no overflow); a non-finite output gives an inf or NaN noise
            signal = sum(torch.linalg.vector_norm(r.detach(), dtype=torch.float64) ** 2 for r in ref)
            noise = sum(torch.linalg.vector_norm(r.detach() - o, dtype=torch.float64) ** 2 for r, o in zip(ref, outs))
            acc = self.errors[name].setdefault(fmt.name, [0.0, 0.0])  # device tensors after the first call
            acc[0] = acc[0] + signal
            acc[1] = acc[1] + noise

    def flat_params(self) -> torch.Tensor:
        """Every recorded parameter, flattened and concatenated (a copy), fp32 ``(total,)``."""
        return torch.cat([p.detach().flatten() for p in self.params.values()]) if self.params else torch.zeros(0)

    def flat_grads(self) -> torch.Tensor:
        """Their gradients the same way (zeros where a parameter has none)."""
        if not self.params:
            return torch.zeros(0)
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
                          for p in self.params.values()])

    def record_params(self, w_fp32: torch.Tensor, grad_fp32: torch.Tensor) -> None:
        """After backward, before the optimizer step: the weights as used, and their gradients."""
        if self.params:
            self.weights.add(w_fp32, self.seg, self.numels)
            self.param_grads.add(grad_fp32, self.seg, self.numels)

    def record_updates(self, before_fp32: torch.Tensor, grad_fp32: torch.Tensor) -> None:
        """After the optimizer step: lost updates per storage format (module docstring of report)."""
        if not self.params:
            return
        delta_fp32 = self.flat_params() - before_fp32
        intended = (delta_fp32 != 0) | (grad_fp32 != 0)
        self.updated.scatter_add_(0, self.seg, intended.to(torch.int64))
        for fmt in self.storage:
            half_ulp_fp32 = 0.5 * fmt.ulp(before_fp32)
            lost = intended & (delta_fp32.abs() < half_ulp_fp32)
            self.lost[fmt.name].scatter_add_(0, self.seg, lost.to(torch.int64))


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


def _resolve_formats(formats: Iterable[str | Format]) -> list[Format]:
    if isinstance(formats, (str, Format)):
        formats = (formats,)
    resolved = list(dict.fromkeys(get_format(f) for f in formats))
    if not resolved:
        raise ValueError(f"inspect formats={formats!r} is empty; e.g. formats={DEFAULT_FORMATS}")
    return resolved


def _loss_of(loss_fn: Callable, model: nn.Module, batch: Any) -> torch.Tensor:
    loss = loss_fn(model, batch)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()
            and loss.requires_grad):
        raise ValueError(f"inspect loss_fn(model, batch) must return a scalar floating tensor that requires grad, "
                         f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    return loss


def inspect(model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
            policy: str | Policy = "fp32", formats: Iterable[str | Format] = DEFAULT_FORMATS, steps: int = 4,
            lr: float | None = None, optimizer: Any = None,
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
            ``"e4m3fn"``).
        steps: training steps (the error measurement runs on the last one).
        lr: learning rate of every parameter group (``None``: the optimizer's own, or 1e-3).
        optimizer: ``None`` (``torch.optim.AdamW``), an optimizer over ``model``'s parameters (copied
            with the model, state included), or a factory ``model -> Optimizer`` such as
            ``workload.make_optimizer``.
        device: where the copy trains (``None``: the model's device).

    Returns:
        A :class:`~mixprec.numerics.NumericsReport`. The learning rate is held constant (no
        scheduler): lost updates are measured at the given, peak, rate.

    Raises:
        ValueError / TypeError: bad arguments; fewer than ``steps`` batches; a non-fp32 model; or
            a reference step that went non-finite in fp32 (the message names where, via
            :func:`mixprec.numerics.locate_nonfinite`).
    """
    _check_args(model, steps, lr)
    policy = Policy.parse(policy)
    fmts = _resolve_formats(formats)
    first = next(model.parameters(), None)
    device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
    ref_model, opt = _reference_copy(model, optimizer, lr)
    ref_model.to(device).train()
    cfg = DynamicConfig()
    ladder = [2.0 ** k for k in range(math.ceil(math.log2(cfg.min_scale)), math.floor(math.log2(cfg.max_scale)) + 1)]
    policy_scale = _policy_loss_scale(policy)
    recorder = _Recorder(ref_model, fmts, sorted({1.0, policy_scale, *ladder}))
    losses: list[torch.Tensor] = []
    iterator = iter(batches)
    handles = recorder.install()
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
                loss = _loss_of(loss_fn, ref_model, batch)
                loss.backward()
                w_fp32, grad_fp32 = recorder.flat_params(), recorder.flat_grads()
                _check_finite(ref_model, loss, grad_fp32, batch, loss_fn, step, handles)
                recorder.record_params(w_fp32, grad_fp32)
                opt.step()
                recorder.record_updates(w_fp32, grad_fp32)
                losses.append(loss.detach())
    finally:
        for handle in handles:
            handle.remove()
    return _build_report(recorder, policy, fmts, steps, opt, losses, policy_scale, cfg)


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
    lost = {f: dict(zip(rec.params, v.tolist())) for f, v in rec.lost.items()}
    updated = dict(zip(rec.params, rec.updated.tolist()))
    grad_amax = max([g.amax for g in [*gouts.values(), *pgrads.values()]], default=0.0)
    safe = safe_loss_scale(grad_amax, "fp16", LOSS_SCALE_MARGIN)
    recommended = min(max(safe, cfg.min_scale), cfg.max_scale)
    scales = tuple(sorted({1.0, policy_scale, float(cfg.init_scale), recommended}))
    fp8 = [f for f in fmts if f.bits == 8]
    names = {id(p): n for n, p in rec.params.items()}

    def at_scales(h: _HostCounts) -> dict[str, tuple[RangeStats, ...]]:
        return {f.name: tuple(h.at(f, s) for s in scales) for f in fmts}

    modules = {}
    for name, h in acts.items():
        module = rec.leaves[name]
        errors = {}
        for fmt_name, (signal_t, noise_t) in rec.errors[name].items():
            signal, noise = float(signal_t), float(noise_t)
            noise = math.inf if math.isnan(noise) else noise  # NaN output: as bad as an inf one
            sqnr = math.inf if noise == 0 else (-math.inf if signal == 0 or math.isinf(noise)
                                                else 10 * math.log10(signal / noise))
            rel = 0.0 if noise == 0 else (math.inf if signal == 0 else math.sqrt(noise / signal))
            errors[fmt_name] = ModuleError(sqnr, rel)
        modules[name] = ModuleStats(
            name=name, kind=type(module).__name__, calls=h.calls, numel=h.numel,
            activation={f.name: h.at(f, 1.0) for f in fmts},
            activation_scaled={f.name: h.best(f) for f in fp8},
            grad_output=at_scales(gouts[name]),
            grad_output_scaled={f.name: gouts[name].best(f) for f in fp8},
            error=errors,
            params=tuple(names[id(p)] for p in module.parameters(recurse=False) if id(p) in names
                         and names[id(p)].rpartition(".")[0] == name),
        )
    params = {}
    for name, p in rec.params.items():
        params[name] = ParamStats(
            name=name, module=name.rpartition(".")[0], shape=tuple(p.shape),
            weight={f.name: weights[name].at(f, 1.0) for f in fmts},
            weight_scaled={f.name: weights[name].best(f) for f in fp8},
            grad=at_scales(pgrads[name]),
            grad_scaled={f.name: pgrads[name].best(f) for f in fp8},
            lost={f: int(v[name]) for f, v in lost.items()},
            updated=int(updated[name]),
        )
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
        modules=modules, params=params,
    )
