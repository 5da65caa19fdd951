"""One live engine per model: a second MixedPrecision on a prepared model is refused at build, before it changes
anything, naming set_policy / unwrap; after unwrap() the model takes a new engine, which trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _train_step(mp: mixprec.MixedPrecision) -> bool:
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(torch.randn(4, 8))).float().pow(2).mean()
    mp.backward(loss)
    return mp.step().applied


@pytest.mark.parametrize("first,second", [("bf16-mixed", "bf16-pure"), ("bf16-pure", "bf16-mixed"),
                                          ("bf16-mixed", "bf16-mixed")])
def test_a_second_engine_on_a_prepared_model_is_refused_before_it_changes_anything(first, second):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mp = mixprec.MixedPrecision(model, opt, first)
    hooks = (len(model._forward_hooks), len(model._forward_pre_hooks))
    dtypes = [p.dtype for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"this model is already prepared by a live MixedPrecision engine \(policy "
                                         rf"{first}\).*mp.set_policy\(...\).*mp.unwrap\(\)"):
        mixprec.MixedPrecision(model, opt, second)
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == hooks
    assert [p.dtype for p in model.parameters()] == dtypes
    assert _train_step(mp)   # the first engine trains on, untouched


def test_after_unwrap_the_model_takes_a_new_engine_which_trains():
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-pure")
    assert _train_step(mp)
    mp.unwrap(to_fp32=True)
    again = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-mixed")
    assert _train_step(again) and all(p.dtype == torch.float32 for p in model.parameters())


def test_a_module_inside_or_around_a_prepared_one_is_refused_too():
    inner = _model()
    mp = mixprec.MixedPrecision(inner, torch.optim.AdamW(inner.parameters()), "bf16-mixed")
    outer = nn.Sequential(inner, nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"a module inside this model \(Sequential\) is already prepared"):
        mixprec.MixedPrecision(outer, torch.optim.AdamW(outer.parameters()), "bf16-mixed")
    with pytest.raises(ValueError, match=r"a model holding this one \(Sequential\) is already prepared"):
        mixprec.MixedPrecision(inner[0], torch.optim.AdamW(inner[0].parameters()), "bf16-mixed")
    assert _train_step(mp)


def test_an_engine_nothing_refers_to_owns_nothing():
    """fp32 runs no hooks that would keep the engine alive: once dropped (and collected), the model is free."""
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    del mp
    again = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")
    assert _train_step(again)


class _BrokenFeature:
    """A developer's own feature (``MixedPrecision.feature_types``) whose construction fails: the last step of a
    build, after the casts, masters, hooks and the optimizer's rebinding."""

    def __init__(self, mp):
        raise RuntimeError("feature failed to build")


class _EngineWithBrokenFeature(mixprec.MixedPrecision):
    feature_types = (_BrokenFeature,)


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-mixed", "fp8-mixed"])
def test_a_build_failing_late_leaves_model_and_optimizer_as_they_were(policy):
    """The build undoes itself: the model keeps its fp32 values bit for bit (the masters' exact copies), no hook
    and no swapped linear stays, the optimizer steps the model's params, and a new engine builds and trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="feature failed to build"):
        _EngineWithBrokenFeature(model, opt, policy)
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(params, before))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in params]
    mp = mixprec.MixedPrecision(model, opt, policy)
    with mp.autocast():
        loss = mp.model(torch.randn(4, 32)).float().pow(2).mean()
    mp.backward(loss)
    assert mp.step().applied


def test_a_kahan_build_failing_late_gives_back_the_fp32_values_bit_for_bit():
    """bf16-kahan keeps no masters, but its build holds each param's fp32 value to start the compensation: the
    undo restores from those, exactly (it restored from the bf16 values, silently, before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="feature failed to build") as caught:
        _EngineWithBrokenFeature(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), "bf16-kahan")
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not getattr(caught.value, "__notes__", None)


def test_an_sr_build_failing_late_says_which_params_came_back_from_bf16():
    """bf16-sr holds no fp32 copy (a second one would cost the memory the policy saves): the params come back in
    fp32 from their bf16 rounding, and the re-raised error's note names each one (said, not silent)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="feature failed to build") as caught:
        _EngineWithBrokenFeature(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), "bf16-sr")
    for p, b in zip(model.parameters(), before):
        assert p.dtype == torch.float32 and torch.equal(p, b.bfloat16().float())
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))   # low bits really went
    (note,) = caught.value.__notes__
    assert "4 tensor(s)" in note and all(n in note for n in ("0.weight", "0.bias", "2.weight", "2.bias"))


def test_torch_compile_options_it_refuses_are_refused_before_any_change():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"compile=\{'backend': 'no_such_backend'\}: torch.compile refuses it"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-kahan",
                               compile={"backend": "no_such_backend"})
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_stock_optimizer_a_policy_cannot_run_is_refused_before_any_cast():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"policy bf16-sr writes updates with rounding=.stochastic., which AdamW cannot do"):
        mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-sr")
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_unwrap_gives_the_optimizer_back_the_params():
    """Under -pure the optimizer steps fp32 masters; after unwrap(to_fp32=True) it steps the model again, with
    its state (was: it kept stepping the orphaned masters, a silent no-op on the model)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, opt, "bf16-pure")
    assert _train_step(mp)
    mp.unwrap(to_fp32=True)
    params = list(model.parameters())
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in params]
    assert all(opt.state[p]["step"] == 1 for p in params)
    before = [p.detach().clone() for p in params]
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_two_models_sharing_a_module_under_pure_policies_are_refused_before_the_second_changes_anything():
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    g, d = nn.Sequential(nn.Linear(4, 8), shared), nn.Sequential(shared, nn.Linear(8, 1))
    mp_g = mixprec.MixedPrecision(g, torch.optim.SGD(g.parameters(), lr=0.1), "bf16-pure")
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    head = d[1].weight.detach().clone()
    with pytest.raises(ValueError, match=r"parameter\(s\) \['0.weight', '0.bias'\] are already stored in 16 bits"):
        mixprec.MixedPrecision(d, opt_d, "bf16-pure")
    assert d[1].weight.dtype == torch.float32 and torch.equal(d[1].weight, head)
    assert [id(p) for g_ in opt_d.param_groups for p in g_["params"]] == [id(p) for p in d.parameters()]
    assert mp_g.module is g


def test_hand_over_mid_accumulation_restores_the_masters_values():
    """An earlier run stopped inside an accumulation window (a trainer that raised): the hand-over drops the
    window and still gives the model its fp32 masters' values, not their bf16 roundings."""
    from mixprec.engine.ownership import hand_over

    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-pure", accumulation_steps=2)
    for _ in range(3):   # one applied step, then half a window
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(torch.randn(4, 8))).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    masters = [m.detach().clone() for m in mp.masters.masters]
    with pytest.warns(UserWarning, match="open accumulation window dropped, its fp32 values restored"):
        assert "restored" in hand_over(model, "a trainer")
    assert all(p.dtype == torch.float32 and torch.equal(p, m) for p, m in zip(model.parameters(), masters))
    assert _train_step(mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-mixed"))


def test_an_engine_handed_over_says_who_took_its_model():
    from mixprec.engine.ownership import hand_over

    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-mixed")
    with pytest.warns(UserWarning, match="earlier MixedPrecision engine"):
        hand_over(model, "MixprecPrecision")
    with pytest.raises(RuntimeError, match=r"mp.autocast\(\) on an engine whose model a newer MixprecPrecision took "
                                           r"over .*go on with that one"):
        with mp.autocast():
            pass


def test_hooks_a_dropped_engine_left_are_removed_with_a_warning():
    """An engine dropped without unwrap() leaves its output cast on the model; the next build removes it (said),
    so one cast runs, and keeps the user's own hooks."""
    import gc

    model = _model()
    mine = model.register_forward_hook(lambda m, a, out: None)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-mixed")
    assert sum(type(h).__name__ == "OutputCast" for h in model._forward_hooks.values()) == 1
    del mp
    gc.collect()
    with pytest.warns(UserWarning, match=r"removed [12] hook\(s\) left on this model by an engine that no longer runs it \(one dropped without mp.unwrap\(\)"
                                         r".*; its params are as that engine left them \(float32\)"):
        again = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-mixed")
    casts = [h for h in model._forward_hooks.values() if type(h).__name__ == "OutputCast"]
    assert len(casts) == 1 and mine.id in model._forward_hooks
    assert _train_step(again)


def test_an_engine_on_a_deep_copy_of_a_prepared_model_runs_alone_and_says_the_copys_hooks_went():
    """An EMA or teacher made with copy.deepcopy(mp.module) carries the engine's hooks, inert; an engine built on
    the copy removes them (the warning names copies) and runs its own hooks only: the copy's forward and hook
    count equal those of an engine built on an equal fresh model."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), "bf16-mixed")
    assert _train_step(mp)
    teacher = copy.deepcopy(mp.module)
    fresh = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    fresh.load_state_dict(teacher.state_dict())
    with pytest.warns(UserWarning, match="copy.deepcopy and pickle carry its hooks, inert"):
        on_copy = mixprec.MixedPrecision(teacher, mixprec.optim.AdamW(teacher.parameters(), lr=1e-3), "bf16-mixed")
    on_fresh = mixprec.MixedPrecision(fresh, mixprec.optim.AdamW(fresh.parameters(), lr=1e-3), "bf16-mixed")

    def hooks(m):
        return sum(len(getattr(x, a)) for x in m.modules() for a in ("_forward_hooks", "_forward_pre_hooks"))

    assert hooks(teacher) == hooks(fresh) > 0
    x = torch.randn(4, 8)
    with on_copy.autocast():
        y_copy = on_copy.model(x)
    with on_fresh.autocast():
        y_fresh = on_fresh.model(x)
    assert torch.equal(y_copy, y_fresh)
