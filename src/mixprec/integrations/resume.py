"""A trainer's resume into the engine: the plugin's saved state under the policy it was saved with, or another.

A hand loop chooses ``mp.load_state_dict(state, convert=True)`` or ``adopt_policy=True`` when the policies differ;
a trainer's ``fit(ckpt_path=...)`` passes neither, and the engine's refusal named those arguments, which a
Lightning user cannot pass. Here the state of another policy is converted to the plugin's (as ``set_policy``
would, a ``"convert"`` event: the user chose the plugin's policy), and what the conversion refuses is refused with
the trainer's words: resume under the saved policy.
"""

from __future__ import annotations

from typing import Any

from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.integrations.block_state import check_model_keys

__all__ = ["load_resumed"]


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
