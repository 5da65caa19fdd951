"""The measured op plan (mixprec.autocast.op_plan): the choice, every candidate's numerics, the cache and its key."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

import mixprec
import mixprec.autocast.portable
from mixprec.autocast import kernel_timing, op_plan, plan_measurement, plan_verdict
from mixprec.machine.cache import machine_key
from mixprec.policy.policy import Policy

BF16_U = 2.0 ** -8   # bf16 unit roundoff (8 significand bits incl. the implicit one): |round(x) - x| <= 2^-8 |x|


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache directory and starts from an empty in-process plan; a busy test
    machine's noisy timings are cached all the same (test_noisy_timings_... and tests/autocast/test_plan_verdict.py
    check the rules themselves)."""
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", math.inf)
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 0.0)   # and rounds that disagree
    op_plan.forget()
    yield
    op_plan.forget()


# ---------------------------------------------------------------------- the choice
def test_time_candidates_picks_the_faster_by_construction():
    slow, fast = (lambda: time.sleep(0.03)), (lambda: time.sleep(0.002))
    timing = op_plan.time_candidates({"slow": slow, "fast": fast}, default="slow")
    assert timing.chosen == "fast"
    assert timing.times_ms["fast"] < timing.times_ms["slow"] and timing.times_ms["slow"] >= 30.0
    assert op_plan.time_candidates({"fast": fast, "slow": slow}, default="fast").chosen == "fast"


def test_time_candidates_keeps_the_default_within_the_margin_and_skips_what_is_not_offered():
    same = lambda: time.sleep(0.01)       # noqa: E731 - two candidates of equal speed
    timing = op_plan.time_candidates({"a": same, "b": same, "c": None}, default="b")
    assert timing.chosen == "b" and timing.times_ms["c"] is None
    with pytest.raises(ValueError, match="default"):
        op_plan.time_candidates({"a": same, "b": None}, default="b")


# ---------------------------------------------------------------------- numerics of every candidate
def _inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).bfloat16() for _ in range(3)]


def _reference(q, k, v, causal):
    """Attention in fp64 on the very bf16 values the candidates get."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    scores = q64 @ k64.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, torch.softmax(scores, -1) @ v64


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("candidate", ["fused", "fused-fp32", "matmul", "blockwise"])
def test_every_candidate_agrees_with_the_fp64_reference_to_bf16_arithmetic(candidate, causal):
    """Error bound from the format: the output is a convex combination of v's rows (|out| <= max|v|). Each bf16
    rounding is a relative error <= u = 2^-8: the output's own rounding (u |out|), the probabilities' (u each,
    summed: u max|v|), and in ``matmul`` the scores' (|s| u per score: softmax turns an error e in every score
    into a relative error <= 2e in each probability, so 2 u max|s| max|v|). fp32 accumulation adds ~1e-6."""
    q, k, v = _inputs((2, 3, 40, 16))
    scores, ref = _reference(q, k, v, causal)
    out = op_plan.CANDIDATES[candidate](q, k, v, None, 0.0, causal, None, False, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    u = BF16_U
    s_max = scores.masked_fill(scores == float("-inf"), 0).abs().amax(-1, keepdim=True)
    v_max = v.double().abs().amax()
    bound = u * ref.abs() + u * v_max + (2 * u * s_max * v_max if candidate == "matmul" else 0) + 1e-5
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"{candidate}: max error {err.max():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"
    if candidate == "fused-fp32":   # fp32 attention rounded once: within one bf16 rounding of the exact value
        assert (err <= u * ref.abs() * 1.01 + 1e-5).all()


@pytest.mark.parametrize("candidate", ["fused", "fused-fp32", "matmul", "blockwise"])
def test_every_candidate_backpropagates_like_fp64(candidate):
    """Gradients of q, k, v against fp64: SQNR >= 35 dB (one bf16 rounding is ~52 dB on Gaussian data; the
    backward chains four or five of them; the fused bf16 kernel measures ~44 dB here)."""
    q, k, v = (t.requires_grad_() for t in _inputs((2, 2, 32, 16), seed=1))
    grad = torch.randn(2, 2, 32, 16, generator=torch.Generator().manual_seed(2))
    out = op_plan.CANDIDATES[candidate](q, k, v, None, 0.0, True, None, False, torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), grad.bfloat16())
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q64, k64, v64, is_causal=True), (q64, k64, v64),
                              grad.double())
    for name, g, r in zip("qkv", got, ref):
        assert g.dtype == torch.bfloat16
        sqnr = 10 * torch.log10(r.pow(2).sum() / (g.double() - r).pow(2).sum())
        assert sqnr >= 35, f"{candidate} d{name}: {sqnr:.1f} dB"


def test_noisy_timings_are_flagged(monkeypatch):
    """A candidate whose rounds differ by more than NOISY_SPREAD (a busy machine): flagged, so not cached."""
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", 1.5)
    calls = iter([1, 1, 1, 60, 1, 1, 1, 1, 1, 1, 1, 1])        # sleep ms: one round of "b" hit by a busy machine
    timing = op_plan.time_candidates({"a": lambda: time.sleep(0.004), "b": lambda: time.sleep(next(calls) / 1e3)},
                                     default="a")
    assert timing.spread > kernel_timing.NOISY_SPREAD and timing.noisy


def test_torch_has_the_autocast_kernels_the_plan_replaces():
    """Outside the plan the replacement casts to the autocast dtype, as torch's own kernel for these keys does: a
    torch release without them (the op falling through autocast) would make that a change, so it fails here."""
    for key in ("AutocastCPU", "AutocastCUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::scaled_dot_product_attention", key)
    q, k, v = (t.float() for t in _inputs((1, 2, 8, 4)))
    before = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())   # torch's kernel: cast, run
    with op_plan.planned_kernels("cpu"):
        pass                                          # installs the replacement
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = F.scaled_dot_product_attention(q, k, v)
    assert before.dtype == after.dtype == torch.bfloat16 and torch.equal(before, after)


def test_a_tie_goes_to_the_more_exact_candidate():
    """Within MARGIN of the fastest, noise must not trade exactness for nothing: the first of ``prefer`` wins."""
    same = lambda: time.sleep(0.004)      # noqa: E731
    slow = lambda: time.sleep(0.03)       # noqa: E731
    timing = op_plan.time_candidates({"fused": slow, "fused-fp32": same, "matmul": same}, default="fused",
                                     prefer=("fused-fp32", "fused", "matmul"))
    assert timing.chosen == "fused-fp32"
    timing = op_plan.time_candidates({"fused": slow, "matmul": same, "fused-fp32": same}, default="fused")
    assert timing.chosen == "matmul"      # without a preference: the runs' order


def test_an_engine_lists_only_the_plan_it_uses():
    """entries(policy=...): an fp32 run (e.g. auto after its bf16 trial) or kernels=native uses no plan entry."""
    q = torch.randn(2, 2, 16, 8, dtype=torch.bfloat16)
    op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)
    assert len(op_plan.entries("cpu")) == 1
    assert op_plan.entries("cpu", policy=Policy.parse("fp32")) == []
    assert op_plan.entries("cpu", policy=Policy.parse("bf16-mixed,kernels=native")) == []
    assert op_plan.entries("cpu", policy=Policy.parse("fp16-mixed")) == []          # another compute dtype
    assert len(op_plan.entries("cpu", policy=Policy.parse("bf16-pure"))) == 1
    assert op_plan.choices("cpu", policy=Policy.parse("fp32")) == {}


def test_a_mask_keeps_the_matmul_form_out():
    """A fully masked row is NaN in the matmul form and 0 in a fused kernel: with attn_mask it is not offered."""
    q, k, v = _inputs((1, 1, 8, 4))
    entry = op_plan.choose(q, k, v, torch.ones(8, 8, dtype=torch.bool), dtype=torch.bfloat16, grad=False)
    assert entry.times_ms["matmul"] is None and "attn_mask" in entry.note
    assert entry.times_ms["fused"] is not None and entry.times_ms["fused-fp32"] is not None
    q16 = q.half()                               # fp16 scores could overflow: not offered under fp16 either
    entry = op_plan.choose(q16, q16, q16, is_causal=True, dtype=torch.float16, grad=False)
    assert entry.times_ms["matmul"] is None and "fp16" in entry.note


# ---------------------------------------------------------------------- the plan under autocast, the cache
def _sdpa_step(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_autocast_runs_what_the_plan_chose_and_leaves_the_callers_rng_alone(tmp_path):
    q, k, v = (t.float().requires_grad_() for t in _inputs((2, 2, 16, 8)))
    key = op_plan.plan_key(q, k, v, is_causal=True, dtype=torch.bfloat16, grad=True)
    # saved bytes of the two (N = 512 elements each of q, k, v, out; logsumexp 2·2·16 fp32): fused-fp32 saves more,
    # so it runs only where the memory rule allows it (tests/autocast/test_op_plan_memory.py checks the rule itself)
    saved = {"fused": 4 * 512 * 2 + 2 * 2 * 16 * 4, "fused-fp32": 4 * 512 * 4 + 2 * 2 * 16 * 4}
    (tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json").write_text(
        json.dumps({key: {"chosen": "fused-fp32", "times_ms": {"fused": 2.0, "fused-fp32": 1.0}, "saved_bytes": saved}}))
    with op_plan.allow_extra_saved(None):
        out = _sdpa_step(q, k, v)
    expected = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True).bfloat16()
    assert torch.equal(out, expected)             # fp32 attention rounded once: the cached choice ran
    (entry,) = op_plan.entries("cpu")
    assert (entry.chosen, entry.source) == ("fused-fp32", "cache")

    op_plan.forget()
    torch.manual_seed(7)
    _sdpa_step(*(t.float().requires_grad_() for t in _inputs((3, 2, 16, 8))))   # a new key: measured now
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))      # measuring drew nothing from the caller's generator
    assert [e.source for e in op_plan.entries("cpu")] == ["measured"]


def test_the_cache_is_keyed_by_machine_torch_threads_and_shape(tmp_path):
    q, k, v = (t.float() for t in _inputs((2, 2, 16, 8)))
    with torch.no_grad():
        _sdpa_step(q, k, v)
    (entry,) = op_plan.entries("cpu")
    assert entry.source == "measured" and "q[2, 2, 16, 8]" in entry.shape and entry.shape.endswith(" fwd")
    files = list(tmp_path.glob("op-plan-*.json"))
    assert [f.name for f in files] == [f"op-plan-{machine_key(torch.device('cpu'))}.json"]
    assert f"torch{torch.__version__}" in files[0].name and f"threads{torch.get_num_threads()}" in files[0].name
    assert entry.shape in json.loads(files[0].read_text())

    op_plan.forget()                                # a new process on the same machine: read, not measured
    with torch.no_grad():
        _sdpa_step(q, k, v)
    assert [(e.source, e.chosen) for e in op_plan.entries("cpu")] == [("cache", entry.chosen)]

    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert machine_key(torch.device("cpu")) != files[0].name[len("op-plan-"):-len(".json")]
        with torch.no_grad():
            _sdpa_step(q, k, v)                     # another thread count: its own file, measured again
        assert op_plan.entries("cpu")[-1].source == "measured"
        assert len(list(tmp_path.glob("op-plan-*.json"))) == 2
    finally:
        torch.set_num_threads(threads)


def test_a_compiled_call_is_measured_on_real_tensors_while_tracing():
    """torch.compile traces with fake tensors; the plan measures on real stand-ins of their shapes, and the
    compiled graph runs the chosen kernel (its output equals the eager call's under the same plan)."""
    q, k, v = (t.float() for t in _inputs((2, 2, 16, 8)))
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend="eager")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        out = compiled(q, k, v)
        eager = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (entry,) = op_plan.entries("cpu")
    assert entry.source == "measured" and all(t is not None and t > 0 for t in entry.times_ms.values())
    assert torch.equal(out, eager)


# ---------------------------------------------------------------------- the policy key and the engine
def test_kernels_key_round_trips_and_is_checked():
    policy = Policy.parse("bf16-mixed,kernels=native")
    assert policy.kernels == "native" and Policy.parse(str(policy)) == policy
    assert Policy.parse("bf16-mixed").kernels == "measured" and str(Policy.parse("bf16-mixed")) == "bf16-mixed"
    with pytest.raises(ValueError, match="kernels"):
        Policy.parse("bf16-mixed,kernels=fastest")


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


@pytest.mark.parametrize("kernels", ["measured", "native"])
def test_engine_under_each_kernels_mode_equals_a_hand_loop_making_the_same_choices(kernels):
    torch.manual_seed(0)
    model, twin = _Attention(), _Attention()
    twin.load_state_dict(model.state_dict())
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy=f"bf16-mixed,kernels={kernels}",
                                device="cpu")
    assert f"kernels={kernels}" in mp.decision
    x = torch.randn(2, 12, 16)
    with mp.autocast():
        out = mp.model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), mixprec.autocast.portable.portable_ops("cpu"), \
            op_plan.planned_kernels("cpu", enabled=kernels == "measured"):
        out_twin = twin(x)
    assert torch.equal(out, out_twin.float())
    planned = op_plan.entries("cpu")
    if kernels == "native":
        assert planned == []
    else:
        (entry,) = planned
        assert entry.source == "measured" and entry.chosen in op_plan.CANDIDATES
        assert set(entry.times_ms) == set(op_plan.CANDIDATES)


def test_a_checkpoint_pins_the_kernels_its_run_chose(tmp_path):
    """A resumed run makes the saved run's kernel choices, whatever its own cache says (bitwise resume)."""
    from mixprec.checkpoint.local import load_checkpoint, save_checkpoint

    def engine():
        torch.manual_seed(0)
        model = _Attention()
        return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-mixed", device="cpu")
    mp = engine()
    x = torch.randn(2, 12, 16)
    with mp.autocast():
        loss = mp.model(x).square().mean()
    mp.backward(loss)
    mp.step()
    (entry,) = op_plan.entries("cpu")
    save_checkpoint(tmp_path / "ckpt", mp)

    other = next(c for c in op_plan.CANDIDATES if c != entry.chosen)    # a later process whose cache disagrees
    op_plan.forget()
    cache = tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json"
    cache.write_text(json.dumps({entry.shape: {"chosen": other, "times_ms": {}}}))
    resumed = engine()
    load_checkpoint(tmp_path / "ckpt", resumed)
    with resumed.autocast():
        resumed.model(x)
    (pinned,) = op_plan.entries("cpu")
    assert (pinned.shape, pinned.chosen, pinned.source) == (entry.shape, entry.chosen, "checkpoint")
    assert op_plan.summary("cpu") == [f"{entry.shape} -> {entry.chosen} (checkpoint)"]   # no empty "(checkpoint; )"


@pytest.mark.parametrize("chosen", ["matmul", "fused-fp32"])
def test_a_checkpointed_recompute_makes_the_forwards_kernel_choice_outside_the_autocast_block(chosen):
    # the forward ran under planned_kernels, the backward (and so the recompute) runs outside mp.autocast():
    # the recompute must run the forward's choice, not torch's (else CheckpointError or wrong gradients)
    q, k, v = (t.float().requires_grad_() for t in _inputs((1, 2, 8, 16)))
    key = op_plan.plan_key(q, k, v, is_causal=True, dtype=torch.bfloat16, grad=True)
    op_plan.pin({key: chosen}, "cpu")

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = []
    for wrap in (attend, lambda *a: mixprec.ops.checkpoint(attend, *a)):
        with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
            out = wrap(q, k, v)
        grads.append(torch.autograd.grad(out.float().pow(2).sum(), (q, k, v)))
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
    # and a forward outside planned_kernels recomputes in torch's kernel even inside planned_kernels
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mixprec.ops.checkpoint(attend, q, k, v)
    with op_plan.planned_kernels("cpu"):
        torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))


def test_a_measurement_inside_a_checkpointed_forward_keeps_out_of_its_saved_tensors():
    # the first call of a key measures; inside a non-reentrant checkpoint the stand-ins' saved tensors went
    # through its pack hook, so its backward raised CheckpointError (71 saved in the forward, 5 in recompute)
    q, k, v = (t.float().requires_grad_() for t in _inputs((1, 2, 8, 16)))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q * 1, k * 1, v * 1, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        out = mixprec.ops.checkpoint(attend, q, k, v)
    assert [e.source for e in op_plan.entries("cpu")] == ["measured"]
    checkpointed = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        out = attend(q, k, v)
    for plain, again in zip(torch.autograd.grad(out.float().pow(2).sum(), (q, k, v)), checkpointed):
        assert torch.equal(plain, again)


@pytest.mark.parametrize("bad", [{"chosen": "matmul", "times_ms": [1, 2]}, {"chosen": "matmul", "times_ms": "x"},
                                 {"chosen": ["matmul"]}, {"chosen": "matmul", "times_ms": {"fused": "1 ms"}}])
def test_a_malformed_cache_entry_is_measured_again_not_raised(tmp_path, bad):
    # an edited or foreign cache file is "treated as empty" (mixprec.machine.cache); a malformed entry raised
    # TypeError/ValueError from the user's forward (or later from summary())
    q, k, v = (t.float() for t in _inputs((1, 2, 8, 16)))
    key = op_plan.plan_key(q, k, v, is_causal=True, dtype=torch.bfloat16, grad=False)
    (tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json").write_text(json.dumps({key: bad}))
    with torch.no_grad():
        _sdpa_step(q, k, v)
    assert [e.source for e in op_plan.entries("cpu")] == ["measured"] and len(op_plan.summary("cpu")) == 1


@pytest.mark.filterwarnings("ignore:There is a performance drop")   # torch's: no batching rule for the flash kernel
def test_a_measurement_inside_torch_func_grad_runs_outside_the_transform():
    # the stand-ins' requires_grad_, random draws and saved-tensor hooks are refused inside torch.func
    # transforms: the first call of a key under torch.func.grad (or vmap of it) raised
    q, k, v = (t.float() for t in _inputs((1, 2, 8, 16)))

    def loss(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().pow(2).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        got = torch.func.grad(loss)(q)
        batched = torch.func.vmap(torch.func.grad(loss))(q.unsqueeze(0).expand(2, *q.shape))
    (entry,) = op_plan.entries("cpu")
    assert entry.source == "measured"
    leaf = q.clone().requires_grad_()
    ran = "fused" if entry.chosen == "blockwise" else entry.chosen   # blockwise runs fused under torch.func
    out = op_plan.CANDIDATES[ran](leaf, k, v, None, 0.0, True, None, False, torch.bfloat16)
    (expected,) = torch.autograd.grad(out.float().pow(2).sum(), leaf)
    assert torch.equal(got, expected) and torch.equal(batched[1], expected)


class _CheckpointedAttention(torch.nn.Module):
    def __init__(self, checkpoint=None):
        super().__init__()
        self.qkv, self.checkpoint = torch.nn.Linear(16, 48), checkpoint

    def attend(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        if self.checkpoint is None:
            return self.attend(x).float().pow(2).mean()
        return torch.utils.checkpoint.checkpoint(self.attend, x, use_reentrant=self.checkpoint).float().pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_under_mp_backward_recomputes_in_the_forwards_kernel(reentrant):
    # mp.backward() ran outside planned_kernels, so torch.utils.checkpoint's recompute ran torch's kernel; a
    # reentrant checkpoint's forward (no_grad: "fwd" key) and recompute ("fwd+bwd") also had different keys
    x = torch.randn(2, 8, 16, requires_grad=True)   # a reentrant checkpoint needs an input that requires grad
    q = k = v = torch.empty(2, 2, 8, 8)
    for grad in (True, False):   # the forward's key pinned to matmul: what the plain model runs
        op_plan.pin({op_plan.plan_key(q, k, v, is_causal=True, dtype=torch.bfloat16, grad=grad): "matmul"}, "cpu")
    grads = []
    for checkpoint in (None, reentrant):
        torch.manual_seed(0)
        model = _CheckpointedAttention(checkpoint)
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed")
        if checkpoint:   # reentrant: only the forward's "fwd" key is planned
            op_plan.forget()
            op_plan.pin({op_plan.plan_key(q, k, v, is_causal=True, dtype=torch.bfloat16, grad=False): "matmul"},
                        "cpu")
        with mp.autocast():
            loss = mp.model(x)
        mp.backward(loss)
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)


def test_measured_afresh_measures_again_whatever_the_process_and_the_cache_hold(tmp_path):
    """The bench measures its one plan afresh (issue 25): neither this process's plan (a pin) nor the cache file
    (an earlier run's choice) is read inside the block; the new measurement is written to the cache."""
    q = torch.randn(1, 2, 16, 8)
    key = op_plan.plan_key(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)
    op_plan.pin({key: "fused-fp32"}, "cpu", source="bench")
    assert op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False).source == "bench"
    cache = tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json"
    cache.write_text(json.dumps({key: {"chosen": "matmul", "times_ms": {"fused": 9.0, "fused-fp32": 9.0,
                                                                        "matmul": 1.0}}}))
    with op_plan.measured_afresh():
        entry = op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)
    assert entry.source == "measured" and all(entry.times_ms[c] > 0 for c in op_plan.CANDIDATES)
    assert json.loads(cache.read_text())[key]["times_ms"] == entry.times_ms     # this measurement, cached
    assert op_plan.entries("cpu") == [entry]                                    # and this process's plan after it
    op_plan.forget()
    assert op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False).source == "cache"


def test_a_bench_on_a_busier_machine_keeps_the_cached_choice(tmp_path, monkeypatch):
    """``mixprec bench`` measures its plan afresh; on a busy machine that measurement cached ``fused`` over the
    ``blockwise`` an earlier quiet run had cached, and every later run ran ``fused``. The entry planted here was
    measured on a machine a million times faster than any (fused 1e-4 ms), so whatever this machine's load, the
    new measurement is from a busier one: the cache file stays as it was and this process runs its choice."""
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", 1.5)      # the rules as shipped
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 1.0)
    q = torch.randn(1, 2, 16, 8)
    key = op_plan.plan_key(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)
    cache = tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json"
    planted = {key: {"chosen": "fused-fp32", "times_ms": {"fused": 2e-4, "fused-fp32": 1e-4, "matmul": 4e-4,
                                                          "blockwise": 3e-4}, "note": "",
                     "saved_bytes": {c: 0 for c in op_plan.CANDIDATES}}}
    cache.write_text(json.dumps(planted))
    with op_plan.measured_afresh():
        entry = op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)
    assert json.loads(cache.read_text()) == planted                       # not overwritten
    assert (entry.source, entry.chosen, entry.times_ms) == ("cache", "fused-fp32", planted[key]["times_ms"])
    assert "measured again, not cached (" in entry.note and "the cached fused-fp32 kept" in entry.note
    assert "the machine is busier than when fused-fp32 was cached (fused " in entry.note


def test_a_plan_moves_to_another_dtype_and_says_what_it_cannot_use_there():
    """A bench's one plan, measured in bf16, pinned for an fp16 policy (issue 25): the same choices at the fp16
    keys, except ``matmul`` (bf16 only: fp16 scores could overflow), which runs ``fused`` there, said."""
    q = torch.randn(2, 4, 8, 16)
    key = {d: op_plan.plan_key(q, q, q, is_causal=True, dtype=d, grad=True) for d in (torch.bfloat16, torch.float16)}
    assert key[torch.bfloat16].replace(" bfloat16 ", " float16 ") == key[torch.float16]
    moved, refused = op_plan.retarget({key[torch.bfloat16]: "matmul"}, torch.float16)
    assert moved == {key[torch.float16]: "fused"}
    assert refused[key[torch.float16]].startswith("matmul not offered under fp16") and "runs fused" in \
        refused[key[torch.float16]]
    for chosen in ("fused", "fused-fp32"):
        assert op_plan.retarget({key[torch.bfloat16]: chosen}, torch.float16) == ({key[torch.float16]: chosen}, {})
    assert op_plan.retarget({key[torch.float16]: "fused-fp32"}, torch.bfloat16) == (
        {key[torch.bfloat16]: "fused-fp32"}, {})


# ---------------------------------------------------------------------- a fake clock: what noise can fake
def _fake_clock(monkeypatch, samples):
    """Every timed call of a measurement reads ``samples`` (candidate → ms of its successive calls, the last
    repeated) instead of the clock, and runs nothing. Returns ``timed``: time_candidates on this clock
    (the plan's measurements call it too), and ``calls``: candidate → calls timed in the last measurement."""
    calls: dict[str, int] = {}
    names: dict[int, str] = {}

    def fake_time_call(run, device):
        name = names[id(run)]
        calls[name] = calls.get(name, 0) + 1
        return samples[name][min(calls[name], len(samples[name])) - 1] / 1e3

    def timed(runs, **kwargs):
        calls.clear()
        names.update({id(r): n for n, r in runs.items() if r is not None})
        return kernel_timing.time_candidates(runs, **kwargs)
    monkeypatch.setattr(kernel_timing, "time_call", fake_time_call)
    monkeypatch.setattr(plan_measurement, "time_candidates", timed)
    return timed, calls


def test_one_slow_warm_up_does_not_drop_a_candidate_two_do_and_the_kept_one_never(monkeypatch):
    """A warm-up over 3x the fastest (one load spike) is warmed up again beside the fastest: within 3x there, the
    candidate is timed in every round and wins; over 3x twice it is dropped after two calls (the speed benefit);
    a candidate the caller keeps (the plan's cached choice) is timed in every round whatever its warm-ups."""
    timed, calls = _fake_clock(monkeypatch, {"fused": [10.0], "blockwise": [40.0, 5.0], "matmul": [50.0]})
    runs = {n: (lambda: None) for n in ("fused", "blockwise", "matmul")}
    timing = timed(runs, default="fused")
    assert timing.chosen == "blockwise" and timing.times_ms["blockwise"] == 5.0
    assert len(timing.rounds_ms["blockwise"]) == kernel_timing.REPEATS and "matmul" not in timing.rounds_ms
    assert calls == {"fused": 2 + kernel_timing.REPEATS, "blockwise": 2 + kernel_timing.REPEATS, "matmul": 2}
    timed, calls = _fake_clock(monkeypatch, {"fused": [10.0], "blockwise": [40.0, 40.0, 5.0]})
    runs = {n: (lambda: None) for n in ("fused", "blockwise")}
    assert timed(runs, default="fused").chosen == "fused" and calls["blockwise"] == 2   # two slow warm-ups: dropped
    kept = timed(runs, default="fused", keep=("blockwise",))
    assert kept.chosen == "blockwise" and len(kept.rounds_ms["blockwise"]) == kernel_timing.REPEATS


@pytest.mark.parametrize("afresh", [False, True])
def test_a_warm_up_spike_on_the_best_kernel_neither_caches_nor_replaces_the_default(tmp_path, monkeypatch, afresh):
    """blockwise truly 2x faster than fused; load spikes slow its warm-ups 8x. On a fresh cache one spike used to
    drop it and cache fused; under measured_afresh (the bench) it replaced the cached blockwise for every later
    process. Now a single spike is warmed up again, and the cached choice is timed in every round whatever."""
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", 1.5)      # the rules as shipped
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 1.0)
    true = {"fused": [10.0], "fused-fp32": [12.0], "matmul": [30.0], "blockwise": [5.0]}
    q = torch.randn(2, 2, 32, 16, requires_grad=True)

    def choose():
        return op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)
    if afresh:
        _fake_clock(monkeypatch, true)
        assert (choose().chosen, choose().source) == ("blockwise", "measured")     # a quiet run cached it
        _fake_clock(monkeypatch, {**true, "blockwise": [40.0, 40.0, 5.0]})   # two spikes: timed all the same
        with op_plan.measured_afresh():
            entry = choose()
        # its first round (40 ms) chose fused: the rounds disagree, so the cached blockwise is kept as it was
        assert (entry.chosen, entry.source) == ("blockwise", "cache") and "the cached blockwise kept" in entry.note
    else:
        _fake_clock(monkeypatch, {**true, "blockwise": [40.0, 5.0]})
        entry = choose()
        assert (entry.chosen, entry.source) == ("blockwise", "measured")
    assert "replaces" not in entry.note
    assert [e["chosen"] for e in op_plan.cached("cpu")[1].values()] == ["blockwise"]


def test_a_cached_entry_re_chosen_under_another_allowance_runs_only_what_its_rounds_agree_on(monkeypatch):
    """Measured under +0 MiB: fused cached (matmul saves more). Under no limit matmul is fastest by its best round,
    its rounds split 3 matmul / 2 fused: a later process reading the cache, and this one re-choosing, run fused
    (the measured choice), the memory words saying why; rounds that agree on matmul run it."""
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", 1.5)
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 1.0)
    split = {"fused": [10.0], "fused-fp32": [12.0], "blockwise": [20.0], "matmul": [7.0, 7.0, 13.0, 7.0, 13.0, 7.0]}
    _fake_clock(monkeypatch, split)
    q = torch.randn(2, 2, 32, 16, requires_grad=True)

    def choose():
        return op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)
    first = choose()
    assert (first.chosen, first.source) == ("fused", "measured") and first.memory.startswith("matmul skipped")
    assert list(op_plan.cached("cpu")[1].values())[0]["rounds_ms"]["matmul"] == [7.0, 13.0, 7.0, 13.0, 7.0]
    for later_process in (False, True):
        if later_process:
            op_plan.forget()
        with op_plan.allow_extra_saved(None):
            entry = choose()
        assert entry.chosen == "fused" and entry.source == ("cache" if later_process else "measured")
        assert "not matmul under this allowance (the interleaved rounds do not separate the candidates: 3 of 5 " \
               "chose matmul (fused 2)): fused, the measured choice" in entry.memory
    op_plan.forget()
    path = op_plan.cached("cpu")[0]
    on_disk = json.loads(open(path).read())
    next(iter(on_disk.values()))["rounds_ms"]["matmul"] = [7.0] * 5                # rounds that agree
    open(path, "w").write(json.dumps(on_disk))
    with op_plan.allow_extra_saved(None):
        assert (choose().chosen, choose().source) == ("matmul", "cache")
