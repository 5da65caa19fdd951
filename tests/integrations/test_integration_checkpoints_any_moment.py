"""Checkpoints at any moment a trainer chooses, and runs written without mixprec adopted (issue 37, part A).

* A checkpoint inside an accumulation window (Lightning's ``ModelCheckpoint`` after a validation that
  ``val_check_interval`` puts mid-window, its ``OnExceptionCheckpoint`` when a ``training_step`` or a callback
  raises; ``mp.state_dict()`` between a hand loop's micro-batches) holds the
  open window (:mod:`mixprec.engine.open_group`): the run that saved equals bit for bit the run that did not,
  and a run resumed from it equals both. The Hugging Face Trainer saves at optimizer steps only
  (``save_steps`` counts them): the same two equalities, with ``gradient_accumulation_steps=2``.
* A Lightning checkpoint written under ``precision="32-true"`` (fp32 weights, ``torch.optim.AdamW`` state)
  continues under every preset: its first step equals, bit for bit, an engine built on the same fp32 weights
  and optimizer state under ``fp32`` and switched by ``set_policy`` (what the adoption is documented to do),
  the values it starts from are the checkpoint's (fp32 where the policy keeps fp32 values: masters, Kahan
  compensation, fp32 params; their bf16 rounding under ``-sr``/``-lean``), and an event says so.

Every comparison is ``torch.equal`` on the fp32 values the optimizer steps, the stored params and the
optimizer state: the ops are deterministic on a CPU. Tiny MLPs (8 → 16 → 4), CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.optim
from mixprec import MixedPrecision

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint, Timer   # noqa: E402

from mixprec.integrations.lightning import MixprecPrecision   # noqa: E402

IN, OUT, BATCH = 8, 4, 4
ADOPTED = ["bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr", "bf16-lean", "fp16-mixed"]
NEEDS_MIXPREC_OPTIM = ("bf16-kahan", "bf16-sr", "bf16-lean")   # torch.optim.AdamW is refused under these


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)) for _ in range(n)]


class MLP(L.LightningModule):
    """``optimizer``: ``"mixprec"`` (:class:`mixprec.optim.AdamW`) or ``"torch"`` (``torch.optim.AdamW``)."""

    def __init__(self, optimizer: str = "mixprec", seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(IN, 16), nn.GELU(), nn.Linear(16, OUT))
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).float(), y))

    def configure_optimizers(self):
        if self.optimizer == "torch":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        return mixprec.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, sr_seed=0)   # not initial_seed()


class Fixed:
    """Fixed batches, one loader to Lightning (a list would be a list of loaders)."""

    def __init__(self, data: list) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        return iter(self.data)


class Resumable(Fixed):
    """Fixed batches Lightning can resume mid-epoch (it saves and loads ``state_dict``): the next batch to
    train, the iterator's position (Lightning's fetcher takes no batch ahead of a loader with a length)."""

    def __init__(self, data: list, behind: int = 0) -> None:
        super().__init__(data)
        self.start, self.taken, self.behind = 0, 0, behind   # behind: taken batches Lightning will replay

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, len(self.data)):
            self.taken = i + 1
            yield self.data[i]

    def state_dict(self) -> dict:
        return {"next": self.taken - self.behind}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["next"]


def trainer(plugin, **kw) -> L.Trainer:
    kw = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
          "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0, **kw}
    return L.Trainer(plugins=[plugin] if plugin is not None else [], **kw)


def assert_same_run(a: MixedPrecision, b: MixedPrecision) -> None:
    """Bit for bit: fp32 values, stored params, optimizer state, loss scale, counters."""
    wa, wb = a.trainable_state_dict(), b.trainable_state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa), "fp32 values differ"
    assert all(p.dtype == q.dtype and torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]), f"optimizer state of param {i} differs"
    assert torch.equal(a.loss_scale.scale, b.loss_scale.scale)
    assert (a.applied_steps, a.skipped_total, a.boundaries) == (b.applied_steps, b.skipped_total, b.boundaries)


# ---------------------------------------------------------------------- Lightning: a checkpoint mid-window
def fit_mid_window(policy: str, data: list, *, ckpt_dir=None, ckpt_path=None) -> tuple[MixprecPrecision, L.Trainer]:
    """4 optimizer steps of 2 micro-batches over 8 batches, validating every 3 batches: after batch 2 (inside
    the second window) and after batch 5 (a boundary); ``ckpt_dir``: Lightning's ModelCheckpoint saves there
    after each validation (every one kept)."""
    plugin = MixprecPrecision(policy)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)] if ckpt_dir is not None else []
    t = trainer(plugin, max_steps=4, accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1,
                enable_checkpointing=ckpt_dir is not None, callbacks=callbacks)
    t.fit(MLP(seed=0 if ckpt_path is None else 5), Resumable(data), val_dataloaders=Fixed([data[0]]), ckpt_path=ckpt_path)
    return plugin, t


@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed", "bf16-lean"])
def test_lightning_checkpoint_inside_a_window_changes_nothing_and_resumes_exactly(policy, tmp_path):
    data = batches(8)
    plain, _ = fit_mid_window(policy, data)
    saving, t = fit_mid_window(policy, data, ckpt_dir=tmp_path)
    mid = tmp_path / "epoch=0-step=1.ckpt"   # after batch 2: one optimizer step, one micro-batch of the next window
    assert t.global_step == 4 and mid.is_file() and (tmp_path / "epoch=0-step=3.ckpt").is_file()
    group = torch.load(mid, weights_only=False)["MixprecPrecision"]["open_group"]
    assert group is not None and (group["grads"] or group["master_grads"])
    assert_same_run(saving.engine, plain.engine)   # saving never changes training

    resumed, t2 = fit_mid_window(policy, data, ckpt_path=mid)   # a model of another init: all of it is loaded
    assert t2.global_step == 4
    assert_same_run(resumed.engine, plain.engine)


class Stop(Exception):
    """The failure a run checkpoints on (Lightning's OnExceptionCheckpoint)."""


class FailsInStep(MLP):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:   # the second micro-batch of the second window, before its backward
            raise Stop("in training_step")
        return super().training_step(batch, batch_idx)


class FailsAfterBatch(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:   # after the first micro-batch of the second window
            raise Stop("in on_train_batch_end")


@pytest.mark.parametrize("where", ["training_step", "on_train_batch_end"])
def test_lightning_checkpoint_on_an_exception_inside_a_window_resumes_exactly(where, tmp_path):
    """Lightning's OnExceptionCheckpoint saves inside the window; the user's exception is what the fit raises,
    and the resumed run (Lightning replays a batch whose training_step raised, not one whose hook did) equals the
    run that never failed."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    data, policy = batches(8), "fp16-mixed"
    plain, _ = fit_mid_window(policy, data)
    model, callbacks = (FailsInStep(), []) if where == "training_step" else (MLP(), [FailsAfterBatch()])
    t = trainer(MixprecPrecision(policy), max_steps=4, accumulate_grad_batches=2, enable_checkpointing=True,
                callbacks=[*callbacks, OnExceptionCheckpoint(tmp_path)])
    with pytest.raises(Stop, match=where):   # a training_step that raised: its batch is taken and replayed
        t.fit(model, Resumable(data, behind=1 if where == "training_step" else 0))
    path = tmp_path / "on_exception.ckpt"
    assert torch.load(path, weights_only=False)["MixprecPrecision"]["open_group"]["micro_step"] == 1
    resumed = MixprecPrecision(policy)
    t2 = trainer(resumed, max_steps=4, accumulate_grad_batches=2)
    t2.fit(MLP(seed=5), Resumable(data), ckpt_path=path)
    assert t2.global_step == 4
    assert_same_run(resumed.engine, plain.engine)


class BatchClock(Timer):
    """Lightning's Timer on a clock of one second per training batch (the stop it makes depends on where the time
    runs out, not on how long a batch takes here): stops the fit after ``seconds`` batches."""

    def __init__(self, seconds: int) -> None:
        from datetime import timedelta

        super().__init__(duration=timedelta(seconds=seconds), interval="step")
        self.ticks = 0

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        self.ticks += 1
        super().on_train_batch_end(trainer, *args, **kwargs)

    def time_elapsed(self, stage=None) -> float:
        return float(self.ticks)


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-kahan"])
def test_a_timers_stop_inside_a_window_then_save_checkpoint_resumes_exactly(policy, tmp_path):
    """Lightning's Timer ends the fit after batch 2, the first micro-batch of the second window; the user's
    trainer.save_checkpoint there holds the open window (under bf16-kahan its fp32 gradient sums), and the resumed
    fit equals the run that never stopped."""
    data = batches(8)
    plain, _ = fit_mid_window(policy, data)
    t = trainer(MixprecPrecision(policy), max_steps=4, accumulate_grad_batches=2, val_check_interval=3,
                limit_val_batches=1, callbacks=[BatchClock(3)])
    t.fit(MLP(), Resumable(data), val_dataloaders=Fixed([data[0]]))
    t.save_checkpoint(tmp_path / "timer.ckpt")
    assert t.global_step == 1
    assert torch.load(tmp_path / "timer.ckpt", weights_only=False)["MixprecPrecision"]["open_group"]["micro_step"] == 1
    resumed, t2 = fit_mid_window(policy, data, ckpt_path=tmp_path / "timer.ckpt")
    assert t2.global_step == 4
    assert_same_run(resumed.engine, plain.engine)


# ---------------------------------------------------------------------- the engine's own state_dict mid-window
N = 4   # accumulation_steps


def hand_engine(policy: str, seed: int = 0) -> MixedPrecision:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, 16), nn.GELU(), nn.Linear(16, OUT))
    return MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy, device="cpu",
                          accumulation_steps=N)


def hand_steps(mp: MixedPrecision, data: list) -> None:
    for x, y in data:
        with mp.autocast():
            loss = F.cross_entropy(mp.model(mp.cast_inputs(x)).float(), y)
        mp.backward(loss)
        mp.step()


@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed", "bf16-kahan", "bf16-lean"])
def test_engine_state_dict_mid_accumulation_resumes_the_window_bit_for_bit(policy, tmp_path):
    data = batches(3 * N)
    straight = hand_engine(policy)
    hand_steps(straight, data)

    saving = hand_engine(policy)
    hand_steps(saving, data[:N + 2])   # one boundary, then 2 of the next window's 4 micro-batches
    torch.save(saving.state_dict(), tmp_path / "mid.pt")
    hand_steps(saving, data[N + 2:])
    assert_same_run(saving, straight)   # taking the state changed nothing

    state = torch.load(tmp_path / "mid.pt", weights_only=True)
    assert state["open_group"]["micro_step"] == 2 and state["counters"]["boundaries"] == 1
    resumed = hand_engine(policy, seed=5)
    resumed.load_state_dict(state)
    assert resumed.micro_step == 2
    hand_steps(resumed, data[N + 2:])
    assert_same_run(resumed, straight)


def test_a_state_saved_mid_accumulation_is_not_converted_and_must_fit(tmp_path):
    mp = hand_engine("bf16-pure")
    hand_steps(mp, batches(1))
    state = mp.state_dict()
    other = hand_engine("bf16-mixed")
    with pytest.raises(ValueError, match=r"saved mid-accumulation \(1 micro-batch.*pass adopt_policy=True"):
        other.load_state_dict(state, convert=True)
    assert other.micro_step == 0 and str(other.policy) == "bf16-mixed"   # nothing changed
    state["open_group"]["master_grads"]["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"its gradients \['0.weight \(\(3, 3\) float32\)'\] do not fit"):
        hand_engine("bf16-pure").load_state_dict(state)
    adopted = hand_engine("bf16-mixed")
    adopted.load_state_dict(mp.state_dict(), adopt_policy=True)   # the saved policy's own window goes on
    assert str(adopted.policy) == "bf16-pure" and adopted.micro_step == 1


# ---------------------------------------------------------------------- adopting a run written without mixprec
class FirstValues(L.Callback):
    """The engine's fp32 values at the first training batch, before its step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not hasattr(self, "values"):
            self.values = trainer.precision_plugin.engine.trainable_state_dict()


@pytest.mark.parametrize("policy", ADOPTED)
def test_a_32_true_lightning_checkpoint_is_adopted_under_every_preset(policy, tmp_path):
    data = batches(3)
    fp32 = trainer(None, precision="32-true", max_epochs=1)
    fp32.fit(MLP(optimizer="torch"), Fixed(data))   # 3 steps of torch.optim.AdamW in fp32, no mixprec
    path = tmp_path / "fp32.ckpt"
    fp32.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert "MixprecPrecision" not in saved

    optimizer = "mixprec" if policy in NEEDS_MIXPREC_OPTIM else "torch"
    plugin, first = MixprecPrecision(policy), FirstValues()
    t = trainer(plugin, max_epochs=2, max_steps=4, callbacks=[first])
    t.fit(MLP(optimizer=optimizer, seed=5), Fixed(data), ckpt_path=path)   # one more step, on data[0]
    mp = plugin.engine
    assert t.global_step == 4 and mp.boundaries == 4
    adopted = [e for e in mp.events if e.kind == "adopt-checkpoint"]
    assert len(adopted) == 1 and adopted[0].to_dict()["to"] == str(mp.policy) and "fp32 → " in adopted[0].detail
    assert "adopted a run without mixprec state" in mp.decision

    # the values it started from are the checkpoint's fp32 weights (rounded to bf16 where the policy keeps none)
    for name, value in first.values.items():
        w = saved["state_dict"][name]
        if policy == "bf16-kahan":   # bf16 param + its bf16 compensation: |w - bf16(w)| <= 2**-8 |w|, stored in bf16
            assert torch.all((value - w).abs() <= w.abs() * 2.0**-15), name   # to 2**-8 of itself, + one fp32 add
        else:
            assert torch.equal(value, w.bfloat16().float() if policy in ("bf16-sr", "bf16-lean") else w), name

    # the reference: an engine on the same fp32 weights and optimizer state, switched by set_policy
    model = MLP(optimizer=optimizer, seed=7)
    model.load_state_dict(saved["state_dict"])
    opt = model.configure_optimizers()
    ref = MixedPrecision(model, opt, "fp32", device="cpu")
    state = saved["optimizer_states"][0]   # torch.optim.AdamW's: this optimizer's own group keys (sr_seed) added
    opt.load_state_dict({**state, "param_groups": [{**{k: v for k, v in live.items() if k != "params"}, **g}
                                                   for live, g in zip(opt.param_groups, state["param_groups"])]})
    ref.set_policy(policy)
    hand_steps_one(ref, data[0])
    assert_same_weights_and_state(mp, ref)


def hand_steps_one(mp: MixedPrecision, batch) -> None:
    x, y = mp.cast_inputs(batch)
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x).float(), y)
    mp.backward(loss)
    assert mp.step() is not None


def assert_same_weights_and_state(a: MixedPrecision, b: MixedPrecision) -> None:
    wa, wb = a.trainable_state_dict(), b.trainable_state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa), "fp32 values differ"
    assert all(p.dtype == q.dtype and torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_a_lightning_amp_checkpoint_is_adopted(tmp_path):
    """Lightning's own ``precision="bf16-mixed"`` keeps fp32 weights and optimizer state too: adopted the same way."""
    data = batches(2)
    amp = trainer(None, precision="bf16-mixed", max_epochs=1)
    amp.fit(MLP(optimizer="torch"), Fixed(data))
    path = tmp_path / "amp.ckpt"
    amp.save_checkpoint(path)
    plugin, first = MixprecPrecision("bf16-pure"), FirstValues()
    t = trainer(plugin, max_epochs=2, max_steps=3, callbacks=[first])
    t.fit(MLP(optimizer="torch", seed=5), Fixed(data), ckpt_path=path)
    weights = torch.load(path, weights_only=False)["state_dict"]
    assert all(torch.equal(v, weights[n]) for n, v in first.values.items())   # the masters: the saved fp32 values
    assert [e.kind for e in plugin.engine.events].count("adopt-checkpoint") == 1 and t.global_step == 3


def test_a_16_bit_lightning_checkpoint_is_refused_by_name(tmp_path):
    data = batches(2)
    bf16 = trainer(None, precision="bf16-true", max_epochs=1)
    bf16.fit(MLP(optimizer="torch"), Fixed(data))
    path = tmp_path / "bf16.ckpt"
    bf16.save_checkpoint(path)
    t = trainer(MixprecPrecision("bf16-pure"), max_epochs=2)
    with pytest.raises(ValueError, match=r"16-bit weight\(s\) \(net\.0\.bias \(bfloat16\).*'bf16-true'"):
        t.fit(MLP(), Fixed(data), ckpt_path=path)


# ---------------------------------------------------------------------- the Hugging Face Trainer: save_steps
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Regression(nn.Module):
    """A model the Trainer can train: ``forward(x, labels)`` returns ``{"loss", "logits"}``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(IN, 16), nn.GELU(), nn.Linear(16, OUT))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


def _hf_data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(IN, generator=g), "labels": torch.randint(0, OUT, (), generator=g)} for _ in range(n)]


def _hf_trainer(out, policy, *, seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mixprec.integrations.transformers import MixprecTrainer
    options = dict(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                   max_steps=4, learning_rate=1e-2, save_strategy="no", report_to="none", use_cpu=True,
                   disable_tqdm=True, train_sampling_strategy="sequential", seed=0, logging_steps=100)
    args = transformers.TrainingArguments(**{**options, **overrides})
    return MixprecTrainer(_Regression(seed), args, train_dataset=_hf_data(4 * 2 * BATCH), policy=policy)


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-lean"])
def test_hf_save_steps_saves_at_optimizer_steps_and_resumes_exactly(policy, tmp_path):
    from mixprec.integrations.transformers import PRECISION_STATE_NAME
    plain = _hf_trainer(tmp_path / "plain", policy)
    plain.train()
    saving = _hf_trainer(tmp_path / "saving", policy, save_strategy="steps", save_steps=3)
    saving.train()
    folder = tmp_path / "saving" / "checkpoint-3"   # save_steps counts optimizer steps (of 2 micro-batches)
    state = torch.load(folder / PRECISION_STATE_NAME, weights_only=True)
    assert state["counters"]["boundaries"] == 3 and state["open_group"] is None   # at a boundary
    assert saving.engine.boundaries == 4
    assert_same_run(saving.engine, plain.engine)
    resumed = _hf_trainer(tmp_path / "resumed", policy, seed=5)
    resumed.train(resume_from_checkpoint=str(folder))
    assert_same_run(resumed.engine, plain.engine)


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-lean"])
def test_a_plain_hf_trainer_checkpoint_is_adopted(policy, tmp_path):
    """A plain ``transformers.Trainer`` (fp32, its torch AdamW) saves checkpoint-3; ``MixprecTrainer`` resumes it
    for one more step, which equals an engine on the same fp32 weights and optimizer state switched by
    ``set_policy`` (constant lr, max_grad_norm 1.0 as the Trainer's default, the 4th batch)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    data = _hf_data(4 * BATCH)
    options = dict(per_device_train_batch_size=BATCH, learning_rate=1e-2, lr_scheduler_type="constant",
                   report_to="none", use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential", seed=0,
                   logging_steps=100)
    plain = transformers.Trainer(_Regression(), transformers.TrainingArguments(
        str(tmp_path / "plain"), max_steps=3, save_strategy="steps", save_steps=3, **options), train_dataset=data)
    plain.train()
    folder = tmp_path / "plain" / "checkpoint-3"
    from mixprec.integrations.transformers import MixprecTrainer
    adopted = MixprecTrainer(_Regression(seed=5), transformers.TrainingArguments(
        str(tmp_path / "adopted"), max_steps=4, save_strategy="no", **options), train_dataset=data, policy=policy)
    adopted.train(resume_from_checkpoint=str(folder))
    mp = adopted.engine
    assert mp.applied_steps == 4 and [e.kind for e in mp.events].count("adopt-checkpoint") == 1

    # the stream of the optimizer MixprecTrainer built: torch.initial_seed(), which TrainingArguments(seed=0) set
    assert {g["sr_seed"] for g in mp.optimizer.param_groups} == {0}
    model = _Regression(seed=7)
    model.load_state_dict(load_file(folder / "model.safetensors"))
    decay = set(adopted.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    opt = mixprec.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
                               {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=1e-2,
                              sr_seed=0)
    ref = MixedPrecision(model, opt, "fp32", device="cpu", max_grad_norm=1.0)
    state = torch.load(folder / "optimizer.pt", weights_only=True)
    opt.load_state_dict({**state, "param_groups": [{**{k: v for k, v in live.items() if k != "params"}, **g}
                                                   for live, g in zip(opt.param_groups, state["param_groups"])]})
    ref.set_policy(policy)
    batch = transformers.default_data_collator(data[3 * BATCH:4 * BATCH])
    with ref.autocast():
        loss = ref.model(**ref.cast_inputs(batch, keep=("labels",)))["loss"]
    ref.backward(loss)
    assert ref.step().applied
    assert_same_weights_and_state(mp, ref)


def test_a_plain_hf_trainer_checkpoint_of_a_tied_model_is_adopted(tmp_path):
    """GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight`` and its checkpoint holds the tensor once: the
    adopted run starts from the saved fp32 values under both names (one fp32 master) and trains on."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))

    ids = torch.randint(3, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    options = dict(per_device_train_batch_size=2, learning_rate=1e-2, report_to="none", use_cpu=True,
                   disable_tqdm=True, train_sampling_strategy="sequential", seed=0, logging_steps=100)
    plain = transformers.Trainer(gpt2(), transformers.TrainingArguments(
        str(tmp_path / "plain"), max_steps=2, save_strategy="steps", save_steps=2, **options), train_dataset=data)
    plain.train()
    folder = tmp_path / "plain" / "checkpoint-2"
    saved = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in saved   # written once, under the embedding's name

    from mixprec.integrations.transformers import MixprecTrainer
    seen = {}

    class First(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.setdefault("wte", adopted.engine.trainable_state_dict()["transformer.wte.weight"])

    adopted = MixprecTrainer(gpt2(), transformers.TrainingArguments(
        str(tmp_path / "adopted"), max_steps=3, save_strategy="no", **options), train_dataset=data,
        policy="bf16-pure", callbacks=[First()])
    adopted.train(resume_from_checkpoint=str(folder))
    model = adopted.engine.module
    assert adopted.engine.applied_steps == 3 and model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(seen["wte"], saved["transformer.wte.weight"])   # the fp32 master: the saved fp32 values
    assert [e.kind for e in adopted.engine.events].count("adopt-checkpoint") == 1


class _SaveAfterFirstMicroBatch(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            trainer.save_checkpoint(self.path)


def test_resuming_under_another_policy_converts_or_is_refused_with_the_trainers_route(tmp_path):
    """fit(ckpt_path=...) of a bf16-kahan checkpoint under MixprecPrecision("bf16-sr") was refused with the engine's
    "pass convert=True ... or adopt_policy=True", which a Lightning user cannot pass. The plugin's policy is the
    user's choice: the state is converted to it (a convert event) and training goes on in bf16; a window saved open
    whose gradients do not fit the new policy (bf16 ones, fp32 params) is refused naming the policy that saved it."""
    data = Fixed(batches(6))
    first = trainer(MixprecPrecision("bf16-kahan"), max_steps=2)
    first.fit(MLP(), data)
    first.save_checkpoint(tmp_path / "kahan.ckpt")
    plugin = MixprecPrecision("bf16-sr")
    resumed = trainer(plugin, max_steps=4)
    model = MLP(seed=7)
    resumed.fit(model, data, ckpt_path=tmp_path / "kahan.ckpt")
    kinds = [e.kind for e in plugin.engine.events]
    assert "convert" in kinds and plugin.engine.applied_steps == 4 and str(plugin.engine.policy) == "bf16-sr"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}

    window = trainer(MixprecPrecision("bf16-kahan"), max_steps=1, accumulate_grad_batches=2,
                     callbacks=[_SaveAfterFirstMicroBatch(tmp_path / "window.ckpt")])
    window.fit(MLP(), data)
    with pytest.raises(ValueError, match=r"saved mid-accumulation .* do not fit this model under bf16-mixed .* the "
                                         r"model and policy that saved it"):
        trainer(MixprecPrecision("bf16-mixed"), max_steps=2, accumulate_grad_batches=2).fit(
            MLP(), data, ckpt_path=tmp_path / "window.ckpt")


@pytest.mark.parametrize("saved, resumed", [("fp16-mixed", "bf16-mixed"), ("bf16-mixed", "fp16-mixed"),
                                            ("bf16-kahan", "bf16-pure")])
def test_a_window_saved_open_under_another_policy_is_refused_even_where_its_gradients_fit(saved, resumed, tmp_path):
    """fp16-mixed's window holds gradients times its loss scale (65536): resumed under bf16-mixed, whose scale is 1,
    the first step's gradient norm came out ~6e4 times the true one, with a convert event and no error (and
    bf16-mixed into fp16-mixed divided them by 65536). The dtypes fit, so the shape-and-dtype check let it through;
    the window is refused by name instead."""
    data = Fixed(batches(6))
    window = trainer(MixprecPrecision(saved), max_steps=1, accumulate_grad_batches=2,
                     callbacks=[_SaveAfterFirstMicroBatch(tmp_path / "window.ckpt")])
    window.fit(MLP(), data)
    with pytest.raises(ValueError, match=rf"saved inside an accumulation window under MixprecPrecision\('{saved}'\).* "
                                         rf"resume with MixprecPrecision\('{saved}'\)"):
        trainer(MixprecPrecision(resumed), max_steps=2, accumulate_grad_batches=2).fit(
            MLP(), data, ckpt_path=tmp_path / "window.ckpt")


class DropoutMLP(MLP):
    """MLP with dropout, whose training_step can raise after its forward (a NaN check on the loss, say)."""

    def __init__(self, seed: int = 0, fail_at: int | None = None) -> None:
        super().__init__(seed=seed)
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(IN, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, OUT))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == self.fail_at:   # after the forward drew its dropout masks
            raise Stop("after the forward")
        return loss


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_an_exception_after_the_forward_resumes_with_the_replayed_batchs_dropout(policy, tmp_path):
    """OnExceptionCheckpoint when training_step raises after its forward: Lightning replays that batch, and the
    checkpoint's RNG state was taken after the failed forward's dropout draws, so the replay drew other masks
    (weights off by ~1.6e-2). The plugin saves the RNG state from the start of a training step that raised."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    data = batches(8)

    def fit(model, **kw):
        plugin = MixprecPrecision(policy)
        t = trainer(plugin, max_steps=4, accumulate_grad_batches=2, **kw)
        return plugin, t, model

    torch.manual_seed(123)
    plain, t, model = fit(DropoutMLP())
    t.fit(model, Resumable(data))
    torch.manual_seed(123)
    _, t, model = fit(DropoutMLP(fail_at=3), enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(tmp_path)])
    with pytest.raises(Stop):
        t.fit(model, Resumable(data, behind=1))
    resumed, t2, model = fit(DropoutMLP(seed=5))
    t2.fit(model, Resumable(data), ckpt_path=tmp_path / "on_exception.ckpt")
    assert t2.global_step == 4
    assert_same_run(resumed.engine, plain.engine)
