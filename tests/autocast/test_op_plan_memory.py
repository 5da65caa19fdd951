"""The op plan's memory rule (issue 27): each attention candidate's bytes saved for backward are measured with its
time, and a candidate saving more than ``fused`` is chosen only when the user allows it, its choice saying what it
costs in MiB. Saved bytes are asserted against what each candidate's autograd graph keeps, element by element."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.autocast import kernel_timing, op_plan, plan_verdict
from mixprec.autocast.saved_allowance import ENV, mib_words
from mixprec.machine.cache import machine_key
from mixprec.policy.policy import Policy
from mixprec.workloads.gpt import GPT_CONFIGS

MIB = 2**20


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", math.inf)    # a busy machine's timings are cached all the same
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 0.0)   # and rounds that disagree
    op_plan.forget()
    yield
    op_plan.forget()


def _gpt_shape(config: str, batch: int = 2) -> tuple[int, int, int, int]:
    """(B, H, T, D) of a GPT config's attention at a small batch."""
    c = GPT_CONFIGS[config]
    return batch, c.n_head, c.block_size, c.n_embd // c.n_head


def _expected_saved(b: int, h: int, t: int, d: int) -> dict[str, int]:
    """Bytes each candidate's graph keeps on CPU for bf16 q, k, v of shape (b, h, t, d), causal, default scale
    (a power of two for d = 32, 64: q·scale is exact, scores stay bf16 until the fp32 softmax). The fused kernels
    keep q, k, v, the output (2 bytes bf16, 4 bytes fp32 copies) and an fp32 logsumexp per row, and so does
    blockwise (the fused forward; its backward recomputes the rest); matmul keeps q·scale, k, v, its bool causal
    mask, the fp32 and the bf16 probabilities."""
    n, rows, probs = b * h * t * d, b * h * t, b * h * t * t
    return {"fused": 4 * n * 2 + rows * 4,
            "fused-fp32": 4 * n * 4 + rows * 4,
            "matmul": 3 * n * 2 + t * t * 1 + probs * (4 + 2),
            "blockwise": 4 * n * 2 + rows * 4}


def _default_choice(times: dict) -> str:
    """The rule's choice at +0 MiB from measured times: fused unless blockwise (the one candidate saving no more)
    is at least MARGIN faster."""
    return "blockwise" if times["blockwise"] <= times["fused"] * (1 - op_plan.MARGIN) else "fused"


def _entry(shape, **kw) -> op_plan.PlanEntry:
    q = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    return op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True, **kw)


@pytest.mark.parametrize("config", ["baby", "mid"])
def test_by_default_the_chosen_kernel_saves_no_more_than_fused(config):
    shape = _gpt_shape(config)
    entry = _entry(shape)
    expected = _expected_saved(*shape)
    assert entry.saved_bytes == expected                      # measured, each storage once
    assert entry.saved_bytes["matmul"] > entry.saved_bytes["fused"]          # the relation, measured not assumed
    assert entry.saved_bytes["fused-fp32"] > entry.saved_bytes["fused"]
    chosen = _default_choice(entry.times_ms)
    assert entry.saved_bytes[entry.chosen] <= entry.saved_bytes["fused"] and entry.chosen == chosen
    assert entry.extra_saved_allowed_mib == 0.0
    fastest = min((t, n) for n, t in entry.times_ms.items())[1]
    if entry.times_ms[fastest] < entry.times_ms[chosen] and fastest not in ("fused", "blockwise"):   # left out
        extra = mib_words(expected[fastest] - expected["fused"], signed=True)
        assert entry.memory.startswith(f"{fastest} skipped: ") and f"{extra} saved per call over fused" in entry.memory
    elif chosen == "fused":
        assert entry.memory == f"fused: {mib_words(expected['fused'])} saved per call"
    if chosen == "blockwise":
        assert entry.memory.split("; ")[-1].startswith("blockwise: ") and "+0 MiB saved per call" in entry.memory
    # the cache keeps the saved bytes: a second process chooses the same from the file
    op_plan.forget()
    again = _entry(shape)
    assert (again.source, again.chosen, again.saved_bytes) == ("cache", chosen, expected)


@pytest.mark.parametrize("config", ["baby", "mid"])
def test_with_the_permission_the_speed_rule_alone_decides_and_the_choice_names_its_mib(config):
    shape = _gpt_shape(config)
    with op_plan.allow_extra_saved(None):
        entry = _entry(shape)
    times = entry.times_ms
    best = min(times.values())
    fastest_within = [n for n in ("fused-fp32", "fused", "blockwise", "matmul")
                      if times[n] <= best / (1 - op_plan.MARGIN)]
    speed = "fused" if times["fused"] <= best / (1 - op_plan.MARGIN) else fastest_within[0]
    assert entry.chosen == speed and entry.extra_saved_allowed_mib is None
    if speed != "fused":
        extra = entry.saved_bytes[speed] - entry.saved_bytes["fused"]
        assert entry.memory == (f"{speed}: {times['fused'] / times[speed]:.2f}x faster than fused, "
                                f"{mib_words(extra, signed=True)} saved per call (allowed no limit)")
    # outside the block the same measurement is chosen again under the default: never more than fused
    assert _entry(shape).chosen == _default_choice(times)


def _cached_plan(tmp_path, shape, times, saved=None, chosen="matmul", grad=True) -> str:
    q = torch.empty(shape)
    key = op_plan.plan_key(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=grad)
    value = {"chosen": chosen, "times_ms": times, "note": ""}
    if saved is not None:
        value["saved_bytes"] = saved
    (tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json").write_text(json.dumps({key: value}))
    return key


def test_an_allowance_admits_exactly_what_it_covers_and_the_kernel_runs(tmp_path):
    """Times from a cache file (matmul 2x faster than fused), saved bytes from the arithmetic above: the allowance
    decides, at the byte, and the chosen kernel is the one autocast runs."""
    shape = _gpt_shape("baby")
    saved = _expected_saved(*shape)
    extra = saved["matmul"] - saved["fused"]
    _cached_plan(tmp_path, shape, {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}, saved)
    skipped = _entry(shape)
    assert (skipped.source, skipped.chosen) == ("cache", "fused")
    assert skipped.memory.startswith(f"matmul skipped: 2.00x faster than fused, {mib_words(extra, signed=True)} "
                                     "saved per call over fused (allowed +0 MiB: ")
    assert "fused-fp32 skipped" not in skipped.memory                # slower than fused: not a skipped gain
    with op_plan.allow_extra_saved(extra / MIB - 1e-6):              # one byte short: still fused
        assert _entry(shape).chosen == "fused"
    with op_plan.allow_extra_saved(extra / MIB):
        chosen = _entry(shape)
        q, k, v = (torch.randn(shape).requires_grad_() for _ in range(3))
        with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert chosen.chosen == "matmul" and chosen.extra_saved_allowed_mib == extra / MIB
    assert chosen.memory == (f"matmul: 2.00x faster than fused, {mib_words(extra, signed=True)} saved per call "
                             f"(allowed +{extra / MIB:g} MiB: mixprec.autocast.op_plan.allow_extra_saved(mib) or ${ENV})")
    reference = op_plan.CANDIDATES["matmul"](q, k, v, None, 0.0, True, None, False, torch.bfloat16)
    assert torch.equal(out, reference)                               # the allowed kernel is the one that ran
    line, = op_plan.summary("cpu")
    assert line.endswith(chosen.memory + ")") and f"matmul 1.00 ms {mib_words(saved['matmul'])}" in line


def test_every_faster_candidate_left_out_is_named_fastest_first(tmp_path):
    """fused-fp32 and matmul both faster than fused and both saving more: the words name both, not only the
    fastest (a new-user trial found fused-fp32's skip unmentioned)."""
    shape = _gpt_shape("baby")
    saved = _expected_saved(*shape)
    _cached_plan(tmp_path, shape, {"fused": 4.0, "fused-fp32": 2.0, "matmul": 1.0}, saved)
    entry = _entry(shape)
    assert entry.chosen == "fused"
    first, second = entry.memory.split("; ")
    assert first.startswith("matmul skipped: 4.00x faster than fused")
    assert second.startswith("fused-fp32 skipped: 2.00x faster than fused, "
                             f"{mib_words(saved['fused-fp32'] - saved['fused'], signed=True)} saved per call")


def test_the_environment_variable_allows_and_bad_values_are_refused(tmp_path, monkeypatch):
    shape = _gpt_shape("baby")
    saved = _expected_saved(*shape)
    _cached_plan(tmp_path, shape, {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}, saved)
    monkeypatch.setenv(ENV, "inf")
    assert op_plan.extra_saved_allowed() is None and _entry(shape).chosen == "matmul"
    monkeypatch.setenv(ENV, "0.1")
    assert saved["matmul"] - saved["fused"] == 3 * 16384 * 2 + 64 * 64 + 32768 * 6 - 8 * 16384 - 512 * 4   # 0.158 MiB
    assert op_plan.extra_saved_allowed() == 0.1 and _entry(shape).chosen == "fused"
    with op_plan.allow_extra_saved(1):                              # the block wins over the variable
        assert _entry(shape).chosen == "matmul"
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=f"{ENV}='lots' is not allowed: a number of MiB >= 0"):
        op_plan.extra_saved_allowed()
    with pytest.raises(ValueError, match=r"allow_extra_saved\(mib=-1\) is not allowed"):
        with op_plan.allow_extra_saved(-1):
            pass
    with pytest.raises(TypeError, match=r"allow_extra_saved\(mib='144'\): mib must be a number of MiB"):
        with op_plan.allow_extra_saved("144"):
            pass


def test_an_older_cache_entry_loads_measured_again_where_the_rule_needs_its_bytes(tmp_path):
    """Cache files written before issue 27 have no ``saved_bytes``: a ``fwd`` entry is used as it is (nothing is
    saved without a backward); a ``fwd+bwd`` one is measured again (its matmul choice would erase the saving), and
    the entry says so; the file then holds the new measurement."""
    shape = _gpt_shape("baby")
    key = _cached_plan(tmp_path, shape, {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}, chosen="matmul", grad=False)
    q = torch.randn(shape, dtype=torch.bfloat16)
    with torch.no_grad():
        old = op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)
    assert (old.shape, old.source, old.chosen, old.saved_bytes, old.memory) == (key, "cache", "matmul", {}, "")

    op_plan.forget()
    key = _cached_plan(tmp_path, shape, {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}, chosen="matmul")
    entry = _entry(shape)
    # re-measured under the default rule: whichever is fastest among the candidates saving no more than fused
    # (fused or blockwise, timing decides), never the cached matmul
    assert (entry.shape, entry.source) == (key, "measured") and entry.chosen != "matmul"
    assert entry.saved_bytes[entry.chosen] <= entry.saved_bytes["fused"]
    assert "measured again: its cache entry (an older mixprec's) had no saved bytes" in entry.note
    on_disk = json.loads(next(tmp_path.glob("op-plan-*.json")).read_text())[key]
    assert on_disk["saved_bytes"] == _expected_saved(*shape) and "older" not in on_disk["note"]


def test_a_malformed_saved_bytes_entry_is_measured_again(tmp_path):
    shape = _gpt_shape("baby")
    _cached_plan(tmp_path, shape, {"fused": 2.0, "matmul": 1.0}, {"fused": "1 MiB", "matmul": 2})
    assert _entry(shape).source == "measured"


def test_a_pin_keeps_its_choice_whatever_the_allowance():
    """A checkpoint's or the bench's pin is a choice made already (its run's kernels, for a bitwise resume)."""
    shape = _gpt_shape("baby")
    q = torch.empty(shape)
    key = op_plan.plan_key(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)
    op_plan.pin({key: "matmul"}, "cpu", source="bench")
    entry = _entry(shape)
    assert (entry.chosen, entry.source, entry.saved_bytes) == ("matmul", "bench", {})


def test_the_decision_names_the_allowance():
    policy = Policy.parse("bf16-mixed")
    assert "saving for backward at most fused's bytes +0 MiB per call" in op_plan.describe(policy, "cpu")
    with op_plan.allow_extra_saved(144):
        assert "at most fused's bytes +144 MiB per call" in op_plan.describe(policy, "cpu")
    with op_plan.allow_extra_saved(None):
        assert "fastest on this cpu per shape, whatever it saves for backward" in op_plan.describe(policy, "cpu")


def test_the_bench_plan_keeps_the_rule_and_each_candidates_bytes_and_says_them():
    """The bench's one plan (pinned for every worker) is chosen under the default rule; results.json keeps the
    allowance and each entry's saved bytes, and the console / report.md lines print them with the rule's words."""
    from mixprec.machine.capability import Capability
    from mixprec.programs.bench.pinned_plan import measure_bench_plan, pinned_for
    from mixprec.programs.bench.report import op_plan_lines
    from mixprec.programs.bench.runner import BenchConfig

    capability = Capability(device="cpu", bf16=True, fp16=False, bf16_fast=True, fp16_native=False,
                            bf16_speed_ratio=2.0, fp16_speed_ratio=0.0, detail="planted: bf16 only")
    config = BenchConfig(out=None, config="tiny", steps=5, policies=("bf16-mixed",))
    names = ["fp32", "bf16-mixed"]
    plan = measure_bench_plan(config, torch.device("cpu"), capability, names, dict.fromkeys(names), False)
    assert plan["extra_saved_allowed_mib"] == 0.0
    (train,) = [e for e in plan["entries"] if e["shape"].endswith(" fwd+bwd")]
    c = GPT_CONFIGS["tiny"]
    assert train["saved_bytes"] == _expected_saved(c.batch_size, c.n_head, c.block_size, c.n_embd // c.n_head)
    assert train["saved_bytes"][train["chosen"]] <= train["saved_bytes"]["fused"] < train["saved_bytes"]["matmul"]
    assert pinned_for(plan, "bf16-mixed")[train["shape"]] == train["chosen"] == _default_choice(train["times_ms"])
    lines = op_plan_lines({"op_plan": plan, "policies": {}})
    assert "; chosen among kernels saving for backward at most fused's bytes +0 MiB per call ($" in lines[0]
    (line,) = [x for x in lines if x.startswith(f"  {train['shape']} -> {train['chosen']} (")]
    fused = f"fused {train['times_ms']['fused']:.2f} ms {mib_words(train['saved_bytes']['fused'])}"
    assert fused in line and line.endswith(f"; {train['memory']})") and "saved per call" in train["memory"]


def _training_forward_saved(config: str, policy: str) -> int:
    """Bytes a GPT ``config`` training forward (batch 2) saves for backward under ``policy``, parameters left out."""
    from dataclasses import replace

    from mixprec.memory.saved import saved_bytes
    from mixprec.programs.session import build_engine
    from mixprec.workloads.gpt import GPTWorkload

    workload = GPTWorkload(replace(GPT_CONFIGS[config], batch_size=2))
    mp = build_engine(workload, policy, steps=2, seed=0, device="cpu")
    batch = mp.cast_inputs(next(workload.batches("train", 0)))
    with mp.autocast():
        loss, saved = saved_bytes(lambda: workload.loss(mp.model, batch), exclude=list(mp.model.parameters()))
    del loss
    return saved.total


@pytest.mark.parametrize("config", ["baby", "mid"])
def test_a_training_forward_saves_what_torch_autocast_saves_unless_allowed(config, tmp_path):
    """Model level: by default the planned attention makes a bf16-mixed GPT forward save exactly what
    ``kernels=native`` (torch.autocast's fused kernel) saves, whatever the timings say; with the permission and a
    faster matmul (times from the cache file) it saves more, by the probabilities and the causal mask per layer
    less fused's logsumexp (q, k, v are views of one qkv output in the model: kept by both)."""
    b, h, t, d = shape = _gpt_shape(config)
    native = _training_forward_saved(config, "bf16-mixed,kernels=native")
    assert _training_forward_saved(config, "bf16-mixed") == native
    if config != "baby":
        return
    op_plan.forget()
    _cached_plan(tmp_path, shape, {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}, _expected_saved(*shape))
    with op_plan.allow_extra_saved(None):
        allowed = _training_forward_saved(config, "bf16-mixed")
    (entry,) = [e for e in op_plan.entries("cpu") if e.shape.endswith(" fwd+bwd")]
    assert entry.chosen == "matmul" and entry.memory.startswith("matmul: 2.00x faster than fused, +")
    probs = b * h * t * t
    assert allowed - native == GPT_CONFIGS[config].n_layer * (probs * (4 + 2) + t * t - b * h * t * 4)


def test_a_recompute_runs_its_forwards_kernel_whatever_the_allowance_in_backward(tmp_path):
    """A checkpointed attention whose forward ran under a permission (matmul, times from the cache file) recomputes
    in a backward outside it: the recompute takes the key's last choice, matmul, so torch's checkpoint finds the
    same saved tensors and the gradients are matmul's bit for bit. Before, the backward's lookup chose again under
    +0 MiB (fused) and the recompute's saved tensors differed (CheckpointError)."""
    shape = _gpt_shape("baby")
    _cached_plan(tmp_path, shape, {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}, _expected_saved(*shape))
    q, k, v = (torch.randn(shape).requires_grad_() for _ in range(3))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), op_plan.planned_kernels("cpu"):
        with op_plan.allow_extra_saved(None):
            out = torch.utils.checkpoint.checkpoint(attention, q, k, v, use_reentrant=False)
        out.float().sum().backward()                                  # the recompute runs here, at +0 MiB
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    reference = op_plan.CANDIDATES["matmul"](q2, k2, v2, None, 0.0, True, None, False, torch.bfloat16)
    reference.float().sum().backward()
    assert torch.equal(out, reference)
    for got, want in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(got.grad, want.grad)
