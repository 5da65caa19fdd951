"""benchmarks/optimizer_peers.py: bitsandbytes' and torchao's AdamW8bit trained by the bench worker beside ours.

One tiny run (gpt/tiny, 6 steps, fp32 + each peer, sequential timing: ~30 s, most of it torchao compiling its
step) feeds the row tests; the others run no worker. Peers are optional extras: a missing one is skipped.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from mixprec import MixedPrecision
from mixprec.workloads import get_workload

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import optimizer_peers  # noqa: E402

TINY = ["--config", "tiny", "--steps", "6", "--timing", "sequential"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    results = optimizer_peers.main([*TINY, "--ours", "fp32", "--peers", "bitsandbytes,torchao", "--out", str(out)])
    return out, results, {row["name"]: row for row in results["rows"]}


def _tiny_params() -> list[int]:
    """Element counts of the tiny GPT's params (the tied head once)."""
    return [p.numel() for p in get_workload("gpt", config="tiny").build_model().parameters()]


def _worker(out: Path, name: str) -> dict:
    return json.loads((out / "workers" / f"{name}.json").read_text())


def test_bitsandbytes_counts_uint8_states_absmax_per_block_and_one_shared_qmap(tiny_run):
    pytest.importorskip("bitsandbytes")
    out, _, rows = tiny_run
    sizes = _tiny_params()
    # >= min_8bit_size (4096): 2 uint8 states + 2 fp32 absmax per 256 elements; below: 2 fp32 states.
    # The two 256-entry fp32 code books (qmap1, qmap2) are one pair for all params.
    state = sum(2 * n + 2 * 4 * math.ceil(n / 256) if n >= 4096 else 8 * n for n in sizes) + 2 * 256 * 4
    row = rows["bitsandbytes"]
    assert sum(n >= 4096 for n in sizes) == 4 and sum(sizes) == 29792   # the 4 MLP matrices (4096 each) quantized
    assert row["bytes_per_param"] == pytest.approx((8 * sum(sizes) + state) / sum(sizes), abs=1e-12)
    assert row["bytes_per_param"] == pytest.approx(8 + 142592 / 29792, abs=1e-12)    # 12.786
    assert (row["optimizer"], row["policy"]) == ("bitsandbytes.optim.adamw.AdamW8bit", "fp32")
    assert abs(row["eval_loss_delta_vs_fp32"]) < 0.01 and row["final_eval_loss"] != rows["fp32"]["final_eval_loss"]
    assert _worker(out, "peer-bitsandbytes")["lr_per_step"] == _worker(out, "ours0-fp32")["lr_per_step"]


def test_torchao_counts_the_subclass_codes_scales_and_qmap_per_tensor(tiny_run):
    pytest.importorskip("torchao")
    out, _, rows = tiny_run
    sizes = _tiny_params()
    # OptimState8bit where numel >= 4096 and a multiple of 256: uint8 codes, fp32 scale per 256, its own qmap
    state = sum(2 * (n + 4 * n // 256 + 256 * 4) if n >= 4096 and n % 256 == 0 else 8 * n for n in sizes)
    row = rows["torchao"]
    assert row["bytes_per_param"] == pytest.approx((8 * sum(sizes) + state) / sum(sizes), abs=1e-12)   # 12.992
    assert row["optimizer_state_bytes_per_param"] == pytest.approx(state / sum(sizes), abs=1e-12)
    assert (row["optimizer"], row["policy"]) == ("torchao.optim.adam.AdamW8bit", "fp32")
    assert abs(row["eval_loss_delta_vs_fp32"]) < 0.01
    lr_fp32 = _worker(out, "ours0-fp32")["lr_per_step"]
    assert _worker(out, "peer-torchao")["lr_per_step"] == pytest.approx(lr_fp32, rel=1e-6)   # its lr: an fp32 tensor


def test_the_table_has_every_row(tiny_run):
    out, results, rows = tiny_run
    assert list(rows) == ["fp32", "bitsandbytes", "torchao"]
    assert rows["fp32"]["bytes_per_param"] == 16.0 and rows["fp32"]["step_time_ratio_vs_fp32"] == 1.0
    table = (out / "peers.md").read_text()
    assert table == optimizer_peers.markdown(json.loads((out / "peers.json").read_text()))
    for row in results["rows"]:
        line = next(line for line in table.splitlines() if line.startswith(f"| {row['label']} |"))
        if row["skipped_reason"] is None:
            assert f"| {row['bytes_per_param']:.3f} |" in line and "sequential" == row["timing"]
    assert "Step times: sequential" in table


def test_bench_rows_are_reused_and_a_missing_extra_is_a_skipped_row(tiny_run, tmp_path, monkeypatch):
    out, _, rows = tiny_run
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"settings": {"workload": "gpt", "config": "tiny", "steps": 6, "seed": 0, "data": None},
                                 "policies": {"fp32": _worker(out, "ours0-fp32")}, "timing": {"method": "interleaved"},
                                 "seed_noise": {"relative_spread": 0.003}}))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)      # as if not installed
    results = optimizer_peers.main([*TINY, "--bench", str(bench), "--peers", "bitsandbytes", "--out", str(tmp_path)])
    fp32, skipped = results["rows"]
    assert fp32["final_eval_loss"] == rows["fp32"]["final_eval_loss"] and fp32["timing"] == "the bench's (interleaved)"
    assert skipped["skipped_reason"] == "skipped: bitsandbytes not installed (pip install bitsandbytes)"
    assert optimizer_peers._exit_status(results) == 0
    table = (tmp_path / "peers.md").read_text()
    assert "| skipped: bitsandbytes not installed (pip install bitsandbytes) |" in table
    assert "seed band ±0.30%" in table and "(within seed band)" in table


@pytest.mark.slow
def test_interleaved_timing_retimes_the_bench_rows_beside_the_peers(tiny_run, tmp_path):
    pytest.importorskip("bitsandbytes")
    out, _, _ = tiny_run
    bench = tmp_path / "results.json"
    fp32 = _worker(out, "ours0-fp32")
    bench.write_text(json.dumps({"settings": {"workload": "gpt", "config": "tiny", "steps": 6, "seed": 0, "data": None},
                                 "policies": {"fp32": fp32}, "timing": {"method": "sequential"}}))
    results = optimizer_peers.main(["--config", "tiny", "--steps", "6", "--bench", str(bench), "--peers", "bitsandbytes",
                                    "--out", str(tmp_path)])
    assert results["timing"]["method"] == "interleaved" and set(results["timing"]["step_ms"]) == {"fp32", "bitsandbytes"}
    assert [row["timing"] for row in results["rows"]] == ["interleaved", "interleaved"]
    assert results["rows"][0]["step_time_ratio_vs_fp32"] == 1.0
    assert "Step times: interleaved in this run" in (tmp_path / "peers.md").read_text()

def test_a_bench_of_other_settings_is_refused(tmp_path):
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"settings": {"workload": "gpt", "config": "mid", "steps": 300, "seed": 0, "data": None},
                                 "policies": {}}))
    with pytest.raises(ValueError, match=r"config='mid' there, 'tiny' here; steps=300 there, 6 here.*--config"):
        optimizer_peers.main([*TINY, "--bench", str(bench), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--ours 'fp32' with --bench .* drop --ours"):
        optimizer_peers.main([*TINY, "--bench", str(bench), "--ours", "fp32", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--peers 'apex': \['apex'\] not allowed; choose from \['bitsandbytes', 'torchao'\]"):
        optimizer_peers.main([*TINY, "--peers", "apex", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="not a mixprec bench results.json"):
        optimizer_peers.main([*TINY, "--bench", str(tmp_path / "none.json"), "--out", str(tmp_path)])


def test_a_peer_takes_the_workloads_groups_and_the_engine_runs_it_as_it_is():
    pytest.importorskip("bitsandbytes")
    workload = get_workload("gpt", config="tiny")
    model = workload.build_model()
    peer = optimizer_peers.PeerWorkload(workload, optimizer_peers.PEERS["bitsandbytes"]).make_optimizer(model)
    reference = workload.make_optimizer(model)
    keys = ("lr", "betas", "eps", "weight_decay")
    assert [[g[k] for k in keys] for g in peer.param_groups] == [[g[k] for k in keys] for g in reference.param_groups]
    assert [g["weight_decay"] for g in peer.param_groups] == [0.1, 0.0]   # decay on 2-D tensors only
    mp = MixedPrecision(model, peer, policy="fp32", device="cpu", max_grad_norm=1.0)
    assert mp.optimizer is peer   # accepted as it is (fp32 params, round-to-nearest, its own state)
    with pytest.raises(ValueError, match="plain torch.optim.AdamW"):
        optimizer_peers.peer_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), optimizer_peers.PEERS["torchao"])


def test_default_ours_include_our_8bit_optimizer():
    args = optimizer_peers._parse(["--config", "tiny", "--out", "unused"])
    assert args.ours_list == ["fp32", "bf16-sr", "bf16-lean"]   # the 8-bit peers are read against bf16-lean
