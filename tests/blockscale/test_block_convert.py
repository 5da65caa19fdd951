"""convert_to_block_scaled: which linears are swapped, and the report naming every kept one and why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mixprec.blockscale import (BlockScaledLinear, convert_to_block_scaled, find_blocks, get_block_recipe,
                                plan_block_conversion)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    """embed -> 7 blocks -> head (10 classes: not a multiple of 16), and an odd-sized probe registered last."""

    def __init__(self, n_blocks: int = 7):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
        self.heads = nn.ModuleList([nn.Linear(64, 16)])  # a second ModuleList, with fewer linears
        self.head = nn.Linear(64, 10)
        self.probe = nn.Linear(48, 64)


def _kept(report) -> dict[str, str]:
    return dict(report.kept)


def test_nvfp4_keeps_first_last_the_tail_and_bad_shapes_and_names_why():
    model = Tiny()
    report = convert_to_block_scaled(model, "nvfp4")
    assert report.blocks == "layers" and report.tail == ("layers.5", "layers.6")  # ceil(7 * 0.15) = 2
    kept = _kept(report)
    assert set(kept) == {"embed", "layers.5.up", "layers.5.down", "layers.6.up", "layers.6.down", "head", "probe"}
    assert kept["embed"].startswith("first Linear of the network")
    assert "in the bf16 tail: the last 2 of 7 blocks of 'layers'" in kept["layers.6.down"]
    assert kept["head"] == "shape: out_features=10 not a multiple of 16 (16x16 2D weight blocks)"
    assert kept["probe"].startswith("last Linear of the network") and "in_features=48" not in kept["probe"]
    converted = [f"layers.{i}.{p}" for i in range(5) for p in ("up", "down")] + ["heads.0"]
    assert report.converted == tuple(converted)
    for index, name in enumerate(converted):
        module = model.get_submodule(name)
        assert isinstance(module, BlockScaledLinear) and module.index == index
    for name in kept:
        assert type(model.get_submodule(name)) is nn.Linear
    text = str(report)
    assert all(name in text for name in converted + list(kept)) and "11 converted, 7 kept" in text


def test_every_reason_is_listed_and_the_filter_applies_on_top():
    model = Tiny()
    report = convert_to_block_scaled(model, "mxfp8", lambda module, name: not name.startswith("layers.2"))
    kept = _kept(report)
    assert kept["layers.2.up"] == "rejected by module_filter"
    assert report.tail == () and "layers.6.down" in report.converted  # no tail in mxfp8
    assert "head" in report.converted  # 1D blocks: N = 10 is padded in dgrad
    probe = kept["probe"].split("; ")
    assert probe[0].startswith("last Linear") and probe[1] == "shape: in_features=48 not a multiple of " \
                                                             "mxfp8_e4m3's block size 32"


def test_the_parameter_objects_survive_conversion():
    torch.manual_seed(0)
    model = Tiny()
    params = list(model.parameters())
    convert_to_block_scaled(model, "mxfp8")
    assert list(model.parameters()) == params  # the same objects, in the same order


def test_without_a_module_list_each_linear_is_a_block():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), *[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 16))
    recipe = dataclasses.replace(get_block_recipe("nvfp4"), bf16_tail_fraction=0.25)
    report = convert_to_block_scaled(model, recipe)
    assert report.blocks is None and report.tail == ("7", "8")  # ceil(8 * 0.25) = 2 of the 8 linears (1 is ReLU)
    kept = _kept(report)
    assert "in the bf16 tail: the last 2 of 8 linears (no nn.ModuleList of blocks found)" in kept["7"]
    assert kept["8"].startswith("last Linear") and "bf16 tail" in kept["8"]
    assert report.converted == ("2", "3", "4", "5", "6")


def test_blocks_can_be_named_and_must_be_a_container():
    model = Tiny()
    assert find_blocks(model) == "layers"
    report = convert_to_block_scaled(model, dataclasses.replace(get_block_recipe("nvfp4"), bf16_tail_fraction=0.5),
                                     blocks="heads")
    assert report.tail == ("heads.0",) and "bf16 tail" in _kept(report)["heads.0"]
    with pytest.raises(ValueError, match="blocks='embed' is a Linear"):
        convert_to_block_scaled(Tiny(), "nvfp4", blocks="embed")


def test_keep_first_last_off_and_subclasses_and_the_root():
    class Sub(nn.Linear):
        pass

    model = nn.Sequential(Sub(32, 32), nn.Linear(32, 32))
    report = convert_to_block_scaled(model, dataclasses.replace(get_block_recipe("mxfp8"), keep_first_last=False))
    assert report.converted == ("1",) and "Sub is a subclass of nn.Linear" in _kept(report)["0"]
    root = nn.Linear(32, 32)
    kept = _kept(convert_to_block_scaled(root, "mxfp8"))
    assert "root module cannot be replaced" in kept[""]


def test_a_converted_model_trains_a_step():
    model = Tiny()
    convert_to_block_scaled(model, "nvfp4")
    x = torch.randn(24, 32)
    h = model.embed(x)
    for block in model.layers:
        h = block(h)
    model.head(h).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.layers.parameters())


def test_keep_patterns_keep_the_linears_they_name_or_hold_and_say_which_pattern():
    model = Tiny()
    report = convert_to_block_scaled(model, "mxfp8", keep=("layers.1.*", "layers.3"))
    kept = _kept(report)
    assert kept["layers.1.up"] == ("kept by block_keep pattern 'layers.1.*' (the policy's list of linears to keep in "
                                   "the compute dtype)")
    assert kept["layers.3.down"].startswith("kept by block_keep pattern 'layers.3' ")   # a module holding it
    assert type(model.layers[1].up) is nn.Linear and type(model.layers[3].down) is nn.Linear
    assert isinstance(model.layers[2].up, BlockScaledLinear) and "layers.2.up" in report.converted


def test_a_keep_pattern_that_matches_no_linear_is_refused_before_any_swap():
    model = Tiny()
    with pytest.raises(ValueError, match=r"block_keep pattern\(s\) \['layers\.9\.\*'\] match no nn.Linear of the "
                                         r"model nor a module holding one; its linears are \['embed', 'layers.0.up', "):
        convert_to_block_scaled(model, "mxfp8", keep=("layers.1.up", "layers.9.*"))
    assert not any(isinstance(m, BlockScaledLinear) for m in model.modules())
    with pytest.raises(TypeError, match=r"keep='layers.1' must be a tuple of non-empty glob patterns"):
        convert_to_block_scaled(model, "mxfp8", keep="layers.1")


def test_the_plan_is_the_conversions_report_and_swaps_nothing():
    model = Tiny()
    plan = plan_block_conversion(model, "nvfp4", keep=("layers.0",))
    assert not any(isinstance(m, BlockScaledLinear) for m in model.modules())
    assert convert_to_block_scaled(model, "nvfp4", keep=("layers.0",)) == plan
    assert "layers.0.up" not in plan.converted and "layers.1.up" in plan.converted
