"""Where the bench reads a CPU worker's peak memory: its own peak (VmHWM), never its launcher's carried over."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.programs.bench import measure
from mixprec.programs.bench.measure import RU_MAXRSS_SOURCE, MemoryMeter
from mixprec.programs.bench.memory_report import peak_source_lines

_HAS_VMHWM = Path("/proc/self/status").is_file() and "VmHWM:" in Path("/proc/self/status").read_text()
_CHILD = ("import resource; from mixprec.programs.bench.measure import MemoryMeter; m = MemoryMeter('cpu'); "
          "print(m.peak_mb()); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024); print(m.source)")


@pytest.mark.skipif(not _HAS_VMHWM, reason="needs Linux's /proc/self/status VmHWM")
def test_a_worker_child_that_allocates_less_than_its_parent_reports_its_own_smaller_peak():
    """A subprocess child (as the bench's workers are) inherits its parent's ru_maxrss across fork+exec; the meter
    reads VmHWM, the child's own peak, which lies far below a parent that touched 512 MiB more."""
    touched = bytearray(512 * 2**20)
    touched[::4096] = b"\x01" * (len(touched) // 4096)   # fault every page in
    del touched
    parent_mb = MemoryMeter("cpu").peak_mb()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True).stdout
    child_mb, child_ru_maxrss_mb, source = out.splitlines()
    assert parent_mb >= 512
    assert float(child_ru_maxrss_mb) >= parent_mb - 1   # the carried-over floor the meter no longer reads (1 MiB: KiB units)
    assert float(child_mb) < parent_mb - 256            # the child only imported torch: its own peak
    assert "VmHWM" in source and "own" in source


def test_vmhwm_is_read_in_kib_from_the_status_file(tmp_path, monkeypatch):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 999999 kB\nVmHWM:\t   12345 kB\nVmRSS:\t 100 kB\n")
    monkeypatch.setattr(measure, "PROC_SELF_STATUS", str(status))
    meter = MemoryMeter("cpu")
    assert meter.peak_mb() == 12345 / 1024 and "VmHWM" in meter.source


def test_without_vmhwm_the_floored_ru_maxrss_is_said_in_the_source_and_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "PROC_SELF_STATUS", str(tmp_path / "missing"))
    meter = MemoryMeter("cpu")
    assert meter.source == RU_MAXRSS_SOURCE and "floored" in meter.source
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes on macOS, KiB elsewhere
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
    assert before <= meter.peak_mb() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
    own = "process peak RSS (VmHWM of /proc/self/status: this process's own)"
    floored = peak_source_lines({"policies": {"fp32": {"memory_source": RU_MAXRSS_SOURCE},
                                              "bf16-mixed": {"memory_source": RU_MAXRSS_SOURCE}}})
    assert floored[1].startswith("**Peak memory is floored**") and f"{RU_MAXRSS_SOURCE} (fp32, bf16-mixed)" in floored[1]
    fine = peak_source_lines({"policies": {"fp32": {"memory_source": own}, "bf16-mixed": {"memory_source": own}}})
    assert fine == ["", f"Peak memory source: {own} (fp32, bf16-mixed).", ""]
    assert peak_source_lines({"policies": {"fp32": {"memory_source": None}}}) == [""]
