"""The guard escalates under FSDP2 (issue 28): 8-bit optimizer state → fp32 state on the shards, and training
continues (:mod:`mixprec.distributed.sharded_switch`).

2 gloo ranks, ``bf16-lean`` and ``bf16-kahan,state=int8`` (its compensation folded into the params by the
switch) on tests/distributed/test_fsdp2_quantized.py's model (shard boundaries on and inside 256-element
blocks, an empty shard at W = 4), the same batch on every rank (the reduced gradient is one process's exactly).
Rank 1's loss turns NaN at steps 1 and 2: every rank rolls back twice, and the second failure escalates (the
ladder under FSDP2 goes to the state rung: ``fully_shard`` fixed how params are stored). After 2 more steps the
params and the fp32 moments equal, bit for bit, one process that ran step 0, switched to the same policy with
``set_policy`` and ran the same 2 steps; every rank records the same escalate event. A switch that changes the
params' storage, or quantizes the fp32 moments anew, is refused, named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mixprec.optim
from mixprec import Guard, MixedPrecision
from ranks import run_ranks
from test_fsdp2_quantized import _batches, _engine, _model, _snapshot, _step

import torch.nn.functional as F

FAULTS = (1, 2)
STEPS = 5


POLICIES = ("bf16-lean", "bf16-kahan,state=int8")


def _guarded(policy: str, batch: dict, fault: bool) -> tuple[MixedPrecision, list]:
    net = _model()
    mp = MixedPrecision(net, mixprec.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1), policy,
                        device="cpu", strategy="fsdp2", guard=Guard(snapshot_every=1))
    outcomes = []
    for step in range(STEPS):
        x = mp.cast_inputs(batch, keep=("y",))
        with mp.autocast():
            loss = F.mse_loss(mp.model(x["x"]).float(), x["y"])
        if fault and step in FAULTS:
            loss = loss + float("nan")
        mp.backward(loss)
        result = mp.step()
        outcomes.append((result.applied, result.rolled_back, result.escalated))
    return mp, outcomes


def _worker(rank: int, out: Path) -> dict:
    return {policy: _escalated(policy, rank) for policy in POLICIES}


def _escalated(policy: str, rank: int) -> dict:
    batch = _batches(1)[0]
    mp, outcomes = _guarded(policy, batch, fault=rank == 1)
    escalations = [e for e in mp.events if e.get("kind") == "escalate"]
    refused = []
    for other in ("fp32", policy):   # params' storage; quantizing the fp32 moments anew
        try:
            mp.set_policy(other)
            refused.append("")
        except ValueError as err:
            refused.append(str(err))
    return {"outcomes": outcomes, "snapshot": _snapshot(mp), "policy": str(mp.policy),
            "escalations": [(e.get("step"), e.get("detail")) for e in escalations], "refused": refused}


def _one_process(policy: str, new_policy: str) -> dict:
    mp = _engine(policy, None)
    batch = _batches(1)[0]
    _step(mp, batch)
    mp.set_policy(new_policy, kind="escalate")
    for _ in range(STEPS - 1 - len(FAULTS)):
        _step(mp, batch)
    return _snapshot(mp)


@pytest.mark.timeout(300)
def test_fsdp2_guard_escalates_8bit_state_to_fp32_and_continues_like_one_process(tmp_path):
    ranks = run_ranks(_worker, tmp_path, world=2)
    for policy in POLICIES:
        _check(policy, [g[policy] for g in ranks])


def _check(policy: str, got: list[dict]) -> None:
    want = _one_process(policy, got[0]["policy"])
    for r, g in enumerate(got):
        assert g["outcomes"] == [(True, False, False), (False, True, False), (False, True, True),
                                 (True, False, False), (True, False, False)], r
        assert g["policy"] == got[0]["policy"] and "int8" not in g["policy"], r
        assert g["policy"] != policy and "8-bit" not in g["policy"], r
        assert len(g["escalations"]) == 1 and "8-bit optimizer state → fp32 state" in g["escalations"][0][1], r
        assert g["escalations"] == got[0]["escalations"]
        assert not any(k.endswith("_absmax") for k in g["snapshot"]["state"]), r
        assert set(g["snapshot"]["state"]) == set(want["state"]), r
        for part in ("params", "state"):
            for name, value in want[part].items():
                assert torch.equal(g["snapshot"][part][name], value), (policy, r, part, name)
        assert "would re-run fully_shard" in g["refused"][0] and "fp32" in g["refused"][0], r
        assert "would quantize the sharded optimizer state anew" in g["refused"][1], r
