import math

import pytest
import torch

from mixprec.formats import FORMATS, get_format

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
