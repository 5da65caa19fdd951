"""Adopting a run trained without mixprec: a trainer's checkpoint of fp32 weights and a ``torch.optim`` (or
``mixprec.optim``) optimizer's state, written by Lightning under ``precision="32-true"`` (or its AMP
``"bf16-mixed"``/``"16-mixed"``, whose weights and optimizer state are fp32 too) or by a plain
``transformers.Trainer``, continued under any policy.

The run is loaded as what it was, the ``fp32`` policy's state (weights, optimizer state, the step count;
no masters, no loss scale), and converted to the engine's policy by
``mp.load_state_dict(state, convert=True)``: exactly what ``mp.set_policy`` does to a running fp32 engine
(params re-cast from the fp32 weights, masters made from them, Kahan compensations started at what the cast
lost, optimizer state carried over into the policy's format, e.g. fp32 moments into 8-bit codes). The
param-group keys the saved groups lack (``sr_seed``, the stochastic-rounding stream's seed, when
``torch.optim.AdamW`` saved the state and ``mixprec.optim.AdamW`` continues it) take the engine's optimizer's
defaults, as ``add_param_group`` fills a group. One ``"adopt-checkpoint"`` event (and a
decision clause) names what was adopted and converted, beside the ``"convert"`` event of the switch.

Not adopted: a loss scale (Lightning's GradScaler state under ``"16-mixed"``: the engine's starts at its
initial value) and 16-bit weights (``"bf16-true"``/``"16-true"``): refused with a ValueError naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mixprec.engine.loss_scale import from_spec
from mixprec.engine.records import Event

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["adopt_fp32_run"]


def adopt_fp32_run(mp: MixedPrecision, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], *,
                   steps: int, source: str) -> Event:
    """Load the fp32 run (``model_state``: the model's ``state_dict``; ``optimizer_state``: its optimizer's
    ``state_dict``, for ``mp.optimizer``'s param order; ``steps``: its optimizer steps) into ``mp`` (its
    optimizer attached, at a boundary) converted to ``mp``'s policy (module docstring); ``source`` names the
    checkpoint in the event. Returns the ``"adopt-checkpoint"`` event, recorded. No host sync but the loads'.

    Raises:
        ValueError: floating weights that are not fp32 (a 16-bit run), or what the load refuses (another
            model's names or shapes, another optimizer's param groups); nothing has changed then.
    """
    half = sorted(f"{n} ({str(t.dtype).removeprefix('torch.')})" for n, t in model_state.items()
                  if torch.is_tensor(t) and t.is_floating_point() and t.dtype != torch.float32)
    if half:
        raise ValueError(f"{source} holds {len(half)} 16-bit weight(s) ({', '.join(half[:3])}): a run stored in 16 "
                         "bits (Lightning's precision='bf16-true'/'16-true') has no fp32 values to adopt; mixprec "
                         "adopts runs whose weights and optimizer state are fp32 ('32-true', 'bf16-mixed', "
                         "'16-mixed'). Continue it with the precision that saved it")
    defaults = {k: v for k, v in getattr(mp.optimizer, "defaults", {}).items() if k != "params"}
    filled = sorted({k for saved in optimizer_state["param_groups"] for k in defaults if k not in saved})
    groups = [{**defaults, **saved} for saved in optimizer_state["param_groups"]]   # as add_param_group fills them
    before = str(mp.policy)
    mp.load_state_dict({"policy": "fp32", "frozen": None, "model": model_state, "masters": {},
                        "optimizer": {**optimizer_state, "param_groups": groups}, "scheduler": None,
                        "loss_scale": from_spec("none").state_dict(),
                        "counters": dict(micro_step=0, applied_steps=steps, skipped_total=0, boundaries=steps)},
                       convert=True)
    converted = next((e.detail for e in reversed(mp.events) if e.kind == "convert"), f"fp32 → {before}")
    detail = (f"{source}: a run without mixprec state adopted as the fp32 policy's (fp32 weights, "
              f"{type(mp.optimizer).__name__} state of {len(optimizer_state.get('state', {}))} param(s), {steps} "
              f"optimizer step(s)) and converted to {before} as set_policy would: {converted}"
              + (f"; param-group keys the saved groups lacked took this optimizer's defaults: {filled}" if filled else ""))
    event = Event(step=mp.boundaries, kind="adopt-checkpoint", cause=source, module=None, detail=detail,
                  from_policy="fp32", to_policy=before)
    mp.record(event, decision=f"{mp.decision}; adopted a run without mixprec state (fp32 → {before})")
    return event
