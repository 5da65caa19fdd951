"""Where :func:`mixprec.numerics.advice.recommend` starts: :func:`starting_policy`.

With no policy preferred (``--policy fp32``, the default), the advice starts from the policy ``auto`` chooses by
its rule on its own measurement of this model (so an ``auto`` engine and the advice cannot contradict each other);
a measurement ``auto`` marked noisy is said as such, not as a fact about the model. Without a measurement, bf16-mixed
where bf16 was inspected. The caller then keeps in fp32 what the numerics found unsafe.
"""

from __future__ import annotations

import torch

from mixprec.formats import get_format
from mixprec.numerics.stats import NumericsStats
from mixprec.policy.policy import PRESETS, Policy

__all__ = ["starting_policy"]

_BF16_RANGE = "bf16 keeps fp32's exponent range, so activations cannot overflow and no loss scaling is needed"


_FASTER = {False: "trains this model faster", True: "measured faster"}


def _speed_base(report: NumericsStats) -> tuple[Policy, str] | None:
    """The base policy by auto's rule on ``report.speed`` (None: not measured, or its choice computes in a format
    that was not inspected): fp32 where no 16-bit candidate was faster by auto's margin, else auto's choice."""
    speed = report.speed
    if speed is None or speed.choice not in PRESETS:
        return None
    policy = PRESETS[speed.choice]
    measured = (f"by auto's rule on a NOISY measurement (a busy machine: the ratios are unreliable; inspect again on "
                f"a quiet machine) ({speed.decision})" if speed.noisy else f"as auto measured it on this model "
                f"({speed.decision})")
    if not policy.is_mixed:
        return policy, f"{speed.choice}: no 16-bit policy {_FASTER[speed.noisy]} than fp32 here, {measured}"
    if get_format(policy.compute_dtype).name not in report.formats:
        return None
    bf16 = f"; {_BF16_RANGE}" if policy.compute_dtype == torch.bfloat16 else ""
    return policy, f"{speed.choice}: faster than fp32 on this model, {measured}{bf16}"


def starting_policy(report: NumericsStats) -> tuple[Policy, str]:
    """The policy the advice starts from, and why in words: the policy under study when one was given (a 16-bit
    one), else auto's choice on its speed measurement (:class:`~mixprec.numerics.stats.MeasuredSpeed`, noisy ones
    said as such), else bf16-mixed (fp16-mixed where bf16 was not inspected). No host sync."""
    policy = report.policy
    if policy.is_mixed or policy.param_dtype != torch.float32:
        speed = "" if report.speed is None else f" (auto measured on this model: {report.speed.decision})"
        return policy, f"starting from the policy under study, {policy}{speed}"
    by_speed = _speed_base(report)
    if by_speed is not None:
        return by_speed
    if "bf16" in report.formats:
        return PRESETS["bf16-mixed"], f"bf16-mixed: {_BF16_RANGE}"
    if "fp16" in report.formats:
        return PRESETS["fp16-mixed"], "fp16-mixed: bf16 was not inspected"
    return policy, "fp32: neither bf16 nor fp16 was inspected"


