"""Find where a batch first goes non-finite: the batch, a module's forward, the loss, or the backward.

:func:`locate_nonfinite` re-runs one batch under a policy's autocast with a forward pre-hook and
a forward hook on every module (removed before it returns, whatever happens) and names the
first module, in execution order, whose output holds inf/NaN while its inputs were finite
(for example a feed-forward activation above fp16's 65504). A parent whose own code (not a child
module) produced the value is named, since it is the innermost module that ran the op.

Order of the checks, first hit wins:

1. ``"input"``: the batch itself holds non-finite floats; the report names the first module
   that consumed them (or none, when only ``loss_fn`` did).
2. ``"forward"``: the first module call to finish with finite inputs and a non-finite output.
   Its output is recomputed once in fp32 with autocast off, so the report tells an overflow
   (finite in fp32, above the format's max) from a genuine NaN source (non-finite in fp32 too).
3. ``"loss"``: the forward pass is finite, ``loss_fn``'s result is not.
4. ``"backward"``: forward and loss are finite; one backward pass (``torch.autograd.grad`` of
   ``loss * loss_scale``, nothing is written to ``.grad``) names the module that turned a finite
   gradient reaching its output into a non-finite gradient for its inputs or its parameters,
   the one the backward reaches first; or reports that the gradient reaching the model's
   output is already non-finite (the loss's own backward overflows).

Modules that emit ±inf by design (an additive attention mask built in a module) are reported
like any other. The re-run leaves no trace: buffers (BatchNorm statistics) are restored and the
CPU/CUDA RNG state is forked, so training continues as if it had not happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from mixprec.formats import get_format
from mixprec.policy.policy import Policy, cast_floating
from mixprec.policy.tree import tensors

__all__ = ["NonFiniteReport", "locate_nonfinite"]


@dataclass(frozen=True)
class NonFiniteReport:
    """Where a batch first went non-finite (see the module docstring for the four checks).

    Attributes:
        where: ``"input"``, ``"forward"``, ``"loss"`` or ``"backward"``.
        module: qualified name of the module (``""`` is the model itself); None when no module
            is to blame (``"loss"``, a non-finite gradient already at the model's output, or a
            bad batch that only ``loss_fn`` read).
        module_type: the module's class name (``""`` when ``module`` is None).
        dtype: dtype of the offending tensor (the output in ``"forward"``, the gradient in
            ``"backward"``), else None.
        input_amax: max |x| over the module's floating inputs (``"backward"``: over the gradient
            reaching its output), as an fp32 number; inf/nan when they hold such values.
        output_amax: max |y| over its floating outputs (``"backward"``: over the gradients it
            produced); inf or nan.
        output_amax_fp32: ``"forward"`` only: the same output recomputed in fp32 with autocast
            off; finite means the format overflowed. None where not recomputed.
        kind: ``"inf"``, ``"nan"`` or ``"inf and nan"``: what the offending tensor holds.
        loss_finite: whether ``loss_fn``'s result was finite.
        loss_scale: the factor the backward pass multiplied the loss by.
        tensor: ``"backward"`` only: which gradients went non-finite (``"its input gradient"``,
            ``"the gradient of its parameter 'bias'"``).
    """

    where: str
    module: str | None
    module_type: str = ""
    dtype: torch.dtype | None = None
    input_amax: float | None = None
    output_amax: float | None = None
    output_amax_fp32: float | None = None
    kind: str = ""
    loss_finite: bool = False
    loss_scale: float = 1.0
    tensor: str = ""

    @property
    def module_text(self) -> str:
        """``'big' (Linear)``, ``the model (GPT)`` or ``no module``."""
        if self.module is None:
            return "no module"
        return f"the model ({self.module_type})" if self.module == "" else f"{self.module!r} ({self.module_type})"

    def __str__(self) -> str:
        dtype = "" if self.dtype is None else get_format(self.dtype).name
        if self.where == "input":
            first = f"first read by {self.module_text}" if self.module is not None else "read only by the loss function"
            return f"the batch itself holds {self.kind} ({first}): fix the data; precision cannot"
        if self.where == "forward":
            text = (f"{self.module_text} produced {self.kind} in {dtype} from finite inputs "
                    f"(input amax {_num(self.input_amax)}, output amax {_num(self.output_amax)})")
            if self.output_amax_fp32 is not None:
                if math.isfinite(self.output_amax_fp32):
                    text += (f"; in fp32 its output amax is {_num(self.output_amax_fp32)}, above {dtype}'s max "
                             f"{_num(get_format(self.dtype).max)}: an overflow")
                else:
                    text += "; it is non-finite in fp32 too: not a range problem"
            return text
        if self.where == "loss":
            return f"the forward pass is finite but the loss is {self.kind}: the loss function produced it"
        if self.module is None:
            return (f"the gradient reaching the model's output is already {self.kind} at loss scale "
                    f"{_num(self.loss_scale)}: the loss's own backward overflows")
        return (f"backward: {self.module_text} turned a finite {dtype} gradient (amax {_num(self.input_amax)}) into "
                f"{self.kind} in {self.tensor or 'its gradients'} at loss scale {_num(self.loss_scale)}")


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


def _floats(tree: Any) -> list[torch.Tensor]:
    """The floating tensors in a (nested) tree (containers as :mod:`mixprec.policy.tree`)."""
    return [t for t in tensors(tree) if t.is_floating_point()]


def _stats(tensors: list[torch.Tensor]) -> tuple[bool, float | None, torch.dtype | None]:
    """(all finite, amax as a float, dtype of the first non-finite tensor or of the first tensor).

    One host sync."""
    if not tensors:
        return True, None, None
    with torch.no_grad():
        amax_fp32 = torch.stack([t.detach().abs().amax().float().to(tensors[0].device) if t.numel() else
                                 torch.zeros((), device=tensors[0].device) for t in tensors])
        values = amax_fp32.tolist()
    bad = [t.dtype for t, v in zip(tensors, values) if not math.isfinite(v)]
    amax = max(values, key=lambda v: (math.isnan(v), v))  # NaN outranks inf outranks finite
    return not bad, amax, bad[0] if bad else tensors[0].dtype


def _kind(tensors: list[torch.Tensor]) -> str:
    has_nan = any(bool(torch.isnan(t).any()) for t in tensors)
    has_inf = any(bool(torch.isinf(t).any()) for t in tensors)
    return " and ".join(k for k, v in (("inf", has_inf), ("nan", has_nan)) if v) or "no non-finite value"


@dataclass
class _Call:
    """One module call seen by the hooks."""

    name: str
    module: nn.Module
    start: int                                 # order of the pre-hook (execution start)
    in_finite: bool = True
    in_amax: float | None = None
    out_finite: bool = True
    out_amax: float | None = None
    out_dtype: torch.dtype | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)    # floating, requiring grad
    outputs: list[torch.Tensor] = field(default_factory=list)   # floating, requiring grad
    out_fp32_amax: float | None = None
    kind: str = ""


class _Recorder:
    """Forward pre/post hooks on every module; records each call in completion order.

    Host syncs: one per hook call (the finite check and amax of its tensors).
    """

    def __init__(self, model: nn.Module, device_type: str, *, fp32_figure: bool = True) -> None:
        self.model, self.fp32_figure = model, fp32_figure
        self.device_type = device_type
        self.names = {id(m): n for n, m in model.named_modules()}
        self.calls: list[_Call] = []             # in completion order
        self.culprit: _Call | None = None        # first finished call: finite in, non-finite out
        self._stack: list[_Call] = []
        self._started = 0
        self._busy = False                       # True while recomputing in fp32 (no recording)

    def install(self) -> list[Any]:
        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self.post, with_kwargs=True))
        return handles

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy:
            return
        inputs = _floats((args, kwargs))
        finite, amax, _ = _stats(inputs)
        self._stack.append(_Call(self.names.get(id(module), "?"), module, self._started, finite, amax,
                                 inputs=[t for t in inputs if t.requires_grad]))
        self._started += 1

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._busy or not self._stack:
            return
        call = self._stack.pop()
        outputs = _floats(output)
        call.out_finite, call.out_amax, call.out_dtype = _stats(outputs)
        call.outputs = [t for t in outputs if t.requires_grad]
        self.calls.append(call)
        if self.culprit is None and call.in_finite and not call.out_finite:
            self.culprit = call
            call.kind = _kind(outputs)
            call.out_fp32_amax = self._recompute_fp32(module, args, kwargs) if self.fp32_figure else None

    def _recompute_fp32(self, module: nn.Module, args: tuple, kwargs: dict) -> float | None:
        """The module's output amax with fp32 params and inputs, autocast off (None if it fails)."""
        self._busy = True
        try:
            tensors = {n: t.float() for n, t in module.named_parameters()}
            tensors.update({n: b.float() if b.is_floating_point() else b.clone() for n, b in module.named_buffers()})
            with torch.no_grad(), torch.autocast(self.device_type, enabled=False):
                out = torch.func.functional_call(module, tensors, cast_floating(args, torch.float32),
                                                 cast_floating(kwargs, torch.float32))
            _, amax, _ = _stats(_floats(out))
            return amax
        except (RuntimeError, TypeError, ValueError):  # a module that cannot run in fp32 here: no figure
            return None
        finally:
            self._busy = False


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def locate_nonfinite(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                     policy: str | Policy, device: str | torch.device | None = None, *,
                     loss_scale: float = 1.0, fp32_figure: bool = True) -> NonFiniteReport | None:
    """Re-run ``loss_fn(model, batch)`` under ``policy``'s autocast and say where it first went non-finite.

    Args:
        model: the model as it is (parameters in whatever dtype they are stored; a model
            prepared by :class:`mixprec.MixedPrecision` keeps its keep_fp32 regions).
        batch: one batch; its floating tensors are cast to ``policy.param_dtype`` and every
            tensor is moved to ``device``.
        loss_fn: ``loss_fn(model, batch) -> loss`` (a scalar floating tensor).
        policy: a :class:`~mixprec.Policy` or its text (a preset name or ``key=value,...``).
        device: where to run; None: the model's device.
        loss_scale: the loss is multiplied by it for the backward check (the engine's current
            scale, to reproduce an fp16 gradient overflow).
        fp32_figure: recompute the culprit in fp32 for ``output_amax_fp32`` (False under FSDP2: re-calling
            a sharded module all-gathers on one rank only).

    Returns:
        A :class:`NonFiniteReport`, or None when the forward pass, the loss and every gradient
        are finite (a healthy batch, or a failure this re-run does not reproduce).

    The model's training mode is used as it is. Buffers are restored and the RNG forked, so the
    re-run changes no state; no hook remains afterwards, even when ``loss_fn`` raises. Host
    syncs: one per module call (a diagnostic, not for the training loop), plus a few more.

    Raises:
        ValueError / TypeError: a bad policy (as :meth:`Policy.parse`), or ``loss_scale`` <= 0.
    """
    policy = Policy.parse(policy)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (0 < loss_scale < math.inf):
        raise ValueError(f"locate_nonfinite loss_scale={loss_scale!r} is not allowed; it must be a finite number "
                         "> 0, e.g. the engine's current scale float(mp.loss_scale.scale), or 1.0")
    device = _model_device(model) if device is None else torch.device(device)
    batch = cast_floating(batch, policy.param_dtype, device)
    batch_finite, _, _ = _stats(_floats(batch))
    recorder = _Recorder(model, device.type, fp32_figure=fp32_figure)
    fork_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        loss = _rerun_forward(model, batch, loss_fn, policy, device, recorder)
        return _verdict(model, batch, batch_finite, loss, recorder, float(loss_scale))


def _rerun_forward(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], policy: Policy,
                   device: torch.device, recorder: _Recorder) -> Any:
    """``loss_fn(model, batch)`` under ``policy``'s autocast with ``recorder``'s hooks, grad enabled; the hooks
    are removed and the buffers restored afterwards, even when ``loss_fn`` raises."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handles = recorder.install()
    try:
        with torch.enable_grad(), torch.autocast(device.type, dtype=policy.compute_dtype,
                                                 enabled=policy.is_mixed):
            return loss_fn(model, batch)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _verdict(model: nn.Module, batch: Any, batch_finite: bool, loss: Any, recorder: _Recorder,
             loss_scale: float) -> NonFiniteReport | None:
    """Checks 1-4 of the module docstring in order (input, forward, loss, backward) on the recorded re-run."""
    loss_t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
    loss_finite = bool(torch.isfinite(loss_t).all())
    if not batch_finite:
        readers = [c for c in recorder.calls if not c.in_finite]
        first = readers[0] if readers else None
        return NonFiniteReport("input", None if first is None else first.name,
                               "" if first is None else type(first.module).__name__,
                               kind=_kind(_floats(batch)), input_amax=None if first is None else first.in_amax,
                               loss_finite=loss_finite, loss_scale=loss_scale)
    if recorder.culprit is not None:
        c = recorder.culprit
        return NonFiniteReport("forward", c.name, type(c.module).__name__, c.out_dtype, c.in_amax, c.out_amax,
                               c.out_fp32_amax, c.kind, loss_finite, loss_scale)
    if not loss_finite:
        return NonFiniteReport("loss", None, kind=_kind([loss_t]), loss_finite=False, loss_scale=loss_scale)
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        return None
    return _locate_backward(model, loss, recorder.calls, loss_scale)

def _locate_backward(model: nn.Module, loss: torch.Tensor, calls: list[_Call],
                     loss_scale: float) -> NonFiniteReport | None:
    """One backward pass over the recorded graph: check 4, ``"backward"``, of the module docstring."""
    own_params = {id(c): [p for p in c.module.parameters(recurse=False) if p.requires_grad] for c in calls}
    unique: dict[int, torch.Tensor] = {}
    for c in calls:
        for t in (*c.inputs, *c.outputs, *own_params[id(c)]):
            unique.setdefault(id(t), t)
    if not unique:
        return None
    tensors = list(unique.values())
    try:
        grads = torch.autograd.grad(loss * loss_scale, tensors, allow_unused=True)
    except RuntimeError:  # e.g. a recorded tensor was modified in place: no backward verdict
        return None
    grad_of = {id(t): g for t, g in zip(tensors, grads) if g is not None}
    finite = {k: bool(torch.isfinite(g).all()) for k, g in grad_of.items()}  # a sync per tensor
    if all(finite.values()):
        return None

    def bad(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [grad_of[id(t)] for t in ts if not finite.get(id(t), True)]

    candidates = [c for c in calls if not bad(c.outputs) and bad([*c.inputs, *own_params[id(c)]])]
    if not candidates:  # every non-finite gradient came in through some module's output
        root_out = [grad_of[id(t)] for c in calls if c.module is model for t in c.outputs if id(t) in grad_of]
        _, amax, dtype = _stats(root_out)
        return NonFiniteReport("backward", None, dtype=dtype, output_amax=amax,
                               kind=_kind([g for g in root_out if not bool(torch.isfinite(g).all())]),
                               loss_finite=True, loss_scale=loss_scale)
    c = max(candidates, key=lambda call: call.start)  # the backward reaches the latest-started first
    produced = bad([*c.inputs, *own_params[id(c)]])
    param_names = {id(p): n for n, p in c.module.named_parameters(recurse=False)}
    which = ["its input gradient" if not finite.get(id(t), True) else None for t in c.inputs]
    which += [f"the gradient of its parameter {param_names[id(p)]!r}" for p in own_params[id(c)]
              if not finite.get(id(p), True)]
    grads_in = [grad_of[id(t)] for t in c.outputs if id(t) in grad_of]
    _, in_amax, in_dtype = _stats(grads_in)
    _, out_amax, out_dtype = _stats(produced)
    # a parameter's gradient is returned in the parameter's dtype; the overflow happened in the
    # dtype of the gradient flowing through the module, which is the one to report
    return NonFiniteReport("backward", c.name, type(c.module).__name__, in_dtype or out_dtype, in_amax, out_amax,
                           None, _kind(produced), True, loss_scale, tensor=" and ".join(w for w in which if w))
