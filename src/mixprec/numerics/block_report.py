"""The block-format part of the numerics report in words: the markdown section of
:meth:`mixprec.numerics.NumericsReport.to_markdown` and the console lines of ``mixprec inspect`` (the advice is
:mod:`mixprec.numerics.block_advice`'s, the conventions :mod:`mixprec.numerics.block_stats`'s)."""

from __future__ import annotations

import math

from mixprec.blockscale.recipe import OPERANDS
from mixprec.numerics.block_advice import (BLOCK_SQNR_SLACK_DB, BLOCK_UNDERFLOW_MARGIN, BlockAdvice, advise_block,
                                           block_run, block_verdicts)
from mixprec.numerics.block_stats import BlockFormatStats, BlockStats
from mixprec.numerics.figures import pct
from mixprec.numerics.stats import NumericsStats

__all__ = ["kept_tag", "block_markdown", "block_console"]

_TAGS = (("first Linear", "first Linear"), ("last Linear", "last Linear"), ("in the bf16 tail", "bf16 tail"),
         ("shape:", "shape"), ("kept by block_keep", "block_keep"), ("rejected by module_filter", "filter"),
         ("the root module", "root"))


def kept_tag(reason: str) -> str:
    """A short tag for a conversion's kept reasons (``"first Linear"``, ``"bf16 tail"``, ``"shape"``,
    ``"block_keep"``, ``"subclass"``...), several joined by ``+``."""
    tags = []
    for part in reason.split("; "):
        tag = next((t for prefix, t in _TAGS if part.startswith(prefix)), "subclass" if "subclass" in part else part)
        tags.append(tag)
    return "+".join(dict.fromkeys(tags))


def _db(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else str(x)


def _cells(operands: dict[str, BlockStats]) -> list[str]:
    cells = []
    for operand in OPERANDS:
        s = operands.get(operand)
        cells += ["-", "-", "-"] if s is None else [pct(s.saturated), pct(s.underflow), _db(s.sqnr_db)]
    return cells


def _table(stats: BlockFormatStats) -> list[str]:
    head = ["linear", "shape", *(f"{op} {col}" for op in OPERANDS for col in ("sat", "underflow", "SQNR dB")),
            "verdict"]
    failing = {v.linear: v for v in block_verdicts(stats)}
    rows = [["normal data (reference)", "256x256", *_cells(stats.reference),
             f"floor: reference - {BLOCK_SQNR_SLACK_DB:g} dB; underflow bound: max(2 x reference, reference + "
             f"{100 * BLOCK_UNDERFLOW_MARGIN:g} points)"]]
    for linear in stats.linears.values():
        verdict = failing.get(linear.name)
        words = ("not measured" if not linear.operands else
                 verdict.why() if verdict is not None else "ok")
        if linear.kept:
            words += f"; kept by the recipe ({kept_tag(linear.kept)})"
        elif verdict is not None:
            words += ": keep in bf16"
        rows.append([linear.name, "x".join(map(str, linear.shape)), *_cells(linear.operands), words])
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _advice_lines(advice: BlockAdvice) -> list[str]:
    policy = "none (no block policy runs this recipe)" if advice.policy is None else f"`{advice.policy}`"
    recipe = ", ".join(f"{name} ({kept_tag(reason)})" for name, reason in advice.recipe_keeps) or "none"
    return [f"Keep in bf16: {', '.join(advice.keep) or 'nothing beyond the recipe'}; the recipe keeps {recipe}.",
            "", f"Advised policy {block_run(advice.format)}: {policy}", "", *(f"- {r}" for r in advice.reasons), ""]


def block_markdown(report: NumericsStats) -> list[str]:
    """The report's block-format section: per format the advice and a table of every linear's operands (sat:
    blocks with a saturated element; underflow: non-zero elements flushed to zero; SQNR), below a row of normal
    data, the reference. Empty without block formats."""
    if not report.block:
        return []
    lines = ["## Block formats (linears; x: input, W: weight, dy: output gradient, as the recipe's GEMMs read them)",
             ""]
    for stats in report.block:
        lines += [f"### {stats.format} under `{stats.recipe}`", "", *_advice_lines(advise_block(report, stats.format))]
        lines += [*_table(stats), ""]
    return lines


def block_console(report: NumericsStats) -> list[str]:
    """What ``mixprec inspect`` prints per block format: the linears to keep in bf16 (the recipe's, then the
    advised ones) and the advised policy."""
    lines = []
    for stats in report.block:
        advice = advise_block(report, stats.format)
        recipe = [f"{name} ({kept_tag(reason)})" for name, reason in advice.recipe_keeps]
        advised = [f"{v.linear} ({v.why()})" for v in advice.failing if not v.kept]
        lines.append(f"{stats.format}: keep in bf16: {', '.join(recipe + advised) or 'nothing'}")
        policy = "none (no block policy runs this recipe)" if advice.policy is None else str(advice.policy)
        lines.append(f"{stats.format}: {block_run(stats.format)}: {policy}")
    return lines
