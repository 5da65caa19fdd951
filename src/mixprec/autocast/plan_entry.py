"""One entry of the measured op plan (:mod:`mixprec.autocast.op_plan`): what was chosen for one op at one key, and
why. A frozen record, shared by the plan and the ranks' agreement on it (:mod:`mixprec.autocast.plan_agreement`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PlanEntry"]


@dataclass(frozen=True)
class PlanEntry:
    """One planned op at one key: ``chosen`` among ``times_ms`` (candidate → best forward(+backward) time in
    ms, None where not timed), ``source`` ``"measured"``, ``"cache"`` (measured by an earlier process on
    this machine), ``"checkpoint"`` (pinned by a resumed checkpoint: :func:`mixprec.autocast.op_plan.pin`), ``"bench"`` (a bench worker's pin of
    the plan its runner measured once),
    ``"measured (noisy: ...)"`` (used in this process only) or ``"default (traced, not measured)"``; ``shape`` is the key in words;
    ``saved_bytes``: candidate → bytes its forward saves for backward per call (None: not offered or unknown;
    empty for a pin); ``memory``: the memory rule's words for this choice (module docstring);
    ``extra_saved_allowed_mib``: the allowance it was chosen under (MiB per call over ``fused``; None: no limit)."""

    op: str
    shape: str
    chosen: str
    times_ms: dict[str, float | None] = field(default_factory=dict)
    source: str = "measured"
    note: str = ""
    saved_bytes: dict[str, int | None] = field(default_factory=dict)
    memory: str = ""
    extra_saved_allowed_mib: float | None = 0.0

