"""Every rank runs the same measured attention kernel per key (issue 28): rank 0's choice, agreed at the boundary.

Each rank reads its own plan cache, planted with timings that make rank 0 choose ``matmul`` and rank 1
``fused-fp32`` at the same keys (no wall-clock dependence: nothing is timed). Before the first boundary every rank
runs ``fused`` at a key it measured (the same kernel everywhere); at the boundary the ranks agree and from then
on both run rank 0's ``matmul``: the entries say so, the kernel's output is ``matmul``'s bit for bit, the eval
losses of both ranks are equal bit for bit, and the ``"op-plan"`` event has the same words on both ranks. A key
only rank 1 met (rank-dependent code) runs ``fused`` there, is pinned ``fused`` on both ranks at the boundary, and
no collective runs in a forward (nothing can hang). One process: nothing changes (the planted choice runs at
once, no event, no clause).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mixprec.autocast import op_plan, plan_agreement
from mixprec.autocast.attention_kernels import CANDIDATES
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.machine.cache import machine_key
from mixprec.policy.resolve import resolve_policy
from mixprec.programs.session import evaluate, precision_optimizer, train_step
from mixprec.workloads.gpt import GPT_CONFIGS, GPTWorkload
from ranks import run_ranks

CONFIG = replace(GPT_CONFIGS["baby"], n_layer=2, batch_size=2)
B, H, T, D = 2, CONFIG.n_head, CONFIG.block_size, CONFIG.n_embd // CONFIG.n_head
ODD_B = 1   # a batch size only rank 1 runs (rank-dependent code)
RANK_TIMES = ({"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0},    # rank 0: matmul fastest
              {"fused": 2.0, "fused-fp32": 1.0, "matmul": 4.0})    # rank 1: fused-fp32 fastest
SAVED = {"fused": 1, "fused-fp32": 1, "matmul": 1}   # equal: the memory rule leaves the choice to speed


def _key(b: int, grad: bool) -> str:
    q = torch.empty(b, H, T, D)
    return op_plan.plan_key(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=grad)


def _plant(cache: Path, times: dict[str, float]) -> None:
    """A cache file whose training, eval and odd-batch keys hold ``times``: the plan reads, never times."""
    cache.mkdir(parents=True, exist_ok=True)
    value = {"chosen": "fused", "times_ms": times, "note": "", "saved_bytes": SAVED}
    keys = [_key(B, True), _key(B, False), _key(ODD_B, False)]
    (cache / f"op-plan-{machine_key(torch.device('cpu'))}.json").write_text(json.dumps({k: value for k in keys}))


def _engine(strategy: str | None) -> tuple[MixedPrecision, GPTWorkload]:
    workload = GPTWorkload(CONFIG)
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = precision_optimizer(workload.make_optimizer(model), resolve_policy("bf16-mixed", "cpu"))
    return MixedPrecision(model, optimizer, "bf16-mixed", device="cpu", strategy=strategy), workload


def _runs(mp: MixedPrecision, b: int) -> torch.Tensor:
    """What the model's attention runs at key (b, eval) inside ``mp.autocast()`` on fixed inputs."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, H, T, D, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad(), mp.autocast():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _kernel_output(name: str, b: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, H, T, D, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        return CANDIDATES[name](q, k, v, None, 0.0, True, None, False, torch.bfloat16)


def _chosen() -> dict[str, tuple[str, str]]:
    return {e.shape: (e.chosen, e.source) for e in op_plan.entries("cpu")}


def _rank(rank: int, out: Path, strategy: str) -> dict:
    os.environ["MIXPREC_CACHE_DIR"] = str(out / f"cache{rank}")
    _plant(out / f"cache{rank}", RANK_TIMES[rank])
    op_plan.forget()
    mp, workload = _engine(strategy)
    before = evaluate(mp, workload)["loss"]            # the eval key, measured (planted) here: pending
    odd = _runs(mp, ODD_B) if rank == 1 else None      # a key rank 1 alone meets: no collective, fused
    pending = op_plan.unagreed("cpu")
    ran_before = _chosen()
    batches = workload.batches("train", rank)
    train_step(mp, workload, next(batches))           # the training key: pending; agreed at this boundary
    agreed = _chosen()
    after = evaluate(mp, workload)["loss"]
    train_step(mp, workload, next(batches))
    return {"before": before, "after": after, "pending": pending, "ran_before": ran_before, "agreed": agreed,
            "odd": odd, "eval_out": _runs(mp, B), "odd_out": _runs(mp, ODD_B), "decision": mp.decision,
            "events": [e.to_dict() for e in mp.events if e.kind == "op-plan"], "ranks": plan_agreement.ranks(),
            "params": [p.detach().clone() for p in mp.module.parameters()] if strategy == "ddp" else None}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_every_rank_runs_rank_0s_kernel_after_the_boundary(tmp_path, strategy):
    r0, r1 = run_ranks(_rank, tmp_path, strategy, world=2, timeout_s=360)
    train, fwd, odd = _key(B, True), _key(B, False), _key(ODD_B, False)
    # the planted timings would make the ranks choose differently
    assert r0["pending"] == {fwd: "matmul"} and r1["pending"] == {fwd: "fused-fp32", odd: "fused-fp32"}
    # before the boundary: fused on every rank (the same kernel), the eval losses equal bit for bit
    assert r0["ran_before"][fwd][0] == r1["ran_before"][fwd][0] == "fused"
    assert torch.equal(r1["odd"], _kernel_output("fused", ODD_B))
    assert r0["before"] == r1["before"]
    # after it: rank 0's choice on both ranks, for the keys rank 0 met; fused for the key it did not
    for r in (r0, r1):
        assert r["ranks"] == 2 and "rank 0's measured attention kernel" in r["decision"]
        assert r["agreed"][train] == r["agreed"][fwd] == ("matmul", "rank 0's choice, agreed by 2 ranks")
        assert r["agreed"][odd][0] == "fused" and "rank 0 had not met this key" in r["agreed"][odd][1]
        assert torch.equal(r["eval_out"], _kernel_output("matmul", B))
        assert torch.equal(r["odd_out"], _kernel_output("fused", ODD_B))
        assert len(r["events"]) == 1 and r["events"][0]["cause"] == "agreed" and r["events"][0]["step"] == 1
        assert f"{fwd} -> matmul (measured: rank 0 matmul, rank 1 fused-fp32)" in r["events"][0]["detail"]
    assert r0["after"] == r1["after"] and r0["events"] == r1["events"]
    assert not math.isclose(r0["after"], r0["before"], rel_tol=0, abs_tol=0)   # a step was taken between
    if strategy == "ddp":   # the replicas stay equal bit for bit
        assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


def test_one_process_runs_its_own_choice_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    _plant(tmp_path, RANK_TIMES[1])
    op_plan.forget()
    try:
        mp, workload = _engine(None)
        assert torch.equal(_runs(mp, B), _kernel_output("fused-fp32", B))   # no agreement: the plan's choice
        train_step(mp, workload, next(workload.batches("train", 0)))
        assert plan_agreement.ranks() == 0 and op_plan.unagreed("cpu") == {}
        assert _chosen()[_key(B, True)] == ("fused-fp32", "cache")
        assert not [e for e in mp.events if e.kind == "op-plan"] and "rank 0's" not in mp.decision
    finally:
        op_plan.forget()


def test_settle_takes_rank_0s_choice_or_fused_where_rank_0_did_not_meet_the_key():
    settled = plan_agreement.settle([{"a": "matmul"}, {"a": "fused-fp32", "b": "matmul"}])
    assert settled == {"a": ("matmul", "rank 0's choice, agreed by 2 ranks"),
                       "b": ("fused", "rank 0's choice (fused: rank 0 had not met this key), agreed by 2 ranks")}
    with pytest.raises(ValueError, match="one dict per rank"):
        plan_agreement.settle([])
