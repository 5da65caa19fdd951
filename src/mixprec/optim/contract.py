"""The optimizer-precision contract: what the engine asks of an optimizer, stated once.

Two kinds of optimizer run under :class:`mixprec.MixedPrecision`:

* a :class:`PrecisionAware` one (:class:`mixprec.optim.AdamW`, :class:`mixprec.optim.SGD`): fp32 math
  for any param dtype; it takes the policy's ``rounding``, ``state_dtype`` and ``state_rounding``
  (unless it was built with explicit ones, which must then agree with the policy), holds Kahan
  compensation per param, 8-bit state where the policy says ``state=int8``/``fp8``, and re-keys
  (converting where the state format changes) its state when the engine swaps the tensors it steps;
* a stock ``torch.optim`` optimizer: state in its params' dtype, round-to-nearest writes. It is
  accepted only where that is exact enough: fp32 stepped tensors (fp32 params or fp32 masters; complex64
  params, two fp32 numbers each, which every policy keeps as they are), ``rounding='nearest'``, fp32 state.

The engine calls only the functions below. None syncs the host with the device.
"""

from __future__ import annotations

import warnings
from typing import Protocol, runtime_checkable

import torch

from mixprec.optim.arguments import check_saved_options
from mixprec.optim.precision_optimizer import PrecisionOptimizer
from mixprec.optim.sr_seed import seeded_groups
from mixprec.policy.policy import Policy, state_name
from mixprec.messages.location import user_stacklevel

__all__ = ["PrecisionAware", "check", "check_loadable", "configure", "compensation", "move_state", "start_compensation", "state_note"]

# stepped tensors a stock optimizer handles as it would in an fp32 run: complex64 is two fp32 numbers
# (torch.optim steps it on its fp32 real view), complex128 more; complex32 is 16-bit and is not here
_FULL_PRECISION = {torch.float32, torch.complex64, torch.complex128}


@runtime_checkable
class PrecisionAware(Protocol):
    """An optimizer that does its own precision (see :class:`mixprec.optim.precision_optimizer.PrecisionOptimizer`)."""

    rounding: str
    state_dtype: torch.dtype
    state_rounding: str

    @property
    def precision_explicit(self) -> bool: ...

    def set_precision(self, *, rounding: str, state_dtype: torch.dtype, state_rounding: str) -> None: ...

    def compensation(self, p: torch.Tensor) -> torch.Tensor | None: ...

    def move_state(self, moves: list[tuple[torch.Tensor, torch.Tensor | None]], *, rounding: str,
                   state_dtype: torch.dtype, state_rounding: str) -> None: ...

    def state_note(self) -> str: ...

    def start_compensation(self, residuals: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...


def check(opt: torch.optim.Optimizer, policy: Policy, stepped_dtypes: set[torch.dtype]) -> None:
    """Raise ValueError (naming the fix) if ``opt`` cannot run ``policy`` stepping ``stepped_dtypes``."""
    if isinstance(opt, PrecisionAware):
        # only what was passed to the constructor must agree: the settings left out follow the policy
        explicit = getattr(opt, "explicit_precision", None)
        if explicit is None:   # a PrecisionAware optimizer of another make: all three are its own
            explicit = ({"rounding": opt.rounding, "state_dtype": opt.state_dtype, "state_rounding": opt.state_rounding}
                        if opt.precision_explicit else {})
        differ = {k: v for k, v in explicit.items() if v != getattr(policy, k)}
        if differ:
            def text(values: dict) -> str:
                return ", ".join(f"{k}={state_name(v) if k == 'state_dtype' else v!r}" for k, v in values.items())
            keys = {"rounding": "rounding", "state_dtype": "state", "state_rounding": "state_rounding"}
            hint = ""
            try:
                wanted = policy.replace(**differ)
                hint = f", e.g. policy={str(wanted)!r}"
            except ValueError:
                pass
            raise ValueError(f"{type(opt).__name__} was built with {text(differ)} but the policy {policy} says "
                             f"{text({k: getattr(policy, k) for k in differ})}; drop those arguments (the policy sets "
                             f"them) or write them into the policy ({', '.join(keys[k] + '=' for k in differ)}{hint})")
        return
    name = type(opt).__name__
    lacks = ([f"writes updates with rounding={policy.rounding!r}"] if policy.rounding != "nearest" else []) + (
        [f"asks for state={state_name(policy.state_dtype)}"] if policy.state_dtype != torch.float32 else [])
    if lacks:   # every missing capability at once, so one fix covers them
        raise ValueError(f"policy {policy} {' and '.join(lacks)}, which {name} cannot do; {_replacement(opt)}")
    half = sorted(str(d).replace("torch.", "") for d in stepped_dtypes - _FULL_PRECISION)
    if half:
        raise ValueError(f"{name} would keep its state in {half} under policy {policy} (16-bit params, no master "
                         "weights): small moments round away. Fix: use mixprec.optim.AdamW (fp32 state and math), "
                         "or master=fp32 (e.g. bf16-pure)")


def _replacement(opt: torch.optim.Optimizer) -> str:
    """What to use instead of the stock ``opt`` under a policy it cannot run, for its own update rule."""
    name = type(opt).__name__
    if isinstance(opt, (torch.optim.AdamW, torch.optim.SGD)):
        return f"use mixprec.optim.{name} (the same hyperparameters; it does both)"
    if type(opt) is torch.optim.Adam:
        if all(not g.get("weight_decay") for g in opt.param_groups):
            return ("use mixprec.optim.AdamW(..., weight_decay=0): Adam without weight decay is AdamW with "
                    "weight_decay=0 (mixprec's AdamW defaults to 0.01, as torch's)")
        return ("mixprec.optim has no Adam with coupled (L2) weight decay: mixprec.optim.AdamW decays decoupled, a "
                "different regularisation (retune weight_decay), or keep Adam under a policy with fp32 masters or "
                "params (bf16-pure, bf16-mixed)")
    return (f"mixprec.optim has AdamW and SGD only, nothing with {name}'s update rule: switch to one of them, or "
            f"keep {name} under a policy with fp32 masters or params (bf16-pure, bf16-mixed)")


def check_loadable(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """Raise now what ``opt.load_state_dict(state_dict)`` would refuse, loading nothing: for a :mod:`mixprec.optim`
    optimizer a saved group made with an option its math lacks, or without ``sr_seed`` while it rounds
    stochastically (:func:`mixprec.optim.sr_seed.seeded_groups`); a stock optimizer's own load checks only group
    sizes, which it raises before changing anything. The engine calls this before it loads weights or masters, so a
    refused checkpoint leaves the engine as it was. ValueError as :meth:`PrecisionOptimizer.load_state_dict`."""
    if isinstance(opt, PrecisionOptimizer):
        check_saved_options(type(opt).__name__, state_dict["param_groups"], opt._unimplemented_options)
        seeded_groups(opt, state_dict["param_groups"])


def configure(opt: torch.optim.Optimizer, policy: Policy) -> str:
    """Give a :class:`PrecisionAware` optimizer without explicit settings the policy's rounding and
    state format (before its first step); a stock optimizer has nothing to configure. Returns the
    decision's note on 8-bit state (:func:`state_note`)."""
    wanted = (policy.rounding, policy.state_dtype, policy.state_rounding)
    if isinstance(opt, PrecisionAware) and (opt.rounding, opt.state_dtype, opt.state_rounding) != wanted:
        # check() passed: the constructor's explicit settings are the policy's, the others follow it
        opt.set_precision(rounding=policy.rounding, state_dtype=policy.state_dtype,
                          state_rounding=policy.state_rounding)
    if policy.state_dtype == torch.float16:
        warnings.warn(f"policy {policy} keeps optimizer state in fp16: Adam's second moment (grad**2) "
                      "underflows fp16 below 6e-8, i.e. for gradients under ~2e-4, and the update then "
                      "blows up; prefer state=bf16 (fp32's range) or fp32", stacklevel=user_stacklevel())
    return state_note(opt)


def state_note(opt: torch.optim.Optimizer) -> str:
    """How a :class:`PrecisionAware` optimizer holds 8-bit state (tensors and elements quantized, kept in
    fp32), for the engine's decision and events; "" for 16/32-bit state or a stock optimizer."""
    return opt.state_note() if isinstance(opt, PrecisionAware) else ""


def compensation(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    """What Kahan rounding owes ``p`` (``p``'s dtype and shape), or None."""
    return opt.compensation(p) if isinstance(opt, PrecisionAware) else None


def start_compensation(opt: torch.optim.Optimizer, policy: Policy, values_fp32: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> None:
    """Under a Kahan ``policy``, start each 16-bit param's compensation at what storing it lost: for
    ``(p, value_fp32)`` pairs (``p`` just cast from its fp32 value), ``value_fp32 - p`` — so ``p`` plus its
    compensation is the fp32 value from step 0, not the rounded one. No-op otherwise. No host sync."""
    if policy.rounding == "kahan" and isinstance(opt, PrecisionAware):
        opt.start_compensation([(p, v - p.detach().float()) for p, v in values_fp32 if p.dtype in (torch.float16, torch.bfloat16)])


def move_state(opt: torch.optim.Optimizer, moves: list[tuple[torch.Tensor, torch.Tensor | None]],
               policy: Policy) -> None:
    """Re-key ``opt``'s state after the engine swapped the tensors it steps (``(old, new)`` pairs;
    ``new=None`` drops the state) and adopt ``policy``'s precision: moments whose storage format changes
    (e.g. ``state=fp32`` → ``state=int8``) are converted through fp32, others move bit for bit. A stock
    optimizer's state moves as it is (fp32 under every policy :func:`check` accepts)."""
    if isinstance(opt, PrecisionAware):
        opt.move_state(moves, rounding=policy.rounding, state_dtype=policy.state_dtype,
                       state_rounding=policy.state_rounding)
        return
    states = [(new, opt.state.pop(old, None)) for old, new in moves]
    for new, state in states:
        if state and new is not None:
            opt.state[new] = state
