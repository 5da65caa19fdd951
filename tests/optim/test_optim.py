"""Tests for mixprec.optim: bit-exact vs torch.optim in fp32, and the 16-bit write-back modes."""

from __future__ import annotations

import copy
import io
import pickle
import math
import warnings

import pytest
import torch
from torch import nn

import mixprec
import mixprec.optim as mo
from mixprec import MixedPrecision
from mixprec.formats import get_format
from mixprec.optim.rounding import stochastic_round_to_bf16, write_back_
from engine_loops import _one_step

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BF16_EPS = get_format(torch.bfloat16).eps  # 2**-7: spacing of bf16 in [1, 2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_public_api():
    assert mo.__all__ == ["AdamW", "SGD", "adopt_sr_seed"]
    assert issubclass(mo.AdamW, torch.optim.Optimizer) and issubclass(mo.SGD, torch.optim.Optimizer)


# ------------------------------------------------------------------ fp32: bit-exact vs torch.optim
def _make_params(dtype=torch.float32):
    shapes = [(7, 5), (5,), (3, 2, 4)]
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]


def _groups(params, **second_group):
    return [{"params": params[:2]}, {"params": params[2:], **second_group}]


def _run_against_torch(ours_cls, torch_cls, kwargs, steps=30):
    ref = _make_params()
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch_cls(_groups(ref, lr=3e-3), foreach=False, **kwargs)
    opt_mine = ours_cls(_groups(mine, lr=3e-3), **kwargs)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=10, gamma=0.5)
    sched_mine = torch.optim.lr_scheduler.StepLR(opt_mine, step_size=10, gamma=0.5)
    for i in range(steps):
        if i == 15:  # change lr by hand too
            for opt in (opt_ref, opt_mine):
                opt.param_groups[0]["lr"] = 7e-3
        for p_ref, p_mine in zip(ref, mine):
            grad = torch.randn_like(p_ref)
            p_ref.grad, p_mine.grad = grad.clone(), grad.clone()
        opt_ref.step()
        opt_mine.step()
        sched_ref.step()
        sched_mine.step()
    for p_ref, p_mine in zip(ref, mine):
        assert torch.equal(p_ref, p_mine)
        assert not torch.equal(p_ref, torch.zeros_like(p_ref))
    return opt_ref, opt_mine, ref, mine


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-3, weight_decay=0.0),
    dict(lr=1e-3),  # default weight_decay=1e-2
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
])
def test_adamw_fp32_bit_exact_vs_torch(kwargs):
    opt_ref, opt_mine, ref, mine = _run_against_torch(mo.AdamW, torch.optim.AdamW, kwargs)
    for p_ref, p_mine in zip(ref, mine):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_ref.state[p_ref][key], opt_mine.state[p_mine][key])
        assert opt_mine.state[p_mine]["step"].dtype == torch.float32
        assert float(opt_mine.state[p_mine]["step"]) == 30.0


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=1e-2),
    dict(lr=1e-2, momentum=0.9),
    dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
])
def test_sgd_fp32_bit_exact_vs_torch(kwargs):
    opt_ref, opt_mine, ref, mine = _run_against_torch(mo.SGD, torch.optim.SGD, kwargs)
    if kwargs.get("momentum"):
        for p_ref, p_mine in zip(ref, mine):
            assert torch.equal(opt_ref.state[p_ref]["momentum_buffer"], opt_mine.state[p_mine]["momentum_buffer"])


# ------------------------------------------------------------------ bf16 lost updates and the cures
STEPS, LR = 100, 1e-4


def _constant_grad_run(rounding, dtype, n):
    """AdamW (no weight decay) on n weights at 1.0 with constant grad 0.5 for STEPS steps."""
    p = torch.nn.Parameter(torch.ones(n, dtype=dtype))
    opt = mo.AdamW([p], lr=LR, weight_decay=0.0, rounding=rounding)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            p.grad = torch.full_like(p, 0.5)
            opt.step()
    assert all(w.filename == __file__ for w in caught)  # stacklevel points at the caller
    return p.detach(), opt, [str(w.message) for w in caught]


def test_bf16_nearest_loses_updates_and_warns_once():
    p, _, messages = _constant_grad_run("nearest", torch.bfloat16, 16)
    assert torch.equal(p, torch.ones(16, dtype=torch.bfloat16))
    assert len(messages) == 1
    assert "100.0%" in messages[0] and "rounding='kahan'" in messages[0] and "bf16-pure" in messages[0]


def test_updates_lost_only_after_the_lr_decays_are_caught_at_a_later_check_step():
    """Adam moves each weight by ~lr: at lr 1e-2 bf16 weights at 1.0 train (ulp 2**-7 / 2 ~ 3.9e-3),
    after the lr drops to 1e-4 they stop. The check runs at steps 1, 10, 100: step 100 sees it."""
    p = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    opt = mo.AdamW([p], lr=1e-2, weight_decay=0.0, rounding="nearest")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 121):
            if step == 50:
                opt.param_groups[0]["lr"] = 1e-4
            p.grad = torch.full_like(p, 0.5)
            opt.step()
            if step == 99:
                assert caught == []                 # steps 1 and 10 trained fine
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "of step 100's nonzero updates" in messages[0]


def test_fp32_and_kahan_do_not_warn():
    _, _, messages = _constant_grad_run(None, torch.float32, 16)
    assert messages == []
    _, _, messages = _constant_grad_run("kahan", torch.bfloat16, 16)
    assert messages == []


def test_bf16_kahan_tracks_fp32():
    p_fp32, _, _ = _constant_grad_run(None, torch.float32, 16)
    p_bf16, opt, _ = _constant_grad_run("kahan", torch.bfloat16, 16)
    comp = opt.state[opt.param_groups[0]["params"][0]]["kahan_comp"]
    assert comp.dtype == torch.bfloat16
    moved = 1.0 - p_fp32[0].item()
    assert moved == pytest.approx(STEPS * LR, rel=1e-3)  # Adam's step is ~lr for a constant grad
    # p + comp carries the fp32 sum except for the rounding of comp to bf16 on each step. After
    # step (3), |comp| <= half an ulp of p (2**-9 here, p in [0.5, 1)), so comp's own bf16 spacing
    # is <= 2**-17 and each step loses <= 2**-18: over STEPS steps <= STEPS * 2**-18 ~ 3.8e-4
    # (measured ~1.3e-4), vs a movement of 1e-2.
    comp_bound = STEPS * 2.0**-18
    assert torch.all((p_bf16.float() + comp.float() - p_fp32).abs() <= comp_bound)
    # and the bf16 weight itself is within half an ulp (2**-9) of the fp32 result, plus that.
    assert torch.all((p_bf16.float() - p_fp32).abs() <= 2.0**-9 + comp_bound)
    assert torch.all(p_bf16 < 1.0)


def test_bf16_stochastic_mean_matches_fp32():
    n = 65536
    p_fp32, _, _ = _constant_grad_run(None, torch.float32, 1)
    p_bf16, _, messages = _constant_grad_run("stochastic", torch.bfloat16, n)
    assert messages == []
    # Without weight decay Adam's update u_t does not depend on p, so each element ends at
    # p_T = 1 + sum_t u_t + sum_t e_t (+ fp32 rounding of p + u_t, <= 2**-25 per step), where the
    # stochastic-rounding errors e_t have mean 0 given the past (unbiased) and lie in an
    # interval of width ulp = 2**-8 (p in [0.5, 1)), so Var(e_t) <= ulp**2 / 4. They are
    # martingale differences, independent across elements: Var(mean) <= STEPS * ulp**2 / (4 n),
    # sigma <= sqrt(100) * 2**-8 / 2 / 256 ~ 7.6e-5, 3 sigma ~ 2.3e-4 (movement: 1e-2).
    sigma = math.sqrt(STEPS * (2.0**-8) ** 2 / (4 * n))
    error = abs(p_bf16.double().mean().item() - p_fp32.double().item())
    assert error <= 3 * sigma + STEPS * 2.0**-25
    assert p_bf16.float().std().item() > 0  # really stochastic: elements differ


def test_stochastic_step_reproducible_from_rng_state():
    def run():
        p = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
        opt = mo.SGD([p], lr=1e-3, momentum=0.9, rounding="stochastic")
        for _ in range(3):
            p.grad = torch.full_like(p, 0.7)
            opt.step()
        return p.detach()
    rng = torch.get_rng_state()
    first = run()
    torch.set_rng_state(rng)
    assert torch.equal(first.view(torch.int16), run().view(torch.int16))


# ------------------------------------------------------------------ stochastic rounding, exactly
def test_sr_representable_values_unchanged():
    x_bf16 = torch.randn(10000).to(torch.bfloat16)
    x_bf16 = torch.cat([x_bf16, torch.tensor([0.0, -0.0, 1.0, -2.0, torch.finfo(torch.bfloat16).max],
                                             dtype=torch.bfloat16)])
    result = stochastic_round_to_bf16(x_bf16.float())
    assert torch.equal(result.view(torch.int16), x_bf16.view(torch.int16))


def test_sr_rounds_to_a_neighbour():
    x = torch.randn(100000) * 10.0 ** torch.randint(-20, 20, (100000,)).float()
    result = stochastic_round_to_bf16(x).float()
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # toward zero
    up = torch.nextafter(down.to(torch.bfloat16), torch.sign(x).to(torch.bfloat16) * math.inf).float()
    assert torch.all((result == down) | (result == up))
    assert torch.any(result == down) and torch.any(result == up)


@pytest.mark.parametrize("f", [0.1, 0.25, 0.5, 0.9])
def test_sr_probability_of_rounding_up(f):
    n = 200000
    lo, hi = 1.0, 1.0 + BF16_EPS
    x = torch.full((n,), lo + f * (hi - lo))  # f is exact on fp32's 2**-16 grid within the spacing
    result = stochastic_round_to_bf16(x).float()
    assert torch.all((result == lo) | (result == hi))
    p_up = (result == hi).double().mean().item()
    assert abs(p_up - f) <= 3 * math.sqrt(f * (1 - f) / n)


def test_sr_non_finite_stay_non_finite():
    bits = torch.tensor([0x7F800000, -0x800000, 0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001],
                        dtype=torch.int32)  # inf, -inf, nan, nan (max payload), -nan (all ones), snan
    x = bits.view(torch.float32).repeat(1000)
    result = stochastic_round_to_bf16(x)
    assert torch.equal(torch.isposinf(result), torch.isposinf(x))
    assert torch.equal(torch.isneginf(result), torch.isneginf(x))
    assert torch.equal(torch.isnan(result), torch.isnan(x))
    # the largest finite fp32 rounds to bf16 max or +inf (its upper neighbour)
    big = stochastic_round_to_bf16(torch.full((1000,), torch.finfo(torch.float32).max))
    assert torch.all((big == torch.finfo(torch.bfloat16).max) | torch.isposinf(big))


def test_sr_negative_symmetric():
    x = torch.rand(10000) + 0.5
    gen = torch.Generator().manual_seed(1)
    positive = stochastic_round_to_bf16(x, generator=gen)
    gen.manual_seed(1)
    negative = stochastic_round_to_bf16(-x, generator=gen)
    assert torch.equal(negative, -positive)


# ------------------------------------------------------------------ state dtypes
@pytest.mark.filterwarnings("ignore:.*rounded away")
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_state_dtype_default_fp32_on_16_bit_params(param_dtype):
    for opt_cls, kwargs, keys in [(mo.AdamW, {}, ("exp_avg", "exp_avg_sq")),
                                  (mo.SGD, dict(momentum=0.9), ("momentum_buffer",))]:
        p = torch.nn.Parameter(torch.randn(8).to(param_dtype))
        opt = opt_cls([p], **kwargs)
        assert opt.state_dtype == torch.float32 and opt.rounding == "nearest"
        p.grad = torch.randn_like(p)
        opt.step()
        for key in keys:
            assert opt.state[p][key].dtype == torch.float32
        assert opt.state[p]["step"].dtype == torch.float32


def test_state_dtype_bf16():
    p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    opt = mo.AdamW([p], state_dtype=torch.bfloat16, rounding="kahan")
    p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    assert opt.state[p]["kahan_comp"].dtype == torch.bfloat16
    # the moment after two steps of the same grad: (1 - beta1**2) * g, stored rounded to nearest
    expected = ((1 - 0.9**2) * p.grad.float()).to(torch.bfloat16)
    assert torch.allclose(opt.state[p]["exp_avg"].float(), expected.float(), rtol=2 * BF16_EPS, atol=0)
    q = torch.nn.Parameter(torch.randn(8))
    sgd = mo.SGD([q], momentum=0.9, state_dtype=torch.bfloat16)
    q.grad = torch.randn_like(q)
    sgd.step()
    assert sgd.state[q]["momentum_buffer"].dtype == torch.bfloat16
    assert q.dtype == torch.float32


# ------------------------------------------------------------------ fp16 eps bug
def test_fp16_zero_grad_adam_step_keeps_params():
    p = torch.nn.Parameter(torch.randn(64).to(torch.float16))
    before = p.detach().clone()
    opt = mo.AdamW([p], eps=1e-8, weight_decay=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), before)
    # torch.optim.Adam keeps the moments in fp16, where eps=1e-8 rounds to 0: 0 / 0 = NaN
    q = torch.nn.Parameter(before.clone())
    torch_opt = torch.optim.Adam([q], eps=1e-8, foreach=False)
    q.grad = torch.zeros_like(q)
    torch_opt.step()
    assert torch.isnan(q).all()


# ------------------------------------------------------------------ errors and set_precision
def test_bad_arguments_raise_value_error():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"AdamW rounding='round' is not allowed; choose one of"):
        mo.AdamW([p], rounding="round")
    with pytest.raises(ValueError, match=r"SGD state_dtype=torch.float64 is not allowed"):
        mo.SGD([p], state_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"AdamW lr=-1.0 is not allowed; it must be a number >= 0"):
        mo.AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0 is not allowed.*< 1.0"):
        mo.AdamW([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"SGD momentum=-0.5"):
        mo.SGD([p], momentum=-0.5)
    with pytest.raises(ValueError, match=r"nesterov=True needs momentum > 0 and dampening == 0"):
        mo.SGD([p], nesterov=True)


def test_stochastic_on_fp16_raises():
    p16 = torch.nn.Parameter(torch.randn(4).to(torch.float16))
    with pytest.raises(ValueError, match=r"rounding='stochastic' needs bf16 params, got param dtype torch.float16"):
        mo.AdamW([p16], rounding="stochastic")
    opt = mo.SGD([p16])
    with pytest.raises(ValueError, match=r"needs bf16 params, got param dtype torch.float16"):
        opt.set_precision(rounding="stochastic", state_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"needs bf16 params, got param dtype torch.float16"):
        write_back_(p16.detach(), torch.zeros(4), rounding="stochastic")


def test_set_precision_and_precision_explicit():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = mo.AdamW([p])
    assert opt.precision_explicit is False
    assert mo.AdamW([p], rounding="nearest").precision_explicit is True
    assert mo.SGD([p], state_dtype=torch.float32).precision_explicit is True
    opt.set_precision(rounding="kahan", state_dtype=torch.bfloat16)
    assert (opt.rounding, opt.state_dtype, opt.precision_explicit) == ("kahan", torch.bfloat16, False)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and "kahan_comp" in opt.state[p]
    with pytest.raises(RuntimeError, match=r"set_precision must be called before the first step"):
        opt.set_precision(rounding="nearest", state_dtype=torch.float32)


# ------------------------------------------------------------------ state_dict round trip
@pytest.mark.parametrize("opt_cls, kwargs, dtype", [
    (mo.AdamW, dict(lr=1e-2), torch.float32),
    (mo.AdamW, dict(lr=1e-3, rounding="kahan"), torch.bfloat16),
    (mo.AdamW, dict(lr=1e-3, rounding="kahan", state_dtype=torch.bfloat16), torch.float16),
    (mo.SGD, dict(lr=1e-2, momentum=0.9, rounding="kahan"), torch.bfloat16),
])
def test_state_dict_round_trip(opt_cls, kwargs, dtype):
    grads = [[torch.randn(s) for s in [(7, 5), (5,), (3, 2, 4)]] for _ in range(10)]

    def steps(opt, params, grads_slice):
        for step_grads in grads_slice:
            for p, g in zip(params, step_grads):
                p.grad = g.to(dtype)
            opt.step()

    start = _make_params(dtype)
    straight = [torch.nn.Parameter(p.detach().clone()) for p in start]
    opt_straight = opt_cls(straight, **kwargs)
    torch.manual_seed(0)   # bf16 state is stochastically rounded: the resumed run continues the RNG, as a checkpoint does
    steps(opt_straight, straight, grads)

    first = [torch.nn.Parameter(p.detach().clone()) for p in start]
    opt_first = opt_cls(first, **kwargs)
    torch.manual_seed(0)
    steps(opt_first, first, grads[:5])
    buffer = io.BytesIO()
    torch.save(opt_first.state_dict(), buffer)
    buffer.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt_resumed = opt_cls(resumed, **kwargs)
    opt_resumed.load_state_dict(torch.load(buffer))
    for p in resumed:
        state = opt_resumed.state[p]
        if "kahan_comp" in state:
            assert state["kahan_comp"].dtype == dtype
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in state:
                assert state[key].dtype == opt_resumed.state_dtype
    steps(opt_resumed, resumed, grads[5:])

    for p_straight, p_resumed in zip(straight, resumed):
        assert torch.equal(p_straight.view(torch.int8) if dtype != torch.float32 else p_straight,
                           p_resumed.view(torch.int8) if dtype != torch.float32 else p_resumed)
        for key, value in opt_straight.state[p_straight].items():
            assert torch.equal(value, opt_resumed.state[p_resumed][key]), key


@pytest.mark.parametrize("torch_cls, kwargs, ours, option", [
    (torch.optim.AdamW, dict(maximize=True), mo.AdamW, "maximize=True"),
    (torch.optim.AdamW, dict(amsgrad=True), mo.AdamW, "amsgrad=True"),
    (torch.optim.Adam, dict(weight_decay=0.1), mo.AdamW, "decoupled_weight_decay=False"),
    (torch.optim.SGD, dict(momentum=0.9, maximize=True), mo.SGD, "maximize=True"),
])
@pytest.mark.parametrize("state_dtype", [None, "int8"])
def test_loading_a_torch_state_whose_options_we_do_not_implement_is_refused(torch_cls, kwargs, ours, option,
                                                                             state_dtype):
    """A torch.optim state made with maximize / amsgrad / Adam's L2 decay would load and then step the other
    way (or without the max): refused, naming the option, nothing loaded."""
    theirs = torch.nn.Parameter(torch.randn(64, 64))
    torch_opt = torch_cls([theirs], lr=1e-2, **kwargs)
    theirs.grad = torch.randn(64, 64)
    torch_opt.step()
    mine = torch.nn.Parameter(theirs.detach().clone())
    opt = ours([mine], lr=1e-2, state_dtype=state_dtype)
    with pytest.raises(ValueError, match=option) as err:
        opt.load_state_dict(torch_opt.state_dict())
    assert "torch.optim" in str(err.value) and len(opt.state) == 0 and "maximize" not in opt.param_groups[0]
    plain = torch_cls([theirs], lr=1e-2, momentum=0.9) if torch_cls is torch.optim.SGD else torch_cls([theirs], lr=1e-2)
    # the options at their defaults load (torch.optim.Adam without weight decay too)
    theirs.grad = torch.randn(64, 64)
    plain.step()
    opt.load_state_dict(plain.state_dict())
    assert len(opt.state) == 1


@pytest.mark.parametrize("opt_cls, option, value, fix", [
    (mo.AdamW, "maximize", True, "negate the loss"), (mo.AdamW, "amsgrad", True, "torch.optim.AdamW"),
    (mo.AdamW, "foreach", True, "drop it"), (mo.AdamW, "fused", True, "drop it"),
    (mo.AdamW, "capturable", True, "torch.optim"), (mo.SGD, "maximize", True, "negate the loss"),
    (mo.SGD, "differentiable", True, "torch.optim"),
])
def test_torch_optim_options_we_do_not_implement_are_named_with_the_fix(opt_cls, option, value, fix):
    """torch.optim's options were Python's bare "unexpected keyword argument"; their no-op values are accepted,
    so ``AdamW(params, foreach=None, maximize=False)`` copied from a torch.optim call builds."""
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(TypeError, match=f"{option}={value!r}.*{fix}"):
        opt_cls([p], lr=1e-3, **{option: value})
    noops = dict(foreach=None, fused=False, maximize=False, differentiable=False)
    opt_cls([p], lr=1e-3, **noops, **(dict(capturable=False, amsgrad=False) if opt_cls is mo.AdamW else {}))
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):
        opt_cls([p], lrr=1e-3)


# ================================================================ case 15 through the engine


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


# ---------------------------------------------------------------- Kahan keeps its residual
def _kahan_net(seed=30):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))


def _within_residual_rounding(got, want):
    """``got`` (stored bf16 + bf16 compensation) equals the fp32 ``want`` up to the compensation's own
    bf16 rounding: at most 2**-8 of what the cast lost, ``|want - bf16(want)|``."""
    lost = (want - want.to(torch.bfloat16).float()).abs()
    return bool(((got - want).abs() <= lost * 2.0 ** -8).all())


def test_kahan_export_at_build_is_the_fp32_weights_not_their_bf16_rounding():
    model = _kahan_net()
    w_fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    mp = MixedPrecision(model, mo.AdamW(model.parameters(), lr=1e-3), policy="bf16-kahan", device="cpu")
    export = mp.trainable_state_dict()
    for n, w in w_fp32.items():
        assert _within_residual_rounding(export[n], w)
        rounded_error = (w.to(torch.bfloat16).float() - w).abs().max()
        assert (export[n] - w).abs().max() < rounded_error / 100   # round-to-nearest alone is 100x further off
    fp32 = mp.unwrap(to_fp32=True)
    for n, p in fp32.named_parameters():
        assert p.dtype == torch.float32 and _within_residual_rounding(p.detach(), w_fp32[n])


def test_kahan_residual_survives_a_convert_from_fp32_and_a_guard_rollback(tmp_path):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(31))
    model = _kahan_net()
    mp32 = MixedPrecision(model, mo.AdamW(model.parameters(), lr=1e-2), policy="fp32", device="cpu")
    for _ in range(2):
        mp32.backward(mp32.model(x).pow(2).mean())
        mp32.step()
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    mixprec.save_checkpoint(tmp_path, mp32)
    target = _kahan_net(seed=99)
    mp = MixedPrecision(target, mo.AdamW(target.parameters(), lr=1e-2), policy="bf16-kahan", device="cpu",
                        guard=mixprec.Guard(snapshot_every=1))
    mixprec.load_checkpoint(tmp_path, mp, convert=True)
    converted = mp.trainable_state_dict()
    assert all(_within_residual_rounding(converted[n], w) for n, w in saved.items())
    for _ in range(2):
        mp.backward(mp.model(mp.cast_inputs(x)).float().pow(2).mean())
        mp.step()
    good = mp.trainable_state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):   # the first non-finite step in a row is only dropped, the second rolls back
            mp.backward(mp.model(mp.cast_inputs(x)).float().pow(2).mean() * float("nan"))
            result = mp.step()
    assert result.rolled_back
    after = mp.trainable_state_dict()
    assert all(torch.equal(after[n], good[n]) for n in good)   # the compensation came back with the params


@pytest.mark.parametrize("make", [lambda ps: mixprec.optim.AdamW(ps, rounding="kahan", state_dtype=torch.int8, sr_seed=3),
                                  lambda ps: mixprec.optim.SGD(ps, lr=0.1, momentum=0.9, rounding="stochastic",
                                                               state_dtype=torch.bfloat16, sr_seed=3)],
                         ids=["adamw-kahan-int8", "sgd-sr-bf16"])
@pytest.mark.parametrize("copier", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))], ids=["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_precision_and_steps_as_the_original(make, copier):
    """torch's Optimizer.__getstate__ keeps defaults, state and param groups only: a deep copy (a teacher, an EMA's
    copy of model and optimizer) or a pickle had no rounding / state_dtype and failed at its first step
    (AttributeError). The copy steps bit for bit as the original."""
    torch.manual_seed(0)
    model = nn.Linear(64, 80).bfloat16()   # 5120 elements: int8 state quantizes the weight's moments
    opt = make(model.parameters())
    x = torch.randn(4, 64).bfloat16()
    model(x).float().square().mean().backward()
    opt.step()
    model_copy, opt_copy = copier((model, opt))
    assert (opt_copy.rounding, opt_copy.state_dtype, opt_copy.explicit_precision) == \
        (opt.rounding, opt.state_dtype, opt.explicit_precision)
    for m, o in ((model, opt), (model_copy, opt_copy)):
        o.zero_grad()
        m(x).float().square().mean().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model_copy.parameters()))


@pytest.mark.parametrize("make, fix", [
    (lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), r"use mixprec.optim.AdamW \(the same hyperparameters"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), r"use mixprec.optim.SGD \(the same hyperparameters"),
    (lambda ps: torch.optim.Adam(ps), r"use mixprec.optim.AdamW\(\.\.\., weight_decay=0\): Adam without weight decay"),
    (lambda ps: torch.optim.Adam(ps, weight_decay=1e-4), r"no Adam with coupled \(L2\) weight decay: .*decoupled"),
    (lambda ps: torch.optim.Adagrad(ps), r"AdamW and SGD only, nothing with Adagrad's update rule"),
], ids=["adamw", "sgd", "adam", "adam-l2", "adagrad"])
def test_a_refused_stock_optimizer_is_told_the_replacement_for_its_own_update_rule(make, fix):
    """mixprec.optim.AdamW was offered for every optimizer: for Adam with weight decay it silently changes the
    regularisation (coupled L2 -> decoupled; and its default decay 0.01 where Adam's is 0), and for Adagrad it
    is another method."""
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=fix):
        MixedPrecision(model, make(model.parameters()), policy="bf16-sr", device="cpu")
