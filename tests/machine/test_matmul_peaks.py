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


def test_a_cache_file_holding_a_noisy_peak_is_measured_again_not_trusted(tmp_path, monkeypatch):
    """A busy machine's peak in the cache (fp32 at 1.4 GFLOP/s, written by an older ``mixprec doctor``) put the
    bench's MFU at 8455 % of it; it is measured again, and the quiet measurement replaces the file."""
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    path = matmul.peaks_path(torch.device("cpu"))
    path.write_text('{"fp32": {"dtype": "fp32", "gflops_per_s": 1.4, "n": 256, "spread": 2.0}}')
    quiet = {"fp32": matmul.MatmulPeak("fp32", 45.0, 1024, 47.7, spread=1.1)}
    monkeypatch.setattr(matmul, "measure_peaks", lambda device: quiet)
    assert matmul.cached_peaks("cpu") == quiet
    assert matmul.MatmulPeak(**__import__("json").loads(path.read_text())["fp32"]) == quiet["fp32"]


@pytest.mark.parametrize("spread", [1.1, 3.0])
def test_doctor_caches_the_peaks_it_measures_only_when_quiet(spread, tmp_path, monkeypatch):
    from mixprec.programs import doctor

    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    peaks = {name: matmul.MatmulPeak(name, 45.0, 128, 0.1, spread=spread) for name in matmul.DTYPES}
    monkeypatch.setattr(doctor, "measure_peaks", lambda device: peaks)
    report = doctor.run_doctor(measure=True)
    cpu = next(d for d in report["devices"] if d["device"] == "cpu")
    assert matmul.peaks_path(torch.device("cpu")).exists() == (spread < matmul.NOISY_SPREAD)
    assert (cpu["peaks_cache"] is None) == (spread > matmul.NOISY_SPREAD)


def test_a_size_that_stops_growing_early_is_a_busy_machine_not_a_peak(monkeypatch):
    """A steadily slow machine times evenly (spread 1.0) but stops the size early: fp32 at 128^3 taking 20 ms a
    product (0.2 GFLOP/s) is marked noisy and not cached; fp16 stopping early is what slow fp16 kernels do."""
    monkeypatch.setattr(matmul, "time_call", lambda call, device: 0.02)
    fp32 = matmul.measure_matmul("fp32", "cpu")
    assert (fp32.n, fp32.spread) == (128, 1.0) and fp32.noisy
    assert fp32.note.startswith("noisy: the size stopped growing at n=128 (20.0 ms per product; a busy machine)")
    assert not matmul.measure_matmul("fp16", "cpu").noisy
    assert not matmul.measure_matmul("fp32", "cpu", n=128).noisy   # a size asked for is measured as asked
