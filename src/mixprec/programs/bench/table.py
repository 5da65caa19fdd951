"""The bench's results table: its columns and cells (report.md's table) and the compact console table.

One cell per (row, column key), read from results.json's rows; report.md shows every column, the console a subset
(:data:`_CONSOLE`), each byte figure with its ratio to fp32 in one cell. With a peer row
(:mod:`mixprec.programs.bench.peer`) every row also shows its speed and saved bytes against it (``speedup vs
torch-autocast``, ``saved vs torch-autocast``), the peer's name marked ``(peer)``.
"""

from __future__ import annotations

from mixprec.programs.bench.figures import fmt
from mixprec.programs.bench.peer import PEER, label
from mixprec.programs.bench.per_rank import rank0_tag

__all__ = ["has_compiled", "memory_budget_of", "has_peer", "columns", "cells", "format_table"]

# (column key, console header; a key pair: "value (ratio)" in one cell) for the console table
_CONSOLE = (("policy", "policy"), ("verdict", "verdict"), ("step", "step ms"), ("speedup", "speedup"),
            ("speedup_peer", f"vs {PEER}"), ("peak", "RSS MiB"), ("state", "B/param"),
            (("saved", "saved_ratio"), "saved MiB"), ("saved_peer", f"saved vs {PEER}"),
            (("live", "live_ratio"), "live MiB"), ("loss", "eval loss"), ("delta", "delta"), ("skips", "skips"),
            ("budget", "batch in"), ("compile", "compile s"))


def has_compiled(results: dict) -> bool:
    """Whether the run had ``--compile`` (the ``<policy>+compiled`` rows)."""
    return bool(results.get("settings", {}).get("compile"))


def memory_budget_of(results: dict) -> str | None:
    """The run's ``--memory-budget`` (None: not measured)."""
    return (results.get("settings") or {}).get("memory_budget")


def has_peer(results: dict) -> bool:
    """Whether the run has the peer's row (SKIPPED or not): then the vs-peer columns are shown."""
    return PEER in results["policies"]


def _largest_batch(e: dict) -> str:
    """The row's largest batch in ``--memory-budget`` (``unbounded``: the fit's peak does not grow with the batch)."""
    fit = e.get("memory_budget") or {}
    if "largest_batch" not in fit:
        return "-"
    return "unbounded" if fit["largest_batch"] is None else f"{fit['largest_batch']:,}"


def columns(results: dict) -> list[tuple[str, str]]:
    """report.md's columns, (key, header): the vs-peer ones with a peer row, the budget one under
    ``--memory-budget``, the compile one under ``--compile``."""
    unit = next((e["item_unit"] for e in results["policies"].values() if e.get("item_unit")), "items")
    peak = results.get("mfu_peak")
    r0 = rank0_tag(results, " (rank 0)")   # every rank's: per_rank_markdown
    peer = [("speedup_peer", f"speedup vs {PEER}")] if has_peer(results) else []
    saved_peer = [("saved_peer", f"saved vs {PEER}")] if has_peer(results) else []
    budget = [("budget", f"batch in {memory_budget_of(results)}")] if memory_budget_of(results) else []
    return [("policy", "policy"), ("verdict", "verdict"), ("step", "step ms"), ("speedup", _speed("speedup", results)),
            *[(key, _speed(header, results)) for key, header in peer],
            ("items", f"{unit}/s"), ("gflops", "GFLOP/s"), ("mfu", f"MFU vs {peak['dtype']} peak" if peak else "MFU"),
            ("peak", "peak RSS MiB"), ("memory", "RSS ratio"), ("state", f"bytes/param{r0}"), ("saved", "saved MiB"),
            ("saved_ratio", "saved ratio"), *saved_peer, ("live", f"peak live MiB{r0}"), ("live_ratio", "live ratio"),
            ("loss", "eval loss"), ("delta", "loss delta"), ("skips", "skipped steps"), *budget,
            *([("compile", "compile s")] if has_compiled(results) else [])]


def _speed(header: str, results: dict) -> str:
    """A speed column's header, marked where the timing was noisy (no speed verdict: the ratios are unreliable)."""
    return f"{header} (NOISY)" if (results.get("timing") or {}).get("noisy") else header


def cells(name: str, e: dict) -> dict[str, str]:
    """Row ``name``'s cell for every column key (:func:`columns` picks which are shown)."""
    mib = {k: None if e.get(k) is None else e[k] / 2**20 for k in ("saved_activation_bytes", "peak_live_bytes")}
    return {
        "policy": label(name), "verdict": e["verdict"], "step": fmt(e.get("step_time_ms_median"), ".1f"),
        "speedup": fmt(e.get("speedup_vs_fp32"), ".2f", "x"), "speedup_peer": fmt(e.get("speedup_vs_peer"), ".2f", "x"),
        "items": fmt(e.get("items_per_s"), ",.0f"), "gflops": fmt(e.get("gflops_per_s"), ".1f"),
        "mfu": fmt(e.get("mfu"), ".1%"), "peak": fmt(e.get("peak_memory_mb"), ",.0f"),
        "memory": fmt(e.get("memory_ratio_vs_fp32"), ".2f", "x"), "state": fmt(e.get("state_bytes_per_param"), ".2f"),
        "saved": fmt(mib["saved_activation_bytes"], ",.2f"),
        "saved_ratio": fmt(e.get("saved_activation_ratio_vs_fp32"), ".2f", "x"),
        "saved_peer": fmt(e.get("saved_activation_ratio_vs_peer"), ".2f", "x"),
        "live": fmt(mib["peak_live_bytes"], ",.2f"), "live_ratio": fmt(e.get("peak_live_ratio_vs_fp32"), ".2f", "x"),
        "loss": fmt(e.get("final_eval_loss"), ".4f"), "delta": fmt(e.get("eval_loss_delta_vs_fp32"), "+.2%"),
        "skips": fmt(e.get("skipped_steps"), "d"), "budget": _largest_batch(e),
        "compile": fmt(e.get("compile_time_s"), ".1f")}


def format_table(results: dict) -> str:
    """The compact plain-text table printed at the end of a bench run."""
    shown = {key for key, _ in columns(results)}
    r0 = rank0_tag(results, " r0")   # every rank's: per_rank_lines
    picked = [(key, (_speed(header, results) if key in ("speedup", "speedup_peer") else header)
               + (r0 if key in ("state", ("live", "live_ratio")) else "")
               + (f" {memory_budget_of(results)}" if key == "budget" else ""))
              for key, header in _CONSOLE if (key[0] if isinstance(key, tuple) else key) in shown]
    headers = [header for _, header in picked]
    rows = []
    for name, e in results["policies"].items():
        c = cells(name, e)
        rows.append([c[key] if isinstance(key, str) else c[key[0]] if c[key[0]] == "-" else f"{c[key[0]]} ({c[key[1]]})"
                     for key, _ in picked])
    states = [e.get("state_bytes") or {} for e in results["policies"].values()]
    if any(sb.get("n_frozen") for sb in states):   # LoRA / frozen layers: the two parts' bytes/param
        at = next(i for i, (key, _) in enumerate(picked) if key == "state") + 1
        headers.insert(at, "train/frozen B/param")
        for row, sb in zip(rows, states):
            row.insert(at, f"{fmt(sb.get('per_trainable_param'), '.2f')} / {fmt(sb.get('per_frozen_param'), '.2f')}")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
