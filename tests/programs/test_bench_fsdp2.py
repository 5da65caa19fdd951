"""``mixprec bench --strategy fsdp2`` under torchrun, 2 gloo processes (issue 28): every rank's training-state bytes
per parameter and peak live tensor bytes, gathered to rank 0's row (results.json ``*_per_rank`` keys with their max
over ranks), printed and in report.md, labelled per rank. The bf16-lean figure of each rank equals the count from
the model's shapes and FSDP2's dim-0 chunks (:func:`test_memory_state.expected_rank_bytes`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from mixprec.programs.bench.report import POLICY_KEYS
from mixprec.workloads import get_workload
from ranks import free_port
from test_memory_state import expected_rank_bytes

WORLD = 2


def _fp32_per_param(r: int) -> float:
    model = get_workload("gpt", config="tiny").build_model()
    total = 0
    for p in model.parameters():
        chunk, rest = math.ceil(p.shape[0] / WORLD), p[0].numel()
        total += 2 * 4 * chunk * rest + 2 * 4 * max(0, min(chunk, p.shape[0] - r * chunk)) * rest
    return total / sum(p.numel() for p in model.parameters())


@pytest.mark.timeout(400)
def test_bench_fsdp2_reports_state_bytes_and_peak_live_bytes_per_rank(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "mixprec", "bench",
                           "--workload", "gpt", "--config", "tiny", "--policies", "bf16-lean", "--steps", "5",
                           "--strategy", "fsdp2", "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (results["settings"]["strategy"], results["settings"]["world_size"]) == ("fsdp2", WORLD)
    lean = results["policies"]["bf16-lean"]
    want = [expected_rank_bytes("tiny", WORLD, r)["per_param"] for r in range(WORLD)]
    assert lean["state_bytes_per_param_per_rank"] == want
    assert lean["state_bytes_per_param_per_rank_max"] == max(want)
    for name, e in results["policies"].items():
        state, live = e["state_bytes_per_param_per_rank"], e["peak_live_bytes_per_rank"]
        assert len(state) == len(live) == WORLD and all(b > 0 for b in live), name
        # rank 0's own figures are the row's; the others come from the other ranks' workers
        assert (state[0], live[0]) == (e["state_bytes_per_param"], e["peak_live_bytes"]), name
        rank1 = json.loads(next((out / "workers" / "rank-1").glob(f"*-{name}.json")).read_text())
        assert (state[1], live[1]) == (rank1["state_bytes_per_param"], rank1["peak_live_bytes"]), name
        assert (e["state_bytes_per_param_per_rank_max"], e["peak_live_bytes_per_rank_max"]) == (max(state), max(live))
    # fp32 under FSDP2: fp32 params and grads padded to a chunk, two fp32 moments on the rank's rows
    assert results["policies"]["fp32"]["state_bytes_per_param_per_rank"] == [_fp32_per_param(r) for r in range(WORLD)]
    assert done.stdout.count("REFERENCE") == 1   # rank 0 alone prints
    assert "B/param r0" in done.stdout and f"per rank (fsdp2, {WORLD} ranks;" in done.stdout
    assert f"bf16-lean: training state per rank {want[0]:.2f} (rank 0), {want[1]:.2f} (rank 1) B/param" in done.stdout
    report = (out / "report.md").read_text()
    assert "## Per rank" in report and "bytes/param (rank 0)" in report and "peak live MiB (rank 0)" in report
    assert f"- bf16-lean: training state per rank {want[0]:.2f} (rank 0)" in report
    # the bench under torchrun, whatever the strategy (tests/distributed/test_distributed.py's DDP run of it is slow): every row
    # has the report's keys, each rank trained in its own worker, and the throughput is summed over the ranks
    for name, e in results["policies"].items():
        assert set(POLICY_KEYS) <= set(e), name
        ranks = [json.loads(next((out / "workers" / sub).glob(f"*-{name}.json")).read_text()) for sub in ("", "rank-1")]
        assert ranks[0]["pid"] != ranks[1]["pid"], name
        per_rank = [r["items_per_batch"] / r["step_time_ms_median"] * 1e3 for r in ranks]   # each rank's own speed
        assert e["items_per_s"] == pytest.approx(sum(per_rank), rel=1e-9) and e["tokens_per_s"] == e["items_per_s"]
    assert results["policies"]["fp32"]["verdict"] == "REFERENCE"
