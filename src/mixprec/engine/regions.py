"""fp32 regions and the output cast: what a policy installs on a model's forwards.

A *region* runs one module with autocast off and its floating inputs cast to fp32 (the policy's
``keep_fp32`` patterns, and every BatchNorm under 16-bit params, as Apex O2's
``keep_batchnorm_fp32``); its output goes back to the 16-bit param dtype under pure policies. The
root module's floating outputs are cast to the policy's ``output_dtype`` (fp32 logits for the loss),
and a frozen embedding table stored in 16 bits returns its lookups in fp32, as an fp32 table would.
A region turns autocast off inside the kept module's ``forward`` (replaced by an instance attribute),
so no autocast state is carried between two hooks and ``torch.compile`` traces it. The hooks and region
forwards are picklable objects (no closures), so a prepared model still pickles and deep-copies.

Under 16-bit params a trainable dense ``nn.Embedding`` or ``nn.EmbeddingBag`` gets
:class:`Fp32GradEmbedding` as its forward: the lookup is torch's, but the backward adds the gradients of
repeated indices in fp32 and rounds the table's gradient once to the weight's dtype (torch's own backward
adds them in the weight's dtype, and a bf16 sum stalls once it dwarfs each term: 10,000 lookups of one
token with gradient 0.01 sum to 4, not 100). Sparse embeddings (``sparse=True``) are left to
:mod:`mixprec.engine.gradients`.

A module with no kernel for the policy's dtypes on its device (an fp16 ``nn.LSTM`` on a CPU whose oneDNN
has no fp16 LSTM primitive) would fail at the first forward: :func:`no_kernel_reason` finds it at build
by running a tiny module of the same RNN type once (forward and backward, in the param dtype, under the
policy's autocast) on the device, cached per (type, dtypes, device), and :func:`keep_fp32_modules` keeps
such modules as fp32 regions; the decision names them and gives torch's error.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.engine.feature import Feature
from mixprec.policy.policy import Policy, cast_floating

__all__ = ["Fp32GradEmbedding", "Fp32Region", "OutputCast", "Regions", "keep_fp32_modules", "no_kernel_reason"]

_PROBED_TYPES = (nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell, nn.GRUCell, nn.RNNCell)   # fused kernels per dtype
_PROBES: dict[tuple, str | None] = {}   # (type, forward, bidirectional, dtypes, mixed, device) → error or None


def _probe(kind: type, bidirectional: bool, policy: Policy, device: torch.device) -> str | None:
    """Run a tiny ``kind`` (2 features, 1 step, batch 1) forward and backward as ``policy`` would on
    ``device``; torch's error text, or None. The global CPU RNG is left as it was (fork_rng)."""
    extra = {"bidirectional": True} if bidirectional else {}
    cell = kind in (nn.LSTMCell, nn.GRUCell, nn.RNNCell)
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            module = kind(2, 2, **extra).to(device=device, dtype=policy.param_dtype)
            x = torch.ones((1, 2) if cell else (1, 1, 2), device=device, dtype=policy.param_dtype)
            with torch.autocast(device.type, dtype=policy.compute_dtype, enabled=policy.is_mixed):
                out = module(x)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    except (RuntimeError, NotImplementedError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return None


def no_kernel_reason(module: nn.Module, policy: Policy) -> str | None:
    """Why ``module`` cannot run under ``policy``'s dtypes on the device of its parameters: torch's error
    from a one-off probe of its RNN type (:data:`_PROBED_TYPES`, cached per type, dtypes and device), or
    None (it runs, it is not an RNN, it has no parameters, or the policy is plain fp32). The first probe
    of a key runs a tiny forward and backward on the device (a host sync there)."""
    kind = next((t for t in _PROBED_TYPES if isinstance(module, t)), None)
    param = next(module.parameters(recurse=False), None)
    if kind is None or param is None or (policy.param_dtype == torch.float32 and not policy.is_mixed):
        return None
    bidirectional = bool(getattr(module, "bidirectional", False))
    key = (kind, kind.forward, bidirectional, policy.param_dtype, policy.compute_dtype, policy.is_mixed,
           str(param.device))   # kind.forward: a patched forward is probed afresh
    if key not in _PROBES:
        _PROBES[key] = _probe(kind, bidirectional, policy, param.device)
    return _PROBES[key]


class Fp32Region:
    """One kept module's fp32 region: a forward pre-hook casting floating inputs to fp32, the module's
    ``forward`` replaced by this object (it runs the original with autocast off) and a forward hook
    casting floating outputs to ``out_dtype`` (None: left as they are).

    The autocast context is entered and left inside one call of ``forward``, never carried from a
    pre-hook to a post-hook, so ``torch.compile`` traces the region (the hooks are stateless). The
    replacement is the module's instance attribute ``forward``; :meth:`remove` gives back the one it
    had (the class's, or an instance-level one set earlier). A picklable object holding its module
    (a cycle that pickle and ``copy.deepcopy`` restore); no host sync.
    """

    def __init__(self, module: nn.Module, device_type: str, out_dtype: torch.dtype | None) -> None:
        self.module = module
        self.device_type = device_type
        self.out_dtype = out_dtype
        self.previous = module.__dict__.get("forward")   # an instance-level forward set before ours, else None

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        return cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.previous if self.previous is not None else type(self.module).forward.__get__(self.module)
        with torch.autocast(self.device_type, enabled=False):
            return forward(*args, **kwargs)

    def post(self, module: nn.Module, args: tuple, output: Any):
        return cast_floating(output, self.out_dtype) if self.out_dtype is not None else output

    def install(self) -> list[Any]:
        """Hook the module and replace its ``forward``; returns what :meth:`Regions.remove` removes."""
        self.module.forward = self
        return [self.module.register_forward_pre_hook(self.pre, with_kwargs=True), self,
                self.module.register_forward_hook(self.post)]

    def remove(self) -> None:
        """Give the module back the ``forward`` it had (its hooks are removed by their handles)."""
        if self.module.__dict__.get("forward") is not self:
            return
        if self.previous is None:
            del self.module.forward
        else:
            self.module.forward = self.previous


class _EmbeddingFp32Grad(torch.autograd.Function):
    """``F.embedding(indices, weight)`` whose weight gradient is summed in fp32 and rounded once to
    ``weight.dtype`` (``aten.embedding_dense_backward`` on the fp32 output gradient: padding row and
    ``scale_grad_by_freq`` as torch's). Costs an fp32 copy of the output gradient and an fp32 table-sized
    gradient during backward; no host sync. Not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, indices: torch.Tensor, weight: torch.Tensor, padding_idx: int,
                scale_grad_by_freq: bool) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.rows, ctx.padding_idx, ctx.by_freq, ctx.dtype = weight.shape[0], padding_idx, scale_grad_by_freq, weight.dtype
        return F.embedding(indices, weight, None if padding_idx < 0 else padding_idx, None, 2.0, scale_grad_by_freq)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (indices,) = ctx.saved_tensors
        grad_fp32 = torch.ops.aten.embedding_dense_backward(grad_out.float(), indices, ctx.rows, ctx.padding_idx,
                                                            ctx.by_freq)
        return None, grad_fp32.to(ctx.dtype), None, None


class _EmbeddingBagFp32Grad(torch.autograd.Function):
    """``F.embedding_bag(indices, weight, offsets, per_sample_weights=psw, **options)`` whose weight (and
    ``psw``) gradients are summed in fp32 and rounded once: the backward reruns the bag on an fp32 copy of
    the table (exact: a widening cast) and differentiates that. Costs an fp32 copy of the table and an
    fp32 table-sized gradient during backward; no host sync. Not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, indices: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None,
                psw: torch.Tensor | None, options: dict) -> torch.Tensor:
        ctx.save_for_backward(indices, weight, offsets, psw)
        ctx.options = options
        return F.embedding_bag(indices, weight, offsets, per_sample_weights=psw, **options)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        indices, weight, offsets, psw = ctx.saved_tensors
        with torch.enable_grad():
            weight_fp32 = weight.detach().float().requires_grad_(ctx.needs_input_grad[1])
            psw_fp32 = None if psw is None else psw.detach().float().requires_grad_(ctx.needs_input_grad[3])
            out_fp32 = F.embedding_bag(indices, weight_fp32, offsets, per_sample_weights=psw_fp32, **ctx.options)
            wrt = [t for t in (weight_fp32, psw_fp32) if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out_fp32, wrt, grad_out.float()) if wrt else ())
        grad_weight = next(grads).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_psw = next(grads).to(psw.dtype) if psw is not None and ctx.needs_input_grad[3] else None
        return None, grad_weight, None, grad_psw, None


class Fp32GradEmbedding:
    """The ``forward`` of one dense ``nn.Embedding`` or ``nn.EmbeddingBag`` with a 16-bit weight: the
    same lookup (``max_norm`` renormalisation included, done first as ``F.embedding`` does it), with the
    weight's gradient summed in fp32 and rounded once (:class:`_EmbeddingFp32Grad`,
    :class:`_EmbeddingBagFp32Grad`). Installed as the module's instance attribute ``forward`` (only on
    modules that have none and keep torch's forward); :meth:`remove` deletes it. A picklable object
    holding its module; no host sync.
    """

    def __init__(self, module: nn.Embedding | nn.EmbeddingBag) -> None:
        self.module = module

    @staticmethod
    def applies(module: nn.Module, frozen16: set[int]) -> bool:
        """True for a dense ``nn.Embedding``/``nn.EmbeddingBag`` whose trainable weight Parameter is stored
        in 16 bits and whose forward is torch's (not an override, not an instance attribute)."""
        kind = nn.Embedding if isinstance(module, nn.Embedding) else nn.EmbeddingBag
        return (isinstance(module, kind) and not module.sparse and "forward" not in module.__dict__
                and type(module).forward is kind.forward and isinstance(module.weight, nn.Parameter)
                and module.weight.requires_grad and id(module.weight) not in frozen16
                and module.weight.dtype in (torch.bfloat16, torch.float16))

    def __call__(self, indices: torch.Tensor, offsets: torch.Tensor | None = None,
                 per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        m = self.module
        if m.max_norm is not None:   # as F.embedding: renormalise the looked-up rows in place, untracked
            indices = indices.contiguous()
            with torch.no_grad():
                torch.embedding_renorm_(m.weight, indices, m.max_norm, m.norm_type)
        if isinstance(m, nn.Embedding):
            return _EmbeddingFp32Grad.apply(indices, m.weight, -1 if m.padding_idx is None else m.padding_idx,
                                            m.scale_grad_by_freq)
        options = {"mode": m.mode, "scale_grad_by_freq": m.scale_grad_by_freq, "include_last_offset":
                   m.include_last_offset, "padding_idx": m.padding_idx}
        return _EmbeddingBagFp32Grad.apply(indices, m.weight, offsets, per_sample_weights, options)

    def install(self) -> list[Any]:
        self.module.forward = self
        return [self]

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward


class OutputCast:
    """Forward hook casting a module's floating outputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        return cast_floating(output, self.dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def keep_fp32_modules(model: nn.Module, policy: Policy) -> dict[str, nn.Module]:
    """The modules ``policy`` runs in fp32, by name: its ``keep_fp32`` matches (``fnmatch`` on
    ``model.named_modules()`` names), plus every BatchNorm when params are 16-bit (its running
    statistics stay fp32), plus every module with no kernel for the policy's dtypes on its device
    (:func:`no_kernel_reason`; probed once per type, dtypes and device). A matched container that is
    never called (ModuleList/ModuleDict) stands for its children; modules nested in another kept module
    are covered by the outer one.

    Raises:
        ValueError: a pattern matches no module (the names are listed).
    """
    found = {name: m for name, m in model.named_modules()
             if name and any(fnmatch.fnmatchcase(name, pat) for pat in policy.keep_fp32)}
    unmatched = [pat for pat in policy.keep_fp32 if not any(fnmatch.fnmatchcase(n, pat) for n in found)]
    if unmatched:
        raise ValueError(f"policy keep_fp32 patterns {unmatched} match no module of the model; module names "
                         f"look like {[n for n, _ in model.named_modules() if n][:8]}")
    if policy.param_dtype != torch.float32:
        found.update({name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    found.update({name: m for name, m in model.named_modules() if name and no_kernel_reason(m, policy)})
    containers = (nn.ModuleList, nn.ModuleDict)
    while any(isinstance(m, containers) for m in found.values()):
        for name in [n for n, m in found.items() if isinstance(m, containers)]:
            container = found.pop(name)
            found.update({f"{name}.{child}": m for child, m in container.named_children()})
    return {n: m for n, m in found.items() if not any(n.startswith(o + ".") for o in found if o != n)}


class Regions(Feature):
    """The hooks of one policy on one model: :meth:`install`, then :meth:`remove` (before a new policy)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []   # hook handles and Fp32Region forwards, each with .remove()

    def wrap(self, model: nn.Module, policy: Policy, device_type: str, keep: dict[str, nn.Module],
                frozen16: set[int]) -> str:
        """Hook ``keep``'s modules as fp32 regions, the root's output cast, (under fp32 params) the fp32
        lookups of frozen embedding tables whose weight id is in ``frozen16``, and (under 16-bit params) the
        fp32-summed backward of trainable dense embeddings and bags (:class:`Fp32GradEmbedding`). Returns the
        decision's note on the embeddings ("" when there are none)."""
        region_out = policy.param_dtype if policy.param_dtype != torch.float32 else None
        for module in keep.values():
            self._handles.extend(Fp32Region(module, device_type, region_out).install())
        missing = {name: why for name, m in keep.items() if (why := no_kernel_reason(m, policy))}
        note = "".join(f"; {name} ({type(keep[name]).__name__}) kept fp32: its kernel fails on {device_type} under "
                       f"params={_name(policy.param_dtype)}, compute={_name(policy.compute_dtype)} ({why})"
                       for name, why in missing.items())
        if policy.is_mixed or policy.param_dtype != torch.float32:
            self._handles.append(model.register_forward_hook(OutputCast(policy.output_dtype)))
        if policy.param_dtype == torch.float32:
            # autocast leaves embedding lookups alone: only the table's values are rounded, as autocast rounds weights
            for module in model.modules():
                if isinstance(module, nn.Embedding) and id(module.weight) in frozen16:
                    self._handles.append(module.register_forward_hook(OutputCast(torch.float32)))
            return note
        summed = [name for name, m in model.named_modules() if Fp32GradEmbedding.applies(m, frozen16)]
        for name in summed:
            self._handles.extend(Fp32GradEmbedding(model.get_submodule(name)).install())
        dtype = _name(policy.param_dtype)
        if summed:
            more = f" and {len(summed) - 5} more" if len(summed) > 5 else ""
            note += f"; embedding backward sums repeated tokens in fp32, rounded once to {dtype}: {summed[:5]}{more}"
        return note

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
