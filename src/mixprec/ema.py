"""An fp32 exponential moving average of the trainable weights (Polyak averaging), kept next to an engine.

Why fp32: under a ``-pure`` policy with ``decay=0.999`` each EMA update moves a weight by ``(1 - decay)``
times its distance to the current weight, about ``1e-3 * 1e-4`` at ``lr=1e-4``: far below half a bf16
ulp (``2**-9`` at 0.3), so an EMA kept in the params' bf16 never moves. The shadow here is fp32 and
is fed the best fp32 value of each weight (its fp32 master where one exists, else the param plus the
optimizer's Kahan compensation, else the param upcast), so it moves as an fp32 EMA does.

The update rule is ``torch.optim.swa_utils.get_ema_multi_avg_fn``'s (and timm ``ModelEmaV2``'s)::

    shadow = lerp(shadow, w, 1 - decay)      # = decay * shadow + (1 - decay) * w, one fp32 foreach op

run after **applied** optimizer steps only (a step the engine skips, e.g. an fp16 overflow, never
calls ``optimizer.step()`` and so never updates the shadow), every ``every``-th applied step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.engine.feature import held_method
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.messages.location import user_stacklevel
from mixprec.optim import contract

__all__ = ["EMA"]

_STATE_KEYS = ("decay", "every", "steps_seen", "updates", "engine_step", "shadow")


def _check_args(mp: MixedPrecision, decay: Any, every: Any) -> None:
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"EMA(mp=...) needs a mixprec.MixedPrecision, got {type(mp).__name__}; build the engine "
                        "first: mp = MixedPrecision(model, optimizer, policy); ema = EMA(mp)")
    ok = isinstance(decay, (int, float)) and not isinstance(decay, bool) and math.isfinite(decay) and 0 < decay < 1
    if not ok:
        raise ValueError(f"EMA {decay=!r} is not allowed; it must be a float in (0, 1), e.g. decay=0.999 "
                         "(an average over about 1 / (1 - decay) = 1000 steps)")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"EMA {every=!r} is not allowed; it must be an int >= 1 (update the shadow every that "
                         "many applied steps), e.g. every=1")
    if mp.optimizer is None:
        raise RuntimeError("EMA(mp): the engine has no optimizer yet (built with optimizer=None), and the EMA updates "
                           "after each optimizer step; attach it first: mp.attach(optimizer), then EMA(mp)")
    if mp.strategy == "fsdp2":
        raise ValueError("EMA under strategy='fsdp2' is not supported: the params are shards (DTensors) that the "
                         "swap and the checkpoints do not handle; use strategy=None or 'ddp'")


def _value_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.complex64 if p.is_complex() else torch.float32



class EMA:
    """An fp32 exponential moving average ("shadow") of ``mp``'s trainable params, updated after each
    ``every``-th applied step as ``shadow = decay * shadow + (1 - decay) * w`` (``torch._foreach_lerp_``;
    the rule of ``torch.optim.swa_utils.get_ema_multi_avg_fn`` and timm ``ModelEmaV2``; Polyak averaging).

    ``w`` is each param's best fp32 value: its fp32 master (``-pure`` policies), else the param plus the
    optimizer's Kahan compensation (``bf16-kahan``), else the param itself (fp32) or upcast. The shadow
    starts as those values at construction. Shapes: as the params; dtype fp32 (complex64 for complex
    params); on the params' device. Frozen params are left out (they do not move); buffers (BatchNorm
    running stats) are not averaged.

    Usage::

        mp = mixprec.MixedPrecision(model, optimizer, "bf16-pure")
        ema = mixprec.EMA(mp, decay=0.999)
        ...train with mp.backward / mp.step as usual...
        with ema.swapped():
            evaluate(mp.model)

    The update runs in an ``optimizer.register_step_post_hook``, which the engine reaches only on applied
    steps; it never syncs the host with the device. ``every=N`` counts applied steps (``steps_seen``) and
    updates on every N-th (``updates``); ``decay`` is applied per update. A param made trainable later
    (``mp.unfreeze``) or whose shape changed (a model edit) starts from its current value at the next
    update, with a warning. A guard rollback (or loading an engine state without the EMA's) does not rewind
    the shadow: the first update after it warns once. ``mp.set_policy`` is followed (the values are read
    from ``mp.masters`` at each update).

    Read access: :attr:`shadow` (name → fp32 tensor, references; e.g. ``model.load_state_dict(ema.shadow,
    strict=False)`` to export). Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (exact), or
    ``mixprec.save_checkpoint(..., ema=ema)`` / ``load_checkpoint(..., ema=ema)``.

    Raises:
        TypeError: ``mp`` is not a :class:`mixprec.MixedPrecision`.
        ValueError: ``decay`` not in (0, 1), ``every`` not an int >= 1, or ``mp.strategy == "fsdp2"``.
    """

    def __init__(self, mp: MixedPrecision, decay: float = 0.999, *, every: int = 1) -> None:
        _check_args(mp, decay, every)
        self.mp = mp
        self.decay = float(decay)
        self.every = every
        self.steps_seen = 0          # applied steps seen since the EMA was built (or as restored)
        self.updates = 0             # shadow updates done
        self.engine_step = mp.applied_steps   # mp.applied_steps after the last applied step seen
        self._rewind_warned = False
        self._active_swap = False
        self._shadow: dict[str, torch.Tensor] = {name: value.detach().to(_value_dtype(value), copy=True)
                                                 for name, value in self._sources().items()}
        self._hook = mp.optimizer.register_step_post_hook(held_method(self._after_optimizer_step))   # weakly: no cycle

    # ------------------------------------------------------------------ the update
    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        """The averaged weights by param name (fp32 or complex64, on the device; references: do not write)."""
        return dict(self._shadow)

    def _sources(self) -> dict[str, torch.Tensor]:
        """Each trainable param's best fp32 value by name: its master (a reference), else a new tensor
        (the param upcast, plus Kahan compensation), else the fp32 param itself. No host sync."""
        mp = self.mp
        master_of = {id(p): m for p, m in mp.masters.pairs}
        values: dict[str, torch.Tensor] = {}
        for name, p in mp.module.named_parameters():
            if not p.requires_grad or not (p.is_floating_point() or p.is_complex()):
                continue
            master = master_of.get(id(p))
            if master is not None:
                values[name] = master.detach()
                continue
            value = p.detach().to(_value_dtype(p))   # no copy for an fp32 param
            comp = contract.compensation(mp.optimizer, p)
            values[name] = value if comp is None else value + comp.to(value.dtype)
        return values

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        mp = self.mp
        if mp.applied_steps < self.engine_step and not self._rewind_warned:
            self._rewind_warned = True
            warnings.warn(f"EMA: the engine went back from applied step {self.engine_step} to {mp.applied_steps} "
                          "(a guard rollback, or mp.load_state_dict / load_checkpoint without ema=); the shadow "
                          "is not rewound and keeps the average of the undone steps. To rewind it too, load a "
                          "checkpoint with load_checkpoint(..., ema=ema)", stacklevel=user_stacklevel())
        self.engine_step = mp.applied_steps + 1   # the engine counts this step right after optimizer.step()
        self.steps_seen += 1
        if self.steps_seen % self.every == 0:
            self._update()

    @torch.no_grad()
    def _update(self) -> None:
        sources = self._sources()
        self._sync_entries(sources)
        names = list(self._shadow)
        torch._foreach_lerp_([self._shadow[n] for n in names], [sources[n] for n in names], 1.0 - self.decay)
        self.updates += 1

    def _sync_entries(self, sources: dict[str, torch.Tensor]) -> None:
        """Entries for params that became trainable or changed shape start from their current value;
        params no longer trainable (or gone) are dropped; one warning names them."""
        new = [n for n, v in sources.items() if n not in self._shadow or self._shadow[n].shape != v.shape]
        gone = [n for n in self._shadow if n not in sources]
        if not new and not gone:
            return
        for n in gone:
            del self._shadow[n]
        for n in new:
            self._shadow[n] = sources[n].detach().to(_value_dtype(sources[n]), copy=True)
        warnings.warn(f"EMA: the trainable params changed (unfreeze, a model edit or a new policy's layout): "
                      f"{len(new)} ({', '.join(new[:5])}) start from their current value, {len(gone)} "
                      f"({', '.join(gone[:5])}) are no longer averaged", stacklevel=user_stacklevel())

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Put the shadow into the model's params for the ``with`` block (e.g. an evaluation), then restore
        the exact previous params: the same tensors, bit for bit.

        Each param is given a copy of its shadow cast to the param's storage dtype (bf16 under ``-pure`` and
        ``bf16-kahan``: the evaluation sees the average rounded to nearest, as the model sees its masters);
        this costs one copy of the trainable params in their storage dtype. The swap goes through
        ``param.data``, so version counters are untouched: the engine does not take it for a user edit, and
        masters, optimizer state and Kahan compensation are not touched. The autocast cache is cleared on
        entry and exit. No host sync.

        Raises:
            RuntimeError: nested ``swapped()``; an optimizer step inside the block (it would train the
                averaged weights, then be thrown away); a param whose shape changed since the last update.
        """
        if self._active_swap:
            raise RuntimeError("EMA.swapped() is already active; nested swaps would restore the shadow as the "
                               "model's weights. Leave the outer `with ema.swapped():` first")
        named = dict(self.mp.module.named_parameters())
        wrong = [n for n, s in self._shadow.items() if n not in named or named[n].shape != s.shape]
        if wrong:
            raise RuntimeError(f"EMA.swapped(): the params {wrong[:5]} are gone or changed shape since the last "
                               "EMA update (a model edit); train one step (the EMA then restarts them) first")
        refuse = self.mp.optimizer.register_step_pre_hook(self._refuse_step)
        saved: dict[str, torch.Tensor] = {}
        self._active_swap = True
        try:
            with torch.no_grad():
                for n, s in self._shadow.items():
                    p = named[n]
                    saved[n] = p.data
                    p.data = s.to(p.dtype, copy=True)
            torch.clear_autocast_cache()   # casts cached for the raw weights must not serve the shadow
            yield
        finally:
            for n, data in saved.items():
                named[n].data = data
            torch.clear_autocast_cache()
            refuse.remove()
            self._active_swap = False

    @staticmethod
    def _refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("an optimizer step inside `with ema.swapped():` would train the averaged weights and be "
                           "thrown away on exit; train outside the block (evaluate only inside it)")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"decay", "every", "steps_seen", "updates", "engine_step", "shadow": {name: tensor}}`` (tensors
        are references). No host sync."""
        return {"decay": self.decay, "every": self.every, "steps_seen": self.steps_seen, "updates": self.updates,
                "engine_step": self.engine_step, "shadow": dict(self._shadow)}

    def load_state_dict(self, state: dict[str, Any], *, check_only: bool = False) -> None:
        """Restore a :meth:`state_dict` exactly (shadow values copied, counters set). ``check_only``: raise,
        change nothing. No host sync.

        Raises:
            ValueError: other keys, another ``decay`` / ``every`` (build the EMA as the run did), or a shadow
                whose names, shapes or dtypes differ from this EMA's (another model or frozen set).
        """
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"EMA.load_state_dict: state keys {got} are not {sorted(_STATE_KEYS)}; pass the "
                             "output of EMA.state_dict()")
        if state["decay"] != self.decay or state["every"] != self.every:
            raise ValueError(f"EMA.load_state_dict: the state was saved with decay={state['decay']!r}, "
                             f"every={state['every']!r}; this EMA has decay={self.decay!r}, every={self.every!r}. "
                             f"Build it as the run did: EMA(mp, decay={state['decay']!r}, every={state['every']!r})")
        saved = state["shadow"]
        if set(saved) != set(self._shadow):
            diff = sorted(set(saved) ^ set(self._shadow))
            raise ValueError(f"EMA.load_state_dict: the saved shadow averages other params (differing: {diff[:5]}); "
                             "build the same model, with the same frozen params, before loading")
        for n, s in self._shadow.items():
            t = saved[n]
            if not isinstance(t, torch.Tensor) or t.shape != s.shape or t.dtype != s.dtype:
                have = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"EMA.load_state_dict: shadow {n!r} is {have}, this EMA's is {s.dtype} "
                                 f"{list(s.shape)}; build the same model before loading")
        if check_only:
            return
        with torch.no_grad():
            for n, s in self._shadow.items():
                s.copy_(saved[n])
        self.steps_seen, self.updates = int(state["steps_seen"]), int(state["updates"])
        self.engine_step = int(state["engine_step"])

    def __repr__(self) -> str:
        return (f"EMA(decay={self.decay}, every={self.every}, params={len(self._shadow)}, "
                f"steps_seen={self.steps_seen}, updates={self.updates})")
