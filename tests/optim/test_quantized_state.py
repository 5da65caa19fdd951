"""8-bit optimizer state (mixprec.optim.quantized_state) and what uses it: AdamW / SGD with
``state_dtype='int8' | 'fp8'``, the engine, checkpoints, set_policy, the guard, the inspector and the
bench's tensor census. Exact where the arithmetic allows it, statistical (with a bound from the
variance) for stochastic rounding, against fp32 state everywhere else."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
import mixprec.optim as mo
from mixprec import Guard
from mixprec import MixedPrecision
from mixprec.programs.bench.measure import state_bytes
from mixprec.checkpoint.local import load_checkpoint, resolve_checkpoint, save_checkpoint
from mixprec.numerics import inspect
from mixprec.optim import quantized_state as qs

CODES = list(qs.CODES.values())
BIG = (64, 128)   # 8192 elements: quantized (>= 4096 elements, 2-D), 32 blocks


def _coded(x: torch.Tensor, code: qs.Code) -> torch.Tensor:
    return x.clamp_min(0).sqrt() if code.sqrt else x


def _decoded(y: torch.Tensor, code: qs.Code) -> torch.Tensor:
    return y.square() if code.sqrt else y


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# ================================================================ the codes
def test_every_code_value_round_trips_exactly_and_the_bytes_are_exact():
    """Inputs built from the table with a power-of-two scale: every step of quantize/dequantize is exact."""
    for code in CODES:
        table = code.table()
        scale = 2.0 ** -5
        y = table * scale                                           # absmax = qmax * scale: scale exact
        x = _decoded(y, code)                                       # sqrt(fl(y**2)) == y in binary fp
        codes, absmax = qs.quantize(x, code)
        assert codes.dtype == code.storage_dtype and codes.shape == x.shape and absmax.dtype == torch.float32
        assert absmax.shape == (math.ceil(x.numel() / 256),)        # 253 / 247 / 256 values: a short last block
        assert torch.equal(qs.dequantize(codes, absmax, code), x), code
        if code.indexed:
            assert torch.equal(codes, torch.arange(256, dtype=torch.uint8))
    for n in (4096, 5000, 256 * 17 + 3):
        codes, absmax = qs.quantize(torch.randn(n), qs.CODES["dynamic-signed"])
        assert codes.numel() * 1 + absmax.numel() * 4 == qs.nbytes(n) == n + 4 * math.ceil(n / 256)


@pytest.mark.parametrize("code", CODES, ids=str)
def test_nearest_rounding_picks_a_nearest_table_value_and_errs_at_most_half_a_gap(code):
    """Blocks over six decades of magnitude, the largest element positive (see the -1 test below).
    Bound per element, in scale units ``y = coded / (absmax / qmax)``: ``|y_hat - y| <= min_j |T_j - y|`` (up
    to the fp32 rounding of the midpoints), hence ``<= max gap / 2``; for the sqrt code ``|v_hat - v| =
    |s_hat - s| * (s_hat + s) <= d * (2 s + d)`` with ``d`` the bound on ``s = sqrt(v)``."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-6, 0, 16)[:, None]
    x = x.abs() if code.sqrt else x
    x[:, 0] = _coded(x, code).abs().amax(1)
    x[:, 0] = _decoded(x[:, 0], code)                               # each block's absmax element positive
    codes, absmax = qs.quantize(x, code)
    table64 = code.table().double()
    scale64 = (absmax / code.qmax).double()[:, None]
    y = _coded(x, code).double() / scale64
    y_hat = (_coded(qs.dequantize(codes, absmax, code), code).double() / scale64)
    nearest = (y[..., None] - table64).abs().amin(-1)
    assert bool((((y_hat - y).abs()) <= nearest + 2.0 ** -22 * y.abs().clamp_min(2.0 ** -20)).all())
    half_gap = float(table64.diff().max()) / 2
    d = half_gap * scale64 * (1 + 2.0 ** -20)
    err = (qs.dequantize(codes, absmax, code).double() - x.double()).abs()
    bound = d * (2 * _coded(x, code).double() + d) if code.sqrt else d
    assert bool((err <= bound + x.double().abs() * 2.0 ** -22).all())   # + the fp32 rounding of the product


@pytest.mark.parametrize("code", CODES, ids=str)
def test_the_fast_lookup_equals_torch_bucketize(code):
    """quantize's table lookup against a reference: ``torch.bucketize`` on the fp32 midpoints (ties go down),
    at random values, at every midpoint, at its two fp32 neighbours and at 0 and +-qmax."""
    table = code.table()
    mids = (table[:-1] + table[1:]) / 2
    inf = torch.tensor(math.inf)
    probe = torch.cat([(torch.rand(4000) * 2 - 1) * code.qmax, mids, mids.nextafter(inf), mids.nextafter(-inf),
                       torch.tensor([0.0, -0.0, 1.0, -1.0]) * code.qmax]).clamp(-code.qmax, code.qmax)
    probe = probe.abs() if code.sqrt else probe
    x = torch.cat([_decoded(probe, code), torch.zeros((-probe.numel()) % 256)])   # whole blocks
    x = torch.cat([x, _decoded(torch.full((256,), code.qmax), code)])             # a block of scale 1 ...
    x = x.view(-1, 256)
    x[:, 0] = _decoded(torch.tensor(code.qmax), code)                             # ... every block's
    codes, absmax = qs.quantize(x, code)
    y = _coded(x, code) / (absmax / code.qmax)[:, None]
    expect = torch.bucketize(y, mids)
    got = codes.long() if code.indexed else torch.bucketize(codes.float(), mids)   # fp8: its value's index
    if code.indexed:
        assert torch.equal(got, expect)
    else:   # torch's fp8 cast rounds ties to even, not down: equal except exactly at a midpoint
        at_mid = torch.isin(y, mids)
        assert torch.equal(got[~at_mid], expect[~at_mid]) and bool(((got - expect).abs() <= 1).all())


def test_zeros_all_equal_blocks_and_a_negative_absmax():
    for code in CODES:
        codes, absmax = qs.quantize(torch.zeros(3, 256), code)
        assert torch.equal(absmax, torch.zeros(3)) and torch.equal(qs.dequantize(codes, absmax, code), torch.zeros(3, 256))
        for c in (0.37, 3e-5, 1e4):   # each element is its block's absmax: exact (sqrt code: to 1 ulp)
            x = torch.full((2, 256), c)
            out = qs.dequantize(*qs.quantize(x, code), code)
            assert torch.equal(out, x) if not code.sqrt else torch.allclose(out, x, rtol=2.0 ** -23, atol=0), (code, c)
    # a block whose largest magnitude is negative: fp8 is symmetric; the signed dynamic map's lowest value
    # is -0.99297 (bitsandbytes' map), so the block's absmax is |c| / 0.99297 and -|c| reads back as itself
    x = torch.full((256,), -0.5)
    assert torch.equal(qs.dequantize(*qs.quantize(x, qs.CODES["e4m3"]), qs.CODES["e4m3"]), x)
    signed = qs.CODES["dynamic-signed"]
    codes, absmax = qs.quantize(x, signed)
    assert torch.equal(codes, torch.zeros(256, dtype=torch.uint8)) and torch.equal(absmax, torch.tensor([0.5]) / -signed.table()[0])
    assert torch.allclose(qs.dequantize(codes, absmax, signed), x, rtol=2.0 ** -22, atol=0)
    assert abs(float(signed.table()[0]) + 0.99297) < 1e-5


def test_zero_state_equals_quantized_zeros_for_every_code_and_shape():
    for code in CODES:
        for shape in ((), (0,), (5,), (3, 300), BIG):
            want = qs.quantize(torch.zeros(shape), code)
            got = qs.zeros(shape, code, "cpu")
            # the codes bit for bit; the scales equal (quantize's signed-map max(amax, -amin / 0.99297) gives
            # some zero blocks -0.0, which decodes, compares and rounds as 0.0), here all +0.0
            assert _same(got[0], want[0]) and torch.equal(got[1], want[1]), (code, shape)
            assert got[1].dtype == torch.float32 and not _bits(got[1]).any(), (code, shape)


def _peak_rss_during(fn) -> float:
    """MiB the process's resident set rose above its size before ``fn()`` at its peak (Linux: the kernel's
    VmHWM, reset to the current RSS through /proc/self/clear_refs)."""
    def status(field: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    result = fn()
    peak = status("VmHWM")
    del result
    return peak - before


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_zero_state_takes_its_own_bytes_of_memory_not_an_fp32_copy_and_its_temporaries():
    n = 16 * 2**20   # a 16 Mi-element param (a 43k x 384 embedding): 16 MiB of codes, 0.25 MiB of scales
    code = qs.CODES["dynamic-signed"]
    via_fp32 = _peak_rss_during(lambda: qs.quantize(torch.zeros(n), code))   # what zeros() did before
    direct = _peak_rss_during(lambda: qs.zeros((n,), code, "cpu"))
    assert direct < 16 + 8, direct   # the codes and scales, plus slack for the allocator
    assert via_fp32 > 4 * 16, via_fp32   # the fp32 zeros alone are 64 MiB: the meter sees such temporaries


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_negative_block_maximum_is_not_shrunk_every_step_by_the_signed_map(sign):
    """The signed map's lowest value is -0.99297 (bitsandbytes' map, no -1): a block whose largest magnitude was
    negative stored it 0.7 % short, and a momentum buffer compounds that every step: SGD momentum 0.99 moved a
    negative-gradient outlier 38 % less than fp32 state (a positive one exactly as far). Now both signs within
    0.1 % of fp32 state after 300 steps (the decoded extreme is exact to an fp32 rounding per step)."""
    g = torch.full(BIG, 0.01)
    g.view(-1)[::256] = sign                                   # each block's largest magnitude: sign * 1
    p, q = nn.Parameter(torch.zeros(BIG)), nn.Parameter(torch.zeros(BIG))
    int8, fp32 = mo.SGD([p], lr=1.0, momentum=0.99, state_dtype="int8"), mo.SGD([q], lr=1.0, momentum=0.99)
    for _ in range(300):
        p.grad, q.grad = g.clone(), g.clone()
        int8.step()
        fp32.step()
    outliers = p.detach().view(-1)[::256] / q.detach().view(-1)[::256]
    assert bool(((outliers - 1).abs() < 1e-3).all()), outliers[:4]
    x = torch.full((256,), -0.5)                               # the negative extreme reads back as itself
    signed = qs.CODES["dynamic-signed"]
    assert torch.allclose(qs.dequantize(*qs.quantize(x, signed), signed), x, rtol=2.0 ** -22, atol=0)


def test_a_non_finite_value_turns_its_block_nan_and_no_other():
    for code in CODES:
        x = torch.rand(4, 256) + 0.5
        x[1, 7], x[2, 9] = math.nan, math.inf
        codes, absmax = qs.quantize(x, code)
        out = qs.dequantize(codes, absmax, code)
        assert absmax[1].isnan() and absmax[2].isnan()
        assert out[1].isnan().all() and out[2].isnan().all()         # loud, and the whole block
        clean = qs.dequantize(*qs.quantize(x[[0, 3]], code), code)
        assert torch.equal(out[[0, 3]], clean)                         # the other blocks as if alone


@pytest.mark.parametrize("code", [c for c in CODES if not c.indexed], ids=str)
def test_fp8_blocks_of_tiny_finite_values_stay_finite(code):
    """A block whose absmax is under ``qmax * 2**-126`` (v = g**2 of |g| ~ 1e-19 under E5M2) made the scale
    ``absmax / qmax`` subnormal or 0, its values inf or NaN: they read back finite, each within the format's
    half ulp of itself plus half its smallest subnormal step at the floor scale ``2**-126`` per table unit."""
    tiny = torch.finfo(torch.float32).tiny
    step = float(code.table()[code.table() > 0].min())           # the format's smallest positive value
    half_ulp = torch.finfo(code.storage_dtype).eps / 2
    for magnitude in (1e-36, 1e-38, 1e-40, 1e-42, 1e-44):
        x = torch.rand(4, 256, generator=torch.Generator().manual_seed(0)) * magnitude
        for rounding in ("nearest", "stochastic"):
            out = qs.dequantize(*qs.quantize(x, code, rounding=rounding), code)
            assert torch.isfinite(out).all(), (magnitude, rounding)
            bound = (2 if rounding == "stochastic" else 1) * (half_ulp * x + step * tiny / 2)
            assert ((out - x).abs() <= bound).all(), (magnitude, rounding)
    normal = torch.rand(4, 256) + 0.5                              # untouched above the floor: as before
    codes, absmax = qs.quantize(normal, code)
    assert torch.equal(codes.float(), (normal.view(4, 256) / (absmax / code.qmax)[:, None]).to(code.storage_dtype).float())
    p = nn.Parameter(torch.randn(BIG))
    opt = mo.AdamW([p], lr=1e-3, state_dtype="fp8")
    for _ in range(3):
        p.grad = torch.randn(BIG) * 1e-19
        opt.step()
    assert torch.isfinite(p).all() and not opt.state[p]["exp_avg_sq_absmax"].isnan().any()


@pytest.mark.parametrize("code", CODES, ids=str)
def test_stochastic_rounding_is_unbiased_within_a_bound_from_its_variance(code):
    """One block repeated N times (each copy its own draws, fixed generator): the mean decoded value of
    each element is within 5 standard errors of the coded value, the variance of one draw being
    ``(hi - y)(y - lo)`` scale units squared (exactly 0 on a table value: then the mean is exact)."""
    g = torch.Generator().manual_seed(11)
    block = torch.rand(256, generator=g) * 2 - 1
    block = block.abs() if code.sqrt else block
    block[0] = 1.0
    block = _decoded(block * 0.3, code)
    n = 2000
    codes, absmax = qs.quantize(block.repeat(n), code, rounding="stochastic", generator=torch.Generator().manual_seed(5))
    draws = _coded(qs.dequantize(codes, absmax, code), code).view(n, 256).double()
    scale = float(absmax[0]) / code.qmax
    y = (_coded(block, code) / scale).double()
    table = code.table().double()
    i = (torch.bucketize(y, table, right=True) - 1).clamp(0, table.numel() - 2)
    variance = (table[i + 1] - y).clamp_min(0) * (y - table[i]).clamp_min(0) * scale ** 2
    error = (draws.mean(0) - y * scale).abs()
    assert bool((error <= 5 * (variance / n).sqrt() + 1e-6 * y.abs() * scale).all())
    assert bool((draws.std(0) > 0).any())                              # it does draw
    nearest = _coded(qs.dequantize(*qs.quantize(block, code), code), code)
    assert not torch.equal(draws[0].float(), nearest)


def test_bad_inputs_name_the_argument_and_the_fix():
    code = qs.CODES["dynamic-signed"]
    with pytest.raises(ValueError, match=r"quantize x_fp32.dtype=torch.float16 is not allowed; pass an fp32"):
        qs.quantize(torch.zeros(4, dtype=torch.float16), code)
    with pytest.raises(ValueError, match=r"quantize rounding='up' is not allowed; choose one of"):
        qs.quantize(torch.zeros(4), code, rounding="up")
    codes, absmax = qs.quantize(torch.zeros(600), code)
    with pytest.raises(ValueError, match=r"does not fit codes of shape \(600,\): expected fp32 \(3,\)"):
        qs.dequantize(codes, absmax[:2], code)
    with pytest.raises(ValueError, match=r"code_for state_dtype=torch.bfloat16 is not an 8-bit state format"):
        qs.code_for(torch.bfloat16, nonnegative=False)
    p = nn.Parameter(torch.zeros(BIG))
    with pytest.raises(ValueError, match=r"AdamW state_dtype='int4' is not allowed; choose one of .*'int8'"):
        mo.AdamW([p], state_dtype="int4")
    with pytest.raises(ValueError, match=r"SGD state_rounding='stochastic' rounds bf16 or 8-bit state, but "
                                         r"state_dtype=torch.float32; pass state_dtype='bf16' \(or 'int8'"):
        mo.SGD([p], momentum=0.9, state_rounding="stochastic")
    with pytest.raises(ValueError, match=r"state_rounding='round' is not allowed"):
        mo.AdamW([p], state_dtype="int8", state_rounding="round")


# ================================================================ the optimizers
def quadratic(state: str, state_rounding: str = "nearest", steps: int = 400) -> tuple[float, float]:
    """AdamW from 0 on ``sum(a * (w - w*)**2) / 2`` over a (64, 128) tensor, curvatures ``a`` log-uniform in
    [0.1, 10] (a 100x spread inside every block), lr 0.05 cosine-decayed to 0. Returns the largest and the
    RMS distance to the optimum ``w*`` (standard normal: RMS 1 at the start)."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(BIG, generator=g)
    curvature = torch.empty(BIG).uniform_(math.log(0.1), math.log(10.0), generator=g).exp()
    w = nn.Parameter(torch.zeros(BIG))
    opt = mo.AdamW([w], lr=0.05, weight_decay=0.0, state_dtype=state, state_rounding=state_rounding)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    for _ in range(steps):
        w.grad = curvature * (w.detach() - target)
        opt.step()
        schedule.step()
    distance = (w.detach() - target).abs()
    return float(distance.max()), float(distance.pow(2).mean().sqrt())


def test_8bit_state_adamw_reaches_the_fp32_optimum_of_a_quadratic():
    """Stated tolerance: every format ends within 0.05 of the optimum everywhere and 5e-4 RMS (fp32 state
    measured 0.013 / 2.2e-4; int8 0.021 / 3.0e-4; fp8 0.022 / 2.5e-4, all 2000x closer than the start)."""
    torch.manual_seed(0)
    results = {(s, r): quadratic(s, r) for s, r in [("fp32", "nearest"), ("int8", "nearest"), ("int8", "stochastic"),
                                                    ("fp8", "nearest"), ("fp8", "stochastic")]}
    for key, (worst, rms) in results.items():
        assert worst < 0.05 and rms < 5e-4, (key, worst, rms)


@pytest.mark.parametrize("opt_cls, kwargs, param_dtype", [
    (mo.AdamW, dict(lr=1e-2, state_dtype="int8"), torch.float32),
    (mo.AdamW, dict(lr=1e-2, state_dtype="fp8", state_rounding="stochastic"), torch.float32),
    (mo.AdamW, dict(lr=1e-2, state_dtype=torch.int8, rounding="stochastic", state_rounding="stochastic"), torch.bfloat16),
    (mo.SGD, dict(lr=1e-2, momentum=0.9, state_dtype="int8", state_rounding="stochastic"), torch.float32),
])
def test_state_dict_round_trip_is_bit_exact(opt_cls, kwargs, param_dtype):
    """Train 10 steps straight, or 5, ``state_dict()`` through ``torch.save``, load into a fresh optimizer,
    5 more: the params and every state tensor (codes, absmax scales, fp32 state of the small ones) agree
    bit for bit (stochastic roundings draw from torch's RNG, which runs on undisturbed)."""
    g = torch.Generator().manual_seed(2)
    start = [torch.randn(BIG, generator=g), torch.randn(100, 50, generator=g), torch.randn(128, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(10)]

    def run(params, opt, steps):
        for step_grads in steps:
            for p, grad in zip(params, step_grads):
                p.grad = grad.to(param_dtype)
            opt.step()

    torch.manual_seed(9)
    straight = [nn.Parameter(t.to(param_dtype, copy=True)) for t in start]
    opt_straight = opt_cls(straight, **kwargs)
    run(straight, opt_straight, grads)
    torch.manual_seed(9)
    first = [nn.Parameter(t.to(param_dtype, copy=True)) for t in start]
    opt_first = opt_cls(first, **kwargs)
    run(first, opt_first, grads[:5])
    buffer = io.BytesIO()
    torch.save(opt_first.state_dict(), buffer)
    buffer.seek(0)
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    opt_resumed = opt_cls(resumed, **kwargs)
    opt_resumed.load_state_dict(torch.load(buffer))
    moment = "momentum_buffer" if opt_cls is mo.SGD else "exp_avg"
    assert opt_resumed.state[resumed[0]][moment].dtype in (torch.uint8, torch.float8_e4m3fn)
    assert opt_resumed.state[resumed[1]][moment + "_absmax"].shape == (20,)       # 5000 elements: a short last block
    assert opt_resumed.state[resumed[2]][moment].dtype == torch.float32          # 1-D: fp32 state
    run(resumed, opt_resumed, grads[5:])
    for p_a, p_b in zip(straight, resumed):
        assert _same(p_a.detach(), p_b.detach())
        state_a, state_b = opt_straight.state[p_a], opt_resumed.state[p_b]
        assert set(state_a) == set(state_b)
        for key in state_a:
            assert _same(state_a[key], state_b[key]), key


def test_small_and_1d_tensors_keep_fp32_state_by_design_and_the_layout_says_so():
    big, short, flat = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(63, 64)), nn.Parameter(torch.randn(8192))
    cplx = nn.Parameter(torch.randn(64, 64, dtype=torch.complex64))
    opt = mo.AdamW([big, short, flat, cplx], state_dtype="int8")
    assert opt.state_layout() == {"quantized_tensors": 1, "quantized_elements": 4096,
                                  "full_tensors": 3, "full_elements": 4032 + 8192 + 4096}
    for p in (big, short, flat, cplx):
        p.grad = torch.randn_like(p)
    opt.step()
    assert {k: v.dtype for k, v in opt.state[big].items()} == {
        "step": torch.float32, "exp_avg": torch.uint8, "exp_avg_absmax": torch.float32,
        "exp_avg_sq": torch.uint8, "exp_avg_sq_absmax": torch.float32}
    assert opt.state[big]["exp_avg_absmax"].shape == (16,)
    for p, dtype in ((short, torch.float32), (flat, torch.float32), (cplx, torch.complex64)):
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} and opt.state[p]["exp_avg"].dtype == dtype
    note = opt.state_note()
    assert "int8 blockwise (256-element blocks, fp32 absmax, codes rounded to nearest) for 1 tensor(s) (4,096 elements)" in note
    assert "3 tensor(s) (16,320 elements) keep fp32 state by design (fewer than 4096 elements or 1-D)" in note
    assert mo.AdamW([big]).state_note() == "" and mo.AdamW([short], state_dtype="fp8").state_layout()["quantized_tensors"] == 0
    assert "saves" not in note
    assert mo.AdamW([short, flat], state_dtype="int8").state_note().endswith(
        "2 tensor(s) (12,224 elements) keep fp32 state by design (fewer than 4096 elements or 1-D): no tensor here "
        "is large enough, so every moment is fp32 and int8 state saves nothing on this model")
    assert "optimizer state fp8 blockwise (256-element blocks, fp32 absmax, codes stochastically rounded)" in \
        mo.AdamW([big], state_dtype="fp8", state_rounding="stochastic").state_note()


def test_8bit_state_follows_fp32_state_closely_for_adamw_and_sgd_momentum():
    g = torch.Generator().manual_seed(4)
    start = torch.randn(BIG, generator=g)
    grads = [torch.randn(BIG, generator=g) * 1e-2 for _ in range(20)]
    for cls, kwargs in ((mo.AdamW, dict(lr=1e-3)), (mo.SGD, dict(lr=1.0, momentum=0.9))):
        finals = {}
        for state in ("fp32", "int8", "fp8"):
            w = nn.Parameter(start.clone())
            opt = cls([w], state_dtype=state, **kwargs)
            for grad in grads:
                w.grad = grad
                opt.step()
            finals[state] = w.detach() - start
        moved = finals["fp32"].abs().mean()
        for state in ("int8", "fp8"):   # the total update differs by a few % of its size (it sums 20 steps)
            assert float((finals[state] - finals["fp32"]).abs().mean()) < 0.05 * float(moved), (cls, state)


def test_loading_converts_between_fp32_and_8bit_state():
    """A torch.optim.AdamW state loads into 8-bit state quantized (codes = quantize(saved moment)); 8-bit
    state loads into fp32 state dequantized (moments = dequantize(codes))."""
    w = nn.Parameter(torch.randn(BIG))
    torch_opt = torch.optim.AdamW([w], lr=1e-3)
    for _ in range(3):
        w.grad = torch.randn(BIG)
        torch_opt.step()
    saved = torch_opt.state_dict()
    int8 = mo.AdamW([w], lr=1e-3, state_dtype="int8")
    int8.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        code = qs.code_for(torch.int8, nonnegative=key == "exp_avg_sq")
        codes, absmax = qs.quantize(saved["state"][0][key], code)
        assert _same(int8.state[w][key], codes) and _same(int8.state[w][key + "_absmax"], absmax)
    back = mo.AdamW([w], lr=1e-3)
    back.load_state_dict(int8.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        code = qs.code_for(torch.int8, nonnegative=key == "exp_avg_sq")
        assert _same(back.state[w][key], qs.dequantize(int8.state[w][key], int8.state[w][key + "_absmax"], code))
        assert key + "_absmax" not in back.state[w]


def test_a_nan_gradient_given_to_the_optimizer_itself_poisons_its_block_loudly():
    """Outside the engine (which skips the step first), a NaN gradient element updates its param element to
    NaN (as with fp32 state: the step's math is fp32) and makes the stored moments of its block of 256 NaN,
    so the next step turns that whole block of params NaN: visible, confined to the block."""
    w = nn.Parameter(torch.randn(BIG))
    opt = mo.AdamW([w], state_dtype="int8")
    grad = torch.randn(BIG)
    grad[0, 3] = math.nan
    w.grad = grad
    opt.step()
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        absmax = opt.state[w][key]
        assert absmax[0].isnan() and not absmax[1:].isnan().any()
    assert w.detach().isnan().nonzero().tolist() == [[0, 3]]
    w.grad = torch.randn(BIG)
    opt.step()
    assert w.detach().view(-1)[:256].isnan().all() and not w.detach().view(-1)[256:].isnan().any()


# ================================================================ through the engine
class Net(nn.Module):
    """8192 + 5120 weights quantized; biases, LayerNorm and a 1-D gain keep fp32 state."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.out = nn.Linear(128, 40)

    def forward(self, x):
        return self.out(self.norm(F.gelu(self.inp(x))))


def batch(k: int) -> dict:
    g = torch.Generator().manual_seed(100 + k)
    return {"x": torch.randn(8, 64, generator=g), "y": torch.randn(8, 40, generator=g)}


def loss_fn(model, b):
    return F.mse_loss(model(b["x"]).float(), b["y"])


def build(policy: str, init_seed: int = 0, guard=None) -> MixedPrecision:
    torch.manual_seed(init_seed)
    model = Net()
    opt = mo.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    return MixedPrecision(model, opt, policy=policy, device="cpu", scheduler=scheduler, max_grad_norm=1.0,
                          guard=guard)


def train(mp: MixedPrecision, start: int, stop: int, corrupt_at: int | None = None) -> list:
    results = []
    for k in range(start, stop):
        b = mp.cast_inputs(batch(k), keep=("y",))
        if k == corrupt_at:
            b["x"][2, 5] = math.nan
        with mp.autocast():
            loss = loss_fn(mp.model, b)
        mp.backward(loss)
        results.append(mp.step())
    return results


def _state_copy(opt) -> dict:
    return {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}


def test_engine_decision_and_a_skipped_nan_step_leave_the_8bit_state_untouched():
    mp = build("bf16-lean")
    assert "optimizer state int8 blockwise" in mp.decision and "for 2 tensor(s) (13,312 elements)" in mp.decision
    train(mp, 0, 2)
    before = _state_copy(mp.optimizer)
    (result,) = train(mp, 2, 3, corrupt_at=2)
    assert not result.applied and result.skipped_reason == "nonfinite"    # skipped before the optimizer
    after = _state_copy(mp.optimizer)
    assert before.keys() == after.keys() and all(_same(before[k], after[k]) for k in before)
    assert all(r.applied for r in train(mp, 3, 5))
    assert all(torch.isfinite(v.float()).all() for s in mp.optimizer.state.values() for v in s.values())


def test_bytes_per_param_of_the_census_are_exact_on_known_param_counts():
    """bf16-lean: 2 B param + 2 B grad; state 2 x (n + 4 ceil(n / 256)) for the two quantized weights,
    8 B per element (fp32 moments) for the biases and LayerNorm; the policy's 6.03 is the all-quantized
    limit."""
    mp = build("bf16-lean")
    train(mp, 0, 1)
    measured = {}
    b = mp.cast_inputs(batch(1), keep=("y",))
    with mp.autocast():
        loss = loss_fn(mp.model, b)
    mp.backward(loss)
    measured["s"] = state_bytes(mp.model, mp.optimizer)
    mp.step()
    sizes = [p.numel() for p in mp.model.parameters()]   # 8192, 128, 128, 128, 5120, 40
    quantized = [n for p, n in zip(mp.model.parameters(), sizes) if p.dim() == 2]
    n = sum(sizes)
    state = 2 * sum(qs.nbytes(k) for k in quantized) + 8 * (n - sum(quantized))
    s = measured["s"]
    assert (s.params, s.grads, s.masters, s.compensation) == (2 * n, 2 * n, 0, 0)
    assert s.optimizer_state == state and s.quantized_state == 2 * sum(qs.nbytes(k) for k in quantized)
    assert s.quantized_elements == 2 * sum(quantized) == 2 * 13312
    assert s.per_param == (4 * n + state) / n
    assert mixprec.Policy.parse("bf16-lean").bytes_per_param() == 6.03125 < s.per_param < 6.4


@pytest.mark.parametrize("policy", ["bf16-lean", "bf16-lean,state_rounding=stochastic", "bf16-kahan,state=fp8"])
def test_checkpoint_resume_is_bit_exact(policy, tmp_path):
    """Train 6 steps straight, or 3, save, load into a fresh engine (other weights, other RNG state), 3 more:
    every saved tensor (params, 8-bit codes and absmax scales, fp32 state, RNG) agrees bit for bit."""
    from safetensors.torch import load_file

    torch.manual_seed(7)
    straight = build(policy)
    train(straight, 0, 6)
    save_checkpoint(tmp_path / "straight", straight)
    torch.manual_seed(7)
    first = build(policy)
    train(first, 0, 3)
    save_checkpoint(tmp_path / "half", first)
    torch.manual_seed(123)
    resumed = build(policy, init_seed=1)
    load_checkpoint(tmp_path / "half", resumed)
    train(resumed, 3, 6)
    save_checkpoint(tmp_path / "resumed", resumed)
    a, b = (load_file(resolve_checkpoint(tmp_path / n) / "state.safetensors") for n in ("straight", "resumed"))
    assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    code_dtype = torch.uint8 if "int8" in policy or policy.startswith("bf16-lean") else torch.float8_e4m3fn
    assert a["optimizer/state/0/exp_avg"].dtype == code_dtype and a["optimizer/state/0/exp_avg_absmax"].shape == (32,)
    ma, mb = (load_file(resolve_checkpoint(tmp_path / d) / "model.safetensors") for d in ("straight", "resumed"))
    assert set(ma) == set(mb) and all(_same(ma[k], mb[k]) for k in ma)


def test_checkpoint_conversion_between_fp32_and_int8_state_is_recorded(tmp_path):
    src = build("bf16-sr")
    train(src, 0, 3)
    save_checkpoint(tmp_path / "sr", src)
    saved = src.optimizer.state_dict()["state"]
    lean = build("bf16-lean", init_seed=1)
    load_checkpoint(tmp_path / "sr", lean, convert=True)
    event = lean.events[-1]
    assert event["kind"] == "convert" and "converted fp32 → int8" in event["detail"]
    state = lean.optimizer.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        codes, absmax = qs.quantize(saved[0][key], qs.code_for(torch.int8, nonnegative=key == "exp_avg_sq"))
        assert _same(state[0][key], codes) and _same(state[0][key + "_absmax"], absmax)
    assert _same(state[1]["exp_avg"], saved[1]["exp_avg"])    # a bias: fp32 state either way
    assert all(r.applied for r in train(lean, 3, 5))

    save_checkpoint(tmp_path / "lean", lean)
    int8 = lean.optimizer.state_dict()["state"]
    back = build("bf16-sr", init_seed=2)
    load_checkpoint(tmp_path / "lean", back, convert=True)
    assert "converted int8 → fp32" in back.events[-1]["detail"]
    fp32 = back.optimizer.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        code = qs.code_for(torch.int8, nonnegative=key == "exp_avg_sq")
        assert _same(fp32[0][key], qs.dequantize(int8[0][key], int8[0][key + "_absmax"], code))


def test_set_policy_migrates_fp32_and_int8_state_and_keeps_an_unchanged_format_bit_for_bit():
    mp = build("bf16-mixed")
    train(mp, 0, 3)
    fp32 = mp.optimizer.state_dict()["state"]
    event = mp.set_policy("bf16-mixed,state=int8")
    assert "converted fp32 → int8" in event["detail"] and "optimizer state int8 blockwise" in mp.decision
    int8 = mp.optimizer.state_dict()["state"]
    code = qs.code_for(torch.int8, nonnegative=False)
    assert _same(int8[0]["exp_avg"], qs.quantize(fp32[0]["exp_avg"], code)[0])
    event = mp.set_policy("bf16-lean")          # params to bf16, the same int8 format: codes move as they are
    assert "converted" not in event["detail"]
    now = mp.optimizer.state_dict()["state"]
    assert all(_same(now[i][k], int8[i][k]) for i in int8 for k in int8[i])
    assert all(r.applied for r in train(mp, 3, 5))
    event = mp.set_policy("bf16-sr")
    assert "converted int8 → fp32" in event["detail"]
    assert mp.optimizer.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


def test_guard_rollback_restores_the_8bit_state_bit_for_bit():
    guard = Guard(snapshot_every=1000, loss_fn=loss_fn)
    mp = build("bf16-lean", guard=guard)
    train(mp, 0, 3)
    guard.take_snapshot(mp)
    snapshot = _state_copy(mp.optimizer)
    train(mp, 3, 5)
    assert not all(_same(snapshot[k], v) for k, v in _state_copy(mp.optimizer).items())
    kept = _state_copy(mp.optimizer)
    (dropped,) = train(mp, 5, 6, corrupt_at=5)   # the first non-finite step in a row: its batch dropped
    assert not dropped.rolled_back and mp.events[-1]["kind"] == "skip"
    assert all(_same(kept[k], v) for k, v in _state_copy(mp.optimizer).items())
    (result,) = train(mp, 6, 7, corrupt_at=6)    # the second: rolled back
    assert result.rolled_back and mp.events[-1]["kind"] == "rollback"
    restored = _state_copy(mp.optimizer)
    assert restored.keys() == snapshot.keys() and all(_same(snapshot[k], restored[k]) for k in snapshot)
    assert all(r.applied for r in train(mp, 7, 9))


def test_inspector_lost_updates_are_measured_with_8bit_state():
    """The lost-update statistic reads the optimizer's fp32 delta, whatever holds its state: with int8
    state the LayerNorm gains lose every update in bf16 at lr 1e-4 (as with fp32 state) and the big
    weight's fraction matches fp32 state's within 5 points."""
    data = [batch(k) for k in range(3)]
    reports = {}
    for state in ("fp32", "int8"):
        torch.manual_seed(0)
        reports[state] = inspect(Net(), data, loss_fn, lr=1e-4, steps=3, policy="bf16-lean",
                                 optimizer=lambda m, s=state: mo.AdamW(m.parameters(), lr=1e-4, state_dtype=s))
    gains = reports["int8"].params["norm.weight"]
    assert gains.updated == 3 * 128 and gains.lost_update("bf16") == 1.0
    big = {s: r.params["inp.weight"].lost_update("bf16") for s, r in reports.items()}
    assert abs(big["int8"] - big["fp32"]) < 0.05
    rec = reports["int8"].recommend()
    assert mixprec.Policy.parse(str(rec.policy)) == rec.policy and rec.policy.state_dtype == torch.int8


def test_the_contract_refuses_what_cannot_run_int8_state():
    model = Net()
    with pytest.raises(ValueError, match=r"asks for state=int8, which AdamW cannot do; use mixprec.optim.AdamW"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-mixed,state=int8", device="cpu")
    model = Net()
    explicit = mo.AdamW(model.parameters(), state_dtype="int8", state_rounding="stochastic")
    with pytest.raises(ValueError, match=r"AdamW was built with state_rounding='stochastic' but the policy bf16-lean "
                                         r"says state_rounding='nearest'; drop those arguments \(the policy sets them\) or "
                                         r"write them into the policy \(state_rounding=, e.g. "
                                         r"policy='bf16-lean,state_rounding=stochastic'\)"):
        MixedPrecision(model, explicit, policy="bf16-lean", device="cpu")


def test_an_optimizer_given_only_state_dtype_takes_the_rest_from_the_policy():
    """AdamW(..., state_dtype="int8") under bf16-lean agrees with the policy: it was refused because the
    rounding it was not given defaulted to 'nearest'; now the settings left out follow the policy."""
    model = Net()
    opt = mo.AdamW(model.parameters(), lr=1e-3, state_dtype="int8")
    mp = MixedPrecision(model, opt, policy="bf16-lean", device="cpu")
    assert (opt.rounding, opt.state_dtype, opt.state_rounding) == ("stochastic", torch.int8, "nearest")
    assert "8-bit-state AdamW steps" in mp.decision
    with pytest.raises(ValueError, match=r"AdamW was built with state_dtype='int8' but the policy bf16-sr says "
                                         r"state_dtype='fp32'.*\(state=, e.g. policy='bf16-lean'\)"):
        other = Net()
        MixedPrecision(other, mo.AdamW(other.parameters(), state_dtype="int8"), policy="bf16-sr", device="cpu")
    mp.set_policy("bf16-kahan,state=int8")        # the explicit state stays, the rounding follows the new policy
    assert (opt.rounding, opt.state_dtype) == ("kahan", torch.int8)


def test_sgd_without_momentum_under_8bit_state_says_it_keeps_no_state():
    big = nn.Parameter(torch.randn(64, 64))
    plain = mo.SGD([big], lr=0.1, state_dtype="int8")
    assert plain.state_layout() == {"quantized_tensors": 0, "quantized_elements": 0, "full_tensors": 0, "full_elements": 0}
    assert plain.state_note() == ("; optimizer state int8: none is kept (SGD without momentum holds no moment buffers), "
                                  "so int8 state changes nothing")
    assert mo.SGD([big], lr=0.1, momentum=0.9, state_dtype="int8").state_layout()["quantized_tensors"] == 1


def test_a_torch_optimizer_under_bf16_lean_hears_both_things_it_lacks():
    model = Net()
    with pytest.raises(ValueError, match=r"policy bf16-lean writes updates with rounding='stochastic' and asks for "
                                         r"state=int8, which AdamW cannot do; use mixprec.optim.AdamW"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-lean", device="cpu")


def test_the_decision_says_how_8bit_sgd_momentum_steps_run():
    model = Net()
    mp = MixedPrecision(model, mixprec.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy="bf16-lean",
                        device="cpu")
    assert mp.decision.endswith("; 8-bit-state SGD steps: torch ops (the fused C kernel is AdamW's)")
    model = Net()
    plain = MixedPrecision(model, mixprec.optim.SGD(model.parameters(), lr=0.1), policy="bf16-lean", device="cpu")
    assert "8-bit-state SGD steps" not in plain.decision   # no momentum: no state, nothing to say
