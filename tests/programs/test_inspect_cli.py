"""`mixprec inspect` and `mixprec bench --policies advised` through the CLI entry point."""

import json

import pytest

from mixprec.programs.cli import main


def test_inspect_cli_writes_report_files(tmp_path, capsys):
    out = tmp_path / "inspect"
    assert main(["inspect", "--workload", "gpt", "--config", "tiny", "--steps", "2", "--out", str(out)]) == 0
    assert "speed (auto's measurement on this model, which the advice follows): auto → " in capsys.readouterr().out
    data = json.loads((out / "numerics.json").read_text())
    assert data["modules"] and (out / "numerics.md").read_text().startswith("#")
    assert (out / "numerics.png").stat().st_size > 1000


def test_bench_runs_the_advised_policy_next_to_fp32(tmp_path):
    out = tmp_path / "bench"
    # one seed, no eval points, no peer: nothing asserted here reads them (a shorter run)
    status = main(["bench", "--workload", "gpt", "--config", "tiny", "--policies", "advised", "--steps", "6",
                   "--out", str(out), "--max-loss-delta", "1.0", "--seeds", "1", "--eval-every", "0", "--no-peer"])
    results = json.loads((out / "results.json").read_text())
    advised = results["advice"]["policy"]
    assert advised in results["policies"] and results["advice"]["reasons"]
    # auto's measurement decides fp32 or bf16 (issue 25): fp32 advised is the reference row itself
    verdicts = ("REFERENCE",) if advised == "fp32" else ("PASS", "FAIL")
    assert results["policies"][advised]["verdict"] in verdicts
    assert "as auto measured it on this model" in results["advice"]["reasons"][0]
    assert status in (0, 1)


def test_bench_report_says_when_the_advised_policy_equals_a_named_one(tmp_path, capsys):
    """`--policies advised,<same policy>` runs it once, and report.md, results.json and the console say so instead
    of a silent dedupe."""
    from mixprec.programs.inspect import advised_policy

    advised, _ = advised_policy("gpt", config="tiny", device="cpu")  # what bench asks (same defaults)
    out = tmp_path / "bench"
    main(["bench", "--workload", "gpt", "--config", "tiny", "--policies", f"advised,{advised}", "--steps", "6",
          "--out", str(out), "--max-loss-delta", "1.0", "--device", "cpu", "--seeds", "1", "--eval-every", "0",
          "--no-peer"])   # one seed, no eval points, no peer: nothing asserted here reads them (a shorter run)
    results = json.loads((out / "results.json").read_text())
    assert list(results["policies"]).count(str(advised)) == 1
    report = (out / "report.md").read_text()
    row = "the `fp32` reference row" if str(advised) == "fp32" else f"`{advised}`"   # auto's measurement decides
    assert f"Advised policy (`mixprec inspect`): `{advised}`; its row is {row} (also asked for by name" in report
    assert results["advice"]["merged"] == [{"request": "advised", "row": str(advised), "also_asked_as": [str(advised)]}]
    assert f"\nadvised resolved to {advised} and runs as that row (" in capsys.readouterr().out


def test_inspect_with_a_block_format_prints_the_linears_kept_in_bf16_and_the_advised_block_policy(tmp_path, capsys):
    out = tmp_path / "inspect"
    assert main(["inspect", "--workload", "gpt", "--config", "tiny", "--steps", "1", "--formats", "bf16,nvfp4",
                 "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # gpt/tiny: 2 blocks, so nvfp4's bf16 tail is blocks.1; the first linear and the head (103 outputs) are kept too
    assert ("nvfp4: keep in bf16: blocks.0.attn.qkv (first Linear), blocks.1.attn.qkv (bf16 tail), "
            "blocks.1.attn.proj (bf16 tail), blocks.1.fc (bf16 tail), blocks.1.proj (bf16 tail), "
            "lm_head (last Linear+shape)") in printed
    assert printed.startswith("advised policy on this device (as it trains here now): ")
    assert "\nnvfp4: for an nvfp4 run (native block-scaled GEMMs: NVIDIA Blackwell, e.g. B200; emulated, and slower " \
           "than bf16, elsewhere): nvfp4-mixed\n" in printed and printed.count("advised policy") == 1
    data = json.loads((out / "numerics.json").read_text())
    assert [b["format"] for b in data["block"]] == ["nvfp4"] and "## Block formats" in (out / "numerics.md").read_text()


@pytest.mark.slow   # 25 s on a busy 2-core machine: a bench of one emulated NVFP4 row
def test_bench_runs_an_advised_block_policy_and_its_decision_names_the_kept_linears(tmp_path):
    out = tmp_path / "bench"
    policy = "nvfp4-mixed,block_keep=blocks.0.fc"   # what the advice prints for a linear below its floor
    assert main(["bench", "--config", "tiny", "--policies", policy, "--steps", "5", "--quick", "--out", str(out),
                 "--device", "cpu", "--seeds", "1", "--eval-every", "0", "--no-peer"]) == 0
    row = json.loads((out / "results.json").read_text())["policies"][policy]
    assert row["final_eval_loss"] is not None and "block_keep: blocks.0.fc" in row["decision"]


def test_inspect_refuses_a_policy_whose_compute_format_is_missing_before_training(tmp_path, capsys):
    """`--formats nvfp4 --policy nvfp4-mixed` used to run the whole inspection, then fail and write nothing."""
    out = tmp_path / "inspect"
    assert main(["inspect", "--workload", "gpt", "--config", "tiny", "--steps", "1", "--formats", "nvfp4",
                 "--policy", "nvfp4-mixed", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("inspect formats=nvfp4: the policy under study, nvfp4-mixed, computes in bf16, which its advice reads; "
            "add it: formats=nvfp4,bf16 (mixprec inspect --formats nvfp4,bf16)") in err
    assert not out.exists()


def test_a_bad_format_is_refused_with_the_spellings_help_uses(tmp_path, capsys):
    """The error listed e4m3fn, mxfp8_e4m3, mxfp4_e2m1 where --help says e4m3, mxfp8, mxfp4 (both work)."""
    out = tmp_path / "inspect"
    assert main(["inspect", "--config", "tiny", "--formats", "bf16,nvfp5", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    formats, _, block = err.partition("nor a block format")
    assert "'e4m3'," in formats and "e4m3fn'" not in formats and not out.exists()
    listed = block.split("([")[1].split("])")[0].replace("'", "").split(", ")
    assert listed == ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8", "mxfp8_e5m2", "nvfp4"]
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert all(name in helped.split("block formats too (")[1].split(")")[0].split(", ") for name in listed)
