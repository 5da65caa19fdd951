"""Recompute's step time: a policy with ``MixedPrecision(checkpoint=PLAN)`` against the same policy without it.

Issue 27's speed target for the recompute plan: bf16-lean with ``checkpoint="auto"`` at most 1.3x bf16-lean's step
time (GPT ``small``, batch 64). Two engines train the same GPT from the same seed on the same batches (inputs cast,
forward under the policy's autocast, ``mp.backward``, ``mp.step()``: :func:`mixprec.programs.session.train_step`);
``auto``'s plan is measured and chosen in the recompute engine's first warm-up step. After ``--warmup`` steps each
(default 2), the steps are timed interleaved, A B A B ... (A without recompute, B with it; each step between two
device syncs, :mod:`mixprec.machine.timing`), so that drift in the machine's speed hits both. Prints, and writes
with ``--json``: each engine's median step time, the ratio of the medians (the figure to judge, on a quiet
machine), and the 10th-90th percentile of the per-pair ratios (B_i / A_i). ``--steps`` pairs, at least 5 for a
verdict (fewer: a smoke run, said so). The plan the recompute engine ran is printed (times in ms).

    python benchmarks/recompute_step_time.py                                  # GPT small, batch 64, bf16-lean
    python benchmarks/recompute_step_time.py --config tiny --steps 1          # smoke run: does it work
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import mixprec
import mixprec.optim
from mixprec.machine.timing import time_call
from mixprec.memory.recompute import RecomputePlan
from mixprec.programs.session import train_step
from mixprec.workloads import get_workload

MIN_PAIRS = 5   # fewer timed pairs: no verdict


def _engine(workload, policy: str, checkpoint, device: str) -> mixprec.MixedPrecision:
    torch.manual_seed(0)
    model = workload.build_model()
    return mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), policy, device=device,
                                  checkpoint=checkpoint)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small", help="GPT config (default small: T=256, batch 64)")
    parser.add_argument("--policy", default="bf16-lean")
    parser.add_argument("--checkpoint", default="auto", help="MixedPrecision(checkpoint=...): 'auto', 'auto:1.5', "
                        "or comma-separated module globs ('blocks.*', 'selective:blocks.*')")
    parser.add_argument("--steps", type=int, default=7, help=f"timed pairs (A then B), >= {MIN_PAIRS} for a verdict")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per engine first (auto measures in its first)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps {args.steps} and --warmup {args.warmup} must be >= 1 (auto measures in a warm-up step)")

    workload = get_workload("gpt", args.config)
    checkpoint = args.checkpoint if args.checkpoint.startswith("auto") else args.checkpoint.split(",")
    plain = _engine(workload, args.policy, None, args.device)
    recomputed = _engine(workload, args.policy, checkpoint, args.device)
    batches = workload.batches("train", seed=0)
    times_ms: dict[str, list[float]] = {"plain": [], "recompute": []}
    for i in range(args.warmup + args.steps):
        batch = next(batches)   # both engines train on the same batch, A then B
        for name, mp in (("plain", plain), ("recompute", recomputed)):
            seconds = time_call(lambda: train_step(mp, workload, batch), mp.device)
            times_ms[name] += [seconds * 1e3] if i >= args.warmup else []

    pair_ratios = [b / a for a, b in zip(times_ms["plain"], times_ms["recompute"])]
    plans = [e.get("detail") for e in recomputed.events if e.get("kind") == "recompute"]
    result = {
        "config": args.config, "policy": args.policy, "checkpoint": args.checkpoint, "device": args.device,
        "batch": workload.config.batch_size, "pairs": args.steps, "warmup": args.warmup,
        "plain_ms_median": statistics.median(times_ms["plain"]),
        "recompute_ms_median": statistics.median(times_ms["recompute"]),
        "ratio_of_medians": statistics.median(times_ms["recompute"]) / statistics.median(times_ms["plain"]),
        "pair_ratio_p10": _percentile(pair_ratios, 0.1), "pair_ratio_p90": _percentile(pair_ratios, 0.9),
        "times_ms": times_ms, "plan": plans[-1] if plans else None, "verdict": args.steps >= MIN_PAIRS,
    }
    print(f"GPT {args.config}, batch {result['batch']}, {args.policy} on {args.device}, {args.steps} interleaved "
          f"pairs after {args.warmup} warm-up steps each")
    print(f"  without recompute: median {result['plain_ms_median']:.1f} ms")
    print(f"  checkpoint={args.checkpoint!r}: median {result['recompute_ms_median']:.1f} ms")
    print(f"  ratio of medians {result['ratio_of_medians']:.3f}x (per pair p10-p90 {result['pair_ratio_p10']:.3f}-"
          f"{result['pair_ratio_p90']:.3f}x)" + ("" if result["verdict"] else
                                               f"; fewer than {MIN_PAIRS} pairs: a smoke run, no verdict"))
    if plans:
        print("  " + RecomputePlan.from_text(plans[-1]).text(readable=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
