"""The checks of a :class:`~mixprec.policy.policy.Policy`'s linear-precision fields: ``fp8``, ``fp8_format``,
``fp8_keep_ends``, ``block``, ``block_keep`` and ``block_disable``.

A policy's linears run in the compute dtype, or in fp8 (``fp8``: :mod:`mixprec.fp8`), or block-scaled (``block``:
a recipe of :mod:`mixprec.blockscale`), never two of them. :func:`check_linear_fields` checks each field's value,
:func:`check_linear_needs` what the fields need of each other and of the compute dtype; both raise ValueError (or
TypeError for a non-bool ``fp8_keep_ends``) naming the field, the value, what is allowed and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.policy.choices import (BLOCK_COMPUTE_DTYPES, BLOCK_RECIPE_NAMES, BLOCK_RECIPE_PARTS, FP8_FORMATS,
                                    FP8_RECIPES, _dtype_name)

__all__ = ["BLOCK_PRESETS", "check_linear_fields", "check_linear_needs", "block_preset_text", "canonical_disable"]

# the preset (or preset + override) that runs each block recipe: the fix a refusal names
BLOCK_PRESETS = {"mxfp8": "mxfp8-mixed", "nvfp4": "nvfp4-mixed", "nvfp4-plain": "nvfp4-mixed,block=nvfp4-plain"}


def block_preset_text(block: str) -> str:
    """The policy text that runs block recipe ``block`` under bf16-mixed, e.g. ``"nvfp4-mixed"``."""
    return BLOCK_PRESETS.get(block, f"bf16-mixed,block={block}")


def canonical_disable(parts: tuple[str, ...]) -> tuple[str, ...]:
    """``block_disable``'s parts in the recipes' order (``hadamard``, ``sr``, ``2d``, ``tail``, ``ends``), so two
    orders of the same parts are one policy; call after the checks."""
    order = BLOCK_RECIPE_PARTS["nvfp4"]
    return tuple(p for p in order if p in parts)


def check_linear_fields(policy: Any) -> None:
    """Each linear-precision field of ``policy`` is one of its allowed values (module docstring)."""
    if policy.fp8 is not None and policy.fp8 not in FP8_RECIPES:
        raise ValueError(f"Policy fp8={policy.fp8!r} is not allowed; choose None or one of {FP8_RECIPES}")
    if policy.fp8_format not in FP8_FORMATS:
        raise ValueError(f"Policy fp8_format={policy.fp8_format!r} is not allowed; choose one of {FP8_FORMATS}")
    if not isinstance(policy.fp8_keep_ends, bool):
        raise TypeError(f"Policy fp8_keep_ends={policy.fp8_keep_ends!r} must be a bool: True keeps the first and "
                        "last linears out of fp8 (text key fp8_ends=keep), False converts them (fp8_ends=fp8)")
    if policy.block is not None and policy.block not in BLOCK_RECIPE_NAMES:
        raise ValueError(f"Policy block={policy.block!r} is not allowed; choose None (text block=none) or one of "
                         f"{BLOCK_RECIPE_NAMES}, the recipes of mixprec.blockscale.BLOCK_RECIPES (presets: "
                         "mxfp8-mixed, nvfp4-mixed)")
    keep = policy.block_keep
    if not isinstance(keep, tuple) or not all(isinstance(p, str) and p for p in keep):
        raise TypeError(f"Policy block_keep={keep!r} must be a tuple of non-empty glob strings naming linears, e.g. "
                        "('blocks.*.attn.proj', 'blocks.3')")
    for pattern in keep:
        if any(c in pattern for c in ",=| "):
            raise ValueError(f"Policy block_keep pattern {pattern!r} may not contain ',', '=', '|' or spaces")
    off = policy.block_disable
    if not isinstance(off, tuple) or not all(isinstance(p, str) for p in off):
        raise TypeError(f"Policy block_disable={off!r} must be a tuple of recipe parts, e.g. ('sr', 'hadamard')")


def check_linear_needs(policy: Any) -> None:
    """What the fields need: fp8's other keys need ``fp8``; fp8 a 16-bit compute dtype; ``block`` bf16 compute
    and no ``fp8`` (module docstring)."""
    if policy.fp8 is None and not policy.fp8_keep_ends:
        raise ValueError("Policy fp8_ends=fp8 (fp8_keep_ends=False) needs fp8 linears; set fp8=tensorwise "
                         "(or use the fp8-mixed preset)")
    if policy.fp8 is None and policy.fp8_format != "hybrid":
        raise ValueError(f"Policy fp8_format={policy.fp8_format!r} needs fp8 linears; set fp8=tensorwise "
                         "(or use the fp8-mixed preset)")
    if policy.fp8 is not None and policy.compute_dtype == torch.float32:
        raise ValueError(f"Policy fp8={policy.fp8!r} with compute=fp32: fp8 linears output in the 16-bit compute "
                         "dtype; set compute=bf16 (or use the fp8-mixed preset)")
    if policy.block is None:
        if policy.block_keep:
            raise ValueError(f"Policy block_keep={'|'.join(policy.block_keep)!r} keeps linears out of block scaling, "
                             "but block=none: set block (e.g. 'nvfp4-mixed,block_keep=...') or drop block_keep")
        if policy.block_disable:
            raise ValueError(f"Policy block_disable={'|'.join(policy.block_disable)!r} turns parts of a block recipe "
                             "off, but block=none: set block (e.g. 'nvfp4-mixed,block_disable=sr') or drop it")
        return
    has = BLOCK_RECIPE_PARTS[policy.block]
    for i, part in enumerate(policy.block_disable):
        if part not in has or part in policy.block_disable[:i]:
            if part in has:
                raise ValueError(f"Policy block_disable part {part!r} is named twice; name each part once")
            raise ValueError(f"Policy block_disable part {part!r} is not a part of recipe block={policy.block!r}; it "
                             f"has {'|'.join(has)} to turn off (e.g. block_disable={has[0]})")
    if policy.fp8 is not None:
        raise ValueError(f"Policy block={policy.block!r} with fp8={policy.fp8!r}: a linear runs block-scaled or in "
                         f"fp8, not both; set fp8=none (e.g. {block_preset_text(policy.block)!r}) or block=none "
                         "(e.g. 'fp8-mixed')")
    if policy.compute_dtype not in BLOCK_COMPUTE_DTYPES:
        raise ValueError(f"Policy block={policy.block!r} with compute={_dtype_name(policy.compute_dtype)}: "
                         "block-scaled linears are offered under bf16 compute only (the recipes' own: their GEMMs "
                         "output bf16, and the linears they keep, the first/last and the bf16 tail, run in bf16); "
                         f"params may be fp32 or bf16; set compute=bf16 (e.g. {block_preset_text(policy.block)!r})")
