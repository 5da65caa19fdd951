"""Resuming a training run: the checkpoint checked to be this run's, loaded, and the data position it saved.

The data position is the number of batches drawn from the seeded stream ``workload.batches("train", seed)`` (and the
number of ranks that drew them), so the resumed run replays the stream that far and sees exactly the batches the
uninterrupted run would. A run asks for a policy as its checkpoints record it (:func:`requested_policy`); a run
whose guard escalated precision, or whose ``auto`` decided, continues under the policy it saved.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.checkpoint import LATEST, load_checkpoint, read_manifest, resolve_checkpoint
from mixprec.messages.location import user_stacklevel
from mixprec.distributed.process import is_main_process, world_size
from mixprec.programs.train.config import AUTO, TrainConfig

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["ResumePoint", "requested_policy", "resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: ``start``, the steps done (it continues at ``start + 1``); ``saved_world``, the number
    of ranks that trained them (the stream is replayed ``start * saved_world`` batches); ``schedule_steps``, the
    total the learning-rate schedule was built for (the run's ``steps`` on a fresh start)."""

    start: int
    saved_world: int
    schedule_steps: int


def requested_policy(policy: Any, mp: MixedPrecision) -> str:
    """What a run asks for, as its checkpoints record it (``policy_requested``): "auto" for ``policy="auto"``
    (decided or still pending: the engine runs fp32 until auto's first forward), else the policy ``mp`` was
    built under, as text."""
    return AUTO if isinstance(policy, str) and policy.strip().lower() == AUTO else str(mp.policy)


def _same_request(manifest: dict, requested: str) -> bool:
    """Whether the checkpoint's run asked for the policy this run asks for (``requested``: its ``--policy``, "auto"
    for auto): its recorded ``policy_requested``, or for "auto" a run that took its auto decision (an ``"auto"``
    event: checkpoints written before "auto" was recorded as asked)."""
    if manifest["extra"].get("policy_requested") == requested:
        return True
    return requested == AUTO and any(e.get("kind") == "auto" for e in manifest.get("events") or [])


def resume_point(workload: Any, config: TrainConfig, mp: MixedPrecision, averager: Any, requested: str
                 ) -> ResumePoint:
    """With ``resume`` and a checkpoint in the run's root: check it is this run's (``requested``: the policy this run
    asks for, :func:`requested_policy`), load it into ``mp`` and ``averager`` (either format, as the strategy wrote
    it) and return its data position; else a fresh start (step 0)."""
    fresh = ResumePoint(start=0, saved_world=1, schedule_steps=config.steps)
    if not (config.resume and (config.root / LATEST).is_file()):
        if config.resume:
            print(f"mixprec train: --resume: no checkpoint in {config.root} yet; starting from step 0", file=sys.stderr)
        return fresh
    checkpoint = resolve_checkpoint(config.root)
    manifest = read_manifest(checkpoint)
    saved_extra = manifest.get("extra", {})
    schedule_steps = saved_extra.get("schedule_steps", saved_extra.get("steps", config.steps))
    _check_same_run(manifest, workload, config.seed, checkpoint, config.steps)
    if saved_extra.get("ema") != config.ema:
        raise ValueError(f"--resume: the run in {str(checkpoint)!r} was trained with --ema {saved_extra.get('ema')}, "
                         f"this run has --ema {config.ema}; pass the run's --ema")
    saved_policy = manifest["policy"]
    # a run whose guard escalated precision continues under the escalated policy; an auto run under its decision
    adopt = saved_policy != requested and _same_request(manifest, requested)
    if saved_policy != requested and not adopt:
        ran = manifest["extra"].get("policy_requested")
        own = f" (or the run's own --policy '{ran}')" if ran not in (None, saved_policy) else ""
        raise ValueError(f"--resume: {checkpoint} was saved under policy {saved_policy!r} but this run asks for "
                         f"{requested!r}; resume with --policy '{saved_policy}'{own} (converting a run to "
                         "another policy is done in Python: mixprec.load_checkpoint(..., convert=True))")
    load_checkpoint(checkpoint, mp, adopt_policy=adopt, ema=averager)
    point = ResumePoint(start=manifest["data_position"]["batches"],
                        saved_world=manifest["data_position"].get("world_size", 1), schedule_steps=schedule_steps)
    print(f"mixprec train: resuming from {checkpoint} (step {point.start}, policy {mp.policy})", file=sys.stderr)
    from mixprec.programs.session import world_change_words   # the global batch at another number of ranks
    if (change := world_change_words(point.saved_world, world_size(), workload, mp.events)) and is_main_process():
        print(f"mixprec train: --resume: {change}", file=sys.stderr)
    return point


def _check_same_run(manifest: dict, workload: Any, seed: int, where: Path, steps: int) -> None:
    """ValueError unless the checkpoint at ``where`` (its ``manifest``) is this run's: the same LoRA, workload,
    config, model and seed; a warning when ``steps`` is not what its learning-rate schedule was built for."""
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
    at = manifest.get("step")
    if isinstance(at, int) and at > steps:   # refused before the schedule's warning, which would read as advice
        raise ValueError(f"--resume: the checkpoint {str(where)!r} is at step {at}, past --steps {steps}; pass "
                         f"--steps >= {at}")
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
