"""The one walker over nested batches, outputs and states: which containers hold tensors, and how
each is rebuilt.

Containers: ``dict`` and its subclasses (``OrderedDict`` with a state dict's ``_metadata``,
transformers' ``ModelOutput``, ``defaultdict``: the subclass and its attributes are kept, via
``copy.copy``), ``collections.UserDict`` (transformers' ``BatchEncoding``), namedtuples, lists,
tuples and dataclass instances (every field, ``init=False`` ones included, frozen ones too).
Everything else is a leaf. The caller's containers are never modified.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["field_names", "map_fields", "map_tensors", "tensors"]


def field_names(tree: Any) -> list[Any] | None:
    """The keys (dicts), field names (namedtuples, dataclasses) or indices (lists, tuples) of a
    container, None for a leaf."""
    if isinstance(tree, (dict, collections.UserDict)):
        return list(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return list(tree._fields)
    if isinstance(tree, (list, tuple)):
        return list(range(len(tree)))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [f.name for f in dataclasses.fields(tree)]
    return None


def map_fields(tree: Any, fn: Callable[[Any, Any], Any]) -> Any:
    """A copy of the container ``tree`` with each child ``v`` under key ``k`` replaced by ``fn(k, v)``
    (one level). Raises TypeError for a leaf."""
    names = field_names(tree)
    if names is None:
        raise TypeError(f"map_fields: {type(tree).__name__} is not a container")
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(fn(k, getattr(tree, k)) for k in names))
    if isinstance(tree, (list, tuple)):
        return type(tree)(fn(i, v) for i, v in enumerate(tree))
    if type(tree) is dict:
        return {k: fn(k, v) for k, v in tree.items()}
    out = copy.copy(tree)   # keeps the subclass (ModelOutput, OrderedDict's _metadata, ...) and its extras
    if isinstance(tree, (dict, collections.UserDict)):
        for k in names:
            out[k] = fn(k, tree[k])
    else:
        for k in names:
            object.__setattr__(out, k, fn(k, getattr(tree, k)))   # works on frozen dataclasses too
    return out


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any], *, leaf: Callable[[Any], Any] | None = None) -> Any:
    """``tree`` rebuilt with ``fn(t)`` for every tensor ``t`` and ``leaf(x)`` for every other leaf
    (default: the leaf itself). No host sync of its own."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if field_names(tree) is None:
        return tree if leaf is None else leaf(tree)
    return map_fields(tree, lambda _, v: map_tensors(v, fn, leaf=leaf))


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, depth first, in container order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    names = field_names(tree)
    if names is None:
        return []
    get = (lambda k: getattr(tree, k)) if (dataclasses.is_dataclass(tree) or hasattr(tree, "_fields")) \
        else tree.__getitem__
    return [t for k in names for t in tensors(get(k))]
