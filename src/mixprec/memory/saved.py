"""Bytes saved for backward: what the autograd graph of a forward keeps alive until its backward.

Counted through ``torch.autograd.graph.saved_tensors_hooks`` (every tensor an autograd node saves, custom
``autograd.Function``\\ s included), once per storage (:class:`~mixprec.memory.storages.StorageCounter`: a view
keeps its whole storage), leaving out the tensors a caller names (the model's parameters: memory the step does
not add; an fp32 Linear saves its weight, which costs nothing extra, while autocast's bf16 copy of it does).
Validated against a tensor census (tests/memory/test_memory_saved.py). A non-reentrant
``torch.utils.checkpoint`` region's inputs are seen (torch saves them through its own autograd Function); what the
region keeps inside it (a selective-checkpoint policy's saved op outputs) is not (its own hooks replace ours there)
— peak live tensor bytes (:mod:`mixprec.memory.live`) see those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from mixprec.memory.storages import StorageCounter

__all__ = ["SavedBytes", "SavedTensorCounter", "saved_bytes"]


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward by one forward. ``total`` counts each storage once; ``by_dtype`` splits it by the
    saved tensor's dtype name (``"torch.bfloat16"``...); ``tensors`` is how many save calls there were (a tensor
    saved by two nodes counts twice there, once in bytes)."""

    total: int
    by_dtype: dict[str, int] = field(default_factory=dict)
    tensors: int = 0

    @property
    def mib(self) -> float:
        """``total`` in MiB (2**20 bytes)."""
        return self.total / 2**20

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"bytes", "mib", "by_dtype", "tensors"}``."""
        return {"bytes": self.total, "mib": self.mib, "by_dtype": dict(self.by_dtype), "tensors": self.tensors}


class SavedTensorCounter(AbstractContextManager["SavedTensorCounter"]):
    """Counts what autograd saves inside ``with`` (the forward); :meth:`result` reads the count. Nested
    ``saved_tensors_hooks`` inside the block (a checkpointed region) replace this one there; hooks around it still
    pack (a tensor they keep as nothing, ``kept_nbytes == 0``: a weight copy cast again in backward, is not counted).
    No host sync; the tensors pass through unchanged (no copy, no effect on numerics)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._counter = StorageCounter(list(exclude))
        self._by_dtype: dict[str, int] = {}
        self._tensors = 0
        self._outer: tuple | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        self._tensors += 1
        packed = self._outer[0](tensor) if self._outer else tensor
        if getattr(packed, "kept_nbytes", None) == 0:   # the enclosing hooks keep nothing (a weight copy recast)
            return packed
        added = self._counter.add(tensor)
        if added:
            key = str(tensor.dtype)
            self._by_dtype[key] = self._by_dtype.get(key, 0) + added
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        return self._outer[1](packed) if self._outer else packed

    def __enter__(self) -> SavedTensorCounter:
        # the hooks around this block (mp.autocast()'s weight-copy recast, a user's) still pack: innermost hooks
        # are the only ones torch applies, so these hand every tensor on and count what the outer ones keep
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, traceback)

    def result(self) -> SavedBytes:
        """What was saved so far."""
        return SavedBytes(total=sum(self._by_dtype.values()), by_dtype=dict(self._by_dtype), tensors=self._tensors)


def saved_bytes(forward: Callable[[], Any], *, exclude: Iterable[torch.Tensor] = ()) -> tuple[Any, SavedBytes]:
    """Runs ``forward()`` (a closure computing the loss, under whatever autocast the caller opened) and returns
    its output with the bytes its graph saved for backward, ``exclude`` (e.g. ``model.parameters()``) left out.
    The graph is returned alive in the output: call backward on it or drop it."""
    with SavedTensorCounter(exclude) as counter:
        out = forward()
    return out, counter.result()
