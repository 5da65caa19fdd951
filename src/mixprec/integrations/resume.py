"""A trainer's resume into the engine: the plugin's saved state under the policy it was saved with, or another.

A hand loop chooses ``mp.load_state_dict(state, convert=True)`` or ``adopt_policy=True`` when the policies differ;
a trainer's ``fit(ckpt_path=...)`` passes neither, and the engine's refusal named those arguments, which a
Lightning user cannot pass. Here the state of another policy is converted to the plugin's (as ``set_policy``
would, a ``"convert"`` event: the user chose the plugin's policy), and what the conversion refuses is refused with
the trainer's words: resume under the saved policy.

A trainer's resume may also replace Parameter objects the engine holds: the Hugging Face Trainer resuming a peft
model calls ``load_adapter``, which builds new LoRA Parameters (fp32) after the engine was built on the old ones
(its masters, its optimizer contract). :func:`restore_replaced_params` puts the engine's Parameters back with the
loaded values, before the optimizer is built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.integrations.block_state import check_model_keys

__all__ = ["load_resumed", "restore_replaced_params"]


def load_resumed(engine: MixedPrecision, state: dict[str, Any], owner: str, *, open_window: bool = False) -> None:
    """Load ``state`` (``owner``'s saved engine state) into ``engine``: exactly under the same policy, converted to
    ``engine``'s otherwise (the block-scaled linears the policy adds start their stochastic-rounding streams fresh).
    ValueError naming ``owner``, nothing changed: under the same policy, a model state whose keys are not the
    module's (:func:`~mixprec.integrations.block_state.check_model_keys`: a block-scaled linear's stream missing is
    refused, never restarted); with the saved policy, a conversion refused (a window saved open, ``open_window``
    when the caller took it out of ``state``; a strategy that cannot switch)."""
    saved = state.get("policy")
    if saved is None or saved == str(engine.policy):
        check_model_keys(engine, state["model"], owner)
        engine.load_state_dict(state)
        return
    if open_window:   # its gradients carry the saved policy's loss scale and dtypes: not converted
        raise ValueError(f"{owner}({str(engine.policy)!r}) resuming a checkpoint saved inside an accumulation window "
                         f"under {owner}({saved!r}): the window's gradients are that policy's (its loss scale, its "
                         f"dtypes) and are not converted; resume with {owner}({saved!r}), then change the policy at "
                         "a later checkpoint saved at an optimizer step")
    try:
        engine.load_state_dict(state, convert=True)
    except ValueError as err:
        raise ValueError(f"{owner}({str(engine.policy)!r}) resuming a checkpoint saved under {owner}({saved!r}): "
                         f"converting it was refused ({err}); resume with {owner}({saved!r}), then change the policy "
                         "at a later checkpoint saved at an optimizer step") from err


def restore_replaced_params(model: nn.Module, before: dict[str, nn.Parameter]) -> list[str]:
    """Where ``model`` now holds, under a name of ``before`` (name -> the Parameter the engine was built on),
    another Parameter of the same shape: copy its values into the old one (rounded to the old one's dtype, as a
    load into the model would) and set the old one back on its module. Returns the names restored. No host sync."""
    restored = []
    for name, new in list(model.named_parameters()):
        old = before.get(name)
        if old is None or old is new or old.shape != new.shape:
            continue
        with torch.no_grad():
            old.copy_(new.detach())
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, old)
        restored.append(name)
    return restored
