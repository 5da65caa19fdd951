"""Bench outputs: ``results.json``, ``report.md``, ``loss_curves.png``, ``loss_wallclock.png``, ``speed_memory.png``.

:func:`write_outputs` writes them; :func:`report_markdown` assembles report.md from its sections, each from the
module of its concept (the table: :mod:`~mixprec.programs.bench.table`; the timing and the attention plan:
:mod:`~mixprec.programs.bench.timing_report`, :mod:`~mixprec.programs.bench.op_plan_report`; the peer, memory, per-rank
and recompute sections: their ``*_report``/row modules); the plots are :mod:`~mixprec.programs.bench.figures`'.

``results.json`` (strict JSON: non-finite numbers are written as null)::

    {"mixprec_bench": 1, "created": ISO time, "command": "mixprec bench ...",
     "settings": {workload, config, policies, steps, warmup_steps, seed, data, device, force,
                  eval_every, targets: {max_loss_delta, min_speedup, max_memory_ratio}, memory_budget},
     "workload": Workload.describe() (model, optimizer, data source and split, vocabulary),
     "environment": {torch, python, platform, device, torch_threads, capability,
                     peaks_gflops_per_s: {fp32, bf16, fp16, fp8}, peaks_matmul_n, peaks_origin, command,
                     cpu_name + cpu_flags + cpu_count (CPU) | gpu_name (CUDA)},
     "reference": "fp32",
     "policies": {requested name: {POLICY_KEYS...}, ...},   # fp32 first
     "timing": {method, blocks, block_steps, spread: {policy: p90/p10}, noisy, spread_limit, ...},
               # spread/noisy: one decision over the table's step times (programs/bench/noise.py)
     "seed_noise": {seeds, fp32_eval_losses, relative_spread, fp32_eval_curves} | null,
     "mfu_peak": {dtype, gflops_per_s, n, source, measured_at, measured_by_pid, torch} | null, "portable_ops": {...} | null,
     "parent_pid": int, "wall_s": float,
     "op_plan": {measured_with, dtype, pid, entries: [{op, shape, chosen, times_ms, source, note}],
                 policies: {name: {dtype, pinned: {key: choice}, not_offered: {key: why}}}, error?} | null,
               # the bench's one attention plan, measured once and pinned for every worker (pinned_plan.py);
               # each row's op_plan and timing.op_plan say what its workers ran (source "bench": the pinned plan)
     "peer": {row, dtype, grad_scaler, skipped_reason, note} | null}
               # the plain-autocast peer (peer.py): its row "torch-autocast" is last in "policies"; null: --no-peer

Per policy (:data:`POLICY_KEYS`; a SKIPPED policy has null measurements): units are in the
names (``_ms``, ``_mb`` = MiB, ``_per_s``); ``speedup_vs_fp32`` = fp32 median step time / this
one; ``memory_ratio_vs_fp32`` = peak memory / fp32's; ``eval_loss_delta_vs_fp32`` = relative
final validation-loss change, ``(loss - loss_fp32) / loss_fp32``; ``eval_curve`` = ``[[step, eval loss], ...]``
after every ``eval_every``-th step, the final eval last (``loss_unit``, e.g. ``"nats/char"``); ``state_bytes_per_param`` is
measured from the tensors (:func:`mixprec.programs.bench.measure.state_bytes`); ``decision`` is how the
engine resolved the policy; ``pid`` is the worker process. Under ``bench --compile`` each policy has
a second row, ``<policy>+compiled`` (``compiled``: true), trained by ``MixedPrecision(..., compile=True)``;
its ``compile_time_s`` is the time its warm-up steps took beyond its median step (the compilation,
in the first step), so ``step_time_ms_median`` is the compiled steady state; ``first_step_ms`` and
``warmup_excess_s`` are recorded for every row (eager rows: kernel and allocator set-up).
``saved_activation_bytes`` / ``peak_live_bytes`` (and their ``_ratio_vs_fp32``) are one extra untimed step's
bytes saved for backward (parameters left out) and peak live tensor bytes, ``step_memory`` = ``{saved: {bytes,
mib, by_dtype, tensors}, live: {bytes, baseline, total, total_mib, source}, batch_rows}`` or ``{error}``;
``memory_budget`` = ``{budget_bytes, largest_batch, fixed_bytes, per_sample_bytes, points, residuals,
predicted_bytes}`` or ``{error, budget}`` under ``--memory-budget``, else null (:mod:`mixprec.programs.bench.step_memory`).
A ``<policy>+recompute`` row trains with ``--recompute``'s plan: ``recompute``, ``recompute_plan``,
``step_time_ratio_vs_no_recompute`` (:mod:`mixprec.programs.bench.recompute_rows`; null on other rows).
Under ``--strategy``: ``*_per_rank`` (+ ``_max``), every rank's own figures (:mod:`mixprec.programs.bench.per_rank`).
Against the ``torch-autocast`` peer (:mod:`mixprec.programs.bench.peer`), on every row: ``speedup_vs_peer`` = the
peer's median step time / this one, ``saved_activation_ratio_vs_peer`` and ``peak_live_ratio_vs_peer`` = this row's
bytes / the peer's (null without a peer). ``step_profile``: where the step goes, per category, from a profiled window
after the timing (:mod:`mixprec.programs.bench.step_profile`; null under sequential timing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mixprec.programs.bench.memory_report import memory_lines, peak_source_lines
from mixprec.programs.bench.op_plan_report import op_plan_lines, op_plan_markdown, plan_deviations
from mixprec.programs.bench.peer import label
from mixprec.programs.bench.peer_report import peer_markdown
from mixprec.programs.bench.per_rank import per_rank_markdown, rank0_tag
from mixprec.programs.bench.recompute_rows import recompute_markdown
from mixprec.programs.bench.results import COMPILED_SUFFIX, POLICY_KEYS
from mixprec.programs.bench.figures import (eval_curve_of, fmt, loss_unit, plot_loss_curves, plot_loss_wallclock,
                                            plot_speed_memory, ran_rows, seed_band)
from mixprec.programs.bench.step_profile import step_profile_markdown
from mixprec.programs.bench.table import cells, columns, format_table, has_compiled
from mixprec.programs.bench.timing_report import timing_lines

__all__ = ["POLICY_KEYS", "COMPILED_SUFFIX", "write_outputs", "format_table", "auto_lines", "op_plan_lines", "plan_deviations", "timing_lines", "seed_noise_lines", "eval_curve_lines", "report_markdown",
           "plot_loss_curves", "plot_loss_wallclock", "plot_speed_memory", "peaks_line"]

_HOW_TO_READ = """\
## How to read a verdict

Every policy trains the same model from the same seed on the same batches as fp32 (the
REFERENCE), each in its own process. Its final validation loss (on fixed validation batches,
under the policy's own autocast) is compared with fp32's as a relative delta: +1.00 % means
1 % higher (worse) loss. A policy PASSES when that delta is at most `--max-loss-delta`
and, where given, its speedup (fp32 median step time / its own) is at least `--min-speedup`
and its peak-memory ratio to fp32 is at most `--max-memory-ratio`. FAIL lists every target
missed (or the crash); SKIPPED gives the measured reason the device cannot run the policy
natively (`--force` runs it anyway). *bytes/param* is the training state read from the
actual tensors (params, grads, fp32 masters, optimizer state, compensation buffers). On a
CPU, peak memory is the process's own peak RSS (the line below the table names its source),
which includes a few hundred MiB of interpreter and torch libraries, so its ratio understates state savings; bytes/param shows them. It also
includes glibc heap fragmentation, which grows with varying tensor sizes (e.g. a masked-LM's
varying number of masked tokens) and can make a 16-bit policy's peak RSS *exceed* fp32's;
`MALLOC_MMAP_THRESHOLD_=131072` in the environment removes most of it. That is the opposite of
the timing workers' setting (the timing line's 256 MiB threshold, which keeps the heap so a step
does not re-fault it): a low threshold trades step time for peak RSS. Peak memory here comes
from the training runs: in the one pass (the default) those are the resident workers, under the
timing line's malloc setting; under `--timing sequential`, glibc's defaults.
"""


def _event_lines(policies: dict) -> list[str]:
    """One line per engine/guard event per policy, or a line saying there were none."""
    lines = [f"- {name}, step {ev.get('step')}: {ev.get('kind')} — {ev.get('cause')}"
             + (f" (module `{ev['module']}`)" if ev.get("module") else "") + f": {ev.get('detail', '')}"
             for name, e in policies.items() for ev in (e.get("events") or [])]
    skipped = [f"- {name}: {e['skipped_steps']} skipped step(s) {e.get('skipped_by_reason') or ''}"
               for name, e in policies.items() if e.get("skipped_steps")]
    return lines + skipped or ["- none: every step of every policy applied"]


def _row_words(results: dict, chosen: str) -> str:
    """Which row an advised policy is (when it equals a policy also asked for by name, that policy runs once)."""
    if chosen == results.get("reference"):
        row = f"its row is the `{chosen}` reference row"
    else:
        row = f"its row is `{chosen}`" if chosen in results["policies"] else "it did not run"
    if chosen in results["settings"].get("requested_policies", ()):
        row += " (also asked for by name: it ran once)"
    return row


def _advice_lines(results: dict) -> list[str]:
    """``--policies advised`` / ``advised:<format>``: what the numerics advisor chose and why, and which row it is."""
    advice = results.get("advice")
    if not advice:
        return []
    lines = []
    if advice.get("policy"):
        chosen = advice["policy"]
        lines.append(f"Advised policy (`mixprec inspect`): `{chosen}`; {_row_words(results, chosen)}. Why: "
                     + "; ".join(advice["reasons"]))
    for block in advice.get("block", []):
        chosen, kept = block["policy"], ", ".join(block["kept_in_bf16"]) or "nothing"
        lines.append(f"Advised {block['format']} policy (`{block['request']}`, as `{block['inspected_as']}` "
                     f"advises): `{chosen}`; {_row_words(results, chosen)}; linears kept in bf16: {kept}. "
                     "Why: " + "; ".join(block["reasons"]))
    return lines + [""]


def _state_lines(policies: dict) -> list[str]:
    """Per policy: trainable and frozen parameter counts with the training-state bytes of each part
    (frozen params: storage only, no grad/master/state), and any eval metric besides the loss."""
    lines = []
    for name, e in policies.items():
        sb = e.get("state_bytes") or {}
        if not sb.get("n_params"):
            continue
        n, frozen = sb["n_params"], sb.get("n_frozen", 0)
        text = (f"- {label(name)}: {n - frozen:,} trainable ({(n - frozen) / n:.2%}) at "
                f"{fmt(sb.get('per_trainable_param'), '.2f')} B/param")
        if frozen:
            text += f", {frozen:,} frozen at {fmt(sb.get('per_frozen_param'), '.2f')} B/param"
        text += f"; whole model {fmt(sb.get('per_param'), '.2f')} B/param ({sb.get('total', 0) / 2**20:,.1f} MiB)"
        if sb.get("quantized_state"):   # 8-bit moments: codes + absmax scales, the rest of the state is fp32
            text += (f"; optimizer state {sb['optimizer_state'] / n:.2f} B/param, of which 8-bit codes and scales "
                     f"{sb['quantized_state'] / n:.2f} ({sb.get('quantized_elements', 0):,} moment elements)")
        extra = {k: v for k, v in (e.get("final_eval") or {}).items() if k != "loss"}
        if extra:
            text += "; final eval " + ", ".join(f"{k} {fmt(v, '.4f')}" for k, v in extra.items())
        lines.append(text)
    return lines or ["- not measured"]


def _compile_lines(results: dict) -> list[str]:
    """``--compile``: what the ``+compiled`` rows are, and compiled vs eager step time per policy."""
    if not has_compiled(results):
        return []
    policies = results["policies"]
    pairs = [(name, policies[name], policies.get(name + COMPILED_SUFFIX)) for name in results["settings"]["policies"]]
    lines = ["", "Compiled rows (`<policy>+compiled`): the same policy, seed and batches, trained by "
             "`MixedPrecision(..., compile=True)` (torch.compile, inductor) in its own process. *compile s* is the "
             "time its warm-up steps took beyond its median step (the compilation, in the first step): it is "
             "not part of *step ms*, the compiled steady state. Speedups are against eager fp32.", ""]
    for name, eager, compiled in pairs:
        if compiled is None or eager.get("step_time_ms_median") is None or compiled.get("step_time_ms_median") is None:
            continue
        ratio = eager["step_time_ms_median"] / compiled["step_time_ms_median"]
        lines.append(f"- {name}: eager {eager['step_time_ms_median']:.1f} ms/step, compiled "
                     f"{compiled['step_time_ms_median']:.1f} ms/step ({ratio:.2f}x eager), compile "
                     f"{fmt(compiled.get('compile_time_s'), '.1f', ' s')} (first step "
                     f"{fmt(compiled.get('first_step_ms'), ',.0f', ' ms')})")
    return lines


def auto_lines(results: dict) -> list[str]:
    """One line per ``auto`` row: the policy it ran and why (the engine's decision: the ratio measured on
    the model at its first forward, or the matmul probe's rule)."""
    return [e["decision"] if e["decision"].startswith("auto →") else f"{name} ran {e.get('policy')}: {e['decision']}"
            for name, e in results["policies"].items()
            if str(e.get("requested") or name).lower() == "auto" and e.get("decision")]


def seed_noise_lines(results: dict) -> list[str]:
    """The seed-noise band: fp32's final eval loss at each seed and their relative spread."""
    noise = results.get("seed_noise")
    if not noise:
        return []
    losses = ", ".join(f"seed {s}: {v:.4f}" for s, v in zip(noise["seeds"], noise["fp32_eval_losses"]))
    if noise.get("relative_spread") is None:
        return [f"seed noise: not measured ({noise.get('error')}); {losses}"]
    return [f"seed noise: fp32 eval loss {losses}; band ±{noise['relative_spread']:.2%} (a delta inside it is "
            "indistinguishable from another seed)"]


def _portable_lines(results: dict) -> list[str]:
    """What ``ops=portable`` (CUDA's autocast op lists on this device) cost: the interleaved A/B timing."""
    cost = results.get("portable_ops")
    if not cost:
        return []
    ratio = cost["ratio_portable_over_native"]
    return ["", f"Portable ops (`ops=portable`, the default: CUDA's autocast op lists on this device): "
            f"{cost['policy']} {cost['portable_step_ms_median']:.1f} ms/step against "
            f"{cost['native_step_ms_median']:.1f} ms/step with `ops=native` (torch's own lists), ratio {ratio:.3f} "
            f"(median of {cost['timed_steps_each']} steps each, interleaved in one process; target <= 1.03"
            f"{'' if ratio <= 1.03 else ': above it here'})."]


def eval_curve_lines(results: dict) -> list[str]:
    """report.md's eval-curve table: per eval step, each policy's eval loss (and its delta vs fp32) and the
    fp32 seeds' spread at that step."""
    ran = ran_rows(results)
    reference = eval_curve_of(ran.get(results["reference"]))
    if len(reference) < 2:
        return []
    band = seed_band(results)
    names = list(ran)
    curves = {name: eval_curve_of(ran[name]) for name in names}
    lines = [f"## Eval loss over training (every {results['settings'].get('eval_every')} steps, {loss_unit(results)})",
             "", "| step | " + " | ".join(names) + (" | seed noise |" if band else " |"),
             "|---:|" + "---:|" * (len(names) + bool(band))]
    for step, ref in sorted(reference.items()):
        cells = []
        for name in names:
            value = curves[name].get(step)
            delta = "" if name == results["reference"] or value is None or not ref else f" ({(value - ref) / ref:+.2%})"
            cells.append(fmt(value, ".4f") + delta)
        seed = [f"±{band[step]:.2%}" if step in band else "-"] if band else []
        lines.append(f"| {step} | " + " | ".join(cells + seed) + " |")
    return lines + [""]


def _header_lines(results: dict) -> list[str]:
    """report.md's title, the command, the targets, the device and the workload."""
    s, env, w = results["settings"], results["environment"], results["workload"]
    t = s["targets"]
    targets = [f"max loss delta +{t['max_loss_delta']:.2%}"]
    targets += [f"min speedup {t['min_speedup']}x"] if t["min_speedup"] else []
    targets += [f"max memory ratio {t['max_memory_ratio']}x"] if t["max_memory_ratio"] else []
    hardware = env.get("gpu_name") or f"{env.get('cpu_name')}, {env['torch_threads']} threads, flags: " \
                                        f"{' '.join(env.get('cpu_flags') or []) or 'n/a'}"
    return [
        f"# mixprec bench: {s['workload']}/{s['config'] or 'default'}, {s['steps']} steps, seed {s['seed']}, "
        f"{s['device']}",
        "",
        "Command:",
        "",
        f"```\n{results['command']}\n```",
        "",
        f"Targets: {', '.join(targets)}. Device: {s['device']} ({hardware}); torch {env['torch']}, "
        f"python {env['python']}. {peaks_line(results)}",
        f"Workload: {w.get('workload', s['workload'])}, {json.dumps(w.get('model', {}))}; "
        f"{w.get('items_per_batch', _row_value(results, 'items_per_batch', '?'))} "
        f"{w.get('item_unit', _row_value(results, 'item_unit', 'items'))} per step; data: "
        f"{(w.get('data') or {}).get('source', 'workload-defined')}.",
    ]


def peaks_line(results: dict) -> str:
    """report.md's sentence on the matmul peaks (the MFU denominators): each dtype's GFLOP/s at its size and where
    it comes from (measured by this run, or a cache file: when, by which process, under which torch)."""
    env = results["environment"]
    origin, sizes = env.get("peaks_origin") or {}, env.get("peaks_matmul_n") or {}
    peaks = "; ".join(f"{k} {fmt(v, '.1f')}" + (f" at {sizes[k]}³" if sizes.get(k) else "")
                      + (f" ({origin[k]})" if origin.get(k) else "") for k, v in env["peaks_gflops_per_s"].items())
    mfu = results.get("mfu_peak")
    against = f" MFU is against {mfu['dtype']}'s {fmt(mfu['gflops_per_s'], '.1f')} ({mfu.get('source', 'origin not recorded')})." \
        if mfu else ""
    if mfu and mfu.get("unreliable"):
        against += f" **No MFU**: {mfu['unreliable']}."
    return f"Matmul peaks (GFLOP/s, `mixprec doctor`; `mixprec doctor` re-measures them): {peaks}.{against}"


def _row_value(results: dict, key: str, default: Any) -> Any:
    """``key`` as the rows recorded it (``items_per_batch``, ``item_unit``: a workload whose ``describe()`` leaves
    them out), else ``default``."""
    return next((e[key] for e in results["policies"].values() if e.get(key)), default)


def report_markdown(results: dict) -> str:
    """``report.md``: the table, each verdict with its reason, how each policy ran, the command."""
    keys, headers = zip(*columns(results))
    lines = [
        *_header_lines(results),
        *_compile_lines(results),
        *_portable_lines(results),
        *(["", *(f"How auto decided: {line}." for line in auto_lines(results))] if auto_lines(results) else []),
        "",
        *(f"{line}." for line in timing_lines(results) + seed_noise_lines(results)),
        "",
        *_advice_lines(results),
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|",
        *("| " + " | ".join(cells(name, e)[k] for k in keys) + " |" for name, e in results["policies"].items()),
        *peak_source_lines(results),
        *op_plan_markdown(results),
        *eval_curve_lines(results),
        *peer_markdown(results),
        *step_profile_markdown(results),
        *memory_lines(results),
        *per_rank_markdown(results),
        *recompute_markdown(results),
        "## Parameters and training state" + rank0_tag(results, " (rank 0's tensors)"),
        "",
        *(_state_lines(results["policies"])),
        "",
        "## Verdicts",
        "",
        *(f"- **{label(name)}: {e['verdict']}**: {e['reason']}" for name, e in results["policies"].items()),
        "",
        "## How each policy ran",
        "",
        *(f"- {label(name)}: `{e.get('policy') or '-'}` ({e.get('decision') or e.get('skipped_reason') or e.get('error')}); "
          f"optimizer {e.get('optimizer') or '-'}; worker pid {e.get('pid') or '-'}"
          for name, e in results["policies"].items()),
        "",
        "## Events (skips, rollbacks, escalations)",
        "",
        *(_event_lines(results["policies"])),
        "",
        "![training loss](loss_curves.png)",
        "",
        "![eval loss vs training time](loss_wallclock.png)",
        "",
        "![speed and memory](speed_memory.png)",
        "",
        _HOW_TO_READ,
    ]
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_outputs(results: dict, out: Path) -> dict[str, Path]:
    """Write the five outputs into ``out``; returns their paths by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("results.json", "report.md", "loss_curves.png", "loss_wallclock.png",
                                              "speed_memory.png")}
    paths["results.json"].write_text(json.dumps(_json_safe(results), indent=1, allow_nan=False, default=str))
    paths["report.md"].write_text(report_markdown(results))
    plot_loss_curves(results, paths["loss_curves.png"])
    plot_loss_wallclock(results, paths["loss_wallclock.png"])
    plot_speed_memory(results, paths["speed_memory.png"])
    return paths
