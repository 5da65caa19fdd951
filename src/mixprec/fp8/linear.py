"""``Float8Linear``: a drop-in ``nn.Linear`` whose three GEMMs take scaled fp8 operands.

For ``x (M, K)`` and ``W (N, K)`` (``M`` = tokens, ``K`` = ``in_features``, ``N`` = ``out_features``)::

    forward      y  = x  @ W^T     contracts K   operands: input (e4m3), weight (e4m3)
    grad_input   gx = gy @ W       contracts N   operands: grad_output (e5m2 in hybrid), weight
    grad_weight  gW = gy^T @ x     contracts M   operands: grad_output, input

Each GEMM accumulates in fp32 and rounds its output once, to the compute dtype (the autocast
dtype when autocast is on, else the input's dtype) -- as an autocast ``nn.Linear`` does, and
what ``_scaled_mm``'s rowwise kernels require; ``gx`` and ``gW`` are then cast to the input's
and the weight's dtypes (fp32 master weights get a bf16-rounded gradient, as under bf16
autocast). The bias is added outside the fp8 GEMM, in the compute dtype, as autocast's
``F.linear`` does. Scales follow :class:`~mixprec.fp8.scaling.ScaledFloat8`.

Two backends with the same numerics (the fp8 operands are bit-identical; only the fp32
summation order and the place the scale is applied differ):

* ``torch._scaled_mm`` -- fp8 tensor cores on CUDA sm_89+; it also runs on CPU but through a
  reference kernel (measured here at ~0.1 GFLOP/s, ~10^4x slower than a bf16 matmul), so only
  ``use_scaled_mm=True`` selects it there (tests compare the two paths with it);
* emulation -- ``from_fp8`` (``data / scale`` in fp32) of both operands, then an fp32 matmul.

``use_scaled_mm=None`` (auto) resolves per device and per GEMM at call time
(:func:`mixprec.fp8.fp8_available` plus a cached probe of the dtype combination).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.autocast.first_order import first_order_backward
from mixprec.fp8.recipes import ROLES, CurrentScaling, DelayedScaling, Float8Recipe
from mixprec.fp8.scaling import ScaledFloat8

__all__ = ["Float8Linear", "clamped_scales", "fp8_available"]

_SCALED_MM_MULTIPLE = 16  # cuBLASLt fp8: the contraction dim and mat2's dims must be multiples of 16
_MIN_CUDA_CAPABILITY = (8, 9)  # Ada / Hopper and newer have fp8 tensor cores


# --------------------------------------------------------------------------- backend choice
@functools.cache
def _scaled_mm_error(device: torch.device, a_dtype: torch.dtype, b_dtype: torch.dtype,
                     rowwise: bool, out_dtype: torch.dtype) -> str | None:
    """Run a tiny ``_scaled_mm`` with these dtypes on ``device``: None if it works, else the error.

    Cached per argument tuple. Runs one small kernel and syncs once per new combination.
    """
    m = k = n = _SCALED_MM_MULTIPLE
    a = torch.ones(m, k, device=device).to(a_dtype)
    b = torch.ones(n, k, device=device).to(b_dtype).t()  # (K, N), column-major
    scale_a = torch.ones((m, 1) if rowwise else (), device=device)
    scale_b = torch.ones((1, n) if rowwise else (), device=device)
    try:
        y = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        if not bool((y.float() == k).all()):
            return f"torch._scaled_mm gave wrong values for a {m}x{k}x{n} probe"
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def fp8_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether fp8 GEMMs on ``device`` run on fast fp8 hardware through ``torch._scaled_mm``.

    Returns ``(True, reason)`` on CUDA devices of capability >= 8.9 where a probe ``_scaled_mm``
    (e4m3 x e4m3 -> bf16) runs; otherwise ``(False, reason)`` and :class:`Float8Linear` emulates
    (same numerics, fp32 matmul speed). On CPU ``_scaled_mm`` does run, but through a reference
    kernel ~10^4x slower than a bf16 matmul (measured on an AMX Xeon with torch 2.13), so this
    says False; pass ``use_scaled_mm=True`` to use it anyway. Resolved at call time; the probe
    is cached per device and syncs once.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, f"{device}: CUDA is not available in this process; Float8Linear would emulate"
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_fp8_available(index)
    if device.type == "cpu":
        return False, ("cpu: torch._scaled_mm runs here only through a reference kernel (~0.1 GFLOP/s, "
                       "~10^4x slower than bf16 matmul); Float8Linear emulates (quantise -> dequantise -> "
                       "fp32 matmul, same numerics); use_scaled_mm=True forces _scaled_mm")
    return False, f"{device}: no fp8 torch._scaled_mm support is known for {device.type!r}; Float8Linear emulates"


@functools.cache
def _cuda_fp8_available(index: int) -> tuple[bool, str]:
    """:func:`fp8_available` for one CUDA device (cached: its hardware does not change)."""
    device = torch.device("cuda", index)
    name, capability = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
    arch = f"sm_{capability[0]}{capability[1]}"
    if capability < _MIN_CUDA_CAPABILITY:
        return False, (f"{device} ({name}, {arch}) has no fp8 tensor cores (needs sm_"
                       f"{_MIN_CUDA_CAPABILITY[0]}{_MIN_CUDA_CAPABILITY[1]}+); Float8Linear emulates")
    error = _scaled_mm_error(device, torch.float8_e4m3fn, torch.float8_e4m3fn, False, torch.bfloat16)
    if error is not None:
        return False, f"{device} ({name}, {arch}): torch._scaled_mm failed a probe ({error}); Float8Linear emulates"
    return True, f"{device} ({name}, {arch}): torch._scaled_mm runs on fp8 tensor cores"


def _use_scaled_mm(use_scaled_mm: bool | None, a: ScaledFloat8, b: ScaledFloat8, out_dtype: torch.dtype) -> bool:
    """Resolve the ``use_scaled_mm`` option for one GEMM (None = auto: fast hardware and dtypes run)."""
    if use_scaled_mm is not None:
        return use_scaled_mm
    device = a.data.device
    if not fp8_available(device)[0]:
        return False
    rowwise = a.scale.ndim > 0 or b.scale.ndim > 0
    return _scaled_mm_error(device, a.data.dtype, b.data.dtype, rowwise, out_dtype) is None


# --------------------------------------------------------------------------- the GEMM
def _pad_contraction(a_fp8: torch.Tensor, b_fp8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad ``a (M, K)`` and ``b (K, N)`` along K to a multiple of 16 (exact: zeros add nothing).

    Needed for the grad_weight GEMM, which contracts over the token count M. Works on the raw
    bytes (the all-zero bit pattern is +0.0 in every fp8 format) since fp8 has few kernels.
    """
    pad = -a_fp8.shape[1] % _SCALED_MM_MULTIPLE
    if pad == 0:
        return a_fp8, b_fp8
    a_padded = F.pad(a_fp8.view(torch.uint8), (0, pad)).view(a_fp8.dtype)  # (M, K + pad)
    b_padded = F.pad(b_fp8.t().view(torch.uint8), (0, pad)).view(b_fp8.dtype).t()  # (K + pad, N), column-major
    return a_padded, b_padded


def _mm(a: ScaledFloat8, b: ScaledFloat8, *, out_dtype: torch.dtype, use_scaled_mm: bool | None) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` from scaled fp8 operands, fp32 accumulation, result in ``out_dtype``.

    ``a.scale`` is ``()`` or ``(M, 1)``, ``b.scale`` ``()`` or ``(1, N)``: constant along K.
    """
    # autocast off on both paths: torch's CPU fallback for _scaled_mm (no oneDNN fp8) dequantises and calls
    # matmul, which the caller's autocast would run in bf16; the emulation is an fp32 matmul by definition
    with torch.autocast(a.data.device.type, enabled=False):
        if _use_scaled_mm(use_scaled_mm, a, b, out_dtype):
            a_fp8 = a.data.contiguous()                  # (M, K) row-major
            b_fp8 = b.data.t().contiguous().t()          # (K, N) column-major
            a_fp8, b_fp8 = _pad_contraction(a_fp8, b_fp8)
            return torch._scaled_mm(a_fp8, b_fp8,
                                    scale_a=a.scale.reciprocal().contiguous(),  # _scaled_mm multiplies back
                                    scale_b=b.scale.reciprocal().contiguous(),
                                    out_dtype=out_dtype)
        return (a.dequantize() @ b.dequantize()).to(out_dtype)  # (M, N)


# --------------------------------------------------------------------------- casts
Scaling = CurrentScaling | DelayedScaling
Operand = torch.Tensor | ScaledFloat8


def _maybe_cast(t: Operand, scaling: Scaling, *, role: str, axis: int) -> ScaledFloat8:
    """The one place a GEMM operand becomes fp8, for a GEMM contracting along ``axis``.

    An operand already in fp8 (an earlier GEMM keeps its fp8 cast only when the scale is per
    tensor) has a scale valid along any axis and is reused as is; a high-precision tensor is cast
    by the recipe's ``scaling``.
    """
    if isinstance(t, ScaledFloat8):
        return t
    return scaling.cast(t, role=role, axis=axis)


def _keep(t_hp: torch.Tensor, t_fp8: ScaledFloat8) -> Operand:
    """What a later GEMM needs of an operand: its fp8 cast if the scale is per tensor (reusable
    along any axis, and 1 byte/element to save), else the high-precision tensor to recast."""
    return t_fp8 if t_fp8.scale.ndim == 0 else t_hp


def _pack(operand: Operand) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(data, scale)`` of a kept operand for ``save_for_backward``; scale None for a tensor."""
    return (operand.data, operand.scale) if isinstance(operand, ScaledFloat8) else (operand, None)


def _unpack(data: torch.Tensor, scale: torch.Tensor | None) -> Operand:
    return data if scale is None else ScaledFloat8(data, scale)


class _Float8Matmul(torch.autograd.Function):
    """``y = x @ W^T`` with all three GEMMs in scaled fp8 (shapes in the module docstring)."""

    @staticmethod
    def forward(ctx, x_hp: torch.Tensor, weight_hp: torch.Tensor, scaling: Scaling,
                out_dtype: torch.dtype, use_scaled_mm: bool | None, name: str | None = None) -> torch.Tensor:
        x_fp8 = _maybe_cast(x_hp, scaling, role="input", axis=-1)            # (M, K), scale () or (M, 1)
        weight_fp8 = _maybe_cast(weight_hp, scaling, role="weight", axis=-1)  # (N, K), scale () or (N, 1)
        y = _mm(x_fp8, weight_fp8.t(), out_dtype=out_dtype, use_scaled_mm=use_scaled_mm)  # (M, N)
        x_kept, weight_kept = _keep(x_hp, x_fp8), _keep(weight_hp, weight_fp8)
        ctx.save_for_backward(*_pack(x_kept), *_pack(weight_kept))
        ctx.scaling, ctx.use_scaled_mm, ctx.out_dtype = scaling, use_scaled_mm, out_dtype
        ctx.x_dtype, ctx.weight_dtype, ctx.name = x_hp.dtype, weight_hp.dtype, name
        return y

    @staticmethod
    def backward(ctx, grad_y_hp: torch.Tensor):  # grad_y_hp: (M, N); first order only (mixprec.autocast.first_order)
        saved = ctx.saved_tensors
        return first_order_backward("an fp8 linear", lambda: _Float8Matmul._grads(ctx, grad_y_hp, *saved),
                                    (grad_y_hp, *saved), ctx.name) + (None,) * 4

    @staticmethod
    def _grads(ctx, grad_y_hp: torch.Tensor, x_data, x_scale, weight_data, weight_scale
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_kept, weight_kept = _unpack(x_data, x_scale), _unpack(weight_data, weight_scale)
        scaling, use_scaled_mm, out_dtype = ctx.scaling, ctx.use_scaled_mm, ctx.out_dtype
        grad_y_fp8 = _maybe_cast(grad_y_hp, scaling, role="grad_output", axis=-1)  # (M, N), scale () or (M, 1)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            weight_fp8 = _maybe_cast(weight_kept, scaling, role="weight", axis=0)  # (N, K), scale () or (1, K)
            grad_x = _mm(grad_y_fp8, weight_fp8, out_dtype=out_dtype, use_scaled_mm=use_scaled_mm)  # (M, K)
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_y_t_fp8 = _maybe_cast(_keep(grad_y_hp, grad_y_fp8), scaling,
                                       role="grad_output", axis=0).t()  # (N, M), scale () or (N, 1)
            x_fp8 = _maybe_cast(x_kept, scaling, role="input", axis=0)  # (M, K), scale () or (1, K)
            grad_weight = _mm(grad_y_t_fp8, x_fp8, out_dtype=out_dtype, use_scaled_mm=use_scaled_mm)  # (N, K)
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_x, grad_weight


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``x``'s device, else ``x``'s dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class Float8Linear(nn.Linear):
    """``nn.Linear`` with fp8 GEMMs in forward and backward (see the module docstring).

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        recipe: ``"tensorwise"``, ``"rowwise"``, ``"delayed"`` or a :class:`Float8Recipe`.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``; None = the
            recipe object's format, or ``"hybrid"`` for a recipe name.
        use_scaled_mm: ``True`` always ``torch._scaled_mm``, ``False`` always emulate, ``None``
            (default) ``_scaled_mm`` where fp8 hardware runs it (:func:`fp8_available`).

    The scaling state (``delayed``: amax histories and scales) lives in the ``scaling``
    submodule's buffers and so in ``state_dict()``. Build from an existing linear, sharing its
    ``Parameter`` objects, with :meth:`from_linear`. ``built_by``: the policy text of the
    ``MixedPrecision`` engine that swapped this linear in (its ``unwrap()`` swaps it back), None
    for one built by the caller (an engine runs it as built). ``qualified_name``: its name in the
    model :func:`~mixprec.fp8.convert_to_float8` converted it in (None otherwise), for messages.
    """

    built_by: str | None = None
    qualified_name: str | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: str | Float8Recipe = "tensorwise", fp8_format: str | None = None,
                 use_scaled_mm: bool | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if use_scaled_mm not in (None, True, False):
            raise TypeError(f"Float8Linear {use_scaled_mm=} must be True, False or None (auto)")
        self.recipe = Float8Recipe.resolve(recipe, fp8_format)
        self.use_scaled_mm = use_scaled_mm
        scaling_device = None if self.weight.device.type == "meta" else self.weight.device
        self.scaling = self.recipe.make_scaling(device=scaling_device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: str | Float8Recipe = "tensorwise",
                    fp8_format: str | None = None, use_scaled_mm: bool | None = None) -> "Float8Linear":
        """A Float8Linear holding ``linear``'s own ``weight``/``bias`` Parameter objects (no copy), so
        an optimizer built on them keeps working. Scaling state goes to the weight's device."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe, fp8_format=fp8_format, use_scaled_mm=use_scaled_mm)
        new.weight = linear.weight
        new.bias = linear.bias
        new.scaling = new.recipe.make_scaling(device=linear.weight.device)
        new.train(linear.training)
        return new

    @property
    def linear_kind(self) -> str:
        """What runs this linear's GEMMs, in words: ``"fp8 (recipe tensorwise(format=hybrid,margin=0))"``."""
        return f"fp8 (recipe {self.recipe})"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out_dtype = _compute_dtype(input)
        x_hp = input.reshape(-1, self.in_features)  # (M, K)
        y = _Float8Matmul.apply(x_hp, self.weight, self.scaling, out_dtype, self.use_scaled_mm,
                                self.qualified_name)  # (M, N)
        y = y.reshape(*input.shape[:-1], self.out_features)  # (..., N)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, use_scaled_mm={self.use_scaled_mm}"


def clamped_scales(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per fp8 linear of ``model`` (module name), per operand role: how many scales the amax floor
    clamped since the model was converted (an all-zero or subnormal tensor, or rows of one under
    rowwise, e.g. a zero-initialised LoRA ``B``, padding, dead experts). Such casts give
    exact zeros instead of NaN; a count that keeps growing flags a layer that feeds fp8 nothing.
    Only linears with a nonzero count are listed. **Syncs** the host with the device once.
    """
    named = [(name, m.scaling.clamped) for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not named:
        return {}
    counts = torch.stack([c for _, c in named]).tolist()
    return {name: dict(zip(ROLES, row)) for (name, _), row in zip(named, counts) if any(row)}
