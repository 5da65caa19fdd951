"""MixprecTrainer under torchrun (issue 37): several processes, bit for bit the engine's own ``strategy="ddp"``.

2 gloo ranks (tests/ranks.py: torchrun's environment variables; this file is also the script of
``torchrun --nproc-per-node 2``, :func:`test_mixprec_trainer_under_torchrun_itself`), a tiny GPT-2 from a config,
4 optimizer steps of 2 micro-batches. Each rank trains ``MixprecTrainer`` with its own ``TrainingArguments(seed=
SEED + rank)`` (so its optimizer's stochastic-rounding seed is its own until the trainer agrees on rank 0's), then
the reference on the same ranks: ``MixedPrecision(..., strategy="ddp")`` by hand on the same global batches (rank r,
step k, micro-batch j: batch ``(2k + j) * 2 + r``, as accelerate shards the Trainer's sequential batches), with the
Trainer's loss (summed over tokens, divided by its count of labels over every rank and micro-batch, times the
number of processes, times the accumulation steps the engine divides by again), its AdamW groups, linear schedule
and ``max_grad_norm=1.0``. Compared bit for bit (``torch.equal``) on the fp32 values the optimizer steps
(``trainable_state_dict``: the masters under ``bf16-pure``, the bf16 params under ``bf16-sr``), and across ranks.
A checkpoint rank 0 writes after 2 steps, resumed on both ranks for the last 2, ends where the 4 uninterrupted
steps do, bit for bit. On main MixprecTrainer refused several processes.

Accelerate in the same ranks: the one-process recipe (engine without ``strategy=``, its model through
``accelerator.prepare``) with accelerate's per-rank seeds (``set_seed(seed, device_specific=True)``) trained on
main, each replica rounding its own way; it is refused at the first ``mp.backward()``, naming the route:
``strategy="ddp"`` with only the dataloader prepared, which equals the engine's own DDP on ``shard_batches``. And
``accelerator.prepare(mp.model)`` on the engine's DDP (accelerate wraps it in a second DDP; not detected on main) is
refused at its first forward.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import mixprec  # noqa: E402
from mixprec.distributed import process as mpd  # noqa: E402
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402
from ranks import free_port, run_ranks, tests_on_path  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, ACC, LR, SEED, WORLD = 64, 8, 2, 4, 2, 1e-3, 123, 2
CASES = (("bf16-sr", ACC), ("bf16-pure", ACC))


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg)


def rows() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, VOCAB, (STEPS * ACC * WORLD * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def trainer_run(rank: int, out: Path, policy: str, accumulation: int, *, resume: Path | None = None,
                **overrides) -> MixprecTrainer:
    options = dict(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulation,
                   max_steps=STEPS, learning_rate=LR, weight_decay=0.01, lr_scheduler_type="linear",
                   logging_steps=STEPS, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                   train_sampling_strategy="sequential", seed=SEED + rank)   # per-rank seeds, on purpose
    args = transformers.TrainingArguments(**{**options, **overrides})
    trainer = MixprecTrainer(gpt2(), args, train_dataset=rows(), policy=policy, verify_replicas_every=1)
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def engine_ddp(rank: int, policy: str, accumulation: int, decay: set[str]) -> mixprec.MixedPrecision:
    """The engine's own DDP loop on the batches the Trainer gives rank ``rank``, with the Trainer's loss."""
    model = gpt2()
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = mixprec.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8, sr_seed=SEED)   # rank 0's seed
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=STEPS)
    mp = mixprec.MixedPrecision(model, opt, policy, scheduler=sched, max_grad_norm=1.0,
                                accumulation_steps=accumulation, strategy="ddp")
    data = rows()
    batches = [transformers.default_data_collator(data[i:i + BATCH]) for i in range(0, len(data), BATCH)]
    # the Trainer's count: every label (none is -100) of the step's micro-batches on every rank
    labels = torch.tensor(float(WORLD * accumulation * BATCH * SEQ))
    for batch in mpd.shard_batches(batches):
        model.train()
        with mp.autocast():
            loss = mp.model(**mp.cast_inputs(batch, keep=("labels",)), num_items_in_batch=labels).loss * WORLD
        mp.backward(loss * accumulation)
        mp.step()
    return mp


def accelerate_runs(rank: int) -> dict:
    """The one-process recipe on 2 processes (refused), then the route (the engine's DDP, the loader prepared)
    against the engine's own DDP on shard_batches."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(mixed_precision="no", cpu=True)
    data = rows()[:STEPS * WORLD * BATCH]
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=transformers.default_data_collator)
    model = gpt2()
    set_seed(SEED, device_specific=True)   # accelerate's per-rank seeds: the optimizer's sr_seed is SEED + rank
    mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=LR), "bf16-sr")
    prepared, prepared_loader = accelerator.prepare(mp.model, loader)
    out = {"recipe": None}
    try:
        for batch in prepared_loader:
            with mp.autocast():
                loss = prepared(**mp.cast_inputs(batch)).loss
            mp.backward(loss)
            mp.step()
    except ValueError as err:
        out["recipe"] = str(err)
    # one throwaway step of the engine's DDP first: the measured op plan is process state, and a key this process
    # has not agreed with the other ranks runs fused until the next boundary (mixprec.autocast.plan_agreement), so
    # where the plan chooses another kernel the first DDP engine's first step would differ from the second's
    set_seed(SEED)
    model = gpt2()
    warm = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=LR), "bf16-sr", strategy="ddp")
    with warm.autocast():
        loss = warm.model(**warm.cast_inputs(next(iter(mpd.shard_batches(list(loader)))))).loss
    warm.backward(loss)
    warm.step()
    for name in ("route", "engine"):
        set_seed(SEED)
        model = gpt2()
        mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=LR), "bf16-sr", strategy="ddp")
        batches = accelerator.prepare(loader) if name == "route" else mpd.shard_batches(list(loader))
        for batch in batches:
            with mp.autocast():
                loss = mp.model(**mp.cast_inputs(batch)).loss
            mp.backward(loss)
            mp.step()
        out[name] = mp.trainable_state_dict()
    set_seed(SEED)   # the engine's DDP handed to accelerator.prepare: accelerate wraps it in a second DDP
    model = gpt2()
    mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=LR), "bf16-sr", strategy="ddp")
    wrapped = accelerator.prepare(mp.model)
    out["wrapped again"] = None
    try:
        with mp.autocast():
            wrapped(**mp.cast_inputs(next(iter(accelerator.prepare(loader))))).loss
    except ValueError as err:
        out["wrapped again"] = (type(wrapped).__name__, str(err), mp.boundaries)
    return out


def worker(rank: int, out: Path, cases=CASES) -> dict:
    results = {"accelerate": accelerate_runs(rank)} if cases == CASES else {}
    for policy, accumulation in cases:
        saving = {"save_strategy": "steps", "save_steps": STEPS // 2} if policy == "bf16-sr" else {}
        trainer = trainer_run(rank, out / policy, policy, accumulation, **saving)
        mp = trainer.engine
        reference = engine_ddp(rank, policy, accumulation, set(trainer.get_decay_parameter_names(trainer.model)))
        results[policy] = {"trainer": mp.trainable_state_dict(), "engine": reference.trainable_state_dict(),
                           "applied": (mp.applied_steps, reference.applied_steps), "strategy": mp.strategy,
                           "wrapped": type(trainer.model_wrapped).__name__, "decision": mp.decision,
                           "events": [e.to_dict() for e in mp.events],
                           "sr_seed": mp.optimizer.param_groups[0]["sr_seed"]}
        if saving:   # rank 0 saved checkpoint-2 on the way; every rank resumes it for the last 2 steps
            resumed = trainer_run(rank, out / "resumed", policy, accumulation,
                                  resume=out / policy / f"checkpoint-{STEPS // 2}")
            results[policy]["resumed"] = resumed.engine.trainable_state_dict()
    return results


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"{what}: {len(differ)} of {len(a)} fp32 weights differ, e.g. {differ[:3]}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One 2-rank run of :func:`worker` for the tests below."""
    return run_ranks(worker, tmp_path_factory.mktemp("ranks"), timeout_s=200)


@pytest.mark.timeout(240)
def test_mixprec_trainer_on_two_ranks_equals_the_engines_own_ddp_bit_for_bit(ranks):
    for policy, _ in CASES:
        for rank, result in enumerate(ranks):
            got = result[policy]
            assert got["applied"] == (STEPS, STEPS) and got["strategy"] == "ddp", policy
            assert got["wrapped"] == "DistributedDataParallel", policy   # the engine's wrapper, not a second one
            assert_same(got["trainer"], got["engine"], f"{policy}, rank {rank}: MixprecTrainer vs strategy='ddp'")
            assert got["sr_seed"] == SEED, policy   # rank 0's TrainingArguments(seed=SEED + 0)
        assert_same(ranks[0][policy]["trainer"], ranks[1][policy]["trainer"], f"{policy}: rank 0 vs rank 1")
    for rank, result in enumerate(ranks):   # 2 steps, checkpoint, 2 more on 2 ranks: the 4 uninterrupted steps
        assert_same(result["bf16-sr"]["resumed"], result["bf16-sr"]["trainer"], f"rank {rank}: resumed vs whole")
    event = next(e for e in ranks[1]["bf16-sr"]["events"] if e["kind"] == "replicas")
    assert f"sr_seed [{SEED}, {SEED}] from rank 0 on every rank (this rank had [{SEED + 1}, {SEED + 1}]" \
        in event["detail"]
    assert "2 processes: rank 0's sr_seed on every rank, replicas compared by fingerprint every 1 step(s)" \
        in ranks[1]["bf16-sr"]["decision"]


@pytest.mark.timeout(240)
def test_accelerate_on_two_ranks_needs_the_engines_ddp_and_then_equals_it(ranks):
    for rank, result in enumerate(ranks):
        got = result["accelerate"]
        assert got["recipe"] is not None, "the engine trained under accelerate's DDP with per-rank rounding seeds"
        assert got["recipe"].startswith("this MixedPrecision engine (bf16-sr) runs in an accelerate run of 2 "
                                        "processes without strategy=") and "strategy='ddp'" in got["recipe"]
        assert_same(got["route"], got["engine"], f"rank {rank}: accelerate's sharded loader vs shard_batches")
    assert_same(ranks[0]["accelerate"]["route"], ranks[1]["accelerate"]["route"], "rank 0 vs rank 1")
    for result in ranks:   # accelerator.prepare(mp.model) put a second DDP around the engine's: refused at its forward
        kind, words, boundaries = result["accelerate"]["wrapped again"]
        assert kind == "DistributedDataParallel" and boundaries == 0
        assert words.startswith("mp.model (the engine's DistributedDataParallel, strategy='ddp') runs inside another "
                                "DistributedDataParallel (accelerator.prepare(mp.model) under several processes")


def test_verify_replicas_every_is_checked_by_name(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"MixprecTrainer\(verify_replicas_every=-5\) is not allowed"):
        MixprecTrainer(gpt2(), args, train_dataset=rows(), policy="bf16-mixed", verify_replicas_every=-5)


@pytest.mark.slow   # default set: test_mixprec_trainer_on_two_ranks_equals_the_engines_own_ddp_bit_for_bit runs
# this worker on 2 ranks with torchrun's environment (tests/ranks.py); here torchrun starts two fresh interpreters
@pytest.mark.timeout(240)
def test_mixprec_trainer_under_torchrun_itself(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), __file__, str(tmp_path)]
    done = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1", **tests_on_path()}, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["bf16-sr"] for r in range(WORLD))
    for rank, got in enumerate((r0, r1)):
        assert got["applied"] == (STEPS, STEPS)
        assert_same(got["trainer"], got["engine"], f"rank {rank}: MixprecTrainer vs strategy='ddp'")
        assert_same(got["resumed"], got["trainer"], f"rank {rank}: resumed vs whole")
    assert_same(r0["trainer"], r1["trainer"], "rank 0 vs rank 1")


if __name__ == "__main__":   # torchrun --nproc-per-node 2 tests/integrations/test_transformers_ranks.py OUT_DIR
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    mpd.init_process_group_from_env("cpu")
    torch.save(worker(rank, Path(sys.argv[1]), cases=CASES[:1]), Path(sys.argv[1]) / f"rank{rank}.pt")
    mpd.leave_process_group(wait_for_all=True)
