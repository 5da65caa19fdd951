"""Block quantization against the independent reference (blockscale_reference.py, written from the specs' text).

Every comparison is exact: element codes, scale codes, and the dequantized values bit for bit (the sign of zero
included; NaN compared as NaN).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import blockscale_reference as ref
from blockscale_checks import (ELEMENTS, FP32_MAX, FP32_TINY, MX, assert_bits_equal, check_mx, check_nvfp4,
                               magnitudes, mx_adversarial, nvfp4_adversarial)
from mixprec.blockscale import decode, dequantize, encode, quantize, round_to_element
from mixprec.formats import BLOCK_FORMATS, ELEMENT_FORMATS, get_block_format

# ---------------------------------------------------------------------- element formats
@pytest.mark.parametrize("name", ELEMENTS)
def test_decode_of_every_code_is_the_bit_field_value(name):
    fmt = ELEMENT_FORMATS[name]
    codes = torch.arange(2 ** fmt.bits, dtype=torch.uint8)
    expected = [float(ref.code_value(name, c)) for c in range(2 ** fmt.bits)]
    expected = [math.copysign(v, -1.0) if (c >> (fmt.bits - 1)) and v == 0 else v for c, v in enumerate(expected)]
    assert_bits_equal(decode(codes, fmt), expected, name)
    if fmt.dtype is not None:   # and torch's own dtype agrees
        assert_bits_equal(decode(codes, fmt), codes.view(fmt.dtype).float().tolist(), f"{name} vs torch")


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_inverts_decode(name):
    fmt = ELEMENT_FORMATS[name]
    codes = torch.arange(2 ** fmt.bits, dtype=torch.uint8)
    values = decode(codes, fmt)
    expected = [ref.code_of(v, name) for v in values.tolist()]
    assert encode(values, fmt).tolist() == expected
    numbers = ~torch.isnan(values)
    assert torch.equal(encode(values, fmt)[numbers], codes[numbers])


def _rounding_probes(name: str) -> list[float]:
    """Grid values, midpoints and near-midpoints (both signs), values beyond max, tiny, fp32 subnormals, specials."""
    grid = [float(v) for v in ref.grid(name)[0]]
    probes = []
    for a, b in zip(grid, grid[1:]):
        mid = (a + b) / 2
        probes += [a, mid, math.nextafter(mid, 0), math.nextafter(mid, math.inf), a + (b - a) / 4]
    top = grid[-1]
    spacing = math.ldexp(1.0, ref.EMAX[name] - ref.SPECS[name][1])
    probes += [top, top + spacing / 2, top + spacing / 2 * 0.999, top + spacing, 2 * top, 1e30, FP32_MAX,
               grid[1] / 2, grid[1] / 4, 1e-30, FP32_TINY, 0.0, math.inf, math.nan]
    probes = [float(torch.tensor(p, dtype=torch.float32)) for p in probes]   # exactly fp32 values
    return probes + [-p for p in probes]


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("name", ELEMENTS)
def test_round_to_nearest_even_matches_the_reference(name, saturate):
    fmt = ELEMENT_FORMATS[name]
    if not saturate and not fmt.has_nan:
        with pytest.raises(ValueError, match="saturate=False"):
            round_to_element(torch.zeros(1), fmt, saturate=False)
        return
    probes = _rounding_probes(name)
    out = round_to_element(torch.tensor(probes, dtype=torch.float32), fmt, saturate=saturate)
    assert_bits_equal(out, [ref.round_nearest(p, name, saturate) for p in probes], name)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_rounding_matches_torchs_own_cast_in_range(name):
    """A second, independent reference for FP8: torch's RNE cast, on values inside ±max_normal."""
    fmt = ELEMENT_FORMATS[name]
    probes = torch.tensor([p for p in _rounding_probes(name) if math.isfinite(p) and abs(p) <= fmt.max_normal])
    probes = torch.cat([probes, torch.randn(4096) * fmt.max_normal / 8, torch.randn(4096) * fmt.min_normal])
    probes = probes.clamp(-fmt.max_normal, fmt.max_normal)
    assert_bits_equal(round_to_element(probes, fmt), probes.to(fmt.dtype).float().tolist(), name)


def test_stochastic_rounding_with_fixed_bits_matches_the_reference():
    generator = torch.Generator().manual_seed(1)
    for name in ELEMENTS:
        fmt = ELEMENT_FORMATS[name]
        probes = torch.tensor(_rounding_probes(name), dtype=torch.float32)
        for bits in (torch.zeros_like(probes, dtype=torch.int64), torch.full_like(probes, -1, dtype=torch.int32),
                     torch.randint(-2 ** 31, 2 ** 31, probes.shape, dtype=torch.int32, generator=generator)):
            out = round_to_element(probes, fmt, random_bits=bits)
            unsigned = (bits.to(torch.int64) & 0xFFFFFFFF).tolist()
            assert_bits_equal(out, [ref.round_stochastic(p, name, r) for p, r in zip(probes.tolist(), unsigned)], name)


# ---------------------------------------------------------------------- MX
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("name", MX)
def test_mx_random_tensors_match_the_reference(name, rounding):
    fmt = dataclasses.replace(get_block_format(name), scale_rounding=rounding)
    generator = torch.Generator().manual_seed(2 * MX.index(name) + (rounding == "rceil"))
    check_mx(magnitudes((7, 2, 64), generator), fmt)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("name", MX)
def testmx_adversarial_blocks_match_the_reference(name, rounding):
    fmt = dataclasses.replace(get_block_format(name), scale_rounding=rounding)
    check_mx(mx_adversarial(fmt), fmt)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_mx_fp8_without_saturation_overflows_like_ofp8(name):
    fmt = dataclasses.replace(get_block_format(name), saturate=False)
    q = check_mx(mx_adversarial(fmt), fmt)
    overflowed = q.dequantize()[12]   # the saturation block: its largest values overflow instead
    assert (torch.isinf(overflowed).any() if fmt.element.has_inf else torch.isnan(overflowed).any())


@pytest.mark.parametrize("name", MX)
def test_mx_special_blocks_as_documented(name):
    fmt = get_block_format(name)
    x = mx_adversarial(fmt)
    q = quantize(x, fmt)
    scales, values = q.scale_codes.flatten(), q.dequantize()
    assert scales[0] == 0 and scales[1] == 0                          # zeros: the smallest scale, 2**-127
    assert torch.equal(values[1].view(torch.int32), x[1].view(torch.int32))   # -0.0 stays -0.0
    assert (scales[7:10] == 255).all() and torch.isnan(values[7:10]).all()   # NaN, +inf, -inf blocks: NaN
    assert (q.codes[7:10] == 0).all()
    assert scales[3] == 127 + 127 - fmt.element.emax                 # fp32 max: floor(log2) = 127
    assert scales[4] == 0 and scales[6] == 0                          # subnormals and below: clamped to -127
    assert torch.equal(q.scale_values()[0], torch.full((1,), 2.0 ** -127))


# ---------------------------------------------------------------------- NVFP4
def test_nvfp4_random_tensors_match_the_reference():
    generator = torch.Generator().manual_seed(4)
    x = magnitudes((7, 64), generator)
    for rows in (x[:7], x[7:], x[2:3], x[5:6], x[:1]):    # per magnitude and mixed: the tensor scale varies
        check_nvfp4(rows)


def test_nvfp4_adversarial_tensor_matches_the_reference():
    q = check_nvfp4(nvfp4_adversarial())
    assert q.tensor_scale.item() == 1.0 and q.scale_codes[1:3].flatten().tolist() == [0x38, 0x01]
    assert (q.scale_codes[7:10] == 0x7F).all() and torch.isnan(q.dequantize()[7:10]).all()
    assert (q.scale_codes[4:7] == 0).all() and (q.codes[4:7] & 0x7 == 0).all()


def test_nvfp4_blocks_above_a_given_tensor_amax_saturate_like_the_reference():
    x = torch.tensor([[2700.0, -2687.0] + [100.0] * 14, [3.0] * 16, [1e6] + [1.0] * 15])
    for amax in (2688.0, 10.0):
        q = check_nvfp4(x, tensor_amax=torch.tensor(amax))
        assert q.scale_codes[0] == 0x7E     # 448: saturated


@pytest.mark.parametrize("amax", [0.0, 1e-42, FP32_MAX, float("nan")])
def test_nvfp4_tensor_scale_edges_match_the_reference(amax):
    x = torch.tensor([[amax] + [0.0] * 14 + [-amax / 3]], dtype=torch.float32)
    check_nvfp4(x)


def test_nvfp4_given_tensor_amax_and_single_level_variant():
    x = torch.randn(4, 32) * 10
    q = quantize(x, "nvfp4", tensor_amax=torch.tensor(x.abs().max().item() * 4))
    assert q.tensor_scale.item() == pytest.approx(x.abs().max().item() * 4 / 2688)
    single = dataclasses.replace(get_block_format("nvfp4"), tensor_scale=False)
    q1 = quantize(x, single)
    assert q1.tensor_scale is None
    expected = round_to_element(x.abs().reshape(4, 2, 16).amax(-1) / torch.full((), 6.0), ELEMENT_FORMATS["e4m3"])
    assert torch.equal(q1.scale_values(), expected)


# ---------------------------------------------------------------------- shapes, arguments, errors
def test_shapes_dtypes_and_input_dtypes():
    x = torch.randn(2, 3, 64)
    for name in BLOCK_FORMATS:
        q = quantize(x, name)
        size = BLOCK_FORMATS[name].block_size
        assert q.shape == x.shape and q.codes.shape == x.shape
        assert q.scale_codes.shape == (2, 3, 64 // size)
        assert dequantize(q).shape == x.shape and dequantize(q).dtype == torch.float32
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(quantize(x.to(dtype), name).codes, quantize(x.to(dtype).float(), name).codes)
    fp8 = quantize(x, "mxfp8_e4m3")
    assert torch.equal(fp8.codes.view(torch.float8_e4m3fn).float(), fp8.element_values())


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"shape \(4, 30\).*block size 32"):
        quantize(torch.randn(4, 30), "mxfp8_e4m3")
    with pytest.raises(ValueError, match=r"shape \(\)"):
        quantize(torch.tensor(1.0), "nvfp4")
    with pytest.raises(TypeError, match="float64"):
        quantize(x.double(), "mxfp4_e2m1")
    with pytest.raises(TypeError, match="int64"):
        quantize(torch.ones(32, dtype=torch.int64), "mxfp4_e2m1")
    with pytest.raises(ValueError, match="mxfp4_e2m1"):
        quantize(x, "fp4")
    with pytest.raises(ValueError, match="rounding='up'"):
        quantize(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match="exactly one of"):
        quantize(x, "nvfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="stochastic"):
        quantize(x, "nvfp4", generator=torch.Generator())
    with pytest.raises(ValueError, match=r"random_bits has shape \(4,\)"):
        quantize(x, "nvfp4", rounding="stochastic", random_bits=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="random_bits has dtype torch.float32"):
        quantize(x, "nvfp4", rounding="stochastic", random_bits=torch.zeros(4, 32))
    with pytest.raises(ValueError, match="tensor_amax"):
        quantize(x, "mxfp8_e4m3", tensor_amax=torch.tensor(1.0))
