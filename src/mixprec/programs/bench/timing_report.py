"""How a bench's step times were measured, as the console and report.md say it: the method, the spread, whether
they are noisy, where the run's wall time went."""

from __future__ import annotations

__all__ = ["timing_lines"]


def _malloc_text(malloc_env: dict | None) -> str:
    """How the timing workers' malloc was set (their step time is compute, not page faults: interleaved.TIMING_MALLOC_ENV)."""
    if not malloc_env:
        return ""
    return "; malloc: " + " ".join(f"{k}={v}" for k, v in malloc_env.items())


def _spread_text(t: dict) -> str:
    """The p90/p10 spread of each row's table step time (results.json's ``timing.spread``, decided once by
    :func:`mixprec.programs.bench.noise.settle_noise`); a row the interleaved timing could not time is marked."""
    errors = t.get("errors") or {}
    spread = ", ".join(f"{n} {v:.2f}" + (" (quality run)" if n in errors else "")
                       for n, v in (t.get("spread") or {}).items())
    if t.get("drift_corrected"):
        raw = ", ".join(f"{n} {v:.2f}" for n, v in (t.get("spread_raw") or {}).items())
        return (f"p90/p10 spread, the drift common to every row divided out round by round: {spread} (noisy above "
                f"{t.get('spread_limit', 1.5)}; raw: {raw})")
    return f"p90/p10 spread: {spread or 'not measured'} (noisy above {t.get('spread_limit', 1.5)})"


def timing_lines(results: dict) -> list[str]:
    """How the table's step times were measured, their spread, and whether they carry a speed verdict: the
    console and report.md print these lines, and only these, about the timing; "noisy" is ``timing.noisy``."""
    t = results.get("timing") or {}
    if t.get("method") == "interleaved" and t.get("one_pass"):
        timed = [r.get("timed_steps") for r in (results.get("policies") or {}).values() if r.get("timed_steps")]
        count = f"{min(timed)}-{max(timed)}" if timed and min(timed) != max(timed) else f"{timed[0] if timed else 0}"
        retimed = (f"; the pass was noisy, so every row was timed again after its quality run ({t['retime_rounds']} "
                   f"rounds of {t['retime_block_steps']} steps, each after one untimed step)" if t.get("retimed") else
                   "; the pass was noisy, and a smoke test (--quick) does not time again" if t.get("retime_skipped")
                   else "")
        how = (f"timing: interleaved in one pass ({t['blocks']} rounds of {t['block_steps']} steps per row, each row in "
               f"its own resident worker, taking turns; the timed steps are the quality steps, leaving out the "
               f"warm-up, each turn's first step and the step after each eval{_malloc_text(t.get('malloc_env'))}"
               f"{retimed}): step time is the median of each row's {count} timed steps")
    elif t.get("method") == "interleaved":
        retimed = f", re-timed {t['retimed']}x" if t.get("retimed") else ""
        how = (f"timing: interleaved ({t['blocks']} rounds of {t['block_steps']} steps per policy in resident "
               f"workers, each block after one untimed step{retimed}{_malloc_text(t.get('malloc_env'))}): step time "
               f"is the median of each policy's {t['blocks'] * t['block_steps']} timed steps")
    else:
        warmup = (results.get("settings") or {}).get("warmup_steps")
        how = f"timing: sequential (each policy's quality run): step time is the median after {warmup} warm-up steps"
    lines = [f"{how}; {_spread_text(t)}"]
    if t.get("noisy"):
        lines.append(f"TIMINGS NOISY: a policy's p90/p10 spread stayed above {t.get('spread_limit', 1.5)} — the "
                     "machine was busy; the speedups are unreliable and no speed verdict is given")
    lines += [f"timing: {n} not timed interleaved ({err}): its step time is its quality run's"
              for n, err in (t.get("errors") or {}).items()]
    if t.get("phases_s") and results.get("wall_s") is not None:
        lines.append(f"wall time {results['wall_s']:.0f} s: " + ", ".join(
            f"{_PHASE_WORDS.get(k, k)} {v:.0f} s" for k, v in t["phases_s"].items() if v >= 0.5))
    return lines


_PHASE_WORDS = {"plan": "workload and attention plan", "build": "building the workers", "turns": "the rows' steps",
                "finish": "final evals and memory steps", "retime": "timing again", "profile": "step profiles",
                "seed_band": "seed band", "stop": "stopping the workers"}
