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
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy

from mixprec import ops
from mixprec.machine.random_streams import forked_streams
from mixprec.machine.timing import time_call
from mixprec.memory.recompute_region import region_forward, scratch_buffers
from mixprec.memory.saved import SavedTensorCounter
from mixprec.memory.storages import StorageCounter

__all__ = ["MODES", "BlockPlan", "RecomputePlan", "RecomputeRequest", "parse_request", "keep_matmuls",
           "pooled_seconds", "repeated_blocks", "match_blocks", "measure_block", "block_peak_bytes", "choose_modes",
           "RecomputedForwards"]

MODES = ("none", "selective", "full")
DEFAULT_MAX_RATIO = 1.3   # at most 1.3x the step time without recompute
_UNITS_PER_BLOCK = 64   # choose_modes: the time budget in 64 units per block (each extra time rounded up)
_ARG = "recompute"
_ALLOWED = ("None or 'none' (no recompute), 'auto' or 'auto:<max time ratio>' (e.g. 'auto:1.5'), a module name or glob "
            "('blocks.*'), or a list of them; prefix a name with 'selective:' to keep matmul outputs")


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


@dataclass(frozen=True)
class BlockPlan:
    """One block's choice: its module ``name``, ``mode`` (one of :data:`MODES`) and, when measured, the bytes kept
    for backward (``saved_bytes``) and the median forward+backward seconds (``seconds``) of each mode, in
    :data:`MODES` order (None when the mode was named, not measured)."""

    name: str
    mode: str
    saved_bytes: tuple[int, int, int] | None = None
    seconds: tuple[float, float, float] | None = None

    def text(self, readable: bool = False) -> str:
        """``name mode [saved none/selective/full B; fwd+bwd ... s]``; ``readable``: milliseconds to 3 significant
        digits (for people; the default text keeps every digit and parses back)."""
        if self.saved_bytes is None or self.seconds is None:
            return f"{self.name} {self.mode}"
        saved = "/".join(str(b) for b in self.saved_bytes)
        if readable:
            ms = "/".join(f"{s * 1e3:.3g}" for s in self.seconds)
            return f"{self.name} {self.mode} [saved {saved} B; fwd+bwd {ms} ms]"
        return f"{self.name} {self.mode} [saved {saved} B; fwd+bwd {'/'.join(repr(s) for s in self.seconds)} s]"


_BLOCK = re.compile(r"(\S+) (none|selective|full)(?: \[saved (\d+)/(\d+)/(\d+) B; fwd\+bwd (\S+)/(\S+)/(\S+) s\])?")


@dataclass(frozen=True)
class RecomputePlan:
    """What each block recomputes: ``request`` (the option as given, e.g. ``"auto"``), ``max_ratio`` (auto's time
    bound; None for named blocks), ``blocks`` (:class:`BlockPlan`, in model order) and ``scope``: what the bound
    held for, ``"step"`` (the blocks' total time: :func:`choose_modes`) or ``"block"`` (each block's own time:
    plans recorded before the step rule). :meth:`text` is the event's detail and parses back (:meth:`from_text`):
    a checkpoint's event log restores the same plan, older ones included."""

    request: str
    blocks: tuple[BlockPlan, ...]
    max_ratio: float | None = None
    scope: str = "step"

    def modes(self) -> dict[str, str]:
        return {b.name: b.mode for b in self.blocks}

    def note(self) -> str:
        """The decision clause: how many blocks recompute how, and the bytes the plan saves where measured."""
        counts = {m: sum(b.mode == m for b in self.blocks) for m in MODES}
        shown = ", ".join(f"{n} {m}" for m, n in counts.items() if n) or "no repeated blocks found: nothing"
        measured = [b for b in self.blocks if b.saved_bytes is not None]
        if not measured:
            return f"; recompute {self.request}: {shown}"
        before = sum(b.saved_bytes[0] for b in measured)
        after = sum(b.saved_bytes[MODES.index(b.mode)] for b in measured)
        slower = sum(b.seconds[MODES.index(b.mode)] for b in measured) / max(sum(b.seconds[0] for b in measured), 1e-12)
        bound = f"time <= {self.max_ratio}x" + (" per block" if self.scope == "block" else "")
        saved = [b.saved_bytes for b in measured]
        peak = (f" (peak in backward {block_peak_bytes(saved, [b.mode for b in measured]) / 2**20:.2f} MiB instead "
                f"of {block_peak_bytes(saved, ['none'] * len(saved)) / 2**20:.2f} MiB)")
        unmeasured = [b.name for b in self.blocks if b.saved_bytes is None]
        skipped = (f"; {unmeasured} none, not measured (did not run in training before the first step boundary)"
                   if unmeasured else "")
        return (f"; recompute {self.request} (measured, {bound}): {shown}; blocks keep {after / 2**20:.2f} MiB for "
                f"backward instead of {before / 2**20:.2f} MiB{peak} at {slower:.2f}x their forward+backward "
                f"time{skipped}")

    def text(self, readable: bool = False) -> str:
        """The plan on one line; ``readable``: times in ms to 3 significant digits (printed, not parsed back)."""
        bound = "" if self.max_ratio is None else f" <= {self.max_ratio!r}" + (" per step" * (self.scope == "step"))
        return f"recompute plan {self.request}{bound}: " + ", ".join(b.text(readable) for b in self.blocks)

    @classmethod
    def from_text(cls, text: str) -> RecomputePlan:
        """The plan :meth:`text` wrote (a plan without `` per step`` after its bound: ``scope="block"``).
        ValueError for other text."""
        head = re.match(r"recompute plan (\S+)(?: <= (\S+)( per step)?)?: ", text)
        if head is None:
            raise ValueError(f"not a recompute plan: {text[:80]!r}")
        blocks = []
        for m in _BLOCK.finditer(text[head.end():]):
            g = m.groups()
            measured = g[2] is not None
            blocks.append(BlockPlan(g[0], g[1], tuple(int(x) for x in g[2:5]) if measured else None,
                                    tuple(float(x) for x in g[5:8]) if measured else None))
        ratio = head.group(2)
        return cls(head.group(1), tuple(blocks), None if ratio is None else float(ratio),
                   "block" if ratio is not None and head.group(3) is None else "step")


@dataclass(frozen=True)
class RecomputeRequest:
    """The parsed option: ``kind`` ``"off"``, ``"auto"`` (with ``max_ratio``) or ``"named"`` (``patterns``: pairs
    of a module-name glob and its mode); ``text`` is the option as shown in the decision."""

    kind: str
    text: str = ""
    max_ratio: float = DEFAULT_MAX_RATIO
    patterns: tuple[tuple[str, str], ...] = ()


def parse_request(value: Any, arg: str = _ARG) -> RecomputeRequest:
    """``MixedPrecision(recompute=value)`` as a :class:`RecomputeRequest`. ValueError/TypeError naming the
    argument (``arg``: ``"recompute"``, the CLI's ``"--recompute"``), the value and what is allowed."""
    if value is None or value is False or value == "none":
        return RecomputeRequest("off")
    if isinstance(value, str) and (value == "auto" or value.startswith("auto:")):
        ratio = value[5:] or str(DEFAULT_MAX_RATIO)
        try:
            max_ratio = float(ratio)
        except ValueError:
            max_ratio = float("nan")
        if not 1.0 <= max_ratio < float("inf"):
            raise ValueError(f"{arg}={value!r}: the time ratio after 'auto:' must be a number >= 1 (the step may "
                             f"take at most that many times its time without recompute), e.g. 'auto:1.3'")
        return RecomputeRequest("auto", f"auto:{max_ratio!r}" if value != "auto" else "auto", max_ratio)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{arg}={value!r} is not allowed; pass {_ALLOWED}")
    patterns = []
    for name in names:
        mode, _, pattern = name.rpartition(":") if ":" in name else ("full", "", name)
        meant = _meant(name, mode, pattern)
        if meant is not None:
            raise ValueError(f"{arg}={value!r}: {name!r} is not allowed (it would name a module); did you mean "
                             f"{meant!r}? (the words 'auto', 'none', 'selective' and 'full' are lower case)")
        if mode not in ("selective", "full") or not pattern:
            raise ValueError(f"{arg}={value!r}: {name!r} is not allowed; pass {_ALLOWED}")
        patterns.append((pattern, mode))
    return RecomputeRequest("named", ",".join(names), patterns=tuple(patterns))


def _meant(name: str, mode: str, pattern: str) -> str | None:
    """The lower-case option a capitalised ``'Auto'``, ``'None'`` or ``'Selective:...'`` means; None otherwise."""
    if name.lower() in ("auto", "none") or name.lower().startswith("auto:"):
        return name.lower()
    if mode.lower() in ("selective", "full") and mode not in ("selective", "full"):
        return f"{mode.lower()}:{pattern}"
    return None


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


def match_blocks(model: nn.Module, patterns: Iterable[tuple[str, str]], arg: str = _ARG) -> dict[str, str]:
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


def block_peak_bytes(saved_bytes: Sequence[tuple[int, int, int]], modes: Sequence[str]) -> int:
    """The blocks' bytes at the step's peak under ``modes``: the most, over blocks ``i``, of what the blocks before
    ``i`` keep for backward (``saved_bytes[j][mode j]``) plus block ``i``'s whole activations (``saved_bytes[i][0]``:
    rebuilt by its recompute, or kept) while its backward runs. Bytes outside the blocks (embedding, head, loss,
    gradients) are the same under every plan and left out."""
    kept, peak = 0, 0
    for saved, mode in zip(saved_bytes, modes, strict=True):
        peak = max(peak, kept + saved[0])
        kept += saved[MODES.index(mode)]
    return peak


def choose_modes(saved_bytes: Sequence[tuple[int, int, int]], seconds: Sequence[tuple[float, float, float]],
                 max_ratio: float) -> tuple[str, ...]:
    """Each block's mode (:data:`MODES`), chosen jointly: the fewest :func:`block_peak_bytes` whose total extra
    time, the sum over blocks of ``seconds[i][mode] - seconds[i][0]``, is at most ``(max_ratio - 1)`` times the
    blocks' time without recompute ``sum(seconds[i][0])`` (the step takes at least that: its recompute overhead is
    then within ``max_ratio`` too); of those, the least extra time. Exact up to the time budget's grid (64 units
    per block, each extra time rounded up, a recompute at least one unit: the bound always holds; at most 1/64 of
    the budget left unused); identical blocks' times pooled first (:func:`pooled_seconds`). The last of identical blocks runs ``"none"`` (recomputing it lowers no peak of this
    model; measured at GPT small, batch 64: it costs the head's bytes at the start of backward, 6 %). On the
    CPU, no host sync."""
    seconds = pooled_seconds(saved_bytes, seconds)
    grid = _UNITS_PER_BLOCK * max(len(seconds), 4)
    budget = (max_ratio - 1.0) * sum(s[0] for s in seconds)
    units = [(0, *(_units(t - s[0], budget, grid) for t in s[1:])) for s in seconds]
    low, high = 0, block_peak_bytes(saved_bytes, ["none"] * len(saved_bytes))   # all none: within any bound
    for i, saved in enumerate(saved_bytes):   # no plan beats every earlier block keeping its fewest bytes
        low = max(low, sum(min(b) for b in saved_bytes[:i]) + saved[0])
    best = ("none",) * len(saved_bytes)
    while low < high:   # bisect the least peak some plan within the budget reaches
        target = (low + high) // 2
        fit = _fit(saved_bytes, units, target, grid)
        low, high, best = (low, target, fit) if fit is not None else (target + 1, high, best)
    return best


def pooled_seconds(saved_bytes: Sequence[tuple[int, int, int]], seconds: Sequence[tuple[float, float, float]]
                   ) -> list[tuple[float, float, float]]:
    """Each block's seconds per mode, replaced by the median over the blocks keeping the same bytes in every mode
    when there are 3 or more of them (identical blocks on the same input: a transformer's layers), so one timing
    hit by a neighbour's load cannot change one block's mode (measured at GPT small under load: one block timed
    1.5x its five peers went selective, the step's peak 0.20x fp32's instead of 0.148x). Others unchanged."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, saved in enumerate(saved_bytes):
        groups.setdefault(tuple(saved), []).append(i)
    out = [tuple(s) for s in seconds]
    for members in groups.values():
        if len(members) >= 3:
            pooled = tuple(statistics.median(seconds[i][m] for i in members) for m in range(len(MODES)))
            for i in members:
                out[i] = pooled
    return out


def _units(extra_s: float, budget_s: float, grid: int) -> int:
    """``extra_s`` in units of ``budget_s / grid``, rounded up, at least one (a recompute is never free, even where
    noise timed it faster); ``grid + 1``: never fits."""
    return grid + 1 if budget_s <= 0 else min(grid + 1, max(1, math.ceil(extra_s * grid / budget_s)))


def _fit(saved_bytes: Sequence[tuple[int, int, int]], units: list[tuple[int, ...]], target: int,
         grid: int) -> tuple[str, ...] | None:
    """Modes whose :func:`block_peak_bytes` is at most ``target`` in at most ``grid`` time units: the fewest units
    (then the fewest kept bytes); None if there are none. Dynamic programming over the units used so far: for each
    count, the fewest bytes the blocks so far keep (fewer is never worse for the blocks after)."""
    never = torch.iinfo(torch.int64).max // 4
    kept = torch.full((grid + 1,), never, dtype=torch.int64)   # kept[t]: fewest bytes kept so far, in t units
    kept[0] = 0
    picks = []
    for saved, cost in zip(saved_bytes, units):
        within = kept + saved[0] <= target   # this block's backward stays within the target
        after, origin, mode = torch.full_like(kept, never), torch.zeros_like(kept), torch.zeros_like(kept)
        for m, u in enumerate(cost):
            if u > grid:
                continue
            reach = torch.where(within, kept + saved[m], never)[:grid + 1 - u]
            better = reach < after[u:]
            after[u:] = torch.where(better, reach, after[u:])
            origin[u:] = torch.where(better, torch.arange(grid + 1 - u), origin[u:])
            mode[u:] = torch.where(better, m, mode[u:])
        kept = after
        picks.append((origin.tolist(), mode.tolist()))
    ends = (kept < never).nonzero()
    if not len(ends):
        return None
    t, modes = int(ends[0]), []
    for origin, mode in reversed(picks):
        t, m = origin[t], mode[t]
        modes.append(MODES[m])
    return tuple(reversed(modes))


def _settled(forward: Callable[..., Any], mode: str, block: nn.Module, name: str) -> Callable[..., Any]:
    """``forward`` run in ``mode``: one code object for every block, no per-block value looked up (a traced model
    inlines each block's call, one graph for all)."""
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return _run(forward, mode, args, kwargs, block, name)
    recomputed.__wrapped__ = forward   # type: ignore[attr-defined]
    return recomputed


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
        for name, block in self._blocks.items():
            block.forward = self._wrap(name, block.forward)

    def _wrap(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        if self.modes[name] != "pending":
            return _settled(forward, self.modes[name], self._blocks[name], name)

        @torch.compiler.disable   # eager until settled: no traced frame per block (dynamo's recompile limit)
        def pending(*args: Any, **kwargs: Any) -> Any:
            if not (torch.is_grad_enabled() and self._blocks[name].training):
                return forward(*args, **kwargs)
            with scratch_buffers(self._blocks[name]):   # measuring forwards leave every buffer as it was
                mode = self._on_pending(name, forward, args, kwargs)
            return _run(forward, mode, args, kwargs, self._blocks[name], name)
        pending.__wrapped__ = forward   # type: ignore[attr-defined]
        return pending

    def settle(self, modes: dict[str, str]) -> None:
        """Each block of ``modes`` runs its mode from its next call on (traced inline under compile)."""
        for name, mode in modes.items():
            self.modes[name] = mode
            self._blocks[name].forward = _settled(self._own[name], mode, self._blocks[name], name)

    def remove(self) -> None:
        for block in self._blocks.values():
            if "forward" in vars(block):
                del block.forward
        self._blocks = {}
