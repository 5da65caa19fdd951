import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import DivergenceError

from mixprec import MixedPrecision
from mixprec.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, from_spec
from engine_loops import _linear, _one_step

INF, NAN = float("inf"), float("nan")
FUSED = "_amp_foreach_non_finite_check_and_unscale_"


def _bad(kind: str) -> torch.Tensor:
    return torch.full((3,), NAN if kind == "nan" else INF)


def _run(ls, found_infs):
    for f in found_infs:
        ls.update(torch.tensor(float(f)))


def _torch_scaler(found_infs, **kwargs):
    """Feed grads through GradScaler's public API; returns [(scale, growth_tracker)] per step."""
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.0)
    history = []
    for f in found_infs:
        scaler.scale(torch.ones(()))
        param.grad = _bad("inf") if f else torch.ones(3)
        scaler.step(opt)
        scaler.update()
        sd = scaler.state_dict()
        history.append((sd["scale"], sd["_growth_tracker"]))
    return history


# ---------------------------------------------------------------- interface
@pytest.mark.parametrize("ls, dynamic, enabled, scale", [
    (NoLossScale(), False, False, 1.0),
    (StaticLossScale(128.0), False, True, 128.0),
    (DynamicLossScale(), True, True, 2.0**16),
])
def test_interface(ls, dynamic, enabled, scale):
    assert (ls.dynamic, ls.enabled) == (dynamic, enabled)
    assert ls.scale.dtype == torch.float32 and ls.scale.shape == () and ls.scale.item() == scale
    assert ls.to("cpu") is ls
    loss = torch.tensor(3.0)
    assert torch.equal(ls.scale_loss(loss), loss * scale)
    assert ls.at_floor().dtype == torch.bool


@pytest.mark.parametrize("cls", [NoLossScale, lambda: StaticLossScale(8.0), DynamicLossScale])
def test_to_moves_every_state_tensor(cls):
    ls = cls().to("meta")
    found_inf = ls.unscale_([torch.ones(2, device="meta")])
    ls.update(found_inf)
    assert found_inf.device.type == "meta" and ls.at_floor().device.type == "meta"
    assert all(getattr(ls.state, f.name).device.type == "meta" for f in dataclasses.fields(ls.state))


def test_no_loss_scale_returns_loss_object_and_still_checks_finiteness():
    ls = NoLossScale()
    loss = torch.tensor(3.0)
    assert ls.scale_loss(loss) is loss
    grads = [torch.tensor([1.5, -2.0]), torch.tensor([NAN])]
    assert ls.unscale_(grads).item() == 1.0
    assert torch.equal(grads[0], torch.tensor([1.5, -2.0]))
    ls.update(torch.tensor(1.0))
    ls.update(torch.tensor(1.0))
    assert ls.consecutive_skips.item() == 2 and ls.at_floor().item()
    ls.update(torch.tensor(0.0))
    assert ls.state.consecutive_skips.item() == 0


# ---------------------------------------------------------------- unscale
@pytest.mark.parametrize("fused", [True, False])
def test_unscale_exact_and_found_inf_over_mixed_dtypes(fused, monkeypatch):
    if not fused:
        monkeypatch.delattr(torch, FUSED)
    ls = StaticLossScale(2.0**10)
    want = [torch.tensor([0.1, -3.0, 1e-20]), torch.tensor([0.5, 7.0], dtype=torch.bfloat16)]
    grads = [w * 2.0**10 for w in want] + [None]
    found_inf = ls.unscale_(grads)
    assert found_inf.dtype == torch.float32 and found_inf.shape == () and found_inf.item() == 0.0
    for g, w in zip(grads, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    grads = [torch.ones(2), torch.tensor([1.0, INF], dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)]
    assert ls.unscale_(grads).item() == 1.0


def test_unscale_flags_overflow_caused_by_a_scale_below_one():
    grads = [torch.tensor([60000.0], dtype=torch.float16)]  # * 16 overflows fp16
    assert StaticLossScale(2.0**-4).unscale_(grads).item() == 1.0


# ---------------------------------------------------------------- dynamic rule
def test_200_nan_steps_stop_at_the_floor_unlike_grad_scaler():
    ls = DynamicLossScale()
    for _ in range(200):
        ls.update(ls.unscale_([_bad("nan")]))
    assert ls.scale.item() == 1.0 and ls.at_floor().item()
    assert ls.consecutive_skips is ls.state.consecutive_skips and ls.floor_skips is ls.state.floor_skips
    assert ls.consecutive_skips.item() == 200
    assert ls.floor_skips.item() == 200 - 16  # 2**16 reaches 1 after 16 backoffs
    # Contrast: torch's GradScaler underflows to 0.0 (denormal, then zero) on CPU.
    assert _torch_scaler([1] * 200)[-1][0] == 0.0


def test_parity_with_grad_scaler():
    seq = [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    ls = DynamicLossScale(growth_interval=3)
    for f, (scale, tracker) in zip(seq, _torch_scaler(seq, growth_interval=3)):
        ls.update(torch.tensor(float(f)))
        assert ls.scale.item() == scale and ls.state.growth_tracker.item() == tracker


def test_hysteresis_two():
    ls = DynamicLossScale(hysteresis=2)
    _run(ls, [1])
    assert ls.scale.item() == 2.0**16 and ls.state.consecutive_skips.item() == 1
    _run(ls, [0, 1])  # the clean step resets the hysteresis counter
    assert ls.scale.item() == 2.0**16
    _run(ls, [1])
    assert ls.scale.item() == 2.0**15 and ls.state.consecutive_skips.item() == 2
    _run(ls, [1])  # counter was reset by the backoff
    assert ls.scale.item() == 2.0**15
    assert ls.state.growth_tracker.item() == 0


def test_ceiling_and_floor():
    ls = DynamicLossScale(init_scale=2.0**3, growth_interval=1, max_scale=2.0**5)
    _run(ls, [0] * 10)
    assert ls.scale.item() == 2.0**5 and ls.state.growth_tracker.item() == 0
    ls = DynamicLossScale(init_scale=1.0, min_scale=2.0**-4)
    _run(ls, [1] * 4)
    assert ls.scale.item() == 2.0**-4 and ls.at_floor().item() and ls.state.floor_skips.item() == 0
    _run(ls, [1] * 3)
    assert ls.scale.item() == 2.0**-4 and ls.state.floor_skips.item() == 3
    _run(ls, [0])
    assert ls.state.floor_skips.item() == 0 and ls.state.consecutive_skips.item() == 0


# ---------------------------------------------------------------- precision and syncs
def test_no_float64_and_no_host_sync(monkeypatch):
    seen, inv_dtypes = [], []
    fused = getattr(torch, FUSED)

    def spy(grads, found_inf, inv_scale):
        inv_dtypes.append(inv_scale.dtype)
        return fused(grads, found_inf, inv_scale)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
            seen.append((func, {t.dtype for t in flat if isinstance(t, torch.Tensor)}))
            return out

    monkeypatch.setattr(torch, FUSED, spy)
    for ls in (NoLossScale(), StaticLossScale(2.0**-3), DynamicLossScale(min_scale=2.0**-4, hysteresis=2)):
        with Record():
            ls.scale_loss(torch.ones(()))
            for f in (1, 1, 0, 1):
                grads = [torch.full((2,), INF if f else 1.0), torch.ones(2, dtype=torch.bfloat16)]
                ls.update(ls.unscale_(grads))
            ls.at_floor()
            ls.load_state_dict(ls.state_dict())
        assert {getattr(ls.state, f.name).dtype for f in dataclasses.fields(ls.state)} <= {torch.float32, torch.int32}
    assert inv_dtypes and set(inv_dtypes) == {torch.float32}
    assert not [f for f, dtypes in seen if torch.float64 in dtypes]
    assert not [f for f, _ in seen if "_local_scalar_dense" in str(f)]  # .item(): a host sync


# ---------------------------------------------------------------- serialisation
def _non_default(ls):
    """A copy of ``ls`` with every config and state field set away from its default."""
    changes = {"init_scale": 2.0**10, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7,
               "hysteresis": 3, "min_scale": 2.0**-5, "max_scale": 2.0**20, "scale": 3.0}
    config = {f.name: changes[f.name] for f in dataclasses.fields(ls.config)}
    out = type(ls)(**config)
    for i, f in enumerate(dataclasses.fields(out.state)):
        getattr(out.state, f.name).copy_(torch.tensor(i + 5))
    return out


@pytest.mark.parametrize("cls", [NoLossScale, lambda: StaticLossScale(8.0), DynamicLossScale])
def test_state_dict_round_trip_covers_every_field(cls):
    src, dst = _non_default(cls()), cls()
    sd = src.state_dict()
    assert set(sd["config"]) == {f.name for f in dataclasses.fields(src.config)}
    assert set(sd["state"]) == {f.name for f in dataclasses.fields(src.state)}
    for f in dataclasses.fields(src.state):
        assert not torch.equal(getattr(src.state, f.name), getattr(dst.state, f.name)), f.name
    before = {k: v.clone() for k, v in sd["state"].items()}
    dst.load_state_dict(sd)
    assert dst.config == src.config
    for f in dataclasses.fields(src.state):
        a, b = getattr(src.state, f.name), getattr(dst.state, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f.name
    dst.update(torch.tensor(1.0))  # no aliasing: the loaded object does not write into sd
    assert all(torch.equal(sd["state"][k], v) for k, v in before.items())


def test_load_state_dict_rejects_other_class_and_bad_keys():
    dyn = DynamicLossScale()
    with pytest.raises(ValueError, match="'StaticLossScale' state dict into DynamicLossScale"):
        dyn.load_state_dict(StaticLossScale(2.0).state_dict())
    sd = dyn.state_dict()
    del sd["state"]["floor_skips"]
    with pytest.raises(ValueError, match=r"missing \['floor_skips'\]"):
        DynamicLossScale().load_state_dict(sd)
    sd = dyn.state_dict()
    sd["state"]["scale"] = torch.tensor(2.0, dtype=torch.float64)
    target = DynamicLossScale(init_scale=4.0)
    with pytest.raises(ValueError, match="0-dim torch.float32 tensor"):
        target.load_state_dict(sd)
    assert target.scale.item() == 4.0 and target.config.init_scale == 4.0  # nothing changed


# ---------------------------------------------------------------- validation and from_spec
@pytest.mark.parametrize("kwargs, match", [
    ({"min_scale": 0.0}, "min_scale=0.0 is not allowed.*normal fp32"),
    ({"min_scale": 1e-40}, "min_scale=1e-40"),
    ({"max_scale": 1e39}, "max_scale=1e\\+39"),
    ({"init_scale": 0.5}, r"init_scale=0.5.*\[min_scale, max_scale\]"),
    ({"init_scale": 2.0**30}, "init_scale"),
    ({"growth_factor": 1.0}, "growth_factor=1.0.*> 1"),
    ({"backoff_factor": 1.0}, r"backoff_factor=1.0.*\(0, 1\)"),
    ({"growth_interval": 0}, "growth_interval=0.*int >= 1"),
    ({"hysteresis": 1.5}, "hysteresis=1.5"),
    ({"hysteresis": True}, "hysteresis=True"),
])
def test_dynamic_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)


def test_min_scale_below_one_is_allowed():
    assert DynamicLossScale(init_scale=2.0**-3, min_scale=2.0**-4).scale.item() == 2.0**-3


@pytest.mark.parametrize("scale", [0.0, -1.0, INF, NAN, 1e-45])
def test_static_validation(scale):
    with pytest.raises(ValueError, match="StaticLossScale scale="):
        StaticLossScale(scale)


def test_from_spec():
    assert isinstance(from_spec("none"), NoLossScale)
    assert from_spec(128.0).scale.item() == 128.0 and isinstance(from_spec(128), StaticLossScale)
    dyn = from_spec("dynamic", growth_interval=5)
    assert isinstance(dyn, DynamicLossScale) and dyn.config.growth_interval == 5
    with pytest.raises(ValueError, match="apply only to spec='dynamic'"):
        from_spec(8.0, growth_interval=5)
    with pytest.raises(ValueError, match="spec='static'"):
        from_spec("static")


# ================================================================ scales below one, through the engine (cases 1 and 2)


def test_case01_a_floor_below_one_is_kept_when_gradients_overflow():
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        max_stuck_skips=4, loss_scale=DynamicLossScale(init_scale=1.0, min_scale=2.0 ** -3))
    with pytest.raises(DivergenceError, match=r"at its floor 0\.125"):
        for _ in range(50):   # gradients overflow (finite loss): the scale backs off below 1, to its floor
            _one_step(mp, torch.randn(2, 4), lambda out: 1e6 * out.float().sum())   # 1e6 * 0.125 > 65504
    assert float(mp.loss_scale.scale) == 0.125


# ---------------------------------------------------------------- case 2: stuck at the floor
def test_case02_min_scale_below_one_lets_an_overflowing_step_apply_like_fp32():
    x = torch.randn(2, 4)

    def run(policy, loss_scale=None):
        model = _linear(4, 3)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-9), policy=policy, device="cpu",
                            loss_scale=loss_scale, max_stuck_skips=5)
        results = [_one_step(mp, x, lambda out: 1e5 * out.float().sum()) for _ in range(8)]
        return model, mp, results

    model, mp, results = run("fp16-mixed", DynamicLossScale(init_scale=4.0, min_scale=2.0 ** -4))
    applied = [r.applied for r in results]
    assert applied[0] is False and any(applied)               # overflow at 4, applies once the scale is < 1
    first = applied.index(True)
    assert [r.skipped_reason for r in results[:first]] == ["overflow"] * first
    assert results[first].loss_scale < 1.0 and results[-1].skipped_total == first
    assert mp.applied_steps == 8 - first and int(mp.loss_scale.floor_skips) == 0
    # the applied updates are fp32's, to fp16's rounding of the output gradient
    ref_model = _linear(4, 3)
    opt = torch.optim.SGD(ref_model.parameters(), lr=1e-9)
    for _ in range(8 - first):
        opt.zero_grad()
        (1e5 * ref_model(x).sum()).backward()
        opt.step()
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_the_foreach_unscale_is_torchs_fused_one_bit_for_bit(dtype, poison):
    """torch's CUDA _amp_foreach_non_finite_check_and_unscale_ has no bf16 kernel: under bf16-kahan/-sr/-lean on an
    H200 every step raised NotImplementedError (the first CUDA bench). There the engine runs the foreach path; on
    this CPU both run, and they must agree bit for bit: values times 1/scale rounded once, the flag from the values
    before the multiply."""
    from mixprec.engine.loss_scale import _check_and_unscale_

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(37, generator=gen).to(dtype) * 3, torch.randn(5, 7, generator=gen).to(dtype)]
    if poison is not None:
        grads[1][2, 3] = poison
    inv_scale = torch.tensor(1.0 / 3.0)   # not a power of two: the product rounds
    out = {}
    for fused in (True, False):
        copies, found = [g.clone() for g in grads], torch.zeros(())
        _check_and_unscale_(copies, found, inv_scale, use_fused=fused)
        out[fused] = (copies, found)
    assert out[True][1].item() == out[False][1].item() == (0.0 if poison is None else 1.0)
    assert all(torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(out[True][0], out[False][0]))
