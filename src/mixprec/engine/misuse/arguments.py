"""The engine's checks of its arguments and inputs: what ``MixedPrecision(...)``, ``mp.attach(...)``,
``mp.backward(loss)`` and ``mp.cast_inputs(batch)`` take. Errors name the argument, the value and the fix
(TypeError/ValueError); nothing here syncs the host with the device.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from mixprec.engine.misuse.cast_targets import keep_fields
from mixprec.engine.misuse.outside import check_not_wrapped
from mixprec.engine.ownership import check_unowned
from mixprec.memory.recompute import match_blocks, parse_request
from mixprec.messages.location import user_stacklevel
from mixprec.policy.policy import cast_floating
from mixprec.policy.tree import field_names, map_fields, map_tensors

__all__ = ["check_args", "check_optimizer", "check_loss", "needs_closure", "as_tensors", "cast_batch"]


def check_args(model: Any, max_grad_norm: Any, accumulation_steps: Any, recompute: Any = None,
               checkpoint: Any = None, guard: Any = None) -> Any:
    """The constructor's argument checks, before anything changes; returns the recompute option (``checkpoint=``,
    its old name, taken with a DeprecationWarning; TypeError for both, and for a ``guard`` without ``after_step``)."""
    if isinstance(guard, type):
        raise TypeError(f"guard={guard.__name__} is a class: pass an instance, e.g. guard={guard.__name__}()")
    if guard is not None and not callable(getattr(guard, "after_step", None)):
        raise TypeError(f"guard={guard!r} has no after_step(mp, result): pass a mixprec.Guard (e.g. "
                        "guard=mixprec.Guard()) or None (the default: a stuck loss scale is still refused)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if checkpoint is not None:
        if recompute is not None:
            raise TypeError(f"MixedPrecision got recompute={recompute!r} and checkpoint={checkpoint!r}: checkpoint= is "
                            "the old name of recompute=; pass recompute= alone")
        warnings.warn("MixedPrecision(checkpoint=...) is now recompute=... (activation recompute, not saving: "
                      "mixprec.save_checkpoint saves); checkpoint= still works in this release", DeprecationWarning,
                      stacklevel=user_stacklevel())
        recompute = checkpoint
    request = parse_request(recompute)   # before anything changes: a bad recompute= names itself
    if request.kind == "named":
        match_blocks(model, request.patterns)
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an int >= 1")
    if max_grad_norm is not None and not (float(max_grad_norm) > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 or None (no clipping)")
    check_unowned(model)   # a model another live engine prepared (after the arguments' own errors)
    return recompute


def check_optimizer(model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    if optimizer is None:
        raise ValueError(f"scheduler={type(scheduler).__name__} given without an optimizer; pass both, or attach them "
                         "together later: mp.attach(optimizer, scheduler)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None: an evaluation engine, mp.attach(...) "
                        f"later), got {type(optimizer).__name__}")
    check_not_wrapped(optimizer)   # accelerate's AcceleratedOptimizer: build the engine before prepare()
    if needs_closure(optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__} needs a closure in step() (it re-evaluates the loss, "
                        "as LBFGS does), which the engine's one-backward step cannot give; use a first-order "
                        "optimizer (mixprec.optim.AdamW, torch.optim.SGD/Adam), or train it without MixedPrecision")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("scheduler=ReduceLROnPlateau needs a metric at each step, which the engine does not "
                        "have; pass scheduler=None and call it yourself: `if result and result.applied: "
                        "plateau.step(val_loss)`")
    stepped = getattr(scheduler, "optimizer", None)   # torch's schedulers (SequentialLR checks its children's)
    if isinstance(stepped, torch.optim.Optimizer) and stepped is not optimizer:
        raise ValueError(f"scheduler={type(scheduler).__name__} was built on another optimizer "
                         f"({type(stepped).__name__} at {id(stepped):#x}) than optimizer={type(optimizer).__name__} "
                         f"(at {id(optimizer):#x}): the engine would step it after each applied step and this "
                         "optimizer's learning rate would never change. Build the scheduler on the optimizer you "
                         "pass (with two engines, as in a GAN, give each its own pair)")
    model_params = {id(p) for p in model.parameters()}
    if model_params and not any(id(p) in model_params for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("optimizer holds none of the model's parameters; build it on model.parameters() "
                         "(before MixedPrecision) so the engine can step and, where needed, rebind it")


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` has a required ``closure`` argument (LBFGS)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"loss must be a scalar floating tensor, got {type(loss).__name__} of shape "
                         f"{tuple(getattr(loss, 'shape', ()))} and dtype {getattr(loss, 'dtype', None)}; reduce it "
                         "(.mean()) and compute it in floating point")
    if not loss.requires_grad:
        raise ValueError("loss does not require grad, so nothing can be trained from it. Likely causes: it was "
                         "computed under torch.no_grad() or torch.inference_mode(); from detached tensors "
                         "(.detach(), .item(), .data, numpy); every parameter it depends on is frozen "
                         "(requires_grad=False); or reentrant activation checkpointing (use_reentrant=True) "
                         "whose inputs do not require grad cut the graph (pass use_reentrant=False). Compute it "
                         "from mp.model's output with autograd enabled")


def as_tensors(batch: Any) -> Any:
    """``batch`` with numpy arrays and scalars as tensors (``torch.as_tensor``); containers rebuilt, as
    :mod:`mixprec.policy.tree` does, so the caller's batch is not modified."""
    return map_tensors(batch, lambda t: t, leaf=_from_numpy)


def cast_batch(batch: Any, dtype: torch.dtype, device: torch.device, keep: tuple[str, ...]) -> Any:
    """``batch`` on ``device``, its floating tensors cast to ``dtype`` but those under the top-level keys,
    fields or indices ``keep`` (moved only; one key or index alone counts as one: :func:`~mixprec.engine.misuse.
    cast_targets.keep_fields`). Raises ValueError for a ``keep`` entry the batch lacks, TypeError for a ``keep``
    that names no field."""
    keep = keep_fields(keep)
    if not keep:
        return cast_floating(batch, dtype, device)
    names = field_names(batch) or []
    missing = [k for k in keep if k not in names]
    if missing:
        raise ValueError(f"cast_inputs(keep={keep!r}): {missing} not found; batch keys are {sorted(names)}")
    return map_fields(batch, lambda k, v: cast_floating(v, None if k in keep else dtype, device))


def _from_numpy(leaf: Any) -> Any:
    """A numpy array or scalar as a tensor (``torch.as_tensor``); any other leaf unchanged."""
    if type(leaf).__module__ == "numpy" and hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return torch.as_tensor(leaf)
    return leaf
