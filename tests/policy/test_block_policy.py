"""Block-scaled policies as data: the ``block`` field, the presets ``mxfp8-mixed`` / ``nvfp4-mixed``, the ablation
override, the canonical text and the refusals. The engine running them is tests/blockscale/test_block_presets.py's."""

import pytest
import torch

from mixprec import blockscale
from mixprec.blockscale.recipe import recipe_parts
from mixprec.policy.choices import BLOCK_RECIPE_NAMES, BLOCK_RECIPE_PARTS
from mixprec.policy.policy import PRESETS, Policy
from mixprec.policy.text import text_items


def test_the_policy_layers_recipe_names_are_blockscales_recipes():
    assert BLOCK_RECIPE_NAMES == tuple(blockscale.BLOCK_RECIPES)


@pytest.mark.parametrize("name,block", [("mxfp8-mixed", "mxfp8"), ("nvfp4-mixed", "nvfp4")])
def test_block_presets_are_bf16_mixed_plus_the_recipe(name, block):
    preset = PRESETS[name]
    assert preset == PRESETS["bf16-mixed"].replace(block=block)
    assert preset.block == block and preset.fp8 is None and preset.bytes_per_param() == 16
    assert str(preset) == name and Policy.parse(name) == preset
    assert f"eligible linears block-scaled ({block} recipe)" in preset.summary()


@pytest.mark.parametrize("text,block,canonical", [
    ("nvfp4-mixed,block=nvfp4-plain", "nvfp4-plain", "nvfp4-mixed,block=nvfp4-plain"),   # the ablation
    ("nvfp4-mixed,block=NVFP4_plain", "nvfp4-plain", "nvfp4-mixed,block=nvfp4-plain"),
    ("bf16-mixed,block=mxfp8", "mxfp8", "mxfp8-mixed"),
    ("nvfp4-mixed,block=none", None, "bf16-mixed"),
    ("mxfp8-mixed,keep_fp32=head", "mxfp8", "mxfp8-mixed,keep_fp32=head"),
    ("bf16-sr,block=nvfp4", "nvfp4", "bf16-sr,block=nvfp4"),               # bf16 params compute in bf16: allowed
    ("bf16-pure,block=mxfp8", "mxfp8", "bf16-pure,block=mxfp8"),
    ("params=fp32,compute=bf16,block=nvfp4", "nvfp4", "nvfp4-mixed"),
])
def test_block_text_parses_and_prints_back(text, block, canonical):
    policy = Policy.parse(text)
    assert policy.block == block
    assert str(policy) == canonical and Policy.parse(str(policy)) == policy


def test_the_long_form_names_the_block_recipe():
    long_form = ",".join(f"{k}={v}" for k, v in text_items(PRESETS["nvfp4-mixed"]))
    assert "block=nvfp4" in long_form and Policy.parse(long_form) == PRESETS["nvfp4-mixed"]
    assert ("block", "none") in text_items(PRESETS["bf16-mixed"])


@pytest.mark.parametrize("text,match", [
    ("bf16-mixed,block=nvfp5", r"policy key block='nvfp5' is not allowed \(did you mean 'nvfp4'\?\); choose one of "
                               r"\('mxfp8', 'nvfp4', 'nvfp4-plain'\) .* or none"),
    ("bf16-mixed,block=mxfp6", r"block='mxfp6' is not allowed"),
    ("nvfp4-mixed,fp8=tensorwise", r"Policy block='nvfp4' with fp8='tensorwise': a linear runs block-scaled or in "
                                   r"fp8, not both; set fp8=none \(e.g. 'nvfp4-mixed'\) or block=none"),
    ("fp8-mixed,block=mxfp8", r"block='mxfp8' with fp8='tensorwise'.*set fp8=none \(e.g. 'mxfp8-mixed'\)"),
    ("fp32,block=mxfp8", r"Policy block='mxfp8' with compute=fp32: block-scaled linears are offered under bf16 "
                         r"compute only.*set compute=bf16 \(e.g. 'mxfp8-mixed'\)"),
    ("fp16-mixed,block=nvfp4-plain", r"block='nvfp4-plain' with compute=fp16.*'nvfp4-mixed,block=nvfp4-plain'"),
    ("nvfp4-mixed,compute=fp16", r"block='nvfp4' with compute=fp16"),
    ("nvfp4-mixed,block=mxfp8,block=nvfp4", r"sets block twice"),
])
def test_block_refusals_name_the_argument_the_value_and_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(text)


def test_block_refusals_in_python_too():
    with pytest.raises(ValueError, match=r"Policy block='mxfp4' is not allowed; choose None \(text block=none\) or "
                                         r"one of \('mxfp8', 'nvfp4', 'nvfp4-plain'\)"):
        Policy(compute_dtype=torch.bfloat16, block="mxfp4")
    with pytest.raises(ValueError, match="compute=fp32"):
        PRESETS["nvfp4-mixed"].replace(compute_dtype=torch.float32)
    assert PRESETS["nvfp4-mixed"].replace(block=None) == PRESETS["bf16-mixed"]


def test_block_keep_names_linears_kept_in_bf16_and_round_trips():
    policy = Policy.parse("nvfp4-mixed,block_keep=blocks.*.fc|head")
    assert policy.block_keep == ("blocks.*.fc", "head") and policy.block == "nvfp4"
    assert str(policy) == "nvfp4-mixed,block_keep=blocks.*.fc|head" and Policy.parse(str(policy)) == policy
    assert "eligible linears block-scaled (nvfp4 recipe; block_keep blocks.*.fc|head)" in policy.summary()
    long_form = ",".join(f"{k}={v}" for k, v in text_items(policy))
    assert "block_keep=blocks.*.fc|head" in long_form and Policy.parse(long_form) == policy
    assert "block_keep" not in dict(text_items(PRESETS["nvfp4-mixed"]))   # the presets' text is unchanged


@pytest.mark.parametrize("text,error,match", [
    ("bf16-mixed,block_keep=head", ValueError, r"Policy block_keep='head' keeps linears out of block scaling, but "
                                               r"block=none: set block \(e.g. 'nvfp4-mixed,block_keep=...'\)"),
    ("nvfp4-mixed,block=none,block_keep=head", ValueError, r"but block=none"),
])
def test_block_keep_needs_a_block_recipe(text, error, match):
    with pytest.raises(error, match=match):
        Policy.parse(text)


def test_block_keep_refusals_in_python():
    with pytest.raises(TypeError, match=r"Policy block_keep='head' must be a tuple of non-empty glob strings"):
        PRESETS["nvfp4-mixed"].replace(block_keep="head")
    with pytest.raises(ValueError, match=r"Policy block_keep pattern 'a b' may not contain"):
        PRESETS["nvfp4-mixed"].replace(block_keep=("a b",))


def test_the_policy_layers_recipe_parts_are_what_each_recipe_has_on():
    assert BLOCK_RECIPE_PARTS == {name: recipe_parts(r) for name, r in blockscale.BLOCK_RECIPES.items()}


def test_block_disable_turns_recipe_parts_off_and_round_trips():
    policy = Policy.parse("nvfp4-mixed,block_disable=sr|Hadamard")
    assert policy.block_disable == ("hadamard", "sr") and policy.block == "nvfp4"   # the recipes' order
    assert policy == Policy.parse("nvfp4-mixed,block_disable=hadamard|sr")          # one order, one policy
    assert str(policy) == "nvfp4-mixed,block_disable=hadamard|sr" and Policy.parse(str(policy)) == policy
    assert "block-scaled (nvfp4 recipe without hadamard+sr)" in policy.summary()
    long_form = ",".join(f"{k}={v}" for k, v in text_items(policy))
    assert "block_disable=hadamard|sr" in long_form and Policy.parse(long_form) == policy
    assert Policy.parse("nvfp4-mixed,block_disable=none") == PRESETS["nvfp4-mixed"]
    assert "block_disable" not in dict(text_items(PRESETS["nvfp4-mixed"]))
    assert Policy.parse("mxfp8-mixed,block_disable=ends").block_disable == ("ends",)


@pytest.mark.parametrize("text,match", [
    ("bf16-mixed,block_disable=sr", r"Policy block_disable='sr' turns parts of a block recipe off, but block=none: "
                                    r"set block \(e.g. 'nvfp4-mixed,block_disable=sr'\) or drop it"),
    ("mxfp8-mixed,block_disable=sr", r"Policy block_disable part 'sr' is not a part of recipe block='mxfp8'; "
                                     r"it has ends to turn off \(e.g. block_disable=ends\)"),
    ("nvfp4-mixed,block=nvfp4-plain,block_disable=hadamard", r"'hadamard' is not a part of recipe "
                                                             r"block='nvfp4-plain'; it has 2d\|ends"),
    ("nvfp4-mixed,block_disable=sr|sr", r"part 'sr' is named twice; name each part once"),
    ("nvfp4-mixed,block_disable=rht", r"part 'rht' is not a part of recipe block='nvfp4'; it has "
                                      r"hadamard\|sr\|2d\|tail\|ends"),
])
def test_block_disable_refusals_name_the_part_the_recipe_and_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(text)


def test_block_disable_refusals_in_python():
    with pytest.raises(TypeError, match=r"Policy block_disable='sr' must be a tuple of recipe parts"):
        PRESETS["nvfp4-mixed"].replace(block_disable="sr")
    assert PRESETS["nvfp4-mixed"].replace(block_disable=("tail",)).block_disable == ("tail",)
