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
