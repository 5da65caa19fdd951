"""A workload's numerics: :func:`mixprec.numerics.inspect` run on a :class:`~mixprec.workloads.Workload`, the speed
``auto`` measures on its model, and the policy it advises (what ``mixprec inspect`` reports and ``mixprec bench
--policies advised`` runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.machine.capability import normalize_device, probe
from mixprec.numerics.advice import Recommendation
from mixprec.numerics.inspect import DEFAULT_FORMATS, inspect
from mixprec.numerics.report import NumericsReport
from mixprec.numerics.stats import MeasuredSpeed
from mixprec.auto.trial import choose
from mixprec.policy.policy import Policy
from mixprec.policy.resolve import auto_candidates
from mixprec.workloads import Workload, get_workload

__all__ = ["INSPECT_STEPS", "inspect_workload", "measure_speed", "advised_policy"]

INSPECT_STEPS = 4   # fp32 training steps inspected by default


def _workload(workload: Workload | str, config: str | None = None, data: str | None = None,
              lora: str | None = None) -> Workload:
    if isinstance(workload, Workload):
        if config is not None or data is not None or lora is not None:
            raise ValueError("advised_policy/inspect_workload: config=, data= and lora= apply to a workload spec string, "
                             f"not to a built Workload ({type(workload).__name__}); drop them")
        return workload
    if isinstance(workload, str):
        return get_workload(workload, config=config, data=data, lora=lora)
    raise TypeError(f"workload={workload!r} must be a mixprec.workloads.Workload or a spec such as 'gpt' or "
                    "'package.module:function'")


def _forward_arguments(model: torch.nn.Module, call: Callable[[], Any]) -> tuple[tuple, dict]:
    """The arguments of ``model``'s first forward inside ``call()`` (run under no_grad)."""
    seen: list[tuple[tuple, dict]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen.append((args, kwargs))
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            call()
    finally:
        handle.remove()
    if not seen:
        raise ValueError("measure_speed: the workload's loss never called the model it was given, so auto has no "
                         "forward to time; call model(...) inside Workload.loss")
    return seen[0]


def measure_speed(workload: Workload | str, *, seed: int = 0, device: str | torch.device | None = None,
                  config: str | None = None, data: str | None = None, lora: str | None = None) -> MeasuredSpeed:
    """The speed ``policy="auto"`` measures on ``workload``'s model: :func:`mixprec.auto.trial.choose` (and its
    in-process and disk cache) on the model as an engine's pending ``auto`` times it at its first training
    forward: built after ``torch.manual_seed(seed)`` in an fp32 engine, called as the workload's loss calls it on
    its first ``"train"`` batch (``mp.cast_inputs``), the candidates :func:`mixprec.policy.resolve.auto_candidates`
    of the device's probe. A bench or training run's ``auto`` on the same workload and machine reads the same
    measurement (one cache key), so the advice and ``auto``'s decision agree. Host syncs: the trial's (none of
    its own on a CPU), and a forward to find the model's arguments."""
    wl = _workload(workload, config, data, lora)
    dev = normalize_device(device)
    candidates = auto_candidates(probe(dev))
    if len(candidates) < 2:
        return MeasuredSpeed(candidates[0], {}, f"auto → {candidates[0]}: the only policy {dev} runs natively")
    torch.manual_seed(seed)
    mp = MixedPrecision(wl.build_model(), None, policy="fp32", device=dev)   # auto's build: fp32 storage
    batch = mp.cast_inputs(next(wl.batches("train", seed)), keep=wl.keep_fp32_inputs)
    args, kwargs = _forward_arguments(mp.model, lambda: wl.loss(mp.model, batch))
    trial = choose(mp.module, args, kwargs, mp.device, candidates)
    return MeasuredSpeed(trial.choice, trial.ratios, trial.decision(mp.device.type), noisy=trial.noisy)


def inspect_workload(workload: Workload | str, *, config: str | None = None, data: str | None = None,
                     steps: int = INSPECT_STEPS, seed: int = 0, device: str | torch.device | None = None,
                     policy: str | Policy = "fp32", formats: tuple[str, ...] = DEFAULT_FORMATS,
                     lr: float | None = None, lora: str | None = None,
                     speed: MeasuredSpeed | bool = True) -> NumericsReport:
    """:func:`mixprec.numerics.inspect` on a workload: its model built after ``torch.manual_seed(seed)``,
    its ``"train"`` batches for ``seed``, its loss and its optimizer recipe (``make_optimizer``).

    ``device``: ``None`` inspects on the best available device (as the other commands run). ``speed``: the
    report's ``speed`` (what the advice's choice of a 16-bit policy reads): True measures it as ``auto`` does
    (:func:`measure_speed`), False leaves it unmeasured, a :class:`~mixprec.numerics.stats.MeasuredSpeed` is used
    as given.
    """
    wl = _workload(workload, config, data, lora)
    dev = normalize_device(device)
    torch.manual_seed(seed)
    model = wl.build_model()
    report = inspect(model, wl.batches("train", seed), wl.loss, policy=policy, formats=formats, steps=steps,
                     lr=lr, optimizer=wl.make_optimizer, device=dev)
    if speed is True:
        speed = measure_speed(wl, seed=seed, device=dev)
    return dataclasses.replace(report, speed=speed or None)


def advised_policy(workload: Workload | str, *, steps: int = INSPECT_STEPS, seed: int = 0,
                   device: str | torch.device | None = None, policy: str | Policy = "fp32",
                   config: str | None = None, data: str | None = None,
                   lora: str | None = None, speed: MeasuredSpeed | bool = True) -> tuple[Policy, Recommendation]:
    """Inspect ``workload`` and return ``(recommended policy, recommendation)`` — what
    ``mixprec bench --policies advised`` runs. ``str(policy)`` is its text form; for an fp16
    policy start the dynamic loss scale at ``recommendation.initial_loss_scale``, which the
    policy text does not carry. ``speed``: as :func:`inspect_workload`'s (by default ``auto``'s own measurement
    of the model, whose rule picks fp32 or a 16-bit policy when the policy under study is fp32).
    """
    report = inspect_workload(workload, config=config, data=data, steps=steps, seed=seed, device=device,
                              policy=policy, lora=lora, speed=speed)
    recommendation = report.recommend()
    return recommendation.policy, recommendation
