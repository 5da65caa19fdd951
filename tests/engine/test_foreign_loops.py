"""A framework's loop habits around the engine, refused by name (:mod:`mixprec.engine.misuse.foreign_loops`):
Accelerate's gradient accumulation, ``accelerator.clip_grad_norm_`` on an engine's params, and a scheduler the
engine steps stepped by the user as well. Each case also runs the right way and is checked against its
reference (the engine's own accumulation bit for bit; accelerate's clip on a model no engine holds equal to
torch's; the scheduler's ``last_epoch`` equal to the applied steps). A tiny linear model, CPU."""

from __future__ import annotations

import pytest
import torch

import mixprec

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate's process-wide states (its own tests reset them the same way)."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _loss(mp, model, batch) -> torch.Tensor:
    x, y = mp.cast_inputs(batch, keep=(1,))
    with mp.autocast():
        return torch.nn.functional.mse_loss(model(x).float(), y)


# ---------------------------------------------------------------------- accumulation
def test_accelerate_gradient_accumulation_other_than_the_engines_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, opt, "bf16-mixed")
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True, gradient_accumulation_steps=4)
    prepared, _ = accelerator.prepare(mp.model, opt)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*accumulation_steps=1.*"
                                         r"MixedPrecision\(model, optimizer, policy, accumulation_steps=4\)"):
        with accelerator.accumulate(prepared):
            mp.backward(_loss(mp, prepared, _data(1)[0]))
    assert mp.micro_step == 0 and mp.applied_steps == 0   # refused before anything ran


def test_accelerate_accumulation_equal_to_the_engines_trains_as_the_engine_alone():
    data = _data(8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, opt, "bf16-pure", accumulation_steps=4)
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True, gradient_accumulation_steps=4)
    prepared, _ = accelerator.prepare(mp.model, opt)
    for batch in data:
        with accelerator.accumulate(prepared):
            mp.backward(_loss(mp, prepared, batch))
            mp.step()
    ref_model = _model()
    ref = mixprec.MixedPrecision(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), "bf16-pure",
                                 accumulation_steps=4)
    for batch in data:
        ref.backward(_loss(ref, ref_model, batch))
        ref.step()
    assert mp.applied_steps == ref.applied_steps == 2
    mine, theirs = mp.trainable_state_dict(), ref.trainable_state_dict()
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


def test_stale_accelerate_state_does_not_touch_a_model_accelerate_never_prepared():
    accelerate.Accelerator(mixed_precision="no", cpu=True, gradient_accumulation_steps=4)   # process-wide state
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed")
    mp.backward(_loss(mp, model, _data(1)[0]))
    assert mp.step().applied


# ---------------------------------------------------------------------- clipping
@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed"])
def test_accelerator_clip_grad_norm_on_an_engines_params_is_refused(policy):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, opt, policy)
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    prepared, _ = accelerator.prepare(mp.model, opt)
    mp.backward(_loss(mp, prepared, _data(1)[0]))
    with pytest.raises(RuntimeError, match=r"max_grad_norm=1.0"):
        accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_"):   # the masters the optimizer steps, too
        accelerator.clip_grad_norm_(list(mp.master_parameters()), 1.0)
    assert mp.step().applied   # the refusal changed nothing


def test_accelerator_clip_grad_norm_elsewhere_is_accelerates_own():
    engine_model = _model()
    mp = mixprec.MixedPrecision(engine_model, torch.optim.SGD(engine_model.parameters(), lr=0.1), "bf16-pure")
    mp.backward(_loss(mp, engine_model, _data(1)[0]))   # installs the check
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    other, twin = _model(), _model()
    x, y = _data(1)[0]
    for m in (other, twin):
        torch.nn.functional.mse_loss(m(x), y).backward()
    norm = accelerator.clip_grad_norm_(other.parameters(), 0.01)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(other.parameters(), twin.parameters()))


# ---------------------------------------------------------------------- the scheduler
def _engine_with_scheduler(policy: str = "bf16-mixed"):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return mixprec.MixedPrecision(model, opt, policy, scheduler=sched), sched


def test_a_scheduler_the_engine_steps_stepped_by_the_user_too_is_refused():
    mp, sched = _engine_with_scheduler()
    data = _data(3)
    mp.backward(_loss(mp, mp.model, data[0]))
    mp.step()
    sched.step()   # the user's own call: the learning rate moves twice per step
    with pytest.raises(RuntimeError, match=r"LambdaLR.step\(\) was called 1 time\(s\) outside the engine.*Remove"):
        mp.backward(_loss(mp, mp.model, data[1]))
    assert sched.last_epoch == 2 and mp.applied_steps == 1


def test_a_scheduler_stepped_only_by_the_engine_and_resumes_pass():
    mp, sched = _engine_with_scheduler()
    data = _data(6)
    for batch in data[:3]:
        mp.backward(_loss(mp, mp.model, batch))
        mp.step()
    state = mp.state_dict()
    again, again_sched = _engine_with_scheduler()   # a resumed run: a fresh engine loads the scheduler's state
    again.load_state_dict(state)
    mp.load_state_dict(state)                        # and the same engine loading a state
    for engine in (mp, again):
        for batch in data[3:]:
            engine.backward(_loss(engine, engine.model, batch))
            engine.step()
    assert sched.last_epoch == again_sched.last_epoch == mp.applied_steps == again.applied_steps == 6


def test_fp16_skipped_steps_do_not_look_like_a_users_step():
    mp, sched = _engine_with_scheduler("fp16-mixed")
    data = _data(4)
    for i, batch in enumerate(data):
        loss = _loss(mp, mp.model, batch)
        mp.backward(loss * 1e30 if i == 1 else loss)   # an overflow: skipped, no scheduler step
        mp.step()
    assert mp.skipped_total == 1 and sched.last_epoch == mp.applied_steps == 3


def test_a_scheduler_not_attached_to_the_engine_is_the_users():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    mp = mixprec.MixedPrecision(model, opt, "bf16-mixed")
    for batch in _data(3):
        mp.backward(_loss(mp, model, batch))
        if mp.step().applied:
            sched.step()
    assert sched.last_epoch == mp.applied_steps == 3


# ---------------------------------------------------------------------- what a refusal says
@pytest.mark.parametrize("policy, scaled", [("bf16-pure", False), ("fp32", False), ("fp16-mixed", True)])
def test_a_stray_optimizer_step_says_what_applies_to_the_policy(policy, scaled):
    """Between ``mp.backward()`` and ``mp.step()`` the gradients are multiplied by the loss scale only under a
    policy that scales the loss (fp16); the refusal says so only there."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, opt, policy, accumulation_steps=2)
    mp.backward(_loss(mp, mp.model, _data(1)[0]))
    with pytest.raises(RuntimeError, match=r"between mp.backward\(\) and mp.step\(\)") as refused:
        opt.step()
    text = str(refused.value)
    assert ("multiplied by the loss scale" in text) == scaled and ("scales no loss" in text) == (not scaled)
    assert "micro-batch 1 of accumulation_steps=2" in text


@pytest.mark.parametrize("policy, scaled, masters", [("bf16-pure", False, True), ("bf16-mixed", False, False),
                                                     ("fp16-mixed", True, False)])
def test_a_foreign_loops_step_says_what_applies_to_the_policy(policy, scaled, masters):
    """A framework's own ``loss.backward()`` + ``optimizer.step()`` on an engine's model: the refusal names loss
    scaling only where the policy scales the loss, and "nothing trains" only where fp32 masters exist."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, opt, policy)
    _loss(mp, mp.model, _data(1)[0]).backward()   # not mp.backward
    with pytest.raises(RuntimeError, match=r"called outside mp.step\(\)") as refused:
        opt.step()
    text = str(refused.value)
    assert ("no loss scaling" in text) == scaled and ("no inf/NaN check" in text) == (not scaled)
    assert ("nothing trains" in text) == masters
