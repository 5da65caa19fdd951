"""Blockwise-quantized optimizer state: one byte per element plus one fp32 absmax per 256 elements.

A moment tensor ``x_fp32`` (any shape, ``n`` elements) is held as two tensors:

* ``codes``: shape of ``x``, one byte per element: ``uint8`` indices into a 256-entry code table
  (``state=int8``), or the fp8 values themselves (``state=fp8``: ``float8_e4m3fn`` / ``float8_e5m2``);
* ``absmax``: fp32, shape ``(ceil(n / 256),)``: the largest magnitude of the coded values (``x``, or
  ``sqrt(x)`` for the ``dynamic-sqrt`` code; under ``dynamic-signed`` at least ``|lowest| / 0.99297``, see
  Rounding) in each block of 256 consecutive elements in row-major order
  (the last block may be short: it is padded with zeros, which change no absmax, and the padding is not
  stored).

**Scale convention** (stated here once): a block's coded values are divided by the block's scale
``absmax / qmax`` (fp32; ``qmax`` is 1 for the dynamic maps, the fp8 format's largest finite value for
fp8), so they lie in ``[-qmax, qmax]``, and rounded to the code's table; dequantizing multiplies the
table value by the same scale (and squares it for ``dynamic-sqrt``). Under fp8 the scale is never below
the smallest normal fp32, ``2**-126`` (a tinier one made a block of tiny values inf or NaN). Exact bytes of one tensor:
``n + 4 * ceil(n / 256)`` (:func:`nbytes`). The codes (their tables, which moment takes which, and why), and the
lookup that rounds to a table: :mod:`mixprec.optim.quantized_codes`.

**Rounding.** ``"nearest"``: the closest table value (for the dynamic maps a lookup on the midpoints between
neighbours, equal to ``torch.bucketize``: an exact tie goes to the lower one; for fp8 torch's
round-to-nearest-even cast). ``"stochastic"``: between the two neighbours ``lo <= y < hi`` round up with
probability ``(y - lo) / (hi - lo)``, so the coded value is unbiased, ``E[decoded] = y``, for every ``y``
inside the table's range (under ``dynamic-sqrt`` that is ``sqrt(v)``: ``v`` reads back biased up by the
rounding's variance, at most ``(gap / 2)**2`` in scale units). The one value outside the range is the
normalised ``-1`` of a block whose absmax element is negative under the signed map (its lowest value is
``-0.99297``, as in bitsandbytes): there the block's absmax is stored as ``|lowest| / 0.99297``, so that value
maps onto ``-0.99297`` and reads back as itself (stored 0.7 % short, as bitsandbytes does, a momentum buffer
compounded the shortfall step after step: 38 % at momentum 0.99).

**Non-finite values.** A block holding a NaN or an infinity stores ``absmax = NaN``, so all 256 of its
elements read back NaN: the poison is visible, never a finite wrong value, and it does not spread past its
block. The engine never lets it come to that: it skips a step with non-finite gradients before the
optimizer runs. Negative values under ``dynamic-sqrt`` (never a second moment) are stored as 0.

Which tensors are quantized (:func:`quantizes`): floating (not complex) tensors with at least 4096
elements and at least 2 dimensions. Smaller ones and 1-D ones (norms, biases) keep fp32 state: bitsandbytes'
``min_8bit_size=4096`` and torchao's 4096-element minimum; the 1-D rule is ours (norm gains and biases
are few and sensitive). Every function here is vectorised (a block is a row of an ``(nblocks, 256)``
view) and none syncs the host with the device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mixprec.optim.quantized_codes import CODES, BinLookup, Code, bin_lookup, bucketize, code_for, code_of
from mixprec.optim.sr_stream import SRKey, uniform
from mixprec.policy.policy import STATE_ROUNDINGS

__all__ = ["BLOCK_SIZE", "MIN_QUANTIZED_NUMEL", "ABSMAX_SUFFIX", "Code", "CODES", "BinLookup", "bin_lookup", "code_for",
           "code_of", "quantizes", "quantize", "dequantize", "sqrt_fp32", "zeros", "nbytes", "state_shape",
           "piece_absmax", "quantize_piece", "dequantize_piece"]

BLOCK_SIZE = 256             # elements per absmax scale (Dettmers et al. 2022; bitsandbytes, torchao)
MIN_QUANTIZED_NUMEL = 4096   # smaller tensors keep fp32 state (bitsandbytes min_8bit_size, torchao)
ABSMAX_SUFFIX = "_absmax"    # optimizer-state key of a moment's scales: state["exp_avg" + ABSMAX_SUFFIX]


def sqrt_fp32(x_fp32: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root of ``x_fp32`` (a new tensor): IEEE's ``sqrt``, as a C ``sqrtf`` or a
    CUDA kernel gives it. torch's CPU float ``sqrt`` errs by one ulp in about 0.6 % of values (measured, torch
    2.13: its vector math library is accurate to 1 ulp, not correctly rounded), so on a CPU the root is taken
    in fp64 and rounded once to fp32 (exact: fp64 holds more than the 2 x 24 + 2 bits that makes the double
    rounding of a square root innocuous). Elsewhere torch's fp32 ``sqrt``."""
    if x_fp32.device.type == "cpu":
        return x_fp32.double().sqrt_().float()
    return x_fp32.sqrt()


def quantizes(t: torch.Tensor) -> bool:
    """Whether 8-bit state would quantize the state of ``t`` (module docstring): a real floating tensor with
    at least :data:`MIN_QUANTIZED_NUMEL` elements and at least 2 dimensions."""
    return t.is_floating_point() and t.dim() >= 2 and t.numel() >= MIN_QUANTIZED_NUMEL


def nbytes(numel: int) -> int:
    """Exact bytes of one quantized tensor of ``numel`` elements: the codes and the fp32 absmax scales."""
    return numel + 4 * math.ceil(numel / BLOCK_SIZE)


def state_shape(key: str, param_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape optimizer-state entry ``key`` has for a param of ``param_shape``: ``(nblocks,)`` for an
    absmax entry (``key`` ends in :data:`ABSMAX_SUFFIX`), else the param's shape (codes included)."""
    if key.endswith(ABSMAX_SUFFIX):
        return (math.ceil(math.prod(param_shape) / BLOCK_SIZE),)
    return tuple(param_shape)


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (n,) as ``(ceil(n / 256), 256)``, the tail zero-padded (a copy only when padding)."""
    pad = (-flat.numel()) % BLOCK_SIZE
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, BLOCK_SIZE)


def _block_absmax(blocks_fp32: torch.Tensor, code: Code) -> torch.Tensor:
    """Per block (a row), the absmax its codes are scaled by: the largest magnitude of the coded values; under the
    signed map at least ``|lowest| / 0.99297``, the map's lowest value being ``-0.99297`` (no ``-1``), so a
    block's most negative value maps onto that value instead of being stored 0.7 % short (a momentum buffer
    compounded the shortfall every step: 38 % at momentum 0.99). NaN propagates. ``(nblocks,)`` fp32."""
    if code.sqrt:
        return blocks_fp32.amax(dim=1)                        # sqrt(x) >= 0
    if code.name != "dynamic-signed":
        return blocks_fp32.abs().amax(dim=1)
    lowest = float(-code.table()[0])                          # 0.99297
    return torch.maximum(blocks_fp32.amax(dim=1), blocks_fp32.amin(dim=1).neg_().div_(lowest))


def _unit(absmax: torch.Tensor, code: Code) -> torch.Tensor:
    """Per block, what one table unit is worth: ``absmax / qmax`` (absmax itself, exactly, for the dynamic maps).
    Under fp8 never less than the smallest normal fp32 (``2**-126``): a block's absmax under ``qmax * 2**-126``
    (a ``v`` of ~1e-34) made it subnormal or 0, and the block's values inf or NaN when divided by it. Such a
    block is coded against the floor instead (its values lose fp8 precision, like fp32 subnormals)."""
    if code.qmax == 1.0:
        return absmax
    return absmax.clamp_min(code.qmax * torch.finfo(torch.float32).tiny) / code.qmax   # exact: NaN stays NaN


def _round_index(y: torch.Tensor, code: Code, rounding: str, generator: torch.Generator | SRKey | None) -> torch.Tensor:
    """Indices into ``code``'s table of ``y`` (table units), rounded to nearest or stochastically."""
    if rounding == "nearest":
        return bucketize(y, code, "midpoints", inclusive=False)
    table = code.table(y.device)
    lower = (bucketize(y, code, "table", inclusive=True) - 1).clamp_(0, table.numel() - 2)
    lo = table.index_select(0, lower.view(-1)).view(y.shape)            # lo <= y < hi inside the table's range
    hi = table.index_select(0, lower.view(-1) + 1).view(y.shape)
    p_up = (y - lo).div_(hi - lo)                             # < 0 below the table: never up (clamped)
    draw = (uniform(generator, y.shape, y.device) if isinstance(generator, SRKey)   # element j: global index offset + j
            else torch.rand(y.shape, generator=generator, device=y.device))
    return lower + (draw < p_up)


def _encoded(y: torch.Tensor, code: Code, rounding: str, generator: torch.Generator | SRKey | None) -> torch.Tensor:
    """``y`` (table units) rounded to ``code`` as stored: table indices for the dynamic maps; for fp8 ``y`` itself
    under ``"nearest"`` (the cast into the storage dtype rounds it to nearest even), else the table values."""
    if not code.indexed and rounding == "nearest":
        return y
    index = _round_index(y, code, rounding, generator)
    return index if code.indexed else code.table(y.device).index_select(0, index.view(-1))


def _values(flat_codes: torch.Tensor, code: Code) -> torch.Tensor:
    """The table values (fp32, table units) of stored ``flat_codes`` (1-D): a new tensor."""
    return code.table(flat_codes.device).index_select(0, flat_codes.int()) if code.indexed else flat_codes.float()


def quantize(x_fp32: torch.Tensor, code: Code, *, rounding: str = "nearest",
             generator: torch.Generator | SRKey | None = None,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x_fp32`` blockwise with ``code``; returns ``(codes, absmax)`` (module docstring).

    Each block's coded values (``x``, or ``sqrt(x)`` for ``dynamic-sqrt``) are divided by the block's scale
    ``absmax / qmax`` (fp32; :func:`dequantize` multiplies by the same number) and rounded to the table.

    Args:
        x_fp32: fp32 tensor, any shape.
        code: a :class:`Code` (:func:`code_for`).
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; one uniform number per element of the padded
            ``(nblocks, 256)`` layout, element ``j`` row-major).
        generator: the uniforms of ``"stochastic"``: an :class:`mixprec.optim.sr_stream.SRKey` (the counter-based
            stream; element ``j`` takes global index ``key.offset + j``, so a block-aligned slice draws as in the
            whole tensor; what the optimizers pass), a ``torch.Generator``, or None: torch's global RNG (for
            standalone use: restoring its state reproduces it).
        out: ``(codes, absmax)`` to write into (an optimizer's state, updated in place), or None.

    Returns:
        ``codes`` of ``x_fp32``'s shape in ``code.storage_dtype`` and ``absmax`` fp32 ``(ceil(n / 256),)``
        (NaN for a block holding a non-finite value): ``out``, or new tensors on ``x_fp32``'s device.
        No host sync.

    Raises:
        ValueError: ``x_fp32`` is not fp32; unknown ``rounding``.
    """
    if x_fp32.dtype != torch.float32:
        raise ValueError(f"quantize x_fp32.dtype={x_fp32.dtype} is not allowed; pass an fp32 tensor (x.float())")
    if rounding not in STATE_ROUNDINGS:
        raise ValueError(f"quantize rounding={rounding!r} is not allowed; choose one of {STATE_ROUNDINGS}")
    coded_fp32 = sqrt_fp32(x_fp32.clamp_min(0)) if code.sqrt else x_fp32         # NaN stays NaN
    blocks_fp32 = _blocks(coded_fp32.reshape(-1))                                 # (nblocks, 256)
    absmax = _block_absmax(blocks_fp32, code)                                     # (nblocks,); NaN propagates
    absmax = torch.where(torch.isfinite(absmax), absmax, torch.nan)               # inf too: the block reads NaN
    scale = torch.where(absmax > 0, absmax, 1.0)                                  # an all-zero block: codes of 0
    y = blocks_fp32 / _unit(scale, code)[:, None]                                # (nblocks, 256), |y| <~ qmax
    encoded = _encoded(y, code, rounding, generator).reshape(-1)[: x_fp32.numel()].view(x_fp32.shape)
    if out is None:
        return encoded.to(code.storage_dtype), absmax
    out[0].copy_(encoded)   # the one conversion into the storage dtype
    out[1].copy_(absmax)
    return out


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: Code) -> torch.Tensor:
    """The fp32 values of ``(codes, absmax)`` made by :func:`quantize` with ``code``: a new fp32 tensor of
    ``codes``' shape (``table[codes] * (absmax / qmax)`` per block, squared for ``dynamic-sqrt``; a NaN absmax
    reads NaN). No host sync.

    Raises:
        ValueError: ``absmax`` does not hold one fp32 scale per block of ``codes``.
    """
    if absmax.dtype != torch.float32 or tuple(absmax.shape) != state_shape(ABSMAX_SUFFIX, codes.shape):
        raise ValueError(f"dequantize absmax of dtype {absmax.dtype} and shape {tuple(absmax.shape)} does not fit "
                         f"codes of shape {tuple(codes.shape)}: expected fp32 {state_shape(ABSMAX_SUFFIX, codes.shape)}")
    out = _blocks(_values(codes.reshape(-1), code)).mul_(_unit(absmax, code)[:, None])   # (nblocks, 256)
    out = out.square_() if code.sqrt else out
    return out.reshape(-1)[: codes.numel()].view(codes.shape)


def zeros(shape: torch.Size | tuple[int, ...], code: Code, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of an all-zero tensor of ``shape``: the code of 0 everywhere, absmax 0.

    The same tensors as ``quantize(torch.zeros(shape), code)``, built without that fp32 tensor and its
    temporaries (about 20 bytes per element at once: a 30522 x 384 embedding's state took ~270 MB of RSS at the
    first step); only one zero block is quantized, for its code byte, which then fills the codes.
    """
    zero_codes, _ = quantize(torch.zeros(BLOCK_SIZE, dtype=torch.float32, device=device), code)
    codes = torch.empty(shape, dtype=code.storage_dtype, device=device)
    codes.copy_(zero_codes[0])
    return codes, torch.zeros(state_shape(ABSMAX_SUFFIX, codes.shape), dtype=torch.float32, device=device)


# ------------------------------------------------------------- pieces of one block (a sharded param's edge blocks)
def piece_absmax(x_fp32: torch.Tensor, code: Code) -> torch.Tensor:
    """The absmax a block would get from ``x_fp32``'s elements alone (a piece of one block: its part on this
    rank): 0-d fp32, NaN propagating. The max over a block's pieces is the block's absmax (the short last block's
    zero padding changes no absmax), before the rule that turns a non-finite absmax into NaN. No host sync."""
    coded_fp32 = sqrt_fp32(x_fp32.clamp_min(0)) if code.sqrt else x_fp32
    return _block_absmax(coded_fp32.reshape(1, -1), code)[0]


def quantize_piece(x_fp32: torch.Tensor, absmax: torch.Tensor, code: Code, *, rounding: str = "nearest",
                   generator: torch.Generator | SRKey | None = None) -> torch.Tensor:
    """The codes :func:`quantize` gives ``x_fp32`` (a piece of one block, 1-D) when the whole block's absmax is
    ``absmax`` (0-d fp32): the same bits, element ``j`` drawing at global index ``generator.offset + j`` under
    stochastic rounding. Returns the codes in ``code.storage_dtype``. No host sync."""
    coded_fp32 = sqrt_fp32(x_fp32.clamp_min(0)) if code.sqrt else x_fp32
    absmax = torch.where(torch.isfinite(absmax), absmax, torch.nan)
    scale = torch.where(absmax > 0, absmax, 1.0)
    y = coded_fp32.reshape(-1) / _unit(scale.reshape(1), code)
    return _encoded(y, code, rounding, generator).view(x_fp32.shape).to(code.storage_dtype)


def dequantize_piece(codes: torch.Tensor, absmax: torch.Tensor, code: Code) -> torch.Tensor:
    """The fp32 values of ``codes`` (a piece of one block) under the block's ``absmax`` (0-d fp32), as
    :func:`dequantize` reads them: a new fp32 tensor of ``codes``' shape. No host sync."""
    out = _values(codes.reshape(-1), code).mul_(_unit(absmax.reshape(1), code))
    out = out.square_() if code.sqrt else out
    return out.view(codes.shape)
