"""``mixprec inspect``: inspect a workload's numerics and write the report, and the advised policy
for ``mixprec bench --policies advised`` (and, per block format asked for, the linears to keep in bf16 and the block
policy that keeps them).

``mixprec inspect --workload gpt --config baby [--data PATH] [--steps K] [--device D] --out DIR``
writes ``DIR/numerics.md``, ``DIR/numerics.json`` and ``DIR/numerics.png`` and prints the
recommendation and the speed it read: ``auto``'s own measurement of the model (the same trial and cache as
``policy="auto"``: :func:`mixprec.numerics.workload.measure_speed`), whose rule picks fp32 or a 16-bit policy.
``--workload package.module:function`` inspects a user workload (:func:`mixprec.workloads.get_workload`).
Bad arguments raise ``ValueError`` / ``TypeError`` / ``ImportError`` with the reason; the ``mixprec`` front end
turns them into exit status 2.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mixprec.numerics.block_report import block_console
from mixprec.numerics.inspect import DEFAULT_FORMATS
from mixprec.numerics.report import NumericsReport
from mixprec.numerics.workload import INSPECT_STEPS, advised_policy, inspect_workload

__all__ = ["add_inspect_parser", "run_inspect", "inspect_workload", "advised_policy", "DEFAULT_STEPS"]

DEFAULT_STEPS = INSPECT_STEPS

_EPILOG = """\
Trains a copy of the workload's model for a few fp32 steps (its own AdamW recipe at the peak
learning rate, no scheduler) and measures, per leaf module and format: activation and gradient
range (overflow, subnormal, flushed to zero; fp8 also at the best per-tensor scale), the error
of running the module in the format (SQNR), the largest safe fp16 loss scale and the share of
optimizer updates lost without fp32 master weights. Block formats (--formats nvfp4,mxfp8):
per linear, its input, weight and output gradient as the recipe's GEMMs read them (saturated
blocks, underflow, SQNR against what the format gives normal data), the linears to keep in bf16
and the block policy that keeps them (block_keep=...). The advised precision follows what
policy=auto measures on this model (fp32 where 16-bit is not faster here). Writes numerics.md, numerics.json (read it
back with mixprec.numerics.NumericsReport.from_json) and numerics.png (modules x formats).
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_inspect_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``inspect`` subcommand to ``subparsers`` and return its parser (dispatch to
    :func:`run_inspect`)."""
    p = subparsers.add_parser("inspect", help="per-layer numerics in fp16/bf16/fp8 and an advised policy",
                              description="Which layer is unsafe in which format, and what to do about it.",
                              epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="gpt", help="built-in workload (gpt, digits, minilm) or "
                   "package.module:function returning a mixprec.workloads.Workload (default: gpt)")
    p.add_argument("--config", default=None, help="workload config (default: the workload's own, baby for gpt)")
    p.add_argument("--data", default=None, help="UTF-8 text file for gpt or minilm (default: the embedded pydoc corpus)")
    p.add_argument("--lora", default=None, metavar="SPEC", help="LoRA adapters on a transformers workload, "
                   "e.g. r=8,alpha=16,targets=query,value (needs mixprec[hf])")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batch order (default: 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    p.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                   help=f"fp32 training steps to inspect (default: {DEFAULT_STEPS})")
    p.add_argument("--policy", default="fp32", help="the policy you intend to train with; the advice starts from "
                   "it (default: fp32 = no preference: the policy auto measures fastest on this model, bf16-mixed where "
                   "speed was not measured; then what the numerics found unsafe is kept in fp32)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated formats to measure (default: {','.join(DEFAULT_FORMATS)}); block formats "
                   "too (nvfp4, mxfp8, mxfp8_e5m2, mxfp6_e2m3, mxfp6_e3m2, mxfp4): every linear's operands in them "
                   "and the linears to keep in bf16")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's peak rate)")
    p.add_argument("--out", default=None, help="output directory (default: runs/inspect-<timestamp>)")
    return p


def write_report(report: NumericsReport, out: str | Path) -> list[Path]:
    """Write ``numerics.md``, ``numerics.json`` and ``numerics.png`` into ``out`` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "numerics.md", out / "numerics.json"
    md.write_text(report.to_markdown())
    js.write_text(report.to_json())
    return [md, js, report.heatmap(out / "numerics.png")]


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``mixprec inspect`` from parsed ``args``; prints the recommendation, returns 0.

    Raises:
        ValueError / TypeError / ImportError: a bad workload, config, data file, policy or format.
    """
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    start = time.perf_counter()
    report = inspect_workload(args.workload, config=args.config, data=args.data, steps=args.steps, seed=args.seed,
                              device=args.device, policy=args.policy, formats=formats, lr=args.lr,
                              lora=getattr(args, "lora", None))
    paths = write_report(report, args.out or Path("runs") / f"inspect-{time.strftime('%Y%m%d-%H%M%S')}")
    rec = report.recommend()
    scale = f" (initial loss scale {rec.initial_loss_scale:g})" if rec.initial_loss_scale is not None else ""
    print(f"advised policy on this device (as it trains here now): {rec.policy}{scale}")
    for reason in rec.reasons:
        print(f"- {reason}")
    if report.speed is not None:   # the evidence the choice of precision read: auto's own measurement
        print(f"speed (auto's measurement on this model, which the advice follows): {report.speed.decision}")
    for fmt in report.formats:
        flagged = sorted({f.module for f in report.flagged(fmt)})
        print(f"{fmt}: {len(flagged)} modules flagged" + (f" ({', '.join(flagged[:5])}"
                                                          f"{', ...' if len(flagged) > 5 else ''})" if flagged else ""))
    for line in block_console(report):   # per block format: the linears kept in bf16, the policy for such a run
        print(line)
    print(f"wrote {', '.join(str(p) for p in paths)} ({time.perf_counter() - start:.1f} s)")
    return 0
