"""Replacing a model's modules in place, their hooks carried over: the one swap every conversion uses.

:func:`convert_to_block_scaled`, :func:`revert_block_scaled` (:mod:`mixprec.blockscale.convert`),
:func:`mixprec.fp8.convert_to_float8` and :func:`mixprec.fp8.revert_float8` put each replacement under every parent
holding the module it replaces (a shared module has several) through :func:`replace_modules`. The replacement
takes over the replaced module's hook dicts themselves (the same dict objects, not copies): forward, forward-pre
(with and without kwargs, ``always_call`` included), full backward and backward-pre hooks, and the state-dict
save/load hooks, so a hook registered before the swap fires after it and its ``RemovableHandle`` still removes it
(the handle holds a reference to the dict). This depends on ``torch.nn.Module``'s private attributes
(:data:`HOOK_DICTS`, ``_is_full_backward_hook`` and ``_modules``, present since torch 2.0); an attribute a torch version lacks is
skipped. The replacements are built by their classes' ``from_linear`` and register no hook of their own (a
replacement holding one is a ValueError, so nothing is silently dropped). Parameter hooks
(``weight.register_hook``) need nothing: the replacements hold the same Parameter objects.
"""

from __future__ import annotations

from torch import nn

__all__ = ["HOOK_DICTS", "carry_hooks", "replace_modules"]

#: ``nn.Module``'s hook dicts a replacement takes over (private torch attributes; module docstring).
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Make ``new`` hold ``old``'s hook dicts (the same objects, so ``old``'s handles remove them) and its
    ``_is_full_backward_hook`` flag (module docstring). ValueError if ``new`` already holds a hook of its own."""
    own = [attr for attr in HOOK_DICTS if getattr(new, attr, None)]
    if own:
        raise ValueError(f"carry_hooks: the replacement {type(new).__name__} already holds hooks in {own}; carrying "
                         f"{type(old).__name__}'s over would drop them")
    for attr in HOOK_DICTS:
        if attr in old.__dict__:
            new.__dict__[attr] = old.__dict__[attr]
    if "_is_full_backward_hook" in old.__dict__:
        new.__dict__["_is_full_backward_hook"] = old.__dict__["_is_full_backward_hook"]


def replace_modules(model: nn.Module, replacements: dict[nn.Module, nn.Module]) -> None:
    """Put each replacement under every parent of ``model`` holding the module it replaces (shared modules too),
    its hooks carried over (:func:`carry_hooks`), in place. Changes nothing else; no tensor copied, no host sync."""
    for old, new in replacements.items():
        carry_hooks(old, new)
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):   # not named_children(): it skips a repeated child
            if child is not None and child in replacements:
                setattr(parent, child_name, replacements[child])
