"""What the Lightning plugins take from the user and from each batch, checked the same way for both.

:class:`~mixprec.integrations.lightning.MixprecPrecision` (the Trainer's) and
:class:`~mixprec.integrations.lightning_fabric.MixprecFabricPrecision` (Fabric's) refuse the engine options their
trainer owns (:func:`check_options`, naming where to set each instead), check ``keep_inputs`` (:func:`check_keep`)
and cast each batch through the engine keeping those targets as they come (:func:`cast_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["check_options", "check_keep", "cast_batch"]


def check_options(options: dict[str, Any], owner: dict[str, str], plugin: str) -> None:
    """ValueError for the first of ``options`` that ``owner`` (option → where to set it instead) holds, naming
    ``plugin``."""
    for key in options:
        if key in owner:
            raise ValueError(f"{plugin}({key}={options[key]!r}): the trainer owns this; use {owner[key]}")


def check_keep(keep_inputs: Any, owner: str) -> tuple:
    """``keep_inputs`` as a tuple of keys, fields or indices; TypeError naming ``owner`` for anything else."""
    if not isinstance(keep_inputs, (tuple, list)) or not all(isinstance(k, (str, int)) for k in keep_inputs):
        raise TypeError(f"{owner}(keep_inputs={keep_inputs!r}): pass a tuple of the batch's top-level keys, fields or "
                        "indices whose floats are targets, kept as they come (e.g. keep_inputs=(1,) for (x, y) "
                        "batches, keep_inputs=('labels',) for dicts)")
    return tuple(keep_inputs)


def cast_batch(mp: MixedPrecision, data: Any, keep_inputs: tuple) -> Any:
    """``mp.cast_inputs(data, keep=...)`` with the ``keep_inputs`` entries this batch has (a predict batch
    may carry no target)."""
    if isinstance(data, Mapping):
        keep = tuple(k for k in keep_inputs if k in data)
    elif isinstance(data, (tuple, list)):
        keep = tuple(k for k in keep_inputs if isinstance(k, int) and -len(data) <= k < len(data))
    else:
        keep = tuple(k for k in keep_inputs if isinstance(k, str) and hasattr(data, k))
    return mp.cast_inputs(data, keep=keep)
