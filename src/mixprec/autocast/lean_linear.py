"""A Linear that keeps less for backward: the activation's input instead of its output. Hook-free; every gradient
bit for bit the unfused ops'.

Under bf16 autocast, ``fc2(gelu(fc1(x)))`` makes autograd keep, per MLP, GELU's input ``h`` (GELU's own backward
needs it) and GELU's output ``g`` (``fc2``'s weight gradient needs it): two tensors of the hidden width, 4 MiB per
block at ``gpt/mid``. ``g`` is one elementwise op of ``h``: the backward can compute it again, with the same bits.

Mechanism (no saved-tensor hook). Inside :func:`mixprec.autocast.saved_dtype.saved_in_compute` (the ``saved=compute``
option, every bf16 policy's default, and ``saved=rebuild``) a Python kernel on the device's autocast key for
``aten::gelu`` and ``aten::silu`` (ops the autocast lists leave alone: it does what the fallthrough did) *marks* the
output: its class becomes :class:`LeanInput`, a ``torch.Tensor`` subclass that runs every torch function as a plain
tensor except ``F.linear`` (``nn.Linear``), which it runs as one autograd function with the plain path's forward
(autocast's casts of the weight and bias, the same kernel: the same output bits), keeping ``h`` (kept anyway by the
activation's own node) instead of ``g``, and the weight's cast copy as torch's linear keeps it. Its backward runs the
activation again on ``h`` and the matrix products of torch's own ``addmm``/``mm`` backward (``grad_y @ W``,
``grad_y.T @ g``) and the bias's row sum. The input's gradient goes to the marked tensor as in the plain graph: the
activation's own node then runs torch's backward of it, and hooks on the output (``register_hook``, ``retain_grad``,
FSDP2's pre-backward) fire as before. The weight and bias are cast once per autocast block and shared by every lean
read (:func:`cast_region`, as autocast's cast cache shares one copy among plain reads): a weight read several times
(shared layers, a discriminator on real and fake in one block, a double backward) has its bf16 gradients summed at
that one copy and cast once, as in the plain path. So every gradient equals the unfused ops' bit for bit
(tests/autocast/test_lean_linear.py); the graph differs only in what the Linear's node keeps. An output used elsewhere as well
(a residual, a second head) keeps its other uses' saved tensors as before. Left as it was: a weight read by a lean
and by a plain Linear in one block (two copies, its two gradients summed in fp32: within half a bf16 ulp of the plain
bf16 sum), a ``.data`` write to the output before the Linear reads it (invisible to version counters: the backward
computes the output again, unwritten; write under ``torch.no_grad()``).

Marked only where this is exact and invisible: grad enabled, the input requiring grad, a plain tensor, eager (not
while torch.compile, a dispatch mode, ``torch.jit`` or a ``torch.func`` transform traces: the compiler's own
partitioner recomputes such ops; not under forward-mode AD). Fused only when the marked tensor reaches ``F.linear`` as
it came (not a view, not written in place since: its version counter is checked) with plain weights; the first
fusion releases the activation's input (a second consumer takes the plain path). Double backward (gradient
penalties, second-order methods) works: the backward is built from differentiable ops on saved inputs (``h`` is an
input of the function, so the weight gradient is differentiated through it).

Visible to a caller: inside ``mp.autocast()`` with grad enabled, ``type(F.gelu(h))`` is :class:`LeanInput`
(``isinstance(..., torch.Tensor)`` holds; every op on it returns a plain tensor; it pickles as a plain tensor). A
marked output kept after backward keeps its input alive until its first fusion. No host sync.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["LeanInput", "ACTIVATIONS", "activation_kernel", "cast_region", "mark"]


#: aten activation op -> its keyword arguments besides the input, in schema order
ACTIVATIONS: dict[str, tuple[str, ...]] = {"gelu": ("approximate",), "silu": ()}
_LINEARS = (F.linear, torch._C._nn.linear)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LeanInput(torch.Tensor):
    """A marked activation output (module docstring): a plain tensor for every torch function except ``F.linear``,
    which keeps the activation's input for backward instead of this output. Same shape, dtype and autograd history as
    the op's output: it is that tensor, its class changed."""

    _mixprec_input: torch.Tensor | None   # the activation's input (None once a fusion released it)
    _mixprec_op: str                      # the activation (a key of ACTIVATIONS)
    _mixprec_kwargs: dict[str, Any]
    _mixprec_version: int

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _LINEARS and args and type(args[0]) is cls:
            fused = _fused_linear(*args, **kwargs)
            if fused is not None:
                return fused
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, **kwargs: Any) -> str:
        return _plain(self).__repr__(**kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _plain(self).__reduce_ex__(protocol)


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def mark(out: torch.Tensor, x: torch.Tensor, op: str, op_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """``out`` (the output of activation ``op`` on ``x``) marked for a lean ``F.linear`` when that is exact and
    invisible (module docstring); else ``out`` as it is. The caller runs inside ``saved_in_compute``."""
    if (not torch.is_grad_enabled() or not x.requires_grad or type(out) is not torch.Tensor
            or type(x) is not torch.Tensor or _traced()):
        return out
    out.__class__ = LeanInput
    out._mixprec_input, out._mixprec_op, out._mixprec_kwargs = x, op, dict(op_kwargs or {})
    out._mixprec_version = out._version
    return out


def _fused_linear(x: LeanInput, weight: Any, bias: Any = None) -> torch.Tensor | None:
    op = x._mixprec_op
    if (x._version != x._mixprec_version or x._mixprec_input is None or not torch.is_grad_enabled()
            or type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN)):
        return None
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    h, x._mixprec_input = x._mixprec_input, None   # the first fusion releases the activation's input
    with torch._C.DisableTorchFunctionSubclass():
        weight_c, bias_c = _region_cast(weight, dtype, device_type), _region_cast(bias, dtype, device_type)
        return _LeanLinear.apply(x, h, weight_c, bias_c, op, x._mixprec_kwargs, dtype)


class _Region(threading.local):
    depth = 0
    casts: dict[int, tuple[torch.Tensor, int, torch.dtype, torch.Tensor]]


_region = _Region()


@contextmanager
def cast_region() -> Iterator[None]:
    """Inside (outermost: until it exits), each parameter a lean Linear reads is cast once, and every lean read of it
    shares that cast, as ``torch.autocast``'s cast cache shares one copy among plain reads until the outermost block
    exits: the uses' weight gradients are then summed in the 16-bit dtype at the copy and cast once, bit for bit as
    the plain path. Entered by :func:`mixprec.autocast.saved_dtype.saved_in_compute`. Per thread."""
    if _region.depth == 0:
        _region.casts = {}
    _region.depth += 1
    try:
        yield
    finally:
        _region.depth -= 1
        if _region.depth == 0:
            _region.casts = {}


def _region_cast(t: torch.Tensor | None, dtype: torch.dtype | None, device_type: str) -> torch.Tensor | None:
    """:func:`_cast` of ``t``, differentiable, shared by every lean read of the same leaf tensor inside the current
    :func:`cast_region` while its version counter stays, as autocast's cache keeps leaves that require grad (and
    nothing while ``torch.is_autocast_cache_enabled()`` is off)."""
    if not _eligible(t, dtype, device_type):
        return t
    if not (t.is_leaf and t.requires_grad) or _region.depth == 0 or not torch.is_autocast_cache_enabled():
        return t.to(dtype)   # as autocast: no cache for these, nor where its cache is off (a selective recompute)
    held = _region.casts.get(id(t))
    if held is not None and held[0] is t and held[1] == t._version and held[2] == dtype:
        return held[3]
    cast = t.to(dtype)
    _region.casts[id(t)] = (t, t._version, dtype, cast)
    return cast


def _eligible(t: torch.Tensor | None, dtype: torch.dtype | None, device_type: str) -> bool:
    """Whether autocast casts ``t`` for a lower-precision op (``cached_cast``): a floating tensor of the device, not
    fp64, not in ``dtype`` already (None: autocast is off)."""
    return (t is not None and dtype is not None and t.is_floating_point() and t.dtype not in (torch.float64, dtype)
            and t.device.type == device_type)


def _cast(t: torch.Tensor, dtype: torch.dtype | None, device_type: str) -> torch.Tensor:
    """Autocast's cast of an argument of a lower-precision op, without the cache; anything not eligible as it is."""
    return t.to(dtype) if _eligible(t, dtype, device_type) else t


class _LeanLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (``weight`` and ``bias`` cast already, as autocast casts them) keeping ``h``
    where ``x = op(h)`` instead of ``x``, and the weight as torch's linear keeps it (module docstring). ``x``'s
    gradient goes to ``x`` (the activation's own node then runs torch's backward of the op; hooks on ``x`` fire);
    ``h`` gets none from here (it is an input so that a double backward differentiates the weight gradient
    through it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                op: str, op_kwargs: dict[str, Any], dtype: torch.dtype | None) -> torch.Tensor:
        device_type = x.device.type
        y = F.linear(_cast(x, dtype, device_type), weight, bias)
        ctx.save_for_backward(h, weight)
        ctx.op, ctx.op_kwargs, ctx.dtype = op, op_kwargs, dtype
        ctx.x_dtype, ctx.x_shape, ctx.has_bias = x.dtype, x.shape, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        h, weight = ctx.saved_tensors
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        device_type = grad_y.device.type
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:   # torch's mm backward: grad_y @ W, back to x's dtype as autocast's cast's backward
            grad_x = grad_2d.mm(weight).view(ctx.x_shape).to(ctx.x_dtype)
        if need_w:   # grad_y.T @ x, x computed again from h
            x_c = _cast(getattr(torch.ops.aten, ctx.op).default(h, **ctx.op_kwargs), ctx.dtype, device_type)
            grad_w = grad_2d.t().mm(x_c.reshape(-1, x_c.shape[-1]))
        if need_b and ctx.has_bias:
            grad_b = grad_2d.sum(0)
        return grad_x, None, grad_w, grad_b, None, None, None


def _traced() -> bool:
    """Whether a transform or tracer is active that a custom autograd function would change: torch.compile, a
    dispatch mode, ``torch.jit`` tracing, a ``torch.func`` transform, or forward-mode AD (a dual level open: the
    function has no ``jvp``)."""
    from torch.autograd import forward_ad
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode
    return (torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or torch.jit.is_tracing()
            or torch._C._functorch.peek_interpreter_stack() is not None or forward_ad._current_level >= 0)


def activation_kernel(name: str, device_type: str, is_on: Callable[[], bool]) -> Callable[..., Any]:
    """The autocast-key kernel of ``aten::<name>`` (one of :data:`ACTIVATIONS`) for ``device_type``: the op with that
    device's autocast off (what the fallthrough did; a redispatch below the key recursed under torch.compile's Python
    dispatcher), its output marked (:func:`mark`) when ``is_on()``."""
    op = getattr(torch.ops.aten, name).default
    names = ACTIVATIONS[name]

    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast(device_type, enabled=False):
            out = op(x, *args, **kwargs)
        if not torch.is_grad_enabled() or not is_on():
            return out
        return mark(out, x, name, {**dict(zip(names, args)), **kwargs})
    return kernel
