"""The bench's memory of one training step, measured on extra steps after the timed ones and the final eval.

* :func:`measure_step_memory`: one whole step (inputs cast, forward under the policy's autocast, ``mp.backward``,
  ``mp.step()``; ``mp`` an engine or the plain-autocast peer, :class:`mixprec.programs.session.StepCalls`: the same
  calls, the same measurement) on a training batch, with the bytes its forward saved for backward (:mod:`mixprec.memory.saved`,
  the model's parameters left out) and its peak live tensor bytes (:mod:`mixprec.memory.live`). The hooks and the
  profiler cost time: these steps are never timed, and they run after everything else the row reports was read
  (they change the weights; nothing is measured after them).
* :func:`measure_batch_budget`: the same peak at two or three batch sizes (the training batch halved, as is, and
  doubled: rows from the next batches of the same stream), fitted by :mod:`mixprec.memory.batch_budget`. The training
  batch's own point is the step measured above when given (same engine, same shapes: it is not stepped again);
  each new size is measured after one unmeasured step at that size (first calls at a new shape plan kernels,
  e.g. the attention plan's key, and allocate caches: that must not land in the measured peak; a forward alone
  left a few bytes of the first backward's in the measured step, 1-3 B off the line). Measuring every size
  after a warm step cost 7 training batches' worth of rows per policy; reusing the batch's point, 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.memory.batch_budget import BatchBudget, largest_batch, parse_bytes
from mixprec.memory.live import PeakLive, peak_live_bytes, resident_tensors
from mixprec.memory.saved import SavedBytes, SavedTensorCounter
from mixprec.programs.session import StepCalls
from mixprec.workloads import Workload

__all__ = ["StepMemory", "measure_step_memory", "measure_batch_budget", "batch_of_size", "budget_batch_sizes",
           "row_memory", "memory_ratios"]


@dataclass(frozen=True)
class StepMemory:
    """One step's memory: ``saved`` (bytes saved for backward by its forward, parameters excluded) and ``live``
    (its peak live tensor bytes above and including the baseline)."""

    saved: SavedBytes
    live: PeakLive


def _step(mp: StepCalls, workload: Workload, batch: dict) -> SavedBytes:
    """One training step like :func:`mixprec.programs.session.train_step`, counting what the forward saves."""
    batch = mp.cast_inputs(batch, keep=workload.keep_fp32_inputs)
    with mp.autocast(), SavedTensorCounter(exclude=list(mp.model.parameters())) as counter:
        loss = workload.loss(mp.model, batch)
    mp.backward(loss)
    mp.step()
    return counter.result()


def measure_step_memory(mp: StepCalls, workload: Workload, batch: dict) -> StepMemory:
    """One untimed training step on ``batch`` with its saved and peak live bytes (see the module docstring).
    Host syncs: the engine's, plus the live measurement's on CUDA and MPS."""
    saved, live = peak_live_bytes(lambda: _step(mp, workload, batch), mp.device,
                                  resident=resident_tensors(mp.model, mp.optimizer), model=mp.model)
    return StepMemory(saved=saved, live=live)


def batch_of_size(batches: Any, size: int) -> dict:
    """A batch of ``size`` rows: rows of the next batches of ``batches`` (an iterator of dicts of tensors whose
    first dimension is the batch), concatenated and cut to ``size``.

    Raises:
        ValueError: a batch entry is not a tensor with a batch dimension (the batch cannot be resized).
    """
    parts: list[dict] = []
    rows = 0
    for batch in batches:
        bad = [k for k, v in batch.items() if not (isinstance(v, torch.Tensor) and v.dim() >= 1)]
        if bad:
            raise ValueError(f"batch entries {bad} are not tensors with a batch dimension: the batch size "
                             "cannot be changed for --memory-budget")
        parts.append(batch)
        rows += len(next(iter(batch.values())))
        if rows >= size:
            break
    return {k: torch.cat([p[k] for p in parts])[:size] for k in parts[0]}


def budget_batch_sizes(batch: int) -> tuple[int, ...]:
    """The batch sizes the fit measures: half the training batch (when that is a new size >= 1), the batch
    itself and twice it."""
    return tuple(sorted({max(1, batch // 2), batch, 2 * batch}))


def measure_batch_budget(mp: StepCalls, workload: Workload, budget: str | int, seed: int,
                         measured: tuple[int, int] | None = None) -> BatchBudget:
    """The largest batch whose predicted peak live bytes fit ``budget`` (bytes or ``"4GiB"``) for this engine
    and workload: peaks at :func:`budget_batch_sizes` fitted to a line (:func:`mixprec.memory.batch_budget.largest_batch`);
    ``measured`` = ``(training batch rows, its peak live bytes)`` already measured on this engine (that size is not
    stepped again); each other size gets one unmeasured step, then one measured step, on batches of the training
    stream of ``seed``. Batch sizes are in rows of the workload's batch (samples or sequences, not tokens). Host
    syncs: the steps'.

    Raises:
        ValueError: ``budget`` is not a size, or the workload's batch cannot be resized.
    """
    budget_bytes = parse_bytes(budget, name="memory_budget")
    stream = workload.batches("train", seed)
    rows = len(next(iter(next(workload.batches("train", seed)).values())))   # the training batch's rows
    points = [measured] if measured is not None and measured[0] == rows else []
    for size in budget_batch_sizes(rows):
        if points and size == points[0][0]:
            continue
        _step(mp, workload, batch_of_size(stream, size))
        points.append((size, measure_step_memory(mp, workload, batch_of_size(stream, size)).live.total))
    return largest_batch(sorted(points), budget_bytes)


def row_memory(mp: StepCalls, workload: Workload, batch: dict, *, seed: int,
               budget: str | None = None) -> dict[str, Any]:
    """A bench row's memory fields (results.json keys ``saved_activation_bytes``, ``peak_live_bytes``,
    ``step_memory``, and ``memory_budget`` when ``budget`` is given), measured on extra untimed steps on ``batch``
    (the workload's training batch). A measurement that fails is recorded as ``{"error": ...}`` in its key (shown
    in the report), never as a number; the training row stands."""
    fields: dict[str, Any] = {}
    measured = None
    try:
        memory = measure_step_memory(mp, workload, batch)
        fields.update(saved_activation_bytes=memory.saved.total, peak_live_bytes=memory.live.total,
                      step_memory={"saved": memory.saved.as_dict(), "live": memory.live.as_dict(),
                                   "batch_rows": len(next(iter(batch.values())))})
        measured = (len(next(iter(batch.values()))), memory.live.total)
    except Exception as err:   # e.g. a compiled graph the hooks cannot see into: said, not guessed
        fields["step_memory"] = {"error": f"{type(err).__name__}: {err}"}
    if budget is not None:
        try:
            fields["memory_budget"] = measure_batch_budget(mp, workload, budget, seed, measured).as_dict()
        except Exception as err:
            fields["memory_budget"] = {"error": f"{type(err).__name__}: {err}", "budget": budget}
    return fields


def memory_ratios(row: Any, reference: Any) -> dict[str, float | None]:
    """``saved_activation_ratio_vs_fp32`` and ``peak_live_ratio_vs_fp32`` of ``row`` against ``reference`` (two
    :class:`~mixprec.programs.bench.results.PolicyRun`\\ s); None where either was not measured."""
    def ratio(key: str) -> float | None:
        mine, ref = getattr(row, key), getattr(reference, key)
        return mine / ref if mine is not None and ref else None
    return {"saved_activation_ratio_vs_fp32": ratio("saved_activation_bytes"),
            "peak_live_ratio_vs_fp32": ratio("peak_live_bytes")}
