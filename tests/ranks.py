"""The W-process gloo harness the distributed tests share: start ``world`` ranks with torchrun's environment
variables on a free port (one thread each, a 60 s collective timeout), run ``fn(rank, out_dir, *args)`` on each,
and return what each rank returned. A rank that raises fails the test with every rank's traceback; ranks still
running after ``timeout_s`` (a collective that hangs) fail it too and are killed.

The ranks are forked from multiprocessing's fork server, which imports torch and mixprec once per pytest
process (:data:`PRELOAD`), not started as fresh interpreters (``spawn``): spawn spent about 3 s of a 2-core
machine importing them in every rank, most of a 2-rank test (issue 36). Each rank is still a new process with
nothing but those imports done (the server runs no test code), it imports the test's module itself as under
spawn, and it takes the test's environment as it is when the ranks start (a fork server's children otherwise
inherit the server's, from when it started)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as torch_mp

from mixprec.distributed import process as mpd

__all__ = ["free_port", "run_ranks"]

START_METHOD = "forkserver"
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "mixprec",
           "mixprec.optim", "ranks"]
multiprocessing.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tests_on_path() -> dict[str, str]:
    """``PYTHONPATH`` for a test file that torchrun starts as a script (its folder is on ``sys.path``, not tests/):
    tests/ first (``ranks.py``, ``engine_loops.py``), then the caller's."""
    here = str(Path(__file__).resolve().parent)
    return {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}


def _entry(rank: int, world: int, port: int, out: str, fn, args: tuple, env: dict[str, str]) -> None:
    os.environ.clear()   # the test's environment when the ranks started, not the fork server's
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mpd.init_process_group_from_env("cpu", timeout=timedelta(seconds=60))
    finished = False
    try:
        result = fn(rank, Path(out), *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
        finished = True
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:   # a rank that finished waits for its peers before tearing gloo down (an abort seen under load)
        mpd.leave_process_group(wait_for_all=finished)


def run_ranks(fn, tmp_path: Path, *args, world: int = 2, timeout_s: float = 150) -> list:
    """Run ``fn(rank, tmp_path, *args)`` (a module-level function) on ``world`` gloo ranks; return each rank's
    result, rank order."""
    ctx = torch_mp.start_processes(_entry, args=(world, free_port(), str(tmp_path), fn, args, dict(os.environ)),
                                   nprocs=world, join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {timeout_s} s: a collective hangs")
    except torch_mp.ProcessRaisedException:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
        pytest.fail(f"a rank raised:\n{errors}")
    finally:
        for proc in ctx.processes:   # only the processes this test started
            if proc.is_alive():
                proc.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
