"""``mixprec bench`` with the block-scaled presets: the CLI takes them, they train like any row, and the verdict and
the report say their GEMMs were emulated (the speed is not a native GEMM's)."""

from __future__ import annotations

import json

from mixprec.programs.bench.judging import judge_policies
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.verdict import Targets
from mixprec.programs.cli import main


def test_bench_runs_the_block_presets_and_says_they_are_emulated(tmp_path, capsys):
    out = tmp_path / "out"
    # the cheapest bench: 5 steps, one seed, no eval points, no peer (test_bench.py's tiny bench covers the rest)
    status = main(["bench", "--config", "tiny", "--policies", "bf16-mixed,mxfp8-mixed,nvfp4-mixed,block=nvfp4-plain",
                   "--steps", "5", "--quick", "--out", str(out), "--device", "cpu", "--seeds", "1",
                   "--eval-every", "0", "--no-peer"])
    assert status == 0
    rows = json.loads((out / "results.json").read_text())["policies"]
    assert list(rows) == ["fp32", "bf16-mixed", "mxfp8-mixed", "nvfp4-mixed,block=nvfp4-plain"]
    for name in ("mxfp8-mixed", "nvfp4-mixed,block=nvfp4-plain"):
        row = rows[name]
        assert row["verdict"] == "SMOKE" and row["final_eval_loss"] is not None, row["reason"]
        assert "block-scaled linears" in row["decision"] and "emulated on cpu" in row["decision"]
        assert "linears emulated (exact dequantize + fp32 GEMM" in row["reason"]
    assert rows["nvfp4-mixed,block=nvfp4-plain"]["policy"] == "nvfp4-mixed,block=nvfp4-plain"
    assert "emulated" not in rows["bf16-mixed"]["reason"]
    report = (out / "report.md").read_text()
    assert "mxfp8 linears emulated" in report and "no native block-scaled matmul on this device" in report
    assert "mxfp8 linears emulated" in capsys.readouterr().out


def test_an_unknown_block_recipe_is_an_error_naming_the_recipes(tmp_path, capsys):
    status = main(["bench", "--config", "tiny", "--policies", "nvfp4-mixed,block=nvfp5", "--steps", "5",
                   "--out", str(tmp_path)])
    assert status == 2
    assert "block='nvfp5' is not allowed (did you mean 'nvfp4'?)" in capsys.readouterr().err


def test_a_row_that_never_ran_gets_no_emulation_words():
    rows = {"fp32": PolicyRun(policy="fp32", step_time_ms_median=10.0, final_eval_loss=2.0, peak_memory_mb=100.0),
            "mxfp8-mixed": PolicyRun(policy="mxfp8-mixed", error="worker crashed")}
    judged = judge_policies(rows, Targets())
    assert judged["mxfp8-mixed"].verdict == "FAIL" and "emulated" not in judged["mxfp8-mixed"].reason
