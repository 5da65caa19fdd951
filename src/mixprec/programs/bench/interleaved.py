"""Interleaved timing-only rounds: rows' steps timed in short alternating blocks, so drift cannot fake a speedup.

The bench itself times each row on its quality steps, in one pass (:mod:`mixprec.programs.bench.turns`); this module
times rows that have already trained (``benchmarks/optimizer_peers.py`` times its peers beside the bench's rows):
one resident worker process per row (the same engine, model, seed and batch stream as its quality run, built by
:func:`serve`), then rounds of short blocks A B C … A B C … (each round starts one policy later), so drift lands on every policy alike. Each block
starts with one untimed step: the first step after a worker sat idle wakes its threads and refills caches, a
fixed cost that would otherwise weigh more on the faster policies. Per policy:
median, p10 and p90 of all timed steps, and the spread p90/p10. While a policy's spread exceeds
:data:`mixprec.programs.bench.noise.SPREAD_LIMIT` the rounds are repeated (at most :data:`RETIMES` times); whether
the timing is ``noisy`` in the end is decided once, for every row, by :func:`mixprec.programs.bench.noise.settle_noise`.

The plain-autocast peer (:mod:`mixprec.programs.bench.peer`) is timed as a row like the others, in its own worker.
After the timing, each worker profiles a short window of its steps (:mod:`mixprec.programs.bench.step_profile`:
where the step goes, per category), one worker after the other, never inside the timed rounds.

Source: the A/B interleaving of ``benchmarks/overhead.py``; the threshold is the same order as
:data:`mixprec.autocast.op_plan.NOISY_SPREAD`. Host syncs: the workers' (one per step for timing).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import asdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from mixprec.programs.bench.measure import percentile, time_steps
from mixprec.programs.bench import noise
from mixprec.programs.bench.mfu import peak_key
from mixprec.programs.bench.peer import build_trainee, row_identity
from mixprec.programs.bench.pinned_plan import pin_in_worker
from mixprec.programs.bench.spec import RunSpec
from mixprec.programs.bench.step_profile import profile_steps
from mixprec.programs.session import train_step
from mixprec.workloads import get_workload

__all__ = ["RETIMES", "TIMING_MALLOC_ENV", "time_interleaved", "serve", "stop_workers"]

RETIMES = 1           # extra sets of rounds tried while a policy is noisy
# The interleaved timing workers' glibc malloc thresholds (unless the environment sets them): a long-lived
# process keeps its heap, so the step time is compute, not page faults. With glibc's adaptive defaults a worker
# returns part of its heap to the OS after a step and faults it back in during the next, a fixed cost per step
# that weighs most on the fastest policies and understates their speedup (docs/bench.md, "Page faults, not
# compute", has the measurement). Export the same two variables to get the timed speed in your own runs.
# Ignored by other C libraries (macOS, musl).
TIMING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def serve(spec: RunSpec) -> int:
    """The worker side (``python -m mixprec.programs.bench --serve SPEC_JSON``): build the policy's engine (or the peer's
    loop: :func:`~mixprec.programs.bench.peer.build_trainee`) as its quality run did (a recompute row's
    ``spec.recompute`` names the plan its quality run measured, block by block), print ``{"ready": ...}``, then for each
    stdin line ``{"steps": k, "untimed": u}`` train u untimed and k timed steps and print ``{"times_ms": [...]}``;
    ``{"plan": true}``: what it planned; ``{"profile": true}``: a profiled window (:func:`_profile`); ``{"quit": true}``
    or end of input stops it. Returns the exit status."""
    try:
        workload = get_workload(spec.workload, config=spec.config, data=spec.data, lora=spec.lora)
        pin_in_worker(spec.op_plan, spec.device)   # the bench's one attention plan, as in the quality run
        mp = build_trainee(workload, spec)
        batches = _forever(workload, spec.seed)
    except Exception as err:   # reported to the runner, which times the others
        print(json.dumps({"ready": False, "error": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    print(json.dumps({"ready": True, "policy": row_identity(mp).policy}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        step = lambda: train_step(mp, workload, next(batches))   # noqa: E731
        if command.get("plan"):   # what this worker's engine planned: key, choice, source
            found = row_identity(mp).op_plan
            print(json.dumps({"op_plan": [{k: e[k] for k in ("shape", "chosen", "source")} for e in found]}), flush=True)
            continue
        if command.get("profile"):
            print(json.dumps({"step_profile": _profile(step, mp.device, row_identity(mp).compute_dtype, spec)}),
                  flush=True)
            continue
        time_steps(step, mp.device, int(command.get("untimed", 0)))   # the block's first step wakes threads, caches
        times = time_steps(step, mp.device, int(command["steps"]))
        print(json.dumps({"times_ms": times}), flush=True)
    return 0


def _profile(step: Callable[[], Any], device: torch.device, dtype: torch.dtype, spec: RunSpec) -> dict[str, Any]:
    """:func:`~mixprec.programs.bench.step_profile.profile_steps` of this worker's step against the measured matmul peak
    in its compute dtype, or ``{"error": ...}`` (said in the report, never a number)."""
    try:
        key = peak_key(dtype)
        return profile_steps(step, device, peak_dtype=key, peak_gflops=spec.peaks_gflops.get(key))
    except Exception as err:   # a profiler that cannot run here: the row stands without its profile
        return {"error": f"{type(err).__name__}: {err}"}


def _forever(workload: Any, seed: int) -> Iterator[Any]:
    """The workload's training batches, started again when a finite stream ends."""
    while True:
        yield from workload.batches("train", seed)


def _ask(proc: subprocess.Popen, command: dict) -> dict:
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the timing worker (pid {proc.pid}) exited (status {proc.wait()})")
    return json.loads(line)


def time_interleaved(specs: dict[str, RunSpec], workdir: Path, env: dict[str, str], *, block_steps: int,
                     rounds: int, warmup_steps: int) -> dict[str, Any]:
    """Time every policy of ``specs`` (row name → its quality run's spec) interleaved, as the module says.

    Returns results.json's ``timing``: ``method`` (``"interleaved"``), ``blocks`` (per policy), ``block_steps``,
    ``step_ms`` (row → ``median``/``p10``/``p90`` in ms, None when its worker failed), ``spread`` (row → p90/p10),
    ``retimed`` (sets of rounds beyond the first), ``noisy`` (``noise.is_noisy(spread)``; the runner's is ``settle_noise``'s),
    ``errors`` (row → why it was not timed), ``malloc_env`` (the workers' :data:`TIMING_MALLOC_ENV`; a
    variable already set in ``env`` wins), ``op_plan`` (row → what its worker's engine planned:
    ``shape`` (the key), ``chosen``, ``source``; ``"bench"`` where it pinned the bench's one plan), ``step_profile`` (row →
    its profiled window after the timing, :func:`mixprec.programs.bench.step_profile.profile_steps`, or ``{"error"}``)."""
    env = {**env, **{k: env.get(k, v) for k, v in TIMING_MALLOC_ENV.items()}}   # a set variable wins
    procs: dict[str, subprocess.Popen] = {}
    errors: dict[str, str] = {}
    times: dict[str, list[float]] = {}
    try:
        for name, spec in specs.items():
            procs[name] = _start(name, spec, workdir, env)
        errors.update(_warm(procs, warmup_steps))
        times.update({name: [] for name in procs if name not in errors})
        live = list(times)
        retimed = 0
        for attempt in range(1 + RETIMES):
            for r in range(rounds):
                for name in live[r % len(live):] + live[:r % len(live)] if live else []:
                    try:
                        times[name] += _ask(procs[name], {"steps": block_steps, "untimed": 1})["times_ms"]
                    except (RuntimeError, ValueError) as err:
                        errors[name] = str(err)
                live = [n for n in live if n not in errors]
            spread = {n: percentile(times[n], 0.9) / percentile(times[n], 0.1) for n in live}
            if attempt == RETIMES or not noise.is_noisy(spread):
                break
            retimed += 1
            for n in live:       # a noisy set is not kept: the next one replaces it
                times[n] = []
        plans = _plans(procs, [n for n in live if n not in errors])
        profiles = _ask_each(procs, [n for n in live if n not in errors], {"profile": True}, "step_profile")
    finally:
        stop_workers(procs.values())
    step_ms = {n: ({"median": statistics.median(t), "p10": percentile(t, 0.1), "p90": percentile(t, 0.9)}
                   if t and n not in errors else None) for n, t in times.items()}
    spread = {n: round(v["p90"] / v["p10"], 3) for n, v in step_ms.items() if v}
    return {"method": "interleaved", "blocks": rounds, "block_steps": block_steps, "step_ms": step_ms,
            "spread": spread, "retimed": retimed, "noisy": noise.is_noisy(spread),
            "spread_limit": noise.SPREAD_LIMIT, "errors": errors, "malloc_env": {k: env[k] for k in TIMING_MALLOC_ENV},
            "op_plan": plans, "step_profile": profiles}


def _warm(procs: dict[str, subprocess.Popen], warmup_steps: int) -> dict[str, str]:
    """Each worker's ready line read and, when it is ready, its ``warmup_steps`` untimed steps run, in start order:
    row -> why its worker did not start (the rows it leaves out are ready and warm)."""
    errors = {}
    for name, proc in procs.items():
        ready = json.loads(proc.stdout.readline() or '{"ready": false, "error": "no reply"}')
        if not ready.get("ready"):
            errors[name] = ready.get("error", "the timing worker did not start")
            continue
        _ask(proc, {"steps": warmup_steps})
    return errors


def stop_workers(procs: Iterable[subprocess.Popen]) -> None:
    """Ask every resident worker to quit (``{"quit": true}``, then end of input), all at once (each interpreter's
    exit takes about a second), then wait up to 60 s for each; kill the ones that do not stop."""
    procs = list(procs)
    for proc in procs:
        try:
            if proc.poll() is None:
                proc.stdin.write(json.dumps({"quit": True}) + "\n")
                proc.stdin.close()
        except (OSError, ValueError):
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(name: str, spec: RunSpec, workdir: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start row ``name``'s resident timing worker (:func:`serve`), its spec and log in ``workdir``."""
    spec_path = workdir / f"timing-{''.join(c if c.isalnum() or c in '-_' else '_' for c in name)}.spec.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    with open(spec_path.with_suffix(".log"), "w", encoding="utf-8") as log:
        return subprocess.Popen([sys.executable, "-m", "mixprec.programs.bench", "--serve", str(spec_path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)


def _plans(procs: dict[str, subprocess.Popen], rows: list[str]) -> dict[str, list[dict]]:
    """Row -> what its timing worker's engine planned (key, choice, source): the check that it ran the bench's plan."""
    plans = {}
    for name in rows:
        try:
            plans[name] = _ask(procs[name], {"plan": True})["op_plan"]
        except (RuntimeError, ValueError, KeyError) as err:   # said as a row that did not report the bench's plan
            plans[name] = [{"shape": "-", "chosen": "-", "source": f"not reported ({err})"}]
    return plans


def _ask_each(procs: dict[str, subprocess.Popen], rows: list[str], command: dict, key: str) -> dict[str, Any]:
    """Row -> its worker's ``key`` in the reply to ``command``, asked of one worker after the other (none runs while
    another answers), or ``{"error": ...}`` where the worker did not answer."""
    replies: dict[str, Any] = {}
    for name in rows:
        try:
            replies[name] = _ask(procs[name], command)[key]
        except (RuntimeError, ValueError, KeyError) as err:
            replies[name] = {"error": f"{type(err).__name__}: {err}"}
    return replies
