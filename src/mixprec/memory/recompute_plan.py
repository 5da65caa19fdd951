"""The recompute plan as data: the three modes, each block's choice, the plan's text, the option that asks for it.

``MixedPrecision(recompute=...)`` is parsed by :func:`parse_request` into a :class:`RecomputeRequest`: off,
``"auto"`` (with its time bound) or named blocks in a mode. The plan that follows is a :class:`RecomputePlan` of
:class:`BlockPlan` (a block's mode and, when measured, its bytes kept for backward and forward+backward seconds in
each of :data:`MODES`); its :meth:`~RecomputePlan.text` is the event's detail and parses back, and
:func:`block_peak_bytes` is the blocks' bytes at the step's peak under a plan. How the modes run and are
measured: :mod:`mixprec.memory.recompute`; how ``"auto"`` chooses them: :mod:`mixprec.memory.recompute_choice`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MODES", "DEFAULT_MAX_RATIO", "BlockPlan", "RecomputePlan", "RecomputeRequest", "parse_request",
           "block_peak_bytes"]

MODES = ("none", "selective", "full")
DEFAULT_MAX_RATIO = 1.3   # at most 1.3x the step time without recompute
_ARG = "recompute"
_ALLOWED = ("None or 'none' (no recompute), 'auto' or 'auto:<max time ratio>' (e.g. 'auto:1.5'), a module name or glob "
            "('blocks.*'), or a list of them; prefix a name with 'selective:' to keep matmul outputs")


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
