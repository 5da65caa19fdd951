"""The bench's figures, ``loss_curves.png``, ``loss_wallclock.png`` and ``speed_memory.png``, and the readings of a results.json that they
share with ``report.md`` (the rows that trained, eval curves, the seed band, number formatting).

Every function takes the results.json content (a dict); matplotlib is imported only to plot (Agg backend).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mixprec.programs.bench.peer import label

__all__ = ["plot_loss_curves", "plot_loss_wallclock", "plot_speed_memory", "fmt", "ran_rows", "eval_curve_of", "loss_unit",
           "seed_band", "delta_axis_limits", "wallclock_curve"]


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``; ``-`` for None or a non-finite float."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def ran_rows(results: dict) -> dict[str, dict]:
    """The rows that trained (they have a training loss per step), in results.json order, keyed by the name tables
    and legends print (the peer's marked, :func:`mixprec.programs.bench.peer.label`)."""
    return {label(n): e for n, e in results["policies"].items() if e.get("loss_per_step")}


def _moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


_STYLES = ("-", "--", "-.", ":")          # policies that track fp32 overlap: dashes keep each one visible
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _width(index: int, count: int) -> float:
    """Line width by drawing order, widest first: a curve drawn over an identical one leaves it showing as an outline."""
    return 1.0 + 0.7 * (count - 1 - index)


def eval_curve_of(entry: dict | None) -> dict:
    """A row's ``eval_curve`` as ``{step: eval loss or None}``."""
    return dict((step, loss) for step, loss in (entry or {}).get("eval_curve") or [])


def loss_unit(results: dict) -> str:
    """The workload's loss unit (``Workload.loss_unit``), read from the first row that trained."""
    return next((e["loss_unit"] for e in ran_rows(results).values() if e.get("loss_unit")),
                "unit not set: Workload.loss_unit")


def _plot_training(ax: Any, results: dict, window: int) -> None:
    """Training loss per step: raw (faint) and a trailing moving average, one colour and dash per policy."""
    for index, (name, e) in enumerate(ran_rows(results).items()):
        losses = [math.nan if v is None else v for v in e["loss_per_step"]]
        steps = range(1, len(losses) + 1)
        (line,) = ax.plot(steps, _moving_average(losses, window), lw=_width(index, len(ran_rows(results))),
                          ls=_STYLES[index % len(_STYLES)],
                          color=f"C{index}", label=name)
        ax.plot(steps, losses, lw=0.5, alpha=0.2, color=line.get_color())
    ax.plot([], [], color="gray", lw=0.5, alpha=0.5, label="raw, per step (faint)")
    smooth = f"lines: trailing mean over {window} steps" if window > 1 else "per step"
    ax.set(ylabel=f"training loss ({loss_unit(results)})", title=f"training loss ({smooth})")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3)


def _plot_eval(ax: Any, results: dict) -> None:
    """Eval loss at each eval point (the row's ``eval_curve``), with markers and dashes so overlaps stay visible."""
    for index, (name, e) in enumerate(ran_rows(results).items()):
        curve = [(st, v) for st, v in e.get("eval_curve") or [] if v is not None]
        if curve:
            ax.plot(*zip(*curve), lw=_width(index, len(ran_rows(results))), ls=_STYLES[index % len(_STYLES)],
                    marker=_MARKERS[index % len(_MARKERS)], ms=3 + 2 * _width(index, len(ran_rows(results))), mfc="none", color=f"C{index}", label=f"{name} (final {fmt(e.get('final_eval_loss'), '.4f')})")
    ax.set(ylabel=f"eval loss ({loss_unit(results)})", title="validation loss over training (fixed val batches)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


def seed_band(results: dict) -> dict[int, float]:
    """Per eval step, the fp32 seeds' relative spread ((max - min) / min) — the band a delta is read against."""
    curves = [eval_curve_of({"eval_curve": c}) for c in (results.get("seed_noise") or {}).get("fp32_eval_curves") or [] if c]
    if len(curves) < 2:
        return {}
    band = {}
    for step in curves[0]:
        values = [c.get(step) for c in curves]
        if all(v is not None for v in values):
            band[step] = (max(values) - min(values)) / min(values)
    return band


def delta_axis_limits(deltas_pct: list[float], min_span_pct: float = 0.02) -> tuple[float, float]:
    """The Δ panel's y limits (percent): the policies' deltas and 0, padded by 15 % of their span (at least
    ``min_span_pct``), so ±0.2 % differences fill the panel instead of lying flat under a ±2 % gate."""
    values = [0.0, *(v for v in deltas_pct if math.isfinite(v))]
    lo, hi = min(values), max(values)
    pad = 0.15 * max(hi - lo, min_span_pct)
    return lo - pad, hi + pad


def _outside(value: float, limits: tuple[float, float]) -> str:
    """"" when ``value`` lies within ``limits``, else "above the axis" / "below the axis"."""
    return "" if limits[0] <= value <= limits[1] else ("above the axis" if value > limits[1] else "below the axis")


def _plot_eval_delta(ax: Any, results: dict) -> None:
    """Eval-loss delta vs fp32 (%) at each eval point, the y axis scaled to the deltas (:func:`delta_axis_limits`);
    the gate (+max loss delta, judged at the final point) and the seed-noise band (shaded ±, per eval point) are
    drawn where they fall inside it and marked at the edge where they do not."""
    reference = eval_curve_of(ran_rows(results).get(results["reference"]))
    deltas: list[float] = []
    for index, (name, e) in enumerate(ran_rows(results).items()):
        points = [(st, 100 * (v - reference[st]) / reference[st]) for st, v in e.get("eval_curve") or []
                  if name != results["reference"] and v is not None and reference.get(st)]
        if points:
            deltas += [d for _, d in points]
            ax.plot(*zip(*points), lw=_width(index, len(ran_rows(results))), ls=_STYLES[index % len(_STYLES)],
                    marker=_MARKERS[index % len(_MARKERS)], ms=3 + 2 * _width(index, len(ran_rows(results))), mfc="none", color=f"C{index}", label=name)
    limits = delta_axis_limits(deltas)
    band = seed_band(results)
    if band:
        steps = sorted(band)
        widest = 100 * max(band.values())
        beyond = ", beyond the axis at some steps" if widest > max(abs(limits[0]), abs(limits[1])) else ""
        ax.fill_between(steps, [-100 * band[st] for st in steps], [100 * band[st] for st in steps], color="gray",
                        alpha=0.2, label=f"seed noise (fp32 at {len([c for c in results['seed_noise']['fp32_eval_curves'] if c])} seeds){beyond}")
    limit_pct = 100 * results["settings"]["targets"]["max_loss_delta"]
    outside = _outside(limit_pct, limits)
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(limit_pct, color="red", lw=0.8, ls="--",
               label=f"gate: --max-loss-delta +{limit_pct:g}% (final eval)" + (f", {outside}" if outside else ""))
    ax.set_ylim(*limits)
    ax.set(xlabel="step (optimizer steps)", ylabel="eval loss vs fp32 (%)",
           title="eval-loss delta vs fp32, axis scaled to the deltas" +
                 (f"; the gate (+{limit_pct:g}%) lies {outside}" if outside else ""))
    ax.title.set_fontsize(9)
    longest = max((len(text) for text in ax.get_legend_handles_labels()[1]), default=0)
    ax.legend(fontsize=7, ncol=1 if longest > 32 else 3)   # three long labels side by side ran off the axes
    ax.grid(alpha=0.3)


def wallclock_curve(entry: dict) -> list[tuple[float, float]]:
    """A row's eval curve against cumulative training seconds: ``(seconds after step s, eval loss at s)``, the
    seconds summed over the row's measured per-step times (``step_time_ms_per_step``, eval excluded; a step
    without a time counts at the median). Empty without an eval curve or step times."""
    times = entry.get("step_time_ms_per_step") or []
    fill = entry.get("step_time_ms_median")
    if fill is None:
        known = sorted(t for t in times if t is not None)
        fill = known[len(known) // 2] if known else None
    if fill is None:
        return []
    cumulative, total = [], 0.0
    for t in times:
        total += (fill if t is None else t) / 1000
        cumulative.append(total)
    return [(cumulative[st - 1] if st <= len(cumulative) else total + (st - len(cumulative)) * fill / 1000, v)
            for st, v in entry.get("eval_curve") or [] if v is not None and st >= 1]


def plot_loss_wallclock(results: dict, path: Path) -> Any:
    """Eval loss against cumulative training seconds per policy (:func:`wallclock_curve`): the trade-off mixed
    precision is about, lower-left is better. Returns the (closed) matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    ran = ran_rows(results)
    for index, (name, e) in enumerate(ran.items()):
        curve = wallclock_curve(e)
        if curve:
            ax.plot(*zip(*curve), lw=_width(index, len(ran)), ls=_STYLES[index % len(_STYLES)],
                    marker=_MARKERS[index % len(_MARKERS)], ms=4, mfc="none", color=f"C{index}",
                    label=f"{name} ({fmt(curve[-1][0], '.1f')} s, final {fmt(curve[-1][1], '.4f')})")
    s = results["settings"]
    noisy = ("\nTIMINGS NOISY: the seconds are unreliable and their order is no ranking (no speed verdict)"
             if (results.get("timing") or {}).get("noisy") else "")
    ax.set(xlabel="cumulative training seconds (the quality run's measured step times; eval excluded)",
           ylabel=f"eval loss ({loss_unit(results)})",
           title=f"eval loss vs training time: {s['workload']}/{s['config'] or 'default'}, {s['device']}{noisy}")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_loss_curves(results: dict, path: Path) -> Any:
    """Three panels sharing the step axis: training loss (raw and smoothed), eval loss at each eval point, and
    each policy's eval-loss delta vs fp32 with the gate and the seed-noise band. Returns the (closed) matplotlib
    Figure, whose axes can still be read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["settings"]
    fig, (ax, ax_eval, ax_delta) = plt.subplots(3, 1, figsize=(8, 9), sharex=True,
                                                gridspec_kw={"height_ratios": [2, 1.5, 1.2]})
    _plot_training(ax, results, max(1, s["steps"] // 20))
    _plot_eval(ax_eval, results)
    _plot_eval_delta(ax_delta, results)
    fig.suptitle(f"{s['workload']}/{s['config'] or 'default'}, {s['steps']} steps, seed {s['seed']}, {s['device']}",
                 fontsize=10)
    return _save(fig, path)


def _plot_step_memory(ax: Any, ran: dict[str, dict]) -> None:
    """One bar pair per policy: saved-for-backward and peak live tensor MiB of one step (label: ratio to fp32)."""
    names, width = list(ran), 0.4
    for offset, (key, ratio_key, label) in enumerate((("saved_activation_bytes", "saved_activation_ratio_vs_fp32",
                                                        "saved for backward"),
                                                       ("peak_live_bytes", "peak_live_ratio_vs_fp32", "peak live"))):
        xs = [i + (offset - 0.5) * width for i in range(len(names))]
        bars = ax.bar(xs, [(ran[n].get(key) or 0) / 2**20 for n in names], width, label=label,
                      color=f"C{offset}", alpha=0.85)
        for bar, n in zip(bars, names):
            ax.annotate(fmt(ran[n].get(ratio_key), ".2f", "x"), (bar.get_x() + bar.get_width() / 2,
                                                                  bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=7)
    ax.set(title="one step's tensors; label: ratio to fp32", ylabel="MiB", xlabel="policy")


def plot_speed_memory(results: dict, path: Path) -> Any:
    """Bars per policy: median step time with p10/p90 whiskers (label: speedup), peak memory (label: ratio to
    fp32), training-state bytes/param, and one step's saved-for-backward and peak live tensor MiB (a bar pair,
    labels: ratios to fp32). Returns the (closed) matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = ran_rows(results)
    names = list(ran)
    panels = [("step_time_ms_median", "step time (ms)", "median step time; whiskers p10-p90; label: speedup",
               "speedup_vs_fp32"),
              ("peak_memory_mb", "peak memory (MiB)", "peak memory; label: ratio to fp32", "memory_ratio_vs_fp32"),
              ("state_bytes_per_param", "training state (bytes/param)", "training state per parameter", None)]
    if (results.get("timing") or {}).get("noisy"):   # no speed verdict was given: the labels must not read as one
        panels[0] = panels[0][:2] + ("TIMINGS NOISY: step times and speedups unreliable (no speed verdict)",
                                     panels[0][3])
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4))
    _plot_step_memory(axes[3], ran)
    for ax in axes[3:]:
        ax.title.set_fontsize(9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax, (key, ylabel, title, ratio_key) in zip(axes, panels):
        values = [ran[n].get(key) or 0.0 for n in names]
        whiskers = None
        if key == "step_time_ms_median":
            whiskers = [[max(0.0, v - (ran[n].get("step_time_ms_p10") or v)) for v, n in zip(values, names)],
                        [max(0.0, (ran[n].get("step_time_ms_p90") or v) - v) for v, n in zip(values, names)]]
        bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))], yerr=whiskers, capsize=3)
        for i, (bar, n) in enumerate(zip(bars, names)):
            label = fmt(ran[n].get(ratio_key), ".2f", "x") if ratio_key else fmt(ran[n].get(key), ".1f")
            top = bar.get_height() + (whiskers[1][i] if whiskers else 0.0)   # above the whisker
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom", fontsize=8)
        ax.set(title=title, ylabel=ylabel, xlabel="policy")
        ax.title.set_fontsize(9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    method = (results.get("timing") or {}).get("method", "sequential")
    fig.suptitle(f"speed and memory vs fp32 ({results['settings']['device']}; step time: {method} timing)",
                 fontsize=10)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Any:
    """Lay out, write ``path`` (PNG, 110 dpi) and close ``fig``; returns it (closed)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
