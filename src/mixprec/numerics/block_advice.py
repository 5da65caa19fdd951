"""Which linears to keep in bf16 under a block format: the advice read off the inspector's block statistics.

**The rule.** A linear fails a block format when one of its GEMM operands (``x``, ``W``, ``dy``, measured as the
recipe's GEMMs read them: :mod:`mixprec.numerics.block_stats`) has an SQNR more than ``slack_db``
(:data:`BLOCK_SQNR_SLACK_DB`, 3 dB) below the operand's *reference* SQNR, the one the same format and recipe give
i.i.d. normal data (``BlockFormatStats.reference_sqnr_db``: NVFP4 with its recipe about 20 / 19 / 17 dB for
``x`` / ``W`` (16x16 tiles) / ``dy`` (stochastically rounded), MXFP8 about 31.5 dB). A failing linear that the
recipe converts is named in the advised policy's ``block_keep`` (it stays ``nn.Linear`` in bf16); one the recipe
keeps anyway (first/last linear, the bf16 tail, a shape it cannot scale) is reported, not added.

**Why this target, and how it reads as a loss delta.** What the issue's gate judges is the final loss delta
against bf16; what can be measured before the run is each GEMM's quantization error. Under the additive-noise
model of quantization (each quantized operand adds independent error of relative power ``10**(-SQNR/10)`` to its
GEMM's output; the loss moves in proportion to the error power injected, to first order), a linear at its
reference SQNR injects what a well-behaved layer injects in that format, the regime in which the recipes
publish their loss deltas (MXFP8 at parity with bf16, NVFP4 within a few percent: the sources cited in
:mod:`mixprec.blockscale.recipe`). A linear ``d`` dB below injects ``10**(d/10)`` times that error power: at
3 dB, twice, as much as two well-behaved layers, so the model leaves the regime the published delta covers
through that layer. Keeping it in bf16 removes its share. The reference is computed, not tabulated, so every
format and recipe gets its own target; 3 dB is ten times the spread of the measured SQNRs of normal-like
operands (about ±0.3 dB), so a well-behaved layer is not kept by chance. ``slack_db`` is the knob: a smaller
slack is a tighter loss-delta target. What this proxy does not see: a layer whose few flushed blocks carry
little of its norm keeps a good SQNR (the underflow column shows them); the bench's quality gate is the
evidence that the advised policy trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixprec.numerics.block_stats import BlockFormatStats, LinearBlockStats
from mixprec.numerics.figures import num
from mixprec.numerics.patterns import covering_patterns
from mixprec.numerics.stats import NumericsStats
from mixprec.policy.choices import BLOCK_RECIPE_NAMES
from mixprec.policy.linears import block_preset_text
from mixprec.policy.policy import Policy

__all__ = ["BLOCK_SQNR_SLACK_DB", "BlockVerdict", "BlockAdvice", "block_verdicts", "advise_block", "block_risk",
           "judge_block_policy"]

BLOCK_SQNR_SLACK_DB = 3.0   # fail: an operand's SQNR this far below the format's reference (twice its error power)
_MARGINAL_DB = 1.5          # heatmap "marginal": within this of failing


@dataclass(frozen=True)
class BlockVerdict:
    """One failing linear: its worst ``operand`` below its floor (``sqnr_db`` < ``floor_db``) and ``kept``, the
    recipe's reason for keeping it anyway (``""``: the recipe converts it, so the advice keeps it)."""

    linear: str
    operand: str
    sqnr_db: float
    floor_db: float
    kept: str


@dataclass(frozen=True)
class BlockAdvice:
    """The advice for one block format: the ``failing`` linears, the converted ones among them to ``keep`` in bf16
    (qualified names), the linears the recipe keeps itself (``recipe_keeps``: name, reason), and the advised
    ``policy`` (its ``block_keep`` covering ``keep``; None when no policy runs this format's recipe), with
    ``reasons`` in words (module docstring for the rule)."""

    format: str
    recipe: str
    slack_db: float
    failing: tuple[BlockVerdict, ...]
    keep: tuple[str, ...]
    recipe_keeps: tuple[tuple[str, str], ...]
    policy: Policy | None
    reasons: tuple[str, ...]

    def kept_in_bf16(self) -> tuple[str, ...]:
        """Every linear that stays in bf16 under the advice: the recipe's own keeps, then ``keep``."""
        return tuple(name for name, _ in self.recipe_keeps) + self.keep

    def __str__(self) -> str:
        policy = "none (no block policy runs this recipe)" if self.policy is None else str(self.policy)
        return (f"{self.format}: keep in bf16: {', '.join(self.kept_in_bf16()) or 'nothing'}\n"
                f"{self.format}: advised policy: {policy}\n" + "\n".join(f"- {r}" for r in self.reasons))


def _floor(stats: BlockFormatStats, operand: str, slack_db: float) -> float:
    return stats.reference_sqnr_db[operand] - slack_db


def _verdict(stats: BlockFormatStats, linear: LinearBlockStats, slack_db: float) -> BlockVerdict | None:
    """The linear's worst operand relative to its floor, if below it (NaN counts as failing)."""
    worst: BlockVerdict | None = None
    for operand, s in linear.operands.items():
        floor = _floor(stats, operand, slack_db)
        if not s.sqnr_db >= floor and (worst is None or s.sqnr_db - floor < worst.sqnr_db - worst.floor_db):
            worst = BlockVerdict(linear.name, operand, s.sqnr_db, floor, linear.kept)
    return worst


def block_verdicts(stats: BlockFormatStats, slack_db: float = BLOCK_SQNR_SLACK_DB) -> list[BlockVerdict]:
    """Every linear of ``stats`` that fails (module docstring), in model order."""
    if not (isinstance(slack_db, (int, float)) and not isinstance(slack_db, bool) and math.isfinite(slack_db)):
        raise ValueError(f"slack_db={slack_db!r} must be a finite number of dB, e.g. {BLOCK_SQNR_SLACK_DB}")
    found = (_verdict(stats, linear, slack_db) for linear in stats.linears.values())
    return [v for v in found if v is not None]


def _base(stats: BlockFormatStats, base: Policy | None) -> Policy | None:
    if not stats.recipe_name:
        return None
    if base is not None and base.block == stats.recipe_name:
        return base
    return Policy.parse(block_preset_text(stats.recipe_name))


def _words(verdicts: list[BlockVerdict] | tuple[BlockVerdict, ...], limit: int = 4) -> str:
    items = [f"{v.linear} ({v.operand} {num(v.sqnr_db, 3)} dB < {v.floor_db:.1f})" for v in verdicts[:limit]]
    return ", ".join(items) + (f" and {len(verdicts) - limit} more" if len(verdicts) > limit else "")


def advise_block(report: NumericsStats, fmt: str, *, base: Policy | None = None,
                 slack_db: float = BLOCK_SQNR_SLACK_DB) -> BlockAdvice:
    """The advice for block format ``fmt`` of ``report`` (module docstring). ``base``: the policy to extend when it
    runs the recipe ``fmt`` was inspected under (its ``block_keep`` is kept), else the recipe's preset.

    Raises:
        ValueError: ``fmt`` was not inspected; ``slack_db`` not a finite number.
    """
    stats = report.block_stats(fmt)
    verdicts = block_verdicts(stats, slack_db)
    keep = tuple(v.linear for v in verdicts if not v.kept)
    recipe_keeps = tuple((n, s.kept) for n, s in stats.linears.items() if s.kept)
    reasons = [f"{stats.format} under {stats.recipe}: a linear is kept in bf16 when an operand's SQNR is more than "
               f"{slack_db:g} dB below what the recipe gives normal data (x {stats.reference_sqnr_db['x']:.1f}, "
               f"W {stats.reference_sqnr_db['W']:.1f}, dy {stats.reference_sqnr_db['dy']:.1f} dB)"]
    if keep:
        reasons.append(f"block_keep: {_words([v for v in verdicts if not v.kept])}")
    else:
        reasons.append("no linear the recipe converts is below its floor: nothing to add to the recipe's own keeps")
    if any(v.kept for v in verdicts):
        reasons.append(f"below the floor but kept by the recipe already: {_words([v for v in verdicts if v.kept])}")
    policy = _base(stats, base)
    if policy is None:
        reasons.append(f"no policy runs {stats.format} linears (the block recipes: {', '.join(BLOCK_RECIPE_NAMES)}); "
                       "the advice names the linears only")
    elif keep:
        bad = [n for n in keep if any(c in n for c in ",=| ")]
        patterns = covering_patterns([n for n in keep if n not in bad], report.module_names,
                                     allowed=[n for n, _ in recipe_keeps])
        policy = policy.replace(block_keep=tuple(dict.fromkeys(policy.block_keep + patterns)))
        if bad:
            reasons.append(f"cannot name {bad} in block_keep (',', '=', '|' or spaces); rename them")
    return BlockAdvice(stats.format, stats.recipe, float(slack_db), tuple(verdicts), keep, recipe_keeps, policy,
                       tuple(reasons))


def block_risk(report: NumericsStats, module: str, fmt: str) -> tuple[int, str]:
    """(level, short text) of one heatmap cell: 2 failing (text: the operand and its SQNR), 1 within
    ``_MARGINAL_DB`` of the floor, 0 fine (text: the worst SQNR); ``(-1, "")`` for a module that is no measured
    linear. A linear the recipe keeps gets the text ``kept``."""
    stats = report.block_stats(fmt)
    linear = stats.linears.get(module)
    worst = None if linear is None else linear.worst()
    if worst is None:
        return (-1, "kept" if linear is not None and linear.kept else "")
    verdict = _verdict(stats, linear, BLOCK_SQNR_SLACK_DB)
    suffix = " (kept)" if linear.kept else ""
    if verdict is not None:
        return 2, f"{verdict.operand} {verdict.sqnr_db:.0f} dB{suffix}"
    margin = min(s.sqnr_db - _floor(stats, op, BLOCK_SQNR_SLACK_DB) for op, s in linear.operands.items())
    return (1 if margin < _MARGINAL_DB else 0), f"{worst[0]} {worst[1]:.0f} dB{suffix}"


def judge_block_policy(report: NumericsStats, policy: Policy) -> tuple[Policy, list[str]]:
    """A block policy under study judged on the report: ``policy`` with ``block_keep`` extended by the advice of
    the block format inspected under its recipe, and the reasons (unchanged, with a reason saying so, when no
    block format was inspected under it; unchanged without ``block``)."""
    if policy.block is None:
        return policy, []
    for stats in report.block:
        if stats.recipe_name == policy.block:
            advice = advise_block(report, stats.format, base=policy)
            return advice.policy, list(advice.reasons)
    return policy, [f"block={policy.block}: its block-scaled linears are not judged here (no block format was "
                    f"inspected under that recipe; add its format, e.g. formats=...,nvfp4); the bench's quality gate "
                    "against bf16 is their evidence"]
