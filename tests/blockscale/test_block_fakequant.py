"""The GEMM operands' fast path, fake_quantize, against quantize().dequantize(), bit for bit.

quantize() is checked against the specs' independent reference in test_block_quantize.py. Here the fast path must
give the same fp32 values (the sign of zero included; NaN where they are NaN), draw the same random bits and leave
a generator in the same state, for every format, rounding, input dtype and layout the linears use.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from block_emulation import butterfly_rht, operand
from block_emulation import weight_tiles as tile_by_tile
from blockscale_checks import FP32_MAX, magnitudes, mx_adversarial, nvfp4_adversarial
from mixprec.blockscale import fake_quantize, hadamard_transform, quantize, random_signs
from mixprec.blockscale.gemm import gemm_operand, weight_tiles
from mixprec.formats import BLOCK_FORMATS, get_block_format

FORMATS = [(name, r) for name, f in BLOCK_FORMATS.items() for r in (("floor", "rceil") if f.is_mx else ("nearest",))]
ROUNDINGS = ["nearest", "stochastic"]


def _format(name: str, scale_rounding: str):
    return dataclasses.replace(get_block_format(name), scale_rounding=scale_rounding)


def assert_same(fast: torch.Tensor, slow: torch.Tensor, what: str = "") -> None:
    """fp32, the same shape, NaN at the same places and every other value the same bits."""
    assert fast.dtype == torch.float32 and fast.shape == slow.shape, what
    nan = torch.isnan(slow)
    assert torch.equal(torch.isnan(fast), nan), f"{what}: NaN positions differ"
    differ = (fast.view(torch.int32) != slow.view(torch.int32)) & ~nan
    assert not differ.any(), (f"{what}: {int(differ.sum())} values differ, e.g. {fast[differ][:4].tolist()} vs "
                              f"{slow[differ][:4].tolist()}")


def check(x: torch.Tensor, fmt, rounding: str = "nearest", seed: int = 0, **kwargs) -> torch.Tensor:
    """fake_quantize(x) equals quantize(x).dequantize(); with stochastic rounding from two generators seeded
    alike, which end in the same state. Returns the fast values."""
    generators = [torch.Generator().manual_seed(seed) for _ in range(2)] if rounding == "stochastic" else [None] * 2
    fast = fake_quantize(x, fmt, rounding=rounding, generator=generators[0], **kwargs)
    slow = quantize(x, fmt, rounding=rounding, generator=generators[1], **kwargs).dequantize()
    assert_same(fast, slow, f"{fmt.name} {rounding} {x.dtype}")
    if rounding == "stochastic":
        assert torch.equal(generators[0].get_state(), generators[1].get_state())
    return fast


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name, scale_rounding", FORMATS)
def test_random_tensors_of_every_dtype_match(name, scale_rounding, rounding):
    fmt, generator = _format(name, scale_rounding), torch.Generator().manual_seed(len(name))
    wide = magnitudes((14, 3, 64), generator)                      # 1e-30 .. 1e30 and fp32's whole range
    check(wide, fmt, rounding, seed=1)
    check(wide.bfloat16(), fmt, rounding, seed=2)
    check((torch.randn(6, 64, generator=generator) * 300).half(), fmt, rounding, seed=3)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name, scale_rounding", [f for f in FORMATS if f[0] != "nvfp4"])
def test_mx_adversarial_blocks_match(name, scale_rounding, rounding):
    fmt = _format(name, scale_rounding)
    out = check(mx_adversarial(fmt), fmt, rounding)
    assert torch.isnan(out[7:10]).all() and torch.equal(out[1].view(torch.int32), torch.full((32,), -2 ** 31,
                                                                                                dtype=torch.int32))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_nvfp4_adversarial_blocks_and_tensor_amax_edges_match(rounding):
    fmt = get_block_format("nvfp4")
    check(nvfp4_adversarial(), fmt, rounding)
    above = torch.tensor([[2700.0, -2687.0] + [100.0] * 14, [3.0] * 16, [1e6] + [1.0] * 15])
    for amax in (2688.0, 10.0, 1e-30):                              # blocks above a given tensor amax saturate
        check(above, fmt, rounding, tensor_amax=torch.tensor(amax))
    for amax in (0.0, 1e-42, FP32_MAX, float("nan")):               # tensor scales 1.0, tiny, huge
        check(torch.tensor([[amax] + [0.0] * 14 + [-amax / 3]]), fmt, rounding)
    single = dataclasses.replace(fmt, tensor_scale=False)           # one-level E4M3 scales
    check(nvfp4_adversarial(), single, rounding)


def _sweep(element) -> torch.Tensor:
    """fp32 values densely around ``element``'s grid: every exponent from below its subnormals to its top binade,
    all 2**12 top mantissa patterns (the rounding bit and the ties of every element format are in them) and the
    low 11 bits at 0, 1, half and all ones (ties, just above and below them); plus fp32 subnormals."""
    exponents = torch.arange(element.emin - element.mantissa_bits - 3, element.emax + 1)
    top = torch.arange(2 ** 12) << 11
    low = torch.tensor([0, 1, 0x3FF, 0x400, 0x401, 0x7FF])
    bits = ((exponents + 127).reshape(-1, 1, 1) << 23) + top.reshape(1, -1, 1) + low.reshape(1, 1, -1)
    subnormals = torch.randint(1, 2 ** 23, (4096,), generator=torch.Generator().manual_seed(0))
    return torch.cat([bits.flatten(), subnormals]).to(torch.int32).view(torch.float32)


def _thresholds(values: torch.Tensor, element) -> torch.Tensor:
    """``floor(frac(|v| / ulp) * 2**32)`` in fp64 (exact), the ulp ``2**(max(floor(log2 |v|), emin) - m)``."""
    a = values.double().abs()
    exponent = torch.frexp(a).exponent - 1
    ulp = torch.exp2((exponent.clamp(min=element.emin) - element.mantissa_bits).double())
    t = a / ulp
    return torch.floor((t - torch.floor(t)) * 2.0 ** 32).to(torch.int64)


@pytest.mark.parametrize("name", [n for n, f in BLOCK_FORMATS.items() if f.is_mx])
def test_dense_sweep_under_a_unit_scale_rounds_as_quantize(name):
    """Blocks led by ``2**emax`` get the E8M0 scale 1, so the sweep meets the element grid itself: nearest even,
    and stochastic with bits one below, at and one above each value's threshold (the comparison's edges)."""
    fmt = get_block_format(name)
    element = fmt.element
    values = _sweep(element)
    values = torch.cat([values, -values])
    lead = float(2 ** element.emax)
    rows = values[: values.numel() // 31 * 31].reshape(-1, 31)
    x = torch.cat([torch.full((rows.shape[0], 1), lead), rows], dim=1)
    assert (quantize(x, fmt).scale_codes == 127).all()
    check(x, fmt)
    thresholds = _thresholds(x, element)
    for delta in (-1, 0, 1):
        bits = (thresholds + delta).clamp(0, 2 ** 32 - 1)
        fast = fake_quantize(x, fmt, rounding="stochastic", random_bits=bits)
        assert_same(fast, quantize(x, fmt, rounding="stochastic", random_bits=bits).dequantize(), f"delta {delta}")


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "nvfp4"])
def test_a_transposed_input_matches_and_keeps_its_layout(name, rounding):
    fmt = get_block_format(name)
    stored = torch.randn(96, 40, generator=torch.Generator().manual_seed(7)) * 10
    stored[5, 3], stored[40, 7], stored[70:80, 9] = float("nan"), -float("inf"), 0.0
    for x in (stored.t(), stored.bfloat16().t()):                   # (40, 96), its K = 96 down the columns
        out = check(x, fmt, rounding, seed=4)
        assert out.t().is_contiguous()


def _tiles_through_quantize(w: torch.Tensor, tile_fmt, side: int) -> torch.Tensor:
    """Each ``side x side`` tile copied out as one block of ``side**2``, quantize().dequantize(), put back."""
    n, k = w.shape
    tiles = w.reshape(n // side, side, k // side, side).transpose(1, 2).reshape(n // side, k // side, -1)
    values = quantize(tiles, tile_fmt).dequantize()
    return values.reshape(n // side, k // side, side, side).transpose(1, 2).reshape(n, k)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4"])
def test_2d_weight_tiles_match_the_tile_by_tile_reference(name):
    """weight_tiles quantizes the tiles as a view of W; against block_emulation's tiles cut one by one, and (with a
    NaN tile, whose NVFP4 tensor amax that emulation does not mask) against the tiles copied out and quantized."""
    fmt = get_block_format(name)
    side = fmt.block_size
    tile_fmt = dataclasses.replace(fmt, block_size=side * side)
    w = torch.randn(2 * side, 3 * side, generator=torch.Generator().manual_seed(8))
    w[:side, :side] *= 1e4                                          # a loud tile sets the NVFP4 tensor scale
    w[side:, side:2 * side] = 0.0                                   # an all-zero tile
    w[side:, 2 * side:] *= 1e-9                                     # a quiet tile: NVFP4 block scale near 0
    assert_same(weight_tiles(w, tile_fmt, side), tile_by_tile(w, fmt), name)
    w[side + 1, 2 * side + 3] = float("nan")                       # a NaN tile
    assert_same(weight_tiles(w, tile_fmt, side), _tiles_through_quantize(w, tile_fmt, side), name)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4"])
def test_gemm_operands_match_the_reference_emulation_in_every_layout(name, rounding):
    """gemm_operand (padding, transform, fast quantizer, transposed layouts kept) against block_emulation's
    operand (concatenated zeros, the butterflies as index pairs, quantize().dequantize())."""
    fmt = get_block_format(name)
    signs = random_signs(16, 3)
    stored = torch.randn(40, 72, generator=torch.Generator().manual_seed(9)).bfloat16()
    for t in (stored, stored.t(), stored[:, :64], stored[:, :64].t()):   # C = 72, 40, 64, 40: padded or not
        for s in (None, signs):
            fast_gen, slow_gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
            sr = rounding == "stochastic"
            fast = gemm_operand(t, fmt, rounding=rounding, generator=fast_gen if sr else None, signs=s)
            slow = operand(t, fmt, rounding=rounding, generator=slow_gen if sr else None, signs=s)
            assert_same(fast, slow, f"{tuple(t.shape)} stride {t.stride()} signs {s is not None}")
            assert torch.equal(fast_gen.get_state(), slow_gen.get_state())


def test_the_hadamard_transform_keeps_its_bits_in_every_layout():
    signs = random_signs(16, 5)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(12))
    expected = butterfly_rht(x, signs)                              # along the last dim, as index pairs
    assert_same(hadamard_transform(x, signs), expected)
    assert_same(hadamard_transform(x.t().contiguous().t(), signs), expected)        # stored transposed
    assert_same(hadamard_transform(x.t(), signs, dim=0).t(), expected)              # along dim 0
    assert_same(hadamard_transform(x.bfloat16(), signs), butterfly_rht(x.bfloat16(), signs))


def test_arguments_are_refused_as_quantize_refuses_them():
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="x is torch.float64"):
        fake_quantize(x.double(), "mxfp8")
    with pytest.raises(ValueError, match="block size 32"):
        fake_quantize(x[:, :20], "mxfp8")
    with pytest.raises(ValueError, match="rounding='up'"):
        fake_quantize(x, "mxfp8", rounding="up")
    with pytest.raises(ValueError, match="exactly one of random_bits"):
        fake_quantize(x, "mxfp8", rounding="stochastic")
    with pytest.raises(ValueError, match="tensor_amax is for formats with a tensor scale"):
        fake_quantize(x, "mxfp8", tensor_amax=torch.tensor(1.0))


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_overflowing_fp8_variants_match_through_quantize(name):
    fmt = dataclasses.replace(get_block_format(name), saturate=False)
    for rounding in ROUNDINGS:
        out = check(mx_adversarial(fmt), fmt, rounding)
        assert not math.isfinite(out[12].abs().max().item())   # the saturation block overflows instead


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4"])
def test_inductor_compiles_the_fast_path_to_the_same_bits(name):
    """A model compiled with inductor runs fake_quantize in generated C++ (Triton on CUDA), built with
    -fno-signed-zeros: the magic-number rounding, the signed zeros and the NaN blocks must survive it. Slow:
    ~20 s of compilation per format on a small CPU."""
    torch._dynamo.reset()
    fmt = get_block_format(name)
    x = torch.cat([torch.randn(2, 32) * 100, mx_adversarial(get_block_format("mxfp8_e4m3"))[:12]])
    bits = torch.randint(0, 2 ** 32, x.shape, dtype=torch.int64)

    def both(x, bits):
        return fake_quantize(x, fmt), fake_quantize(x, fmt, rounding="stochastic", random_bits=bits)

    for eager, compiled in zip(both(x, bits), torch.compile(both, backend="inductor")(x, bits)):
        assert_same(compiled, eager, name)
