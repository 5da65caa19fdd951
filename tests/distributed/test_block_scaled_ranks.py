"""Block-scaled linears (``mxfp8-mixed``, ``nvfp4-mixed``) under DDP and FSDP2 on 2 gloo ranks, against one process.

What makes a W-rank run one process's (mixprec.distributed.wrapping, mixprec.blockscale.streams): FSDP2 all-gathers
the fp32 params before the linears, so every block scale is the whole weight's; every rank rounds with the same
stochastic-rounding stream per linear, counted per backward call; every gradient collective sums in fp32. The
harness (tests/ranks.py) compares what the ranks return with one process in the pytest process (one thread, as
the ranks). SGD with momentum, no clipping (a norm over shards sums in another order).

* (a) **Every rank the global batch**: each rank's gradient is one process's, the fp32 reduction of 2 equal terms
  divided by 2 is exact, so after 4 steps the losses and every param equal one process's with ``==`` /
  ``torch.equal``, stochastic rounding and Hadamard signs included.
* (b) **Shards, round to nearest** (``mxfp8-mixed``; ``nvfp4-mixed,block=nvfp4-plain``): a rank's activations and
  gradients are its own tensors (NVFP4's tensor scale is its shard's amax, as Transformer Engine computes it with
  no amax reduction over data-parallel ranks), so a 2-rank step is one process's step accumulating the 2 shards as
  micro-batches: each shard's ``dW`` rounded to bf16, halved (exact) and summed once in fp32, in both. Asserted bit
  for bit. What separates either from one process on the concatenated batch is that process's own choice between
  one batch and two micro-batches (where ``dW`` rounds to bf16, NVFP4's tensor scales): not the distribution.
* (c) **Shards, stochastic rounding** (``nvfp4-mixed``): rank 1 rounds its shard with the bits one process gives the
  first rows, so the world size changes the noise, not its law. Statistically: the 2-rank params' distance to one
  process's (global batch) is at most twice the distance between two one-process runs whose streams differ (moved
  on by 1000 calls). Both are distances between two realizations of the rounding noise of the same update. On top,
  the 2-rank run's noise is correlated across its ranks (shared bits: at most twice the variance, a factor
  sqrt(3/2) on the expected distance) and it carries (b)'s deterministic effect of sharding (per-shard ``dW``
  rounding, NVFP4's per-shard tensor scales), which adds in quadrature: the factor 2 leaves it up to 1.6 times the
  spread. (Measured here: the spreads of three stream offsets within 0.6 % of each other, the 2-rank distance 1.01
  times the spread.) A coarse check, of errors as large as the noise; (a) checks the mechanisms bit for bit.
* (d) Checkpoints: an FSDP2 run saved with DCP after 2 steps and resumed in fresh engines (whose streams had moved
  on) continues bit for bit, losses and params; so does DDP's (rank 0's one-process file). An FSDP2 checkpoint of
  2 ranks on the global batch continues in one process as one process's uninterrupted run: the streams' state is
  one count per linear at any world size. Ranks whose streams differ at a save: warned and recorded.
* (e) What FSDP2 cannot do with the block-scaled linears it sharded is refused by name: ``set_policy`` swapping them
  and the guard's first rung. Under DDP ``set_policy`` swaps them out and in again (DDP re-lists the buffers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec import checkpoint as ckpt
from mixprec.blockscale import BlockScaledLinear
from mixprec.distributed import process as mpd
from mixprec.policy.policy import Policy
from mixprec.safety.escalation import next_policy
from block_nets import Net
from ranks import run_ranks

WORLD, STEPS, ROWS = 2, 4, 32          # ROWS per rank: one MX block of tokens (wgrad's M) per shard
SAME = ("mxfp8-mixed", "nvfp4-mixed")
NEAREST = ("mxfp8-mixed", "nvfp4-mixed,block=nvfp4-plain")
SR = "nvfp4-mixed"


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(WORLD * ROWS, 16, generator=g), torch.randint(0, 8, (WORLD * ROWS,), generator=g)


def _shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in _global_batch(step))


def _engine(policy: str, strategy: str | None, accumulation: int = 1) -> MixedPrecision:
    torch.manual_seed(0)
    model = Net()
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy, device="cpu",
                          strategy=strategy, accumulation_steps=accumulation)


def _step(mp: MixedPrecision, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = batch
    with mp.autocast():
        loss = nn.functional.cross_entropy(mp.model(x).float(), y)
    mp.backward(loss)
    mp.step()
    return loss.item()


def _streams(mp: MixedPrecision) -> dict[str, list[int]]:
    return {n: m.get_extra_state().tolist() for n, m in mp.module.named_modules() if isinstance(m, BlockScaledLinear)}


def _snapshot(mp: MixedPrecision, losses: list[float]) -> dict:
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in mp.module.named_parameters()}
    return {"losses": losses, "params": params, "streams": _streams(mp), "decision": mp.decision,
            "reduce_dtypes": mpd.gradient_reduce_dtypes(mp.model) if mp.strategy else None}


def _train(policy: str, strategy: str | None, batches: list, accumulation: int = 1, move_streams: int = 0) -> dict:
    mp = _engine(policy, strategy, accumulation)
    for m in mp.module.modules():   # move_streams: the same run with each stream that many calls on
        if isinstance(m, BlockScaledLinear) and move_streams:
            m.set_extra_state(m.get_extra_state() + torch.tensor([0, move_streams]))
    return _snapshot(mp, [_step(mp, b) for b in batches])


def _one_process(*args, **kwargs) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the ranks: the same kernels' summation order
    try:
        return _train(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------- (a), (b), (c): one launch per strategy
def _worker(rank: int, out: Path, strategy: str) -> dict:
    same = {p: _train(p, strategy, [_global_batch(i) for i in range(STEPS)]) for p in SAME}
    shards = {p: _train(p, strategy, [_shard(i, rank) for i in range(STEPS)]) for p in (*NEAREST, SR)}
    return {"same": same, "shards": shards}


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def ranks(request, tmp_path_factory):
    return request.param, run_ranks(_worker, tmp_path_factory.mktemp(request.param), request.param)


def _assert_same_run(got: dict, want: dict, what: tuple) -> None:
    assert got["losses"] == want["losses"], what
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), (*what, name)
    assert got["streams"] == want["streams"], what


@pytest.mark.timeout(300)
def test_every_rank_on_the_global_batch_equals_one_process_bit_for_bit(ranks):
    strategy, results = ranks
    for policy in SAME:
        want = _one_process(policy, None, [_global_batch(i) for i in range(STEPS)])
        sr = Policy.parse(policy).block == "nvfp4"   # its recipe rounds dy stochastically: a count per backward
        assert sorted(want["streams"].values()) == [[i, STEPS if sr else 0] for i in range(6 if sr else 8)]
        for r, result in enumerate(results):
            got = result["same"][policy]
            _assert_same_run(got, want, (strategy, policy, r))
            assert got["reduce_dtypes"] == {torch.float32}, (strategy, policy)
            assert ("same stochastic-rounding stream per linear" in got["decision"]) == sr, got["decision"]
            assert ("all-gathers the params as stored (fp32)" in got["decision"]) == (strategy == "fsdp2")
        assert not torch.equal(want["params"]["blocks.0.fc1.weight"], _start()["blocks.0.fc1.weight"])   # trained


@pytest.mark.timeout(300)
def test_on_shards_round_to_nearest_equals_one_process_accumulating_the_shards(ranks):
    strategy, results = ranks
    micro = [_shard(i, r) for i in range(STEPS) for r in range(WORLD)]
    for policy in NEAREST:
        want = _one_process(policy, None, micro, accumulation=WORLD)
        for r, result in enumerate(results):
            got = result["shards"][policy]
            assert got["losses"] == want["losses"][r::WORLD], (strategy, policy, r)   # rank r's = micro-batch r's
            for name, value in want["params"].items():
                assert torch.equal(got["params"][name], value), (strategy, policy, r, name)


def _start() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach() for n, p in Net().named_parameters()}


def _distance(a: dict, b: dict) -> float:
    return float(sum(((a[n].float() - b[n].float()) ** 2).sum() for n in b) ** 0.5)


@pytest.mark.timeout(300)
def test_on_shards_stochastic_rounding_is_within_one_process_s_own_rounding_spread(ranks):
    strategy, results = ranks
    batches = [_global_batch(i) for i in range(STEPS)]
    want = _one_process(SR, None, batches)
    other = _one_process(SR, None, batches, move_streams=1000)
    spread = _distance(other["params"], want["params"])
    assert spread > 1e-2 * _distance(want["params"], _start()), spread   # the rounding noise is real here
    for r, result in enumerate(results):
        got = result["shards"][SR]
        assert _distance(got["params"], want["params"]) <= 2 * spread, (strategy, r, spread)
        assert got["streams"] == want["streams"], (strategy, r)   # one count per backward call, as one process
    for name, value in results[0]["shards"][SR]["params"].items():   # the ranks hold one model
        assert torch.equal(results[1]["shards"][SR]["params"][name], value), name


# ---------------------------------------------------------------------- (d) checkpoints, (e) refusals
def _resume(policy: str, strategy: str, root: Path, batches: list) -> dict:
    """2 steps, save, 2 more; a fresh engine one step elsewhere (its streams and weights moved on) loads the save
    and takes the same 2 steps."""
    mp = _engine(policy, strategy)
    for batch in batches[:2]:
        _step(mp, batch)
    ckpt.save_checkpoint(root, mp)
    straight = _snapshot(mp, [_step(mp, b) for b in batches[2:]])
    resumed = _engine(policy, strategy)
    _step(resumed, batches[-1])
    ckpt.load_checkpoint(root, resumed)
    loaded = _streams(resumed)
    return {"straight": straight, "resumed": _snapshot(resumed, [_step(resumed, b) for b in batches[2:]]),
            "loaded": loaded}


def _checkpoint_worker(rank: int, out: Path) -> dict:
    import warnings

    shards = [_shard(i, rank) for i in range(STEPS)]
    results = {("fsdp2", p): _resume(p, "fsdp2", out / f"fsdp2-{p}", shards) for p in SAME}
    results[("ddp", SR)] = _resume(SR, "ddp", out / "ddp", shards)
    mp = _engine(SR, "fsdp2")   # on the global batch: continued in one process by the test
    for i in range(2):
        _step(mp, _global_batch(i))
    ckpt.save_checkpoint(out / "global", mp)
    try:
        mp.set_policy("bf16-mixed")
    except ValueError as err:
        results["set_policy"] = str(err)
    if rank == 1:   # as if rank 1 had run backward through blocks.0.fc1 once more than rank 0
        fc1 = mp.module.blocks[0].fc1
        fc1.set_extra_state(fc1.get_extra_state() + torch.tensor([0, 1]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.save_checkpoint(out / "uneven", mp)
    results["uneven"] = ([str(w.message) for w in caught], [e.to_dict() for e in mp.events if e.kind == "block-streams"])
    return results


@pytest.mark.timeout(300)
def test_checkpoints_resume_bit_for_bit_and_continue_at_another_world_size(tmp_path):
    results = run_ranks(_checkpoint_worker, tmp_path)
    for key in (*(("fsdp2", p) for p in SAME), ("ddp", SR)):
        for r, result in enumerate(results):
            got = result[key]
            _assert_same_run(got["resumed"], got["straight"], (*key, r))
            counted = key[1] == SR   # nvfp4-mixed counts its backward calls; mxfp8-mixed has no stream to count
            assert got["loaded"] == {n: [s[0], 2 if counted else 0] for n, s in got["straight"]["streams"].items()}
    manifest = ckpt.read_manifest(tmp_path / f"fsdp2-{SR}")
    assert (manifest["format"], manifest["world_size"]) == ("mixprec-dcp", WORLD)
    # saved by 2 FSDP2 ranks on the global batch after 2 steps; one process continues as if never interrupted
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches = [_global_batch(i) for i in range(STEPS)]
        want = _train(SR, None, batches)
        mp = _engine(SR, None)
        ckpt.load_checkpoint(tmp_path / "global", mp)
        got = _snapshot(mp, [_step(mp, b) for b in batches[2:]])
    finally:
        torch.set_num_threads(threads)
    assert got["losses"] == want["losses"][2:] and got["streams"] == want["streams"]
    assert all(torch.equal(got["params"][n], v) for n, v in want["params"].items())
    for r, result in enumerate(results):   # (e) and the uneven streams, on every rank
        assert "cannot be swapped under strategy='fsdp2'" in result["set_policy"], result.get("set_policy")
        warned, events = result["uneven"]
        assert any("rank 1's 'blocks.0.fc1' has served 3 backward call(s), rank 0's 2" in w for w in warned), warned
        assert len(events) == 1 and "not bit for bit on the ranks that differed" in events[0]["detail"], events


def test_the_guard_s_first_rung_is_refused_by_name_under_fsdp2():
    for policy in ("mxfp8-mixed", "nvfp4-mixed"):
        new, why = next_policy(Policy.parse(policy), None, bf16_ok=True, sharded=True)
        assert new is None and "refused under strategy='fsdp2'" in why and "fully_shard sharded" in why, why


def _switch_worker(rank: int, out: Path) -> dict:
    mp = _engine(SR, "ddp")
    losses = [_step(mp, _shard(0, rank))]
    mp.set_policy("bf16-mixed")   # every block-scaled linear, its Hadamard signs (DDP's only buffers) with it, out
    counts = [sum(isinstance(m, BlockScaledLinear) for m in mp.module.modules())]
    losses.append(_step(mp, _shard(1, rank)))
    mp.set_policy(SR)             # and in again: new linears, their streams from call 0 (as in one process)
    counts.append(sum(isinstance(m, BlockScaledLinear) for m in mp.module.modules()))
    losses.append(_step(mp, _shard(2, rank)))
    return {**_snapshot(mp, losses), "counts": counts}


@pytest.mark.timeout(300)
def test_under_ddp_set_policy_swaps_the_block_linears_out_and_back(tmp_path):
    ranks = run_ranks(_switch_worker, tmp_path)
    for r, got in enumerate(ranks):
        assert got["counts"] == [0, 6] and all(torch.isfinite(torch.tensor(got["losses"]))), (r, got["losses"])
        assert sorted(got["streams"].values()) == [[i, 1] for i in range(6)]   # one backward since converted again
    for name, value in ranks[0]["params"].items():   # the replicas stayed one model
        assert torch.equal(ranks[1]["params"][name], value), name
