"""`mixprec inspect` and `mixprec bench --policies advised` through the CLI entry point."""

import json

from mixprec.cli import main


def test_inspect_cli_writes_report_files(tmp_path):
    out = tmp_path / "inspect"
    assert main(["inspect", "--workload", "gpt", "--config", "tiny", "--steps", "2", "--out", str(out)]) == 0
    data = json.loads((out / "numerics.json").read_text())
    assert data["modules"] and (out / "numerics.md").read_text().startswith("#")
    assert (out / "numerics.png").stat().st_size > 1000


def test_bench_runs_the_advised_policy_next_to_fp32(tmp_path):
    out = tmp_path / "bench"
    status = main(["bench", "--workload", "gpt", "--config", "tiny", "--policies", "advised", "--steps", "6",
                   "--out", str(out), "--max-loss-delta", "1.0"])
    results = json.loads((out / "results.json").read_text())
    advised = results["advice"]["policy"]
    assert advised in results["policies"] and results["advice"]["reasons"]
    assert results["policies"][advised]["verdict"] in ("PASS", "FAIL")
    assert status in (0, 1)
