"""How the bench says one training step's memory: report.md's section and the console's budget lines, read from
results.json's rows (``saved_activation_bytes``, ``peak_live_bytes``, ``step_memory``, ``memory_budget``:
:mod:`mixprec.programs.bench.step_memory`)."""

from __future__ import annotations

from mixprec.programs.bench.figures import fmt
from mixprec.programs.bench.peer import label

__all__ = ["memory_lines", "budget_lines", "peak_source_lines"]

_WHAT = ("Measured on one extra training step per policy after its final eval (never timed: the hooks and the "
         "profiler cost time), on the workload's first training batch. *saved*: bytes the forward saved for "
         "backward (`saved_tensors_hooks`, each storage once, the model's parameters left out; a bf16 weight copy "
         "autocast keeps counts). *peak live*: the most tensor bytes alive at once during the step, the training "
         "state at its start included (CPU: the profiler's allocation events, requested bytes, baseline from a "
         "census of parameters, buffers, gradients and optimizer state; CUDA: `max_memory_allocated`, 512-byte "
         "blocks; MPS: `current_allocated_memory` sampled, a lower bound). Neither includes the interpreter, "
         "libraries or allocator caches that peak RSS holds. Ratios are to fp32's.")


def _mib(value: int | float | None) -> str:
    """Bytes in MiB, or in KiB below 1 MiB (a tiny model's figures)."""
    if value is not None and abs(value) < 2**20:
        return fmt(value / 2**10, ",.1f", " KiB")
    return fmt(None if value is None else value / 2**20, ",.2f", " MiB")


def _row_line(name: str, e: dict) -> str:
    """One policy's step memory in words, or why it was not measured."""
    memory = e.get("step_memory") or {}
    if "error" in memory:
        return f"- {name}: not measured ({memory['error']})"
    saved, live = memory["saved"], memory["live"]
    dtypes = ", ".join(f"{k.removeprefix('torch.')} {_mib(v)}" for k, v in saved["by_dtype"].items())
    return (f"- {name}: saved {_mib(saved['bytes'])} ({fmt(e.get('saved_activation_ratio_vs_fp32'), '.2f', 'x')}; "
            f"{dtypes or 'nothing'}); peak live {_mib(live['total'])} "
            f"({fmt(e.get('peak_live_ratio_vs_fp32'), '.2f', 'x')}) = state at the start {_mib(live['baseline'])} "
            f"+ the step's {_mib(live['bytes'])}; batch of {memory['batch_rows']} rows; source: {live['source']}")


def budget_lines(results: dict) -> list[str]:
    """Per policy, the largest batch whose predicted peak live bytes fit ``--memory-budget``, with its fit (the
    console prints these; report.md too). Empty without the flag."""
    budget = (results.get("settings") or {}).get("memory_budget")
    if not budget:
        return []
    lines = [f"largest batch in {budget} (peak live tensor bytes = fixed + per-sample x batch, least squares over "
             "the measured batch sizes; rows of the workload's batch):"]
    for name, e in results["policies"].items():
        fit = e.get("memory_budget")
        if not fit:
            continue
        if "error" in fit:
            lines.append(f"  {label(name)}: not measured ({fit['error']})")
            continue
        largest = "unbounded (the peak does not grow with the batch)" if fit["largest_batch"] is None \
            else f"{fit['largest_batch']:,} (predicted {_mib(fit['predicted_bytes'])})"
        worst = max(abs(r) for r in fit["residuals"])
        points = ", ".join(f"{b}: {_mib(p)}" for b, p in fit["points"])
        lines.append(f"  {label(name)}: {largest}; fixed {_mib(fit['fixed_bytes'])} + {_mib(fit['per_sample_bytes'])} "
                     f"per row; measured {points}; largest residual {worst:,.0f} B")
    return lines


def peak_source_lines(results: dict) -> list[str]:
    """report.md's line on where the peak-memory column was read (each row's ``memory_source``), with a warning
    when a row could read only a peak floored at its launcher's (``ru_maxrss``: its ratio to fp32's is then no
    evidence), between blank lines; a blank line alone when no row says."""
    by_source: dict[str, list[str]] = {}
    for name, e in results["policies"].items():
        if e.get("memory_source"):
            by_source.setdefault(e["memory_source"], []).append(label(name))
    if not by_source:
        return [""]
    text = "; ".join(f"{source} ({', '.join(names)})" for source, names in by_source.items())
    floored = any("floored" in source for source in by_source)
    return ["", ("**Peak memory is floored** (no per-process peak on this system; a ratio near 1.00x says nothing): "
             if floored else "Peak memory source: ") + text + ".", ""]


def memory_lines(results: dict) -> list[str]:
    """report.md's section on one training step's memory: what the figures are, each policy's, the budget."""
    rows = [_row_line(label(name), e) for name, e in results["policies"].items() if e.get("step_memory")]
    if not rows:
        return []
    budget = budget_lines(results)
    return ["## Memory of one training step", "", _WHAT, "", *rows, "",
            *([budget[0][0].upper() + budget[0][1:], "", *(f"- {line.strip()}" for line in budget[1:]), ""]
              if budget else [])]
