"""Weight copies cast again in backward: autocast's 16-bit copy of an fp32 weight is not kept for backward.

Under bf16-mixed, autocast casts each fp32 weight to bf16 for its matmul, and autograd saves that copy for the
backward (``grad_x = grad_y @ W_bf16``): at ``gpt/mid`` 6 MiB of the 73 MiB saved, the gap between bf16-mixed's
0.55x fp32's saved bytes and the 16-bit-weight presets' 0.50x. Inside :func:`recast_weight_copies`
(entered by ``mp.autocast()`` under the policy option ``saved=compute``, every bf16 policy's default) a saved
tensor that is such a copy (or a view of one: a linear saves ``W_bf16.t()``) is packed as a reference to its
fp32 parameter, and the backward casts the parameter again. The values are the same bit for bit (a cast rounds
to nearest even, the same input gives the same bits), so every gradient is unchanged; the cost is one cast per
weight per backward (the copy lives for its node's backward only).

What counts as a copy: a tensor whose autograd history is exactly one ``_to_copy`` (``ToCopyBackward0``) of one
of the engine's parameters (its gradient accumulator's variable), on the same device, in another dtype, with the
parameter's layout. Frozen weights (no autograd history), FSDP2's unsharded parameters (not the engine's
parameters) and everything a compiled graph saves are left as they are. The parameter must not change between
the forward and the backward that reads it (as for any saved tensor): a change torch's version counter sees
raises at the backward instead of using other values.

Hooks: ``saved_tensors_hooks`` apply only at the top of their stack, so these compose with the hooks around them
(a user's ``save_on_cpu``, :class:`~mixprec.memory.saved.SavedTensorCounter`): every tensor that is not a weight
copy goes to the enclosing pack hook (torch's ``_top_saved_tensors_default_hooks``); hooks opened inside
(a checkpointed region's) replace these there, as they would any. Where saved-tensor hooks are disabled (some
tracing contexts), nothing changes. No host sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["recast_weight_copies"]


@dataclass(frozen=True)
class _Recast:
    """A saved weight copy, packed: cast ``param`` to ``dtype`` again and view it as it was saved."""

    param: torch.Tensor
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    version: int
    kept_nbytes: int = 0   # what keeping it costs (the parameter is there anyway): SavedTensorCounter reads it

    def unpack(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError("a parameter changed between the forward and the backward that reads its 16-bit "
                               f"copy (shape {list(self.param.shape)}, version {self.version} -> "
                               f"{self.param._version}); run backward before the optimizer step, or "
                               "policy saved=fp32 to keep autocast's copy")
        copy = self.param.detach().to(self.dtype)
        return copy.as_strided(self.size, self.stride, self.offset)


def _weight_source(tensor: torch.Tensor, params: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The engine parameter ``tensor`` (or its base, for a view) is a plain 16-bit cast of, else None."""
    base = tensor if tensor._base is None else tensor._base
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    accumulator = fn.next_functions[0][0]
    param = getattr(accumulator, "variable", None)
    if param is None or params.get(id(param)) is not param:
        return None
    if (base.dtype == param.dtype or base.device != param.device or base.shape != param.shape
            or base.stride() != param.stride() or base.storage_offset() != 0):
        return None
    return param


@contextlib.contextmanager
def recast_weight_copies(params: Iterable[torch.Tensor], *, enabled: bool = True) -> Iterator[None]:
    """Inside: a saved 16-bit copy of one of ``params`` (fp32 leaves requiring grad) is packed as a reference and
    cast again in backward (see the module docstring). ``enabled=False`` (or hooks disabled here): nothing."""
    if not enabled or torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
        yield
        return
    by_id = {id(p): p for p in params if p.requires_grad and p.is_floating_point()}
    if not by_id:
        yield
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack: Callable[[torch.Tensor], Any] | None = outer[0] if outer else None
    outer_unpack: Callable[[Any], torch.Tensor] | None = outer[1] if outer else None

    def pack(tensor: torch.Tensor) -> Any:
        param = _weight_source(tensor, by_id)
        if param is not None:
            return _Recast(param, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                           param._version)
        return (outer_pack(tensor),) if outer_pack is not None else tensor

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Recast):
            return packed.unpack()
        return outer_unpack(packed[0]) if outer_unpack is not None else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
