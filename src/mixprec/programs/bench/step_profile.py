"""Where a training step goes, per category: a short profiled window in each row's resident timing worker.

After the interleaved timing (never inside the timed steps: the profiler costs time), each row's timing worker
(:mod:`mixprec.programs.bench.interleaved`; a policy's engine or the peer's loop) runs :func:`profile_steps`: one
warm-up step inside the profiler (its first events carry the profiler's own start-up) and :data:`PROFILED_STEPS`
profiled steps, each inside a ``record_function`` range (:data:`STEP_RANGE`), under ``torch.profiler.profile``
(CPU activity; CUDA too on a CUDA device). Every profiler event inside a step's range gets one category:

* ``optimizer``: everything under an ``Optimizer.*`` range (``torch.optim``'s ``Optimizer.step#AdamW.step`` and
  ``Optimizer.zero_grad#...``, which every ``torch.optim.Optimizer`` subclass records, mixprec's included): its
  ops, its casts and its Python time;
* ``casts``: ops named :data:`CAST_OPS` (``_to_copy``, ``to``, ``_foreach_copy_``, and ``copy_`` where it is no
  other op's inner copy: alone or inside a cast), wherever they run outside the optimizer (autocast's weight casts,
  inside ``linear``; an engine's input and master casts);
* ``matmul``: ops named :data:`MATMUL_OPS` (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``, ``matmul``,
  ``_scaled_mm`` ...), an attention kernel's GEMMs included when they are ops of their own (the ``matmul``
  candidate's);
* ``attention``: ops and autograd nodes whose name holds ``scaled_dot_product``, ``flash``, ``attention``, ``sdpa``
  or ``blockwise`` (torch's fused kernels and their backward, mixprec's blockwise backward node);
* an op named none of these belongs to its nearest enclosing op or autograd node that has a category (the views and
  allocations inside a ``linear`` are matmul's, those inside a cast are the cast's); else ``elementwise``;
* ``python/other``: the rest of the step's wall time: the self time of the step range itself and of everything
  that is not an op (autograd's node and engine wrappers, the engine's Python between ops). On CPU it is summed
  from those self times, so the categories add up to the profiled step time as the profiler accounts it (each
  event's self time is its duration minus its children's: a tree's self times sum to its root's duration).

Time per event: its self CPU time on CPU (each op's wall time minus its children's: the kernels run inside the op
on CPU); on CUDA its self device time (the kernels it launched), ``python/other`` then being the step's wall time
minus the ops' device time (the GPU idle between kernels) — the CUDA path has not run on real hardware yet.

**Matmul roofline**: the profiler's FLOP estimate of the GEMM ops (:data:`FLOP_OPS`, ``with_flops=True``: ``2·m·n·k``
per ``mm``) over the matmul category's time gives the achieved GFLOP/s, against the bench's measured matmul peak in
the row's compute dtype (``mixprec doctor``'s, ``RunSpec.peaks_gflops``): how far the row's GEMMs are from the
roofline. All figures are per step (window totals divided by the steps). The profiled step is slower than the timed
one (the profiler records every op): read the shares, and the timed step time for speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from mixprec.programs.bench.figures import fmt
from mixprec.programs.bench.peer import label

__all__ = ["CATEGORIES", "MATMUL_OPS", "FLOP_OPS", "CAST_OPS", "STEP_RANGE", "PROFILED_STEPS", "category_of",
           "profile_steps", "step_profile_lines", "step_profile_markdown"]

CATEGORIES = ("matmul", "attention", "elementwise", "optimizer", "casts", "python/other")
MATMUL_OPS = frozenset(f"aten::{n}" for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm",
                                              "mv", "addmv", "dot", "einsum", "_int_mm"))
FLOP_OPS = frozenset(f"aten::{n}" for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"))
CAST_OPS = frozenset(f"aten::{n}" for n in ("copy_", "_to_copy", "to", "_foreach_copy_"))
_COPYING = CAST_OPS - {"aten::to"}   # ``to`` returns its input when nothing changes: a cast call only with a copy under it
_ATTENTION_WORDS = ("scaled_dot_product", "flash", "attention", "sdpa", "blockwise")
STEP_RANGE = "mixprec.bench.step"   # the record_function range around each profiled step
PROFILED_STEPS = 3


def _is_op(event: Any) -> bool:
    """A dispatched operator (``aten::mm``, a ``torch.library`` op), not a range or an autograd wrapper."""
    return "::" in event.name and not event.name.startswith(("autograd::", "torch::autograd::")) \
        and not event.is_user_annotation


def _own_category(event: Any) -> str | None:
    """The category ``event``'s own name gives (None: it inherits one, or is elementwise / python/other)."""
    if event.is_user_annotation:
        return "optimizer" if event.name.startswith("Optimizer.") else None
    if event.name in CAST_OPS:
        return "casts"
    if event.name in MATMUL_OPS:
        return "matmul"
    lowered = event.name.lower()
    return "attention" if any(word in lowered for word in _ATTENTION_WORDS) else None


def category_of(event: Any, root: Any) -> str:
    """The category of one profiler event inside the step range ``root`` (the module docstring's rules)."""
    ancestors = []
    parent = event.cpu_parent
    while parent is not None and parent is not root:
        ancestors.append(parent)
        parent = parent.cpu_parent
    if any(_own_category(a) == "optimizer" for a in [event, *ancestors]):
        return "optimizer"
    if not _is_op(event):
        return "python/other"
    own = _own_category(event)
    enclosing = next((a for a in ancestors if _is_op(a)), None)
    if event.name == "aten::copy_" and enclosing is not None and enclosing.name not in CAST_OPS:
        own = None   # the copy inside another op (addmm's bias, clone's) is that op's work, not a cast
    if own is not None:
        return own
    inherited = next((c for c in map(_own_category, ancestors) if c is not None), None)
    return inherited or "elementwise"


def _run_window(step: Callable[[], Any], device: torch.device) -> list[Any]:
    """One warm-up and :data:`PROFILED_STEPS` profiled steps; the profiler's events of the profiled ones (read when
    its one active cycle ends). A device sync per step on CUDA."""
    events: list[Any] = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_flops=True, on_trace_ready=lambda done: events.extend(done.events()),
                 schedule=schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)) as prof:
        for _ in range(1 + PROFILED_STEPS):
            with record_function(STEP_RANGE):
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            prof.step()
    return events


def _inside(events: list[Any], root: Any, cuda: bool) -> list[Any]:
    """The events in ``root``'s time range (its thread's only on CPU, where the whole step runs in one thread)."""
    start, end = root.time_range.start, root.time_range.end
    return [e for e in events if e is not root and start <= e.time_range.start and e.time_range.end <= end
            and (cuda or e.thread == root.thread)]


def _is_call(event: Any, root: Any, category: str) -> bool:
    """Whether ``event`` is one call of ``category``: an op whose nearest enclosing op is of another category (or none);
    for casts, a copying op (:data:`CAST_OPS` but ``to``) not inside another copying op (a no-op ``x.to(x.dtype)`` is
    no cast; ``to`` -> ``_to_copy`` -> ``copy_`` is one)."""
    if not _is_op(event) or (category == "casts" and event.name not in _COPYING):
        return False
    parent = event.cpu_parent
    while parent is not None and parent is not root and not _is_op(parent):
        parent = parent.cpu_parent
    if parent is None or parent is root:
        return True
    return parent.name not in _COPYING if category == "casts" else category_of(parent, root) != category


def _summarise(events: list[Any], cuda: bool) -> tuple[dict[str, float], dict[str, int], float, float, int]:
    """Window totals: category -> µs, category -> calls, matmul FLOPs, the steps' wall µs, and the step count."""
    roots = [e for e in events if e.name == STEP_RANGE]
    micros = dict.fromkeys(CATEGORIES, 0.0)
    calls = dict.fromkeys(CATEGORIES, 0)
    flops, wall = 0.0, 0.0
    for root in roots:
        wall += root.cpu_time_total
        micros["python/other"] += 0.0 if cuda else root.self_cpu_time_total
        for e in _inside(events, root, cuda):
            category = category_of(e, root)
            if cuda and not _is_op(e):
                continue
            micros[category] += e.self_device_time_total if cuda else e.self_cpu_time_total
            calls[category] += _is_call(e, root, category)
            if category == "matmul" and e.name in FLOP_OPS:
                flops += float(e.flops or 0)
    if cuda:
        micros["python/other"] = wall - sum(micros.values())
    return micros, calls, flops, wall, len(roots)


def profile_steps(step: Callable[[], Any], device: torch.device, *, peak_dtype: str,
                  peak_gflops: float | None) -> dict[str, Any]:
    """Profile :data:`PROFILED_STEPS` calls of ``step()`` (one training step each) after one warm-up inside the
    profiler, and return results.json's ``step_profile``: ``steps``, ``warmup_steps``, ``device``, ``time_source``,
    ``step_ms`` (the profiled step's wall time, ms), ``categories`` (category -> ``ms``, ``share`` of ``step_ms``,
    ``calls`` per step: :func:`_is_call`), ``matmul_gflop`` (GEMM GFLOP per step),
    ``matmul_gflops_per_s``, ``matmul_peak_dtype``/``matmul_peak_gflops_per_s`` (the measured peak in the row's compute
    dtype, ``peak_dtype``; None: not measured) and ``matmul_of_peak``. Host syncs: the steps', and one per step on CUDA."""
    cuda = device.type == "cuda"
    micros, calls, flops, wall, n = _summarise(_run_window(step, device), cuda)
    if n != PROFILED_STEPS:
        raise RuntimeError(f"the profiler recorded {n} '{STEP_RANGE}' ranges, expected {PROFILED_STEPS}")
    step_ms = wall / 1e3 / n
    matmul_s = micros["matmul"] / 1e6 / n
    achieved = flops / n / matmul_s / 1e9 if matmul_s > 0 and flops else None
    return {"steps": n, "warmup_steps": 1, "device": device.type,
            "time_source": "self device time (torch.profiler)" if cuda else "self CPU time (torch.profiler)",
            "step_ms": step_ms,
            "categories": {c: {"ms": micros[c] / 1e3 / n, "share": micros[c] / wall, "calls": calls[c] / n}
                           for c in CATEGORIES},
            "matmul_gflop": flops / n / 1e9, "matmul_gflops_per_s": achieved, "matmul_peak_dtype": peak_dtype,
            "matmul_peak_gflops_per_s": peak_gflops,
            # a peak below what the step achieved was measured on a busy machine: no share of it
            "matmul_of_peak": achieved / peak_gflops if achieved is not None and peak_gflops
            and achieved <= peak_gflops else None}


def _cells(p: dict[str, Any]) -> list[str]:
    """One row's cells: each category's ms per step (share), casts with their calls, the matmul roofline."""
    cats = p["categories"]
    cells = [f"{cats[c]['ms']:.2f} ({cats[c]['share']:.0%})" for c in CATEGORIES]
    cells[CATEGORIES.index("casts")] += f", {cats['casts']['calls']:g} calls"
    peak = f"{p['matmul_peak_dtype']} {fmt(p.get('matmul_peak_gflops_per_s'), ',.1f')}"
    share = (f"{fmt(p['matmul_of_peak'], '.1%')} of {peak}" if p.get("matmul_of_peak") is not None else
             f"above the {peak} peak (measured on a busy machine)" if p.get("matmul_peak_gflops_per_s") else "no peak")
    return [f"{p['step_ms']:.2f}", *cells, fmt(p.get("matmul_gflops_per_s"), ",.1f"), share]


def step_profile_lines(results: dict) -> list[str]:
    """The console's lines: one per row with a step profile (ms per step per category, the matmul roofline)."""
    rows = [(n, e["step_profile"]) for n, e in results["policies"].items() if e.get("step_profile")]
    if not rows:
        return []
    lines = [f"where the step goes (profiled window of {PROFILED_STEPS} steps after the timing; ms per step "
             "(share): " + ", ".join(CATEGORIES) + "; matmul GFLOP/s and its share of the measured peak):"]
    for name, p in rows:
        if "error" in p:
            lines.append(f"  {label(name)}: not profiled ({p['error']})")
            continue
        cells = _cells(p)
        lines.append(f"  {label(name)}: step {cells[0]} ms: " + ", ".join(f"{c} {v}" for c, v in zip(CATEGORIES, cells[1:]))
                     + f"; matmul {cells[-2]} GFLOP/s, {cells[-1]}")
    return lines


def step_profile_markdown(results: dict) -> list[str]:
    """report.md's "Where the step goes" section: a table, one row per policy and the peer."""
    rows = [(n, e["step_profile"]) for n, e in results["policies"].items() if e.get("step_profile")]
    if not rows:
        return []
    head = ["row", "profiled step ms", *(f"{c} ms (share)" for c in CATEGORIES), "matmul GFLOP/s", "matmul vs peak"]
    lines = ["## Where the step goes", "",
             f"A profiled window in each row's timing worker after the timing ({PROFILED_STEPS} steps after one warm-up, "
             "`torch.profiler`): ms per step by category, from each op's self time; `optimizer` is everything under "
             "`Optimizer.*` ranges, `casts` `copy_`/`_to_copy`/`to` outside them, `python/other` the step's time "
             "outside any op. The profiled step is slower than the timed one; read the shares. Matmul GFLOP/s: the "
             "profiler's GEMM FLOPs over the matmul time, against the measured matmul peak in the row's compute dtype.",
             "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, p in rows:
        cells = ["-"] * (len(head) - 1) if "error" in p else _cells(p)
        lines.append(f"| {label(name)} | " + " | ".join(cells) + " |")
    errors = [f"- {label(n)}: not profiled ({p['error']})" for n, p in rows if "error" in p]
    return lines + [""] + (errors + [""] if errors else [])
