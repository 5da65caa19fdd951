"""The plain-autocast peer: the row ``torch-autocast`` in every bench, what a user writes instead of mixprec.

Every policy is compared with fp32; a user choosing mixprec also compares it with the loop they would write
without it. The peer is that loop, trained and measured like a policy: the same model from the same
seed, the same batches, the same learning-rate schedule and the same gradient clipping, but

* the model stays fp32, the optimizer is the workload's own recipe (:meth:`~mixprec.workloads.Workload.make_optimizer`,
  ``torch.optim.AdamW`` for gpt: its hyperparameters, ``foreach``/``fused`` left at torch's defaults) with its
  schedule (:meth:`~mixprec.workloads.Workload.make_scheduler`), as :func:`mixprec.programs.session.build_engine`
  builds them for a policy;
* each forward (evaluation included) runs under ``torch.autocast(device_type, dtype=...)``; then
  ``clip_grad_norm_(model.parameters(), max_norm)``, ``optimizer.step()``, ``scheduler.step()``,
  ``zero_grad(set_to_none=True)``; a ``torch.amp.GradScaler`` where the dtype is fp16 (disabled, a no-op, in bf16);
* nothing of mixprec's autocast runs: no engine, no op plan, no portable op lists, no saved-dtype kernels. Those
  are registered with torch only when an engine first enters ``mp.autocast()``, which never happens in the peer's
  processes, so its attention is torch's own ``scaled_dot_product_attention`` under plain autocast (its row's
  ``op_plan`` is everything its process planned: empty).

Its dtype is the device's 16-bit autocast candidate, as the bench and ``auto`` decide it
(:func:`mixprec.policy.resolve.auto_candidates`: bf16 where it runs natively, fp16 on a GPU without fast bf16, never
fp16 on a CPU); a device with none gives a SKIPPED row with the reason (never an fp32 peer). It runs in its own
quality worker and its own resident timing worker, interleaved with the policies; its verdict is the quality gate
alone (``--max-loss-delta`` against fp32: the speed and memory targets judge mixprec's policies). Every row gets
its speed and saved bytes against it (:data:`PEER_KEYS`). Not under ``--strategy`` (the peer trains in one
process) nor compiled; ``mixprec bench --no-peer`` leaves it out.

This module is the seam between the bench and the peer: :func:`build_trainee` and :func:`row_identity` are the only
places a worker tells the peer from an engine; :func:`plan_peer`, :func:`peer_targets` and :func:`with_peer_ratios`
the runner's; :func:`label` the report's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Union

import torch

from mixprec.autocast import op_plan
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.records import Event
from mixprec.machine.capability import Capability, normalize_device
from mixprec.policy.policy import PRESETS
from mixprec.policy.resolve import auto_candidates
from mixprec.programs.bench.spec import RunSpec
from mixprec.programs.bench.verdict import Targets
from mixprec.programs.session import build_engine
from mixprec.workloads import Workload
from mixprec.workloads.base import Batch, move_batch

__all__ = ["PEER", "PEER_KEYS", "PeerStep", "AutocastPeer", "Trainee", "RowIdentity", "PeerPlan", "build_trainee",
           "row_identity", "plan_peer", "peer_targets", "with_peer_ratios", "label"]

PEER = "torch-autocast"   # the peer's row name
PEER_KEYS = ("speedup_vs_peer", "saved_activation_ratio_vs_peer", "peak_live_ratio_vs_peer")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PeerStep:
    """What one :meth:`AutocastPeer.step` did, with the engine's ``StepResult`` names the bench reads.

    ``applied``: False only when the fp16 ``GradScaler`` skipped the step (its scale went down);
    ``loss_scale``: the scale the step's backward used (1.0 without scaling); ``grad_norm``: the global L2 norm of
    the unscaled gradients before clipping, read from the device on access (**a host sync**; nan when the
    workload does not clip, so no norm was computed)."""

    applied: bool
    skipped_reason: str | None
    step: int                      # applied optimizer steps so far
    loss_scale: float
    grad_norm_t: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def grad_norm(self) -> float:
        return math.nan if self.grad_norm_t is None else float(self.grad_norm_t)


class AutocastPeer:
    """The fp32 model, the workload's torch optimizer and schedule, ``torch.autocast`` in ``dtype``: a user's loop
    (module docstring) offering the calls the bench's step, evaluation and memory step make on an engine
    (:class:`mixprec.programs.session.StepCalls`). ``steps``: the schedule's length; ``seed``: torch's global
    seed before the model is built (the policies' initial weights).

    Raises:
        ValueError: ``dtype`` is not bf16 or fp16, or the workload's optimizer is not a ``torch.optim`` one (then
            the loop would not be a plain torch loop; the message names the class).
    """

    def __init__(self, workload: Workload, *, dtype: torch.dtype, steps: int, seed: int,
                 device: str | torch.device | None) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"AutocastPeer dtype={dtype!r} must be torch.bfloat16 or torch.float16 (torch.autocast's "
                             "16-bit dtypes); an fp32 loop is the fp32 reference's")
        self.device = normalize_device(device)
        self.compute_dtype = dtype
        torch.manual_seed(seed)
        self.model = workload.build_model().to(self.device)
        self.optimizer = workload.make_optimizer(self.model)
        if not type(self.optimizer).__module__.startswith("torch.optim"):
            raise ValueError(f"the torch-autocast peer needs a torch.optim optimizer from the workload's make_optimizer, "
                             f"got {type(self.optimizer).__module__}.{type(self.optimizer).__name__}; run the bench with "
                             "--no-peer, or return a torch.optim optimizer")
        self.scheduler = workload.make_scheduler(self.optimizer, steps)
        self.max_grad_norm = workload.max_grad_norm
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=dtype == torch.float16)
        self.applied_steps = 0
        self.events: list[Any] = []   # a plain loop records none (the engine's: mp.events)

    def cast_inputs(self, batch: Batch, *, keep: tuple[str, ...] = ()) -> Batch:
        """``batch`` moved to the device, dtypes unchanged (autocast casts inside the ops; ``keep`` changes
        nothing). No host sync."""
        return move_batch(batch, self.device)

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast(device_type, dtype)``, nothing else."""
        with torch.autocast(self.device.type, dtype=self.compute_dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``scaler.scale(loss).backward()`` (the loss itself in bf16: the scaler is disabled). No host sync."""
        self.scaler.scale(loss).backward()

    def step(self) -> PeerStep:
        """Unscale (fp16), clip to the workload's max norm, ``scaler.step(optimizer)`` (``optimizer.step()`` in bf16),
        ``scaler.update()``, ``scheduler.step()``, ``zero_grad(set_to_none=True)``. Host syncs: none in bf16; in fp16
        the scaler's own (it reads whether any gradient was inf/nan) and two reads of the scale."""
        scale = self.scaler.get_scale()             # fp16: a host sync; 1.0 when disabled
        self.scaler.unscale_(self.optimizer)        # a no-op when disabled
        norm = None if self.max_grad_norm is None else \
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        applied = self.scaler.get_scale() >= scale  # the scaler backs off only after a skipped step
        self.applied_steps += applied
        return PeerStep(applied=applied, skipped_reason=None if applied else "overflow", step=self.applied_steps,
                        loss_scale=scale, grad_norm_t=norm)

    @property
    def decision(self) -> str:
        """What the peer runs, in words (its row's ``decision``)."""
        clip = "no clipping" if self.max_grad_norm is None else f"clip_grad_norm_(max_norm={self.max_grad_norm:g})"
        scaler = "torch.amp.GradScaler" if self.scaler.is_enabled() else "no GradScaler"
        optimizer = f"{type(self.optimizer).__module__}.{type(self.optimizer).__name__}"
        return (f"the peer, not a mixprec policy: the fp32 model under torch.autocast('{self.device.type}', "
                f"dtype={self.compute_dtype}) around each forward (evaluation too), {optimizer} and the schedule from "
                f"the workload's recipe, {clip}, {scaler}; torch's own autocast kernels (no mixprec op plan, op lists "
                "or engine)")


Trainee = Union[MixedPrecision, AutocastPeer]


def build_trainee(workload: Workload, spec: RunSpec) -> Trainee:
    """What a bench worker trains for ``spec``: the peer for :data:`PEER` (its ``autocast_dtype``), else the
    policy's engine (:func:`mixprec.programs.session.build_engine`). ValueError/TypeError: refused (a SetupError
    in the worker)."""
    if spec.policy == PEER:
        if spec.autocast_dtype not in _DTYPES:
            raise ValueError(f"the {PEER} row needs RunSpec autocast_dtype 'bfloat16' or 'float16', got "
                             f"{spec.autocast_dtype!r}")
        return AutocastPeer(workload, dtype=_DTYPES[spec.autocast_dtype], steps=max(spec.steps, 1), seed=spec.seed,
                            device=spec.device)
    return build_engine(workload, spec.policy, steps=max(spec.steps, 1), seed=spec.seed, device=spec.device,
                        strategy=spec.strategy, compile=spec.compile, recompute=spec.recompute)


@dataclass(frozen=True)
class RowIdentity:
    """What a row's worker ran, as results.json says it: ``policy`` (the engine's policy text, or :data:`PEER`),
    ``decision``, ``compute_dtype``, ``op_plan`` (the attention plan entries it ran, as dicts), ``events``."""

    policy: str
    decision: str
    compute_dtype: torch.dtype
    op_plan: list[dict[str, Any]]
    events: list[dict[str, Any]]


def row_identity(trainee: Trainee) -> RowIdentity:
    """:class:`RowIdentity` of an engine or of the peer. The peer's ``op_plan`` is every entry its process planned,
    on any device (none: nothing of mixprec's planned kernels ran there)."""
    if isinstance(trainee, AutocastPeer):
        return RowIdentity(policy=PEER, decision=trainee.decision, compute_dtype=trainee.compute_dtype,
                           op_plan=[dataclasses.asdict(e) for e in op_plan.entries()], events=[])
    return RowIdentity(policy=str(trainee.policy), decision=trainee.decision, compute_dtype=trainee.policy.compute_dtype,
                       op_plan=[dataclasses.asdict(e) for e in op_plan.entries(trainee.device.type, policy=trainee.policy)],
                       events=[Event.of(e).to_dict() for e in trainee.events])


@dataclass(frozen=True)
class PeerPlan:
    """The runner's plan for the peer: its ``dtype`` (``"bfloat16"``/``"float16"``) or why it is SKIPPED
    (``skipped_reason``); ``row`` None: no row at all (under a strategy), ``note`` says why."""

    row: str | None
    dtype: str | None
    skipped_reason: str | None
    note: str = ""

    def rows(self) -> dict[str, str | None]:
        """The row the bench adds, name -> why it is SKIPPED (None: it runs); empty under a strategy."""
        return {} if self.row is None else {self.row: self.skipped_reason}

    def autocast_dtype(self, name: str) -> str | None:
        """``RunSpec.autocast_dtype`` for row ``name``: the peer's dtype on its row, None on a policy's."""
        return self.dtype if name == self.row else None

    def as_json(self) -> dict[str, Any]:
        """results.json's ``peer``: ``row``, ``dtype``, ``grad_scaler`` (fp16), ``skipped_reason``, ``note``."""
        return {"row": self.row, "dtype": self.dtype, "grad_scaler": self.dtype == "float16",
                "skipped_reason": self.skipped_reason, "note": self.note}


def plan_peer(device: torch.device, capability: Capability, *, strategy: str | None) -> PeerPlan:
    """The peer's dtype on ``device`` (the 16-bit candidate of :func:`mixprec.policy.resolve.auto_candidates` for
    ``capability``), SKIPPED with the reason where there is none, no row under a ``strategy``. No host sync."""
    if strategy is not None:
        return PeerPlan(row=None, dtype=None, skipped_reason=None,
                        note=f"no {PEER} row under --strategy {strategy}: the peer is a one-process loop")
    sixteen = [c for c in auto_candidates(capability) if c != "fp32"]
    if not sixteen:
        detail = capability.detail or "its probe found no native bf16 or fp16"
        return PeerPlan(row=PEER, dtype=None, skipped_reason=f"no 16-bit torch.autocast runs natively on {device} "
                        f"({detail}): the peer would run fp32, which is the reference's row")
    return PeerPlan(row=PEER, dtype=str(PRESETS[sixteen[0]].compute_dtype).removeprefix("torch."), skipped_reason=None)


def peer_targets(name: str, targets: Targets) -> tuple[Targets, str]:
    """The targets row ``name`` is judged against, and words for its reason: the peer gets the quality gate alone
    (``max_loss_delta``; speed and memory targets are for mixprec's policies), every other row ``targets``."""
    if name != PEER:
        return targets, ""
    return Targets(max_loss_delta=targets.max_loss_delta), "; the peer (plain torch.autocast): quality gate only"


def with_peer_ratios(entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` (row -> :class:`~mixprec.programs.bench.results.PolicyRun`) with :data:`PEER_KEYS` on every row
    against the peer's: ``speedup_vs_peer`` (the peer's median step time / the row's), ``saved_activation_ratio_vs_peer``
    and ``peak_live_ratio_vs_peer`` (the row's bytes / the peer's); None where either was not measured, and on
    every row when there is no peer row."""
    peer = entries.get(PEER)
    if peer is None:
        return entries

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    return {name: replace(e, speedup_vs_peer=ratio(peer.step_time_ms_median, e.step_time_ms_median),
                          saved_activation_ratio_vs_peer=ratio(e.saved_activation_bytes, peer.saved_activation_bytes),
                          peak_live_ratio_vs_peer=ratio(e.peak_live_bytes, peer.peak_live_bytes))
            for name, e in entries.items()}


def label(name: str) -> str:
    """A row's name as tables print it: the peer marked as such (``torch-autocast (peer)``)."""
    return f"{name} (peer)" if name == PEER else name
