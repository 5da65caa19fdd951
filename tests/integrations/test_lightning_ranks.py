"""Several processes under Lightning's Trainer (issue 37): the replicas never drift apart silently.

2 gloo ranks of ``L.Trainer(strategy="ddp", plugins=[MixprecPrecision(...)])`` on a tiny MLP, 4 steps, each rank
on its own batches (rank r: batches r, r + 2, ...), through tests/ranks.py (torchrun's environment variables);
the same worker runs under ``torchrun --nproc-per-node 2`` itself when this file is the script
(:func:`test_per_rank_seeds_under_torchrun_itself`). Every comparison of the ranks is bit for bit
(``torch.equal``) on the params as stored, which under ``bf16-sr`` are the weights (no fp32 copy).

* per-rank seeds (``seed_everything(seed + rank)``, Lightning's common use) under ``bf16-sr``: each rank's
  ``mixprec.optim.AdamW`` takes ``torch.initial_seed()`` as its stochastic-rounding seed, so on main every replica
  rounded its own way; the plugin gives every rank rank 0's (an event says so), and the replicas stay equal.
* a rank-local edit (a callback changing one weight on rank 1): the fingerprint check (``verify_replicas_every=1``)
  refuses at the next step on both ranks, naming rank 1 and the param.
* a checkpoint inside an accumulation window (a callback's ``trainer.save_checkpoint`` after the first micro-batch
  of the second window; ``bf16-mixed``, 2 micro-batches per step): saving changes nothing, and a run resumed from
  it (a model of another init) continues each rank's window, equal bit for bit to the run that never stopped; on
  main the resume was refused (the checkpoint held rank 0's window only).
* ``GradientAccumulationScheduler({1: 2})``: under ``bf16-mixed`` the plugin follows the new count (an event) and
  the replicas stay equal (checked every step); under ``bf16-pure`` (fp32 masters, which Lightning's ``no_sync``
  leaves rank-local) it is refused at epoch 1's first micro-batch, where main trained on, each rank its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

L = pytest.importorskip("lightning")

import torch   # noqa: E402
import torch.nn.functional as F   # noqa: E402
from lightning.pytorch.callbacks import GradientAccumulationScheduler   # noqa: E402
from torch import nn   # noqa: E402
from torch.utils.data import DataLoader   # noqa: E402

import mixprec.optim   # noqa: E402
from mixprec.distributed import process as mpd   # noqa: E402
from mixprec.integrations.lightning import MixprecFabricPrecision, MixprecPrecision   # noqa: E402
from ranks import free_port, run_ranks, tests_on_path   # noqa: E402

SEED, STEPS, WORLD = 1234, 4, 2


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


class MLP(L.LightningModule):
    """16-32-4, MSE, mixprec.optim.AdamW (bf16-sr needs it); built after the caller's seed (so per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return mixprec.optim.AdamW(self.parameters(), lr=1e-2)


class EditOnRank1(L.Callback):
    """What goes wrong in real runs without a word: a callback that changes a weight on one rank only."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx == 1:
            with torch.no_grad():
                pl_module.net[2].weight[0, 0] += 0.5


def fit(rank: int, plugin: MixprecPrecision, *, callbacks=(), per_rank: int = STEPS, ckpt_path=None, save_to=None,
        **kw) -> dict:
    model = MLP()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin], callbacks=list(callbacks),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        **{"max_steps": STEPS, **kw})
    data = batches(WORLD * per_rank)[rank::WORLD]
    trainer.fit(model, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)   # rank 0 writes it
    engine = plugin.engine
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "dtypes": {p.dtype for p in model.parameters()}, "boundaries": engine.boundaries,
            "events": [e.to_dict() for e in engine.events], "decision": engine.decision,
            "sr_seed": engine.optimizer.param_groups[0]["sr_seed"]}


def per_rank_seeds(rank: int) -> dict:
    """bf16-sr with seed_everything(SEED + rank) before the model and the optimizer are built."""
    L.seed_everything(SEED + rank)
    return fit(rank, MixprecPrecision("bf16-sr", keep_inputs=(1,)))


def resumed_per_rank_seeds(rank: int, out: Path) -> dict:
    """Per-rank seeds under bf16-sr, 2 epochs of 2 steps: whole, and 1 epoch + checkpoint + 1 resumed epoch."""
    runs = {}
    for name, epochs, ckpt, save in (("whole", 2, None, None), ("first", 1, None, out / "epoch0.ckpt"),
                                     ("resumed", 2, out / "epoch0.ckpt", None)):
        L.seed_everything(SEED + rank)
        runs[name] = fit(rank, MixprecPrecision("bf16-sr", keep_inputs=(1,)), per_rank=2, max_steps=-1,
                         max_epochs=epochs, ckpt_path=ckpt, save_to=save)
    return runs


def fabric_per_rank_seeds(rank: int) -> dict:
    """The same under Fabric's DDP: fabric.setup, plugin.attach, fabric.backward, optimizer.step()."""
    L.seed_everything(SEED + rank)
    plugin = MixprecFabricPrecision("bf16-sr", verify_replicas_every=1)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin])
    fabric.launch()
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(net, mixprec.optim.AdamW(net.parameters(), lr=1e-2))
    plugin.attach(optimizer)
    for x, y in batches(WORLD * STEPS)[rank::WORLD]:
        fabric.backward(F.mse_loss(model(x).float(), y))   # the plugin casts x, opens the autocast
        optimizer.step()
    return {"weights": {n: p.detach().clone() for n, p in net.named_parameters()},
            "applied": plugin.engine.applied_steps,
            "events": [e.to_dict() for e in plugin.engine.events]}


class SaveInsideWindow(L.Callback):
    """``trainer.save_checkpoint`` on every rank (Lightning's checkpointing is collective; rank 0 writes) after the
    first micro-batch of the second accumulation window."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            trainer.save_checkpoint(self.path)


def window_runs(rank: int, out: Path) -> dict:
    """bf16-mixed, 3 steps of 2 micro-batches per rank: whole, saving inside the second window, resumed from it."""
    from test_integration_checkpoints_any_moment import Resumable

    path, runs = out / "inside-window.ckpt", {}
    for name, callbacks, ckpt in (("whole", [], None), ("saving", [SaveInsideWindow(path)], None),
                                  ("resumed", [], path)):
        L.seed_everything(SEED if name != "resumed" else SEED + 7)   # resumed: another init, all of it loaded
        model, plugin = MLP(), MixprecPrecision("bf16-mixed", keep_inputs=(1,), verify_replicas_every=1)
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin], callbacks=callbacks,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                            max_steps=3, accumulate_grad_batches=2)
        trainer.fit(model, Resumable(batches(WORLD * 6)[rank::WORLD]), ckpt_path=ckpt)
        runs[name] = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "boundaries": plugin.engine.boundaries, "global_step": trainer.global_step}
    saved = torch.load(path, weights_only=False)["MixprecPrecision"]
    runs["saved"] = {"micro_step": saved["open_group"]["micro_step"], "ranks": len(saved["open_group_ranks"]),
                     "differ": not all(torch.equal(saved["open_group_ranks"][0]["grads"][n],
                                                   saved["open_group_ranks"][1]["grads"][n])
                                       for n in saved["open_group_ranks"][0]["grads"])}
    return runs


def fabric_window_runs(rank: int, out: Path) -> dict:
    """Fabric's DDP, bf16-mixed, 3 steps of 2 micro-batches (no_backward_sync on the first): whole, saving with
    fabric.save after the first micro-batch of the second step, resumed from it (another init)."""
    path, runs = out / "fabric-window.ckpt", {}
    data = batches(WORLD * 6)[rank::WORLD]
    for name in ("whole", "saving", "resumed"):
        L.seed_everything(SEED + (7 if name == "resumed" else 0))
        plugin = MixprecFabricPrecision("bf16-mixed", verify_replicas_every=1)
        fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin])
        fabric.launch()
        net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        model, optimizer = fabric.setup(net, mixprec.optim.AdamW(net.parameters(), lr=1e-2))
        plugin.attach(optimizer)
        start = 0
        if name == "resumed":
            fabric.load(path, {"mixprec": plugin})
            start = 3
        for i in range(start, 6):
            x, y = data[i]
            with fabric.no_backward_sync(model, enabled=i % 2 == 0):
                fabric.backward(F.mse_loss(model(x).float(), y) / 2)
            if i % 2 == 1:
                optimizer.step()
            if name == "saving" and i == 2:
                fabric.save(path, {"mixprec": plugin})
        runs[name] = {"weights": {n: p.detach().clone() for n, p in net.named_parameters()},
                      "applied": plugin.engine.applied_steps}
    saved = torch.load(path, weights_only=False)["mixprec"]
    runs["ranks"] = len(saved["open_group_ranks"])
    return runs


def worker(rank: int, out: Path) -> dict:
    results = {"seeds": per_rank_seeds(rank), "fabric": fabric_per_rank_seeds(rank),
               "resume": resumed_per_rank_seeds(rank, out), "window": window_runs(rank, out),
               "fabric window": fabric_window_runs(rank, out)}
    L.seed_everything(SEED)
    results["scheduler-mixed"] = fit(rank, MixprecPrecision("bf16-mixed", keep_inputs=(1,), verify_replicas_every=1),
                                     callbacks=[GradientAccumulationScheduler({1: 2})], per_rank=4, max_steps=-1,
                                     max_epochs=2)
    try:
        fit(rank, MixprecPrecision("bf16-pure", keep_inputs=(1,)), callbacks=[GradientAccumulationScheduler({1: 2})],
            per_rank=4, max_steps=-1, max_epochs=2)
        results["scheduler-pure"] = None
    except ValueError as err:
        results["scheduler-pure"] = str(err)
    plugin = MixprecPrecision("bf16-sr", keep_inputs=(1,), verify_replicas_every=1)
    try:
        fit(rank, plugin, callbacks=[EditOnRank1()])
        results["edit"] = None
    except RuntimeError as err:
        results["edit"] = {"error": str(err), "boundaries": plugin.engine.boundaries,
                           "events": [e.to_dict() for e in plugin.engine.events]}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One 2-rank run of :func:`worker` for the tests below (each asserts one part of it)."""
    return run_ranks(worker, tmp_path_factory.mktemp("ranks"), timeout_s=200)


def assert_equal_replicas(a: dict, b: dict) -> None:
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"the ranks' weights differ: {differ}"


@pytest.mark.timeout(240)
def test_per_rank_seeds_under_bf16_sr_keep_the_replicas_equal(ranks):
    r0, r1 = (r["seeds"] for r in ranks)
    assert r0["dtypes"] == r1["dtypes"] == {torch.bfloat16} and r0["boundaries"] == r1["boundaries"] == STEPS
    assert_equal_replicas(r0["weights"], r1["weights"])
    assert r0["sr_seed"] == r1["sr_seed"] == SEED   # rank 0's seed_everything(SEED + 0)
    event = next(e for e in r1["events"] if e["kind"] == "replicas")
    assert f"sr_seed [{SEED}] from rank 0 on every rank (this rank had [{SEED + 1}]; seeded per rank)" \
        in event["detail"]
    assert "2 processes: rank 0's sr_seed on every rank, replicas compared by fingerprint every 100 step(s)" \
        in r1["decision"]


@pytest.mark.timeout(240)
def test_a_resumed_run_agrees_on_the_seeds_again_and_continues_bit_for_bit(ranks):
    for rank, r in enumerate(ranks):
        whole, resumed = r["resume"]["whole"], r["resume"]["resumed"]
        assert whole["boundaries"] == resumed["boundaries"] == 4, rank
        assert_equal_replicas(resumed["weights"], whole["weights"])   # and rank 0's equal rank 1's:
        assert_equal_replicas(resumed["weights"], ranks[0]["resume"]["whole"]["weights"])
        assert resumed["sr_seed"] == SEED
        agreed = [e["detail"] for e in resumed["events"] if e["kind"] == "replicas"]
        assert agreed and "after the checkpoint load: sr_seed" in agreed[-1], rank


@pytest.mark.timeout(240)
def test_a_checkpoint_inside_a_window_holds_every_ranks_window_and_resumes_bit_for_bit(ranks):
    for rank, r in enumerate(ranks):
        w = r["window"]
        assert w["saved"] == {"micro_step": 1, "ranks": WORLD, "differ": True}   # each rank's own gradients
        assert w["whole"]["global_step"] == w["resumed"]["global_step"] == 3
        assert_equal_replicas(w["saving"]["weights"], w["whole"]["weights"])   # saving changes nothing
        assert_equal_replicas(w["resumed"]["weights"], w["whole"]["weights"])
        assert_equal_replicas(w["whole"]["weights"], ranks[0]["window"]["whole"]["weights"])


@pytest.mark.timeout(240)
def test_fabric_save_inside_a_window_holds_every_ranks_window_and_resumes_bit_for_bit(ranks):
    """On main every rank loaded rank 0's window (the plugin's state was rank 0's) and trained on, until a replica
    check found the ranks apart (every 100 steps by default)."""
    for r in ranks:
        w = r["fabric window"]
        assert w["ranks"] == WORLD and w["whole"]["applied"] == w["saving"]["applied"] == 3
        assert w["resumed"]["applied"] == 3   # restored at 1, then the window and one more step
        assert_equal_replicas(w["saving"]["weights"], w["whole"]["weights"])
        assert_equal_replicas(w["resumed"]["weights"], w["whole"]["weights"])
        assert_equal_replicas(w["whole"]["weights"], ranks[0]["fabric window"]["whole"]["weights"])


@pytest.mark.timeout(240)
def test_fabric_with_per_rank_seeds_keeps_the_replicas_equal(ranks):
    r0, r1 = (r["fabric"] for r in ranks)
    assert r0["applied"] == r1["applied"] == STEPS   # and compared by fingerprint after each step
    assert_equal_replicas(r0["weights"], r1["weights"])
    event = next(e for e in r1["events"] if e["kind"] == "replicas")
    assert event["detail"].startswith(f"MixprecFabricPrecision on 2 processes at attach: sr_seed [{SEED}] from rank 0 "
                                      f"on every rank (this rank had [{SEED + 1}]; seeded per rank)")


@pytest.mark.timeout(240)
def test_an_accumulation_scheduler_is_followed_or_refused_mid_run(ranks):
    r0, r1 = (r["scheduler-mixed"] for r in ranks)
    assert r0["boundaries"] == r1["boundaries"] == 4 + 2   # epoch 0: 4 steps of 1; epoch 1: 2 of 2 micro-batches
    assert_equal_replicas(r0["weights"], r1["weights"])   # and compared by fingerprint after each step
    changes = [e["detail"] for e in r0["events"] if e["kind"] == "accumulation"]
    assert changes == ["Lightning's accumulate_grad_batches 1 -> 2 at epoch 1: followed (each micro-batch's loss "
                       "divided by Lightning joins the window its optimizer_step closes)"]
    for r in ranks:
        assert r["scheduler-pure"] is not None, "bf16-pure trained on with rank-local master gradients"
        assert r["scheduler-pure"].startswith("accumulate_grad_batches=2 on 2 processes with bf16-pure (fp32 masters) "
                                              "(changed from 1 at epoch 1: a GradientAccumulationScheduler")


@pytest.mark.timeout(240)
def test_a_rank_local_edit_is_refused_by_the_fingerprint_naming_rank_and_param(ranks):
    for r in ranks:
        edit = r["edit"]
        assert edit is not None, "the replicas drifted apart silently"
        assert edit["boundaries"] == 3   # edited after step 2: found after step 3, the next check
        assert "MixprecPrecision on 2 processes: the replicas differ after step 3: rank 1's 'net.2.weight' is not " \
               "rank 0's (1 of 4 tensors differ on rank 1" in edit["error"]
        assert edit["events"][-1]["kind"] == "replicas" and edit["events"][-1]["detail"] == edit["error"]


def test_one_process_runs_no_replica_check_and_the_interval_is_checked_by_name():
    L.seed_everything(SEED)
    model, plugin = MLP(), MixprecPrecision("bf16-sr", keep_inputs=(1,), verify_replicas_every=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(batches(2), batch_size=None))
    assert plugin.engine.applied_steps == 2 and not any(e.kind == "replicas" for e in plugin.engine.events)
    assert "processes" not in plugin.engine.decision and plugin.engine.optimizer.param_groups[0]["sr_seed"] == SEED
    with pytest.raises(ValueError, match=r"MixprecPrecision\(verify_replicas_every=-1\) is not allowed; pass an "
                                         r"int >= 0 \(default 100; 0 turns the check off\)"):
        MixprecPrecision("bf16-mixed", verify_replicas_every=-1)
    with pytest.raises(TypeError, match=r"MixprecFabricPrecision\(verify_replicas_every=True\): pass an int"):
        MixprecFabricPrecision("bf16-mixed", verify_replicas_every=True)


# ---------------------------------------------------------------------- under torchrun itself
@pytest.mark.slow   # default set: test_per_rank_seeds_under_bf16_sr_keep_the_replicas_equal runs this worker on
# 2 ranks with torchrun's environment (tests/ranks.py); here torchrun starts two fresh interpreters
@pytest.mark.timeout(240)
def test_per_rank_seeds_under_torchrun_itself(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), __file__, str(tmp_path)]
    done = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1", **tests_on_path()}, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert r0["dtypes"] == {torch.bfloat16} and r0["boundaries"] == r1["boundaries"] == STEPS
    assert_equal_replicas(r0["weights"], r1["weights"])


if __name__ == "__main__":   # torchrun --nproc-per-node 2 tests/integrations/test_lightning_ranks.py OUT_DIR
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    mpd.init_process_group_from_env("cpu")
    torch.save(per_rank_seeds(rank), Path(sys.argv[1]) / f"rank{rank}.pt")
    mpd.leave_process_group(wait_for_all=True)


def test_a_window_saved_by_two_processes_is_refused_on_one_by_name():
    """Each rank's window is its own: one process cannot continue two ranks' windows (nor a checkpoint that holds
    one rank's only, as older ones did on several processes; that case needs several processes to raise)."""
    from mixprec.integrations.replica_checks import own_window

    state = {"open_group": {"micro_step": 1}, "open_group_ranks": [{"micro_step": 1}, {"micro_step": 1}]}
    with pytest.raises(ValueError, match=r"MixprecPrecision: this checkpoint was saved inside an accumulation window "
                                         r"by 2 processes, each with its own gradients of the window; resume it on 2 "
                                         r"processes \(not 1\)"):
        own_window(state, "MixprecPrecision")
    assert own_window({"open_group": {"micro_step": 1}}, "MixprecPrecision") == {"open_group": {"micro_step": 1}}


def _old_window_refusals(rank: int, out: Path) -> dict[str, str]:
    """own_window on a checkpoint of one rank's window (saved before every rank's was gathered), on 2 ranks."""
    from mixprec.integrations.replica_checks import own_window

    words = {}
    for owner in ("MixprecPrecision", "MixprecFabricPrecision"):
        try:
            own_window({"open_group": {"micro_step": 1}}, owner)
        except ValueError as err:
            words[owner] = str(err)
    return words


def test_an_old_window_checkpoint_is_refused_with_each_frameworks_route(tmp_path):
    """The refusal named Lightning's ModelCheckpoint to Fabric users too; each framework gets its own route."""
    for words in run_ranks(_old_window_refusals, tmp_path):
        assert "ModelCheckpoint(every_n_train_steps=...)" in words["MixprecPrecision"]
        assert "fabric.save after optimizer.step()" in words["MixprecFabricPrecision"]
        assert "ModelCheckpoint" not in words["MixprecFabricPrecision"]
