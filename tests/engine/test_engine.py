"""The training-step engine, through the public API.

The cases of shared/cases/cases.md that the engine answers are named ``test_caseNN_...``
(cases 1-4, 6-8, 11, 16, 17 and 25); the other cases live with the module they test.
"""

import copy
import math
import pickle
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import DivergenceError
from mixprec import MixedPrecision
from mixprec.engine.loss_scale import DynamicLossScale, StaticLossScale
from mixprec.autocast.portable import portable_ops
from engine_loops import _linear, _one_step

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))


def with_opt(model, opt_cls, **kw):
    """(model, optimizer built on that model's parameters)."""
    return model, opt_cls(model.parameters(), **kw)


def token_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 16, (4, 6), generator=g) for _ in range(n)]


def lm_loss(logits, x):
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


def train(mp, batches):
    results = []
    for x in batches:
        x = mp.cast_inputs(x)
        with mp.autocast():
            loss = lm_loss(mp.model(x), x)
        mp.backward(loss)
        results.append(mp.step())
    return results


# ---------------------------------------------------------------- parity with hand-written torch.amp
@pytest.mark.parametrize("policy,dtype,portable", [("bf16-mixed", torch.bfloat16, True),
                                                    ("fp16-mixed", torch.float16, True),
                                                    ("bf16-mixed,ops=native", torch.bfloat16, False)])
def test_bitwise_parity_with_hand_written_autocast_and_gradscaler(policy, dtype, portable):
    """The engine adds nothing to torch.autocast + GradScaler but the op lists its ``ops`` key names."""
    ref = tiny_lm()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    for x in token_batches(20):
        with torch.autocast("cpu", dtype=dtype), portable_ops("cpu", enabled=portable):
            loss = lm_loss(ref(x), x)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)

    model = tiny_lm()
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1 / (1 + s))
    mp = MixedPrecision(model, opt2, policy=policy, device="cpu", scheduler=sched2, max_grad_norm=1.0)
    results = train(mp, token_batches(20))
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert results[-1].step == 20 and results[-1].skipped_total == 0
    assert results[-1].loss_scale == (scaler.get_scale() if dtype == torch.float16 else 1.0)
    assert sched2.last_epoch == sched.last_epoch == 20


# ---------------------------------------------------------------- case 4: the engine owns the lifecycle
def test_case04_accumulation_unscales_once_and_misuse_names_the_call():
    model = tiny_lm()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        accumulation_steps=4, max_grad_norm=1.0)
    out = train(mp, token_batches(8))
    assert [r is None for r in out] == [True, True, True, False] * 2
    assert out[3].step == 1 and out[7].step == 2

    mp1 = MixedPrecision(*with_opt(tiny_lm(), torch.optim.SGD, lr=0.1), device="cpu", policy="fp32")
    x = token_batches(1)[0]
    mp1.backward(lm_loss(mp1.model(x), x))
    with pytest.raises(RuntimeError, match=r"backward\(\) called for micro-batch 2 since the last step\(\) with "
                                           r"accumulation_steps=1.*retain_graph=True"):
        mp1.backward(lm_loss(mp1.model(x), x))
    assert mp1.step() is not None
    with pytest.raises(RuntimeError, match=r"step\(\) called without backward\(\)"):
        mp1.step()


def test_accumulation_equals_big_batch_in_fp32():
    def run(accum):
        model = tiny_lm()
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.5), policy="fp32", device="cpu",
                            accumulation_steps=accum)
        data = torch.cat(token_batches(4))
        for chunk in data.chunk(accum):
            mp.backward(lm_loss(mp.model(chunk), chunk))
            mp.step()
        return [p.detach() for p in model.parameters()]
    for a, b in zip(run(1), run(4)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- case 6: skipped steps and the scheduler
def test_case06_step_lr_decays_only_on_the_applied_step():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with torch.no_grad():
        model.bias.fill_(0.5)
    mp = MixedPrecision(model, opt, policy="fp16-mixed", device="cpu", scheduler=sched)
    x = torch.randn(1, 4) * 0.01  # one row, small: grads * 2**15 fit fp16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        with mp.autocast():
            loss = model(x).float().sum() * 1e35  # overflows fp16 at scale 2**16
        mp.backward(loss)
        skipped = mp.step()
        with mp.autocast():
            loss = model(x).float().sum()
        mp.backward(loss)
        applied = mp.step()
    assert (skipped.applied, skipped.skipped_reason, skipped.loss_scale) == (False, "overflow", 2.0 ** 16)
    assert applied.applied and applied.step == 1 and applied.skipped_total == 1
    assert applied.loss_scale == 2.0 ** 15
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5


# ---------------------------------------------------------------- master weights (cases 16, 17)
def test_case16_bf16_pure_masters_keep_small_updates_of_torch_adamw_with_fp32_state():
    torch.manual_seed(0)
    model = nn.Linear(16, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    mp = MixedPrecision(model, opt, policy="bf16-pure", device="cpu")
    x = torch.ones(2, 16)
    for _ in range(100):
        x_in = mp.cast_inputs(x)
        with mp.autocast():
            loss = model(x_in).float().sum() * 0.25   # grad 0.5 per weight
        mp.backward(loss)
        mp.step()
    (master,) = list(mp.master_parameters())
    assert master.dtype == torch.float32 and model.weight.dtype == torch.bfloat16
    torch.testing.assert_close(master, torch.full_like(master, 1.0 - 100 * 1e-4), rtol=0, atol=2e-6)
    assert torch.equal(model.weight, master.to(torch.bfloat16))          # params are the rounded masters
    state = opt.state[master]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32   # case 17


def test_stock_optimizer_on_16bit_params_without_masters_is_refused_with_fix():
    model = tiny_lm()
    with pytest.raises(ValueError, match=r"would keep its state in .*bfloat16.*mixprec\.optim\.AdamW"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="params=bf16,compute=bf16",
                       device="cpu")
    with pytest.raises(ValueError, match=r"rounding='kahan'.*mixprec\.optim"):
        MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="bf16-kahan", device="cpu")


def test_optimizer_that_already_stepped_is_refused():
    model = tiny_lm()
    opt = torch.optim.AdamW(model.parameters())
    x = token_batches(1)[0]
    lm_loss(model(x), x).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="before the first optimizer.step"):
        MixedPrecision(model, opt, policy="bf16-pure", device="cpu")


# ---------------------------------------------------------------- autocast, inputs, outputs, keep_fp32
def test_cast_inputs_casts_floats_only_through_nested_structures():
    @dataclass
    class Batch:
        x: torch.Tensor
        ids: torch.Tensor

    mp = MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="bf16-pure", device="cpu")
    ids = torch.tensor([3, 2 ** 40])
    batch = {"a": [torch.ones(2), (torch.ones(1, dtype=torch.float16), ids)], "b": Batch(torch.ones(3), ids),
             "mask": torch.tensor([True]), "name": "x"}
    out = mp.cast_inputs(batch)
    assert out["a"][0].dtype == torch.bfloat16 and out["a"][1][0].dtype == torch.bfloat16
    assert out["a"][1][1].dtype == torch.int64 and torch.equal(out["a"][1][1], ids)   # token ids stay exact
    assert out["b"].x.dtype == torch.bfloat16 and out["b"].ids.dtype == torch.int64
    assert out["mask"].dtype == torch.bool and out["name"] == "x"


def test_output_dtype_and_fp32_policy_adds_nothing():
    """The model's outputs come back in fp32 under every preset (docs/engine.md says so); output=bf16 changes it."""
    from mixprec.policy.policy import PRESETS

    x = token_batches(1)[0]
    for name in PRESETS:
        mp = MixedPrecision(*with_opt(tiny_lm(), mixprec.optim.AdamW), policy=name, device="cpu")
        with mp.autocast():
            assert mp.model(x).dtype == torch.float32 and str(mp.policy) == name, name
    mp16 = MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), device="cpu",
                          policy="bf16-mixed,output=bf16")
    with mp16.autocast():
        assert mp16.model(x).dtype == torch.bfloat16
    model = tiny_lm()
    MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="fp32", device="cpu")
    assert not model._forward_hooks and not model._forward_pre_hooks


class Overflowing(nn.Module):
    """A block whose middle linear produces 76800 (> fp16 max 65504): case 11."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.big = nn.Linear(64, 8, bias=False)
        self.out = nn.Linear(8, 1)
        with torch.no_grad():
            self.inp.weight.copy_(torch.eye(64))
            self.inp.bias.zero_()
            self.big.weight.fill_(30.0)

    def forward(self, x):
        return self.out(self.big(self.inp(x)) / 1e5)


def test_case11_keep_fp32_module_stays_finite_where_fp16_overflows():
    x = torch.full((1, 64), 40.0)
    plain = MixedPrecision(*with_opt(Overflowing(), torch.optim.SGD, lr=0.1), policy="fp16-mixed",
                           device="cpu")
    with plain.autocast():
        assert torch.isinf(plain.model.big(x)).all()
    model = Overflowing()
    kept = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed,keep_fp32=big",
                          device="cpu")
    seen = {}
    model.big.register_forward_hook(lambda m, a, o: seen.update(inp=a[0].dtype, out=o.dtype, amax=o.abs().max()))
    with kept.autocast():
        y = kept.model(x)
        assert torch.is_autocast_enabled("cpu")        # restored after the fp32 region
    assert seen["inp"] == torch.float32 and seen["out"] == torch.float32 and seen["amax"].item() == 76800.0
    assert torch.isfinite(y).all()
    # under bf16 the same block stays finite without any help
    mp_bf16 = MixedPrecision(*with_opt(Overflowing(), torch.optim.SGD, lr=0.1),
                             policy="bf16-mixed", device="cpu")
    with mp_bf16.autocast():
        assert torch.isfinite(mp_bf16.model(x)).all()


def test_keep_fp32_under_pure_policy_keeps_those_params_fp32():
    model = tiny_lm()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-pure,keep_fp32=3", device="cpu")
    assert model[3].weight.dtype == torch.float32 and model[1].weight.dtype == torch.bfloat16
    res = train(mp, token_batches(3))[-1]
    assert res.applied
    with pytest.raises(ValueError, match=r"match no module.*module names look like"):
        MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="bf16-mixed,keep_fp32=nope",
                       device="cpu")


def test_prepared_model_pickles_deepcopies_and_unwraps():
    model = tiny_lm()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-pure,keep_fp32=3", device="cpu")
    x = token_batches(1)[0]
    with mp.autocast():
        y = mp.model(x)
    for clone in (pickle.loads(pickle.dumps(mp.model)), copy.deepcopy(mp.model)):
        with mp.autocast():
            assert torch.equal(clone(x), y)
    assert type(mp.model) is nn.Sequential                      # never wrapped or patched
    assert mp.unwrap() is model and not model._forward_hooks and not model[3]._forward_pre_hooks
    with pytest.raises(RuntimeError, match=r"mp.autocast\(\) after mp.unwrap\(\).*build a new MixedPrecision"):
        with mp.autocast():
            pass


# ---------------------------------------------------------------- state_dict: continue == uninterrupted
@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr"])
def test_state_dict_resume_is_bit_exact(policy):
    data = token_batches(10)

    def build():
        model = tiny_lm()
        opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        return MixedPrecision(model, opt, policy=policy, device="cpu", scheduler=sched, max_grad_norm=1.0,
                              loss_scale=DynamicLossScale(growth_interval=3) if "fp16" in policy else None)

    straight = build()
    torch.manual_seed(5)   # stochastic rounding draws from torch's RNG: restore it as a checkpoint does
    train(straight, data)
    first = build()
    torch.manual_seed(5)
    train(first, data[:5])
    saved, rng = copy.deepcopy(first.state_dict()), torch.get_rng_state()
    resumed = build()
    resumed.load_state_dict(saved)
    torch.set_rng_state(rng)
    train(resumed, data[5:])
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(straight.master_parameters(), resumed.master_parameters()):
        assert torch.equal(a, b)
    assert straight.loss_scale.scale.item() == resumed.loss_scale.scale.item()
    assert (straight.applied_steps, straight.skipped_total) == (resumed.applied_steps, resumed.skipped_total)
    assert straight.scheduler.last_epoch == resumed.scheduler.last_epoch


def test_load_state_dict_from_another_policy_is_refused():
    a = MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="bf16-pure", device="cpu")
    b = MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="bf16-mixed", device="cpu")
    with pytest.raises(ValueError, match=r"saved under policy 'bf16-pure', this engine runs bf16-mixed"):
        b.load_state_dict(a.state_dict())


# ---------------------------------------------------------------- construction errors and decisions
def test_bad_arguments_are_named():
    m = tiny_lm()
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match=r"accumulation_steps=0 must be an int >= 1"):
        MixedPrecision(m, opt, policy="fp32", device="cpu", accumulation_steps=0)
    with pytest.raises(ValueError, match=r"max_grad_norm=-1"):
        MixedPrecision(m, opt, policy="fp32", device="cpu", max_grad_norm=-1)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        MixedPrecision(m, "adam", policy="fp32", device="cpu")
    with pytest.raises(ValueError, match=r"preset 'bf16' is not known"):
        MixedPrecision(m, opt, policy="bf16", device="cpu")


def test_case25_no_silent_fp32_run_decision_names_effective_policy():
    mp = MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="auto", device="cpu")
    assert mp.decision.startswith("auto: pending") and str(mp.policy) == "fp32"   # decided at the first forward
    with mp.autocast():
        loss = mp.model(torch.randint(0, 16, (2, 8))).float().mean()
    mp.backward(loss)
    mp.step()
    assert str(mp.policy) in mp.decision and mp.decision.startswith(f"auto → {mp.policy}: measured on this model")
    with mp.autocast():   # the effective compute dtype is what autocast really runs
        y = nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == mp.policy.compute_dtype


# ---------------------------------------------------------------- low-precision optimizers through the engine
@pytest.mark.parametrize("policy,state_dtype,has_comp", [("bf16-kahan", torch.float32, True),
                                                          ("bf16-sr", torch.float32, False),
                                                          ("bf16-kahan,state=bf16", torch.bfloat16, True)])
def test_kahan_and_sr_policies_adopt_policy_precision_and_keep_small_updates(policy, state_dtype, has_comp):
    model = nn.Linear(256, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    mp = MixedPrecision(model, opt, policy=policy, device="cpu")
    assert opt.rounding == mp.policy.rounding and opt.state_dtype == state_dtype
    x = torch.ones(1, 256)
    for _ in range(100):
        with mp.autocast():
            loss = model(mp.cast_inputs(x)).float().sum()
        mp.backward(loss)
        mp.step()
    w = model.weight.detach().float()
    state = opt.state[model.weight]
    assert model.weight.dtype == torch.bfloat16
    # an fp32 run moves every weight by 100 * lr = 1e-2 to 0.99; plain bf16 rounding would leave 1.0 exactly.
    # The bf16 weight is within half a bf16 ulp at 0.99 (2**-9) of it, plus the rounding noise of the
    # compensation buffer / the sampling noise of stochastic rounding (averaged over 256 weights).
    half_ulp = mixprec.get_format("bf16").ulp(torch.tensor(0.99)).item() / 2
    assert abs(w.mean().item() - 0.99) <= half_ulp + 2e-4
    if has_comp:  # weight + compensation carries what bf16 could not store
        assert abs((w + state["kahan_comp"].float()).mean().item() - 0.99) < 2e-4
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == state_dtype
    assert ("kahan_comp" in state) == has_comp


def test_explicit_optimizer_precision_that_contradicts_the_policy_is_refused():
    model = tiny_lm()
    opt = mixprec.optim.AdamW(model.parameters(), rounding="stochastic")
    with pytest.raises(ValueError, match=r"rounding='stochastic'.*policy bf16-kahan says rounding='kahan'"):
        MixedPrecision(model, opt, policy="bf16-kahan", device="cpu")


def test_nonfinite_loss_in_an_early_micro_batch_is_reported_as_nonfinite():
    model = nn.Linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        accumulation_steps=2)
    x = torch.randn(1, 4) * 0.01
    for factor in (float("nan"), 1.0):   # NaN first, a clean loss last
        with mp.autocast():
            loss = model(x).float().sum() * factor
        mp.backward(loss)
        res = mp.step()
    assert (res.applied, res.skipped_reason) == (False, "nonfinite")


def test_fp8_mixed_policy_converts_linears_keeps_fp32_state_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, policy="fp8-mixed,recipe=delayed", device="cpu")
    assert type(model[2]).__name__ == "Float8Linear" and type(model[0]) is nn.Linear   # first/last kept
    assert list(mp.fp8_report.converted) == ["2"] and "fp8 linears (delayed, hybrid)" in mp.decision
    x = torch.randn(16, 32)
    target = torch.randn(16, 32)
    losses = []
    for _ in range(30):
        with mp.autocast():
            loss = F.mse_loss(mp.model(mp.cast_inputs(x)), target)
        mp.backward(loss)
        assert mp.step().applied
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    state = opt.state[model[2].weight]
    assert state["exp_avg"].dtype == torch.float32 and model[2].weight.dtype == torch.float32   # case 17
    with pytest.raises(ValueError, match="changes the fp8 linears"):
        mp.set_policy("bf16-mixed")


def test_fp8_ends_policy_key_converts_the_first_and_last_linears_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="fp8-mixed,fp8_ends=fp8",
                        device="cpu")
    assert sorted(mp.fp8_report.converted) == ["0", "2", "4"] and not mp.fp8_report.skipped
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(torch.randn(8, 32))).square().mean()
    mp.backward(loss)
    assert mp.step().applied
    with pytest.raises(ValueError, match="changes the fp8 linears"):
        mp.set_policy("fp8-mixed")   # keep_ends differs: the linears cannot be swapped back mid-run


def test_cast_inputs_keep_leaves_named_float_tensors_exact():
    mp = MixedPrecision(*with_opt(tiny_lm(), torch.optim.AdamW), policy="bf16-pure", device="cpu")
    target = torch.tensor([1.0 + 2 ** -12])          # not representable in bf16
    out = mp.cast_inputs({"x": torch.ones(2), "target": target}, keep=("target",))
    assert out["x"].dtype == torch.bfloat16
    assert out["target"].dtype == torch.float32 and torch.equal(out["target"], target)
    with pytest.raises(ValueError, match=r"\['y'\] not found; batch keys are \['target', 'x'\]"):
        mp.cast_inputs({"x": torch.ones(2), "target": target}, keep=("y",))


# ---------------------------------------------------------------- regressions from the break-it pass
def test_steps_inside_one_autocast_region_use_the_updated_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.05), policy="bf16-mixed", device="cpu")
    losses = []
    with mp.autocast():   # autocast's weight-cast cache must not outlive an optimizer step
        for _ in range(30):
            loss = F.mse_loss(mp.model(x), y)
            mp.backward(loss)
            mp.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-kahan"])
def test_batchnorm_is_kept_fp32_under_16bit_params(policy):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu")
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(torch.randn(6, 4))).float().sum()
    mp.backward(loss)
    assert mp.step().applied and model[1].running_mean.dtype == torch.float32


def test_keep_fp32_on_a_module_list_covers_its_children():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Overflowing()])

        def forward(self, x):
            return self.blocks[0](x)

    model = Stack()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed,keep_fp32=blocks",
                        device="cpu")
    with mp.autocast():
        assert torch.isfinite(mp.model(torch.full((1, 64), 40.0))).all()


def test_lifecycle_misuse_is_named():
    model = tiny_lm()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp32", device="cpu",
                        accumulation_steps=2)
    x = token_batches(1)[0]
    with pytest.raises(ValueError, match="loss does not require grad"):
        with torch.no_grad():
            mp.backward(lm_loss(mp.model(x), x))
    mp.backward(lm_loss(mp.model(x), x))
    assert mp.step() is None
    with pytest.raises(RuntimeError, match=r"step\(\) called without backward\(\)"):
        mp.step()
    assert mp.state_dict()["open_group"] is not None   # mid-window: the open window is saved (engine/open_group.py)
    with pytest.raises(TypeError, match="ReduceLROnPlateau needs a metric"):
        m = tiny_lm()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        MixedPrecision(m, o, policy="fp32", device="cpu", scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(o))
    with pytest.raises(ValueError, match="optimizer holds none of the model's parameters"):
        MixedPrecision(tiny_lm(), torch.optim.SGD(tiny_lm().parameters(), lr=0.1), policy="fp32", device="cpu")
    m = tiny_lm()   # a GAN's two schedulers swapped: the passed optimizer's lr would never change
    o, other = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(tiny_lm().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler=LambdaLR was built on another optimizer"):
        MixedPrecision(m, o, policy="fp32", device="cpu", scheduler=torch.optim.lr_scheduler.LambdaLR(other, lambda s: 0.0))
    mp = MixedPrecision(m, None, policy="fp32", device="cpu")
    with pytest.raises(ValueError, match="scheduler=LambdaLR was built on another optimizer"):
        mp.attach(o, torch.optim.lr_scheduler.LambdaLR(other, lambda s: 0.0))
    assert mp.optimizer is None   # refused before anything was bound
    with pytest.warns(UserWarning, match="underflows fp16"):
        m = tiny_lm()
        MixedPrecision(m, mixprec.optim.AdamW(m.parameters()), policy="fp16-pure,state=fp16", device="cpu")


def test_pure_policy_masters_adopt_params_loaded_after_the_engine_was_built():
    """Weights loaded into the model after MixedPrecision (a common order) must not be silently
    overwritten by the stale fp32 masters at the next step."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    pretrained = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="bf16-pure", device="cpu")
    x = torch.randn(4, 8)

    def step():
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().square().mean()
        mp.backward(loss)
        return mp.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error")       # ordinary steps never look like an outside edit
        step()
        step()
    model.load_state_dict(pretrained)        # after the engine: params change, masters do not
    with pytest.warns(UserWarning, match=r"4 parameter\(s\) \(0.weight, 0.bias, 2.weight, 2.bias\).*written "
                                         r"outside the engine"):
        step()
    for name, p in model.named_parameters():   # lr=0: the step keeps what was loaded
        assert torch.equal(p, pretrained[name].to(torch.bfloat16)), name
    assert mp.events[-1]["kind"] == "adopt"


def test_unwrap_to_fp32_returns_the_masters_at_full_precision():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="bf16-pure", device="cpu")
    x = torch.randn(4, 8)
    for _ in range(3):
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().square().mean()
        mp.backward(loss)
        mp.step()
    masters = [m.detach().clone() for m in mp.master_parameters()]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)   # more than bf16 precision
    params = list(model.parameters())
    assert mp.unwrap(to_fp32=True) is model
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == torch.float32 and torch.equal(p, m)
    assert model(x).dtype == torch.float32          # plain fp32 inference, no autocast


# ================================================================ cases of shared/cases/cases.md on the engine


# ---------------------------------------------------------------- case 1: NaN every step
@pytest.mark.parametrize("policy, scale, where", [
    ("bf16-mixed", 1.0, "data"),          # no loss scaling; NaN in the input batch itself
    ("fp16-mixed", 2.0 ** 16, "loss"),    # a non-finite *loss* never halves the scale: scaling cannot fix it
    ("fp16-pure", 2.0 ** 16, "data"),
])
def test_case01_nan_every_step_keeps_the_scale_and_raises_blaming_the_data(policy, scale, where):
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu",
                        max_stuck_skips=6)
    x = torch.randn(2, 4)
    if where == "data":
        x[0, 0] = float("nan")
    factor = float("nan") if where == "loss" else 1.0
    scales = []
    with pytest.raises(DivergenceError) as err:
        for _ in range(200):
            result = _one_step(mp, x, lambda out: out.float().sum() * factor)
            assert not result.applied and result.skipped_reason == "nonfinite"
            scales.append(result.loss_scale)
    assert set(scales) == {scale} and float(mp.loss_scale.scale) == scale     # never 0, never denormal
    msg = str(err.value)
    assert "6 consecutive steps with a non-finite loss" in msg and "gradients hold NaN" in msg
    assert "the fault is in the data or the forward pass" in msg and "loss scaling cannot fix" in msg
    assert "locate_nonfinite" in msg
    assert mp.applied_steps == 0 and mp.skipped_total == 6


# ---------------------------------------------------------------- case 2: stuck at the floor
def test_case02_stuck_at_floor_is_counted_and_raises_at_the_threshold_naming_overflow():
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        loss_scale=DynamicLossScale(init_scale=2.0, min_scale=1.0), max_stuck_skips=3)
    x = torch.randn(2, 4)
    seen = []
    with pytest.raises(DivergenceError, match=r"3 consecutive skipped steps .* floor 1 .*loss is finite") as err:
        for _ in range(50):   # d loss / d out = 1e5 > fp16 max at any scale >= 1
            seen.append(_one_step(mp, x, lambda out: 1e5 * out.sum()))
    assert "loss is finite but gradients overflow even at the smallest scale" in str(err.value)
    # scale 2 (skip, back off to 1), then two skips at the floor; the third raises
    assert [(r.applied, r.skipped_reason, r.loss_scale, r.skipped_total) for r in seen] == [
        (False, "overflow", 2.0, 1), (False, "overflow", 1.0, 2), (False, "overflow", 1.0, 3)]
    # the raising (4th) step is a finished boundary: counted as skipped, loss scale updated
    assert (mp.boundaries, mp.skipped_total, mp.applied_steps, mp.micro_step) == (4, 4, 0, 0)
    assert int(mp.loss_scale.floor_skips) == 3 and int(mp.loss_scale.consecutive_skips) == 4
    assert mp.applied_steps == 0


# ---------------------------------------------------------------- case 3: clipping sees unscaled grads
@pytest.mark.parametrize("policy, loss_scale, max_norm", [
    ("fp16-mixed", None, 1.0),                      # dynamic 2**16; the true norm is below max_norm: no clip
    ("fp16-mixed", StaticLossScale(2.0 ** -8), 0.01),   # a scale below one
    ("fp16-mixed", StaticLossScale(256.0), 0.01),
    ("fp16-pure", None, 0.01),                      # dynamic 2**16 on fp16 params with fp32 masters
])
def test_case03_clipping_and_reported_norm_match_fp32_whatever_the_scale(policy, loss_scale, max_norm):
    torch.manual_seed(0)
    w0 = torch.randn(1, 4) * 0.1
    x = torch.randn(8, 4) * 0.3

    def run(policy, loss_scale=None, accumulation=2):
        model = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(w0)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu",
                            max_grad_norm=max_norm, loss_scale=loss_scale, accumulation_steps=accumulation)
        for chunk in x.chunk(accumulation):
            result = _one_step(mp, chunk, lambda out: 5.0 * out.float().pow(2).mean())
        return next(mp.master_parameters()).detach().clone(), result

    w32, r32 = run("fp32")
    w16, r16 = run(policy, loss_scale)
    assert (r32.grad_norm > max_norm) == (max_norm < 1.0)          # the clip is active where meant to be
    assert r16.loss_scale == (loss_scale.scale.item() if loss_scale else 2.0 ** 16)
    # each gradient is fp32's to a few fp16 roundings (the fp16 output, its gradient, the cast input,
    # the fp16 weight-gradient GEMM output: <= 4 u = 2 fp16 eps relative); the scales are powers of two
    fp16_eps = mixprec.get_format("fp16").eps
    assert r16.applied and math.isclose(r16.grad_norm, r32.grad_norm, rel_tol=2 * fp16_eps)
    # the update lr * g carries that error; |lr * g| < |w|, so 1 fp16 eps of |w| bounds it
    torch.testing.assert_close(w16, w32, rtol=fp16_eps, atol=0)    # the (clipped) update is fp32's
    assert not torch.equal(w16, w0)


def test_case03_inf_gradients_stay_visible_to_the_skip_when_clipping():
    model = nn.Linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed", device="cpu",
                        max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    result = _one_step(mp, torch.randn(2, 4), lambda out: out.float().sum() * float("inf"))
    assert not result.applied and result.skipped_reason == "nonfinite"
    assert not math.isfinite(result.grad_norm)                       # the reported norm is not disguised
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- case 4: the lifecycle belongs to the engine
def test_case04_skip_then_apply_and_refused_misuse_leave_the_engine_usable():
    model = _linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-pure", device="cpu",
                        max_grad_norm=1.0, accumulation_steps=2)
    x = torch.randn(2, 4) * 0.01
    small = lambda out: out.float().mean()           # noqa: E731
    huge = lambda out: out.float().mean() * 1e30     # noqa: E731
    assert _one_step(mp, x, huge) is None            # first micro-batch: no boundary yet
    skipped = _one_step(mp, x, small)                # the boundary: overflow anywhere in it skips
    assert (skipped.applied, skipped.skipped_reason) == (False, "overflow")
    assert all(m.grad is None for m in mp.master_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert _one_step(mp, x, small) is None
    applied = _one_step(mp, x, small)                # no "unscale_() has already been called"
    assert applied.applied and applied.step == 1 and applied.loss_scale == 2.0 ** 15
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(x)).float().mean()
    mp.backward(loss)
    mp.step()
    mp.backward(mp.model(mp.cast_inputs(x)).float().mean())
    with pytest.raises(RuntimeError, match=r"backward\(\) called for micro-batch 3 since the last step\(\) with "
                                           r"accumulation_steps=2"):
        mp.backward(mp.model(mp.cast_inputs(x)).float().mean())
    result = mp.step()                               # the refused call changed nothing
    assert result.applied and result.step == 2
    with pytest.raises(RuntimeError, match=r"step\(\) called without backward\(\)"):
        mp.step()


# ---------------------------------------------------------------- case 6: schedulers follow applied steps
SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=3),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 2), torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 1)],
        milestones=[2]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_case06_any_epoch_scheduler_steps_only_on_applied_steps_without_warnings(name):
    model = _linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(1, 4) * 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no "lr_scheduler.step() before optimizer.step()"
        scheduler = SCHEDULERS[name](opt)
        mp = MixedPrecision(model, opt, policy="fp16-mixed", device="cpu", scheduler=scheduler)
        results = [_one_step(mp, x, lambda out, k=k: out.float().sum() * k) for k in (1e35, 1.0, 1e35, 1.0)]
    assert [r.applied for r in results] == [False, True, False, True]
    assert [r.step for r in results] == [0, 1, 1, 2] and [r.skipped_total for r in results] == [1, 1, 2, 2]
    assert (mp.applied_steps, mp.skipped_total, mp.boundaries) == (2, 2, 4)
    assert scheduler.last_epoch == 2


# ---------------------------------------------------------------- case 7: 16-bit parameters and scaling
def test_case07_half_models_are_refused_or_get_fp32_masters():
    # under a '-mixed' policy the trainable fp16 params are stored in fp32 (the policy's param dtype),
    # named in the decision: the fp32 copy is stepped, autocast computes in fp16, scaling works
    whole = nn.Linear(4, 1).half()
    mp16 = MixedPrecision(whole, torch.optim.SGD(whole.parameters(), lr=0.1), policy="fp16-mixed", device="cpu")
    assert whole.weight.dtype == FP32 and "2 trainable 16-bit param(s) stored in fp32, as fp16-mixed trains them (weight, bias)" in mp16.decision
    assert _one_step(mp16, torch.randn(2, 4) * 0.01, lambda out: out.float().mean() * 0.1).applied
    stray = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    stray[1].to(BF16)
    with pytest.raises(ValueError, match=r"1\.weight \(bfloat16\), 1\.bias \(bfloat16\)"):
        MixedPrecision(stray, torch.optim.SGD(stray.parameters(), lr=0.1), policy="fp16-pure", device="cpu")
    # the fp16 policy with fp32 masters: the 16-bit copy computes, the fp32 copy is stepped, scaling works
    model = nn.Linear(4, 1).half()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-pure", device="cpu")
    result = _one_step(mp, torch.randn(2, 4) * 0.01, lambda out: out.float().mean() * 0.1)
    (master_w, master_b) = list(mp.master_parameters())
    assert result.applied and result.loss_scale == 2.0 ** 16
    assert model.weight.dtype == FP16 and master_w.dtype == FP32 and master_w.grad is None
    assert torch.equal(model.weight, master_w.to(FP16)) and torch.equal(model.bias, master_b.to(FP16))
    stray_fp16 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    stray_fp16[1].half()   # one layer accidentally cast: detected at build, stored in fp32, named
    mp_stray = MixedPrecision(stray_fp16, torch.optim.SGD(stray_fp16.parameters(), lr=0.1), policy="fp16-mixed",
                              device="cpu")
    assert stray_fp16[1].weight.dtype == FP32 and "(1.weight, 1.bias)" in mp_stray.decision


# ---------------------------------------------------------------- case 8: no scaling under bf16
@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr", "fp8-mixed"])
def test_case08_bf16_policies_scale_nothing_warn_nothing_and_still_skip_nan(policy):
    model = nn.Sequential(_linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu")
    assert not mp.loss_scale.enabled and float(mp.loss_scale.scale) == 1.0
    before = [p.detach().clone() for p in model.parameters()]
    result = _one_step(mp, torch.randn(2, 16), lambda out: out.float().sum() * float("nan"))
    assert (result.applied, result.skipped_reason, result.loss_scale) == (False, "nonfinite", 1.0)
    assert (result.step, result.skipped_total) == (0, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("policy, override, scale", [
    ("bf16-mixed", "dynamic", 2.0 ** 16), ("bf16-pure,loss_scale=dynamic", None, 2.0 ** 16),
    ("bf16-pure", 128.0, 128.0), ("bf16-sr", DynamicLossScale(), 2.0 ** 16)])
def test_case08_forcing_a_scale_under_bf16_warns_and_trains_at_that_scale(policy, override, scale):
    model = _linear(4, 1)
    with pytest.warns(UserWarning, match="bf16 has fp32's exponent range"):
        mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu",
                            loss_scale=override)
    results = [_one_step(mp, torch.randn(2, 4)) for _ in range(3)]
    assert all(r.applied and r.loss_scale == scale for r in results)


# ---------------------------------------------------------------- case 11: an FFN activation above 65504
class _FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 8, bias=False)
        self.ln = nn.LayerNorm(8)
        self.down = nn.Linear(8, 1)
        with torch.no_grad():
            self.up.weight.fill_(30.0)   # 40 * 30 * 64 = 76800 > 65504

    def forward(self, x):
        return self.down(self.ln(self.up(x)))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(_FFN(), _FFN())

    def forward(self, x):
        return self.blocks[0](x) + self.blocks[1](x)


def test_case11_nested_overflow_is_named_and_a_glob_keeps_every_match_in_fp32():
    x = torch.full((1, 64), 40.0)
    loss_fn = lambda model, batch: model(batch).float().sum()   # noqa: E731
    report = mixprec.locate_nonfinite(_Stack(), x, loss_fn, "fp16-mixed", "cpu")
    assert (report.where, report.module, report.dtype, report.kind) == ("forward", "blocks.0.up", FP16, "inf")
    assert report.output_amax_fp32 == 76800.0 and "an overflow" in str(report)
    assert mixprec.locate_nonfinite(_Stack(), x, loss_fn, "bf16-mixed", "cpu") is None   # bf16 stays finite

    model = _Stack()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-4), policy="fp16-mixed,keep_fp32=blocks.*.up",
                        device="cpu")
    ran_in = {}
    for name in ("blocks.0.up", "blocks.1.up", "blocks.0.down"):
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: ran_in.update({name: o.dtype}))
    with mp.autocast():
        y = mp.model(x)
    assert ran_in == {"blocks.0.up": FP32, "blocks.1.up": FP32, "blocks.0.down": FP16}
    assert torch.isfinite(y).all()
    mp.backward(y.float().mean())
    assert mp.step() is not None


# ---------------------------------------------------------------- case 16: bf16 weights and small updates
def test_case16_master_weights_with_mixprec_adamw_and_opt_in_pure_bf16_warns():
    def run(policy):
        model = nn.Linear(16, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = mixprec.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mp = MixedPrecision(model, opt, policy=policy, device="cpu")
            for _ in range(100):
                _one_step(mp, torch.ones(2, 16), lambda out: out.float().sum() * 0.25)   # grad 0.5
        return model, mp, [str(w.message) for w in caught]

    model, mp, caught = run("bf16-pure")
    (master,) = list(mp.master_parameters())
    torch.testing.assert_close(master, torch.full_like(master, 1.0 - 100 * 1e-4), rtol=0, atol=2e-6)
    assert torch.equal(model.weight, master.to(BF16)) and not model.weight.eq(1.0).any()
    assert not [m for m in caught if "rounded away" in m]
    model, mp, caught = run("params=bf16,compute=bf16")      # pure bf16 without masters: opt-in, and warned
    assert torch.equal(model.weight, torch.ones_like(model.weight))
    assert len([m for m in caught if "rounded away" in m and "bf16-pure" in m]) == 1


# ---------------------------------------------------------------- case 17: optimizer state dtype
@pytest.mark.parametrize("policy, make_opt", [
    ("fp16-mixed", lambda ps: torch.optim.AdamW(ps)),
    ("fp16-pure", lambda ps: torch.optim.AdamW(ps)),
    ("fp16-pure", lambda ps: mixprec.optim.SGD(ps, lr=1e-3, momentum=0.9)),
    ("bf16-sr", lambda ps: mixprec.optim.AdamW(ps)),
    ("fp8-mixed,recipe=rowwise", lambda ps: torch.optim.AdamW(ps)),
])
def test_case17_optimizer_state_is_fp32_after_one_step(policy, make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    opt = make_opt(model.parameters())
    mp = MixedPrecision(model, opt, policy=policy, device="cpu")
    assert _one_step(mp, torch.randn(4, 16) * 0.1, lambda out: out.float().pow(2).mean()).applied
    moments = {k: v.dtype for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
    assert moments and set(moments.values()) == {FP32}
    assert len(opt.state) == 6


# ---------------------------------------------------------------- case 25: the effective compute dtype
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-pure", "fp16-pure", "bf16-kahan"])
def test_case25_autocast_really_computes_in_the_policy_dtype_and_fp16_batches_are_normalised(policy):
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu")
        batch = mp.cast_inputs({"a": torch.randn(2, 4).half(), "b": torch.randn(2, 4).half()})
        with mp.autocast():
            joined = torch.cat([batch["a"], batch["b"]])       # no at::autocast::prioritize error
            y = model[0](joined)
    assert not [w for w in caught if "Disabling autocast" in str(w.message)]
    assert y.dtype == mp.policy.compute_dtype != FP32
    assert joined.dtype == mp.policy.param_dtype
    assert mp.decision.startswith(f"{mp.policy} on cpu as asked")


# ---------------------------------------------------------------- regressions found reviewing the engine redesign
def test_a_guard_assigned_after_build_judges_the_steps():
    # `mixprec train --guard` attaches its Guard as `mp.guard = Guard(...)` after building the engine
    from mixprec import Guard
    from mixprec.engine.loss_scale import DynamicLossScale
    model = _linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.01), "fp16-mixed", device="cpu",
                        loss_scale=DynamicLossScale(init_scale=2.0**10, min_scale=2.0**6))
    mp.guard = Guard(snapshot_every=1, overflow_backoffs=2)
    x = torch.randn(2, 4)
    results = [_one_step(mp, x) for _ in range(3)] + [_one_step(mp, x, lambda out: 1e9 * out.float().sum())
                                                      for _ in range(2)]
    assert [r.applied for r in results] == [True, True, True, False, False]
    assert results[-1].rolled_back and mp.guard.counts["overflow"] == 1
    assert [e["kind"] for e in mp.events] == ["rollback"]


def test_load_state_dict_of_a_run_that_unfroze_params_under_masters_is_exact():
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
        model[0].requires_grad_(False)
        return MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), "bf16-pure", device="cpu")

    x = torch.randn(3, 4)
    mp = build()
    _one_step(mp, x)
    mp.unfreeze("0.*")
    _one_step(mp, x)
    state = mp.state_dict()
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.frozen_names() == [] and set(state["masters"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    _one_step(mp, x), _one_step(resumed, x)
    for (_, a), (_, b) in zip(mp.masters.pairs, resumed.masters.pairs):
        assert torch.equal(a, b)


def test_trainable_16_bit_params_under_mixed_are_stored_in_fp32_and_recorded():
    """LoRA adapters cast with their bf16 base before wrapping (peft's get_peft_model upcasts them)."""
    torch.manual_seed(0)
    base, adapter = nn.Linear(8, 8), nn.Linear(8, 8)
    model = nn.Sequential(base, adapter).to(torch.bfloat16)
    base.requires_grad_(False)
    values = adapter.weight.detach().float().clone()
    mp = MixedPrecision(model, torch.optim.AdamW(adapter.parameters(), lr=1e-2), policy="bf16-mixed", device="cpu")
    assert adapter.weight.dtype == torch.float32 and torch.equal(adapter.weight, values)   # exact upcast
    assert base.weight.dtype == torch.bfloat16
    assert "2 trainable 16-bit param(s) stored in fp32" in mp.decision and "1.weight" in mp.decision
    with mp.autocast():
        mp.backward(mp.model(torch.randn(2, 8)).float().sum())
    assert mp.step().applied and adapter.weight.dtype == torch.float32


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure"])
def test_a_distribution_in_the_output_is_rebuilt_in_fp32_not_clamped_at_bf16_eps(policy):
    """Categorical(probs=bf16) clamps its logits at log(eps_bf16) = -4.84; the output cast rebuilds it from
    fp32 probs. Tolerance: the bf16 roundings of x, W and the logits (3 x 2**-8 relative, times 4 for the
    logit scale), doubled through log_softmax."""
    import copy

    class PolicyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 50)

        def forward(self, x):
            return torch.distributions.Categorical(probs=torch.softmax(self.head(x) * 4, -1))

    torch.manual_seed(0)
    ref, x = PolicyNet(), torch.randn(3, 4)
    model = copy.deepcopy(ref)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    with mp.autocast():
        dist = mp.model(mp.cast_inputs(x))
    actions = torch.arange(50)[:, None].expand(50, 3)
    got, want = dist.log_prob(actions).detach(), ref(x).log_prob(actions).detach()
    assert dist.probs.dtype == torch.float32 and float(got.min()) < -4.84 - 5   # no clamp at bf16's eps
    logit_mag = float((ref.head.weight.abs() @ x.abs().T + ref.head.bias.abs()[:, None]).max().detach()) * 4
    assert float((got - want).abs().max()) <= 2 * 3 * 2.0 ** -8 * logit_mag


@pytest.mark.parametrize("policy, words", [
    ("bf16-lean", "bf16-lean on cpu as asked (params bf16, compute bf16, no fp32 masters: updates stochastically "
                  "rounded into bf16, optimizer state int8)"),
    ("bf16-pure", "bf16-pure on cpu as asked (params bf16, compute bf16, fp32 masters rounded to nearest into bf16, "
                  "optimizer state fp32)"),
    ("fp16-mixed", "fp16-mixed on cpu as asked (params fp32, compute fp16 (autocast), optimizer state fp32, "
                   "dynamic loss scale)"),
])
def test_the_decision_starts_with_what_the_policy_stores_and_computes_in(policy, words):
    """A user reading mp.decision learns each precision without the policies table: the words match the real
    param dtypes, masters and optimizer state (and the 8-bit state's own rounding is named as the codes')."""
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 4))
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, device="cpu")
    assert mp.decision.startswith(words), mp.decision
    assert {p.dtype for p in model.parameters()} == {mp.policy.param_dtype}
    assert {m.dtype for m in mp.master_parameters()} == {FP32 if mp.policy.has_masters else mp.policy.param_dtype}
    with mp.autocast():
        loss = model(mp.cast_inputs(torch.randn(8, 64))).float().pow(2).mean()
    mp.backward(loss)
    mp.step()
    codes = {v.dtype for s in mp.optimizer.state.values() for k, v in s.items() if k == "exp_avg"}
    assert codes == ({torch.uint8, FP32} if policy == "bf16-lean" else {FP32})
    assert ("codes rounded to nearest" in mp.decision) == (policy == "bf16-lean")
    event = mp.set_policy("bf16-sr,state=fp8")
    assert mp.decision.startswith("bf16-sr,state=fp8 on cpu (params bf16, compute bf16, no fp32 masters: updates "
                                  "stochastically rounded into bf16, optimizer state fp8; set_policy at boundary 1")
    assert event["to"] == "bf16-sr,state=fp8"


def test_a_step_results_repr_shows_its_loss_scale_and_grad_norm():
    """The README lists ``.loss_scale`` and ``.grad_norm``; printing a result shows them (a new user missed them)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed")
    with mp.autocast():
        loss = mp.model(torch.randn(8, 4)).float().pow(2).mean()
    mp.backward(loss)
    result = mp.step()
    shown = repr(result)
    assert f"loss_scale={result.loss_scale!r}" in shown and f"grad_norm={result.grad_norm!r}" in shown
    assert shown.startswith("StepResult(applied=True, skipped_reason=None, step=1,") and "_t=" not in shown


def test_the_global_norm_sums_in_model_order_whatever_the_param_groups_order():
    """Two param groups in the reverse of the model's order (as the HF Trainer's decay / no-decay groups): the
    engine summed the norm in group order, one fp32 ulp off clip_grad_norm_(model.parameters()), and so clipped
    to other weights. In fp32 it now equals torch's norm and clip bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    ref = copy.deepcopy(model)
    x = torch.randn(32, 64)

    def groups(m):
        params = list(m.parameters())
        return [{"params": params[3:]}, {"params": params[:3], "weight_decay": 0.0}]   # reversed, uneven

    mp = MixedPrecision(model, torch.optim.AdamW(groups(model), lr=1e-2), policy="fp32", device="cpu",
                        max_grad_norm=0.5)
    opt = torch.optim.AdamW(groups(ref), lr=1e-2)
    for _ in range(3):
        mp.backward(mp.model(x).pow(2).mean())
        norm = mp.step().grad_norm_t
        ref(x).pow(2).mean().backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        assert torch.equal(norm, torch_norm)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
