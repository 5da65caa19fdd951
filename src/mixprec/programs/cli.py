"""The ``mixprec`` command line (also ``python -m mixprec``): bench, train, sample, doctor, inspect.

``main(argv)`` returns the exit status: 0 on success; 1 when ``bench`` judged a policy FAIL
(so CI can gate on the evidence); 2 for bad arguments or inputs (the message says which);
130 / 143 when ``train`` was stopped by SIGINT / SIGTERM after saving a checkpoint (continue it
with ``--resume``; see :mod:`mixprec.programs.train`).
A user workload ``--workload package.module:function`` is imported with the working directory
on ``sys.path`` (and on the bench workers' ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import sys
import warnings
import time
from pathlib import Path

__all__ = ["main", "build_parser"]

_BENCH_EPILOG = """\
Each row (fp32 the reference, each policy, then the torch-autocast peer: a plain torch.autocast
loop; --no-peer leaves it out) trains in its own resident process from the same seed and batch
order, and the processes take turns a block of steps at a time: one pass gives both the quality
and the interleaved step times. Verdicts: PASS / FAIL / SKIPPED / REFERENCE (SMOKE under --quick),
against the targets; exit status 1 when any row FAILs. Outputs in --out: results.json, report.md,
loss_curves.png, loss_wallclock.png, speed_memory.png. See the README for the measured run time.
"""


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _split_policies(text: str) -> tuple[str, ...]:
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


def _count(text: str) -> int:
    """An int >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give a whole number >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


class _SubcommandParser(argparse.ArgumentParser):
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
                                parser_class=_SubcommandParser)
    _add_bench_parser(sub, presets)
    _add_train_parser(sub, presets)
    _add_sample_parser(sub)

    from mixprec.programs.inspect import add_inspect_parser

    add_inspect_parser(sub)
    doctor = sub.add_parser("doctor", help="devices, dtype support, measured matmul peaks, what auto picks")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _workload_args(p: argparse.ArgumentParser, config_help: str) -> None:
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


def _add_bench_parser(sub: argparse._SubParsersAction, presets: str) -> None:
    """``mixprec bench``'s arguments."""
    from mixprec.programs.bench.runner import DEFAULT_GPT_CONFIG, DEFAULT_POLICIES, DEFAULT_STEPS

    bench = sub.add_parser("bench", help="compare policies with fp32 on a workload and judge them",
                           description="Compare precision policies with fp32 on one workload.", epilog=_BENCH_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_args(bench, f"workload config: gpt has tiny, baby, mid, small, long (default: {DEFAULT_GPT_CONFIG}); "
                  "minilm has tiny, default; digits has default")
    bench.add_argument("--policies", default=",".join(DEFAULT_POLICIES), type=_split_policies,
                       help=f"comma-separated policies: presets ({presets}) or key=value text such as "
                       f"bf16-kahan,state=int8; fp32 is always added first (default: {','.join(DEFAULT_POLICIES)})")
    bench.add_argument("--steps", type=_positive_int, default=None,
                       help=f"optimizer steps per policy, >= 5 (default: the workload's: {DEFAULT_STEPS} for gpt)")
    bench.add_argument("--out", default=None, help="output directory (default: runs/bench-<timestamp>)")
    bench.add_argument("--max-loss-delta", type=float, default=0.02,
                       help="largest allowed relative increase of the final eval loss vs fp32 (default: 0.02)")
    bench.add_argument("--min-speedup", type=float, default=None, help="smallest allowed speedup vs fp32 (default: none)")
    bench.add_argument("--max-memory-ratio", type=float, default=None,
                       help="largest allowed process peak RSS over fp32's (RSS MiB, not tensor bytes; default: none)")
    bench.add_argument("--memory-budget", default=None, metavar="SIZE",
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
    bench.add_argument("--seeds", type=_positive_int, default=None,
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
    bench.add_argument("--eval-every", type=_count, default=None, metavar="K",
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


def _add_train_parser(sub: argparse._SubParsersAction, presets: str) -> None:
    """``mixprec train``'s arguments."""
    train = sub.add_parser("train", help="train one policy; log metrics; save a checkpoint",
                           description="Train a workload under one policy, with metrics, checkpoints, resume and "
                           "an optional divergence guard.")
    _workload_args(train, "workload config (default: the workload's own, baby for gpt)")
    train.add_argument("--policy", default="auto", help=f"policy preset ({presets}, auto) or key=value text "
                       "(default: auto)")
    train.add_argument("--steps", type=_positive_int, default=200, help="optimizer steps (default: 200)")
    train.add_argument("--eval-every", type=int, default=0, help="evaluate every K steps (default: 0 = at the end only)")
    train.add_argument("--out", default=None, help="output directory (default: runs/train-<timestamp>)")
    train.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                       help="save a checkpoint to OUT/checkpoints every N steps (default: 0 = at the end and on "
                       "SIGTERM/SIGINT only)")
    train.add_argument("--keep", type=_positive_int, default=None, metavar="K",
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


def _add_sample_parser(sub: argparse._SubParsersAction) -> None:
    """``mixprec sample``'s arguments."""
    sample = sub.add_parser("sample", help="generate text from a gpt checkpoint (fill [MASK] for minilm) written by "
                            "mixprec train")
    sample.add_argument("dir", help="the train --out directory, its checkpoints/ directory or one step-N directory")
    sample.add_argument("--prompt", default="\n", help="text to continue (characters of the training vocabulary); "
                        "minilm: text with one or more [MASK] tokens to fill")
    sample.add_argument("--tokens", type=_positive_int, default=200, help="characters to generate (default: 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default: 0.8)")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    sample.add_argument("--policy", default="fp32", help="policy the model runs under while sampling (default: fp32; "
                        "16-bit weights load exactly, saved fp32 masters are used where present)")
    sample.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")


def _cmd_bench(args: argparse.Namespace, command: str) -> int:
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
    out = Path(args.out or Path("runs") / f"bench-{_timestamp()}")
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
                 + step_profile_lines(results)):
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


def _cmd_train(args: argparse.Namespace, command: str) -> int:
    from mixprec.programs.train import run_training
    from mixprec.workloads import get_workload

    if args.resume and args.out is None:
        raise ValueError("--resume needs --out: the directory of the run to continue")
    if args.strategy and args.out is None:
        raise ValueError("--strategy needs --out: every rank writes into the same directory")
    workload = get_workload(args.workload, config=args.config, data=args.data, lora=args.lora)
    out = Path(args.out or Path("runs") / f"train-{_timestamp()}")
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


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from mixprec.checkpoint.local import resolve_checkpoint
    from mixprec.checkpoint import load_model_weights, read_manifest as read_distributed_manifest
    from mixprec.engine.mixed_precision import MixedPrecision
    from mixprec.optim import SGD
    from mixprec.workloads import GPT, Corpus, GPTConfig, generate

    path = Path(args.dir)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    path = resolve_checkpoint(path)
    description = read_distributed_manifest(path)["extra"].get("workload", {})   # one-process or DCP format
    if description.get("workload") == "minilm":
        return _sample_minilm(path, description, args)
    if description.get("workload") != "gpt":
        raise ValueError(f"sample: {str(path)!r} holds a {description.get('workload')!r} checkpoint; sample needs "
                         "one from `mixprec train --workload gpt` (or minilm)")
    model_desc, vocab = description["model"], description["data"]["vocab"]
    fields = set(GPTConfig.__dataclass_fields__) - {"optim"}
    model = GPT(GPTConfig(**{k: v for k, v in model_desc.items() if k in fields}), len(vocab))
    load_model_weights(path, model)   # fp32 values (masters where saved; DCP shards gathered), then --policy
    mp = MixedPrecision(model, SGD(model.parameters(), lr=0.0), policy=args.policy, device=args.device)
    corpus = Corpus.from_text(vocab, source=str(path))
    idx = torch.tensor([corpus.encode(args.prompt)], dtype=torch.int64, device=mp.device)  # (1, T0)
    generator = torch.Generator(device=mp.device).manual_seed(args.seed)
    with mp.autocast():
        ids = generate(mp.model, idx, args.tokens, temperature=args.temperature, generator=generator)
    print(corpus.decode(ids[0].tolist()))
    return 0


def _sample_minilm(path: Path, description: dict, args: argparse.Namespace) -> int:
    """Fill each ``[MASK]`` of ``--prompt`` with the trained MiniLM's five most likely tokens."""
    import torch

    from mixprec.checkpoint import load_model_weights
    from mixprec.engine.mixed_precision import MixedPrecision
    from mixprec.optim import SGD
    from mixprec.workloads import get_workload

    lora = (description.get("model") or {}).get("lora")
    workload = get_workload("minilm", config=description.get("config"), lora=lora)
    torch.manual_seed(args.seed)
    model = workload.build_model()
    load_model_weights(path, model)
    mp = MixedPrecision(model, SGD(model.parameters(), lr=0.0), policy=args.policy, device=args.device)
    ids = [workload.cls_id, *workload.encode(args.prompt), workload.sep_id]
    if workload.mask_id not in ids:
        raise ValueError(f"sample --prompt {args.prompt!r}: a minilm checkpoint fills [MASK] tokens; put at least one "
                         "in the prompt, e.g. --prompt 'the [MASK] statement returns from a function'")
    input_ids = torch.tensor([ids], dtype=torch.int64, device=mp.device)  # (1, T)
    mp.module.eval()
    with torch.no_grad(), mp.autocast():
        logits = mp.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0]  # (T, V)
    for k, position in enumerate([i for i, t in enumerate(ids) if t == workload.mask_id], start=1):
        probs = logits[position].float().softmax(-1)
        top = probs.topk(5)
        words = ", ".join(f"{workload.decode([int(i)]).strip()} ({float(p):.2f})" for p, i in zip(top.values, top.indices))
        print(f"[MASK] {k}: {words}")
    return 0


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
    if args.command == "bench":
        return _cmd_bench(args, command)
    if args.command == "train":
        return _cmd_train(args, command)
    if args.command == "sample":
        return _cmd_sample(args)
    if args.command == "inspect":
        from mixprec.programs.inspect import run_inspect

        return run_inspect(args)
    return _cmd_doctor(args)
