"""The guard's knobs and what it counts: :class:`GuardConfig` (frozen, validated) and :class:`GuardState`.

:class:`mixprec.Guard` builds its :class:`GuardConfig` from its keyword arguments (a knob out of range raises
ValueError naming it, its value, what is allowed and an example) and keeps its counts, its running loss window
and its streaks in a :class:`GuardState`, which ``Guard.state_dict`` saves as plain data. :data:`CAUSES` are the
failures it detects. All three are importable from :mod:`mixprec.guard`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CAUSES", "GuardConfig", "GuardState"]

CAUSES = ("nonfinite", "overflow", "spike", "skips")


def _check(name: str, value: Any, ok: bool, allowed: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"Guard {name}={value!r} is not allowed; it must be {allowed}; {fix}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class GuardConfig:
    """The guard's knobs (frozen; see :class:`mixprec.Guard` for their meaning)."""

    snapshot_every: int = 50
    check_every: int = 1
    spike_factor: float | None = 3.0
    spike_zscore: float | None = None
    spike_window: int = 50
    spike_warmup: int = 20
    overflow_backoffs: int = 16
    max_consecutive_skips: int = 20
    escalate_after: int = 2
    max_rollbacks: int = 8

    def __post_init__(self) -> None:
        for name, example in (("snapshot_every", 50), ("check_every", 1), ("spike_window", 50),
                              ("overflow_backoffs", 16), ("max_consecutive_skips", 20), ("escalate_after", 2)):
            value = getattr(self, name)
            _check(name, value, _is_int(value) and value >= 1, "an int >= 1", f"e.g. {name}={example}")
        _check("spike_warmup", self.spike_warmup, _is_int(self.spike_warmup) and self.spike_warmup >= 2,
               "an int >= 2 (a running statistic needs two losses)", "e.g. spike_warmup=20")
        _check("spike_warmup", self.spike_warmup, self.spike_warmup <= self.spike_window,
               f"an int in [2, spike_window={self.spike_window}] (the window holds the warm-up losses)",
               "lower spike_warmup or raise spike_window")
        _check("max_rollbacks", self.max_rollbacks, _is_int(self.max_rollbacks) and self.max_rollbacks >= 0,
               "an int >= 0 (0: raise at the first failure)", "e.g. max_rollbacks=8")
        _check("spike_factor", self.spike_factor,
               self.spike_factor is None or (_is_positive(self.spike_factor) and self.spike_factor > 1),
               "None (off) or a finite number > 1", "e.g. spike_factor=3.0 (loss above 3x its running mean)")
        _check("spike_zscore", self.spike_zscore, self.spike_zscore is None or _is_positive(self.spike_zscore),
               "None (off) or a finite number > 0", "e.g. spike_zscore=6.0")


@dataclass
class GuardState:
    """What the guard has counted and remembers, besides its snapshot (JSON-friendly).

    ``counts``: detections per cause and actions taken (``rollback``, ``skip``, ``escalate``);
    ``escalations``: what each escalation did (``"keep 'fc' in fp32"``, ``"bf16 → fp32"``) or why
    none happened (``"none: ..."``; the events hold the full policies); ``losses``: the running window of applied,
    healthy losses; ``failures_here``: failures since the snapshot was taken (the "place");
    ``skip_streak`` / ``backoff_streak``: consecutive skipped steps / loss-scale back-offs; ``nonfinite_streak``:
    consecutive steps skipped as non-finite since the last applied one.
    """

    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in (*CAUSES, "rollback", "skip", "escalate")})
    escalations: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    failures_here: int = 0
    skip_streak: int = 0
    backoff_streak: int = 0
    nonfinite_streak: int = 0
