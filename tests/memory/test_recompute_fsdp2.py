"""The recompute plan under FSDP2 (issue 27): ``MixedPrecision(..., strategy="fsdp2", recompute=...)`` on 2 gloo
ranks, GPT ``tiny``.

Each block is its own FSDP2 unit and the plan wraps the block's ``forward`` (an instance attribute), inside the
unit's pre/post-forward hooks: the block's forward runs on its all-gathered params, and in backward FSDP2's
pre-backward hook all-gathers them again before the recompute replays the forward (the order torch documents for
activation checkpointing with ``fully_shard``: the checkpoint inside the unit). The replay is exact (same params,
same op lists and kernels, the RNG replayed), and the forward's values never depend on what autograd keeps, so on
every rank the run with a plan equals the run without one **bit for bit** (whole blocks, selective and
``"auto"``, whose measurement forks the RNG and writes no ``.grad``), under fp32, bf16-mixed and bf16-lean.

Saved bytes (:mod:`mixprec.memory.saved`, the params' sharded storages left out): whole-block recompute keeps each
block's input instead of what the block saved, so the forward's saved bytes drop by at least what ``"auto"``
measured per block (``saved[none] - saved[full]``, the block's params left out); "at least": without recompute
the graph also keeps FSDP2's all-gathered (unsharded) weights, which the exclusion of the sharded params cannot
name. Selective recompute's kept matmul outputs live inside the region, which ``memory.saved`` does not see
(docs/engine.md): only "lower" is asserted for it.

``"auto"``: every rank takes the most memory-saving mode any rank chose and records rank 0's measurements with
those modes, so the plan text, the ``"recompute"`` event, ``state_dict()["recompute"]`` and the decision are the
same string on every rank. A DCP checkpoint (``mixprec.save_checkpoint``) carries the plan in its event log: fresh
engines built with ``"auto"`` load it as it was (the same measured seconds: not measured again) and continue bit
for bit. A module that FSDP2 shards on its own inside a block (a ``keep_fp32`` module) cannot be measured by
``"auto"`` (refused at build, naming the alternative); named blocks recompute it exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec
import mixprec.optim
from mixprec import MixedPrecision
from mixprec.checkpoint import read_manifest
from mixprec.memory.recompute import RecomputePlan
from mixprec.memory.saved import saved_bytes
from mixprec.workloads.gpt import GPTWorkload
from ranks import free_port, run_ranks

STEPS, SAVE_AT = 4, 2
PLANS = (None, "blocks.*", ("selective:blocks.*",), "auto")


def _engine(workload: GPTWorkload, policy: str, checkpoint) -> MixedPrecision:
    torch.manual_seed(0)
    model = workload.build_model()
    checkpoint = list(checkpoint) if isinstance(checkpoint, tuple) else checkpoint
    return MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=3e-3), policy, device="cpu",
                          strategy="fsdp2", recompute=checkpoint)


def _train(mp: MixedPrecision, workload: GPTWorkload, batches: list, *, count_saved: bool = False) -> int | None:
    """Steps through ``batches``; ``count_saved``: the bytes the last step's forward saved for backward."""
    saved = None
    for i, batch in enumerate(batches):
        with mp.autocast():
            if count_saved and i == len(batches) - 1:   # after auto's measurement: only the step's own graph
                loss, counted = saved_bytes(lambda: workload.loss(mp.model, mp.cast_inputs(batch)),
                                            exclude=mp.module.parameters())
                saved = counted.total
            else:
                loss = workload.loss(mp.model, mp.cast_inputs(batch))
        mp.backward(loss)
        assert mp.step().applied
    return saved


def _params(mp: MixedPrecision) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in mp.module.named_parameters()}


def _recompute_events(mp: MixedPrecision) -> list[tuple[str, str]]:
    return [(e.get("cause"), e.get("detail")) for e in mp.events if e.get("kind") == "recompute"]


def _batches(workload: GPTWorkload) -> list:
    from mixprec.distributed import process as mpd

    return list(mpd.shard_batches([b for _, b in zip(range(2 * STEPS), workload.batches("train", seed=0))]))


def _agree_the_op_plan(workload: GPTWorkload, policy: str, batches: list) -> None:
    """One throwaway step, so that every compared engine runs the ranks' agreed attention kernel from its first
    step. The measured op plan is process state: under a strategy a key this process meets for the first time
    runs ``fused`` until the ranks agree at the next boundary (:mod:`mixprec.autocast.plan_agreement`), and
    later engines in the process find it agreed. Where the plan chooses another kernel (``blockwise`` where
    fused's bf16 backward is slow), the first engine's first step would otherwise differ from the others'."""
    _train(_engine(workload, policy, None), workload, batches[:1])


def _plans_worker(rank: int, out: Path, policy: str) -> dict:
    workload = GPTWorkload("tiny")
    batches = _batches(workload)
    _agree_the_op_plan(workload, policy, batches)
    result = {}
    for plan in PLANS:
        mp = _engine(workload, policy, plan)
        _train(mp, workload, batches[:SAVE_AT])
        if plan == "auto":
            mixprec.save_checkpoint(out / "ckpt", mp)
        saved = _train(mp, workload, batches[SAVE_AT:], count_saved=True)
        result[plan] = {"params": _params(mp), "saved": saved, "decision": mp.decision,
                        "state": mp.state_dict()["recompute"], "events": _recompute_events(mp)}
    resumed = _engine(workload, policy, "auto")
    pending = resumed.decision
    mixprec.load_checkpoint(out / "ckpt", resumed)
    result["resumed"] = {"state": resumed.state_dict()["recompute"], "events": _recompute_events(resumed),
                         "decision": resumed.decision, "pending": pending}
    _train(resumed, workload, batches[SAVE_AT:])
    result["resumed"]["params"] = _params(resumed)
    return result


def _assert_equal(got: dict, want: dict, what) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (what, name)


@pytest.mark.timeout(400)
# bf16-lean in the default set (bf16 params, stochastic rounding replayed, 8-bit state: the most the replay must get
# exactly right); fp32 and bf16-mixed are slow
@pytest.mark.parametrize("policy", [pytest.param("fp32", marks=pytest.mark.slow),
                                    pytest.param("bf16-mixed", marks=pytest.mark.slow), "bf16-lean"])
def test_fsdp2_recompute_trains_bit_for_bit_saves_less_and_runs_one_plan_on_every_rank(tmp_path, policy):
    ranks = run_ranks(_plans_worker, tmp_path, policy, timeout_s=380)
    for r, got in enumerate(ranks):
        for plan in PLANS[1:]:
            _assert_equal(got[plan]["params"], got[None]["params"], (policy, r, plan))   # replayed exactly
        assert got[None]["state"] is None and "recompute" not in got[None]["decision"]
        assert got["blocks.*"]["decision"].endswith("; recompute blocks.*: 2 full")
        assert got[("selective:blocks.*",)]["decision"].endswith("; recompute selective:blocks.*: 2 selective")
        auto = RecomputePlan.from_text(got["auto"]["state"]["text"])
        assert [b.name for b in auto.blocks] == ["blocks.0", "blocks.1"] and auto.note() in got["auto"]["decision"]
        assert got["auto"]["events"] == [("auto", auto.text())]   # measured once, at the first step
        # saved for backward: whole blocks keep their inputs only, at least what auto measured them to free
        freed = sum(b.saved_bytes[0] - b.saved_bytes[2] for b in auto.blocks)
        assert freed > 0 and got[None]["saved"] - got["blocks.*"]["saved"] >= freed, (policy, r)
        assert got[("selective:blocks.*",)]["saved"] < got[None]["saved"]
        # the DCP checkpoint's plan, loaded as it was: the same measured seconds, no new measurement
        resumed = got["resumed"]
        assert "recompute auto: pending" in resumed["pending"] and "pending" not in resumed["decision"]
        assert resumed["state"] == got["auto"]["state"] and auto.note() in resumed["decision"]
        assert resumed["events"] == [("auto", auto.text()), ("loaded", auto.text())]
        _assert_equal(resumed["params"], got["auto"]["params"], (policy, r, "resumed"))
    for got in ranks[1:]:   # one plan: the same text, event and decision on every rank; one model
        for plan in PLANS:
            assert (got[plan]["state"], got[plan]["events"], got[plan]["decision"]) == (
                ranks[0][plan]["state"], ranks[0][plan]["events"], ranks[0][plan]["decision"]), plan
            _assert_equal(got[plan]["params"], ranks[0][plan]["params"], plan)
    events = [e for e in read_manifest(tmp_path / "ckpt")["events"] if e["kind"] == "recompute"]
    assert [(e["cause"], e["detail"]) for e in events] == [("auto", ranks[0]["auto"]["state"]["text"])]


# ---------------------------------------------------------------------- a module sharded on its own inside a block
NESTED = "bf16-lean,keep_fp32=blocks.0.ln_1"   # blocks.0.ln_1: an FSDP2 unit with fp32 params inside blocks.0


def _nested_worker(rank: int, out: Path) -> dict:
    workload = GPTWorkload("tiny")
    batches = _batches(workload)[:2]
    _agree_the_op_plan(workload, NESTED, batches)
    result = {}
    for plan in PLANS[:3]:
        mp = _engine(workload, NESTED, plan)
        _train(mp, workload, batches)
        result[plan] = _params(mp)
    try:
        _engine(workload, NESTED, "auto")
    except ValueError as error:
        result["refused"] = str(error)
    return result


@pytest.mark.timeout(300)
def test_fsdp2_named_blocks_recompute_an_inner_fp32_unit_exactly_and_auto_is_refused_naming_the_fix(tmp_path):
    ranks = run_ranks(_nested_worker, tmp_path, timeout_s=280)
    for r, got in enumerate(ranks):
        for plan in PLANS[1:3]:   # the inner unit all-gathers its fp32 params again in the recompute
            _assert_equal(got[plan], got[None], (r, plan))
        assert got[None]["blocks.0.ln_1.weight"].dtype == torch.float32
        refused = got["refused"]
        for words in ("recompute='auto' under strategy='fsdp2'", "['blocks.0.ln_1']", "recompute='blocks.*'",
                      "recompute=['selective:blocks.*']"):
            assert words in refused, (words, refused)


# ---------------------------------------------------------------------- the train CLI under torchrun
@pytest.mark.timeout(300)
def test_train_cli_fsdp2_recompute_auto_prints_one_plan_on_every_rank(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), "-m", "mixprec", "train", "--workload",
                           "gpt", "--config", "tiny", "--policy", "bf16-lean", "--strategy", "fsdp2", "--steps", "2",
                           "--out", str(out), "--recompute", "auto"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    (event,) = [e for e in read_manifest(out / "checkpoints")["events"] if e["kind"] == "recompute"]
    shown = RecomputePlan.from_text(event["detail"]).text(readable=True)   # ms to 3 significant digits
    # both ranks write to torchrun's one stdout: a rank's line can land after the other's progress bar (its "\r"
    # redraw, no newline), so each rank's plan is counted where it appears, not only at a line's start
    printed = [line for line in done.stdout.splitlines() if "recompute plan " in line]
    assert done.stdout.count(shown + "\n") == 2 and shown.startswith("recompute plan auto <= 1.3 per step: blocks.0 "), \
        (shown, printed, done.stdout[-3000:], done.stderr[-3000:])
    assert done.stdout.count("recompute plan ") == 2, printed   # one plan per rank, no other
    assert "recompute auto: pending" in done.stderr and " ms]" in shown
