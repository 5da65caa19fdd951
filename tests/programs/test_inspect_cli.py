"""`mixprec inspect` and `mixprec bench --policies advised` through the CLI entry point."""

import json

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


def test_bench_report_says_when_the_advised_policy_equals_a_named_one(tmp_path):
    """`--policies advised,<same policy>` runs it once, and report.md says so instead of a silent dedupe."""
    from mixprec.programs.inspect import advised_policy

    advised, _ = advised_policy("gpt", config="tiny", device="cpu")  # what bench asks (same defaults)
    out = tmp_path / "bench"
    main(["bench", "--workload", "gpt", "--config", "tiny", "--policies", f"advised,{advised}", "--steps", "6",
          "--out", str(out), "--max-loss-delta", "1.0", "--device", "cpu", "--seeds", "1", "--eval-every", "0",
          "--no-peer"])   # one seed, no eval points, no peer: nothing asserted here reads them (a shorter run)
    results = json.loads((out / "results.json").read_text())
    assert list(results["policies"]).count(str(advised)) == 1
    report = (out / "report.md").read_text()
    assert f"Advised policy (`mixprec inspect`): `{advised}`; its row is `{advised}` (also asked for by name" in report
