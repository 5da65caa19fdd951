"""A Linear that keeps less for backward: the activation's input instead of its output, the fp32 weight instead
of its 16-bit copy. Hook-free; gradients bit for bit the unfused ops' where each weight is read once per block.

Under bf16 autocast, ``fc2(gelu(fc1(x)))`` makes autograd keep, per MLP, GELU's input ``h`` (GELU's own backward
needs it) and GELU's output ``g`` (``fc2``'s weight gradient needs it): two tensors of the hidden width, 4 MiB per
block at ``gpt/mid``. And each Linear keeps autocast's bf16 copy of its fp32 weight (for ``grad_x = grad_y @ W``),
which autocast's cast cache also holds until the outermost autocast block exits. ``g`` is one elementwise op of
``h``, and the copy one cast of the parameter: the backward can make both again, with the same bits.

Mechanism (no saved-tensor hook). Inside :func:`mixprec.autocast.saved_dtype.saved_in_compute` (the ``saved=compute``
option, every bf16 policy's default, and ``saved=rebuild``), the outputs of ops whose kernels mixprec runs are
*marked*: ``gelu`` and ``silu`` (a Python kernel on the autocast key, where the lists leave them alone: it does what
the fallthrough did, then marks) and ``layer_norm``/``rms_norm`` (:mod:`mixprec.autocast.saved_dtype`'s). A marked
output's class becomes :class:`LeanInput`, a ``torch.Tensor`` subclass that runs every torch function as a plain
tensor except ``F.linear`` (``nn.Linear``), which it runs as one autograd function: autocast's casts of the input,
weight and bias (the weight's not cached: its copy is freed after the product), the same kernel, so the same
output bits; it keeps the activation's input ``h`` (kept anyway by the activation's own node; for a norm's output,
the cast input autocast's linear keeps anyway) and the weight parameter itself (no new storage). Its backward casts
the weight again and runs the matrix products of torch's own ``addmm``/``mm`` backward (``grad_y @ W``, and
``grad_y.T @ x`` with ``x`` computed again from ``h``: same op, same input, the same bits) and the bias's row sum.
The input's gradient goes to the marked tensor as in the plain graph: the activation's own node then runs torch's
backward of it, and hooks on the output (``register_hook``, ``retain_grad``, FSDP2's pre-backward) fire as before.
So every gradient equals the unfused ops' bit for bit (tests/test_lean_linear.py) where each weight is read once per
autocast block; the graph differs only in what the Linear's node keeps. An output used elsewhere as well (a
residual, a second head) keeps its other uses' saved tensors as before.

Where they differ (tests/test_lean_linear.py; found by trying to break it):

* **A weight read more than once in one autocast block** (shared layers as in ALBERT, a discriminator called on real
  and fake in one ``mp.autocast()``, a weight read by a lean and a plain Linear): the plain path sums the uses'
  bf16 gradients at autocast's one cached bf16 copy and casts the sum; here each use's gradient is cast to fp32 and
  the sum is fp32. More exact, within half a bf16 ulp of the plain sum for each weight gradient (an optimizer then
  carries such differences on, as any rounding difference).
* **An optimizer step between two backward passes of one retained forward** (``retain_graph=True``, ``step()``,
  ``backward()`` again) raises torch's "modified by an inplace operation", as it does in fp32 training: the Linear
  keeps the parameter itself, which the step changed (the plain autocast path keeps a bf16 copy and computes the
  second backward with the weights the forward used).
* A ``.data`` write to the activation's output before the Linear reads it is invisible (as to torch's version
  counters): the backward computes the output again from the input, unwritten. Write under ``torch.no_grad()``.

Marked only where this is exact and invisible: grad enabled, the input requiring grad, a plain tensor, eager (not
while torch.compile, a dispatch mode, ``torch.jit`` or a ``torch.func`` transform traces: the compiler's own
partitioner recomputes such ops; not under forward-mode AD). Fused only when the marked tensor reaches ``F.linear`` as it came (not a view, not
written in place since: its version counter is checked) with plain weights; the first fusion releases the
activation's input (a second consumer takes the plain path). Double backward (gradient penalties, second-order
methods) works: the backward is built from differentiable ops on saved inputs (``h`` is an input of the function,
so the weight gradient is differentiated through it); there a -mixed weight's two gradients (the forward's
product's and the backward's) are each cast to fp32 and summed in fp32, where the plain path sums them in bf16 at
autocast's copy and then casts: the lean weight gradient is the more exact one, within half a bf16 ulp of the plain.

Visible to a caller: inside ``mp.autocast()`` with grad enabled, ``type(gelu(h))`` is :class:`LeanInput`
(``isinstance(..., torch.Tensor)`` holds; every op on it returns a plain tensor; it pickles as a plain tensor). A
marked activation output kept after backward keeps its input alive until its first fusion. No host sync.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["LeanInput", "ACTIVATIONS", "activation_kernel", "mark"]


#: aten activation op -> its keyword arguments besides the input, in schema order
ACTIVATIONS: dict[str, tuple[str, ...]] = {"gelu": ("approximate",), "silu": ()}
_LINEARS = (F.linear, torch._C._nn.linear)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LeanInput(torch.Tensor):
    """A marked op output (module docstring): a plain tensor for every torch function except ``F.linear``, which
    keeps the activation's input (or the cast input) and the fp32 weight for backward. Same shape, dtype and
    autograd history as the op's output: it is that tensor, its class changed."""

    _mixprec_input: torch.Tensor | None   # the activation's input (None: a norm's output, or released)
    _mixprec_op: str | None               # the activation (a key of ACTIVATIONS), None for a norm's output
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


def mark(out: torch.Tensor, x: torch.Tensor, op: str | None = None,
         op_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """``out`` (the output of ``op`` on ``x``; ``op=None``: a norm's output) marked for a lean ``F.linear`` when that
    is exact and invisible (module docstring); else ``out`` as it is. The caller runs inside ``saved_in_compute``."""
    if (not torch.is_grad_enabled() or not x.requires_grad or type(out) is not torch.Tensor
            or type(x) is not torch.Tensor or _traced()):
        return out
    out.__class__ = LeanInput
    out._mixprec_input, out._mixprec_op, out._mixprec_kwargs = (x if op else None), op, dict(op_kwargs or {})
    out._mixprec_version = out._version
    return out


def _fused_linear(x: LeanInput, weight: Any, bias: Any = None) -> torch.Tensor | None:
    op = x._mixprec_op
    if (x._version != x._mixprec_version or (op is not None and x._mixprec_input is None)
            or not torch.is_grad_enabled() or type(weight) not in _PLAIN
            or (bias is not None and type(bias) not in _PLAIN)):
        return None
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    with torch._C.DisableTorchFunctionSubclass():
        if op is None:   # a norm's output: autocast's cast, differentiable (a double backward reaches x through it)
            return _LeanLinear.apply(_cast(x, dtype, device_type), None, weight, bias, None, {}, dtype)
        h, x._mixprec_input = x._mixprec_input, None   # the first fusion releases the activation's input
        return _LeanLinear.apply(x, h, weight, bias, op, x._mixprec_kwargs, dtype)


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None, device_type: str) -> torch.Tensor | None:
    """Autocast's cast of an argument of a lower-precision op (``cached_cast``, without the cache): a floating
    tensor of the device, not fp64, to ``dtype`` (None: autocast is off); anything else as it is."""
    if (t is None or dtype is None or not t.is_floating_point() or t.dtype in (torch.float64, dtype)
            or t.device.type != device_type):
        return t
    return t.to(dtype)


class _LeanLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` under autocast ``dtype`` (None: off) keeping ``weight`` and, where ``x = op(h)``,
    ``h`` instead of ``x`` (module docstring). ``x``'s gradient goes to ``x`` (the activation's own node then runs
    torch's backward of the op; hooks on ``x`` fire); ``h`` gets none from here (it is an input so that a double
    backward differentiates the weight gradient through it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                op: str | None, op_kwargs: dict[str, Any], dtype: torch.dtype | None) -> torch.Tensor:
        device_type = x.device.type
        y = F.linear(_cast(x, dtype, device_type), _cast(weight, dtype, device_type), _cast(bias, dtype, device_type))
        ctx.save_for_backward(h if op else x, weight)
        ctx.op, ctx.op_kwargs, ctx.dtype = op, op_kwargs, dtype
        ctx.x_dtype, ctx.x_shape, ctx.has_bias = x.dtype, x.shape, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        kept, weight = ctx.saved_tensors
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        device_type = grad_y.device.type
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:   # torch's mm backward: grad_y @ W (W cast again), back to x's dtype as autocast's cast's backward
            grad_x = grad_2d.mm(_cast(weight, ctx.dtype, device_type)).view(ctx.x_shape).to(ctx.x_dtype)
        if need_w:   # grad_y.T @ x, x computed again from h where it is an activation's output
            x_c = _cast(getattr(torch.ops.aten, ctx.op).default(kept, **ctx.op_kwargs) if ctx.op else kept,
                        ctx.dtype, device_type)
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
