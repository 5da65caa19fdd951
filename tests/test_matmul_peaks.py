"""Matmul peaks (mixprec.machine.matmul): a peak measured on a busy machine is used by its process, never cached."""

from __future__ import annotations

import pytest
import torch

from mixprec.machine import matmul


def test_a_measured_peak_says_its_spread():
    peak = matmul.measure_matmul("fp32", "cpu", n=128)
    assert peak.spread is not None and peak.spread >= 1.0
    assert peak.noisy == (peak.spread > matmul.NOISY_SPREAD)
    assert ("noisy" in peak.note) == peak.noisy


@pytest.mark.parametrize("spread, cached", [(1.1, True), (3.0, False)])
def test_only_quiet_peaks_are_cached(spread, cached, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    peaks = {"fp32": matmul.MatmulPeak("fp32", 45.0, 1024, 47.7, spread=spread),
             "bf16": matmul.MatmulPeak("bf16", 180.0, 2048, 95.8, spread=1.05)}
    monkeypatch.setattr(matmul, "measure_peaks", lambda device: peaks)
    assert matmul.cached_peaks("cpu") == peaks
    assert matmul.peaks_path(torch.device("cpu")).exists() == cached


def test_a_cache_file_without_spread_still_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    path = matmul.peaks_path(torch.device("cpu"))
    path.write_text('{"fp32": {"dtype": "fp32", "gflops_per_s": 150.0, "n": 1024}}')
    peak = matmul.cached_peaks("cpu")["fp32"]
    assert (peak.gflops_per_s, peak.spread, peak.noisy) == (150.0, None, False)
