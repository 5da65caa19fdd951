"""What a forward outside ``mp.autocast()`` is told: :func:`outside_autocast`.

Under a ``-mixed`` policy a training forward outside ``mp.autocast()`` computes in fp32 (the params are fp32;
only autocast computes in 16 bits): said once. Where params are stored in 16 bits (``-pure`` policies' params,
or frozen params stored in the compute dtype under any policy), an fp32 input outside autocast meets 16-bit
weights and, unless the model casts it, its first matmul fails with torch's dtype error, which names neither the
cause nor the fix: said once, before it fails, with the fix. Pure: no host sync.
"""

from __future__ import annotations

import torch

from mixprec.policy.policy import Policy

__all__ = ["outside_autocast"]


def outside_autocast(policy: Policy, frozen16: int, args: tuple, training: bool) -> tuple[str, str, str] | None:
    """``(key, kind, words)`` for a forward of ``args`` outside ``mp.autocast()`` under ``policy`` with ``frozen16``
    frozen params stored in the compute dtype (``training``: grad enabled), or None when there is nothing to say.
    The caller says each key once."""
    if policy.is_mixed and policy.param_dtype == torch.float32 and training:
        return ("outside-autocast", "forward", f"the model ran a training forward outside mp.autocast() under "
                f"{policy}: it computed in fp32 (parameters are fp32 under '-mixed' policies; only autocast computes "
                "in 16 bits). Wrap the forward and the loss: `with mp.autocast(): loss = ...`")
    if policy.param_dtype == torch.float32 and not frozen16:
        return None
    stored = policy.param_dtype if policy.param_dtype != torch.float32 else policy.compute_dtype
    found = _float_input_not_in(args, stored)
    if found is None:
        return None
    pure = policy.param_dtype != torch.float32
    whose = "its parameters are" if pure else f"its {frozen16} frozen parameter(s) are stored in"
    fix = (", or pass the batch through mp.cast_inputs()" if pure else
           ", or keep the frozen modules in fp32 (policy keep_fp32=<module>)")
    return ("outside-autocast-dtype", "forward", f"the model got a {_name(found)} input outside mp.autocast() while "
            f"{whose} {_name(stored)} under {policy}: unless the model casts it, its first matmul fails with a dtype "
            "error ('mat1 and mat2 must have the same dtype'). Run every forward, evaluation included, inside "
            f"`with mp.autocast():`{fix}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _float_input_not_in(args: tuple, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the first floating tensor among ``args`` (and one level of list/tuple/dict inside them)
    that is not ``dtype``; None when there is none."""
    for arg in args:
        items = arg.values() if isinstance(arg, dict) else arg if isinstance(arg, (list, tuple)) else (arg,)
        for t in items:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                return t.dtype
    return None
