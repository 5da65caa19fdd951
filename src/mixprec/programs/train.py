"""The training loop behind ``mixprec train``: log, evaluate, checkpoint, resume, stop on a signal.

:func:`run_training` trains one workload under one policy and writes into ``out``::

    metrics.jsonl        one JSON record per step ({"kind": "train", ...}) and per evaluation ({"kind": "eval"};
                         with ema: eval_ema_<metric> next to eval_<metric>)
    events.jsonl         with guard=True: mp.events (rollbacks, escalations, ...), one per line
    tensorboard/         when tensorboard is installed
    checkpoints/         a checkpoint root (mixprec.checkpoint.local): step-N/ directories and `latest`
    trainable.safetensors  when params are frozen (LoRA): the trainable ones only, fp32, at the end
                         (MixedPrecision.trainable_state_dict; load with load_state_dict(strict=False))

Checkpoints are saved every ``checkpoint_every`` steps, at the end, and when the process gets
SIGTERM or SIGINT: the signal is noted, the current step finishes, a checkpoint is saved at that
step boundary and :func:`run_training` returns with status ``128 + signal number`` (130 for
SIGINT, 143 for SIGTERM; a second signal interrupts at once with ``KeyboardInterrupt``).

``resume=True`` continues from ``out/checkpoints/latest`` (a fresh start, with a note, when there is
none): the engine state, RNG states and guard counts are restored, and the data position is the
number of batches drawn from the seeded stream ``workload.batches("train", seed)``, which is
replayed that far, so the resumed run sees exactly the batches the uninterrupted run would: its
final parameters are bitwise those of an uninterrupted run (same device, policy and ``steps``).
``metrics.jsonl`` keeps the records up to the checkpoint and continues from there. ``steps`` is
the run's total; the learning-rate schedule was fixed for the total the run started with (it is
restored from the checkpoint).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.autocast import op_plan
from mixprec.checkpoint.local import LATEST, load_checkpoint, read_manifest, resolve_checkpoint, save_checkpoint
from mixprec.distributed.process import (any_across_ranks, is_main_process, load_distributed_checkpoint, rank,
                                 read_distributed_manifest, save_distributed_checkpoint, shard_batches)

__all__ = ["TrainOutcome", "run_training", "CHECKPOINTS"]

CHECKPOINTS = "checkpoints"
TRAINABLE_FILE = "trainable.safetensors"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class TrainOutcome:
    """What :func:`run_training` did.

    ``status``: 0 when all ``steps`` ran, ``128 + signum`` when a signal stopped the run (after
    saving a checkpoint). ``step``: steps done (the data position). ``checkpoint``: the last one saved.
    """

    status: int
    step: int
    final_eval: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    stopped_by: str | None = None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _tensorboard(out: Path):
    """A TensorBoard SummaryWriter in ``out/tensorboard``, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def _add_scalars(writer, prefix: str, values: dict, step: int) -> None:
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)


def _keep_records_until(path: Path, step: int) -> None:
    """Drop the records of ``path`` (JSON lines with a "step") after ``step``: they are redone."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


class _StopSignals:
    """Note SIGTERM / SIGINT instead of dying; restore the previous handlers on exit.

    Only in the main thread (Python delivers signals there); elsewhere it does nothing.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.received = signum

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _check_same_run(manifest: dict, workload: Any, seed: int, where: Path, steps: int) -> None:
    extra = manifest.get("extra", {})
    saved, now = extra.get("workload", {}), workload.describe()
    lora = lambda d: d.get("lora", (d.get("model") or {}).get("lora"))  # noqa: E731  (minilm: under "model")
    if lora(saved) != lora(now):
        raise ValueError(f"--resume: the checkpoint {str(where)!r} was trained with --lora {lora(saved)}, this "
                         f"run has --lora {lora(now)}; pass the run's --lora (or another --out)")
    for key in ("workload", "config", "model"):
        if saved.get(key) != now.get(key):
            raise ValueError(f"--resume: the checkpoint {str(where)!r} is from workload {saved.get('workload')!r} "
                             f"config {saved.get('config')!r}, this run is {now.get('workload')!r} config "
                             f"{now.get('config')!r} ({key} differs); pass the run's --workload/--config or another --out")
    saved_steps = extra.get("schedule_steps", extra.get("steps"))   # what the LR schedule was built for
    if saved_steps is not None and saved_steps != steps:
        warnings.warn(f"--resume with --steps {steps}, but the run's learning-rate schedule was built for "
                      f"{saved_steps} steps and resumes as it was (the scheduler's state is restored): steps past "
                      f"{saved_steps} run at the schedule's final rate. For a schedule over {steps} steps, start a "
                      "new run", stacklevel=3)
    position = manifest.get("data_position", {})
    if position.get("seed") != seed or "batches" not in position:
        raise ValueError(f"--resume: the checkpoint {str(where)!r} was trained with --seed {position.get('seed')}, "
                         f"this run has --seed {seed}; the batch stream would differ: pass --seed {position.get('seed')}")


def run_training(workload: Any, *, policy: str = "auto", steps: int, out: str | Path, seed: int = 0,
                 eval_every: int = 0, checkpoint_every: int = 0, keep: int | None = None, resume: bool = False,
                 device: str | None = None, guard: bool = False, command: str = "",
                 workload_spec: str | None = None, progress: bool = True,
                 on_step: Callable[[int, dict], None] | None = None, strategy: str | None = None,
                 ema: float | None = None, compile: bool = False) -> TrainOutcome:
    """Train ``workload`` under ``policy`` for ``steps`` optimizer steps, writing into ``out``.

    Args:
        workload: a :class:`mixprec.workloads.Workload`.
        policy, device: as for :class:`mixprec.MixedPrecision`.
        steps: total optimizer steps of the run (a resumed run continues up to it).
        out: output directory (module docstring).
        seed: seeds the weights and the batch stream.
        eval_every: evaluate every this many steps (0: at the end only).
        checkpoint_every: save a checkpoint every this many steps (0: only at the end and on a signal).
        keep: checkpoints kept (None: all).
        resume: continue from ``out/checkpoints/latest``.
        guard: attach a :class:`mixprec.Guard` (``loss_fn=workload.loss``) and write ``events.jsonl``.
        command, workload_spec: stored in the checkpoints' ``extra`` (``mixprec sample`` reads it).
        progress: show a tqdm bar on stderr.
        on_step: called as ``on_step(step, record)`` after each step's record is written.
        strategy: None, ``"ddp"`` or ``"fsdp2"`` (launched by torchrun; :mod:`mixprec.distributed.process`).
            Rank ``r`` of ``W`` trains on batches ``r, r + W, ...`` of the stream; ``step`` counts
            global steps. Rank 0 writes ``out``'s logs, other ranks ``out/rank-<r>/``; checkpoints
            are :func:`mixprec.distributed.process.save_distributed_checkpoint`'s (DCP under FSDP2), and a
            stop signal on any rank stops every rank at the same step.
        ema: keep a :class:`mixprec.EMA` with this decay (e.g. 0.999): each evaluation also runs on the
            averaged weights (``ema_<metric>`` in ``final_eval``), and it is saved in the checkpoints and
            resumed (refused with ``strategy``).
        compile: ``MixedPrecision(..., compile=True)`` (torch.compile, inductor; not with ``strategy``).
            The compilation runs in the first step: its ``step_time_ms`` includes it, and the first
            evaluation compiles the no-grad forward.

    Returns:
        :class:`TrainOutcome`; ``status`` 0, or 130 / 143 after SIGINT / SIGTERM.

    Raises:
        ValueError: bad arguments; ``out`` holds a run's checkpoints and ``resume`` is False; on
            ``resume``, a checkpoint from another workload, seed or policy
            (:class:`mixprec.checkpoint.local.CheckpointError` for a damaged one).
        DivergenceError: the guard gave up (``events.jsonl`` is written first).
    """
    from tqdm import tqdm

    from mixprec.programs.bench.measure import synchronize
    from mixprec.programs.session import build_engine, evaluate, train_step
    from mixprec.ema import EMA
    from mixprec.guard import Guard

    for name, value in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"run_training {name}={value!r} is not allowed; pass an int >= 0 (0: off)")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"run_training keep={keep!r} is not allowed; pass an int >= 1 or None (keep all)")
    if ema is not None and strategy is not None:
        raise ValueError(f"run_training ema={ema!r} with strategy={strategy!r} is not supported (the distributed "
                         "checkpoints do not carry an EMA yet); drop --ema or --strategy")
    out = Path(out)
    root = out / CHECKPOINTS
    if not resume and (root / LATEST).is_file():
        raise ValueError(f"{str(out)!r} holds the checkpoints of a run already; pass --resume to continue it, or "
                         "choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    mp = build_engine(workload, policy, steps=steps, seed=seed, device=device, strategy=strategy, compile=compile)
    policy_requested = str(mp.policy)
    if guard:
        mp.guard = Guard(loss_fn=workload.loss)
    averager = None if ema is None else EMA(mp, decay=ema)

    start, saved_world, schedule_steps = 0, 1, steps
    if resume and (root / LATEST).is_file():
        checkpoint = resolve_checkpoint(root)
        manifest = (read_distributed_manifest if strategy else read_manifest)(checkpoint)
        schedule_steps = manifest.get("extra", {}).get("schedule_steps", manifest.get("extra", {}).get("steps", steps))
        _check_same_run(manifest, workload, seed, checkpoint, steps)
        if manifest.get("extra", {}).get("ema") != ema:
            raise ValueError(f"--resume: the run in {str(checkpoint)!r} was trained with --ema "
                             f"{manifest.get('extra', {}).get('ema')}, this run has --ema {ema}; pass the run's --ema")
        saved_policy = manifest["policy"]
        # a run whose guard escalated precision continues under the escalated policy
        adopt = saved_policy != policy_requested and manifest["extra"].get("policy_requested") == policy_requested
        if saved_policy != policy_requested and not adopt:
            raise ValueError(f"--resume: {checkpoint} was saved under policy {saved_policy!r} but this run asks for "
                             f"{policy_requested!r}; resume with --policy '{saved_policy}' (converting a run to "
                             "another policy is done in Python: mixprec.load_checkpoint(..., convert=True))")
        if strategy:
            load_distributed_checkpoint(checkpoint, mp, adopt_policy=adopt)
        else:
            load_checkpoint(checkpoint, mp, adopt_policy=adopt, ema=averager)
        start = manifest["data_position"]["batches"]
        saved_world = manifest["data_position"].get("world_size", 1)
        print(f"mixprec train: resuming from {checkpoint} (step {start}, policy {mp.policy})", file=sys.stderr)
    elif resume:
        print(f"mixprec train: --resume: no checkpoint in {root} yet; starting from step 0", file=sys.stderr)
    if start > steps:
        raise ValueError(f"--resume: the checkpoint is at step {start}, past --steps {steps}; pass --steps >= {start}")
    print(f"mixprec train: {workload.name}/{workload.config_name}, policy {mp.policy} ({mp.decision}), "
          f"{steps} steps -> {out}", file=sys.stderr)

    batches = workload.batches("train", seed)
    for _ in range(start * saved_world):   # replay the stream to the data position (drawn, not trained)
        next(batches)
    batches = shard_batches(batches)       # this rank's share (one process: all of it)
    logs = out if is_main_process() else out / f"rank-{rank()}"
    logs.mkdir(exist_ok=True)
    metrics_path, events_path = logs / "metrics.jsonl", logs / "events.jsonl"
    if start:
        _keep_records_until(metrics_path, start)
    elif metrics_path.exists():
        metrics_path.unlink()
    if guard:
        events_path.write_text("".join(json.dumps(e, default=str) + "\n" for e in mp.events), encoding="utf-8")
    events_written = len(mp.events)

    def extra(eval_metrics: dict) -> dict:
        return {"workload": workload.describe(), "workload_spec": workload_spec or workload.name, "seed": seed,
                "steps": steps, "schedule_steps": schedule_steps, "command": command, "decision": mp.decision,
                "policy_requested": policy_requested, "final_eval": eval_metrics, "ema": ema}

    def save(step: int, eval_metrics: dict) -> Path:
        position = {"split": "train", "seed": seed, "batches": step}
        if strategy:
            return save_distributed_checkpoint(root, mp, extra=extra(eval_metrics), keep=keep, data_position=position)
        return save_checkpoint(root, mp, extra=extra(eval_metrics), keep=keep, data_position=position, ema=averager)

    def evaluate_all() -> dict[str, float]:
        metrics = evaluate(mp, workload)
        if averager is not None:
            with averager.swapped():
                metrics.update({f"ema_{k}": v for k, v in evaluate(mp, workload).items()})
        return metrics

    writer = _tensorboard(out) if is_main_process() else None
    eval_metrics: dict[str, float] = {}
    last_saved: tuple[int, Path] | None = None
    step, stopped = start, None
    shown = mp.decision   # printed above; auto decides at the first forward, a guard may escalate
    try:
        with _StopSignals() as signals, open(metrics_path, "a", encoding="utf-8") as log, \
                tqdm(total=steps, initial=start, unit="step", disable=not progress or not is_main_process()) as bar:
            for step in range(start + 1, steps + 1):
                batch, lr = next(batches), float(mp.optimizer.param_groups[0]["lr"])  # a tensor lr (torchao) logs as a number
                synchronize(mp.device)
                t0 = time.perf_counter()
                loss, result = train_step(mp, workload, batch)
                synchronize(mp.device)
                if mp.decision != shown and is_main_process():
                    shown = mp.decision
                    bar.write(f"mixprec train: step {step}: policy {mp.policy} ({mp.decision})", file=sys.stderr)
                record = {"kind": "train", "step": step, "loss": _finite(float(loss)), "applied": result.applied,
                          "skipped_reason": result.skipped_reason, "loss_scale": result.loss_scale,
                          "grad_norm": _finite(result.grad_norm), "lr": lr,
                          "step_time_ms": (time.perf_counter() - t0) * 1e3}
                log.write(json.dumps(record) + "\n")
                _add_scalars(writer, "train", record, step)
                if step == steps or (eval_every > 0 and step % eval_every == 0):
                    eval_metrics = evaluate_all()
                    log.write(json.dumps({"kind": "eval", "step": step,
                                          **{f"eval_{k}": _finite(v) for k, v in eval_metrics.items()}}) + "\n")
                    _add_scalars(writer, "eval", eval_metrics, step)
                    bar.set_postfix(eval_loss=f"{eval_metrics['loss']:.4f}")
                log.flush()
                if guard and len(mp.events) > events_written:
                    with open(events_path, "a", encoding="utf-8") as events:
                        events.writelines(json.dumps(e, default=str) + "\n" for e in mp.events[events_written:])
                    events_written = len(mp.events)
                bar.update(1)
                if checkpoint_every and step % checkpoint_every == 0 and step != steps:
                    last_saved = (step, save(step, eval_metrics))
                if on_step is not None:
                    on_step(step, record)
                stop = signals.received is not None
                if strategy:  # every rank stops at the same step, or the next collective hangs
                    stop = bool(any_across_ranks(torch.tensor(stop, device=mp.device)))
                if stop:
                    stopped = signal.Signals(signals.received or signal.SIGTERM).name
                    last_saved = (step, save(step, eval_metrics))
                    break
            else:
                if step > start:   # periodic saves skip the last step: this is the one save there
                    last_saved = (step, save(step, eval_metrics))
    finally:
        if writer is not None:
            writer.close()
        if guard and len(mp.events) > events_written:   # e.g. the "diverged" event before DivergenceError
            with open(events_path, "a", encoding="utf-8") as events:
                events.writelines(json.dumps(e, default=str) + "\n" for e in mp.events[events_written:])
    path = last_saved[1] if last_saved else None
    if stopped is not None:
        print(f"mixprec train: {stopped} at step {step}: saved {path}; continue with --resume", file=sys.stderr)
        return TrainOutcome(128 + signal.Signals[stopped].value, step, eval_metrics, path, stopped)
    if step == start:
        print(f"mixprec train: the run in {out} is complete already (step {step} of {steps})", file=sys.stderr)
    else:
        ema_note = f" (EMA {eval_metrics['ema_loss']:.4f})" if averager is not None else ""
        print(f"final eval loss {eval_metrics['loss']:.4f}{ema_note}; wrote {metrics_path} and {path}")
        print("".join(f"op plan: {line}\n" for line in op_plan.summary(mp.device.type, policy=mp.policy)), end="")
        if strategy is None and mp.frozen_names():   # LoRA / partly frozen: the trained params alone, small
            from safetensors.torch import save_file

            trainable_path = out / TRAINABLE_FILE
            save_file(mp.trainable_state_dict(), str(trainable_path), metadata={"policy": str(mp.policy),
                                                                                 "step": str(step)})
            print(f"wrote {trainable_path} (the trainable parameters only, fp32: "
                  f"{trainable_path.stat().st_size / 2**20:.1f} MiB)")
    return TrainOutcome(0, step, eval_metrics, path, None)
