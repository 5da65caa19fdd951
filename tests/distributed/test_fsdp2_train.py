"""``mixprec train --strategy fsdp2 --policy bf16-lean`` under torchrun, 2 processes (issue 28).

Each rank reports its training-state bytes per parameter, measured from its own tensors (a DTensor: its local
shard; 8-bit state's scales: whole on every rank), printed and written to its ``metrics.jsonl`` (a ``"state"``
record) and to the checkpoint's ``extra``. The test derives every rank's bytes from the model's shapes and
FSDP2's sharding (dim 0 cut in ``ceil(d0 / W)`` rows; params and gradients held padded to that on every rank,
optimizer state on the rank's own rows) and checks the sum over ranks against one process's measurement.
The eval loss is compared with one process trained on the same global batches (rank 0's and rank 1's batches
concatenated), within the band the same run spans over seeds 0, 1 and 2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from mixprec import checkpoint as ckpt
from mixprec.programs.session import build_engine, evaluate, train_step
from mixprec.workloads import get_workload
from ranks import free_port

STEPS, WORLD = 3, 2
QUANTIZED_MIN = 4096   # the engine's threshold for 8-bit state (2-D, at least 4096 elements; the decision says so)


def _rows(d0: int, r: int) -> int:
    chunk = math.ceil(d0 / WORLD)
    return max(0, min(chunk, d0 - r * chunk))


def _model() -> torch.nn.Module:
    return get_workload("gpt", config="tiny").build_model()


def _expected(r: int) -> dict:
    """Rank ``r``'s bytes from the shapes: bf16 params and grads padded to ``ceil(d0 / W)`` rows; AdamW's two
    moments on the rank's rows, int8 codes (1 byte) for the quantized params plus their fp32 scales whole (one per
    256 elements), fp32 (4 bytes) for the rest."""
    model = _model()
    params = grads = state = 0
    for p in model.parameters():
        d0, rest = p.shape[0], p[0].numel()
        params += 2 * math.ceil(d0 / WORLD) * rest
        quantized = p.dim() >= 2 and p.numel() >= QUANTIZED_MIN
        state += 2 * (_rows(d0, r) * rest * (1 if quantized else 4) + (4 * math.ceil(p.numel() / 256) if quantized
                                                                         else 0))
    return {"params": params, "grads": params, "optimizer_state": state,
            "n_params": sum(p.numel() for p in model.parameters())}


def _one_process_eval(seed: int) -> tuple[float, dict]:
    """One process, bf16-lean, every step on the global batch of two ranks (batches 2k and 2k + 1)."""
    from mixprec.programs.bench.measure import state_bytes

    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, "bf16-lean", steps=STEPS, seed=seed, device="cpu")
    stream, measured = workload.batches("train", seed), {}
    for step in range(1, STEPS + 1):
        pair = [next(stream) for _ in range(WORLD)]
        batch = {k: torch.cat([b[k] for b in pair]) for k in pair[0]}
        after = (lambda: measured.update(state_bytes(mp.model, mp.optimizer).as_dict())) if step == 2 else None
        train_step(mp, workload, batch, after)
    return evaluate(mp, workload)["loss"], measured


@pytest.mark.timeout(300)
def test_train_fsdp2_bf16_lean_reports_state_bytes_per_param_per_rank(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "mixprec", "train",
                           "--workload", "gpt", "--config", "tiny", "--policy", "bf16-lean", "--strategy", "fsdp2",
                           "--steps", str(STEPS), "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = []
    for r, log in enumerate((out / "metrics.jsonl", out / "rank-1" / "metrics.jsonl")):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        (state,) = [rec for rec in records if rec["kind"] == "state"]
        assert (state["rank"], state["world_size"], state["step"]) == (r, WORLD, 2)
        want = _expected(r)
        assert {k: state[k] for k in want} == want, r
        assert (state["masters"], state["compensation"]) == (0, 0)
        assert state["whole"] == sum(2 * 4 * math.ceil(p.numel() / 256) for p in _model().parameters()
                                     if p.dim() >= 2 and p.numel() >= QUANTIZED_MIN)   # the scales, whole
        total = want["params"] + want["grads"] + want["optimizer_state"]
        assert state["per_param"] == total / want["n_params"]
        assert f"training state: {state['per_param']:.2f} bytes/param on rank {r} of {WORLD}" in done.stdout
        ranks.append(state)
    assert {"kind": "state", **ckpt.read_manifest(out / "checkpoints")["extra"]["state_bytes"]} == ranks[0]

    ref_loss, ref_state = _one_process_eval(0)
    # the shards add up to one process's state (the bench's count): params and grads but FSDP2's row padding,
    # moments exactly, and the scales, held whole on each rank, once
    scales = ref_state["quantized_state"] - ref_state["quantized_elements"]   # codes: 1 byte each
    assert ranks[0]["whole"] == scales
    assert sum(s["optimizer_state"] for s in ranks) - (WORLD - 1) * scales == ref_state["optimizer_state"]
    assert ref_state["params"] <= sum(s["params"] for s in ranks)

    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if line.startswith('{"kind": "eval"')][-1]["eval_loss"]
    band = [ref_loss] + [_one_process_eval(seed)[0] for seed in (1, 2)]
    assert abs(final - ref_loss) <= max(band) - min(band), (final, band)
