"""``mixprec bench``: its arguments and its run (the table, the lines after it, the exit status)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixprec.programs.cli.arguments import (add_workload_args, bench_steps, count, positive_float, positive_int,
                                             size_with_unit, split_policies, timestamp)

__all__ = ["add_parser", "run"]

_EPILOG = """\
Each row (fp32 the reference, each policy, then the torch-autocast peer: a plain torch.autocast
loop; --no-peer leaves it out) trains in its own resident process from the same seed and batch
order, and the processes take turns a block of steps at a time: one pass gives both the quality
and the interleaved step times. Verdicts: PASS / FAIL / SKIPPED / REFERENCE (SMOKE under --quick),
against the targets; exit status 1 when any row FAILs. Outputs in --out: results.json, report.md,
loss_curves.png, loss_wallclock.png, speed_memory.png. See the README for the measured run time.
"""


def add_parser(sub: argparse._SubParsersAction, presets: str) -> None:
    """``mixprec bench``'s arguments: what runs and the targets it is judged against, then
    :func:`_add_run_args`."""
    from mixprec.programs.bench.runner import DEFAULT_GPT_CONFIG, DEFAULT_POLICIES, DEFAULT_STEPS

    bench = sub.add_parser("bench", help="compare policies with fp32 on a workload and judge them",
                           description="Compare precision policies with fp32 on one workload.", epilog=_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(bench, f"workload config: gpt has tiny, baby, mid, small, long (default: {DEFAULT_GPT_CONFIG}); "
                      "minilm has tiny, default; digits has default")
    bench.add_argument("--policies", default=",".join(DEFAULT_POLICIES), type=split_policies,
                       help=f"comma-separated policies: presets ({presets}) or key=value text such as "
                       "bf16-kahan,state=int8; 'advised' runs the numerics advisor's policy, 'advised:nvfp4' (or "
                       "mxfp8) the block policy it advises, overrides allowed after it; fp32 is always added first "
                       f"(default: {','.join(DEFAULT_POLICIES)})")
    bench.add_argument("--steps", type=bench_steps, default=None,
                       help=f"optimizer steps per policy, >= 5 (default: the workload's: {DEFAULT_STEPS} for gpt)")
    bench.add_argument("--out", default=None, help="output directory (default: runs/bench-<timestamp>)")
    bench.add_argument("--max-loss-delta", type=positive_float, default=0.02,
                       help="largest allowed relative increase of the final eval loss vs fp32 (default: 0.02)")
    bench.add_argument("--min-speedup", type=positive_float, default=None, help="smallest allowed speedup vs fp32 (default: none)")
    bench.add_argument("--max-memory-ratio", type=positive_float, default=None,
                       help="largest allowed process peak RSS over fp32's (RSS MiB, not tensor bytes; default: none)")
    _add_run_args(bench)


def _add_run_args(bench: argparse.ArgumentParser) -> None:
    """``mixprec bench``'s arguments on how the rows run and what else is measured beside them."""
    bench.add_argument("--memory-budget", default=None, metavar="SIZE", type=size_with_unit,
                       help="also report, per policy, the largest batch whose peak live tensor bytes fit SIZE "
                       "(e.g. 4GiB, 512MiB, 2.5GB): peaks measured at half, once and twice the batch, fitted to a line")
    bench.add_argument("--force", action="store_true",
                       help="run policies the device cannot run natively (e.g. fp16 on a CPU) instead of SKIPPING")
    bench.add_argument("--strategy", choices=("ddp", "fsdp2"), default=None,
                       help="run each policy on several processes (needs --out): `torchrun --nproc-per-node N -m "
                       "mixprec bench --strategy ddp --out DIR`; throughput is summed over the ranks")
    bench.add_argument("--compile", action="store_true",
                       help="also run each policy compiled (torch.compile, inductor) as the row <policy>+compiled; "
                       "compile time is reported apart from the step time")
    bench.add_argument("--seeds", type=positive_int, default=None,
                       help="train the fp32 reference at this many seeds (seed, seed+1, ...): the spread of its eval "
                       "loss is the seed-noise band each verdict is read against; the extra seeds' runs are kept per "
                       "workload and machine and reused while this run's fp32 ends at the same loss (default 2, "
                       "--quick 1; 1 turns it off)")
    bench.add_argument("--fresh-seed-band", action="store_true", help="train the extra seeds again (not the kept runs)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke test in about a minute or two: 30 steps (unless --steps), no seed band, no step "
                       "profiles; its best verdict is SMOKE, never PASS (it says what it did not establish)")
    bench.add_argument("--portable-cost", action="store_true",
                       help="also time ops=portable (CUDA's autocast op lists on this device) against ops=native for "
                       "the first -mixed policy, interleaved in one process (default: off)")
    bench.add_argument("--eval-every", type=count, default=None, metavar="K",
                       help="also measure each policy's eval loss after every K-th step (the eval curve in "
                       "results.json and loss_curves.png; default: steps // 10; 0: only the final eval)")
    bench.add_argument("--recompute", default=None, metavar="PLAN",
                       help="the recompute plan of the rows named <policy>+recompute in --policies (e.g. "
                       "--policies bf16-lean,bf16-lean+recompute): MixedPrecision(recompute=PLAN), 'auto' (default: "
                       "each block measured, none/selective/full recompute chosen jointly, the blocks at most 1.3x "
                       "their time), 'auto:1.5', or module names/globs ('blocks.*', 'selective:blocks.*'), checked "
                       "against the model before training; without a +recompute row it is refused (exit 2)")
    bench.add_argument("--no-peer", dest="peer", action="store_false",
                       help="leave out the torch-autocast row: the plain torch.autocast + torch AdamW loop a user would "
                       "write instead, trained and timed like a policy, each row's speed and saved bytes shown against it "
                       "(default: on)")
    bench.add_argument("--timing", choices=("interleaved", "sequential"), default="interleaved",
                       help="interleaved (default): one pass, every row in its own resident worker, the workers taking "
                       "turns a block of steps at a time, so machine drift hits all alike and the quality steps are the "
                       "timed steps; sequential: one row after the other, each timed on its own steps")


def run(args: argparse.Namespace, command: str) -> int:
    """Run the bench ``args`` describe, print its table and lines; 1 when a row FAILs, else 0."""
    from mixprec.programs.bench.advised_rows import merged_lines
    from mixprec.programs.bench.memory_report import budget_lines
    from mixprec.programs.bench.peer_report import peer_lines
    from mixprec.programs.bench.per_rank import per_rank_lines
    from mixprec.programs.bench.recompute_rows import recompute_lines
    from mixprec.programs.bench.report import auto_lines, format_table, op_plan_lines, seed_noise_lines, timing_lines
    from mixprec.programs.bench.runner import BenchConfig, run_bench
    from mixprec.programs.bench.step_profile import step_profile_lines
    from mixprec.programs.bench.verdict import Targets

    targets = Targets(max_loss_delta=args.max_loss_delta, min_speedup=args.min_speedup,
                      max_memory_ratio=args.max_memory_ratio)
    if args.strategy and args.out is None:
        raise ValueError("--strategy needs --out: every rank writes into the same directory")
    out = Path(args.out or Path("runs") / f"bench-{timestamp()}")
    if (out / "results.json").is_file() and _main_process():   # said before the hours of work, not after
        print(f"mixprec bench: {out} holds an earlier bench's results.json; this run replaces its files (pass "
              "another --out to keep them)", file=sys.stderr)
    config = BenchConfig(out=out, workload=args.workload, config=args.config, policies=args.policies,
                         steps=args.steps, seed=args.seed, data=args.data, device=args.device, force=args.force,
                         targets=targets, command=command, strategy=args.strategy, lora=args.lora,
                         compile=args.compile, timing=args.timing,
                         seeds=args.seeds if args.seeds is not None else 1 if args.quick else 2,
                         eval_every=args.eval_every, memory_budget=args.memory_budget, recompute=args.recompute,
                         peer=args.peer, quick=args.quick, portable_cost=args.portable_cost,
                         fresh_seed_band=args.fresh_seed_band)
    results = run_bench(config).to_json()
    if config.strategy is not None and results["settings"]["world_size"] > 1 and not _main_process():
        return 1 if any(e["verdict"] == "FAIL" for e in results["policies"].values()) else 0  # rank 0 reports
    print(format_table(results))
    for line in (timing_lines(results) + seed_noise_lines(results) + auto_lines(results) + op_plan_lines(results)
                 + budget_lines(results) + per_rank_lines(results) + recompute_lines(results) + peer_lines(results)
                 + step_profile_lines(results) + merged_lines(results)):
        print(line)
    for name, entry in results["policies"].items():
        if entry["verdict"] in ("FAIL", "SKIPPED", "SMOKE"):
            print(f"{name}: {entry['verdict']}: {entry['reason']}")
    print(f"wrote {out}/results.json, report.md, loss_curves.png, loss_wallclock.png, speed_memory.png "
          f"({results['wall_s']:.0f} s)")
    return 1 if any(e["verdict"] == "FAIL" for e in results["policies"].values()) else 0


def _main_process() -> bool:
    from mixprec.distributed.process import is_main_process

    return is_main_process()
