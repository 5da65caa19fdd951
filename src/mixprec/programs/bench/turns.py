"""One pass: every row trains in its own resident worker and the workers take turns, a block of steps each.

The bench's default timing (``timing="interleaved"``). Each row (a policy, the plain-autocast peer, a compiled or
recompute row, the fp32 reference at an extra seed for the seed-noise band) gets one worker process,
``python -m mixprec.programs.bench --turns SPEC_JSON OUT_JSON`` (:func:`serve_training`), which builds its engine
as a one-shot worker would (:class:`~mixprec.programs.bench.worker.Training`; the builds run one after another,
so an engine that measures while it builds, ``policy="auto"``, measures alone). The runner then hands out turns:
round r gives every row ``block_steps`` steps, starting one row later than round r - 1, until every row has
trained ``steps`` steps. Only one worker computes at a time, so drift on a shared machine lands on every row
alike, and the steps a row trains are the steps it is timed on: its quality and its speed come from the same run.
A row's step time is the median over its steps after the warm-up, leaving out each turn's first step (a worker
that sat idle wakes its threads and refills caches, a fixed cost that would weigh more on faster rows) and the
step after each eval point; evaluations are never timed. Then each worker finishes alone (final eval, memory
steps), and, where a row's spread exceeds :data:`mixprec.programs.bench.noise.SPREAD_LIMIT`, every row is timed
again in rounds of timing-only steps after its quality run (:data:`RETIME_BLOCK` steps after one untimed step;
the new times replace the step times, the quality steps' median is kept as ``sequential_step_time_ms_median``).
Last, each worker profiles a short window (:mod:`mixprec.programs.bench.step_profile`), one after the other.

Source: the A/B interleaving of ``benchmarks/overhead.py`` and the bench's earlier separate timing phase
(:mod:`mixprec.programs.bench.interleaved`, kept for ``benchmarks/optimizer_peers.py``), now on the quality steps.
Host syncs: the workers' (one per step for timing).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from mixprec.programs.bench.interleaved import TIMING_MALLOC_ENV, stop_workers
from mixprec.programs.bench.measure import percentile, time_steps
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.spec import RunSpec

if TYPE_CHECKING:
    from mixprec.programs.bench.peer import Trainee
    from mixprec.programs.bench.worker import Training

__all__ = ["RETIME_BLOCK", "Progress", "Turns", "serve_training", "with_step_times"]

RETIME_BLOCK = 5   # timed steps per turn when a noisy pass is timed again (after one untimed step)


def serve_training(spec: RunSpec, out_path: Path) -> int:
    """The worker side: wait for ``{"build": true}``, build ``spec``'s row and print ``{"ready": true}`` (or
    ``{"ready": false, "error", "stage"}``, the error also written to ``out_path`` as a one-shot worker would), then
    answer one stdin line at a time: ``{"train": k}`` trains the next k steps (the first untimed) and prints
    ``{"step": n, "times_ms": [...], "evals": [[step, loss], ...]}`` (the eval points it just passed);
    ``{"finish": true}`` writes the row to ``out_path`` and prints ``{"finished": true}``; after that,
    ``{"steps": k, "untimed": u}`` trains u untimed and k timed steps outside the row (re-timing) and prints
    ``{"times_ms": [...]}``; ``{"profile": true}`` prints ``{"step_profile": ...}``; ``{"quit": true}`` or the end of
    input stops it. A failure prints ``{"error": ..., "stage": "train"}`` (also written to ``out_path``) and stops."""
    from mixprec.programs.bench.worker import SetupError, Training
    from mixprec.programs.session import train_step

    def fail(err: BaseException, stage: str, key: str) -> int:
        traceback.print_exc()
        error = {"error": str(err) if stage == "setup" else f"{type(err).__name__}: {err}", "stage": stage}
        out_path.write_text(json.dumps(error))
        print(json.dumps({key: False, **error} if key == "ready" else error), flush=True)
        return 1

    if json.loads(sys.stdin.readline() or "{}").get("build") is not True:
        return 2
    try:
        training = Training(spec)
    except SetupError as err:
        return fail(err, "setup", "ready")
    except Exception as err:   # reported to the runner as a failed row
        return fail(err, "train", "ready")
    print(json.dumps({"ready": True}), flush=True)
    step = lambda: train_step(training.mp, training.workload, next(training.batches))   # noqa: E731
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        try:
            reply = _answer(command, training, step, spec, out_path)
        except Exception as err:
            return fail(err, "train", "error")
        print(json.dumps(reply), flush=True)
    return 0


def _answer(command: dict[str, Any], training: Training, step: Callable[[], Any], spec: RunSpec, out_path: Path
            ) -> dict[str, Any]:
    """The reply to one command of :func:`serve_training` (``train``, ``finish``, ``profile``, else timing-only
    steps); ``step`` trains one step outside the row."""
    if "train" in command:
        seen = len(training.record.eval_curve)
        times = training.advance(int(command["train"]), untimed_first=True)
        return {"step": training.step, "times_ms": times, "evals": training.record.eval_curve[seen:]}
    if command.get("finish"):
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(training.finish().to_json(), default=str))
        tmp.replace(out_path)
        return {"finished": True}
    if command.get("profile"):
        return {"step_profile": _profile(step, training.mp, spec)}
    time_steps(step, training.mp.device, int(command.get("untimed", 0)))
    return {"times_ms": time_steps(step, training.mp.device, int(command["steps"]))}


def _profile(step: Callable[[], Any], mp: Trainee, spec: RunSpec) -> dict[str, Any]:
    """:func:`~mixprec.programs.bench.step_profile.profile_steps` of this worker's step against the measured matmul
    peak in its compute dtype, or ``{"error": ...}`` (said in the report, never a number)."""
    from mixprec.programs.bench.mfu import peak_key
    from mixprec.programs.bench.peer import row_identity
    from mixprec.programs.bench.step_profile import profile_steps

    try:
        key = peak_key(row_identity(mp).compute_dtype)
        return profile_steps(step, mp.device, peak_dtype=key, peak_gflops=spec.peaks_gflops.get(key))
    except Exception as err:   # a profiler that cannot run here: the row stands without its profile
        return {"error": f"{type(err).__name__}: {err}"}


@dataclass
class _Worker:
    proc: subprocess.Popen
    spec: RunSpec
    out_path: Path
    step: int = 0
    times: list[float] = field(default_factory=list)   # this pass's timed steps (warm-up and turn-first left out)
    rounds: list[int] = field(default_factory=list)    # the round each of ``times`` ran in
    error: dict[str, Any] | None = None


class Turns:
    """The resident workers of one bench pass (see the module docstring); use as a context manager (the workers
    are stopped on exit). ``jobs``: row name -> spec; ``file_names``: row name -> the stem of its files in
    ``workdir`` (spec, OUT_JSON, log). Rows whose worker failed to build are in :attr:`failed` (name -> the
    worker's ``{"error", "stage"}``) and take no turns."""

    def __init__(self, jobs: dict[str, RunSpec], file_names: dict[str, str], workdir: Path, env: dict[str, str]) -> None:
        self.env = {**env, **{k: env.get(k, v) for k, v in TIMING_MALLOC_ENV.items()}}   # a set variable wins
        self.workers: dict[str, _Worker] = {}
        self.failed: dict[str, dict[str, Any]] = {}
        self.rounds = 0
        for name, spec in jobs.items():   # all start (imports overlap); each builds alone, below
            stem = file_names[name]
            spec_path, out_path = workdir / f"{stem}.spec.json", workdir / f"{stem}.json"
            spec_path.write_text(json.dumps(asdict(spec), indent=1))
            out_path.unlink(missing_ok=True)
            with open(workdir / f"{stem}.log", "w", encoding="utf-8") as log:
                proc = subprocess.Popen([sys.executable, "-m", "mixprec.programs.bench", "--turns", str(spec_path),
                                         str(out_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                        text=True, env=self.env)
            self.workers[name] = _Worker(proc, spec, out_path)

    def __enter__(self) -> Turns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self, on_built: Callable[[str], None] | None = None) -> None:
        """Each worker builds its row in turn (one at a time: a build that measures does so alone)."""
        for name in list(self.workers):
            reply = self._ask(name, {"build": True})
            if not reply.get("ready"):
                self._drop(name, reply)
            elif on_built is not None:
                on_built(name)

    @property
    def live(self) -> list[str]:
        """The rows whose worker is running, in start order."""
        return [n for n, w in self.workers.items() if w.error is None]

    def train(self, block_steps: int, on_turn: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        """Hand out turns of ``block_steps`` steps until every live row has trained its ``spec.steps`` steps;
        ``on_turn(row, reply)`` after each turn (the progress display)."""
        while True:
            live = [n for n in self.live if self.workers[n].step < self.workers[n].spec.steps]
            if not live:
                return
            shift = self.rounds % len(live)
            for name in live[shift:] + live[:shift]:
                worker = self.workers[name]
                reply = self._ask(name, {"train": block_steps})
                if "error" in reply:
                    self._drop(name, reply)
                    continue
                first = worker.step
                kept = [t for i, t in enumerate(reply["times_ms"], first)
                        if i > first and i >= worker.spec.warmup_steps
                        and not (worker.spec.eval_every > 1 and i % worker.spec.eval_every == 0)]
                worker.times += kept
                worker.rounds += [self.rounds] * len(kept)
                worker.step = reply["step"]
                if on_turn is not None:
                    on_turn(name, reply)
            self.rounds += 1

    def finish(self) -> dict[str, PolicyRun]:
        """Every live row finishes (final eval, memory steps), one after the other: the rows as their OUT_JSON holds
        them (a worker that failed: its error and stage)."""
        rows = {}
        for name in self.workers:
            if self.workers[name].error is None:
                reply = self._ask(name, {"finish": True})
                if "error" in reply:
                    self._drop(name, reply)
            rows[name] = self._row(name)
        return rows

    def tagged(self) -> dict[str, list[tuple[int, float]]]:
        """Row -> ``[(round, ms), ...]``: the pass's timed steps of each live row, each with the round it ran in
        (:func:`~mixprec.programs.bench.noise.drift_corrected_spreads`)."""
        return {n: list(zip(w.rounds, w.times)) for n, w in self.workers.items() if w.error is None and w.times}

    def retime(self, names: list[str], rounds: int) -> dict[str, list[tuple[int, float]]]:
        """Timing-only rounds after the quality runs (:data:`RETIME_BLOCK` timed steps per turn after one untimed
        step, the order rotating per round): row -> ``[(round, ms), ...]``, its timed steps; a row whose worker
        failed is left out."""
        times: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
        for r in range(rounds):
            order = [n for n in names if self.workers[n].error is None]
            for name in order[r % len(order):] + order[:r % len(order)] if order else []:
                reply = self._ask(name, {"steps": RETIME_BLOCK, "untimed": 1})
                if "error" in reply:
                    self._drop(name, reply)
                else:
                    times[name] += [(r, t) for t in reply["times_ms"]]
        return {n: t for n, t in times.items() if self.workers[n].error is None and t}

    def ask_each(self, names: list[str], command: dict, key: str) -> dict[str, Any]:
        """Row -> its worker's ``key`` in the reply to ``command``, asked of one worker after the other (none runs
        while another answers), or ``{"error": ...}`` where it did not answer."""
        replies = {}
        for name in names:
            if self.workers[name].error is not None:
                continue
            reply = self._ask(name, command)
            replies[name] = reply[key] if key in reply else {"error": reply.get("error", "no reply")}
        return replies

    def close(self) -> None:
        """Stop every worker (:func:`~mixprec.programs.bench.interleaved.stop_workers`)."""
        stop_workers(w.proc for w in self.workers.values())

    def _ask(self, name: str, command: dict) -> dict[str, Any]:
        proc = self.workers[name].proc
        try:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (OSError, ValueError) as err:
            line, status = "", f"{type(err).__name__}: {err}"
        if not line:
            status = proc.poll()
            return {"error": f"the worker (pid {proc.pid}) exited (status {status}); log "
                             f"{self.workers[name].out_path.with_suffix('.log')}", "stage": "train"}
        return json.loads(line)

    def _drop(self, name: str, reply: dict[str, Any]) -> None:
        worker = self.workers[name]
        worker.error = {"error": reply.get("error") or "the worker did not start", "stage": reply.get("stage", "train")}
        if worker.error["stage"] == "setup":
            self.failed[name] = worker.error

    def _row(self, name: str) -> PolicyRun:
        worker = self.workers[name]
        try:
            value = json.loads(worker.out_path.read_text())
        except (OSError, ValueError):
            value = worker.error or {"error": f"the worker wrote no results ({worker.out_path})", "stage": "train"}
        return PolicyRun.from_json({"requested": worker.spec.policy, **value})


class Progress:
    """The one progress bar's updates (a turn's steps) and, at each eval point every row of ``rows`` has passed,
    the partial table on stderr: each row's eval loss (its delta against ``reference``'s) and its median step
    time so far (ms; each turn's first step left out)."""

    def __init__(self, steps: int, rows: list[str], reference: str, bar: tqdm) -> None:
        self.steps, self.rows, self.reference, self.bar = steps, rows, reference, bar
        self.losses: dict[int, dict[str, float | None]] = {}
        self.times: dict[str, list[float]] = {n: [] for n in rows}

    def turn(self, name: str, reply: dict[str, Any]) -> None:
        """:meth:`Turns.train`'s ``on_turn``."""
        self.bar.update(len(reply["times_ms"]))
        if name not in self.times:
            return
        self.times[name] += reply["times_ms"][1:]
        for step, loss in reply["evals"]:
            self.losses.setdefault(step, {})[name] = loss
            if set(self.losses[step]) == set(self.rows):
                self.bar.write(self.line(step), file=sys.stderr)

    def line(self, step: int) -> str:
        """The partial table at eval point ``step``, one line."""
        losses = self.losses[step]
        ref = losses.get(self.reference)
        words = [f"{n} {v:.4f}" + (f" ({(v - ref) / ref:+.2%})" if ref and n != self.reference else "")
                 if v is not None else f"{n} not finite" for n, v in ((n, losses[n]) for n in self.rows)]
        speed = [f"{n} {statistics.median(t):.0f}" for n, t in self.times.items() if t]
        return f"step {step}/{self.steps}: eval loss {', '.join(words)} | ms/step so far {', '.join(speed)}"


def with_step_times(rows: dict[str, PolicyRun], step_times: dict[str, list[tuple[int, float]]]) -> dict[str, PolicyRun]:
    """``rows`` with each named row's step time (median, p10, p90) taken from ``step_times`` (row -> ``[(round,
    ms), ...]``, the re-timing) and its throughput rescaled to it; the quality steps' median is kept as
    ``sequential_step_time_ms_median``."""
    rows = dict(rows)
    for name, tagged in step_times.items():
        times = [ms for _, ms in tagged]
        e = rows[name]
        median = statistics.median(times)
        scale = e.step_time_ms_median / median       # throughput scales inversely with step time
        rescaled = {key: getattr(e, key) * scale for key in ("items_per_s", "tokens_per_s", "gflops_per_s", "mfu")
                    if getattr(e, key) is not None}
        rows[name] = replace(e, sequential_step_time_ms_median=e.step_time_ms_median, step_time_ms_median=median,
                             step_time_ms_p10=percentile(times, 0.1), step_time_ms_p90=percentile(times, 0.9),
                             timed_steps=len(times), **rescaled)
    return rows
