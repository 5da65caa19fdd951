"""Which linears to keep in bf16 under a block format: the advice read off the inspector's block statistics.

**The rule.** A linear fails a block format when one of its GEMM operands (``x``, ``W``, ``dy``, measured as the
recipe's GEMMs read them: :mod:`mixprec.numerics.block_stats`) has an SQNR more than ``slack_db``
(:data:`BLOCK_SQNR_SLACK_DB`, 3 dB) below the operand's *reference* SQNR, or flushes to zero a share of its
non-zero elements above the operand's *underflow bound* (:func:`underflow_bound`: twice the reference's share
and at least :data:`BLOCK_UNDERFLOW_MARGIN`, 10 percentage points, above it), the one the same format and recipe give
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
slack is a tighter loss-delta target.

**Why an underflow bound too.** SQNR weighs each element by its power, so an operand whose blocks hold a few
large elements among many small ones keeps a good SQNR while the small ones are flushed: a weight of 0.01s with
one 3.0 per 16x16 tile loses 99.6 % of its elements in NVFP4 at an SQNR far above the floor, because the large
elements carry the signal power. A GEMM reads each flushed element as zero; what the small elements add up to
over a contraction (a bias, a direction the large ones do not span) is gone, which the additive-noise model
behind the SQNR rule does not see. So the flushed share is judged on its own, against the same reference: normal
data flushes what the format's block scale implies (NVFP4 about 7 % of ``x`` and ``dy`` and 10 % of ``W``,
MXFP8 about none). The bound mirrors the 3 dB slack (twice the error power): twice the reference's share, twice
the elements a well-behaved operand loses; and at least 10 points above it, so that a format whose reference
flushes nearly nothing (MXFP8) does not flag an operand for a few tiny elements. Measured operands of gpt/tiny
lie within 4 points of the reference (NVFP4: 6.3-10.6 % against 6.7-10.2 %), far from either bound. What
neither criterion sees: a layer whose few flushed elements matter more than their share; the bench's quality
gate is the evidence that the advised policy trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixprec.numerics.block_stats import BlockFormatStats, LinearBlockStats
from mixprec.numerics.figures import num, pct
from mixprec.numerics.patterns import covering_patterns
from mixprec.numerics.stats import NumericsStats
from mixprec.policy.choices import BLOCK_RECIPE_NAMES
from mixprec.policy.linears import block_preset_text
from mixprec.policy.policy import Policy

__all__ = ["BLOCK_SQNR_SLACK_DB", "BLOCK_UNDERFLOW_MARGIN", "underflow_bound", "BlockVerdict", "BlockAdvice",
           "block_run", "block_verdicts", "advise_block", "block_risk", "judge_block_policy"]

BLOCK_SQNR_SLACK_DB = 3.0   # fail: an operand's SQNR this far below the format's reference (twice its error power)
BLOCK_UNDERFLOW_MARGIN = 0.10   # fail: a flushed share at least this far above the reference's (and twice it)
_MARGINAL_DB = 1.5          # heatmap "marginal": within this of failing


@dataclass(frozen=True)
class BlockVerdict:
    """One failing linear: the ``operand`` that fails and ``kept``, the recipe's reason for keeping it anyway
    (``""``: the recipe converts it, so the advice keeps it). ``criterion`` ``"sqnr"``: the operand furthest below
    its floor (``sqnr_db`` < ``floor_db``); ``"underflow"`` (no operand below its SQNR floor): the operand furthest
    above its underflow bound (``underflow`` > ``underflow_bound``, shares of its non-zero elements). Every field
    is filled for the failing operand whichever the criterion."""

    linear: str
    operand: str
    sqnr_db: float
    floor_db: float
    kept: str
    criterion: str = "sqnr"
    underflow: float = 0.0
    underflow_bound: float = 1.0

    def why(self) -> str:
        """The failure in words, e.g. ``"W SQNR 7.6 dB < 16.1"`` or ``"W underflow 99.6% > 20.4%"``."""
        if self.criterion == "underflow":
            return f"{self.operand} underflow {pct(self.underflow)} > {pct(self.underflow_bound)}"
        return f"{self.operand} SQNR {num(self.sqnr_db, 3)} dB < {self.floor_db:.1f}"


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
                f"{self.format}: {block_run(self.format)}: {policy}\n" + "\n".join(f"- {r}" for r in self.reasons))


def block_run(fmt: str) -> str:
    """Whose advice a block format's policy is, in words: ``"for an nvfp4 run (native block-scaled GEMMs: NVIDIA
    Blackwell, e.g. B200; emulated, and slower than bf16, elsewhere)"``, so it does not read as a rival of the
    elementwise advice, which is for the device the inspector ran on."""
    article = "an" if fmt[:1] in "aeimnosx" else "a"
    return (f"for {article} {fmt} run (native block-scaled GEMMs: NVIDIA Blackwell, e.g. B200; emulated, and slower "
            "than bf16, elsewhere)")


def _floor(stats: BlockFormatStats, operand: str, slack_db: float) -> float:
    return stats.reference_sqnr_db[operand] - slack_db


def underflow_bound(reference_underflow: float) -> float:
    """The largest flushed share (0..1) of an operand's non-zero elements that passes, given the share the
    reference (normal data) flushes: ``max(2 * reference, reference + BLOCK_UNDERFLOW_MARGIN)`` (module
    docstring), e.g. 0.204 for NVFP4's ``W`` (reference 0.102), 0.10 for a reference of 0."""
    return max(2 * reference_underflow, reference_underflow + BLOCK_UNDERFLOW_MARGIN)


def _verdict(stats: BlockFormatStats, linear: LinearBlockStats, slack_db: float) -> BlockVerdict | None:
    """The linear's worst operand below its SQNR floor (NaN counts as failing), else its worst above its underflow
    bound, else None."""
    found: list[tuple[int, float, BlockVerdict]] = []
    for operand, s in linear.operands.items():
        floor, bound = _floor(stats, operand, slack_db), underflow_bound(stats.reference[operand].underflow)
        fields = (linear.name, operand, s.sqnr_db, floor, linear.kept)
        if not s.sqnr_db >= floor:
            found.append((0, s.sqnr_db - floor, BlockVerdict(*fields, "sqnr", s.underflow, bound)))
        elif s.underflow > bound:
            found.append((1, bound - s.underflow, BlockVerdict(*fields, "underflow", s.underflow, bound)))
    if not found:
        return None
    return min(found, key=lambda f: (f[0], -math.inf if math.isnan(f[1]) else f[1]))[2]   # SQNR first, then worst


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
    items = [f"{v.linear} ({v.why()})" for v in verdicts[:limit]]
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
    ref, bound = stats.reference, {op: underflow_bound(s.underflow) for op, s in stats.reference.items()}
    reasons = [f"{stats.format} under {stats.recipe}: a linear is kept in bf16 when an operand's SQNR is more than "
               f"{slack_db:g} dB below what the recipe gives normal data (x {ref['x'].sqnr_db:.1f}, "
               f"W {ref['W'].sqnr_db:.1f}, dy {ref['dy'].sqnr_db:.1f} dB) or it flushes more of its non-zero "
               f"elements than twice normal data's share and {100 * BLOCK_UNDERFLOW_MARGIN:g} points above it (x "
               f"{pct(bound['x'])}, W {pct(bound['W'])}, dy {pct(bound['dy'])})"]
    if keep:
        reasons.append(f"block_keep: {_words([v for v in verdicts if not v.kept])}")
    else:
        reasons.append("no linear the recipe converts fails either criterion: nothing to add to the recipe's own keeps")
    if any(v.kept for v in verdicts):
        reasons.append(f"failing but kept by the recipe already: {_words([v for v in verdicts if v.kept])}")
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
    """(level, short text) of one heatmap cell: 2 failing (text: the operand and its SQNR, or its flushed share), 1
    within ``_MARGINAL_DB`` of the floor, 0 fine (text: the worst SQNR); ``(-1, "")`` for a module that is no measured
    linear. A linear the recipe keeps gets the text ``kept``."""
    stats = report.block_stats(fmt)
    linear = stats.linears.get(module)
    worst = None if linear is None else linear.worst()
    if worst is None:
        return (-1, "kept" if linear is not None and linear.kept else "")
    verdict = _verdict(stats, linear, BLOCK_SQNR_SLACK_DB)
    suffix = " (kept)" if linear.kept else ""
    if verdict is not None and verdict.criterion == "underflow":
        return 2, f"{verdict.operand} flushed {verdict.underflow:.0%}{suffix}"
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
