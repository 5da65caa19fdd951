"""What a BlockScaledLinear keeps for backward: x's wgrad operand packed (its format's bytes, not x's), nothing of x
when the weight needs no gradient; the gradients bit for bit those of computing that operand in backward from x
(the path before packing), under every recipe variant, dtype, autocast, SR stream, recompute and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import mixprec.blockscale.linear as linear_module
from block_emulation import emulate
from mixprec.blockscale import BlockScaledLinear, get_block_recipe
from mixprec.blockscale.gemm import block_gemm, gemm_operand
from mixprec.blockscale.recipe import recipe_parts
from mixprec.blockscale.streams import stream_key

NVFP4 = get_block_recipe("nvfp4")
MXFP8 = get_block_recipe("mxfp8")
VARIANTS = {"mxfp8": MXFP8, "nvfp4": NVFP4, "nvfp4-plain": get_block_recipe("nvfp4-plain")}
VARIANTS.update({f"{name} without {part}": get_block_recipe(name, disable=(part,))
                 for name in ("mxfp8", "nvfp4") for part in recipe_parts(get_block_recipe(name))})
M = 40   # tokens: not a multiple of 16 or 32, so wgrad pads M


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int), b.view(as_int))


def _module(recipe, k: int = 64, n: int = 64, index: int = 2) -> BlockScaledLinear:
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.1)
    return BlockScaledLinear.from_linear(lin, recipe=recipe, index=index)


def _inputs(dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, 64, generator=g) * torch.rand(M, 1, generator=g).exp2().mul(4)).to(dtype)
    return x, torch.randn(M, 64, generator=g) * 1e-3


def _old_wgrad(recipe, module, x, dy, generator, out_dtype) -> torch.Tensor:
    """dW as backward computed it before packing: x's operand from x in backward, after dgrad's draw of dy's bits."""
    fx, fdy, rounding = recipe.operand_format("x"), recipe.operand_format("dy"), recipe.rounding("dy")
    signs = module.hadamard_signs if recipe.hadamard else None
    draws = generator if recipe.stochastic_rounding else None
    gemm_operand(dy, fdy, rounding=rounding, generator=draws)                         # dgrad's draw comes first
    a = gemm_operand(dy.t(), fdy, rounding=rounding, generator=draws, signs=signs)
    return block_gemm(a, gemm_operand(x.t(), fx, signs=signs), out_dtype).to(module.weight.dtype)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradients_equal_the_path_that_quantized_x_in_backward(name, dtype, autocast):
    recipe = VARIANTS[name]
    module = _module(recipe)
    x, dy = _inputs(dtype)
    out_dtype = torch.bfloat16 if autocast else dtype
    dy = dy.to(out_dtype)
    x_leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x_leaf)
    y.backward(dy)
    key = stream_key(recipe.seed + module.index, 0)
    old_dw = _old_wgrad(recipe, module, x, dy, torch.Generator().manual_seed(key), out_dtype)
    _, edx, edw = emulate(recipe, x, module.weight.detach(), dy, out_dtype, signs=module.hadamard_signs,
                          generator=torch.Generator().manual_seed(key))
    assert _bits_equal(module.weight.grad, old_dw), "dW"
    assert _bits_equal(module.weight.grad, edw) and _bits_equal(x_leaf.grad, edx), "against the emulation"


def test_an_sr_run_keeps_the_old_paths_stream_and_weights_over_steps():
    module = _module(NVFP4, index=4)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    w_old = module.weight.detach().clone()
    g = torch.Generator().manual_seed(9)
    for step in range(4):
        x, dy = torch.randn(M, 64, generator=g), torch.randn(M, 64, generator=g) * 1e-2
        opt.zero_grad()
        module(x.requires_grad_()).backward(dy)
        reference = BlockScaledLinear.from_linear(nn.Linear(64, 64, bias=False), recipe=NVFP4, index=4)
        with torch.no_grad():
            reference.weight.copy_(w_old)
        generator = torch.Generator().manual_seed(stream_key(NVFP4.seed + 4, step))
        dw_old = _old_wgrad(NVFP4, reference, x.detach(), dy, generator, torch.float32)
        assert _bits_equal(module.weight.grad, dw_old), f"step {step}"
        assert module.get_extra_state().tolist() == [NVFP4.seed + 4, step + 1]
        opt.step()
        w_old -= 0.5 * dw_old
        assert _bits_equal(module.weight.detach(), w_old)


def _saved_bytes(module: nn.Module, x: torch.Tensor, autocast: bool = False) -> tuple[int, int]:
    """(bytes of the tensors autograd saves in the forward that are not the module's own, bytes of its own:
    parameters and buffers saved by reference, not copies)."""
    own = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
    sizes: dict[int, tuple[bool, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = (storage.data_ptr() in own, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            module(x)
    return (sum(n for is_own, n in sizes.values() if not is_own), sum(n for is_own, n in sizes.values() if is_own))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("m", [64, 40])
def test_the_bytes_saved_per_input_element_are_the_formats(m, autocast):
    """NVFP4: half a byte an element, an E4M3 byte per 16, 4 bytes of tensor scale; MXFP8: a byte an element and an
    E8M0 byte per 32; both over the tokens padded to whole blocks. fp32 x took 4 bytes, bf16 autocast's x 2."""
    k = n = 256
    x = torch.randn(m, k, requires_grad=True)
    for recipe, per_element, per_tensor in ((NVFP4, 0.5 + 1 / 16, 4), (MXFP8, 1 + 1 / 32, 0)):
        padded = -(-m // recipe.block_size) * recipe.block_size
        saved, _ = _saved_bytes(_module(recipe, k, n), x, autocast)
        assert saved == padded * k * per_element + per_tensor
        assert saved / (m * k) < 2, "fewer bytes than bf16's copy of x"
    plain_bf16, _ = _saved_bytes(nn.Linear(k, n, bias=False), x, autocast=True)
    assert plain_bf16 == m * k * 2 + n * k * 2   # autocast's bf16 copies of x and of the weight


def test_nothing_of_x_is_kept_when_the_weight_is_frozen_and_nothing_is_packed_without_grad(monkeypatch):
    module = _module(NVFP4)
    module.weight.requires_grad_(False)
    x, dy = _inputs(torch.float32)
    x_leaf = x.clone().requires_grad_()
    saved, own = _saved_bytes(module, x_leaf)
    assert saved == 0 and own > 0   # the weight itself, for dgrad
    module(x_leaf).backward(dy)
    _, edx, _ = emulate(NVFP4, x, module.weight, dy, torch.float32, signs=module.hadamard_signs,
                        generator=torch.Generator().manual_seed(stream_key(NVFP4.seed + 2, 0)))
    assert _bits_equal(x_leaf.grad, edx) and module.weight.grad is None
    calls = []
    monkeypatch.setattr(linear_module, "pack_operand", lambda *a, **k: calls.append(a))
    module.weight.requires_grad_(True)
    with torch.no_grad():
        module(x_leaf)
    assert calls == [], "evaluation packs nothing"


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_recomputed_forward_gives_the_same_gradients_and_stream(name):
    """Non-reentrant checkpoint: the forward runs again in backward, packs the same operand, draws nothing."""
    x, dy = _inputs(torch.float32)
    results = []
    for checkpointed in (False, True):
        module = _module(VARIANTS[name])
        x_leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if checkpointed:
                y = torch.utils.checkpoint.checkpoint(module, x_leaf, use_reentrant=False)
            else:
                y = module(x_leaf)
        y.backward(dy.bfloat16())
        results.append((x_leaf.grad, module.weight.grad, module.get_extra_state()))
    (dx, dw, stream), (cdx, cdw, cstream) = results
    assert _bits_equal(dx, cdx) and _bits_equal(dw, cdw) and torch.equal(stream, cstream)
