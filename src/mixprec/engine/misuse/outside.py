"""What a framework around the engine does behind its back, made loud (docs/integrations.md).

Trainers (the Hugging Face ``Trainer``, Accelerate, Lightning) bring their own precision machinery; next to
an engine it silently contradicts the policy. Three checks, each cheap (no host sync):

* **someone else's autocast**: a forward of the engine's model that runs under a ``torch.autocast`` the
  policy does not open (``Accelerator(mixed_precision="bf16")`` or ``TrainingArguments(bf16=True)`` around an
  ``fp32`` policy; an fp16 autocast around a bf16 one). Where the engine hooks the forward (every policy but
  plain fp32, which adds no hook to the model), forward pre-hooks on the root and on each of its direct
  children check ``torch.is_autocast_enabled``/``torch.get_autocast_dtype`` (the children, because Accelerate
  opens its autocast *inside* ``model.forward``, after the root's pre-hooks ran). Every policy, fp32
  included, also looks for a ``torch.autocast`` held by a replaced ``model.forward`` (what Accelerate's
  ``prepare`` installs) before the engine's own optimizer step, so the decision is corrected before the first
  update. Said once: a warning, a ``"foreign-autocast"`` event and a clause on
  :attr:`mixprec.MixedPrecision.decision` naming what the forward really computed in (the decision line never
  claims a precision the run does not have). Not refused: an evaluation under someone else's autocast is
  legitimate, and the event makes the run's numbers honest. Not seen: a ``with torch.autocast(...)`` of your
  own around an fp32 engine's model (no hook there).
* **someone else's loop stepping the optimizer**: the engine's optimizer stepped outside ``mp.step()``
  while its parameters hold gradients that no ``mp.backward()`` produced (a framework's own
  ``loss.backward()`` + ``optimizer.step()``, with the engine built in a callback). Under ``-pure`` that
  steps the masters with no gradients (nothing trains); under ``-mixed`` it trains in fp32, unscaled and
  unchecked. RuntimeError naming the integration to use instead.
* **an optimizer another framework wrapped**: ``accelerate``'s ``AcceleratedOptimizer`` (what
  ``accelerator.prepare(...)`` returns) given to the engine, which must step, rebind and watch the real
  one. TypeError naming the order that works: build the engine first, then ``accelerator.prepare``.

Source: ``torch.is_autocast_enabled`` / ``torch.get_autocast_dtype`` (the autocast state a forward runs
under); accelerate 1.15 ``Accelerator.prepare_model`` (wraps ``model.forward`` in its autocast) and
``AcceleratedOptimizer`` (a torch ``Optimizer`` subclass that never runs ``Optimizer.__init__``).
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Any

import torch

from mixprec.engine.misuse.foreign_loops import before_engine_step
from mixprec.auto.pending import PENDING
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event
from mixprec.messages.location import user_stacklevel

__all__ = ["watch_autocast", "before_optimizer_step", "check_outside_step", "check_not_wrapped", "wrapped_autocast",
           "check_model_not_wrapped", "stray_step_text", "INTEGRATIONS"]

#: What to use instead of driving an engine from a framework's own loop (named in the errors).
INTEGRATIONS = ("the Hugging Face Trainer: mixprec.integrations.transformers.MixprecTrainer(model, args, policy=...); "
                "Lightning: L.Trainer(plugins=[mixprec.integrations.lightning.MixprecPrecision(policy)]); "
                "Accelerate with Accelerator(mixed_precision='no'): build MixedPrecision before "
                "accelerator.prepare(mp.model, optimizer, loader) and call mp.backward(loss) / mp.step() "
                "instead of accelerator.backward(loss) / optimizer.step()")

_MARK = "under someone else's"   # in the decision clause: the check is silent while the decision says it
_WARNED: weakref.WeakSet = weakref.WeakSet()   # engines that warned (once each; the event and clause come again
#                                               after a set_policy rewrote the decision line)
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # engine -> the wrapped forward last searched


class _AutocastHook:
    """A forward pre-hook holding its engine weakly (a dropped engine is not kept alive by the model); a
    copied or pickled hook (a deep copy of the model for an EMA or a teacher) holds none."""

    def __init__(self, engine: Engine | None, name: str) -> None:
        self._ref = None if engine is None else weakref.ref(engine)
        self.name = name

    def __getstate__(self) -> dict[str, Any]:
        return {"_ref": None, "name": self.name}

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        mp = None if self._ref is None else self._ref()
        if mp is None or torch.compiler.is_compiling() or _MARK in mp.decision:
            return
        found = foreign_autocast(mp)
        if found is not None:
            _report(mp, found, self.name)


def watch_autocast(mp: Engine) -> list[Any]:
    """Register the someone-else's-autocast check (module docstring) on ``mp.module`` and its direct
    children; returns the hook handles (the caller removes them with the engine's other hooks)."""
    handles = [mp.module.register_forward_pre_hook(_AutocastHook(mp, type(mp.module).__name__))]
    for name, child in mp.module.named_children():
        handles.append(child.register_forward_pre_hook(_AutocastHook(mp, name)))
    return handles


def foreign_autocast(mp: Engine) -> torch.dtype | None:
    """The dtype of an autocast enabled on ``mp.device`` that ``mp.policy`` does not open (None when there is
    none, or while ``policy='auto'`` is still pending: its timing runs the candidates' autocasts)."""
    device_type = mp.device.type
    if not torch.is_autocast_enabled(device_type) or mp.decision.startswith(PENDING):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return None if _expected(mp, dtype) else dtype


def _expected(mp: Engine, dtype: torch.dtype) -> bool:
    """True when ``dtype`` is the autocast ``mp.policy`` opens itself (its compute dtype; fp32 opens none)."""
    return mp.policy.is_mixed and dtype == mp.policy.compute_dtype


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype).removeprefix("torch."))


def _report(mp: Engine, dtype: torch.dtype, where: str) -> None:
    found = _short(dtype)
    policy = mp.policy
    runs = f"autocast in {_short(policy.compute_dtype)}" if policy.is_mixed else "no autocast"
    detail = (f"the forward of {where} ran under a {found} torch.autocast on {mp.device.type} that this engine did "
              f"not open (policy {policy} runs {runs}): Accelerator(mixed_precision=...), TrainingArguments("
              "bf16=True/fp16=True) or a `with torch.autocast(...)` around the model. That forward computed in "
              f"{found}, not as the policy says. Let mixprec own the precision: Accelerator(mixed_precision='no'), "
              "mixprec.integrations.transformers.MixprecTrainer (it refuses or adopts bf16=/fp16=), and no "
              "autocast of your own around mp.model")
    clause = f"; but a forward ran {_MARK} {found} autocast (event 'foreign-autocast'): not {policy}'s numerics"
    mp.record(Event(step=mp.boundaries, kind="foreign-autocast", cause="outside the engine", module=where,
                    detail=detail), decision=mp.decision + clause)
    if mp not in _WARNED:
        _WARNED.add(mp)
        warnings.warn(f"mixprec: {detail} (said once)", stacklevel=user_stacklevel())


def before_optimizer_step(mp: Engine, *, engine_step: bool) -> None:
    """The engine's optimizer step pre-hook, after its own checks: a step outside ``mp.step()``
    (``engine_step`` False) goes through :func:`check_outside_step`; the engine's own step first looks for an
    autocast wrapped around ``mp.module.forward`` (:func:`wrapped_autocast`; fp32 policies have no forward
    hooks), so the decision is corrected before the first update."""
    if not engine_step:
        check_outside_step(mp)
        return
    before_engine_step(mp)   # a scheduler.step() the engine did not make (engine/misuse/foreign_loops.py)
    forward = mp.module.__dict__.get("forward")
    if forward is None or _MARK in mp.decision or _CHECKED.get(mp) is forward:
        return
    _CHECKED[mp] = forward
    found = wrapped_autocast(forward)
    if found is not None and found.device == mp.device.type and not _expected(mp, found.fast_dtype):
        _report(mp, found.fast_dtype, f"{type(mp.module).__name__}.forward, wrapped (Accelerator.prepare?)")


def wrapped_autocast(forward: Any) -> torch.autocast | None:
    """The ``torch.autocast`` a replaced ``forward`` holds (Accelerate's ``prepare_model`` sets ``model.forward``
    to its autocast decorator, behind ``convert_outputs_to_fp32``): found through bound methods' ``__func__``,
    ``__wrapped__``, closure cells and callable wrapper objects' attributes (64 objects at most; never a module)."""
    todo, seen = [forward], set()
    while todo and len(seen) < 64:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.autocast):
            return obj
        todo.extend(x for x in (getattr(obj, "__func__", None), getattr(obj, "__wrapped__", None)) if x is not None)
        todo.extend(_cell(c) for c in (getattr(obj, "__closure__", None) or ()))
        if hasattr(obj, "__dict__") and callable(obj) and not isinstance(obj, (types.FunctionType, types.MethodType,
                                                                                type)):
            todo.extend(v for v in vars(obj).values() if callable(v))   # a wrapper object's wrapped callable
    return None


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return None


def check_outside_step(mp: Engine) -> None:
    """Called before the engine's optimizer steps outside ``mp.step()`` at a boundary (no micro-batch pending):
    RuntimeError when its parameters or the tensors it steps hold gradients (module docstring); a step with
    no gradients, or with every learning rate 0 (``torch.distributed.checkpoint``'s state layout), changes
    nothing and passes."""
    groups = mp.optimizer.param_groups
    if all(float(g.get("lr", 1.0)) == 0.0 for g in groups):   # torch.distributed.checkpoint lays out optimizer
        return                                                   # state with zero grads and lr 0: a no-op step
    held = [p for p in (*mp.masters.params, *(p for g in groups for p in g["params"])) if p.grad is not None]
    if not held:
        return
    misses = ("no loss scaling, no overflow skip" if mp.loss_scale.enabled else
              "no inf/NaN check or skip, no clipping (max_grad_norm)")
    raise RuntimeError(
        f"optimizer.step() on the optimizer of a MixedPrecision engine ({mp.policy}) was called outside mp.step(), "
        f"with gradients on {len({id(p) for p in held})} of its tensors that mp.backward() did not produce: a "
        "framework's own loop (loss.backward() or accelerator.backward(), then optimizer.step()) is driving a "
        f"model the engine was built on, e.g. from a TrainerCallback. The engine never sees the step: {misses}"
        + (", and the fp32 masters get no gradients, so nothing trains" if mp.masters.pairs else
           ", and the model trains as that loop computes, not as the policy says")
        + ". Use the integration instead — " + INTEGRATIONS)


def stray_step_text(mp: Engine) -> str:
    """The RuntimeError text for an ``optimizer.step()`` between ``mp.backward()`` and ``mp.step()``, saying what
    the gradients are under ``mp``'s policy (scaled only where a loss scale is on; part of a window
    mid-accumulation)."""
    state = (f"still multiplied by the loss scale ({mp.policy} scales the loss), unclipped and unchecked for inf/NaN"
             if mp.loss_scale.enabled else
             f"unclipped and unchecked for inf/NaN ({mp.policy} scales no loss; the check and clip come in mp.step())")
    window = (f"; this is micro-batch {mp.micro_step} of accumulation_steps={mp.accumulation_steps}, so they are "
              "only part of the step's gradients" if mp.accumulation_steps > 1 else "")
    return (f"optimizer.step() called between mp.backward() and mp.step(): the gradients are {state}{window}. "
            "Remove the call; mp.step() steps the optimizer (and skips the step when it must)")


def check_not_wrapped(optimizer: Any) -> None:
    """TypeError for an optimizer that Accelerate wrapped (``accelerator.prepare`` ran before the engine was
    built): the engine must step, rebind and hook the optimizer itself."""
    if type(optimizer).__module__.split(".")[0] == "accelerate" and hasattr(optimizer, "optimizer"):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is the wrapper accelerator.prepare() returns, so prepare() ran "
            "before MixedPrecision was built; the engine must own the real optimizer (it rebinds it to fp32 "
            "masters, steps it only on applied steps and refuses a stray optimizer.step()). Build the engine "
            "first: mp = MixedPrecision(model, optimizer, policy); model, optimizer, loader = "
            "accelerator.prepare(mp.model, optimizer, loader), with Accelerator(mixed_precision='no'). Inside the "
            "Hugging Face Trainer (a TrainerCallback gets this wrapper) use "
            "mixprec.integrations.transformers.MixprecTrainer instead")


def _wrapper_name(model: Any) -> str | None:
    """``DistributedDataParallel``, ``FullyShardedDataParallel`` (FSDP1) or ``FSDPModule`` (FSDP2's
    ``fully_shard``) when ``model`` is one, else None (by class name along the MRO: no import of FSDP)."""
    names = {c.__name__ for c in type(model).__mro__}
    return next((n for n in ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule") if n in names), None)


def check_model_not_wrapped(model: Any, policy: Any, strategy: str | None) -> None:
    """ValueError, before anything changes, for a model that someone else wrapped in DDP or FSDP before the
    engine was built, where that cannot stay right: under ``strategy=`` (the engine wraps it itself), or a
    policy that stores params in another dtype than fp32 (DDP built its buckets, and FSDP its flat params, for
    the fp32 ones: the engine's casts would make the ranks reduce 16-bit gradients, or drift apart, silently).
    fp32 params under an fp32 or ``-mixed`` policy are left as they are: the wrapper reduces fp32 gradients; not
    under fp8 or block-scaled linears (the engine swaps modules inside the wrapper: untested, refused)."""
    kind = _wrapper_name(model)
    swaps = policy.fp8 is not None or policy.block is not None
    if kind is None or (strategy is None and policy.param_dtype == torch.float32 and not swaps):
        return
    why = (f"strategy={strategy!r} wraps the model itself" if strategy is not None else
           f"policy {policy} swaps linears for {'fp8' if policy.fp8 else 'block-scaled'} modules inside the {kind} "
           "(not tested: the wrapper was built for the modules it saw)" if swaps else
           f"policy {policy} stores params in {str(policy.param_dtype).replace('torch.', '')}, and {kind} was built "
           "for the fp32 ones (its gradient reduction and the ranks' copies would no longer match, silently)")
    raise ValueError(
        f"model is a {kind} built before MixedPrecision: {why}. Build the engine on the unwrapped module and "
        f"let it wrap: MixedPrecision(model, optimizer, policy, strategy='ddp' or 'fsdp2'); in Lightning use "
        "mixprec.integrations.lightning.MixprecPrecision (it prepares the module before the strategy wraps it)")
