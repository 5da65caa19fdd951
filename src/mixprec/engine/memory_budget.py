"""The engine's ``memory_budget=`` option: what the measured attention plan may spend on speed, in bytes.

By default the op plan (:mod:`mixprec.autocast.op_plan`) never runs an attention kernel that saves more for
backward than ``fused`` (+0 MiB per call). ``MixedPrecision(..., memory_budget="4GiB")`` (or an int of bytes)
lets it trade bytes for speed within a budget of peak live tensor bytes:

1. The engine measures the peak live tensor bytes of one training step (:class:`mixprec.memory.live.LiveMeter`:
   on CUDA the allocator's peak, on CPU the profiler's memory events, so **that step runs under the profiler on
   CPU**, slower; on MPS sampled) under the plan's default (+0 MiB per call), and counts the planned attention
   calls a backward follows (:class:`mixprec.autocast.saved_allowance.CallCounter`; recomputes included). The
   measured step is the **second** training step (boundary 2): the first measures the plan's kernels (their
   timings must not carry the profiler's per-op overhead, nor their stand-ins' bytes count in the peak). On the
   CPU, while a profiler session of the user's records (``torch.profiler``, Lightning's ``PyTorchProfiler``), the
   measurement waits for the first training step without one (:func:`mixprec.memory.live.blocked`: its own
   session, nested, would end the user's trace): a ``"memory-budget"`` event (cause ``deferred``) and the
   pending clause say so.
2. Over the budget: a warning (once), a ``"memory-budget"`` event (cause ``over``) and a decision clause naming
   the overshoot (:func:`size_words`: B, KiB, MiB, GiB as fits) and the fixes left: ``recompute="auto"``
   without a recompute plan, full recompute where the plan leaves blocks selective or not recomputed, else a
   smaller batch or a larger budget; the plan stays at ``fused``'s bytes.
3. Headroom ``H = budget - peak``: attention may save ``H / 2 / n`` bytes per call over ``fused`` (``n``: the
   step's planned calls), so the extra summed over one step stays within half the headroom (:data:`SHARE`; the
   other half covers allocator slack and what the stand-ins' figure misses: a model whose q, k, v are views of
   one projection keeps 2·B·H·T·D bytes more under ``matmul``, docs/op-plan.md). The measured keys are chosen
   again from their measurement (:func:`mixprec.autocast.op_plan.rechosen`, nothing re-measured) from the next
   step on; a ``"memory-budget"`` event (cause ``measured``) and the decision say which kernel each key now runs,
   its extra MiB per call and per step, the budget and the headroom.

The allowance is the engine's own (:func:`mixprec.autocast.saved_allowance.scoped_allowance`, entered in
``mp.autocast()`` and ``mp.backward()``): another engine's lookups, and the process-wide
``allow_extra_saved`` / ``$MIXPREC_ATTENTION_EXTRA_SAVED_MIB``, are untouched (with a budget those do not apply
to this engine). ``mp.state_dict()["memory_budget"]`` and the event (a checkpoint's log) carry the decision;
loading either re-applies it, never measured again. Limits: each rank decides alone under a strategy; a
graph compiled before the decision keeps the kernels it traced. No host sync but the meter's (two device syncs
on CUDA, one per sample on MPS), once.
"""

from __future__ import annotations

import logging
import re
import warnings
import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.autocast.op_plan import entries, rechosen
from mixprec.autocast.saved_allowance import CallCounter, mib_words, scoped_allowance
from mixprec.engine.feature import Feature, HeldEngine
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event
from mixprec.memory.batch_budget import parse_bytes
from mixprec.memory.live import LiveMeter, blocked, resident_tensors
from mixprec.memory.recompute import RecomputePlan
from mixprec.messages.location import user_stacklevel

__all__ = ["BudgetDecision", "MemoryBudget", "SHARE", "parse_budget", "size_words"]

log = logging.getLogger("mixprec")

SHARE = 0.5   # the share of the headroom the attention plan's extra saved bytes may take in one step
_KIND = "memory-budget"
_DEFAULT = "fused"
_NUMBERS = re.compile(r"\[budget (\d+) B, peak (\d+) B, (\d+) calls, allowance (\S+) MiB per call\]$")


def size_words(n_bytes: int | None) -> str:
    """``n_bytes`` for a sentence in the unit that reads: ``"512 B"``, ``"1 KiB"``, ``"13.4 MiB"``, ``"4 GiB"``,
    ``"1 TiB"`` (powers of 2, three significant digits, whole numbers from 100 up); "unknown" for None."""
    if n_bytes is None:
        return "unknown"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale:
            value = n_bytes / scale
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{n_bytes} B"


def parse_budget(option: Any) -> int | None:
    """``memory_budget=`` as bytes (None: no budget). TypeError/ValueError naming the argument, the value and the
    allowed forms."""
    if option is None:
        return None
    if isinstance(option, bool) or not isinstance(option, (str, int)):
        raise TypeError(f"memory_budget={option!r}: allowed are None (no budget), a size text such as '4GiB' or "
                        "'512MiB', or an int of bytes > 0; e.g. MixedPrecision(..., memory_budget='4GiB')")
    return parse_bytes(option, name="memory_budget")


@dataclass(frozen=True)
class BudgetDecision:
    """What the measured step gave: ``budget_bytes``; ``peak_bytes`` (its peak live tensor bytes,
    :attr:`mixprec.memory.live.PeakLive.total`); ``calls``: its planned attention calls a backward followed;
    ``allowed_mib``: MiB per call the plan may save over ``fused`` from then on (0 over the budget);
    ``step``: the boundary it was decided at (not compared)."""

    budget_bytes: int
    peak_bytes: int
    calls: int
    allowed_mib: float
    step: int = field(compare=False)

    @property
    def headroom_bytes(self) -> int:
        """``budget_bytes - peak_bytes`` (negative: over the budget)."""
        return self.budget_bytes - self.peak_bytes

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every field (what ``mp.state_dict()["memory_budget"]`` holds)."""
        return {"budget_bytes": self.budget_bytes, "peak_bytes": self.peak_bytes, "calls": self.calls,
                "allowed_mib": self.allowed_mib, "step": self.step}

    def numbers(self) -> str:
        """The tail of the event's detail a checkpoint's log is re-applied from."""
        return (f"[budget {self.budget_bytes} B, peak {self.peak_bytes} B, {self.calls} calls, "
                f"allowance {self.allowed_mib!r} MiB per call]")


class MemoryBudget(Feature):
    """The budget of one engine (module docstring): ``note`` is its decision clause ("" without a budget).
    :meth:`scope` is entered in ``mp.autocast()`` and ``mp.backward()``, :meth:`at_boundary` after each step."""

    _mp = HeldEngine()   # weakly: the engine owns this

    key = "memory_budget"

    def __init__(self, mp: Engine, option: Any) -> None:
        self._mp = mp
        self.budget_bytes = parse_budget(option)
        self.decided: BudgetDecision | None = None
        self._boundaries = 0   # this engine's boundaries since it was built
        self._meter: LiveMeter | None = None
        self._counter: CallCounter | None = None
        self._counts: dict[str, int] = {}   # the measured step's planned calls per key
        self._decided_note = ""   # the clause once decided, kept as written (the decision's text is replaced by it)
        self._deferred = ""   # why the measured step waits (a user's profiler session), from the boundary it began
        self._step_began = False   # the measured step is started (or deferred) at a step's first scope only
        self._abandoned: weakref.finalize | None = None   # stops the meter if this is collected inside the window

    @property
    def on(self) -> bool:
        return self.budget_bytes is not None or self.decided is not None

    @property
    def allowed_mib(self) -> float:
        """MiB per call the engine's attention may save over ``fused`` now (0 until decided)."""
        return 0.0 if self.decided is None else self.decided.allowed_mib

    @property
    def note(self) -> str:
        """The decision's clause: pending, then as written when decided or loaded ("" without a budget)."""
        if not self.on:
            return ""
        if self.decided is None:
            when = (f"deferred {self._deferred}; measured at the first training step without one" if self._deferred
                    else "the second training step's peak live tensors are measured, under the profiler on CPU")
            return f"; memory_budget {size_words(self.budget_bytes)}: pending (attention at fused's bytes; {when})"
        return self._decided_note

    def _words(self, loaded: str = "") -> str:
        d = self.decided
        head = f"; memory_budget {size_words(d.budget_bytes)}{loaded}: peak {size_words(d.peak_bytes)}"
        if d.headroom_bytes < 0:
            return (f"{head} is {size_words(-d.headroom_bytes)} OVER the budget; attention kept at fused's bytes; "
                    f"to fit: {_fixes(self._mp.events)}")
        return (f"{head}, headroom {size_words(d.headroom_bytes)}; attention may save +{d.allowed_mib:.4g} MiB per call "
                f"over fused ({SHARE:g} of the headroom over {d.calls} calls a step): {self._chosen_words(d)}")

    def scope(self) -> AbstractContextManager[None]:
        """The engine's allowance in this thread (nothing without a budget); starts the measured step when due
        (the second training step: after one boundary, grad enabled, an optimizer attached; deferred while the
        meter is :func:`~mixprec.memory.live.blocked`). Nothing while torch.compile traces (the graph keeps the
        kernels it traced)."""
        if not self.on or torch.compiler.is_compiling():
            return nullcontext()
        if (self.decided is None and self._meter is None and not self._step_began and self._boundaries >= 1
                and self._mp.optimizer is not None and torch.is_grad_enabled()):
            self._step_began = True   # a later scope of this step (its backward) never starts a partial window
            why = blocked(self._mp.device)
            if why is not None:
                self._defer(why)
                return scoped_allowance(self.allowed_mib)
            self._counter = CallCounter()
            self._meter = LiveMeter(self._mp.device, resident=list(resident_tensors(self._mp.module, self._mp.optimizer)),
                                    model=self._mp.module)
            self._counter.start()
            self._meter.start()
            # an engine dropped inside the window (an exception, a `del mp`) must not leave the profiler recording
            self._abandoned = weakref.finalize(self, _stop_meter, self._meter, self._counter)
        return self._window(scoped_allowance(self.allowed_mib)) if self._meter is not None else \
            scoped_allowance(self.allowed_mib)

    @contextmanager
    def _window(self, allowance: AbstractContextManager[None]):
        """``allowance`` inside the measured window: an exception leaving it ends the window unread (the step is
        measured again at the next one), so a failed step kept alive by its traceback cannot leave the profiler
        recording for the rest of the process."""
        try:
            with allowance:
                yield
        except BaseException:
            self._stop()
            self._step_began = False
            raise

    def _defer(self, why: str) -> None:
        """The measured step waits: recorded once (a ``"memory-budget"`` event, cause ``deferred``, and the pending
        clause), at the first step it waits for each reason."""
        if self._deferred.endswith(f": {why}"):
            return
        before = self.note
        self._deferred = f"at step {self._mp.boundaries}: {why}"
        self._mp.record(Event(self._mp.boundaries, _KIND, "deferred", None, self.note[2:]),
                        decision=_replace(self._mp.decision, before, self.note))
        log.info("mixprec: %s", self.note[2:])

    def at_boundary(self, mp: Engine) -> None:
        """After a step: the measured step's decision (module docstring), recorded as an event and in the decision."""
        self._boundaries += 1
        self._step_began = False
        if self._meter is None:
            return
        meter, counter, self._meter, self._counter = self._meter, self._counter, None, None
        self._abandoned.detach()
        counter.stop()
        try:
            live = meter.stop()
        except RuntimeError as err:   # a profiler session opened inside the window: measured again at a later step
            self._defer(str(err))
            return
        self._counts = dict(counter.counts)
        calls = sum(self._counts.values())
        headroom = self.budget_bytes - live.total
        allowed = headroom * SHARE / calls / 2**20 if headroom >= 0 and calls else 0.0
        before = self.note
        self.decided = BudgetDecision(self.budget_bytes, live.total, calls, allowed, self._mp.boundaries)
        self._decided_note = self._words()
        over = self.decided.headroom_bytes < 0
        detail = (f"{self.note[2:]}; measured: {live.source}; per key: {self._key_words()} "
                  f"{self.decided.numbers()}")
        if over:
            warnings.warn(f"mixprec: {self.note[2:]}", RuntimeWarning, stacklevel=user_stacklevel())
        self._mp.record(Event(self._mp.boundaries, _KIND, "over" if over else "measured", None, detail),
                        decision=_replace(self._mp.decision, before, self.note))
        log.info("mixprec: %s", detail)

    def state(self) -> dict[str, Any] | None:
        """The decision as ``mp.state_dict()`` carries it (None until decided)."""
        return None if self.decided is None else self.decided.as_dict()

    def load(self, state: dict[str, Any]) -> None:
        """Re-apply the decision of a loaded state (its ``"memory_budget"``, else the last ``"memory-budget"``
        event of its ``"events"``, a checkpoint's), as it was: never measured again. Nothing to do without one."""
        saved = _saved(state)
        if saved is None or saved == self.decided:
            return
        before = self.note
        self._stop()
        own = self.budget_bytes
        self.decided, self.budget_bytes = saved, saved.budget_bytes
        self._counts = {}
        self._decided_note = self._words(" (loaded" + ("" if own in (None, saved.budget_bytes) else
                                                        f"; this engine's own {size_words(own)} not used") + ")")
        self._mp.record(Event(self._mp.boundaries, _KIND, "loaded", None, f"{self.note[2:]} {saved.numbers()}"),
                        decision=_replace(self._mp.decision, before, self.note))

    def remove(self) -> None:
        """Stop a measurement in progress (``mp.unwrap()``)."""
        self._stop()

    def _stop(self) -> None:
        if self._meter is not None:
            self._abandoned.detach()
            meter, counter, self._meter, self._counter = self._meter, self._counter, None, None
            _stop_meter(meter, counter)

    def _rechosen(self, allowed_mib: float) -> list[tuple[str, str, int | None]]:
        """(key, kernel now, extra bytes per call over fused) for each training key of the engine's plan."""
        out = []
        for e in entries(self._mp.device.type, policy=self._mp.policy):
            if e.shape in self._counts:
                now = rechosen(e, allowed_mib)
                saved = now.saved_bytes
                extra = None if saved.get(now.chosen) is None or saved.get(_DEFAULT) is None else \
                    saved[now.chosen] - saved[_DEFAULT]
                out.append((e.shape, now.chosen, 0 if now.chosen == _DEFAULT else extra))
        return out

    def _chosen_words(self, d: BudgetDecision) -> str:
        if not self._counts:
            return "re-applied at each key's next call"
        changed = [(k, c, x) for k, c, x in self._rechosen(d.allowed_mib) if c != _DEFAULT]
        if not changed:
            return "every training key stays fused"
        return ", ".join(f"{k} -> {c} ({mib_words(x, signed=True)} per call)" for k, c, x in changed)

    def _key_words(self) -> str:
        words, total = [], 0
        for key, chosen, extra in self._rechosen(self.allowed_mib):
            n = self._counts[key]
            step = None if extra is None else extra * n
            total += step or 0
            words.append(f"{key} -> {chosen} ({mib_words(extra, signed=True)} per call x {n} calls = "
                         f"{mib_words(step, signed=True)} per step)")
        return "; ".join(words) + f"; in all {mib_words(total, signed=True)} per step" if words else "no training key"


def _stop_meter(meter: LiveMeter, counter: CallCounter) -> None:
    """Stop a measured step's meter and counter, its result unread (``remove()``, or the engine collected inside
    the window: the finalizer holds these two, not the engine)."""
    counter.stop()
    try:
        meter.stop()
    except RuntimeError:   # its session was ended from outside: nothing of the meter's is left running
        pass


def _fixes(events: list) -> str:
    """The fixes an over-budget step can still take, from the recompute plan the engine runs (its last
    ``"recompute"`` event): without one, recompute; with blocks left selective or unrecomputed, full recompute of
    the repeated blocks; with every block full, only a smaller batch or a larger budget."""
    texts = [Event.of(e).detail for e in events if Event.of(e).kind == "recompute"]
    plan = None if not texts else RecomputePlan.from_text(texts[-1])
    if plan is None:
        return 'recompute="auto" (recompute blocks in backward), a smaller batch, or a larger budget'
    if not plan.blocks:
        return (f"a smaller batch or a larger budget (recompute={plan.request!r} found no repeated blocks; name "
                "the blocks to recompute, e.g. recompute=\"layers.*\")")
    partial = [b.name for b in plan.blocks if b.mode != "full"]
    if not partial:
        return (f"a smaller batch or a larger budget (recompute={plan.request!r} already recomputes every one of "
                f"its {len(plan.blocks)} blocks in full)")
    parents = {n.rpartition(".")[0] for n in partial}
    glob = f"{parents.pop()}.*" if len(parents) == 1 and "" not in parents else ",".join(partial)
    return (f"full recompute of the {len(partial)} of {len(plan.blocks)} blocks recompute={plan.request!r} leaves "
            f"selective or not recomputed (recompute={glob!r}), a smaller batch, or a larger budget")


def _saved(state: dict[str, Any]) -> BudgetDecision | None:
    saved = state.get("memory_budget")
    if saved:
        return BudgetDecision(**saved)
    event = next((e for e in reversed(state.get("events") or []) if e.get("kind") == _KIND), None)
    match = None if event is None else _NUMBERS.search(event.get("detail") or "")
    if match is None:
        return None
    budget, peak, calls, allowed = match.groups()
    return BudgetDecision(int(budget), int(peak), int(calls), float(allowed), int(event.get("step")))


def _replace(decision: str, clause: str, new: str) -> str:
    return decision.replace(clause, new) if clause and clause in decision else decision + new
