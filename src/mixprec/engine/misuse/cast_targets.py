"""Which floating fields of a batch look like targets: the fields ``mp.cast_inputs`` rounds to 16 bits under
16-bit params that a loss may compare in fp32 (a regression target, a label, a reward), for the loop checks
(:mod:`mixprec.engine.misuse.loop_checks`) to name once with the ``keep=`` fix. Host values only; no sync.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from mixprec.policy.tree import field_names

__all__ = ["TARGET_NAMES", "keep_fields", "suspected_targets"]

#: Field names taken for targets by the ``cast_inputs`` check (compared lower-case).
TARGET_NAMES = frozenset({"y", "target", "targets", "label", "labels", "reward", "rewards", "return", "returns",
                          "value", "values", "advantage", "advantages", "score", "scores"})


def keep_fields(keep: Any) -> tuple:
    """``cast_inputs``' ``keep`` as a tuple of fields: one key or index (a str, an int) is a field of its own
    (``keep="label"`` keeps the field ``"label"``, not its characters). TypeError for anything else."""
    if isinstance(keep, (str, int)) and not isinstance(keep, bool):
        return (keep,)
    if keep is None:
        return ()
    if isinstance(keep, (tuple, list, set, frozenset)):
        return tuple(keep)
    raise TypeError(f"cast_inputs(keep={keep!r}): keep is a {type(keep).__name__}; pass a key, a field name or an "
                    "index, or a tuple of them, e.g. keep=('y',) or keep=(1,)")


def suspected_targets(batch: Any, keep: tuple) -> list[Any]:
    """The top-level floating fields of ``batch`` (keys, indices or attributes: :func:`mixprec.policy.tree.
    field_names`) outside ``keep`` that may be targets: those :data:`TARGET_NAMES` names, else every floating
    field but the first when there are several; [] for a batch without fields."""
    names = field_names(batch)
    if names is None:
        return []
    floats = [k for k in names if k not in keep and _is_float(_child(batch, k))]
    return [k for k in floats if str(k).lower() in TARGET_NAMES] or (floats[1:] if len(floats) > 1 else [])


def _child(batch: Any, key: Any) -> Any:
    if isinstance(batch, (dict, collections.UserDict)) or (isinstance(batch, (list, tuple)) and isinstance(key, int)):
        return batch[key]
    return getattr(batch, key)


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()
