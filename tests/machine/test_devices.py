import pytest
import torch
from torch.overrides import TorchFunctionMode

from mixprec import MixedPrecision
from mixprec.machine.capability import Capability, probe
from mixprec.policy.resolve import resolve, resolve_policy
from mixprec.policy.policy import PRESETS
from engine_loops import _linear, _one_step


FP32 = torch.float32


def cap(device, bf16=True, bf16_fast=True, fp16_native=True, fp16=True, detail="test"):
    return Capability(device=device, bf16=bf16, fp16=fp16, bf16_fast=bf16_fast, fp16_native=fp16_native,
                      detail=detail)


@pytest.mark.parametrize("device,capability,expected", [
    ("cuda:1", cap("cuda:1", bf16_fast=True, detail="A100, compute capability 8.0"), "bf16-mixed"),
    ("cuda", cap("cuda", bf16_fast=False, detail="T4, compute capability 7.5"), "fp16-mixed"),
    ("mps", cap("mps", bf16=True), "bf16-mixed"),
    ("mps:0", cap("mps", bf16=False, bf16_fast=False, detail="macOS 13"), "fp16-mixed"),
    ("cpu", cap("cpu", bf16_fast=True), "bf16-mixed"),
    ("cpu", cap("cpu", bf16_fast=False, fp16_native=False), "fp32"),
    ("cpu", cap("cpu", bf16_fast=False, fp16_native=True), "fp32"),  # never fp16 on a CPU
])
def test_auto_per_device(device, capability, expected):
    res = resolve("auto", device, capability=capability)
    assert res.policy == PRESETS[expected]
    assert res.device.type == torch.device(device).type
    assert expected in res.decision
    # the scaler is on exactly where fp16 computes
    assert (res.policy.loss_scale == "dynamic") == (expected == "fp16-mixed")


def test_explicit_unrunnable_policy_raises_or_falls_back_explicitly():
    old_mac = cap("mps", bf16=False, bf16_fast=False, detail="macOS 13")
    with pytest.raises(ValueError, match=r"cannot run on mps.*Policies this device can run: .*fp16-mixed.*allow_fallback"):
        resolve("bf16-pure", "mps", capability=old_mac)
    res = resolve("bf16-pure", "mps", capability=old_mac, allow_fallback=True)
    assert res.fell_back and res.policy == PRESETS["fp16-mixed"]
    assert res.decision.startswith("FALLBACK: asked bf16-pure on mps")


def test_cpu_probe_is_measured_and_cached():
    c = probe("cpu")
    assert c.bf16_speed_ratio is not None and c.bf16_speed_ratio > 0
    assert c.fp16_speed_ratio is not None and c.fp16_speed_ratio > 0
    assert c.bf16_fast == (c.bf16_speed_ratio >= 1.1)
    assert probe("cpu") is c
    auto = resolve_policy("auto", "cpu")
    assert auto == (PRESETS["bf16-mixed"] if c.bf16_fast else PRESETS["fp32"])


def test_fp16_on_cpu_runs_as_asked_with_a_note_when_not_native():
    slow = cap("cpu", fp16_native=False, detail="fp16 0.002x")
    res = resolve("fp16-mixed", "cpu", capability=slow)
    assert res.policy == PRESETS["fp16-mixed"] and not res.fell_back
    assert "emulated, not native" in res.decision


@pytest.mark.parametrize("device,match", [
    ("tpu", "is not a device"), ("cuda:7", "CUDA is not available"), ("banana", "is not a device"),
])
def test_bad_devices(device, match):
    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match=match):
        resolve("fp32", device)


# ================================================================ case 27 through the engine


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


def test_the_matmul_probe_draws_nothing_from_the_callers_rng():
    # a run that measures the probe (first in a process, empty cache) and one that reads it from the cache
    # must see the same random stream: MixedPrecision(policy="auto") probes at build, between model init
    # and the first batch
    from mixprec.machine import capability as devices
    torch.manual_seed(3)
    before = torch.get_rng_state()
    devices._best_matmul_s((torch.float32, torch.float16), 16, torch.device("cpu"), reps=1)
    assert torch.equal(before, torch.get_rng_state())


def test_fp16_counts_as_native_on_x86_only_with_fp16_matmul_instructions():
    """A loaded 2-core EPYC timed its 2-thread fp32 256^3 product ~50x slow and called fp16 (no native kernel,
    ~100x slower than fp32) 1.5x faster: the cached verdict then ran fp16-mixed rows. The flags decide on x86."""
    import platform

    from mixprec.machine.capability import reprobe
    from mixprec.machine.matmul import cpu_flags

    c = reprobe("cpu")
    if platform.machine().lower() in ("x86_64", "amd64") and cpu_flags():
        has = bool({"avx512_fp16", "amx_fp16"} & set(cpu_flags()))
        assert c.fp16_native == (has and c.fp16_speed_ratio >= 0.5)
        assert ("not native" in c.detail) == (not has)


def test_a_probe_whose_fp32_times_disagree_is_noisy_and_not_cached(tmp_path, monkeypatch):
    """fp32 per flop over 4x slower at 256^3 than at 512^3 is load: this process keeps the verdict, the cache file
    is not written (the next process measures again); an undisturbed probe is cached."""
    from mixprec.machine import capability as devices

    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    times = {512: [8e-3, 2e-3], 256: [20e-3, 10e-3]}   # fp32 256^3 at 20 ms: 20x its 512^3 rate
    monkeypatch.setattr(devices, "_best_matmul_s", lambda dtypes, n, device: times[n])
    devices._probe_cached.cache_clear()
    try:
        c = devices.probe("cpu")
        assert "noisy" in c.detail and not list(tmp_path.rglob("cpu-probe-*.json"))
        times[256] = [1e-3, 2e-3]
        devices._probe_cached.cache_clear()
        c = devices.probe("cpu")
        assert "noisy" not in c.detail and len(list(tmp_path.rglob("cpu-probe-*.json"))) == 1
        assert c.bf16_speed_ratio == 4.0 and c.bf16_fast
    finally:
        devices._probe_cached.cache_clear()


def test_a_cached_probe_that_calls_fp16_native_on_a_cpu_without_fp16_instructions_is_corrected(tmp_path, monkeypatch):
    """A cache file written before the flags decided (a busy machine's timing) said fp16_native=True on an x86 CPU
    without avx512_fp16/amx_fp16; it was read as it was."""
    import dataclasses
    import json

    from mixprec.machine import capability as devices

    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(devices, "_fp16_hardware", lambda: (False, "; no avx512_fp16/amx_fp16"))
    stale = Capability(device="cpu", bf16=True, fp16=True, bf16_fast=True, fp16_native=True, bf16_speed_ratio=4.0,
                       fp16_speed_ratio=1.5, detail="measured")
    path = devices._cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(stale)))
    devices._probe_cached.cache_clear()
    try:
        c = devices.probe("cpu")
        assert not c.fp16_native and c.bf16_fast and "no avx512_fp16" in c.detail
    finally:
        devices._probe_cached.cache_clear()
