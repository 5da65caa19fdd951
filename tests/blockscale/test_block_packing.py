"""Packed GEMM operands: every element and scale code round-trips exactly, and an operand packed then unpacked is
gemm_operand's, bit for bit and in its layout, for every block format, input dtype, layout and corner case."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockscale_checks import magnitudes, mx_adversarial, nvfp4_adversarial
from mixprec.blockscale import decode, random_signs
from mixprec.blockscale.gemm import gemm_operand
from mixprec.blockscale.packing import (pack_elements, pack_operand, pack_scales, unpack_elements, unpack_operand,
                                        unpack_scales)
from mixprec.blockscale.scales import E4M3, E8M0_NAN, e8m0_values
from mixprec.formats import BLOCK_FORMATS, ELEMENT_FORMATS, get_block_format

FORMATS = [(name, r) for name, f in BLOCK_FORMATS.items() if f.saturate
           for r in (("floor", "rceil") if f.is_mx else ("nearest",))]


def _format(name: str, scale_rounding: str):
    return dataclasses.replace(get_block_format(name), scale_rounding=scale_rounding)


def _finite_codes(element) -> torch.Tensor:
    """Every code of ``element`` whose value is finite (uint8)."""
    codes = torch.arange(2 ** element.bits, dtype=torch.uint8)
    return codes[torch.isfinite(decode(codes, element))]


def assert_same_operand(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32, the same shape and strides, NaN at the same places and every other value the same bits."""
    assert got.dtype == torch.float32 and got.shape == expected.shape, what
    assert got.stride() == expected.stride(), f"{what}: layout {got.stride()} vs {expected.stride()}"
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    differ = (got.view(torch.int32) != expected.view(torch.int32)) & ~nan
    assert not differ.any(), f"{what}: {int(differ.sum())} values differ, e.g. {got[differ][:4].tolist()}"


@pytest.mark.parametrize("name", list(ELEMENT_FORMATS))
def test_every_finite_element_code_round_trips_exactly(name):
    element = ELEMENT_FORMATS[name]
    codes = _finite_codes(element)
    values = decode(codes, element)                                   # -0.0 and the subnormals included
    packed = pack_elements(values, element)
    if element.bits == 4:                                             # two a byte, the first in the low nibble
        assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() // 2
        assert torch.equal(packed, codes[0::2] | (codes[1::2] << 4))
    elif element.dtype is not None:                                   # FP8: torch's own bits
        assert packed.dtype == element.dtype
        assert torch.equal(packed.view(torch.uint8), values.to(element.dtype).view(torch.uint8))
    else:                                                             # FP6: one a byte
        assert torch.equal(packed, codes)
    back = unpack_elements(packed, element, tuple(codes.shape))
    assert torch.equal(back.view(torch.int32), values.view(torch.int32))


def test_fp4_codes_of_an_odd_count_fill_the_last_byte_with_zero():
    element = ELEMENT_FORMATS["e2m1"]
    values = torch.tensor([[6.0, -0.5, -0.0]])
    packed = pack_elements(values, element)
    assert packed.tolist() == [0x7 | (0x9 << 4), 0x8]
    assert torch.equal(unpack_elements(packed, element, (1, 3)).view(torch.int32), values.view(torch.int32))


def test_every_scale_code_round_trips_and_a_non_finite_scale_packs_as_nan():
    e8m0 = get_block_format("mxfp8_e4m3")
    codes = torch.arange(255, dtype=torch.uint8)                      # 2**-127 (an fp32 subnormal) .. 2**127
    assert torch.equal(pack_scales(e8m0_values(codes), e8m0), codes)
    assert torch.equal(unpack_scales(codes, e8m0).view(torch.int32), e8m0_values(codes).view(torch.int32))
    special = torch.tensor([float("inf"), float("nan")])              # fake_quantize's scale of a NaN/inf block
    assert pack_scales(special, e8m0).tolist() == [E8M0_NAN, E8M0_NAN]
    assert torch.isnan(unpack_scales(pack_scales(special, e8m0), e8m0)).all()
    nvfp4 = get_block_format("nvfp4")
    values = decode(_finite_codes(E4M3), E4M3).abs().unique()         # 0, the subnormals, .. 448
    packed = pack_scales(values, nvfp4)
    assert packed.dtype == torch.float8_e4m3fn
    assert torch.equal(unpack_scales(packed, nvfp4).view(torch.int32), values.view(torch.int32))
    assert torch.isnan(unpack_scales(pack_scales(torch.tensor([float("nan")]), nvfp4), nvfp4)).all()


def _operands(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """``blocks (R, C)`` (blocks along C) as the GEMMs hand operands over: rows, stored transposed (``x.t()``), a
    non-contiguous slice, and with C not a multiple of the block size (padded)."""
    stored = blocks.t().contiguous()
    wide = torch.cat([blocks, blocks], dim=1)
    return {"rows": blocks, "transposed": stored.t(), "slice": wide[:, : blocks.shape[1]],
            "padded": stored.t()[:, 1:]}


def _check_round_trip(blocks: torch.Tensor, fmt, what: str) -> None:
    signs = random_signs(16, 3)
    for layout, t in _operands(blocks).items():
        for transform in (None, signs):
            for dtype in (torch.float32, torch.bfloat16):
                t_in = t.to(dtype)
                got = unpack_operand(pack_operand(t_in, fmt, signs=transform))
                expected = gemm_operand(t_in, fmt, signs=transform)
                assert_same_operand(got, expected, f"{what} {layout} {dtype} rht={transform is not None}")


@pytest.mark.parametrize("name, scale_rounding", FORMATS)
def test_random_operands_unpack_to_gemm_operands_bit_for_bit(name, scale_rounding):
    fmt = _format(name, scale_rounding)
    generator = torch.Generator().manual_seed(len(name))
    wide = magnitudes((7, 64), generator)                             # 1e-30 .. 1e30 and fp32's whole range
    _check_round_trip(wide, fmt, f"{fmt.name} wide")
    tokens = torch.randn(40, 64, generator=generator) * torch.rand(40, 1, generator=generator).exp2()
    _check_round_trip(tokens, fmt, f"{fmt.name} tokens")


@pytest.mark.parametrize("name, scale_rounding", [f for f in FORMATS if f[0] != "nvfp4"])
def test_mx_adversarial_blocks_unpack_to_gemm_operands(name, scale_rounding):
    fmt = _format(name, scale_rounding)
    blocks = mx_adversarial(fmt)                                      # zeros, -0.0, subnormals, NaN/inf blocks, ...
    _check_round_trip(blocks, fmt, fmt.name)
    packed = unpack_operand(pack_operand(blocks, fmt))
    assert torch.isnan(packed[7:10]).all(), "NaN and inf blocks come back all NaN"
    assert torch.equal(packed[1].view(torch.int32), torch.full((32,), -2 ** 31, dtype=torch.int32)), "-0.0"


def test_nvfp4_adversarial_blocks_unpack_to_gemm_operands():
    fmt = get_block_format("nvfp4")
    blocks = nvfp4_adversarial()
    _check_round_trip(blocks, fmt, "nvfp4")
    packed = unpack_operand(pack_operand(blocks, fmt))
    assert torch.isnan(packed[7:10]).all(), "NaN and inf blocks come back all NaN"
    assert torch.equal(packed[6].view(torch.int32), torch.full((16,), -2 ** 31, dtype=torch.int32)), "-0.0"


@pytest.mark.parametrize("name, elements_bytes", [("mxfp8_e4m3", 1.0), ("mxfp6_e2m3", 1.0), ("mxfp4_e2m1", 0.5),
                                                  ("nvfp4", 0.5)])
def test_the_packed_bytes_are_the_formats(name, elements_bytes):
    """Elements, one scale byte a block, NVFP4's 4-byte tensor scale: for an operand of 40 x 100, padded to whole
    blocks (112 columns for NVFP4's 16, 128 for MX's 32)."""
    fmt = get_block_format(name)
    packed = pack_operand(torch.randn(40, 100), fmt)
    numel = 40 * -(-100 // fmt.block_size) * fmt.block_size
    expected = numel * elements_bytes + numel // fmt.block_size + (4 if fmt.tensor_scale else 0)
    assert packed.nbytes == expected


def test_a_format_that_overflows_is_refused():
    fmt = dataclasses.replace(get_block_format("mxfp8_e4m3"), saturate=False)
    with pytest.raises(ValueError, match=r"mxfp8_e4m3 overflows to inf/NaN \(saturate=False\)"):
        pack_operand(torch.randn(4, 32), fmt)
