"""``mixprec train``: its arguments and its run (:func:`mixprec.programs.train.run_training`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.programs.cli.arguments import add_workload_args, count, positive_int, timestamp

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction, presets: str) -> None:
    """``mixprec train``'s arguments."""
    train = sub.add_parser("train", help="train one policy; log metrics; save a checkpoint",
                           description="Train a workload under one policy, with metrics, checkpoints, resume and "
                           "an optional divergence guard.")
    add_workload_args(train, "workload config (default: the workload's own, baby for gpt)")
    train.add_argument("--policy", default="auto", help=f"policy preset ({presets}, auto) or key=value text "
                       "(default: auto)")
    train.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default: 200)")
    train.add_argument("--eval-every", type=int, default=0, help="evaluate every K steps (default: 0 = at the end only)")
    train.add_argument("--out", default=None, help="output directory (default: runs/train-<timestamp>)")
    train.add_argument("--checkpoint-every", type=count, default=0, metavar="N",
                       help="save a checkpoint to OUT/checkpoints every N steps (default: 0 = at the end and on "
                       "SIGTERM/SIGINT only)")
    train.add_argument("--keep", type=positive_int, default=None, metavar="K",
                       help="keep the newest K checkpoints (default: all)")
    train.add_argument("--resume", action="store_true",
                       help="continue from OUT/checkpoints/latest (needs --out): weights, optimizer, RNG and the "
                       "data position; the result equals an uninterrupted run")
    train.add_argument("--guard", action="store_true",
                       help="attach mixprec.Guard (rollback / escalation) and write OUT/events.jsonl")
    train.add_argument("--ema", type=float, default=None, metavar="DECAY",
                       help="also keep an fp32 EMA of the weights (mixprec.EMA) with this decay, e.g. 0.999; every "
                       "evaluation runs on both the raw and the averaged weights (default: none)")
    train.add_argument("--strategy", choices=("ddp", "fsdp2"), default=None,
                       help="train on several processes (needs --out): launch with `torchrun --nproc-per-node N "
                       "-m mixprec train --strategy ddp --out DIR ...`; each rank takes every N-th batch, so the "
                       "global batch is N x the workload's (default: one process)")
    train.add_argument("--recompute", default=None, metavar="PLAN",
                       help="recompute blocks in backward to save activation memory (MixedPrecision recompute=): "
                       "'auto' (each block measured: none, selective or whole-block recompute, the blocks at most 1.3x "
                       "their time; 'auto:1.5' another bound), or module names/globs, comma-separated ('blocks.*', "
                       "'selective:blocks.*')")
    train.add_argument("--compile", action="store_true",
                       help="compile the model (torch.compile, inductor); step 1's step_time_ms includes compiling")


def run(args: argparse.Namespace, command: str) -> int:
    """Train as ``args`` say; the run's exit status (0, or 130 / 143 after SIGINT / SIGTERM)."""
    from mixprec.programs.train import run_training
    from mixprec.workloads import get_workload

    if args.resume and args.out is None:
        raise ValueError("--resume needs --out: the directory of the run to continue")
    if args.strategy and args.out is None:
        raise ValueError("--strategy needs --out: every rank writes into the same directory")
    workload = get_workload(args.workload, config=args.config, data=args.data, lora=args.lora)
    out = Path(args.out or Path("runs") / f"train-{timestamp()}")
    recompute = _recompute_arg(args.recompute)
    try:
        outcome = run_training(workload, policy=args.policy, steps=args.steps, out=out, seed=args.seed,
                               eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, keep=args.keep,
                               resume=args.resume, device=args.device, guard=args.guard, command=command,
                               workload_spec=args.workload, strategy=args.strategy, ema=args.ema,
                               compile=args.compile, recompute=recompute)
    except ValueError as err:   # the engine's glob check (recompute=...): say it as the flag the user typed
        if recompute is None or not str(err).startswith("recompute: "):
            raise
        raise ValueError(f"--recompute {args.recompute!r}: {str(err).removeprefix('recompute: ')}") from None
    return outcome.status


def _recompute_arg(value: str | None) -> str | list[str] | None:
    """``--recompute``: "auto..." as it is, else the comma-separated module names/globs as a list. ValueError or
    TypeError naming ``--recompute`` for a value the engine's ``recompute=`` refuses."""
    from mixprec.memory.recompute import parse_request

    if value is None:
        return value
    option = value if value.startswith("auto") else [name.strip() for name in value.split(",") if name.strip()]
    parse_request(option, arg="--recompute")
    return option
