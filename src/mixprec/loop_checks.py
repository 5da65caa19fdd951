"""Checks on the user's training loop: the silent mistakes a loop makes around the engine, made loud.

Each check is cheap (Python loops over the parameters, no host sync) and speaks once:

* **foreign gradients**: at a boundary's first ``backward()``, gradients already on the engine's
  parameters were produced by someone else (another engine's backward through this model, as a GAN's
  generator step leaves on the discriminator, or a ``loss.backward()`` called directly). They are
  discarded, as ``optimizer.zero_grad()`` before the step would (torch.amp's recipe zeroes at the top of
  each step), with a one-time warning and an event.
* **gradients gone before the step**: fewer gradients at ``step()`` than the last ``backward()`` left
  means ``optimizer.zero_grad()``/``model.zero_grad()`` ran in between: RuntimeError (the step would
  apply part of the gradient).
* **a direct ``optimizer.step()``** between ``backward()`` and ``step()`` would apply scaled,
  unclipped gradients: RuntimeError from an optimizer step pre-hook.
* **missing gradients**: trainable parameters that got no gradient at a boundary are named once.
* **a training forward outside ``mp.autocast()``** under a ``-mixed`` policy runs in fp32: one warning.
* **a float field rounded by ``cast_inputs``** under 16-bit params (a regression target, say): one
  warning naming the field and the ``keep=`` fix.

The hooks drop their engine when copied or pickled (a deep copy of the model, as an EMA or a teacher
is made, must not report to the engine of the original).
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import torch
from torch import nn

from mixprec.tree import field_names

__all__ = ["LoopChecks", "TARGET_NAMES"]

#: Field names taken for targets by the ``cast_inputs`` check (compared lower-case).
TARGET_NAMES = frozenset({"y", "target", "targets", "label", "labels", "reward", "rewards", "return", "returns",
                          "value", "values", "advantage", "advantages", "score", "scores"})


class _ForwardHook:
    """The root module's forward pre-hook: the engine's checks before each eager forward."""

    def __init__(self, checks: LoopChecks | None) -> None:
        self.checks = checks

    def __getstate__(self):
        return {"checks": None}

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.checks is not None and not torch.compiler.is_compiling():
            self.checks.before_forward(module)


class _StepHook:
    """The optimizer's step pre-hook: refuses an ``optimizer.step()`` inside the engine's step."""

    def __init__(self, checks: LoopChecks | None) -> None:
        self.checks = checks

    def __getstate__(self):
        return {"checks": None}

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.checks is not None:
            self.checks.before_optimizer_step()


class LoopChecks:
    """The checks of one engine (module docstring). ``owner`` has ``module``, ``optimizer``, ``policy``,
    ``device``, ``masters``, ``events``, ``boundaries`` and ``micro_step``; ``on_forward``
    is called before each eager forward of ``owner.module`` (model-edit detection)."""

    def __init__(self, owner: Any, on_forward: Any) -> None:
        self.owner, self.on_forward = owner, on_forward
        self.applying = False          # True while the engine itself steps the optimizer
        self.grads_after_backward = 0
        self.reported_missing: set[int] = set()
        self.spoken: set[str] = set()
        self._handles: list[Any] = []

    def install(self) -> None:
        """The optimizer's step pre-hook, and (unless the policy is plain fp32: no hook on the model
        then, and an edit is found at ``backward()``) the model's forward pre-hook."""
        policy = self.owner.policy
        self._handles = [self.owner.optimizer.register_step_pre_hook(_StepHook(self))]
        if policy.is_mixed or policy.param_dtype != torch.float32:
            self._handles.append(self.owner.module.register_forward_pre_hook(_ForwardHook(self)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---------------------------------------------------------------- hooks
    def before_forward(self, module: nn.Module) -> None:
        if module is not self.owner.module:
            return
        self.on_forward()
        mp = self.owner
        mixed = mp.policy.is_mixed and mp.policy.param_dtype == torch.float32
        if mixed and torch.is_grad_enabled() and not torch.is_autocast_enabled(mp.device.type):
            self._once("outside-autocast", "forward", f"the model ran a training forward outside mp.autocast() under "
                       f"{mp.policy}: it computed in fp32 (parameters are fp32 under '-mixed' policies; only "
                       "autocast computes in 16 bits). Wrap the forward and the loss: `with mp.autocast(): loss = "
                       "...`")

    def before_optimizer_step(self) -> None:
        mp = self.owner
        if not self.applying and mp.micro_step:
            raise RuntimeError("optimizer.step() called between mp.backward() and mp.step(): the gradients are "
                               "still multiplied by the loss scale, unclipped and unchecked for inf/NaN. Remove the "
                               "call; mp.step() steps the optimizer (and skips the step when it must)")

    # ---------------------------------------------------------------- the step
    def before_first_backward(self) -> None:
        """Discard gradients on the engine's params that its own backward did not produce."""
        mp = self.owner
        stepped = [t for g in mp.optimizer.param_groups for t in g["params"]]
        held = [t for t in [*mp.masters.params, *stepped] if t.grad is not None]
        if not held:
            return
        names = self._names(held)
        for t in held:
            t.grad = None
        self._once("foreign-grads", "foreign-gradients",
                   f"gradients on {len(names)} parameter(s) of this engine ({', '.join(names[:4])}"
                   f"{', ...' if len(names) > 4 else ''}) were there before its first backward() of the step: "
                   "another engine's backward() through this model (a GAN's generator step reaches the "
                   "discriminator), or a loss.backward() called directly. They were discarded, as "
                   "optimizer.zero_grad() at the top of the step would; this engine's step uses only the "
                   "gradients of its own backward() calls")

    def after_backward(self, n_grads: int) -> None:
        self.grads_after_backward = n_grads

    def at_boundary(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads``, after raising if gradients vanished since the last backward(), and naming (once) the
        trainable params that have none."""
        mp = self.owner
        if len(grads) < self.grads_after_backward:
            lost, self.grads_after_backward = self.grads_after_backward - len(grads), 0
            raise RuntimeError(f"{lost} gradient(s) that mp.backward() produced are gone at mp.step(): "
                               "optimizer.zero_grad() or model.zero_grad() ran between them. The engine zeroes "
                               "gradients itself after every step; remove that call")
        self.grads_after_backward = 0
        missing = [t for g in mp.optimizer.param_groups for t in g["params"]
                   if t.requires_grad and t.grad is None and id(t) not in self.reported_missing]
        if not missing:
            return grads
        self.reported_missing.update(id(t) for t in missing)   # named once (ids: no name walk per step)
        new = self._names(missing)
        detail = (f"{len(new)} trainable parameter(s) received no gradient at boundary {mp.boundaries} "
                  f"({', '.join(new[:5])}{', ...' if len(new) > 5 else ''}), so this step does not train them: "
                  "unused in the forward, detached (.detach(), .data, torch.no_grad()), or cut off by reentrant "
                  "activation checkpointing whose inputs do not require grad (use_reentrant=False fixes that). "
                  "Freeze them (requires_grad_(False) before building) if that is intended")
        self._event("missing-gradients", detail)
        warnings.warn(f"mixprec: {detail}", stacklevel=4)
        return grads

    def check_cast(self, batch: Any, dtype: torch.dtype, keep: tuple) -> None:
        """Warn once when ``cast_inputs`` rounds a float field that may be a target to a 16-bit ``dtype``."""
        if dtype == torch.float32 or "cast-target" in self.spoken:
            return
        names = field_names(batch)
        if names is None:
            return
        floats = [k for k in names if k not in keep and _is_float(_child(batch, k))]
        suspects = [k for k in floats if str(k).lower() in TARGET_NAMES] or (floats[1:] if len(floats) > 1 else [])
        if suspects:
            self._once("cast-target", "cast-target",
                       f"cast_inputs rounded the floating field(s) {suspects} to {str(dtype)[6:]} with the inputs "
                       f"(policy {self.owner.policy} stores parameters in 16 bits). If one is a target or a label "
                       f"that the loss compares in fp32, keep it: mp.cast_inputs(batch, keep={tuple(suspects)!r})")

    # ---------------------------------------------------------------- helpers
    def _names(self, tensors: list[torch.Tensor]) -> list[str]:
        mp = self.owner
        by_id = {}
        stepped_of = {id(p): t for p, t in zip(mp.masters.params, mp.masters.masters)}
        for n, p in mp.module.named_parameters():
            by_id.setdefault(id(p), n)
            by_id.setdefault(id(stepped_of.get(id(p), p)), n)
        return list(dict.fromkeys(by_id.get(id(t), "?") for t in tensors))

    def _event(self, kind: str, detail: str) -> None:
        mp = self.owner
        mp.events.append({"step": mp.boundaries, "kind": kind, "cause": "training loop", "module": None,
                          "detail": detail})

    def _once(self, key: str, kind: str, detail: str) -> None:
        if key in self.spoken:
            return
        self.spoken.add(key)
        self._event(kind, detail)
        warnings.warn(f"mixprec: {detail} (said once)", stacklevel=5)


def _child(batch: Any, key: Any) -> Any:
    if isinstance(batch, (dict, collections.UserDict)) or (isinstance(batch, (list, tuple)) and isinstance(key, int)):
        return batch[key]
    return getattr(batch, key)


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()
