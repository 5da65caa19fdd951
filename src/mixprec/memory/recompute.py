"""What to recompute in backward instead of keeping it from the forward: a measured, per-block recompute plan.

Three modes per block (a submodule whose ``forward`` is wrapped; parameter names and ``state_dict`` unchanged):
``"none"`` (autograd keeps what it saves), ``"selective"`` (:func:`mixprec.ops.checkpoint` with
:func:`keep_matmuls`: the outputs of matmuls, attention and convolutions are kept, norms, activations, casts and
elementwise ops are recomputed; torch's selective activation checkpointing, ``create_selective_checkpoint_contexts``)
and ``"full"`` (the whole block recomputed from its inputs: Hugging Face's ``gradient_checkpointing_enable``).
Both recomputes run under the forward's autocast state, op lists and kernels (:func:`mixprec.ops.checkpoint`), so
the gradients equal the ones without recompute bit for bit where the ops are deterministic.

``"auto"`` measures each repeated block (the children of the model's largest ``ModuleList``/``Sequential`` of
one class) at its first training call, on its real input: bytes kept for backward in each mode (saved tensors
through :class:`mixprec.memory.saved.SavedTensorCounter`; under recompute, the inputs the region keeps and the
outputs the policy keeps, each storage once, parameters left out) and forward+backward seconds in each mode
(:mod:`mixprec.machine.timing`, modes interleaved, median). Once the last block is measured, :func:`choose_modes`
chooses every block's mode jointly: the fewest bytes at the step's peak (:func:`block_peak_bytes`: during block
``i``'s backward, what the blocks before it keep plus block ``i``'s whole activations) whose total extra time is
at most ``max_ratio - 1`` times the blocks' time without recompute (a lower bound of the step's: the step then
stays within ``max_ratio``). Recomputing the last block lowers no peak of this model, so it runs ``"none"`` (the
bytes outside the blocks, the head's and the loss's, are left out: they do make it cost some). Measuring
forks every global random stream (torch's, numpy's, python's ``random``): the run's random streams are the ones
they would be without it; it runs with autocast's cast cache off, leaving the region's cache as it was.

This module runs and measures the modes and installs the plan; the plan as data and the option parsed are in
:mod:`mixprec.memory.recompute_plan`, ``"auto"``'s joint choice in :mod:`mixprec.memory.recompute_choice` (every
name is importable from here).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import statistics
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy

from mixprec import ops
from mixprec.machine.random_streams import forked_streams
from mixprec.machine.timing import time_call
from mixprec.memory.recompute_choice import choose_modes, pooled_seconds
from mixprec.memory.recompute_plan import (DEFAULT_MAX_RATIO, MODES, BlockPlan, RecomputePlan, RecomputeRequest,
                                           block_peak_bytes, parse_request)
from mixprec.memory.recompute_region import region_forward, scratch_buffers
from mixprec.memory.saved import SavedTensorCounter
from mixprec.memory.storages import StorageCounter

__all__ = ["MODES", "DEFAULT_MAX_RATIO", "BlockPlan", "RecomputePlan", "RecomputeRequest", "parse_request", "keep_matmuls",
           "pooled_seconds", "repeated_blocks", "match_blocks", "measure_block", "block_peak_bytes", "choose_modes",
           "RecomputedForwards"]


def _aten_ops(*names: str) -> frozenset:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# The expensive ops whose outputs selective recompute keeps (everything else is recomputed).
KEPT_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")


def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep the outputs of matmuls, attention and convolutions (:data:`KEPT_OPS`),
    recompute the rest (norms, activations, casts, elementwise ops: cheap per byte)."""
    return CheckpointPolicy.MUST_SAVE if getattr(op, "overloadpacket", op) in KEPT_OPS else \
        CheckpointPolicy.PREFER_RECOMPUTE


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the children of the model's largest (by parameter count) ``ModuleList``/``Sequential`` of two or
    more modules of one class: a transformer's layers. Empty if there is none."""
    best, best_params = [], 0
    for name, module in model.named_modules():
        children = list(module.children())
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(children) < 2:
            continue
        if len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            prefix = f"{name}." if name else ""
            best, best_params = [f"{prefix}{child}" for child, _ in module.named_children()], params
    return best


def match_blocks(model: nn.Module, patterns: Iterable[tuple[str, str]], arg: str = "recompute") -> dict[str, str]:
    """Module name → mode for the modules matching each ``(glob, mode)`` (``fnmatch``; a module inside a matched
    one is left to it). ValueError (naming ``arg``) for a glob matching nothing, or only containers without a
    forward, and for two patterns giving one module different modes (``["selective:layers.1", "layers.*"]``)."""
    named = dict(model.named_modules())
    chosen: dict[str, str] = {}
    by: dict[str, str] = {}
    for pattern, mode in patterns:
        hits = [n for n, m in named.items() if n and fnmatch.fnmatchcase(n, pattern)
                and not isinstance(m, (nn.ModuleList, nn.ModuleDict))]
        if not hits:
            hint = repeated_blocks(model)
            raise ValueError(f"{arg}: {pattern!r} matches no module with a forward of {type(model).__name__}; "
                             f"name submodules as model.named_modules() does" +
                             (f", e.g. {hint[0].rsplit('.', 1)[0]}.* for {hint[:2]}" if hint else ""))
        shown = pattern if mode == "full" else f"{mode}:{pattern}"
        clash = next((n for n in hits if chosen.get(n, mode) != mode), None)
        if clash is not None:
            raise ValueError(f"{arg}: {by[clash]!r} makes {clash} {chosen[clash]} and {shown!r} makes it {mode}; give "
                             "each module one mode: narrow the glob (e.g. 'layers.[02-9]*') or drop one of them")
        chosen.update({n: mode for n in hits})
        by.update({n: shown for n in hits})
    return {n: m for n, m in chosen.items() if not any(n.startswith(f"{o}.") for o in chosen)}


class _KeptCounter(TorchDispatchMode):
    """Counts the output storages of the ops :func:`keep_matmuls` keeps (what selective recompute holds)."""

    def __init__(self, counter: StorageCounter, total: int) -> None:
        super().__init__()
        self.counter, self.total = counter, total

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in KEPT_OPS:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.total += self.counter.add(leaf)
        return out


def _run(forward: Callable[..., Any], mode: str, args: tuple, kwargs: dict, block: nn.Module | None = None,
         name: str = "") -> Any:
    if mode == "none" or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():   # traced: autocast is in the graph; torch's own recompute contexts
        context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, keep_matmuls)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs,
                                                 **({"context_fn": context} if mode == "selective" else {}))
    fn = forward if block is None else region_forward(forward, block, name, mode)
    return ops.checkpoint(fn, *args, selective=keep_matmuls if mode == "selective" else None, **kwargs)


def _kept_bytes(forward: Callable[..., Any], mode: str, args: tuple, kwargs: dict, params: list) -> int:
    """Bytes the graph keeps for backward after one forward in ``mode`` (the output dropped unused)."""
    if mode == "none":
        with SavedTensorCounter(params) as saved:
            forward(*args, **kwargs)
        return saved.result().total
    counter = StorageCounter(params)   # the region keeps its inputs for the recompute
    inputs = sum(counter.add(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    kept = _KeptCounter(counter, inputs)

    def counted(*a: Any, **k: Any) -> Any:
        with kept:
            return forward(*a, **k)

    out = _run(counted if mode == "selective" else forward, mode, args, kwargs)
    differentiable = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out))
    return kept.total if differentiable else 0   # no graph: the region keeps nothing (a frozen block)


def measure_block(forward: Callable[..., Any], params: list[torch.Tensor], args: tuple, kwargs: dict,
                  device: torch.device, repeats: int = 5,
                  saved_hooks: Callable[[], contextlib.AbstractContextManager[None]] | None = None
                  ) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    """Bytes kept for backward and median forward+backward seconds of ``forward(*args, **kwargs)`` in each of
    :data:`MODES` (interleaved, one warm-up round, ``repeats`` timed rounds; gradients by ``torch.autograd.grad``:
    no ``.grad`` is written). Inputs are detached copies requiring grad as the real ones do (a frozen block on an
    input without grad keeps nothing: 0 bytes in every mode, forward seconds only); every global random stream is
    forked (:func:`mixprec.machine.random_streams.forked_streams`: torch's, numpy's, python's; the caller's
    streams are unchanged); the saved-tensor hooks open around the call (a caller's
    :func:`mixprec.memory.saved.saved_bytes`) do not see the measuring passes, which run under ``saved_hooks()``
    when given (the engine's forward's own: :mod:`mixprec.autocast.saved_rebuilds`, so ``"none"`` counts what
    that forward keeps); a profiler session of the caller's
    shows them inside one range, ``mixprec: checkpoint block timing``. Host syncs: two per timed call (CUDA/MPS)."""
    leaves = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                      else t, (args, kwargs))
    args, kwargs = leaves
    wrt = [t for t in tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt += [p for p in params if p.requires_grad]

    def step(mode: str) -> None:
        out = [t for t in tree_leaves(_run(forward, mode, args, kwargs))
               if isinstance(t, torch.Tensor) and t.requires_grad]
        if out:   # else nothing to differentiate: a frozen block
            torch.autograd.grad(sum(t.float().sum() for t in out), wrt, allow_unused=True)

    with forked_streams(device), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
            saved_hooks() if saved_hooks is not None else contextlib.nullcontext(), \
            torch.profiler.record_function("mixprec: checkpoint block timing"), \
            _uncached_casts(device):   # leaves the region's cast cache as it was: the real forward then casts
        saved = tuple(_kept_bytes(forward, m, args, kwargs, params) for m in MODES)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for round_ in range(repeats + 1):
            for mode in MODES:
                seconds = time_call(lambda: step(mode), device)
                times[mode] += [seconds] if round_ else []
    return saved, tuple(statistics.median(times[m]) for m in MODES)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _uncached_casts(device: torch.device) -> contextlib.ExitStack:
    """The current autocast states of ``cpu`` and ``device`` with autocast's cast cache off (entered)."""
    stack = contextlib.ExitStack()
    for device_type in dict.fromkeys(("cpu", device.type)):
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                                               cache_enabled=False))
    return stack


class _Recomputed:
    """A block's ``forward`` run in ``mode``: one code for every block, its values attributes of this object (a traced
    model inlines each block's call, one graph for all). An object, not a closure, so a deep copy of the model (an
    EMA, a teacher) runs the copy's own block: ``copy.deepcopy`` copies the block and its bound ``forward`` with it
    (a closure would be shared, and the copy would run the original's weights); it pickles with the model."""

    def __init__(self, forward: Callable[..., Any], mode: str, block: nn.Module, name: str) -> None:
        self.forward, self.mode, self.block, self.name = forward, mode, block, name
        self.__wrapped__ = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self.forward, self.mode, args, kwargs, self.block, self.name)


class _Pending:
    """A block's ``forward`` until ``"auto"`` settles its mode (:class:`RecomputedForwards`): eager, never traced
    (no traced frame per block: dynamo's recompile limit); at each training call it runs in the mode ``on_pending``
    returns. A deep copy or a pickle of it is the copied block's own forward, unplanned (``"none"``): the plan is
    measured and chosen by the engine of the original."""

    def __init__(self, forward: Callable[..., Any], block: nn.Module, name: str,
                 on_pending: Callable[[str, Callable[..., Any], tuple, dict], str]) -> None:
        self.forward, self.block, self.name, self.on_pending = forward, block, name, on_pending
        self.__wrapped__ = forward

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.block.training):
            return self.forward(*args, **kwargs)
        with scratch_buffers(self.block):   # measuring forwards leave every buffer as it was
            mode = self.on_pending(self.name, self.forward, args, kwargs)
        return _run(self.forward, mode, args, kwargs, self.block, self.name)

    def __deepcopy__(self, memo: dict) -> _Recomputed:
        return _Recomputed(copy.deepcopy(self.forward, memo), "none", copy.deepcopy(self.block, memo), self.name)

    def __reduce__(self) -> tuple:
        return _Recomputed, (self.forward, "none", self.block, self.name)


class RecomputedForwards:
    """Installs the plan: each named block's ``forward`` becomes a wrapper running it in its mode (``"pending"``:
    runs eagerly, never traced, and at each training call runs in the mode ``on_pending(name, forward, args,
    kwargs)`` returns, until :meth:`settle` gives it its mode). :meth:`remove` restores the blocks' own ``forward``."""

    def __init__(self, model: nn.Module, modes: dict[str, str],
                 on_pending: Callable[[str, nn.Module, tuple, dict], str] | None = None) -> None:
        self.modes = dict(modes)
        self._on_pending = on_pending
        self._blocks = {n: m for n, m in model.named_modules() if n in self.modes}
        self._own = {n: block.forward for n, block in self._blocks.items()}
        self._installed: dict[str, Callable[..., Any]] = {}
        for name, block in self._blocks.items():
            block.forward = self._installed[name] = self._wrap(name, block.forward)

    def _wrap(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        if self.modes[name] != "pending":
            return _Recomputed(forward, self.modes[name], self._blocks[name], name)
        return _Pending(forward, self._blocks[name], name, self._on_pending)

    def settle(self, modes: dict[str, str]) -> None:
        """Each block of ``modes`` runs its mode from its next call on (traced inline under compile)."""
        for name, mode in modes.items():
            self.modes[name] = mode
            wrapper = _Recomputed(self._own[name], mode, self._blocks[name], name)
            self._blocks[name].forward = self._installed[name] = wrapper

    def remove(self) -> None:
        """Each block's own ``forward`` back, where the block still runs this plan's wrapper (not one installed
        over it since)."""
        for name, block in self._blocks.items():
            if vars(block).get("forward") is self._installed.get(name):
                del block.forward
        self._blocks, self._installed = {}, {}
