"""A second derivative through an fp8 or block-scaled linear is refused where it is taken (a gradient penalty built
with ``create_graph=True`` used to add nothing to the weights' gradients, silently); first-order gradients are
unchanged bit for bit."""

import pytest
import torch
from torch import nn

from mixprec.blockscale.linear import BlockScaledLinear
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.fp8.linear import Float8Linear


def _linears():
    torch.manual_seed(0)
    base = nn.Linear(64, 64)
    return {"mxfp8": BlockScaledLinear.from_linear(base, recipe="mxfp8"),
            "nvfp4": BlockScaledLinear.from_linear(base, recipe="nvfp4"),
            "fp8": Float8Linear.from_linear(base)}


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8"])
def test_create_graph_gives_the_first_order_gradient_and_differentiating_it_raises_naming_the_fix(name):
    lin = _linears()[name]
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grads = []
    for create_graph in (False, True):
        if isinstance(lin, BlockScaledLinear) and lin._stream is not None:
            lin.set_extra_state(torch.tensor([lin.sr_seed, 0]))   # the same SR bits for both backwards
        (g,) = torch.autograd.grad(torch.tanh(lin(x)).sum(), x, create_graph=create_graph)
        grads.append(g)
    assert torch.equal(grads[0], grads[1]) and not grads[0].requires_grad and grads[1].requires_grad
    penalty = (grads[1].norm(dim=1) - 1).pow(2).mean()
    with pytest.raises(RuntimeError, match="a second derivative through a.* linear") as err:
        penalty.backward()
    assert "first-order only" in str(err.value) and "block_keep=" in str(err.value)


def _critic() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def _penalty_step(policy: str) -> tuple[MixedPrecision, torch.Tensor]:
    """docs/loops.md's WGAN-GP penalty through the engine: one step, the middle linear's weight gradient."""
    model = _critic()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy=policy, device="cpu")
    x_hat = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    with mp.autocast():
        out = mp.model(x_hat)
    (g,) = mp.unscale(torch.autograd.grad(mp.scale_loss(out.sum()), x_hat, create_graph=True))
    penalty = ((g.norm(dim=1) - 1) ** 2).mean()
    mp.backward(out.mean() + 10 * penalty)
    return mp, model[2].weight.grad


def test_a_gradient_penalty_under_a_block_policy_fails_at_its_backward_and_block_keep_makes_it_train():
    with pytest.raises(RuntimeError, match=r"block-scaled linear \(mxfp8\).*block_keep=<their names>.*"
                                           r"\(this one: 2\)"):
        _penalty_step("mxfp8-mixed")   # the middle linear is converted (first and last kept by the recipe)
    with pytest.warns(UserWarning, match="converted 0 linears"):   # every linear kept: said, not silent
        mp, grad = _penalty_step("mxfp8-mixed,block_keep=2")
    _, reference = _penalty_step("bf16-mixed")
    assert type(mp.model[2]) is nn.Linear and torch.equal(grad, reference)   # the penalty reached the weight


def test_the_refusal_names_the_fp8_linear_it_passed_through():
    with pytest.raises(RuntimeError, match=r"through an fp8 linear .*keep_fp32=<their names> or fp8=none.*"
                                           r"\(this one: 2\)"):
        _penalty_step("fp8-mixed")   # the middle linear is fp8 (first and last kept)
