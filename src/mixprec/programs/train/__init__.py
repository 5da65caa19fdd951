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

The parts, one module each: :mod:`~mixprec.programs.train.config` (the arguments and the outcome),
:mod:`~mixprec.programs.train.loop` (the run step by step), :mod:`~mixprec.programs.train.resume` (the checkpoint
checked and loaded, the data position), :mod:`~mixprec.programs.train.logs` (metrics, events, TensorBoard),
:mod:`~mixprec.programs.train.signals` (SIGTERM / SIGINT noted until a step boundary).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.autocast import op_plan
from mixprec.auto.pending import PENDING
from mixprec.checkpoint import LATEST
from mixprec.memory.recompute import RecomputePlan
from mixprec.programs.train.config import AUTO, CHECKPOINTS, TRAINABLE_FILE, TrainConfig, TrainOutcome
from mixprec.programs.train.loop import TrainingRun
from mixprec.programs.train.resume import requested_policy, resume_point

__all__ = ["TrainOutcome", "TrainConfig", "run_training", "train", "CHECKPOINTS"]


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
    requested = requested_policy(config.policy, mp)
    run = TrainingRun(workload, config, mp, averager, requested,
                      resume_point(workload, config, mp, averager, requested))
    if run.start > config.steps:
        raise ValueError(f"--resume: the checkpoint is at step {run.start}, past --steps {config.steps}; pass "
                         f"--steps >= {run.start}")
    shown = AUTO if mp.decision.startswith(PENDING) else mp.policy   # pending: fp32 only until auto decides
    print(f"mixprec train: {workload.name}/{workload.config_name}, policy {shown} ({mp.decision}), "
          f"{config.steps} steps -> {config.out}", file=sys.stderr)
    step, stopped = run.loop()
    return _finish(run, step, stopped)


def _finish(run: TrainingRun, step: int, stopped: str | None) -> TrainOutcome:
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
