"""Portable autocast (mixprec.autocast.portable): CUDA's op lists on CPU, checked against torch's own.

The op lists are checked against torch two ways: the dispatcher's ``AutocastCUDA`` registrations (present
on a CPU-only build) in both directions, and the ``AT_FORALL_*`` macros of the installed
``ATen/autocast_mode.h`` (skipped where the wheel ships no headers). The dtype tests then run every op of
CUDA's fp32 and lower-precision lists through the dispatcher under bf16 autocast on CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision
from mixprec import Policy
from mixprec.autocast.portable import CUDA_OPS, op_table, portable_ops, ported_ops

BF16 = mixprec.get_format("bf16")
FP32_CATEGORIES = ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype")


# ---------------------------------------------------------------------- the lists against torch
def _autocast_cuda_ops() -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {n.removeprefix("aten::") for n in names
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}


def test_cuda_ops_match_the_dispatchers_autocast_cuda_registrations_both_ways():
    registered = _autocast_cuda_ops()
    assert sorted(set(CUDA_OPS) - registered) == [], "listed but torch has no AutocastCUDA kernel"
    assert sorted(registered - set(CUDA_OPS)) == [], "torch has an AutocastCUDA kernel mixprec does not list"


def _header_lists() -> dict[str, set[str]] | None:
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        return None
    text = header.read_text()
    out = {}
    for macro in ("LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE"):
        body = re.search(rf"#define AT_FORALL_{macro}\(_\)(.*?)(?:\n\n|\n#)", text, re.S).group(1)
        out[macro] = {a if not b else f"{a}.{b}" for a, b in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body)}
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S).group(1)
    out["APPEND_DTYPE"] = set(re.findall(r'"(norm\.\w+)"', body))
    return out


def test_categories_match_the_installed_autocast_header():
    lists = _header_lists()
    if lists is None:
        pytest.skip("this torch wheel ships no ATen/autocast_mode.h")
    by_category = {c: {n for n, k in CUDA_OPS.items() if k == c} for c in set(CUDA_OPS.values())}
    assert by_category["fp32"] == lists["FP32"]
    assert by_category["fp32_set_opt_dtype"] == lists["FP32_SET_OPT_DTYPE"]
    assert by_category["fp32_append_dtype"] == lists["APPEND_DTYPE"]
    assert by_category["promote"] == lists["PROMOTE"]
    # CUDA registers cudnn convolutions in lower precision outside the shared macro
    assert by_category["lower_precision"] - lists["LOWER_PRECISION_FP"] == {"cudnn_convolution",
                                                                              "cudnn_convolution_transpose"}
    assert lists["LOWER_PRECISION_FP"] <= by_category["lower_precision"]


# ---------------------------------------------------------------------- every listed op's output dtype
def _t(*shape, positive=False):
    x = torch.rand(*shape) + 0.5 if positive else torch.randn(*shape)
    return x.to(torch.bfloat16)


def _lstm_cell_args():
    return (_t(2, 3), [_t(2, 4), _t(2, 4)], _t(16, 3), _t(16, 4))


def _cell_args(gates):
    return (_t(2, 3), _t(2, 4), _t(gates * 4, 3), _t(gates * 4, 4))


# op -> (args, kwargs) built from fresh bf16 tensors; every op of CUDA's fp32 and lower-precision lists
# appears here or in NO_CPU_KERNEL (checked by test_every_listed_op_has_a_sample)
SAMPLES = {
    "_convolution": lambda: ((_t(1, 2, 5, 5), _t(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                              False, False, False, False), {}),
    "_convolution.deprecated": lambda: ((_t(1, 2, 5, 5), _t(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False,
                                         [0, 0], 1, False, False, False), {}),
    "conv1d": lambda: ((_t(1, 2, 5), _t(3, 2, 3)), {}),
    "conv2d": lambda: ((_t(1, 2, 5, 5), _t(3, 2, 3, 3)), {}),
    "conv3d": lambda: ((_t(1, 2, 4, 4, 4), _t(3, 2, 3, 3, 3)), {}),
    "conv_tbc": lambda: ((_t(5, 1, 2), _t(3, 2, 4), _t(4), 1), {}),
    "conv_transpose1d": lambda: ((_t(1, 2, 5), _t(2, 3, 3)), {}),
    "conv_transpose2d.input": lambda: ((_t(1, 2, 5, 5), _t(2, 3, 3, 3)), {}),
    "conv_transpose3d.input": lambda: ((_t(1, 2, 4, 4, 4), _t(2, 3, 3, 3, 3)), {}),
    "convolution": lambda: ((_t(1, 2, 5, 5), _t(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),
    "prelu": lambda: ((_t(2, 3), _t(3)), {}),
    "addmm": lambda: ((_t(2, 4), _t(2, 3), _t(3, 4)), {}),
    "addmv": lambda: ((_t(2), _t(2, 3), _t(3)), {}),
    "addr": lambda: ((_t(2, 3), _t(2), _t(3)), {}),
    "matmul": lambda: ((_t(2, 3), _t(3, 4)), {}),
    "einsum": lambda: (("ij,jk->ik", [_t(2, 3), _t(3, 4)]), {}),
    "mm": lambda: ((_t(2, 3), _t(3, 4)), {}),
    "mv": lambda: ((_t(2, 3), _t(3)), {}),
    "linalg_vecdot": lambda: ((_t(2, 3), _t(2, 3)), {}),
    "linear": lambda: ((_t(2, 3), _t(4, 3)), {}),
    "addbmm": lambda: ((_t(2, 4), _t(5, 2, 3), _t(5, 3, 4)), {}),
    "baddbmm": lambda: ((_t(5, 2, 4), _t(5, 2, 3), _t(5, 3, 4)), {}),
    "bmm": lambda: ((_t(5, 2, 3), _t(5, 3, 4)), {}),
    "chain_matmul": lambda: (([_t(2, 3), _t(3, 4), _t(4, 2)],), {}),
    "linalg_multi_dot": lambda: (([_t(2, 3), _t(3, 4), _t(4, 2)],), {}),
    "lstm_cell": lambda: (_lstm_cell_args(), {}),
    "gru_cell": lambda: (_cell_args(3)[:2] + (_t(12, 3), _t(12, 4)), {}),
    "rnn_tanh_cell": lambda: ((_t(2, 3), _t(2, 4), _t(4, 3), _t(4, 4)), {}),
    "rnn_relu_cell": lambda: ((_t(2, 3), _t(2, 4), _t(4, 3), _t(4, 4)), {}),
    "scaled_dot_product_attention": lambda: ((_t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8)), {}),
    # fp32
    "acos": lambda: ((_t(3, 4) * 0.5,), {}),
    "asin": lambda: ((_t(3, 4) * 0.5,), {}),
    "cosh": lambda: ((_t(3, 4),), {}),
    "erfinv": lambda: ((_t(3, 4) * 0.5,), {}),
    "exp": lambda: ((_t(3, 4),), {}),
    "expm1": lambda: ((_t(3, 4),), {}),
    "log": lambda: ((_t(3, 4, positive=True),), {}),
    "log10": lambda: ((_t(3, 4, positive=True),), {}),
    "log2": lambda: ((_t(3, 4, positive=True),), {}),
    "log1p": lambda: ((_t(3, 4, positive=True),), {}),
    "reciprocal": lambda: ((_t(3, 4, positive=True),), {}),
    "rsqrt": lambda: ((_t(3, 4, positive=True),), {}),
    "sinh": lambda: ((_t(3, 4),), {}),
    "tan": lambda: ((_t(3, 4),), {}),
    "pow.Tensor_Scalar": lambda: ((_t(3, 4), 2), {}),
    "pow.Tensor_Tensor": lambda: ((_t(3, 4, positive=True), _t(3, 4)), {}),
    "pow.Scalar": lambda: ((2.0, _t(3, 4)), {}),
    "softplus": lambda: ((_t(3, 4),), {}),
    "layer_norm": lambda: ((_t(3, 4), [4]), {}),
    "native_layer_norm": lambda: ((_t(3, 4), [4], None, None, 1e-5), {}),
    "rms_norm": lambda: ((_t(3, 4), [4]), {}),
    "group_norm": lambda: ((_t(2, 4, 3), 2), {}),
    "frobenius_norm.dim": lambda: ((_t(3, 4), [0, 1]), {}),
    "nuclear_norm": lambda: ((_t(3, 4),), {}),
    "nuclear_norm.dim": lambda: ((_t(3, 4), [0, 1]), {}),
    "cosine_similarity": lambda: ((_t(3, 4), _t(3, 4)), {}),
    "poisson_nll_loss": lambda: ((_t(3, 4), _t(3, 4, positive=True), True, False, 1e-8, 1), {}),
    "cosine_embedding_loss": lambda: ((_t(3, 4), _t(3, 4), torch.tensor([1.0, -1.0, 1.0]).bfloat16()), {}),
    "nll_loss": lambda: ((_t(3, 4), torch.tensor([0, 1, 2])), {}),
    "nll_loss2d": lambda: ((_t(2, 4, 3, 3), torch.zeros(2, 3, 3, dtype=torch.long)), {}),
    "hinge_embedding_loss": lambda: ((_t(3, 4), torch.ones(3, 4).bfloat16()), {}),
    "kl_div": lambda: ((_t(3, 4), _t(3, 4, positive=True)), {}),
    "l1_loss": lambda: ((_t(3, 4), _t(3, 4)), {}),
    "smooth_l1_loss": lambda: ((_t(3, 4), _t(3, 4)), {}),
    "huber_loss": lambda: ((_t(3, 4), _t(3, 4)), {}),
    "mse_loss": lambda: ((_t(3, 4), _t(3, 4)), {}),
    "margin_ranking_loss": lambda: ((_t(3), _t(3), torch.ones(3).bfloat16()), {}),
    "multilabel_margin_loss": lambda: ((_t(2, 4), torch.tensor([[1, -1, 0, 0], [2, 0, -1, 0]])), {}),
    "soft_margin_loss": lambda: ((_t(3, 4), torch.ones(3, 4).bfloat16()), {}),
    "triplet_margin_loss": lambda: ((_t(3, 4), _t(3, 4), _t(3, 4)), {}),
    "multi_margin_loss": lambda: ((_t(3, 4), torch.tensor([0, 1, 2])), {}),
    "binary_cross_entropy_with_logits": lambda: ((_t(3, 4), torch.rand(3, 4).bfloat16()), {}),
    "dist": lambda: ((_t(3, 4), _t(3, 4)), {}),
    "pdist": lambda: ((_t(3, 4),), {}),
    "cdist": lambda: ((_t(3, 4), _t(2, 4)), {}),
    "renorm": lambda: ((_t(3, 4), 2, 0, 1.0), {}),
    "logsumexp": lambda: ((_t(3, 4), [1]), {}),
    "upsample_nearest1d": lambda: ((_t(1, 2, 4), [8]), {}),
    "_upsample_nearest_exact1d": lambda: ((_t(1, 2, 4), [8]), {}),
    "upsample_nearest2d": lambda: ((_t(1, 2, 4, 4), [8, 8]), {}),
    "_upsample_nearest_exact2d": lambda: ((_t(1, 2, 4, 4), [8, 8]), {}),
    "upsample_nearest3d": lambda: ((_t(1, 2, 2, 2, 2), [4, 4, 4]), {}),
    "_upsample_nearest_exact3d": lambda: ((_t(1, 2, 2, 2, 2), [4, 4, 4]), {}),
    "upsample_linear1d": lambda: ((_t(1, 2, 4), [8], False), {}),
    "upsample_bilinear2d": lambda: ((_t(1, 2, 4, 4), [8, 8], False), {}),
    "_upsample_bilinear2d_aa": lambda: ((_t(1, 2, 4, 4), [8, 8], False), {}),
    "upsample_trilinear3d": lambda: ((_t(1, 2, 2, 2, 2), [4, 4, 4], False), {}),
    "upsample_bicubic2d": lambda: ((_t(1, 2, 4, 4), [8, 8], False), {}),
    "_upsample_bicubic2d_aa": lambda: ((_t(1, 2, 4, 4), [8, 8], False), {}),
    "prod": lambda: ((_t(3, 4),), {}),
    "prod.dim_int": lambda: ((_t(3, 4), 1), {}),
    "softmax.int": lambda: ((_t(3, 4), 1), {}),
    "log_softmax.int": lambda: ((_t(3, 4), 1), {}),
    "cumprod": lambda: ((_t(3, 4), 1), {}),
    "cumsum": lambda: ((_t(3, 4), 1), {}),
    "linalg_vector_norm": lambda: ((_t(3, 4),), {}),
    "linalg_matrix_norm": lambda: ((_t(3, 4), 1), {}),
    "linalg_matrix_norm.str_ord": lambda: ((_t(3, 4),), {}),
    "sum": lambda: ((_t(3, 4),), {}),
    "sum.dim_IntList": lambda: ((_t(3, 4), [1]), {}),
    "norm.Scalar": lambda: ((_t(3, 4),), {}),
    "norm.ScalarOpt_dim": lambda: ((_t(3, 4), 2, [1]), {}),
    # promote: one bf16 and one fp32 input -> both fp32 (the widest)
    "addcdiv": lambda: ((_t(3, 4), _t(3, 4).float(), _t(3, 4, positive=True)), {}),
    "addcmul": lambda: ((_t(3, 4), _t(3, 4).float(), _t(3, 4)), {}),
    "atan2": lambda: ((_t(3, 4), _t(3, 4).float()), {}),
    "bilinear": lambda: ((_t(2, 3), _t(2, 4).float(), _t(5, 3, 4)), {}),
    "cross": lambda: ((_t(2, 3), _t(2, 3).float()), {}),
    "dot": lambda: ((_t(3), _t(3).float()), {}),
    "vdot": lambda: ((_t(3), _t(3).float()), {}),
    "grid_sampler": lambda: ((_t(1, 2, 4, 4), _t(1, 3, 3, 2).float(), 0, 0, False), {}),
    "index_put": lambda: ((_t(4, 3), [torch.tensor([0, 2])], _t(2, 3).float()), {}),
    "tensordot": lambda: ((_t(2, 3), _t(3, 4).float(), [1], [0]), {}),
    "scatter_add": lambda: ((_t(3, 4), 1, torch.zeros(3, 4, dtype=torch.long), _t(3, 4).float()), {}),
}
# CUDA-only kernels: nothing to run on a CPU (test_no_cpu_kernel checks they really have none)
NO_CPU_KERNEL = ("_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "_scaled_dot_product_flash_attention",
                 "cudnn_convolution", "cudnn_convolution_transpose")
PORTED_CATEGORIES = ("lower_precision", "promote") + FP32_CATEGORIES
# fp32-list ops whose CPU kernels refuse bf16: they raise under ops=native and run (in fp32) under ops=portable
NATIVE_REFUSES = ("nuclear_norm", "nuclear_norm.dim", "pdist", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")


def _op(name):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_every_listed_op_has_a_sample():
    listed = {n for n, c in CUDA_OPS.items() if c in PORTED_CATEGORIES}
    assert listed == set(SAMPLES) | set(NO_CPU_KERNEL)


@pytest.mark.parametrize("name", NO_CPU_KERNEL)
def test_no_cpu_kernel(name):
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU")


def _run_under_bf16(name, *, portable):
    args, kwargs = SAMPLES[name]()
    with torch.autocast("cpu", dtype=torch.bfloat16), portable_ops("cpu", enabled=portable):
        return _first(_op(name)(*args, **kwargs))


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_portable_op_dtype_is_cudas(name):
    """Under bf16 autocast on CPU with portable ops, each op's output dtype is the one CUDA's category gives."""
    expected = torch.bfloat16 if CUDA_OPS[name] == "lower_precision" else torch.float32
    assert _run_under_bf16(name, portable=True).dtype == expected


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return type(value)(_to_fp32(v) for v in value) if isinstance(value, (list, tuple)) else value


@pytest.mark.parametrize("name", sorted(n for n in SAMPLES if CUDA_OPS[n] == "lower_precision"))
def test_portable_lower_precision_ops_cast_fp32_inputs_to_bf16(name):
    """fp32 inputs (in lists too: einsum, chain_matmul) are cast down, as CUDA's autocast does."""
    args, kwargs = SAMPLES[name]()
    with torch.autocast("cpu", dtype=torch.bfloat16), portable_ops("cpu"):
        assert _first(_op(name)(*_to_fp32(args), **kwargs)).dtype == torch.bfloat16


def test_native_leaves_ported_ops_in_the_input_dtype_and_keeps_cpus_own():
    """ops=native: the ported fp32-list ops stay bf16 (CPU's own behaviour); ops CPU casts itself are unchanged."""
    ported = ported_ops("cpu")
    fp32_ported = [n for n in ported if ported[n] in FP32_CATEGORIES and n in SAMPLES]
    assert {"exp", "cumsum", "softmax.int", "log_softmax.int", "layer_norm", "sum", "logsumexp"} <= set(fp32_ported)
    stayed_bf16, refused = [], []
    for name in fp32_ported:
        try:
            if _run_under_bf16(name, portable=False).dtype == torch.bfloat16:
                stayed_bf16.append(name)
        except RuntimeError:              # CPU has no bf16 kernel ("not implemented for 'BFloat16'")
            refused.append(name)
    # bf16 with no CPU kernel: under ops=native these raise, under ops=portable they run in fp32 (as on CUDA)
    assert sorted(refused) == sorted(NATIVE_REFUSES)
    assert stayed_bf16 == [n for n in fp32_ported if n not in NATIVE_REFUSES]
    assert _run_under_bf16("mse_loss", portable=False).dtype == torch.float32     # CPU's own fp32 kernel
    assert _run_under_bf16("mm", portable=False).dtype == torch.bfloat16


def test_promote_with_bf16_inputs_only_stays_bf16_and_mixes_with_ported_matmuls():
    with torch.autocast("cpu", dtype=torch.bfloat16), portable_ops("cpu"):
        assert torch.dot(_t(3), _t(3)).dtype == torch.bfloat16
        weight, u, v = torch.randn(4, 3), torch.randn(4), torch.randn(3)       # spectral_norm's power iteration
        assert torch.dot(u, torch.mv(weight, v)).dtype == torch.float32     # mv bf16 (CUDA's list), dot promotes


def test_decomposed_ops_are_cast_and_backward_runs():
    """torch.linalg.norm (aten linalg_norm, in no autocast list) decomposes in C++ into linalg_vector_norm,
    which the autocast key catches as CUDA's does; the backward flows to the fp32 leaf."""
    for key in ("AutocastCPU", "AutocastCUDA"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::linalg_norm", key)
    x_fp32 = torch.randn(4, 10, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.linalg.norm(x_fp32.bfloat16()).dtype == torch.bfloat16          # CPU's own lists
        with portable_ops("cpu"):
            norm = torch.linalg.norm(x_fp32.bfloat16())
            loss = F.cross_entropy(x_fp32.bfloat16(), torch.randint(0, 10, (4,)))      # CPU's own fp32 kernel
    assert norm.dtype == loss.dtype == torch.float32
    (norm + loss).backward()
    assert x_fp32.grad is not None and x_fp32.grad.dtype == torch.float32


def test_portable_ops_restores_state_and_is_off_outside():
    x = _t(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with portable_ops("cpu"):
            with portable_ops("cpu"):
                assert x.exp().dtype == torch.float32
            assert x.exp().dtype == torch.float32
        assert x.exp().dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="boom"), portable_ops("cpu"):
            raise RuntimeError("boom")
        assert x.exp().dtype == torch.bfloat16


def test_op_table_names_each_ported_op():
    rows = {name: (category, native) for name, category, native in op_table("cpu")}
    assert rows["exp"] == ("fp32", "ported") and rows["mm"] == ("lower_precision", "own kernel")
    assert all(native == "same" for _, _, native in op_table("cuda"))


# ---------------------------------------------------------------------- through the engine
class DecayingWindow(nn.Module):
    """y_t = sum_{s<=t} exp(L_t - L_s) x_s with L = cumsum(log a): a decaying window (a per-step decay a_t in
    (e^-0.2, 1), learned from x) over a long sequence, written as exponentials of cumulative sums."""

    def __init__(self, features):
        super().__init__()
        self.gate = nn.Linear(features, 1)

    def forward(self, x):                                               # x: (B, T, F)
        log_a = -0.2 * torch.sigmoid(self.gate(x)).squeeze(-1)          # (B, T)
        cum_log_a = torch.cumsum(log_a, dim=1)                          # (B, T), reaches about -20 per 100 steps
        steps = x.shape[1]
        causal = torch.ones(steps, steps, dtype=torch.bool).tril()       # (T, T)
        gap = cum_log_a[:, :, None] - cum_log_a[:, None, :]             # (B, T, T)
        decay = torch.exp(gap.masked_fill(~causal, float("-inf")))      # (B, T, T)
        return decay @ x                                                # (B, T, F)


def _decaying_window_error(policy):
    torch.manual_seed(0)
    model = DecayingWindow(8)
    x = torch.randn(2, 2048, 8)
    with torch.no_grad():
        reference = model(x)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy=policy)
    with torch.no_grad(), mp.autocast():
        out = mp.model(mp.cast_inputs(x)).float()
    return ((out - reference).norm() / reference.norm()).item(), mp


def test_decaying_window_within_2_percent_with_portable_and_far_off_with_native():
    """Over 2048 steps the cumulative log-decay reaches about -200, where bf16's spacing is 1: a bf16 cumsum
    makes exp(L_t - L_s) off by factors up to e. Portable runs cumsum and exp in fp32 (CUDA's lists), so
    only the bf16 matmul rounds: decay and x to bf16, half an eps each (BF16.eps = 2^-7)."""
    portable_err, mp = _decaying_window_error("bf16-mixed")
    native_err, _ = _decaying_window_error("bf16-mixed,ops=native")
    assert portable_err < 0.02
    assert portable_err < BF16.eps
    assert native_err > 0.1, native_err                   # the contrast: CPU's own lists
    assert native_err > 20 * portable_err
    assert "ops=portable" in mp.decision


def test_policy_ops_key_round_trips_and_validates():
    native = Policy.parse("bf16-mixed,ops=native")
    assert native.ops == "native" and Policy.parse(str(native)) == native
    assert Policy.parse("bf16-mixed").ops == "portable" and str(Policy.parse("bf16-mixed,ops=portable")) == "bf16-mixed"
    with pytest.raises(ValueError, match=r"ops='cuda'.*portable.*native"):
        Policy.parse("bf16-mixed,ops=cuda")
    with pytest.raises(ValueError, match=r"ops='fast'.*portable.*native"):
        Policy(compute_dtype=torch.bfloat16, ops="fast")


def test_decision_records_native():
    _, mp = _decaying_window_error("bf16-mixed,ops=native")
    assert "ops=native" in mp.decision and "exp" in mp.decision


def test_compiled_forward_has_the_portable_dtypes():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 8))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed")
    compiled = torch.compile(lambda x: mp.model[0](x).softmax(-1).exp().sum(-1), backend="aot_eager")
    x = torch.randn(2, 16, 8)
    with mp.autocast():
        eager = mp.model[0](x).softmax(-1).exp().sum(-1)
        out = compiled(x)
        assert mp.model[0](x).dtype == torch.bfloat16          # the linear stays bf16: softmax's fp32 is the port
    assert eager.dtype == out.dtype == torch.float32
    torch.testing.assert_close(out, eager)
    out.mean().backward()
    torch._dynamo.reset()


def test_a_checkpointed_recompute_casts_as_its_forward_outside_the_autocast_block():
    # mp.backward() runs outside mp.autocast(): the recompute ran the CPU's own lists (exp in bf16) where
    # the forward ran CUDA's (exp in fp32): CheckpointError for the saved tensors' dtypes
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        return torch.exp(lin(x)).sum(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16), portable_ops("cpu"):
        plain, checkpointed = block(x), mixprec.ops.checkpoint(block, x)
    assert plain.dtype == checkpointed.dtype == torch.float32
    for a, b in zip(torch.autograd.grad(plain.sum(), (x, lin.weight)),
                    torch.autograd.grad(checkpointed.sum(), (x, lin.weight))):
        assert torch.equal(a, b)
