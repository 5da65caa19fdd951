"""BlockRecipe: the presets' defaults as their sources state them, lookup, validation, derived formats."""

from __future__ import annotations

import dataclasses

import pytest

from mixprec.blockscale import BLOCK_RECIPES, GEMMS, RECIPE_PARTS, BlockRecipe, get_block_recipe
from mixprec.blockscale.recipe import recipe_parts
from mixprec.formats import get_block_format


def test_gemms_quantize_each_operand_along_the_contraction():
    assert GEMMS == {"forward": (("x", "K"), ("W", "K")), "dgrad": (("dy", "N"), ("W", "N")),
                     "wgrad": (("dy", "M"), ("x", "M"))}


def test_mxfp8_is_torchaos_e4m3_everywhere_with_rceil_scales():
    r = get_block_recipe("mxfp8")
    for operand in ("x", "W", "dy"):
        fmt = r.operand_format(operand)
        assert (fmt.element.name, fmt.block_size, fmt.scale_format, fmt.scale_rounding) == ("e4m3", 32, "e8m0", "rceil")
        assert r.rounding(operand) == "nearest"
    assert (r.weight_blocks, r.hadamard, r.stochastic_rounding, r.bf16_tail_fraction, r.keep_first_last) == \
        ("1d", False, False, 0.0, True)
    assert r.quantized_gemms == ("forward", "dgrad", "wgrad")


def test_nvfp4_is_transformer_engines_recipe_with_torchtitans_tail():
    r = get_block_recipe("nvfp4")
    assert all(r.operand_format(o) == get_block_format("nvfp4") for o in ("x", "W", "dy"))
    assert (r.weight_blocks, r.hadamard, r.hadamard_size, r.stochastic_rounding) == ("2d", True, 16, True)
    assert (r.bf16_tail_fraction, r.keep_first_last) == (0.15, True)
    assert [r.rounding(o) for o in ("x", "W", "dy")] == ["nearest", "nearest", "stochastic"]
    tile = r.weight_tile_format()
    assert (tile.block_size, tile.element.name, tile.scale_format, tile.tensor_scale) == (256, "e2m1", "e4m3", True)


def test_nvfp4_plain_drops_exactly_the_transform_the_rounding_and_the_tail():
    full, plain = get_block_recipe("nvfp4"), get_block_recipe("nvfp4-plain")
    differing = {f.name for f in dataclasses.fields(BlockRecipe) if getattr(full, f.name) != getattr(plain, f.name)}
    assert differing == {"name", "hadamard", "stochastic_rounding", "bf16_tail_fraction"}
    assert (plain.hadamard, plain.stochastic_rounding, plain.bf16_tail_fraction) == (False, False, 0.0)


def test_lookup_by_name_spelling_or_object():
    assert get_block_recipe("NVFP4_plain") is BLOCK_RECIPES["nvfp4-plain"]
    custom = BlockRecipe(format="mxfp8_e4m3", grad_format="mxfp8_e5m2")
    assert get_block_recipe(custom) is custom
    assert custom.operand_format("dy").element.name == "e5m2" and custom.operand_format("x").element.name == "e4m3"
    with pytest.raises(ValueError, match=r"choose one of \['mxfp8', 'nvfp4', 'nvfp4-plain'\]"):
        get_block_recipe("fp4")
    with pytest.raises(TypeError):
        get_block_recipe(3)


@pytest.mark.parametrize("fields, message", [
    ({"format": "fp7"}, "format='fp7'"),
    ({"grad_format": "nvfp4"}, "blocks of 16"),
    ({"format": "nvfp4", "scale_rounding": "rceil"}, "nvfp4 has e4m3 scales"),
    ({"scale_rounding": "up"}, "scale_rounding='up'"),
    ({"weight_blocks": "3d"}, "weight_blocks='3d'"),
    ({"hadamard_size": 8}, "power of 4"),
    ({"hadamard": True, "format": "nvfp4", "hadamard_size": 64}, "does not divide"),
    ({"bf16_tail_fraction": 1.0}, r"\[0, 1\)"),
    ({"quantized_gemms": ("fwd",)}, "quantized_gemms"),
    ({"quantized_gemms": ["forward"]}, "quantized_gemms"),
    ({"seed": -1}, "seed"),
    ({"hadamard": 1}, "hadamard=1"),
])
def test_invalid_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        BlockRecipe(**fields)


def test_operand_names_are_checked():
    with pytest.raises(ValueError, match="operand='w'"):
        get_block_recipe("mxfp8").operand_format("w")


@pytest.mark.parametrize("n, fraction, expected", [(32, 0.15, 5), (12, 0.15, 2), (100, 0.15, 15), (4, 0.15, 1),
                                                   (7, 0.0, 0), (0, 0.15, 0), (20, 0.15, 3)])
def test_the_tail_counts_ceil_of_n_times_the_fraction(n, fraction, expected):
    assert BlockRecipe(bf16_tail_fraction=fraction).tail_blocks(n) == expected


def test_str_names_every_nondefault_choice():
    assert str(get_block_recipe("nvfp4")) == \
        "nvfp4(nvfp4, W=2d, rht16(wgrad), sr(dy), bf16_tail=0.15, first/last kept)"
    assert "gemms=forward+dgrad" in str(BlockRecipe(quantized_gemms=("forward", "dgrad")))


@pytest.mark.parametrize("part,field,value", [
    ("hadamard", "hadamard", False), ("sr", "stochastic_rounding", False), ("2d", "weight_blocks", "1d"),
    ("tail", "bf16_tail_fraction", 0.0), ("ends", "keep_first_last", False)])
def test_disable_turns_off_exactly_one_part_of_the_recipe_and_names_it(part, field, value):
    full = get_block_recipe("nvfp4")
    off = get_block_recipe("nvfp4", disable=(part,))
    differing = {f.name for f in dataclasses.fields(BlockRecipe) if getattr(full, f.name) != getattr(off, f.name)}
    assert differing == {"name", field} and getattr(off, field) == value
    assert off.name == f"nvfp4 without {part}" and part not in recipe_parts(off)
    assert recipe_parts(full) == tuple(RECIPE_PARTS)


def test_disabling_the_transform_the_rounding_and_the_tail_is_the_plain_recipe_under_another_name():
    off = get_block_recipe("nvfp4", disable=("tail", "sr", "hadamard"))
    assert off.name == "nvfp4 without hadamard+sr+tail"   # canonical order, whatever the order asked
    assert dataclasses.replace(off, name="nvfp4-plain") == BLOCK_RECIPES["nvfp4-plain"]
    assert get_block_recipe("mxfp8", disable=()) is BLOCK_RECIPES["mxfp8"]


@pytest.mark.parametrize("recipe,disable,error,match", [
    ("mxfp8", ("sr",), ValueError, r"block recipe disable part 'sr' is not on in recipe 'mxfp8'; recipe 'mxfp8' "
                                   r"has ends to disable"),
    ("nvfp4", ("rht",), ValueError, r"part 'rht' is not a recipe part; recipe 'nvfp4' has hadamard, sr, 2d, tail, "
                                    r"ends to disable"),
    ("nvfp4", ("sr", "sr"), ValueError, r"part 'sr' is repeated"),
    ("nvfp4", "sr", TypeError, r"disable='sr' must be a tuple of part names"),
])
def test_disable_refuses_what_the_recipe_does_not_have(recipe, disable, error, match):
    with pytest.raises(error, match=match):
        get_block_recipe(recipe, disable=disable)
