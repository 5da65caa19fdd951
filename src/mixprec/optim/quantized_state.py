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
``n + 4 * ceil(n / 256)`` (:func:`nbytes`).

The codes (:data:`CODES`), by state format and moment:

* ``dynamic-signed`` (``state=int8``: first moment, momentum): a uint8 index into 256 values: 0, 1 and 127
  dynamic-exponent values of each sign, magnitudes 5.5e-7 .. 0.993;
* ``dynamic-sqrt`` (``state=int8``: Adam's second moment ``v``): ``sqrt(v)`` as a uint8 index into the
  unsigned map: 0, 1 and 254 values 3.25e-7 .. 0.9965;
* ``e4m3`` (``state=fp8``: first moment, momentum): ``float8_e4m3fn`` values (qmax 448, smallest 2**-9);
* ``e5m2`` (``state=fp8``: second moment, ``v`` itself): ``float8_e5m2`` values (qmax 57344, smallest 2**-16).

**Why these codes.** The int8 tables are the *dynamic tree* maps of Dettmers et al., "8-bit Optimizers via
Block-wise Quantization" (ICLR 2022), as bitsandbytes ``AdamW8bit`` and torchao ``AdamW8bit`` build them
(``create_dynamic_map``: in each decade ``10**-7 .. 1`` a run of linearly spaced values, more of them in the
upper decades; the signed map spends one bit on the sign, the unsigned one spends it on precision), with
blocks of 256 and a per-block absmax, as there. A non-linear code is needed because one block holds values
over many decades: a linear int8 code keeps only values above ``absmax / 254``. The dynamic maps keep
values down to ~3e-7 of the block's largest; nearest rounding errs by at most half the gap between two
neighbours: in the top decade 0.0035 x absmax unsigned (0.35 % of a value near absmax, 3.5 % near a tenth
of it) and 0.0070 x absmax signed, with fewer values, relatively coarser, in each lower decade.

One choice differs from bitsandbytes and torchao, which code ``v`` itself: here the unsigned map codes
``sqrt(v)``, the update's denominator. Coding ``v`` keeps ``sqrt(v)`` only down to ``4e-4`` of the
block's largest; an element whose ``v`` rounds to 0 while its first moment does not then steps by up to
``1 / sqrt(1 - beta2)`` = 32 times its normal size (its next ``v`` holds only that step's ``g**2``).
Coding ``sqrt(v)`` keeps it down to ``3e-7`` of the block's largest, at the map's relative error in
``sqrt(v)`` (coding ``v`` halves that error in ``sqrt(v)``, but over half the decades). On a quadratic with a 100x
spread of curvatures (the test suite's toy) AdamW with ``v`` coded ended 0.30 from the optimum at worst
(RMS 4.3e-3) and with ``sqrt(v)`` coded 0.021 (RMS 3.0e-4; fp32 state: 0.013, RMS 2.2e-4). The fp8
variant follows the issue's choice (and arXiv 2409.12517, which torchao's ``subclass_fp8`` cites): E4M3 for
the signed first moment, ``v`` itself in E5M2, whose range (``sqrt(v)`` down to 1.6e-5 of the block's
largest) makes the square root unnecessary.

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

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.optim.sr_stream import SRKey, uniform
from mixprec.policy.policy import QUANTIZED_STATE_DTYPES, STATE_ROUNDINGS

__all__ = ["BLOCK_SIZE", "MIN_QUANTIZED_NUMEL", "ABSMAX_SUFFIX", "Code", "CODES", "BinLookup", "bin_lookup", "code_for",
           "code_of", "quantizes", "quantize", "dequantize", "sqrt_fp32", "zeros", "nbytes", "state_shape",
           "piece_absmax", "quantize_piece", "dequantize_piece"]

BLOCK_SIZE = 256             # elements per absmax scale (Dettmers et al. 2022; bitsandbytes, torchao)
MIN_QUANTIZED_NUMEL = 4096   # smaller tensors keep fp32 state (bitsandbytes min_8bit_size, torchao)
ABSMAX_SUFFIX = "_absmax"    # optimizer-state key of a moment's scales: state["exp_avg" + ABSMAX_SUFFIX]


@dataclass(frozen=True)
class Code:
    """An 8-bit code: how normalised block values are stored (module docstring)."""

    name: str
    storage_dtype: torch.dtype   # torch.uint8 (an index into the table) or an fp8 dtype (the value)
    sqrt: bool = False           # codes sqrt(x) (x >= 0), decoded squared

    @property
    def indexed(self) -> bool:
        """True when codes are indices into :meth:`table` (the dynamic maps), False for fp8 values."""
        return self.storage_dtype == torch.uint8

    @property
    def qmax(self) -> float:
        """The value a block's absmax maps to: 1 for the dynamic maps, the fp8 format's max."""
        return 1.0 if self.indexed else float(torch.finfo(self.storage_dtype).max)

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The code's values in ascending order (fp32, on ``device``; 256 for the dynamic maps, the
        distinct finite values for fp8), in units where the block's absmax is :attr:`qmax`."""
        return _table(self.name, str(torch.device(device)))

    def __str__(self) -> str:
        return self.name


CODES = {c.name: c for c in (Code("dynamic-signed", torch.uint8), Code("dynamic-sqrt", torch.uint8, sqrt=True),
                             Code("e4m3", torch.float8_e4m3fn), Code("e5m2", torch.float8_e5m2))}


def _dynamic_map(*, signed: bool) -> list[float]:
    """Dettmers' dynamic tree map (bitsandbytes ``create_dynamic_map(signed, 7, 8)``): for each decade
    ``10**(k-6)``, k = 0..6, the midpoints of ``2**k`` (signed) or ``2**(k+1)`` (unsigned) equal steps of
    ``linspace(0.1, 1)`` times the decade (negated too when signed), then 0 and 1; fp32 arithmetic, as there."""
    values = [0.0, 1.0]
    for k in range(7):
        steps = 2 ** k if signed else 2 ** (k + 1)
        bounds = torch.linspace(0.1, 1, steps + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += ((10 ** (k - 6)) * means).tolist()
        values += (-(10 ** (k - 6)) * means).tolist() if signed else []
    return sorted(values)


@functools.cache
def _table(name: str, device: str) -> torch.Tensor:
    code = CODES[name]
    if code.indexed:
        return torch.tensor(_dynamic_map(signed=not code.sqrt), dtype=torch.float32, device=device)
    every = torch.arange(256, dtype=torch.uint8).view(code.storage_dtype).float()   # all 256 bit patterns
    return torch.unique(every[torch.isfinite(every)]).to(device)                    # sorted; +-0 once


@functools.cache
def _midpoints(name: str, device: str) -> torch.Tensor:
    table = _table(name, device)
    return (table[:-1] + table[1:]) / 2   # (len - 1,): nearest-rounding boundaries


@dataclass(frozen=True)
class BinLookup:
    """``torch.bucketize`` for one sorted boundary set, by the fp32 bit pattern: bin ``b`` holds the floats
    whose 32 bits start with ``b`` (the top ``32 - shift`` bits: sign, exponent, leading mantissa bits), an
    interval of values, and no interval between ``-qmax`` and ``qmax`` holds two boundaries. ``counts[b]``:
    the number of boundaries below the interval (<= 255: there are at most 256 and the interval's lowest
    value is at most qmax, the last); ``bound[b]``: the first boundary at or above its lowest value."""

    shift: int                 # bin = (bits >> shift) & mask
    mask: int
    counts: torch.Tensor       # uint8 (2 ** (32 - shift),)
    bound: torch.Tensor        # fp32 (2 ** (32 - shift),); +inf where no boundary is left


def bin_lookup(code: Code, kind: str, device: torch.device | str = "cpu") -> BinLookup:
    """The :class:`BinLookup` of ``code``'s ``kind`` boundaries on ``device``: ``"midpoints"`` (between
    neighbouring values: nearest rounding of an indexed code), ``"magnitudes"`` (between neighbouring
    non-negative values: nearest rounding of an fp8 code's magnitude) or ``"table"`` (the values: the two
    neighbours of stochastic rounding). Built once per code, kind and device (<= 320 KB). Raises ValueError
    for another ``kind``."""
    if kind not in ("midpoints", "magnitudes", "table"):
        raise ValueError(f"bin_lookup kind={kind!r} is not allowed; choose 'midpoints', 'magnitudes' or 'table'")
    return _lookup(code.name, kind, str(torch.device(device)))


@functools.cache
def _lookup(name: str, kind: str, device: str) -> BinLookup:
    """The coarsest bit-pattern binning in which no bin inside ``[-qmax, qmax]`` holds two of the code's
    ``kind`` boundaries (``"midpoints"`` or ``"table"``); built once per code, kind and device (<= 320 KB)."""
    if kind == "magnitudes":
        values = _table(name, "cpu")[_table(name, "cpu") >= 0]
        bounds = (values[:-1] + values[1:]) / 2
    else:
        bounds = _midpoints(name, "cpu") if kind == "midpoints" else _table(name, "cpu")
    qmax = CODES[name].qmax
    for shift in range(23, 8, -1):
        bins = torch.arange(2 ** (32 - shift), dtype=torch.int64)
        first = (bins << shift).to(torch.int32).view(torch.float32)              # the bin's first and last
        last = ((bins << shift) + (2 ** shift - 1)).to(torch.int32).view(torch.float32)   # bit patterns
        low = torch.minimum(first, last).nan_to_num(nan=0.0).clamp(-qmax, qmax)  # negative floats: reversed
        high = torch.maximum(first, last).nan_to_num(nan=0.0).clamp(-qmax, qmax)
        counts = torch.bucketize(low, bounds)                                     # boundaries below the bin
        if bool((torch.bucketize(high, bounds, right=True) - counts <= 1).all()):
            bound = torch.cat([bounds, torch.tensor([math.inf])])[counts]
            return BinLookup(shift, 2 ** (32 - shift) - 1, counts.to(device, torch.uint8), bound.to(device))
    raise RuntimeError(f"no binning separates the {kind} of code {name!r}")   # not reached for CODES


def _bucketize(y: torch.Tensor, name: str, kind: str, *, inclusive: bool) -> torch.Tensor:
    """``torch.bucketize(y, boundaries, right=inclusive)`` for the code's ``kind`` boundaries (``y`` fp32 in
    ``[-qmax, qmax]``; NaN gives some valid index), by a lookup on the top bits and one comparison: several
    times faster on a CPU than the binary search. uint8 for ``inclusive=False`` (at most 255: codes as they
    are stored), else int32. Tests pin it to ``torch.bucketize``."""
    lookup = _lookup(name, kind, str(y.device))
    bins = (y.reshape(-1).view(torch.int32) >> lookup.shift).bitwise_and_(lookup.mask)   # (n,) the top bits
    below = lookup.counts.index_select(0, bins).view(y.shape)     # boundaries below y's bin
    bound = lookup.bound.index_select(0, bins).view(y.shape)      # the one that may lie in it, below y
    if inclusive:
        return below.int().add_(bound <= y)
    return below.add_(bound < y)


def sqrt_fp32(x_fp32: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root of ``x_fp32`` (a new tensor): IEEE's ``sqrt``, as a C ``sqrtf`` or a
    CUDA kernel gives it. torch's CPU float ``sqrt`` errs by one ulp in about 0.6 % of values (measured, torch
    2.13: its vector math library is accurate to 1 ulp, not correctly rounded), so on a CPU the root is taken
    in fp64 and rounded once to fp32 (exact: fp64 holds more than the 2 x 24 + 2 bits that makes the double
    rounding of a square root innocuous). Elsewhere torch's fp32 ``sqrt``."""
    if x_fp32.device.type == "cpu":
        return x_fp32.double().sqrt_().float()
    return x_fp32.sqrt()


def code_for(state_dtype: torch.dtype, *, nonnegative: bool) -> Code:
    """The code a policy's 8-bit ``state_dtype`` uses for a moment: ``torch.int8`` → ``dynamic-signed``, or
    ``dynamic-sqrt`` for a ``nonnegative`` moment (Adam's second); ``torch.float8_e4m3fn`` → E4M3, or E5M2
    for a ``nonnegative`` moment. Raises ValueError for another dtype."""
    if state_dtype == torch.int8:
        return CODES["dynamic-sqrt" if nonnegative else "dynamic-signed"]
    if state_dtype == torch.float8_e4m3fn:
        return CODES["e5m2" if nonnegative else "e4m3"]
    raise ValueError(f"code_for state_dtype={state_dtype!r} is not an 8-bit state format; choose one of "
                     f"{list(QUANTIZED_STATE_DTYPES)}")


def code_of(codes: torch.Tensor, *, nonnegative: bool) -> Code:
    """The code stored ``codes`` were made with (read from their dtype; uint8 codes are ``dynamic-signed``,
    or ``dynamic-sqrt`` for a ``nonnegative`` moment). Raises ValueError for another dtype."""
    if codes.dtype == torch.uint8:
        return CODES["dynamic-sqrt" if nonnegative else "dynamic-signed"]
    for code in CODES.values():
        if code.storage_dtype == codes.dtype:
            return code
    raise ValueError(f"codes of dtype {codes.dtype} are not 8-bit optimizer state; expected one of "
                     f"{sorted({str(c.storage_dtype) for c in CODES.values()})}")


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
    lowest = float(-_table(code.name, "cpu")[0])              # 0.99297
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
        return _bucketize(y, code.name, "midpoints", inclusive=False)
    table = _table(code.name, str(y.device))
    lower = (_bucketize(y, code.name, "table", inclusive=True) - 1).clamp_(0, table.numel() - 2)
    lo = table.index_select(0, lower.view(-1)).view(y.shape)            # lo <= y < hi inside the table's range
    hi = table.index_select(0, lower.view(-1) + 1).view(y.shape)
    p_up = (y - lo).div_(hi - lo)                             # < 0 below the table: never up (clamped)
    draw = (uniform(generator, y.shape, y.device) if isinstance(generator, SRKey)   # element j: global index offset + j
            else torch.rand(y.shape, generator=generator, device=y.device))
    return lower + (draw < p_up)


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
            whole tensor), a ``torch.Generator``, or None: torch's global RNG (restoring its state reproduces it).
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
    if not code.indexed and rounding == "nearest":
        encoded = y                                                               # the fp8 cast rounds to nearest even
    else:
        index = _round_index(y, code, rounding, generator)
        encoded = index if code.indexed else _table(code.name, str(y.device)).index_select(0, index.view(-1))
    encoded = encoded.reshape(-1)[: x_fp32.numel()].view(x_fp32.shape)
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
    flat_codes = codes.reshape(-1)
    values = _table(code.name, str(codes.device)).index_select(0, flat_codes.int()) if code.indexed else flat_codes.float()
    out = _blocks(values).mul_(_unit(absmax, code)[:, None])                  # (nblocks, 256)
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
    if not code.indexed and rounding == "nearest":
        encoded = y
    else:
        index = _round_index(y, code, rounding, generator)
        encoded = index if code.indexed else _table(code.name, str(y.device)).index_select(0, index.view(-1))
    return encoded.view(x_fp32.shape).to(code.storage_dtype)


def dequantize_piece(codes: torch.Tensor, absmax: torch.Tensor, code: Code) -> torch.Tensor:
    """The fp32 values of ``codes`` (a piece of one block) under the block's ``absmax`` (0-d fp32), as
    :func:`dequantize` reads them: a new fp32 tensor of ``codes``' shape. No host sync."""
    flat_codes = codes.reshape(-1)
    values = _table(code.name, str(codes.device)).index_select(0, flat_codes.int()) if code.indexed else flat_codes.float()
    out = values.mul_(_unit(absmax.reshape(1), code))
    out = out.square_() if code.sqrt else out
    return out.view(codes.shape)
