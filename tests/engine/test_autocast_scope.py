"""The engine's autocast scope (mixprec.engine.autocast_scope): casts that follow the weights inside one block.

torch.autocast caches the 16-bit cast of each fp32 leaf that requires grad until its outermost block exits, so a
parameter written in place inside an open ``mp.autocast()`` block (``model.load_state_dict``, ``p.copy_`` under
``no_grad``) used to keep its old cast: the next forward was the old weights' output bit for bit. References are
a fresh engine built on a model that holds the new weights from the start: the same casts of the same values,
so the outputs must be equal bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision

POLICIES = ["bf16-mixed", "fp16-mixed", "bf16-pure"]


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _engine(model: nn.Module, policy: str, optimizer: bool = True) -> MixedPrecision:
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    return MixedPrecision(model, opt, policy, device="cpu", loss_scale=256.0 if policy.startswith("fp16") else None)


def _x() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(3))


def _fresh_output(new: nn.Module, policy: str, x: torch.Tensor) -> torch.Tensor:
    fresh = _engine(copy.deepcopy(new), policy, optimizer=False)
    with fresh.autocast():
        return fresh.model(fresh.cast_inputs(x))


def _write(model: nn.Module, new: nn.Module, how: str) -> None:
    if how == "load_state_dict":
        model.load_state_dict(new.state_dict())
    else:
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters()):
                p.copy_(q)


@pytest.mark.parametrize("how", ["load_state_dict", "copy_"])
@pytest.mark.parametrize("policy", POLICIES)
def test_weights_written_inside_an_open_block_are_used_by_the_next_forward(policy, how):
    model, new = _net(0), _net(1)
    mp = _engine(model, policy)
    x = mp.cast_inputs(_x())
    with mp.autocast():
        y_old = mp.model(x)
        _write(model, new, how)
        y_new = mp.model(x)
    y_ref = _fresh_output(new, policy, _x())
    assert not torch.equal(y_old, y_ref)   # the write changes the output
    assert y_new.dtype == y_ref.dtype and torch.equal(y_new, y_ref)
    if policy.endswith("-mixed"):   # fp32 params: their cached casts were dropped, and that is recorded once
        assert [e.kind for e in mp.events].count("autocast-cache") == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_write_inside_the_block_then_training_equals_an_engine_built_on_the_new_weights(policy):
    """The forward after the write, its backward and step, and the next forward: as an engine built on the new
    weights (under -pure the masters adopt the written 16-bit values at the boundary, with a warning, so the
    reference starts from those values too)."""
    model, new = _net(0), _net(1)
    mp = _engine(model, policy)
    x = mp.cast_inputs(_x())
    with mp.autocast():
        mp.model(x)
        _write(model, new, "load_state_dict")
        loss = mp.model(x).float().square().mean()
    ref_model = copy.deepcopy(model)   # the written values as the params hold them (16-bit under -pure)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.data = p.data.float()
    ref = _engine(ref_model, policy)
    with ref.autocast():
        ref_loss = ref.model(ref.cast_inputs(_x())).float().square().mean()
    assert torch.equal(loss, ref_loss)
    if policy.endswith("-pure"):
        with pytest.warns(UserWarning, match="written outside the engine|adopt"):
            mp.backward(loss)
            assert mp.step().applied
    else:
        mp.backward(loss)
        assert mp.step().applied
    ref.backward(ref_loss)
    assert ref.step().applied
    with mp.autocast(), ref.autocast():
        assert torch.equal(mp.model(x), ref.model(x))


def test_no_write_keeps_the_cache_and_records_nothing():
    """Forwards with no write in between reuse torch's cached casts (same tensor objects) and record no event;
    the engine's own step between two blocks is not a user write either."""
    model = _net(0)
    mp = _engine(model, "bf16-mixed")
    x = _x()
    for _ in range(2):
        with mp.autocast():
            y1 = mp.model(x)
            y2 = mp.model(x)
            loss = (y1.float() + y2.float()).square().mean()
        assert torch.equal(y1, y2)
        mp.backward(loss)
        assert mp.step().applied
    assert "autocast-cache" not in [e.kind for e in mp.events]


def test_a_data_write_is_not_seen_and_the_documented_fix_works():
    """``p.data.copy_`` bumps no version counter (the limit docs/engine.md states); torch.clear_autocast_cache()
    or a write under no_grad fixes it."""
    model, new = _net(0), _net(1)
    mp = _engine(model, "bf16-mixed")
    x = _x()
    with mp.autocast():
        y_old = mp.model(x)
        for p, q in zip(model.parameters(), new.parameters()):
            p.data.copy_(q.data)
        assert torch.equal(mp.model(x), y_old)   # stale: nothing the engine can see changed
        torch.clear_autocast_cache()
        assert torch.equal(mp.model(x), _fresh_output(new, "bf16-mixed", x))
