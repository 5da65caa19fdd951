"""The bench's one attention plan: measured once, before the timed policies run, and pinned for every worker.

Under ``kernels=measured`` (:mod:`mixprec.autocast.op_plan`) attention runs in the kernel measured fastest at its
shape. When every worker measured its own plan, a busy machine (whose measurements are used in one process
only) made the workers choose differently: in one bench bf16-sr ran ``matmul`` and the others ``fused``, the same
shape measuring 120.4 ms in one worker and 15.2 ms in another, so the speed column compared different kernels.

Now the runner measures the plan once, in its own process, before any worker starts (no policy's run competes
for the cores): it builds the workload under the first runnable policy that plans (a bf16 one where one runs:
every candidate is offered in bf16), runs one training step and the evaluation (the keys every worker meets),
each key measured afresh (:func:`mixprec.autocast.op_plan.measured_afresh`: interleaved rounds, each candidate's
best time; where noise could have decided the measurement and the cache file holds the key, the cached choice:
:mod:`mixprec.autocast.plan_verdict`). Every worker (quality run, seed runs, interleaved timing) pins those choices before it builds its
engine (:func:`pin_in_worker`: :func:`mixprec.autocast.op_plan.pin`, source :data:`SOURCE`). A policy computing in
another dtype gets the same choices at its own keys (:func:`mixprec.autocast.op_plan.retarget`); where a choice is
not offered there (``matmul`` under fp16) it runs ``fused`` and the plan says so. Under a strategy rank 0 measures
and every rank pins its plan. The console, report.md and results.json (``op_plan``) show the one plan.

The plan is chosen under the op plan's memory rule (:mod:`mixprec.autocast.saved_allowance`): each entry keeps every
candidate's bytes saved for backward per call (``saved_bytes``) and the rule's words (``memory``: "matmul skipped:
1.31x faster than fused, +144 MiB saved per call over fused ..."), and the plan the allowance it was measured under
(``extra_saved_allowed_mib``: 0 unless ``$MIXPREC_ATTENTION_EXTRA_SAVED_MIB`` allows more; null: no limit), so no
pinned choice saves more for backward than ``fused`` unless the user allowed it (:func:`entry_words`,
:func:`rule_words`: what the console and report.md print).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from typing import Any

import torch

from mixprec.autocast import op_plan
from mixprec.autocast.saved_allowance import ENV, mib_words
from mixprec.distributed.process import from_main_process, is_main_process
from mixprec.machine.capability import Capability, normalize_device
from mixprec.policy.policy import PRESETS, Policy
from mixprec.policy.resolve import auto_candidates, resolve
from mixprec.programs.session import build_engine, evaluate, train_step
from mixprec.workloads import get_workload

__all__ = ["SOURCE", "measure_bench_plan", "pinned_for", "pin_in_worker", "entry_words", "rule_words"]

SOURCE = "bench"   # the source of a worker's pinned plan entries (PlanEntry.source)


def _planners(names: list[str], skip: dict[str, str | None], device: torch.device,
              capability: Capability) -> dict[str, tuple[str, Policy]]:
    """Runnable policy name -> (the policy text an engine is built with, the policy) for the names whose engine
    plans attention (autocast on, ``kernels=measured``); ``auto`` as its 16-bit candidate."""
    planners = {}
    for name in names:
        if skip.get(name) is not None:
            continue
        if name.strip().lower() == "auto":
            sixteen = [c for c in auto_candidates(capability) if c != "fp32"]
            spec, policy = (sixteen[0], PRESETS[sixteen[0]]) if sixteen else (name, PRESETS["fp32"])
        else:
            spec, policy = name, resolve(name, device, capability=capability).policy
        if policy.is_mixed and policy.kernels == "measured":
            planners[name] = (spec, policy)
    return planners


def _measure(config: Any, device: torch.device, spec: str) -> list[op_plan.PlanEntry]:
    """Every key one training step and one evaluation of ``config``'s workload under ``spec`` meet, measured afresh
    in this process (the entries, first-use order)."""
    workload = get_workload(config.workload, config=config.config_name, data=config.data, lora=config.lora)
    with op_plan.measured_afresh():
        mp = build_engine(workload, spec, steps=config.steps, seed=config.seed, device=str(device))
        train_step(mp, workload, next(workload.batches("train", config.seed)))
        evaluate(mp, workload)
        found = op_plan.entries(device.type, policy=mp.policy)
    del mp
    gc.collect()
    return found


def _dtype(policy: Policy) -> str:
    return str(policy.compute_dtype)[6:]


def measure_bench_plan(config: Any, device: torch.device, capability: Capability, names: list[str],
                       skip: dict[str, str | None], progress: bool) -> dict[str, Any] | None:
    """The bench's one attention plan (module docstring), measured in this process (rank 0's under a strategy:
    a collective then) before any worker starts. ``config``: the bench's :class:`BenchConfig`. Returns
    results.json's ``op_plan`` (None when no runnable policy plans): ``measured_with`` (the policy it was measured
    under), ``dtype``, ``pid``, ``extra_saved_allowed_mib`` (the memory rule's allowance, MiB per call over
    ``fused``; None: no limit), ``entries`` (:class:`mixprec.autocast.op_plan.PlanEntry` as dicts: key, choice,
    source, each candidate's time in ms and bytes saved for backward per call, the memory rule's words), ``policies`` (name -> ``dtype``, ``pinned`` key -> choice,
    ``not_offered`` key -> why), and ``error`` where the measurement failed (the workers then plan for
    themselves, and report.md says so). Host syncs: the measurement's."""
    planners = _planners(names, skip, device, capability)
    if not planners:
        return None
    plan = _plan(config, device, planners, progress) if is_main_process() else None
    return from_main_process(plan) if config.strategy is not None else plan


def _plan(config: Any, device: torch.device, planners: dict[str, tuple[str, Policy]],
          progress: bool) -> dict[str, Any]:
    """:func:`measure_bench_plan` on this process."""
    name = next((n for n, (_, p) in planners.items() if p.compute_dtype == torch.bfloat16), next(iter(planners)))
    spec, policy = planners[name]
    if progress:
        print(f"measuring the attention plan once, under {spec}, before the timed runs (pinned for every policy)",
              file=sys.stderr)
    plan: dict[str, Any] = {"measured_with": spec, "dtype": _dtype(policy), "pid": os.getpid(),
                            "extra_saved_allowed_mib": op_plan.extra_saved_allowed()}
    try:
        found = _measure(config, device, spec)
    except (ValueError, TypeError, RuntimeError) as err:   # the workers report the policy's own failure
        return {**plan, "entries": [], "policies": {},
                "error": f"{type(err).__name__}: {err} (each worker plans for itself)"}
    choices = {e.shape: e.chosen for e in found}
    policies = {}
    for row, (_, p) in planners.items():
        pinned, refused = (choices, {}) if p.compute_dtype == policy.compute_dtype else \
            op_plan.retarget(choices, p.compute_dtype)
        policies[row] = {"dtype": _dtype(p), "pinned": pinned, "not_offered": refused}
    return {**plan, "entries": [dataclasses.asdict(e) for e in found], "policies": policies}


def pinned_for(plan: dict[str, Any] | None, name: str) -> dict[str, str]:
    """The choices policy ``name``'s workers pin (key -> candidate; empty: none, they plan for themselves)."""
    return dict(((plan or {}).get("policies") or {}).get(name, {}).get("pinned") or {})


def pin_in_worker(choices: dict[str, str], device: str | None) -> None:
    """In a worker, before its engine is built: use the bench's ``choices`` (key -> candidate) on ``device``'s type
    (:func:`mixprec.autocast.op_plan.pin`, source :data:`SOURCE`). No host sync."""
    if choices:
        op_plan.pin(choices, normalize_device(device).type, source=SOURCE)


def entry_words(entry: dict[str, Any]) -> str:
    """A plan entry (results.json's form) in words: its source, each timed candidate's best time and the bytes it
    saves for backward per call (where any is saved), and the memory rule's words (an older results.json without
    them: the times alone)."""
    saved = entry.get("saved_bytes") or {}
    shown = saved if any(saved.values()) else {}
    times = ", ".join(f"{c} {t:.2f} ms" + (f" {mib_words(shown[c])}" if shown.get(c) is not None else "")
                      for c, t in (entry.get("times_ms") or {}).items() if t is not None)
    return "; ".join(filter(None, [entry["source"], times, entry.get("memory") or ""]))


def rule_words(plan: dict[str, Any]) -> str:
    """The memory rule the bench's plan was chosen under (results.json ``op_plan``), "" for an older one."""
    if "extra_saved_allowed_mib" not in plan:
        return ""
    allowed = plan["extra_saved_allowed_mib"]
    if allowed is None:
        return f"chosen on speed alone, whatever a kernel saves for backward (${ENV}=inf)"
    return f"chosen among kernels saving for backward at most fused's bytes +{allowed:g} MiB per call (${ENV})"
