"""The engine in phases: prepare → attach → unscale_and_check → apply_or_skip (docs/engine.md).

``mp.step()`` is ``mp.apply_or_skip(mp.unscale_and_check())`` at a boundary: the phases by hand give the
same weights, losses and results bit for bit. Tiny tensors: fp16 matmuls are slow on CPUs.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.engine.mixed_precision import StepCheck


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]


def build(policy, **kw):
    model = tiny()
    return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy, device="cpu", **kw)


def loss_of(mp, x, y):
    x = mp.cast_inputs(x)
    with mp.autocast():
        return F.mse_loss(mp.model(x).float(), y)


def run(mp, data, phases, accumulation=1):
    out = []
    for i, (x, y) in enumerate(data):
        mp.backward(loss_of(mp, x, y))
        if phases and (i + 1) % accumulation == 0:
            check = mp.unscale_and_check()
            assert isinstance(check, StepCheck)
            out.append(mp.apply_or_skip(check))
        else:
            out.append(mp.step())
    return out


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "bf16-pure", "fp16-mixed"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_phases_by_hand_equal_step_bit_for_bit(policy, accumulation):
    one, two = build(policy, accumulation_steps=accumulation, max_grad_norm=0.5), \
        build(policy, accumulation_steps=accumulation, max_grad_norm=0.5)
    data = batches(4)
    r1, r2 = run(one, data, False), run(two, data, True, accumulation)
    assert same(one.module.parameters(), two.module.parameters())
    assert same(one.master_parameters(), two.master_parameters())
    for a, b in zip(r1, r2):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.applied, a.step, a.skipped_total, a.skipped_reason) == (b.applied, b.step, b.skipped_total,
                                                                                b.skipped_reason)
            assert torch.equal(a.grad_norm_t, b.grad_norm_t) and torch.equal(a.loss_scale_t, b.loss_scale_t)
    assert torch.equal(one.loss_scale.scale, two.loss_scale.scale)


def test_check_shows_unscaled_fp32_grads_to_the_caller():
    mp = build("fp16-mixed")
    x, y = batches(1)[0]
    mp.backward(loss_of(mp, x, y))
    check = mp.unscale_and_check()
    assert not check.skipped and check.loss_finite and check.stuck_skips == 0
    grads = [p.grad for p in mp.module.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(norm, check.grad_norm_t)
    assert mp.apply_or_skip(check).applied


def test_skipped_fp16_overflow_through_the_phases():
    mp = build("fp16-mixed")
    x, y = batches(1)[0]
    scale = float(mp.loss_scale.scale)
    before = [p.detach().clone() for p in mp.module.parameters()]
    mp.backward(loss_of(mp, x, y) * float("inf"))
    check = mp.unscale_and_check()
    assert check.skipped
    result = mp.apply_or_skip(check)
    assert not result.applied and result.skipped_total == 1
    assert same(before, mp.module.parameters())
    mp.backward(loss_of(mp, x, y))
    assert mp.apply_or_skip(mp.unscale_and_check()).applied
    assert float(mp.loss_scale.scale) <= scale


def test_wrong_order_raises_naming_the_right_one():
    mp = build("bf16-mixed", accumulation_steps=2)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="backward"):
        mp.unscale_and_check()
    mp.backward(loss_of(mp, x, y))
    with pytest.raises(RuntimeError, match="mp.step"):
        mp.unscale_and_check()          # before the boundary
    assert mp.step() is None
    mp.backward(loss_of(mp, x, y))
    check = mp.unscale_and_check()
    with pytest.raises(RuntimeError, match="apply_or_skip"):
        mp.unscale_and_check()
    with pytest.raises(RuntimeError, match="apply_or_skip"):
        mp.step()
    with pytest.raises(RuntimeError, match="apply_or_skip"):
        mp.backward(loss_of(mp, x, y))
    assert mp.apply_or_skip(check).applied
    with pytest.raises(RuntimeError, match="unscale_and_check"):
        mp.apply_or_skip(check)         # once per boundary


def test_eval_only_engine_and_attach_later():
    model = tiny()
    mp = MixedPrecision(model, None, "bf16-mixed", device="cpu")
    x, y = batches(1)[0]
    with torch.no_grad(), mp.autocast():
        out = mp.model(mp.cast_inputs(x))
    assert out.shape == (3, 2)
    with pytest.raises(RuntimeError, match=r"mp\.attach\("):
        mp.backward(loss_of(mp, x, y))
    with pytest.raises(RuntimeError, match=r"mp\.attach\("):
        mp.step()
    mp.attach(torch.optim.AdamW(model.parameters(), lr=1e-2))
    reference = build("bf16-mixed")
    for engine in (mp, reference):
        for x, y in batches(3):
            engine.backward(loss_of(engine, x, y))
            engine.step()
    assert same(mp.module.parameters(), reference.module.parameters())
    with pytest.raises(RuntimeError, match="attach"):
        mp.attach(torch.optim.AdamW(model.parameters()))


def test_optimizer_none_keeps_the_other_argument_checks():
    with pytest.raises(TypeError, match="model"):
        MixedPrecision(object(), None, "fp32")
    with pytest.raises(TypeError, match="optimizer"):
        MixedPrecision(tiny(), "sgd", "fp32")
    model = tiny()
    with pytest.raises(ValueError, match=r"mp\.attach\(optimizer, scheduler\)"):
        MixedPrecision(model, None, "fp32", scheduler=torch.optim.lr_scheduler.StepLR(
            torch.optim.SGD(model.parameters(), lr=0.1), 1))
    with pytest.raises(ValueError, match="none of the model's parameters"):
        MixedPrecision(model, None, "fp32").attach(torch.optim.SGD(tiny(1).parameters(), lr=0.1))


def test_eval_engine_under_pure_policy_attaches_masters():
    model = tiny()
    mp = MixedPrecision(model, None, "bf16-pure", device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp.attach(opt)
    assert all(t.dtype == torch.float32 for g in opt.param_groups for t in g["params"])
    reference = build("bf16-pure")
    for engine in (mp, reference):
        for x, y in batches(3):
            engine.backward(loss_of(engine, x, y))
            engine.step()
    assert same(mp.master_parameters(), reference.master_parameters())
