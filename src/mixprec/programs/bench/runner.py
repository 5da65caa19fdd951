"""``mixprec bench``: every policy side by side with fp32, one resident process each, then verdicts.

Plan: fp32 always runs, first, as the reference. Each other policy is resolved for the device
with the measured capability (:func:`mixprec.policy.resolve.resolve`); a policy the device refuses,
and fp16 on a CPU whose probe says fp16 is not native, is SKIPPED with the measured reason
unless ``force=True``. Nothing is run in another precision than asked: each worker records
the engine's ``policy`` and ``decision`` and the report shows them.

Each runnable policy then trains in its own worker process (honest peak memory, no state shared between rows),
from the same seed and batch order; by default the workers take turns in one pass (:mod:`~mixprec.programs.bench.turns`),
so the quality steps are the interleaved timed steps. The runner reads
the measurements, computes the deltas against fp32 (speedup, memory ratio, relative eval-loss delta),
judges them (:mod:`~mixprec.programs.bench.verdict`), writes the outputs (:mod:`~mixprec.programs.bench.report`).

**Default step count** (:data:`DEFAULT_STEPS` = 300 on ``gpt``/``mid``): why 300, as measured, is in docs/bench.md
("Why 300 steps"). ``--quick`` (:data:`QUICK_STEPS`) is a smoke test and says so in its verdicts.

Testing hook, read ONLY here: ``MIXPREC_BENCH_CAPABILITY`` holds a JSON object of
:class:`mixprec.machine.capability.Capability` fields that replaces the measured probe when planning
(``{"device": "cpu", "bf16": true, "fp16": true, "bf16_fast": true, "fp16_native": false, "detail":
"..."}`` makes fp16 SKIPPED on any CPU); the workers still run with the real device.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from mixprec.programs.bench.launch import free_port, run_worker, worker_env
from mixprec.programs.bench.interleaved import TIMING_MALLOC_ENV
from mixprec.programs.bench.mfu import one_mfu_peak, peaks_environment
from mixprec.programs.bench.report import COMPILED_SUFFIX, write_outputs
from mixprec.programs.bench.noise import settle_noise
from mixprec.programs.bench.peer import PeerPlan, peer_targets, plan_peer, with_peer_ratios
from mixprec.programs.bench.pinned_plan import measure_bench_plan, pinned_for
from mixprec.programs.bench.portable_cost import bench_portable_cost
from mixprec.programs.bench.recompute_rows import (DEFAULT_RECOMPUTE, check_plan_fits, check_recompute_rows,
                                                   recompute_option, split_row, with_recompute_ratios)
from mixprec.programs.bench.results import BenchResults, PolicyRun
from mixprec.programs.bench.seed_band import band_key, kept_runs, seed_noise
from mixprec.programs.bench.schedule import (QUICK_STEPS, PhaseClock, block_steps_for, eval_every_for,
                                             warmup_steps_for)
from mixprec.programs.bench.turns import RETIME_BLOCK, Progress, Turns, with_step_times
from mixprec.programs.bench.step_memory import memory_ratios
from mixprec.programs.bench.verdict import Targets, judge, smoke_words
from mixprec.programs.bench.spec import RunSpec
from mixprec.machine.capability import Capability, normalize_device, probe
from mixprec.machine.cache import cpu_name
from mixprec.policy.resolve import resolve
from mixprec.distributed.process import from_main_process, init_process_group_from_env, is_main_process, rank, world_size
from mixprec.machine.matmul import cached_peaks, cpu_flags
from mixprec.memory.batch_budget import parse_bytes
from mixprec.policy.policy import Policy
from mixprec.workloads import get_workload

if TYPE_CHECKING:
    from mixprec.numerics.advice import Recommendation

__all__ = ["BenchConfig", "DEFAULT_POLICIES", "DEFAULT_STEPS", "DEFAULT_GPT_CONFIG", "CAPABILITY_ENV", "run_bench",
           "plan_policy", "judge_policies"]

DEFAULT_POLICIES = ("fp32", "bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr")
DEFAULT_STEPS = 300
DEFAULT_GPT_CONFIG = "mid"
REFERENCE = "fp32"
CAPABILITY_ENV = "MIXPREC_BENCH_CAPABILITY"
TIMING_METHODS = ("interleaved", "sequential")   # BenchConfig.timing: how step times are measured


@dataclass(frozen=True)
class BenchConfig:
    """Everything one bench run needs (the CLI builds it from its flags).

    ``config=None`` means ``mid`` for the ``gpt`` workload and the workload's own default
    otherwise; ``steps=None`` the workload's ``default_steps`` (300 for gpt). ``lora`` (e.g.
    ``"r=8,alpha=16,targets=query,value"``) fine-tunes LoRA adapters on a transformers workload. ``command`` is the exact command line, recorded in the outputs. ``strategy``
    (``"ddp"``, ``"fsdp2"``): run under torchrun, one runner per rank (see :func:`run_bench`). ``compile``: each
    policy also runs compiled (``MixedPrecision(..., compile=True)``, inductor) in its own worker, as
    the row ``<policy>+compiled`` (:data:`mixprec.programs.bench.report.COMPILED_SUFFIX`), judged against eager fp32 like the others;
    its compilation time is reported apart from its step time. ``timing``: ``"interleaved"`` (default: one pass,
    every row trains in its own resident worker and the workers take turns a block of steps at a time,
    :mod:`mixprec.programs.bench.turns`, so each row's quality steps are also its timed steps, interleaved with the
    others') or ``"sequential"`` (one row after the other, each timed on its own steps; always under a strategy).
    ``seeds``: the fp32 reference also trains at ``seeds - 1`` more seeds (``seed + 1``, ...): the spread of its
    final eval loss is the seed-noise band each verdict is read against (1: none; not under a strategy).
    ``eval_every``: every policy also measures its validation loss after every K-th step (its ``eval_curve``);
    None: :func:`eval_every_for` (about ten points), 0: only the final eval. ``memory_budget`` (``"4GiB"``):
    each policy also reports the largest batch whose peak live tensor bytes fit it (None: not measured).
    ``recompute``: the engine's ``recompute=`` for the ``<policy>+recompute`` rows named in ``policies``
    (:mod:`mixprec.programs.bench.recompute_rows`; ``"auto"`` (None), ``"auto:1.5"``, ``"blocks.*"``, ...; refused
    without such a row, and at :func:`run_bench` before any training when it names blocks the model lacks).
    ``peer``: also train and time the plain-``torch.autocast`` loop a user would write instead, as the row
    ``torch-autocast`` (:mod:`mixprec.programs.bench.peer`; every row gets its speed and saved bytes against it);
    False: ``--no-peer``. ``quick``: a smoke test (``--quick``): :data:`QUICK_STEPS` steps unless ``steps`` is given,
    no step profiles, and no verdict better than ``SMOKE`` (what it did not establish is said). ``portable_cost``: also
    time ``ops=portable`` against ``ops=native`` (:mod:`mixprec.programs.bench.portable_cost`). ``fresh_seed_band``: train
    the extra seeds again instead of reusing the runs kept for this workload and machine
    (:mod:`mixprec.programs.bench.seed_band`).
    """

    out: Path
    workload: str = "gpt"
    config: str | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    steps: int | None = None
    seed: int = 0
    data: str | None = None
    device: str | None = None
    force: bool = False
    targets: Targets = field(default_factory=Targets)
    command: str = ""
    strategy: str | None = None
    lora: str | None = None
    compile: bool = False
    timing: str = "interleaved"
    seeds: int = 2
    eval_every: int | None = None
    memory_budget: str | None = None
    recompute: str | None = None
    peer: bool = True
    quick: bool = False
    portable_cost: bool = False
    fresh_seed_band: bool = False

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, name="bench memory_budget")   # ValueError naming it and the units
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"bench seeds={self.seeds!r} must be an int >= 1 (1: no seed-noise band)")
        if self.eval_every is not None and (isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int)
                                            or self.eval_every < 0):
            raise ValueError(f"bench eval_every={self.eval_every!r} must be an int >= 0 (0: only the final eval) "
                             "or None (about ten eval points per run)")
        if self.timing not in TIMING_METHODS:
            raise ValueError(f"bench timing={self.timing!r} is not allowed; choose one of {TIMING_METHODS}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 5):
            raise ValueError(f"bench steps={self.steps!r} must be an int >= 5 (warm-up steps are not timed)")
        if self.compile and self.strategy is not None:
            raise ValueError(f"bench compile=True with strategy={self.strategy!r}: the engine does not compile a "
                             "DDP/FSDP2-wrapped model; drop --compile or --strategy")
        if not self.policies or not all(isinstance(p, str) and p.strip() for p in self.policies):
            raise ValueError(f"bench policies={self.policies!r} must be non-empty policy names, "
                             f"e.g. {','.join(DEFAULT_POLICIES)}")
        check_recompute_rows(self.recompute, self.policies)   # a bad value, or a plan no row uses: ValueError

    @property
    def config_name(self) -> str | None:
        return DEFAULT_GPT_CONFIG if self.config is None and self.workload == "gpt" else self.config


def _capability(device: torch.device, capability: Capability | None) -> Capability:
    if capability is not None:
        return capability
    text = os.environ.get(CAPABILITY_ENV)
    if text:
        try:
            return Capability(**json.loads(text))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{CAPABILITY_ENV}={text!r} is not a JSON object of Capability fields "
                             f"({list(Capability.__dataclass_fields__)}): {err}") from None
    return probe(device)


def plan_policy(spec: str, device: torch.device, capability: Capability, *, force: bool) -> str | None:
    """Why ``spec`` is SKIPPED on ``device`` (None: it runs). ``force`` runs non-native fp16."""
    try:
        policy = resolve(spec, device, capability=capability).policy
    except ValueError as err:
        return str(err)
    fp16 = torch.float16 in (policy.param_dtype, policy.compute_dtype)
    if fp16 and device.type == "cpu" and not capability.fp16_native and not force:
        return (f"fp16 is not native on this CPU ({capability.detail or 'measured: fp16 matmul far slower than fp32'}); "
                "it would run emulated and slowly: pass --force to run it anyway")
    return None


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


def judge_policies(entries: dict[str, PolicyRun], targets: Targets, *, noisy: bool = False,
                   seed_noise: dict | None = None, smoke: str | None = None) -> dict[str, PolicyRun]:
    """``entries`` with the deltas vs fp32 and a verdict added to every row; ``noisy`` timings give no speed
    verdict; with ``seed_noise`` (results.json's) each reason says whether the loss delta lies within the seed band;
    ``smoke`` (what a smoke test did not establish): a PASS becomes ``SMOKE``, its reason led by these words."""
    ref = entries[REFERENCE]
    if ref.error is None and ref.skipped_reason is None and ref.final_eval_loss is None:
        ref = replace(ref, error="the fp32 eval loss is not finite: the reference diverged")
        entries = {**entries, REFERENCE: ref}
    ref_error = ref.error or (ref.skipped_reason and f"fp32 did not run: {ref.skipped_reason}")
    judged = {}
    for name, e in entries.items():
        row_targets, peer_note = peer_targets(name, targets)   # the peer: the quality gate alone
        if e.step_time_ms_median is not None and ref_error is None:
            loss, ref_loss = e.final_eval_loss, ref.final_eval_loss
            e = replace(e, speedup_vs_fp32=ref.step_time_ms_median / e.step_time_ms_median,
                        memory_ratio_vs_fp32=e.peak_memory_mb / ref.peak_memory_mb, **memory_ratios(e, ref),
                        eval_loss_delta_vs_fp32=None if loss is None else (loss - ref_loss) / ref_loss)
        error = e.error
        if name != REFERENCE and ref_error is not None and error is None and e.skipped_reason is None:
            error = f"no fp32 reference to compare with ({ref_error})"
        diverged = e.step_time_ms_median is not None and e.final_eval_loss is None
        verdict = judge(targets=row_targets, loss_delta=math.nan if diverged else e.eval_loss_delta_vs_fp32,
                        speedup=None if noisy else e.speedup_vs_fp32, memory_ratio=e.memory_ratio_vs_fp32,
                        reference=name == REFERENCE, skipped_reason=e.skipped_reason, error=error)
        note = ("" if e.skipped_reason else peer_note) + \
            ("; timings noisy: no speed verdict" if noisy and e.speedup_vs_fp32 is not None else "")
        delta, band = e.eval_loss_delta_vs_fp32, (seed_noise or {}).get("relative_spread")
        if band is not None and delta is not None and math.isfinite(delta):
            note += f"; {'within' if abs(delta) <= band else 'outside'} seed noise (±{band:.2%})"
        reason = verdict.reason + (note if name != REFERENCE else "")
        if smoke is not None and verdict.verdict == "PASS":
            verdict, reason = replace(verdict, verdict="SMOKE"), f"{smoke}; {reason}"
        judged[name] = replace(e, verdict=verdict.verdict, reason=reason)
    return judged


ADVISED = "advised"  # --policies advised: run what `mixprec inspect` recommends for this workload


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
    cap = _capability(device, capability)
    workload = get_workload(config.workload, config=config.config_name, data=config.data, lora=config.lora)
    description = workload.describe()
    default_steps = QUICK_STEPS if config.quick else int(getattr(workload, "default_steps", DEFAULT_STEPS))
    config, workload = replace(config, steps=config.steps or default_steps), None
    peaks = cached_peaks(device)
    names, skip, advice = _plan(config, device, cap, progress)
    bases = {split_row(n)[0]: skip[n] for n in names}   # a recompute row's policy plans like its plain row
    plan = measure_bench_plan(config, device, cap, list(bases), bases, progress)   # one attention plan, pinned for all
    planned_s, runnable = time.perf_counter() - start, [n for n in bases if bases[n] is None]   # planned_s: until here
    peer = plan_peer(device, cap, strategy=config.strategy) if config.peer else None
    rows = names + list(peer.rows() if peer else {})   # the policies' rows, the peer's last
    skip = {**skip, **(peer.rows() if peer else {})}
    out = Path(config.out)
    workdir = out / "workers" if is_main_process() else out / "workers" / f"rank-{rank()}"
    workdir.mkdir(parents=True, exist_ok=True)
    evals = eval_every_for(config.steps, quick=config.quick) if config.eval_every is None else config.eval_every
    run = _Run(config, device, workdir, {name: peak.gflops_per_s for name, peak in peaks.items()},
               warmup_steps_for(config.steps), evals, plan, peer)
    if config.timing == "interleaved" and config.strategy is None:
        entries, seed_noise, timing = _train_in_turns(run, rows, skip, progress)
    else:
        entries, seed_noise = _train_rows(run, rows, skip, progress)
        timing = settle_noise({"method": "sequential"}, entries)
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
        advice=None if advice is None else {"policy": str(advice.policy), "reasons": list(advice.reasons),
                                            "initial_loss_scale": advice.initial_loss_scale},
        policies=entries, timing=timing, seed_noise=seed_noise, mfu_peak=mfu_peak, portable_ops=portable,
        parent_pid=os.getpid(), wall_s=time.perf_counter() - start, op_plan=plan,
        peer=None if peer is None else peer.as_json())
    if is_main_process():
        write_outputs(results.to_json(), out)
    return results


def _plan(config: BenchConfig, device: torch.device, cap: Capability, progress: bool
          ) -> tuple[list[str], dict[str, str | None], Recommendation | None]:
    """The rows' policy names (fp32 first, ``advised`` replaced by the advisor's policy), why each is SKIPPED
    (None: it runs; rank 0's plan under a strategy) and the advice (None unless asked for)."""
    names = list(dict.fromkeys([REFERENCE, *(p.strip() for p in config.policies)]))
    advice = None
    if ADVISED in names:  # the numerics advisor's policy, measured like any other
        from mixprec.numerics.workload import advised_policy

        advised, advice = advised_policy(config.workload, config=config.config_name, data=config.data,
                                         device=device, lora=config.lora)
        names = list(dict.fromkeys(str(advised) if n == ADVISED else n for n in names))
        if progress and is_main_process():
            print(f"advised policy: {advised}\n  " + "\n  ".join(advice.reasons), file=sys.stderr)
    for name in names:  # a typo is an error, not a SKIPPED policy: only the device may refuse
        if split_row(name)[0].lower() != "auto":
            Policy.parse(split_row(name)[0])
    if any(split_row(n)[1] for n in names):   # named blocks the model lacks: bad input, not a SKIPPED row
        check_plan_fits(config)
    skip = {name: plan_policy(split_row(name)[0], device, cap, force=config.force) for name in names}
    if config.strategy is not None:
        init_process_group_from_env("cpu")   # the runners' own group: plans and ports, never tensors
        skip = from_main_process(skip)       # every rank runs the same policies in the same order
    if skip[REFERENCE] is not None:
        raise ValueError(f"the fp32 reference cannot run on {device}: {skip[REFERENCE]}")
    return names, skip, advice


@dataclass(frozen=True)
class _Run:
    """What every row of one bench run shares (:func:`run_bench` fills it once the plan is known)."""

    config: BenchConfig
    device: torch.device
    workdir: Path
    peaks_gflops: dict[str, float | None]
    warmup_steps: int
    eval_every: int
    op_plan: dict[str, Any] | None   # the bench's one attention plan (pinned_plan.measure_bench_plan)
    peer: PeerPlan | None            # the plain-autocast peer's plan (None: --no-peer)

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


def _jobs(run: _Run, names: list[str]) -> list[tuple[int, str, bool]]:
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


def _train_in_turns(run: _Run, names: list[str], skip: dict[str, str | None], progress: bool
                    ) -> tuple[dict[str, PolicyRun], dict[str, Any] | None, dict[str, Any]]:
    """The one pass (:mod:`mixprec.programs.bench.turns`): every runnable row, and the fp32 reference at the extra
    seeds unless their kept runs fit, train taking turns; then the final evals and memory steps, a re-timing when
    the pass was noisy, and the step profiles. Returns the rows (no verdicts yet), ``seed_noise`` and results.json's
    ``timing``."""
    config = run.config
    entries: dict[str, PolicyRun] = {}
    specs: dict[str, RunSpec] = {}
    files: dict[str, str] = {}
    for index, name, compiled in _jobs(run, names):
        row = name + COMPILED_SUFFIX if compiled else name
        if skip[name] is not None:
            entries[row] = PolicyRun.skipped(name, skip[name])
        else:
            specs[row], files[row] = run.spec(name, compiled), _file_name(index, name, compiled)
    seeds = [config.seed + k for k in range(1, config.seeds)]
    kept = None if config.fresh_seed_band or not seeds else kept_runs(run.device, band_key(specs[REFERENCE], seeds))
    extra = {} if kept is not None or not seeds else {
        f"seed{seed}-fp32": replace(specs[REFERENCE], seed=seed, memory_budget=None) for seed in seeds}
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
        for index, name, compiled in _jobs(run, names):
            row = name + COMPILED_SUFFIX if compiled else name
            if row in specs:
                entries[row] = _as_row(config, specs[row], name, rows[row])
        entries = {row: entries[row] for row in [n + s for _, n, c in _jobs(run, names)
                                                 for s in [COMPILED_SUFFIX if c else ""]]}
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
        trained = {int(n[4:].split("-")[0]): rows[n] for n in extra}
        band = seed_noise(specs.get(REFERENCE), entries[REFERENCE], seeds, run.workdir, bar,
                          fresh=config.fresh_seed_band, trained=trained)
        clock.lap("seed_band")
    clock.lap("stop")
    return entries, band, {**timing, "phases_s": clock.laps}


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


def _train_rows(run: _Run, names: list[str], skip: dict[str, str | None], progress: bool
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


def _settings(run: _Run, names: list[str]) -> dict[str, Any]:
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
