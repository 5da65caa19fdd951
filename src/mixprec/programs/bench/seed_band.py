"""The seed-noise band: the fp32 reference trained at more seeds, its final eval losses' relative spread.

A verdict is read against this band (a loss delta inside it is indistinguishable from another seed). Training fp32
again costs one more reference run, so the extra seeds' results are kept per workload and machine
(:func:`~mixprec.machine.cache.machine_key`: hardware, torch build, threads) in the cache directory, keyed by
everything that decides them (workload, config, data, LoRA, steps, warm-up, eval points, seeds), and a later
bench reuses them. A kept entry is used only when this run's own fp32 reference ended at
exactly the loss the entry was measured beside (same machine, same code: the fp32 run is bit for bit the same);
otherwise the extra seeds are trained again and the entry replaced. ``--fresh-seed-band`` trains them regardless.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mixprec.machine.cache import cache_dir, machine_key, read_json, write_json
from mixprec.machine.capability import normalize_device
from mixprec.programs.bench.launch import run_worker
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.spec import RunSpec

__all__ = ["band", "band_key", "kept_runs", "keep_runs", "seed_noise"]


def band_key(reference: RunSpec, seeds: list[int]) -> str:
    """The cache key of the extra seeds' runs of ``reference`` (the fp32 row's spec)."""
    fields = {k: v for k, v in asdict(reference).items() if k not in ("peaks_gflops", "op_plan", "memory_budget")}
    return json.dumps({**fields, "extra_seeds": seeds}, sort_keys=True)


def _path(device: torch.device):
    return cache_dir() / f"seed-band-{machine_key(device)}.json"


def kept_runs(device: torch.device, key: str) -> dict[str, Any] | None:
    """The kept entry for ``key``: ``{"reference_loss", "seeds", "fp32_eval_losses", "fp32_eval_curves",
    "created"}``, or None."""
    entry = read_json(_path(device)).get(key)
    return entry if isinstance(entry, dict) and {"reference_loss", "seeds", "fp32_eval_losses"} <= set(entry) else None


def keep_runs(device: torch.device, key: str, reference: PolicyRun, runs: dict[int, PolicyRun]) -> None:
    """Keep the extra seeds' runs (all finished) beside the reference loss they were measured with."""
    path = _path(device)
    entries = read_json(path)
    entries[key] = {"reference_loss": reference.final_eval_loss, "seeds": list(runs),
                    "fp32_eval_losses": [r.final_eval_loss for r in runs.values()],
                    "fp32_eval_curves": [r.eval_curve for r in runs.values()],
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(path, entries)


def band(seed: int, reference: PolicyRun, seeds: list[int], losses: list[float | None],
         curves: list[Any], source: str) -> dict[str, Any]:
    """results.json's ``seed_noise``: ``seeds`` (the run's own first), ``fp32_eval_losses``, ``relative_spread``
    ((max - min) / min; None with ``error`` when a run did not finish), ``fp32_eval_curves`` (same order) and
    ``source`` (``"measured in this run"`` or ``"kept from the run of <date> on this machine"``)."""
    all_losses, all_curves = [reference.final_eval_loss, *losses], [reference.eval_curve, *curves]
    out = {"seeds": [seed, *seeds], "fp32_eval_losses": all_losses, "fp32_eval_curves": all_curves, "source": source}
    if any(loss is None for loss in all_losses):
        return {**out, "relative_spread": None, "error": "the fp32 run at another seed did not finish"}
    return {**out, "relative_spread": (max(all_losses) - min(all_losses)) / min(all_losses)}


def seed_noise(spec: RunSpec | None, reference: PolicyRun, seeds: list[int], workdir: Path, bar: tqdm, *,
               fresh: bool = False, trained: dict[int, PolicyRun] | None = None) -> dict[str, Any] | None:
    """results.json's ``seed_noise`` (:func:`band`) for the fp32 row ``spec`` that ended as ``reference``, or None (no
    extra seed, or a reference that did not finish). The extra seeds' runs come from ``trained`` (the one pass
    trained them beside the rows), else from the cache when they were kept beside this very reference loss (not
    when ``fresh``), else they are trained now, one after the other (one-shot workers in ``workdir``, counted on
    ``bar``); runs that all finished are kept for the next bench."""
    if not seeds or spec is None or reference.final_eval_loss is None:
        return None
    key, device = band_key(spec, seeds), normalize_device(spec.device)
    kept = None if fresh or trained else kept_runs(device, key)
    if kept is not None and kept["reference_loss"] == reference.final_eval_loss and kept["seeds"] == seeds:
        return band(spec.seed, reference, seeds, kept["fp32_eval_losses"], kept.get("fp32_eval_curves") or [],
                    f"kept from the run of {kept.get('created', '?')} on this machine (its fp32 reference ended at "
                    "this run's loss, bit for bit)")
    runs = dict(trained or {})
    for seed in (s for s in seeds if s not in runs):
        bar.total += spec.steps
        bar.set_description(f"fp32 at seed {seed} (seed-noise band)")
        runs[seed] = run_worker(replace(spec, seed=seed, memory_budget=None), workdir, f"seed{seed}-fp32", bar)
    if all(run.final_eval_loss is not None for run in runs.values()):
        keep_runs(device, key, reference, runs)
    return band(spec.seed, reference, seeds, [runs[s].final_eval_loss for s in seeds],
                [runs[s].eval_curve for s in seeds], "measured in this run")
