"""The Hugging Face ``TrainingArguments`` under :class:`~mixprec.integrations.transformers.MixprecTrainer`'s engine.

What the engine cannot run yet is refused (:func:`refuse_unsupported`, :func:`check_whole_steps`); ``bf16=True`` /
``fp16=True`` are checked against the policy (:func:`check_flag`; :data:`FLAG_POLICY`: the policy each one gives
with ``policy=None``) and their adoption recorded (:func:`record_adopted_flag`); the Trainer gets a copy of the
arguments without its own autocast and clipping (:func:`engine_arguments`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from transformers import TrainingArguments

from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.records import Event
from mixprec.optim.adamw import AdamW
from mixprec.optim.sgd import SGD
from mixprec.policy.policy import Policy
from mixprec.policy.resolve import resolve

__all__ = ["FLAG_POLICY", "own_optimizer", "refuse_unsupported", "check_flag", "check_whole_steps", "engine_arguments",
           "record_adopted_flag"]

#: The policy ``policy=None`` takes from ``TrainingArguments(bf16=True)`` / ``(fp16=True)``.
FLAG_POLICY = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}


def check_whole_steps(dataloader: Any, args: TrainingArguments) -> None:
    """ValueError when the training would reach an epoch's end on a short accumulation step (the epoch's batches
    not a multiple of ``gradient_accumulation_steps``, and ``max_steps`` past the epoch's whole steps): the
    engine's accumulation group is fixed, and the Trainer would find it only after training that epoch."""
    try:
        batches = len(dataloader)
    except TypeError:   # no length (an IterableDataset): found at the short step itself, in training_step
        return
    steps = args.gradient_accumulation_steps
    whole = batches // steps
    if batches % steps == 0 or 0 < args.max_steps <= whole:
        return
    raise ValueError(
        f"the training dataloader has {batches} batches per epoch and gradient_accumulation_steps={steps}, so each "
        f"epoch would end on a short optimizer step of {batches % steps} micro-batch(es) (max_steps="
        f"{args.max_steps} reaches it), which MixprecTrainer's engine cannot accumulate (its group is fixed). Make the "
        f"batches per epoch a multiple of {steps} (a train_dataset of a multiple of per_device_train_batch_size x "
        f"{steps} examples, with dataloader_drop_last=True for a partial last batch), or set max_steps <= {whole} "
        "(the first epoch's whole steps)")


def refuse_unsupported(args: TrainingArguments) -> None:
    """ValueError for the arguments MixprecTrainer does not support yet (listed in the
    :mod:`mixprec.integrations.transformers` docstring)."""
    unsupported = [(name, why) for name, on, why in (
        ("bf16_full_eval", args.bf16_full_eval, "it casts the model to bf16 for evaluation"),
        ("fp16_full_eval", args.fp16_full_eval, "it casts the model to fp16 for evaluation"),
        ("torch_compile", args.torch_compile, "pass a compiled model or use MixedPrecision(compile=True)"),
        ("fsdp", bool(args.fsdp), "FSDP through the Trainer is not supported yet (torchrun without fsdp= runs DDP; "
                                  "the engine's own MixedPrecision(strategy='fsdp2') shards)"),
        ("deepspeed", args.deepspeed is not None, "DeepSpeed owns the precision itself; torchrun without deepspeed= "
                                                  "runs DDP"),
        ("n_gpu", args.n_gpu > 1, "DataParallel over several GPUs in one process is not supported; launch one "
                                  "process per GPU with torchrun (DDP)"),
    ) if on]
    if unsupported:
        name, why = unsupported[0]
        raise ValueError(f"MixprecTrainer does not support TrainingArguments({name}={getattr(args, name)!r}): {why}; "
                         "the engine's policy sets the precision of training and evaluation alike")


def check_flag(flag: str | None, policy: str | Policy, device: torch.device) -> None:
    """ValueError when ``args.bf16``/``args.fp16`` contradicts ``policy`` (it must compute in that dtype)."""
    if flag is None:
        return
    if isinstance(policy, str) and policy == "auto":
        raise ValueError(f"TrainingArguments({flag}=True) with policy='auto': auto may choose another precision. "
                         f"Pass policy=None (it takes {FLAG_POLICY[flag]!r} from {flag}=True), a {flag} policy, "
                         f"or drop {flag}=True")
    resolved = resolve(policy, device).policy
    if resolved.compute_dtype != (torch.bfloat16 if flag == "bf16" else torch.float16):
        raise ValueError(f"TrainingArguments({flag}=True) contradicts policy {resolved}, which computes in "
                         f"{str(resolved.compute_dtype).removeprefix('torch.')}: drop {flag}=True (the policy sets "
                         f"the precision), or pass a {flag} policy (e.g. {FLAG_POLICY[flag]!r})")


def engine_arguments(args: TrainingArguments, strategy: str | None) -> TrainingArguments:
    """A copy of ``args`` for the Trainer: no autocast of its own (bf16/fp16 off: the engine's is the one)
    and no clipping of its own (``max_grad_norm`` 0: the engine clips). Under ``strategy="ddp"`` the Trainer never
    enters DDP's ``no_sync`` (``sync_each_batch``): the engine sets which micro-batches reduce (every one under
    fp32 masters, whose gradients accumulate outside DDP's view)."""
    own = copy.copy(args)
    own.bf16 = own.fp16 = False
    own.mixed_precision = "no"
    own.max_grad_norm = 0.0
    if strategy is not None:
        config = args.accelerator_config
        kwargs = {**(config.gradient_accumulation_kwargs or {}), "sync_each_batch": True}
        own.accelerator_config = dataclasses.replace(config, gradient_accumulation_kwargs=kwargs)
    return own


def record_adopted_flag(mp: MixedPrecision, flag: str, max_grad_norm: float) -> None:
    """The event and decision clause of an adopted ``bf16=True``/``fp16=True``."""
    detail = (f"TrainingArguments({flag}=True) adopted: policy {mp.policy} computes in {flag}; the Trainer's own "
              f"autocast is off (one autocast: the engine's), max_grad_norm={max_grad_norm} clips in the engine")
    mp.record(Event(step=mp.boundaries, kind="hf-flag", cause="MixprecTrainer", module=None, detail=detail),
              decision=f"{mp.decision}; TrainingArguments({flag}=True) adopted (Trainer autocast off)")


def own_optimizer(cls: type, kwargs: dict[str, Any], optim: str) -> tuple[type, dict[str, Any], str] | None:
    """The :mod:`mixprec.optim` class for the Trainer's torch ``cls`` built from ``args.optim`` (``optim``):
    ``torch.optim.AdamW`` -> :class:`~mixprec.optim.AdamW`, ``torch.optim.SGD`` -> :class:`~mixprec.optim.SGD`,
    with ``kwargs`` less ``fused``/``foreach`` (torch's kernels, not an option of the math) and the words of the
    event that says so; None for any other class (the Trainer's own is kept; a policy it cannot run refuses it)."""
    own = {torch.optim.AdamW: AdamW, torch.optim.SGD: SGD}.get(cls)
    if own is None:
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    return own, kwargs, (f"args.optim={optim}: mixprec.optim.{own.__name__} with the Trainer's parameter groups and "
                         f"{sorted(kwargs)} (the same math as torch.optim.{cls.__name__} in fp32, up to the order of "
                         "fp32 operations, which a fused kernel changes; the policy's state format and rounding "
                         "otherwise)")
