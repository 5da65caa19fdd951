"""Tests for mixprec.programs.bench: verdicts, measurements, planning and a tiny bench end to end."""

from __future__ import annotations

import json
import statistics
import math
import os
import textwrap
from dataclasses import asdict, replace

import pytest
import torch

from mixprec.autocast.attention_kernels import CANDIDATES
from mixprec.programs.bench import Targets, judge
from mixprec.programs.bench.measure import median_step_ms, state_bytes, warmup_excess_s
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.figures import plot_loss_wallclock
from mixprec.programs.bench.report import POLICY_KEYS, eval_curve_lines, plot_loss_curves, plot_speed_memory
from mixprec.programs.bench.runner import CAPABILITY_ENV, BenchConfig, judge_policies, plan_policy
from mixprec.programs.bench.schedule import eval_every_for, warmup_steps_for
from mixprec.programs.bench.worker import RunSpec, run_policy
from mixprec.programs.session import build_engine, precision_optimizer, train_step
from mixprec.programs.cli import main
from mixprec.machine.capability import Capability
from mixprec.optim import AdamW
from mixprec.policy.policy import Policy
from mixprec.workloads import get_workload

NO_FP16_CPU = Capability(device="cpu", bf16=True, fp16=True, bf16_fast=True, fp16_native=False,
                         bf16_speed_ratio=2.0, fp16_speed_ratio=0.002,
                         detail="planted: fp16 matmul 0.002x fp32")

# --- verdicts on planted numbers ----------------------------------------------------------

VERDICT_CASES = [
    # (kwargs, verdict, words in the reason)
    (dict(loss_delta=0.004, speedup=1.4, memory_ratio=0.9), "PASS", ["+0.40%", "1.40x"]),
    (dict(loss_delta=-0.01, speedup=1.1, memory_ratio=1.0), "PASS", ["-1.00%"]),
    (dict(loss_delta=0.031, speedup=1.4, memory_ratio=0.9), "FAIL", ["+3.10%", "limit +2.00%"]),
    (dict(loss_delta=0.004, speedup=1.1, memory_ratio=0.9, min_speedup=1.3), "FAIL", ["speedup 1.10x", "min 1.30x"]),
    (dict(loss_delta=0.004, speedup=1.4, memory_ratio=1.2, max_memory_ratio=1.0), "FAIL", ["peak RSS 1.20x"]),
    (dict(loss_delta=0.004, speedup=1.4, memory_ratio=0.9, min_speedup=1.3, max_memory_ratio=1.0), "PASS", []),
    (dict(loss_delta=math.nan, speedup=1.4), "FAIL", ["not finite"]),
    (dict(loss_delta=None), "FAIL", ["no fp32 reference"]),
    (dict(skipped_reason="fp16 is not native on this CPU"), "SKIPPED", ["not native"]),
    (dict(error="worker crashed"), "FAIL", ["worker crashed"]),
    (dict(reference=True), "REFERENCE", ["fp32 reference"]),
]


@pytest.mark.parametrize("kwargs, expected, words", VERDICT_CASES)
def test_verdict_on_planted_numbers(kwargs, expected, words):
    target_keys = {"min_speedup", "max_memory_ratio"}
    targets = Targets(**{k: kwargs.pop(k) for k in list(kwargs) if k in target_keys})
    verdict = judge(targets=targets, **kwargs)
    assert verdict.verdict == expected
    for word in words:
        assert word in verdict.reason


def test_speed_and_loss_failures_are_both_listed():
    verdict = judge(targets=Targets(min_speedup=1.5), loss_delta=0.05, speedup=1.2)
    assert verdict.verdict == "FAIL"
    assert "+5.00%" in verdict.reason and "speedup 1.20x" in verdict.reason


@pytest.mark.parametrize("field, value", [("max_loss_delta", 0.0), ("min_speedup", -1.0), ("max_memory_ratio", math.inf)])
def test_targets_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        Targets(**{field: value})


def _entry(**measured):
    return {**dict.fromkeys(POLICY_KEYS), **measured}


def _judged(entries, targets):
    """judge_policies on rows given as results.json dicts; the judged rows as dicts again."""
    rows = judge_policies({name: PolicyRun.from_json(e) for name, e in entries.items()}, targets)
    return {name: row.to_json() for name, row in rows.items()}


def test_judge_policies_computes_deltas_against_fp32():
    entries = {"fp32": _entry(step_time_ms_median=300.0, peak_memory_mb=500.0, final_eval_loss=2.0),
               "bf16-mixed": _entry(step_time_ms_median=200.0, peak_memory_mb=450.0, final_eval_loss=2.01),
               "bf16-sr": _entry(step_time_ms_median=250.0, peak_memory_mb=440.0, final_eval_loss=None)}
    entries = _judged(entries, Targets(min_speedup=1.3))
    bf16 = entries["bf16-mixed"]
    assert bf16["speedup_vs_fp32"] == 1.5 and bf16["memory_ratio_vs_fp32"] == 0.9
    assert bf16["eval_loss_delta_vs_fp32"] == pytest.approx(0.005)
    assert [e["verdict"] for e in entries.values()] == ["REFERENCE", "PASS", "FAIL"]
    assert "not finite" in entries["bf16-sr"]["reason"]


def test_without_a_finished_fp32_run_nothing_passes():
    entries = {"fp32": _entry(error="RuntimeError: boom", stage="train"),
               "bf16-mixed": _entry(step_time_ms_median=200.0, peak_memory_mb=450.0, final_eval_loss=2.01)}
    entries = _judged(entries, Targets())
    assert entries["fp32"]["verdict"] == "FAIL"
    assert entries["bf16-mixed"]["verdict"] == "FAIL" and "no fp32 reference" in entries["bf16-mixed"]["reason"]


# --- measurements ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy, expected", [("fp32", 16.0), ("bf16-mixed", 16.0), ("bf16-pure", 18.0),
                                              ("bf16-kahan", 14.0), ("bf16-sr", 12.0)])
def test_state_bytes_per_param_from_real_tensors(policy, expected):
    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, policy, steps=10, seed=0, device="cpu")
    batches = workload.batches("train", 0)
    train_step(mp, workload, next(batches))  # creates the optimizer state
    measured = {}
    train_step(mp, workload, next(batches),
               after_backward=lambda: measured.update(s=state_bytes(mp.model, mp.optimizer)))
    state = measured["s"]
    assert state.per_param == expected  # exact: read from tensors, not from the policy table
    assert state.n_params == workload.num_params()  # the tied head counted once
    assert state.scalars > 0  # step counters are reported, outside per_param



class _Packed(torch.Tensor):
    """A wrapper subclass shaped like torchao's OptimState8bit: reports float32, holds uint8 codes and fp32 scales."""

    @staticmethod
    def __new__(cls, codes, scale):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes, scale):
        self.codes, self.scale = codes, scale

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["codes"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_Packed does not compute ({func})")


def _census(model, state):
    """state_bytes of ``model`` with an optimizer whose state is ``state`` (param -> dict) and grads set."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state.update(state)
    return state_bytes(model, opt)


def test_state_bytes_counts_a_wrapper_subclass_by_the_tensors_it_holds():
    model = torch.nn.Linear(128, 64)                          # weight 8192, bias 64 elements
    qmap_fp32 = torch.linspace(-1, 1, 256)                      # one code book shared by both states: once
    codes = lambda: _Packed(torch.zeros(64, 128, dtype=torch.uint8), torch.ones(32))   # noqa: E731
    nested = _Packed(_Packed(torch.zeros(64, 128, dtype=torch.uint8), qmap_fp32), torch.ones(32))
    state = {model.weight: {"step": torch.tensor(3.0), "exp_avg": codes(), "exp_avg_sq": nested,
                            "qmap": qmap_fp32},
             model.bias: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64)}}
    counted = _census(model, state)
    # weight: 2 x (8192 uint8 codes + 32 fp32 scales) + the shared 256 fp32 qmap; bias: 2 x 64 fp32
    assert counted.optimizer_state == 2 * (8192 + 32 * 4) + 256 * 4 + 2 * 64 * 4
    assert (counted.params, counted.grads, counted.scalars) == (8256 * 4, 8256 * 4, 2 * 4)


def test_state_bytes_of_plain_tensors_is_unchanged_by_the_subclass_rule():
    model = torch.nn.Linear(128, 64)
    exp_avg = torch.zeros(64, 128)
    state = {model.weight: {"step": torch.tensor(1.0), "exp_avg": exp_avg, "exp_avg_sq": torch.zeros(64, 128),
                            "view": exp_avg[:8]},            # a view of a counted storage: nothing more
             model.bias: {"momentum": torch.zeros(64, dtype=torch.bfloat16)}}
    counted = _census(model, state)
    assert counted.optimizer_state == 2 * 8192 * 4 + 64 * 2
    assert counted.total == 2 * 8256 * 4 + 2 * 8192 * 4 + 64 * 2 and counted.scalars == 4


def test_state_bytes_of_torchao_8bit_state_counts_codes_scales_and_qmap():
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    model = torch.nn.Linear(128, 64)
    state = {model.weight: {"exp_avg": subclass_8bit.OptimState8bit.zeros((64, 128), True, 256, "cpu"),
                            "exp_avg_sq": subclass_8bit.OptimState8bit.zeros((64, 128), False, 256, "cpu")}}
    assert state[model.weight]["exp_avg"].dtype == torch.float32      # its nominal dtype: 4 B/element, not true
    # per state: 8192 uint8 codes, 8192 / 256 = 32 fp32 scales, its own 256-entry fp32 qmap
    assert _census(model, state).optimizer_state == 2 * (8192 + 32 * 4 + 256 * 4)


def test_bf16_lean_census_counts_8bit_codes_and_their_scales_exactly():
    """bf16-lean on gpt/tiny: 2 B param + 2 B grad each; the two moments of every tensor with >= 4096
    elements and 2 dims as 1-byte codes + one fp32 absmax per 256, the rest (embeddings under 4096
    elements, norms, biases) fp32 moments: the census reads exactly that from the tensors."""
    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, "bf16-lean", steps=10, seed=0, device="cpu")
    batches = workload.batches("train", 0)
    train_step(mp, workload, next(batches))
    measured = {}
    train_step(mp, workload, next(batches),
               after_backward=lambda: measured.update(s=state_bytes(mp.model, mp.optimizer)))
    sizes = [(p.numel(), p.dim()) for p in mp.model.parameters()]
    quantized = [n for n, dim in sizes if n >= 4096 and dim >= 2]
    n_params = sum(n for n, _ in sizes)
    codes_and_scales = 2 * sum(n + 4 * math.ceil(n / 256) for n in quantized)
    state = measured["s"]
    assert quantized and state.n_params == n_params == workload.num_params()
    assert state.optimizer_state == codes_and_scales + 8 * (n_params - sum(quantized))
    assert (state.quantized_state, state.quantized_elements) == (codes_and_scales, 2 * sum(quantized))
    assert state.per_param == (4 * n_params + state.optimizer_state) / n_params   # 8.72 on tiny
    assert "optimizer state int8 blockwise" in mp.decision


def test_portable_ops_timing_runs_a_policy_that_needs_mixprec_optim():
    """``bench --policies fp32,bf16-sr,bf16-lean`` times ops=portable on bf16-sr, whose stochastic rounding the
    workload's torch.optim.AdamW cannot do: the timing engines get mixprec's twin, as the workers do."""
    from mixprec.programs.bench.portable_cost import measure_portable_cost, ported_policy

    assert ported_policy(["fp32", "bf16-sr", "bf16-lean"]) == "bf16-sr"
    for policy in ("bf16-sr", "bf16-lean"):
        cost = measure_portable_cost("gpt", policy, "cpu", config="tiny", steps=2, block=1, warmup=1)
        assert cost["policy"] == policy and cost["timed_steps_each"] == 2


def test_precision_optimizer_only_where_the_policy_needs_one():
    model = torch.nn.Linear(4, 4)
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.99))
    assert precision_optimizer(adamw, Policy.parse("bf16-mixed")) is adamw
    twin = precision_optimizer(adamw, Policy.parse("bf16-kahan"))
    assert isinstance(twin, AdamW)
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in twin.param_groups] == \
        [(3e-3, (0.9, 0.99), 0.1), (3e-3, (0.9, 0.99), 0.0)]
    with pytest.raises(ValueError, match="rounding='stochastic'.*mixprec.optim"):
        precision_optimizer(torch.optim.Adam(model.parameters()), Policy.parse("bf16-sr"))
    lean = precision_optimizer(torch.optim.AdamW(model.parameters()), Policy.parse("bf16-mixed,state=int8"))
    assert isinstance(lean, AdamW)   # 8-bit state needs mixprec's optimizer too
    with pytest.raises(ValueError, match=r"state=int8, which Adam cannot do"):
        precision_optimizer(torch.optim.Adam(model.parameters()), Policy.parse("bf16-lean"))


def test_median_step_ms_drops_warmup():
    assert median_step_ms([100.0, 50.0, 10.0, 11.0, 12.0], warmup_steps=2) == 11.0
    assert warmup_steps_for(10) == 2 and warmup_steps_for(300) == 20
    with pytest.raises(ValueError, match="no step times"):
        median_step_ms([], warmup_steps=0)


def test_warmup_excess_is_what_the_warmup_took_beyond_the_median():
    # a compile in step 1 (2000 ms), a slow step 2 (50 ms); median of the timed steps 11 ms
    assert warmup_excess_s([2000.0, 50.0, 10.0, 11.0, 12.0], warmup_steps=2) == pytest.approx((1989.0 + 39.0) / 1e3)
    assert warmup_excess_s([5.0, 20.0, 20.0], warmup_steps=1) == 0.0   # never negative


# --- planning -------------------------------------------------------------------------------

def test_fp16_on_cpu_without_native_fp16_is_skipped_unless_forced():
    cpu = torch.device("cpu")
    reason = plan_policy("fp16-mixed", cpu, NO_FP16_CPU, force=False)
    assert "not native" in reason and "planted" in reason and "--force" in reason
    assert plan_policy("fp16-mixed", cpu, NO_FP16_CPU, force=True) is None
    assert plan_policy("bf16-mixed", cpu, NO_FP16_CPU, force=False) is None


def test_policy_the_device_refuses_is_skipped_with_its_reason():
    no_bf16 = Capability(device="cpu", bf16=False, fp16=True, bf16_fast=False, fp16_native=True, detail="no bf16")
    reason = plan_policy("bf16-mixed", torch.device("cpu"), no_bf16, force=True)
    assert "cannot run bf16" in reason


def test_a_bench_whose_every_asked_policy_is_skipped_is_refused_before_its_output_exists(tmp_path, monkeypatch,
                                                                                          capsys):
    """``--policies fp16-mixed`` on a CPU without native fp16: the only row asked for would be SKIPPED; the command
    exited 0 and wrote a run directory comparing nothing. Now exit 2 with the reason and the fix; one runnable row
    (bf16-mixed), or fp32 alone, still plans."""
    from mixprec.programs.bench.row_plan import plan_rows

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"--policies fp16-mixed: every policy asked for would be SKIPPED on cpu"):
        plan_rows(BenchConfig(out="x", config="tiny", policies=("fp16-mixed",)), cpu, NO_FP16_CPU, False)
    names, skip, _ = plan_rows(BenchConfig(out="x", config="tiny", policies=("fp16-mixed", "bf16-mixed")), cpu,
                               NO_FP16_CPU, False)
    assert names == ["fp32", "fp16-mixed", "bf16-mixed"] and skip["fp16-mixed"] and skip["bf16-mixed"] is None
    assert plan_rows(BenchConfig(out="x", config="tiny", policies=("fp32",)), cpu, NO_FP16_CPU, False)[0] == ["fp32"]
    monkeypatch.setenv(CAPABILITY_ENV, json.dumps(asdict(NO_FP16_CPU)))
    out = tmp_path / "out"
    assert main(["bench", "--config", "tiny", "--steps", "5", "--policies", "fp16-mixed", "--out", str(out),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "fp16-mixed: fp16 is not native on this CPU" in err and "pass --force to run it anyway" in err
    assert not out.exists()


def test_bench_config_validates_steps():
    with pytest.raises(ValueError, match="steps=3"):
        BenchConfig(out="x", steps=3)


def test_eval_every_is_validated():
    assert eval_every_for(300) == 30 and eval_every_for(40) == 4 and eval_every_for(5) == 1
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="eval_every"):
            BenchConfig(out="x", eval_every=bad)
        with pytest.raises(ValueError, match="eval_every"):
            RunSpec(workload="gpt", policy="fp32", steps=10, eval_every=bad)


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed"])
def test_eval_points_change_nothing_in_training(policy):
    """Evaluating every 3 steps (eval mode, no_grad, under the policy's autocast) leaves the training trajectory
    bit for bit as without; the curve's last point is the final eval."""
    spec = RunSpec(workload="gpt", config="tiny", policy=policy, steps=8, seed=0, device="cpu")
    plain, curved = run_policy(spec).to_json(), run_policy(RunSpec(**{**asdict(spec), "eval_every": 3})).to_json()
    assert curved["loss_per_step"] == plain["loss_per_step"]
    assert curved["final_eval_loss"] == plain["final_eval_loss"]
    assert [st for st, _ in curved["eval_curve"]] == [3, 6, 8] and curved["eval_curve"][-1][1] == plain["final_eval_loss"]
    assert plain["eval_curve"] == [[8, plain["final_eval_loss"]]] and curved["loss_unit"] == "nats/char"
    assert curved["eval_curve"][0][1] > curved["eval_curve"][-1][1]   # 5 more AdamW steps at lr 1e-3 lower it


def _curve_results(fp32_curve, bf16_curve, seed_curves, max_loss_delta=0.02):
    entry = lambda curve: _entry(loss_per_step=[3.0, 2.5, 2.0], eval_curve=curve, final_eval_loss=curve[-1][1],  # noqa: E731
                                 loss_unit="nats/char", step_time_ms_median=10.0, step_time_ms_p10=9.0,
                                 step_time_ms_p90=12.0, peak_memory_mb=100.0, state_bytes_per_param=16.0)
    return {"reference": "fp32", "policies": {"fp32": entry(fp32_curve), "bf16-mixed": entry(bf16_curve)},
            "seed_noise": {"seeds": [0, 1], "fp32_eval_curves": seed_curves},
            "settings": {"steps": 3, "eval_every": 1, "workload": "gpt", "config": "tiny", "seed": 0, "device": "cpu",
                         "targets": {"max_loss_delta": max_loss_delta}}, "timing": {"method": "interleaved"}}


def test_eval_curve_table_states_each_delta_and_the_seed_band():
    fp32, bf16, seed1 = [[1, 2.0], [3, 1.6]], [[1, 2.02], [3, 1.6]], [[1, 2.1], [3, 1.64]]
    lines = eval_curve_lines(_curve_results(fp32, bf16, [fp32, seed1]))
    assert lines[0] == "## Eval loss over training (every 1 steps, nats/char)"
    assert "| 1 | 2.0000 | 2.0200 (+1.00%) | ±5.00% |" in lines      # (2.1 - 2.0) / 2.0
    assert "| 3 | 1.6000 | 1.6000 (+0.00%) | ±2.50% |" in lines      # (1.64 - 1.6) / 1.6


def test_loss_plot_draws_eval_deltas_gate_and_seed_band(tmp_path):
    fp32, bf16, seed1 = [[1, 2.0], [3, 1.6]], [[1, 2.02], [3, 1.616]], [[1, 2.1], [3, 1.64]]
    fig = plot_loss_curves(_curve_results(fp32, bf16, [fp32, seed1], max_loss_delta=0.03), tmp_path / "l.png")
    train, evals, delta = fig.axes
    assert [a.get_ylabel() for a in fig.axes] == ["training loss (nats/char)", "eval loss (nats/char)",
                                                  "eval loss vs fp32 (%)"]
    assert delta.get_xlabel() == "step (optimizer steps)"
    assert {line.get_linestyle() for line in train.lines[:4:2]} == {"-", "--"}   # two policies, two dashes
    assert "raw, per step (faint)" in [t.get_text() for t in train.get_legend().get_texts()]
    assert [list(line.get_xdata()) for line in evals.lines] == [[1, 3], [1, 3]]
    curve = next(line for line in delta.lines if line.get_label() == "bf16-mixed")
    assert list(curve.get_ydata()) == pytest.approx([1.0, 1.0])                  # eval deltas, in percent
    gate = next(line for line in delta.lines if line.get_label().startswith("gate"))
    assert list(gate.get_ydata()) == [3.0, 3.0]
    (band,) = delta.collections                                                   # ±5 % at step 1, ±2.5 % at 3
    ys = band.get_paths()[0].vertices[:, 1]
    assert max(ys) == pytest.approx(5.0) and min(ys) == pytest.approx(-5.0)


def test_seed_band_label_counts_the_seeds_that_finished(tmp_path):
    """--seeds 3 whose third fp32 run did not finish: the band is drawn from the two curves there are, and its
    label said "fp32 at 3 seeds"."""
    fp32, seed1 = [[1, 2.0], [3, 1.6]], [[1, 2.1], [3, 1.64]]
    results = _curve_results(fp32, fp32, [fp32, seed1])
    results["seed_noise"].update(seeds=[0, 1, 2], error="the fp32 run at another seed did not finish")
    delta = plot_loss_curves(results, tmp_path / "l.png").axes[2]
    labels = [t.get_text() for t in delta.get_legend().get_texts()]
    assert "seed noise (fp32 at 2 seeds), beyond the axis at some steps" in labels, labels   # ±5 %, deltas 0


def test_speed_plot_has_p10_p90_whiskers_and_axis_labels(tmp_path):
    fig = plot_speed_memory(_curve_results([[3, 1.6]], [[3, 1.6]], []), tmp_path / "s.png")
    assert [a.get_ylabel() for a in fig.axes] == ["step time (ms)", "peak memory (MiB)", "training state (bytes/param)",
                                                "MiB"]
    assert all(a.get_xlabel() == "policy" for a in fig.axes)
    segments = fig.axes[0].collections[0].get_segments()                         # one whisker per bar: p10..p90
    assert [tuple(seg[:, 1]) for seg in segments] == [(9.0, 12.0), (9.0, 12.0)]


def test_speed_plot_says_timings_noisy_where_no_speed_verdict_is_given(tmp_path):
    """A noisy timing gives no speed verdict (console, report.md, results.json); the plot's speedup labels said
    "0.45x" on a 40x p90/p10 spread with nothing beside them."""
    results = _curve_results([[3, 1.6]], [[3, 1.6]], [])
    results["timing"] = {"method": "interleaved", "noisy": True}
    fig = plot_speed_memory(results, tmp_path / "noisy.png")
    assert "TIMINGS NOISY" in fig.axes[0].get_title() and "unreliable" in fig.axes[0].get_title()
    results["timing"]["noisy"] = False
    assert "NOISY" not in plot_speed_memory(results, tmp_path / "quiet.png").axes[0].get_title()


def _report_results(timing, fp32_p90=12.0):
    """A whole results.json as report.md reads it: fp32 and bf16-mixed, fp32's p10..p90 9..``fp32_p90`` ms."""
    results = _curve_results([[3, 1.6]], [[3, 1.6]], [])
    results.update(command="mixprec bench --config tiny", timing=timing, workload={}, seed_noise=None,
                   environment={"torch": "2", "python": "3", "cpu_name": "cpu", "torch_threads": 2, "cpu_flags": [],
                                "peaks_gflops_per_s": {"fp32": 10.0}})
    results["settings"].update(warmup_steps=20, targets={"max_loss_delta": 0.02, "min_speedup": None,
                                                         "max_memory_ratio": None})
    for name, e in results["policies"].items():
        e.update(verdict="REFERENCE" if name == "fp32" else "PASS", reason="-")
    results["policies"]["fp32"]["step_time_ms_p90"] = fp32_p90
    return results


_INTERLEAVED = {"method": "interleaved", "blocks": 4, "block_steps": 5, "retimed": 0, "errors": {},
                "spread_limit": 1.5, "spread": {"fp32": 1.333, "bf16-mixed": 1.333}, "noisy": False}


@pytest.mark.parametrize("noisy", [False, True])
def test_noisy_is_one_decision_that_console_report_and_plot_read(noisy, tmp_path):
    """Issue 25: report.md decided "noisy" again from the rows' p90/p10 (its own 1.5) while the console read
    ``timing.noisy``: a run was flagged in report.md and not on the console. Now all of them read ``timing.noisy``."""
    from mixprec.programs.bench.report import report_markdown, timing_lines

    results = _report_results({**_INTERLEAVED, "spread": {"fp32": 5.33, "bf16-mixed": 1.333}, "noisy": noisy},
                              fp32_p90=48.0)
    console, report = "\n".join(timing_lines(results)), report_markdown(results)
    title = plot_speed_memory(results, tmp_path / "s.png").axes[0].get_title()
    assert ("TIMINGS NOISY" in console) is ("TIMINGS NOISY" in report) is ("TIMINGS NOISY" in title) is noisy
    wallclock = plot_loss_wallclock(results, tmp_path / "w.png").axes[0].get_title()   # its order read as a ranking
    assert ("TIMINGS NOISY" in wallclock) is noisy
    assert "timings are noisy" not in report.lower()          # no second decision


def test_sequential_spreads_that_say_noisy_make_the_timing_noisy():
    """Issue 25: results.json said ``"noisy": false`` with fp32's p90/p10 at 47.94 (the sequential path hard-coded
    False). The rows' spreads decide, whichever way they were timed, and the verdict gives no speed judgement."""
    from mixprec.programs.bench.noise import SPREAD_LIMIT, settle_noise

    rows = {"fp32": PolicyRun(step_time_ms_median=10.0, step_time_ms_p10=2.0, step_time_ms_p90=95.88),
            "bf16-mixed": PolicyRun(step_time_ms_median=5.0, step_time_ms_p10=4.9, step_time_ms_p90=5.1),
            "fp16-mixed": PolicyRun.skipped("fp16-mixed", "not native")}
    timing = settle_noise({"method": "sequential"}, rows)
    assert timing == {"method": "sequential", "spread": {"fp32": 47.94, "bf16-mixed": 1.041}, "noisy": True,
                      "spread_limit": SPREAD_LIMIT}
    retimed = settle_noise({**_INTERLEAVED, "errors": {"fp32": "worker exited"}}, rows)   # fp32 kept its own timing
    assert retimed["noisy"] and retimed["spread"]["fp32"] == 47.94 and retimed["method"] == "interleaved"
    quiet = {**rows, "fp32": replace(rows["fp32"], step_time_ms_p10=9.0, step_time_ms_p90=11.0)}
    assert settle_noise({"method": "sequential"}, quiet)["noisy"] is False


@pytest.mark.parametrize("method", ["interleaved", "sequential"])
def test_report_describes_the_timing_its_table_comes_from_and_its_spread_once(method):
    """Issue 25: report.md said "median after 20 warm-up steps" above a table from the interleaved timing, and
    printed the p90/p10 spread twice, with different values (the timing's and the rows')."""
    from mixprec.programs.bench.report import report_markdown

    timing = _INTERLEAVED if method == "interleaved" else {"method": "sequential", "spread": {"fp32": 1.333},
                                                           "noisy": False, "spread_limit": 1.5}
    report = report_markdown(_report_results(timing))
    assert report.count("p90/p10") == 1 and "fp32 1.33" in report
    if method == "interleaved":
        assert "warm-up" not in report and "4 rounds of 5 steps per policy in resident workers" in report
        assert "step time is the median of each policy's 20 timed steps" in report
    else:
        assert "interleaved" not in report and "step time is the median after 20 warm-up steps" in report


# --- end to end through the CLI ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """One tiny bench, 3 policies, 10 steps; fp16-mixed SKIPPED by a planted capability."""
    out = tmp_path_factory.mktemp("bench") / "out"
    argv = ["bench", "--config", "tiny", "--policies", "bf16-mixed,fp16-mixed", "--steps", "10",
            "--out", str(out), "--device", "cpu", "--memory-budget", "64MiB", "--portable-cost"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CAPABILITY_ENV, json.dumps(asdict(NO_FP16_CPU)))
        status = main(argv)
    return status, out, json.loads((out / "results.json").read_text())


def test_tiny_bench_results_schema(tiny_bench):
    status, _, results = tiny_bench
    assert status == 0
    assert list(results["policies"]) == ["fp32", "bf16-mixed", "fp16-mixed", "torch-autocast"]  # fp32 first, the peer last
    for entry in results["policies"].values():
        assert set(POLICY_KEYS) <= set(entry)
    env = results["environment"]
    for key in ("torch", "python", "device", "cpu_flags", "peaks_gflops_per_s", "command"):
        assert key in env
    assert env["command"].startswith("mixprec bench --config tiny")
    fp32, bf16 = results["policies"]["fp32"], results["policies"]["bf16-mixed"]
    assert fp32["verdict"] == "REFERENCE" and fp32["state_bytes_per_param"] == 16.0
    assert bf16["verdict"] == "PASS", bf16["reason"]
    assert bf16["policy"] == "bf16-mixed" and "as asked" in bf16["decision"]
    assert len(bf16["loss_per_step"]) == 10 and len(bf16["loss_scale_history"]) == 10
    for key in ("step_time_ms_median", "tokens_per_s", "speedup_vs_fp32", "peak_memory_mb", "gflops_per_s",
                "mfu", "final_eval_loss", "eval_loss_delta_vs_fp32"):
        assert isinstance(bf16[key], float) and bf16[key] > -1, key
    assert bf16["skipped_steps"] == 0
    assert results["settings"]["eval_every"] == 1   # 10 steps // 10: an eval point after every step
    for e in (fp32, bf16):
        assert [st for st, _ in e["eval_curve"]] == list(range(1, 11)) and e["eval_curve"][-1][1] == e["final_eval_loss"]
    cost = results["portable_ops"]   # ops=portable timed against ops=native, interleaved, for bf16-mixed
    assert cost["policy"] == "bf16-mixed" and cost["method"] == "interleaved" and cost["timed_steps_each"] == 20
    ms_ratio = cost["portable_step_ms_median"] / cost["native_step_ms_median"]   # medians rounded to 0.01 ms
    assert cost["ratio_portable_over_native"] == pytest.approx(ms_ratio, rel=0.01 / cost["native_step_ms_median"] * 2)
    noise = results["seed_noise"]   # fp32 trained again at seed 1: the band each verdict is read against
    assert noise["seeds"] == [0, 1] and noise["fp32_eval_losses"][0] == fp32["final_eval_loss"]
    assert noise["fp32_eval_curves"][0] == fp32["eval_curve"] and noise["fp32_eval_curves"][1][-1][1] == \
        noise["fp32_eval_losses"][1]
    lo, hi = min(noise["fp32_eval_losses"]), max(noise["fp32_eval_losses"])
    assert noise["relative_spread"] == pytest.approx((hi - lo) / lo) and lo != hi   # another seed, another loss
    inside = abs(bf16["eval_loss_delta_vs_fp32"]) <= noise["relative_spread"]
    assert f"{'within' if inside else 'outside'} seed noise (±{noise['relative_spread']:.2%})" in bf16["reason"]
    assert fp32["op_plan"] == []   # autocast off: nothing planned
    peaks = {d: v for d, v in env["peaks_gflops_per_s"].items() if d in ("fp32", "bf16", "fp16") and v}
    best = max(peaks, key=peaks.get)    # MFU against one named peak, the device's fastest dtype, for every row
    mfu_peak = results["mfu_peak"]   # and where that peak comes from: this process or a cache file (issue 25)
    assert {k: mfu_peak[k] for k in ("dtype", "gflops_per_s")} == {"dtype": best, "gflops_per_s": peaks[best]}
    assert mfu_peak["source"] == env["peaks_origin"][best] and mfu_peak["n"] == env["peaks_matmul_n"][best]
    assert mfu_peak["source"].startswith(("measured by this process", "cached"))
    for e in (fp32, bf16):
        assert e["mfu"] == pytest.approx(e["gflops_per_s"] / peaks[best]) and e["mfu_own_dtype"] is not None
    plan = {e["shape"].split()[-1]: e for e in bf16["op_plan"]}   # the tiny GPT's attention: training and eval keys
    assert set(plan) == {"fwd+bwd", "fwd"} and "kernels=measured" in bf16["decision"]
    measured = {e["shape"]: e for e in results["op_plan"]["entries"]}   # measured once by the bench, pinned here
    for e in plan.values():
        assert e["op"] == "scaled_dot_product_attention" and e["chosen"] in CANDIDATES
        assert e["source"] == "bench" and e["chosen"] == measured[e["shape"]]["chosen"]
        # measured afresh (noisy: "measured (noisy: ...)"), or the cache file's entry kept where the new measurement
        # could not replace it (tests/autocast/test_plan_verdict.py), its note saying why
        assert measured[e["shape"]]["source"].startswith(("measured", "cache"))
        assert measured[e["shape"]]["times_ms"][e["chosen"]] > 0


def test_tiny_bench_reports_one_steps_memory_and_the_largest_batch_in_the_budget(tiny_bench):
    """Issue 27: the bench could not see activation memory (peak RSS buries it). Each row now has the bytes one
    extra, untimed step saved for backward and its peak live tensor bytes, with ratios to fp32, and the largest
    batch whose fitted peak fits --memory-budget (failed before: no such keys)."""
    _, out, results = tiny_bench
    rows = results["policies"]
    fp32, bf16 = rows["fp32"], rows["bf16-mixed"]
    for e in (fp32, bf16):
        memory = e["step_memory"]
        live, saved = memory["live"], memory["saved"]
        assert e["saved_activation_bytes"] == saved["bytes"] == sum(saved["by_dtype"].values()) > 0
        assert e["peak_live_bytes"] == live["total"] == live["baseline"] + live["bytes"]
        # every saved tensor is alive at the end of the forward, on top of the state the step started with
        assert live["total"] >= live["baseline"] + saved["bytes"]
        assert live["baseline"] >= e["state_bytes"]["total"] - e["state_bytes"]["grads"]   # params, moments: live
        assert memory["batch_rows"] == 4 and "profiler" in live["source"]
        fit = e["memory_budget"]
        assert [b for b, _ in fit["points"]] == [2, 4, 8] and fit["budget_bytes"] == 64 * 2**20
        assert dict(fit["points"])[4] == live["total"]   # the training batch's point is the step measured above
        predict = lambda b: fit["fixed_bytes"] + fit["per_sample_bytes"] * b
        assert predict(fit["largest_batch"]) <= 64 * 2**20 < predict(fit["largest_batch"] + 1)
        assert [p - predict(b) for b, p in fit["points"]] == pytest.approx(fit["residuals"], abs=1e-3)
    assert fp32["saved_activation_ratio_vs_fp32"] == 1.0 and fp32["peak_live_ratio_vs_fp32"] == 1.0
    assert bf16["saved_activation_ratio_vs_fp32"] == bf16["saved_activation_bytes"] / fp32["saved_activation_bytes"]
    assert bf16["peak_live_ratio_vs_fp32"] == bf16["peak_live_bytes"] / fp32["peak_live_bytes"]
    assert "torch.bfloat16" in bf16["step_memory"]["saved"]["by_dtype"]      # autocast's matmul inputs
    # the embedding's token ids and the loss's targets are saved too
    assert set(fp32["step_memory"]["saved"]["by_dtype"]) == {"torch.float32", "torch.int64"}
    skipped = rows["fp16-mixed"]
    assert skipped["saved_activation_bytes"] is None and skipped["memory_budget"] is None
    assert results["settings"]["memory_budget"] == "64MiB"
    assert results["seed_noise"] is not None                                 # the seed runs fit no budget
    report = (out / "report.md").read_text()
    assert "## Memory of one training step" in report
    assert "| saved MiB | saved ratio | saved vs torch-autocast | peak live MiB |" in report
    saved = fp32["saved_activation_bytes"]    # KiB below 1 MiB
    assert f"fp32: saved {f'{saved / 2**10:,.1f} KiB' if saved < 2**20 else f'{saved / 2**20:,.2f} MiB'} (1.00x" in report
    assert f"fp32: {fit and fp32['memory_budget']['largest_batch']:,} (predicted" in report
    assert "| batch in 64MiB |" in report


def test_console_table_shows_step_memory_with_ratios_and_the_budget_column():
    from mixprec.programs.bench.report import format_table

    def entry(saved, live, ratio, batch):
        return {"verdict": "PASS", "saved_activation_bytes": saved, "peak_live_bytes": live,
                "saved_activation_ratio_vs_fp32": ratio, "peak_live_ratio_vs_fp32": ratio,
                "memory_budget": {"largest_batch": batch}}

    table = format_table({"settings": {"memory_budget": "4GiB"},
                          "policies": {"fp32": entry(2 * 2**20, 3 * 2**20, 1.0, 105),
                                       "bf16-mixed": entry(2**20, 1.5 * 2**20, 0.5, None)}}).splitlines()
    assert table[0].split()[8:12] == ["saved", "MiB", "live", "MiB"] and table[0].endswith("batch in 4GiB")
    assert "2.00 (1.00x)" in table[2] and "3.00 (1.00x)" in table[2] and table[2].endswith("105")
    assert "1.00 (0.50x)" in table[3] and "1.50 (0.50x)" in table[3] and table[3].endswith("unbounded")
    assert "batch in" not in format_table({"policies": {"fp32": entry(1, 1, 1.0, 1)}})


def test_a_step_memory_that_failed_is_said_not_shown_as_a_number():
    from mixprec.programs.bench.memory_report import budget_lines, memory_lines

    results = {"settings": {"memory_budget": "1GiB"},
               "policies": {"fp32": {"step_memory": {"error": "RuntimeError: boom"},
                                     "memory_budget": {"error": "ValueError: cannot resize", "budget": "1GiB"}}}}
    assert "- fp32: not measured (RuntimeError: boom)" in memory_lines(results)
    assert "  fp32: not measured (ValueError: cannot resize)" in budget_lines(results)
    assert memory_lines({"policies": {"fp32": {"step_memory": None}}}) == []


def test_memory_budget_flag_is_validated_naming_it(tmp_path, capsys):
    status = main(["bench", "--config", "tiny", "--steps", "5", "--out", str(tmp_path), "--memory-budget", "4 GiBs"])
    assert status == 2
    assert "bench memory_budget='4 GiBs' is not a memory size" in capsys.readouterr().err


@pytest.mark.slow   # default set: the recompute bench's two planning rows (bf16-lean and its recompute row) check the
# one plan measured once and pinned for every quality run and timing worker (test_a_recompute_row_is_its_own_row_...)
def test_every_worker_of_a_bench_runs_the_one_attention_plan_measured_once(tmp_path, capsys):
    """Issue 25: each policy's worker measured its own attention plan (bf16-sr ran ``matmul``, the others
    ``fused``; one shape read 120.4 ms in one worker, 15.2 ms in another), so the speed column compared different
    kernels. Now the runner measures the plan once, before any worker starts, and every row's worker pins it; the
    console and report.md print that one plan, once."""
    out = tmp_path / "out"
    main(["bench", "--config", "tiny", "--policies", "bf16-mixed,bf16-sr", "--steps", "5", "--seeds", "1",
          "--eval-every", "0", "--out", str(out), "--device", "cpu", "--max-loss-delta", "1.0"])
    results = json.loads((out / "results.json").read_text())
    plan = results["op_plan"]
    assert plan["measured_with"] == "bf16-mixed" and plan["dtype"] == "bfloat16" and plan["pid"] == os.getpid()
    chosen = {e["shape"]: e["chosen"] for e in plan["entries"]}
    assert {key.split()[-1] for key in chosen} == {"fwd+bwd", "fwd"}      # the training and the eval key
    for e in plan["entries"]:
        # measured in this run; on a busy machine the measurement may not replace the cached choice, which then
        # runs (source "cache", docs/op-plan.md): either way every candidate has a time
        assert e["source"].startswith(("measured", "cache")) and all(e["times_ms"][c] > 0 for c in ("fused", "fused-fp32"))
    for name in ("bf16-mixed", "bf16-sr"):
        assert plan["policies"][name] == {"dtype": "bfloat16", "pinned": chosen, "not_offered": {}}
        ran = results["policies"][name]["op_plan"]   # the row's one worker (quality and timing): the pinned plan
        assert {e["shape"]: e["chosen"] for e in ran} == chosen and {e["source"] for e in ran} == {"bench"}
    assert results["policies"]["bf16-mixed"]["pid"] != results["policies"]["bf16-sr"]["pid"] != os.getpid()
    console, report = capsys.readouterr().out, (out / "report.md").read_text()
    assert console.count("attention plan: measured once under bf16-mixed") == 1
    assert "every worker ran this plan" in console and "did not run the bench's plan" not in console
    for key, choice in chosen.items():
        assert console.count(f"{key} -> {choice}") == 1 and report.count(f"`{key}`") == 1
    assert report.count("## Op plan") == 1 and "every worker ran this plan" in report


def test_a_worker_that_did_not_run_the_pinned_plan_is_named():
    """The check behind "every worker ran this plan": a row whose engine planned a key itself, or chose otherwise,
    is named with the key, its choice and its source (console and report.md)."""
    from mixprec.programs.bench.report import op_plan_lines, plan_deviations

    key = "sdpa q[2, 4, 8, 16] k[2, 4, 8, 16] v[2, 4, 8, 16] bfloat16 causal=True mask=none dropout=False " \
          "scale=default gqa=False fwd+bwd"
    entry = {"op": "scaled_dot_product_attention", "shape": key, "chosen": "matmul", "source": "measured",
             "times_ms": {"fused": 2.0, "fused-fp32": 1.9, "matmul": 1.0}, "note": ""}
    plan = {"measured_with": "bf16-mixed", "dtype": "bfloat16", "pid": 1, "entries": [entry],
            "policies": {n: {"dtype": "bfloat16", "pinned": {key: "matmul"}, "not_offered": {}}
                         for n in ("bf16-mixed", "bf16-sr")}}
    pinned = {"shape": key, "chosen": "matmul", "source": "bench"}
    results = {"op_plan": plan, "policies": {"fp32": {"op_plan": []}, "bf16-mixed": {"op_plan": [pinned]},
                                             "bf16-sr": {"op_plan": [{**pinned, "chosen": "fused",
                                                                      "source": "measured (noisy: ...)"}]}},
               "timing": {"op_plan": {"bf16-mixed": [pinned], "bf16-sr": [pinned]}}}
    assert plan_deviations(results) == [f"bf16-sr did not run the bench's plan at `{key}`: fused (measured (noisy: ...))"]
    results["policies"]["bf16-sr"]["op_plan"] = [pinned]
    results["timing"]["op_plan"]["bf16-sr"] = [{**pinned, "chosen": "fused"}]
    assert plan_deviations(results) == [f"bf16-sr (its timing worker) did not run the bench's plan at `{key}`: "
                                        "fused (bench)"]
    results["timing"]["op_plan"]["bf16-sr"] = [pinned]
    lines = op_plan_lines(results)
    assert plan_deviations(results) == [] and lines[-1].strip().startswith("every worker ran this plan")
    assert lines[1].strip() == f"{key} -> matmul (measured; fused 2.00 ms, fused-fp32 1.90 ms, matmul 1.00 ms)"


def test_tiny_bench_times_the_policies_on_their_quality_steps_taking_turns(tiny_bench):
    """Issue 36: one pass. The rows' resident workers take turns (3 steps each at 10 steps), so each row's step time is
    the median of its own quality steps (``step_time_ms_per_step``) after the warm-up, each turn's first step left
    out; the table's speedups are those medians' ratios."""
    from mixprec.programs.bench.schedule import block_steps_for, warmup_steps_for

    _, out, results = tiny_bench
    timing = results["timing"]
    assert timing["method"] == "interleaved" and timing["one_pass"] and timing["block_steps"] == block_steps_for(10) == 3
    assert timing["blocks"] == 4                                     # ceil(10 / 3) rounds of turns
    assert set(timing["step_ms"]) == {"fp32", "bf16-mixed", "torch-autocast"} and not timing["errors"]   # fp16-mixed was SKIPPED
    from mixprec.programs.bench.interleaved import TIMING_MALLOC_ENV   # the workers' malloc keeps its heap (no per-step faults)
    assert timing["malloc_env"] == {k: os.environ.get(k, v) for k, v in TIMING_MALLOC_ENV.items()}
    assert isinstance(timing["noisy"], bool)
    timed_steps = [i for i in range(warmup_steps_for(10), 10) if i % 3 != 0]   # turns start at steps 0, 3, 6, 9
    assert timed_steps == [2, 4, 5, 7, 8]
    for name, step in timing["step_ms"].items():
        e = results["policies"][name]
        assert e["step_time_ms_median"] == step["median"] and e["step_time_ms_p10"] <= step["median"] <= step["p90"]
        assert timing["spread_raw"][name] == pytest.approx(step["p90"] / step["p10"], abs=1e-3)   # three rows: the
        own = statistics.median(e["step_time_ms_per_step"][i] for i in timed_steps)           # drift divided out
        if timing["retimed"]:   # a noisy pass was timed again after the quality runs; the pass's median is kept
            assert e["sequential_step_time_ms_median"] == own and e["timed_steps"] == 4 * 5
        else:
            assert e["step_time_ms_median"] == own and e["timed_steps"] == 5
    if not timing["retimed"]:   # the noise decision's spreads, from each step's time and round (turn r: steps 3r..3r+2)
        from mixprec.programs.bench.noise import drift_corrected_spreads

        tagged = {n: [(i // 3, results["policies"][n]["step_time_ms_per_step"][i]) for i in timed_steps]
                  for n in timing["step_ms"]}
        assert timing["drift_corrected"] and timing["spread"] == drift_corrected_spreads(tagged)
    bf16 = results["policies"]["bf16-mixed"]
    assert bf16["speedup_vs_fp32"] == pytest.approx(timing["step_ms"]["fp32"]["median"] / timing["step_ms"]["bf16-mixed"]
                                                    ["median"])
    assert "timing: interleaved in one pass (4 rounds of 3 steps per row" in (out / "report.md").read_text()
    assert "malloc: MALLOC_MMAP_THRESHOLD_=" in (out / "report.md").read_text()


@pytest.mark.slow   # default set: the interleaved noise decision and its missing speed verdict under a real noisy
# neighbour (test_a_real_noisy_neighbour_is_said_...), the CLI's noisy path end to end under --timing sequential
# (test_noisy_sequential_timing_...) and console / report.md / plot reading the one decision (test_noisy_is_one_...)
def test_noisy_interleaved_timing_is_said_and_gives_no_speed_verdict(tmp_path, capsys, monkeypatch):
    """Console, report.md and results.json agree on noisy timings, and no speed verdict is given. One seed and no eval
    points: this CLI run took over 300 s with them on a loaded machine (issue 25); the noise path is the same."""
    from mixprec.programs.bench import noise

    monkeypatch.setattr(noise, "SPREAD_LIMIT", 1.0)   # any spread is "noisy": the path, deterministically
    out = tmp_path / "out"
    status = main(["bench", "--config", "tiny", "--policies", "bf16-mixed", "--steps", "5", "--out", str(out),
                   "--device", "cpu", "--min-speedup", "0.01", "--seeds", "1", "--eval-every", "0"])
    results = json.loads((out / "results.json").read_text())
    assert results["timing"]["noisy"] and results["timing"]["retimed"] == 1   # timed again after the pass, still noisy
    bf16 = results["policies"]["bf16-mixed"]
    assert status == 1 and bf16["verdict"] == "FAIL"          # a speed target cannot be judged on noisy timings
    assert "speedup not measured" in bf16["reason"] and "timings noisy: no speed verdict" in bf16["reason"]
    assert "TIMINGS NOISY" in capsys.readouterr().out and "TIMINGS NOISY" in (out / "report.md").read_text()


_NEIGHBOUR = """
import time
while True:      # a noisy neighbour, in phase with the others (wall clock): busy 20 ms, idle 20 ms, until killed
    if int(time.time() / 0.02) % 2 == 0:
        pass
    else:
        time.sleep(0.02 - time.time() % 0.02)
"""


def test_a_real_noisy_neighbour_is_said_and_gives_no_speed_verdict(tmp_path):
    """Busy-loop processes (three per core, all busy for 20 ms then idle for 20 ms, in phase) share the CPU
    with the bench's one pass (its resident workers taking turns, :class:`~mixprec.programs.bench.turns.Turns`): a
    tiny step (~3 ms) runs either beside them (at about a third of the CPU) or alone, so the p90/p10 spread of the
    rows' timed quality steps exceeds SPREAD_LIMIT, and again in the re-timing; the one noise decision says so, the
    timing lines say TIMINGS NOISY and no speed verdict is given. (Phases of 0.15-0.2 s were not enough: short
    rounds could fall inside one phase and read 1.19.) Only the pass runs beside the neighbours (the whole CLI bench
    took over 300 s there on a loaded machine); the CLI's noisy path is
    test_noisy_interleaved_timing_is_said_and_gives_no_speed_verdict's."""
    import subprocess
    import sys

    from mixprec.programs.bench.noise import settle_noise
    from mixprec.programs.bench.report import timing_lines
    from mixprec.programs.bench.turns import Turns, with_step_times

    specs = {name: RunSpec(workload="gpt", policy=name, steps=24, config="tiny", device="cpu", warmup_steps=2)
             for name in ("fp32", "bf16-mixed", "bf16-pure")}   # three rows: the spread with the common drift taken out
    neighbours = [subprocess.Popen([sys.executable, "-c", _NEIGHBOUR]) for _ in range(3 * (os.cpu_count() or 2))]
    try:
        with Turns(specs, {n: n for n in specs}, tmp_path, dict(os.environ)) as turns:
            turns.build()
            turns.train(6)
            rows = turns.finish()
            assert not turns.failed and all(r.error is None for r in rows.values())
            first = settle_noise({"method": "interleaved", "one_pass": True, "blocks": turns.rounds, "block_steps": 6},
                                 rows, tagged=turns.tagged())
            retimed_tagged = turns.retime(list(specs), 4)
            retimed = with_step_times(rows, retimed_tagged)
    finally:
        for p in neighbours:
            p.kill()
            p.wait()
    assert first["noisy"] and all(r.timed_steps == 24 - 2 - 3 for r in rows.values())   # turns start at 0, 6, 12, 18
    assert first["drift_corrected"]   # a neighbour's bursts are not a drift common to every row: still noisy
    settled = settle_noise(first, retimed, tagged=retimed_tagged)
    assert settled["noisy"] and max(settled["spread"].values()) > settled["spread_limit"], settled["spread"]
    rows = {n: replace(r, peak_memory_mb=100.0) for n, r in retimed.items()}
    bf16 = judge_policies(rows, Targets(min_speedup=0.01), noisy=settled["noisy"])["bf16-mixed"]
    assert bf16.verdict == "FAIL" and "speedup not measured" in bf16.reason and "no speed verdict" in bf16.reason
    assert any(line.startswith("TIMINGS NOISY") for line in timing_lines({"timing": settled, "settings": {}}))


def test_noisy_sequential_timing_is_said_everywhere_and_gives_no_speed_verdict(tmp_path, capsys, monkeypatch):
    """Issue 25: the sequential path wrote ``"noisy": false`` whatever its spreads (fp32's was 47.94 once)."""
    from mixprec.programs.bench import noise

    monkeypatch.setattr(noise, "SPREAD_LIMIT", 1.0)   # any spread is "noisy": the path, deterministically
    out = tmp_path / "out"
    status = main(["bench", "--config", "tiny", "--policies", "bf16-mixed", "--steps", "6", "--out", str(out),
                   "--device", "cpu", "--timing", "sequential", "--seeds", "1", "--eval-every", "0",
                   "--min-speedup", "0.01"])
    results = json.loads((out / "results.json").read_text())
    timing, bf16 = results["timing"], results["policies"]["bf16-mixed"]
    assert timing["method"] == "sequential" and timing["noisy"] and timing["spread_limit"] == 1.0
    assert timing["spread"]["fp32"] == pytest.approx(results["policies"]["fp32"]["step_time_ms_p90"]
                                                     / results["policies"]["fp32"]["step_time_ms_p10"], abs=1e-3)
    assert status == 1 and "timings noisy: no speed verdict" in bf16["reason"]
    console, report = capsys.readouterr().out, (out / "report.md").read_text()
    assert "TIMINGS NOISY" in console and "TIMINGS NOISY" in report
    assert "speedup (NOISY)" in console and "| speedup (NOISY) |" in report   # the ratios' own column says so
    assert "vs torch-autocast (NOISY)" in console and "speedup vs torch-autocast (NOISY)" in report
    # what test_sequential_timing_keeps_the_quality_runs_step_times asserts (slow): the quality runs' step times
    # are the table's, and sequential asks for no timing run beyond the quality runs
    assert results["seed_noise"] is None
    assert all("sequential_step_time_ms_median" not in e for e in results["policies"].values())
    assert results["portable_ops"] is None


@pytest.mark.slow   # default set: the same CLI path (--timing sequential, one seed) and these assertions in
# test_noisy_sequential_timing_is_said_everywhere_and_gives_no_speed_verdict
def test_sequential_timing_keeps_the_quality_runs_step_times(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "--config", "tiny", "--policies", "bf16-mixed", "--steps", "5", "--out", str(out),
                 "--device", "cpu", "--timing", "sequential", "--seeds", "1"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["timing"]["method"] == "sequential" and results["seed_noise"] is None
    assert all("sequential_step_time_ms_median" not in e for e in results["policies"].values())
    assert results["portable_ops"] is None   # sequential asks for no timing run beyond the quality runs (46 steps)


def test_tiny_bench_skips_non_native_fp16(tiny_bench):
    _, _, results = tiny_bench
    fp16 = results["policies"]["fp16-mixed"]
    assert fp16["verdict"] == "SKIPPED"
    assert "not native" in fp16["reason"] and "--force" in fp16["reason"]
    assert fp16["step_time_ms_median"] is None and fp16["pid"] is None  # it never ran


def test_each_policy_runs_in_its_own_process(tiny_bench):
    _, _, results = tiny_bench
    pids = [e["pid"] for e in results["policies"].values() if e["pid"] is not None]
    assert len(pids) == 3 and len(set(pids)) == 3   # fp32, bf16-mixed and the torch-autocast peer
    assert os.getpid() not in pids and results["parent_pid"] == os.getpid()


def test_same_seed_same_batches_same_start(tiny_bench):
    _, _, results = tiny_bench
    fp32, bf16 = results["policies"]["fp32"]["loss_per_step"], results["policies"]["bf16-mixed"]["loss_per_step"]
    assert fp32[0] == pytest.approx(bf16[0], rel=1e-2)  # same weights and first batch; bf16 rounding only


def test_tiny_bench_writes_report_and_plots(tiny_bench):
    _, out, results = tiny_bench
    for name in ("loss_curves.png", "loss_wallclock.png", "speed_memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    report = (out / "report.md").read_text()
    speedup = "speedup (NOISY)" if results["timing"]["noisy"] else "speedup"   # a busy machine marks the ratios
    assert f"| policy | verdict | step ms | {speedup} |" in report
    assert results["command"] in report
    assert "**fp16-mixed: SKIPPED**" in report and "**bf16-mixed: PASS**" in report
    assert "Portable ops (`ops=portable`, the default" in report and "with `ops=native`" in report
    assert "## Op plan" in report and "| scaled_dot_product_attention | `sdpa q[" in report   # the bench's one plan
    assert "every worker ran this plan" in report
    assert "## Eval loss over training (every 1 steps, nats/char)" in report and "| seed noise |" in report
    assert "![eval loss vs training time](loss_wallclock.png)" in report and " MFU is against " in report


USER_WORKLOAD = textwrap.dedent('''
    import torch
    from torch import nn
    from mixprec.workloads import Workload

    class Regression(Workload):
        """Linear targets from 16 features; a 2-layer MLP; samples per batch = 32."""
        name = "regression"
        item_unit = "samples"
        items_per_batch = 32
        default_steps = 7   # what bench runs without --steps

        def __init__(self, config):
            self.config_name = config
            self.w_true = torch.linspace(-1, 1, 16)[:, None]  # (16, 1)

        def build_model(self):
            return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

        def _batch(self, gen):
            x = torch.randn(32, 16, generator=gen)
            return {"x": x, "y": x @ self.w_true}

        def batches(self, split, seed=0):
            if split == "val":
                gen = torch.Generator().manual_seed(1234)
                return iter([self._batch(gen) for _ in range(4)])
            gen = torch.Generator().manual_seed(seed)
            return (self._batch(gen) for _ in iter(int, 1))

        def loss(self, model, batch):
            return nn.functional.mse_loss(model(batch["x"]).float(), batch["y"].float())

        def flops_per_step(self):
            return 6.0 * 32 * (16 * 64 + 64)

        def describe(self):
            return {"workload": self.name, "config": self.config_name}

    def make_workload(config="small"):
        return Regression(config)
''')


def test_user_workload_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_user_workload.py").write_text(USER_WORKLOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    # one seed, no eval points, no peer: nothing asserted here reads them (a shorter run)
    status = main(["bench", "--workload", "my_user_workload:make_workload", "--config", "wide",
                   "--policies", "bf16-mixed", "--out", str(out), "--device", "cpu", "--seeds", "1",
                   "--eval-every", "0", "--no-peer"])
    results = json.loads((out / "results.json").read_text())
    assert status == 0
    assert results["settings"]["steps"] == 7 and len(results["policies"]["fp32"]["loss_per_step"]) == 7
    assert results["workload"] == {"workload": "regression", "config": "wide"}
    bf16 = results["policies"]["bf16-mixed"]
    assert bf16["verdict"] == "PASS", bf16["reason"]
    assert bf16["item_unit"] == "samples" and bf16["tokens_per_s"] is None and bf16["items_per_s"] > 0
    assert "| samples/s |" in (out / "report.md").read_text()


def test_a_workload_without_a_loss_unit_is_not_labelled_nats(tmp_path):
    """USER_WORKLOAD (an MSE regression) sets no ``loss_unit``: its plots and eval table said "nats"."""
    from mixprec.workloads import Workload

    assert Workload.loss_unit is None
    results = _curve_results([[1, 2.0], [3, 1.6]], [[1, 2.0], [3, 1.6]], [])
    for entry in results["policies"].values():
        entry["loss_unit"] = None
    fig = plot_loss_curves(results, tmp_path / "l.png")
    assert all("nats" not in a.get_ylabel() and "unit not set" in a.get_ylabel() for a in fig.axes[:2])
    assert "nats" not in eval_curve_lines(results)[0] and "unit not set" in eval_curve_lines(results)[0]


def test_unknown_policy_is_an_error_not_a_skip(tmp_path, capsys):
    status = main(["bench", "--config", "tiny", "--policies", "bf16-mixd", "--steps", "5", "--out", str(tmp_path)])
    assert status == 2
    assert "'bf16-mixd' is not known" in capsys.readouterr().err


def test_bad_workload_is_a_clean_error(tmp_path, capsys):
    status = main(["bench", "--workload", "no_such_module_xyz:make", "--steps", "5", "--out", str(tmp_path)])
    assert status == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


def test_printed_table_splits_bytes_per_param_when_params_are_frozen():
    from mixprec.programs.bench.report import format_table

    def entry(per_param, frozen):
        state = {"n_params": 100, "n_frozen": frozen, "per_trainable_param": 16.0,
                 "per_frozen_param": 2.0 if frozen else None}
        return {"verdict": "PASS", "state_bytes_per_param": per_param, "state_bytes": state}

    lora = format_table({"policies": {"fp32": entry(4.12, 99), "bf16-mixed": entry(2.14, 99)}})
    assert "train/frozen B/param" in lora.splitlines()[0]
    assert "16.00 / 2.00" in lora.splitlines()[3]
    full = format_table({"policies": {"fp32": entry(16.0, 0)}})
    assert "frozen" not in full


def test_bench_auto_says_what_it_chose_and_the_measured_ratio(tmp_path, capsys):
    out = tmp_path / "out"
    # one seed, no eval points, no peer: nothing asserted here reads them (a shorter run)
    status = main(["bench", "--config", "tiny", "--policies", "fp32,auto", "--steps", "5", "--out", str(out),
                   "--device", "cpu", "--seeds", "1", "--eval-every", "0", "--no-peer"])
    assert status == 0
    auto = json.loads((out / "results.json").read_text())["policies"]["auto"]
    assert auto["decision"].startswith(f"auto → {auto['policy']}: measured on this model")
    assert "bf16-mixed" in auto["decision"] and "x fp32" in auto["decision"]
    assert [e["kind"] for e in auto["events"]][:1] == ["auto"]
    assert f"How auto decided: auto → {auto['policy']}: measured" in (out / "report.md").read_text()
    console = capsys.readouterr().out
    assert f"\nauto → {auto['policy']}: measured on this model" in console
    if auto["policy"] == "fp32":
        assert auto["op_plan"] == []    # its bf16 trial's plan is not this fp32 run's
    plan = [e for e in auto["op_plan"] if e["shape"].endswith("fwd+bwd")]   # a bf16 auto planned its attention
    if plan:   # the bench's one plan, measured under auto's 16-bit candidate and pinned for it
        assert f"{plan[0]['shape']} -> {plan[0]['chosen']}" in console and plan[0]["source"] == "bench"
        assert "attention plan: measured once under bf16-mixed" in console and "every worker ran this plan" in console


def test_how_to_read_says_the_rss_malloc_hint_is_the_opposite_of_the_timing_setting():
    from mixprec.programs.bench import report
    text = " ".join(report._HOW_TO_READ.split())
    assert "MALLOC_MMAP_THRESHOLD_=131072" in text and "opposite of the timing workers' setting" in text
    assert "trades step time for peak RSS" in text


def test_delta_panel_is_scaled_to_the_deltas_with_the_gate_marked_outside(tmp_path):
    """±0.2 % deltas under a 2 % gate: the Δ axis spans the deltas (issue 25: a ±2 % axis squashed them onto 0);
    the gate, far outside, is still a line and is marked at the panel's edge and in its legend."""
    from mixprec.programs.bench.figures import delta_axis_limits
    lo, hi = delta_axis_limits([0.2, -0.1, 0.05])
    assert -0.3 < lo < -0.1 and 0.2 < hi < 0.35          # the data and 0, padded, not ±2 %
    assert delta_axis_limits([]) == pytest.approx((-0.003, 0.003))   # nothing but 0: a small span round it
    fp32, bf16, seed1 = [[1, 2.0], [3, 1.6]], [[1, 2.004], [3, 1.5968]], [[1, 2.001], [3, 1.6016]]
    delta = plot_loss_curves(_curve_results(fp32, bf16, [fp32, seed1]), tmp_path / "l.png").axes[2]
    lo, hi = delta.get_ylim()
    assert -0.3 < lo < -0.2 and 0.2 < hi < 0.35, (lo, hi)   # deltas +0.2 % and -0.2 %
    labels = [t.get_text() for t in delta.get_legend().get_texts()]
    assert "gate: --max-loss-delta +2% (final eval), above the axis" in labels, labels
    assert delta.get_title() == "eval-loss delta vs fp32, axis scaled to the deltas; the gate (+2%) lies above the axis"
    assert "seed noise (fp32 at 2 seeds)" in labels       # ±0.1 % at most: inside, drawn as is


def test_loss_against_wall_clock_is_written_with_cumulative_seconds(tmp_path):
    from mixprec.programs.bench.figures import plot_loss_wallclock, wallclock_curve
    row = _entry(eval_curve=[[1, 2.5], [3, 2.0]], step_time_ms_per_step=[100.0, 200.0, 300.0])
    assert [x for x, _ in wallclock_curve(row)] == pytest.approx([0.1, 0.6])    # seconds after steps 1 and 3
    assert [v for _, v in wallclock_curve(row)] == [2.5, 2.0]
    fp32, bf16 = [[1, 2.0], [3, 1.6]], [[1, 2.02], [3, 1.6]]
    results = _curve_results(fp32, bf16, [fp32])
    results["policies"]["fp32"]["step_time_ms_per_step"] = [100.0, 100.0, 100.0]
    results["policies"]["bf16-mixed"]["step_time_ms_per_step"] = [50.0, None, 40.0]   # None: counts at the median
    fig = plot_loss_wallclock(results, tmp_path / "w.png")
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("cumulative training seconds") and ax.get_ylabel() == "eval loss (nats/char)"
    assert [list(line.get_xdata()) for line in ax.lines] == [pytest.approx([0.1, 0.3]), pytest.approx([0.05, 0.1])]
    assert [list(line.get_ydata()) for line in ax.lines] == [[2.0, 1.6], [2.02, 1.6]]


def test_mfu_peak_and_report_say_where_each_peak_comes_from():
    """A peak read from a cache another process wrote is labelled so (when, by which pid and torch) in results.json
    (``mfu_peak``, ``environment.peaks_origin``) and report.md; one measured by this process says that."""
    from mixprec.machine.matmul import MatmulPeak
    from mixprec.programs.bench.mfu import one_mfu_peak, peaks_environment
    from mixprec.programs.bench.report import peaks_line
    peaks = {"fp32": MatmulPeak("fp32", 202.7, 128, measured_at="2026-12-01T10:00:00Z", pid=1, torch="2.13.0"),
             "bf16": MatmulPeak("bf16", 860.5, 512, measured_at="2026-12-01T10:00:01Z", pid=1, torch="2.13.0"),
             "fp16": MatmulPeak("fp16", 0.5, 128, measured_at="2026-12-01T11:00:00Z", pid=os.getpid(), torch="x"),
             "fp8": MatmulPeak("fp8", 0.1, 128)}
    rows = {"fp32": PolicyRun(gflops_per_s=43.0, mfu=0.2)}
    mfu_peak, rows = one_mfu_peak(rows, peaks)
    assert mfu_peak == {"dtype": "bf16", "gflops_per_s": 860.5, "n": 512, "measured_at": "2026-12-01T10:00:01Z",
                        "measured_by_pid": 1, "torch": "2.13.0", "unreliable": None,
                        "source": "cached: measured 2026-12-01T10:00:01Z by pid 1, torch 2.13.0"}
    assert rows["fp32"].mfu == pytest.approx(43.0 / 860.5) and rows["fp32"].mfu_own_dtype == 0.2
    env = peaks_environment(peaks)
    assert env["peaks_gflops_per_s"]["fp32"] == 202.7 and env["peaks_matmul_n"]["bf16"] == 512
    assert env["peaks_origin"]["fp16"] == "measured by this process at 2026-12-01T11:00:00Z"
    assert env["peaks_origin"]["fp8"] == "cached; when and by which process not recorded (an older cache file)"
    line = peaks_line({"environment": env, "mfu_peak": mfu_peak})
    assert "fp32 202.7 at 128³ (cached: measured 2026-12-01T10:00:00Z by pid 1, torch 2.13.0)" in line
    assert "MFU is against bf16's 860.5 (cached: measured 2026-12-01T10:00:01Z by pid 1, torch 2.13.0)." in line


def test_a_peak_below_what_a_row_achieved_gives_no_mfu_and_says_why():
    """A busy machine's peak (fp32 1.4 GFLOP/s, bf16 89.7) put a row at 8455 % of it; a peak below an achieved
    rate is no peak: MFU is not shown, results.json and report.md say why, and the step profile's share too."""
    from mixprec.machine.matmul import MatmulPeak
    from mixprec.programs.bench.mfu import one_mfu_peak, peaks_environment
    from mixprec.programs.bench.report import peaks_line
    from mixprec.programs.bench.step_profile import step_profile_lines
    peaks = {"fp32": MatmulPeak("fp32", 1.4, 256), "bf16": MatmulPeak("bf16", 89.7, 1024)}
    rows = {"fp32": PolicyRun(gflops_per_s=120.0, mfu=85.7), "bf16-mixed": PolicyRun(gflops_per_s=60.0, mfu=0.67)}
    mfu_peak, rows = one_mfu_peak(rows, peaks)
    assert all(r.mfu is None and r.mfu_own_dtype is None for r in rows.values())
    assert mfu_peak["unreliable"].startswith("fp32 achieved more than the measured peak: it was measured on a busy")
    assert "**No MFU**: fp32 achieved more than the measured peak" in peaks_line(
        {"environment": peaks_environment(peaks), "mfu_peak": mfu_peak})
    cats = {c: {"ms": 1.0, "share": 0.1, "calls": 1} for c in ("matmul", "attention", "elementwise", "optimizer",
                                                                 "casts", "python/other")}
    profile = {"step_ms": 10.0, "categories": cats, "matmul_gflops_per_s": 120.4, "matmul_peak_dtype": "fp32",
               "matmul_peak_gflops_per_s": 1.4, "matmul_of_peak": None}
    (line,) = step_profile_lines({"policies": {"fp32": {"step_profile": profile}}})[1:]
    assert line.endswith("matmul 120.4 GFLOP/s, above the fp32 1.4 peak (measured on a busy machine)")


def test_cached_peaks_keep_when_and_by_whom_they_were_measured(tmp_path, monkeypatch):
    from mixprec.machine import matmul
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    # a 128³ product takes microseconds: its spread is noise whatever the load, so the measurement is marked quiet
    # here (the noisy rule itself: tests/machine/test_matmul_peaks.py)
    monkeypatch.setattr(matmul, "measure_peaks",
                        lambda device: {"fp32": replace(matmul.measure_matmul("fp32", device, n=128), spread=1.0,
                                                        note="")})
    fresh = matmul.cached_peaks("cpu")["fp32"]
    assert fresh.n == 128 and fresh.pid == os.getpid() and fresh.torch == torch.__version__ and fresh.measured_at
    assert matmul.cached_peaks("cpu")["fp32"] == fresh                  # read back from the file, provenance kept
    assert matmul.peak_origin(fresh).startswith("measured by this process")
    assert matmul.peak_origin(replace(fresh, pid=fresh.pid + 1)).startswith(f"cached: measured {fresh.measured_at} by pid")


def test_a_policy_in_another_dtype_pins_the_plan_at_its_own_keys_and_says_what_it_cannot_use():
    """The bench's one plan, measured under bf16, pinned for an fp16 policy (issue 25): the same choices at its fp16
    keys (:func:`op_plan.retarget`), and where a choice is bf16-only (``matmul``) the console and report.md say so."""
    from mixprec.autocast import op_plan
    from mixprec.programs.bench.pinned_plan import measure_bench_plan, pinned_for
    from mixprec.programs.bench.report import op_plan_lines

    config = BenchConfig(out=None, config="tiny", steps=5, policies=("bf16-mixed", "fp16-mixed", "bf16-pure"))
    names = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]
    plan = measure_bench_plan(config, torch.device("cpu"), NO_FP16_CPU, names, dict.fromkeys(names), False)
    chosen = {e["shape"]: e["chosen"] for e in plan["entries"]}
    assert plan["measured_with"] == "bf16-mixed" and set(plan["policies"]) == {"bf16-mixed", "fp16-mixed", "bf16-pure"}
    assert pinned_for(plan, "bf16-pure") == pinned_for(plan, "bf16-mixed") == chosen and pinned_for(plan, "fp32") == {}
    fp16, refused = op_plan.retarget(chosen, torch.float16)
    assert plan["policies"]["fp16-mixed"] == {"dtype": "float16", "pinned": fp16, "not_offered": refused}
    assert all(" float16 " in key for key in fp16) and len(fp16) == len(chosen) == 2
    key = next(iter(fp16))
    plan["policies"]["fp16-mixed"]["not_offered"] = {key: "matmul not offered under fp16 (...): runs fused"}
    lines = op_plan_lines({"op_plan": plan, "policies": {}})
    assert f"  fp16-mixed at {key.split(' causal=')[0]}: matmul not offered under fp16 (...): runs fused" in lines


# --- recompute rows (issue 27) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def recompute_bench(tmp_path_factory):
    """A tiny bench with bf16-lean and its recompute row, every block recomputed whole (a named plan: no timing
    decides it, so the saved-bytes relation below is the plan's, not the machine's)."""
    out = tmp_path_factory.mktemp("bench") / "out"
    argv = ["bench", "--config", "tiny", "--policies", "bf16-lean,bf16-lean+recompute", "--recompute", "blocks.*",
            "--steps", "5", "--seeds", "1", "--eval-every", "0", "--out", str(out), "--device", "cpu",
            "--max-loss-delta", "1.0"]
    status = main(argv)
    return status, out, json.loads((out / "results.json").read_text())


def test_a_recompute_row_is_its_own_row_with_its_plan_and_its_step_time_against_the_plain_row(recompute_bench, capsys):
    """Issue 27: the bench could not show the recompute plan (failed before: ``bf16-lean+recompute`` was an unknown
    policy, exit status 2). Now it is a row of its own: trained in its own worker with MixedPrecision(recompute=),
    judged against fp32, its plan stored and printed, its step time over the plain row's from the same timing."""
    status, out, results = recompute_bench
    assert status == 0
    rows = results["policies"]
    assert list(rows) == ["fp32", "bf16-lean", "bf16-lean+recompute", "torch-autocast"]   # the peer last
    plain, row = rows["bf16-lean"], rows["bf16-lean+recompute"]
    assert row["requested"] == row["policy"] == "bf16-lean" and row["verdict"] == "PASS", row["reason"]
    assert row["pid"] not in (plain["pid"], rows["fp32"]["pid"])
    assert row["recompute"] == "blocks.*" and plain["recompute"] is None and plain["recompute_plan"] is None
    assert results["settings"]["recompute"] == "blocks.*"
    plan = row["recompute_plan"]
    assert [(b["name"], b["mode"]) for b in plan["blocks"]] == [("blocks.0", "full"), ("blocks.1", "full")]
    assert plan["text"] == "recompute plan blocks.*: blocks.0 full, blocks.1 full" and "2 full" in row["decision"]
    # the whole forward of each block is recomputed: autograd keeps only each block's input there
    assert 0 < row["saved_activation_bytes"] < plain["saved_activation_bytes"]
    assert row["saved_activation_ratio_vs_fp32"] == row["saved_activation_bytes"] / rows["fp32"]["saved_activation_bytes"]
    assert row["step_time_ratio_vs_no_recompute"] == row["step_time_ms_median"] / plain["step_time_ms_median"]
    assert plain["step_time_ratio_vs_no_recompute"] is None
    assert results["timing"]["method"] == "interleaved" and set(results["timing"]["step_ms"]) == set(rows)
    # recompute runs the forward again under the same autocast state: the same losses, bit for bit (CPU, fixed
    # shapes and threads: deterministic ops; the stochastic rounding draws the same seeded stream)
    assert row["loss_per_step"] == plain["loss_per_step"] and row["final_eval_loss"] == plain["final_eval_loss"]
    report = (out / "report.md").read_text()
    assert "## Recompute plan" in report and "- bf16-lean+recompute: plan blocks.*: 2 full" in report
    assert "  - blocks.1: full" in report and "| bf16-lean+recompute | PASS |" in report
    # the bench's one attention plan (issue 25), measured once in this process before any worker and pinned for
    # both planning rows: each quality run's engine and each timing worker's ran it, nothing else (also asserted
    # with two policies by test_every_worker_of_a_bench_runs_the_one_attention_plan_measured_once, slow)
    plan = results["op_plan"]
    chosen = {e["shape"]: e["chosen"] for e in plan["entries"]}
    assert plan["pid"] == os.getpid() and {key.split()[-1] for key in chosen} == {"fwd+bwd", "fwd"}
    for e in plan["entries"]:
        # measured in this run; on a busy machine the measurement may not replace the cached choice, which then
        # runs (source "cache", docs/op-plan.md): either way every candidate has a time
        assert e["source"].startswith(("measured", "cache")) and all(e["times_ms"][c] > 0 for c in ("fused", "fused-fp32"))
    assert plan["policies"]["bf16-lean"] == {"dtype": "bfloat16", "pinned": chosen, "not_offered": {}}
    for name in ("bf16-lean", "bf16-lean+recompute"):   # each row's one worker (its quality steps are its timed ones)
        ran = rows[name]["op_plan"]
        assert {e["shape"]: e["chosen"] for e in ran} == chosen and {e["source"] for e in ran} == {"bench"}, name
    assert report.count("## Op plan") == 1 and "every worker ran this plan" in report


def test_a_recompute_row_name_splits_into_its_policy():
    from mixprec.programs.bench.recompute_rows import split_row

    assert split_row("bf16-lean+recompute") == ("bf16-lean", True) and split_row("bf16-lean") == ("bf16-lean", False)


@pytest.mark.parametrize("value, words", [("auto:0.5", "must be a number >= 1"), ("nope:blocks.*", "is not allowed"),
                                          ("", "must be 'auto'")])
def test_bench_recompute_is_validated_naming_it(value, words, tmp_path, capsys):
    with pytest.raises((ValueError, TypeError), match=words):
        BenchConfig(out=tmp_path, recompute=value)
    status = main(["bench", "--config", "tiny", "--steps", "5", "--out", str(tmp_path), "--recompute", value])
    assert status == 2 and words in capsys.readouterr().err


def test_report_header_takes_the_batch_size_from_the_rows_when_describe_leaves_it_out():
    """A custom workload's describe() returned {}: the header read "? items per step" although every row had
    recorded items_per_batch=64 and used it for samples/s."""
    from mixprec.programs.bench.report import report_markdown

    results = _report_results(_INTERLEAVED)
    for e in results["policies"].values():
        e.update(items_per_batch=64, item_unit="samples")
    assert "; 64 samples per step; data:" in report_markdown(results)
