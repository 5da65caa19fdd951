"""Starting a bench worker process and reading the row it wrote: :func:`run_worker` (the quality runs, the seed runs)
and the environment every worker inherits (:func:`worker_env`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.spec import RunSpec

__all__ = ["free_port", "worker_env", "run_worker"]


def free_port() -> int:
    """A TCP port free on this host now (for the worker ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The parent's environment with the working directory on PYTHONPATH (user workloads)."""
    env = dict(os.environ)
    paths = [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def run_worker(spec: RunSpec, workdir: Path, name: str, bar: tqdm,
               env_update: dict[str, str] | None = None) -> PolicyRun:
    """Run one row (a policy, or the peer) in its own process; the row its OUT_JSON holds (measurements, or an error and its stage)."""
    spec_path, out_path, log_path = (workdir / f"{name}{suffix}" for suffix in (".spec.json", ".json", ".log"))
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    out_path.unlink(missing_ok=True)
    done = 0
    env = worker_env()
    if env_update is not None:  # the worker ranks of one policy meet on their own store, not torchrun's
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        env.update(env_update)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mixprec.programs.bench", str(spec_path), str(out_path)],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        for line in proc.stdout or ():
            if line.startswith("step ") and line[5:].strip().isdigit():
                step = int(line[5:])
                bar.update(step - done)
                done = step
        status = proc.wait()
    bar.update(spec.steps - done)
    try:
        result = json.loads(out_path.read_text())
    except (OSError, ValueError):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        result = {"error": f"worker exited with status {status} and no results; log {log_path}: {' | '.join(tail)}",
                  "stage": "train"}
    return PolicyRun.from_json({"requested": spec.policy, **result})
