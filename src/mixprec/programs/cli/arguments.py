"""What the subcommands share: argument types, the subcommand parser class, the workload arguments and the
timestamp of a default output directory."""

from __future__ import annotations

import argparse
import difflib
import os
import time

__all__ = ["SubcommandParser", "add_workload_args", "bench_steps", "check_out", "count", "positive_float", "size_with_unit", "positive_int", "split_policies", "timestamp"]


def timestamp() -> str:
    """Now, as a default output directory names it (``runs/bench-<timestamp>``)."""
    return time.strftime("%Y%m%d-%H%M%S")


def split_policies(text: str) -> tuple[str, ...]:
    """``"fp32,bf16-kahan,state=bf16"`` → ``("fp32", "bf16-kahan,state=bf16")``: a ``key=value``
    part belongs to the policy before it (a preset name can only start a policy)."""
    policies: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and policies:
            policies[-1] += f",{part}"
        else:
            policies.append(part)
    return tuple(policies)


def count(text: str) -> int:
    """An int >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give a whole number >= 0")
    return value


def bench_steps(text: str) -> int:
    """An int >= 5 (argparse type: bench's ``--steps``; its warm-up steps are not timed)."""
    value = count(text)
    if value < 5:
        raise argparse.ArgumentTypeError(f"{value} is below 5; bench needs >= 5 steps per policy (its warm-up steps "
                                         "are not timed)")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return value


def positive_int(text: str) -> int:
    """An int >= 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def check_out(out: str | None) -> None:
    """ValueError when ``--out`` names an existing file: the run would fail after its work, when it writes (the
    directory itself is created later, by the run)."""
    if out is not None and os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file, not a directory; pass a directory (created if needed) for the "
                         "run's outputs")


def size_with_unit(text: str) -> str:
    """A memory size with its unit (argparse type): ``4GiB``, ``512MiB``, ``2.5GB``. A bare number is refused on
    the command line (``--memory-budget 4`` meant 4 GiB, not 4 bytes); the API's int stays bytes."""
    if text.strip().replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} has no unit; write one: B, KiB, MiB, GiB, TiB (powers of 2) or "
                                         f"kB, MB, GB, TB (powers of 10), e.g. {text.strip()}GiB")
    return text


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its error, with its usage (``mixprec bench
    --polices x`` prints bench's usage and the nearest option), not the top-level parser's."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            options = [o for action in self._actions for o in action.option_strings]
            near = [difflib.get_close_matches(e.split("=")[0], options, n=1) for e in extras if e.startswith("-")]
            hint = "; did you mean " + ", ".join(m[0] for m in near if m) + "?" if any(near) else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace, extras


def add_workload_args(p: argparse.ArgumentParser, config_help: str) -> None:
    """The workload arguments ``bench`` and ``train`` share."""
    p.add_argument("--workload", default="gpt", help="built-in workload (gpt, digits, minilm) or "
                   "package.module:function returning a mixprec.workloads.Workload (default: gpt)")
    p.add_argument("--config", default=None, help=config_help)
    p.add_argument("--data", default=None, help="UTF-8 text file for gpt or minilm (default: the embedded pydoc "
                   "corpus)")
    p.add_argument("--lora", default=None, metavar="SPEC",
                   help="fine-tune LoRA adapters (the peft library) instead of every weight, e.g. "
                   "r=8,alpha=16,targets=query,value; the frozen base is stored in the compute dtype "
                   "(minilm workload; needs mixprec[hf])")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batch order (default: 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
