"""``mixprec bench``: every policy side by side with fp32, one resident process each, then verdicts.

:func:`run_bench` plans the rows (:mod:`~mixprec.programs.bench.row_plan`: fp32 first as the reference, each other
policy resolved for the device with the measured capability, SKIPPED with the measured reason where the device
refuses it; nothing is run in another precision than asked: each worker records the engine's ``policy`` and
``decision`` and the report shows them), measures the bench's one attention plan
(:mod:`~mixprec.programs.bench.pinned_plan`), trains the rows (:mod:`~mixprec.programs.bench.row_runs`: by default
in one pass of resident workers taking turns, so the quality steps are the interleaved timed steps), computes the
deltas against fp32 (speedup, memory ratios, relative eval-loss delta) and judges them
(:mod:`~mixprec.programs.bench.judging`), then assembles the results and writes the outputs
(:mod:`~mixprec.programs.bench.report`).

**Default step count** (:data:`DEFAULT_STEPS` = 300 on ``gpt``/``mid``): enough steps for the model to leave the
unigram plateau, so a loss delta measures training rather than the first drop, while the default run stays within
its time budget on a small CPU; docs/bench.md ("Why 300 steps") has the numbers. ``--quick``
(:data:`~mixprec.programs.bench.schedule.QUICK_STEPS`) is a smoke test and says so in its verdicts.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from mixprec.distributed.process import is_main_process, world_size
from mixprec.machine.cache import cpu_name
from mixprec.machine.capability import Capability, normalize_device
from mixprec.machine.matmul import cached_peaks, cpu_flags
from mixprec.programs.bench.config import (DEFAULT_GPT_CONFIG, DEFAULT_POLICIES, DEFAULT_STEPS, REFERENCE,
                                           BenchConfig)
from mixprec.programs.bench.judging import judge_policies
from mixprec.programs.bench.mfu import one_mfu_peak, peaks_environment
from mixprec.programs.bench.peer import plan_peer, with_peer_ratios
from mixprec.programs.bench.pinned_plan import measure_bench_plan
from mixprec.programs.bench.portable_cost import bench_portable_cost
from mixprec.programs.bench.recompute_rows import DEFAULT_RECOMPUTE, split_row, with_recompute_ratios
from mixprec.programs.bench.report import write_outputs
from mixprec.programs.bench.results import BenchResults
from mixprec.programs.bench.row_plan import CAPABILITY_ENV, capability_for, plan_policy, plan_rows
from mixprec.programs.bench.row_runs import RowRun, train_rows
from mixprec.programs.bench.schedule import QUICK_STEPS
from mixprec.programs.bench.verdict import smoke_words
from mixprec.workloads import get_workload

__all__ = ["BenchConfig", "DEFAULT_POLICIES", "DEFAULT_STEPS", "DEFAULT_GPT_CONFIG", "CAPABILITY_ENV", "run_bench",
           "plan_policy", "judge_policies"]


def run_bench(config: BenchConfig, *, capability: Capability | None = None, progress: bool = True) -> BenchResults:
    """Run the bench described by ``config``, write its outputs to ``config.out`` and return
    the results (``results.json`` is their :meth:`~BenchResults.to_json`).

    ``capability`` replaces the device probe when planning which policies run (tests).

    With ``config.strategy``, every torchrun rank calls this: the runners join a gloo group
    (coordination only), follow rank 0's plan, and for each policy start one worker per rank,
    which meet on a fresh port rank 0 picks (``MASTER_PORT``) and train as one run; only rank 0
    writes ``config.out`` (its workers' files; other ranks' under ``workers/rank-<r>``), with
    throughput summed over the ranks. All ranks return the results.

    Raises:
        ValueError / ImportError: a bad policy name, workload, config, data path or device
            (before any run).
    """
    start = time.perf_counter()
    device = normalize_device(config.device)
    cap = capability_for(device, capability)
    config, description = _with_steps(config)
    peaks = cached_peaks(device)
    names, skip, advice = plan_rows(config, device, cap, progress)
    bases = {split_row(n)[0]: skip[n] for n in names}   # a recompute row's policy plans like its plain row
    plan = measure_bench_plan(config, device, cap, list(bases), bases, progress)   # one attention plan, pinned for all
    planned_s, runnable = time.perf_counter() - start, [n for n in bases if bases[n] is None]   # planned_s: until here
    peer = plan_peer(device, cap, strategy=config.strategy) if config.peer else None
    run = RowRun.prepare(config, device, peaks, plan, peer)
    entries, seed_noise, timing = train_rows(run, names + list(peer.rows() if peer else {}),   # the peer's row last
                                             {**skip, **(peer.rows() if peer else {})}, progress)
    timing["phases_s"] = {"plan": round(planned_s, 2), **timing.get("phases_s", {})}
    entries = with_peer_ratios(with_recompute_ratios(entries))
    mfu_peak, entries = one_mfu_peak(entries, peaks)
    entries = judge_policies(entries, config.targets, noisy=timing["noisy"], seed_noise=seed_noise,
                             smoke=smoke_words(config.steps, config.seeds > 1) if config.quick else None)
    portable = bench_portable_cost(config, device, runnable, progress) if config.portable_cost else None
    results = BenchResults(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=config.command,
        settings=_settings(run, names), workload=description,
        environment=_environment(device, cap, peaks, config.command), reference=REFERENCE,
        advice=advice,
        policies=entries, timing=timing, seed_noise=seed_noise, mfu_peak=mfu_peak, portable_ops=portable,
        parent_pid=os.getpid(), wall_s=time.perf_counter() - start, op_plan=plan,
        peer=None if peer is None else peer.as_json())
    if is_main_process():
        write_outputs(results.to_json(), Path(config.out))
    return results


def _with_steps(config: BenchConfig) -> tuple[BenchConfig, dict]:
    """``config`` with its step count (``--steps``, else :data:`QUICK_STEPS` under ``--quick``, else the workload's
    ``default_steps``) and the workload's description; the workload, built to read them, is dropped."""
    workload = get_workload(config.workload, config=config.config_name, data=config.data, lora=config.lora)
    description = workload.describe()
    default_steps = QUICK_STEPS if config.quick else int(getattr(workload, "default_steps", DEFAULT_STEPS))
    return replace(config, steps=config.steps or default_steps), description


def _environment(device: torch.device, capability: Capability, peaks: dict[str, Any], command: str) -> dict:
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "capability": asdict(capability),
        **peaks_environment(peaks),
        "command": command,
    }
    if device.type == "cuda":
        env["gpu_name"] = torch.cuda.get_device_name(device)
    else:
        env.update(cpu_name=cpu_name(), cpu_flags=cpu_flags(), cpu_count=os.cpu_count())
    return env


def _settings(run: RowRun, names: list[str]) -> dict[str, Any]:
    """results.json's ``settings``."""
    config = run.config
    return {"workload": config.workload, "config": config.config_name, "policies": names,
            "requested_policies": [p.strip() for p in config.policies],
            "steps": config.steps, "warmup_steps": run.warmup_steps, "compile": config.compile,
            "eval_every": run.eval_every, "seed": config.seed, "data": config.data, "lora": config.lora,
            "device": str(run.device), "force": config.force, "targets": asdict(config.targets),
            "strategy": config.strategy, "world_size": world_size(), "memory_budget": config.memory_budget,
            "recompute": (config.recompute or DEFAULT_RECOMPUTE) if any(split_row(n)[1] for n in names) else None,
            "peer": config.peer, "quick": config.quick, "portable_cost": config.portable_cost}
