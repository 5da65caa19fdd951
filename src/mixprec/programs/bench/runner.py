"""``mixprec bench``: every policy side by side with fp32, one subprocess each, then verdicts.

Plan: fp32 always runs, first, as the reference. Each other policy is resolved for the device
with the measured capability (:func:`mixprec.policy.resolve.resolve`); a policy the device refuses,
and fp16 on a CPU whose probe says fp16 is not native, is SKIPPED with the measured reason
unless ``force=True``. Nothing is run in another precision than asked: each worker records
the engine's ``policy`` and ``decision`` and the report shows them.

Each runnable policy then trains in the worker, ``python -m mixprec.programs.bench`` (its own process:
honest peak memory, no disturbance between runs), from the same seed and batch order. The runner reads
the measurements, computes the deltas against fp32 (speedup, memory ratio, relative eval-loss delta),
judges them (:mod:`~mixprec.programs.bench.verdict`), writes the outputs (:mod:`~mixprec.programs.bench.report`).

**Default step count** (:data:`DEFAULT_STEPS` = 300, on ``gpt``/``mid``), measured on the
2-core Xeon (AMX, avx512_bf16) this was written on, torch 2.13:

* Budget: the whole default run must finish in 10 minutes. Median step times there: fp32
  233 ms, bf16-mixed 160, bf16-pure 146, bf16-kahan 170, bf16-sr 181, i.e. 0.89 s for one
  step of all five policies, plus 10-30 s per worker for start-up, model build and the final
  evaluation. The default run took 447 s (7.5 min) with another job sharing the cores part of
  the time: ~25 % headroom. (On a saturated machine, load 6 on 2 cores, it took 24 min: a
  benchmark needs a quiet machine. The eval losses of both runs matched bit for bit, except
  bf16-mixed's: 1.9704 vs 1.9700, not bit-reproducible from run to run on this CPU.)
* Signal: at 300 steps the model is well past the unigram plateau (eval loss 1.97 nats/char
  vs 2.56 at step 30). The final eval losses of the four bf16 policies lie within 0.09 % of
  fp32's, below the fp32 seed-to-seed spread at 300 steps (seeds 0, 1, 2: 1.9698, 1.9810,
  1.9741; standard deviation 0.29 %), so the 2 % gate sits about 7 standard deviations of
  run-to-run noise above it: a FAIL means a real precision problem, not chance. At 30 steps
  the deltas were larger (up to +0.30 %) and measured the steep initial drop, not training.

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
from mixprec.programs.bench.mfu import one_mfu_peak, peaks_environment
from mixprec.programs.bench.report import COMPILED_SUFFIX, write_outputs
from mixprec.programs.bench.noise import settle_noise
from mixprec.programs.bench.peer import PeerPlan, peer_targets, plan_peer, with_peer_ratios
from mixprec.programs.bench.pinned_plan import measure_bench_plan, pinned_for
from mixprec.programs.bench.portable_cost import bench_portable_cost
from mixprec.programs.bench.recompute_rows import (DEFAULT_RECOMPUTE, check_plan_fits, check_recompute_rows,
                                                   pinned_checkpoint, recompute_option, split_row, with_recompute_ratios)
from mixprec.programs.bench.results import BenchResults, PolicyRun
from mixprec.programs.bench.step_memory import memory_ratios
from mixprec.programs.bench.verdict import Targets, judge
from mixprec.programs.bench.spec import RunSpec
from mixprec.machine.capability import Capability, normalize_device, probe
from mixprec.machine.cache import cpu_name
from mixprec.policy.resolve import resolve
from mixprec.distributed.process import from_main_process, init_process_group_from_env, is_main_process, rank, world_size
from mixprec.machine.matmul import cached_peaks, cpu_flags
from mixprec.memory.budget import parse_bytes
from mixprec.policy.policy import Policy
from mixprec.workloads import get_workload

if TYPE_CHECKING:
    from mixprec.numerics.advice import Recommendation

__all__ = ["BenchConfig", "DEFAULT_POLICIES", "DEFAULT_STEPS", "DEFAULT_GPT_CONFIG", "CAPABILITY_ENV",
           "run_bench", "plan_policy", "judge_policies", "warmup_steps_for", "eval_every_for"]

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
    its compilation time is reported apart from its step time. ``timing``: ``"interleaved"`` (default: after
    the quality runs, every policy is timed again in alternating blocks, :mod:`mixprec.programs.bench.interleaved`, and
    its step time, throughput and speedup come from there) or ``"sequential"`` (each quality run's own steps).
    ``seeds``: the fp32 reference also trains at ``seeds - 1`` more seeds (``seed + 1``, ...): the spread of its
    final eval loss is the seed-noise band each verdict is read against (1: none; not under a strategy).
    ``eval_every``: every policy also measures its validation loss after every K-th step (its ``eval_curve``);
    None: :func:`eval_every_for` (about ten points), 0: only the final eval. ``memory_budget`` (``"4GiB"``):
    each policy also reports the largest batch whose peak live tensor bytes fit it (None: not measured).
    ``recompute``: the engine's ``checkpoint=`` for the ``<policy>+recompute`` rows named in ``policies``
    (:mod:`mixprec.programs.bench.recompute_rows`; ``"auto"`` (None), ``"auto:1.5"``, ``"blocks.*"``, ...; refused
    without such a row, and at :func:`run_bench` before any training when it names blocks the model lacks).
    ``peer``: also train and time the plain-``torch.autocast`` loop a user would write instead, as the row
    ``torch-autocast`` (:mod:`mixprec.programs.bench.peer`; every row gets its speed and saved bytes against it);
    False: ``--no-peer``.
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


def warmup_steps_for(steps: int) -> int:
    """Untimed warm-up steps: 10 % of the run, at least 2, at most 20."""
    return min(20, max(2, steps // 10))


def eval_every_for(steps: int) -> int:
    """Steps between eval points when ``--eval-every`` is not given: ``steps // 10`` (at least 1), so each run
    has about ten points. An eval is a forward over the fixed validation batches (8 for gpt, about 3
    training steps' time), so the ten cost about 10 % of a run's training time, not its step time."""
    return max(1, steps // 10)


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
                   seed_noise: dict | None = None) -> dict[str, PolicyRun]:
    """``entries`` with the deltas vs fp32 and a verdict added to every row; ``noisy`` timings give no speed
    verdict; with ``seed_noise`` (results.json's) each reason says whether the loss delta lies within the seed band."""
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
        judged[name] = replace(e, verdict=verdict.verdict, reason=verdict.reason + (note if name != REFERENCE else ""))
    return judged


ADVISED = "advised"  # --policies advised: run what `mixprec inspect` recommends for this workload


def _retime(config: BenchConfig, entries: dict[str, PolicyRun], specs: dict[str, RunSpec], workdir: Path,
            progress: bool) -> tuple[dict[str, Any], dict[str, PolicyRun]]:
    """``timing="interleaved"``: time the rows that trained, interleaved (:mod:`mixprec.programs.bench.interleaved`), and
    replace their step time and what derives from it (the quality run's median is kept as
    ``sequential_step_time_ms_median``) and add their ``step_profile`` (the window each timing worker profiled after
    the timing; moved from the timing's reply to the rows); returns results.json's ``timing`` (with ``malloc_env``: the workers' glibc malloc
    thresholds, :data:`mixprec.programs.bench.interleaved.TIMING_MALLOC_ENV` unless the environment set them; ``spread``
    and ``noisy`` decided over every row by :func:`~mixprec.programs.bench.noise.settle_noise`) and the rows.
    Sequential under a strategy or with < 2 rows."""
    rows = [n for n in specs if entries[n].step_time_ms_median is not None]
    if config.timing != "interleaved" or config.strategy is not None or len(rows) < 2:
        return settle_noise({"method": "sequential"}, entries), entries
    from mixprec.programs.bench.interleaved import time_interleaved

    rounds = max(4, min(12, config.steps // 25))
    if progress:
        print(f"timing {len(rows)} rows interleaved: {rounds} rounds of 5 steps each", file=sys.stderr)
    timing = time_interleaved({n: specs[n] for n in rows}, workdir, worker_env(), block_steps=5, rounds=rounds,
                              warmup_steps=3)
    entries = dict(entries)
    profiles = timing.pop("step_profile", {})
    for name, step in timing["step_ms"].items():
        e = entries[name] = replace(entries[name], step_profile=profiles.get(name))
        if step is None:
            continue
        scale = e.step_time_ms_median / step["median"]       # throughput scales inversely with step time
        rescaled = {key: getattr(e, key) * scale for key in ("items_per_s", "tokens_per_s", "gflops_per_s", "mfu")
                    if getattr(e, key) is not None}
        entries[name] = replace(e, sequential_step_time_ms_median=e.step_time_ms_median,
                                step_time_ms_median=step["median"], step_time_ms_p10=step["p10"],
                                step_time_ms_p90=step["p90"], **rescaled)
    return settle_noise(timing, entries), entries


def _seed_noise(config: BenchConfig, spec: RunSpec | None, reference: PolicyRun, seeds: list[int], workdir: Path,
                bar: tqdm) -> dict[str, Any] | None:
    """The fp32 reference trained again at each of ``seeds``: results.json's ``seed_noise`` = ``seeds`` (all,
    the run's own first), ``fp32_eval_losses``, ``relative_spread`` ((max - min) / min), ``fp32_eval_curves``
    (each seed's ``eval_curve``, same order), or None (no extra seed, or a reference that did not finish)."""
    if not seeds or spec is None or reference.final_eval_loss is None:
        return None
    losses, curves = [reference.final_eval_loss], [reference.eval_curve]
    for seed in seeds:
        bar.set_description(f"fp32 at seed {seed} (seed-noise band)")
        result = run_worker(replace(spec, seed=seed, memory_budget=None), workdir, f"seed{seed}-fp32", bar)
        if result.final_eval_loss is None:
            return {"seeds": [config.seed, *seeds], "fp32_eval_losses": losses, "relative_spread": None,
                    "fp32_eval_curves": curves,
                    "error": result.error or "the fp32 run at another seed did not finish"}
        losses.append(result.final_eval_loss)
        curves.append(result.eval_curve)
    return {"seeds": [config.seed, *seeds], "fp32_eval_losses": losses,
            "relative_spread": (max(losses) - min(losses)) / min(losses), "fp32_eval_curves": curves}


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
    if config.steps is None:
        config = replace(config, steps=int(getattr(workload, "default_steps", DEFAULT_STEPS)))
    del workload
    peaks = cached_peaks(device)
    names, skip, advice = _plan(config, device, cap, progress)
    bases = {split_row(n)[0]: skip[n] for n in names}   # a recompute row's policy plans like its plain row
    plan = measure_bench_plan(config, device, cap, list(bases), bases, progress)   # one attention plan, pinned for all
    runnable = [n for n in bases if bases[n] is None]
    peer = plan_peer(device, cap, strategy=config.strategy) if config.peer else None
    rows = names + list(peer.rows() if peer else {})   # the policies' rows, the peer's last
    skip = {**skip, **(peer.rows() if peer else {})}
    out = Path(config.out)
    workdir = out / "workers" if is_main_process() else out / "workers" / f"rank-{rank()}"
    workdir.mkdir(parents=True, exist_ok=True)
    run = _Run(config, device, workdir, {name: peak.gflops_per_s for name, peak in peaks.items()},
               warmup_steps_for(config.steps),
               eval_every_for(config.steps) if config.eval_every is None else config.eval_every, plan, peer)
    entries, specs, seed_noise = _train_rows(run, rows, skip, progress)
    timing, entries = _retime(config, entries, specs, workdir, progress)
    entries = with_peer_ratios(with_recompute_ratios(entries))
    mfu_peak, entries = one_mfu_peak(entries, peaks)
    entries = judge_policies(entries, config.targets, noisy=timing["noisy"], seed_noise=seed_noise)
    portable = bench_portable_cost(config, device, runnable, progress)
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
                       checkpoint=recompute_option(config.recompute or DEFAULT_RECOMPUTE) if recomputed else None,
                       autocast_dtype=self.peer.autocast_dtype(name) if self.peer else None)


def _train_rows(run: _Run, names: list[str], skip: dict[str, str | None], progress: bool
                ) -> tuple[dict[str, PolicyRun], dict[str, RunSpec], dict[str, Any] | None]:
    """Train every runnable row (eager, then compiled under ``--compile``; the peer eager only) in its own worker,
    then the fp32 reference at the extra seeds: the rows (no verdicts yet), the specs of the rows that ran, and
    ``seed_noise``."""
    config = run.config
    eager_only = set(run.peer.rows()) if run.peer else set()
    jobs = [(index, name, compiled) for index, name in enumerate(names)
            for compiled in ((False, True) if config.compile else (False,)) if not (compiled and name in eager_only)]
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
            file_name = f"{index}{'c' if compiled else ''}-{''.join(c if c.isalnum() or c in '-_' else '_' for c in name)}"
            result = run_worker(spec, run.workdir, file_name, bar, env_update)
            recomputed = split_row(name)[1]   # timed with the plan its quality run used, not measured again
            specs[row] = replace(spec, checkpoint=pinned_checkpoint(result.recompute_plan)) if recomputed else spec
            if result.stage == "setup":  # the engine (or the peer's loop) refused it: it did not run
                entries[row] = PolicyRun.skipped(spec.policy, f"the engine refused it: {result.error}")
            else:
                entries[row] = replace(result, requested=spec.policy,
                                       recompute=(config.recompute or DEFAULT_RECOMPUTE) if recomputed else None)
        seed_noise = _seed_noise(config, specs.get(REFERENCE), entries[REFERENCE], extra_seeds, run.workdir, bar)
    return entries, specs, seed_noise


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
            "peer": config.peer}
