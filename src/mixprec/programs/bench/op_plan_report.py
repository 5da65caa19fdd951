"""The bench's one attention plan (results.json ``op_plan``), as the console and report.md say it: each key's choice
with every candidate's time, the policies it was pinned for, and any worker that did not run it."""

from __future__ import annotations

from mixprec.programs.bench.figures import fmt
from mixprec.programs.bench.pinned_plan import SOURCE as PINNED_SOURCE
from mixprec.programs.bench.pinned_plan import entry_words, rule_words
from mixprec.programs.bench.recompute_rows import split_row
from mixprec.programs.bench.results import COMPILED_SUFFIX

__all__ = ["op_plan_lines", "op_plan_markdown", "plan_deviations"]


def plan_deviations(results: dict) -> list[str]:
    """One line per key where a row's worker (its quality run, or its interleaved timing worker) did not run the
    bench's one attention plan (results.json ``op_plan``): a key it planned itself, or another choice. Empty: every
    worker ran the pinned plan."""
    pinned = {n: p.get("pinned") or {} for n, p in ((results.get("op_plan") or {}).get("policies") or {}).items()}
    ran = [(row, "", e.get("op_plan") or []) for row, e in results["policies"].items()]
    ran += [(row, " (its timing worker)", found)
            for row, found in ((results.get("timing") or {}).get("op_plan") or {}).items()]
    return [f"{row}{where} did not run the bench's plan at `{e['shape']}`: {e['chosen']} ({e['source']})"
            for row, where, found in ran for e in found
            if e["source"] != PINNED_SOURCE or pinned.get(split_row(row.removesuffix(COMPILED_SUFFIX))[0], {}).get(e["shape"])
            != e["chosen"]]


def op_plan_lines(results: dict) -> list[str]:
    """The bench's one attention plan (results.json ``op_plan``), as the console and report.md say it: where and
    under which policy it was measured, each key's choice with every candidate's time, the policies it was pinned
    for, what a policy computing in another dtype cannot use, and :func:`plan_deviations`."""
    plan = results.get("op_plan")
    if not plan:
        return []
    if plan.get("error"):
        return [f"attention plan: not measured once ({plan['error']})"]
    lines = [f"attention plan: measured once under {plan['measured_with']} by the bench (pid {plan['pid']}) before "
             f"the timed runs, pinned for every policy that plans ({', '.join(plan['policies'])})"
             + "".join(f"; {w}" for w in [rule_words(plan)] if w) + ("" if plan["entries"] else ": no planned op ran")]
    lines += [f"  {e['shape']} -> {e['chosen']} ({entry_words(e)})" for e in plan["entries"]]
    lines += [f"  {name} at {key.split(' causal=')[0]}: {why}" for name, p in plan["policies"].items()
              for key, why in (p.get("not_offered") or {}).items()]
    ran = ["  every worker ran this plan (checked in each row's worker's engine)"]
    deviations = [f"  {line}" for line in plan_deviations(results)]
    return lines + (deviations or (ran if plan["entries"] else []))


def op_plan_markdown(results: dict) -> list[str]:
    """report.md's op plan (``kernels=measured``): the bench's one plan as a table (key, choice, source, each
    candidate's time) and :func:`op_plan_lines`' words; without one (measured by no policy, or failed), each
    policy's own entries."""
    plan = results.get("op_plan") or {}
    one = bool(plan.get("entries"))
    rows = [("", e) for e in plan["entries"]] if one else \
        [(name, e) for name, entry in results["policies"].items() for e in entry.get("op_plan") or []]
    if not rows:
        return ["", *(f"{line.strip()}." for line in op_plan_lines(results))] if plan else []
    candidates = sorted({c for _, e in rows for c in e["times_ms"]})
    saving = [c for c in candidates if any((e.get("saved_bytes") or {}).get(c) for _, e in rows)]
    first = "" if one else "policy | "
    lines = ["", "## Op plan (`kernels=measured`: the kernel measured fastest on this device at each shape)", "",
             *(f"- {line.strip()}" for line in op_plan_lines(results)), "",
             f"| {first}op | key | chosen | source | " + " | ".join(f"{c} (ms)" for c in candidates)
             + "".join(f" | {c} saved (MiB)" for c in saving) + " |",
             f"|{'---|' if first else ''}---|---|---|---|" + "---:|" * (len(candidates) + len(saving))]
    for name, e in rows:
        saved = [(e.get("saved_bytes") or {}).get(c) for c in saving]
        times = [fmt(e["times_ms"].get(c), ".2f") for c in candidates] + [fmt(b and b / 2**20, ".3g") for b in saved]
        lines.append(f"| {name + ' | ' if first else ''}{e['op']} | `{e['shape']}` | **{e['chosen']}** | {e['source']} | "
                     + " | ".join(times) + " |")
    lines.append("")
    lines.append("Times: best of interleaved forward (+backward for `fwd+bwd` keys) runs on random inputs of the "
                 "key's shapes (`mixprec.autocast.op_plan`); the default (`fused`, torch.autocast's kernel) is replaced only "
                 "by a candidate at least 5 % faster, among those saving for backward (one forward's saved tensors, "
                 "per call) no more than `fused` plus the allowance above; `cache`: measured by an earlier run on "
                 "this machine.")
    return lines + [""]
