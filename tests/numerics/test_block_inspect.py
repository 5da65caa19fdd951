"""The inspector's block formats: each linear's operands counted as the recipe's GEMMs read them, equal to counts
derived here from the formats' arithmetic and from quantize/dequantize; the report keeps them (JSON, markdown,
heatmap); the advisor keeps the linears that fall below the format's reference SQNR in bf16 with ``block_keep``,
and the advised policy trains with those linears really in bf16."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, Policy
from mixprec.blockscale import BlockRecipe, BlockScaledLinear, get_block_recipe, quantize
from mixprec.formats import get_block_format
from mixprec.numerics import NumericsReport, inspect
from mixprec.numerics.block_advice import BLOCK_SQNR_SLACK_DB, judge_block_policy
from mixprec.numerics.block_measure import operand_counts, recipe_for_format
from mixprec.workloads import get_workload


def _counts(operand, t, recipe, **kwargs) -> tuple[int, int, int, int, float, float]:
    blocks, saturated, nonzero, flushed, signal, noise = operand_counts(operand, t, recipe, **kwargs).tolist()
    return int(blocks), int(saturated), int(nonzero), int(flushed), signal, noise


# ---------------------------------------------------------------- counts against the formats' arithmetic
def _one_huge_per_block(rows: int, cols: int, block: int, huge: float, small: float) -> torch.Tensor:
    """``(rows, cols)``: ``small`` everywhere, ``huge`` at the first element of every block along the last dim."""
    t = torch.full((rows, cols), small)
    t[:, ::block] = huge
    return t


def test_one_huge_element_per_block_saturates_every_block_and_flushes_the_rest():
    """MXFP8 E4M3, OCP ``floor`` scales: a block holding 1.9 * 2**10 gets the scale 2**(10 - 8) = 4 (E4M3's emax is
    8), so 1.9 * 2**10 / 4 = 486.4 > 448 saturates; the others, 2**-20 / 4 = 2**-22, lie below half of E4M3's
    smallest subnormal (2**-9 / 2) and flush to zero. The SQNR's sums: the same from quantize/dequantize."""
    fmt = get_block_format("mxfp8_e4m3")
    recipe = BlockRecipe("forward-only", format=fmt.name, quantized_gemms=("forward",))   # x read once, along K
    x = _one_huge_per_block(4, 64, 32, 1.9 * 2 ** 10, 2.0 ** -20)
    blocks, saturated, nonzero, flushed, signal, noise = _counts("x", x, recipe)
    assert (blocks, saturated, nonzero, flushed) == (8, 8, 256, 248)   # saturated 100 %, underflow 31/32 exactly
    x_hat = quantize(x, fmt).dequantize().double()
    assert signal == x.double().square().sum().item()
    assert noise == (x.double() - x_hat).square().sum().item()
    by_hand = 8 * ((1.9 * 2 ** 10 - 448 * 4) ** 2 + 31 * 2.0 ** -40)   # the huge one clamped to 448 * 4
    assert noise == pytest.approx(by_hand, rel=1e-6)   # 1.9 * 2**10 is not exact in fp32: 2**-24 relative


def test_every_gemm_read_counts_and_rceil_scales_never_saturate():
    """A weight is read along K (forward) and along N (dgrad) under 1D blocks: a diagonal of huge values puts one in
    every block both ways. Under the mxfp8 recipe's ``rceil`` scales (2**ceil(log2(amax / 448))) nothing
    saturates; E4M3's subnormals still flush the small ones."""
    w = torch.full((32, 32), 2.0 ** -30)
    w.fill_diagonal_(1.9 * 2 ** 10)
    floor = BlockRecipe("floor", format="mxfp8_e4m3", quantized_gemms=("forward", "dgrad"))
    assert _counts("W", w, floor)[:4] == (64, 64, 2048, 2 * (1024 - 32))
    rceil = get_block_recipe("mxfp8")
    assert _counts("W", w, rceil)[:4] == (64, 0, 2048, 2 * (1024 - 32))


def test_nvfp4_weights_are_read_once_in_16x16_tiles():
    """NVFP4 with 2D weight blocks: one scale per 16x16 tile, one read serving forward and dgrad. A tile of a single
    21 * 2**-5 among 0.03s: the tensor scale is 21 * 2**-5 / (6 * 448) = 2**-12 and the tile's E4M3 scale
    (21 * 2**-5 / 6) / 2**-12 = 448, all exact, so the large value lands on 6 exactly (no saturation) and 0.03 on
    0.274, which rounds to E2M1's subnormal 0.5 (nothing flushes)."""
    w = torch.full((32, 32), 0.03)
    w[::16, ::16] = 21 * 2.0 ** -5   # one per tile: rows 0 and 16, columns 0 and 16
    blocks, saturated, nonzero, flushed, signal, noise = _counts("W", w, get_block_recipe("nvfp4"))
    assert (blocks, saturated, nonzero, flushed) == (4, 0, 1024, 0)
    tiles = w.reshape(2, 16, 2, 16).transpose(1, 2).reshape(2, 2, 256)
    fmt16x16 = get_block_recipe("nvfp4").weight_tile_format()
    assert noise == (tiles.double() - quantize(tiles, fmt16x16).dequantize().double()).square().sum().item()
    by_hand = 4 * 255 * (0.5 * 448 * 2.0 ** -12 - 0.03) ** 2   # every 0.03 dequantized to 0.5 * its scale
    assert noise == pytest.approx(by_hand, rel=1e-6)   # 0.03 is not exact in fp32
    assert 10 * math.log10(signal / noise) < 7   # about 6.3 dB: far below what normal data gets (about 19)


# ---------------------------------------------------------------- through inspect
class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.mid, self.last = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.last(F.gelu(self.mid(F.gelu(self.first(x)))))


def _regression(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(64, 32, generator=g), "y": torch.randn(64, 16, generator=g)} for _ in range(n)]


def _mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def test_inspect_counts_a_planted_weight_exactly_and_round_trips_through_json(tmp_path):
    """One step (the weight the forward reads is the planted one): ``mid``'s weight has one huge value per row and
    per column, read along K and along N in MXFP8 E5M2 (its own recipe: OCP floor scales, 1D blocks): E5M2's emax
    is 15, 1.9 * 2**10 / 2**-5 = 1.9 * 2**15 > 57344 saturates every block, 2**-30 / 2**-5 flushes."""
    torch.manual_seed(0)
    model = Three()
    with torch.no_grad():
        model.mid.weight.fill_(2.0 ** -30).fill_diagonal_(1.9 * 2 ** 10)
    report = inspect(model, _regression(1), _mse, formats=("bf16", "mxfp8_e5m2"), steps=1)
    assert report.formats == ("bf16",) and report.block_formats == ("mxfp8_e5m2",)
    stats = report.block_stats("mxfp8-e5m2")
    assert stats.recipe_name == "" and stats.recipe.startswith("mxfp8_e5m2(")
    w = stats.linears["mid"].operands["W"]
    assert (w.blocks, w.saturated_blocks, w.nonzero, w.flushed) == (64, 64, 2048, 1984)
    assert w.saturated == 1.0 and w.underflow == 31 / 32
    x = stats.linears["mid"].operands["x"]
    assert x.blocks == 64 * 1 + 32 * 2   # x (64, 32): 64 rows of one block along K; x^T (32, 64): two along M
    assert stats.linears["first"].kept.startswith("first Linear") and stats.linears["mid"].kept == ""
    assert NumericsReport.from_json(report.to_json()) == report
    markdown = report.to_markdown()
    assert "### mxfp8_e5m2 under `mxfp8_e5m2(" in markdown and "| mid | 32x32 |" in markdown
    assert "Formats: bf16, mxfp8_e5m2." in markdown   # the header lists the block formats too
    assert report.heatmap(tmp_path / "numerics.png").stat().st_size > 1000


def test_block_formats_alone_and_unknown_names():
    report = inspect(Three(), _regression(1), _mse, formats=("nvfp4",), steps=1)
    assert report.formats == () and report.block_formats == ("nvfp4",) and report.modules
    assert "## Block formats" in report.to_markdown() and "Formats: nvfp4." in report.to_markdown()
    with pytest.raises(ValueError, match=r"inspect formats: 'nvfp5' is neither a format .* nor a block format "
                                         r"\(\['mxfp4', 'mxfp6_e2m3', 'mxfp6_e3m2', 'mxfp8', 'mxfp8_e5m2', 'nvfp4'\]\)"):
        inspect(Three(), _regression(1), _mse, formats=("nvfp5",), steps=1)
    with pytest.raises(ValueError, match=r"block format 'mxfp8' was not inspected; this report holds \['nvfp4'\]"):
        report.block_advice("mxfp8")


def test_the_recipe_a_format_is_inspected_under():
    assert recipe_for_format("nvfp4", Policy.parse("fp32")).name == "nvfp4"
    assert recipe_for_format("nvfp4", Policy.parse("nvfp4-mixed,block=nvfp4-plain")).name == "nvfp4-plain"
    assert recipe_for_format("mxfp8", Policy.parse("fp32")).name == "mxfp8"
    own = recipe_for_format("mxfp6_e2m3", Policy.parse("nvfp4-mixed"))
    assert own.format == "mxfp6_e2m3" and own.weight_blocks == "1d" and not own.hadamard


# ---------------------------------------------------------------- the advice, and the advised policy training
def _planted_gpt():
    """gpt/tiny with ``blocks.0.fc``'s weight (128x32) made of 16x16 tiles of one 0.02 among 0.001s: 7.6 dB in
    NVFP4 (test_nvfp4_weights_are_read_once_in_16x16_tiles' arithmetic, scaled), far below normal data's 19."""
    workload = get_workload("gpt", config="tiny")
    torch.manual_seed(0)
    model = workload.build_model()
    with torch.no_grad():
        w = model.blocks[0].fc.weight
        w.fill_(0.001)
        w[::16, ::16] = 0.02
    return workload, model


def test_the_advice_keeps_the_planted_linear_in_bf16_and_that_policy_trains_with_it_in_bf16():
    workload, model = _planted_gpt()
    report = inspect(model, workload.batches("train", 0), workload.loss, formats=("bf16", "nvfp4"), steps=1,
                     optimizer=workload.make_optimizer)
    advice = report.block_advice("nvfp4")
    # fc's weight fails by SQNR; its output, one large row in 16, reaches proj's input as one large element per
    # 16-element block among small ones, which flush (proj's x: the underflow criterion, test_block_underflow.py)
    assert advice.keep == ("blocks.0.fc", "blocks.0.proj")
    assert [(v.operand, v.criterion) for v in advice.failing] == [("W", "sqnr"), ("x", "underflow")]
    floor = report.block_stats("nvfp4").reference_sqnr_db["W"] - BLOCK_SQNR_SLACK_DB
    assert advice.failing[0].floor_db == floor and advice.failing[0].sqnr_db < 8 < floor
    assert advice.failing[1].underflow > advice.failing[1].underflow_bound
    assert "blocks.0.fc" in advice.kept_in_bf16() and "lm_head" in advice.kept_in_bf16()   # the recipe's own too
    policy = advice.policy
    assert policy.block == "nvfp4" and Policy.parse(str(policy)) == policy
    assert str(policy) in ("nvfp4-mixed,block_keep=blocks.0.fc|blocks.0.proj",
                           "nvfp4-mixed,block_keep=blocks.*.fc|blocks.0.proj")
    assert report.recommend().block == (advice,)
    under_study = inspect(model, workload.batches("train", 0), workload.loss, formats=("bf16", "nvfp4"), steps=1,
                          optimizer=workload.make_optimizer, policy="nvfp4-mixed").recommend()
    assert under_study.policy.block == "nvfp4" and under_study.policy.block_keep == policy.block_keep

    mp = MixedPrecision(model, workload.make_optimizer(model), policy=policy, device="cpu")
    kept = dict(mp.block_report.kept)
    assert kept["blocks.0.fc"].startswith("kept by block_keep pattern") and "block_keep: blocks.0.fc" in mp.decision
    assert type(model.blocks[0].fc) is nn.Linear and isinstance(model.blocks[0].attn.proj, BlockScaledLinear)
    seen = []
    model.blocks[0].fc.register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, m.weight.dtype, out.dtype)))
    losses = []
    for batch in itertools.islice(workload.batches("train", 0), 12):
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = workload.loss(mp.model, batch)
        mp.backward(loss)
        mp.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) < sum(losses[:3]), losses
    assert seen and all(out == torch.bfloat16 for _, _, out in seen)   # the kept linear ran in bf16 (autocast)


def test_a_linear_the_recipe_keeps_is_reported_below_its_floor_but_not_added():
    workload, model = _planted_gpt()
    with torch.no_grad():
        model.blocks[1].fc.weight.copy_(model.blocks[0].fc.weight)   # blocks.1 is nvfp4's bf16 tail (1 of 2)
        model.blocks[0].fc.reset_parameters()
    report = inspect(model, workload.batches("train", 0), workload.loss, formats=("nvfp4",), steps=1,
                     optimizer=workload.make_optimizer)
    advice = report.block_advice("nvfp4")
    assert advice.keep == () and [v.linear for v in advice.failing] == ["blocks.1.fc", "blocks.1.proj"]
    assert advice.failing[0].kept.startswith("in the bf16 tail") and advice.policy == Policy.parse("nvfp4-mixed")
    assert any("kept by the recipe already: blocks.1.fc" in r for r in advice.reasons)
    assert report.block_advice("nvfp4", slack_db=-100.0).keep   # a target no linear meets keeps every converted one
    with pytest.raises(ValueError, match=r"slack_db=nan must be a finite number of dB"):
        report.block_advice("nvfp4", slack_db=float("nan"))


def test_a_policy_under_study_whose_compute_format_is_not_inspected_is_refused_before_any_step():
    """nvfp4-mixed computes its unconverted layers in bf16, which its advice reads: formats=("nvfp4",) alone is
    refused up front (the batches are never drawn), naming the argument, the value and the fix."""
    def batches():
        raise AssertionError("a batch was drawn: the check came after a training step")
        yield

    with pytest.raises(ValueError, match=r"^inspect formats=nvfp4: the policy under study, nvfp4-mixed, computes in "
                                         r"bf16, .*add it: formats=nvfp4,bf16 \(mixprec inspect --formats nvfp4,bf16\)"):
        inspect(Three(), batches(), _mse, policy="nvfp4-mixed", formats=("nvfp4",), steps=1)
    with pytest.raises(ValueError, match=r"formats=fp16,mxfp8_e4m3: the policy under study, mxfp8-mixed, computes in bf16"):
        inspect(Three(), batches(), _mse, policy="mxfp8-mixed", formats=("fp16", "mxfp8"), steps=1)
    report = inspect(Three(), _regression(1), _mse, policy="nvfp4-mixed", formats=("bf16", "nvfp4"), steps=1)
    assert report.formats == ("bf16",) and report.block_formats == ("nvfp4",) and report.recommend().policy.block


def test_a_policy_turning_recipe_parts_off_is_inspected_and_advised_under_its_own_recipe():
    policy = Policy.parse("nvfp4-mixed,block_disable=sr")
    assert recipe_for_format("nvfp4", policy).name == "nvfp4 without sr"
    report = inspect(Three(), _regression(1), _mse, policy=policy, formats=("bf16", "nvfp4"), steps=1)
    (stats,) = report.block
    assert stats.recipe_name == "nvfp4" and "nvfp4 without sr(" in stats.recipe   # the preset its policy names
    judged, reasons = judge_block_policy(report, policy)
    assert judged.block == "nvfp4" and judged.block_disable == ("sr",)
    assert not any("not judged here" in r for r in reasons)
    assert report.recommend().policy.block_disable == ("sr",)
