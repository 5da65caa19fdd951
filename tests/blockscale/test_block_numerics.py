"""How close block-scaled linears come to exact arithmetic: the GEMMs' SQNR against fp64 per format, against a
bound derived from the element format's mantissa bits; what stochastic rounding buys; a tiny MLP trained 50 steps.

The SQNR expected of one GEMM (all tensors Gaussian, so every block is used the same way):

* one operand rounded to nearest in an element format of ``m`` mantissa bits, values spread over the binades of
  its normal range: in a binade ``[2**e, 2**(e+1))`` the error is uniform over ``±ulp/2`` with ``ulp = 2**(e-m)``,
  so for values uniform in the binade ``E[x**2] / E[err**2] = (7/3 * 4**e) / (4**(e-m) / 12) = 28 * 4**m``:
  ``S = 6.02 m + 14.47 dB`` (E4M3: 32.5 dB, E5M2: 26.5, E2M1: 20.5);
* stochastic rounding: the error variance is ``E[f(1-f)] ulp**2 = ulp**2 / 6`` for a uniform fraction ``f``,
  twice round-to-nearest's ``ulp**2 / 12``: ``S - 3.01 dB``;
* a GEMM ``A @ B^T`` of operands with independent relative errors of power ``10**(-S_a/10)`` and
  ``10**(-S_b/10)`` sums them (first order): ``S_gemm = -10 log10(10**(-S_a/10) + 10**(-S_b/10))``.

Measured values sit up to ~1 dB below (Gaussian values weigh the binades unevenly, a block's largest element
rarely lands on the top of the grid, E2M1's subnormal half-step near zero, 16x16 weight tiles share one scale):
the tests allow 2 dB below and 1 dB above (above: the quantization did not happen).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from block_emulation import weight_tiles
from mixprec.blockscale import BlockRecipe, BlockScaledLinear, convert_to_block_scaled, get_block_recipe
from mixprec.formats import get_block_format

MARGIN_BELOW_DB, MARGIN_ABOVE_DB = 2.0, 1.0


def _operand_db(mantissa_bits: int, stochastic: bool = False) -> float:
    return 6.02 * mantissa_bits + 14.47 - (3.01 if stochastic else 0.0)


def _gemm_db(a_db: float, b_db: float) -> float:
    return -10 * math.log10(10 ** (-a_db / 10) + 10 ** (-b_db / 10))


def _sqnr_db(got: torch.Tensor, exact: torch.Tensor) -> float:
    return 10 * math.log10(exact.pow(2).sum() / (got.double() - exact).pow(2).sum())


def _expected(recipe: BlockRecipe) -> dict[str, float]:
    x, w = (_operand_db(recipe.operand_format(o).element.mantissa_bits) for o in ("x", "W"))
    dy = _operand_db(recipe.operand_format("dy").element.mantissa_bits, recipe.stochastic_rounding)
    return {"y": _gemm_db(x, w), "dx": _gemm_db(dy, w), "dW": _gemm_db(dy, x)}


RECIPES = {
    "mxfp8": get_block_recipe("mxfp8"),
    "mxfp8-e5m2-grads": BlockRecipe(format="mxfp8_e4m3", grad_format="mxfp8_e5m2", scale_rounding="rceil"),
    "nvfp4": get_block_recipe("nvfp4"),
    "nvfp4-plain": get_block_recipe("nvfp4-plain"),
    "nvfp4-plain-1d": dataclasses.replace(get_block_recipe("nvfp4-plain"), weight_blocks="1d"),
}


def _measure(recipe: BlockRecipe) -> dict[str, float]:
    """SQNR (dB) of y, dx and dW against fp64 for Gaussian x (256, 128), W (128, 128), dy."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(256, 128, generator=g), torch.randn(128, 128, generator=g) * 0.05, \
        torch.randn(256, 128, generator=g)
    lin = nn.Linear(128, 128, bias=False)
    lin.weight.data.copy_(w)
    module = BlockScaledLinear.from_linear(lin, recipe=recipe)
    x = x.requires_grad_()
    y = module(x)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.double(), dy.double()
    return {"y": _sqnr_db(y.detach(), x64 @ w64.t()), "dx": _sqnr_db(x.grad, dy64 @ w64),
            "dW": _sqnr_db(module.weight.grad, dy64.t() @ x64)}


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_gemm_reaches_the_sqnr_its_mantissa_bits_predict(name):
    recipe = RECIPES[name]
    measured = _measure(recipe)
    for gemm, expected in _expected(recipe).items():
        assert expected - MARGIN_BELOW_DB <= measured[gemm] <= expected + MARGIN_ABOVE_DB, \
            f"{name} {gemm}: {measured[gemm]:.2f} dB, expected {expected:.2f} dB"


def test_the_specs_floor_scales_lose_to_rceil_by_saturating():
    """OCP MX's floor puts a block's amax in the element's top binade, [256, 512) for E4M3, whose values above 448
    saturate; rceil never saturates. On Gaussian data floor loses ~1 dB per GEMM (the reason torchao's MXFP8
    training recipe computes rceil scales, recipe.py)."""
    floor = _measure(BlockRecipe(format="mxfp8_e4m3"))
    rceil = _measure(get_block_recipe("mxfp8"))
    assert all(rceil[g] > floor[g] + 0.5 for g in ("y", "dx", "dW")), (floor, rceil)


def test_stochastic_rounding_of_dy_removes_the_bias_that_rounding_to_nearest_keeps():
    """dgrad with the same quantized W: the mean over 32 backward passes of nvfp4's SR'd dy approaches the dgrad of
    the exact dy (error power / ~32), while round-to-nearest repeats one biased result; one SR draw alone is
    noisier than round-to-nearest (the 3 dB above)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g) * 0.1
    dy = torch.randn(64, 64, generator=g) * torch.rand(64, 1, generator=g).pow(4)  # many small gradients
    results = {}
    for name in ("nvfp4", "nvfp4-plain"):
        lin = nn.Linear(64, 64, bias=False)
        lin.weight.data.copy_(w)
        module = BlockScaledLinear.from_linear(lin, recipe=name)
        draws = []
        for _ in range(32):
            xx = x.clone().requires_grad_()
            module(xx).backward(dy)
            draws.append(xx.grad.double())
        results[name] = draws
    target = dy.double() @ weight_tiles(w, get_block_format("nvfp4")).double()  # both recipes: W in 16x16 tiles
    sr_one, sr_mean = _sqnr_db(results["nvfp4"][0], target), _sqnr_db(torch.stack(results["nvfp4"]).mean(0), target)
    rn_one, rn_mean = (_sqnr_db(results["nvfp4-plain"][0], target),
                       _sqnr_db(torch.stack(results["nvfp4-plain"]).mean(0), target))
    assert rn_one == rn_mean                           # deterministic: averaging does nothing
    assert sr_one < rn_one                             # one SR draw is noisier
    assert sr_mean > rn_mean + 10                      # but unbiased: 32 draws gain ~15 dB
    assert sr_mean > sr_one + 10 * math.log10(32) - 2


class _Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.layers = nn.ModuleList(_Block(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _batches(seed: int, steps: int, split: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    teacher = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed)) / 32 ** 0.5
    g = torch.Generator().manual_seed(1000 + seed + 7919 * split)
    xs = [torch.randn(128, 32, generator=g) for _ in range(steps)]
    return [(x, torch.tanh(x @ teacher * 3)) for x in xs]


def _train(recipe: str | None, seed: int = 0, steps: int = 50) -> float:
    """Adam, 50 steps of MSE regression onto a fixed random teacher; the held-out loss of the trained model (its
    forward still block-scaled)."""
    torch.manual_seed(seed)
    model = _MLP()
    if recipe is not None:
        convert_to_block_scaled(model, recipe)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for x, y in _batches(seed, steps, split=0):
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        return sum((model(x) - y).pow(2).mean().item() for x, y in _batches(seed, 4, split=1)) / 4


def test_a_tiny_mlp_trains_50_steps_close_to_fp32():
    """mxfp8 within 1 % of fp32's held-out loss, both NVFP4 recipes within 5 % (measured on this machine: fp32
    0.1680, mxfp8 0.1685, nvfp4 0.1710, nvfp4-plain 0.1707 for seed 0).

    What this toy cannot show: that the NVFP4 recipe (random Hadamard transform on wgrad, SR of gradients, bf16
    tail) beats nvfp4-plain. Over seeds 0-2 of this task and of variants built to favour it (per-token log-normal
    input scales, Pareto-tailed target noise) the ordering flipped from seed to seed by less than the seed-to-seed
    spread; the recipe is a remedy for biases that accumulate over long runs of large models (the NVFP4 paper,
    arXiv 2509.25149), not for 50 steps of a 4-block MLP. What holds at the GEMM level is pinned above (SR's
    unbiasedness); the random Hadamard transform measurably *lowers* a single wgrad's SQNR on inputs whose
    outlier tokens differ between x and dy (the transform mixes one operand's outlier error into the other's
    outlier), so no test claims it helps here."""
    losses = {name: _train(name) for name in (None, "mxfp8", "nvfp4", "nvfp4-plain")}
    fp32 = losses[None]
    assert abs(losses["mxfp8"] - fp32) <= 0.01 * fp32, losses
    for name in ("nvfp4", "nvfp4-plain"):
        assert abs(losses[name] - fp32) <= 0.05 * fp32, losses
    assert losses["nvfp4"] != losses["nvfp4-plain"]
