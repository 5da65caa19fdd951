"""Stochastic rounding, properties over generated inputs (hypothesis), and torch.compile of the quantizers."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from blockscale_checks import MX, check_mx, check_nvfp4, magnitudes, mx_adversarial
from mixprec.blockscale import quantize
from mixprec.formats import BLOCK_FORMATS, get_block_format


# ---------------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("name", MX)
def test_mx_stochastic_rounding_matches_the_reference(name):
    fmt = get_block_format(name)
    generator = torch.Generator().manual_seed(MX.index(name))
    for x in (magnitudes((7, 64), generator), mx_adversarial(fmt)):
        bits = torch.randint(-2 ** 31, 2 ** 31, x.shape, dtype=torch.int32, generator=generator)
        check_mx(x, fmt, bits)


def test_nvfp4_stochastic_rounding_matches_the_reference():
    generator = torch.Generator().manual_seed(7)
    x = magnitudes((7, 64), generator)
    for rows in (x[:7], x[7:], x[3:4]):
        check_nvfp4(rows, bits=torch.randint(0, 2 ** 32, rows.shape, dtype=torch.int64, generator=generator))


def test_a_generator_draws_the_bits_it_would_be_given():
    x = torch.randn(8, 64)
    for name in BLOCK_FORMATS:
        drawn = quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(3))
        bits = torch.randint(0, 2 ** 32, x.shape, dtype=torch.int64, generator=torch.Generator().manual_seed(3))
        given_bits = quantize(x, name, rounding="stochastic", random_bits=bits)
        assert torch.equal(drawn.codes, given_bits.codes) and torch.equal(drawn.scale_codes, given_bits.scale_codes)
        assert not torch.equal(drawn.codes, quantize(x, name).codes)     # it did round stochastically


# value, block amax fixing the scale, format: the value lies strictly between two representable neighbours
SR_CASES = [
    (2.3, 4.0, "mxfp4_e2m1"),        # between 2 and 3 (normal range), scale 2**0
    (-0.3, 4.0, "mxfp4_e2m1"),       # between -0.5 and 0 (subnormal range)
    (0.1, 7.5, "mxfp6_e2m3"),        # between 0 and 0.125
    (100.7, 256.0, "mxfp8_e4m3"),    # between 96 and 104
    (1e-3, 2.0 ** 15, "mxfp8_e5m2"),  # far below the scale: between 0 and 2**-16
    (2.3, 6.0, "nvfp4"),
    (-4.9, 6.0, "nvfp4"),
]


@pytest.mark.parametrize("value,amax,name", SR_CASES)
def test_stochastic_rounding_is_unbiased(value, amax, name):
    """The mean of N stochastic roundings of a fixed value converges to it.

    Each rounding is the lower or the upper neighbour, ``gap`` apart; their mean has standard deviation
    ``gap * sqrt(p (1 - p) / N) <= gap / (2 sqrt(N))``. The bound asserted is 6 of those (a false failure has
    probability ~2e-9 under the central limit theorem; the seed is fixed besides), and nearest rounding, for
    contrast, is biased by more than it.
    """
    fmt = get_block_format(name)
    rows, n = 8192, fmt.block_size
    x = torch.full((rows, n), value)
    x[:, 0] = amax
    q = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(11))
    samples = q.dequantize()[:, 1:].double()
    lo, hi = samples.min().item(), samples.max().item()
    assert lo <= value <= hi and lo < hi                                 # two neighbours, both drawn
    assert samples.unique().numel() == 2
    bound = 6 * (hi - lo) / (2 * math.sqrt(samples.numel()))
    assert abs(samples.mean().item() - value) <= bound
    nearest = quantize(x[:1], fmt).dequantize()[0, 1].item()
    assert abs(nearest - value) > bound


# ---------------------------------------------------------------------- generated inputs (hypothesis)
fp32_values = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
fp32_finite = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=60, deadline=None)
@given(block=st.lists(fp32_values, min_size=32, max_size=32), name=st.sampled_from(MX),
       rounding=st.sampled_from(["floor", "rceil"]))
def test_mx_equals_the_reference_on_generated_blocks(block, name, rounding):
    fmt = dataclasses.replace(get_block_format(name), scale_rounding=rounding)
    check_mx(torch.tensor([block], dtype=torch.float32), fmt)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(fp32_values, min_size=32, max_size=32), amplitude=st.sampled_from([1.0, 1e-20, 1e20]))
def test_nvfp4_equals_the_reference_on_generated_tensors(values, amplitude):
    x = torch.tensor(values, dtype=torch.float32).reshape(2, 16) * amplitude
    check_nvfp4(x)


@settings(max_examples=60, deadline=None)
@given(block=st.lists(fp32_finite, min_size=32, max_size=32), name=st.sampled_from(MX),
       rounding=st.sampled_from(["floor", "rceil"]))
def test_mx_dequantized_values_are_a_fixed_point(block, name, rounding):
    """Quantizing what quantization returned returns it again, bit for bit (finite blocks; with rceil a block
    within 2**-4 of fp32's max can round up to 2**128, which dequantizes to inf: documented, left out here)."""
    fmt = dataclasses.replace(get_block_format(name), scale_rounding=rounding)
    once = quantize(torch.tensor([block]), fmt).dequantize()
    assume(bool(torch.isfinite(once).all()))
    twice = quantize(once, fmt).dequantize()
    assert torch.equal(once.view(torch.int32), twice.view(torch.int32))


# ---------------------------------------------------------------------- torch.compile
def _roundtrip(name):
    def fn(x, bits):
        plain = quantize(x, name).dequantize()
        return plain, quantize(x, name, rounding="stochastic", random_bits=bits).dequantize()
    return fn


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_quantize_traces_whole_under_torch_compile(name):
    x = torch.cat([torch.randn(3, 32), mx_adversarial(get_block_format("mxfp8_e4m3"))]).reshape(-1, 64)
    bits = torch.randint(-2 ** 31, 2 ** 31, x.shape, dtype=torch.int32)
    compiled = torch.compile(_roundtrip(name), backend="eager", fullgraph=True)   # fullgraph: no graph break
    for eager, traced in zip(_roundtrip(name)(x, bits), compiled(x, bits)):
        assert torch.equal(torch.isnan(eager), torch.isnan(traced))
        assert torch.equal(eager.nan_to_num().view(torch.int32), traced.nan_to_num().view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4"])
def test_inductor_compiles_to_the_same_bits(name):
    """Inductor's generated code (C++ on CPU, Triton on CUDA) gives the eager bits, on a tiny tensor with special
    blocks. Slow: ~20 s of compilation per format on a small CPU."""
    torch._dynamo.reset()
    x = torch.cat([torch.randn(2, 32) * 100, mx_adversarial(get_block_format("mxfp8_e4m3"))[:6]])
    bits = torch.randint(-2 ** 31, 2 ** 31, x.shape, dtype=torch.int32)
    start = time.perf_counter()
    compiled = torch.compile(_roundtrip(name), backend="inductor")
    for eager, traced in zip(_roundtrip(name)(x, bits), compiled(x, bits)):
        assert torch.equal(torch.isnan(eager), torch.isnan(traced))
        assert torch.equal(eager.nan_to_num().view(torch.int32), traced.nan_to_num().view(torch.int32))
    assert time.perf_counter() - start < 240
