"""The hooks of :func:`mixprec.numerics.inspect` on the reference copy: what they record (activations,
their gradients, parameters, lost updates) and how a module is re-run in a format to measure its error
(the inspect module's docstring describes both). Device tensors only; no host sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mixprec.formats import Format, get_format
from mixprec.numerics.counts import _RangeCounter, _Thresholds
from mixprec.policy.tree import map_tensors, tensors

__all__ = ["round_to_format", "fake_quantise_fp8"]


# ---------------------------------------------------------------------- running in a format
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
