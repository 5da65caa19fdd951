"""Tests for the mixprec command line (train, sample, doctor, bench flags), checkpoints and doctor."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys
import warnings

import pytest
import torch

from mixprec.programs.bench.runner import DEFAULT_POLICIES, DEFAULT_STEPS
from mixprec.workloads import GPTWorkload
from mixprec.programs.session import build_engine, train_step
from mixprec.checkpoint.local import load_checkpoint, read_manifest, save_checkpoint
from mixprec.programs.cli import build_parser, main
from mixprec.optim import c_kernels
from mixprec.machine.matmul import measure_matmul
from mixprec.workloads import get_workload


def test_python_dash_m_mixprec_help():
    done = subprocess.run([sys.executable, "-m", "mixprec", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for command in ("bench", "train", "sample", "doctor"):
        assert command in done.stdout


def test_version_prints_the_package_version(capsys):
    import mixprec

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"mixprec {mixprec.__version__}\n"


@pytest.mark.parametrize("argv, command, option", [
    (["bench", "--polices", "x"], "bench", "--policies"),
    (["train", "--stepz", "3"], "train", "--steps"),
    (["doctor", "--jsn"], "doctor", "--json"),
])
def test_a_misspelled_subcommand_flag_gets_that_subcommands_usage(argv, command, option, capsys):
    """Issue 25: `mixprec bench --polices x` printed the top-level usage (`usage: mixprec [-h] {bench,...}`)
    and `mixprec: error`, so the user never saw bench's options."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith(f"usage: mixprec {command} [-h]"), err
    assert f"mixprec {command}: error: unrecognized arguments:" in err and f"did you mean {option}?" in err
    with pytest.raises(SystemExit):          # an unknown option before the subcommand stays the top level's
        main(["--polices", "bench"])
    assert capsys.readouterr().err.startswith("usage: mixprec [-h] [--version] {bench,")


def test_bench_defaults_and_policy_list_parsing():
    args = build_parser().parse_args(["bench"])
    assert (args.workload, args.config, args.steps, args.lora) == ("gpt", None, None, None)  # steps: the workload's
    assert GPTWorkload.default_steps == DEFAULT_STEPS
    assert args.policies == DEFAULT_POLICIES and args.max_loss_delta == 0.02
    assert args.min_speedup is None and args.max_memory_ratio is None and not args.force
    args = build_parser().parse_args(["bench", "--policies", "fp32,bf16-kahan,state=bf16,bf16-sr"])
    assert args.policies == ("fp32", "bf16-kahan,state=bf16", "bf16-sr")


def test_bench_rejects_too_few_steps(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--config", "tiny", "--steps", "3", "--out", str(tmp_path)])
    assert done.value.code == 2 and "argument --steps: 3 is below 5" in capsys.readouterr().err


def test_train_then_sample(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--workload", "gpt", "--config", "tiny", "--policy", "bf16-pure", "--steps", "12",
                 "--eval-every", "5", "--out", str(out), "--device", "cpu"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert {"step", "loss", "applied", "skipped_reason", "loss_scale", "grad_norm", "lr", "step_time_ms"} <= set(train[0])
    assert [r["step"] for r in evals] == [5, 10, 12] and evals[-1]["eval_loss"] > 0
    manifest = read_manifest(out / "checkpoints")
    assert manifest["policy"] == "bf16-pure" and manifest["counters"]["applied_steps"] == 12
    assert set(manifest["files"]) == {"model.safetensors", "masters.safetensors", "state.safetensors"}
    assert manifest["model"]["aliases"] == {"lm_head.weight": "wte.weight"}
    assert manifest["extra"]["workload"]["data"]["vocab"]  # the vocabulary travels with the weights
    capsys.readouterr()
    assert main(["sample", str(out), "--prompt", "The ", "--tokens", "40", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text.rstrip("\n")) >= 40


def test_checkpoint_round_trip_keeps_fp32_masters(tmp_path):
    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, "bf16-pure", steps=5, seed=0, device="cpu")
    batches = workload.batches("train", 0)
    for _ in range(3):
        train_step(mp, workload, next(batches))
    save_checkpoint(tmp_path / "ck", mp, extra={"note": "x"})
    save_checkpoint(tmp_path / "ck", mp, extra={"note": "y"})  # a second save at the same step: latest moves
    fresh = build_engine(workload, "bf16-pure", steps=5, seed=1, device="cpu")
    assert load_checkpoint(tmp_path / "ck", fresh) == {"note": "y"}
    for (_, m_saved), (_, m_loaded) in zip(mp.masters.pairs, fresh.masters.pairs):
        assert torch.equal(m_saved, m_loaded)
    for p_saved, p_loaded in zip(mp.model.parameters(), fresh.model.parameters()):
        assert p_loaded.dtype == torch.bfloat16 and torch.equal(p_saved, p_loaded)
    fp32 = build_engine(workload, "fp32", steps=5, seed=1, device="cpu")
    load_checkpoint(tmp_path / "ck", fp32, convert=True)  # an fp32 model takes the fp32 masters, not the bf16 rounding
    masters = dict(zip((id(p) for p, _ in mp.masters.pairs), (m for _, m in mp.masters.pairs)))
    for p_saved, p_fp32 in zip(mp.model.parameters(), fp32.model.parameters()):
        assert torch.equal(masters[id(p_saved)], p_fp32)
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]  # no temporary files left


def test_corrupt_checkpoint_is_refused(tmp_path):
    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, "fp32", steps=5, seed=0, device="cpu")
    save_checkpoint(tmp_path / "ck", mp)
    with open(tmp_path / "ck" / "step-0" / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ValueError, match="sha256"):
        load_checkpoint(tmp_path / "ck", mp)
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_manifest(tmp_path)


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"torch", "python", "platform", "devices"} <= set(report)
    cpu = report["devices"][0]
    assert cpu["device"] == "cpu" and "cpu_flags" in cpu
    assert set(cpu["dtypes"]) == set(cpu["matmul"]) == {"fp32", "bf16", "fp16", "fp8"}
    assert cpu["dtypes"]["bf16"] == {"autocast": True, "matmul": True}
    assert cpu["matmul"]["fp32"]["gflops_per_s"] > 0
    assert cpu["auto_policy"] in ("fp32", "bf16-mixed") and cpu["auto_reason"].startswith("auto")
    assert "exp" in cpu["autocast_ops"]["ported"]["fp32"] and "mm" in cpu["autocast_ops"]["own kernel"]["lower_precision"]
    expected = "fused C kernel" if c_kernels.compiler() else ("torch ops: no C compiler (set CC, or install cc, gcc or "
                                                              "clang) (the same bits as the kernel, a 2-4x slower optimizer step)")
    assert report["adamw_8bit_cpu"] == expected
    library = report["adamw_8bit_cpu_library"]
    assert (library is not None) == (expected == "fused C kernel")
    assert library is None or (Path(library).is_file() and Path(library).parent.name == "c-kernels")


def test_doctor_says_how_int8_state_steps_run(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "8-bit-state AdamW steps on a CPU (state=int8|fp8, bf16-lean): " in out
    if c_kernels.compiler():   # where the kernel runs, the doctor names its file and how to turn it off
        assert "checked bit for bit against the torch-op reference at load; built with " in out
        assert ".so (MIXPREC_C_KERNELS=0 turns it off)" in out


def test_measure_matmul_stays_small_when_slow():
    peak = measure_matmul("fp32", "cpu", budget_s=0.01, max_n=4096)
    assert 128 <= peak.n <= 1024 and peak.gflops_per_s > 0  # a 10 ms budget stops the doubling early
    with pytest.raises(ValueError, match="dtype_name"):
        measure_matmul("int8", "cpu")


def test_resume_under_another_policy_names_the_cli_fix(tmp_path, capsys):
    from mixprec.programs.cli import main as cli_main

    out = tmp_path / "run"
    common = ["train", "--workload", "gpt", "--config", "tiny", "--steps", "2", "--checkpoint-every", "1",
              "--out", str(out)]
    assert cli_main([*common, "--policy", "fp32"]) == 0
    assert cli_main([*common, "--policy", "bf16-mixed", "--resume"]) == 2
    assert "resume with --policy 'fp32'" in capsys.readouterr().err


def test_sample_reads_a_dcp_checkpoint_like_a_one_process_one(tmp_path, capsys):
    """`mixprec sample` on a torch.distributed.checkpoint (FSDP2 format) run: the weights are gathered into
    a plain model; the text equals sampling the same weights from a one-process checkpoint."""
    from mixprec.checkpoint.dcp import save as save_distributed_checkpoint

    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, "fp32", steps=5, seed=0, device="cpu")   # no masters: DCP-saveable
    batches = workload.batches("train", 0)
    for _ in range(3):
        train_step(mp, workload, next(batches))
    extra = {"workload": workload.describe()}
    save_distributed_checkpoint(tmp_path / "dcp_run", mp, extra=extra)
    save_checkpoint(tmp_path / "plain_run", mp, extra=extra)
    assert (next((tmp_path / "dcp_run").glob("step-*")) / "dcp").is_dir()
    texts = []
    for run in ("dcp_run", "plain_run"):
        capsys.readouterr()
        assert main(["sample", str(tmp_path / run), "--prompt", "The ", "--tokens", "30", "--seed", "3",
                     "--device", "cpu"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("The ")


def test_cli_warnings_are_one_line_without_the_source_echo(capsys):
    """A warning during a command prints as 'Category: message', not Python's file:line + source line."""
    import warnings

    from mixprec.programs.cli import _one_line_warning

    text = _one_line_warning(UserWarning("the LR schedule was saved for 10 steps"), UserWarning, "/x/y.py", 12,
                             line="    warnings.warn(...)")
    assert text == "UserWarning: the LR schedule was saved for 10 steps\n"
    before = warnings.formatwarning
    from mixprec.programs.cli import main
    assert main(["bench", "--memory-budget", "4XB"]) == 2   # a bad argument: the error path
    assert warnings.formatwarning is before       # restored after the command


def test_doctor_prints_one_bf16_ratio_at_one_size(monkeypatch, capsys):
    """Issue 25: the table's bf16 ratio was bf16 at 512³ over fp32 at 128³ (5.13) and the auto line said 4.22×
    (both at 512³). Now the table's ratio is the probe's, both dtypes at 512³, and the auto line repeats no number."""
    from mixprec.machine import capability
    from mixprec.machine.matmul import MatmulPeak
    from mixprec.programs import doctor
    cap = capability.Capability(device="cpu", bf16=True, fp16=True, bf16_fast=True, fp16_native=False,
                                bf16_speed_ratio=4.22, fp16_speed_ratio=0.003,
                                detail="measured matmul speed vs fp32: bf16 4.22x (512^3), fp16 0.0030x (256^3)")
    peaks = {"fp32": MatmulPeak("fp32", 145.7, 128), "bf16": MatmulPeak("bf16", 747.5, 512),
             "fp16": MatmulPeak("fp16", 0.44, 128), "fp8": MatmulPeak("fp8", 0.1, 256)}
    timed = []
    monkeypatch.setattr(capability, "_probe_cached", lambda key: cap)
    monkeypatch.setattr(doctor, "_visible_devices", lambda: [torch.device("cpu")])
    monkeypatch.setattr(doctor, "cached_peaks", lambda device: peaks)
    monkeypatch.setattr(doctor, "measure_matmul", lambda name, device, n: timed.append((name, n)) or
                        MatmulPeak(name, 200.0, n))
    report = doctor.run_doctor(measure=False)
    ratios = report["devices"][0]["matmul_vs_fp32"]
    assert ratios["bf16"]["ratio"] == 4.22 and ratios["bf16"]["n"] == 512
    assert ratios["fp8"] == {"ratio": 0.0005, "n": 256, "source": "fp32 timed at the same size"}
    assert timed == [("fp32", 256)]                        # fp32 again at fp8's size, nothing else
    text = doctor.format_doctor(report)
    assert "5.13" not in text and text.count("4.22") == 1, text
    bf16_row = next(line for line in text.splitlines() if line.strip().startswith("bf16"))
    assert bf16_row.split()[-2:] == ["4.22", "512³"]
    assert "policy auto without a model: bf16-mixed (auto → bf16-mixed: this CPU's bf16 and fp16 matmul speed vs " \
           "fp32 as in x fp32 above (matmul probe)" in text


@pytest.mark.parametrize("command", ["bench", "train", "inspect"])
def test_an_out_that_is_a_file_is_refused_before_any_work_with_exit_2(command, tmp_path, capsys):
    """Was a FileExistsError / NotADirectoryError traceback and exit 1, after the run's work."""
    afile = tmp_path / "results.txt"
    afile.write_text("mine")
    assert main([command, "--out", str(afile)]) == 2
    err = capsys.readouterr().err
    assert f"mixprec {command}: error: --out '{afile}' is a file, not a directory" in err and afile.read_text() == "mine"


def test_a_memory_budget_without_a_unit_is_refused_before_the_bench_starts(capsys):
    """`--memory-budget 4` meant 4 GiB and ran a whole bench against 4 bytes."""
    with pytest.raises(SystemExit) as done:
        main(["bench", "--memory-budget", "4"])
    assert done.value.code == 2 and "'4' has no unit; write one: B, KiB, MiB, GiB" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["train", "--checkpoint-every", "-1"], "argument --checkpoint-every: -1 is negative"),
    (["bench", "--steps", "3"], "argument --steps: 3 is below 5; bench needs >= 5 steps"),
    (["bench", "--max-loss-delta", "-0.1"], "argument --max-loss-delta: -0.1 must be a finite number > 0"),
    (["bench", "--min-speedup", "nan"], "argument --min-speedup: nan must be a finite number > 0"),
])
def test_numeric_flags_are_refused_by_the_flag_the_user_typed(argv, says, capsys):
    """They named internal fields (run_training checkpoint_every=-1, Targets max_loss_delta, bench steps=3), and
    `--steps 0` said "not a positive integer" where the rule is >= 5."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and says in capsys.readouterr().err


def test_a_resume_with_fewer_steps_than_the_checkpoint_is_refused_before_the_schedule_warning(tmp_path, capsys):
    """It warned 'For a schedule over 4 steps, start a new run' (advice), then refused the run."""
    out = str(tmp_path / "run")
    assert main(["train", "--config", "tiny", "--steps", "6", "--checkpoint-every", "3", "--out", out,
                 "--policy", "fp32"]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no schedule warning on the way to the refusal
        assert main(["train", "--config", "tiny", "--steps", "4", "--resume", "--out", out, "--policy", "fp32"]) == 2
    assert "is at step 6, past --steps 4; pass --steps >= 6" in capsys.readouterr().err
