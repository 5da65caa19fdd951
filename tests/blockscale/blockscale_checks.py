"""Comparisons of mixprec.blockscale with the independent reference (blockscale_reference.py), and test inputs.

Every comparison is exact: element codes, scale codes, and the dequantized values bit for bit (the sign of zero
included; NaN compared as NaN).
"""

from __future__ import annotations

import math

import torch

import blockscale_reference as ref
from mixprec.blockscale import BlockQuantized, quantize
from mixprec.formats import BLOCK_FORMATS, ELEMENT_FORMATS, get_block_format

MX = [name for name, f in BLOCK_FORMATS.items() if f.is_mx]
ELEMENTS = list(ELEMENT_FORMATS)
FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = 2.0 ** -149   # smallest fp32 subnormal


def assert_bits_equal(actual: torch.Tensor, expected: list[float], what: str = "") -> None:
    """Bitwise equality of fp32 values (NaN matches NaN whatever its payload)."""
    expected_t = torch.tensor(expected, dtype=torch.float32).reshape(actual.shape)
    assert actual.dtype == torch.float32
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected_t)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    bits_a = actual.view(torch.int32)[~nan_a]
    bits_e = expected_t.view(torch.int32)[~nan_e]
    wrong = (bits_a != bits_e).nonzero().flatten()[:5]
    assert wrong.numel() == 0, (f"{what}: {int((bits_a != bits_e).sum())} values differ, e.g. "
                                f"{actual[~nan_a][wrong].tolist()} vs reference {expected_t[~nan_e][wrong].tolist()}")


def check_mx(x: torch.Tensor, fmt, bits: torch.Tensor | None = None) -> BlockQuantized:
    """quantize(x) equals the reference block by block: scale codes, element codes, dequantized bits."""
    kwargs = {} if bits is None else {"rounding": "stochastic", "random_bits": bits}
    q = quantize(x, fmt, **kwargs)
    rows = x.reshape(-1, fmt.block_size).tolist()
    row_bits = None if bits is None else (bits.reshape(-1, fmt.block_size).to(torch.int64) & 0xFFFFFFFF).tolist()
    expected = [ref.mx_block(row, fmt.element.name, fmt.scale_rounding, fmt.saturate,
                             None if row_bits is None else row_bits[i]) for i, row in enumerate(rows)]
    assert q.scale_codes.dtype == torch.uint8 and q.codes.dtype == torch.uint8 and q.tensor_scale is None
    assert q.scale_codes.flatten().tolist() == [e[0] for e in expected], f"{fmt.name}: E8M0 scales differ"
    assert q.codes.reshape(-1, fmt.block_size).tolist() == [e[1] for e in expected], f"{fmt.name}: codes differ"
    assert_bits_equal(q.dequantize(), [v for e in expected for v in e[2]], fmt.name)
    return q


def check_nvfp4(x: torch.Tensor, tensor_amax: torch.Tensor | None = None,
                 bits: torch.Tensor | None = None) -> BlockQuantized:
    """quantize(x, "nvfp4") equals the reference: tensor scale, E4M3 and E2M1 codes, dequantized bits."""
    fmt = get_block_format("nvfp4")
    kwargs = {} if bits is None else {"rounding": "stochastic", "random_bits": bits}
    q = quantize(x, fmt, tensor_amax=tensor_amax, **kwargs)
    rows = x.reshape(-1, x.shape[-1]).tolist()
    amax = None if tensor_amax is None else tensor_amax.item()
    row_bits = None if bits is None else (bits.reshape(len(rows), -1).to(torch.int64) & 0xFFFFFFFF).tolist()
    tensor_scale, scale_rows, code_rows, out_rows = ref.nvfp4(rows, fmt.block_size, amax, row_bits)
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.shape == ()
    assert q.tensor_scale.item() == tensor_scale
    assert q.scale_codes.reshape(len(rows), -1).tolist() == scale_rows, "E4M3 block scales differ"
    assert q.codes.reshape(len(rows), -1).tolist() == code_rows, "E2M1 codes differ"
    assert_bits_equal(q.dequantize(), [v for row in out_rows for v in row], "nvfp4")
    return q


def magnitudes(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Normal noise at magnitudes 1e-30 .. 1e30, plus log-uniform values over fp32's whole range (subnormals in)."""
    rows = shape[0]
    scales = torch.tensor([10.0 ** k for k in (-30, -12, -3, 0, 3, 12, 30)])
    scale = scales[torch.arange(rows) % len(scales)].reshape(rows, *([1] * (len(shape) - 1)))
    x = torch.randn(shape, generator=generator) * scale
    wide = torch.exp2(torch.empty(shape).uniform_(-149, 127.9, generator=generator))
    wide = wide * torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    return torch.cat([x, wide], dim=0)


def mx_adversarial(fmt) -> torch.Tensor:
    """Blocks from the spec's corner cases, one block per row."""
    n, element = fmt.block_size, fmt.element
    grid = sorted({abs(v) for v in ref.grid(element.name)[0]})
    midpoints = [float((a + b) / 2) for a, b in zip(grid, grid[1:])]
    emax = element.emax

    def block(values, fill=0.0):
        values = list(values)[:n]
        return values + [fill] * (n - len(values))

    blocks = [
        block([]),                                            # all zeros
        block([], fill=-0.0),                                 # negative zeros
        block([FP32_MAX, 1.0, -1.0, 1e-30]),                  # one huge element; the rest underflow
        block([-FP32_MAX, FP32_MAX * 0.75]),                  # the top of E8M0's range
        block([FP32_TINY, -FP32_TINY, 3 * FP32_TINY, 1e-40, -1e-39, 2.0 ** -126]),  # fp32 subnormals: exponent -127
        block([2.0 ** (emax - 127), 2.0 ** (emax - 128), 2.0 ** -140]),  # the bottom of E8M0's range, exactly
        block([2.0 ** (emax - 128) * 1.5, 2.0 ** -135]),      # below it: the exponent clamps to -127
        block([float("nan"), 1.0]),                           # NaN
        block([float("inf"), 1.0]),                           # +inf
        block([2.0, -float("inf")]),                          # -inf
        block([math.ldexp(element.max_normal, 3)] + [math.ldexp(m, 3) for m in midpoints]),       # ties, 2**3
        block([-math.ldexp(element.max_normal, -5)] + [-math.ldexp(m, -5) for m in midpoints]),   # ties, negative
        block([math.ldexp(2.0 - 2.0 ** -20, emax)] + [math.ldexp(1.999, emax - k) for k in range(8)]),  # saturation
        block([math.ldexp(element.max_normal, 0) * (1 + 2.0 ** -23), 0.5, -0.0]),  # just above max: rceil's next
        block([math.ldexp(element.max_normal, 0)] + [math.ldexp(g, -1) for g in map(float, grid)]),  # exact values
    ]
    return torch.tensor(blocks, dtype=torch.float32)


def nvfp4_adversarial() -> torch.Tensor:
    """NVFP4's corner cases, one block of 16 per row: the tensor amax 6 * 448 (tensor scale exactly 1), E2M1's ties
    under block scales 1, 2**-9 and 1.125 * 2**-6, blocks whose scale rounds to 0, zeros of both signs, NaN and
    inf blocks, fp32 subnormals."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 6.0, 0.0, -0.0, 0.5, 1.0]
    rows = [
        [2688.0] + [1.0] * 15,                                  # tensor amax 6 * 448: tensor scale exactly 1
        ties,                                                   # block scale 1: ties to even in E2M1
        [x * 2 ** -9 for x in ties],                            # block scale 2**-9 (E4M3's smallest subnormal)
        [x * 2 ** -6 * 1.125 for x in ties],                    # block scale 1.125 * 2**-6, E4M3's normals
        [1e-3, -1e-3] + [0.0] * 14,                             # far below the tensor's amax: scale rounds to 0
        [0.0] * 16,                                             # all zeros
        [-0.0] * 16,                                            # negative zeros
        [float("nan")] + [1.0] * 15,                            # NaN block
        [float("inf")] + [1.0] * 15,                            # inf block
        [1.0] * 15 + [-float("inf")],                           # -inf block
        [FP32_TINY, 1e-40] + [0.0] * 14,                        # fp32 subnormals
    ]
    return torch.tensor(rows, dtype=torch.float32)
