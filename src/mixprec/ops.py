"""Autocast-safe ops: small functions that make the known autocast traps behave the same everywhere.

Each function's docstring names the trap it removes. None of them syncs the host with the
device: they only enqueue tensor ops and read Python-side autocast state.

================================  =======================================================
function                          trap it removes
================================  =======================================================
:func:`mask_value`,               ``-1e10`` / ``-inf`` masks overflow fp16 or NaN softmax
:func:`masked_fill_min`
:func:`rms_norm`,                 squares overflow and tiny eps underflows in 16-bit norms
:func:`layer_norm_stats`
:func:`binary_cross_entropy`      probability BCE refused by CUDA autocast, allowed on CPU
:func:`checkpoint`                recompute under a different autocast state than forward
:func:`custom_fwd`,               custom autograd Functions: mixed input dtypes, backward
:func:`custom_bwd`                in another dtype than forward
:func:`autocast_dtype`,           fp32 buffers receiving autocast outputs (``index_put``)
:func:`zeros_like_output`
================================  =======================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.autocast.recompute_state import recompute_context_fn

__all__ = [
    "mask_value",
    "masked_fill_min",
    "rms_norm",
    "layer_norm_stats",
    "binary_cross_entropy",
    "checkpoint",
    "custom_fwd",
    "custom_bwd",
    "autocast_dtype",
    "zeros_like_output",
]

_REDUCTIONS = ("mean", "sum", "none")


def _device_type(device: str | torch.device) -> str:
    """``"cuda:1"`` / ``torch.device("cuda", 1)`` → ``"cuda"``; rejects anything else clearly."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        try:
            return torch.device(device).type
        except RuntimeError:
            raise ValueError(f"device={device!r} is not a device; use e.g. 'cpu', 'cuda', 'cuda:1', 'mps'") from None
    raise TypeError(f"device={device!r} must be a str or torch.device, e.g. 'cpu' or 'cuda:0'")


def _check_floating(name: str, dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name}={dtype!r} must be a floating torch.dtype (torch.float32, torch.bfloat16, "
                        "torch.float16, ...)")


# ---------------------------------------------------------------------------- masks
def mask_value(dtype: torch.dtype) -> float:
    """The most negative finite value of ``dtype`` (``torch.finfo(dtype).min``), for attention masks.

    fp16: -65504.0; bf16: about -3.39e38; fp32: about -3.40e38. Unlike ``-1e10`` (overflows fp16:
    ``masked_fill`` raises, and the additive form ``mask * -1e10`` gives ``0 * -inf = NaN``) and
    ``-inf`` (a fully masked row softmaxes to NaN), it is representable in ``dtype``, so a fully
    masked row softmaxes to a uniform row. No host sync (pure Python).

    Raises:
        TypeError: ``dtype`` is not a floating dtype.
    """
    _check_floating("dtype", dtype)
    return float(torch.finfo(dtype).min)


def masked_fill_min(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scores`` with the entries where ``mask`` is True set to :func:`mask_value` of its dtype.

    Args:
        scores: floating tensor of any shape, e.g. attention logits ``(B, nh, T, T)``, in any
            floating dtype (fp16, bf16, fp32, ...); the result keeps shape and dtype.
        mask: bool tensor broadcastable to ``scores``; True means "masked out".

    A partly masked row then softmaxes to exactly 0 at the masked entries. A **fully masked
    row softmaxes to a uniform row** (``1 / row_length`` everywhere): finite, not NaN — the
    caller decides whether to zero such rows. Prefer this over adding ``mask * big_negative``:
    adding to a finite minimum can still overflow to ``-inf`` in fp16. Out of place; no host
    sync.

    Raises:
        TypeError: ``scores`` is not floating, or ``mask`` is not a bool tensor.
    """
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise TypeError(f"scores must be a floating tensor, got {getattr(scores, 'dtype', type(scores).__name__)}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = masked out), got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}; convert with mask.bool()")
    return scores.masked_fill(mask, mask_value(scores.dtype))


# ---------------------------------------------------------------------------- norms
def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 <= float(eps) < float("inf")):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0, e.g. 1e-6")
    return float(eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight``, statistics in fp32.

    Args:
        x: ``(..., D)`` floating tensor, any floating dtype.
        weight: optional ``(D,)`` gain (any floating dtype; applied in fp32).
        eps: added to the fp32 mean of squares, so ``1e-12`` stays ``1e-12`` (in fp16 it would
            round to 0 and a constant-zero row would give ``0 * rsqrt(0) = NaN``).

    Returns:
        ``(..., D)`` in ``x.dtype``. The square, mean, eps and rsqrt are computed in fp32 whatever
        the input dtype, so fp16 values above ~256 (whose squares overflow fp16) are fine. For
        example, a hand-written fp16 RMSNorm of a ``(1, 1280)`` tensor of 300s returns zeros
        (``rsqrt(inf) = 0``); this returns ones. Elementwise ops only, so autocast does not change
        them. No host sync.

    Raises:
        TypeError: ``x`` is not floating. ValueError: ``eps`` is negative or not finite.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    eps = _check_eps(eps)
    x_fp32 = x.float()
    mean_sq_fp32 = x_fp32.square().mean(dim=-1, keepdim=True)  # (..., 1)
    y_fp32 = x_fp32 * torch.rsqrt(mean_sq_fp32 + eps)
    if weight is not None:
        y_fp32 = y_fp32 * weight.float()
    return y_fp32.to(x.dtype)


def layer_norm_stats(x: torch.Tensor, dim: int | Sequence[int] = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased, as LayerNorm) variance of ``x`` over ``dim``, computed and **returned in fp32**.

    Args:
        x: floating tensor, any floating dtype.
        dim: reduced dim(s); kept as size 1 so the stats broadcast against ``x``.

    Returns:
        ``(mean, var)``, each fp32 with ``x``'s shape and ``dim`` reduced to 1. They stay fp32 on
        purpose: the variance of fp16 data can exceed fp16's max (values of ±300 give 90000 >
        65504), so casting it back would re-create the overflow :func:`rms_norm` avoids. Normalise with
        ``((x.float() - mean) * torch.rsqrt(var + eps)).to(x.dtype)``: eps is then added in fp32.
        No host sync.

    Raises:
        TypeError: ``x`` is not floating.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    var_fp32, mean_fp32 = torch.var_mean(x.float(), dim=dim, correction=0, keepdim=True)
    return mean_fp32, var_fp32


# ---------------------------------------------------------------------------- BCE
def binary_cross_entropy(probs: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, *,
                         reduction: str = "mean") -> torch.Tensor:
    """Probability-space binary cross-entropy, always in fp32 with autocast disabled.

    **Prefer** ``F.binary_cross_entropy_with_logits`` on the logits: it is numerically stable
    (log-sum-exp) and autocast-safe on every device. Use this only where the model already
    outputs probabilities.

    Args:
        probs: probabilities in ``[0, 1]``, any shape, any floating dtype (e.g. a bf16 sigmoid
            output from an autocast region).
        target: same shape as ``probs``; cast to fp32.
        weight: optional rescaling weight broadcastable to ``probs``; cast to fp32.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns:
        fp32 loss: a scalar, or ``probs``' shape for ``reduction="none"``. Gradients flow back to
        ``probs`` in its own dtype.

    CUDA autocast raises "binary_cross_entropy ... unsafe to autocast" while CPU autocast
    silently runs it; here autocast is disabled for ``probs``' device type and inputs are upcast,
    so every device computes the same fp32 loss and never raises. ``log`` is clamped at -100 as in
    torch. No host sync.

    Raises:
        TypeError: ``probs`` is not floating. ValueError: unknown ``reduction``.
    """
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise TypeError(f"probs must be a floating tensor, got {getattr(probs, 'dtype', type(probs).__name__)}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not allowed; choose one of {_REDUCTIONS}")
    with torch.autocast(probs.device.type, enabled=False):
        return F.binary_cross_entropy(probs.float(), target.float(),
                                      weight=None if weight is None else weight.float(), reduction=reduction)


# ---------------------------------------------------------------------------- checkpoint
def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True,
               selective: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Activation checkpointing whose recompute runs under exactly the forward's autocast state.

    ``fn(*args, **kwargs)`` runs now without saving its intermediate activations; backward runs it
    again to rebuild them. Wraps ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    (torch's own check then raises ``CheckpointError`` if a recomputed saved tensor differs in
    shape, dtype or device) and adds a recompute context (:mod:`mixprec.autocast.recompute_state`) that
    captures, at call time, the autocast ``(device type, enabled, dtype, cache_enabled)`` for ``cpu``, for
    every device type of the tensor arguments and for the current accelerator, and re-enters exactly those states
    (and which devices had :func:`mixprec.autocast.op_plan.planned_kernels` and
    :func:`mixprec.autocast.portable.portable_ops` on: the recompute makes its forward's kernel
    choices and casts) innermost during recompute, verifying that they took effect (``RuntimeError`` if not).

    So a recompute in a backward that runs outside the autocast region, under a different
    dtype, or after nested regions were left, computes in the forward's dtypes. (Under the engine, a plain
    ``torch.utils.checkpoint`` recomputes with the engine's op lists in the backward passes it holds, see
    :mod:`mixprec.engine.autocast_scope`; this function carries its forward's state in any backward.) Without it, a
    naive recompute outside autocast ran bf16 layers in fp32 (dtype-mismatch error or metadata
    mismatch), and fairscale re-entered autocast with the default fp16 instead of bf16.

    Args:
        fn: the function or module to checkpoint.
        *args, **kwargs: passed to ``fn`` (keyword arguments too, as torch's non-reentrant mode).
        preserve_rng_state: replay the forward's RNG state (dropout) in the recompute.
        selective: a selective-checkpoint policy (``policy_fn(ctx, op, *args, **kwargs)`` returning a
            ``torch.utils.checkpoint.CheckpointPolicy``, as ``create_selective_checkpoint_contexts`` takes): the
            outputs of the ops it marks ``MUST_SAVE`` are kept from the forward, only the others are recomputed
            (:mod:`mixprec.memory.recompute`). None: the whole of ``fn`` is recomputed. A selective region runs
            its forward and recompute with autocast's cast cache off (each casts afresh: the op counts torch's
            selective checkpoint compares then agree even after an earlier forward in the same autocast region).

    Returns:
        ``fn``'s output. Shapes and dtypes are ``fn``'s own. No host sync.
    """
    context_fn = recompute_context_fn(args, kwargs, selective)   # the forward's autocast state, captured now
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                             context_fn=context_fn, **kwargs)


# ---------------------------------------------------------------------------- custom Functions
def custom_fwd(fwd: Callable | None = None, *, device_type: str | torch.device,
               cast_inputs: torch.dtype | None = None) -> Callable:
    """Decorate ``forward`` of a ``torch.autograd.Function`` to declare its autocast behaviour.

    A checked pass-through to ``torch.amp.custom_fwd`` (torch >= 2.4), which already handles mixed
    input dtypes and runs ``backward`` in the forward's dtype; use it together with
    :func:`custom_bwd` on ``backward``.

    * ``cast_inputs=None``: ``forward`` runs under the current autocast state, which is recorded
      on ``ctx``; ``backward`` (with :func:`custom_bwd`) re-enters that same state — same enabled
      flag and same dtype (bf16 stays bf16; the pre-2.0 bug ran a bf16 forward's backward in fp16).
    * ``cast_inputs=dtype`` (the op's compute dtype): inside an autocast region, every floating
      tensor argument on ``device_type`` (fp64 excepted, nested lists/tuples/dicts included) is
      cast to ``dtype`` and ``forward`` runs with autocast **disabled**; ``backward`` too. This is
      the fix for non-native kernels that autocast does not reach ("expected m1 and m2 to have the
      same dtype, but got: c10::BFloat16 != float"). Gradients reach each input in its own dtype.
    * Outside an autocast region the decorator is a no-op: no cast happens.

    Args:
        fwd: the ``forward`` staticmethod (omit to use as ``@custom_fwd(device_type=...)``).
        device_type: ``"cpu"``, ``"cuda"``, ``"mps"``... (``"cuda:0"`` is accepted as ``"cuda"``).
        cast_inputs: ``None`` or a floating dtype.

    No host sync.

    Raises:
        TypeError: ``cast_inputs`` is not a floating dtype (torch itself would cast floats to it).
        ValueError: ``device_type`` is not a device.
    """
    device_type = _device_type(device_type)
    if cast_inputs is not None:
        _check_floating("cast_inputs", cast_inputs)
    return torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable | None = None, *, device_type: str | torch.device) -> Callable:
    """Decorate ``backward`` of a ``torch.autograd.Function``: run it under the forward's autocast state.

    Pass-through to ``torch.amp.custom_bwd``; requires ``forward`` decorated with :func:`custom_fwd`
    for the same ``device_type`` (it reads the state that decorator stored on ``ctx``). Incoming
    gradients already have the forward outputs' dtypes, so there is no ``cast_inputs`` here.
    No host sync.

    Raises:
        ValueError: ``device_type`` is not a device.
    """
    return torch.amp.custom_bwd(bwd, device_type=_device_type(device_type))


# ---------------------------------------------------------------------------- buffers
def autocast_dtype(device_type: str | torch.device = "cpu", *,
                   reference_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a matmul/linear on ``reference_dtype`` inputs produces right now on ``device_type``.

    Inside an enabled autocast region: the autocast dtype (bf16 or fp16) — except for fp64
    inputs, which autocast leaves alone. Outside (or with autocast disabled, e.g. in a module the
    policy keeps in fp32): ``reference_dtype`` itself (fp32 by default; pass the param dtype for
    pure-16-bit policies). Use it to allocate buffers that receive autocast outputs in place or by
    index: embeddings, by contrast, are not autocast and stay fp32. Reads Python-side
    autocast state only; no host sync.

    Raises:
        TypeError: ``reference_dtype`` is not floating. ValueError: ``device_type`` is not a device.
    """
    device_type = _device_type(device_type)
    _check_floating("reference_dtype", reference_dtype)
    if torch.is_autocast_enabled(device_type) and reference_dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    return reference_dtype


def zeros_like_output(shape: Sequence[int] | torch.Size, *, device: str | torch.device,
                      reference_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zero tensor of ``shape`` on ``device`` in :func:`autocast_dtype` — a buffer autocast outputs fit.

    ``buf[mask] = linear(x[mask])`` inside a bf16 autocast region fails on an fp32 buffer with
    "Index put requires the source and destination dtypes match, got Float for the destination
    and BFloat16 for the source"; a buffer from this helper is bf16 there and fp32
    outside autocast. ``reference_dtype`` defaults to fp32 (see :func:`autocast_dtype`).
    No host sync.
    """
    dtype = autocast_dtype(device, reference_dtype=torch.float32 if reference_dtype is None else reference_dtype)
    return torch.zeros(tuple(shape), dtype=dtype, device=device)
