"""The training loop behind ``mixprec train``: log, evaluate, checkpoint, resume, stop on a signal.

:func:`run_training` trains one workload under one policy and writes into ``out``::

    metrics.jsonl        one JSON record per step ({"kind": "train", ...}) and per evaluation ({"kind": "eval"};
                         with ema: eval_ema_<metric> next to eval_<metric>)
    events.jsonl         with guard=True: mp.events (rollbacks, escalations, ...), one per line
    tensorboard/         when tensorboard is installed
    checkpoints/         a checkpoint root (mixprec.checkpoint): step-N/ directories and `latest`
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
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.autocast import op_plan
from mixprec.checkpoint import LATEST, load_checkpoint, read_manifest, resolve_checkpoint, save_checkpoint
from mixprec.distributed.process import any_across_ranks, is_main_process, rank, shard_batches, world_size
from mixprec.auto.pending import PENDING
from mixprec.engine.records import Event
from mixprec.memory.recompute import RecomputePlan
from mixprec.messages.location import user_stacklevel

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["TrainOutcome", "TrainConfig", "run_training", "train", "CHECKPOINTS"]

AUTO = "auto"
CHECKPOINTS = "checkpoints"
TRAINABLE_FILE = "trainable.safetensors"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class TrainOutcome:
    """What :func:`run_training` did.

    ``status``: 0 when all ``steps`` ran, ``128 + signum`` when a signal stopped the run (after
    saving a checkpoint). ``step``: steps done (the data position). ``checkpoint``: the last one saved.
    ``state_bytes``: this rank's training state measured from its tensors after the backward of the first step
    that has optimizer state (:func:`mixprec.distributed.rank_state.rank_state_bytes` as a dict, with ``step``,
    ``rank`` and ``world_size``; ``per_param``: bytes per parameter per rank); None when no step had optimizer
    state (``steps`` 1 from scratch). Also in ``metrics.jsonl`` (a ``"state"`` record) and the checkpoints' extra.
    """

    status: int
    step: int
    final_eval: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    stopped_by: str | None = None
    state_bytes: dict | None = None


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
                      "new run", stacklevel=user_stacklevel())
    position = manifest.get("data_position", {})
    if position.get("seed") != seed or "batches" not in position:
        raise ValueError(f"--resume: the checkpoint {str(where)!r} was trained with --seed {position.get('seed')}, "
                         f"this run has --seed {seed}; the batch stream would differ: pass --seed {position.get('seed')}")


@dataclass(frozen=True)
class TrainConfig:
    """:func:`run_training`'s arguments after the workload (documented there); :meth:`check` validates them."""

    steps: int
    out: Path
    policy: str = "auto"
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 0
    keep: int | None = None
    resume: bool = False
    device: str | None = None
    guard: bool = False
    command: str = ""
    workload_spec: str | None = None
    progress: bool = True
    on_step: Callable[[int, dict], None] | None = None
    strategy: str | None = None
    ema: float | None = None
    compile: bool = False
    recompute: Any = None

    def check(self) -> None:
        """Raise ValueError for a bad argument (naming it, the value and what is allowed)."""
        for name, value in (("eval_every", self.eval_every), ("checkpoint_every", self.checkpoint_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"run_training {name}={value!r} is not allowed; pass an int >= 0 (0: off)")
        keep = self.keep
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"run_training keep={keep!r} is not allowed; pass an int >= 1 or None (keep all)")
        if self.ema is not None and self.strategy is not None:
            raise ValueError(f"run_training ema={self.ema!r} with strategy={self.strategy!r} is not supported (the "
                             "distributed checkpoints do not carry an EMA yet); drop --ema or --strategy")

    @property
    def root(self) -> Path:
        """The run's checkpoint root."""
        return self.out / CHECKPOINTS


def run_training(workload: Any, *, policy: str = "auto", steps: int, out: str | Path, seed: int = 0,
                 eval_every: int = 0, checkpoint_every: int = 0, keep: int | None = None, resume: bool = False,
                 device: str | None = None, guard: bool = False, command: str = "",
                 workload_spec: str | None = None, progress: bool = True,
                 on_step: Callable[[int, dict], None] | None = None, strategy: str | None = None,
                 ema: float | None = None, compile: bool = False, recompute: Any = None) -> TrainOutcome:
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
            are :func:`mixprec.save_checkpoint`'s for the strategy (DCP under FSDP2), and a
            stop signal on any rank stops every rank at the same step.
        ema: keep a :class:`mixprec.EMA` with this decay (e.g. 0.999): each evaluation also runs on the
            averaged weights (``ema_<metric>`` in ``final_eval``), and it is saved in the checkpoints and
            resumed (refused with ``strategy``).
        compile: ``MixedPrecision(..., compile=True)`` (torch.compile, inductor; not with ``strategy``).
            The compilation runs in the first step: its ``step_time_ms`` includes it, and the first
            evaluation compiles the no-grad forward.
        recompute: ``MixedPrecision(..., recompute=recompute)``: None, ``"auto"`` (each block measured in the
            first step; the plan is printed at the end and carried by the checkpoints) or block names/globs.

    Returns:
        :class:`TrainOutcome`; ``status`` 0, or 130 / 143 after SIGINT / SIGTERM.

    Raises:
        ValueError: bad arguments; ``out`` holds a run's checkpoints and ``resume`` is False; on
            ``resume``, a checkpoint from another workload, seed or policy
            (:class:`mixprec.CheckpointError` for a damaged one).
        DivergenceError: the guard gave up (``events.jsonl`` is written first).
    """
    config = TrainConfig(steps=steps, out=Path(out), policy=policy, seed=seed, eval_every=eval_every,
                         checkpoint_every=checkpoint_every, keep=keep, resume=resume, device=device, guard=guard,
                         command=command, workload_spec=workload_spec, progress=progress, on_step=on_step,
                         strategy=strategy, ema=ema, compile=compile, recompute=recompute)
    return train(workload, config)


def train(workload: Any, config: TrainConfig) -> TrainOutcome:
    """:func:`run_training` with its arguments in ``config``."""
    from mixprec.ema import EMA
    from mixprec.guard import Guard
    from mixprec.programs.session import build_engine

    config.check()
    if not config.resume and (config.root / LATEST).is_file():
        raise ValueError(f"{str(config.out)!r} holds the checkpoints of a run already; pass --resume to continue "
                         "it, or choose another --out")
    config.out.mkdir(parents=True, exist_ok=True)
    mp = build_engine(workload, config.policy, steps=config.steps, seed=config.seed, device=config.device,
                      strategy=config.strategy, compile=config.compile, recompute=config.recompute,
                      guard=Guard(loss_fn=workload.loss) if config.guard else None)
    averager = None if config.ema is None else EMA(mp, decay=config.ema)
    run = _Run(workload, config, mp, averager)
    _resume(run)
    if run.start > config.steps:
        raise ValueError(f"--resume: the checkpoint is at step {run.start}, past --steps {config.steps}; pass "
                         f"--steps >= {run.start}")
    shown = AUTO if mp.decision.startswith(PENDING) else mp.policy   # pending: fp32 only until auto decides
    print(f"mixprec train: {workload.name}/{workload.config_name}, policy {shown} ({mp.decision}), "
          f"{config.steps} steps -> {config.out}", file=sys.stderr)
    step, stopped = run.loop()
    return _finish(run, step, stopped)


def _resume(run: _Run) -> None:
    """With ``resume`` and a checkpoint in the run's root: check it is this run's, load it (either format,
    as the strategy wrote it) and set the data position; else a fresh start."""
    config, mp = run.config, run.mp
    if not (config.resume and (config.root / LATEST).is_file()):
        if config.resume:
            print(f"mixprec train: --resume: no checkpoint in {config.root} yet; starting from step 0", file=sys.stderr)
        return
    checkpoint = resolve_checkpoint(config.root)
    manifest = read_manifest(checkpoint)
    saved_extra = manifest.get("extra", {})
    run.schedule_steps = saved_extra.get("schedule_steps", saved_extra.get("steps", config.steps))
    _check_same_run(manifest, run.workload, config.seed, checkpoint, config.steps)
    if saved_extra.get("ema") != config.ema:
        raise ValueError(f"--resume: the run in {str(checkpoint)!r} was trained with --ema {saved_extra.get('ema')}, "
                         f"this run has --ema {config.ema}; pass the run's --ema")
    saved_policy, requested = manifest["policy"], run.policy_requested
    # a run whose guard escalated precision continues under the escalated policy; an auto run under its decision
    adopt = saved_policy != requested and _same_request(manifest, requested)
    if saved_policy != requested and not adopt:
        ran = manifest["extra"].get("policy_requested")
        own = f" (or the run's own --policy '{ran}')" if ran not in (None, saved_policy) else ""
        raise ValueError(f"--resume: {checkpoint} was saved under policy {saved_policy!r} but this run asks for "
                         f"{requested!r}; resume with --policy '{saved_policy}'{own} (converting a run to "
                         "another policy is done in Python: mixprec.load_checkpoint(..., convert=True))")
    load_checkpoint(checkpoint, mp, adopt_policy=adopt, ema=run.averager)
    run.start = manifest["data_position"]["batches"]
    run.saved_world = manifest["data_position"].get("world_size", 1)
    print(f"mixprec train: resuming from {checkpoint} (step {run.start}, policy {mp.policy})", file=sys.stderr)
    from mixprec.programs.session import world_change_words   # the global batch at another number of ranks
    if (change := world_change_words(run.saved_world, world_size(), run.workload, mp.events)) and is_main_process():
        print(f"mixprec train: --resume: {change}", file=sys.stderr)


def _same_request(manifest: dict, requested: str) -> bool:
    """Whether the checkpoint's run asked for the policy this run asks for (``requested``: its ``--policy``, "auto"
    for auto): its recorded ``policy_requested``, or for "auto" a run that took its auto decision (an ``"auto"``
    event: checkpoints written before "auto" was recorded as asked)."""
    if manifest["extra"].get("policy_requested") == requested:
        return True
    return requested == AUTO and any(e.get("kind") == "auto" for e in manifest.get("events") or [])


def _requested_policy(policy: Any, mp: MixedPrecision) -> str:
    """What a run asks for, as its checkpoints record it (``policy_requested``): "auto" for ``policy="auto"``
    (decided or still pending: the engine runs fp32 until auto's first forward), else the policy ``mp`` was
    built under, as text."""
    return AUTO if isinstance(policy, str) and policy.strip().lower() == AUTO else str(mp.policy)


def _event_lines(events: list) -> list[str]:
    return [json.dumps(Event.of(e).to_dict(), default=str) + "\n" for e in events]


class _Run:
    """One training run in progress: the engine, the data stream, the logs and what was saved last."""

    def __init__(self, workload: Any, config: TrainConfig, mp: MixedPrecision, averager: Any) -> None:
        self.workload, self.config, self.mp, self.averager = workload, config, mp, averager
        self.policy_requested = _requested_policy(config.policy, mp)
        self.start, self.saved_world, self.schedule_steps = 0, 1, config.steps
        self.eval_metrics: dict[str, float] = {}
        self.last_saved: tuple[int, Path] | None = None
        self.state: dict | None = None

    def open_logs(self) -> None:
        """This rank's log directory; ``metrics.jsonl`` kept up to the data position; ``events.jsonl`` started."""
        self.logs = self.config.out if is_main_process() else self.config.out / f"rank-{rank()}"
        self.logs.mkdir(exist_ok=True)
        self.metrics_path, self.events_path = self.logs / "metrics.jsonl", self.logs / "events.jsonl"
        if self.start:
            _keep_records_until(self.metrics_path, self.start)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        if self.config.guard:
            self.events_path.write_text("".join(_event_lines(self.mp.events)), encoding="utf-8")
        self.events_written = len(self.mp.events)

    def write_events(self) -> None:
        """Append the events recorded since the last call to ``events.jsonl`` (with a guard)."""
        if self.config.guard and len(self.mp.events) > self.events_written:
            with open(self.events_path, "a", encoding="utf-8") as events:
                events.writelines(_event_lines(self.mp.events[self.events_written:]))
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
        record = {"kind": "train", "step": step, "loss": _finite(float(loss)), "applied": result.applied,
                  "skipped_reason": result.skipped_reason, "loss_scale": result.loss_scale,
                  "grad_norm": _finite(result.grad_norm), "lr": lr, "step_time_ms": step_s * 1e3}
        log.write(json.dumps(record) + "\n")
        if after is not None:
            log.write(json.dumps({"kind": "state", **self.state}) + "\n")
        _add_scalars(writer, "train", record, step)
        if self.eval_due(step):
            self.eval_metrics = self.evaluate()
            log.write(json.dumps({"kind": "eval", "step": step,
                                  **{f"eval_{k}": _finite(v) for k, v in self.eval_metrics.items()}}) + "\n")
            _add_scalars(writer, "eval", self.eval_metrics, step)
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
        writer = _tensorboard(c.out) if is_main_process() else None
        step, shown = self.start, mp.decision   # printed already; auto decides at the first forward, a guard may escalate
        try:
            with _StopSignals() as signals, open(self.metrics_path, "a", encoding="utf-8") as log, \
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


def _finish(run: _Run, step: int, stopped: str | None) -> TrainOutcome:
    """Report the run's end; with frozen params (LoRA) also write the trainable ones alone."""
    mp, config, eval_metrics = run.mp, run.config, run.eval_metrics
    path = run.last_saved[1] if run.last_saved else None
    if stopped is not None:
        print(f"mixprec train: {stopped} at step {step}: saved {path}; continue with --resume", file=sys.stderr)
        return TrainOutcome(128 + signal.Signals[stopped].value, step, eval_metrics, path, stopped, run.state)
    if step == run.start:
        print(f"mixprec train: the run in {config.out} is complete already (step {step} of {config.steps})",
              file=sys.stderr)
        return TrainOutcome(0, step, eval_metrics, path, None, run.state)
    ema_note = f" (EMA {eval_metrics['ema_loss']:.4f})" if run.averager is not None else ""
    print(f"final eval loss {eval_metrics['loss']:.4f}{ema_note}; wrote {run.metrics_path} and {path}")
    if run.state is not None:
        print(f"training state: {run.state['per_param']:.2f} bytes/param on rank {run.state['rank']} of "
              f"{run.state['world_size']} (measured from its tensors at step {run.state['step']})")
    print("".join(f"op plan: {line}\n" for line in op_plan.summary(mp.device.type, policy=mp.policy)), end="")
    plans = [e.get("detail") for e in mp.events if e.get("kind") == "recompute"]   # recompute="auto": measured
    print("".join(f"{RecomputePlan.from_text(plan).text(readable=True)}\n" for plan in plans[-1:]), end="")
    if config.strategy is None and mp.frozen_names():   # LoRA / partly frozen: the trained params alone, small
        from safetensors.torch import save_file

        trainable_path = config.out / TRAINABLE_FILE
        save_file(mp.trainable_state_dict(), str(trainable_path), metadata={"policy": str(mp.policy),
                                                                             "step": str(step)})
        print(f"wrote {trainable_path} (the trainable parameters only, fp32: "
              f"{trainable_path.stat().st_size / 2**20:.1f} MiB)")
    return TrainOutcome(0, step, eval_metrics, path, None, run.state)
