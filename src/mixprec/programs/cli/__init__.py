"""The ``mixprec`` command line (also ``python -m mixprec``): bench, train, sample, doctor, inspect.

``main(argv)`` returns the exit status: 0 on success; 1 when ``bench`` judged a policy FAIL
(so CI can gate on the evidence); 2 for bad arguments or inputs (the message says which);
130 / 143 when ``train`` was stopped by SIGINT / SIGTERM after saving a checkpoint (continue it
with ``--resume``; see :mod:`mixprec.programs.train`).
A user workload ``--workload package.module:function`` is imported with the working directory
on ``sys.path`` (and on the bench workers' ``PYTHONPATH``).

Each subcommand has its module here, with its arguments and its run: :mod:`~mixprec.programs.cli.bench`,
:mod:`~mixprec.programs.cli.train`, :mod:`~mixprec.programs.cli.sample` (``inspect``'s are
:mod:`mixprec.programs.inspect`'s; ``doctor``'s are below); what they share is
:mod:`~mixprec.programs.cli.arguments`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings

from mixprec.programs.cli import bench, sample, train
from mixprec.programs.cli.arguments import SubcommandParser, check_out

__all__ = ["main", "build_parser"]


def _version() -> str:
    """``mixprec.__version__``, read from the package every ``mixprec.*`` module runs inside (an import of the
    public API from a program would point up the layers; the package is always imported first)."""
    return sys.modules["mixprec"].__version__


def build_parser() -> argparse.ArgumentParser:
    from mixprec.policy.policy import PRESETS

    presets = ", ".join(PRESETS)   # e.g. bf16-lean (8-bit optimizer state) is opt-in: not in the default list

    parser = argparse.ArgumentParser(prog="mixprec", description="Mixed-precision training for PyTorch, "
                                     "with the evidence: speed, memory and quality against fp32.")
    parser.add_argument("--version", action="version", version=f"mixprec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,train,sample,doctor,inspect}",
                                parser_class=SubcommandParser)
    bench.add_parser(sub, presets)
    train.add_parser(sub, presets)
    sample.add_parser(sub)

    from mixprec.programs.inspect import add_inspect_parser

    add_inspect_parser(sub)
    doctor = sub.add_parser("doctor", help="devices, dtype support, measured matmul peaks, what auto picks")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _cmd_doctor(args: argparse.Namespace) -> int:
    from mixprec.programs.doctor import format_doctor, run_doctor

    report = run_doctor()
    print(json.dumps(report, indent=1) if args.json else format_doctor(report))
    return 0


def _one_line_warning(message: Warning | str, category: type, filename: str, lineno: int, file=None,
                      line: str | None = None) -> str:
    """A warning as the CLI prints it: one line, its category and message, without Python's source echo."""
    return f"{category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """Run the ``mixprec`` command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.
    Warnings print as one line each (category: message), not with Python's file/line/source echo."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    command = "mixprec " + shlex.join(argv)
    if ":" in getattr(args, "workload", "") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    previous_format, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    _whole_lines_under_torchrun()
    finished = False
    try:
        status = _run_command(args, command)
        finished = True
        return status
    except (ValueError, TypeError, ImportError, FileNotFoundError) as err:
        print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = previous_format
        if "torch.distributed" in sys.modules:
            from mixprec.distributed.process import leave_process_group

            leave_process_group(wait_for_all=finished)


def _whole_lines_under_torchrun() -> None:
    """Under torchrun (WORLD_SIZE > 1) every rank shares the launcher's stdout: line-buffer it, so each line (or
    block printed at once) reaches the pipe in one write and no rank's line is split by another's output."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and callable(getattr(sys.stdout, "reconfigure", None)):
        sys.stdout.reconfigure(line_buffering=True)


def _run_command(args: argparse.Namespace, command: str) -> int:
    check_out(getattr(args, "out", None))   # before any work
    if args.command == "bench":
        return bench.run(args, command)
    if args.command == "train":
        return train.run(args, command)
    if args.command == "sample":
        return sample.run(args)
    if args.command == "inspect":
        from mixprec.programs.inspect import run_inspect

        return run_inspect(args)
    return _cmd_doctor(args)
