"""The block advice's underflow criterion: a linear whose weight is almost all flushed in NVFP4 is kept in bf16
although its SQNR passes (the few large elements carry the signal power); well-behaved data is not flagged."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import Policy
from mixprec.numerics import inspect
from mixprec.numerics.block_advice import BLOCK_UNDERFLOW_MARGIN, block_verdicts, underflow_bound
from mixprec.numerics.block_stats import BlockFormatStats, LinearBlockStats
from mixprec.workloads import get_workload

SMALL, BIG = 0.01, 3.0


def _inspect_gpt(plant: bool):
    """gpt/tiny inspected in NVFP4 for one step; ``plant``: ``blocks.0.fc``'s weight (128x32) is ``SMALL`` with one
    ``BIG`` per 16x16 tile (NVFP4's 2D weight blocks)."""
    workload = get_workload("gpt", config="tiny")
    torch.manual_seed(0)
    model = workload.build_model()
    if plant:
        with torch.no_grad():
            w = model.blocks[0].fc.weight
            w.fill_(SMALL)
            w[::16, ::16] = BIG
    return inspect(model, workload.batches("train", 0), workload.loss, formats=("nvfp4",), steps=1,
                   optimizer=workload.make_optimizer)


def test_underflow_bound_is_twice_the_reference_and_ten_points_above_it():
    assert underflow_bound(0.102) == 0.204 and underflow_bound(0.068) == 0.068 + BLOCK_UNDERFLOW_MARGIN
    assert underflow_bound(0.0) == BLOCK_UNDERFLOW_MARGIN == 0.10


def test_a_weight_flushed_but_for_one_element_per_tile_is_kept_in_bf16_though_its_sqnr_passes():
    """Each 16x16 tile: the NVFP4 scale is 3.0 / 6 = 0.5 exactly (tensor scale 3 / (6 * 448), block scale 448), so
    0.01 / 0.5 = 0.02 lies below half of E2M1's smallest subnormal 0.5: 255 of 256 elements flush, 3.0 is exact.
    SQNR = 10 log10((9 + 255 s**2) / (255 s**2)), s the fp32 0.01: 25.5 dB, above NVFP4's W floor (about 16)."""
    report = _inspect_gpt(plant=True)
    stats = report.block_stats("nvfp4")
    w = stats.linears["blocks.0.fc"].operands["W"]
    s = float(torch.tensor(SMALL))
    assert w.flushed * 256 == w.nonzero * 255 and w.underflow == 255 / 256
    assert w.sqnr_db == pytest.approx(10 * math.log10((BIG**2 + 255 * s * s) / (255 * s * s)), rel=1e-5)
    assert w.sqnr_db > stats.reference_sqnr_db["W"] - 3.0      # the SQNR rule alone would pass it
    advice = report.block_advice("nvfp4")
    [verdict] = [v for v in advice.failing if v.linear == "blocks.0.fc"]
    assert (verdict.criterion, verdict.operand, verdict.underflow) == ("underflow", "W", 255 / 256)
    assert verdict.underflow_bound == underflow_bound(stats.reference["W"].underflow)
    assert "blocks.0.fc" in advice.keep and advice.policy.block_keep
    assert any(f"blocks.0.fc (W underflow 99.6% > {verdict.underflow_bound * 100:.3g}%)" in r for r in advice.reasons)
    assert "W underflow 99.6% >" in report.to_markdown()


def test_normal_data_and_the_untouched_gpt_are_not_flagged():
    report = _inspect_gpt(plant=False)
    stats = report.block_stats("nvfp4")
    assert block_verdicts(stats) == [] and report.block_advice("nvfp4").keep == ()
    assert report.block_advice("nvfp4").policy == Policy.parse("nvfp4-mixed")
    # normal data itself, as a linear: the reference row judged against itself
    as_linear = LinearBlockStats("normal", (256, 256), dict(stats.reference), "")
    alone = BlockFormatStats(stats.format, stats.recipe, stats.recipe_name, stats.reference, {"normal": as_linear})
    assert block_verdicts(alone) == [] and all(ref.underflow > 0 for ref in stats.reference.values())
