"""Range counting for :func:`mixprec.numerics.inspect`: the sorted thresholds of every (format, scale), the
device-side counters that histogram a tensor against them in one pass, and their reading on the host.

Conventions (what "subnormal", "flushed", "overflow" count) are in :mod:`mixprec.numerics.report`.
Counting never syncs; :meth:`_RangeCounter.to_host` is the one read.
"""

from __future__ import annotations

import math

import torch

from mixprec.formats import Format, get_format
from mixprec.numerics.stats import RangeStats

_LIMITS = ("max", "normal", "flush")


# ---------------------------------------------------------------------- pure pieces
def _limit(fmt: Format, kind: str) -> float:
    return {"max": fmt.max, "normal": fmt.smallest_normal, "flush": fmt.smallest_subnormal / 2}[kind]

class _Thresholds:
    """Sorted unique fp32 thresholds ``t`` such that ``count(|x| < t)`` gives every count we need.

    For each (format, scale): ``smallest_normal / scale`` (subnormal), ``smallest_subnormal / 2 /
    scale`` (flushed) and ``nextafter(max / scale, inf)`` (so ``count(|x| < t) = count(|x| <= max /
    scale)`` and overflow is the rest); plus the smallest positive fp32 (so zeros are counted).
    Limits below fp32's range become 0 (a count of 0, which is exact: no fp32 value is below them).
    """

    def __init__(self, formats: list[Format], scales: list[float]) -> None:
        keys = [(f.name, kind, s) for f in formats for kind in _LIMITS for s in scales] + [("", "zero", 1.0)]
        raw = torch.tensor([_limit(get_format(f), kind) / s if kind != "zero" else 0.0 for f, kind, s in keys],
                           dtype=torch.float32)
        is_max = torch.tensor([kind in ("max", "zero") for _, kind, _ in keys])
        raw = torch.where(is_max, torch.nextafter(raw, torch.tensor(math.inf)), raw)
        self.values = torch.unique(raw)  # sorted ascending
        self.index = dict(zip(keys, torch.searchsorted(self.values, raw).tolist()))
        # fp8 at the best per-tensor scale: limits relative to amax, compared with |x| / amax
        fp8 = [f for f in formats if f.bits == 8]
        keys8 = [(f.name, kind) for f in fp8 for kind in ("normal", "flush")]
        raw8 = torch.tensor([_limit(get_format(f), kind) / get_format(f).max for f, kind in keys8],
                            dtype=torch.float32)
        self.values8 = torch.unique(raw8)
        self.index8 = dict(zip(keys8, torch.searchsorted(self.values8, raw8).tolist()))
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self.values.to(device), self.values8.to(device))
        return self._on[device]


def _histogram(x: torch.Tensor, thresholds: torch.Tensor, weights: torch.Tensor, key_offset: torch.Tensor | None,
               segments: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment and sorted threshold ``t_j``: the count of ``x < t_j`` (int64) and the sum of
    ``weights`` over those elements, both ``(segments, len(thresholds))``, and each segment's total
    weight ``(segments,)``. Element ``i`` falls in segment ``key_offset[i] // (len(thresholds) + 1)``.

    One bucketize over ``x``; the histograms are ``scatter_add_`` into a few bins (no ``bincount``:
    its parallel passes are costly on a busy CPU). No host sync.
    """
    bins = len(thresholds) + 1
    idx = torch.bucketize(x, thresholds, right=True)  # number of thresholds <= x (NaN sorts above all)
    key = idx if key_offset is None else idx + key_offset
    ones = torch.ones((), dtype=torch.int64, device=x.device).expand(key.shape)
    count = torch.zeros(segments * bins, dtype=torch.int64, device=x.device).scatter_add_(0, key, ones)
    total = torch.zeros(segments * bins, dtype=weights.dtype, device=x.device).scatter_add_(0, key, weights)
    count, total = count.reshape(segments, bins), total.reshape(segments, bins)
    return count.cumsum(1)[:, :-1], total.cumsum(1)[:, :-1], total.sum(1)


class _RangeCounter:
    """Counts for one tensor role (``segments`` tensors at once, e.g. every parameter), summed over
    calls and steps; device tensors, no host sync.

    ``below[s, j]`` counts elements of segment ``s`` with ``|x| < thresholds.values[j]`` (a
    non-finite element sorts above every threshold: it counts as an overflow) and ``below_sq``
    sums their squares; ``sq`` is each segment's total sum of squares (fp64). ``scaled`` /
    ``scaled_sq`` do the same at each call's best fp8 scale ``fmt.max / amax``, compared as
    ``|x| < (limit / fmt.max) * amax``; no element overflows at that scale (``|x| <= amax``).
    Squares are taken of ``|x| / amax`` in fp32 (no overflow) and rescaled by ``amax**2`` in fp64.
    Each call costs a handful of passes over ``x`` (abs, amax, scale, square, bucketize).
    """

    def __init__(self, thresholds: _Thresholds, fp8: list[Format], segments: int = 1) -> None:
        self.thresholds = thresholds
        self.fp8 = fp8
        self.segments = segments
        self.numel = [0] * segments
        self.calls = 0
        self.amax: torch.Tensor | None = None  # (S,)
        self.below: torch.Tensor | None = None  # (S, K)
        self.below_sq: torch.Tensor | None = None
        self.sq: torch.Tensor | None = None  # (S,)
        self.scaled: torch.Tensor | None = None  # (S, K8)
        self.scaled_sq: torch.Tensor | None = None
        self._offsets: tuple[torch.Tensor, torch.Tensor] | None = None  # seg * bins, for both histograms

    def add(self, x: torch.Tensor, seg: torch.Tensor | None = None, numels: list[int] | None = None) -> None:
        """Count ``x`` (flattened); with ``seg``, element ``i`` belongs to segment ``seg[i]`` and
        ``numels`` gives each segment's size."""
        x_abs = x.detach().float().abs().flatten()
        static, static8 = self.thresholds.on(x_abs.device)
        k = len(static)
        if seg is None:
            amax = x_abs.amax().reshape(1) if x_abs.numel() else torch.zeros(1, device=x_abs.device)
            amax_safe = torch.where(amax > 0, amax, 1.0)  # an all-zero x: its zeros still count as zeros
            y = x_abs * amax_safe.reciprocal()  # |x| / amax in [0, 1]
            # the fp8 limits scale with this call's amax: merge them into the one sorted threshold list
            merged, order = torch.sort(torch.cat([static, static8 * amax_safe]))
            count, energy, sq = _histogram(x_abs, merged, y.square(), None, 1)
            count = torch.empty_like(count).scatter_(1, order[None], count)
            energy = torch.empty_like(energy).scatter_(1, order[None], energy)
            below, below_sq, scaled, scaled_sq = count[:, :k], energy[:, :k], count[:, k:], energy[:, k:]
        else:
            if self._offsets is None:
                self._offsets = (seg * (k + 1), seg * (len(static8) + 1))
            amax = torch.zeros(self.segments, device=x_abs.device).scatter_reduce_(0, seg, x_abs, "amax")
            y = x_abs * torch.where(amax > 0, amax, 1.0).reciprocal()[seg]
            y_sq = y.square()
            below, below_sq, sq = _histogram(x_abs, static, y_sq, self._offsets[0], self.segments)
            scaled, scaled_sq, _ = _histogram(y, static8, y_sq, self._offsets[1], self.segments)
        amax_sq = amax.double().square()  # (S,)
        below_sq, scaled_sq = below_sq.double() * amax_sq[:, None], scaled_sq.double() * amax_sq[:, None]
        sq = sq.double() * amax_sq
        if self.below is None:
            self.amax, self.below, self.below_sq, self.sq, self.scaled, self.scaled_sq = (
                amax, below, below_sq, sq, scaled, scaled_sq)
        else:
            self.amax = torch.maximum(self.amax, amax)
            self.below += below
            self.below_sq += below_sq
            self.sq += sq
            self.scaled += scaled
            self.scaled_sq += scaled_sq
        for s, n in enumerate(numels if numels is not None else [x_abs.numel()]):
            self.numel[s] += n
        self.calls += 1

    def to_host(self) -> list["_HostCounts"]:
        """Read the counts as Python numbers, one set per segment (a host sync)."""
        if self.below is None:
            return [_HostCounts(self.thresholds, self.fp8, 0, 0, 0.0, [], [], 0.0, [], [])] * self.segments
        amax, below, below_sq, sq = self.amax.tolist(), self.below.tolist(), self.below_sq.tolist(), self.sq.tolist()
        scaled, scaled_sq = self.scaled.tolist(), self.scaled_sq.tolist()
        return [_HostCounts(self.thresholds, self.fp8, self.numel[s], self.calls, amax[s], below[s], below_sq[s],
                            sq[s], scaled[s], scaled_sq[s]) for s in range(self.segments)]


class _HostCounts:
    """One segment's counts as Python numbers, and the :class:`RangeStats` they give."""

    def __init__(self, thresholds: _Thresholds, fp8: list[Format], numel: int, calls: int, amax: float,
                 below: list[int], below_sq: list[float], sq: float, scaled: list[int], scaled_sq: list[float]) -> None:
        self.t, self.fp8 = thresholds, fp8
        self.numel, self.calls, self.amax, self.sq = numel, calls, amax, sq
        self.below, self.below_sq, self.scaled, self.scaled_sq = below, below_sq, scaled, scaled_sq
        self.zeros = below[thresholds.index[("", "zero", 1.0)]] if below else 0

    def _fractions(self, count: int, energy: float) -> tuple[float, float]:
        nonzero = self.numel - self.zeros
        return ((count - self.zeros) / nonzero if nonzero else 0.0), (energy / self.sq if self.sq > 0 else 0.0)

    def at(self, fmt: Format, scale: float) -> RangeStats:
        if not self.numel:
            return RangeStats(scale, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        over = self.numel - self.below[self.t.index[(fmt.name, "max", scale)]]
        i, j = self.t.index[(fmt.name, "normal", scale)], self.t.index[(fmt.name, "flush", scale)]
        sub, sub_energy = self._fractions(self.below[i], self.below_sq[i])
        flushed, flushed_energy = self._fractions(self.below[j], self.below_sq[j])
        return RangeStats(scale, self.amax, over / self.numel, sub, flushed, sub_energy, flushed_energy)

    def best(self, fmt: Format) -> RangeStats:
        """fp8 at the best per-tensor scale (``scale`` reported from the amax over all calls)."""
        scale = fmt.max / self.amax if 0 < self.amax < math.inf else 1.0
        if not self.numel:
            return RangeStats(scale, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        i, j = self.t.index8[(fmt.name, "normal")], self.t.index8[(fmt.name, "flush")]
        sub, sub_energy = self._fractions(self.scaled[i], self.scaled_sq[i])
        flushed, flushed_energy = self._fractions(self.scaled[j], self.scaled_sq[j])
        return RangeStats(scale, self.amax, 0.0, sub, flushed, sub_energy, flushed_energy)
