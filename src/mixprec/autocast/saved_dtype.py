"""Saved in the compute dtype: a norm that autocast runs in fp32 saves its input for backward in bf16.

CUDA's autocast lists (and ``ops=portable`` on every device) run ``layer_norm`` and ``rms_norm`` in fp32, and
autograd then saves the fp32 input: under bf16-mixed the fp32 residual stream, under ``-pure`` an fp32 copy of
the bf16 one. Measured at GPT ``small`` (docs/policies.md) that is 23 % of the bytes saved for backward and the gap
between bf16-mixed's 0.58 x fp32 and a plain bf16 model's 0.50 x. Inside :func:`saved_in_compute` (entered
by ``mp.autocast()`` under the policy option ``saved=compute``, every bf16 policy's default) these ops still
**compute in fp32**, bit for bit as before, but save the input rounded to bf16 (under ``-pure`` the bf16
input itself: no new storage, and exact) plus, for ``layer_norm``, its fp32 row statistics (mean, rstd: one
number each per row). The backward upcasts the saved input and runs torch's own fp32 backward
(``native_layer_norm_backward``; ``rms_norm``: the op recomputed on the upcast input under autograd).

Numerics. Where the input is bf16 already (``-pure``, ``-sr``, ``-kahan``, ``-lean``) the upcast is exact and the
gradients equal the fp32-saved op's bit for bit. Where it is fp32 (bf16-mixed's residual stream), the
backward sees ``x (1 + d)``, ``|d| <= u = 2^-8``: the normalised input ``xhat`` moves by at most
``u (|xhat| + |mean| rstd)`` per element, and the gradient by that times the op's (bounded, linear) backward
(the derivation and the check: ``tests/autocast/test_saved_activations.py``). fp16 is not offered: a norm's fp32
input can exceed fp16's range. Double backward (gradient penalties) works: the bf16 copy is made by a
differentiable cast outside the function, so a graph built in backward reaches the input through it.

Mechanism. Under ``ops=portable`` on CPU (and MPS for ``rms_norm``) :mod:`mixprec.autocast.portable`'s kernel
for these ops calls :func:`run`. On CUDA, where torch's own autocast kernel runs them in fp32, a
``torch.library`` kernel replaces it on ``AutocastCUDA`` the first time ``saved_in_compute`` is entered there;
outside it (``saved=fp32``, a plain ``torch.autocast``) that kernel does what torch's does: cast the floating
inputs to fp32 and run the op with autocast off. Under ``ops=native`` on CPU and MPS nothing changes (their
own lists leave the norms alone). The switch is per thread, held by the engine's backward passes, restored by
:func:`mixprec.ops.checkpoint`'s recompute (:func:`saved_devices`, :func:`saved_as`) and annotated into traced
graphs, like the op lists' (:mod:`mixprec.autocast.switch`). No host sync anywhere.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from mixprec.autocast.lean_linear import ACTIVATIONS, activation_kernel, cast_region
from mixprec.autocast.switch import Switch

__all__ = ["SAVED_OPS", "saved_in_compute", "saved_devices", "saved_as", "is_on", "run", "describe"]

#: the aten ops whose fp32 input is saved in bf16 inside :func:`saved_in_compute`
SAVED_OPS = ("layer_norm", "rms_norm")
_REPLACED_KEYS = {"cuda": "AutocastCUDA"}   # where torch's own fp32 autocast kernel is replaced by ours
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "mps": "AutocastMPS"}
_libraries: dict[str, torch.library.Library] = {}
_lock = threading.Lock()


class _LayerNormSavedLow(torch.autograd.Function):
    """``native_layer_norm`` in fp32 on ``x_fp32``; saves ``x_low`` (its bf16 rounding, an input so that a
    double backward reaches ``x`` through the cast that made it), the weight and bias as given, and the fp32
    mean and rstd (``(rows, 1)``)."""

    @staticmethod
    def forward(ctx: Any, x_fp32: torch.Tensor, x_low: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, normalized_shape: list[int], eps: float) -> torch.Tensor:
        w32 = None if weight is None else weight.float()
        b32 = None if bias is None else bias.float()
        out, mean, rstd = torch.native_layer_norm(x_fp32, normalized_shape, w32, b32, eps)
        ctx.save_for_backward(x_low, weight, bias, mean, rstd)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x_low, weight, bias, mean, rstd = ctx.saved_tensors
        w32 = None if weight is None else weight.float()
        b32 = None if bias is None else bias.float()
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(grad_out.contiguous(), x_low.float(),
                                                               ctx.normalized_shape, mean, rstd, w32, b32, mask)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dx, None, dw, db, None, None


class _RMSNormSavedLow(torch.autograd.Function):
    """``rms_norm`` in fp32 on ``x_fp32``; saves ``x_low`` and the weight; the backward recomputes the op on
    ``x_low`` upcast, under autograd (one elementwise pass: torch's ``rms_norm`` returns no statistics)."""

    @staticmethod
    def forward(ctx: Any, x_fp32: torch.Tensor, x_low: torch.Tensor, weight: torch.Tensor | None,
                normalized_shape: list[int], eps: float | None) -> torch.Tensor:
        w32 = None if weight is None else weight.float()
        ctx.save_for_backward(x_low, weight)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return torch.rms_norm(x_fp32, normalized_shape, w32, eps)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x_low, weight = ctx.saved_tensors
        create = torch.is_grad_enabled()
        with torch.enable_grad():
            x32 = x_low.float() if create else x_low.float().requires_grad_(ctx.needs_input_grad[0])
            w32 = None if weight is None else (weight.float() if create else
                                               weight.detach().float().requires_grad_(ctx.needs_input_grad[2]))
            out = torch.rms_norm(x32, ctx.normalized_shape, w32, ctx.eps)
            wanted = [t for t, need in ((x32, ctx.needs_input_grad[0]), (w32, ctx.needs_input_grad[2]))
                      if need and t is not None]
            grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=create, allow_unused=True))
        dx = next(grads) if ctx.needs_input_grad[0] else None
        dw = next(grads) if weight is not None and ctx.needs_input_grad[2] else None
        return dx, None, None if dw is None else dw.to(weight.dtype), None, None


def _eligible(t: Any, device_type: str) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == device_type


def _fp32(t: Any, device_type: str) -> Any:
    return t.to(torch.float32) if _eligible(t, device_type) else t


def _overload(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.aten, name).default


def _arguments(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    schema = _overload(name)._schema.arguments
    full = dict(zip((a.name for a in schema), args), **kwargs)
    for a in schema:
        if a.name not in full and a.has_default_value():
            full[a.name] = a.default_value
    return full


def _as_autocast(name: str, args: tuple, kwargs: dict, device_type: str) -> Any:
    """What autocast's fp32 list does for ``name`` (autocast off around it): the floating inputs cast to fp32."""
    return _overload(name)(*(_fp32(v, device_type) for v in args), **{k: _fp32(v, device_type) for k, v in kwargs.items()})


def run(name: str, args: tuple, kwargs: dict, device_type: str) -> torch.Tensor:
    """``aten::<name>`` (one of :data:`SAVED_OPS`) on ``args``/``kwargs``, computed in fp32 as autocast's fp32 list
    does, its input saved in the autocast dtype (bf16) when a backward will need it (module docstring); else exactly
    what the fp32 list does. Call with ``device_type``'s autocast off (from an autocast kernel). Output: fp32, the
    input's shape."""
    a = _arguments(name, args, kwargs)
    x = a["input"]
    tensors = [t for t in (x, a["weight"], a.get("bias")) if isinstance(t, torch.Tensor)]
    low = torch.get_autocast_dtype(device_type)
    if (not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors) or low != torch.bfloat16
            or not _eligible(x, device_type)):
        return _as_autocast(name, args, kwargs, device_type)
    x_fp32 = x.to(torch.float32)
    x_low = x if x.dtype == low else x_fp32.to(low)   # -pure: the bf16 input itself (exact, no new storage)
    shape = list(a["normalized_shape"])
    if name == "layer_norm":
        return _LayerNormSavedLow.apply(x_fp32, x_low, a["weight"], a["bias"], shape, a["eps"])
    return _RMSNormSavedLow.apply(x_fp32, x_low, a["weight"], shape, a["eps"])


def _kernel(name: str, device_type: str) -> Any:
    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            if _switch.is_on(device_type):
                return run(name, args, kwargs, device_type)
            return _as_autocast(name, args, kwargs, device_type)   # torch's own kernel, as it was
    return kernel


def _install(device_type: str) -> None:
    """Replace torch's autocast kernels of :data:`SAVED_OPS` on ``device_type``'s key where it has its own
    (CUDA); elsewhere :mod:`mixprec.autocast.portable`'s kernels call :func:`run`. Register the activation kernels
    of :mod:`mixprec.autocast.lean_linear` on its autocast key. Once per process."""
    with _lock:
        if device_type in _libraries or device_type not in _AUTOCAST_KEYS:
            return
        key_name = _AUTOCAST_KEYS[device_type]
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():   # torch warns that a kernel for this key is replaced: that is the point
            warnings.simplefilter("ignore")
            if device_type in _REPLACED_KEYS:
                for name in SAVED_OPS:
                    library.impl(name, _kernel(name, device_type), key_name, with_keyset=True)
            for name in ACTIVATIONS:
                library.impl(name, activation_kernel(name, device_type, lambda: _switch.is_on(device_type)), key_name)
        _libraries[device_type] = library


_switch = Switch(("cpu", "cuda", "mps"), _install)


def saved_in_compute(device_type: str, *, enabled: bool = True) -> AbstractContextManager[None]:
    """Inside, :data:`SAVED_OPS` that autocast runs in fp32 on ``device_type`` save their input in bf16 (the
    autocast dtype; under fp16 autocast nothing changes), per thread; a no-op with ``enabled=False``. Restores
    the previous state on exit. No host sync."""
    return _in_compute(device_type, enabled)


@contextmanager
def _in_compute(device_type: str, enabled: bool) -> Iterator[None]:
    with _switch.turned_on(device_type, enabled=enabled), (cast_region() if enabled else nullcontext()):
        yield


def saved_devices() -> tuple[str, ...]:
    """The device types :func:`saved_in_compute` is on for here now (what a checkpoint's recompute restores)."""
    return _switch.on()


def saved_as(devices: tuple[str, ...]) -> AbstractContextManager[None]:
    """Inside, exactly ``devices`` (:func:`saved_devices` of an earlier moment) save in bf16. No host sync."""
    return _switch.exactly(devices)


def is_on(device_type: str) -> bool:
    """Whether :func:`saved_in_compute` is on for ``device_type`` here now (what the kernels ask)."""
    return _switch.is_on(device_type)


def describe(saved: str, device_type: str, *, compute_dtype: torch.dtype, ops: str) -> str:
    """The decision's words for a policy's ``saved`` option on ``device_type`` ("" under fp32 or fp16 compute)."""
    if compute_dtype != torch.bfloat16:
        return ""
    if saved == "fp32":
        return "; saved=fp32: norms computed in fp32 save their fp32 input for backward (as torch.autocast)"
    lean = "a Linear fed by gelu/silu keeps the activation's input for backward, not its output (same bits)"
    if ops == "native" and device_type != "cuda":
        return (f"; saved={saved} has no effect under ops=native on {device_type} on the norms (its own autocast lists "
                f"leave them in their input dtype); {lean}")
    words = ("; saved=compute: layer_norm and rms_norm compute in fp32 and save their input for backward in bf16 "
             f"(with fp32 row statistics); {lean}")
    if saved == "rebuild":
        words = words.replace("saved=compute", "saved=rebuild") + (
            "; weight copies and gelu/silu outputs read by anything else are not kept for backward but rebuilt there "
            "(same bits)")
    return words
