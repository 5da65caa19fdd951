"""Block-scaled linears' own state in a trainer's checkpoint: each
:class:`~mixprec.blockscale.linear.BlockScaledLinear`'s ``hadamard_signs`` and ``_extra_state`` (its stochastic
rounding stream ``[sr_seed, calls]``: :func:`mixprec.blockscale.block_state_keys`).

A trainer restores the model's weights into the module as it stands, and that is not always the module the policy
converted: Lightning's ``fit(ckpt_path=...)`` loads ``checkpoint["state_dict"]`` (strictly) before the precision
plugin's ``convert_module`` swaps the ``nn.Linear`` layers, so the block keys must not be in that dict; it loads
one into a module the plugin converted already (``trainer.test(ckpt_path="best")`` after ``fit``) just as well. So
the plugin moves the block keys out of ``checkpoint["state_dict"]`` into its own entry (:func:`split_block_state`),
lets a module it converted load a dict holding none of them (:func:`allow_absent_block_state`: the streams stay the
module's), and gives them back to the engine's exact load (:func:`with_block_state`), whose keys are checked
first (:func:`check_model_keys`: a stream that cannot be restored is an error, never dropped). The Hugging Face
Trainer restores into the converted module, but not strictly: :class:`~mixprec.integrations.transformers.MixprecTrainer`
keeps the block keys in its own file too, so they are never left to ``load_state_dict(strict=False)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.blockscale import block_state_keys
from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["split_block_state", "with_block_state", "allow_absent_block_state", "check_model_keys"]


def split_block_state(module: nn.Module, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Remove ``module``'s block keys from ``state_dict`` (``module.state_dict()``'s layout, e.g. Lightning's
    ``checkpoint["state_dict"]``), in place, and return them by key (empty: ``module`` has no block-scaled linear).
    The tensors are those of ``state_dict`` (references); no host sync."""
    return {key: state_dict.pop(key) for key in sorted(block_state_keys(module)) if key in state_dict}


def with_block_state(model_state: dict[str, Any], block_state: dict[str, Any], *,
                     module: nn.Module | None = None) -> dict[str, Any]:
    """A new dict: ``model_state`` less ``module``'s own block keys (a converted module's state dict, whose streams
    the saved ones replace), then ``block_state`` (saved by :func:`split_block_state`) over it. References; no
    host sync."""
    dropped = set() if module is None else block_state_keys(module)
    return {**{k: v for k, v in model_state.items() if k not in dropped}, **block_state}


def allow_absent_block_state(module: nn.Module) -> RemovableHandle:
    """Let ``module.load_state_dict`` take a state dict holding none of ``module``'s block keys (a trainer's
    checkpoint whose block state travels apart, :func:`split_block_state`): those keys are then not reported
    missing, and the linears keep their own signs and streams. A dict holding some of them but not all is still
    refused as torch refuses it (strict). Returns the hook's handle; the set of block keys is read at each load."""
    def hook(mod: nn.Module, incompatible: Any) -> None:
        keys = block_state_keys(mod)
        if keys and keys <= set(incompatible.missing_keys):
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in keys]
    return module.register_load_state_dict_post_hook(hook)


def check_model_keys(engine: MixedPrecision, model_state: dict[str, Any], owner: str) -> None:
    """Raise ValueError, before anything changes, unless ``model_state`` (a saved run's model state under
    ``engine``'s policy) has exactly the keys of ``engine.module.state_dict()``, naming the missing and unexpected
    keys (block-scaled linears' signs and stochastic-rounding streams among them) and ``owner``."""
    own, saved = set(engine.module.state_dict()), set(model_state)
    if own == saved:
        return
    missing, unexpected = sorted(own - saved), sorted(saved - own)
    block = sorted((own ^ saved) & (block_state_keys(engine.module) | {k for k in saved if k.endswith(
        ("._extra_state", ".hadamard_signs"))}))
    why = (f" ({len(block)} of them block-scaled linears' signs or stochastic-rounding streams, e.g. {block[0]!r}: "
           "resuming without them would restart the streams)" if block else "")
    raise ValueError(f"{owner}({str(engine.policy)!r}) cannot restore the saved model state: missing keys "
                     f"{missing[:6]}, unexpected keys {unexpected[:6]}{why}; resume with the model and policy the run "
                     "was saved with")
