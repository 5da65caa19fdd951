"""A bench run's results as records: :class:`PolicyRun` (one row: one policy's measurements and verdict) and
:class:`BenchResults` (the run), with ``to_json()``/``from_json()`` at the edge (results.json, the worker's
OUT_JSON). The JSON keeps results.json's keys, order and presence exactly (:data:`POLICY_KEYS` first).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["POLICY_KEYS", "RUN_KEYS", "PER_RANK_KEYS", "COMPILED_SUFFIX", "PolicyRun", "BenchResults"]

COMPILED_SUFFIX = "+compiled"   # the row of a policy run under bench --compile

POLICY_KEYS = (
    "requested", "policy", "decision", "compute_dtype", "device", "pid", "optimizer", "steps",
    "step_time_ms_median", "step_time_ms_p10", "step_time_ms_p90", "tokens_per_s", "items_per_s", "item_unit", "speedup_vs_fp32",
    "gflops_per_s", "peak_gflops_per_s", "mfu", "mfu_own_dtype", "peak_memory_mb", "memory_ratio_vs_fp32", "memory_source",
    "state_bytes_per_param", "state_bytes", "final_eval", "final_eval_loss", "eval_loss_delta_vs_fp32",
    "skipped_steps", "skipped_by_reason", "loss_per_step", "loss_scale_history", "grad_norm_per_step",
    "lr_per_step", "step_time_ms_per_step", "events", "verdict", "reason", "skipped_reason", "error",
    "compiled", "first_step_ms", "warmup_excess_s", "compile_time_s", "eval_curve", "loss_unit",
    "saved_activation_bytes", "saved_activation_ratio_vs_fp32", "peak_live_bytes", "peak_live_ratio_vs_fp32",
    "step_memory", "memory_budget", "recompute", "recompute_plan", "step_time_ratio_vs_no_recompute",
    "speedup_vs_peer", "saved_activation_ratio_vs_peer", "peak_live_ratio_vs_peer", "step_profile",
)
RUN_KEYS = (
    "op_plan", "torch_threads", "warmup_steps", "items_per_batch", "flops_per_step", "strategy", "world_size", "wall_s",
)
"""The keys a row that trained has besides :data:`POLICY_KEYS` (a SKIPPED or failed row has none of them)."""
PER_RANK_KEYS = ("state_bytes_per_param_per_rank", "state_bytes_per_param_per_rank_max", "peak_live_bytes_per_rank",
                 "peak_live_bytes_per_rank_max")
"""Every rank's figures on rank 0's row under a strategy, with their max over ranks (absent in one process)."""


@dataclass(frozen=True)
class PolicyRun:
    """One row of results.json: what a worker measured for one policy (None: not measured), the deltas against
    fp32 and the verdict the runner added. Units are in the names (``_ms``, ``_mb`` = MiB, ``_per_s``);
    ``eval_curve`` is ``[[step, eval loss], ...]``, the final eval last; ``state_bytes``, ``final_eval``,
    ``events`` and ``op_plan`` are kept in their JSON form. ``stage`` (``"setup"``/``"train"``) says where a
    failed worker stopped; ``sequential_step_time_ms_median`` is the quality run's own median when the row
    was re-timed after its quality steps; ``timed_steps`` how many steps its median is of (the warm-up, each turn's
    first step and each step after an eval point left out). ``saved_activation_bytes`` (the parameters left out) and ``peak_live_bytes`` (the
    step's peak of live tensors, baseline included) come from one extra untimed step after the final eval
    (:mod:`mixprec.programs.bench.step_memory`), ``step_memory`` their detail (or ``{"error": ...}``);
    ``memory_budget`` the largest batch in ``--memory-budget`` (:class:`mixprec.memory.batch_budget.BatchBudget`'s dict).
    ``recompute``, ``recompute_plan``, ``step_time_ratio_vs_no_recompute``: a ``<policy>+recompute`` row's
    (:mod:`mixprec.programs.bench.recompute_rows`), None on other rows. ``speedup_vs_peer`` (the ``torch-autocast``
    peer's median step time / this row's), ``saved_activation_ratio_vs_peer`` and ``peak_live_ratio_vs_peer`` (this
    row's bytes / the peer's): every row against the plain-autocast peer (:mod:`mixprec.programs.bench.peer`), None
    without it. ``step_profile``: where the step goes, per category, from a profiled window in the row's timing worker
    (:mod:`mixprec.programs.bench.step_profile`; None under sequential timing). Under a strategy ``state_bytes*`` and
    ``peak_live_bytes`` are rank 0's own, and ``*_per_rank`` (+ ``_max``) every rank's
    (:mod:`mixprec.programs.bench.per_rank`)."""

    requested: str | None = None
    policy: str | None = None
    decision: str | None = None
    compute_dtype: str | None = None
    device: str | None = None
    pid: int | None = None
    optimizer: str | None = None
    steps: int | None = None
    step_time_ms_median: float | None = None
    step_time_ms_p10: float | None = None
    step_time_ms_p90: float | None = None
    tokens_per_s: float | None = None
    items_per_s: float | None = None
    item_unit: str | None = None
    speedup_vs_fp32: float | None = None
    gflops_per_s: float | None = None
    peak_gflops_per_s: float | None = None
    mfu: float | None = None
    mfu_own_dtype: float | None = None
    peak_memory_mb: float | None = None
    memory_ratio_vs_fp32: float | None = None
    memory_source: str | None = None
    state_bytes_per_param: float | None = None
    state_bytes: dict[str, Any] | None = None
    final_eval: dict[str, float] | None = None
    final_eval_loss: float | None = None
    eval_loss_delta_vs_fp32: float | None = None
    skipped_steps: int | None = None
    skipped_by_reason: dict[str, int] | None = None
    loss_per_step: list[float | None] | None = None
    loss_scale_history: list[float | None] | None = None
    grad_norm_per_step: list[float | None] | None = None
    lr_per_step: list[float] | None = None
    step_time_ms_per_step: list[float] | None = None
    events: list[dict[str, Any]] | None = None
    verdict: str | None = None
    reason: str | None = None
    skipped_reason: str | None = None
    error: str | None = None
    compiled: bool | None = None
    first_step_ms: float | None = None
    warmup_excess_s: float | None = None
    compile_time_s: float | None = None
    eval_curve: list[list] | None = None
    loss_unit: str | None = None
    saved_activation_bytes: int | None = None
    saved_activation_ratio_vs_fp32: float | None = None
    peak_live_bytes: int | None = None
    peak_live_ratio_vs_fp32: float | None = None
    step_memory: dict[str, Any] | None = None
    memory_budget: dict[str, Any] | None = None
    recompute: Any = None
    recompute_plan: dict[str, Any] | None = None
    step_time_ratio_vs_no_recompute: float | None = None
    speedup_vs_peer: float | None = None
    saved_activation_ratio_vs_peer: float | None = None
    peak_live_ratio_vs_peer: float | None = None
    step_profile: dict[str, Any] | None = None
    # a row that trained (RUN_KEYS)
    op_plan: list[dict[str, Any]] | None = None
    torch_threads: int | None = None
    warmup_steps: int | None = None
    items_per_batch: int | None = None
    flops_per_step: float | None = None
    strategy: str | None = None
    world_size: int | None = None
    wall_s: float | None = None
    # present only when set
    stage: str | None = None
    sequential_step_time_ms_median: float | None = None
    timed_steps: int | None = None
    state_bytes_per_param_per_rank: list[float] | None = None
    state_bytes_per_param_per_rank_max: float | None = None
    peak_live_bytes_per_rank: list[int | None] | None = None
    peak_live_bytes_per_rank_max: int | None = None

    @classmethod
    def skipped(cls, requested: str, reason: str) -> PolicyRun:
        """A SKIPPED row: nothing measured, ``reason`` why the policy did not run."""
        return cls(requested=requested, skipped_reason=reason)

    @property
    def trained(self) -> bool:
        """Whether a worker trained this row to the end (it carries :data:`RUN_KEYS`)."""
        return self.wall_s is not None

    def to_json(self) -> dict[str, Any]:
        """results.json's row: :data:`POLICY_KEYS` always, :data:`RUN_KEYS` for a row that trained, then
        ``stage``, ``sequential_step_time_ms_median``, ``timed_steps`` and the per-rank figures (under a strategy:
        :mod:`mixprec.programs.bench.per_rank`) where set."""
        keys = POLICY_KEYS + (RUN_KEYS if self.trained else ())
        out = {key: getattr(self, key) for key in keys}
        for key in _WHEN_SET:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PolicyRun:
        """A row from its JSON form (results.json's or a worker's OUT_JSON; missing keys are None).

        Raises:
            ValueError: ``value`` has a key a row does not have.
        """
        unknown = sorted(set(value) - _FIELDS)
        if unknown:
            raise ValueError(f"a bench row has no keys {unknown}; allowed: {sorted(_FIELDS)}")
        return cls(**value)


_FIELDS = frozenset(f.name for f in fields(PolicyRun))
_WHEN_SET = ("stage", "sequential_step_time_ms_median", "timed_steps", *PER_RANK_KEYS)


@dataclass(frozen=True)
class BenchResults:
    """One bench run: results.json's content, its rows typed. ``settings``, ``workload``, ``environment``,
    ``advice``, ``timing``, ``seed_noise``, ``mfu_peak``, ``portable_ops``, ``op_plan`` (the bench's one attention plan,
    :func:`mixprec.programs.bench.pinned_plan.measure_bench_plan`; None when no policy plans) and ``peer`` (the
    plain-autocast peer's plan, :meth:`mixprec.programs.bench.peer.PeerPlan.as_json`; None under ``--no-peer``) keep their JSON form
    (see :mod:`mixprec.programs.bench.report` for their keys)."""

    created: str
    command: str
    settings: dict[str, Any]
    workload: dict[str, Any]
    environment: dict[str, Any]
    reference: str
    advice: dict[str, Any] | None
    policies: dict[str, PolicyRun]
    timing: dict[str, Any]
    seed_noise: dict[str, Any] | None
    mfu_peak: dict[str, Any] | None
    portable_ops: dict[str, Any] | None
    parent_pid: int
    wall_s: float
    mixprec_bench: int = field(default=1)
    op_plan: dict[str, Any] | None = None
    peer: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """results.json's object (before non-finite floats become null), keys in results.json's order."""
        out: dict[str, Any] = {"mixprec_bench": self.mixprec_bench}
        for f in fields(self):
            if f.name != "mixprec_bench":
                out[f.name] = getattr(self, f.name)
        out["policies"] = {name: row.to_json() for name, row in self.policies.items()}
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> BenchResults:
        """A run from results.json's object."""
        return cls(**{**value, "policies": {n: PolicyRun.from_json(r) for n, r in value["policies"].items()}})
