"""Autocast-safe ops (mixprec.ops) and the autocast cases 10, 12, 14, 20-23 and 25 (cases.md).

Each trap is shown on raw torch first (so the test fails loudly if torch changes), then fixed
through the op, usually inside the engine's ``mp.autocast()``. fp16 tensors are tiny: fp16
matmuls can be very slow on CPUs without native kernels.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import ops
from mixprec import MixedPrecision
from engine_loops import _linear, _one_step

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
POLICIES = [("bf16-mixed", BF16), ("fp16-mixed", FP16)]


def _engine(model: nn.Module, policy: str) -> MixedPrecision:
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")


# ---------------------------------------------------------------- case 10: masks
@pytest.mark.parametrize("dtype", [FP16, BF16, FP32])
def test_mask_value_is_the_most_negative_finite_value(dtype):
    assert ops.mask_value(dtype) == torch.finfo(dtype).min
    assert torch.isfinite(torch.tensor(ops.mask_value(dtype), dtype=dtype))
    assert ops.mask_value(FP16) == -65504.0


def test_mask_value_rejects_integer_dtypes():
    with pytest.raises(TypeError, match=r"dtype=torch.int64 must be a floating torch.dtype"):
        ops.mask_value(torch.int64)


def _scores_and_mask(dtype):
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], dtype=dtype)  # (2, 4)
    mask = torch.tensor([[False, True, False, True], [True, True, True, True]])     # row 1 fully masked
    return scores, mask


def test_big_negative_constants_break_fp16_masks():
    """The trap: -1e10 does not fit fp16; the additive form gives 0 * -inf = NaN; -inf rows give NaN."""
    scores, mask = _scores_and_mask(FP16)
    with pytest.raises(RuntimeError, match="without overflow"):
        scores.masked_fill(mask, -1e10)
    additive = scores + mask.to(FP16) * torch.tensor(-1e10, dtype=FP16)
    assert torch.isnan(additive[0, 0]) and torch.isnan(additive[0, 2])   # unmasked entries poisoned
    assert torch.isnan(scores.masked_fill(mask, float("-inf")).softmax(-1)[1]).all()


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_masked_fill_min_softmax_is_finite_and_fully_masked_row_is_uniform(dtype):
    scores, mask = _scores_and_mask(dtype)
    filled = ops.masked_fill_min(scores, mask)
    assert filled.dtype == dtype and filled[0, 1].item() == torch.finfo(dtype).min
    probs = filled.softmax(-1)
    assert torch.isfinite(probs).all()
    assert probs[1].tolist() == [0.25, 0.25, 0.25, 0.25]                 # documented: uniform, not NaN
    assert probs[0, 1].item() == 0.0 and probs[0, 3].item() == 0.0      # masked entries exactly 0
    expected = torch.softmax(torch.tensor([1.0, 3.0]), -1).to(dtype)    # fp32 reference on the unmasked
    torch.testing.assert_close(probs[0, [0, 2]], expected)


def test_masked_fill_min_wants_a_bool_mask():
    scores, mask = _scores_and_mask(FP32)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor.*mask.bool\(\)"):
        ops.masked_fill_min(scores, mask.float())


# ---------------------------------------------------------------- case 12: norms
def _handwritten_rms_norm(x, eps):
    """What case 12's users wrote: everything in the input dtype, eps included."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.tensor(eps, dtype=x.dtype))


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_rms_norm_of_300s_is_ones(dtype):
    x = torch.full((1, 1280), 300.0, dtype=dtype)
    if dtype == FP16:   # the trap: 300**2 = 90000 > 65504 -> inf -> rsqrt = 0 -> silent zeros
        assert (_handwritten_rms_norm(x, 1e-6) == 0).all()
    y = ops.rms_norm(x)
    assert y.dtype == dtype and y.shape == (1, 1280)
    assert (y == 1.0).all()


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_rms_norm_tiny_eps_is_applied_in_fp32(dtype):
    x = torch.zeros(2, 8, dtype=dtype)
    if dtype == FP16:   # the trap: 1e-12 rounds to 0 in fp16 -> 0 * rsqrt(0) = NaN
        assert torch.tensor(1e-12, dtype=FP16).item() == 0.0
        assert torch.isnan(_handwritten_rms_norm(x, 1e-12)).all()
    y = ops.rms_norm(x, eps=1e-12)
    assert y.dtype == dtype and (y == 0).all()


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_rms_norm_matches_fp64_reference(dtype):
    x = torch.randn(4, 16) * 50
    weight = torch.linspace(0.5, 2.0, 16)
    x_lp = x.to(dtype)
    ref = x_lp.double() / torch.sqrt(x_lp.double().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    y = ops.rms_norm(x_lp, weight, eps=1e-6)
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref.to(dtype), rtol=1e-6 if dtype == FP32 else None,
                               atol=1e-6 if dtype == FP32 else None)


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), True])
def test_rms_norm_rejects_bad_eps(eps):
    with pytest.raises(ValueError, match=r"eps=.* must be a finite number >= 0"):
        ops.rms_norm(torch.ones(2, 4), eps=eps)


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_layer_norm_stats_are_fp32_and_exact(dtype):
    x = torch.tensor([[300.0, -300.0] * 4, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]], dtype=dtype)  # (2, 8)
    mean, var = ops.layer_norm_stats(x)
    assert mean.dtype == var.dtype == FP32 and mean.shape == var.shape == (2, 1)
    assert mean[:, 0].tolist() == [0.0, 4.5]
    assert var[:, 0].tolist() == [90000.0, 5.25]                # 90000 would be inf in fp16
    assert torch.isinf(var.to(FP16)[0, 0])
    y = ((x.float() - mean) * torch.rsqrt(var + 1e-5)).to(dtype)  # the documented normalisation
    torch.testing.assert_close(y, F.layer_norm(x.float(), (8,), eps=1e-5).to(dtype))


def test_layer_norm_stats_over_several_dims():
    x = torch.arange(24, dtype=BF16).reshape(2, 3, 4)
    mean, var = ops.layer_norm_stats(x, dim=(1, 2))
    assert mean.shape == (2, 1, 1)
    assert mean.flatten().tolist() == [5.5, 17.5]
    assert var.flatten().tolist() == pytest.approx([143 / 12, 143 / 12])  # population variance of 0..11


# ---------------------------------------------------------------- case 14: BCE
@pytest.mark.parametrize("policy, dtype", POLICIES)
def test_bce_on_probabilities_is_fp32_under_autocast(policy, dtype):
    model = nn.Linear(4, 1)
    mp = _engine(model, policy)
    x = mp.cast_inputs(torch.randn(3, 4))
    target = torch.ones(3, 1)
    with mp.autocast():
        probs = torch.sigmoid(model.forward(x))     # .forward: skip the engine's fp32 output hook
        loss = ops.binary_cross_entropy(probs, target)
    assert probs.dtype == dtype
    assert loss.dtype == FP32 and loss.shape == ()
    torch.testing.assert_close(loss, -torch.log(probs.float()).mean(), rtol=1e-6, atol=0)
    loss.backward()
    assert model.weight.grad is not None and torch.isfinite(model.weight.grad).all()
    assert model.weight.grad.abs().sum() > 0


def test_bce_runs_with_autocast_disabled_on_fp32_inputs(monkeypatch):
    """What makes CPU and CUDA agree: torch's BCE never sees autocast or a 16-bit input."""
    seen = []
    real = F.binary_cross_entropy

    def spy(p, t, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), p.dtype, t.dtype))
        return real(p, t, **kwargs)

    monkeypatch.setattr(F, "binary_cross_entropy", spy)
    with torch.autocast("cpu", dtype=BF16):
        ops.binary_cross_entropy(torch.tensor([0.25, 0.5], dtype=BF16), torch.tensor([1, 0], dtype=BF16))
    assert seen == [(False, FP32, FP32)]


def test_bce_reductions_and_errors():
    probs = torch.tensor([0.5, 0.25], dtype=BF16)
    target = torch.tensor([1.0, 0.0])
    weight = torch.tensor([1.0, 2.0])
    none = ops.binary_cross_entropy(probs, target, weight, reduction="none")
    expected = torch.tensor([-torch.log(torch.tensor(0.5)), -2 * torch.log(torch.tensor(0.75))])
    torch.testing.assert_close(none, expected)
    torch.testing.assert_close(ops.binary_cross_entropy(probs, target, weight, reduction="sum"), expected.sum())
    with pytest.raises(ValueError, match=r"reduction='avg' is not allowed; choose one of"):
        ops.binary_cross_entropy(probs, target, reduction="avg")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA half of case 14 needs a GPU")
def test_bce_same_on_cuda_where_raw_bce_is_refused():
    probs = torch.tensor([0.25, 0.5, 0.75], device="cuda")
    target = torch.tensor([1.0, 0.0, 1.0], device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(probs, target)
        loss = ops.binary_cross_entropy(probs, target)
    assert loss.dtype == FP32
    torch.testing.assert_close(loss.cpu(), ops.binary_cross_entropy(probs.cpu(), target.cpu()))


# ---------------------------------------------------------------- case 20: no_grad then grad in one region
@pytest.mark.parametrize("policy, dtype", POLICIES)
def test_no_grad_forward_does_not_poison_the_autocast_weight_cache(policy, dtype):
    model = nn.Linear(2, 2)
    mp = _engine(model, policy)
    x = mp.cast_inputs(torch.tensor([[1.0, 2.0], [3.0, -1.0]]))
    with mp.autocast():
        with torch.no_grad():
            y_no_grad = model(x)
        y = model(x)
    assert y_no_grad.grad_fn is None
    assert y.grad_fn is not None
    assert torch.equal(y, y_no_grad)
    y.sum().backward()
    # d(sum(x @ W.T + b))/dW[i, j] = sum over the batch of x[:, j] = [4, 1] for every row i
    assert model.weight.grad.tolist() == [[4.0, 1.0], [4.0, 1.0]]
    assert model.bias.grad.tolist() == [2.0, 2.0]


# ---------------------------------------------------------------- case 21: checkpoint
class _Recorder:
    """Forward hooks recording (output dtype, autocast enabled, cache flag) per call."""

    def __init__(self, *modules):
        self.calls = []
        for m in modules:
            m.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls.append((output.dtype, torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))


def _two_linears():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def _full_recompute():
    """Recompute every op: by default torch stops as soon as the saved tensors are rebuilt, before
    the last layer's forward hook would fire."""
    return torch.utils.checkpoint.set_checkpoint_early_stop(False)


@pytest.mark.parametrize("policy, dtype", POLICIES)
def test_checkpoint_recomputes_in_the_forward_dtype(policy, dtype):
    model = _two_linears()
    mp = _engine(model, policy)
    rec = _Recorder(model[0], model[1])
    x = mp.cast_inputs(torch.randn(2, 8)).requires_grad_()
    with mp.autocast(), _full_recompute():
        y = ops.checkpoint(lambda inp, *, scale: model(inp) * scale, x, scale=2.0)
    assert len(rec.calls) == 2
    y.sum().backward()                     # outside the autocast region: recompute must re-enter it
    assert len(rec.calls) == 4, "backward did not recompute"
    assert rec.calls[:2] == [(dtype, True, True)] * 2
    assert rec.calls[2:] == rec.calls[:2]
    ckpt_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    for p in [*model.parameters(), x]:
        p.grad = None
    with mp.autocast():                    # the same step without checkpointing: identical grads
        (model(x) * 2.0).sum().backward()
    for got, want in zip(ckpt_grads, [*[p.grad for p in model.parameters()], x.grad]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("policy, outer, inner", [("bf16-mixed", BF16, FP16), ("fp16-mixed", FP16, BF16)])
def test_checkpoint_recompute_state_with_nested_autocast_regions(policy, outer, inner):
    model = _two_linears()
    mp = _engine(model, policy)
    rec = _Recorder(model[0], model[1])

    def block(inp):
        h = model[0](inp)
        with torch.autocast("cpu", enabled=False):   # a region nested inside the checkpointed fn
            return model[1](h.float())

    x = mp.cast_inputs(torch.randn(2, 8)).requires_grad_()
    with mp.autocast(), _full_recompute():
        a = ops.checkpoint(model[0], x)                                      # outer region
        with torch.autocast("cpu", dtype=inner, cache_enabled=False):        # nested region
            b = ops.checkpoint(block, x)
        assert torch.get_autocast_dtype("cpu") == outer
    forward = list(rec.calls)
    assert forward == [(outer, True, True), (inner, True, False), (FP32, False, False)]
    (a.float().sum() + b.sum()).backward()
    recompute = rec.calls[3:]
    assert sorted(recompute, key=str) == sorted(forward, key=str)   # backward order is autograd's
    assert len(recompute) == 3


def test_checkpoint_without_grad_just_runs():
    model = _two_linears()
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        assert torch.equal(ops.checkpoint(model, x), model(x))


# ---------------------------------------------------------------- case 22: custom autograd Functions
def _strict_mm(fwd_decorator=None, bwd_decorator=None, log=None):
    """A Function whose forward and backward call a strict-dtype matmul (a stand-in for a custom kernel)."""
    fwd_decorator = fwd_decorator or (lambda f: f)
    bwd_decorator = bwd_decorator or (lambda f: f)

    class StrictMM(torch.autograd.Function):
        @staticmethod
        @fwd_decorator
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = a.mm(b)
            if log is not None:
                log.append(("fwd", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                            a.dtype, b.dtype, out.dtype))
            return out

        @staticmethod
        @bwd_decorator
        def backward(ctx, grad_out):
            a, b = ctx.saved_tensors
            grad_a = grad_out.mm(b.t())
            if log is not None:
                log.append(("bwd", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                            grad_out.dtype, grad_a.dtype))
            return grad_a, a.t().mm(grad_out)

    return StrictMM


def test_custom_function_gets_mixed_dtypes_without_the_decorator():
    """The trap: autocast does not reach into a custom kernel; a bf16 activation meets an fp32 weight."""
    lin = nn.Linear(4, 4)
    w = torch.randn(4, 3)
    with torch.autocast("cpu", dtype=BF16):
        act = lin(torch.randn(2, 4))
        with torch.autocast("cpu", enabled=False), pytest.raises(RuntimeError, match="same dtype"):
            _strict_mm().apply(act, w)


@pytest.mark.parametrize("policy, dtype", POLICIES)
def test_custom_fwd_cast_inputs_declares_the_compute_dtype(policy, dtype):
    model = nn.Linear(4, 4)
    mp = _engine(model, policy)
    log = []
    fn = _strict_mm(ops.custom_fwd(device_type="cpu", cast_inputs=FP32), ops.custom_bwd(device_type="cpu"), log)
    w = torch.randn(4, 3, requires_grad=True)
    with mp.autocast():
        act = model.forward(mp.cast_inputs(torch.randn(2, 4)))
        act.retain_grad()
        out = fn.apply(act, w)
    assert act.dtype == dtype
    assert out.dtype == FP32
    assert torch.equal(out, act.float().mm(w))
    out.sum().backward()
    assert log[0] == ("fwd", False, dtype, FP32, FP32, FP32)    # inputs cast, autocast off inside
    assert log[1][:2] == ("bwd", False) and log[1][3:] == (FP32, FP32)  # backward: same state as forward
    assert act.grad.dtype == dtype                              # autograd hands each input its own dtype
    assert torch.equal(act.grad, torch.ones(2, 3).mm(w.detach().t()).to(dtype))
    assert torch.equal(w.grad, act.detach().float().t().mm(torch.ones(2, 3)))


@pytest.mark.parametrize("policy, dtype", POLICIES)
def test_custom_bwd_reenters_the_forward_autocast_dtype(policy, dtype):
    model = nn.Linear(4, 4)
    mp = _engine(model, policy)
    log = []
    fn = _strict_mm(ops.custom_fwd(device_type="cpu"), ops.custom_bwd(device_type="cpu"), log)
    w = torch.randn(4, 3, requires_grad=True)
    with mp.autocast():
        act = model.forward(mp.cast_inputs(torch.randn(2, 4)))
        out = fn.apply(act, w)          # a (half) @ w (fp32): autocast casts both, output half
    assert out.dtype == dtype
    out.float().sum().backward()        # outside autocast
    assert log == [("fwd", True, dtype, dtype, FP32, dtype), ("bwd", True, dtype, dtype, dtype)]
    assert w.grad.dtype == FP32 and torch.isfinite(w.grad).all()


def test_custom_fwd_is_a_no_op_outside_autocast():
    log = []
    fn = _strict_mm(ops.custom_fwd(device_type="cpu", cast_inputs=BF16), ops.custom_bwd(device_type="cpu"), log)
    out = fn.apply(torch.ones(2, 2), torch.ones(2, 2))
    assert out.dtype == FP32 and log[0][3:] == (FP32, FP32, FP32)


def test_custom_fwd_validates_its_arguments():
    with pytest.raises(TypeError, match=r"cast_inputs=torch.int32 must be a floating torch.dtype"):
        ops.custom_fwd(device_type="cpu", cast_inputs=torch.int32)
    with pytest.raises(ValueError, match=r"device='gpu' is not a device"):
        ops.custom_fwd(device_type="gpu")
    with pytest.raises(TypeError, match=r"must be a str or torch.device"):
        ops.custom_bwd(device_type=0)
    ops.custom_fwd(device_type="cuda:0")   # normalised to "cuda", as torch.amp expects


# ---------------------------------------------------------------- case 23: buffers for autocast outputs
@pytest.mark.parametrize("policy, dtype", POLICIES)
def test_indexed_write_into_a_buffer_matching_autocast(policy, dtype):
    model = nn.Linear(16, 32)
    mp = _engine(model, policy)
    x = mp.cast_inputs(torch.randn(3, 16))
    rows = torch.tensor([True, False, True])
    with mp.autocast():
        out = model.forward(x[rows])                    # (2, 32) in the compute dtype
        plain = torch.zeros(3, 32)
        with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
            plain[rows] = out
        buf = ops.zeros_like_output((3, 32), device=mp.device)
        buf[rows] = out
    assert buf.dtype == dtype
    assert torch.equal(buf[rows], out)
    assert (buf[1] == 0).all()
    outside = ops.zeros_like_output(torch.Size([3, 32]), device="cpu")
    outside[rows] = model(x[rows])                      # outside autocast: fp32 output, fp32 buffer
    assert outside.dtype == FP32


def test_autocast_dtype_follows_the_current_region():
    assert ops.autocast_dtype("cpu") == FP32
    assert ops.autocast_dtype("cpu", reference_dtype=BF16) == BF16   # pure-bf16 params, autocast off
    with torch.autocast("cpu", dtype=BF16):
        assert ops.autocast_dtype("cpu") == BF16
        assert ops.autocast_dtype(torch.device("cpu")) == BF16
        assert ops.autocast_dtype("cpu", reference_dtype=FP16) == BF16   # autocast casts fp16 too
        assert ops.autocast_dtype("cpu", reference_dtype=torch.float64) == torch.float64
        assert ops.autocast_dtype("cuda:0") == FP32                     # another device's region is off
        with torch.autocast("cpu", enabled=False):                      # e.g. a keep_fp32 module
            assert ops.autocast_dtype("cpu") == FP32
        with torch.autocast("cpu", dtype=FP16):
            assert ops.autocast_dtype("cpu") == FP16
    with pytest.raises(TypeError, match=r"reference_dtype=torch.int64 must be a floating"):
        ops.autocast_dtype("cpu", reference_dtype=torch.int64)


# ---------------------------------------------------------------- case 25: fp16 inputs in CPU bf16 autocast
def test_fp16_inputs_concatenate_after_engine_cast_inputs():
    # The raw path raises inside torch: at::autocast::prioritize knows only fp32 and the autocast dtype.
    a16 = torch.tensor([[1.0, 2.5]], dtype=FP16)
    b16 = torch.tensor([[-3.0, 0.125]], dtype=FP16)
    with torch.autocast("cpu", dtype=BF16), pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
        torch.cat([a16, b16])
    mp = _engine(nn.Linear(2, 2), "bf16-mixed")
    batch = mp.cast_inputs({"a": a16, "b": b16, "ids": torch.tensor([1, 2])})
    assert batch["a"].dtype == FP32 and batch["ids"].dtype == torch.int64
    with mp.autocast():
        joined = torch.cat([batch["a"], batch["b"]])
    assert joined.dtype == FP32
    assert joined.tolist() == [[1.0, 2.5], [-3.0, 0.125]]


# ================================================================ the ops inside a trained model (cases.md)


# ---------------------------------------------------------------- case 10: masks
def test_case10_masked_scores_under_the_engine_fp16_region_softmax_finitely():
    model = nn.Sequential(_linear(4, 4))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu")
    mask = torch.tensor([[False, True, False, True], [True, True, True, True]])
    with mp.autocast():
        scores = model[0](torch.randn(2, 4))          # a submodule: the compute dtype, fp16
        probs = ops.masked_fill_min(scores, mask).softmax(-1)
    assert scores.dtype == FP16
    assert torch.isfinite(probs).all()
    assert (probs[0][mask[0]] == 0).all() and torch.allclose(probs[0].float().sum(), torch.tensor(1.0), atol=1e-3)
    assert torch.equal(probs[1].float(), torch.full((4,), 0.25))   # a fully masked row is uniform

    class BigNegativeMask(nn.Module):                 # the trap: an additive -1e10 mask in fp16
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(4, 4)

        def forward(self, x):
            s = self.q(x)
            return (s + mask.to(s.dtype) * -1e10).softmax(-1)

    report = mixprec.locate_nonfinite(BigNegativeMask(), torch.randn(2, 4), lambda m, b: m(b).float().sum(),
                                      "fp16-mixed", "cpu")
    assert report is not None and report.where == "forward" and report.module == ""   # the model's own op
    assert report.module_type == "BigNegativeMask" and report.dtype == FP16 and "nan" in report.kind


# ---------------------------------------------------------------- case 12: norm statistics in fp32
def test_case12_rms_norm_in_a_model_stays_finite_where_the_hand_written_norm_goes_silent():
    class Norm(nn.Module):
        def __init__(self, naive):
            super().__init__()
            self.naive = naive
            self.weight = nn.Parameter(torch.ones(1280))

        def forward(self, x):
            if self.naive:   # what case 12's users wrote: square and eps in the input dtype
                return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-12) * self.weight.to(x.dtype)
            return ops.rms_norm(x, self.weight, eps=1e-12)

    x = torch.full((2, 1280), 300.0)
    for naive, expect in ((True, 0.0), (False, 1.0)):
        model = nn.Sequential(Norm(naive))
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="fp16-pure", device="cpu")
        with mp.autocast():
            out = model[0](mp.cast_inputs(x))
        # the naive norm's rsqrt runs in fp32 (CUDA's autocast list, ops=portable), so its product is fp32
        assert out.dtype == (FP32 if naive else FP16) and torch.equal(out.float(), torch.full((2, 1280), expect))
    # a constant-zero row with eps 1e-12 gives zeros, not 0 * rsqrt(0) = NaN; 300s have a finite fp16 backward
    zeros = ops.rms_norm(torch.zeros(1, 16, dtype=FP16), eps=1e-12)
    assert torch.equal(zeros, torch.zeros(1, 16, dtype=FP16))
    xg = torch.full((1, 16), 300.0, dtype=FP16, requires_grad=True)
    w = torch.ones(16, dtype=FP16, requires_grad=True)
    out = ops.rms_norm(xg, w, eps=1e-12)
    (out.float() * torch.arange(16.0)).sum().backward()
    assert torch.equal(out, torch.ones_like(out))
    assert torch.isfinite(xg.grad).all() and torch.isfinite(w.grad).all() and xg.grad.dtype == FP16
    assert w.grad.tolist() == list(range(16))


# ---------------------------------------------------------------- case 14: probability BCE
@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed", "bf16-pure", "fp16-pure", "fp32"])
def test_case14_probability_bce_is_an_fp32_loss_that_trains_under_every_policy(policy):
    model = nn.Sequential(_linear(4, 1), nn.Sigmoid())
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    with mp.autocast():
        probs = model[1](model[0](mp.cast_inputs(torch.randn(3, 4))))
        loss = ops.binary_cross_entropy(probs, torch.ones(3, 1))
    assert probs.dtype == mp.policy.compute_dtype
    assert loss.dtype == FP32 and torch.isfinite(loss)
    mp.backward(loss)
    assert mp.step().applied
    with torch.autocast("cpu", dtype=BF16):   # saturated probabilities: log clamped at -100, as torch
        clamped = ops.binary_cross_entropy(torch.tensor([0.0, 1.0], dtype=BF16), torch.tensor([1.0, 0.0]))
    assert clamped.item() == 100.0


# ---------------------------------------------------------------- case 20: autocast cast cache and no_grad
@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-pure", "fp8-mixed"])
def test_case20_no_grad_forward_then_grad_forward_trains_every_parameter(policy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    x = mp.cast_inputs(torch.randn(2, 16) * 0.1)
    with mp.autocast():
        with torch.no_grad():
            y0 = mp.model(x)
        y = mp.model(x)
    assert y0.grad_fn is None and y.grad_fn is not None and torch.equal(y, y0)
    mp.backward(y.float().pow(2).mean())
    assert all(m.grad is not None and m.grad.abs().sum() > 0 for m in mp.master_parameters())
    assert mp.step().applied


# ---------------------------------------------------------------- case 21: checkpoint recompute
def test_case21_checkpointed_block_in_a_pure_policy_recomputes_in_the_forward_dtypes():
    ran = []

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            def inner(t):   # two linears 8 -> 8, as in the case; the GELU output is recomputed
                out = self.b(F.gelu(self.a(t)))
                ran.append((out.dtype, torch.is_autocast_enabled("cpu")))
                return out
            return self.head(ops.checkpoint(inner, x))

    torch.manual_seed(0)
    model = Block()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-pure,keep_fp32=head",
                        device="cpu")
    with mp.autocast(), torch.utils.checkpoint.set_checkpoint_early_stop(False):   # recompute all of it
        loss = mp.model(mp.cast_inputs(torch.randn(2, 8))).float().sum()
    with torch.autocast("cpu", dtype=FP16):       # backward under another autocast state
        mp.backward(loss)
    assert ran == [(BF16, True), (BF16, True)]    # forward, then recompute: the same state
    assert mp.step().applied and model.head.weight.dtype == FP32 and model.a.weight.dtype == BF16


# ---------------------------------------------------------------- case 22: custom autograd Functions
class _StrictMatmul(torch.autograd.Function):
    """A stand-in for a custom kernel: a matmul that wants both operands in one dtype."""

    log: list = []

    @staticmethod
    @ops.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        _StrictMatmul.log.append(("fwd", a.dtype, b.dtype, torch.is_autocast_enabled("cpu")))
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @ops.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        _StrictMatmul.log.append(("bwd", grad.dtype, torch.is_autocast_enabled("cpu")))
        return grad.mm(b.t()), a.t().mm(grad)


@pytest.mark.parametrize("policy, dtype", [("fp16-mixed", FP16), ("bf16-pure", BF16), ("fp16-pure", FP16)])
def test_case22_custom_function_inside_a_trained_model(policy, dtype):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(4, 4)
            self.w = nn.Parameter(torch.randn(4, 3) * 0.1)

        def forward(self, x):
            h = self.proj(x)
            self.h_dtype = h.dtype
            return _StrictMatmul.apply(h, self.w)

    _StrictMatmul.log = []
    model = Net()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    result = _one_step(mp, torch.randn(2, 4) * 0.1, lambda out: out.float().mean())
    assert model.h_dtype == dtype
    assert _StrictMatmul.log == [("fwd", FP32, FP32, False), ("bwd", FP32, False)]
    assert result.applied and all(torch.isfinite(m).all() for m in mp.master_parameters())


# ---------------------------------------------------------------- case 23: buffers for autocast outputs
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-pure"])
def test_case23_scatter_into_a_policy_buffer_inside_a_trained_model(policy):
    class Scatter(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(16, 32)
            self.head = nn.Linear(32, 1)

        def forward(self, x, rows):
            ref = self.head.weight.dtype if mp.policy.param_dtype != FP32 else None
            buf = ops.zeros_like_output((x.shape[0], 32), device=x.device, reference_dtype=ref)
            buf[rows] = self.lin(x[rows])
            self.buf_dtype = buf.dtype
            return self.head(buf)

    model = Scatter()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    rows = torch.tensor([True, False, True])
    with mp.autocast():
        out = mp.model(mp.cast_inputs(torch.randn(3, 16) * 0.1), rows)
        assert model.buf_dtype == mp.policy.compute_dtype
    mp.backward(out.float().mean() * 0.1)
    assert mp.step().applied
