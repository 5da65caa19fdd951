"""What this machine's matmuls can do: which dtypes run (:func:`dtype_support`) and how fast (:func:`measure_matmul`,
:func:`cached_peaks`), for ``mixprec doctor`` and the bench's MFU.

Throughput is in GFLOP/s (``2 * n**3`` FLOPs per ``n x n`` product) for each dtype: ``a @ b`` for
fp32/bf16/fp16 and ``torch._scaled_mm`` with e4m3 operands, fp32 scales and a bf16 output for fp8. The
size ``n`` doubles from 128 until one product takes about 1/32 of the per-dtype time budget (the device is
then busy, not launching) or reaches the device's maximum size; slow dtypes (fp16 or fp8 without native
kernels, hundreds of times slower than fp32 on many CPUs) therefore stop at a small ``n`` and cost little
time. Each product is timed between two device syncs (:func:`mixprec.machine.timing.time_call`).

Measured peaks are cached as JSON in ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``), one file per
device, torch version and thread count, so ``mixprec bench`` computes MFU (model FLOP utilisation =
achieved GFLOP/s / peak GFLOP/s of the policy's compute dtype) without re-measuring.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mixprec.machine.cache import cache_dir, cpu_name
from mixprec.machine.cache import cpu_flags as machine_cpu_flags
from mixprec.machine.capability import normalize_device
from mixprec.machine.timing import time_call

__all__ = ["MatmulPeak", "DTYPES", "cpu_flags", "device_name", "matmul_call", "measure_matmul", "measure_peaks",
           "peaks_path", "write_peaks", "cached_peaks", "dtype_support", "peak_origin"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
# CPU features that decide 16-bit and 8-bit matmul speed (x86 names from /proc/cpuinfo; Arm "Features").
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
              "amx_tile", "amx_bf16", "amx_fp16", "amx_int8", "asimd", "asimdhp", "bf16", "sve", "sve2", "i8mm")
_MAX_N = {"cpu": 2048, "mps": 4096, "cuda": 8192}        # largest square matmul measured
_BUDGET_S = {"cpu": 0.6, "mps": 0.5, "cuda": 0.5}       # time budget per dtype (seconds)
NOISY_SPREAD = 1.5   # slowest / fastest timed product above which a peak is not cached (as the op plan's rule)
_GROWS_ON_CPU = {"fp32": 512, "bf16": 512}   # sizes any CPU's fp32/bf16 matmul passes within the budget when idle


@dataclass(frozen=True)
class MatmulPeak:
    """Measured matmul throughput of one dtype on one device.

    ``gflops_per_s`` is ``2 * n**3 / median_ms / 1e6`` (None when the dtype cannot run a
    matmul there, with the error in ``note``). ``measured_at`` (UTC, ISO 8601), ``pid`` and ``torch`` say when, by
    which process and under which torch it was measured (empty / None in a cache file from before they were kept).
    ``spread``: the slowest timed product over the fastest (1.0 on a quiet machine); above :data:`NOISY_SPREAD`
    the machine was busy, and :func:`cached_peaks` keeps the peak for this process only (a cached low peak would
    put every later MFU above its true value).
    """

    dtype: str
    gflops_per_s: float | None
    n: int = 0
    median_ms: float | None = None
    note: str = ""
    measured_at: str = ""
    pid: int | None = None
    torch: str = ""
    spread: float | None = None

    @property
    def noisy(self) -> bool:
        """True when ``spread`` exceeds :data:`NOISY_SPREAD`, or the note says the size stopped growing too early
        (both: a busy machine): not cached."""
        return (self.spread is not None and self.spread > NOISY_SPREAD) or self.note.startswith("noisy")


def peak_origin(peak: MatmulPeak) -> str:
    """Where ``peak`` comes from, in words: measured by this process, or cached (when, by which process and torch)."""
    if peak.pid == os.getpid():
        return f"measured by this process at {peak.measured_at or '?'}"
    if not peak.measured_at:
        return "cached; when and by which process not recorded (an older cache file)"
    return f"cached: measured {peak.measured_at} by pid {peak.pid}, torch {peak.torch or '?'}"


def cpu_flags() -> list[str]:
    """The matmul-relevant CPU feature flags of this machine (from ``/proc/cpuinfo``; [] elsewhere)."""
    present = set(machine_cpu_flags())
    return [f for f in _CPU_FLAGS if f in present]


def device_name(device: torch.device) -> str:
    """The device's name in words: the GPU's, "Apple MPS (<arch>)", or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    return cpu_name()


def matmul_call(dtype_name: str, n: int, device: torch.device) -> Callable[[], torch.Tensor]:
    """A zero-argument closure computing one ``n x n x n`` product in ``dtype_name``."""
    a_fp32 = torch.randn(n, n, device=device)
    b_fp32 = torch.randn(n, n, device=device)
    if dtype_name == "fp8":
        a_fp8 = a_fp32.to(torch.float8_e4m3fn)
        b_fp8_t = b_fp32.to(torch.float8_e4m3fn).t()  # (n, n), column-major as _scaled_mm requires
        scale = torch.ones((), device=device)  # fp32 scales: 1.0 (randn is well inside e4m3's range)
        return lambda: torch._scaled_mm(a_fp8, b_fp8_t, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    dtype = DTYPES[dtype_name]
    a, b = a_fp32.to(dtype), b_fp32.to(dtype)
    return lambda: a @ b


def measure_matmul(dtype_name: str, device: torch.device | str = "cpu", *, budget_s: float | None = None,
                   max_n: int | None = None, n: int | None = None) -> MatmulPeak:
    """Measure matmul GFLOP/s of ``dtype_name`` (``fp32``, ``bf16``, ``fp16``, ``fp8``) on ``device``.

    ``n`` doubles from 128 while eight times the last product's time stays under ``budget_s / 4``
    (so the next, 8x larger product would still fit) and ``n < max_n``; then the median of 3 to 20
    timed products at that ``n``. Total time is about ``2 * budget_s`` at most. A given ``n`` is measured at that
    size only (to compare two dtypes like with like). Host syncs: around every timed product.
    """
    device = normalize_device(device)
    if dtype_name not in DTYPES:
        raise ValueError(f"measure_matmul dtype_name={dtype_name!r} is not allowed; choose one of {list(DTYPES)}")
    budget_s = _BUDGET_S[device.type] if budget_s is None else budget_s
    max_n = (_MAX_N[device.type] if max_n is None else max_n) if n is None else n
    n = 128 if n is None else n
    stamp = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
             "torch": torch.__version__}
    try:
        while True:
            call = matmul_call(dtype_name, n, device)
            call()  # warm-up: kernel selection and first-touch allocation
            one_s = min(time_call(call, device) for _ in range(2))  # min: one stray stall must not stop growth
            if n * 2 > max_n or one_s * 8 > budget_s / 4:
                break
            n *= 2
        reps = max(3, min(20, int(budget_s / 2 / max(one_s, 1e-9))))
        times_s = [time_call(call, device) for _ in range(reps)]
        median_s = statistics.median(times_s)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        return MatmulPeak(dtype_name, None, note=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", **stamp)
    spread = round(max(times_s) / max(min(times_s), 1e-12), 3)
    note = f"noisy: timed products spread {spread:.2f}x (a busy machine); not cached" if spread > NOISY_SPREAD else ""
    if not note and device.type == "cpu" and dtype_name in _GROWS_ON_CPU and n < _GROWS_ON_CPU[dtype_name] < max_n:
        # a steadily slow machine times evenly (no spread) but stops the size early: 256^3 in fp32 taking 20 ms is
        # under 2 GFLOP/s, no CPU's peak
        note = (f"noisy: the size stopped growing at n={n} ({one_s * 1e3:.1f} ms per product; a busy machine); "
                "not cached")
    return MatmulPeak(dtype_name, round(2 * n**3 / median_s / 1e9, 3), n, round(median_s * 1e3, 4), note=note,
                      spread=spread, **stamp)


def measure_peaks(device: torch.device | str = "cpu") -> dict[str, MatmulPeak]:
    """:func:`measure_matmul` for every dtype in :data:`DTYPES` (about 2-4 s on a small CPU)."""
    return {name: measure_matmul(name, device) for name in DTYPES}


def peaks_path(device: torch.device) -> Path:
    """Where :func:`cached_peaks` keeps ``device``'s peaks: a file per device and torch version (and CPU threads)."""
    name = "".join(c if c.isalnum() else "-" for c in device_name(device))[:60]
    key = f"{device.type}{device.index if device.index is not None else ''}-{name}-torch{torch.__version__}"
    if device.type == "cpu":
        key += f"-threads{torch.get_num_threads()}"
    return cache_dir() / f"peaks-{key.replace('/', '_')}.json"


def write_peaks(device: torch.device, peaks: dict[str, MatmulPeak]) -> Path | None:
    """Write ``peaks`` to :func:`peaks_path` atomically: the path, or None when it cannot be written."""
    path = peaks_path(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in peaks.items()}, indent=1))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def cached_peaks(device: torch.device | str = "cpu", *, remeasure: bool = False) -> dict[str, MatmulPeak]:
    """Matmul peaks of ``device`` from the cache, measuring (and caching) them when absent. A measurement with a
    noisy dtype (:attr:`MatmulPeak.noisy`) is returned but not written: the next process measures again; a cache
    file holding one (written by hand, or by an older ``mixprec doctor``) is measured again, not trusted."""
    device = normalize_device(device)
    path = peaks_path(device)
    if not remeasure:
        try:
            cached = {k: MatmulPeak(**v) for k, v in json.loads(path.read_text()).items()}
            if not any(p.noisy for p in cached.values()):
                return cached
        except (OSError, ValueError, TypeError):
            pass
    peaks = measure_peaks(device)
    if not any(p.noisy for p in peaks.values()):
        write_peaks(device, peaks)
    return peaks


def dtype_support(device: torch.device | str) -> dict[str, dict[str, bool | None]]:
    """Per dtype: ``{"autocast": bool | None, "matmul": bool}`` on ``device``, by trying each.

    ``autocast`` is None for fp32 (autocast off is fp32) and False for fp8 (torch.autocast has
    no fp8 mode; fp8 runs through scaled matmuls). A tiny 16 x 16 product tests each case.
    """
    device = normalize_device(device)
    support: dict[str, dict[str, bool | None]] = {}
    for name, dtype in DTYPES.items():
        try:
            matmul_call(name, 16, device)()
            matmul = True
        except (RuntimeError, TypeError, NotImplementedError):
            matmul = False
        autocast: bool | None = None if name == "fp32" else False
        if name in ("bf16", "fp16") and torch.amp.is_autocast_available(device.type):
            try:
                x_fp32 = torch.randn(16, 16, device=device)
                with torch.autocast(device.type, dtype=dtype):
                    autocast = (x_fp32 @ x_fp32).dtype == dtype
            except (RuntimeError, TypeError):
                autocast = False
        support[name] = {"autocast": autocast, "matmul": matmul}
    return support
