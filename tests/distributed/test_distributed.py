"""Multi-process training (issue 7; cases 28 and 29): DDP and FSDP2 on CPU with gloo.

Each multi-process test starts 2 processes itself (``torch.multiprocessing`` spawn, a free
port, torchrun's environment variables, 60 s collective timeout) and kills them if they have
not finished within the test's time limit, so a hang fails the test instead of stalling the
suite. Each rank writes what it saw to ``rank<r>.pt``; the test compares ranks with each other
and with a one-process run in the pytest process.

Tolerances, on the training's whole update: ``|Δ_a − Δ_b| / |Δ_b|`` where ``Δ`` is the change
of all parameters (one vector) over the run, with SGD (Adam's normalised steps would turn bf16
noise in near-zero gradients into full-size differences). They come from the formats, not from
one machine's output (an elementwise relative bound also bounds this ratio of norms):

* fp32, DDP (2 ranks) vs one process on the same global batch (MLP 16-32-4, batches of 8 rows,
  4 steps): only the order of fp32 sums differs. Each sum of n terms is within ``n u`` of exact
  (u = eps/2), the longest sums have K + rows = 32 + 8 terms, and 4 updates add up:
  ``4 * 40 * eps_fp32`` (1.9e-5; measured 2e-7).
* bf16 (mixed and pure, DDP vs one process, FSDP2 vs DDP, FSDP2 resumed in one process vs the
  2-rank run continuing): a gradient goes through about 4 roundings to bf16 (the forward output,
  its gradient, the input gradient, the weight gradient), each within u_bf16 = eps_bf16 / 2, so
  two runs that round in different places differ by at most ``2 * 4 * u = 4 * eps_bf16`` (3.1e-2;
  measured 2.5e-3 to 3e-3). The fp32 losses from bf16 logits agree to ``eps_bf16`` (measured 1e-4).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec.optim
from mixprec import Guard, MixedPrecision, Policy, get_format
from mixprec.distributed import process as mpd
from mixprec import checkpoint as ckpt
from mixprec.checkpoint import dcp as ckdcp
from mixprec.engine.loss_scale import DynamicLossScale
from engine_loops import _one_step
from ranks import free_port, run_ranks

WORLD = 2
FP32 = torch.float32
FP32_EPS, BF16_EPS = get_format("fp32").eps, get_format("bf16").eps
FP32_TOL = 4 * 40 * FP32_EPS   # see the module docstring
BF16_TOL = 4 * BF16_EPS


# ---------------------------------------------------------------------- the 2-process harness: tests/ranks.py
# ---------------------------------------------------------------------- models and data
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _stream(n: int):
    """The deterministic per-rank batch stream (4 samples each); every rank iterates all of it."""
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield {"x": torch.randn(4, 16, generator=g), "y": torch.randn(4, 4, generator=g)}


def _cat(batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def _mse_step(mp: MixedPrecision, batch: dict, *, after_backward=None, loss_hook=None):
    batch = mp.cast_inputs(batch)
    with mp.autocast():
        loss = F.mse_loss(mp.model(batch["x"]).float(), batch["y"].float())
    if loss_hook is not None:
        loss = loss_hook(loss)
    mp.backward(loss)
    if after_backward is not None:
        after_backward()
    return loss.detach(), mp.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().float().clone()


def _params(mp: MixedPrecision) -> dict[str, torch.Tensor]:
    """fp32 values by name: masters where they exist, whole tensors under FSDP2."""
    names = [n for n, _ in mp.module.named_parameters()]
    return {n: _full(m) for n, m in zip(names, mp.master_parameters())}


def _rel_update_diff(got: dict, ref: dict, init: dict) -> float:
    """|Δ_got − Δ_ref| / |Δ_ref| over all parameters together (Δ: change from ``init``)."""
    num = sum(((got[n] - ref[n]) ** 2).sum() for n in ref) ** 0.5
    den = sum(((ref[n] - init[n]) ** 2).sum() for n in ref) ** 0.5
    return float(num / den)


def _mlp_engine(policy: str, accumulation: int = 1, strategy: str | None = None) -> MixedPrecision:
    model = _mlp()
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy, device="cpu",
                          accumulation_steps=accumulation, max_grad_norm=1.0, strategy=strategy)


def _train_mlp(policy: str, accumulation: int, strategy: str | None, batches, save_to: Path | None = None) -> dict:
    mp = _mlp_engine(policy, accumulation, strategy)
    for batch in batches:
        _mse_step(mp, batch)
    saved = None if save_to is None else ckpt.save_checkpoint(save_to, mp)
    return {"params": _params(mp), "reduce_dtypes": mpd.gradient_reduce_dtypes(mp.model),
            "applied": mp.applied_steps, "saved": saved,
            "momentum": [mp.optimizer.state[t]["momentum_buffer"].clone() for t in mp.master_parameters()]}


# ---------------------------------------------------------------------- DDP == one process
DDP_CASES = (("fp32", 1, FP32_TOL), ("bf16-mixed", 1, BF16_TOL), ("bf16-mixed", 2, BF16_TOL),
             ("bf16-pure", 2, BF16_TOL))
STEPS = 4


def _ddp_worker(rank: int, out: Path) -> dict:
    return {(policy, acc): _train_mlp(policy, acc, "ddp", mpd.shard_batches(_stream(STEPS * acc * WORLD)),
                                      save_to=out / "ck" if policy == "bf16-pure" else None)
            for policy, acc, _ in DDP_CASES}


@pytest.mark.timeout(120)
def test_ddp_two_ranks_equal_one_process_on_the_global_batch(tmp_path):
    ranks = run_ranks(_ddp_worker, tmp_path, timeout_s=100)
    init = {n: p.detach().float() for n, p in _mlp().named_parameters()}
    for policy, acc, tolerance in DDP_CASES:
        stream = list(_stream(STEPS * acc * WORLD))
        global_batches = [_cat(stream[i:i + acc * WORLD]) for i in range(0, len(stream), acc * WORLD)]
        ref = _train_mlp(policy, 1, None, global_batches)
        for r, result in enumerate(ranks):
            got = result[(policy, acc)]
            assert got["applied"] == STEPS
            assert got["reduce_dtypes"] == {torch.float32}, (policy, acc)  # also bf16 buckets (bf16-pure)
            assert _rel_update_diff(got["params"], ref["params"], init) <= tolerance, (policy, acc, r)
        for name in ref["params"]:  # replicas are bitwise identical
            assert torch.equal(ranks[0][(policy, acc)]["params"][name], ranks[1][(policy, acc)]["params"][name])
    # rank 0 alone saved the bf16-pure run in the one-process format; it loads into a one-process engine
    saved = ranks[0][("bf16-pure", 2)]
    assert saved["saved"] == ranks[1][("bf16-pure", 2)]["saved"] == tmp_path / "ck" / f"step-{STEPS}"
    manifest = ckpt.read_manifest(tmp_path / "ck")
    assert manifest["extra"]["distributed"] == {"strategy": "ddp", "world_size": 2}
    mp = _mlp_engine("bf16-pure", 2)
    ckpt.load_checkpoint(tmp_path / "ck", mp)
    assert mp.applied_steps == STEPS
    for name, value in _params(mp).items():  # no "module." prefix: the names are the model's own
        assert torch.equal(value, saved["params"][name]), name
    for got, want in zip((mp.optimizer.state[t]["momentum_buffer"] for t in mp.master_parameters()),
                         saved["momentum"]):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------- stochastic rounding: one stream
def _sr_worker(rank: int, out: Path) -> dict:
    """bf16-lean (stochastically rounded bf16 params) and int8 state rounded stochastically, under DDP. The
    rounding stream is keyed by the optimizer's ``sr_seed`` (by default ``torch.initial_seed()`` when it is
    built): seeded alike the replicas stay bitwise equal; seeded per rank (nanoGPT's ``manual_seed(1337 +
    rank)``) the engine refuses to build on every rank (each would round differently and the replicas drift
    apart) — also when one seed is set again after the optimizer was built ("late"), which the check of the
    global RNG state let through; an explicit common ``sr_seed`` makes per-rank global seeds harmless."""
    results = {}
    for case in ("alike", "per-rank", "late", "explicit"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 512), nn.GELU(), nn.Linear(512, 4))   # 8192 weights: int8 state
        torch.manual_seed(0 if case == "alike" else 1337 + rank)
        opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2, **({"sr_seed": 7} if case == "explicit" else {}))
        if case == "late":
            torch.manual_seed(0)
        try:
            mp = MixedPrecision(model, opt, "bf16-lean,state_rounding=stochastic", device="cpu", strategy="ddp")
        except ValueError as err:
            if "sr_seed" not in str(err):
                raise
            results[case] = (str(err), next(model.parameters()).dtype)
            continue
        for batch in mpd.shard_batches(_stream(4 * WORLD)):
            _mse_step(mp, batch)
        results[case] = {n: p.detach().float().clone() for n, p in mp.module.named_parameters()}
    return results


@pytest.mark.timeout(120)
def test_ddp_with_stochastic_rounding_needs_one_rounding_stream_on_every_rank(tmp_path):
    ranks = run_ranks(_sr_worker, tmp_path, timeout_s=100)
    for case in ("alike", "explicit"):
        got = [r[case] for r in ranks]
        assert all(torch.equal(got[0][n], got[1][n]) for n in got[0]), case
    for r in ranks:
        for case in ("per-rank", "late"):
            message, dtype = r[case]
            assert "rounding=stochastic and state_rounding=stochastic" in message and "torch.manual_seed" in message
            assert "sr_seed" in message and dtype == torch.float32, case   # refused before the model was cast


# ---------------------------------------------------------------------- case 28: one rank sees inf / NaN
def _inf_worker(rank: int, out: Path) -> dict:
    results = {}
    # (a) DDP: an inf written into rank 1's gradient after DDP's all-reduce (a rank-local fault)
    # (b) FSDP2 fp16: an inf in rank 1's shard only; the local check of rank 0 sees nothing
    for strategy, policy in (("ddp", "fp32"), ("fsdp2", "fp16-mixed")):
        model = _mlp()
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu",
                            loss_scale=DynamicLossScale(init_scale=4.0), strategy=strategy)
        batches = mpd.shard_batches(_stream(3 * WORLD))
        _mse_step(mp, next(batches))
        before = _params(mp)
        local_finite = []

        def inject():
            grad = next(mp.module.parameters()).grad
            grad_local = grad.to_local() if hasattr(grad, "to_local") else grad
            if rank == 1:
                grad_local[0, 0] = float("inf")
            local_finite.append(all(bool(torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all())
                                    for g in (p.grad for p in mp.module.parameters())))

        _, result = _mse_step(mp, next(batches), after_backward=inject)
        after_skip = _params(mp)
        _, result_next = _mse_step(mp, next(batches))
        results[strategy] = {"local_finite": local_finite[0], "applied": result.applied,
                             "reason": result.skipped_reason, "scale": float(mp.loss_scale.scale),
                             "scale_at_skip": result.loss_scale, "unchanged": all(
                                 torch.equal(before[n], after_skip[n]) for n in before),
                             "next_applied": result_next.applied, "params": _params(mp),
                             "counters": mp.state_dict()["counters"],
                             "loss_scale_state": {k: v.item() for k, v in mp.loss_scale.state_dict()["state"].items()}}
    # (c) DDP + Guard: rank 1's *loss value* is NaN (its gradients are finite), then a spike on rank 1 only
    model = _mlp()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.05), "bf16-mixed", device="cpu",
                        guard=Guard(snapshot_every=1, spike_warmup=2, spike_window=4), strategy="ddp")
    faults = {3: float("nan"), 6: 100.0}  # step -> what rank 1's loss value becomes
    outcomes = []
    for step, batch in enumerate(mpd.shard_batches(_stream(8 * WORLD))):
        fault = faults.get(step) if rank == 1 else None
        hook = None if fault is None else (
            (lambda loss: loss + float("nan")) if fault != fault else (lambda loss: loss + 99.0 * loss.detach()))
        _, result = _mse_step(mp, batch, loss_hook=hook)
        outcomes.append((result.applied, result.rolled_back, result.skipped_reason))
    results["guard"] = {"outcomes": outcomes, "counts": dict(mp.guard.counts), "params": _params(mp),
                        "counters": mp.state_dict()["counters"], "events": [e["kind"] for e in mp.events]}
    # (d) FSDP2 + Guard: the rollback restores every rank's shards (DTensor state) from its snapshot
    model = _mlp()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "bf16-mixed", device="cpu",
                        guard=Guard(snapshot_every=1), strategy="fsdp2")
    batches = mpd.shard_batches(_stream(3 * WORLD))
    _mse_step(mp, next(batches))
    before = _params(mp)
    nan_on_rank_1 = (lambda loss: loss + float("nan")) if rank == 1 else None
    _, result = _mse_step(mp, next(batches), loss_hook=nan_on_rank_1)
    restored = _params(mp)
    _, result_next = _mse_step(mp, next(batches))
    results["fsdp2_guard"] = {"rolled_back": result.rolled_back, "restored": all(
        torch.equal(before[n], restored[n]) for n in before), "next_applied": result_next.applied,
        "counters": mp.state_dict()["counters"], "counts": dict(mp.guard.counts)}
    return results


@pytest.mark.timeout(120)
def test_inf_or_nan_on_one_rank_makes_every_rank_skip_or_roll_back(tmp_path):
    r0, r1 = run_ranks(_inf_worker, tmp_path, timeout_s=100)
    for strategy in ("ddp", "fsdp2"):
        a, b = r0[strategy], r1[strategy]
        assert a["local_finite"] and not b["local_finite"], strategy  # only rank 1 saw the inf locally
        for r in (a, b):
            assert not r["applied"] and r["reason"] == "overflow", strategy
            assert r["unchanged"], strategy  # the skipped step left the params alone
            assert (r["scale_at_skip"], r["scale"]) == (4.0, 2.0), strategy  # both backed off: 4 -> 2
            assert r["next_applied"], strategy
        assert a["counters"] == b["counters"], strategy
        assert a["loss_scale_state"] == b["loss_scale_state"], strategy
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), (strategy, name)
    g0, g1 = r0["guard"], r1["guard"]
    assert g0["outcomes"] == g1["outcomes"]
    assert g0["outcomes"][3] == (False, True, "nonfinite")  # rank 0's loss was fine: it rolled back too
    assert g0["outcomes"][6][:2] == (False, True)           # a spike on rank 1 only: both rolled back
    assert g0["counts"] == g1["counts"] and g0["counts"]["nonfinite"] == 1 and g0["counts"]["spike"] == 1
    assert g0["counts"]["rollback"] == 2
    assert g0["counters"] == g1["counters"] and g0["events"] == g1["events"]
    for name in g0["params"]:
        assert torch.equal(g0["params"][name], g1["params"][name]), name
    f0, f1 = r0["fsdp2_guard"], r1["fsdp2_guard"]
    assert f0["rolled_back"] and f1["rolled_back"] and f0["restored"] and f1["restored"]
    assert f0["next_applied"] and f1["next_applied"]
    assert f0["counters"] == f1["counters"] and f0["counts"] == f1["counts"]


# ---------------------------------------------------------------------- FSDP2 == DDP; fp32 reductions
def _gpt_engine(strategy: str | None, policy: str, accumulation: int = 1, *, seed: int = 0, sgd: bool = False):
    from mixprec.workloads import get_workload

    workload = get_workload("gpt", config="tiny")
    torch.manual_seed(seed)
    model = workload.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9) if sgd else workload.make_optimizer(model)
    mp = MixedPrecision(model, optimizer, policy, device="cpu", scheduler=workload.make_scheduler(optimizer, 10),
                        max_grad_norm=workload.max_grad_norm, accumulation_steps=accumulation, strategy=strategy)
    return workload, mp


def _gpt_step(mp: MixedPrecision, workload, batch: dict):
    batch = mp.cast_inputs(batch)
    with mp.autocast():
        loss = workload.loss(mp.model, batch)
    mp.backward(loss)
    return float(loss.detach()), mp.step()


def _fsdp_worker(rank: int, out: Path) -> dict:
    seen: list[torch.dtype] = []  # what the gradient collectives were handed, observed outside mixprec
    reduce_scatter = dist.reduce_scatter_single

    def observe(output, input, *args, **kwargs):
        seen.append(input.dtype)
        return reduce_scatter(output, input, *args, **kwargs)

    dist.reduce_scatter_single = observe
    results = {}
    for strategy, accumulation in (("ddp", 2), ("fsdp2", 2), ("fsdp2", 1)):
        seen.clear()
        workload, mp = _gpt_engine(strategy, "bf16-mixed", accumulation, sgd=True)
        init = _params(mp)
        batches = mpd.shard_batches(workload.batches("train", 0))
        losses = [_gpt_step(mp, workload, next(batches))[0] for _ in range(3 * accumulation)]
        results[(strategy, accumulation)] = {
            "losses": losses, "init": init, "params": _params(mp), "applied": mp.applied_steps, "observed": list(seen),
            "reduce_dtypes": mpd.gradient_reduce_dtypes(mp.model),
            "sharded": sum(hasattr(p, "full_tensor") for p in mp.module.parameters()),
            "fsdp_modules": sorted(n for n, m in mp.module.named_modules() if hasattr(m, "set_custom_reduce_scatter"))}
    # keep_fp32 under FSDP2: the kept module is sharded on its own and gathered in fp32
    workload, mp = _gpt_engine("fsdp2", "bf16-mixed,keep_fp32=ln_f", sgd=True)
    ran_in: dict[str, tuple] = {}
    for name in ("ln_f", "blocks.0.ln_1"):
        mp.module.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: ran_in.setdefault(name, (m.weight.dtype, out.dtype)) and None)
    _gpt_step(mp, workload, next(mpd.shard_batches(workload.batches("train", 0))))
    results["keep_fp32"] = {"ran_in": ran_in, "fsdp_modules": sorted(
        n for n, m in mp.module.named_modules() if hasattr(m, "set_custom_reduce_scatter"))}
    return results


@pytest.mark.timeout(120)
def test_fsdp2_bf16_matches_ddp_and_reduces_gradients_in_fp32(tmp_path):
    ranks = run_ranks(_fsdp_worker, tmp_path, timeout_s=100)
    for r, res in enumerate(ranks):
        ddp = res[("ddp", 2)]
        for acc in (2, 1):
            fsdp = res[("fsdp2", acc)]
            assert fsdp["fsdp_modules"] == ["", "blocks.0", "blocks.1"]  # per block, then the root
            assert fsdp["sharded"] == len(fsdp["params"])
            # every reduce-scatter ran in fp32, on the accumulation path (no-sync micro-batches) and without
            assert fsdp["observed"] and set(fsdp["observed"]) == {torch.float32}, (acc, fsdp["observed"])
            assert fsdp["reduce_dtypes"] == {torch.float32}
            assert len(fsdp["observed"]) == 3 * 3  # 3 boundaries x 3 FSDP groups: no reduction mid-accumulation
            assert fsdp["applied"] == 3
        fsdp = res[("fsdp2", 2)]
        assert ddp["reduce_dtypes"] == {torch.float32}
        torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(ddp["losses"]), rtol=BF16_EPS, atol=0)
        assert _rel_update_diff(fsdp["params"], ddp["params"], ddp["init"]) <= BF16_TOL, r
        keep = res["keep_fp32"]
        assert keep["fsdp_modules"] == ["", "blocks.0", "blocks.1", "ln_f"]
        # a block's LayerNorm gathers bf16 weights; ops=portable runs layer_norm in fp32 as CUDA's autocast does
        assert keep["ran_in"] == {"ln_f": (torch.float32, torch.float32), "blocks.0.ln_1": (torch.bfloat16, torch.float32)}
    for key in (k for k in ranks[0] if k != "keep_fp32"):  # the whole model is the same on both ranks
        for name in ranks[0][key]["params"]:
            assert torch.equal(ranks[0][key]["params"][name], ranks[1][key]["params"][name]), (key, name)


# ---------------------------------------------------------------------- DCP: 2 FSDP2 ranks -> 1 process
SAVE_AT, CONTINUE = 3, 2


def _checkpoint_worker(rank: int, out: Path) -> dict:
    workload, mp = _gpt_engine("fsdp2", "bf16-mixed", sgd=True)
    batches = mpd.shard_batches(workload.batches("train", 0))
    for _ in range(SAVE_AT):
        _gpt_step(mp, workload, next(batches))
    saved = ckpt.save_checkpoint(out / "ck", mp, extra={"note": "two ranks"})
    at_save = {"params": _params(mp), "momentum": {n: _full(mp.optimizer.state[p]["momentum_buffer"])
                                                   for n, p in mp.module.named_parameters()},
               "lr": mp.optimizer.param_groups[0]["lr"], "counters": mp.state_dict()["counters"]}
    losses = [_gpt_step(mp, workload, next(batches))[0] for _ in range(CONTINUE)]
    return {"saved": str(saved), "at_save": at_save, "losses": losses, "params": _params(mp)}


@pytest.mark.timeout(120)
def test_fsdp2_checkpoint_from_two_ranks_resumes_in_one_process(tmp_path):
    r0, r1 = run_ranks(_checkpoint_worker, tmp_path, timeout_s=100)
    workload, mp = _gpt_engine(None, "bf16-mixed", seed=123, sgd=True)  # other weights: all must come from the file
    assert r0["saved"] == r1["saved"] == str(tmp_path / "ck" / f"step-{SAVE_AT}")
    extra = ckpt.load_checkpoint(tmp_path / "ck", mp)  # the root: follows `latest`
    assert extra == {"note": "two ranks"}
    manifest = ckpt.read_manifest(tmp_path / "ck")
    assert (manifest["strategy"], manifest["world_size"], manifest["policy"]) == ("fsdp2", 2, "bf16-mixed")
    assert manifest["data_position"] == {"boundaries": SAVE_AT, "world_size": 2}
    at_save = r0["at_save"]
    assert mp.state_dict()["counters"] == at_save["counters"]
    assert mp.optimizer.param_groups[0]["lr"] == at_save["lr"]  # the scheduler resumed too
    for name, p in mp.module.named_parameters():
        assert torch.equal(p.detach(), at_save["params"][name]), name
        assert torch.equal(mp.optimizer.state[p]["momentum_buffer"], at_save["momentum"][name]), name
    # continue on the same global batches the two ranks saw: batches 2k and 2k+1 of the stream, together
    stream = workload.batches("train", 0)
    for _ in range(SAVE_AT * WORLD):
        next(stream)
    losses = []
    for _ in range(CONTINUE):
        loss, result = _gpt_step(mp, workload, _cat([next(stream) for _ in range(WORLD)]))
        assert result.applied
        losses.append(loss)
    two_rank_mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(two_rank_mean), rtol=BF16_EPS, atol=0)
    assert _rel_update_diff(_params(mp), r0["params"], at_save["params"]) <= BF16_TOL


# ---------------------------------------------------------------------- one process: no collectives, clear refusals
def test_strategy_none_runs_no_collective(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran with strategy=None")

    for name in ("all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, forbidden)
    model = _mlp()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed", device="cpu",
                        guard=Guard(snapshot_every=1))
    for batch in _stream(3):
        _, result = _mse_step(mp, batch)
        assert result.applied
    assert mp.model is mp.module is model and mp.strategy is None


def test_unknown_strategy_is_refused_naming_the_choices():
    model = _mlp()
    with pytest.raises(ValueError, match=r"strategy='zero3' is not allowed; choose None .* \('ddp', 'fsdp2'\)"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu", strategy="zero3")


@pytest.mark.parametrize("policy, match", [
    ("fp16-mixed", "computes in fp16 under FSDP2.*ORs the found-inf flag"),   # case 29: never silently underflow
    # bf16-lean (8-bit state) runs under FSDP2 since issue 28: tests/distributed/test_fsdp2_quantized.py
])
def test_fsdp2_refuses_what_it_cannot_run_safely(policy, match):
    with pytest.raises(ValueError, match=match):  # refused before any collective: no process group needed
        mpd.wrap_model(_mlp(), Policy.parse(policy), "fsdp2", torch.device("cpu"))


def test_shard_batches_gives_rank_r_every_world_size_th_batch():
    assert list(mpd.shard_batches(range(7), rank=1, world_size=2)) == [1, 3, 5]
    assert list(mpd.shard_batches(range(7))) == list(range(7))  # no process group: one rank takes all
    with pytest.raises(ValueError, match=r"rank=2 must lie in \[0, world_size=2\)"):
        mpd.shard_batches(range(3), rank=2, world_size=2)


def test_any_across_ranks_without_a_group_is_the_flag_itself():
    flag = torch.tensor([0.0, 1.0])
    assert mpd.any_across_ranks(flag) is flag
    assert mpd.is_main_process() and mpd.world_size() == 1 and mpd.rank() == 0


# ---------------------------------------------------------------------- one checkpoint writer for both formats
def _dcp_run(steps: int) -> MixedPrecision:
    """A one-process engine on the DCP path (strategy=None, fp32: the optimizer steps the params)."""
    mp = _mlp_engine("fp32")
    for batch in _stream(steps):
        _mse_step(mp, batch)
    return mp


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name the fsynced files")
def test_dcp_save_fsyncs_every_file_and_directory_before_the_rename_then_latest(tmp_path, monkeypatch):
    from mixprec.checkpoint import layout as checkpoint_dir
    log: list[tuple] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (log.append(("fsync", _fd_path(fd))), real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (log.append(("rename", str(a), str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (log.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    root = tmp_path / "ck"
    saved = ckdcp.save(root, _dcp_run(2))
    monkeypatch.undo()

    assert saved == root / "step-2" and checkpoint_dir.resolve_checkpoint(root) == saved
    (_, tmp, final), = [e for e in log if e[0] == "rename" and e[2] == str(saved)]
    at_rename = log.index(("rename", tmp, final))
    synced_before = {e[1] for e in log[:at_rename] if e[0] == "fsync"}
    written = [p for p in saved.rglob("*")] + [saved]
    assert any(p.suffix == ".distcp" for p in written) and (saved / "manifest.json").is_file()
    for path in written:   # every file DCP and rank 0 wrote, every directory, under the temporary name
        assert str(path).replace(str(saved), tmp) in synced_before, path.relative_to(root)
    (_, pointer, latest), = [e for e in log if e[0] == "replace"]
    assert latest == str(root / "latest") and log.index(("replace", pointer, latest)) > at_rename
    assert ("fsync", pointer) in log[at_rename:log.index(("replace", pointer, latest))]
    assert ("fsync", str(root)) in log[at_rename:]                      # the rename and the pointer, durable
    assert (root / "latest").read_text() == "step-2\n"


# A kill -9 at each point of the commit, in a fresh process (forking pytest could deadlock in OpenMP).
_KILLED_SAVE = """
import os, signal, sys
sys.path[:0] = {paths!r}   # this file's folder, and tests/ (ranks.py, engine_loops.py)
import test_distributed as T
point = {point!r}
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
if point == "commit":   # the temporary directory is written (shards and manifest), nothing committed yet
    T.ckdcp.commit_checkpoint = die
else:                   # os.rename of .tmp to step-N, or os.replace of .latest-... to latest
    real = getattr(os, point)
    def die_at_commit(src, dst, *args, **kwargs):
        if os.path.basename(dst) in ("step-5", "latest"):   # not DCP's own rename of its .metadata
            die()
        return real(src, dst, *args, **kwargs)
    setattr(os, point, die_at_commit)
T.ckdcp.save({root!r}, T._dcp_run(5), keep=1)
os._exit(3)
"""


@pytest.mark.parametrize("point", ["commit", "rename", "replace"])
def test_dcp_save_killed_mid_way_leaves_latest_naming_the_previous_loadable_checkpoint(tmp_path, point):
    import subprocess
    import sys

    root = tmp_path / "ck"
    before = _dcp_run(2)
    ckdcp.save(root, before, keep=1)
    code = _KILLED_SAVE.format(paths=[str(Path(__file__).parent), str(Path(__file__).parents[1])], root=str(root), point=point)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    left = sorted(p.name for p in root.iterdir())
    assert any(name.startswith(".tmp-step-5-") for name in left) == (point != "replace"), left
    assert ("step-5" in left) == (point == "replace"), left   # renamed: complete, but latest not yet moved
    assert (root / "latest").read_text() == "step-2\n"
    fresh = _mlp_engine("fp32")
    ckpt.load_checkpoint(root, fresh)
    assert fresh.boundaries == 2
    for (name, p), q in zip(fresh.module.named_parameters(), before.module.parameters()):
        assert torch.equal(p, q), name
    ckdcp.save(root, fresh, keep=1)   # the next save clears what the killed one left
    # a step-5 renamed before the kill is ahead of the resumed run's step-2: a future it left, set aside; the
    # step-2 it resumed from is its parent (kept as the run's own, then pruned by keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2.1"] + ["superseded"] * (point == "replace")
    assert not (root / "superseded" / "step-2").exists()


def test_dcp_save_that_raises_after_writing_removes_its_temporary_directory(tmp_path, monkeypatch):
    from mixprec.checkpoint import layout as checkpoint_dir
    root = tmp_path / "ck"
    ckdcp.save(root, _dcp_run(2))

    real_rename = os.rename

    def fail_at_commit(src, dst):   # DCP's own rename of its .metadata goes through
        if Path(dst).name.startswith("step-"):
            raise OSError("disk full (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint_dir.os, "rename", fail_at_commit)
    with pytest.raises(OSError, match="simulated"):
        ckdcp.save(root, _dcp_run(3))
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2"]
    assert ckpt.read_manifest(root)["step"] == 2


@pytest.mark.parametrize("save", ["local", "dcp"])
def test_both_formats_keep_exactly_k_checkpoints_the_new_one_and_the_newest_others(tmp_path, save):
    from mixprec.checkpoint import local as checkpoint
    from mixprec.checkpoint.layout import step_dirs

    save_fn = {"local": checkpoint.save_checkpoint, "dcp": ckdcp.save}[save]
    root = tmp_path / "ck"
    mp = _mlp_engine("fp32")
    for batch in _stream(4):
        _mse_step(mp, batch)
        save_fn(root, mp, keep=2)
    assert [d.name for d in step_dirs(root)] == ["step-3", "step-4"]
    with pytest.warns(UserWarning, match="step of 2 checkpoint"):   # a run restarted from scratch: the old
        save_fn(root, _mlp_engine("fp32"), keep=2)                   # run's later ones are set aside, kept
    assert [d.name for d in step_dirs(root)] == ["step-0"]
    assert [d.name for d in step_dirs(root / "superseded")] == ["step-3", "step-4"]
    assert (root / "latest").read_text() == "step-0\n"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ValueError, match="save_checkpoint keep=0 is not allowed"):
        save_fn(root, mp, keep=0)


# ---------------------------------------------------------------------- the command line under torchrun
@pytest.mark.timeout(240)
def test_train_under_torchrun_with_fsdp2_then_resume_in_one_process(tmp_path):
    """`mixprec train` under torchrun at 2 FSDP2 ranks writes a DCP checkpoint and a log per rank; one plain process
    resumes it (DCP reshards) and says the global batch changes (2 x 128 tokens of the tiny GPT to 1 x 128) with the
    reshard event's words; a later resume at the same world size says nothing of it (the words also asserted by
    tests/engine/test_user_messages.py::test_a_resume_at_another_world_size_says_the_global_batch_changes, slow)."""
    import json
    import subprocess
    import sys

    from mixprec.checkpoint.dcp import reshard_note
    from mixprec.workloads.gpt import GPT_CONFIGS

    out = tmp_path / "run"
    common = ["-m", "mixprec", "train", "--workload", "gpt", "--config", "tiny", "--policy", "bf16-mixed",
              "--strategy", "fsdp2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port())]
    done = subprocess.run([*launch, *common, "--steps", "2"], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = ckpt.read_manifest(out / "checkpoints")
    assert (manifest["format"], manifest["strategy"], manifest["world_size"]) == ("mixprec-dcp", "fsdp2", 2)
    assert manifest["data_position"]["batches"] == 2 and manifest["data_position"]["world_size"] == 2
    for log in (out / "metrics.jsonl", out / "rank-1" / "metrics.jsonl"):  # rank 0 at the top, rank 1 apart
        assert [r["step"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"] == [1, 2]
    # the 2-rank FSDP2 run continues in one plain process (a group of one): DCP reshards the checkpoint
    done = subprocess.run([sys.executable, *common, "--steps", "3", "--resume"], env=env, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "step-2" in done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert ckpt.read_manifest(out / "checkpoints")["world_size"] == 1
    per = GPT_CONFIGS["tiny"].batch_size * GPT_CONFIGS["tiny"].block_size
    assert (f"mixprec train: --resume: the checkpoint was saved at 2 rank(s), this run has 1: the global batch "
            f"changes from 2 x {per} = {2 * per} tokens per step to 1 x {per} = {per} tokens") in done.stderr
    assert f"for the same global batch resume on 2 rank(s); {reshard_note(2, 1)}" in done.stderr
    done = subprocess.run([sys.executable, *common, "--steps", "4", "--resume"], env=env, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0 and "resuming from" in done.stderr, done.stderr[-3000:]
    assert "global batch" not in done.stderr


@pytest.mark.slow   # default set: tests/programs/test_bench_fsdp2.py runs the bench under torchrun at 2 ranks (--strategy fsdp2,
# the same runner and workers) and asserts these: the table on rank 0 alone, a worker per rank, throughput summed
@pytest.mark.timeout(120)
def test_bench_under_torchrun_writes_the_report_with_throughput_summed_over_ranks(tmp_path):
    import json
    import subprocess
    import sys

    from mixprec.programs.bench.report import POLICY_KEYS

    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), "-m", "mixprec", "bench", "--workload",
                           "gpt", "--config", "tiny", "--policies", "fp32", "--steps", "5", "--strategy", "ddp",
                           "--out", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("REFERENCE") == 1  # rank 0 alone prints the table
    results = json.loads((out / "results.json").read_text())
    assert (results["settings"]["strategy"], results["settings"]["world_size"]) == ("ddp", 2)
    assert (out / "report.md").is_file()
    entry = results["policies"]["fp32"]
    assert set(POLICY_KEYS) <= set(entry) and entry["verdict"] == "REFERENCE"
    ranks = [json.loads((out / "workers" / sub / "0-fp32.json").read_text()) for sub in ("", "rank-1")]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    per_rank = [r["items_per_batch"] / r["step_time_ms_median"] * 1e3 for r in ranks]  # each rank's own speed
    assert entry["items_per_s"] == pytest.approx(sum(per_rank), rel=1e-9)
    assert entry["tokens_per_s"] == entry["items_per_s"]


# ================================================================ cases 28 and 29 in a one-process gloo group


# ---------------------------------------------------------------- cases 28 and 29: one-process gloo group
@pytest.fixture
def gloo_world_of_one(monkeypatch):
    port = free_port()
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_case28_flags_of_every_micro_batch_go_through_the_agreement(gloo_world_of_one):
    model = _small_mlp()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure", device="cpu",
                        strategy="ddp", accumulation_steps=2)
    calls = []
    real = mpd.any_across_ranks

    def counting(flags):
        calls.append(flags.detach().clone())
        return real(flags)

    mpd.any_across_ranks = counting
    try:
        x = torch.randn(2, 8) * 0.1
        assert _one_step(mp, x, lambda out: out.float().mean() * float("nan")) is None   # NaN in micro-batch 1
        skipped = _one_step(mp, x, lambda out: out.float().mean())
        applied = [_one_step(mp, x, lambda out: out.float().mean()) for _ in range(2)][-1]
    finally:
        mpd.any_across_ranks = real
    assert (skipped.applied, skipped.skipped_reason) == (False, "nonfinite")
    assert applied.applied and (mp.applied_steps, mp.skipped_total, mp.boundaries) == (1, 1, 2)
    assert len(calls) == 2 and calls[0].tolist() == [1.0, 1.0] and calls[1].tolist() == [0.0, 0.0]
    assert mp.agree_on("spike", ("nonfinite", "spike")) == "spike"
    with pytest.raises(ValueError, match=r"choice='oops' is not one of"):
        mp.agree_on("oops", ("nonfinite", "spike"))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_case29_gradient_collectives_run_in_fp32_with_and_without_accumulation(gloo_world_of_one, accumulation):
    model = _small_mlp()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure", device="cpu",
                        strategy="ddp", accumulation_steps=accumulation)
    assert mpd.gradient_reduce_dtypes(mp.model) == frozenset()     # nothing reduced yet
    for _ in range(2 * accumulation):
        _one_step(mp, torch.randn(4, 8) * 0.1, lambda out: out.float().pow(2).mean())
    assert mp.applied_steps == 2
    assert mpd.gradient_reduce_dtypes(mp.model) == {FP32}
    fp16 = _small_mlp()   # fp16 under FSDP2: the engine wires its sharded found-inf check and a dynamic scale
    mp16 = MixedPrecision(fp16, torch.optim.SGD(fp16.parameters(), lr=0.1), "fp16-mixed", device="cpu",
                          strategy="fsdp2")
    assert mp16.loss_scale.dynamic and float(mp16.loss_scale.scale) == 2.0 ** 16


# ---------------------------------------------------------------------- FSDP2 side inputs stay fp32
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, phase, *, mask=None):
        return self.lin(x) + torch.cos(phase) + (0 if mask is None else mask)


class _SideNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.register_buffer("phase", torch.linspace(0, 2000, 8))

    def forward(self, x):
        mask = torch.full((8,), 1e-3) * self.phase   # fp32, made in the forward, passed by keyword
        for block in self.blocks:
            x = block(x, self.phase, mask=mask)
        return x


def _side_worker(rank: int, out: Path) -> dict:
    model = _SideNet()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed", device="cpu",
                        strategy="fsdp2")
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0].dtype, args[1].dtype, kwargs["mask"].dtype)) and None, with_kwargs=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with mp.autocast():
        y = mp.model(mp.cast_inputs(x))
    return {"out": y.detach().float(), "seen": seen}


@pytest.mark.timeout(120)
def test_fsdp2_side_inputs_reach_the_blocks_in_fp32(tmp_path):
    results = run_ranks(_side_worker, tmp_path, timeout_s=100)
    model = _SideNet()
    one = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed", device="cpu")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with one.autocast():
        want = one.model(one.cast_inputs(x)).detach().float()
    for r in results:
        # the hidden state is cast (FSDP's all-gather dtype), the phase table and the keyword mask are not
        assert r["seen"][0] == (torch.bfloat16, torch.float32, torch.float32)
        # as in one process up to the bf16 matmuls (each |output| <= ~4: a few bf16 ulps of 4 = 2**-6)
        assert float((r["out"] - want).abs().max()) <= 4 * 2.0 ** -6


# ---------------------------------------------------------------------- FSDP2: a finite norm that overflows fp32 squares
def _huge_norm_worker(rank: int, out: Path) -> dict:
    mp = _mlp_engine("fp32", strategy="fsdp2")   # max_grad_norm=1.0
    before = _params(mp)
    norm64 = []

    def blow_up():   # finite gradients ~1e25: their squares (1e50) overflow fp32, their norm does not
        for p in mp.module.parameters():
            p.grad.to_local().mul_(1e25) if hasattr(p.grad, "to_local") else p.grad.mul_(1e25)
        norm64.append(sum(float((_full(p.grad).double() ** 2).sum()) for p in mp.module.parameters()) ** 0.5)

    _, result = _mse_step(mp, next(mpd.shard_batches(_stream(WORLD))), after_backward=blow_up)
    step = {n: _params(mp)[n] - before[n] for n in before}
    return {"applied": result.applied, "norm": result.grad_norm, "norm64": norm64[0],
            "step_norm": sum(float((d.double() ** 2).sum()) for d in step.values()) ** 0.5}


@pytest.mark.timeout(120)
def test_fsdp2_clips_finite_gradients_whose_squares_overflow_fp32(tmp_path):
    for r in run_ranks(_huge_norm_worker, tmp_path, timeout_s=100):
        assert r["applied"] and math.isfinite(r["norm"])
        assert abs(r["norm"] - r["norm64"]) <= 1e-5 * r["norm64"]   # fp32 rounding of the scaled sums
        assert 0.0 < r["step_norm"] <= 0.1 * (1 + 1e-5) * 1.0 + 1e-6   # lr 0.1 x clipped norm 1: not zeroed


# ---------------------------------------------------------------------- the replicas' fingerprint (issue 37)
def test_fingerprint_is_the_position_weighted_sum_of_the_bit_patterns():
    """One int64 per tensor, sum of bits(x_i) * (2i + 1) in exact integer arithmetic: [1.0, 2.0] in fp32 is
    0x3F800000 * 1 + 0x40000000 * 3; bf16 reads its 16-bit patterns (0x3F80, 0x4000); one ulp anywhere, a sign
    of zero or a swap of two elements changes it."""
    from mixprec.distributed.replicas import fingerprints

    pair = torch.tensor([1.0, 2.0])
    got = fingerprints([pair, pair.bfloat16(), torch.tensor([2.0, 1.0])])
    assert got.dtype == torch.int64 and got.tolist() == [0x3F800000 + 3 * 0x40000000, 0x3F80 + 3 * 0x4000,
                                                         0x40000000 + 3 * 0x3F800000]
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    ulp = x.clone()
    ulp.view(-1)[7] = torch.nextafter(ulp.view(-1)[7], torch.tensor(float("inf")))
    zeros = torch.zeros(4)
    signed = zeros.clone()
    signed[2] = -0.0
    a, b, c, d = fingerprints([x, ulp, zeros, signed]).tolist()
    assert a == fingerprints([x.clone()]).item() and a != b and c != d
    assert fingerprints([x.t()]).item() == fingerprints([x.t().contiguous()]).item()   # layout-free: element order
