"""Saved tensors rebuilt in backward instead of kept: autocast's weight copies and activation outputs (opt-in).

Two kinds of tensor that autograd saves for backward are cheap to make again from what it keeps anyway:

* **Weight copies.** Under bf16-mixed autocast casts each fp32 weight to bf16 for its matmul and autograd keeps that
  copy for ``grad_x = grad_y @ W_bf16`` (6 MiB at ``gpt/mid``). A copy (or a view of one: a linear saves
  ``W_bf16.t()``) whose autograd history is exactly one ``_to_copy`` of one of the engine's parameters, on its
  device, with its layout, is packed as a reference to the parameter and cast again in backward. Frozen weights (no
  history) and FSDP2's unsharded parameters (not the engine's) are kept. The parameter must not change before the
  backward reads it: a change its version counter shows raises there.
* **Activation outputs.** In ``fc2(gelu(fc1(x)))`` autograd keeps GELU's input (its own backward needs it) and GELU's
  output (``fc2``'s weight gradient needs it): two tensors of the hidden width. The output of ``gelu`` or ``silu``
  (or a view of one) is packed as a reference to the op's autograd node, whose saved input is kept anyway, and the
  backward runs the op again on it (4 MiB per block at ``gpt/mid``, for one elementwise op per block in backward).
  The node runs after every consumer's backward, so its input is there when they read.

Numerics: a cast, or an elementwise op, of the same input in the same dtype gives the same bits, so every gradient
is unchanged (the tests compare with runs that keep them, bit for bit). Double backward (gradient penalties) works:
torch gives an unpacked tensor the saved one's autograd history.

Entered by ``mp.autocast()`` under the policy option ``saved=rebuild`` only (opt-in: ``saved=compute``, the bf16
default, installs no saved-tensor hook). Its limits, each a reason it is not the default:

* ``torch.func`` transforms (``grad``, ``vmap(grad)``, ``jacrev``) refuse to run under any saved-tensor hook;
* a GELU/SiLU output made inside a ``torch.utils.checkpoint`` region and saved outside it (a region ending in the
  activation: the engine's ``recompute=`` on blocks that end in one) fails at backward (the region's hooks allow one
  unpack of the activation's input, and the rebuild is a second);
* a GELU/SiLU output saved by two heads backpropagated in two separate ``backward()`` calls (without
  ``retain_graph``): the second cannot rebuild it (the first freed the activation's input);
* a parameter written in place inside one ``mp.autocast()`` block between two calls of a submodule (not the
  model: the engine drops the stale cast before each model forward) is read as written, not as autocast's cached
  copy.

A tensor rebuilt is one not written in place since it was made (version 0 when saved); one written under
``no_grad`` before it is saved is kept as it is. A ``.data`` write is invisible to version counters, as for torch.

Hooks: ``saved_tensors_hooks`` apply only at the top of their stack, so :func:`rebuild_saved` composes with the
hooks around it (a user's ``save_on_cpu``, :class:`~mixprec.memory.saved.SavedTensorCounter`): every other tensor
goes to the enclosing pack hook (torch's ``_top_saved_tensors_default_hooks``); hooks opened inside (a
checkpointed region's) replace these there. With no enclosing hook, a tensor kept as it is checks its version
counter at unpack, as torch does without hooks (torch skips that check for every tensor under any hooks: an
in-place write to a saved activation would otherwise go unnoticed); an output modified in place after it was
saved raises the same way. Where saved-tensor hooks are disabled (some tracing contexts), nothing changes. No host
sync.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["rebuild_saved", "RERUN_OPS"]

# autograd node -> its op run again on the node's saved input (these nodes save their input, not their output)
RERUN_OPS: dict[str, Callable[[Any], torch.Tensor]] = {
    "GeluBackward0": lambda node: torch.ops.aten.gelu(node._saved_self, approximate=node._saved_approximate),
    "SiluBackward0": lambda node: torch.ops.aten.silu(node._saved_self),
}


def _modified(tensor: torch.Tensor, saved: int, current: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{tensor.dtype} {list(tensor.shape)}] is at version {current}; expected version {saved} instead (a tensor "
        "saved for backward inside mp.autocast() was written in place before the backward read it; write to a "
        "clone, or run the backward first)")


@dataclass(frozen=True)
class _Kept:
    """A tensor kept as it is (detached: holding its autograd history here would make a reference cycle through
    the graph that Python's collector cannot free), with its version when saved (checked at unpack; a detached
    tensor shares the version counter)."""

    tensor: torch.Tensor
    version: int

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise _modified(self.tensor, self.version, self.tensor._version)
        return self.tensor


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


@dataclass(frozen=True)
class _Rerun:
    """A saved activation output, packed: run ``node``'s op again on its saved input, view it as saved. ``output``
    (a weak reference: keeping it would keep the bytes) checks that the output was not written in place since."""

    node: Any
    output: Any
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    kept_nbytes: int = 0   # the input is kept by the node anyway: SavedTensorCounter reads it

    def unpack(self) -> torch.Tensor:
        output = self.output()
        if output is not None and output._version != self.version:
            raise _modified(output, self.version, output._version)
        with torch.no_grad():
            out = RERUN_OPS[type(self.node).__name__](self.node)
        return out.as_strided(self.size, self.stride, self.offset)


def _base(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor._base is None else tensor._base


def _weight_copy(tensor: torch.Tensor, params: dict[int, torch.Tensor]) -> _Recast | None:
    """``tensor`` packed as a recast when it (or its base) is a plain 16-bit cast of one of ``params``."""
    base = _base(tensor)
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    param = getattr(fn.next_functions[0][0], "variable", None)   # the gradient accumulator's variable
    if param is None or params.get(id(param)) is not param:
        return None
    if (base.dtype == param.dtype or base.device != param.device or base.shape != param.shape
            or base.stride() != param.stride() or base.storage_offset() != 0 or base._version != 0):
        return None
    return _Recast(param, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                   param._version)


def _activation_output(tensor: torch.Tensor) -> _Rerun | None:
    """``tensor`` packed as a rerun when it (or its base) is the whole dense output of one of :data:`RERUN_OPS`."""
    base = _base(tensor)
    node = base.grad_fn
    if node is None or type(node).__name__ not in RERUN_OPS or base.storage_offset() != 0 \
            or base.layout != torch.strided or not base.is_contiguous() or base._version != 0:
        return None
    return _Rerun(node, weakref.ref(base), base._version, tuple(tensor.shape), tuple(tensor.stride()),
                  tensor.storage_offset())


@contextlib.contextmanager
def rebuild_saved(params: Iterable[torch.Tensor] = (), *, weight_copies: bool = True,
                  activation_outputs: bool = True) -> Iterator[None]:
    """Inside: saved 16-bit copies of ``params`` (fp32 leaves requiring grad; when ``weight_copies``) and saved
    ``gelu``/``silu`` outputs (when ``activation_outputs``) are rebuilt in backward instead of kept (module
    docstring). Both off, or hooks disabled here: nothing."""
    by_id = {id(p): p for p in params if p.requires_grad and p.is_floating_point()} if weight_copies else {}
    if not (by_id or activation_outputs) or \
            torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
        yield
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack: Callable[[torch.Tensor], Any] | None = outer[0] if outer else None
    outer_unpack: Callable[[Any], torch.Tensor] | None = outer[1] if outer else None

    def pack(tensor: torch.Tensor) -> Any:
        packed = (_weight_copy(tensor, by_id) if by_id else None) or \
            (_activation_output(tensor) if activation_outputs else None)
        if packed is not None:
            return packed
        if outer_pack is not None:
            return (outer_pack(tensor),)
        return tensor if tensor.is_inference() else _Kept(tensor.detach(), tensor._version)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, (_Kept, _Recast, _Rerun)):
            return packed.unpack()
        return outer_unpack(packed[0]) if outer_unpack is not None else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
