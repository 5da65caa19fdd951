"""``mixprec train --policy auto`` and ``--resume`` (issue 25): the run records that it asked for "auto", not the
fp32 that a pending auto engine builds as, and a resumed auto run continues under the decision its checkpoint
holds, as ``MixedPrecision(model, opt, policy="auto")`` does when it loads that checkpoint from Python."""

import torch

import mixprec
from mixprec.checkpoint import read_manifest, resolve_checkpoint
from mixprec.programs.cli import main as cli_main
from mixprec.programs.session import build_engine
from mixprec.workloads import get_workload


def test_an_auto_run_records_auto_and_resumes_under_its_decision_from_the_cli_and_python(tmp_path, capsys):
    """Failed on main: the run printed "policy fp32" and recorded policy_requested "fp32" while auto was still
    pending, so a resume with --policy fp32 adopted whatever auto had chosen, and one with --policy auto was told
    nothing about the decision."""
    out = tmp_path / "run"
    common = ["train", "--workload", "gpt", "--config", "tiny", "--checkpoint-every", "1", "--out", str(out)]
    assert cli_main([*common, "--policy", "auto", "--steps", "2"]) == 0
    assert "policy auto (auto: pending — timed on this model at its first forward" in capsys.readouterr().err
    manifest = read_manifest(resolve_checkpoint(out / "checkpoints"))
    decided = manifest["policy"]                       # what auto measured here: fp32 or bf16-mixed
    assert manifest["extra"]["policy_requested"] == "auto"
    assert [e["kind"] for e in manifest["events"]] == ["auto"] and manifest["events"][0]["to"] == decided

    other = "bf16-mixed" if decided == "fp32" else "fp32"   # not the run's decision: refused, naming both fixes
    assert cli_main([*common, "--policy", other, "--steps", "3", "--resume"]) == 2
    assert f"resume with --policy '{decided}' (or the run's own --policy 'auto')" in capsys.readouterr().err

    assert cli_main([*common, "--policy", "auto", "--steps", "3", "--resume"]) == 0
    assert f"(step 2, policy {decided})" in capsys.readouterr().err
    manifest = read_manifest(resolve_checkpoint(out / "checkpoints"))
    assert (manifest["policy"], manifest["extra"]["policy_requested"]) == (decided, "auto")
    assert [e["kind"] for e in manifest["events"]] == ["auto"]     # no second trial

    workload = get_workload("gpt", config="tiny")      # from Python: the same checkpoint, the same adoption
    mp = build_engine(workload, "auto", steps=3, seed=0, device="cpu")
    assert mp.decision.startswith("auto: pending")
    mixprec.load_checkpoint(resolve_checkpoint(out / "checkpoints"), mp)
    assert str(mp.policy) == decided and mp.decision.startswith(f"{decided} as loaded: the saved run's decision")
    saved = read_manifest(resolve_checkpoint(out / "checkpoints"))["counters"]
    assert mp.applied_steps + mp.skipped_total == saved["boundaries"] == 3
    assert all(torch.isfinite(p).all() for p in mp.module.parameters())
