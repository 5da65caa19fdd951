"""BlockScaledLinear: every GEMM bit for bit against the independent emulation (block_emulation.py), dtypes under
autocast, shared parameters, the state that makes a resumed run bitwise, torch.compile."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

from block_emulation import emulate
from mixprec.blockscale import BlockRecipe, BlockScaledLinear, get_block_recipe
from mixprec.blockscale.streams import stream_key

NVFP4 = get_block_recipe("nvfp4")
MXFP8 = get_block_recipe("mxfp8")
RECIPES = {
    "mxfp8": MXFP8,
    "nvfp4": NVFP4,
    "nvfp4-plain": get_block_recipe("nvfp4-plain"),
    "nvfp4-1d-rht-sr": dataclasses.replace(NVFP4, weight_blocks="1d"),
    "nvfp4-2d-sr-only": dataclasses.replace(NVFP4, hadamard=False),
    "nvfp4-rht-only": dataclasses.replace(NVFP4, stochastic_rounding=False, weight_blocks="1d"),
    "mxfp8-floor-e5m2-grads": BlockRecipe(format="mxfp8_e4m3", grad_format="mxfp8_e5m2"),
    "mxfp8-2d-rht-sr-seed7": dataclasses.replace(MXFP8, weight_blocks="2d", hadamard=True, stochastic_rounding=True,
                                                 seed=7),
    "mxfp8-wgrad-in-fp32": dataclasses.replace(MXFP8, quantized_gemms=("forward", "dgrad")),
}


_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit patterns (the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _AS_INT[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _run(module: BlockScaledLinear, x: torch.Tensor, dy: torch.Tensor, autocast: bool = False):
    x = x.clone().requires_grad_()
    module.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad


def _inputs(m: int, k: int, n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).exp2().mul(4)).to(dtype)  # uneven tokens
    w = torch.randn(n, k, generator=g) * 0.1
    dy = torch.randn(m, n, generator=g) * 1e-3
    return x, w, dy


def _module(recipe, w: torch.Tensor, index: int = 0) -> BlockScaledLinear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return BlockScaledLinear.from_linear(lin, recipe=recipe, index=index)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("m", [64, 40])  # 40 tokens: wgrad pads M
def test_each_gemm_equals_the_independent_emulation_bit_for_bit(name, m):
    recipe = RECIPES[name]
    n = 48 if recipe.weight_blocks == "1d" else 64  # 48: dgrad pads N for 32-blocks
    x, w, dy = _inputs(m, 64, n, seed=m)
    module = _module(recipe, w, index=3)
    y, dx, dw = _run(module, x, dy)
    generator = torch.Generator().manual_seed(stream_key(recipe.seed + 3, 0))   # its stream's first call
    ey, edx, edw = emulate(recipe, x, w, dy, torch.float32, signs=module.hadamard_signs, generator=generator)
    assert _bits_equal(y, ey), "forward"
    assert _bits_equal(dx, edx), "dgrad"
    assert _bits_equal(dw, edw), "wgrad"


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_under_bf16_autocast_outputs_are_bf16_and_gradients_in_the_inputs_dtypes(name):
    recipe = RECIPES[name]
    x, w, dy = _inputs(32, 64, 64, seed=1)
    module = _module(recipe, w)
    y, dx, dw = _run(module, x, dy.bfloat16(), autocast=True)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    generator = torch.Generator().manual_seed(stream_key(recipe.seed, 0))
    ey, edx, edw = emulate(recipe, x, w, dy.bfloat16(), torch.bfloat16, signs=module.hadamard_signs,
                           generator=generator)
    assert _bits_equal(y, ey) and _bits_equal(dx, edx) and _bits_equal(dw, edw)
    assert torch.equal(dw, dw.bfloat16().float()), "fp32 master weights get a bf16-rounded gradient"


def test_bf16_inputs_give_bf16_outputs_and_the_bias_is_added_in_the_compute_dtype():
    x, w, dy = _inputs(32, 64, 32, seed=2, dtype=torch.bfloat16)
    lin = nn.Linear(64, 32).bfloat16()
    module = BlockScaledLinear.from_linear(lin, recipe="mxfp8")
    y = module(x)
    nobias = _module(MXFP8, lin.weight.detach().float())(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, nobias + lin.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(x.float()).dtype == torch.bfloat16


def test_from_linear_shares_the_parameter_objects():
    lin = nn.Linear(32, 16)
    module = BlockScaledLinear.from_linear(lin, recipe="nvfp4")
    assert module.weight is lin.weight and module.bias is lin.bias
    assert [p for p in module.parameters()] == [lin.weight, lin.bias]
    assert set(module.state_dict()) == {"weight", "bias", "hadamard_signs", "_extra_state"}


def test_dimensions_the_recipe_cannot_scale_are_refused():
    with pytest.raises(ValueError, match="in_features=40 not a multiple of mxfp8_e4m3's block size 32"):
        BlockScaledLinear(40, 32, recipe="mxfp8")
    with pytest.raises(ValueError, match=r"out_features=24 not a multiple of 16 \(16x16 2D weight blocks\)"):
        BlockScaledLinear(32, 24, recipe="nvfp4")
    BlockScaledLinear(32, 24, recipe="mxfp8")  # 1D: dgrad pads N
    with pytest.raises(TypeError, match="float64"):
        BlockScaledLinear(32, 32)(torch.ones(2, 32, dtype=torch.float64))


def _train_steps(module: BlockScaledLinear, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(48, module.in_features, generator=g)
        opt.zero_grad()
        module(x).square().mean().backward()
        opt.step()
        out.append(module.weight.detach().clone())
    return out


def test_a_state_dict_round_trip_resumes_bitwise():
    """Three steps, save (state_dict through torch.save), three more; a fresh module of the same recipe and index
    (its stream at call 0, its signs zeroed here) loaded from the save repeats the last three bit for bit: the
    stream's count and the signs travel."""
    module = BlockScaledLinear(64, 32, recipe="nvfp4", index=5)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    _train_steps(module, opt, 3, seed=0)
    buffer = io.BytesIO()
    torch.save({"model": module.state_dict(), "opt": opt.state_dict()}, buffer)
    continued = _train_steps(module, opt, 3, seed=1)
    assert module.get_extra_state().tolist() == [NVFP4.seed + 5, 6]   # one call per backward

    resumed = BlockScaledLinear(64, 32, recipe="nvfp4", index=5)
    resumed.hadamard_signs.zero_()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)   # tensors only: no pickled objects in the state
    assert saved["model"]["_extra_state"].tolist() == [NVFP4.seed + 5, 3]
    resumed.load_state_dict(saved["model"])
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed_opt.load_state_dict(saved["opt"])
    again = _train_steps(resumed, resumed_opt, 3, seed=1)
    assert torch.equal(resumed.hadamard_signs, module.hadamard_signs)
    assert all(torch.equal(a, b) for a, b in zip(continued, again))


def test_reloading_replays_the_same_rounding_and_another_call_count_does_not():
    """The round trip above is not vacuous: a step replayed from a reloaded state repeats its bits, the same step
    from the same weights at another call of the stream gives other bits."""
    module = BlockScaledLinear(64, 32, recipe="nvfp4")
    state = copy.deepcopy(module.state_dict())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    first = _train_steps(module, opt, 1, seed=0)[0]
    module.load_state_dict(state)
    assert torch.equal(_train_steps(module, opt, 1, seed=0)[0], first)
    state["_extra_state"] = torch.tensor([NVFP4.seed, 1])
    module.load_state_dict(state)
    assert not torch.equal(_train_steps(module, opt, 1, seed=0)[0], first)


def test_a_stream_saved_by_another_linear_or_in_another_form_is_refused():
    module = BlockScaledLinear(32, 32, recipe="nvfp4", index=2)
    with pytest.raises(ValueError, match=r"saved stochastic-rounding stream is \[7, 4\], but this module's sr_seed is 2"):
        module.set_extra_state(torch.tensor([7, 4]))
    with pytest.raises(ValueError, match=r"extra state dict is not this module's stochastic-rounding stream"):
        module.set_extra_state({"sr_seed": 2, "generator_state": torch.Generator().get_state()})
    with pytest.raises(ValueError, match="extra state"):
        module.set_extra_state(torch.tensor([2.0, 1.0]))
    BlockScaledLinear(32, 32, recipe="mxfp8", index=2).set_extra_state(torch.tensor([2, 0]))   # no SR: checked alike
    with pytest.raises(ValueError, match="sr_seed is 2"):
        BlockScaledLinear(32, 32, recipe="mxfp8", index=2).set_extra_state(torch.tensor([3, 0]))


def test_a_negative_call_count_and_damaged_signs_are_refused_by_name():
    module = BlockScaledLinear(32, 32, recipe="nvfp4", index=2)
    with pytest.raises(ValueError, match=r"stream is \[2, -3\]: a negative call count is no stream's state"):
        module.set_extra_state(torch.tensor([2, -3]))
    state = module.state_dict()
    for damaged in (torch.zeros_like(state["hadamard_signs"]), -state["hadamard_signs"]):
        with pytest.raises(RuntimeError, match="hadamard_signs: not the random Hadamard signs of recipe nvfp4"):
            module.load_state_dict({**state, "hadamard_signs": damaged})
    module.load_state_dict(state)   # its own signs load


def test_meta_init_then_to_empty_draws_the_signs_and_keeps_the_stream():
    module = BlockScaledLinear(32, 32, recipe="nvfp4", device="meta")
    assert module.hadamard_signs.is_meta and module.get_extra_state().tolist() == [0, 0]
    module.to_empty(device="cpu")
    reference = BlockScaledLinear(32, 32, recipe="nvfp4")
    assert torch.equal(module.hadamard_signs, reference.hadamard_signs)
    x, w, dy = _inputs(32, 32, 32, seed=4)
    with torch.no_grad():
        module.weight.copy_(w)
        reference.weight.copy_(w)
        module.bias.zero_()
        reference.bias.zero_()
    assert all(_bits_equal(a, b) for a, b in zip(_run(module, x, dy), _run(reference, x, dy)))


@pytest.mark.parametrize("name, fullgraph", [("mxfp8", True), ("nvfp4-plain", True), ("nvfp4", False)])
def test_torch_compile_gives_the_same_bits(name, fullgraph):
    """Without stochastic rounding the whole linear traces as one graph; with it, dynamo cannot take a
    torch.Generator argument (torch 2.13: "Failed to convert args/kwargs to proxy") and the draw breaks the graph,
    the bits staying the same."""
    recipe = RECIPES[name]
    x, w, dy = _inputs(40, 64, 64, seed=5)
    eager, traced = _module(recipe, w), _module(recipe, w)
    compiled = torch.compile(traced, backend="eager", fullgraph=fullgraph)
    for step in range(2):  # the second step: the generator has advanced in both
        expected = _run(eager, x, dy)
        got = _run(compiled, x, dy)
        assert all(_bits_equal(a, b) for a, b in zip(expected, got)), f"step {step}"


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_an_empty_batch_gives_empty_outputs_and_zero_weight_gradients(name):
    module = BlockScaledLinear(32, 32, recipe=name)
    x = torch.randn(0, 5, 32, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.shape == (0, 5, 32) and x.grad.shape == x.shape and torch.equal(module.weight.grad, torch.zeros(32, 32))
