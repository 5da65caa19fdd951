"""The engine on Hugging Face transformers models (built from configs: random weights, no download),
frozen-parameter storage, mp.unfreeze, and LoRA through the peft library."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import mixprec  # noqa: E402
from mixprec.programs.bench.measure import state_bytes  # noqa: E402
from mixprec.autocast.op_plan import planned_kernels  # noqa: E402
from mixprec.autocast.portable import portable_ops  # noqa: E402

VOCAB = 96


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (4, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _build(make, seed: int = 0):
    torch.manual_seed(seed)
    return make()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_mixed_equals_hand_written_autocast_loop(name):
    """The engine adds nothing to an HF model's step: bit-identical to torch.autocast + AdamW."""
    make = MODELS[name]
    model_ref = _build(make)
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=1e-3)
    model = _build(make)
    # saved=fp32: the norms save their fp32 input, as torch.autocast does (the default saves it in bf16)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="bf16-mixed,saved=fp32",
                                device="cpu")
    for step in range(3):
        batch = _batch(step)
        # bf16-mixed's defaults: ops=portable, kernels=measured (the same attention kernel as the engine's plan)
        with torch.autocast("cpu", dtype=torch.bfloat16), portable_ops("cpu"), planned_kernels("cpu"):
            out_ref = model_ref(**batch)
        out_ref.loss.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)

        cast = mp.cast_inputs(batch)
        with mp.autocast():
            out = mp.model(**cast)
        mp.backward(out.loss)
        assert mp.step().applied
        assert type(out) is type(out_ref)          # the ModelOutput class survives the output cast
        assert out.logits.dtype == torch.float32    # cast to output_dtype inside the structure
        assert torch.equal(out.loss, out_ref.loss)
    for (n, p), p_ref in zip(model.named_parameters(), model_ref.parameters()):
        assert torch.equal(p, p_ref), n


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp32_and_pure_policies_train_hf_models(name):
    """fp32 equals a plain loop bit for bit; bf16-pure tracks it (bf16 params, fp32 masters)."""
    make = MODELS[name]
    model_ref = _build(make)
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=1e-3)
    runs = {}
    for policy in ("fp32", "bf16-pure"):
        model = _build(make)
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy=policy, device="cpu")
        runs[policy] = (mp, [])
    losses_ref = []
    batch = _batch(0)   # one batch, so the loss must fall
    for step in range(4):
        out_ref = model_ref(**batch)
        out_ref.loss.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses_ref.append(float(out_ref.loss.detach()))
        for mp, losses in runs.values():
            with mp.autocast():
                out = mp.model(**mp.cast_inputs(batch))
            mp.backward(out.loss)
            mp.step()
            losses.append(float(out.loss.detach()))
    assert runs["fp32"][1] == losses_ref
    pure, losses = runs["bf16-pure"]
    assert all(p.dtype == torch.bfloat16 for p in pure.module.parameters())
    assert all(m.dtype == torch.float32 for m in pure.master_parameters())
    assert losses[-1] < losses[0]
    assert max(abs(a - b) / b for a, b in zip(losses, losses_ref)) < 0.01


def test_cast_inputs_passes_ids_and_masks_through_and_walks_batch_encoding():
    model = _build(_bert)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="bf16-pure", device="cpu")
    batch = _batch()
    encoding = transformers.BatchEncoding({**batch, "inputs_embeds_scale": torch.full((4,), 0.1)})
    cast = mp.cast_inputs(encoding)
    assert isinstance(cast, transformers.BatchEncoding)
    for key in ("input_ids", "attention_mask", "labels"):
        assert cast[key].dtype == torch.int64 and torch.equal(cast[key], batch[key])
    assert cast["inputs_embeds_scale"].dtype == torch.bfloat16      # floating tensors follow the policy
    assert encoding["inputs_embeds_scale"].dtype == torch.float32   # the caller's batch is not modified
    with mp.autocast():
        out = mp.model(**{k: v for k, v in cast.items() if k != "inputs_embeds_scale"})
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.loss)


def _freeze_embeddings(model) -> dict[str, torch.Tensor]:
    frozen = {}
    for n, p in model.named_parameters():
        if n.startswith("bert.embeddings."):
            p.requires_grad_(False)
            frozen[n] = p.detach().clone()
    return frozen


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure", "fp32"])
def test_frozen_params_are_stored_in_compute_dtype_without_grad_master_or_state(policy):
    model = _build(_bert)
    frozen_fp32 = _freeze_embeddings(model)
    trainable_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # frozen params included, as users often do
    mp = mixprec.MixedPrecision(model, opt, policy=policy, device="cpu")
    params = dict(model.named_parameters())

    def stored(name):   # mixed: only what autocast casts itself (embedding tables), norms stay fp32
        mixed_norm = mp.policy.param_dtype == torch.float32 and "LayerNorm" in name
        return torch.float32 if mixed_norm else mp.policy.compute_dtype

    for n, value_fp32 in frozen_fp32.items():
        # stored in the compute dtype, rounded to nearest once
        assert params[n].dtype == stored(n) and torch.equal(params[n], value_fp32.to(stored(n))), n
    for step in range(2):
        with mp.autocast():
            out = mp.model(**mp.cast_inputs(_batch(step)))
        mp.backward(out.loss)
        if step == 1:
            sb = state_bytes(mp.module, mp.optimizer)
        assert mp.step().applied
    master_ids = {id(p) for p, _ in mp.masters.pairs}
    n_frozen = sum(v.numel() for v in frozen_fp32.values())
    for n, value_fp32 in frozen_fp32.items():
        p = params[n]
        assert p.grad is None and id(p) not in master_ids and not mp.optimizer.state.get(p), n
        assert torch.equal(p, value_fp32.to(stored(n))), n          # never updated
    for n, before in trainable_before.items():
        assert params[n].dtype == mp.policy.param_dtype
        assert not torch.equal(params[n].float(), before), n     # trained
    assert sb.n_frozen == n_frozen
    frozen_bytes = sum(v.numel() * (2 if stored(n) == torch.bfloat16 else 4) for n, v in frozen_fp32.items())
    assert sb.frozen_bytes == frozen_bytes
    assert sb.per_frozen_param == pytest.approx(frozen_bytes / n_frozen)
    # trainable: param + grad + 2 Adam moments (+ fp32 master under -pure), in bytes
    expected = {"bf16-mixed": 16.0, "fp32": 16.0, "bf16-pure": 2 + 4 + 4 + 8}[policy]
    assert sb.per_trainable_param == pytest.approx(expected)


def test_frozen_bf16_storage_keeps_the_loss_of_fp32_frozen_weights():
    """Rounding frozen weights once to bf16 changes the bf16-mixed loss by no more than autocast does."""
    losses = {}
    for policy in ("fp32", "bf16-mixed"):
        model = _build(_bert)
        _freeze_embeddings(model)
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy=policy, device="cpu")
        losses[policy] = []
        for step in range(5):
            with mp.autocast():
                out = mp.model(**mp.cast_inputs(_batch(step)))
            mp.backward(out.loss)
            mp.step()
            losses[policy].append(float(out.loss.detach()))
    rel = [abs(a - b) / b for a, b in zip(losses["bf16-mixed"], losses["fp32"])]
    assert max(rel) < 5e-3, rel


def test_unfreezing_by_hand_raises_naming_the_param_and_unfreeze_builds_masters():
    model = _build(_bert)
    _freeze_embeddings(model)
    mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
                                policy="bf16-pure", device="cpu")
    word = model.bert.embeddings.word_embeddings.weight
    assert word.dtype == torch.bfloat16
    word.requires_grad_(True)
    with mp.autocast():
        out = mp.model(**mp.cast_inputs(_batch()))
    with pytest.raises(RuntimeError, match=r"bert\.embeddings\.word_embeddings\.weight.*mp\.unfreeze"):
        mp.backward(out.loss)
    assert mp.micro_step == 0 and word.grad is None   # nothing happened
    word.requires_grad_(False)

    stored_bf16 = word.detach().clone()
    n_groups = len(mp.optimizer.param_groups)
    event = mp.unfreeze("bert.embeddings.word_embeddings.*", lr=5e-4)
    assert event["kind"] == "unfreeze" and mp.events[-1] is event
    assert word.requires_grad and word.dtype == torch.bfloat16
    master = dict((id(p), m) for p, m in mp.masters.pairs)[id(word)]
    assert master.dtype == torch.float32 and torch.equal(master, stored_bf16.float())  # built from the stored value
    assert len(mp.optimizer.param_groups) == n_groups + 1
    assert mp.optimizer.param_groups[-1]["params"] == [master] and mp.optimizer.param_groups[-1]["lr"] == 5e-4
    with mp.autocast():
        out = mp.model(**mp.cast_inputs(_batch()))
    mp.backward(out.loss)
    assert mp.step().applied
    assert not torch.equal(word, stored_bf16)        # it trains now
    assert mp.optimizer.state[master]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="match no frozen parameter"):
        mp.unfreeze("no.such.*")


def test_frozen_run_resumes_bit_exactly_from_a_checkpoint(tmp_path):
    def build():
        model = _build(_bert)
        _freeze_embeddings(model)
        return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="bf16-pure",
                                      device="cpu")

    def train(mp, steps):
        for step in steps:
            with mp.autocast():
                out = mp.model(**mp.cast_inputs(_batch(step)))
            mp.backward(out.loss)
            mp.step()

    straight = build()
    train(straight, range(4))
    first = build()
    train(first, range(2))
    mixprec.save_checkpoint(tmp_path / "ck", first)
    resumed = build()
    mixprec.load_checkpoint(tmp_path / "ck", resumed)
    train(resumed, range(2, 4))
    for (n, p), q in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), n


def _lora_bert():
    model = _build(_bert)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure"])
def test_peft_lora_adapters_train_in_master_precision_with_a_bf16_base(policy):
    model = _lora_bert()
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    lora_b_before = {n: p.detach().clone() for n, p in lora.items() if "lora_B" in n}
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                                policy=policy, device="cpu")
    # under mixed, frozen params that autocast does not cast (norm gains; the head's bias, a parameter of
    # BertLMPredictionHead itself) stay fp32, since fp32 activations meet them
    mixed = policy == "bf16-mixed"
    fp32_under_mixed = lambda n: "LayerNorm" in n or n.endswith("predictions.bias")  # noqa: E731
    assert all(p.dtype == (torch.float32 if mixed and fp32_under_mixed(n) else torch.bfloat16) for n, p in base.items())
    assert all(p.dtype == mp.policy.param_dtype for p in lora.values())
    steppers = [t for g in mp.optimizer.param_groups for t in g["params"]]
    assert all(t.dtype == torch.float32 for t in steppers)    # updates in the master precision
    losses = []
    for step in range(6):
        with mp.autocast():
            out = mp.model(**mp.cast_inputs(_batch(0)))
        mp.backward(out.loss)
        if step == 1:
            sb = state_bytes(mp.module, mp.optimizer)
        mp.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < losses[0]
    assert any(not torch.equal(p.float(), lora_b_before[n].float()) for n, p in lora.items() if "lora_B" in n)
    assert sb.n_trainable == sum(p.numel() for p in lora.values())
    assert 2.0 <= sb.per_frozen_param < 2.1
    full = 16.0 if policy == "bf16-mixed" else 18.0   # per param of full fine-tuning under the same policy
    assert sb.per_param < full / 3


def test_frozen_params_under_fp16_mixed_are_fp16():
    model = _build(_bert)
    _freeze_embeddings(model)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="fp16-mixed",
                                device="cpu")
    assert model.bert.embeddings.word_embeddings.weight.dtype == torch.float16
    assert model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.float32
    with mp.autocast():
        out = mp.model(**mp.cast_inputs(_batch()))
    mp.backward(out.loss)
    assert mp.step().applied and torch.isfinite(out.loss)


# ---------------------------------------------------------------- regressions from the break-it pass
def _two_layer(freeze_first=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    if freeze_first:
        model[0].requires_grad_(False)
    return model


def _run(mp, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().square().mean()
        mp.backward(loss)
        mp.step()


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure", "bf16-kahan"])
def test_resume_after_unfreeze_unfreezes_again_and_is_bit_exact(policy, tmp_path):
    def build():
        model = _two_layer()
        opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2)   # frozen params held: unfreeze adds no group
        return mixprec.MixedPrecision(model, opt, policy=policy, device="cpu")

    straight = build()
    straight.unfreeze("0.*")
    _run(straight, 4)
    first = build()
    first.unfreeze("0.*")
    _run(first, 2)
    mixprec.save_checkpoint(tmp_path / "ck", first)
    resumed = build()                                  # built as at the start: layer 0 frozen
    mixprec.load_checkpoint(tmp_path / "ck", resumed)
    assert resumed.module[0].weight.requires_grad and resumed.frozen_names() == []
    g = torch.Generator().manual_seed(0)
    for _ in range(2):                                 # the same batches the straight run saw at steps 3-4
        torch.randn(4, 8, generator=g)
    for _ in range(2):
        x = torch.randn(4, 8, generator=g)
        with resumed.autocast():
            loss = resumed.model(resumed.cast_inputs(x)).float().square().mean()
        resumed.backward(loss)
        resumed.step()
    for (n, p), q in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(p, q), n


def test_guard_rollback_after_unfreeze_restores_the_unfrozen_layout():
    model = _two_layer()
    guard = mixprec.Guard(snapshot_every=1, spike_warmup=2, escalate_after=3)   # the rollback alone, no escalation
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure",
                                device="cpu", guard=guard)
    _run(mp, 3)
    mp.unfreeze("0.*")
    _run(mp, 2)
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    for _ in range(2):   # the first non-finite step in a row is only dropped, the second rolls back
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().square().mean()
        mp.backward(loss)
        result = mp.step()
    assert result.rolled_back and mp.events[-1]["kind"] == "rollback"
    assert model[0].weight.requires_grad and model[0].weight.dtype == torch.bfloat16
    _run(mp, 2)                                         # trains on after the rollback
    assert torch.isfinite(model[0].weight).all()


def test_unfreeze_refuses_options_it_cannot_apply_and_changes_nothing():
    model = _two_layer()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-mixed",
                                device="cpu")
    with pytest.raises(ValueError, match=r"already holds \['0.weight', '0.bias'\].*drop the options"):
        mp.unfreeze("0.*", lr=0.0)
    assert not model[0].weight.requires_grad
    model = _two_layer()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mp = mixprec.MixedPrecision(model, opt, policy="bf16-mixed", device="cpu", scheduler=sched)
    with pytest.raises(ValueError, match=r"does not hold \['0.weight', '0.bias'\].*scheduler LambdaLR"):
        mp.unfreeze("0.*", lr=1e-3)
    assert not model[0].weight.requires_grad and len(opt.param_groups) == 1
    _run(mp, 2)                                         # and the run goes on


def test_a_param_frozen_by_hand_after_the_build_keeps_its_master_and_state_through_set_policy():
    model = _two_layer(freeze_first=False)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure",
                                device="cpu")
    _run(mp, 2)
    model[0].weight.requires_grad_(False)
    master = dict((id(p), m) for p, m in mp.masters.pairs)[id(model[0].weight)].detach().clone()
    mp.set_policy("fp32", cause="test")
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, master)   # fp32 value kept
    assert mp.optimizer.state[model[0].weight]                                                # state kept
    model[0].weight.requires_grad_(True)
    _run(mp, 1)                                         # no "was frozen when built" error


def test_frozen_values_that_do_not_fit_fp16_stay_fp32_as_a_recorded_decision():
    model = _two_layer()
    with torch.no_grad():
        model[0].weight[0, 0] = 1e5                      # beyond fp16's 65504
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="fp16-mixed",
                                device="cpu")
    assert model[0].weight.dtype == torch.float32 and float(model[0].weight[0, 0]) == 1e5
    assert model[0].bias.dtype == torch.float16
    assert "1 frozen param(s) kept in fp32, their values do not fit float16 (0.weight)" in mp.decision


def test_frozen_norms_under_mixed_policies_stay_fp32_and_run():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.LayerNorm(8 * 6 * 6), torch.nn.Linear(8 * 6 * 6, 2))
    model[:5].requires_grad_(False)                     # a frozen backbone, a trainable head
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-mixed",
                                device="cpu")
    assert model[0].weight.dtype == torch.bfloat16      # conv: autocast casts it anyway
    assert model[1].weight.dtype == torch.float32 and model[4].weight.dtype == torch.float32
    for train in (True, False):
        model.train(train)
        with mp.autocast():
            out = mp.model(mp.cast_inputs(torch.randn(2, 3, 8, 8)))
        assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_lora_on_an_embedding_target_trains_its_adapters():
    from mixprec.workloads import apply_lora

    model = apply_lora(_build(_bert), "r=4,alpha=8,targets=word_embeddings,query")
    emb = [n for n, p in model.named_parameters() if "lora_embedding" in n]
    assert emb and all(dict(model.named_parameters())[n].requires_grad for n in emb)


def test_bf16_buffers_of_a_model_loaded_in_bf16_are_accepted_under_bf16_policies():
    model = _build(_llama).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    model.lm_head.float()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW([model.lm_head.weight], lr=1e-3), policy="bf16-mixed",
                                device="cpu")
    with mp.autocast():
        out = mp.model(**mp.cast_inputs(_batch()))
    mp.backward(out.loss)
    assert mp.step().applied


def test_cast_inputs_keep_works_on_batch_encodings_and_dataclass_init_false_fields_survive():
    import dataclasses

    model = _build(_bert)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="bf16-pure", device="cpu")
    enc = transformers.BatchEncoding({**_batch(), "score": torch.tensor([1.0 + 2 ** -12])})
    out = mp.cast_inputs(enc, keep=("score",))
    assert out["score"].dtype == torch.float32 and float(out["score"]) == 1.0 + 2 ** -12

    @dataclasses.dataclass
    class Item:
        x: torch.Tensor
        n: int = dataclasses.field(default=0, init=False)

    item = Item(torch.ones(2))
    item.n = 5
    cast = mp.cast_inputs(item)
    assert cast.n == 5 and cast.x.dtype == torch.bfloat16 and item.x.dtype == torch.float32


# ---------------------------------------------------------------- break-it round 2
def _emb_model():
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.ln = torch.nn.LayerNorm(16)
            self.fc1 = torch.nn.Linear(16, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, ids):
            return self.fc2(torch.relu(self.fc1(self.ln(self.emb(ids)))))

    model = Tiny()
    for module in (model.emb, model.ln, model.fc1):
        module.requires_grad_(False)
    return model


def _ids(step):
    return torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step))


def _train_ids(mp, steps):
    for step in steps:
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(_ids(step))).float().square().mean()
        mp.backward(loss)
        mp.step()


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "bf16-pure"])
def test_frozen_set_is_requires_grad_at_build_whatever_the_storage_and_resume_after_unfreeze_is_exact(
        policy, tmp_path):
    def build():
        model = _emb_model()
        return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy,
                                      device="cpu")

    assert build().frozen_names() == ["emb.weight", "ln.weight", "ln.bias", "fc1.weight", "fc1.bias"]
    straight = build()
    straight.unfreeze("ln.*")
    _train_ids(straight, range(4))
    first = build()
    first.unfreeze("ln.*")
    _train_ids(first, range(2))
    mixprec.save_checkpoint(tmp_path / "ck", first)
    resumed = build()
    mixprec.load_checkpoint(tmp_path / "ck", resumed)
    assert resumed.frozen_names() == ["emb.weight", "fc1.weight", "fc1.bias"]
    _train_ids(resumed, range(2, 4))
    for (n, p), q in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(p, q), n


def test_convert_between_policies_keeps_the_frozen_set(tmp_path):
    model = _emb_model()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="fp32", device="cpu")
    _train_ids(mp, range(2))
    mixprec.save_checkpoint(tmp_path / "ck", mp)
    for policy in ("bf16-mixed", "bf16-pure", "fp16-mixed"):
        other = _emb_model()
        mp2 = mixprec.MixedPrecision(other, torch.optim.AdamW(other.parameters(), lr=1e-2), policy=policy, device="cpu")
        mixprec.load_checkpoint(tmp_path / "ck", mp2, convert=True)
        assert mp2.frozen_names() == ["emb.weight", "ln.weight", "ln.bias", "fc1.weight", "fc1.bias"], policy
        assert not any(e["kind"] == "unfreeze" for e in mp2.events)


def test_a_load_that_would_need_a_new_param_group_is_refused_before_anything_changes(tmp_path):
    def build():
        model = _emb_model()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return mixprec.MixedPrecision(model, opt, policy="bf16-mixed", device="cpu")

    mp = build()
    mp.unfreeze("ln.*", lr=1e-3)
    _train_ids(mp, range(1))
    mixprec.save_checkpoint(tmp_path / "ck", mp)
    fresh = build()
    with pytest.raises(mixprec.CheckpointError, match=r"unfroze \['ln.weight', 'ln.bias'\] into a param group "
                                                      r"this optimizer lacks; call mp.unfreeze"):
        mixprec.load_checkpoint(tmp_path / "ck", fresh)
    assert len(fresh.optimizer.param_groups) == 1 and "ln.weight" in fresh.frozen_names()   # unchanged
    fresh.unfreeze("ln.*", lr=1e-3)                     # as the run did: then it loads
    mixprec.load_checkpoint(tmp_path / "ck", fresh)


def test_fp16_pure_refuses_frozen_values_it_cannot_store_and_mixed_keeps_them_fp32():
    def build(policy):
        model = _emb_model()
        with torch.no_grad():
            model.emb.weight[0, 0] = 1e5
        return model, mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy,
                                             device="cpu")

    with pytest.raises(ValueError, match=r"frozen parameter\(s\) \['emb.weight'\] hold values that do not fit"):
        build("fp16-pure")
    model, mp = build("fp16-mixed")
    mp.unfreeze("ln.*")                                 # a re-plan keeps the unfit one fp32 and frozen
    assert model.emb.weight.dtype == torch.float32 and float(model.emb.weight[0, 0]) == 1e5
    assert "emb.weight" in mp.frozen_names()


def test_frozen_embedding_lookups_stay_fp32_under_mixed_policies():
    """The residual stream of a frozen-embedding model stays fp32 under bf16-mixed, as in an autocast loop:
    the table is stored in bf16, its lookups are returned in fp32."""
    model = _emb_model()
    reference = copy.deepcopy(model)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-mixed",
                                device="cpu")
    assert model.emb.weight.dtype == torch.bfloat16
    with mp.autocast():
        looked_up = model.emb(_ids(0))
    assert looked_up.dtype == torch.float32
    with torch.no_grad():
        reference.emb.weight.copy_(reference.emb.weight.to(torch.bfloat16))   # the same rounded table
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(_ids(0))
    with mp.autocast():
        assert torch.equal(mp.model(_ids(0)), expected.float())


def test_reloading_the_same_values_keeps_the_fp32_masters():
    model = _two_layer(freeze_first=False)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure",
                                device="cpu")
    _run(mp, 2)
    masters = [m.detach().clone() for _, m in mp.masters.pairs]
    model.load_state_dict(model.state_dict())          # same 16-bit values: nothing to adopt
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.state_dict()
    assert all(torch.equal(a, m) for a, (_, m) in zip(masters, mp.masters.pairs))


def test_cast_inputs_keep_names_a_namedtuple_field():
    from collections import namedtuple

    Batch = namedtuple("Batch", ["x", "target"])
    model = _two_layer(freeze_first=False)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    out = mp.cast_inputs(Batch(torch.ones(2), torch.tensor([1.0 + 2 ** -12])), keep=("target",))
    assert type(out) is Batch and out.x.dtype == torch.bfloat16 and out.target.dtype == torch.float32


def test_loading_frozen_values_that_do_not_fit_fp16_storage_is_refused(tmp_path):
    """The fp16 storage of a frozen param was chosen from its values at build; a checkpoint whose values
    do not fit must not become inf/zeros silently (e.g. a config-built model restored from a run)."""
    def build(policy, big=False):
        model = _emb_model()
        if big:
            with torch.no_grad():
                model.emb.weight[0, 0] = 1e5
        return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy,
                                      device="cpu")

    saved = build("fp16-mixed", big=True)                 # emb kept fp32 there
    mixprec.save_checkpoint(tmp_path / "ck", saved)
    target = build("fp16-mixed")                          # emb fits: stored fp16
    before = target.module.emb.weight.detach().clone()
    for kwargs in ({}, {"weights_only": True}):
        with pytest.raises(mixprec.CheckpointError, match=r"frozen parameter\(s\) \['emb.weight'\] do not fit fp16"):
            mixprec.load_checkpoint(tmp_path / "ck", target, **kwargs)
    assert torch.equal(target.module.emb.weight, before) and target.applied_steps == 0
    with pytest.raises(ValueError, match=r"do not fit fp16"):
        target.load_state_dict(saved.state_dict())
    pure = build("fp16-pure")
    with pytest.raises(mixprec.CheckpointError, match=r"do not fit fp16"):
        mixprec.load_checkpoint(tmp_path / "ck", pure, convert=True)
    assert str(pure.policy) == "fp16-pure"               # unchanged


def test_a_frozen_embedding_bag_stays_fp32_under_mixed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(16, 8, mode="sum"), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-mixed",
                                device="cpu")
    assert model[0].weight.dtype == torch.float32
    with mp.autocast():
        out = mp.model(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.float32


def test_review_fixes_16bit_frozen_planned_fp32_step_after_unwrap_and_kahan_unwrap():
    # a frozen 16-bit param planned fp32 (keep_fp32 module) is cast back to fp32 at build
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                policy="bf16-mixed,keep_fp32=0", device="cpu")
    assert model[0].weight.dtype == torch.float32
    with mp.autocast():
        mp.model(torch.randn(2, 4))
    # unwrap(to_fp32=True) under Kahan rounding: the param plus its compensation
    model = _two_layer()
    mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-kahan",
                                device="cpu")
    _run(mp, 3)
    comp = mp.optimizer.state[model[2].weight]["kahan_comp"]
    expected = model[2].weight.float() + comp.float()
    mp.unwrap(to_fp32=True)
    assert torch.equal(model[2].weight, expected)
    with pytest.raises(RuntimeError, match=r"mp.step\(\) after mp.unwrap\(\)"):
        mp.step()


def test_a_load_refused_after_matching_the_frozen_set_leaves_the_engine_frozen_as_given(tmp_path):
    def build(policy):
        model = _emb_model()
        return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy,
                                      device="cpu")

    saved = build("fp8-mixed")
    saved.unfreeze("ln.*")
    _train_ids(saved, range(1))
    mixprec.save_checkpoint(tmp_path / "ck", saved)
    target = build("bf16-mixed")
    frozen, values = target.frozen_names(), [p.detach().clone() for p in target.module.parameters()]
    with pytest.raises(ValueError, match="changes the fp8 linears"):    # fp8 cannot be converted mid-run
        mixprec.load_checkpoint(tmp_path / "ck", target, convert=True)
    assert target.frozen_names() == frozen and not target.module.ln.weight.requires_grad
    assert all(torch.equal(a, b) for a, b in zip(values, target.module.parameters()))
    assert not target.events
