"""replace_modules: every swap (block-scaled, fp8, and back) carries the replaced module's hooks over, and their
handles still remove them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.blockscale import BlockScaledLinear, convert_to_block_scaled, revert_block_scaled
from mixprec.blockscale.swap import HOOK_DICTS, carry_hooks, replace_modules
from mixprec.fp8 import Float8Linear, convert_to_float8, revert_float8


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def _hook_everything(linear: nn.Module, seen: dict) -> list:
    """Register one hook of each kind on ``linear``; each records what it saw in ``seen``. Returns the handles."""
    def put(key, value):
        seen.setdefault(key, []).append(value)
    return [
        linear.register_forward_pre_hook(lambda m, args: put("pre", args[0].clone())),
        linear.register_forward_pre_hook(lambda m, args, kwargs: put("pre_kw", type(m)), with_kwargs=True),
        linear.register_forward_hook(lambda m, args, out: put("fwd", out.detach().clone())),
        linear.register_forward_hook(lambda m, args, kwargs, out: put("fwd_kw", type(m)), with_kwargs=True),
        linear.register_forward_hook(lambda m, args, out: put("always", type(m)), always_call=True),
        linear.register_full_backward_pre_hook(lambda m, gout: put("bwd_pre", gout[0].clone())),
        linear.register_full_backward_hook(lambda m, gin, gout: put("bwd", gin[0].clone())),
        linear.register_state_dict_post_hook(lambda m, sd, prefix, local: put("sd", prefix)),
    ]


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the input's gradient of ``sum(model(x)**2)``, in fp32."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad


SWAPS = {
    "block": lambda m: convert_to_block_scaled(m, "mxfp8"),
    "fp8": lambda m: convert_to_float8(m, "tensorwise"),
}


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_every_hook_kind_fires_after_the_swap_with_the_new_modules_values(swap):
    model, seen = _net(), {}
    handles = _hook_everything(model[2], seen)
    SWAPS[swap](model)
    new_type = BlockScaledLinear if swap == "block" else Float8Linear
    assert type(model[2]) is new_type   # (the first and last linears stay: keep_first_last)
    x = torch.randn(4, 32)
    h0 = model[1](model[0](x)).detach()        # what linear 2 sees
    y, _ = _run(model, x)
    assert set(seen) == {"pre", "pre_kw", "fwd", "fwd_kw", "always", "bwd_pre", "bwd"}
    assert all(len(v) == 1 for v in seen.values())
    assert torch.equal(seen["pre"][0], h0)
    assert seen["fwd_kw"] == seen["pre_kw"] == seen["always"] == [new_type]
    assert torch.equal(seen["fwd"][0], model[2](h0).detach())   # the swapped module's own output, bit for bit
    assert seen["bwd_pre"][0].shape == (4, 64) and seen["bwd"][0].shape == (4, 64)
    model.state_dict()
    assert seen["sd"] == ["2."]
    for handle in handles:
        handle.remove()
    seen.clear()
    _run(model, x)
    model.state_dict()
    assert seen == {}, "a handle from before the swap no longer removed its hook"


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_hooks_survive_the_swap_back_and_the_handles_still_remove_them(swap):
    model, seen = _net(), {}
    handles = _hook_everything(model[2], seen)
    SWAPS[swap](model)
    found = revert_block_scaled(model) if swap == "block" else revert_float8(model)
    assert list(found) == ["2"] and type(model[2]) is nn.Linear
    plain = _net()
    x = torch.randn(4, 32)
    y, gx = _run(model, x)
    y_ref, gx_ref = _run(plain, x)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)      # the same Parameters, a plain fp32 linear again
    assert torch.equal(seen["fwd"][0], plain[2](plain[1](plain[0](x))).detach())
    assert len(seen["bwd"]) == 1 and len(seen["always"]) == 1
    handles[2].remove()    # the forward hook
    seen.clear()
    _run(model, x)
    assert "fwd" not in seen and len(seen["pre"]) == 1


def test_a_replacement_holding_hooks_of_its_own_is_refused_before_any_swap():
    model = _net()
    old = model[2]
    new = BlockScaledLinear.from_linear(old, recipe="mxfp8")
    new.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="already holds hooks"):
        replace_modules(model, {old: new})
    assert model[2] is old


def test_carry_hooks_shares_the_dicts_themselves():
    old, new = nn.Linear(16, 16), nn.Linear(16, 16)
    old.register_forward_hook(lambda *a: None)
    old.register_full_backward_hook(lambda *a: None)
    carry_hooks(old, new)
    for attr in HOOK_DICTS:
        if hasattr(old, attr):
            assert getattr(new, attr) is getattr(old, attr), attr
    assert new._is_full_backward_hook is True


def test_a_shared_module_is_swapped_under_every_parent_with_its_hooks():
    shared = nn.Linear(64, 64)
    model = nn.Sequential(nn.Linear(32, 64), shared, nn.GELU(), shared, nn.Linear(64, 8))
    calls = []
    shared.register_forward_hook(lambda m, a, out: calls.append(type(m)))
    convert_to_block_scaled(model, "mxfp8")
    assert model[1] is model[3] and type(model[1]) is BlockScaledLinear
    model(torch.randn(2, 32))
    assert calls == [BlockScaledLinear, BlockScaledLinear]
