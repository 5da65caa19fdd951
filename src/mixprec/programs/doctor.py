"""``mixprec doctor``: what this machine can run, how fast its matmuls are, and what ``auto`` picks.

For every visible device (the CPU, each CUDA GPU, MPS) the doctor reports:

* which dtypes (fp32, bf16, fp16, fp8 e4m3) work under ``torch.autocast`` and in a matmul;
* measured matmul throughput in GFLOP/s (``2 * n**3`` FLOPs per ``n x n`` product) for each
  dtype: ``a @ b`` for fp32/bf16/fp16 and ``torch._scaled_mm`` with e4m3 operands, fp32 scales
  and a bf16 output for fp8. The size ``n`` doubles from 128 until one product takes about
  1/32 of the per-dtype time budget (the device is then busy, not launching) or reaches the
  device's maximum size; slow dtypes (fp16 or fp8 without native kernels, hundreds of times
  slower than fp32 on many CPUs) therefore stop at a small ``n`` and cost little time;
* the policy ``auto`` resolves to, with the reason (:func:`mixprec.policy.resolve.resolve`).

Measured peaks are cached as JSON in ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``),
one file per device, torch version and thread count, so ``mixprec bench`` computes MFU
(model FLOP utilisation = achieved GFLOP/s / peak GFLOP/s of the policy's compute dtype)
without re-measuring. ``mixprec doctor`` always re-measures and rewrites the cache.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mixprec.optim import c_kernels
from mixprec.machine.cache import cache_dir, cpu_name
from mixprec.machine.cache import cpu_flags as machine_cpu_flags
from mixprec.policy.resolve import auto_candidates, normalize_device, probe, resolve
from mixprec.autocast.op_plan import cached as cached_plan
from mixprec.optim import quantized_adamw
from mixprec.autocast.portable import op_table

__all__ = ["MatmulPeak", "DTYPES", "synchronize", "cpu_flags", "cpu_name", "cache_dir",
           "measure_matmul", "measure_peaks", "cached_peaks", "dtype_support", "run_doctor",
           "format_doctor"]

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


@dataclass(frozen=True)
class MatmulPeak:
    """Measured matmul throughput of one dtype on one device.

    ``gflops_per_s`` is ``2 * n**3 / median_ms / 1e6`` (None when the dtype cannot run a
    matmul there, with the error in ``note``).
    """

    dtype: str
    gflops_per_s: float | None
    n: int = 0
    median_ms: float | None = None
    note: str = ""


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has finished all queued work (a host-device sync; no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def cpu_flags() -> list[str]:
    """The matmul-relevant CPU feature flags of this machine (from ``/proc/cpuinfo``; [] elsewhere)."""
    present = set(machine_cpu_flags())
    return [f for f in _CPU_FLAGS if f in present]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    return cpu_name()


def _matmul_call(dtype_name: str, n: int, device: torch.device) -> Callable[[], torch.Tensor]:
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


def _time_call(call: Callable[[], torch.Tensor], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def measure_matmul(dtype_name: str, device: torch.device | str = "cpu", *, budget_s: float | None = None,
                   max_n: int | None = None) -> MatmulPeak:
    """Measure matmul GFLOP/s of ``dtype_name`` (``fp32``, ``bf16``, ``fp16``, ``fp8``) on ``device``.

    ``n`` doubles from 128 while eight times the last product's time stays under ``budget_s / 4``
    (so the next, 8x larger product would still fit) and ``n < max_n``; then the median of 3 to 20
    timed products at that ``n``. Total time is about ``2 * budget_s`` at most. Host syncs:
    around every timed product.
    """
    device = normalize_device(device)
    if dtype_name not in DTYPES:
        raise ValueError(f"measure_matmul dtype_name={dtype_name!r} is not allowed; choose one of {list(DTYPES)}")
    budget_s = _BUDGET_S[device.type] if budget_s is None else budget_s
    max_n = _MAX_N[device.type] if max_n is None else max_n
    n = 128
    try:
        while True:
            call = _matmul_call(dtype_name, n, device)
            call()  # warm-up: kernel selection and first-touch allocation
            one_s = min(_time_call(call, device) for _ in range(2))  # min: one stray stall must not stop growth
            if n * 2 > max_n or one_s * 8 > budget_s / 4:
                break
            n *= 2
        reps = max(3, min(20, int(budget_s / 2 / max(one_s, 1e-9))))
        median_s = statistics.median(_time_call(call, device) for _ in range(reps))
    except (RuntimeError, TypeError, NotImplementedError) as err:
        return MatmulPeak(dtype_name, None, note=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    return MatmulPeak(dtype_name, round(2 * n**3 / median_s / 1e9, 3), n, round(median_s * 1e3, 4))


def measure_peaks(device: torch.device | str = "cpu") -> dict[str, MatmulPeak]:
    """:func:`measure_matmul` for every dtype in :data:`DTYPES` (about 2-4 s on a small CPU)."""
    return {name: measure_matmul(name, device) for name in DTYPES}


def _peaks_path(device: torch.device) -> Path:
    name = "".join(c if c.isalnum() else "-" for c in _device_name(device))[:60]
    key = f"{device.type}{device.index if device.index is not None else ''}-{name}-torch{torch.__version__}"
    if device.type == "cpu":
        key += f"-threads{torch.get_num_threads()}"
    return cache_dir() / f"peaks-{key.replace('/', '_')}.json"


def _write_cache(device: torch.device, peaks: dict[str, MatmulPeak]) -> Path | None:
    path = _peaks_path(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in peaks.items()}, indent=1))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def cached_peaks(device: torch.device | str = "cpu", *, remeasure: bool = False) -> dict[str, MatmulPeak]:
    """Matmul peaks of ``device`` from the cache, measuring (and caching) them when absent."""
    device = normalize_device(device)
    path = _peaks_path(device)
    if not remeasure:
        try:
            return {k: MatmulPeak(**v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, TypeError):
            pass
    peaks = measure_peaks(device)
    _write_cache(device, peaks)
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
            _matmul_call(name, 16, device)()
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


def _visible_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append(torch.device("mps"))
    return devices


def _device_report(device: torch.device, *, measure: bool) -> dict:
    peaks = measure_peaks(device) if measure else cached_peaks(device)
    cache = _write_cache(device, peaks) if measure else _peaks_path(device)
    try:
        resolution = resolve("auto", device)
        auto_policy, auto_reason = str(resolution.policy), resolution.decision
    except ValueError as err:
        auto_policy, auto_reason = None, str(err)
    candidates = list(auto_candidates(probe(device)))
    report = {"device": str(device), "name": _device_name(device)}
    if device.type == "cpu":
        report.update(threads=torch.get_num_threads(), cpu_count=os.cpu_count(), cpu_flags=cpu_flags())
    elif device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report.update(compute_capability=f"{props.major}.{props.minor}", memory_gb=round(props.total_memory / 2**30, 1))
    report.update(dtypes=dtype_support(device), matmul={k: asdict(v) for k, v in peaks.items()},
                  auto_policy=auto_policy, auto_reason=auto_reason, auto_candidates=candidates,
                  peaks_cache=str(cache) if cache else None,
                  autocast_ops=_autocast_ops(device))
    plan_path, plan = cached_plan(device)
    report.update(op_plan_cache=plan_path, op_plan={key: value.get("chosen") for key, value in plan.items()})
    return report


def _autocast_ops(device: torch.device) -> dict[str, dict[str, list[str]]]:
    """CUDA's fp32 and lower-precision autocast ops by what ``device``'s own autocast does with them:
    ``own kernel`` (cast by torch here too), ``ported`` (cast only under ``ops=portable``), ``same`` (CUDA)."""
    table: dict[str, dict[str, list[str]]] = {}
    for name, category, native in op_table(device.type):
        table.setdefault(native, {}).setdefault(category, []).append(name)
    return table


def run_doctor(*, measure: bool = True) -> dict:
    """The doctor's report as plain data (what ``mixprec doctor --json`` prints).

    Keys: ``torch``, ``python``, ``platform``, ``cuda`` (the CUDA version torch was built
    with, or None), ``devices`` (one dict per visible device: ``device``, ``name``,
    ``dtypes``, ``matmul`` (:class:`MatmulPeak` fields per dtype), ``auto_policy``,
    ``auto_reason`` (the matmul probe's rule, used without a model), ``auto_candidates`` (what ``auto``
    times on a model: :mod:`mixprec.policy.auto`), ``peaks_cache``, plus ``threads``/``cpu_flags`` on the CPU),
    ``adamw_8bit_cpu`` (how 8-bit-state AdamW steps run on a CPU: :func:`mixprec.optim.quantized_adamw.kernel_status`,
    which builds and checks the C kernel if this machine has not yet), ``adamw_8bit_cpu_library`` (the cached
    kernel file it loaded, or None). With ``measure=False`` cached peaks
    are used where present.
    """
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "devices": [_device_report(d, measure=measure) for d in _visible_devices()],
        "adamw_8bit_cpu": quantized_adamw.kernel_status(),
        "adamw_8bit_cpu_library": None if (lib := quantized_adamw.library_path()) is None else str(lib),
    }


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def format_doctor(report: dict) -> str:
    """The human-readable form of :func:`run_doctor`'s report."""
    lines = [f"mixprec doctor: torch {report['torch']}, python {report['python']}, {report['platform']}"]
    for dev in report["devices"]:
        extra = ""
        if "threads" in dev:
            extra = f", {dev['threads']} torch threads; flags: {' '.join(dev['cpu_flags']) or 'none found'}"
        elif "compute_capability" in dev:
            extra = f", compute capability {dev['compute_capability']}, {dev['memory_gb']} GB"
        lines += ["", f"device {dev['device']}: {dev['name']}{extra}",
                  f"  {'dtype':<6}{'autocast':>9}{'matmul':>8}{'GFLOP/s':>11}{'size':>7}{'x fp32':>9}"]
        fp32 = dev["matmul"]["fp32"]["gflops_per_s"]
        for name, support in dev["dtypes"].items():
            peak = dev["matmul"][name]
            gflops = peak["gflops_per_s"]
            ratio = f"{gflops / fp32:.3g}" if gflops and fp32 else "-"
            shown = f"{gflops:.4g}" if gflops is not None else "-"
            lines.append(f"  {name:<6}{_yes_no(support['autocast']):>9}{_yes_no(support['matmul']):>8}"
                         f"{shown:>11}{peak['n'] or '-':>7}{ratio:>9}" + (f"  ({peak['note']})" if peak["note"] else ""))
        lines.append(f"  policy auto without a model: {dev['auto_policy']} ({dev['auto_reason']})")
        if len(dev.get("auto_candidates") or []) > 1:
            lines.append(f"  policy auto with a model (MixedPrecision(policy='auto'), resolve(..., model=...)): "
                         f"{' vs '.join(dev['auto_candidates'])} timed on the model at its first forward")
        for native, categories in dev["autocast_ops"].items():
            lines.append(f"  CUDA autocast ops, {native} on {dev['device']}" +
                         (" (cast only under ops=portable)" if native == "ported" else "") + ":")
            lines += [f"    {category}: {' '.join(names)}" for category, names in categories.items()]
        if dev["peaks_cache"]:
            lines.append(f"  peaks cached at {dev['peaks_cache']}")
        if "op_plan" in dev:
            lines.append(f"  op plan (kernels=measured): {len(dev['op_plan'])} keys measured on this machine, cached at "
                         f"{dev['op_plan_cache']}" + (":" if dev["op_plan"] else ""))
            lines += [f"    {key} -> {chosen}" for key, chosen in dev["op_plan"].items()]
    lines += ["", f"8-bit-state AdamW steps on a CPU (state=int8|fp8, bf16-lean): {report['adamw_8bit_cpu']}"]
    if report.get("adamw_8bit_cpu_library"):
        lines.append(f"  checked bit for bit against the torch-op reference at load; built with "
                     f"{' '.join(c_kernels.compiler() or ['?'])}, cached at {report['adamw_8bit_cpu_library']} "
                     "(MIXPREC_C_KERNELS=0 turns it off)")
    return "\n".join(lines)
