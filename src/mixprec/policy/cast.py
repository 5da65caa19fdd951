"""Casting the floating tensors of a nested structure (inputs, outputs) to a dtype."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec.messages.location import user_stacklevel
from mixprec.policy.tree import map_tensors

__all__ = ["cast_floating"]


def cast_floating(tree: Any, dtype: torch.dtype | None, device: torch.device | None = None) -> Any:
    """Cast floating tensors in ``tree`` to ``dtype`` (and move every tensor to ``device``).

    Integer and bool tensors keep their dtype (token ids stay exact); a ``torch.distributions``
    object is rebuilt from its cast parameters (:func:`_cast_distribution`). Walks the containers of
    :mod:`mixprec.policy.tree` (dicts and their subclasses such as transformers' ``ModelOutput``,
    ``BatchEncoding``, lists, tuples, namedtuples, dataclasses); other leaves are returned unchanged.
    No host sync.
    """
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and dtype is not None and t.dtype != dtype:
            return t.to(device=device, dtype=dtype)
        return t.to(device) if device is not None else t

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.distributions.Distribution) and dtype is not None:
            return _cast_distribution(x, cast)
        return x
    return map_tensors(tree, cast, leaf=leaf)


_uncastable_warned: set[str] = set()


def _cast_distribution(dist: Any, cast: Any) -> Any:
    """``dist`` rebuilt from its constructor arguments (those in ``arg_constraints`` it holds) cast by
    ``cast``: a ``Categorical`` built from bf16 ``probs`` clamps its logits at bf16's eps (log-probs
    >= -4.84); rebuilt from fp32 it does not. ``probs``/``logits`` families are rebuilt from the one they
    were given (``logits`` if held). A type that does not rebuild this way is returned as it is, with one
    warning naming it."""
    held = {k: v for k, v in vars(dist).items() if k in getattr(dist, "arg_constraints", {}) and torch.is_tensor(v)}
    if "logits" in held and "probs" in held:
        held.pop("probs")
    if all(v.dtype == cast(v).dtype for v in held.values()):
        return dist
    try:
        extra = {k: getattr(dist, k) for k in ("total_count",) if hasattr(dist, k) and k not in held}
        return type(dist)(**{k: cast(v) for k, v in held.items()}, **extra, validate_args=False)
    except (TypeError, ValueError):
        name = type(dist).__name__
        if name not in _uncastable_warned:
            _uncastable_warned.add(name)
            warnings.warn(f"mixprec: a {name} distribution in the model's output holds 16-bit parameters that "
                          "mixprec cannot rebuild in fp32; build it from fp32 tensors (e.g. logits.float()) "
                          "(said once)", stacklevel=user_stacklevel())
        return dist

