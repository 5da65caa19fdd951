"""Training every row of a bench: the one pass in turns (the default), or one row after the other.

Each row (a policy, ``<policy>+recompute``, ``<policy>+compiled``, the plain-autocast peer) trains in its own worker
process (honest peak memory, no state shared between rows), from the same seed and batch order. By default
(``timing="interleaved"``, one process) the workers take turns in one pass (:mod:`~mixprec.programs.bench.turns`), so
a row's quality steps are also its interleaved timed steps; then come the final evals and memory steps, a re-timing
when the pass was noisy, and (not under ``--quick``) the step profiles. ``timing="sequential"`` and every strategy
train one row after the other, each timed on its own steps. Either way the fp32 reference also trains at the extra
seeds of the seed-noise band (:mod:`~mixprec.programs.bench.seed_band`) unless their kept runs fit. The rows come
back without verdicts (:func:`~mixprec.programs.bench.judging.judge_policies` adds them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mixprec.distributed.process import from_main_process, is_main_process, rank
from mixprec.machine.matmul import MatmulPeak
from mixprec.programs.bench.config import REFERENCE, BenchConfig
from mixprec.programs.bench.interleaved import TIMING_MALLOC_ENV
from mixprec.programs.bench.launch import free_port, run_worker, worker_env
from mixprec.programs.bench.noise import settle_noise
from mixprec.programs.bench.peer import PeerPlan
from mixprec.programs.bench.pinned_plan import pinned_for
from mixprec.programs.bench.recompute_rows import DEFAULT_RECOMPUTE, recompute_option, split_row
from mixprec.programs.bench.results import COMPILED_SUFFIX, PolicyRun
from mixprec.programs.bench.schedule import PhaseClock, block_steps_for, eval_every_for, warmup_steps_for
from mixprec.programs.bench.seed_band import band_key, kept_runs, seed_noise
from mixprec.programs.bench.spec import RunSpec
from mixprec.programs.bench.turns import RETIME_BLOCK, Progress, Turns, with_step_times

__all__ = ["RowRun", "train_rows"]


@dataclass(frozen=True)
class RowRun:
    """What every row of one bench run shares (:meth:`prepare` makes it once the plan is known)."""

    config: BenchConfig
    device: torch.device
    workdir: Path
    peaks_gflops: dict[str, float | None]
    warmup_steps: int
    eval_every: int
    op_plan: dict[str, Any] | None   # the bench's one attention plan (pinned_plan.measure_bench_plan)
    peer: PeerPlan | None            # the plain-autocast peer's plan (None: --no-peer)

    @classmethod
    def prepare(cls, config: BenchConfig, device: torch.device, peaks: dict[str, MatmulPeak],
                op_plan: dict[str, Any] | None, peer: PeerPlan | None) -> RowRun:
        """The run's rows' common part; makes the workers' directory (``out/workers``, other ranks'
        ``out/workers/rank-<r>``)."""
        out = Path(config.out)
        workdir = out / "workers" if is_main_process() else out / "workers" / f"rank-{rank()}"
        workdir.mkdir(parents=True, exist_ok=True)
        evals = eval_every_for(config.steps, quick=config.quick) if config.eval_every is None else config.eval_every
        return cls(config, device, workdir, {name: peak.gflops_per_s for name, peak in peaks.items()},
                   warmup_steps_for(config.steps), evals, op_plan, peer)

    def spec(self, name: str, compiled: bool) -> RunSpec:
        """The worker's spec for row ``name`` (a policy, ``<policy>+recompute``, or the peer; eager or compiled)."""
        config = self.config
        name, recomputed = split_row(name)
        return RunSpec(workload=config.workload, policy=name, steps=config.steps, seed=config.seed,
                       config=config.config_name, data=config.data, lora=config.lora,
                       device="cuda" if config.strategy and self.device.type == "cuda" else str(self.device),  # LOCAL_RANK's
                       warmup_steps=self.warmup_steps, peaks_gflops=self.peaks_gflops, strategy=config.strategy,
                       compile=compiled, eval_every=self.eval_every, op_plan=pinned_for(self.op_plan, name),
                       memory_budget=config.memory_budget,
                       recompute=recompute_option(config.recompute or DEFAULT_RECOMPUTE) if recomputed else None,
                       autocast_dtype=self.peer.autocast_dtype(name) if self.peer else None)


def _jobs(run: RowRun, names: list[str]) -> list[tuple[int, str, bool]]:
    """(index, name, compiled) of every row to train: each name eager, then compiled under ``--compile`` (the peer
    eager only)."""
    eager_only = set(run.peer.rows()) if run.peer else set()
    return [(index, name, compiled) for index, name in enumerate(names)
            for compiled in ((False, True) if run.config.compile else (False,)) if not (compiled and name in eager_only)]


def _file_name(index: int, name: str, compiled: bool) -> str:
    return f"{index}{'c' if compiled else ''}-{''.join(c if c.isalnum() or c in '-_' else '_' for c in name)}"


def _as_row(config: BenchConfig, spec: RunSpec, name: str, result: PolicyRun) -> PolicyRun:
    """A worker's result as the table's row: SKIPPED where the engine (or the peer's loop) refused it at setup."""
    if result.stage == "setup":
        return PolicyRun.skipped(spec.policy, f"the engine refused it: {result.error}")
    return replace(result, requested=spec.policy,
                   recompute=(config.recompute or DEFAULT_RECOMPUTE) if split_row(name)[1] else None)


def train_rows(run: RowRun, names: list[str], skip: dict[str, str | None], progress: bool
               ) -> tuple[dict[str, PolicyRun], dict[str, Any] | None, dict[str, Any]]:
    """Train the rows ``names`` (``skip``: row -> why it is SKIPPED, None: it runs) as the module says: the rows (no
    verdicts yet), results.json's ``seed_noise`` and its ``timing`` (the step times' one noise decision made)."""
    if run.config.timing == "interleaved" and run.config.strategy is None:
        return _train_in_turns(run, names, skip, progress)
    entries, band = _train_sequentially(run, names, skip, progress)
    return entries, band, settle_noise({"method": "sequential"}, entries)


def _train_in_turns(run: RowRun, names: list[str], skip: dict[str, str | None], progress: bool
                    ) -> tuple[dict[str, PolicyRun], dict[str, Any] | None, dict[str, Any]]:
    """The one pass (:mod:`mixprec.programs.bench.turns`): every runnable row, and the fp32 reference at the extra
    seeds unless their kept runs fit, train taking turns; then the final evals and memory steps, a re-timing when
    the pass was noisy, and the step profiles. Returns the rows (no verdicts yet), ``seed_noise`` and results.json's
    ``timing``."""
    config = run.config
    entries, specs, files = _specs(run, names, skip)
    seeds = [config.seed + k for k in range(1, config.seeds)]
    extra = _extra_seed_specs(run, specs, seeds)
    block = block_steps_for(config.steps, quick=config.quick)
    clock = PhaseClock()
    with tqdm(total=sum(spec.steps for spec in {**specs, **extra}.values()), unit="step", dynamic_ncols=True,
              disable=not progress) as bar, Turns({**specs, **extra}, {**files, **{n: n for n in extra}}, run.workdir,
                                                  worker_env()) as turns:
        bar.set_description(f"building {len(turns.workers)} workers, one at a time")
        turns.build()
        clock.lap("build")
        bar.set_description(f"{len(turns.workers)} rows taking turns, {block} steps each")
        status = Progress(config.steps, list(specs), REFERENCE, bar)
        turns.train(block, on_turn=status.turn)
        clock.lap("turns")
        bar.set_description("final evals and memory steps, one row at a time")
        rows = turns.finish()
        clock.lap("finish")
        entries = _in_row_order(run, names, entries, specs, rows)
        entries, timing = _timing_of_pass(config, turns, specs, entries, block, bar, clock)
        trained = {int(n[4:].split("-")[0]): rows[n] for n in extra}
        band = seed_noise(specs.get(REFERENCE), entries[REFERENCE], seeds, run.workdir, bar,
                          fresh=config.fresh_seed_band, trained=trained)
        clock.lap("seed_band")
    clock.lap("stop")
    return entries, band, {**timing, "phases_s": clock.laps}


def _specs(run: RowRun, names: list[str], skip: dict[str, str | None]
           ) -> tuple[dict[str, PolicyRun], dict[str, RunSpec], dict[str, str]]:
    """The SKIPPED rows as rows; each runnable row's worker spec and the stem of its files."""
    entries: dict[str, PolicyRun] = {}
    specs: dict[str, RunSpec] = {}
    files: dict[str, str] = {}
    for index, name, compiled in _jobs(run, names):
        row = name + COMPILED_SUFFIX if compiled else name
        if skip[name] is not None:
            entries[row] = PolicyRun.skipped(name, skip[name])
        else:
            specs[row], files[row] = run.spec(name, compiled), _file_name(index, name, compiled)
    return entries, specs, files


def _extra_seed_specs(run: RowRun, specs: dict[str, RunSpec], seeds: list[int]) -> dict[str, RunSpec]:
    """The fp32 reference's runs at the extra ``seeds`` (``seed<k>-fp32``), none when their kept runs fit (or
    there are no extra seeds)."""
    config = run.config
    kept = None if config.fresh_seed_band or not seeds else kept_runs(run.device, band_key(specs[REFERENCE], seeds))
    return {} if kept is not None or not seeds else {
        f"seed{seed}-fp32": replace(specs[REFERENCE], seed=seed, memory_budget=None) for seed in seeds}


def _in_row_order(run: RowRun, names: list[str], entries: dict[str, PolicyRun], specs: dict[str, RunSpec],
                  rows: dict[str, PolicyRun]) -> dict[str, PolicyRun]:
    """Every row (the SKIPPED ones in ``entries``, the trained ones from ``rows``, their workers' results) in the
    table's order: each name eager, then compiled."""
    entries = dict(entries)
    for index, name, compiled in _jobs(run, names):
        row = name + COMPILED_SUFFIX if compiled else name
        if row in specs:
            entries[row] = _as_row(run.config, specs[row], name, rows[row])
    return {row: entries[row] for row in [n + s for _, n, c in _jobs(run, names)
                                          for s in [COMPILED_SUFFIX if c else ""]]}


def _timing_of_pass(config: BenchConfig, turns: Turns, specs: dict[str, RunSpec], entries: dict[str, PolicyRun],
                    block: int, bar: tqdm, clock: PhaseClock) -> tuple[dict[str, PolicyRun], dict[str, Any]]:
    """The pass's ``timing`` (its noise settled: a noisy pass timed again), each timed row's step times in it, and
    (not under ``--quick``) each timed row's step profile: the rows and ``timing`` as they then stand."""
    timing = {"method": "interleaved", "one_pass": True, "blocks": turns.rounds, "block_steps": block,
              "retimed": 0, "errors": {}, "malloc_env": {k: turns.env[k] for k in TIMING_MALLOC_ENV}}
    timed = [n for n in specs if entries[n].step_time_ms_median is not None]
    entries, timing = _settle_pass(config, turns, timed, entries, settle_noise(timing, entries, tagged=turns.tagged()),
                                   bar, clock)
    timing["step_ms"] = {n: {"median": entries[n].step_time_ms_median, "p10": entries[n].step_time_ms_p10,
                             "p90": entries[n].step_time_ms_p90} for n in timed}
    if not config.quick:
        bar.set_description("profiling a window of each row's steps")
        profiles = turns.ask_each(timed, {"profile": True}, "step_profile")
        entries = {n: replace(e, step_profile=profiles.get(n)) for n, e in entries.items()}
        clock.lap("profile")
    return entries, timing


def _settle_pass(config: BenchConfig, turns: Turns, timed: list[str], entries: dict[str, PolicyRun],
                 timing: dict[str, Any], bar: tqdm, clock: PhaseClock) -> tuple[dict[str, PolicyRun], dict[str, Any]]:
    """A noisy pass (``timing``): every timed row timed again in timing-only rounds, replacing its step times (not
    under ``--quick``: it says TIMINGS NOISY). The rows and ``timing`` as they then stand."""
    if not timing["noisy"] or len(timed) < 2 or config.quick:
        return entries, {**timing, "retime_skipped": "quick"} if config.quick and timing["noisy"] else timing
    bar.set_description("the pass was noisy: timing again")
    rounds = max(4, min(12, config.steps // 25))
    retimed = turns.retime(timed, rounds)
    entries = with_step_times(entries, retimed)
    timing = settle_noise({**timing, "retimed": 1, "retime_rounds": rounds, "retime_block_steps": RETIME_BLOCK},
                          entries, tagged=retimed)
    clock.lap("retime")
    return entries, timing


def _train_sequentially(run: RowRun, names: list[str], skip: dict[str, str | None], progress: bool
                ) -> tuple[dict[str, PolicyRun], dict[str, Any] | None]:
    """``timing="sequential"`` (and every strategy): train every runnable row (eager, then compiled under
    ``--compile``; the peer eager only) in its own worker, one after the other, then the fp32 reference at the extra
    seeds: the rows (no verdicts yet) and ``seed_noise``."""
    config = run.config
    jobs = _jobs(run, names)
    runnable = [job for job in jobs if skip[job[1]] is None]
    entries: dict[str, PolicyRun] = {}
    specs: dict[str, RunSpec] = {}
    extra_seeds = [] if config.strategy is not None else [config.seed + k for k in range(1, config.seeds)]
    with tqdm(total=config.steps * (len(runnable) + len(extra_seeds)), unit="step", disable=not progress or not is_main_process(),
              dynamic_ncols=True) as bar:
        for index, name, compiled in jobs:
            row = name + COMPILED_SUFFIX if compiled else name
            if skip[name] is not None:
                entries[row] = PolicyRun.skipped(name, skip[name])
                continue
            bar.set_description(f"run {runnable.index((index, name, compiled)) + 1}/{len(runnable)}: {row}")
            spec = run.spec(name, compiled)
            env_update = None if config.strategy is None else {
                "MASTER_PORT": str(from_main_process(free_port() if is_main_process() else None))}
            result = run_worker(spec, run.workdir, _file_name(index, name, compiled), bar, env_update)
            specs[row] = spec
            entries[row] = _as_row(config, spec, name, result)
        band = seed_noise(specs.get(REFERENCE), entries[REFERENCE], extra_seeds, run.workdir, bar,
                          fresh=config.fresh_seed_band)
    return entries, band
