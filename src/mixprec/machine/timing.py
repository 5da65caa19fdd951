"""How mixprec times anything: one device sync and one timer, for the bench, the op plan, ``auto``, the probe
and the doctor.

A device runs queued work asynchronously (CUDA, MPS), so a wall-clock time means something only between two
syncs: :func:`timed` waits for the device before reading the clock, runs the call, and waits again before
reading it a second time. On the CPU the syncs are no-ops and the time is the call's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["synchronize", "timed", "time_call", "time_calls"]

T = TypeVar("T")


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has finished all queued work (a host-device sync on CUDA and MPS; no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(call: Callable[[], T], device: torch.device | str, *,
          clock: Callable[[], float] = time.perf_counter) -> tuple[T, float]:
    """``call()``'s result and the seconds it took on ``device``: sync, read ``clock``, call, sync, read ``clock``
    again. ``clock`` returns seconds (injectable for tests). Host syncs: two (CUDA/MPS), none on the CPU."""
    synchronize(device)
    start = clock()
    value = call()
    synchronize(device)
    return value, clock() - start


def time_call(call: Callable[[], Any], device: torch.device | str, *,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one ``call()`` takes on ``device`` (:func:`timed` without the result)."""
    return timed(call, device, clock=clock)[1]


def time_calls(call: Callable[[], Any], device: torch.device | str, n: int, *,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """:func:`time_call` ``n`` times in a row: each call's seconds, in order. Host syncs: two per call (CUDA/MPS)."""
    return [time_call(call, device, clock=clock) for _ in range(n)]
