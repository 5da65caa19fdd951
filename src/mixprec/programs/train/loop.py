"""A training run in progress (:class:`TrainingRun`): the engine, the data stream from its position, the logs, the
evaluations and the checkpoints, step by step until ``steps`` or a stop signal."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.checkpoint import save_checkpoint
from mixprec.distributed.process import any_across_ranks, is_main_process, rank, shard_batches, world_size
from mixprec.programs.train.config import TrainConfig
from mixprec.programs.train.logs import add_scalars, event_lines, finite, keep_records_until, tensorboard
from mixprec.programs.train.resume import ResumePoint
from mixprec.programs.train.signals import StopSignals

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["TrainingRun"]


class TrainingRun:
    """One training run in progress: the engine, the data stream, the logs and what was saved last."""

    def __init__(self, workload: Any, config: TrainConfig, mp: MixedPrecision, averager: Any, requested: str,
                 point: ResumePoint) -> None:
        self.workload, self.config, self.mp, self.averager = workload, config, mp, averager
        self.policy_requested = requested
        self.start, self.saved_world, self.schedule_steps = point.start, point.saved_world, point.schedule_steps
        self.eval_metrics: dict[str, float] = {}
        self.last_saved: tuple[int, Path] | None = None
        self.state: dict | None = None

    def open_logs(self) -> None:
        """This rank's log directory; ``metrics.jsonl`` kept up to the data position; ``events.jsonl`` started."""
        self.logs = self.config.out if is_main_process() else self.config.out / f"rank-{rank()}"
        self.logs.mkdir(exist_ok=True)
        self.metrics_path, self.events_path = self.logs / "metrics.jsonl", self.logs / "events.jsonl"
        if self.start:
            keep_records_until(self.metrics_path, self.start)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        if self.config.guard:
            self.events_path.write_text("".join(event_lines(self.mp.events)), encoding="utf-8")
        self.events_written = len(self.mp.events)

    def write_events(self) -> None:
        """Append the events recorded since the last call to ``events.jsonl`` (with a guard)."""
        if self.config.guard and len(self.mp.events) > self.events_written:
            with open(self.events_path, "a", encoding="utf-8") as events:
                events.writelines(event_lines(self.mp.events[self.events_written:]))
            self.events_written = len(self.mp.events)

    def extra(self) -> dict:
        c = self.config
        return {"workload": self.workload.describe(), "workload_spec": c.workload_spec or self.workload.name,
                "seed": c.seed, "steps": c.steps, "schedule_steps": self.schedule_steps, "command": c.command,
                "decision": self.mp.decision, "policy_requested": self.policy_requested,
                "final_eval": self.eval_metrics, "ema": c.ema, "state_bytes": self.state}

    def save(self, step: int) -> None:
        """A checkpoint at ``step`` in the format the strategy needs (every rank calls it)."""
        position = {"split": "train", "seed": self.config.seed, "batches": step}
        self.last_saved = (step, save_checkpoint(self.config.root, self.mp, extra=self.extra(), keep=self.config.keep,
                                                 data_position=position, ema=self.averager))

    def evaluate(self) -> dict[str, float]:
        from mixprec.programs.session import evaluate

        metrics = evaluate(self.mp, self.workload)
        if self.averager is not None:
            with self.averager.swapped():
                metrics.update({f"ema_{k}": v for k, v in evaluate(self.mp, self.workload).items()})
        return metrics

    def eval_due(self, step: int) -> bool:
        return step == self.config.steps or (self.config.eval_every > 0 and step % self.config.eval_every == 0)

    def batches(self) -> Any:
        """This rank's share of the stream, replayed to the data position (drawn, not trained)."""
        batches = self.workload.batches("train", self.config.seed)
        for _ in range(self.start * self.saved_world):
            next(batches)
        return shard_batches(batches)

    def train_one(self, step: int, batch: dict, log: Any, writer: Any) -> dict:
        """One step and its record (written to ``log`` and TensorBoard); evaluates when due."""
        from mixprec.machine.timing import timed
        from mixprec.programs.session import train_step

        mp = self.mp
        lr = float(mp.optimizer.param_groups[0]["lr"])  # a tensor lr (torchao) logs as a number
        after = (lambda: self.measure_state(step)) if step == max(2, self.start + 1) else None
        (loss, result), step_s = timed(lambda: train_step(mp, self.workload, batch, after), mp.device)
        record = {"kind": "train", "step": step, "loss": finite(float(loss)), "applied": result.applied,
                  "skipped_reason": result.skipped_reason, "loss_scale": result.loss_scale,
                  "grad_norm": finite(result.grad_norm), "lr": lr, "step_time_ms": step_s * 1e3}
        log.write(json.dumps(record) + "\n")
        if after is not None:
            log.write(json.dumps({"kind": "state", **self.state}) + "\n")
        add_scalars(writer, "train", record, step)
        if self.eval_due(step):
            self.eval_metrics = self.evaluate()
            log.write(json.dumps({"kind": "eval", "step": step,
                                  **{f"eval_{k}": finite(v) for k, v in self.eval_metrics.items()}}) + "\n")
            add_scalars(writer, "eval", self.eval_metrics, step)
        log.flush()
        self.write_events()
        return record

    def measure_state(self, step: int) -> None:
        """This rank's training-state bytes from its tensors, after ``step``'s backward (no sync)."""
        from mixprec.distributed.rank_state import rank_state_bytes

        self.state = {**rank_state_bytes(self.mp.model, self.mp.optimizer).as_dict(), "step": step, "rank": rank(),
                      "world_size": world_size()}

    def loop(self) -> tuple[int, str | None]:
        """Train from the data position to ``steps``, saving as configured; returns the last step and the
        signal that stopped it (None). Every rank stops at the same step."""
        from tqdm import tqdm

        mp, c = self.mp, self.config
        batches = self.batches()
        self.open_logs()
        writer = tensorboard(c.out) if is_main_process() else None
        step, shown = self.start, mp.decision   # printed already; auto decides at the first forward, a guard may escalate
        try:
            with StopSignals() as signals, open(self.metrics_path, "a", encoding="utf-8") as log, \
                    tqdm(total=c.steps, initial=self.start, unit="step",
                         disable=not c.progress or not is_main_process()) as bar:
                for step in range(self.start + 1, c.steps + 1):
                    record = self.train_one(step, next(batches), log, writer)
                    if mp.decision != shown and is_main_process():
                        shown = mp.decision
                        bar.write(f"mixprec train: step {step}: policy {mp.policy} ({mp.decision})", file=sys.stderr)
                    if self.eval_due(step):
                        bar.set_postfix(eval_loss=f"{self.eval_metrics['loss']:.4f}")
                    bar.update(1)
                    if c.checkpoint_every and step % c.checkpoint_every == 0 and step != c.steps:
                        self.save(step)
                    if c.on_step is not None:
                        c.on_step(step, record)
                    stop = signals.received is not None
                    if c.strategy:  # every rank stops at the same step, or the next collective hangs
                        stop = bool(any_across_ranks(torch.tensor(stop, device=mp.device)))
                    if stop:
                        self.save(step)
                        return step, signal.Signals(signals.received or signal.SIGTERM).name
                if step > self.start:   # periodic saves skip the last step: this is the one save there
                    self.save(step)
                return step, None
        finally:
            if writer is not None:
                writer.close()
            self.write_events()   # e.g. the "diverged" event before DivergenceError
