"""Policy resolution: which policy runs where, on a device's :class:`~mixprec.machine.capability.Capability`.

``resolve_policy(spec, device)`` turns ``"auto"`` or any policy into a concrete
:class:`~mixprec.policy.policy.Policy` for a device, and :func:`resolve` also returns the
human-readable decision that :class:`mixprec.MixedPrecision` records. Rules:

* CUDA: ``auto`` is bf16-mixed from compute capability 8.0, fp16-mixed below.
* MPS: bf16-mixed where the installed torch/macOS can create bf16 tensors and autocast to
  bf16 on MPS, else fp16-mixed.
* CPU: bf16-mixed only where this CPU's bf16 matmul is measured faster than fp32 (a short
  probe, cached in-process and on disk: :func:`mixprec.machine.capability.probe`), else fp32. Never
  fp16 on a CPU: its fp16 matmul is measured too, and is typically hundreds of times slower than fp32
  without native kernels.
* With ``model=`` and ``example_batch=``, ``auto`` is decided on the model instead of the matmul
  probe: a few forward+backward steps of fp32 and of each 16-bit candidate the device runs
  natively (:func:`auto_candidates`) are timed on it (:mod:`mixprec.auto.trial`), and a 16-bit
  policy is chosen only when it is measurably faster (3 %).
* An explicit policy the device cannot run raises ``ValueError`` listing what it can run,
  unless ``allow_fallback=True``: then it falls back to what ``auto`` picks, and the decision
  says so. Nothing is downgraded silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.auto.trial import choose, split_batch
from mixprec.machine.capability import Capability, normalize_device, probe
from mixprec.policy.policy import PRESETS, Policy
from mixprec.autocast.portable import describe as describe_ops
from mixprec.autocast.saved_dtype import describe as describe_saved

__all__ = ["Resolution", "auto_candidates", "resolve", "resolve_policy"]

log = logging.getLogger("mixprec")


@dataclass(frozen=True)
class Resolution:
    """The outcome of :func:`resolve`: the policy, the device and the decision in words."""

    policy: Policy
    device: torch.device
    decision: str
    fell_back: bool = False


def _can_run(policy: Policy, cap: Capability) -> str | None:
    """Why ``policy`` cannot run on ``cap``'s device, or None when it can."""
    dtypes = {policy.param_dtype, policy.compute_dtype, policy.state_dtype, policy.output_dtype}
    if torch.bfloat16 in dtypes and not cap.bf16:
        return f"{cap.device} cannot run bf16 ({cap.detail or 'not supported'})"
    if torch.float16 in dtypes and not cap.fp16:
        return f"{cap.device} cannot run fp16"
    return None


def _auto(cap: Capability) -> tuple[str, str]:
    dev = cap.device.split(":")[0]
    if dev == "cuda":
        return ("bf16-mixed", f"auto → bf16-mixed: {cap.detail} supports bf16 natively") if cap.bf16_fast else \
               ("fp16-mixed", f"auto → fp16-mixed: {cap.detail} predates native bf16 (needs 8.0)")
    if dev == "mps":
        return ("bf16-mixed", "auto → bf16-mixed: MPS supports bf16 here") if cap.bf16 else \
               ("fp16-mixed", f"auto → fp16-mixed: {cap.detail}")
    if cap.bf16_fast:
        return "bf16-mixed", f"auto → bf16-mixed: this CPU's {cap.detail} (matmul probe)"
    return "fp32", (f"auto → fp32: this CPU gains nothing from 16-bit matmuls ({cap.detail}; matmul probe); "
                    "fp16 is never chosen on a CPU")


def auto_candidates(cap: Capability) -> tuple[str, ...]:
    """The policies ``auto`` times on a model for ``cap``'s device, fp32 first: fp32 and bf16-mixed where
    bf16 works natively (on CUDA: compute capability 8.0+); fp16-mixed instead only on CUDA/MPS without
    native bf16; never fp16 on a CPU. Only ``-mixed`` policies: fp32 params, fp32's storage."""
    dev = cap.device.split(":")[0]
    if dev == "cpu":
        return ("fp32", "bf16-mixed") if cap.bf16 else ("fp32",)
    native_bf16 = cap.bf16 and (cap.bf16_fast or dev == "mps")
    if native_bf16:
        return ("fp32", "bf16-mixed")
    return ("fp32", "fp16-mixed") if cap.fp16 else ("fp32",)


def _auto_on_model(cap: Capability, dev: torch.device, model: Any, example_batch: Any,
                   loss_fn: Any) -> tuple[str, str]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"resolve('auto', model=...): model must be a torch.nn.Module, got {type(model).__name__}")
    if example_batch is None:
        raise ValueError("resolve('auto', model=...) needs example_batch=... too (what the model is called with: "
                         "a tensor, a tuple of positional arguments or a dict of keyword arguments), on the device")
    candidates = auto_candidates(cap)
    if len(candidates) == 1:
        return candidates[0], f"auto → {candidates[0]}: the only policy {dev} runs natively"
    args, kwargs = split_batch(example_batch)
    trial = choose(model, args, kwargs, dev, candidates, loss_fn=loss_fn)
    return trial.choice, trial.decision(dev.type)


def _op_words(policy: Policy, device_type: str) -> str:
    """The decision's words for the policy's op lists and what its norms save for backward."""
    return describe_ops(policy.ops, device_type, mixed=policy.is_mixed) + describe_saved(
        policy.saved, device_type, compute_dtype=policy.compute_dtype, ops=policy.ops)


def resolve(spec: str | Policy, device: str | torch.device | None = None, *,
            allow_fallback: bool = False, capability: Capability | None = None, model: Any = None,
            example_batch: Any = None, loss_fn: Any = None) -> Resolution:
    """Resolve ``spec`` (``"auto"``, a preset, ``key=value`` text or a Policy) for ``device``.

    Returns a :class:`Resolution` whose ``decision`` explains the choice in one line.
    ``capability`` replaces the probe (to plan for a device that is not here, e.g. ask what
    ``auto`` gives on an sm_75 GPU); the device is then not checked for availability.
    ``model`` and ``example_batch`` (on the device; a tuple is the positional arguments, a dict the
    keyword arguments, anything else the one argument): ``auto`` (and a fallback) times the candidate
    policies on the model (:func:`mixprec.auto.trial.choose`: 14 forward+backward steps for two
    candidates, the model left as found, the result cached) instead of the matmul probe; ``loss_fn``
    turns the output into the scalar backpropagated (default: the fp32 sum of its floating tensors).
    Ignored for an explicit policy. Host syncs: the probe's and the trial's (timing).

    Raises:
        ValueError: bad spec or device; or the device cannot run the policy and
            ``allow_fallback`` is False (the message lists what it can run); ``model`` without
            ``example_batch``, or an output with nothing to backpropagate and no ``loss_fn``.
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if capability is not None:
        dev, cap = torch.device(device if device is not None else capability.device), capability
    else:
        dev = normalize_device(device)
        cap = probe(dev)
    pick = (lambda: _auto(cap)) if model is None else (lambda: _auto_on_model(cap, dev, model, example_batch, loss_fn))
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        name, why = pick()
        policy = PRESETS[name]
        return Resolution(policy, dev, why + _op_words(policy, dev.type))
    policy = Policy.parse(spec)
    reason = _can_run(policy, cap)
    if reason is None:
        note = ""
        if dev.type == "cpu" and torch.float16 in (policy.compute_dtype, policy.param_dtype) and not cap.fp16_native:
            note = (f"; note: fp16 on this CPU is emulated, not native ({cap.detail}) — "
                    "it runs as asked but slowly")
        note += _op_words(policy, dev.type)
        return Resolution(policy, dev, f"{policy} on {dev} as asked ({policy.summary()}){note}")
    runnable = [n for n, p in PRESETS.items() if _can_run(p, cap) is None and p.fp8 is None and p.block is None]
    if not allow_fallback:
        raise ValueError(f"policy {str(policy)!r} cannot run on {dev}: {reason}. Policies this device "
                         f"can run: {runnable}; or pass allow_fallback=True to fall back explicitly")
    name, why = pick()
    decision = f"FALLBACK: asked {policy} on {dev} but {reason}; running {name} instead ({why})"
    log.warning("mixprec: %s", decision)
    decision += _op_words(PRESETS[name], dev.type)
    return Resolution(PRESETS[name], dev, decision, fell_back=True)


def resolve_policy(spec: str | Policy, device: str | torch.device | None = None, *,
                   allow_fallback: bool = False, capability: Capability | None = None, model: Any = None,
                   example_batch: Any = None, loss_fn: Any = None) -> Policy:
    """The policy part of :func:`resolve` (same arguments, same errors)."""
    return resolve(spec, device, allow_fallback=allow_fallback, capability=capability, model=model,
                   example_batch=example_batch, loss_fn=loss_fn).policy
