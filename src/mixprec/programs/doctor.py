"""``mixprec doctor``: what this machine can run, how fast its matmuls are, and what ``auto`` picks.

For every visible device (the CPU, each CUDA GPU, MPS) the doctor reports:

* which dtypes (fp32, bf16, fp16, fp8 e4m3) work under ``torch.autocast`` and in a matmul, and
  measured matmul throughput in GFLOP/s for each (:mod:`mixprec.machine.matmul`);
* the policy ``auto`` resolves to, with the reason (:func:`mixprec.policy.resolve.resolve`).

``mixprec doctor`` always re-measures the matmul peaks and rewrites their cache
(:func:`mixprec.machine.matmul.cached_peaks`, which ``mixprec bench`` reads for MFU), and re-runs the CPU probe
``auto`` decides by. Each dtype's speed relative to fp32 (``x fp32``) is one ratio, taken at one size for both
dtypes: on the CPU, bf16's and fp16's are the probe's (the numbers ``auto`` decided by); otherwise fp32 is timed
again at the dtype's own size.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict

import torch

from mixprec.optim import c_kernels
from mixprec.machine.capability import Capability, probe, reprobe
from mixprec.machine.matmul import (MatmulPeak, cached_peaks, cpu_flags, device_name, dtype_support, measure_matmul,
                                    measure_peaks, peaks_path, write_peaks)
from mixprec.policy.resolve import auto_candidates, resolve
from mixprec.autocast.op_plan import cached as cached_plan
from mixprec.optim import quantized_adamw
from mixprec.autocast.portable import op_table

__all__ = ["run_doctor", "format_doctor"]


def _visible_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append(torch.device("mps"))
    return devices


def _ratios(device: torch.device, peaks: dict[str, MatmulPeak], cap: Capability) -> dict[str, dict]:
    """Per dtype but fp32: ``{ratio, n, source}``, its matmul speed over fp32's at one size ``n`` for both."""
    probed = {"bf16": (cap.bf16_speed_ratio, 512), "fp16": (cap.fp16_speed_ratio, 256)} if device.type == "cpu" else {}
    ratios = {}
    for name, peak in peaks.items():
        if name == "fp32" or not peak.gflops_per_s:
            continue
        if probed.get(name, (None,))[0]:
            ratio, n = probed[name]
            ratios[name] = {"ratio": ratio, "n": n, "source": "the CPU probe auto decides by (best of 5)"}
            continue
        fp32 = peaks["fp32"] if peaks["fp32"].n == peak.n else measure_matmul("fp32", device, n=peak.n)
        if fp32.gflops_per_s:
            ratios[name] = {"ratio": round(peak.gflops_per_s / fp32.gflops_per_s, 4), "n": peak.n,
                            "source": "fp32 timed at the same size"}
    return ratios


def _device_report(device: torch.device, *, measure: bool) -> dict:
    peaks = measure_peaks(device) if measure else cached_peaks(device)
    noisy = any(p.noisy for p in peaks.values())   # a busy machine: shown, never cached (cached_peaks' rule)
    cache = (None if noisy else write_peaks(device, peaks)) if measure else peaks_path(device)
    cap = reprobe(device) if measure else probe(device)
    try:
        resolution = resolve("auto", device)
        auto_policy, auto_reason = str(resolution.policy), resolution.decision
    except ValueError as err:
        auto_policy, auto_reason = None, str(err)
    candidates = list(auto_candidates(cap))
    report = {"device": str(device), "name": device_name(device)}
    if device.type == "cpu":
        report.update(threads=torch.get_num_threads(), cpu_count=os.cpu_count(), cpu_flags=cpu_flags())
    elif device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report.update(compute_capability=f"{props.major}.{props.minor}", memory_gb=round(props.total_memory / 2**30, 1))
    report.update(dtypes=dtype_support(device), matmul={k: asdict(v) for k, v in peaks.items()},
                  matmul_vs_fp32=_ratios(device, peaks, cap),
                  auto_policy=auto_policy, auto_reason=auto_reason, auto_candidates=candidates,
                  auto_reason_brief=auto_reason.replace(cap.detail, "bf16 and fp16 matmul speed vs fp32 as in x fp32 above")
                  if device.type == "cpu" and cap.detail else auto_reason,
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
    ``dtypes``, ``matmul`` (:class:`mixprec.machine.matmul.MatmulPeak` fields per dtype), ``matmul_vs_fp32``
    (per dtype but fp32: ``{ratio, n, source}``, its speed over fp32's with both at size ``n``), ``auto_policy``,
    ``auto_reason`` (the matmul probe's rule, used without a model; ``auto_reason_brief`` the same with the probe's
    ratios left to ``matmul_vs_fp32``), ``auto_candidates`` (what ``auto``
    times on a model: :mod:`mixprec.auto.trial`), ``peaks_cache``, plus ``threads``/``cpu_flags`` on the CPU),
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
                  f"  {'dtype':<6}{'autocast':>9}{'matmul':>8}{'GFLOP/s':>11}{'size':>7}{'x fp32':>9}{'at':>7}"]
        for name, support in dev["dtypes"].items():
            peak = dev["matmul"][name]
            gflops = peak["gflops_per_s"]
            same = dev["matmul_vs_fp32"].get(name)   # one ratio, both dtypes at one size
            ratio = "1" if name == "fp32" else f"{same['ratio']:.3g}" if same else "-"
            at = f"{same['n']}³" if same else (f"{peak['n']}³" if name == "fp32" and peak["n"] else "-")
            shown = f"{gflops:.4g}" if gflops is not None else "-"
            lines.append(f"  {name:<6}{_yes_no(support['autocast']):>9}{_yes_no(support['matmul']):>8}"
                         f"{shown:>11}{peak['n'] or '-':>7}{ratio:>9}{at:>7}" + (f"  ({peak['note']})" if peak["note"] else ""))
        lines.append("  x fp32: the dtype's matmul speed over fp32's with both at the size in 'at' "
                     "(on the CPU, bf16's and fp16's are the probe auto decides by)")
        lines.append(f"  policy auto without a model: {dev['auto_policy']} ({dev['auto_reason_brief']})")
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
