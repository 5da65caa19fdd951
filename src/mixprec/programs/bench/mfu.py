"""The bench's MFU denominators: the matmul peaks it read (``mixprec doctor``'s, measured now or cached by another
process) with where each comes from, and the one named peak every row's MFU is against."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mixprec.machine.matmul import MatmulPeak, peak_origin
from mixprec.programs.bench.results import PolicyRun

__all__ = ["peak_key", "peaks_environment", "one_mfu_peak"]

_PEAK_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def peak_key(dtype: torch.dtype) -> str:
    """The peaks' key for a compute dtype (``"fp32"``, ``"bf16"``, ``"fp16"``: ``RunSpec.peaks_gflops``' keys, a
    row's ``compute_dtype``). KeyError for another dtype."""
    return _PEAK_KEYS[dtype]


def peaks_environment(peaks: dict[str, MatmulPeak]) -> dict[str, dict]:
    """results.json ``environment``'s peak keys: ``peaks_gflops_per_s``, ``peaks_matmul_n`` and ``peaks_origin``
    (per dtype, :func:`mixprec.machine.matmul.peak_origin`: measured by this run, or cached: when, by which
    process and torch)."""
    return {"peaks_gflops_per_s": {name: peak.gflops_per_s for name, peak in peaks.items()},
            "peaks_matmul_n": {name: peak.n for name, peak in peaks.items()},
            "peaks_origin": {name: peak_origin(peak) for name, peak in peaks.items()}}


def one_mfu_peak(entries: dict[str, PolicyRun], peaks: dict[str, MatmulPeak]
                 ) -> tuple[dict[str, Any] | None, dict[str, PolicyRun]]:
    """MFU against one named peak, the device's fastest 16/32-bit matmul dtype (``mixprec doctor``'s, cached per
    torch version and thread count), so the column compares policies; each row keeps ``mfu_own_dtype`` (against
    its compute dtype's peak). Returns results.json's ``mfu_peak`` (None without peaks): ``dtype``,
    ``gflops_per_s``, and where that peak comes from: ``n`` (the matmul size), ``source`` (in words),
    ``measured_at``, ``measured_by_pid``, ``torch``; and the rows."""
    known = {d: p for d, p in peaks.items() if d in ("fp32", "bf16", "fp16") and p.gflops_per_s}
    if not known:
        return None, entries
    dtype = max(known, key=lambda d: known[d].gflops_per_s)
    peak = known[dtype]
    entries = {name: e if e.gflops_per_s is None else
               replace(e, mfu_own_dtype=e.mfu, mfu=e.gflops_per_s / (peak.gflops_per_s * (e.world_size or 1)))
               for name, e in entries.items()}
    above = [n for n, e in entries.items() if max(e.mfu or 0, e.mfu_own_dtype or 0) > 1]
    if above:   # a peak below what a row achieved is no peak (measured on a busy machine): no MFU, said
        entries = {n: replace(e, mfu=None, mfu_own_dtype=None) for n, e in entries.items()}
    return {"dtype": dtype, "gflops_per_s": peak.gflops_per_s, "n": peak.n, "source": peak_origin(peak),
            "measured_at": peak.measured_at or None, "measured_by_pid": peak.pid, "torch": peak.torch or None,
            "unreliable": (f"{', '.join(above)} achieved more than the measured peak: it was measured on a busy "
                           "machine (delete the peaks cache or run `mixprec doctor` on a quiet one); MFU not shown")
            if above else None}, entries
