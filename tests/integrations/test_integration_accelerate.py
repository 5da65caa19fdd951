"""MixedPrecision with Accelerate (accelerate 1.15) and someone else's autocast: the engine built before
``accelerator.prepare`` trains bit-identically to a plain loop; built after, it is refused by name; an autocast
the policy does not open (``Accelerator(mixed_precision="bf16")`` around an fp32 policy) is reported, never a
wrong decision line. A tiny GPT-2 from a config, fixed data, CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import mixprec  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 8, 2, 10


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one process-wide state that refuses another mixed_precision in the same process;
    each test builds its own Accelerator (accelerate's own tests reset it the same way)."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg)


def _batches() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids[i:i + BATCH], "labels": ids[i:i + BATCH].clone()} for i in range(0, len(ids), BATCH)]


def _train(mp, model, batches) -> None:
    for batch in batches:
        with mp.autocast():
            loss = model(**mp.cast_inputs(batch)).loss
        mp.backward(loss)
        mp.step()


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure"])
def test_engine_built_before_prepare_trains_as_a_plain_loop(policy):
    model = _gpt2()
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, opt, policy, max_grad_norm=1.0)
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    prepared, prepared_opt, loader = accelerator.prepare(mp.model, opt, loader)
    _train(mp, prepared, list(loader))
    assert isinstance(prepared_opt, accelerate.optimizer.AcceleratedOptimizer) and mp.applied_steps == STEPS
    plain = _gpt2()
    plain_mp = mixprec.MixedPrecision(plain, mixprec.optim.AdamW(plain.parameters(), lr=1e-3), policy, max_grad_norm=1.0)
    _train(plain_mp, plain_mp.model, _batches())
    mine, theirs = mp.trainable_state_dict(), plain_mp.trainable_state_dict()
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    assert not any(e.kind == "foreign-autocast" for e in mp.events)
    with pytest.raises(RuntimeError, match="between mp.backward"):   # the wrapper steps the engine's optimizer
        with mp.autocast():
            mp.backward(prepared(**mp.cast_inputs(_batches()[0])).loss)
        prepared_opt.step()


def test_engine_built_after_prepare_is_refused_by_name():
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    model, opt = accelerator.prepare(model, opt)
    with pytest.raises(TypeError, match=r"accelerator.prepare\(\).*Build the engine first"):
        mixprec.MixedPrecision(model, opt, "bf16-mixed")
    assert all(p.dtype == torch.float32 for p in model.parameters())   # refused before anything changed


def test_accelerator_bf16_autocast_around_an_fp32_policy_is_reported():
    model = _gpt2()
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, opt, "fp32")
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    prepared, opt = accelerator.prepare(mp.model, opt)
    batch = _batches()[0]
    with mp.autocast():
        loss = prepared(**mp.cast_inputs(batch)).loss
    mp.backward(loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="bf16 torch.autocast"):   # fp32 hooks no forward: found before the step
        assert mp.step().applied
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    events = [e for e in mp.events if e.kind == "foreign-autocast"]
    assert len(events) == 1 and "policy fp32 runs no autocast" in events[0].detail
    assert mp.decision.startswith("fp32") and "someone else's bf16 autocast" in mp.decision
    _train(mp, prepared, _batches()[1:3])   # said once
    assert len([e for e in mp.events if e.kind == "foreign-autocast"]) == 1


@pytest.mark.parametrize("policy, dtype, reported", [
    ("bf16-pure", torch.float16, True),      # another compute dtype than the policy's autocast
    ("bf16-pure", torch.bfloat16, False),    # the policy's own autocast dtype
    ("bf16-mixed", torch.float16, True),     # another compute dtype
    ("bf16-mixed", torch.bfloat16, False),   # the policy's own dtype: nothing contradicts it
    ("fp16-mixed", torch.bfloat16, True),
])
def test_someone_elses_autocast_is_reported_when_it_contradicts_the_policy(policy, dtype, reported):
    """A ``with torch.autocast(...)`` of the user's around the model, seen by the forward hooks (fp32 policies
    add none: test_engine.py asserts it; their case is a wrapped forward, tested above)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    x = mp.cast_inputs(torch.ones(2, 4))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        mp.model(x)
    found = [e for e in mp.events if e.kind == "foreign-autocast"]
    assert len(found) == reported and ("someone else's" in mp.decision) == reported

