"""One entry of the measured op plan (:mod:`mixprec.autocast.op_plan`): what was chosen for one op at one key, and
why. A frozen record, shared by the plan and the ranks' agreement on it (:mod:`mixprec.autocast.plan_agreement`);
and whether an entry of the plan's cache file may be used (:func:`usable_cached`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixprec.autocast.attention_kernels import CANDIDATES

__all__ = ["PlanEntry", "usable_cached"]


@dataclass(frozen=True)
class PlanEntry:
    """One planned op at one key: ``chosen`` among ``times_ms`` (candidate → best forward(+backward) time in
    ms, None where not timed), ``source`` ``"measured"``, ``"cache"`` (measured by an earlier process on
    this machine), ``"checkpoint"`` (pinned by a resumed checkpoint: :func:`mixprec.autocast.op_plan.pin`), ``"bench"`` (a bench worker's pin of
    the plan its runner measured once),
    ``"measured (noisy: ...)"`` (used in this process only) or ``"default (traced, not measured)"``; ``shape`` is the key in words;
    ``saved_bytes``: candidate → bytes its forward saves for backward per call (None: not offered or unknown;
    empty for a pin); ``memory``: the memory rule's words for this choice (module docstring);
    ``extra_saved_allowed_mib``: the allowance it was chosen under (MiB per call over ``fused``; None: no limit);
    ``rounds_ms``: each candidate's interleaved rounds (ms; none for a candidate dropped after its warm-ups, a pin
    or an older cache entry) and ``measured_choice``: the choice its measurement made (the cache file's for an
    entry read from it): a re-choice under another allowance runs what the rounds agree on, else this one or
    ``fused`` (:func:`mixprec.autocast.plan_verdict.agreed_times`)."""

    op: str
    shape: str
    chosen: str
    times_ms: dict[str, float | None] = field(default_factory=dict)
    source: str = "measured"
    note: str = ""
    saved_bytes: dict[str, int | None] = field(default_factory=dict)
    memory: str = ""
    extra_saved_allowed_mib: float | None = 0.0
    rounds_ms: dict[str, list[float]] = field(default_factory=dict)
    measured_choice: str = ""



def _numbers(values: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(values, dict) and all(v is None or (isinstance(v, kind) and not isinstance(v, bool))
                                            for v in values.values())


def usable_cached(cached: Any, key: str) -> bool:
    """Whether a cache file's entry is one :func:`mixprec.autocast.op_plan.choose` wrote (another shape, an edited or
    foreign file: measure). An older version's entry (no ``saved_bytes``) is usable for a ``fwd`` key only (nothing
    is saved there); one without ``rounds_ms`` (older too) is usable, re-chosen from its best times alone."""
    if not isinstance(cached, dict) or not isinstance(cached.get("chosen"), str) or cached["chosen"] not in CANDIDATES:
        return False
    if "saved_bytes" not in cached and key.endswith(" fwd+bwd"):
        return False
    rounds = cached.get("rounds_ms") or {}
    return (_numbers(cached.get("times_ms") or {}, (int, float)) and _numbers(cached.get("saved_bytes") or {}, int)
            and isinstance(rounds, dict) and all(isinstance(r, list) and None not in r and
                                                 _numbers(dict(enumerate(r)), (int, float)) for r in rounds.values()))
