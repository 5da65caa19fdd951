"""How mixprec times anything: one device sync and one timer, for the bench, the op plan, ``auto``, the probe
and the doctor.

A device runs queued work asynchronously (CUDA, MPS), so a wall-clock time means something only between two
syncs: :func:`time_call` waits for the device before reading the clock, runs the call, and waits again before
reading it a second time. On the CPU the syncs are no-ops and the time is the call's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["synchronize", "time_call", "time_calls"]


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has finished all queued work (a host-device sync on CUDA and MPS; no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_call(call: Callable[[], Any], device: torch.device | str, *,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one ``call()`` takes on ``device``: sync, read ``clock``, call, sync, read ``clock`` again.
    ``clock`` returns seconds (injectable for tests). Host syncs: two (CUDA/MPS), none on the CPU."""
    synchronize(device)
    start = clock()
    call()
    synchronize(device)
    return clock() - start


def time_calls(call: Callable[[], Any], device: torch.device | str, n: int, *,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """:func:`time_call` ``n`` times in a row: each call's seconds, in order. Host syncs: two per call (CUDA/MPS)."""
    return [time_call(call, device, clock=clock) for _ in range(n)]
