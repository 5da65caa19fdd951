"""Resuming through a trainer under a block-scaled policy (``mxfp8-mixed``, ``nvfp4-mixed``):
:mod:`mixprec.integrations.block_state`. Each trainer's run of 4 steps against 2 steps, a checkpoint, and a new model,
plugin and trainer resumed to 4: the weights, the losses and every block-scaled linear's stochastic-rounding stream
(``_extra_state``, ``[sr_seed, calls]``) equal bit for bit. Lightning restores the weights before its precision
plugin converts the model, which failed on the block keys ("Unexpected key(s) in state_dict") before. A small net
of the block-scaled tests (``tests/block_nets.py``: 16 inputs, 2 residual blocks of width 64, 8 classes), CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

L = pytest.importorskip("lightning")

import torch   # noqa: E402
import torch.nn.functional as F   # noqa: E402
from torch.utils.data import DataLoader   # noqa: E402

import mixprec.optim   # noqa: E402
from mixprec.integrations.lightning import MixprecFabricPrecision, MixprecPrecision   # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from block_nets import Net   # noqa: E402

BLOCK_POLICIES = ["mxfp8-mixed", "nvfp4-mixed"]


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(n)]


class Classifier(L.LightningModule):
    """``Net(d=64, n=2)`` under a cross-entropy loss; ``losses``: each training step's, detached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(d=64, n=2)
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x).float(), y))

    def configure_optimizers(self):
        return mixprec.optim.AdamW(self.parameters(), lr=1e-2)


def fit(policy: str, epochs: int, *, ckpt_path=None) -> tuple[MixprecPrecision, L.Trainer, Classifier]:
    """``epochs`` epochs of 2 batches (an epoch boundary per checkpoint: Lightning replays a plain loader)."""
    model, plugin = Classifier(), MixprecPrecision(policy)
    t = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, plugins=[plugin])
    t.fit(model, DataLoader(batches(), batch_size=None), ckpt_path=ckpt_path)
    return plugin, t, model


def streams(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if k.endswith("._extra_state")}


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------- Lightning's Trainer
@pytest.mark.parametrize("policy", BLOCK_POLICIES)
def test_lightning_resume_under_a_block_policy_equals_an_uninterrupted_run(policy, tmp_path):
    whole, _, whole_model = fit(policy, 2)
    first, t1, _ = fit(policy, 1)
    path = tmp_path / "first.ckpt"
    t1.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    block = saved["MixprecPrecision"]["block_state"]
    assert block and not block.keys() & saved["state_dict"].keys()   # apart from the weights Lightning restores
    resumed, t2, resumed_model = fit(policy, 2, ckpt_path=path)
    assert t2.global_step == 4 and resumed.engine.applied_steps == 4
    assert_same_state(resumed.engine.module, whole.engine.module)
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.losses, whole_model.losses[2:]))
    calls = {k: int(v[1]) for k, v in streams(resumed.engine.module).items()}
    assert calls and calls == {k: int(v[1]) for k, v in streams(whole.engine.module).items()}
    if policy == "nvfp4-mixed":   # stochastic rounding of dy: the stream moves once per backward
        assert set(calls.values()) == {4}
        assert {int(v[1]) for k, v in block.items() if k.endswith("._extra_state")} == {2}


def test_lightning_checkpoint_loads_without_the_plugin_and_into_the_converted_module(tmp_path):
    """The weights alone: ``load_from_checkpoint`` (no plugin, plain ``nn.Linear``) strictly, and ``validate``
    with ``ckpt_path`` after ``fit`` on the same trainer, whose module the plugin converted already."""
    plugin, t, model = fit("nvfp4-mixed", 1)
    path = tmp_path / "run.ckpt"
    t.save_checkpoint(path)
    plain = Classifier.load_from_checkpoint(path)
    assert all(type(m) is torch.nn.Linear for m in plain.modules() if isinstance(m, torch.nn.Linear))
    weights = {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in weights.items())
    before = streams(model)
    t.validate(model, DataLoader(batches(), batch_size=None), ckpt_path=path, verbose=False)
    assert all(torch.equal(v, streams(model)[k]) for k, v in before.items())


def test_lightning_resume_without_the_saved_streams_is_refused_by_name(tmp_path):
    _, t1, _ = fit("nvfp4-mixed", 1)
    path = tmp_path / "first.ckpt"
    t1.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    del saved["MixprecPrecision"]["block_state"]
    torch.save(saved, path)
    with pytest.raises(ValueError, match=r"MixprecPrecision\('nvfp4-mixed'\) cannot restore .*missing keys .*"
                                         r"_extra_state.*stochastic-rounding streams"):
        fit("nvfp4-mixed", 2, ckpt_path=path)


@pytest.mark.parametrize("saved_policy, policy", [("bf16-mixed", "nvfp4-mixed"), ("nvfp4-mixed", "bf16-mixed")])
def test_lightning_resume_under_another_policy_converts_with_an_event(saved_policy, policy, tmp_path):
    """Saved under one policy, resumed under another: the weights load, the block-scaled linears (if any) start
    their streams fresh, and a ``convert`` event says so (as ``mp.load_state_dict(state, convert=True)``)."""
    first, t1, _ = fit(saved_policy, 1)
    path = tmp_path / "first.ckpt"
    t1.save_checkpoint(path)
    fresh, _, _ = fit(policy, 1)   # one epoch from the start: its streams counted 2 steps
    resumed, _, _ = fit(policy, 2, ckpt_path=path)
    events = [e for e in resumed.engine.events if e.kind == "convert"]
    assert len(events) == 1 and (events[0].from_policy, events[0].to_policy) == (saved_policy, policy)
    assert {k: int(v[1]) for k, v in streams(resumed.engine.module).items()} == \
        {k: int(v[1]) for k, v in streams(fresh.engine.module).items()}


# ---------------------------------------------------------------------- Lightning Fabric
def fabric_run(policy: str, data, *, load=None, save=None) -> tuple[MixprecFabricPrecision, Classifier]:
    model, plugin = Classifier(), MixprecFabricPrecision(policy)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fmodel, fopt = fabric.setup(model, model.configure_optimizers())
    plugin.attach(fopt)
    if load is not None:
        fabric.load(load, {"mixprec": plugin})
    for x, y in data:
        loss = F.cross_entropy(fmodel(x).float(), y)
        model.losses.append(loss.detach())
        fabric.backward(loss)
        fopt.step()
    if save is not None:
        fabric.save(save, {"mixprec": plugin})
    return plugin, model


def test_fabric_resume_under_nvfp4_equals_an_uninterrupted_run(tmp_path):
    data, path = batches(4), tmp_path / "fabric.ckpt"
    whole, whole_model = fabric_run("nvfp4-mixed", data)
    fabric_run("nvfp4-mixed", data[:2], save=path)
    resumed, resumed_model = fabric_run("nvfp4-mixed", data[2:], load=path)
    assert_same_state(resumed.engine.module, whole.engine.module)
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.losses, whole_model.losses[2:]))
    assert {int(v[1]) for v in streams(resumed.engine.module).values()} == {4}


# ---------------------------------------------------------------------- the Hugging Face Trainer
class _HFClassifier(torch.nn.Module):
    _keys_to_ignore_on_save = None   # the Trainer reads it when it reports missing keys (a PreTrainedModel's)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(d=64, n=2)

    def forward(self, x, labels=None):
        out = self.net(x).float()
        return {"loss": F.cross_entropy(out, labels), "logits": out}


def hf_trainer(out, policy: str, **overrides):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mixprec.integrations.transformers import MixprecTrainer
    data = [{"x": x[i], "labels": y[i]} for x, y in batches(4) for i in range(8)]
    args = transformers.TrainingArguments(**{**dict(
        output_dir=str(out), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-2, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential", seed=0,
        logging_steps=100), **overrides})
    return MixprecTrainer(_HFClassifier(), args, train_dataset=data, policy=policy)


def test_hf_trainer_resume_under_nvfp4_equals_an_uninterrupted_run(tmp_path):
    whole = hf_trainer(tmp_path / "a", "nvfp4-mixed", save_strategy="steps", save_steps=2)
    whole.train()
    resumed = hf_trainer(tmp_path / "b", "nvfp4-mixed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert_same_state(resumed.engine.module, whole.engine.module)
    assert {int(v[1]) for v in streams(resumed.engine.module).values()} == {4}


@pytest.mark.parametrize("saved_policy, policy", [("bf16-mixed", "nvfp4-mixed"), ("nvfp4-mixed", "bf16-mixed")])
def test_hf_trainer_resume_under_another_policy_converts_with_an_event(saved_policy, policy, tmp_path):
    hf_trainer(tmp_path / "a", saved_policy, max_steps=2, save_strategy="steps", save_steps=2).train()
    fresh = hf_trainer(tmp_path / "f", policy, max_steps=2)
    fresh.train()
    resumed = hf_trainer(tmp_path / "b", policy)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    events = [e for e in resumed.engine.events if e.kind == "convert"]
    assert len(events) == 1 and (events[0].from_policy, events[0].to_policy) == (saved_policy, policy)
    assert {k: int(v[1]) for k, v in streams(resumed.engine.module).items()} == \
        {k: int(v[1]) for k, v in streams(fresh.engine.module).items()}
