"""Tests for the bench's plain-autocast peer (``programs/bench/peer.py``: the ``torch-autocast`` row) and its step
profile per row (``programs/bench/step_profile.py``): a tiny bench end to end, the peer against a hand-written
``torch.autocast`` loop, the verdict rule, ``--no-peer``, a device without 16-bit autocast, fp16's GradScaler."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import textwrap
from dataclasses import asdict

import pytest
import torch
from torch import nn

from mixprec.machine.capability import Capability
from mixprec.programs.bench.peer import PEER, AutocastPeer, plan_peer, with_peer_ratios
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.runner import CAPABILITY_ENV, judge_policies
from mixprec.programs.bench.step_profile import CATEGORIES, PROFILED_STEPS
from mixprec.programs.bench.verdict import Targets
from mixprec.programs.cli import main
from mixprec.programs.session import train_step
from mixprec.workloads import Workload, get_workload

STEPS, EVAL_EVERY = 8, 4

# What a user writes instead of mixprec, spelled out: the tiny GPT from seed 0, torch AdamW with the workload's
# numbers (decay on matrices only), its warm-up + cosine schedule, clipping at its max norm, bf16 autocast around
# the forward and the evaluation. Run in a fresh process: nothing of mixprec's autocast is registered there.
HAND_LOOP = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn.functional as F
    from mixprec.workloads import get_workload
    from mixprec.workloads.base import WarmupCosine

    steps, eval_every = int(sys.argv[1]), int(sys.argv[2])
    workload = get_workload("gpt", config="tiny")
    cfg = workload.optim

    def loss_of(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch["idx"])
            return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            losses = [loss_of(model, b).float() for b in workload.batches("val")]
        model.train()
        return torch.stack(losses).mean().item()

    torch.manual_seed(0)
    model = workload.build_model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=cfg.betas)
    schedule = WarmupCosine(warmup_steps=cfg.warmup_steps(steps), total_steps=steps, min_ratio=cfg.min_lr / cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    out = {"losses": [], "lrs": [], "norms": [], "evals": []}
    batches = workload.batches("train", 0)
    for step in range(1, steps + 1):
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        loss = loss_of(model, next(batches))
        loss.backward()
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        if eval_every and step % eval_every == 0 and step < steps:
            out["evals"].append([step, evaluate(model)])
    out["evals"].append([steps, evaluate(model)])
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def peer_bench(tmp_path_factory):
    """One tiny bench with its default peer: fp32, bf16-mixed and torch-autocast, 8 steps, eval every 4."""
    out = tmp_path_factory.mktemp("peer") / "out"
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        status = main(["bench", "--config", "tiny", "--policies", "bf16-mixed", "--steps", str(STEPS), "--seeds", "1",
                       "--eval-every", str(EVAL_EVERY), "--out", str(out), "--device", "cpu"])
    return status, out, json.loads((out / "results.json").read_text()), console.getvalue()


@pytest.fixture(scope="module")
def hand_loop():
    done = subprocess.run([sys.executable, "-c", HAND_LOOP, str(STEPS), str(EVAL_EVERY)], capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_peer_row_trains_what_a_hand_written_autocast_loop_trains(peer_bench, hand_loop):
    """The peer's losses, learning rates, gradient norms and eval points are the hand-written loop's, bit for bit
    (CPU, the same seed, batches and ops in another process: deterministic)."""
    status, _, results, _ = peer_bench
    assert status == 0
    rows = results["policies"]
    assert list(rows) == ["fp32", "bf16-mixed", PEER]   # fp32 first, the peer last
    peer = rows[PEER]
    assert peer["loss_per_step"] == hand_loop["losses"]
    assert peer["lr_per_step"] == hand_loop["lrs"] and peer["grad_norm_per_step"] == hand_loop["norms"]
    assert peer["eval_curve"] == hand_loop["evals"] and peer["final_eval_loss"] == hand_loop["evals"][-1][1]
    assert peer["requested"] == peer["policy"] == PEER and peer["compute_dtype"] == "bf16"
    assert peer["optimizer"] == "torch.optim.adamw.AdamW" and "not a mixprec policy" in peer["decision"]
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in peer["decision"] and "no GradScaler" in peer["decision"]
    assert peer["loss_scale_history"] == [1.0] * STEPS and peer["skipped_steps"] == 0
    # nothing of mixprec's planned kernels ran in its process: its worker planned nothing
    assert peer["op_plan"] == []
    assert rows["bf16-mixed"]["op_plan"] != []
    assert len({e["pid"] for e in rows.values()}) == 3
    assert results["peer"] == {"row": PEER, "dtype": "bfloat16", "grad_scaler": False, "skipped_reason": None,
                               "note": ""}
    assert results["settings"]["peer"] is True and PEER not in results["settings"]["policies"]


def test_the_peer_is_measured_and_judged_like_a_policy(peer_bench):
    _, _, results, _ = peer_bench
    rows = results["policies"]
    fp32, peer = rows["fp32"], rows[PEER]
    assert peer["verdict"] == "PASS" and "quality gate only" in peer["reason"], peer["reason"]
    assert peer["eval_loss_delta_vs_fp32"] == (peer["final_eval_loss"] - fp32["final_eval_loss"]) / fp32["final_eval_loss"]
    assert f"eval loss {peer['eval_loss_delta_vs_fp32']:+.2%} vs fp32" in peer["reason"]
    assert peer["state_bytes_per_param"] == 16.0   # fp32 params and grads, two fp32 AdamW moments
    timed = results["timing"]["step_ms"][PEER]     # timed interleaved with the policies, in the same rounds
    assert peer["step_time_ms_median"] == timed["median"] and peer["timed_steps"] > 0
    assert peer["speedup_vs_fp32"] == fp32["step_time_ms_median"] / peer["step_time_ms_median"]
    saved = peer["step_memory"]["saved"]
    assert peer["saved_activation_bytes"] == saved["bytes"] > 0 and "torch.bfloat16" in saved["by_dtype"]
    assert peer["saved_activation_ratio_vs_fp32"] == peer["saved_activation_bytes"] / fp32["saved_activation_bytes"]
    assert peer["peak_live_bytes"] == peer["step_memory"]["live"]["total"] > 0


def test_every_row_has_its_speed_and_saved_bytes_against_the_peer(peer_bench):
    _, out, results, console = peer_bench
    rows = results["policies"]
    peer, step_ms = rows[PEER], results["timing"]["step_ms"]
    for name, e in rows.items():
        assert e["speedup_vs_peer"] == step_ms[PEER]["median"] / step_ms[name]["median"], name
        assert e["saved_activation_ratio_vs_peer"] == e["saved_activation_bytes"] / peer["saved_activation_bytes"], name
        assert e["peak_live_ratio_vs_peer"] == e["peak_live_bytes"] / peer["peak_live_bytes"], name
    assert peer["speedup_vs_peer"] == peer["saved_activation_ratio_vs_peer"] == 1.0
    report = (out / "report.md").read_text()
    noisy = " (NOISY)" if results["timing"]["noisy"] else ""   # a busy machine marks the speed columns
    assert f"| step ms | speedup{noisy} | speedup vs torch-autocast{noisy} |" in report
    assert "| saved ratio | saved vs torch-autocast |" in report
    bf16 = rows["bf16-mixed"]
    cells = f"| {bf16['speedup_vs_fp32']:.2f}x | {bf16['speedup_vs_peer']:.2f}x |"
    assert f"| bf16-mixed | {bf16['verdict']} | {bf16['step_time_ms_median']:.1f} {cells}" in report
    assert f"| {PEER} (peer) | PASS |" in report and f"## The `{PEER}` peer" in report
    marked = " (TIMINGS NOISY: unreliable)" if results["timing"]["noisy"] else ""   # as the table's columns
    assert (f"- bf16-mixed: speed {bf16['speedup_vs_peer']:.2f}x{marked}, saved "
            f"{bf16['saved_activation_ratio_vs_peer']:.2f}x") in report
    header = console.splitlines()[0].split()
    marks = ["(NOISY)"] if noisy else []
    assert header[:8 + 2 * len(marks)] == ["policy", "verdict", "step", "ms", "speedup", *marks, "vs", PEER, *marks, "RSS"]
    assert f"{PEER} (peer)" in console and f"  bf16-mixed: speed {bf16['speedup_vs_peer']:.2f}x" in console


def test_the_step_profile_adds_up_and_counts_the_matmul_flops_and_the_casts(peer_bench):
    """Each row's profiled window: the categories add up to the profiled step (the profiler's self times sum to each
    step range's duration), the GEMM FLOPs are the model's linears' (6 x in x out per token: forward, grad input,
    grad weight), autocast's weight casts are counted, the matmul roofline is against the peak in the row's dtype."""
    _, out, results, console = peer_bench
    workload = get_workload("gpt", config="tiny")
    linears = [m for m in workload.build_model().modules() if isinstance(m, nn.Linear)]
    tokens = workload.config.batch_size * workload.config.block_size
    gemm_flop = 6 * tokens * sum(m.in_features * m.out_features for m in linears)
    peaks = results["environment"]["peaks_gflops_per_s"]
    chosen = {e["chosen"] for e in results["op_plan"]["entries"]}
    for name, e in results["policies"].items():
        p = e["step_profile"]
        assert p["steps"] == PROFILED_STEPS and p["warmup_steps"] == 1 and list(p["categories"]) == list(CATEGORIES)
        total = sum(c["ms"] for c in p["categories"].values())
        assert total == pytest.approx(p["step_ms"], rel=1e-9) and p["step_ms"] > 0, name
        assert sum(c["share"] for c in p["categories"].values()) == pytest.approx(1.0, rel=1e-9)
        assert p["categories"]["matmul"]["ms"] > 0 and p["categories"]["optimizer"]["ms"] > 0, name
        if name != "bf16-mixed" or chosen <= {"fused", "fused-fp32"}:   # torch's attention: no GEMM op of its own
            assert p["matmul_gflop"] * 1e9 == pytest.approx(gemm_flop, rel=1e-12), name
        else:
            assert p["matmul_gflop"] * 1e9 > gemm_flop
        assert p["matmul_peak_dtype"] == e["compute_dtype"] and p["matmul_peak_gflops_per_s"] == peaks[e["compute_dtype"]]
        achieved = p["matmul_gflop"] / (p["categories"]["matmul"]["ms"] / 1e3)
        assert p["matmul_gflops_per_s"] == pytest.approx(achieved, rel=1e-9)
        assert p["matmul_of_peak"] == pytest.approx(achieved / peaks[e["compute_dtype"]], rel=1e-9)
    for name in ("bf16-mixed", PEER):   # every linear's weight is cast to bf16 at each forward
        assert results["policies"][name]["step_profile"]["categories"]["casts"]["calls"] >= len(linears), name
    report = (out / "report.md").read_text()
    section = report[report.index("## Where the step goes"):]
    for name in ("fp32", "bf16-mixed", f"{PEER} (peer)"):
        assert f"\n| {name} | {results['policies'][name.split()[0]]['step_profile']['step_ms']:.2f} |" in section
    assert "where the step goes (profiled window of 3 steps" in console


def test_no_peer_leaves_the_row_and_its_columns_out(tmp_path):
    out = tmp_path / "out"
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        status = main(["bench", "--config", "tiny", "--policies", "bf16-mixed", "--steps", "5", "--seeds", "1",
                       "--eval-every", "0", "--timing", "sequential", "--out", str(out), "--device", "cpu", "--no-peer"])
    results = json.loads((out / "results.json").read_text())
    assert status == 0 and list(results["policies"]) == ["fp32", "bf16-mixed"]
    assert results["peer"] is None and results["settings"]["peer"] is False
    for e in results["policies"].values():
        assert e["speedup_vs_peer"] is None and e["saved_activation_ratio_vs_peer"] is None
        assert e["step_profile"] is None   # sequential timing: no resident worker to profile in
    report = (out / "report.md").read_text()
    assert PEER not in report and PEER not in console.getvalue() and "## Where the step goes" not in report


def test_a_device_without_16_bit_autocast_skips_the_peer_with_the_reason(tmp_path, monkeypatch):
    """Never an fp32 loop under the peer's name: a planted CPU without bf16 gives a SKIPPED row saying why."""
    no_bf16 = Capability(device="cpu", bf16=False, fp16=True, bf16_fast=False, fp16_native=False,
                         detail="planted: no bf16")
    monkeypatch.setenv(CAPABILITY_ENV, json.dumps(asdict(no_bf16)))
    out = tmp_path / "out"
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        status = main(["bench", "--config", "tiny", "--policies", "fp32", "--steps", "5", "--seeds", "1",
                       "--eval-every", "0", "--timing", "sequential", "--out", str(out), "--device", "cpu"])
    results = json.loads((out / "results.json").read_text())
    peer = results["policies"][PEER]
    assert status == 0 and peer["verdict"] == "SKIPPED" and peer["pid"] is None
    assert peer["reason"].startswith("no 16-bit torch.autocast runs natively on cpu (planted: no bf16)")
    assert results["peer"]["dtype"] is None and results["peer"]["skipped_reason"] == peer["reason"]
    assert results["policies"]["fp32"]["speedup_vs_peer"] is None
    assert f"{PEER} (peer): SKIPPED: no 16-bit torch.autocast" in console.getvalue()


def test_the_peer_plan_follows_the_devices_16_bit_candidate():
    cpu = Capability(device="cpu", bf16=True, fp16=True, bf16_fast=True, fp16_native=False)
    old_gpu = Capability(device="cuda", bf16=True, fp16=True, bf16_fast=False, fp16_native=True, detail="sm_75")
    assert plan_peer(torch.device("cpu"), cpu, strategy=None).as_json()["dtype"] == "bfloat16"
    fp16 = plan_peer(torch.device("cuda"), old_gpu, strategy=None).as_json()
    assert (fp16["dtype"], fp16["grad_scaler"], fp16["skipped_reason"]) == ("float16", True, None)
    sharded = plan_peer(torch.device("cpu"), cpu, strategy="fsdp2")
    assert sharded.rows() == {} and "no torch-autocast row under --strategy fsdp2" in sharded.note


def _row(name: str, ms: float, loss: float, saved: int | None = 100) -> PolicyRun:
    return PolicyRun(requested=name, step_time_ms_median=ms, peak_memory_mb=100.0, final_eval_loss=loss,
                     saved_activation_bytes=saved, peak_live_bytes=saved)


def test_the_peer_is_judged_on_the_quality_gate_alone():
    """Speed and memory targets judge mixprec's policies; the peer passes or fails on its eval loss."""
    rows = {"fp32": _row("fp32", 10.0, 2.0), "bf16-mixed": _row("bf16-mixed", 20.0, 2.01),
            PEER: _row(PEER, 20.0, 2.01)}
    judged = judge_policies(rows, Targets(min_speedup=1.5, max_memory_ratio=0.5))
    assert judged["bf16-mixed"].verdict == "FAIL" and "speedup 0.50x (min 1.50x)" in judged["bf16-mixed"].reason
    assert judged[PEER].verdict == "PASS" and "quality gate only" in judged[PEER].reason
    assert "speedup" not in judged[PEER].reason.split(";")[0]
    worse = judge_policies({**rows, PEER: _row(PEER, 5.0, 2.1)}, Targets())[PEER]
    assert worse.verdict == "FAIL" and "eval loss +5.00% vs fp32 (limit +2.00%)" in worse.reason


def test_vs_peer_ratios_are_none_where_either_side_was_not_measured():
    rows = with_peer_ratios({"fp32": _row("fp32", 10.0, 2.0, saved=None), "bf16-mixed": _row("bf16-mixed", 4.0, 2.0),
                             PEER: _row(PEER, 5.0, 2.0, saved=80)})
    assert rows["bf16-mixed"].speedup_vs_peer == 5.0 / 4.0 and rows["bf16-mixed"].saved_activation_ratio_vs_peer == 100 / 80
    assert rows["fp32"].speedup_vs_peer == 0.5 and rows["fp32"].saved_activation_ratio_vs_peer is None
    skipped = with_peer_ratios({"fp32": _row("fp32", 10.0, 2.0), PEER: PolicyRun.skipped(PEER, "no bf16")})
    assert skipped["fp32"].speedup_vs_peer is None and skipped["fp32"].peak_live_ratio_vs_peer is None
    assert with_peer_ratios({"fp32": _row("fp32", 10.0, 2.0)})["fp32"].speedup_vs_peer is None


class _Overflowing(Workload):
    """An MLP whose loss is scaled so that 65536 x its gradients overflow fp16: GradScaler skips steps."""

    name, config_name, items_per_batch, item_unit = "overflowing", "default", 32, "samples"

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def batches(self, split, seed=0):
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(32, 16, generator=gen)
            yield {"x": x, "y": x.flip(1)}

    def loss(self, model, batch):
        return nn.functional.mse_loss(model(batch["x"]).float(), batch["y"]) * 1e3

    def flops_per_step(self):
        return 6.0 * 32 * (16 * 64 * 2)

    def describe(self):
        return {"workload": self.name}


def test_the_fp16_peer_scales_the_loss_and_skips_what_overflows_as_gradscaler_does():
    """fp16: the peer's GradScaler loop against a hand-written one, step by step; a step counts as skipped exactly
    where the unscaled gradients were not finite (read from the gradients, not from the scale)."""
    workload, steps = _Overflowing(), 12
    peer = AutocastPeer(workload, dtype=torch.float16, steps=steps, seed=0, device="cpu")
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.make_optimizer(model)
    scheduler = workload.make_scheduler(optimizer, steps)
    scaler = torch.amp.GradScaler("cpu")
    batches, hand_batches = workload.batches("train"), workload.batches("train")
    applied = []
    for _ in range(steps):
        loss, result = train_step(peer, workload, next(batches))
        batch = next(hand_batches)
        with torch.autocast("cpu", dtype=torch.float16):
            hand_loss = workload.loss(model, batch)
        scale = scaler.get_scale()
        scaler.scale(hand_loss).backward()
        scaler.unscale_(optimizer)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), workload.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        assert float(loss) == float(hand_loss.detach()) and result.loss_scale == scale
        assert result.applied == finite and result.skipped_reason == (None if finite else "overflow")
        assert math.isfinite(result.grad_norm) == finite
        applied.append(result.applied)
    assert not all(applied) and any(applied) and peer.applied_steps == sum(applied)
    for mine, theirs in zip(peer.model.parameters(), model.parameters()):
        assert torch.equal(mine, theirs)
