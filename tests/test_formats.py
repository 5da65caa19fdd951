import dataclasses
import math

import pytest
import torch

from mixprec.formats import (BLOCK_FORMATS, ELEMENT_FORMATS, FORMATS, BlockFormat, ElementFormat, get_block_format,
                             get_format)

FP8 = ["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz"]


def _all_finite_values(fmt):
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).to(torch.float64)
    return values[torch.isfinite(values)]


@pytest.mark.parametrize("name", FP8)
def test_fp8_limits_match_enumeration(name):
    fmt = get_format(name)
    values = _all_finite_values(fmt)
    positive = values[values > 0]
    assert fmt.max == positive.max().item()
    assert fmt.smallest_subnormal == positive.min().item()
    normals = positive[positive >= fmt.smallest_normal]
    subnormals = positive[positive < fmt.smallest_normal]
    # the subnormal range is evenly spaced by smallest_subnormal, and the normal range starts right after it
    assert torch.equal(subnormals, torch.arange(1, len(subnormals) + 1, dtype=torch.float64) * fmt.smallest_subnormal)
    assert normals.min().item() == fmt.smallest_normal
    # spacing just above 1.0 is eps = 2**-mantissa_bits
    assert positive[positive > 1].min().item() - 1.0 == fmt.eps == 2.0 ** -fmt.mantissa_bits


@pytest.mark.parametrize("name,mantissa", [("e4m3fn", 3), ("e4m3fnuz", 3), ("e5m2", 2), ("e5m2fnuz", 2),
                                           ("fp16", 10), ("bf16", 7), ("fp32", 23)])
def test_mantissa_bits(name, mantissa):
    assert get_format(name).mantissa_bits == mantissa


def test_finfo_eps_is_wrong_for_e5m2fnuz_and_we_do_not_use_it():
    # torch.finfo reports 0.125 for e5m2fnuz; the format has 2 mantissa bits, spacing 0.25 at 1.0
    assert torch.finfo(torch.float8_e5m2fnuz).eps == 0.125
    assert get_format("e5m2fnuz").eps == 0.25


@pytest.mark.parametrize("name", FP8)
def test_ulp_is_spacing_to_next_value_for_every_fp8_value(name):
    fmt = get_format(name)
    values = torch.unique(_all_finite_values(fmt).abs())
    ulps = fmt.ulp(values[:-1].float()).double()
    assert torch.equal(ulps, values[1:] - values[:-1])


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
def test_ulp_matches_nextafter_for_wider_formats(name):
    fmt = get_format(name)
    x = torch.tensor([1.0, 3.0, 1000.0, 1e-3, fmt.smallest_normal, fmt.smallest_normal / 4, 0.0, -2.5])
    x = x.to(fmt.dtype).to(torch.float32)
    expected = []
    for v in x.tolist():
        v_t = torch.tensor(abs(v), dtype=fmt.dtype)
        nxt = torch.nextafter(v_t, torch.tensor(math.inf, dtype=fmt.dtype)) if fmt.dtype != torch.bfloat16 else None
        if nxt is None:  # nextafter has no bf16 kernel on CPU: step the bit pattern
            nxt = (v_t.view(torch.int16) + 1).view(torch.bfloat16)
        expected.append(nxt.float().item() - abs(v))
    assert fmt.ulp(x).tolist() == expected


def test_limits_come_from_finfo():
    for fmt in FORMATS.values():
        assert fmt.max == torch.finfo(fmt.dtype).max
        assert fmt.smallest_normal == torch.finfo(fmt.dtype).smallest_normal


def test_get_format_aliases_and_errors():
    assert get_format("float16") is FORMATS["fp16"]
    assert get_format(torch.bfloat16) is FORMATS["bf16"]
    assert get_format("e4m3").dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="'fp12' is not known; choose one of"):
        get_format("fp12")
    with pytest.raises(ValueError, match="not supported"):
        get_format(torch.int8)


# ---------------------------------------------------------------------- element and block formats
# OCP Microscaling Formats (MX) v1.0, section 5.3 (the FP8/FP6/FP4 element formats): emax, max normal,
# min normal, min subnormal, as the spec's tables state them
MX_SPEC_TABLE = {
    "e4m3": (8, 448.0, 2.0 ** -6, 2.0 ** -9),
    "e5m2": (15, 57344.0, 2.0 ** -14, 2.0 ** -16),
    "e3m2": (4, 28.0, 0.25, 0.0625),
    "e2m3": (2, 7.5, 1.0, 0.125),
    "e2m1": (2, 6.0, 1.0, 0.5),
}


@pytest.mark.parametrize("name", list(MX_SPEC_TABLE))
def test_element_format_limits_are_the_specs(name):
    fmt = ELEMENT_FORMATS[name]
    assert (fmt.emax, fmt.max_normal, fmt.min_normal, fmt.min_subnormal) == MX_SPEC_TABLE[name]
    assert fmt.bits == {"e4m3": 8, "e5m2": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4}[name]
    assert fmt.has_nan == (name in ("e4m3", "e5m2")) and fmt.has_inf == (name == "e5m2")


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_element_formats_agree_with_torch(name):
    fmt = ELEMENT_FORMATS[name]
    finfo = torch.finfo(fmt.dtype)
    assert (fmt.max_normal, fmt.min_normal) == (finfo.max, finfo.smallest_normal)
    assert fmt.min_subnormal == get_format(fmt.dtype).smallest_subnormal


def test_block_format_presets():
    expected = {  # name: element, block size, scale format, scale rounding, tensor scale
        "mxfp8_e4m3": ("e4m3", 32, "e8m0", "floor", False),
        "mxfp8_e5m2": ("e5m2", 32, "e8m0", "floor", False),
        "mxfp6_e2m3": ("e2m3", 32, "e8m0", "floor", False),
        "mxfp6_e3m2": ("e3m2", 32, "e8m0", "floor", False),
        "mxfp4_e2m1": ("e2m1", 32, "e8m0", "floor", False),
        "nvfp4": ("e2m1", 16, "e4m3", "nearest", True),
    }
    got = {n: (f.element.name, f.block_size, f.scale_format, f.scale_rounding, f.tensor_scale)
           for n, f in BLOCK_FORMATS.items()}
    assert got == expected
    assert all(f.saturate for f in BLOCK_FORMATS.values())
    assert get_block_format("MXFP8") is BLOCK_FORMATS["mxfp8_e4m3"]
    assert get_block_format("mxfp4-e2m1").name == "mxfp4_e2m1"
    assert get_block_format(BLOCK_FORMATS["nvfp4"]) is BLOCK_FORMATS["nvfp4"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        BLOCK_FORMATS["nvfp4"].block_size = 32


def test_block_and_element_formats_refuse_bad_fields_by_name():
    with pytest.raises(ValueError, match=r"'fp4'.*\['mxfp4_e2m1', 'mxfp6_e2m3'.*'nvfp4'\]"):
        get_block_format("fp4")
    with pytest.raises(TypeError, match="spec=32"):
        get_block_format(32)
    mx = BLOCK_FORMATS["mxfp8_e4m3"]
    with pytest.raises(ValueError, match=r"scale_rounding='nearest'.*e8m0.*\('floor', 'rceil'\)"):
        dataclasses.replace(mx, scale_rounding="nearest")
    with pytest.raises(ValueError, match=r"scale_rounding='rceil'.*e4m3"):
        dataclasses.replace(BLOCK_FORMATS["nvfp4"], scale_rounding="rceil")
    with pytest.raises(ValueError, match="block_size=0"):
        dataclasses.replace(mx, block_size=0)
    with pytest.raises(ValueError, match="scale_format='ue8m0'"):
        dataclasses.replace(mx, scale_format="ue8m0")
    with pytest.raises(ValueError, match="tensor_scale=True"):
        dataclasses.replace(mx, tensor_scale=True)
    with pytest.raises(ValueError, match="saturate=False with e2m1"):
        dataclasses.replace(BLOCK_FORMATS["mxfp4_e2m1"], saturate=False)
    assert dataclasses.replace(mx, saturate=False, scale_rounding="rceil").scale_rounding == "rceil"
    with pytest.raises(ValueError, match="specials='ieee'"):
        ElementFormat("x", 2, 1, 1, "ieee")
    with pytest.raises(ValueError, match="exponent_bits=6"):
        ElementFormat("x", 6, 2, 31, "none")
    assert isinstance(mx, BlockFormat) and str(mx) == "mxfp8_e4m3" and str(mx.element) == "e4m3"
