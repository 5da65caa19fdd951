"""Portable autocast: CUDA's op lists on every device, so one policy gives one set of op dtypes.

``torch.autocast`` keeps one op list per device. CUDA's runs ``exp``, ``log``, ``pow``, ``softmax``,
``log_softmax``, ``cumsum``, ``cumprod``, ``layer_norm``, ``group_norm``, ``norm``, ``logsumexp``,
``sum``, ``prod`` and the losses in fp32; CPU's leaves most of them in the 16-bit input dtype, so a
model built on ``exp(cumsum(x))`` over a long sequence is off by orders of magnitude under bf16 on a
CPU and fine on a GPU. Under ``ops=portable`` (every policy's default) :func:`portable_ops`, entered
by ``mp.autocast()``, makes the device's autocast behave as CUDA's for the ops of :data:`CUDA_OPS`;
``ops=native`` leaves torch's per-device lists alone.

Mechanism. For each op of CUDA's fp32 and lower-precision lists that the device's autocast key
(``AutocastCPU``, ``AutocastMPS``) has no kernel for, a Python kernel is registered once for that key
with ``torch.library`` (at the first portable ``mp.autocast()``). The autocast key runs before
autograd and catches the ops a composite decomposes into (``cross_entropy`` → ``log_softmax`` +
``nll_loss``), exactly where CUDA's own autocast kernels run, so the casts are recorded by autograd
and the backward runs in the dtypes the forward saw. The kernel does what CUDA's C++ kernel does
(``aten/src/ATen/autocast_mode.h``): ``fp32`` casts floating inputs (not fp64) to fp32;
``fp32_set_opt_dtype`` (``sum``, ``softmax`` ...) passes ``dtype=torch.float32`` when the first
input is eligible and no dtype was given; ``fp32_append_dtype`` (``norm``) calls the overload with a
dtype; ``lower_precision`` casts to the autocast dtype; then the op runs with that device's autocast
off. Outside :func:`portable_ops` (``ops=native``, or a plain ``torch.autocast`` in the same process)
the kernel redispatches below the autocast key at once, which is what the fallthrough it replaces did.
A ``torch.overrides.TorchFunctionMode`` was the alternative: it sees Python calls only (not the ops
``cross_entropy`` decomposes into in C++), costs a Python call on every torch function, and the
mapping from Python names to aten overloads would be hand-made.

The lists. :data:`CUDA_OPS` names each aten overload that has an ``AutocastCUDA`` kernel in torch
and its category. It is data in this repository because the category is not exposed at runtime;
the set of ops is: ``tests/autocast/test_portable_autocast.py`` checks it against the dispatcher's
``AutocastCUDA`` registrations in both directions (they exist on a CPU-only build), and against the
``AT_FORALL_*`` lists of the installed ``ATen/autocast_mode.h`` when the wheel ships headers, so a
torch release that changes either fails the test. ``promote`` (``addcmul``, ``atan2``, ``dot`` ...) casts
the floating inputs to the widest of them and the autocast dtype, as CUDA does: it has to be ported with
the lower-precision list (spectral_norm's ``dot(u, mv(W, v))`` mixes a bf16 ``mv`` with an fp32 ``u``).
``banned`` (``binary_cross_entropy``, refused by CUDA's autocast) is listed for the check, not ported.

Cost: a Python call for each ported op that runs under autocast (none for the ops the device's own
autocast already casts); measured at ``mid`` by ``benchmarks/portable_ops.py`` (docs/results-history.md, docs/bench.md).

torch.compile: the kernels run while dynamo and AOTAutograd trace (fake and proxy tensors go
through the autocast key as real ones do), so a forward compiled inside ``mp.autocast()`` has the
portable dtypes (tested), and so does a function that enters ``mp.autocast()`` itself (the traced block
annotates its nodes, :func:`mixprec.autocast.switch.traced_annotation`). Dynamo does not guard on :func:`portable_ops`' state: one function compiled
under ``ops=portable`` and called by an engine with ``ops=native`` (or the reverse) reuses the first
graph. Known limit, not detected; each engine compiles its own model.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from mixprec.autocast.saved_dtype import SAVED_OPS, is_on as saved_is_on, run as run_saved
from mixprec.autocast.switch import Switch

__all__ = ["CUDA_OPS", "ported_ops", "portable_ops", "portable_devices", "portable_as", "op_table", "describe"]

# CUDA's autocast categories (torch 2.13, ATen/autocast_mode.h AT_FORALL_* and the CUDA-only
# registrations in autocast_mode.cpp); checked against torch by tests/autocast/test_portable_autocast.py.
_LOWER = """_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d
conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose"""
_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"""
_FP32_SET_OPT_DTYPE = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""
_FP32_APPEND_DTYPE = "norm.Scalar norm.ScalarOpt_dim"
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
_BANNED = "binary_cross_entropy"

#: aten overload name → CUDA autocast category
CUDA_OPS: dict[str, str] = {
    name: category
    for category, names in (("lower_precision", _LOWER), ("fp32", _FP32), ("fp32_set_opt_dtype", _FP32_SET_OPT_DTYPE),
                            ("fp32_append_dtype", _FP32_APPEND_DTYPE), ("promote", _PROMOTE), ("banned", _BANNED))
    for name in names.split()
}
_PORTED = ("lower_precision", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote")
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "mps": "AutocastMPS"}   # CUDA's own lists need no port
# norm's overloads without a dtype and the ones CUDA's kernel calls instead
_APPEND_DTYPE_TARGET = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

_libraries: dict[str, torch.library.Library] = {}   # device type -> the registrations (kept alive)
_registered: dict[str, frozenset[str]] = {}         # device type -> the ops mixprec registered for its key
_lock = threading.Lock()


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def ported_ops(device_type: str) -> dict[str, str]:
    """The ops of :data:`CUDA_OPS` (fp32 and lower-precision lists) whose category ``device_type``'s own
    autocast lacks (no kernel for its autocast key): name → category. Empty for ``cuda`` and for devices
    with no autocast key mixprec ports to."""
    key = _AUTOCAST_KEYS.get(device_type)
    if key is None:
        return {}
    ours = _registered.get(device_type, frozenset())
    out = {}
    for name, category in CUDA_OPS.items():
        own_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key) and name not in ours
        if category in _PORTED and not own_kernel:
            out[name] = category
    return out


def _eligible(t: Any, device_type: str) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == device_type


def _cast(value: Any, dtype: torch.dtype, device_type: str) -> Any:
    """``value`` (an argument, a list of tensors, or the tuple of all positional arguments) with its eligible
    tensors cast to ``dtype``, as CUDA's ``cached_cast`` does (fp64 and other devices' tensors are left)."""
    if _eligible(value, device_type):
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, list, tuple)) for v in value):
        return type(value)(_cast(v, dtype, device_type) for v in value)
    return value


def _widest(dtype: torch.dtype, value: Any, device_type: str) -> torch.dtype:
    """``dtype`` promoted with every eligible tensor in ``value`` (CUDA's ``promote_type``)."""
    if _eligible(value, device_type):
        return torch.promote_types(dtype, value.dtype)
    if isinstance(value, dict):
        value = tuple(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            dtype = _widest(dtype, v, device_type)
    return dtype


def _with_fp32_dtype(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``args``/``kwargs`` of ``op`` by name, defaults filled, with ``dtype=torch.float32`` unless given."""
    schema = op._schema.arguments
    full = dict(zip((a.name for a in schema), args), **kwargs)
    for a in schema:
        if a.name not in full and a.has_default_value():
            full[a.name] = a.default_value
    if full.get("dtype") is None:
        full["dtype"] = torch.float32
    return full


def _kernel(name: str, category: str, device_type: str, key: torch._C.DispatchKey) -> Callable:
    op = _overload(name)
    target = _overload(_APPEND_DTYPE_TARGET.get(name, name))

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        if not _switch.is_on(device_type):
            return op.redispatch(keyset.remove(key), *args, **kwargs)     # native: the fallthrough it replaces
        dtype = torch.float32 if category != "lower_precision" else torch.get_autocast_dtype(device_type)
        if category == "promote":
            dtype = _widest(torch.get_autocast_dtype(device_type), (args, kwargs), device_type)
        with torch.autocast(device_type, enabled=False):
            if name in SAVED_OPS and saved_is_on(device_type):   # saved=compute: fp32 compute, bf16 saved
                return run_saved(name, args, kwargs, device_type)
            if category in ("fp32", "lower_precision", "promote"):
                kwargs = {k: _cast(v, dtype, device_type) for k, v in kwargs.items()}
                return op(*_cast(args, dtype, device_type), **kwargs)
            if args and _eligible(args[0], device_type):       # fp32_set_opt_dtype, fp32_append_dtype
                return target(**_with_fp32_dtype(op, args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _install(device_type: str) -> None:
    """Register the Python kernels for ``device_type``'s autocast key once per process."""
    with _lock:
        if device_type in _libraries:
            return
        key_name = _AUTOCAST_KEYS[device_type]
        key = getattr(torch._C.DispatchKey, key_name)
        library = torch.library.Library("aten", "IMPL")
        ported = ported_ops(device_type)
        for name, category in ported.items():
            library.impl(name, _kernel(name, category, device_type, key), key_name, with_keyset=True)
        _libraries[device_type], _registered[device_type] = library, frozenset(ported)


_switch = Switch(_AUTOCAST_KEYS, _install)   # the device types portable in each thread (autocast is per thread)


def portable_ops(device_type: str, *, enabled: bool = True) -> AbstractContextManager[None]:
    """Inside, ``device_type``'s autocast runs CUDA's fp32 and lower-precision lists (a no-op for
    ``cuda``, for a device with no autocast key ported, and with ``enabled=False``). Per thread, as
    autocast itself; restores the previous state on exit. No host sync."""
    return _switch.turned_on(device_type, enabled=enabled)


def portable_devices() -> tuple[str, ...]:
    """The device types whose portable ops are on in this thread (:func:`portable_ops`) now: what
    :func:`mixprec.ops.checkpoint` captures at the forward, so that its recompute (in a backward that may run
    outside ``mp.autocast()``) casts as its forward did. No host sync."""
    return _switch.on()


def portable_as(devices: tuple[str, ...]) -> AbstractContextManager[None]:
    """Inside, exactly ``devices`` (:func:`portable_devices` of an earlier moment) have portable ops on in this
    thread: CUDA's lists where the forward had them, the device's own where it did not. No host sync."""
    return _switch.exactly(devices)


def op_table(device_type: str) -> list[tuple[str, str, str]]:
    """(op, CUDA's category, what ``device_type``'s native autocast does) for every op of CUDA's fp32
    and lower-precision lists: ``"own kernel"`` where the device's autocast has one, ``"ported"`` where
    ``ops=portable`` supplies CUDA's, ``"same"`` on CUDA."""
    ported = ported_ops(device_type)
    rows = []
    for name, category in CUDA_OPS.items():
        if category not in _PORTED:
            continue
        native = "same" if device_type == "cuda" else ("ported" if name in ported else "own kernel")
        rows.append((name, category, native))
    return rows


def describe(ops: str, device_type: str, *, mixed: bool) -> str:
    """The decision's words for ``ops`` (a policy's ``ops`` key) on ``device_type``; "" when autocast is off
    (fp32 compute) or when the device's own lists are CUDA's."""
    ported = ported_ops(device_type)
    if not mixed or not ported:
        return ""
    if ops == "portable":
        return f"; ops=portable (CUDA's autocast op lists: {len(ported)} ops {device_type} autocast leaves alone are cast)"
    return (f"; ops=native: {device_type}'s own autocast op lists ({len(ported)} of CUDA's fp32/lower-precision ops "
            "keep their input dtype, e.g. exp, cumsum, softmax, sum in 16 bits)")
