"""The engine's linear swaps: unwrap gives the plain model back, linears found already swapped are never silent,
hooks survive every swap, a block policy that converts nothing says so."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.blockscale import BlockScaledLinear, convert_to_block_scaled
from mixprec.fp8 import Float8Linear


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _engine(model: nn.Module, policy: str) -> tuple[mixprec.MixedPrecision, list[str]]:
    """An engine on ``model`` and the texts of the warnings mixprec raised building it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy=policy)
    return mp, [str(w.message) for w in caught]


def _train_step(mp: mixprec.MixedPrecision, x: torch.Tensor) -> None:
    with mp.autocast():
        loss = mp.model(x).float().pow(2).mean()
    mp.backward(loss)
    mp.step()


SWAPPING = {"nvfp4-mixed,block=nvfp4-plain": BlockScaledLinear, "mxfp8-mixed": BlockScaledLinear,
            "fp8-mixed": Float8Linear}


@pytest.mark.parametrize("policy", sorted(SWAPPING))
@pytest.mark.parametrize("to_fp32", [True, False])
def test_unwrap_gives_back_plain_linears_whose_state_dict_loads_strictly(policy, to_fp32):
    model = _net()
    mp, _ = _engine(model, policy)
    assert type(mp.model[2]) is SWAPPING[policy]
    _train_step(mp, torch.randn(8, 32))
    weight = model[2].weight
    out = mp.unwrap(to_fp32=to_fp32)
    assert [type(m) for m in out if not isinstance(m, nn.GELU)] == [nn.Linear] * 4
    assert out[2].weight is weight                      # the same Parameter objects
    plain = _net()
    plain.load_state_dict(out.state_dict())            # strict: no _extra_state, signs or scaling buffers left
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert torch.equal(out(x), plain(x))           # a plain fp32 forward, bit for bit


def test_a_model_given_back_by_unwrap_trains_under_bf16_mixed_as_a_fresh_one():
    model = _net()
    mp, _ = _engine(model, "nvfp4-mixed,block=nvfp4-plain")
    model = mp.unwrap()
    fresh = _net()
    fresh.load_state_dict(model.state_dict())
    mp2, said = _engine(model, "bf16-mixed")
    mp3, _ = _engine(fresh, "bf16-mixed")
    assert not any("swapped in" in s for s in said) and "run as built" not in mp2.decision
    x = torch.randn(64, 32)
    with torch.no_grad(), mp2.autocast():
        a = mp2.model(x)
    with torch.no_grad(), mp3.autocast():
        b = mp3.model(x)
    assert torch.equal(a, b)


def _leftovers() -> nn.Sequential:
    """A model an nvfp4 engine swapped and that was dropped without unwrap()."""
    model = _net()
    mp, _ = _engine(model, "nvfp4-mixed,block=nvfp4-plain")
    del mp
    gc.collect()
    return model


def test_another_engines_leftovers_warn_and_are_named_under_a_policy_that_swaps_nothing():
    model = _leftovers()
    mp, said = _engine(model, "bf16-mixed")
    warned = [s for s in said if "another MixedPrecision swapped in" in s]
    assert len(warned) == 1 and "old_mp.unwrap()" in warned[0] and "revert_block_scaled(model)" in warned[0]
    assert "2 linear(s) already fp8 or block-scaled, run as built: 2 (block-scaled (recipe nvfp4-plain), left by " \
           "an engine under nvfp4-mixed,block=nvfp4-plain that was not unwrapped)" in mp.decision
    mp.unwrap()      # its unwrap reverts them too: they were an engine's
    assert [type(model[i]) for i in (2, 4)] == [nn.Linear, nn.Linear]


@pytest.mark.parametrize("policy", ["mxfp8-mixed,block_keep=2", "nvfp4-mixed", "fp8-mixed"])
def test_another_engines_leftovers_are_refused_under_a_policy_that_swaps_linears(policy):
    model = _leftovers()
    with pytest.raises(ValueError, match=r"another MixedPrecision swapped in: 2 .*old_mp\.unwrap\(\)"):
        _engine(model, policy)
    assert [type(model[i]).__name__ for i in (0, 2, 4, 6)] == ["Linear", "BlockScaledLinear", "BlockScaledLinear",
                                                                "Linear"]
    assert all(p.dtype == torch.float32 for p in model.parameters())   # refused before anything changed


def test_linears_the_caller_built_run_as_built_and_stay_after_unwrap_and_set_policy():
    model = _net()
    convert_to_block_scaled(model, "nvfp4", module_filter=lambda m, name: name == "2")
    mine = model[2]
    mp, said = _engine(model, "mxfp8-mixed")
    assert not any("swapped in" in s for s in said)
    assert mp.model[2] is mine and type(mp.model[4]) is BlockScaledLinear and mp.model[4].recipe.name == "mxfp8"
    report = mp.block_report
    assert report.converted == ("4",)
    assert dict(report.as_built) == {"2": "already block-scaled (recipe nvfp4), left as built"}
    assert "2" not in dict(report.kept)          # never "kept in bf16"
    assert "2 (block-scaled (recipe nvfp4), built by the caller)" in mp.decision
    assert "1 converted, 2 kept in bf16 (" in mp.decision and "1 left as built (2)" in mp.decision
    mp.set_policy("bf16-mixed")
    assert mp.model[2] is mine and type(mp.model[4]) is nn.Linear
    mp.set_policy("mxfp8-mixed")
    assert mp.model[2] is mine and type(mp.model[4]) is BlockScaledLinear
    out = mp.unwrap()
    assert out[2] is mine and type(out[4]) is nn.Linear


@pytest.mark.parametrize("policy, fmt", [("nvfp4-mixed,block_keep=*", "nvfp4"), ("mxfp8-mixed,block_keep=*", "mxfp8")])
def test_a_block_policy_that_converts_nothing_warns_and_says_so(policy, fmt):
    mp, said = _engine(_net(), policy)
    note = f"{policy} converted 0 linears to block-scaled {fmt} ("
    warned = [s for s in said if note in s]
    assert len(warned) == 1 and warned[0].endswith("; the run is bf16-mixed")
    assert "kept by block_keep pattern '*'" in warned[0]
    assert note in mp.decision and mp.block_report.converted == ()


def test_hooks_on_a_linear_fire_after_the_build_and_after_set_policy_swaps():
    model = _net()
    calls = {"fwd": 0, "pre": 0, "bwd": 0}
    handles = [model[2].register_forward_hook(lambda *a: calls.__setitem__("fwd", calls["fwd"] + 1)),
               model[2].register_forward_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1)),
               model[2].register_full_backward_hook(lambda *a: calls.__setitem__("bwd", calls["bwd"] + 1))]
    mp, _ = _engine(model, "nvfp4-mixed")
    x = torch.randn(8, 32)
    for policy, kind in [("nvfp4-mixed", BlockScaledLinear), ("bf16-mixed", nn.Linear),
                         ("mxfp8-mixed", BlockScaledLinear)]:
        if policy != "nvfp4-mixed":
            mp.set_policy(policy)
        assert type(mp.model[2]) is kind
        before = dict(calls)
        _train_step(mp, x)
        assert {k: calls[k] - before[k] for k in calls} == {"fwd": 1, "pre": 1, "bwd": 1}, policy
    for handle in handles:
        handle.remove()
    _train_step(mp, x)
    assert calls == {"fwd": 3, "pre": 3, "bwd": 3}


def test_a_float64_model_is_pointed_at_a_policy_that_exists():
    model = nn.Linear(4, 4).double()
    with pytest.raises(ValueError) as err:
        _engine(model, "nvfp4-mixed")
    assert "no policy stores float64 (policy 'fp32'" in str(err.value) and "fp32-pure" not in str(err.value)
    model.float()
    mp, _ = _engine(model, "fp32")        # the hint works as said
    assert mp.model.weight.dtype == torch.float32


def test_an_fp8_policy_that_converts_nothing_warns_with_each_reason_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 4))
    mp, said = _engine(model, "fp8-mixed")
    warned = [s for s in said if "converted 0 linears" in s]
    assert warned == ["mixprec: fp8-mixed converted 0 linears to fp8 (tensorwise) (first Linear of the network; "
                      "in_features=24, out_features=24 not a multiple of 16; in_features=24, out_features=4 not a "
                      "multiple of 16; in_features=8, out_features=24 not a multiple of 16; last Linear of the "
                      "network); the run is bf16-mixed"]   # the reasons in sorted order, each once
    assert warned[0][len("mixprec: "):] in mp.decision
