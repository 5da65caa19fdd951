"""`mixprec inspect`'s advice reads the speed `auto` measures on the model and follows auto's rule (issue 25)."""

from __future__ import annotations

import dataclasses
import json

import torch

from mixprec.numerics.report import NumericsReport
from mixprec.numerics.stats import MeasuredSpeed
from mixprec.numerics.workload import advised_policy, inspect_workload, measure_speed
from mixprec.policy.policy import PRESETS
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

SLOW = MeasuredSpeed("fp32", {"bf16-mixed": 0.41}, "auto → fp32: measured on this model (3 interleaved blocks of 2 "
                     "steps): bf16-mixed 0.41x fp32 (needs >= 1.03x); fp16 is never chosen on a CPU")
FAST = MeasuredSpeed("bf16-mixed", {"bf16-mixed": 1.39}, "auto → bf16-mixed: measured on this model (3 interleaved "
                     "blocks of 2 steps): bf16-mixed 1.39x fp32 (faster than fp32 by >= 1.03x)")


def test_the_advice_follows_autos_rule_on_autos_measurement():
    """Issue 25: inspect advised bf16-mixed for gpt/baby where auto measured bf16-mixed at 0.41x fp32 and chose
    fp32. With no policy preferred, the advice now starts from auto's choice on its measurement, and says it."""
    report = inspect_workload("gpt", config="tiny", steps=1, device="cpu", speed=SLOW)
    slow = report.recommend()
    assert slow.policy == PRESETS["fp32"] and SLOW.decision in slow.reasons[0]
    fast = dataclasses.replace(report, speed=FAST).recommend()
    assert fast.policy.compute_dtype == torch.bfloat16 and fast.policy.param_dtype == torch.float32
    assert FAST.decision in fast.reasons[0]
    assert dataclasses.replace(report, speed=None).recommend().policy.compute_dtype == torch.bfloat16  # not measured
    again = NumericsReport.from_json(report.to_json())            # numerics.json keeps the evidence
    assert again.speed == SLOW and again.recommend() == slow
    old = json.loads(report.to_json())
    del old["speed"]                                              # a numerics.json written before the field
    assert NumericsReport.from_json(json.dumps(old)).speed is None
    assert f"auto measured on this model: {SLOW.decision}" in \
        inspect_workload("gpt", config="tiny", steps=1, device="cpu", policy="bf16-pure", speed=SLOW).recommend().reasons[0]


def test_the_advisors_speed_is_the_measurement_autos_engine_decides_on(tmp_path, monkeypatch):
    """The advisor does not time the model its own way: its speed is auto's trial on the same model, arguments
    and candidates (one cache key), so an ``auto`` engine's decision and the advice cannot contradict each other."""
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, "auto", steps=5, seed=0, device="cpu")
    train_step(mp, workload, next(workload.batches("train", 0)))   # auto times its candidates at this forward
    (decided,) = [e for e in mp.events if e.kind == "auto"]
    speed = measure_speed("gpt", config="tiny", device="cpu")
    assert speed.decision == decided.detail and speed.choice == decided.to_policy == str(mp.policy)
    advised, recommendation = advised_policy("gpt", config="tiny", steps=1, device="cpu")
    assert advised.compute_dtype == mp.policy.compute_dtype and speed.decision in recommendation.reasons[0]


def test_advice_from_a_noisy_measurement_says_so_instead_of_stating_it_as_fact():
    """inspect said "no 16-bit policy trains this model faster" from a 1.02x auto itself had marked noisy; a later
    auto on a quieter moment chose bf16-mixed. The words now say it was auto's rule on a noisy measurement."""
    noisy = MeasuredSpeed("fp32", {"bf16-mixed": 1.02}, "auto → fp32: bf16-mixed 1.02x fp32 (needs >= 1.03x, noisy)",
                          noisy=True)
    report = inspect_workload("gpt", config="tiny", steps=1, device="cpu", speed=noisy)
    reason = report.recommend().reasons[0]
    assert "NOISY measurement" in reason and "trains this model faster" not in reason and noisy.decision in reason
    assert NumericsReport.from_json(report.to_json()).speed == noisy
