"""Bytes of tensors counted the way memory is really held: once per storage.

A view keeps its whole storage alive, two views of one storage cost it once, and a wrapper subclass (an fp8
or 8-bit tensor) costs the storages of the tensors it holds (its ``__tensor_flatten__`` attributes).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["StorageCounter", "storage_key"]


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """``(device, data pointer)`` of ``tensor``'s storage: equal for every view of one storage."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


class StorageCounter:
    """Adds up storage bytes, each storage once (keyed by :func:`storage_key`); a wrapper subclass by the
    tensors it holds, recursively. ``exclude`` (tensors) are never counted (e.g. the model's parameters: memory
    the step does not add). No host sync; meta tensors and empty storages count 0."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()) -> None:
        self.seen: set[tuple[str, int]] = set()
        for tensor in exclude:
            self.add(tensor)

    def add(self, tensor: torch.Tensor | None) -> int:
        """Counts ``tensor``'s storage if it is new; returns the bytes added (0 if seen before)."""
        if tensor is None:
            return 0
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            inner = (getattr(tensor, name) for name in names)
            return sum(self.add(t) for t in inner if isinstance(t, torch.Tensor))
        if tensor.device.type == "meta":
            return 0
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if key in self.seen or storage.nbytes() == 0:
            return 0
        self.seen.add(key)
        return storage.nbytes()
