"""A workload's numerics: :func:`mixprec.numerics.inspect` run on a :class:`~mixprec.workloads.Workload`, and the
policy it advises (what ``mixprec inspect`` reports and ``mixprec bench --policies advised`` runs).
"""

from __future__ import annotations

import torch

from mixprec.numerics.advice import Recommendation
from mixprec.numerics.inspect import DEFAULT_FORMATS, inspect
from mixprec.numerics.report import NumericsReport
from mixprec.policy.policy import Policy
from mixprec.machine.capability import normalize_device
from mixprec.workloads import Workload, get_workload

__all__ = ["INSPECT_STEPS", "inspect_workload", "advised_policy"]

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


def inspect_workload(workload: Workload | str, *, config: str | None = None, data: str | None = None,
                     steps: int = INSPECT_STEPS, seed: int = 0, device: str | torch.device | None = None,
                     policy: str | Policy = "fp32", formats: tuple[str, ...] = DEFAULT_FORMATS,
                     lr: float | None = None, lora: str | None = None) -> NumericsReport:
    """:func:`mixprec.numerics.inspect` on a workload: its model built after ``torch.manual_seed(seed)``,
    its ``"train"`` batches for ``seed``, its loss and its optimizer recipe (``make_optimizer``).

    ``device``: ``None`` inspects on the best available device (as the other commands run).
    """
    wl = _workload(workload, config, data, lora)
    dev = normalize_device(device)
    torch.manual_seed(seed)
    model = wl.build_model()
    return inspect(model, wl.batches("train", seed), wl.loss, policy=policy, formats=formats, steps=steps,
                   lr=lr, optimizer=wl.make_optimizer, device=dev)


def advised_policy(workload: Workload | str, *, steps: int = INSPECT_STEPS, seed: int = 0,
                   device: str | torch.device | None = None, policy: str | Policy = "fp32",
                   config: str | None = None, data: str | None = None,
                   lora: str | None = None) -> tuple[Policy, Recommendation]:
    """Inspect ``workload`` and return ``(recommended policy, recommendation)`` — what
    ``mixprec bench --policies advised`` runs. ``str(policy)`` is its text form; for an fp16
    policy start the dynamic loss scale at ``recommendation.initial_loss_scale``, which the
    policy text does not carry.
    """
    report = inspect_workload(workload, config=config, data=data, steps=steps, seed=seed, device=device,
                              policy=policy, lora=lora)
    recommendation = report.recommend()
    return recommendation.policy, recommendation
