"""Optimizer peers: the bench's gpt run with bitsandbytes' and torchao's 8-bit AdamW on fp32 weights, beside ours.

Issue 17's third must-show. A peer run is the workload's own recipe with the optimizer class swapped and nothing
else: the same param groups (weight decay on 2-D tensors only) with the lr, betas, eps and weight decay of the
``torch.optim.AdamW`` that ``Workload.make_optimizer`` builds (read from it, checked on the peer after
construction), the same warm-up + cosine schedule and global-norm clipping, under ``mixprec.MixedPrecision`` with
the fp32 policy. The engine's optimizer contract (``mixprec.optim.contract``) accepts a stock optimizer there as
it is: fp32 params, round-to-nearest, state kept by the optimizer itself; nothing is converted or replaced.

Every run is one ``python -m mixprec.programs.bench`` worker, the bench's own, in its own process: a peer is a thin
:class:`PeerWorkload` named by a ``module:function`` spec (``optimizer_peers:torchao_adamw8bit``), so its
final eval, step timing and bytes/param census (:func:`mixprec.programs.bench.measure.state_bytes`, which counts a
tensor subclass by the tensors it holds) are exactly the bench's.

Peers (optional extras, ``pip install 'mixprec[peers]'``; a missing one is a skipped row and exit status 0):

* bitsandbytes ``AdamW8bit`` (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022): uint8
  ``state1``/``state2`` with one fp32 ``absmax`` per 256-element block and the 256-entry fp32 code books
  ``qmap1``/``qmap2`` (one pair shared by all params); tensors under ``min_8bit_size`` = 4096 elements keep
  fp32 state.
* torchao ``AdamW8bit``: ``exp_avg``/``exp_avg_sq`` as ``OptimState8bit`` (reports float32; holds uint8
  ``codes``, one fp32 ``scale`` per 256-element block and its own 256-entry fp32 ``qmap``); tensors under 4096
  elements or not a multiple of 256 keep fp32 state. Its step is ``torch.compile``d per param shape; the
  compilation falls in the warm-up steps, which the step time leaves out.

"Ours": the rows of a ``mixprec bench`` run of the same workload, config, steps, seed and data
(``--bench DIR/results.json``, whatever policies it has), or the ``--ours`` policies trained here (default
fp32,bf16-sr,bf16-lean; fp32 always, first, as the reference).

Step times (``--timing``): ``interleaved`` (default) times every row again in alternating 5-step blocks with
:func:`mixprec.programs.bench.interleaved.time_interleaved`, as ``mixprec bench`` does, ours included, so all ratios come
from one occasion; ``sequential``: each run's own median, the runs one after another (with ``--bench``, ours
are then the bench's times, taken on another occasion).

    python benchmarks/optimizer_peers.py --config mid --steps 300 --out runs/peers
    python benchmarks/optimizer_peers.py --bench runs/bench/results.json --out runs/peers

Prints the Markdown table and writes it with the JSON to ``--out`` (``peers.md``, ``peers.json``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.programs.bench.interleaved import time_interleaved
from mixprec.programs.bench.report import COMPILED_SUFFIX
from mixprec.programs.bench.schedule import eval_every_for, warmup_steps_for
from mixprec.programs.bench.worker import RunSpec
from mixprec.formats import get_format
from mixprec.policy.policy import Policy
from mixprec.workloads import Workload, get_workload

WORKLOAD = "gpt"
REFERENCE = "fp32"             # ours' reference row, and the policy every peer runs under
DEFAULT_OURS = ("fp32", "bf16-sr", "bf16-lean")   # bf16-lean: our 8-bit AdamW, the row the peers are read against
TIMING_METHODS = ("interleaved", "sequential")
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")   # what a peer takes from the workload's AdamW, per group
BENCH_SETTINGS = ("workload", "config", "steps", "seed", "data")   # what --bench's results.json must share


@dataclass(frozen=True)
class Peer:
    """A peer optimizer: where its class lives, the pip distribution that provides it, the worker's factory in
    this module, and what its state holds (the table's "state format")."""

    name: str
    module: str
    cls: str
    distribution: str
    factory: str
    state_format: str

    @property
    def label(self) -> str:
        return f"{self.distribution} {self.cls}"


PEERS = {
    "bitsandbytes": Peer("bitsandbytes", "bitsandbytes.optim", "AdamW8bit", "bitsandbytes", "bitsandbytes_adamw8bit",
                         "uint8 codes + fp32 absmax per 256 elements, qmap shared; fp32 under 4096 elements"),
    "torchao": Peer("torchao", "torchao.optim", "AdamW8bit", "torchao", "torchao_adamw8bit",
                    "uint8 codes + fp32 scale per 256 elements, qmap per tensor; fp32 under 4096 elements"),
}


def _hyperparameters(group: dict) -> tuple:
    """A param group's params (by identity) and AdamW hyperparameters as plain floats (torchao keeps lr a tensor)."""
    return ([id(p) for p in group["params"]], float(group["lr"]), tuple(float(b) for b in group["betas"]),
            float(group["eps"]), float(group["weight_decay"]))


def peer_optimizer(reference: torch.optim.Optimizer, peer: Peer) -> torch.optim.Optimizer:
    """``peer``'s optimizer over ``reference``'s param groups, each with its lr, betas, eps and weight decay.

    Raises:
        ValueError: ``reference`` is not a plain ``torch.optim.AdamW`` (amsgrad or maximize: the peers do neither).
        RuntimeError: the peer's groups do not hold what was passed in (a silently changed hyperparameter).
    """
    groups = reference.param_groups
    if type(reference) is not torch.optim.AdamW or any(g["amsgrad"] or g["maximize"] for g in groups):
        raise ValueError(f"optimizer peers replace a plain torch.optim.AdamW, but Workload.make_optimizer returned "
                         f"{type(reference).__name__} (amsgrad/maximize off required); use a workload whose "
                         "make_optimizer returns torch.optim.AdamW")
    wanted = [{k: g[k] for k in ("params", *HYPERPARAMETERS)} for g in groups]
    optimizer = getattr(importlib.import_module(peer.module), peer.cls)(wanted)
    got, want = [_hyperparameters(g) for g in optimizer.param_groups], [_hyperparameters(g) for g in wanted]
    if got != want:
        raise RuntimeError(f"{peer.label} changed the param groups it was given: {want} became {got}")
    return optimizer


class PeerWorkload(Workload):
    """``base`` with its optimizer swapped for ``peer``'s (:func:`peer_optimizer`); everything else delegated:
    model, batches, loss, evaluation, param groups, schedule, clipping, throughput units."""

    def __init__(self, base: Workload, peer: Peer) -> None:
        self.base, self.peer = base, peer
        self.name, self.config_name = base.name, base.config_name
        self.items_per_batch, self.item_unit, self.optim = base.items_per_batch, base.item_unit, base.optim
        self.default_steps, self.loss_unit = base.default_steps, base.loss_unit
        self.keep_fp32_inputs = base.keep_fp32_inputs

    @property
    def max_grad_norm(self) -> float | None:
        return self.base.max_grad_norm

    def build_model(self) -> nn.Module:
        return self.base.build_model()

    def batches(self, split: str, seed: int = 0) -> Iterator[dict]:
        return self.base.batches(split, seed)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.base.loss(model, batch)

    def evaluate(self, model: nn.Module, batches: Iterable[dict] | None = None) -> dict[str, float]:
        return self.base.evaluate(model, batches)

    def flops_per_step(self) -> float:
        return self.base.flops_per_step()

    def describe(self) -> dict:
        return {**self.base.describe(), "optimizer_peer": f"{self.peer.module}.{self.peer.cls}"}

    def param_groups(self, model: nn.Module) -> list[dict]:
        return self.base.param_groups(model)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return peer_optimizer(self.base.make_optimizer(model), self.peer)

    def make_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        return self.base.make_scheduler(optimizer, total_steps)


def bitsandbytes_adamw8bit(config: str | None = None, data: str | None = None) -> PeerWorkload:
    """The gpt workload trained with bitsandbytes' ``AdamW8bit`` (spec ``optimizer_peers:bitsandbytes_adamw8bit``)."""
    return PeerWorkload(get_workload(WORKLOAD, config=config, data=data), PEERS["bitsandbytes"])


def torchao_adamw8bit(config: str | None = None, data: str | None = None) -> PeerWorkload:
    """The gpt workload trained with torchao's ``AdamW8bit`` (spec ``optimizer_peers:torchao_adamw8bit``)."""
    return PeerWorkload(get_workload(WORKLOAD, config=config, data=data), PEERS["torchao"])


# ------------------------------------------------------------------------------------------------ the runs


def _worker_env() -> dict[str, str]:
    """This environment with this script's folder (the peers' ``module:function`` specs) and the working
    directory on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(Path(__file__).resolve().parent), os.getcwd(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _spec(args: argparse.Namespace, workload: str, policy: str, *, compile: bool = False) -> RunSpec:
    """The bench's RunSpec for one row (warm-up and eval points as ``mixprec bench`` sets them)."""
    return RunSpec(workload=workload, policy=policy, steps=args.steps, seed=args.seed, config=args.config,
                   data=args.data, device=args.device, warmup_steps=warmup_steps_for(args.steps),
                   eval_every=eval_every_for(args.steps), compile=compile)


def _run_worker(spec: RunSpec, workdir: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    """One ``python -m mixprec.programs.bench`` worker; its results, or ``{"error": ...}`` with the log's tail."""
    spec_path, out_path, log_path = (workdir / f"{name}{s}" for s in (".spec.json", ".json", ".log"))
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    out_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        status = subprocess.run([sys.executable, "-m", "mixprec.programs.bench", str(spec_path), str(out_path)],
                                stdout=subprocess.DEVNULL, stderr=log, env=env).returncode
    print(f"  {name}: exit status {status} after {time.perf_counter() - start:.0f} s", file=sys.stderr)
    try:
        return json.loads(out_path.read_text())
    except (OSError, ValueError):
        tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
        return {"error": f"worker exited with status {status} and no results; log {log_path}: {tail}"}


def _missing(peer: Peer) -> str | None:
    """Why ``peer`` cannot run here (its package is not installed), or None."""
    if importlib.util.find_spec(peer.distribution) is None:
        return f"skipped: {peer.distribution} not installed (pip install {peer.distribution})"
    return None


def _peer_version(peer: Peer) -> str | None:
    try:
        return importlib.metadata.version(peer.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _bench_rows(path: Path, args: argparse.Namespace) -> tuple[dict[str, dict], dict]:
    """Ours from a ``mixprec bench`` results.json: its policy rows and the results; its settings must match.

    Raises:
        ValueError: the file is not a bench's results.json, a setting differs, or it has no fp32 row.
    """
    try:
        results = json.loads(path.read_text())
        settings, rows = results["settings"], results["policies"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--bench {str(path)!r} is not a mixprec bench results.json ({type(err).__name__}: {err}); "
                         "pass the results.json that `mixprec bench --out DIR` wrote (DIR/results.json)") from None
    here = {"workload": WORKLOAD, "config": args.config, "steps": args.steps, "seed": args.seed, "data": args.data}
    differ = [f"{k}={settings.get(k)!r} there, {here[k]!r} here" for k in BENCH_SETTINGS if settings.get(k) != here[k]]
    if differ:
        raise ValueError(f"--bench {str(path)!r} ran other settings than this run ({'; '.join(differ)}): the rows would "
                         "not be comparable; pass the matching --config/--steps/--seed/--data, or run `mixprec bench "
                         f"--config {args.config} --steps {args.steps} --seed {args.seed}` first")
    if (rows.get(REFERENCE) or {}).get("final_eval_loss") is None:
        raise ValueError(f"--bench {str(path)!r} has no finished {REFERENCE} row to compare with; rerun the bench")
    return rows, results


def _run_ours(policies: list[str], args: argparse.Namespace, workdir: Path, env: dict[str, str]
              ) -> tuple[dict[str, dict], dict[str, RunSpec]]:
    """Train each of ``policies`` (fp32 first) in a bench worker; the rows and their specs."""
    rows, specs = {}, {}
    for index, policy in enumerate(policies):
        specs[policy] = _spec(args, WORKLOAD, policy)
        rows[policy] = _run_worker(specs[policy], workdir, f"ours{index}-{_file_name(policy)}", env)
    return rows, specs


def _file_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def _run_peers(peers: list[Peer], args: argparse.Namespace, workdir: Path, env: dict[str, str]
               ) -> tuple[dict[str, dict], dict[str, RunSpec]]:
    """Train each available peer under the fp32 policy in a bench worker; a missing one is a skipped row."""
    rows, specs = {}, {}
    for peer in peers:
        missing = _missing(peer)
        if missing is not None:
            rows[peer.name] = {"skipped_reason": missing}
            continue
        specs[peer.name] = _spec(args, f"{Path(__file__).stem}:{peer.factory}", REFERENCE)
        rows[peer.name] = _run_worker(specs[peer.name], workdir, f"peer-{peer.name}", env)
    return rows, specs


def _retime(rows: dict[str, dict], specs: dict[str, RunSpec], steps: int, workdir: Path,
            env: dict[str, str]) -> dict[str, Any]:
    """Time every row that trained again, interleaved (rounds as ``mixprec bench``'s), and replace its step time
    (the run's own median kept as ``sequential_step_time_ms_median``); the timing record."""
    live = {n: s for n, s in specs.items() if rows[n].get("step_time_ms_median") is not None}
    rounds = max(4, min(12, steps // 25))
    print(f"timing {len(live)} rows interleaved: {rounds} rounds of 5 steps each", file=sys.stderr)
    timing = time_interleaved(live, workdir, env, block_steps=5, rounds=rounds, warmup_steps=3)
    for name, step in timing["step_ms"].items():
        if step is not None:
            row = rows[name]
            row.setdefault("sequential_step_time_ms_median", row["step_time_ms_median"])   # a bench row has its own
            row.update(step_time_ms_median=step["median"], step_time_ms_p10=step["p10"], step_time_ms_p90=step["p90"],
                       timing="interleaved")
    return timing


# ------------------------------------------------------------------------------------------------ the table


def _dtype_label(dtype: Any) -> str:
    """``fp32``/``bf16``/... for a float dtype; anything else (an int8 state) by its own name."""
    try:
        return get_format(dtype).name
    except (ValueError, KeyError, TypeError):
        return str(dtype).replace("torch.", "")


def _ours_formats(policy_text: str | None) -> tuple[str, str]:
    """(weights, state format) of a row, from the policy it ran ("?" for a policy this mixprec does not know)."""
    try:
        policy = Policy.parse(policy_text or "")
    except ValueError:
        return "?", "?"
    weights = _dtype_label(policy.param_dtype)
    if policy.master_dtype is not None:
        weights += f" + {_dtype_label(policy.master_dtype)} master"
    if policy.rounding != "nearest":
        weights += f", {policy.rounding} rounding"
    return weights, f"{_dtype_label(policy.state_dtype)} moments"


def _optimizer_label(entry: dict) -> str:
    """``torch AdamW`` from the worker's ``torch.optim.adamw.AdamW``."""
    path = entry.get("optimizer") or "?"
    return f"{path.split('.')[0]} {path.rsplit('.', 1)[-1]}"


def _row(name: str, entry: dict, kind: str, reference: dict, seed_band: float | None) -> dict[str, Any]:
    """One table row (peers.json's ``rows``): what ran, its measurements and its ratios to the fp32 reference."""
    peer = PEERS.get(name) if kind == "peer" else None
    if peer is not None:
        version = _peer_version(peer)
        label = f"{peer.label} {version or ''}".strip() + f" ({REFERENCE} policy)"
        weights, state_format = _ours_formats(entry.get("policy") or REFERENCE)[0], peer.state_format
    else:
        label, version = f"{name} ({_optimizer_label(entry)})", None
        weights, state_format = _ours_formats(entry.get("policy"))
    row = {"name": name, "kind": kind, "label": label, "version": version, "weights": weights,
           "state_format": state_format, "skipped_reason": entry.get("skipped_reason"), "error": entry.get("error")}
    if entry.get("final_eval_loss") is None and entry.get("step_time_ms_median") is None:
        return row
    state = entry.get("state_bytes") or {}
    loss, ref_loss = entry.get("final_eval_loss"), reference["final_eval_loss"]
    delta = None if loss is None else (loss - ref_loss) / ref_loss
    step, ref_step = entry.get("step_time_ms_median"), reference.get("step_time_ms_median")
    row.update(
        optimizer=entry.get("optimizer"), policy=entry.get("policy"),
        bytes_per_param=entry.get("state_bytes_per_param"),
        optimizer_state_bytes_per_param=state["optimizer_state"] / state["n_params"] if state.get("n_params") else None,
        state_bytes=state, final_eval_loss=loss, eval_loss_delta_vs_fp32=delta,
        within_seed_band=None if delta is None or seed_band is None else abs(delta) <= seed_band,
        step_time_ms_median=step, step_time_ms_p10=entry.get("step_time_ms_p10"),
        step_time_ms_p90=entry.get("step_time_ms_p90"),
        step_time_ratio_vs_fp32=step / ref_step if step and ref_step else None,
        timing=entry.get("timing"), eval_curve=entry.get("eval_curve"))
    return row


HEADERS = ["optimizer / policy", "weights", "state format", "bytes/param (measured)", "of which optimizer state",
           "final eval loss", "Δ vs fp32", "step ms median (p10–p90)", "step time / fp32's"]


def _cells(row: dict) -> list[str]:
    if row.get("bytes_per_param") is None:
        why = row["skipped_reason"] or f"failed: {row['error'] or 'no measurements'}"
        return [row["label"], why, *["—"] * (len(HEADERS) - 2)]
    fmt = lambda x, spec: "—" if x is None else format(x, spec)   # noqa: E731
    delta = row["eval_loss_delta_vs_fp32"]
    band = {True: " (within seed band)", False: " (outside seed band)", None: ""}[row["within_seed_band"]]
    return [row["label"], row["weights"], row["state_format"], fmt(row["bytes_per_param"], ".3f"),
            fmt(row["optimizer_state_bytes_per_param"], ".3f"), fmt(row["final_eval_loss"], ".4f"),
            "—" if delta is None else f"{delta:+.2%}{band}",
            f"{fmt(row['step_time_ms_median'], '.1f')} ({fmt(row['step_time_ms_p10'], '.1f')}–"
            f"{fmt(row['step_time_ms_p90'], '.1f')})", fmt(row["step_time_ratio_vs_fp32"], ".2f")]


def markdown(results: dict) -> str:
    """peers.md: the command, the table and what its columns mean."""
    s = results["settings"]
    lines = [f"# Optimizer peers: {WORKLOAD}/{s['config']}, {s['steps']} steps, seed {s['seed']}", "",
             f"`{results['command']}`", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in results["rows"]]
    band = results.get("seed_band")
    lines += ["", f"- Ours: {results['ours_source']}. Peers train under the {REFERENCE} policy with the workload's "
              "param groups, lr, betas, eps, weight decay, schedule and clipping; only the optimizer class differs.",
              "- bytes/param: params + grads + masters + optimizer state, read from the tensors after a step "
              "(`mixprec.programs.bench.measure.state_bytes`: a tensor subclass by its inner codes and scales, each storage "
              "once); step counters excluded.",
              f"- Step times: {results['timing_note']}.",
              f"- Δ vs fp32: relative final eval loss vs the {REFERENCE} row"
              + (f"; seed band ±{band:.2%} (the bench's fp32 seeds)." if band is not None else ".")]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ the command


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked.

    Raises:
        ValueError: a bad ``--steps``, ``--peers``, ``--ours`` or ``--timing``, or ``--ours`` with ``--bench``.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="mid", help="gpt config (default mid, the bench's)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300, the bench's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="training text (default: the embedded corpus)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {list(PEERS)}")
    parser.add_argument("--ours", default=None, help=f"policies to train here (default {','.join(DEFAULT_OURS)}; "
                        f"{REFERENCE} always runs)")
    parser.add_argument("--bench", type=Path, default=None, help="a mixprec bench results.json of the same "
                        "config/steps/seed/data: ours are its rows")
    parser.add_argument("--timing", default="interleaved", help=f"one of {TIMING_METHODS}")
    parser.add_argument("--out", type=Path, default=Path("runs/optimizer_peers"))
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.steps < 5:
        raise ValueError(f"--steps {args.steps} must be >= 5 (the warm-up steps are not timed); e.g. --steps 300")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise ValueError(f"--peers {args.peers!r}: {unknown or 'none'} not allowed; choose from {list(PEERS)}, "
                         f"comma-separated, e.g. --peers {','.join(PEERS)}")
    if args.timing not in TIMING_METHODS:
        raise ValueError(f"--timing {args.timing!r} is not allowed; choose one of {TIMING_METHODS}")
    if args.bench is not None and args.ours is not None:
        raise ValueError(f"--ours {args.ours!r} with --bench {str(args.bench)!r}: ours come from one or the other; "
                         "drop --ours to read the bench's rows, or drop --bench to train --ours here")
    ours = [p.strip() for p in (args.ours or ",".join(DEFAULT_OURS)).split(",") if p.strip()]
    for policy in ours:
        Policy.parse(policy)   # a typo is an error here, not a failed worker later
    args.peer_list = [PEERS[p] for p in dict.fromkeys(peers)]
    args.ours_list = list(dict.fromkeys([REFERENCE, *ours]))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the peers (and ours unless ``--bench``), time them, write ``peers.json``/``peers.md``; the results.

    Raises:
        ValueError: bad arguments, or a ``--bench`` results.json of other settings (before any run).
    """
    args = _parse(argv)
    bench = None
    if args.bench is not None:
        ours, bench = _bench_rows(args.bench, args)
    workdir = args.out / "workers"
    workdir.mkdir(parents=True, exist_ok=True)
    env = _worker_env()
    specs: dict[str, RunSpec] = {}
    if bench is None:
        ours, specs = _run_ours(args.ours_list, args, workdir, env)
    peers, peer_specs = _run_peers(args.peer_list, args, workdir, env)
    timing = None
    if args.timing == "interleaved":
        if bench is not None:   # the bench's rows, rebuilt as it ran them, timed beside the peers
            specs = {name: _spec(args, WORKLOAD, e["requested"], compile=name.endswith(COMPILED_SUFFIX))
                     for name, e in ours.items() if e.get("requested")}
        timing = _retime({**ours, **peers}, {**specs, **peer_specs}, args.steps, workdir, env)
    return _write(args, ours, peers, bench, timing)


def _timing_note(args: argparse.Namespace, bench: dict | None, timing: dict | None) -> str:
    if timing is not None:
        note = (f"interleaved in this run, every row ({timing['blocks']} rounds of {timing['block_steps']} steps, "
                "`mixprec.programs.bench.interleaved`)")
        return note + ("; NOISY: a p90/p10 spread stayed above the limit" if timing["noisy"] else "")
    if bench is None:
        return "sequential (each run's own steps after warm-up, the runs one after another)"
    method = (bench.get("timing") or {}).get("method", "?")
    return (f"sequential: peers' from their own runs here; ours from the bench ({method}), another occasion: "
            "compare the ratios with care")


def _write(args: argparse.Namespace, ours: dict[str, dict], peers: dict[str, dict], bench: dict | None,
           timing: dict | None) -> dict[str, Any]:
    """Build the rows, print the table and write peers.json and peers.md to ``args.out``."""
    band = ((bench or {}).get("seed_noise") or {}).get("relative_spread")
    for entry in peers.values():
        entry.setdefault("timing", "sequential")
    for entry in ours.values():   # a bench's rows carry their own method only in the bench's `timing`
        entry.setdefault("timing", "sequential" if bench is None else
                         f"the bench's ({(bench.get('timing') or {}).get('method', '?')})")
    reference = ours[REFERENCE]
    if reference.get("final_eval_loss") is None:
        raise RuntimeError(f"the {REFERENCE} reference did not finish: {reference.get('error')}; see {args.out}/workers")
    order = [REFERENCE, *(n for n in ours if n != REFERENCE)]
    rows = [_row(n, ours[n], "ours", reference, band) for n in order]
    rows += [_row(n, e, "peer", reference, band) for n, e in peers.items()]
    results = {
        "optimizer_peers": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join(["python", "benchmarks/optimizer_peers.py", *args.argv]),
        "settings": {"workload": WORKLOAD, "config": args.config, "steps": args.steps, "seed": args.seed,
                     "data": args.data, "device": args.device, "timing": args.timing,
                     "peers": [p.name for p in args.peer_list], "bench": None if args.bench is None else str(args.bench)},
        "ours_source": f"the rows of `{args.bench}`" if bench is not None else "trained in this run",
        "timing_note": _timing_note(args, bench, timing),
        "timing": timing,
        "seed_band": band,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    (args.out / "peers.md").write_text(text)
    print(text)
    return results


def _exit_status(results: dict) -> int:
    """0 when every row trained or was skipped for a missing extra; 1 when one failed."""
    return int(any(row["error"] for row in results["rows"]))


if __name__ == "__main__":
    try:
        sys.exit(_exit_status(main()))
    except ValueError as err:
        sys.exit(f"optimizer_peers.py: error: {err}")
