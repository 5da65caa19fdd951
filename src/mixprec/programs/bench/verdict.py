"""Verdicts: each policy against targets set before the run, relative to the fp32 reference.

A verdict is one of:

* ``REFERENCE``: the fp32 run every other policy is compared with;
* ``SKIPPED``: the policy did not run, with the measured reason (e.g. fp16 on a CPU without
  native fp16 kernels, or a policy the device cannot run); ``--force`` runs such policies;
* ``FAIL``: the run crashed, its final validation loss is not finite, there is no fp32
  reference to compare with, or a target was missed;
* ``PASS``: every target was met;
* ``SMOKE``: every target was met in a smoke test (``mixprec bench --quick``), which cannot establish a PASS: the
  reason says what it did not establish.

Targets (:class:`Targets`):

* ``max_loss_delta``: the largest allowed *relative* increase of the final validation loss,
  ``(loss - loss_fp32) / loss_fp32`` (0.02 = 2 %). A lower loss than fp32 always passes.
* ``min_speedup`` (optional): the smallest allowed ``step_time_fp32 / step_time``.
* ``max_memory_ratio`` (optional): the largest allowed ``peak_memory / peak_memory_fp32``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Targets", "Verdict", "judge", "smoke_words", "VERDICTS"]

VERDICTS = ("PASS", "FAIL", "SKIPPED", "REFERENCE", "SMOKE")


@dataclass(frozen=True)
class Targets:
    """The bar each policy must clear; ``None`` means "not judged"."""

    max_loss_delta: float = 0.02
    min_speedup: float | None = None
    max_memory_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_loss_delta", "min_speedup", "max_memory_ratio"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Targets {name}={value!r} must be a finite number > 0"
                                 + ("" if name == "max_loss_delta" else " or None (not judged)"))


@dataclass(frozen=True)
class Verdict:
    verdict: str  # one of VERDICTS
    reason: str


def judge(*, targets: Targets, loss_delta: float | None = None, speedup: float | None = None,
          memory_ratio: float | None = None, reference: bool = False, skipped_reason: str | None = None,
          error: str | None = None) -> Verdict:
    """The verdict of one policy from its measured deltas against fp32 (a pure function).

    Args:
        targets: the targets set before the run.
        loss_delta: relative final validation-loss delta vs fp32 (None: no reference loss).
        speedup: fp32 median step time / this policy's (None: not measured).
        memory_ratio: process peak RSS / fp32's (None: not measured; the verdict says "peak RSS").
        reference: this is the fp32 reference run.
        skipped_reason: why the policy did not run (gives SKIPPED).
        error: why the run failed (gives FAIL).
    """
    if skipped_reason is not None:
        return Verdict("SKIPPED", skipped_reason)
    if error is not None:
        return Verdict("FAIL", error)
    if reference:
        return Verdict("REFERENCE", "fp32 reference: the other policies are compared with this run")
    if loss_delta is None:
        return Verdict("FAIL", "no fp32 reference loss to compare with (the fp32 run did not finish)")
    if not math.isfinite(loss_delta):
        return Verdict("FAIL", "final validation loss is not finite: training diverged")
    failures, passes = [], []
    loss_text = f"eval loss {loss_delta:+.2%} vs fp32 (limit +{targets.max_loss_delta:.2%})"
    (failures if loss_delta > targets.max_loss_delta else passes).append(loss_text)
    for value, target, name, bad in (
        (speedup, targets.min_speedup, "speedup", lambda v, t: v < t),
        (memory_ratio, targets.max_memory_ratio, "peak RSS", lambda v, t: v > t),   # process RSS, not tensors
    ):
        if target is None:
            if value is not None:
                passes.append(f"{name} {value:.2f}x (no target)")
            continue
        if value is None:
            failures.append(f"{name} not measured (target {target:.2f}x)")
            continue
        bound = "min" if name == "speedup" else "max"
        (failures if bad(value, target) else passes).append(f"{name} {value:.2f}x ({bound} {target:.2f}x)")
    if failures:
        return Verdict("FAIL", "; ".join(failures + passes))
    return Verdict("PASS", "; ".join(passes))


def smoke_words(steps: int, seed_band: bool) -> str:
    """What a smoke test (``mixprec bench --quick``) of ``steps`` steps did not establish: each SMOKE verdict's
    reason starts with it."""
    return (f"smoke test (--quick, {steps} steps): the targets held, but this does not establish a PASS — "
            "final losses this early measure the first drop, not training"
            + ("" if seed_band else ", no seed-noise band was measured")
            + ", and the step times rest on few steps; run without --quick for a verdict")
