"""The escalation ladder: the next, safer policy after a failure that precision may cause.

:func:`next_policy` is the rung after ``policy``: block-scaled linears back to bf16 (``nvfp4-mixed`` →
``bf16-mixed``), keep the first non-finite module in fp32, then fp16 → bf16 (or fp32 where the device cannot run
bf16), then bf16 → fp32, then 8-bit optimizer state → fp32 state; under FSDP2 the rungs that would re-run
``fully_shard`` or swap the modules it sharded are skipped and named. :class:`mixprec.Guard` climbs it through
``mp.set_policy``; :func:`mixprec.guard.next_policy` is this function. Pure: no tensor, no host sync.
"""

from __future__ import annotations

import fnmatch

import torch

from mixprec.policy.policy import PRESETS, QUANTIZED_STATE_DTYPES, Policy

__all__ = ["next_policy"]

_KEEP_PATTERN_FORBIDDEN = ",=| []*?"   # a module name usable as an exact keep_fp32 pattern has none


def next_policy(policy: Policy, module: str | None, *, bf16_ok: bool, sharded: bool = False
                ) -> tuple[Policy | None, str]:
    """The next rung of the escalation ladder from ``policy``, and why (None: nothing left).

    ``sharded`` (FSDP2): rung 1 reshards the FSDP2 unit holding ``module`` in place
    (:mod:`mixprec.distributed.sharded_units`) and rung 4 changes the optimizer state's precision
    (:mod:`mixprec.distributed.sharded_switch`); rungs 0, 2 and 3 would swap sharded modules or re-run
    ``fully_shard``: skipped, named.

    0. block-scaled linears (``block``): → the same policy without them (``mxfp8-mixed`` / ``nvfp4-mixed`` →
       ``bf16-mixed``): the coarsest quantization goes first, before any module is blamed;
    1. ``module`` (the first non-finite module) runs in 16 bits and is not kept yet: keep it in
       fp32 (``keep_fp32 += (module,)``);
    2. any fp16 in the policy: fp16 → bf16 (fp32's exponent range, no loss scaling) where
       ``bf16_ok``, else straight to fp32;
    3. any bf16: → the ``fp32`` preset;
    4. 8-bit optimizer state (``state=int8`` / ``fp8``) under fp32 params and compute: → fp32 state.
    """
    if sharded:
        new, why = next_policy(policy, module, bf16_ok=bf16_ok)
        if new is None or new == policy.replace(state_dtype=new.state_dtype, state_rounding=new.state_rounding,
                                                keep_fp32=new.keep_fp32):
            return new, why   # rung 1 (its FSDP2 unit resharded) or rung 4
        skipped = f"'{why}' refused under strategy='fsdp2': " + (
            "it would swap the modules fully_shard sharded" if new.block != policy.block else
            "it would re-run fully_shard") + " (not done mid-run)"
        if policy.state_dtype in QUANTIZED_STATE_DTYPES:
            return (policy.replace(state_dtype=torch.float32, state_rounding="nearest"),
                    f"8-bit optimizer state → fp32 state ({skipped})")
        return None, skipped
    if policy.block is not None:
        return (policy.replace(block=None, block_keep=(), block_disable=()),
                f"block-scaled linears ({policy.block}) → bf16 (block=none)")
    fp16, bf16 = torch.float16, torch.bfloat16
    dtypes = {policy.param_dtype, policy.compute_dtype, policy.output_dtype, policy.state_dtype}
    if (module and dtypes & {fp16, bf16} and not any(c in module for c in _KEEP_PATTERN_FORBIDDEN)
            and not any(fnmatch.fnmatchcase(module, pat) for pat in policy.keep_fp32)):
        return policy.replace(keep_fp32=(*policy.keep_fp32, module)), f"keep {module!r} in fp32"
    if fp16 in dtypes:
        if not bf16_ok:
            return PRESETS["fp32"], "fp16 → fp32 (this device cannot run bf16)"
        swap = {name: bf16 if getattr(policy, name) == fp16 else getattr(policy, name)
                for name in ("param_dtype", "compute_dtype", "output_dtype", "state_dtype")}
        return policy.replace(**swap, loss_scale="none"), "fp16 → bf16 (fp32's exponent range, no loss scaling)"
    if bf16 in dtypes:
        return PRESETS["fp32"], "bf16 → fp32"
    if policy.state_dtype in QUANTIZED_STATE_DTYPES:
        return (policy.replace(state_dtype=torch.float32, state_rounding="nearest"),
                "8-bit optimizer state → fp32 state")
    return None, "the policy is fp32 already"
