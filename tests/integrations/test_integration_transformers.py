"""MixprecTrainer (mixprec.integrations.transformers) against a hand-written MixedPrecision loop on the same
batches: a tiny GPT-2 built from a config (random weights, no download), fixed data, CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import mixprec  # noqa: E402
from mixprec.engine.loss_scale import DynamicLossScale  # noqa: E402
from mixprec.integrations.transformers import PRECISION_STATE_NAME, MixprecTrainer  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, LR, SEED = 64, 8, 2, 20, 1e-3, 123
PRESETS = ["bf16-mixed", "bf16-pure", "fp16-mixed", "bf16-kahan", "bf16-lean,kernels=native"]


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg)


def _data(n: int = STEPS * BATCH) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(out, **overrides) -> transformers.TrainingArguments:
    options = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                   weight_decay=0.01, lr_scheduler_type="linear", logging_steps=5, save_strategy="no",
                   report_to="none", use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential", seed=0)
    return transformers.TrainingArguments(**{**options, **overrides})


class _SeedEachStep(transformers.TrainerCallback):
    """Seeds the global RNG before each step, where the hand loop seeds it: stochastic rounding (bf16-lean)
    draws from the global RNG, which the Trainer's dataloader also draws from."""

    def on_step_begin(self, args, state, control, **kwargs):
        torch.manual_seed(SEED + state.global_step)


def _trainer(out, policy, *, loss_scale=None, seeded=True, **overrides) -> MixprecTrainer:
    return MixprecTrainer(_gpt2(), _args(out, **overrides), train_dataset=_data(), policy=policy,
                          loss_scale=loss_scale, callbacks=[_SeedEachStep()] if seeded else [])


def _hand_loop(policy, decay_names, *, loss_scale=None, steps=STEPS, accumulation=1):
    """The loop a user writes with MixedPrecision: the Trainer's groups, AdamW hyperparameters, linear
    schedule and max_grad_norm (1.0, its default), on the same batches in the same order."""
    model = _gpt2()
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay_names], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n not in decay_names], "weight_decay": 0.0}]
    opt = mixprec.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    mp = mixprec.MixedPrecision(model, opt, policy, scheduler=sched, max_grad_norm=1.0, loss_scale=loss_scale,
                                accumulation_steps=accumulation)
    data, norms = _data(), []
    for i in range(steps * accumulation):
        if i % accumulation == 0:
            torch.manual_seed(SEED + i // accumulation)
        batch = transformers.default_data_collator(data[i * BATCH:(i + 1) * BATCH])
        model.train()
        with mp.autocast():
            # the Trainer's loss: summed over tokens, divided by its count of labels (num_items_in_batch)
            loss = mp.model(**mp.cast_inputs(batch), num_items_in_batch=(batch["labels"] != -100).sum()).loss
        mp.backward(loss)
        result = mp.step()
        if result is not None:
            norms.append(result.grad_norm_t.item())
    return mp, norms


def _same_weights(a: mixprec.MixedPrecision, b: mixprec.MixedPrecision) -> None:
    """The fp32 master weights (fp32 values plus Kahan compensation where there is no master), bit for bit."""
    wa, wb = a.trainable_state_dict(), b.trainable_state_dict()
    assert wa.keys() == wb.keys()
    differ = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not differ, f"{len(differ)} of {len(wa)} fp32 weights differ, e.g. {differ[:3]}"


@pytest.mark.parametrize("policy", PRESETS)
def test_trainer_matches_hand_loop_bit_for_bit(tmp_path, policy):
    trainer = _trainer(tmp_path, policy)
    trainer.train()
    mp = trainer.engine
    assert mp.applied_steps == STEPS and trainer.state.global_step == STEPS
    hand, norms = _hand_loop(policy, set(trainer.get_decay_parameter_names(trainer.model)))
    _same_weights(mp, hand)
    logged = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    assert logged == [norms[s - 1] for s in range(5, STEPS + 1, 5)]   # the engine's unscaled fp32 norm
    assert trainer.args.max_grad_norm == 0 and mp.max_grad_norm == 1.0   # clipping moved into the engine


def test_gradient_accumulation_divides_the_loss_once(tmp_path):
    """The Trainer normalises each micro-batch's loss over the whole accumulation (num_items_in_batch) and the
    engine divides by accumulation_steps: MixprecTrainer undoes the first, so the step equals a hand loop
    with accumulation_steps=2 on per-micro-batch losses (every factor a power of two: exact)."""
    trainer = _trainer(tmp_path, "bf16-mixed", max_steps=STEPS // 2, gradient_accumulation_steps=2)
    trainer.train()
    assert trainer.engine.accumulation_steps == 2 and trainer.engine.applied_steps == STEPS // 2
    hand, norms = _hand_loop("bf16-mixed", set(trainer.get_decay_parameter_names(trainer.model)), steps=STEPS // 2,
                             accumulation=2)
    _same_weights(trainer.engine, hand)
    logged = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    assert logged == [norms[s - 1] for s in range(5, STEPS // 2 + 1, 5)]


def test_fp16_overflow_skips_never_step_the_scheduler(tmp_path):
    scale = lambda: DynamicLossScale(init_scale=2.0**24)   # noqa: E731  fp16 gradients overflow at first
    trainer = _trainer(tmp_path, "fp16-mixed", loss_scale=scale())
    trainer.train()
    mp, sched = trainer.engine, trainer.engine.scheduler
    assert mp.skipped_total > 0 and mp.applied_steps > 0 and mp.boundaries == trainer.state.global_step == STEPS
    assert sched.last_epoch == mp.applied_steps == STEPS - mp.skipped_total
    assert trainer.lr_scheduler.get_last_lr() == [LR * (STEPS - mp.applied_steps) / STEPS] * 2
    hand, _ = _hand_loop("fp16-mixed", set(trainer.get_decay_parameter_names(trainer.model)), loss_scale=scale())
    assert hand.skipped_total == mp.skipped_total
    _same_weights(mp, hand)


# bf16-sr too: its stochastic rounding draws from the global RNG (not yet an engine-owned generator), which the
# Trainer saves in each checkpoint (rng_state.pth) and restores on resume, so here it resumes exactly
RESUMED = [*PRESETS, "bf16-sr"]


@pytest.mark.parametrize("policy", RESUMED)
def test_resume_from_checkpoint_is_bit_exact(tmp_path, policy):
    fp16 = policy.startswith("fp16")
    scale = (lambda: DynamicLossScale(init_scale=2.0**24)) if fp16 else (lambda: None)   # skipped steps too
    whole = _trainer(tmp_path / "a", policy, loss_scale=scale(), seeded=False, save_strategy="steps", save_steps=10)
    whole.train()   # saves checkpoint-10 on the way: 20 uninterrupted steps
    folder = tmp_path / "a" / "checkpoint-10"
    assert (folder / PRECISION_STATE_NAME).is_file() and (folder / "optimizer.pt").is_file()
    saved = torch.load(folder / PRECISION_STATE_NAME, weights_only=True)
    assert not {"model", "optimizer", "scheduler"} & saved.keys()   # no second copy of what the Trainer saves
    resumed = _trainer(tmp_path / "b", policy, loss_scale=scale(), seeded=False)
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.engine.applied_steps == whole.engine.applied_steps
    assert resumed.engine.skipped_total == whole.engine.skipped_total and (not fp16 or whole.engine.skipped_total)
    _same_weights(whole.engine, resumed.engine)


class _EngineInCallback(transformers.TrainerCallback):
    """What a user tries first: build the engine in a callback, let the Trainer's loop run."""

    def __init__(self, unwrap: bool, policy: str):
        self.unwrap, self.policy = unwrap, policy

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.mp = mixprec.MixedPrecision(model, optimizer.optimizer if self.unwrap else optimizer, self.policy)


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-mixed"])
def test_callback_only_use_is_refused_naming_mixprec_trainer(tmp_path, policy):
    opt_model = _gpt2()
    # the wrapper Accelerate hands the callback: refused at build
    trainer = transformers.Trainer(opt_model, _args(tmp_path), train_dataset=_data(),
                                   callbacks=[_EngineInCallback(False, policy)])
    with pytest.raises(TypeError, match="MixprecTrainer"):
        trainer.train()
    # the real optimizer: refused at the Trainer's first optimizer.step(), before anything trains silently
    trainer = transformers.Trainer(_gpt2(), _args(tmp_path), train_dataset=_data(),
                                   callbacks=[_EngineInCallback(True, policy)])
    with pytest.raises(RuntimeError, match="MixprecTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_bf16_flag_adopted_or_refused(tmp_path):
    trainer = MixprecTrainer(_gpt2(), _args(tmp_path, bf16=True), train_dataset=_data())
    assert str(trainer.engine.policy) == "bf16-mixed"
    assert "TrainingArguments(bf16=True) adopted" in trainer.engine.decision
    assert trainer.accelerator.mixed_precision == "no" and not trainer.args.bf16   # one autocast: the engine's
    assert any(e.kind == "hf-flag" for e in trainer.engine.events)
    MixprecTrainer(_gpt2(), _args(tmp_path, bf16=True), train_dataset=_data(), policy="bf16-pure")   # agrees
    for policy, flag in (("fp32", "bf16"), ("fp16-mixed", "bf16"), ("bf16-mixed", "fp16")):
        model = _gpt2()
        with pytest.raises(ValueError, match=f"{flag}=True"):
            MixprecTrainer(model, _args(tmp_path, **{flag: True}), train_dataset=_data(), policy=policy)
        assert all(p.dtype == torch.float32 for p in model.parameters())   # refused before any cast


def test_evaluate_and_predict_run_under_the_engine(tmp_path):
    """Before and after train: bf16-pure params with fp32 token ids would fail outside the engine's casts;
    the eval loss equals the engine's own forward on the same batch."""
    data = _data(4)
    trainer = MixprecTrainer(_gpt2(), _args(tmp_path, per_device_eval_batch_size=4, max_steps=2),
                             train_dataset=_data(), eval_dataset=data, policy="bf16-pure")
    mp = trainer.engine

    def engine_loss():
        with torch.no_grad(), mp.autocast():
            batch = transformers.default_data_collator(data)   # the Trainer's loss: over its count of labels
            return mp.model(**mp.cast_inputs(batch), num_items_in_batch=(batch["labels"] != -100).sum()).loss.item()

    for when in ("before", "after"):
        metrics = trainer.evaluate()
        assert metrics["eval_loss"] == engine_loss(), when
        pred = trainer.predict(data)
        logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
        assert logits.shape == (4, SEQ, VOCAB), when
        if when == "before":
            trainer.train()


def test_unsupported_arguments_and_a_second_train_are_refused(tmp_path):
    model = _gpt2()
    with pytest.raises(ValueError, match=r"bf16_full_eval=True\): it casts the model"):
        MixprecTrainer(model, _args(tmp_path, bf16_full_eval=True), train_dataset=_data(), policy="bf16-mixed")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    trainer = MixprecTrainer(model, _args(tmp_path, max_steps=1), train_dataset=_data(), policy="bf16-mixed")
    trainer.train()
    with pytest.raises(RuntimeError, match="a second time"):
        trainer.train()


def test_logged_learning_rate_is_the_one_each_step_used(tmp_path):
    """The Trainer logs the lr of the step it just took (read "before update" of the scheduler); the engine steps
    the scheduler inside ``optimizer.step()``, so the view must not log the next step's. Reference: the linear
    schedule on a bare optimizer, stepped ``step - 1`` times (the lr the ``step``-th update used)."""
    trainer = _trainer(tmp_path, "bf16-mixed", max_steps=10, logging_steps=1)
    trainer.train()
    logged = [(e["step"], e["learning_rate"]) for e in trainer.state.log_history if "learning_rate" in e]
    assert [s for s, _ in logged] == list(range(1, 11))
    for step, lr in logged:
        reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
        schedule = transformers.get_linear_schedule_with_warmup(reference, 0, 10)
        for _ in range(step - 1):
            reference.step()
            schedule.step()
        assert lr == schedule.get_last_lr()[0], step


@pytest.mark.parametrize("max_steps", [-1, 2])
def test_an_epoch_ending_on_a_short_step_is_refused_at_train_start(tmp_path, max_steps):
    """4 batches per epoch with gradient_accumulation_steps=3: 3 + a short step of 1, reached by one epoch
    (max_steps=-1) or by max_steps=2. Refused before any step (it used to train the epoch first)."""
    short = MixprecTrainer(_gpt2(), _args(tmp_path, max_steps=max_steps, num_train_epochs=1,
                                          gradient_accumulation_steps=3), train_dataset=_data(8), policy="bf16-mixed")
    with pytest.raises(ValueError, match=r"4 batches per epoch and gradient_accumulation_steps=3.*short optimizer "
                                         r"step of 1.*max_steps <= 1"):
        short.train()
    assert short.engine.applied_steps == 0 and short.engine.micro_step == 0


def test_max_steps_within_the_first_epochs_whole_steps_trains(tmp_path):
    trainer = MixprecTrainer(_gpt2(), _args(tmp_path, max_steps=1, gradient_accumulation_steps=3),
                             train_dataset=_data(8), policy="bf16-mixed")   # 4 batches: one whole step of 3
    trainer.train()
    assert trainer.engine.applied_steps == 1


def test_save_model_writes_the_fp32_masters_under_pure(tmp_path):
    """``save_model()`` under bf16-pure writes the fp32 masters (what the optimizer trained) in the model's own
    parameter names, bit for bit, and ``from_pretrained`` loads them back; buffers as the model holds them."""
    from safetensors.torch import load_file
    trainer = _trainer(tmp_path, "bf16-pure", max_steps=3)
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    saved = load_file(str(out / "model.safetensors"))
    mp = trainer.engine
    masters = mp.masters.named(mp.module.named_parameters())
    assert masters and set(masters) <= set(saved)
    for name, master in masters.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], master.cpu()), name
    assert any(p.dtype == torch.bfloat16 for p in mp.module.parameters())   # the model still trains in bf16
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out), dtype=torch.float32)
    named = dict(loaded.named_parameters())
    assert all(torch.equal(named[n], m.cpu()) for n, m in masters.items())


class _Regression(torch.nn.Module):
    """A model with float regression ``labels`` (an MSE head), recording the dtype its labels arrive in."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.label_dtypes = []

    def forward(self, x, labels=None):
        out = self.net(x).float().squeeze(-1)
        self.label_dtypes.append(labels.dtype)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_float_labels_are_never_rounded_to_the_param_dtype(tmp_path):
    """A regression target under bf16-pure: the batch's floats are cast to bf16, but ``labels`` is the
    Trainer's target by convention and stays fp32 (rounded to bf16, 1.001 would read 1.0), in training and in
    evaluation. Failed before: labels arrived as bf16."""
    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.tensor(1.0 + 2.0 ** -10 * (i + 1))} for i in range(8)]
    model = _Regression()
    trainer = MixprecTrainer(model=model, args=_args(tmp_path / "r", max_steps=2, per_device_train_batch_size=4),
                             train_dataset=data, eval_dataset=data, policy="bf16-pure")
    trainer.train()
    trainer.evaluate()
    assert model.label_dtypes and set(model.label_dtypes) == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_second_trainer_on_the_same_model_takes_over_the_earlier_engine(tmp_path):
    """A new MixprecTrainer on a model an earlier one trained: the earlier engine is unwrapped (fp32 values from
    its masters), said in a warning and a "handover" event, and the new trainer trains."""
    first = _trainer(tmp_path, "bf16-pure", max_steps=2)
    first.train()
    masters = {n: m.clone() for n, m in first.engine.masters.named(first.model.named_parameters()).items()}
    with pytest.warns(UserWarning, match=r"MixprecTrainer: this model was still prepared by an earlier"):
        second = MixprecTrainer(first.model, _args(tmp_path, max_steps=2), train_dataset=_data(), policy="bf16-mixed")
    named = dict(first.model.named_parameters())
    assert masters and all(torch.equal(named[n], m) for n, m in masters.items())
    assert [e.kind for e in second.engine.events] == ["handover"]
    assert second.train().global_step == 2


def test_reduce_lr_on_plateau_is_stepped_by_the_trainer_on_each_evaluation(tmp_path):
    """lr_scheduler_type="reduce_lr_on_plateau" was accepted by __init__ and refused at train() with a fix only a
    hand loop can apply. The Trainer steps it on each evaluation's metric, as a plain Trainer does; the engine
    never steps it (it is not a per-step schedule)."""
    trainer = MixprecTrainer(_gpt2(), _args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau", max_steps=8,
                                            eval_strategy="steps", eval_steps=2, weight_decay=0.0,
                                            lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 10.0}),
                             train_dataset=_data(), eval_dataset=_data(4), policy="bf16-kahan")
    trainer.train()
    plateau = trainer.lr_scheduler
    assert isinstance(plateau, torch.optim.lr_scheduler.ReduceLROnPlateau) and trainer.engine.scheduler is None
    evals = sum("eval_loss" in e for e in trainer.state.log_history)
    assert evals == 4 and plateau.last_epoch == evals
    # threshold 10 (relative, mode min): no evaluation counts as an improvement, so each one halves the lr
    assert trainer.engine.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** evals, rel=1e-12)


def test_optim_sgd_becomes_mixprec_sgd_and_in_fp32_steps_as_the_plain_trainer(tmp_path):
    """optim="sgd" under a rounding policy was refused ("use mixprec.optim.SGD") with no Trainer route; it is
    swapped for mixprec.optim.SGD as adamw_torch is for AdamW (an event says so). Under fp32 the weights equal a
    plain Trainer's with torch's SGD bit for bit (no clipping: the norm's summation order is another matter)."""
    options = dict(optim="sgd", max_grad_norm=0.0, max_steps=6)
    kahan = MixprecTrainer(_gpt2(), _args(tmp_path / "k", **options), train_dataset=_data(), policy="bf16-kahan")
    kahan.train()
    assert type(kahan.engine.optimizer) is mixprec.optim.SGD
    assert any(e.kind == "hf-optimizer" and "mixprec.optim.SGD" in e.detail for e in kahan.engine.events)
    ours = MixprecTrainer(_gpt2(), _args(tmp_path / "o", **options), train_dataset=_data(), policy="fp32")
    ours.train()
    plain = transformers.Trainer(_gpt2(), _args(tmp_path / "p", **options), train_dataset=_data())
    plain.train()
    for (name, p), q in zip(ours.engine.module.named_parameters(), plain.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-sr"])
def test_a_peft_lora_run_resumes_bit_exactly_under_16_bit_params(tmp_path, policy):
    """The Trainer's resume of a peft model (load_adapter) builds new LoRA Parameters after the engine was built on
    the old ones: bf16-pure died with a bare KeyError, bf16-sr blamed the user ("the model gained parameters").
    The engine's Parameters are put back with the loaded values; the resumed run equals the uninterrupted one."""
    peft = pytest.importorskip("peft")

    def lora():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                 init_lora_weights=False)
        return peft.get_peft_model(_gpt2(), config)

    def run(out, resume=None):
        trainer = MixprecTrainer(lora(), _args(out, max_steps=6, save_strategy="steps", save_steps=3),
                                 train_dataset=_data(), policy=policy)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "a")
    resumed = run(tmp_path / "b", str(tmp_path / "a" / "checkpoint-3"))
    assert resumed.engine.applied_steps == whole.engine.applied_steps == 6
    _same_weights(whole.engine, resumed.engine)


def test_load_best_model_at_end_under_pure_gives_the_masters_the_best_checkpoints_fp32_weights(tmp_path):
    """The Trainer loads the best checkpoint's model.safetensors (the masters' fp32 values) into the bf16 params;
    the masters adopted only the rounding (and kept the last step's values where the rounding did not change), so
    save_model() wrote neither the best nor the last weights. Now it writes the best checkpoint's bit for bit."""
    from safetensors.torch import load_file

    scores = []

    def score(_):   # the first evaluation is the best
        scores.append(1)
        return {"score": -float(len(scores))}

    trainer = MixprecTrainer(_gpt2(), _args(tmp_path, max_steps=8, eval_strategy="steps", eval_steps=2,
                                            save_strategy="steps", save_steps=2, learning_rate=1e-2,
                                            load_best_model_at_end=True, metric_for_best_model="score",
                                            greater_is_better=True),
                             train_dataset=_data(), eval_dataset=_data(4), policy="bf16-pure", compute_metrics=score)
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    trainer.save_model(str(tmp_path / "final"))
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert final.keys() == best.keys()
    assert all(torch.equal(final[k], best[k]) for k in best)
