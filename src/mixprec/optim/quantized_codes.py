"""The 8-bit codes of blockwise-quantized optimizer state (:mod:`mixprec.optim.quantized_state`): how a block's
normalised values (in ``[-qmax, qmax]``, units of the block's scale) are stored in one byte each, which code a
moment uses, and the fast lookup that rounds values to a code's table.

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
variant follows arXiv 2409.12517 (which torchao's ``subclass_fp8`` cites): E4M3 for
the signed first moment, ``v`` itself in E5M2, whose range (``sqrt(v)`` down to 1.6e-5 of the block's
largest) makes the square root unnecessary.

**The lookup.** Rounding to a table is ``torch.bucketize`` on its boundaries (the midpoints between neighbours for
nearest rounding, the values themselves for the two neighbours of stochastic rounding). :func:`bucketize` gives
the same indices from the top bits of the fp32 pattern (:class:`BinLookup`, built once per code, kind and device)
and one comparison, several times faster on a CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mixprec.policy.policy import QUANTIZED_STATE_DTYPES

__all__ = ["Code", "CODES", "BinLookup", "bin_lookup", "bucketize", "code_for", "code_of"]


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


def bucketize(y: torch.Tensor, code: Code, kind: str, *, inclusive: bool) -> torch.Tensor:
    """``torch.bucketize(y, boundaries, right=inclusive)`` for ``code``'s ``kind`` boundaries (:func:`bin_lookup`;
    ``y`` fp32 in ``[-qmax, qmax]``; NaN gives some valid index), by a lookup on the top bits and one comparison:
    several times faster on a CPU than the binary search. uint8 for ``inclusive=False`` (at most 255: codes as they
    are stored), else int32. Tests pin it to ``torch.bucketize``. No host sync."""
    lookup = _lookup(code.name, kind, str(y.device))
    bins = (y.reshape(-1).view(torch.int32) >> lookup.shift).bitwise_and_(lookup.mask)   # (n,) the top bits
    below = lookup.counts.index_select(0, bins).view(y.shape)     # boundaries below y's bin
    bound = lookup.bound.index_select(0, bins).view(y.shape)      # the one that may lie in it, below y
    if inclusive:
        return below.int().add_(bound <= y)
    return below.add_(bound < y)


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
