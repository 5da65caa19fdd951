"""Recompute rows: a policy trained with the engine's recompute plan, as a row of its own next to the same policy.

``mixprec bench --policies fp32,bf16-lean,bf16-lean+recompute`` asks for the row ``bf16-lean+recompute``: policy
``bf16-lean`` trained by ``MixedPrecision(..., recompute=PLAN)`` (:mod:`mixprec.memory.recompute`), PLAN the
bench's ``--recompute`` (default ``"auto"``: each repeated block measured at its first training call, none /
selective / full recompute chosen jointly, the blocks within 1.3x their time). The row is judged like any other
(quality against fp32, the same gate; its own step time and memory figures). results.json adds to every row ``recompute`` (the option
as asked, None on a plain row), ``recompute_plan`` (the plan its quality run used: ``request``, ``max_ratio``,
``blocks`` = ``[{name, mode, saved_bytes, seconds}]`` with each mode's bytes kept for backward and
forward+backward seconds in :data:`mixprec.memory.recompute.MODES` order where measured, ``text``) and
``step_time_ratio_vs_no_recompute`` (its step time over the plain row's, both from the same timing: interleaved
by default: the one pass, whose timed steps are the quality run's own; None without that row).

Saved bytes of a recompute row: the saved-tensor count sees what autograd keeps outside the recomputed blocks and
each block's inputs; what a *selective* block keeps inside (its matmul outputs) it does not see
(:mod:`mixprec.memory.saved`); peak live bytes and the plan's per-block bytes do. :func:`recompute_lines` says so.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch

from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.records import Event
from mixprec.memory.recompute import MODES, RecomputePlan, match_blocks, parse_request
from mixprec.programs.bench.figures import fmt

__all__ = ["RECOMPUTE_SUFFIX", "DEFAULT_RECOMPUTE", "split_row", "recompute_option", "check_recompute_rows",
           "check_plan_fits", "plan_of", "with_recompute_ratios", "recompute_lines",
           "recompute_markdown"]

RECOMPUTE_SUFFIX = "+recompute"   # a row trained with the bench's --recompute plan
DEFAULT_RECOMPUTE = "auto"


def split_row(name: str) -> tuple[str, bool]:
    """``"bf16-lean+recompute"`` -> ``("bf16-lean", True)``; a plain policy name -> ``(name, False)``."""
    return (name[:-len(RECOMPUTE_SUFFIX)], True) if name.endswith(RECOMPUTE_SUFFIX) else (name, False)


def recompute_option(text: str) -> str | list[str]:
    """``--recompute`` text as the engine's ``recompute=`` value: ``"auto"``/``"auto:1.5"`` as given, else the
    comma-separated module names or globs (``"selective:blocks.*"``) as a list. ValueError/TypeError naming the
    value and what is allowed (:func:`mixprec.memory.recompute.parse_request`)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"bench recompute={text!r} must be 'auto', 'auto:<max time ratio>' or comma-separated "
                         "module names/globs ('blocks.*', 'selective:blocks.*')")
    value: str | list[str] = text if text.startswith("auto") else [n.strip() for n in text.split(",") if n.strip()]
    parse_request(value, arg="--recompute")
    return value


def check_recompute_rows(text: str | None, policies: tuple[str, ...]) -> None:
    """ValueError/TypeError for a bad ``--recompute`` (:func:`recompute_option`), and ValueError when it was given
    (``text`` not None) but ``policies`` names no ``<policy>+recompute`` row: the plan would change nothing. The
    message names the fix."""
    if text is not None:
        recompute_option(text)
    names = [p.strip() for p in policies]
    if text is None or any(split_row(n)[1] for n in names):
        return
    example = next((n for n in names if n != "fp32"), "bf16-lean")
    raise ValueError(f"bench --recompute {text!r} applies only to the rows named <policy>{RECOMPUTE_SUFFIX}, and "
                     f"--policies {','.join(names)} names none; add one, e.g. --policies "
                     f"{','.join(names)},{example}{RECOMPUTE_SUFFIX}, or drop --recompute")


def check_plan_fits(config: Any) -> None:
    """ValueError unless the named blocks of a :class:`~mixprec.programs.bench.config.BenchConfig`'s ``recompute``
    (None or ``"auto..."`` fit any model) match modules of its workload's model (built on the meta device: nothing
    allocated, the RNG untouched), as ``MixedPrecision(recompute=...)`` would match them at build."""
    text = config.recompute or DEFAULT_RECOMPUTE
    request = parse_request(recompute_option(text))
    if request.kind != "named":
        return
    from mixprec.workloads import get_workload

    with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")   # pretrained weights: names only
        model = get_workload(config.workload, config=config.config_name, data=config.data,
                             lora=config.lora).build_model()
    match_blocks(model, request.patterns, arg=f"bench --recompute {text!r} on the {config.workload} model")


def plan_of(mp: MixedPrecision) -> dict[str, Any] | None:
    """The recompute plan ``mp`` ran (its last ``"recompute"`` event) as results.json's ``recompute_plan``; None
    when it recorded none (no ``recompute=``)."""
    texts = [Event.of(e).detail for e in mp.events if Event.of(e).kind == "recompute"]
    if not texts:
        return None
    plan = RecomputePlan.from_text(texts[-1])
    blocks = [{"name": b.name, "mode": b.mode, "saved_bytes": None if b.saved_bytes is None else list(b.saved_bytes),
               "seconds": None if b.seconds is None else list(b.seconds)} for b in plan.blocks]
    return {"request": plan.request, "max_ratio": plan.max_ratio, "blocks": blocks, "text": plan.text()}


def with_recompute_ratios(entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` (row name -> :class:`~mixprec.programs.bench.results.PolicyRun`) with each recompute row's
    ``step_time_ratio_vs_no_recompute`` (its median step time / its plain row's; None where either is missing)."""
    out = dict(entries)
    for name, e in entries.items():
        base, recomputed = split_row(name)
        plain = entries.get(base)
        if recomputed and plain is not None and e.step_time_ms_median and plain.step_time_ms_median:
            out[name] = replace(e, step_time_ratio_vs_no_recompute=e.step_time_ms_median / plain.step_time_ms_median)
    return out


def _ratio(e: dict, plain: dict | None, key: str) -> str:
    mine, theirs = e.get(key), (plain or {}).get(key)
    return fmt(mine / theirs if mine is not None and theirs else None, ".2f", "x")


def _plan_words(plan: dict[str, Any]) -> str:
    """How many blocks recompute how, and the bytes the measured blocks keep for backward with and without it."""
    counts = {m: sum(b["mode"] == m for b in plan["blocks"]) for m in MODES}
    shown = ", ".join(f"{n} {m}" for m, n in counts.items() if n) or "no repeated blocks found"
    measured = [b for b in plan["blocks"] if b["saved_bytes"] is not None]
    if not measured:
        return f"{shown} (named, not measured)"
    before = sum(b["saved_bytes"][0] for b in measured)
    after = sum(b["saved_bytes"][MODES.index(b["mode"])] for b in measured)
    return (f"{shown}; measured per block at its first call: the blocks keep {after / 2**20:,.2f} MiB for backward "
            f"instead of {before / 2**20:,.2f} MiB")


def recompute_lines(results: dict) -> list[str]:
    """The console's and report.md's lines on the recompute rows: each row's plan (per block mode), its step time
    against the same policy without recompute (the timing the table uses), and its saved and peak live bytes
    against that row and fp32. Empty when no row recomputes."""
    policies = results["policies"]
    rows = [(n, e) for n, e in policies.items() if split_row(n)[1]]
    if not rows:
        return []
    lines = [f"recompute rows (`<policy>{RECOMPUTE_SUFFIX}`: MixedPrecision(recompute={results['settings'].get('recompute')!r}); "
             "saved bytes do not see what a selective block keeps inside, peak live bytes do):"]
    for name, e in rows:
        base = split_row(name)[0]
        plain = policies.get(base)
        plan = e.get("recompute_plan")
        if plan is None:
            lines.append(f"  {name}: no plan ({e.get('error') or e.get('skipped_reason') or 'not recorded'})")
            continue
        lines.append(f"  {name}: plan {plan['request']}: {_plan_words(plan)}; step time "
                     f"{fmt(e.get('step_time_ratio_vs_no_recompute'), '.2f', 'x')} {base}'s; saved "
                     f"{_ratio(e, plain, 'saved_activation_bytes')} {base}'s "
                     f"({fmt(e.get('saved_activation_ratio_vs_fp32'), '.2f', 'x')} fp32's); peak live "
                     f"{_ratio(e, plain, 'peak_live_bytes')} {base}'s "
                     f"({fmt(e.get('peak_live_ratio_vs_fp32'), '.2f', 'x')} fp32's)")
        lines += [f"    {b['name']}: {b['mode']}" + ("" if b["saved_bytes"] is None else
                  " (kept MiB none/selective/full " + "/".join(f"{s / 2**20:.2f}" for s in b["saved_bytes"])
                  + "; fwd+bwd ms " + "/".join(f"{s * 1e3:.1f}" for s in b["seconds"]) + ")")
                  for b in plan["blocks"]]
    return lines


def recompute_markdown(results: dict) -> list[str]:
    """report.md's section on the recompute rows: :func:`recompute_lines` as a list (blocks nested)."""
    lines = recompute_lines(results)
    if not lines:
        return []
    items = [("  - " if line.startswith("    ") else "- ") + line.strip() for line in lines[1:]]
    return ["## Recompute plan", "", lines[0][0].upper() + lines[0][1:], "", *items, ""]
