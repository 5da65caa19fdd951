"""The public bug reports of shared/cases/cases.md, one test per case, through the public API.

These complement test_engine.py, test_ops.py, test_loss_scale.py, test_optim.py, test_devices.py
and test_distributed.py: each test here checks the case's "correct behaviour" (d) on a path those
files do not take (other policies, nested modules, engine-level use of the ops, other schedulers,
data rather than loss faults...). Multi-rank and device halves are checked through what runs on
one CPU (a one-process gloo group, planning capabilities).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import mixprec
from mixprec import DivergenceError, Guard, MixedPrecision, ops
from mixprec.devices import Capability, resolve
from mixprec.loss_scale import DynamicLossScale, StaticLossScale

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _linear(n_in=4, n_out=1, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def _one_step(mp, x, loss_of=lambda out: out.float().sum()):
    with mp.autocast():
        loss = loss_of(mp.model(mp.cast_inputs(x)))
    mp.backward(loss)
    return mp.step()


# ---------------------------------------------------------------- case 1: NaN in the data, every step
@pytest.mark.parametrize("policy, scale", [
    ("bf16-mixed", 1.0),          # no loss scaling
    ("fp16-pure", 2.0 ** 16),     # a non-finite *loss* never halves the scale: scaling cannot fix data
])
def test_case01_nan_batch_every_step_stops_at_the_floor_and_blames_the_data(policy, scale):
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu",
                        max_stuck_skips=6)
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")            # the input batch itself holds NaN
    scales = []
    with pytest.raises(DivergenceError) as err:
        for _ in range(200):
            result = _one_step(mp, x)
            assert not result.applied and result.skipped_reason == "nonfinite"
            scales.append(result.loss_scale)
    assert set(scales) == {scale} and float(mp.loss_scale.scale) == scale     # never 0, never denormal
    assert "6 consecutive steps with a non-finite loss" in str(err.value)
    assert "the fault is in the data or the forward pass" in str(err.value)
    assert mp.applied_steps == 0 and mp.skipped_total == 6


def test_case01_guard_names_the_bad_batch_and_a_floor_below_one_is_kept():
    loss_fn = lambda model, batch: model(batch).float().sum()   # noqa: E731
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        guard=Guard(loss_fn=loss_fn, max_rollbacks=2))
    x = torch.randn(2, 4)
    x[1, 2] = float("nan")
    with pytest.raises(DivergenceError, match=r"first non-finite: the batch itself holds nan"):
        for _ in range(50):
            _one_step(mp, x)
    assert [e["kind"] for e in mp.events] == ["skip", "skip", "diverged"]
    assert mp.guard.state.escalations[-1] == "none: the batch itself holds non-finite values"

    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        max_stuck_skips=4, loss_scale=DynamicLossScale(init_scale=1.0, min_scale=2.0 ** -3))
    with pytest.raises(DivergenceError, match=r"at its floor 0\.125"):
        for _ in range(50):   # gradients overflow (finite loss): the scale backs off below 1, to its floor
            _one_step(mp, torch.randn(2, 4), lambda out: 1e6 * out.float().sum())   # 1e6 * 0.125 > 65504
    assert float(mp.loss_scale.scale) == 0.125


# ---------------------------------------------------------------- case 2: stuck at the floor
def test_case02_min_scale_below_one_lets_an_overflowing_step_apply_like_fp32():
    x = torch.randn(2, 4)

    def run(policy, loss_scale=None):
        model = _linear(4, 3)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-9), policy=policy, device="cpu",
                            loss_scale=loss_scale, max_stuck_skips=5)
        results = [_one_step(mp, x, lambda out: 1e5 * out.float().sum()) for _ in range(8)]
        return model, mp, results

    model, mp, results = run("fp16-mixed", DynamicLossScale(init_scale=4.0, min_scale=2.0 ** -4))
    applied = [r.applied for r in results]
    assert applied[0] is False and any(applied)               # overflow at 4, applies once the scale is < 1
    first = applied.index(True)
    assert [r.skipped_reason for r in results[:first]] == ["overflow"] * first
    assert results[first].loss_scale < 1.0 and results[-1].skipped_total == first
    assert mp.applied_steps == 8 - first and int(mp.loss_scale.floor_skips) == 0
    # the applied updates are fp32's, to fp16's rounding of the output gradient
    ref_model = _linear(4, 3)
    opt = torch.optim.SGD(ref_model.parameters(), lr=1e-9)
    for _ in range(8 - first):
        opt.zero_grad()
        (1e5 * ref_model(x).sum()).backward()
        opt.step()
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=0, atol=1e-6)


def test_case02_stuck_at_floor_is_counted_and_raises_at_the_threshold():
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        loss_scale=DynamicLossScale(init_scale=2.0, min_scale=1.0), max_stuck_skips=3)
    x = torch.randn(2, 4)
    seen = []
    with pytest.raises(DivergenceError, match=r"3 consecutive skipped steps .* floor 1 .*loss is finite"):
        for _ in range(50):
            seen.append(_one_step(mp, x, lambda out: 1e5 * out.sum()))
    # scale 2 (skip, back off to 1), then two skips at the floor; the third raises
    assert [(r.applied, r.skipped_reason, r.loss_scale, r.skipped_total) for r in seen] == [
        (False, "overflow", 2.0, 1), (False, "overflow", 1.0, 2), (False, "overflow", 1.0, 3)]
    # the raising (4th) step is a finished boundary: counted as skipped, loss scale updated
    assert (mp.boundaries, mp.skipped_total, mp.applied_steps, mp.micro_step) == (4, 4, 0, 0)
    assert int(mp.loss_scale.floor_skips) == 3 and int(mp.loss_scale.consecutive_skips) == 4


# ---------------------------------------------------------------- case 3: clipping sees unscaled grads
@pytest.mark.parametrize("policy, loss_scale", [
    ("fp16-mixed", StaticLossScale(2.0 ** -8)),    # a scale below one
    ("fp16-mixed", StaticLossScale(256.0)),
    ("fp16-pure", None),                           # dynamic 2**16 on fp16 params with fp32 masters
])
def test_case03_clipping_and_reported_norm_match_fp32_whatever_the_scale(policy, loss_scale):
    torch.manual_seed(0)
    w0 = torch.randn(1, 4) * 0.1
    x = torch.randn(8, 4) * 0.3

    def run(policy, loss_scale=None, max_norm=0.01, accumulation=2):
        model = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(w0)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu",
                            max_grad_norm=max_norm, loss_scale=loss_scale, accumulation_steps=accumulation)
        for chunk in x.chunk(accumulation):
            result = _one_step(mp, chunk, lambda out: 5.0 * out.float().pow(2).mean())
        return next(mp.master_parameters()).detach().clone(), result

    w32, r32 = run("fp32")
    w16, r16 = run(policy, loss_scale)
    assert r32.grad_norm > 0.01                                     # the clip is active in both runs
    assert r16.applied and math.isclose(r16.grad_norm, r32.grad_norm, rel_tol=2e-3)
    torch.testing.assert_close(w16, w32, rtol=1e-3, atol=1e-6)      # the clipped update is fp32's
    assert not torch.equal(w16, w0)


def test_case03_inf_gradients_stay_visible_to_the_skip_when_clipping():
    model = nn.Linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed", device="cpu",
                        max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    result = _one_step(mp, torch.randn(2, 4), lambda out: out.float().sum() * float("inf"))
    assert not result.applied and result.skipped_reason == "nonfinite"
    assert not math.isfinite(result.grad_norm)                       # the reported norm is not disguised
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- case 4: the lifecycle belongs to the engine
def test_case04_skip_then_apply_and_refused_misuse_leave_the_engine_usable():
    model = _linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-pure", device="cpu",
                        max_grad_norm=1.0, accumulation_steps=2)
    x = torch.randn(2, 4) * 0.01
    small = lambda out: out.float().mean()           # noqa: E731
    huge = lambda out: out.float().mean() * 1e30     # noqa: E731
    assert _one_step(mp, x, huge) is None            # first micro-batch: no boundary yet
    skipped = _one_step(mp, x, small)                # the boundary: overflow anywhere in it skips
    assert (skipped.applied, skipped.skipped_reason) == (False, "overflow")
    assert all(m.grad is None for m in mp.master_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert _one_step(mp, x, small) is None
    applied = _one_step(mp, x, small)                # no "unscale_() has already been called"
    assert applied.applied and applied.step == 1 and applied.loss_scale == 2.0 ** 15
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(x)).float().mean()
    mp.backward(loss)
    mp.step()
    mp.backward(mp.model(mp.cast_inputs(x)).float().mean())
    with pytest.raises(RuntimeError, match=r"backward\(\) called 3 times since the last step\(\) with "
                                           r"accumulation_steps=2"):
        mp.backward(mp.model(mp.cast_inputs(x)).float().mean())
    result = mp.step()                               # the refused call changed nothing
    assert result.applied and result.step == 2
    with pytest.raises(RuntimeError, match=r"step\(\) called without backward\(\)"):
        mp.step()


# ---------------------------------------------------------------- case 6: schedulers follow applied steps
SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=3),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 2), torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 1)],
        milestones=[2]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_case06_any_epoch_scheduler_steps_only_on_applied_steps_without_warnings(name):
    model = _linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(1, 4) * 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no "lr_scheduler.step() before optimizer.step()"
        scheduler = SCHEDULERS[name](opt)
        mp = MixedPrecision(model, opt, policy="fp16-mixed", device="cpu", scheduler=scheduler)
        results = [_one_step(mp, x, lambda out, k=k: out.float().sum() * k) for k in (1e35, 1.0, 1e35, 1.0)]
    assert [r.applied for r in results] == [False, True, False, True]
    assert [r.step for r in results] == [0, 1, 1, 2] and [r.skipped_total for r in results] == [1, 1, 2, 2]
    assert (mp.applied_steps, mp.skipped_total, mp.boundaries) == (2, 2, 4)
    assert scheduler.last_epoch == 2


# ---------------------------------------------------------------- case 7: 16-bit parameters and scaling
def test_case07_half_models_are_refused_or_get_fp32_masters():
    whole = nn.Linear(4, 1).half()
    with pytest.raises(ValueError, match=r"already holds weight \(float16\), bias \(float16\).*model\.float\(\)"):
        MixedPrecision(whole, torch.optim.SGD(whole.parameters(), lr=0.1), policy="fp16-mixed", device="cpu")
    stray = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    stray[1].to(BF16)
    with pytest.raises(ValueError, match=r"1\.weight \(bfloat16\), 1\.bias \(bfloat16\)"):
        MixedPrecision(stray, torch.optim.SGD(stray.parameters(), lr=0.1), policy="fp16-pure", device="cpu")
    # the fp16 policy with fp32 masters: the 16-bit copy computes, the fp32 copy is stepped, scaling works
    model = nn.Linear(4, 1).half()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-pure", device="cpu")
    result = _one_step(mp, torch.randn(2, 4) * 0.01, lambda out: out.float().mean() * 0.1)
    (master_w, master_b) = list(mp.master_parameters())
    assert result.applied and result.loss_scale == 2.0 ** 16
    assert model.weight.dtype == FP16 and master_w.dtype == FP32 and master_w.grad is None
    assert torch.equal(model.weight, master_w.to(FP16)) and torch.equal(model.bias, master_b.to(FP16))


# ---------------------------------------------------------------- case 8: no scaling under bf16
@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr", "fp8-mixed"])
def test_case08_bf16_policies_scale_nothing_warn_nothing_and_still_skip_nan(policy):
    model = nn.Sequential(_linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu")
    assert not mp.loss_scale.enabled and float(mp.loss_scale.scale) == 1.0
    before = [p.detach().clone() for p in model.parameters()]
    result = _one_step(mp, torch.randn(2, 16), lambda out: out.float().sum() * float("nan"))
    assert (result.applied, result.skipped_reason, result.loss_scale) == (False, "nonfinite", 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("policy, override", [("bf16-pure,loss_scale=dynamic", None), ("bf16-pure", 128.0),
                                              ("bf16-sr", DynamicLossScale())])
def test_case08_forcing_a_scale_under_bf16_warns_and_trains(policy, override):
    model = _linear(4, 1)
    with pytest.warns(UserWarning, match="bf16 has fp32's exponent range"):
        mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu",
                            loss_scale=override)
    assert _one_step(mp, torch.randn(2, 4)).applied


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


# ---------------------------------------------------------------- case 11: an FFN activation above 65504
class _FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 8, bias=False)
        self.ln = nn.LayerNorm(8)
        self.down = nn.Linear(8, 1)
        with torch.no_grad():
            self.up.weight.fill_(30.0)   # 40 * 30 * 64 = 76800 > 65504

    def forward(self, x):
        return self.down(self.ln(self.up(x)))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(_FFN(), _FFN())

    def forward(self, x):
        return self.blocks[0](x) + self.blocks[1](x)


def test_case11_nested_overflow_is_named_and_a_glob_keeps_every_match_in_fp32():
    x = torch.full((1, 64), 40.0)
    loss_fn = lambda model, batch: model(batch).float().sum()   # noqa: E731
    report = mixprec.locate_nonfinite(_Stack(), x, loss_fn, "fp16-mixed", "cpu")
    assert (report.where, report.module, report.dtype, report.kind) == ("forward", "blocks.0.up", FP16, "inf")
    assert report.output_amax_fp32 == 76800.0 and "an overflow" in str(report)
    assert mixprec.locate_nonfinite(_Stack(), x, loss_fn, "bf16-mixed", "cpu") is None   # bf16 stays finite

    model = _Stack()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-4), policy="fp16-mixed,keep_fp32=blocks.*.up",
                        device="cpu")
    ran_in = {}
    for name in ("blocks.0.up", "blocks.1.up", "blocks.0.down"):
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: ran_in.update({name: o.dtype}))
    with mp.autocast():
        y = mp.model(x)
    assert ran_in == {"blocks.0.up": FP32, "blocks.1.up": FP32, "blocks.0.down": FP16}
    assert torch.isfinite(y).all()
    mp.backward(y.float().mean())
    assert mp.step() is not None


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
        assert out.dtype == FP16 and torch.equal(out.float(), torch.full((2, 1280), expect))
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


# ---------------------------------------------------------------- case 15: zero gradients and Adam's eps
def test_case15_unused_rows_keep_their_weights_under_fp16_pure_with_stock_adam():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)     # default eps 1e-8 (0 in fp16)
    mp = MixedPrecision(model, opt, policy="fp16-pure", device="cpu")
    unused = model[0].weight[5:].detach().clone()
    ids = torch.tensor([[0, 1, 2]])
    for _ in range(3):
        assert _one_step(mp, ids, lambda out: out.float().pow(2).mean()).applied
    assert torch.equal(model[0].weight[5:], unused)           # zero-gradient rows: unchanged, not NaN
    assert all(torch.isfinite(p).all() for p in model.parameters())
    state = opt.state[next(mp.master_parameters())]
    assert state["exp_avg_sq"].dtype == FP32 and state["exp_avg_sq"][5:].eq(0).all()
    # low-precision state by choice: the denominator still gets eps in fp32
    for state_dtype in (FP16, BF16):
        p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=FP16))
        adam = mixprec.optim.AdamW([p], lr=1e-3, weight_decay=0.0, state_dtype=state_dtype)
        p.grad = torch.zeros_like(p)
        adam.step()
        assert p.tolist() == [1.0, -2.0, 0.5] and adam.state[p]["exp_avg_sq"].dtype == state_dtype


# ---------------------------------------------------------------- case 16: bf16 weights and small updates
def test_case16_master_weights_with_mixprec_adamw_and_opt_in_pure_bf16_warns():
    def run(policy):
        model = nn.Linear(16, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = mixprec.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mp = MixedPrecision(model, opt, policy=policy, device="cpu")
            for _ in range(100):
                _one_step(mp, torch.ones(2, 16), lambda out: out.float().sum() * 0.25)   # grad 0.5
        return model, mp, [str(w.message) for w in caught]

    model, mp, caught = run("bf16-pure")
    (master,) = list(mp.master_parameters())
    torch.testing.assert_close(master, torch.full_like(master, 1.0 - 100 * 1e-4), rtol=0, atol=2e-6)
    assert torch.equal(model.weight, master.to(BF16)) and not model.weight.eq(1.0).any()
    assert not [m for m in caught if "rounded away" in m]
    model, mp, caught = run("params=bf16,compute=bf16")      # pure bf16 without masters: opt-in, and warned
    assert torch.equal(model.weight, torch.ones_like(model.weight))
    assert len([m for m in caught if "rounded away" in m and "bf16-pure" in m]) == 1


# ---------------------------------------------------------------- case 17: optimizer state dtype
@pytest.mark.parametrize("policy, make_opt", [
    ("fp16-mixed", lambda ps: torch.optim.AdamW(ps)),
    ("fp16-pure", lambda ps: torch.optim.AdamW(ps)),
    ("fp16-pure", lambda ps: mixprec.optim.SGD(ps, lr=1e-3, momentum=0.9)),
    ("bf16-sr", lambda ps: mixprec.optim.AdamW(ps)),
    ("fp8-mixed,recipe=rowwise", lambda ps: torch.optim.AdamW(ps)),
])
def test_case17_optimizer_state_is_fp32_after_one_step(policy, make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    opt = make_opt(model.parameters())
    mp = MixedPrecision(model, opt, policy=policy, device="cpu")
    assert _one_step(mp, torch.randn(4, 16) * 0.1, lambda out: out.float().pow(2).mean()).applied
    moments = {k: v.dtype for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
    assert moments and set(moments.values()) == {FP32}
    assert len(opt.state) == 6


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


# ---------------------------------------------------------------- case 25: the effective compute dtype
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-pure", "fp16-pure", "bf16-kahan"])
def test_case25_autocast_really_computes_in_the_policy_dtype_and_fp16_batches_are_normalised(policy):
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu")
        batch = mp.cast_inputs({"a": torch.randn(2, 4).half(), "b": torch.randn(2, 4).half()})
        with mp.autocast():
            joined = torch.cat([batch["a"], batch["b"]])       # no at::autocast::prioritize error
            y = model[0](joined)
    assert not [w for w in caught if "Disabling autocast" in str(w.message)]
    assert y.dtype == mp.policy.compute_dtype != FP32
    assert joined.dtype == mp.policy.param_dtype
    assert mp.decision.startswith(f"{mp.policy} on cpu as asked")


# ---------------------------------------------------------------- case 27: device portability
def test_case27_engine_step_uses_no_float64_and_mps_is_refused_or_planned_clearly():
    class DtypeSpy(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.dtypes.add(t.dtype)
            return out

    model = _linear(4, 2)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        max_grad_norm=1.0)
    spy = DtypeSpy()
    with spy:
        for k in (1e30, 1.0):               # one skip (back-off) and one applied step
            _one_step(mp, torch.randn(2, 4) * 0.01, lambda out, k=k: out.float().mean() * k)
    assert torch.float64 not in spy.dtypes and FP32 in spy.dtypes
    assert mp.applied_steps == 1 and mp.skipped_total == 1
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match=r"device='mps': MPS is not available here; use device='cpu'"):
            mps_model = _linear()
            MixedPrecision(mps_model, torch.optim.SGD(mps_model.parameters(), lr=0.1), policy="auto", device="mps")
    old_mac = Capability(device="mps", bf16=False, fp16=True, bf16_fast=False, fp16_native=True, detail="macOS 13")
    fallback = resolve("bf16-pure", "mps:0", capability=old_mac, allow_fallback=True)
    assert fallback.fell_back and str(fallback.policy) == "fp16-mixed" and fallback.policy.loss_scale == "dynamic"
    assert fallback.device == torch.device("mps", 0) and "cannot run bf16 (macOS 13)" in fallback.decision


# ---------------------------------------------------------------- cases 28 and 29: one-process gloo group
@pytest.fixture
def gloo_world_of_one(monkeypatch):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_case28_flags_of_every_micro_batch_go_through_the_agreement(gloo_world_of_one):
    from mixprec import distributed as mpd

    model = _mlp()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure", device="cpu",
                        strategy="ddp", accumulation_steps=2)
    calls = []
    real = mpd.any_across_ranks

    def counting(flags):
        calls.append(flags.detach().clone())
        return real(flags)

    mpd.any_across_ranks = counting
    try:
        x = torch.randn(2, 8) * 0.1
        assert _one_step(mp, x, lambda out: out.float().mean() * float("nan")) is None   # NaN in micro-batch 1
        skipped = _one_step(mp, x, lambda out: out.float().mean())
        applied = [_one_step(mp, x, lambda out: out.float().mean()) for _ in range(2)][-1]
    finally:
        mpd.any_across_ranks = real
    assert (skipped.applied, skipped.skipped_reason) == (False, "nonfinite")
    assert applied.applied and (mp.applied_steps, mp.skipped_total, mp.boundaries) == (1, 1, 2)
    assert len(calls) == 2 and calls[0].tolist() == [1.0, 1.0] and calls[1].tolist() == [0.0, 0.0]
    assert mp.agree_on("spike", ("nonfinite", "spike")) == "spike"
    with pytest.raises(ValueError, match=r"choice='oops' is not one of"):
        mp.agree_on("oops", ("nonfinite", "spike"))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_case29_gradient_collectives_run_in_fp32_with_and_without_accumulation(gloo_world_of_one, accumulation):
    from mixprec import distributed as mpd

    model = _mlp()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure", device="cpu",
                        strategy="ddp", accumulation_steps=accumulation)
    assert mpd.gradient_reduce_dtypes(mp.model) == frozenset()     # nothing reduced yet
    for _ in range(2 * accumulation):
        _one_step(mp, torch.randn(4, 8) * 0.1, lambda out: out.float().pow(2).mean())
    assert mp.applied_steps == 2
    assert mpd.gradient_reduce_dtypes(mp.model) == {FP32}
    fp16 = _mlp()   # fp16 under FSDP2: the engine wires its sharded found-inf check and a dynamic scale
    mp16 = MixedPrecision(fp16, torch.optim.SGD(fp16.parameters(), lr=0.1), "fp16-mixed", device="cpu",
                          strategy="fsdp2")
    assert mp16.loss_scale.dynamic and float(mp16.loss_scale.scale) == 2.0 ** 16


# ---------------------------------------------------------------- case 30: fp8 with zero and tiny amax
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_case30_fp8_linears_train_through_all_zero_inputs_and_weights(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].weight[3].fill_(1e-40)        # an fp32 subnormal row next to zero rows
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=f"fp8-mixed,recipe={recipe}",
                        device="cpu")
    assert list(mp.fp8_report.converted) == ["1"]
    with mp.autocast():
        zero_out = model[1](torch.zeros(4, 32))
    assert torch.equal(zero_out.float(), model[1].bias.detach().to(zero_out.dtype).float().expand(4, 32))
    for x in (torch.zeros(4, 16), torch.randn(4, 16), torch.randn(4, 16)):
        result = _one_step(mp, x, lambda out: out.float().pow(2).mean())
        assert result.applied and math.isfinite(result.grad_norm)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(b).all() for b in model.buffers())   # delayed: amax history and scales
