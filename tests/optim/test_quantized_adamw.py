"""The 8-bit-state AdamW step: the fused C kernel against the torch-op reference, bit for bit, and its fallback."""

import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec as mp
from mixprec.optim import c_kernels
from mixprec.optim import AdamW, quantized_adamw, quantized_state as qs
from mixprec.optim.adamw import adamw_update_
from mixprec.optim.rounding import write_back_

SIGNED, SQRT = qs.CODES["dynamic-signed"], qs.CODES["dynamic-sqrt"]
PAIRS = {"int8": (SIGNED, SQRT), "fp8": (qs.CODES["e4m3"], qs.CODES["e5m2"])}
fused_only = pytest.mark.skipif(c_kernels.compiler() is None, reason="no C compiler on this machine")


def _state(n: int, gen: torch.Generator, *, codes=(SIGNED, SQRT), m_scale: float = 1e-3, v_scale: float = 1e-6):
    m = qs.quantize(torch.randn(n, generator=gen) * m_scale, codes[0])
    v = qs.quantize(torch.rand(n, generator=gen) * v_scale, codes[1])
    return m, v


def _reference_step(param, grad, m, v, *, rounding, state_rounding, **hyper):
    """reference_update_ plus the write-back AdamW does after it (param rounded with ``rounding``)."""
    param_fp32 = param.float()
    quantized_adamw.reference_update_(param_fp32, grad.float(), m, v, state_rounding=state_rounding, **hyper)
    write_back_(param, param_fp32, rounding=rounding)


def _assert_same(got, want, what):
    """Bitwise equal (a NaN scale equal to a NaN scale)."""
    for name, g, w in zip(("param", "m codes", "m absmax", "v codes", "v absmax"), got, want):
        if g.is_floating_point() and g.numel() == w.numel() and g.dim() == 1 and name.endswith("absmax"):
            assert torch.equal(g.isnan(), w.isnan()), f"{what}: {name} NaN blocks differ"
            g, w = g.nan_to_num(), w.nan_to_num()
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{what}: {name} differs"


@fused_only
def test_the_kernel_builds_loads_and_passes_its_check_against_the_reference():
    assert quantized_adamw.kernel_status() == "fused C kernel"


@fused_only
@pytest.mark.parametrize("p_dtype,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "nearest"),
                                               (torch.bfloat16, "stochastic")])
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("state", ["int8", "fp8"])
def test_fused_steps_equal_the_torch_ops_bit_for_bit(p_dtype, rounding, g_dtype, state_rounding, weight_decay, state):
    gen = torch.Generator().manual_seed(1)
    n = 40 * qs.BLOCK_SIZE + 77            # several threads' ranges and a short last block
    param = torch.randn(n, generator=gen).to(p_dtype)
    m, v = _state(n, gen, codes=PAIRS[state])
    ref_param, ref_m, ref_v = param.clone(), (m[0].clone(), m[1].clone()), (v[0].clone(), v[1].clone())
    for step in range(1, 6):
        grad = (torch.randn(n, generator=gen) * 10.0 ** -step).to(g_dtype)
        hyper = dict(step=float(step), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        torch.manual_seed(step)
        quantized_adamw.fused_step_(param, grad, m, v, rounding=rounding, state_rounding=state_rounding, **hyper)
        after_fused = torch.rand(1)
        torch.manual_seed(step)
        _reference_step(ref_param, grad, ref_m, ref_v, rounding=rounding, state_rounding=state_rounding, **hyper)
        assert torch.equal(torch.rand(1), after_fused), "the two paths drew different amounts of randomness"
        _assert_same((param, m[0], m[1], v[0], v[1]), (ref_param, *ref_m, *ref_v), f"step {step}")


@fused_only
def test_fp8_codes_round_like_torchs_cast_ties_to_even_and_signed_zeros():
    """beta1 = 0 from zero moments: m' = g; a block whose largest |g| is 448 has unit 448 / 448 = 1, so
    y = g and the E4M3 code must be torch's float -> float8_e4m3fn cast of g: ties to even (every midpoint
    between neighbouring magnitudes, both signs), subnormals, values that round to zero (-0 for negatives; m itself
    is never -0: 0 + (g - 0) * 1 is +0 for g = -0)."""
    e4m3 = qs.CODES["e4m3"]
    mags = e4m3.table()[e4m3.table() >= 0]
    mids = (mags[:-1] + mags[1:]) / 2
    special = torch.tensor([448.0, 3.0, 0.0, 2.0**-11, -(2.0**-11), 2.0**-10, -(2.0**-10) * 1.01, 1e-30, -1e-30])
    grad = torch.cat([special, mids, -mids, torch.randn(512 - special.numel() - 2 * mids.numel(),
                                                        generator=torch.Generator().manual_seed(2)) * 10])
    assert grad.numel() == 512 and float(grad.abs().max()) == 448.0
    want = grad.to(torch.float8_e4m3fn).view(torch.uint8)
    for fuse in (True, False):
        param = torch.zeros(512)
        m, v = qs.zeros((512,), e4m3, "cpu"), qs.zeros((512,), qs.CODES["e5m2"], "cpu")
        hyper = dict(step=1.0, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
        if fuse:
            quantized_adamw.fused_step_(param, grad, m, v, **hyper)
        else:
            _reference_step(param, grad, m, v, rounding="nearest", state_rounding="nearest", **hyper)
        assert float(m[1][0]) == 448.0
        assert torch.equal(m[0].view(torch.uint8)[:256], want[:256]), f"fused={fuse}"


@fused_only
def test_exact_midpoints_round_to_the_lower_neighbour_in_both_paths():
    """beta1 = beta2 = 0 from zero moments: m' = g and sqrt(v') = |g| exactly, so gradients placed on the
    midpoints between neighbouring code values (in a block whose largest value is 1) are exact ties."""
    mids_signed = (SIGNED.table()[:-1] + SIGNED.table()[1:]) / 2
    mids_sqrt = (SQRT.table()[:-1] + SQRT.table()[1:]) / 2
    one = torch.tensor([1.0])                                    # each block's largest value: absmax 1
    grad = torch.cat([one, mids_signed, one, mids_sqrt])         # two blocks of 256, every midpoint once
    assert grad.numel() == 512 and bool(qs.sqrt_fp32(grad * grad).eq(grad.abs()).all())
    for fuse in (True, False):
        param = torch.zeros(512)
        m, v = qs.zeros((512,), SIGNED, "cpu"), qs.zeros((512,), SQRT, "cpu")
        hyper = dict(step=1.0, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
        if fuse:
            quantized_adamw.fused_step_(param, grad, m, v, **hyper)
        else:
            _reference_step(param, grad, m, v, rounding="nearest", state_rounding="nearest", **hyper)
        expected_m = torch.bucketize(grad, mids_signed)           # right=False: a tie goes to the lower value
        expected_v = torch.bucketize(grad.abs(), mids_sqrt)
        assert torch.equal(m[1], torch.ones(2)) and torch.equal(v[1], torch.ones(2))
        assert torch.equal(m[0].long(), expected_m), f"fused={fuse}: m ties"
        assert torch.equal(v[0].long(), expected_v), f"fused={fuse}: v ties"


def _train(model_seed: int, fused: bool, monkeypatch, steps: int = 6, policy: str = "bf16-lean"):
    """A tiny model under bf16-lean (int8 moments, bf16 params, stochastic rounding) on a CPU."""
    if not fused:
        monkeypatch.setattr(quantized_adamw, "fusable", lambda *a, **k: False)
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64))
    opt = AdamW(model.parameters(), lr=3e-3)
    trainer = mp.MixedPrecision(model, opt, policy=policy, device="cpu")
    data = torch.randn(steps, 32, 64, generator=torch.Generator().manual_seed(5))
    for x in data:
        with trainer.autocast():
            loss = torch.nn.functional.mse_loss(model(x), x)
        trainer.backward(loss)
        trainer.step()
    monkeypatch.undo()
    return model, opt, trainer


@fused_only
@pytest.mark.parametrize("policy", ["bf16-lean", "bf16-sr,state=fp8"])
def test_bf16_lean_training_takes_the_same_steps_fused_and_unfused(monkeypatch, policy):
    fused_model, fused_opt, trainer = _train(0, True, monkeypatch, policy=policy)
    ref_model, ref_opt, _ = _train(0, False, monkeypatch, policy=policy)
    assert "8-bit-state AdamW steps: fused C kernel" in trainer.decision
    for (name, a), b in zip(fused_model.state_dict().items(), ref_model.state_dict().values()):
        assert a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    fs, rs = fused_opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert any("exp_avg_absmax" in s for s in fs.values())
    for i in fs:
        for key, value in fs[i].items():
            assert torch.equal(value, rs[i][key]), (i, key)


def _python(code: str, **env) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_without_the_kernel_the_torch_ops_run_and_say_why(tmp_path):
    status = "from mixprec.optim import quantized_adamw as q; print(q.kernel_status())"
    cost = " (the same bits as the kernel, a 2-4x slower optimizer step)"
    assert _python(status, MIXPREC_C_KERNELS="0") == "torch ops: turned off by MIXPREC_C_KERNELS=0" + cost
    failed = _python(status, CC="false", MIXPREC_CACHE_DIR=str(tmp_path))
    assert failed == ("torch ops: CC=false failed to build quantized_adamw.c: exit status 1; unset CC or point it "
                      "at a working C compiler" + cost), failed
    missing = _python(status, CC=str(tmp_path / "no-such-cc"), MIXPREC_CACHE_DIR=str(tmp_path))
    assert missing.startswith(f"torch ops: CC={tmp_path / 'no-such-cc'} could not run: "), missing
    assert missing.endswith("; unset CC or point it at a working C compiler" + cost), missing
    (tmp_path / "a-file").write_text("")   # a cache directory under a file cannot be made
    unwritable = _python(status, MIXPREC_CACHE_DIR=str(tmp_path / "a-file" / "cache"))
    assert "is not writable" in unwritable and "set MIXPREC_CACHE_DIR to a writable directory" in unwritable, unwritable
    assert not any((tmp_path / "c-kernels").glob("*.so")) if (tmp_path / "c-kernels").exists() else True


@pytest.mark.slow   # default set: test_threads_racing_the_first_use_never_run_an_unchecked_kernel builds the same
# kernel (an FMA in m's update) and asserts the same refusal ("torch ops: it differs ...") before its thread checks
@fused_only
def test_a_kernel_that_differs_from_the_reference_is_refused(tmp_path):
    """A kernel built with a fused multiply-add in m's update (one rounding fewer) fails the load check."""
    source = Path(quantized_adamw.KERNEL_SOURCE).read_text()
    assert "m = m + (g - m) * omb1;" in source
    bad = tmp_path / "quantized_adamw.c"
    bad.write_text(source.replace("m = m + (g - m) * omb1;", "m = fmaf(g - m, omb1, m);"))
    out = _python(f"from pathlib import Path; from mixprec.optim import quantized_adamw as q; "
                  f"q.KERNEL_SOURCE = Path({str(bad)!r}); print(q.kernel_status())", MIXPREC_CACHE_DIR=str(tmp_path))
    assert out.startswith("torch ops: it differs from the torch-op reference"), out


@fused_only
def test_the_built_kernel_is_cached_and_reused(tmp_path):
    status = "from mixprec.optim import quantized_adamw as q; print(q.kernel_status())"
    assert _python(status, MIXPREC_CACHE_DIR=str(tmp_path)) == "fused C kernel"
    (built,) = (tmp_path / "c-kernels").glob("quantized_adamw-*.so")
    stamp = built.stat().st_mtime_ns
    assert _python(status, MIXPREC_CACHE_DIR=str(tmp_path)) == "fused C kernel"
    assert built.stat().st_mtime_ns == stamp
    assert sorted(f.name for f in (tmp_path / "c-kernels").iterdir()) == [built.name, built.name + ".sha256"]


def _copy_the_built_kernel(cache: Path) -> None:
    """Copy the kernel library this process steps with (built in the session's cache, tests/conftest.py) and its
    recorded digest into ``cache``'s ``c-kernels``; nothing when this process runs the torch ops."""
    built = quantized_adamw.library_path()
    if built is not None:
        (cache / "c-kernels").mkdir(parents=True, exist_ok=True)
        for f in (built, built.with_name(built.name + ".sha256")):
            shutil.copyfile(f, cache / "c-kernels" / f.name)


@fused_only
def test_a_damaged_cached_kernel_is_rebuilt_not_loaded(tmp_path):
    """A truncated library in the cache (a crash after the build, a partly copied cache) killed the process
    with SIGBUS inside dlopen; one that is some other library raised AttributeError out of fusable()."""
    status = "from mixprec.optim import quantized_adamw as q; print(q.kernel_status())"
    # the cache starts with the kernel this session built, copied with its digest: the first use loads it (a build
    # from an empty cache is test_the_built_kernel_is_cached_and_reused's), and each damage below costs one build
    _copy_the_built_kernel(tmp_path)
    assert _python(status, MIXPREC_CACHE_DIR=str(tmp_path)) == "fused C kernel"
    (built,) = (tmp_path / "c-kernels").glob("quantized_adamw-*.so")
    good = built.read_bytes()
    built.write_bytes(good[:3000])
    assert _python(status, MIXPREC_CACHE_DIR=str(tmp_path)) == "fused C kernel"
    recorded = (built.parent / (built.name + ".sha256")).read_text().strip()
    assert hashlib.sha256(built.read_bytes()).hexdigest() == recorded and len(built.read_bytes()) > 3000   # rebuilt
    other = tmp_path / "other.c"
    other.write_text("int other(void) { return 1; }\n")
    subprocess.run([*c_kernels.compiler(), "-shared", "-fPIC", "-o", str(built), str(other)], check=True)
    assert _python(status, MIXPREC_CACHE_DIR=str(tmp_path)) == "fused C kernel"


def test_the_reference_matches_fp32_state_adamw_to_the_codes_resolution():
    """The decomposed op order changes the fp32 math by ulps; after one step from zero state both land on
    the same codes except where an ulp crosses a midpoint (here: none or a handful of 10k elements)."""
    gen = torch.Generator().manual_seed(3)
    n = 40 * qs.BLOCK_SIZE
    grad = torch.randn(n, generator=gen) * 1e-3
    param = torch.randn(n, generator=gen)
    m, v = qs.zeros((n,), SIGNED, "cpu"), qs.zeros((n,), SQRT, "cpu")
    hyper = dict(step=1.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ref = param.clone()
    quantized_adamw.reference_update_(ref, grad, m, v, **hyper)
    exp_avg, exp_avg_sq, full = torch.zeros(n), torch.zeros(n), param.clone()
    adamw_update_(full, grad, exp_avg, exp_avg_sq, **hyper)
    # the params: the two op orders differ by the roundings of the update (step 1: |update| ~ lr, about eight
    # fp32 operations, each within half an ulp) plus the param's own rounding: 1 ulp of the param + 8 of lr
    eps = torch.finfo(torch.float32).eps
    tolerance = eps * torch.exp2(torch.floor(torch.log2(full.abs()))) + 8 * eps * hyper["lr"]
    assert bool(((ref - full).abs() <= tolerance).all())
    assert int((ref != full).sum()) < n // 2   # mostly the same bits: not a looser comparison in disguise
    codes_m, _ = qs.quantize(exp_avg, SIGNED)
    assert int((codes_m != m[0]).sum()) <= n // 1000
    assert math.isfinite(float(m[1].sum()))


@fused_only
def test_a_signed_scale_that_overflows_reads_nan_in_both_paths():
    """A block whose most negative m is below -0.99297 * FLT_MAX has a scale |m| / 0.99297 that overflows
    fp32: quantize stores NaN (as for any non-finite scale); the kernel stored inf."""
    n = 2 * qs.BLOCK_SIZE
    grad = torch.full((n,), 1e-3)
    grad[qs.BLOCK_SIZE + 3] = -3.39e38                            # beta1 = 0: m = g
    hyper = dict(step=1.0, lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0)
    got, want = [], []
    for fuse, out in ((True, got), (False, want)):
        param = torch.ones(n)
        m, v = qs.zeros((n,), SIGNED, "cpu"), qs.zeros((n,), SQRT, "cpu")
        if fuse:
            quantized_adamw.fused_step_(param, grad, m, v, **hyper)
        else:
            _reference_step(param, grad, m, v, rounding="nearest", state_rounding="nearest", **hyper)
        out += [param, *m, *v]
    assert bool(want[2][1].isnan()) and bool(want[4][1].isnan())
    _assert_same(got, want, "an overflowing scale")


@fused_only
def test_state_that_does_not_fit_the_param_is_refused_not_overrun():
    """Loading another model's optimizer state (a smaller param at the same position) must raise, as the torch
    ops do, and not let the kernel read and write past the end of the codes and scales (it crashed)."""
    small, big = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(4096, 64))
    small.grad, big.grad = torch.randn(64, 64), torch.randn(4096, 64)
    saved = AdamW([small], state_dtype="int8")
    saved.step()
    opt = AdamW([big], state_dtype="int8")
    opt.load_state_dict(saved.state_dict())
    state = opt.state[big]
    m, v = (state["exp_avg"], state["exp_avg_absmax"]), (state["exp_avg_sq"], state["exp_avg_sq_absmax"])
    with pytest.raises(ValueError, match=r"exp_avg codes of shape \(64, 64\)"):
        quantized_adamw.fused_step_(big, big.grad, m, v, step=2.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.0)
    with pytest.raises(ValueError, match="does not belong to this param"):
        opt.step()
    with pytest.raises(RuntimeError, match="must match"):       # the torch ops refuse it too
        quantized_adamw.reference_update_(big.detach().clone(), big.grad, m, v, step=2.0, lr=1e-3, beta1=0.9,
                                          beta2=0.999, eps=1e-8, weight_decay=0.0)


@fused_only
def test_threads_racing_the_first_use_never_run_an_unchecked_kernel(tmp_path):
    """A kernel that fails its check (an FMA in m's update), first used by eight threads at once: every
    thread's step must equal the torch-op reference (a thread arriving during the check waits for it)."""
    source = Path(quantized_adamw.KERNEL_SOURCE).read_text()
    bad = tmp_path / "quantized_adamw.c"
    bad.write_text(source.replace("m = m + (g - m) * omb1;", "m = fmaf(g - m, omb1, m);"))
    script = f"""
import threading, time, torch
from pathlib import Path
from mixprec.optim import AdamW, quantized_adamw as q
q.KERNEL_SOURCE = Path({str(bad)!r})
def train(out, i, steps=None):
    w = torch.nn.Parameter(torch.randn(64, 256, generator=torch.Generator().manual_seed(100 + i)))
    opt = AdamW([w], lr=1e-2, state_dtype="int8")
    gen, n, stop = torch.Generator().manual_seed(i), 0, time.monotonic() + 4.0
    while (n < steps) if steps else (time.monotonic() < stop):   # keep stepping through the build and check
        w.grad = torch.randn(64, 256, generator=gen)
        opt.step()
        n += 1
    out[i] = (n, w.detach().clone())
results = {{}}
threads = [threading.Thread(target=train, args=(results, i)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
assert q.kernel_status().startswith("torch ops: it differs"), q.kernel_status()
q.fusable = lambda *a, **k: False
for i in range(8):
    want = {{}}
    train(want, i, steps=results[i][0])
    assert torch.equal(results[i][1], want[i][1]), i
print("ok", min(n for n, _ in results.values()))
"""
    assert _python(script, MIXPREC_CACHE_DIR=str(tmp_path)).startswith("ok")


def test_a_gradient_sharing_the_params_storage_takes_the_reference():
    """The kernel assumes its buffers do not overlap (C restrict); p.grad = p.detach() must not reach it."""
    w = torch.randn(64, 256)
    m, v = qs.zeros(w.shape, SIGNED, "cpu"), qs.zeros(w.shape, SQRT, "cpu")
    assert not quantized_adamw.fusable(w, w.detach(), m[0], v[0], rounding="nearest")
    assert quantized_adamw.fusable(w, w.detach().clone(), m[0], v[0], rounding="nearest") == (quantized_adamw.kernel_status() == "fused C kernel")


@fused_only
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16])
def test_a_negative_e5m2_code_gives_the_references_nan_not_a_clamped_step(p_dtype):
    """E5M2 codes are signed: a v state holding negative codes (none that quantize makes: a hand-built or
    corrupted state) decodes to v < 0 and, where this step's g**2 does not lift it, the reference's
    sqrt(v) is NaN, so those params turn NaN (torch's CPU sqrt gives +NaN). The kernel clamped v to 0
    first and took a finite, huge step there instead."""
    n = 256
    param = torch.linspace(-1, 1, n).to(p_dtype)
    grad = torch.full((n,), 1e-3)
    m = qs.quantize(torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-3, qs.CODES["e4m3"])
    negative = torch.arange(n) % 3 == 0
    v = (torch.where(negative, -1.0, 1.0).to(torch.float8_e5m2), torch.tensor([57344 * 1e-6]))   # v = -+1e-6
    hyper = dict(step=2.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    ref_param, ref_m, ref_v = param.clone(), (m[0].clone(), m[1].clone()), (v[0].clone(), v[1].clone())
    quantized_adamw.fused_step_(param, grad, m, v, **hyper)
    _reference_step(ref_param, grad, ref_m, ref_v, rounding="nearest", state_rounding="nearest", **hyper)
    assert bool(ref_param[negative].isnan().all()) and bool(ref_param[~negative].isfinite().all())
    _assert_same((param, m[0], m[1], v[0], v[1]), (ref_param, *ref_m, *ref_v), "negative v codes")
