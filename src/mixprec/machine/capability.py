"""What a device can run: a :class:`Capability` per device, measured (the CPU's matmul probe, cached in-process
and on disk) or read from the device (CUDA's compute capability, MPS's bf16 support).

* CUDA: bf16 where torch says so; "fast" bf16 from compute capability 8.0.
* MPS: bf16 where the installed torch/macOS can create bf16 tensors and autocast to bf16 on MPS.
* CPU: bf16 counts as fast only where this CPU's bf16 matmul is measured at least 10 % faster than fp32 (512^3,
  the best of 5 after 2 warm-ups, the dtypes taking turns); fp16 is measured too (256^3), and is typically
  hundreds of times slower than fp32 without native kernels: on x86 it counts as native only with avx512_fp16 or
  amx_fp16 in the CPU's flags, whatever a timing says. Cached in ``$MIXPREC_CACHE_DIR`` (default
  ``~/.cache/mixprec``), unless the probe's own fp32 times disagree (a busy machine: then this process only).

Which policy runs on a capability is :mod:`mixprec.policy.resolve`'s question, not this module's.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mixprec.machine.cache import cache_dir, cpu_flags
from mixprec.machine.timing import time_calls

__all__ = ["Capability", "normalize_device", "probe", "reprobe"]

log = logging.getLogger("mixprec")

_FAST_RATIO = 1.1  # a half dtype counts as fast when its matmul beats fp32 by 10 %


@dataclass(frozen=True)
class Capability:
    """What a device can run. Ratios are measured matmul throughput relative to fp32."""

    device: str
    bf16: bool              # bf16 tensors and autocast work
    fp16: bool              # fp16 tensors and autocast work
    bf16_fast: bool         # bf16 matmul faster than fp32 (measured on CPU; by generation on CUDA)
    fp16_native: bool       # fp16 matmul not dramatically slower than fp32
    bf16_speed_ratio: float | None = None  # fp32 time / bf16 time (CPU probe)
    fp16_speed_ratio: float | None = None  # fp32 time / fp16 time (CPU probe)
    detail: str = ""


def normalize_device(device: str | torch.device | None) -> torch.device:
    """``None`` → the best available device (cuda, then mps, then cpu).

    Raises:
        ValueError: the device string is malformed or the device is not available here.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device; use 'cpu', 'cuda', 'cuda:1' or 'mps'") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available in this torch build/machine; "
                             "use device='cpu' (or 'mps' on Apple silicon)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device={device!r}: MPS is not available here; use device='cpu'")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use 'cpu', 'cuda[:N]' or 'mps'")
    return dev


def _best_matmul_s(dtypes: tuple[torch.dtype, ...], n: int, device: torch.device, reps: int = 5) -> list[float]:
    """The fastest of ``reps`` timed ``n``-cube matmuls per dtype, the dtypes taking turns (load that comes and goes
    hits each alike; other load only ever slows a run down, so the fastest is the least disturbed)."""
    gen = torch.Generator(device=device).manual_seed(0)   # its own: probing draws nothing from the caller's RNG
    operands = []
    for dtype in dtypes:
        a = torch.randn(n, n, device=device, generator=gen).to(dtype)
        operands.append((a, torch.randn(n, n, device=device, generator=gen).to(dtype)))
    for a, b in operands:
        for _ in range(2):  # warm-up: the first calls initialise kernels and are much slower
            a @ b
    best = [float("inf")] * len(dtypes)
    for _ in range(reps):
        for i, (a, b) in enumerate(operands):
            best[i] = min(best[i], time_calls(lambda: a @ b, device, 1)[0])
    return best


def _fp16_hardware() -> tuple[bool | None, str]:
    """Whether this CPU has fp16 matmul instructions, from its flags: on x86 avx512_fp16 or amx_fp16 (without
    them torch's fp16 matmul has no native kernel: ~100x slower than fp32 on an AMD EPYC, whatever a timing on a
    busy machine says); None where the flags do not tell (another architecture, no /proc/cpuinfo)."""
    flags = set(cpu_flags())
    if platform.machine().lower() not in ("x86_64", "amd64") or not flags:
        return None, ""
    native = bool(flags & {"avx512_fp16", "amx_fp16"})
    return native, "" if native else "; no avx512_fp16/amx_fp16 in this CPU's flags: fp16 matmuls are not native"


def _cache_path() -> Path:
    key = (f"{platform.machine()}-{platform.processor() or 'cpu'}-torch{torch.__version__}"
           f"-threads{torch.get_num_threads()}").replace("/", "_")
    return cache_dir() / f"cpu-probe-{key}.json"


def _probe_cpu() -> Capability:
    path = _cache_path()
    try:
        cached = Capability(**json.loads(path.read_text()))
        fp16_hw, hw_note = _fp16_hardware()   # a file written before the flags decided (or on a busy machine)
        if cached.fp16_native and fp16_hw is False:
            cached = replace(cached, fp16_native=False, detail=cached.detail + hw_note)
        return cached
    except (OSError, ValueError, TypeError):
        pass
    cpu = torch.device("cpu")
    # bf16: big enough that the matmul, not the call, dominates (~10 ms in fp32 on 2 cores).
    t32, t_bf16 = _best_matmul_s((torch.float32, torch.bfloat16), 512, cpu)
    # fp16: small, because without native kernels it can be ~500x slower than fp32.
    t32_small, t_fp16 = _best_matmul_s((torch.float32, torch.float16), 256, cpu)
    bf16_ratio, fp16_ratio = t32 / t_bf16, t32_small / t_fp16
    # fp32 per flop over 4x slower at 256^3 than at 512^3 is the machine's load, not the CPU (a loaded 2-core
    # machine slowed a 2-thread 256^3 product ~50x): the ratios are not cached
    disturbed = t32_small / 256**3 > 4 * t32 / 512**3
    fp16_hw, hw_note = _fp16_hardware()
    cap = Capability(
        device="cpu", bf16=True, fp16=True,
        bf16_fast=bf16_ratio >= _FAST_RATIO, fp16_native=fp16_ratio >= 0.5 and fp16_hw is not False,
        bf16_speed_ratio=round(bf16_ratio, 3), fp16_speed_ratio=round(fp16_ratio, 5),
        detail=(f"measured matmul speed vs fp32: bf16 {bf16_ratio:.2f}x (512^3), fp16 {fp16_ratio:.4f}x (256^3)"
                + hw_note + ("; noisy: fp32 ran over 4x slower per flop at 256^3 than at 512^3 (a busy machine), "
                             "not cached" if disturbed else "")),
    )
    if disturbed:
        return cap
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(cap)))
    except OSError:
        log.info("mixprec: could not cache the CPU probe at %s", path)
    return cap


def _probe_mps() -> Capability:
    try:
        torch.ones(2, dtype=torch.bfloat16, device="mps") @ torch.ones(2, dtype=torch.bfloat16, device="mps")
        with torch.autocast("mps", dtype=torch.bfloat16):
            pass
        bf16 = True
    except (RuntimeError, TypeError):
        bf16 = False
    return Capability(device="mps", bf16=bf16, fp16=True, bf16_fast=bf16, fp16_native=True,
                      detail="bf16 on MPS needs macOS 14+ and a recent torch" if not bf16 else "")


@functools.cache
def _probe_cached(device_key: str) -> Capability:
    dev = torch.device(device_key)
    if dev.type == "cpu":
        return _probe_cpu()
    if dev.type == "mps":
        return _probe_mps()
    major, minor = torch.cuda.get_device_capability(dev)
    bf16 = torch.cuda.is_bf16_supported()
    return Capability(device=device_key, bf16=bf16, fp16=True, bf16_fast=major >= 8, fp16_native=True,
                      detail=f"{torch.cuda.get_device_name(dev)}, compute capability {major}.{minor}")


def probe(device: str | torch.device | None = None) -> Capability:
    """Measure (once per process, cached on disk for the CPU) what ``device`` can run.

    The CPU probe times four small matmuls (about 0.1 s in all); its result is cached in
    ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``). Host syncs: yes (timing).
    """
    dev = normalize_device(device)
    key = dev.type if dev.type != "cuda" else f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return _probe_cached(key)


def reprobe(device: str | torch.device | None = None) -> Capability:
    """:func:`probe` measured again: the CPU probe's cache file and this process's cached result are dropped first
    (``mixprec doctor``, which re-measures everything it shows)."""
    if normalize_device(device).type == "cpu":
        _cache_path().unlink(missing_ok=True)
    _probe_cached.cache_clear()
    return probe(device)
