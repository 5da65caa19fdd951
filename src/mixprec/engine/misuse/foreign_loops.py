"""A framework's loop steering the engine's run behind its back: refused by name (docs/integrations.md).

A user who moves a loop from Accelerate or Fabric to the engine keeps habits that the engine used to let
through, each training wrong silently. Four checks, each cheap (no host sync):

* **Accelerate's gradient accumulation**: ``Accelerator(gradient_accumulation_steps=N)`` with
  ``accelerator.accumulate(model)`` around ``mp.backward``/``mp.step``: accelerate's accumulation only gates
  its own ``AcceleratedOptimizer.step()`` and ``accelerator.backward``'s division; the engine would step every
  micro-batch. At each ``mp.backward()``, when the engine's model went through ``accelerator.prepare``
  (accelerate marks it ``_is_accelerate_prepared``) and accelerate's process-wide ``GradientState`` (read only
  when ``accelerate.state`` is imported already: mixprec never imports accelerate) says ``num_steps > 1``
  other than the engine's ``accumulation_steps``: ValueError naming both and the fix
  (``MixedPrecision(accumulation_steps=N)``, ``Accelerator()`` without it). Refused, not followed: the
  engine's window, loss division, overflow check and DDP sync all hang on ``accumulation_steps``, fixed at
  build; following a second counter would make two sources of truth. Equal counts pass.
* **Accelerate's processes**: in an accelerate run of several processes (``accelerate launch`` or torchrun:
  accelerate's process-wide ``PartialState`` says ``num_processes > 1``), an engine built without ``strategy=``
  would be trained by accelerate's own DDP (16-bit gradient all-reduce for 16-bit params, a ``no_sync`` the
  engine cannot see, each rank's own stochastic-rounding seed: ``set_seed(seed, device_specific=True)``), and
  the replicas drift apart silently. At each ``mp.backward()``: ValueError naming ``strategy="ddp"`` (the
  engine wraps, reduces in fp32, agrees skips and refuses per-rank rounding seeds) and ``accelerator.prepare``
  of the dataloader only.
* **``accelerator.clip_grad_norm_(params, ...)``** on an engine's parameters: under ``-pure`` the params hold
  no gradients (they are on the fp32 masters), so it clips nothing and returns 0; under fp16 it clips the
  still-scaled gradients; and the engine's own step would not know. Once accelerate is imported, the first
  ``mp.backward()`` of any engine wraps ``accelerate.Accelerator.clip_grad_norm_`` (once per process); the
  wrapper raises RuntimeError naming ``MixedPrecision(max_grad_norm=...)`` when a parameter given belongs to
  a live engine's model or is one of its masters (engines held weakly), and calls accelerate's own otherwise.
* **a scheduler stepped twice**: a scheduler attached to the engine (``MixedPrecision(..., scheduler=s)``,
  ``mp.attach(opt, s)``, Fabric's ``plugin.attach(optimizer, s)``) is stepped by the engine after each applied
  step; a user's own ``scheduler.step()`` as well moves the learning rate twice per step. Before each of its
  own optimizer steps the engine notes the ``last_epoch`` its scheduler step will leave; at the next
  ``mp.backward()`` and the next applied step, a larger ``last_epoch`` with no applied step in between (the
  engine's ``applied_steps`` unchanged) is a ``step()`` the engine did not make: RuntimeError. A load of the
  engine's state (its ``applied_steps`` change) or a fresh engine resumed by Lightning or the HF Trainer starts
  the comparison afresh; a scheduler the engine does not hold is the user's (no check); the Lightning plugin and
  ``MixprecTrainer`` route their framework's ``scheduler.step()`` for it to a no-op already.

Source: accelerate 1.15 ``GradientState`` (``num_steps``, a ``SharedDict`` singleton), ``Accelerator.
prepare_model`` (sets ``model._is_accelerate_prepared``), ``Accelerator.clip_grad_norm_``; torch
``LRScheduler.step`` (adds 1 to ``last_epoch``).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch

from mixprec.engine.protocol import Engine

__all__ = ["at_backward", "before_engine_step"]

_ENGINES: weakref.WeakSet = weakref.WeakSet()              # engines that ran a backward (the clip wrapper's)
_STEPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # engine -> (scheduler id, applied, last_epoch)
_CLIP_MARK = "__mixprec_checks_engine_params__"


def at_backward(mp: Engine) -> None:
    """Every ``mp.backward()``, before anything changes: the three checks of the module docstring (the clip
    wrapper is installed here once accelerate is imported)."""
    _ENGINES.add(mp)
    if "accelerate.state" in sys.modules:
        _check_accumulation(mp, sys.modules["accelerate.state"])
        _check_processes(mp, sys.modules["accelerate.state"])
    if "accelerate.accelerator" in sys.modules:
        _wrap_clip(sys.modules["accelerate.accelerator"])
    _check_scheduler(mp)


def before_engine_step(mp: Engine) -> None:
    """The engine's own optimizer step is about to run (then its scheduler step): check the scheduler, then
    note the ``last_epoch`` that step will leave and the ``applied_steps`` after it."""
    _check_scheduler(mp)
    epoch = _last_epoch(mp.scheduler)
    if epoch is None:
        _STEPPED.pop(mp, None)
    else:
        _STEPPED[mp] = (id(mp.scheduler), mp.applied_steps + 1, epoch + 1)


# ---------------------------------------------------------------------- accumulation
def _check_accumulation(mp: Engine, state_module: Any) -> None:
    shared = getattr(getattr(state_module, "GradientState", None), "_shared_state", None)
    if not shared or not any(getattr(m, "_is_accelerate_prepared", False) for m in (mp.model, mp.module)):
        return
    steps = (shared.get("plugin_kwargs") or {}).get("num_steps", 1)
    if isinstance(steps, int) and steps > 1 and steps != mp.accumulation_steps:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps}) is set, but this MixedPrecision engine "
            f"({mp.policy}) has accumulation_steps={mp.accumulation_steps}: accelerate's accumulation (and "
            "accelerator.accumulate(model)) only gates its own optimizer.step() and accelerator.backward(); the "
            f"engine steps the optimizer every {mp.accumulation_steps} micro-batch(es), not every {steps}. "
            f"Accumulate in the engine: MixedPrecision(model, optimizer, policy, accumulation_steps={steps}), "
            "mp.backward(loss) and mp.step() every micro-batch, and Accelerator(mixed_precision='no') without "
            "gradient_accumulation_steps (no accelerator.accumulate)")


# ---------------------------------------------------------------------- processes
def _check_processes(mp: Engine, state_module: Any) -> None:
    shared = getattr(getattr(state_module, "PartialState", None), "_shared_state", None)
    processes = (shared or {}).get("num_processes", 1)
    if mp.strategy is not None or not isinstance(processes, int) or processes < 2:
        return
    raise ValueError(
        f"this MixedPrecision engine ({mp.policy}) runs in an accelerate run of {processes} processes without "
        "strategy=: accelerate's DDP would reduce its gradients (in the params' 16-bit dtype under 16-bit "
        "storage), its no_sync would decide which micro-batches reduce behind the engine's fp32 masters, and each "
        "rank's stochastic rounding would draw its own stream, so the replicas drift apart. Build "
        "MixedPrecision(model, optimizer, policy, strategy='ddp') (the engine wraps the model in DDP, reduces in "
        "fp32 and checks the ranks' rounding seeds) and pass only the dataloader to accelerator.prepare "
        "(loader = accelerator.prepare(loader); call mp.model, not a model accelerate wrapped)")


# ---------------------------------------------------------------------- clipping
def _wrap_clip(accelerator_module: Any) -> None:
    cls = getattr(accelerator_module, "Accelerator", None)
    original = getattr(cls, "clip_grad_norm_", None)
    if original is None or getattr(original, _CLIP_MARK, False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owner = _engine_of(parameters)
        if owner is not None:
            raise RuntimeError(_CLIP_TEXT.format(policy=owner.policy))
        return original(self, parameters, *args, **kwargs)

    setattr(clip_grad_norm_, _CLIP_MARK, True)
    cls.clip_grad_norm_ = clip_grad_norm_


_CLIP_TEXT = ("accelerator.clip_grad_norm_(...) on the parameters of a MixedPrecision engine ({policy}): it cannot "
              "clip what the optimizer steps — under '-pure' policies the model's params hold no gradients (they "
              "are on the fp32 masters), so it clips nothing and returns 0; under fp16 the gradients are still "
              "multiplied by the loss scale until mp.step(). Clip in the engine, on the unscaled fp32 norm: "
              "MixedPrecision(model, optimizer, policy, max_grad_norm=1.0), and remove the call "
              "(mp.step() returns the pre-clip norm: result.grad_norm)")


def _engine_of(parameters: list[Any]) -> Engine | None:
    """The live engine one of ``parameters`` belongs to (a param of its model or a master), else None."""
    given = {id(p) for p in parameters}
    for mp in list(_ENGINES):
        owned = {id(p) for p in mp.module.parameters()} | {id(m) for m in mp.masters.masters}
        if given & owned:
            return mp
    return None


# ---------------------------------------------------------------------- the scheduler
def _last_epoch(scheduler: Any) -> int | None:
    epoch = getattr(scheduler, "last_epoch", None) if scheduler is not None else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def _check_scheduler(mp: Engine) -> None:
    noted = _STEPPED.get(mp)
    epoch = _last_epoch(mp.scheduler)
    if noted is None or epoch is None or noted[0] != id(mp.scheduler) or noted[1] != mp.applied_steps:
        return
    if epoch > noted[2]:
        _STEPPED.pop(mp, None)   # said once; a caught error does not repeat at every call
        raise RuntimeError(
            f"{type(mp.scheduler).__name__}.step() was called {epoch - noted[2]} time(s) outside the engine since "
            f"its last applied step (last_epoch {epoch}, the engine's step left {noted[2]}): this scheduler is "
            "attached to the MixedPrecision engine (MixedPrecision(..., scheduler=...), mp.attach(optimizer, "
            "scheduler) or Fabric's plugin.attach(optimizer, scheduler)), which steps it after each applied "
            "optimizer step (never on a skipped one), so the learning rate moved twice per step. Remove your own "
            "scheduler.step() call; or keep the scheduler yourself: do not attach it, and step it when "
            "result.applied (mp.step() returns the result)")
