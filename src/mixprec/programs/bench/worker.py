"""One policy, one process: train a workload under the engine (or the plain-autocast peer) and measure it.

The bench runner starts ``python -m mixprec.programs.bench SPEC_JSON OUT_JSON`` once per policy,
so each run has its own process (honest peak memory, no allocator or autocast-cache state
shared between policies). Every worker seeds torch with the same seed before building the
model (identical initial weights) and draws training batches from the same seeded stream
(identical batch order), so the policies differ in precision only. The peer's row (:mod:`mixprec.programs.bench.peer`)
runs here too, its loop in place of the engine: :func:`~mixprec.programs.bench.peer.build_trainee` picks which.

The worker prints ``step N`` to stdout after every step (the runner's progress bar reads it),
logs to stderr, and writes its measurements to ``OUT_JSON``; a failure writes
``{"error": ..., "stage": "setup" | "train"}`` there and exits with status 1 (``setup``: the
engine refused the policy, e.g. a device that cannot run it; the runner reports it SKIPPED.
Anything else is ``train`` and a FAIL).

:func:`mixprec.programs.session.build_engine` and ``train_step`` are shared with ``mixprec train``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from mixprec.programs.bench.measure import MemoryMeter, median_step_ms, percentile, state_bytes, warmup_excess_s
from mixprec.machine.timing import timed
from mixprec.distributed.process import init_process_group_from_env, shard_batches, sum_across_ranks, world_size
from mixprec.programs.bench.mfu import peak_key
from mixprec.programs.bench.peer import Trainee, build_trainee, row_identity
from mixprec.programs.bench.per_rank import per_rank_fields
from mixprec.programs.bench.pinned_plan import pin_in_worker
from mixprec.programs.bench.recompute_rows import plan_of
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.spec import RunSpec
from mixprec.programs.bench.step_memory import row_memory
from mixprec.programs.session import evaluate, train_step
from mixprec.workloads import Workload, get_workload

__all__ = ["RunSpec", "SetupError", "run_policy", "main"]


class SetupError(RuntimeError):
    """The workload or the engine could not be built (e.g. the device cannot run the policy)."""


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _spread_ms(times_ms: list[float]) -> dict[str, float | None]:
    """10th and 90th percentile of the timed steps (ms): how noisy the median is."""
    if not times_ms:
        return {"step_time_ms_p10": None, "step_time_ms_p90": None}
    return {"step_time_ms_p10": percentile(times_ms, 0.1), "step_time_ms_p90": percentile(times_ms, 0.9)}


@dataclass
class _Record:
    """What one run's training loop recorded (:class:`Training`)."""

    memory: MemoryMeter
    history: dict[str, list] = field(default_factory=lambda: {k: [] for k in ("loss", "loss_scale", "grad_norm",
                                                                                "lr", "step_time_ms")})
    skipped: Counter = field(default_factory=Counter)
    eval_curve: list[list] = field(default_factory=list)   # [[step, eval loss], ...], the final eval last
    measured: dict[str, Any] = field(default_factory=dict)
    untimed: set[int] = field(default_factory=set)   # 0-based steps past the warm-up left out of the step time


class Training:
    """One row's run, step by step: the workload and the policy's engine (or the peer's loop) built from ``spec``,
    then :meth:`advance` trains the next steps (timing each: one host sync per step; recording the loss, the loss
    scale, the grad norm, the lr, skipped steps, the eval points and, after ``spec.measure_state_at``'s backward,
    the training-state bytes) and :meth:`finish` measures the rest and returns the row. The one-pass bench
    (:mod:`mixprec.programs.bench.turns`) calls :meth:`advance` a block at a time, interleaved with the other rows'
    workers; :func:`run_policy` all at once.

    Raises:
        SetupError: the engine (or the optimizer) refused the policy for this device or model.
    """

    def __init__(self, spec: RunSpec, progress: Callable[[int], None] | None = None) -> None:
        self.spec, self._progress, self._start_wall = spec, progress, time.perf_counter()
        self.workload = get_workload(spec.workload, config=spec.config, data=spec.data, lora=spec.lora)
        if spec.strategy is not None:  # a collective timeout instead of a hang if another rank fails
            init_process_group_from_env(spec.device, timeout=timedelta(minutes=5))
        pin_in_worker(spec.op_plan, spec.device)   # the bench's one attention plan, not this process's own measurement
        try:
            self.mp = build_trainee(self.workload, spec)   # the policy's engine, or the peer's plain loop
        except (ValueError, TypeError) as err:
            raise SetupError(f"{type(err).__name__}: {err}") from err
        self.record = _Record(memory=MemoryMeter(self.mp.device))
        self.batches = shard_batches(self.workload.batches("train", spec.seed))  # one process: every batch
        self.step = 0   # steps trained so far

    def advance(self, k: int, *, untimed_first: bool = False) -> list[float]:
        """Train the next ``min(k, steps left)`` steps; their wall times (ms). ``untimed_first``: the first of them
        is left out of the row's step time (the first step after the worker sat idle wakes its threads and caches),
        as is every step right after an eval point (unless every step follows one: ``eval_every`` 1)."""
        mp, spec, record, history = self.mp, self.spec, self.record, self.record.history
        times = []
        for i in range(min(k, spec.steps - self.step)):
            step = self.step
            if (i == 0 and untimed_first) or (step > 0 and spec.eval_every > 1 and _is_eval_point(spec, step)):
                record.untimed.add(step)
            batch = next(self.batches)
            lr = float(mp.optimizer.param_groups[0]["lr"])   # a tensor in torchao's optimizers, updated in place
            after = (lambda: record.measured.update(state=state_bytes(mp.model, mp.optimizer))) \
                if step == spec.measure_state_at else None
            (loss, result), step_s = timed(lambda: train_step(mp, self.workload, batch, after_backward=after), mp.device)
            times.append(step_s * 1e3)
            history["step_time_ms"].append(step_s * 1e3)
            record.memory.sample()
            history["loss"].append(_finite_or_none(float(loss)))
            history["loss_scale"].append(result.loss_scale)
            history["grad_norm"].append(_finite_or_none(result.grad_norm))
            history["lr"].append(lr)
            if not result.applied:
                record.skipped[result.skipped_reason or "unknown"] += 1
            self.step += 1
            if _is_eval_point(spec, self.step) and self.step < spec.steps:   # outside the step's timing
                record.eval_curve.append([self.step, _finite_or_none(evaluate(mp, self.workload)["loss"])])
            if self._progress is not None:
                self._progress(self.step)
        return times

    def finish(self) -> PolicyRun:
        """After the last step: the final eval, the row (no verdict yet), the recompute plan and the memory steps
        (:func:`~mixprec.programs.bench.step_memory.row_memory`). Host syncs: the eval's and the memory steps'."""
        mp, spec, workload = self.mp, self.spec, self.workload
        if self.step < spec.steps:
            raise RuntimeError(f"Training.finish after {self.step} of {spec.steps} steps: advance() to the end first")
        eval_metrics = evaluate(mp, workload)
        self.record.eval_curve.append([spec.steps, _finite_or_none(eval_metrics["loss"])])
        row = _policy_run(mp, workload, spec, self.record, eval_metrics, self._start_wall)   # before the memory steps
        if spec.recompute is not None:
            row = dataclasses.replace(row, recompute_plan=plan_of(mp))
        batch = next(shard_batches(workload.batches("train", spec.seed)))
        row = dataclasses.replace(row, **row_memory(mp, workload, batch, seed=spec.seed, budget=spec.memory_budget))
        if spec.strategy is not None:   # every rank's own state and peak live bytes, on rank 0's row
            row = dataclasses.replace(row, **per_rank_fields(row.state_bytes_per_param, row.peak_live_bytes))
        return row


def _is_eval_point(spec: RunSpec, step: int) -> bool:
    """Whether an eval point follows step ``step`` (1-based count of steps done)."""
    return bool(spec.eval_every) and step % spec.eval_every == 0


def run_policy(spec: RunSpec, progress: Callable[[int], None] | None = None) -> PolicyRun:
    """Train ``spec.steps`` steps of one policy and return its measurements (a :class:`PolicyRun` that trained,
    no verdict yet). Host syncs: one per step for timing, plus the engine's, plus one per eval point
    (``spec.eval_every``), plus a read of the lr per step where an optimizer keeps it as a device tensor
    (torchao's).

    Raises:
        SetupError: the engine (or the optimizer) refused the policy for this device or model.
    """
    training = Training(spec, progress)
    training.advance(spec.steps)
    return training.finish()


def _throughput(mp: Trainee, workload: Workload, spec: RunSpec, step_s: float) -> dict[str, Any]:
    """Items/s, tokens/s, GFLOP/s and MFU at ``step_s`` seconds per step, summed over the ranks under a strategy
    (one collective)."""
    flops = float(workload.flops_per_step())
    peak = spec.peaks_gflops.get(peak_key(row_identity(mp).compute_dtype))
    items_per_s, gflops = workload.items_per_batch / step_s, flops / step_s / 1e9
    ranks = world_size() if spec.strategy is not None else 1
    if ranks > 1:  # every rank trained on its own batches: the run's throughput is the sum
        summed = sum_across_ranks(torch.tensor([items_per_s, gflops], dtype=torch.float64, device=mp.device))
        items_per_s, gflops = summed.tolist()
    return {"items_per_s": items_per_s, "tokens_per_s": items_per_s if workload.item_unit == "tokens" else None,
            "flops_per_step": flops, "gflops_per_s": gflops, "peak_gflops_per_s": peak,
            "mfu": gflops / (peak * ranks) if peak else None, "world_size": ranks}


def _policy_run(mp: Trainee, workload: Workload, spec: RunSpec, record: _Record,
                eval_metrics: dict[str, float], start_wall: float) -> PolicyRun:
    """The row of one trained run, from the engine (or the peer), the training record and the final eval."""
    history, times = record.history, record.history["step_time_ms"]
    timed_ms = [t for i, t in enumerate(times) if i >= spec.warmup_steps and i not in record.untimed]
    step_ms = statistics.median(timed_ms) if timed_ms else median_step_ms(times, spec.warmup_steps)
    warmup_excess = warmup_excess_s(times, spec.warmup_steps, step_ms)   # compilation, under compile
    throughput = _throughput(mp, workload, spec, step_ms / 1e3)
    state = record.measured["state"]
    ran = row_identity(mp)
    return PolicyRun(
        requested=spec.policy, policy=ran.policy, decision=ran.decision, op_plan=ran.op_plan,
        compute_dtype=peak_key(ran.compute_dtype), device=str(mp.device), pid=os.getpid(),
        torch_threads=torch.get_num_threads(),
        optimizer=f"{type(mp.optimizer).__module__}.{type(mp.optimizer).__name__}",
        steps=spec.steps, warmup_steps=spec.warmup_steps, step_time_ms_median=step_ms, compiled=spec.compile,
        first_step_ms=times[0], warmup_excess_s=warmup_excess,
        compile_time_s=warmup_excess if spec.compile else None, **_spread_ms(timed_ms or times[spec.warmup_steps:]),
        timed_steps=len(timed_ms),
        items_per_batch=workload.items_per_batch, item_unit=workload.item_unit,
        strategy=spec.strategy, **throughput,
        peak_memory_mb=record.memory.peak_mb(), memory_source=record.memory.source,
        state_bytes_per_param=state.per_param, state_bytes=state.as_dict(),
        final_eval=eval_metrics, final_eval_loss=_finite_or_none(eval_metrics["loss"]),
        eval_curve=record.eval_curve, loss_unit=workload.loss_unit,
        skipped_steps=sum(record.skipped.values()), skipped_by_reason=dict(record.skipped),
        loss_per_step=history["loss"], loss_scale_history=history["loss_scale"],
        grad_norm_per_step=history["grad_norm"], lr_per_step=history["lr"], step_time_ms_per_step=times,
        events=ran.events,
        wall_s=time.perf_counter() - start_wall,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m mixprec.programs.bench SPEC_JSON OUT_JSON``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m mixprec.programs.bench SPEC_JSON OUT_JSON", file=sys.stderr)
        return 2
    spec_path, out_path = args
    try:
        with open(spec_path, encoding="utf-8") as f:
            spec = RunSpec(**json.load(f))
        result, status = run_policy(spec, lambda step: print(f"step {step}", flush=True)).to_json(), 0
    except SetupError as err:
        traceback.print_exc()
        result, status = {"error": str(err), "stage": "setup", "pid": os.getpid()}, 1
    except Exception as err:  # reported to the runner, which turns it into a FAIL verdict
        traceback.print_exc()
        result, status = {"error": f"{type(err).__name__}: {err}", "stage": "train", "pid": os.getpid()}, 1
    tmp = f"{out_path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, out_path)
    return status


if __name__ == "__main__":
    sys.exit(main())
