"""The param set changing mid-run (issue 37, part B): ``optimizer.add_param_group`` on the attached optimizer and
Lightning's finetuning callbacks, under every policy (:mod:`mixprec.engine.param_groups`).

The reference for a group added at step ``K`` is a run whose optimizer held that group from the start while its
params were frozen by hand (``requires_grad_(False)`` after the engine was built: the engine keeps their storage
and masters, torch's optimizers skip params without a gradient, so nothing of theirs moves and no state is made)
until ``K``: the same params, values, param order (stochastic rounding's stream is keyed by the index in the
optimizer's param order) and group options, so the two runs must agree bit for bit. A param frozen *at build* is
stored without a master in the compute dtype (its fp32 low bits rounded away), so its reference starts from
those stored values: the reference model's frozen params are rounded to the compute dtype before the build,
which is exactly what storing them does. Tiny MLP, CPU, ``mixprec.optim.AdamW`` (every policy takes it); the
backbone's second Linear has 64x64 = 4096 weights, so ``bf16-lean``'s int8 state covers a new group's tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec.optim
from mixprec import MixedPrecision

POLICIES = ["bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr", "bf16-lean", "fp16-mixed", "fp32"]
K, STEPS = 2, 5   # the group joins after K steps; STEPS in all


class Net(nn.Module):
    """A backbone (Linear 8→64, tanh, Linear 64→64) and a head (Linear 64→4), seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def train_step(mp: MixedPrecision, batch) -> None:
    x, y = mp.cast_inputs(batch, keep=(1,))
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(mp.model(x).float(), y)
    mp.backward(loss)
    assert mp.step() is not None


def stored_dtype(policy: str) -> torch.dtype | None:
    """The dtype the engine stores a frozen Linear's params in under ``policy`` (None: fp32, unrounded)."""
    return {"fp16-mixed": torch.float16, "fp32": None}.get(policy, torch.bfloat16)


def added_run(policy: str, *, frozen_at_build: bool) -> tuple[MixedPrecision, list[torch.Tensor]]:
    """The optimizer holds the head; after K steps the backbone joins as a new group (lr 5e-3), thawed first when
    it was frozen at build (as Lightning's BaseFinetuning does: make_trainable, then add_param_group)."""
    model = Net()
    if frozen_at_build:
        model.backbone.requires_grad_(False)
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, policy, device="cpu")
    data = batches()
    for batch in data[:K]:
        train_step(mp, batch)
    before = [p.detach().clone() for p in model.backbone.parameters()]
    if frozen_at_build:
        model.backbone.requires_grad_(True)
    opt.add_param_group({"params": model.backbone.parameters(), "lr": 5e-3})   # a generator, read once
    for batch in data[K:]:
        train_step(mp, batch)
    return mp, before


def reference_run(policy: str, *, rounded_to: torch.dtype | None) -> MixedPrecision:
    """Both groups from the start; the backbone frozen by hand after the build until K (``rounded_to``: its values
    rounded to that dtype first, as a frozen-at-build param is stored)."""
    model = Net()
    if rounded_to is not None:
        with torch.no_grad():
            for p in model.backbone.parameters():
                p.copy_(p.to(rounded_to).float())
    opt = mixprec.optim.AdamW([{"params": list(model.head.parameters())},
                               {"params": list(model.backbone.parameters()), "lr": 5e-3}], lr=1e-2)
    mp = MixedPrecision(model, opt, policy, device="cpu")
    model.backbone.requires_grad_(False)
    data = batches()
    for batch in data[:K]:
        train_step(mp, batch)
    model.backbone.requires_grad_(True)
    for batch in data[K:]:
        train_step(mp, batch)
    return mp


def assert_same_run(a: MixedPrecision, b: MixedPrecision) -> None:
    """The fp32 values the optimizer steps (masters; param plus Kahan compensation), the stored params (dtype and
    bits), the optimizer state tensors and the counters agree exactly."""
    fa, fb = a.trainable_state_dict(), b.trainable_state_dict()
    assert fa.keys() == fb.keys()
    for name in fa:
        assert torch.equal(fa[name], fb[name]), f"{name}: fp32 values differ"
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key, value in sa[i].items():
            assert torch.equal(value, sb[i][key]), f"state {i} {key} differs"
    assert (a.applied_steps, a.skipped_total) == (b.applied_steps, b.skipped_total)
    assert torch.equal(a.loss_scale.scale, b.loss_scale.scale)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_group_of_params_the_optimizer_lacked_equals_holding_them_frozen_from_the_start(policy):
    """Trainable at build, not in the optimizer: under -pure the group trains the fp32 masters made at build (on
    main the 16-bit params were stepped with no gradient and overwritten: they never trained), under -kahan the
    compensation kept from build."""
    mp, before = added_run(policy, frozen_at_build=False)
    ref = reference_run(policy, rounded_to=None)
    assert_same_run(mp, ref)
    assert all(not torch.equal(p, q) for p, q in zip(mp.module.backbone.parameters(), before)), "backbone trained"
    event = [e for e in mp.events if e.kind == "param-group"]
    assert len(event) == 1 and event[0].step == K
    assert "4 trainable param(s) the optimizer lacked" in event[0].detail and event[0].detail in mp.decision
    if mp.policy.has_masters:   # the group steps the fp32 masters, never the 16-bit params
        assert {id(t) for t in mp.optimizer.param_groups[1]["params"]} == {id(m) for _, m in mp.masters.pairs[:4]}


@pytest.mark.parametrize("policy", POLICIES)
def test_thawing_params_frozen_at_build_equals_a_run_from_their_stored_values(policy):
    """Frozen at build (stored without master, 16-bit where it only changes rounding), then make_trainable +
    add_param_group: stored as trainable ones, masters from the stored values, state from the first step."""
    mp, before = added_run(policy, frozen_at_build=True)
    ref = reference_run(policy, rounded_to=stored_dtype(policy))
    assert_same_run(mp, ref)
    assert all(not torch.equal(p, q) for p, q in zip(mp.module.backbone.parameters(), before)), "backbone trained"
    assert mp.frozen_names() == []
    event = [e for e in mp.events if e.kind == "param-group"][0]
    assert "4 param(s) frozen at build now trained (backbone.0.weight" in event.detail, event.detail


def thawed_run(policy: str) -> MixedPrecision:
    """The optimizer holds the backbone (frozen at build) in its own group from the start; after K steps only
    ``requires_grad_(True)``: the engine adopts the params before the next forward (on main: RuntimeError at
    backward, "mp.unfreeze")."""
    model = Net()
    model.backbone.requires_grad_(False)
    opt = mixprec.optim.AdamW([{"params": list(model.head.parameters())},
                               {"params": list(model.backbone.parameters()), "lr": 5e-3}], lr=1e-2)
    mp = MixedPrecision(model, opt, policy, device="cpu")
    data = batches()
    for batch in data[:K]:
        train_step(mp, batch)
    model.backbone.requires_grad_(True)
    for batch in data[K:]:
        train_step(mp, batch)
    return mp


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure", "bf16-kahan", "fp32"])
def test_params_frozen_at_build_and_held_train_once_they_require_grad(policy):
    mp = thawed_run(policy)
    assert_same_run(mp, reference_run(policy, rounded_to=stored_dtype(policy)))
    event = [e for e in mp.events if e.kind == "param-group"]
    assert len(event) == 1 and event[0].step == K and "4 param(s) frozen at build now trained" in event[0].detail


def test_a_kahan_optimizer_on_part_of_the_params_saves_its_state():
    """The Kahan compensation of params the optimizer lacks waits in the engine, not in the optimizer's state,
    whose state_dict() could not name them (on main: KeyError); it starts when a group adds them."""
    model = Net()
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-kahan", device="cpu")
    train_step(mp, batches(1)[0])
    assert len(opt.state_dict()["state"]) == 2
    opt.add_param_group({"params": list(model.backbone.parameters())})
    comp = opt.state[model.backbone[0].weight]["kahan_comp"]
    assert comp.dtype == torch.bfloat16 and bool(comp.ne(0).any())   # what storing the fp32 init in bf16 lost
    train_step(mp, batches(1)[0])
    assert len(opt.state_dict()["state"]) == 6


def test_a_group_added_mid_step_is_refused_at_the_call():
    model = Net()
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-pure", device="cpu", accumulation_steps=2)
    x, y = mp.cast_inputs(batches(1)[0], keep=(1,))
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(mp.model(x).float(), y)
    mp.backward(loss)
    assert mp.step() is None
    with pytest.raises(RuntimeError, match=r"add_param_group after 1 micro-batch.*after mp\.step\(\) returns a result"):
        opt.add_param_group({"params": list(model.backbone.parameters())})
    assert len(opt.param_groups) == 1 and not [e for e in mp.events if e.kind == "param-group"]


def test_a_param_the_optimizer_steps_through_its_master_is_refused_as_a_duplicate():
    """Under -pure the optimizer holds head.weight's fp32 master: torch's own duplicate check cannot see the
    16-bit param is the same one."""
    model = Net()
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-pure", device="cpu")
    with pytest.raises(ValueError, match=r"steps head\.weight already \(through their fp32 masters"):
        opt.add_param_group({"params": [model.head.weight]})
    assert len(opt.param_groups) == 1
    mp.unwrap()
    assert "add_param_group" not in opt.__dict__   # torch's own again


# ---------------------------------------------------------------------- Lightning's BackboneFinetuning
def lightning_finetune(policy: str, unfreeze_at: int, epochs: int = 3, ckpt_path=None, all_params: bool = False):
    """``BackboneFinetuning(unfreeze_backbone_at_epoch=unfreeze_at)`` under ``MixprecPrecision(policy)``: the callback
    freezes the backbone in setup, the optimizer takes the trainable params (the head), and at the epoch's start
    the callback makes the backbone trainable and adds it as a group at a tenth of the lr, doubled each epoch
    (``all_params``: the optimizer takes every param, so the callback adds nothing and only makes them trainable)."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import BackboneFinetuning
    from mixprec.integrations.lightning import MixprecPrecision

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            net = Net()
            self.backbone, self.head = net.backbone, net.head

        def forward(self, x):
            return self.head(torch.tanh(self.backbone(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x).float(), y)

        def configure_optimizers(self):
            params = self.parameters() if all_params else filter(lambda p: p.requires_grad, self.parameters())
            return mixprec.optim.AdamW(params, lr=1e-2)

    module, plugin = Module(), MixprecPrecision(policy, keep_inputs=(1,))
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        plugins=[plugin], callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=unfreeze_at)])
    trainer.fit(module, torch.utils.data.DataLoader(batches(4), batch_size=None, shuffle=False), ckpt_path=ckpt_path)
    return plugin.engine, trainer


def hand_finetune(policy: str, unfreeze_at: int, epochs: int = 3, all_params: bool = False) -> MixedPrecision:
    """The same in a hand loop: BackboneFinetuning's lr schedule (initial: head lr x 0.1; then x2 per epoch, never
    above the head's) written out, make_trainable + add_param_group at the epoch's start."""
    model = Net()
    model.backbone.requires_grad_(False)
    opt = mixprec.optim.AdamW(model.parameters() if all_params else model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, policy, device="cpu")
    backbone_lr = None
    for epoch in range(epochs):
        if epoch == unfreeze_at:
            backbone_lr = opt.param_groups[0]["lr"] * 0.1
            model.backbone.requires_grad_(True)
            if not all_params:   # held already: BaseFinetuning.filter_on_optimizer leaves nothing to add
                opt.add_param_group({"params": list(model.backbone.parameters()), "lr": backbone_lr})
        elif epoch > unfreeze_at:
            backbone_lr = min(2.0 * backbone_lr, opt.param_groups[0]["lr"])
            opt.param_groups[-1]["lr"] = backbone_lr
        for batch in torch.utils.data.DataLoader(batches(4), batch_size=None, shuffle=False):
            train_step(mp, batch)
    return mp


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-mixed", "bf16-kahan"])
def test_backbone_finetuning_under_lightning_equals_the_hand_loop(policy):
    """On main: under -pure the unfrozen backbone's 16-bit params reached backward with no master ("mp.unfreeze"
    RuntimeError inside the trainer). Here the backbone trains from epoch 1, bit for bit as the hand loop."""
    engine, trainer = lightning_finetune(policy, unfreeze_at=1)
    ref = hand_finetune(policy, unfreeze_at=1)
    assert trainer.global_step == 12
    assert_same_run(engine, ref)
    stored = [p.detach().to(stored_dtype(policy) or torch.float32).float() for p in Net().backbone.parameters()]
    assert all(not torch.equal(p.float(), q) for p, q in zip(engine.module.backbone.parameters(), stored))
    event = [e for e in engine.events if e.kind == "param-group"]
    assert len(event) == 1 and event[0].step == 4 and event[0].detail in engine.decision
    if engine.policy.has_masters:   # the new group steps the masters since the first step after the call
        masters = {id(m) for _, m in engine.masters.pairs[:4]}
        assert {id(t) for t in engine.optimizer.param_groups[1]["params"]} == masters


def test_backbone_finetuning_from_epoch_0_is_adopted_when_the_optimizer_is_attached():
    """unfreeze_backbone_at_epoch=0: the callback adds the group before the first training step, before the plugin
    attaches the optimizer to the engine; the attach adopts the thawed params, said in the decision."""
    engine, _ = lightning_finetune("bf16-pure", unfreeze_at=0, epochs=2)
    ref = hand_finetune("bf16-pure", unfreeze_at=0, epochs=2)
    assert_same_run(engine, ref)
    event = [e for e in engine.events if e.kind == "param-group"]
    assert len(event) == 1 and event[0].detail.startswith("at attach") and event[0].detail in engine.decision


def test_a_run_resumed_after_backbone_finetuning_unfroze_equals_the_uninterrupted_run(tmp_path):
    """Saved at the end of epoch 1 (backbone unfrozen, in its own group): the resumed Trainer's callback freezes the
    backbone in setup and restores the two groups, the engine unfreezes what the saved run had unfrozen (its
    frozen set) and loads masters and state; epoch 2 then equals the uninterrupted run bit for bit."""
    whole, _ = lightning_finetune("bf16-pure", unfreeze_at=1, epochs=3)
    _, first = lightning_finetune("bf16-pure", unfreeze_at=1, epochs=2)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed, trainer = lightning_finetune("bf16-pure", unfreeze_at=1, epochs=3, ckpt_path=tmp_path / "epoch1.ckpt")
    assert trainer.global_step == 12
    assert_same_run(resumed, whole)


def test_backbone_finetuning_with_an_optimizer_on_every_param_trains_the_backbone():
    """The optimizer holds the frozen backbone (built on ``self.parameters()``): the callback's make_trainable is the
    only change; the engine adopts the params before the next forward (on main: RuntimeError at backward, "frozen
    when built ... mp.unfreeze"). Bit for bit the hand loop that sets requires_grad at the same step."""
    engine, _ = lightning_finetune("bf16-pure", unfreeze_at=1, all_params=True)
    assert_same_run(engine, hand_finetune("bf16-pure", unfreeze_at=1, all_params=True))
    event = [e for e in engine.events if e.kind == "param-group"]
    assert len(event) == 1 and event[0].step == 4 and "require grad now" in event[0].detail


def test_a_policy_switch_right_after_the_call_carries_the_new_group_to_the_new_masters():
    """bf16-pure → fp16-pure before any step: the switch first points the new group at its masters, then re-prepares
    (new masters for the new policy), and the group steps those."""
    model = Net()
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-pure", device="cpu")
    train_step(mp, batches(1)[0])
    opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 5e-3})
    mp.set_policy("fp16-pure")
    before = [m.detach().clone() for _, m in mp.masters.pairs[:4]]
    assert {id(t) for t in opt.param_groups[1]["params"]} == {id(m) for _, m in mp.masters.pairs[:4]}
    train_step(mp, batches(2)[1])
    assert all(not torch.equal(m, b) for (_, m), b in zip(mp.masters.pairs[:4], before))


def test_a_group_under_a_scheduler_the_engine_steps_is_refused_at_the_call():
    """torch's schedulers size their per-group lists when built: the engine's next scheduler step would fail on the
    new group, after the optimizer stepped (torch 2.13: zip(strict=True)). Refused before anything changes; the
    route (the group from the start, frozen until it trains) works."""
    model = Net()
    model.backbone.requires_grad_(False)
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-pure", device="cpu",
                        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    train_step(mp, batches(1)[0])
    model.backbone.requires_grad_(True)
    with pytest.raises(ValueError, match=r"scheduler attached to the engine \(LambdaLR\).*with this group from the"):
        opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 5e-3})
    assert len(opt.param_groups) == 1 and not [e for e in mp.events if e.kind == "param-group"]


def _two_ranks_thaw(rank: int, out) -> str:
    """One rank of a trainer's DDP (the process group is up, the engine itself runs no strategy, as under the
    Lightning plugin): thawing params frozen at build is refused, a group of params trainable at build is not."""
    model = Net()
    model.backbone[0].requires_grad_(False)
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-pure", device="cpu")
    model.backbone[0].requires_grad_(True)
    try:
        opt.add_param_group({"params": list(model.backbone[0].parameters())})
    except ValueError as e:
        refused = str(e)
    else:
        refused = ""
    opt.add_param_group({"params": list(model.backbone[2].parameters())})
    assert len(opt.param_groups) == 2 and mp.events[-1].kind == "param-group"
    return refused


def test_thawing_params_frozen_at_build_under_several_processes_is_refused_at_the_call(tmp_path):
    from ranks import run_ranks

    for refused in run_ranks(_two_ranks_thaw, tmp_path):
        assert refused.startswith("optimizer.add_param_group under several processes: backbone.0.weight, "
                                  "backbone.0.bias were frozen when the model was prepared and wrapped"), refused


def test_a_guard_rolls_back_into_the_layout_with_the_new_group():
    """The guard's snapshot is taken anew at the call (the old one holds one group fewer): a non-finite loss after
    the call rolls back to the step of the call, and training goes on with the group."""
    from mixprec import Guard

    model = Net()
    opt = mixprec.optim.AdamW(model.head.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, "bf16-pure", device="cpu", guard=Guard(snapshot_every=100))
    data = batches()
    for batch in data[:K]:
        train_step(mp, batch)
    opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 5e-3})
    train_step(mp, data[K])
    x, y = mp.cast_inputs(data[K + 1], keep=(1,))
    for _ in range(2):   # the first non-finite step in a row is only dropped, the second rolls back
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(mp.model(x).float(), y) * float("nan")
        mp.backward(loss)
        result = mp.step()
    assert result.rolled_back and mp.applied_steps == K and len(opt.param_groups) == 2
    train_step(mp, data[K + 2])
    assert mp.applied_steps == K + 1


# ---------------------------------------------------------------------- the Hugging Face Trainer
def _hf_thaw_run(policy: str, *, route: str):
    """MixprecTrainer, 4 steps of a frozen body and a trained head; at step 2 a TrainerCallback thaws the body:
    ``route="add_param_group"`` adds a group for it (what a torch user writes), ``route="frozen-in-optimizer"``
    passes an optimizer holding the frozen body from the start and only sets requires_grad."""
    transformers = pytest.importorskip("transformers")
    from mixprec.integrations.transformers import MixprecTrainer

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
            self.body.requires_grad_(False)

        def forward(self, x, labels=None):
            loss = nn.functional.cross_entropy(self.head(torch.relu(self.body(x))).float(), labels)
            return {"loss": loss}

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)

        def __len__(self) -> int:
            return 32

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    seen = {}

    class Thaw(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 2:
                seen["body at step 2"] = model.body.weight.detach().float().clone()
                model.body.requires_grad_(True)
                if route == "add_param_group":
                    optimizer.add_param_group({"params": list(model.body.parameters()), "lr": 1e-2})

    model = Model()
    optimizers = (None, None)
    if route == "frozen-in-optimizer":
        optimizers = (mixprec.optim.AdamW([{"params": list(model.head.parameters())},
                                           {"params": list(model.body.parameters()), "lr": 1e-2}], lr=1e-2), None)
    args = transformers.TrainingArguments(output_dir="unused", per_device_train_batch_size=8, max_steps=4, report_to=[],
                                          save_strategy="no", logging_strategy="no", use_cpu=True,
                                          lr_scheduler_type="constant")
    trainer = MixprecTrainer(model, args, train_dataset=Data(), policy=policy, callbacks=[Thaw()],
                             optimizers=optimizers)
    seen["body at build"] = model.body.weight.detach().float().clone()   # as stored (frozen: bf16 under -mixed too)
    trainer.train()
    return trainer, seen


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-mixed"])
def test_hf_trainer_thaws_a_frozen_body_through_the_optimizer_it_was_given(policy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer, seen = _hf_thaw_run(policy, route="frozen-in-optimizer")
    assert torch.equal(seen["body at step 2"], seen["body at build"])   # frozen: no update before the thaw
    assert not torch.equal(trainer.model.body.weight.detach().float(), seen["body at step 2"])   # trained after it
    assert [e.kind for e in trainer.engine.events].count("param-group") == 1


def test_hf_trainer_add_param_group_from_a_callback_is_refused_with_the_trainers_route(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"optimizer.add_param_group with a scheduler attached to the engine .*under "
                                         r"the Hugging Face Trainer.*MixprecTrainer\(\.\.\., optimizers="):
        _hf_thaw_run("bf16-pure", route="add_param_group")
