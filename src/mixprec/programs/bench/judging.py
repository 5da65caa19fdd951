"""Each row against the fp32 reference: its deltas (speedup, memory ratios, relative eval-loss delta) and its
verdict (:func:`mixprec.programs.bench.verdict.judge`), read against the seed-noise band, the peer's own gate and a
smoke test's limits. A row of block-scaled linears (``mxfp8-mixed``, ``nvfp4-mixed``) says when its GEMMs were emulated."""

from __future__ import annotations

import math
from dataclasses import replace

from mixprec.policy.policy import Policy
from mixprec.programs.bench.config import REFERENCE
from mixprec.programs.bench.peer import peer_targets
from mixprec.programs.bench.results import PolicyRun
from mixprec.programs.bench.step_memory import memory_ratios
from mixprec.programs.bench.verdict import Targets, judge

__all__ = ["judge_policies"]


def judge_policies(entries: dict[str, PolicyRun], targets: Targets, *, noisy: bool = False,
                   seed_noise: dict | None = None, smoke: str | None = None) -> dict[str, PolicyRun]:
    """``entries`` with the deltas vs fp32 and a verdict added to every row; ``noisy`` timings give no speed
    verdict; with ``seed_noise`` (results.json's) each reason says whether the loss delta lies within the seed band;
    ``smoke`` (what a smoke test did not establish): a PASS becomes ``SMOKE``, its reason led by these words."""
    ref = entries[REFERENCE]
    if ref.error is None and ref.skipped_reason is None and ref.final_eval_loss is None:
        ref = replace(ref, error="the fp32 eval loss is not finite: the reference diverged")
        entries = {**entries, REFERENCE: ref}
    ref_error = ref.error or (ref.skipped_reason and f"fp32 did not run: {ref.skipped_reason}")
    judged = {}
    for name, e in entries.items():
        row_targets, peer_note = peer_targets(name, targets)   # the peer: the quality gate alone
        if e.step_time_ms_median is not None and ref_error is None:
            loss, ref_loss = e.final_eval_loss, ref.final_eval_loss
            e = replace(e, speedup_vs_fp32=ref.step_time_ms_median / e.step_time_ms_median,
                        memory_ratio_vs_fp32=e.peak_memory_mb / ref.peak_memory_mb, **memory_ratios(e, ref),
                        eval_loss_delta_vs_fp32=None if loss is None else (loss - ref_loss) / ref_loss)
        error = e.error
        if name != REFERENCE and ref_error is not None and error is None and e.skipped_reason is None:
            error = f"no fp32 reference to compare with ({ref_error})"
        diverged = e.step_time_ms_median is not None and e.final_eval_loss is None
        verdict = judge(targets=row_targets, loss_delta=math.nan if diverged else e.eval_loss_delta_vs_fp32,
                        speedup=None if noisy else e.speedup_vs_fp32, memory_ratio=e.memory_ratio_vs_fp32,
                        reference=name == REFERENCE, skipped_reason=e.skipped_reason, error=error)
        note = ("" if e.skipped_reason else peer_note) + \
            ("; timings noisy: no speed verdict" if noisy and e.speedup_vs_fp32 is not None else "") + _emulated(e)
        delta, band = e.eval_loss_delta_vs_fp32, (seed_noise or {}).get("relative_spread")
        if band is not None and delta is not None and math.isfinite(delta):
            note += f"; {'within' if abs(delta) <= band else 'outside'} seed noise (±{band:.2%})"
        reason = verdict.reason + (note if name != REFERENCE else "")
        if smoke is not None and verdict.verdict == "PASS":
            verdict, reason = replace(verdict, verdict="SMOKE"), f"{smoke}; {reason}"
        judged[name] = replace(e, verdict=verdict.verdict, reason=reason)
    return judged


def _emulated(e: PolicyRun) -> str:
    """The reason's words for a row whose policy ran block-scaled linears emulated (its decision says how they ran;
    "" for native GEMMs and other rows)."""
    if e.decision and "block-scaled linears" in e.decision and "emulated on" not in e.decision:
        return ""
    try:
        block = Policy.parse(e.policy).block if e.policy and e.step_time_ms_median is not None else None
    except ValueError:   # a row that never resolved its policy
        return ""
    return (f"; {block} linears emulated (exact dequantize + fp32 GEMM, no native block-scaled matmul on this device): its speed "
            "is not representative" if block else "")
