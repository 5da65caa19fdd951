"""What portable autocast costs on this device: ``ops=portable`` (the default) timed against ``ops=native``.

Two engines train the same workload from the same seed on the same batches, one with CUDA's op lists
ported to this device (:mod:`mixprec.autocast.portable`), one with torch's own (``<policy>,ops=native``).
They run in one process, interleaved in blocks that alternate which goes first, so drift on a shared
machine lands on both; the medians (ms per step, after warm-up) and their ratio are reported. The bench
runs it for its first ``-mixed`` policy; ``benchmarks/portable_ops.py`` runs it alone, longer.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from mixprec.programs.bench.measure import time_steps
from mixprec.programs.session import precision_optimizer
from mixprec.policy.resolve import resolve_policy
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.policy.policy import Policy
from mixprec.workloads import get_workload

__all__ = ["measure_portable_cost", "ported_policy", "bench_portable_cost"]


def ported_policy(names: list[str]) -> str | None:
    """The first policy of ``names`` that autocasts (compute dtype not fp32) with ``ops=portable``, or None."""
    for name in names:
        if name.lower() == "auto":
            continue
        policy = Policy.parse(name)
        if policy.is_mixed and policy.ops == "portable":
            return name
    return None


def _engine_step(workload: Any, policy: str, device: torch.device) -> Callable[[], None]:
    """One training step of ``policy``'s engine, built as the bench builds it (its precision optimizer where the
    policy rounds updates or keeps 16-bit state: bf16-sr, bf16-kahan)."""
    torch.manual_seed(0)
    model = workload.build_model()
    opt = precision_optimizer(workload.make_optimizer(model), resolve_policy(policy, device))
    mp = MixedPrecision(model, opt, policy=policy, device=device, scheduler=workload.make_scheduler(opt, 10_000),
                        max_grad_norm=workload.max_grad_norm)
    batches = workload.batches("train", seed=0)

    def step() -> None:
        batch = mp.cast_inputs(next(batches), keep=workload.keep_fp32_inputs)
        with mp.autocast():
            loss = workload.loss(mp.model, batch)
        mp.backward(loss)
        mp.step()
    return step


def measure_portable_cost(workload: str, policy: str, device: str | torch.device, *, config: str | None = None,
                          data: str | None = None, lora: str | None = None, steps: int = 20, block: int = 5,
                          warmup: int = 3) -> dict[str, Any]:
    """Median step time (ms) of ``policy`` with ``ops=portable`` and with ``ops=native``, interleaved.

    Returns ``{"policy", "portable_step_ms_median", "native_step_ms_median", "ratio_portable_over_native",
    "timed_steps_each", "method": "interleaved"}``. Host syncs: every step (timing). Raises what the engine
    or the workload raise for a bad ``policy`` or workload.
    """
    device = torch.device(device)
    load = get_workload(workload, config=config, data=data, lora=lora)
    native = f"{Policy.parse(policy).replace(ops='native')}"
    step_portable = _engine_step(load, policy, device)
    step_native = _engine_step(load, native, device)
    time_steps(step_portable, device, warmup)
    time_steps(step_native, device, warmup)
    portable_ms: list[float] = []
    native_ms: list[float] = []
    for i in range(max(1, steps // block)):   # alternate which loop goes first
        order = ((step_native, native_ms), (step_portable, portable_ms))
        for step, sink in (order if i % 2 == 0 else order[::-1]):
            sink.extend(time_steps(step, device, block))
    p, n = statistics.median(portable_ms), statistics.median(native_ms)
    return {"policy": policy, "portable_step_ms_median": round(p, 2), "native_step_ms_median": round(n, 2),
            "ratio_portable_over_native": round(p / n, 4), "timed_steps_each": len(native_ms),
            "method": "interleaved"}


def bench_portable_cost(config: Any, device: torch.device, runnable: list[str], progress: bool) -> dict | None:
    """The bench's ``portable_ops``: the step-time cost of ``ops=portable`` for the first ``-mixed`` policy of
    ``runnable`` (:func:`measure_portable_cost`); ``config`` is the bench's ``BenchConfig``. None under a strategy
    or on CUDA (CUDA's autocast has these lists itself) or without such a policy, and under ``timing="sequential"``
    (it is an extra timing run, 46 steps; sequential timing asks for none beyond the quality runs)."""
    policy = ported_policy(runnable)
    if policy is None or config.strategy is not None or device.type == "cuda" or config.timing == "sequential":
        return None
    if progress:
        print(f"timing ops=portable against ops=native for {policy} (interleaved)", file=sys.stderr)
    return measure_portable_cost(config.workload, policy, device, config=config.config_name, data=config.data,
                                 lora=config.lora)
