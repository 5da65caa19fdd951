"""Precision advice: small pure functions from a :class:`~mixprec.numerics.NumericsReport` to flags
and a :class:`Recommendation`. They read only its statistics
(:class:`~mixprec.numerics.stats.NumericsStats`), never its views.

Rules (thresholds are the module constants below; formats come from :mod:`mixprec.formats`):

* **Flags** (:func:`flags`, per leaf module and format; "unsafe to run this module in it"):

  - ``overflow``: some forward output exceeds the format's max (16/32-bit formats; fp8 is always
    used with a scale, which cannot overflow by construction);
  - ``underflow``: more than :data:`FLUSH_LIMIT` of the non-zero outputs round to zero (fp8: at
    the best per-tensor scale) and they carry more than :data:`FLUSH_ENERGY_LIMIT` of the
    tensor's squared norm. The second condition spares fp32 rounding noise around a gradient
    that is zero in exact arithmetic (the key bias of attention: softmax ignores a shift shared
    by all keys), which flushes harmlessly;
  - ``grad overflow`` / ``grad underflow``: the same for the gradients of the module's outputs and
    of its parameters, judged at a loss scale (fp8: at the best per-tensor scale instead);
  - ``error``: the output's SQNR against fp32 is below :func:`sqnr_limit_db` of the format
    (``-inf`` when the output is non-finite).

* **Loss scale** (:func:`safe_loss_scale`): the largest power of two ``s`` with
  ``grad_amax * s * LOSS_SCALE_MARGIN <= fp16.max``. The margin (8, three doublings) leaves
  room for gradients to grow after the few inspected steps; an overflow beyond it costs one
  skipped step per halving of the dynamic scale.

* **Recommendation** (:func:`recommend`): start from the policy under study, or, when that is
  fp32 (no preference), from what ``auto`` picks by its own rule on its own measurement of this model
  (``report.speed``, :func:`mixprec.numerics.workload.measure_speed`: fp32 when no 16-bit candidate
  trains faster by ``auto``'s margin, else that candidate), so the advice and ``auto`` never contradict each
  other on one workload and machine; without that measurement, from ``bf16-mixed`` (bf16 has fp32's
  exponent range) if bf16 was inspected, else ``fp16-mixed``; keep the modules flagged in the compute format in fp32 (``keep_fp32``
  patterns); under fp16 use dynamic loss scaling starting at the recommended scale; keep fp32
  master weights when more than :data:`LOST_UPDATE_LIMIT` of all updates, or more than
  :data:`PARAM_LOST_UPDATE_LIMIT` of one parameter's, would be lost in the parameters' 16-bit
  format (or use Kahan / stochastic rounding).

* **Block formats** (:mod:`mixprec.numerics.block_advice`): per inspected block format, the linears to keep in
  bf16 and the block policy with their ``block_keep`` (``Recommendation.block``); a block policy under study
  gets its ``block_keep`` extended the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mixprec.formats import Format, get_format
from mixprec.numerics.block_advice import BlockAdvice, advise_block, judge_block_policy
from mixprec.numerics.figures import count, num, pct, pow2
from mixprec.numerics.patterns import covering_patterns
from mixprec.numerics.starting_policy import starting_policy
from mixprec.numerics.stats import ModuleStats, NumericsStats, RangeStats
from mixprec.policy.policy import PRESETS, Policy

__all__ = ["Flag", "Recommendation", "FLUSH_LIMIT", "FLUSH_ENERGY_LIMIT", "LOST_UPDATE_LIMIT",
           "PARAM_LOST_UPDATE_LIMIT", "LOSS_SCALE_MARGIN", "SQNR_SLACK_DB",
           "sqnr_limit_db", "safe_loss_scale", "module_flags", "flags", "risk", "keep_fp32_patterns",
           "check_policy_formats", "recommend"]

FLUSH_LIMIT = 0.01          # a module is flagged when > 1 % of its non-zero values round to zero
FLUSH_ENERGY_LIMIT = 1e-6   # ... and they carry > 1e-6 of the squared norm (0.1 % of the norm)
LOST_UPDATE_LIMIT = 0.01    # masters are advised when > 1 % of intended updates would be lost ...
PARAM_LOST_UPDATE_LIMIT = 0.1  # ... or > 10 % of one parameter's (LayerNorm gains that never move)
LOSS_SCALE_MARGIN = 8.0     # headroom of the recommended loss scale: grad_amax * scale * 8 <= fp16 max
SQNR_SLACK_DB = 20.0        # flag a module whose SQNR is this far below one rounding's SQNR
MARGINAL_DB = 10.0          # risk "marginal" within this many dB above the limit
SUBNORMAL_MARGINAL = 0.1    # risk "marginal" when > 10 % of non-zero values are subnormal


@dataclass(frozen=True)
class Flag:
    """One reason why ``module`` is unsafe in ``format``: ``kind`` is ``overflow``, ``underflow``,
    ``grad overflow``, ``grad underflow`` or ``error``; ``value`` is the number the rule read
    (an amax, a fraction, or an SQNR in dB), ``reason`` says it in words."""

    module: str
    reason: str
    value: float
    kind: str = ""
    format: str = ""


@dataclass(frozen=True)
class Recommendation:
    """The advised policy (concrete, with ``keep_fp32`` patterns for unsafe modules), the initial
    loss scale for fp16 (``None`` without loss scaling; pass it as
    ``DynamicLossScale(init_scale=...)``), the reasons in plain words, and ``block``: per inspected block
    format, which linears to keep in bf16 and the block policy that does
    (:class:`~mixprec.numerics.block_advice.BlockAdvice`)."""

    policy: Policy
    initial_loss_scale: float | None
    reasons: tuple[str, ...]
    block: tuple[BlockAdvice, ...] = ()

    def __str__(self) -> str:
        scale = "" if self.initial_loss_scale is None else f" (initial loss scale {pow2(self.initial_loss_scale)})"
        return "\n".join([f"{self.policy}{scale}", *(f"- {r}" for r in self.reasons), *map(str, self.block)])


# ---------------------------------------------------------------------- thresholds
def sqnr_limit_db(fmt: Format) -> float:
    """The SQNR below which a module is flagged in ``fmt``.

    One round-to-nearest with ``m`` mantissa bits has a relative error uniform in
    ``±2**-(m+1)``, i.e. an SQNR of about ``6.02 * (m + 1) + 4.77`` dB (fp16 71, bf16 53,
    e4m3 29, e5m2 23); a module whose output is :data:`SQNR_SLACK_DB` worse than that loses
    far more than rounding its operands explains.
    """
    return 6.02 * (fmt.mantissa_bits + 1) + 4.77 - SQNR_SLACK_DB


def safe_loss_scale(grad_amax: float, fmt: Format | str = "fp16", margin: float = LOSS_SCALE_MARGIN) -> float:
    """Largest power of two ``s`` with ``grad_amax * s * margin <= fmt.max`` (may be < 1).

    ``grad_amax == 0`` gives ``inf`` (any scale is safe); a non-finite ``grad_amax`` gives 0.0.
    Exact: only multiplications by powers of two.
    """
    fmt = get_format(fmt)
    if grad_amax == 0:
        return math.inf
    if not math.isfinite(grad_amax):
        return 0.0
    scale = 2.0 ** math.floor(math.log2(fmt.max / (margin * grad_amax)))
    while grad_amax * scale * margin > fmt.max:
        scale /= 2
    while grad_amax * scale * 2 * margin <= fmt.max:
        scale *= 2
    return scale


# ---------------------------------------------------------------------- flags
def _grad_stats(report: NumericsStats, m: ModuleStats, fmt: Format, i: int) -> list[tuple[str, RangeStats]]:
    """(what, stats) for the module's output gradients and its parameters' gradients."""
    eight = fmt.bits == 8
    out = [("output gradients", m.grad_output_scaled[fmt.name] if eight else m.grad_output[fmt.name][i])]
    for name in m.params:
        p = report.params[name]
        out.append((f"gradients of {name}", p.grad_scaled[fmt.name] if eight else p.grad[fmt.name][i]))
    return out


def _flushes(stats: RangeStats) -> bool:
    return stats.flushed > FLUSH_LIMIT and stats.flushed_energy > FLUSH_ENERGY_LIMIT


def module_flags(report: NumericsStats, m: ModuleStats, fmt: Format, loss_scale: float) -> list[Flag]:
    """The flags of one module in one format, gradients judged at ``loss_scale`` (module docstring)."""
    found: list[Flag] = []
    eight = fmt.bits == 8
    where = "at the best per-tensor scale" if eight else f"at loss scale {pow2(loss_scale)}"
    act = m.activation_scaled[fmt.name] if eight else m.activation[fmt.name]
    if not eight and act.overflow > 0:
        found.append(Flag(m.name, f"activations reach {num(act.amax)} > {fmt} max {fmt.max:.6g} "
                                  f"({pct(act.overflow)} of elements)", act.amax, "overflow", fmt.name))
    if _flushes(act):
        found.append(Flag(m.name, f"{pct(act.flushed)} of non-zero activations round to zero in {fmt}"
                                  + (" at the best per-tensor scale" if eight else ""), act.flushed, "underflow",
                          fmt.name))
    i = report.scale_index(loss_scale)
    for what, g in _grad_stats(report, m, fmt, i):
        if g.overflow > 0:
            found.append(Flag(m.name, f"{what} reach {num(g.amax * g.scale)} {where} > {fmt} max {fmt.max:.6g}",
                              g.amax * g.scale, "grad overflow", fmt.name))
        if _flushes(g):
            found.append(Flag(m.name, f"{pct(g.flushed)} of non-zero {what} flush to zero in {fmt} {where}",
                              g.flushed, "grad underflow", fmt.name))
    err = m.error.get(fmt.name)
    limit = sqnr_limit_db(fmt)
    if err is not None and not err.sqnr_db >= limit:  # also catches NaN
        text = ("non-finite output" if not math.isfinite(err.rel_error) else
                f"output SQNR {num(err.sqnr_db, 3)} dB < {limit:.0f} dB (relative error {pct(err.rel_error)})")
        found.append(Flag(m.name, f"{text} when run in {fmt}", err.sqnr_db, "error", fmt.name))
    return found


def _default_scale(report: NumericsStats, fmt: Format) -> float:
    return report.recommended_loss_scale if fmt.dtype == torch.float16 else 1.0


def flags(report: NumericsStats, fmt: str | Format, *, loss_scale: float | None = None) -> list[Flag]:
    """Every flag of every leaf module in ``fmt`` (model order). ``loss_scale=None``: the scale the
    advice uses (the recommended one for fp16, 1.0 otherwise).

    Raises:
        ValueError: ``fmt`` was not inspected, or ``loss_scale`` is not one of ``report.loss_scales``.
    """
    fmt = get_format(fmt)
    if fmt.name not in report.formats:
        raise ValueError(f"format {fmt.name!r} was not inspected; the report holds {list(report.formats)}")
    scale = _default_scale(report, fmt) if loss_scale is None else loss_scale
    return [f for m in report.modules.values() for f in module_flags(report, m, fmt, scale)]


def risk(report: NumericsStats, module: str, fmt: str, *, loss_scale: float | None = None) -> tuple[int, str]:
    """(level, short text) for one heatmap cell: 2 flagged (text: the first flag's kind), 1 marginal
    (more than :data:`SUBNORMAL_MARGINAL` subnormal or more than a tenth of :data:`FLUSH_LIMIT`
    flushed, carrying more than :data:`FLUSH_ENERGY_LIMIT` of the squared norm; or an SQNR within
    :data:`MARGINAL_DB` of the limit; text: which), 0 fine (text: the SQNR)."""
    f = get_format(fmt)
    m = report.modules[module]
    scale = _default_scale(report, f) if loss_scale is None else loss_scale
    found = module_flags(report, m, f, scale)
    if found:
        return 2, found[0].kind
    err = m.error.get(f.name)
    sqnr = "" if err is None else f"SQNR {err.sqnr_db:.0f} dB"
    eight = f.bits == 8
    act = m.activation_scaled[f.name] if eight else m.activation[f.name]
    stats = [("act", act)] + [("grad", s) for _, s in _grad_stats(report, m, f, report.scale_index(scale))]
    for what, s in stats:
        if s.subnormal > SUBNORMAL_MARGINAL and s.subnormal_energy > FLUSH_ENERGY_LIMIT:
            return 1, f"{what} sub {pct(s.subnormal)}"
        if _flushes(s) or s.flushed > FLUSH_LIMIT / 10 and s.flushed_energy > FLUSH_ENERGY_LIMIT:
            return 1, f"{what} flush {pct(s.flushed)}"
    if err is not None and err.sqnr_db < sqnr_limit_db(f) + MARGINAL_DB:
        return 1, sqnr
    return 0, sqnr


# ---------------------------------------------------------------------- recommendation
def keep_fp32_patterns(flagged: list[str], module_names: tuple[str, ...]) -> tuple[str, ...]:
    """Glob patterns covering exactly the ``flagged`` modules (:func:`~mixprec.numerics.patterns.covering_patterns`:
    ``blocks.3.fc`` generalised to ``blocks.*.fc`` when every module that matches is flagged)."""
    return covering_patterns(flagged, module_names)


def _compute_formats(policy: Policy) -> list[Format]:
    fmts = [get_format(policy.compute_dtype)] if policy.is_mixed else []
    if policy.param_dtype != torch.float32 and get_format(policy.param_dtype) not in fmts:
        fmts.append(get_format(policy.param_dtype))
    if policy.fp8 is not None:
        fmts.append(get_format("e4m3"))
    return fmts


def _summarise(found: list[Flag], fmt: str, limit: int = 3) -> str:
    by_module: dict[str, Flag] = {}
    for f in found:
        by_module.setdefault(f.module, f)
    items = [f"{name} ({flag.reason})" for name, flag in list(by_module.items())[:limit]]
    more = f" and {len(by_module) - limit} more" if len(by_module) > limit else ""
    return f"{count(len(by_module), 'module')} unsafe in {fmt}: " + "; ".join(items) + more


def _compare_fp16(report: NumericsStats) -> str | None:
    """One sentence on what fp16 would do at loss scale 1, for a bf16 recommendation."""
    if "fp16" not in report.formats:
        return None
    found = flags(report, "fp16", loss_scale=1.0)
    over = [f for f in found if f.kind == "overflow"]
    under = {f.module for f in found if f.kind == "grad underflow"}
    parts = []
    if over:
        worst = max(over, key=lambda f: f.value)
        parts.append(f"{count(len({f.module for f in over}), 'module')} overflow fp16 "
                     f"({worst.module} reaches {num(worst.value)})")
    if under:
        parts.append(f"the gradients of {count(len(under), 'module')} flush to zero in fp16 without loss scaling")
    return "; ".join(parts) if parts else None


def _loss_scale_advice(report: NumericsStats, policy: Policy) -> tuple[Policy, float | None, list[str]]:
    fp16 = policy.compute_dtype == torch.float16 or policy.param_dtype == torch.float16
    if not fp16:
        if policy.loss_scale != "none":
            return policy.replace(loss_scale="none"), None, [
                "loss_scale=none: bf16 has fp32's exponent range, loss scaling does nothing useful"]
        return policy, None, []
    scale = report.recommended_loss_scale
    at_one = {f.module for f in flags(report, "fp16", loss_scale=1.0) if f.kind == "grad underflow"}
    text = (f"fp16 gradients: largest |gradient| {num(report.grad_amax)}; loss scale {pow2(scale)} keeps every "
            f"gradient <= fp16 max / {num(report.loss_scale_margin)} (largest safe power of two: "
            f"{pow2(report.max_safe_loss_scale)})")
    if at_one:
        text += (f"; at loss scale 1 the gradients of {count(len(at_one), 'module')} flush to zero "
                 f"({', '.join(sorted(at_one)[:3])}{', ...' if len(at_one) > 3 else ''})")
    if report.max_safe_loss_scale < 1:
        text += (f"; even at loss scale 1 the largest gradient is within the {num(report.loss_scale_margin)}x margin "
                 "of fp16 max (modules whose gradients overflow fp16 are kept fp32)")
    if isinstance(policy.loss_scale, str):
        text += f" → dynamic loss scaling starting at {pow2(scale)} (DynamicLossScale(init_scale={scale:g}))"
        return policy.replace(loss_scale="dynamic"), scale, [text]
    text += f" → static loss scale {pow2(scale)} (was {policy.loss_scale:g})"
    return policy.replace(loss_scale=scale), scale, [text]


def _storage_advice(report: NumericsStats, policy: Policy) -> tuple[Policy, list[str]]:
    half = policy.param_dtype if policy.param_dtype != torch.float32 else (
        policy.compute_dtype if policy.is_mixed else None)
    if half is None:
        return policy, []
    fmt = get_format(half).name
    if fmt not in report.storage_formats:
        return policy, []
    lost = report.lost_update(fmt)
    worst = max(report.params.values(), key=lambda p: p.lost_update(fmt), default=None)
    worst_lost = worst.lost_update(fmt) if worst is not None else 0.0
    detail = f"lost-update fraction in {fmt} without master weights {pct(lost)}"
    if worst is not None and lost > 0:
        detail += f" ({worst.name} {pct(worst_lost)})"
    alternatives = "or use Kahan / stochastic rounding (rounding=kahan, or bf16-sr for bf16)"
    harmless = lost <= LOST_UPDATE_LIMIT and worst_lost <= PARAM_LOST_UPDATE_LIMIT
    if policy.param_dtype == torch.float32:
        if harmless:
            return policy, [f"{detail}: 16-bit parameters would keep their updates"]
        return policy, [f"{detail} → keep master weights: this policy keeps parameters in fp32 (their own masters); "
                        f"with 16-bit parameters use master=fp32, {alternatives}"]
    if policy.has_masters:
        return policy, [f"{detail}: the fp32 master weights keep them"]
    if policy.rounding != "nearest":
        return policy, [f"{detail} with round-to-nearest: rounding={policy.rounding} compensates"]
    if harmless:
        return policy, [f"{detail}: {fmt} parameters without masters are fine"]
    return policy.replace(master_dtype=torch.float32), [f"{detail} → keep master weights (master=fp32), {alternatives}"]


def check_policy_formats(policy: Policy, formats: Iterable[str]) -> None:
    """Raise ValueError (naming ``formats``, the missing names and the fix) unless ``formats`` (names) hold every
    format ``policy`` computes or stores in, which its advice reads; :func:`mixprec.numerics.inspect` checks first."""
    formats = tuple(formats)
    missing = tuple(f.name for f in _compute_formats(policy) if f.name not in formats)
    if missing:
        raise ValueError(f"inspect formats={','.join(formats)}: the policy under study, {policy}, computes in "
                         f"{','.join(missing)}, which its advice reads; add it: formats={','.join(formats + missing)} "
                         f"(mixprec inspect --formats {','.join(formats + missing)})")


def recommend(report: NumericsStats) -> Recommendation:
    """The advised policy for ``report`` (module docstring for the rules)."""
    policy, why = starting_policy(report)
    policy, block_reasons = judge_block_policy(report, policy)
    reasons = [why] + block_reasons
    per_format = tuple(advise_block(report, fmt) for fmt in report.block_formats)
    if report.losses and not all(math.isfinite(x) for x in report.losses):
        reasons.append("the fp32 reference loss was non-finite: fix the model or data first, precision cannot")
    if not policy.is_mixed and policy.param_dtype == torch.float32:
        return Recommendation(policy, None, tuple(reasons), per_format)
    if policy.compute_dtype == torch.bfloat16 and policy == PRESETS["bf16-mixed"]:
        compare = _compare_fp16(report)
        if compare:
            reasons[0] += f" (fp16 instead: {compare})"
    check_policy_formats(policy, report.formats)
    unsafe: list[str] = []
    for fmt in _compute_formats(policy):
        found = flags(report, fmt)
        if found:
            reasons.append(_summarise(found, fmt.name))
        unsafe += [f.module for f in found if f.module not in unsafe]
    if "" in unsafe:
        return Recommendation(PRESETS["fp32"], None, tuple(
            reasons + ["the model has no submodules and is itself unsafe: train it in fp32"]), per_format)
    policy, scale, loss_reasons = _loss_scale_advice(report, policy)
    if unsafe:
        bad = [n for n in unsafe if any(c in n for c in ",=| ")]
        patterns = keep_fp32_patterns([n for n in unsafe if n not in bad], report.module_names)
        keep = tuple(dict.fromkeys(policy.keep_fp32 + patterns))
        policy = policy.replace(keep_fp32=keep)
        reasons.append(f"keep_fp32={'|'.join(patterns)}: these modules run in fp32 with autocast off")
        if bad:
            reasons.append(f"cannot name {bad} in keep_fp32 (',', '=', '|' or spaces); rename them or train in fp32")
    policy, storage_reasons = _storage_advice(report, policy)
    return Recommendation(policy, scale, tuple(reasons + loss_reasons + storage_reasons), per_format)
