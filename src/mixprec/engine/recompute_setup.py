"""The engine's ``recompute=`` option: which blocks recompute in backward (:mod:`mixprec.memory.recompute`).

``recompute="blocks.*"`` (names or globs, ``"selective:..."`` to keep matmul outputs) wraps those blocks at
build; ``"auto"`` wraps the repeated blocks pending and measures each at its first training call (running it
``"full"``, the mode keeping least, until the plan is chosen); when the last one is measured it chooses every
block's mode jointly (:func:`~mixprec.memory.recompute.choose_modes`: the fewest bytes at the step's peak within
the time bound; every rank then takes, block by block, the most memory-saving mode any rank chose: one all-reduce
per block under a strategy, none alone; every rank records rank 0's measurements with those modes: one broadcast,
one plan text), applies it from the next call on and records the plan as a ``"recompute"`` event and in the
decision. A block that has not run in training by the first step boundary after measuring started (layerdrop) is
not measured: the plan is chosen there for the measured blocks, that one ``none`` (the decision names it). The plan
is in ``mp.state_dict()["recompute"]`` and in the event log a checkpoint carries; loading either re-applies it as it
was (never re-measured), the saved plan winning over the engine's own ``recompute=`` (a bit-exact resume): where
the two differ, a warning and a ``"recompute-replaced"`` event name both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from mixprec.messages.location import user_stacklevel
from mixprec.distributed.strategy import SingleProcess
from mixprec.engine.feature import Feature, HeldEngine
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event
from mixprec.memory.recompute import (BlockPlan, RecomputedForwards, RecomputePlan, choose_modes, match_blocks,
                                      measure_block, parse_request, repeated_blocks)

__all__ = ["RecomputeSetup"]

_KIND = "recompute"
_MOST_SAVING_FIRST = ("full", "selective", "none")


class RecomputeSetup(Feature):
    """Holds the request, the plan and the installed wrappers of one engine. ``note``: the decision clause (""
    when off). ValueError/TypeError for a bad ``recompute=`` value (nothing changed); ValueError for ``"auto"``
    where ``strategy`` cannot measure the blocks."""

    _mp = HeldEngine()   # weakly: the engine owns this

    key = "recompute"

    def __init__(self, mp: Engine, option: Any, strategy: SingleProcess,
                 rebuilds: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self._mp, self._strategy, self._rebuilds = mp, strategy, rebuilds   # rebuilds: the forward's saved rebuilds
        self.request = parse_request(option)
        self.plan: RecomputePlan | None = None
        self._measured: dict[str, tuple[tuple[int, int, int], tuple[float, float, float]]] = {}
        self._forwards: RecomputedForwards | None = None
        if self.request.kind == "named":
            modes = match_blocks(mp.module, self.request.patterns)
            self._install(RecomputePlan(self.request.text, tuple(BlockPlan(n, m) for n, m in modes.items())))
            mp.record(Event(0, _KIND, "requested", None, self.plan.text()))   # at build: boundary 0
        elif self.request.kind == "auto":
            self._names = repeated_blocks(mp.module)
            strategy.check_measured_recompute(mp.module, self._names)
            if self._names:
                self._forwards = RecomputedForwards(mp.module, dict.fromkeys(self._names, "pending"), self._measure)
            else:
                self.plan = RecomputePlan(self.request.text, (), self.request.max_ratio)

    @property
    def note(self) -> str:
        if self.plan is not None:
            return self.plan.note()
        if self.request.kind == "auto":
            return (f"; recompute {self.request.text}: pending, each of {len(self._names)} blocks measured at its "
                    "first training call (run full until the last is measured)")
        return ""

    def state(self) -> dict[str, Any] | None:
        """The plan as ``mp.state_dict()`` carries it (``{"text": ...}``), None when there is none yet."""
        return None if self.plan is None else {"text": self.plan.text()}

    def check(self, state: dict[str, Any]) -> None:
        """ValueError (nothing changed) when the plan ``state`` carries names modules this model lacks."""
        text = _saved_text(state)
        missing = [] if text is None else sorted(set(RecomputePlan.from_text(text).modes()) -
                                                 {n for n, _ in self._mp.module.named_modules()})
        if missing:
            raise ValueError(f"the loaded recompute plan names modules this model lacks: {missing}; load it into "
                             "the model it was saved from")

    def load(self, state: dict[str, Any]) -> None:
        """Re-apply the plan of a loaded state: its ``"recompute"`` entry, else the last ``"recompute"`` event of
        its ``"events"`` (a checkpoint's); nothing to do when it has neither or holds this plan already."""
        text = _saved_text(state)
        if text is None or (self.plan is not None and self.plan.text() == text):
            return
        self.check(state)
        plan, before = RecomputePlan.from_text(text), self.note
        replaced = self._replaced(plan)
        self._install(plan)
        if replaced:   # its own event kind: a "recompute" event's detail is the plan's text, parsed back on load
            warnings.warn(f"mixprec: {replaced}", stacklevel=user_stacklevel())
            self._mp.record(Event(self._mp.boundaries, "recompute-replaced", "loaded", None, replaced))
        self._mp.record(Event(self._mp.boundaries, _KIND, "loaded", None, plan.text()),
                        decision=_replace(self._mp.decision, before, self.note))

    def _replaced(self, plan: RecomputePlan) -> str:
        """Empty when the loaded ``plan`` is what this engine's ``recompute=`` asks for, else a sentence naming
        both."""
        asked = {"off": "None", "auto": repr(self.request.text), "named": repr(self.request.text)}[self.request.kind]
        same = (self.request.kind == "auto" and plan.request == self.request.text) or \
               (self.request.kind == "named" and self.plan is not None and self.plan.modes() == plan.modes())
        if same:
            return ""
        return (f"the loaded state's recompute plan {plan.request!r} ({plan.note().removeprefix('; ')}) replaces "
                f"this engine's recompute={asked}: a resume runs the plan it was saved with (bit-exact); to run "
                "another plan, load a state without its \"recompute\" entry and \"recompute\" events")

    def at_boundary(self, mp: Engine) -> None:
        """At a step boundary after ``"auto"``'s measuring started and before its plan: the plan is chosen for the
        blocks measured; the others (they did not run in training) run ``none``, unmeasured; recorded as when the
        last block is measured."""
        if self.plan is None and self.request.kind == "auto" and self._measured and self._forwards is not None:
            self._choose()

    def remove(self) -> None:
        if self._forwards is not None:
            self._forwards.remove()
            self._forwards = None

    def _install(self, plan: RecomputePlan) -> None:
        self.remove()
        self.plan = plan
        self._forwards = RecomputedForwards(self._mp.module, plan.modes())

    def _measure(self, name: str, forward: Any, args: tuple, kwargs: dict) -> str:
        """The mode block ``name`` runs in now: ``"full"`` until the last block is measured, then the plan's; with
        the engine deleted before the plan was chosen, ``"none"``, the blocks' own forwards back."""
        try:
            self._mp
        except ReferenceError:
            self.remove()
            return "none"
        if name not in self._measured:
            self._measured[name] = measure_block(forward, list(self._mp.module.parameters()), args, kwargs,
                                                 self._mp.device, saved_hooks=self._rebuilds)
        if len(self._measured) < len(self._names) or self.plan is not None:
            return "full"   # keeps the least until the plan is chosen (once chosen, no block is pending)
        self._choose()
        return self.plan.modes()[name]

    def _choose(self) -> None:
        """Chooses, agrees on, applies and records the plan of the measured blocks (the others ``none``)."""
        names = [n for n in self._names if n in self._measured]
        measured = [self._measured[n] for n in names]
        modes = choose_modes([saved for saved, _ in measured], [seconds for _, seconds in measured],
                             self.request.max_ratio)
        modes = [self._mp.agree_on(mode, _MOST_SAVING_FIRST) or mode for mode in modes]   # every rank one plan
        chosen = dict(zip(names, modes))
        before = self.note
        plan = RecomputePlan(self.request.text, tuple(BlockPlan(n, chosen[n], *self._measured[n]) if n in chosen
                                                      else BlockPlan(n, "none") for n in self._names),
                             self.request.max_ratio)
        self.plan = RecomputePlan.from_text(self._strategy.from_main_process(plan.text()))   # one plan, every rank
        self._forwards.settle(self.plan.modes())
        self._mp.record(Event(self._mp.boundaries, _KIND, "auto", None, self.plan.text()),
                        decision=_replace(self._mp.decision, before, self.note))


def _saved_text(state: dict[str, Any]) -> str | None:
    saved = state.get(_KIND)
    if saved:
        return saved["text"]
    return next((e.get("detail") for e in reversed(state.get("events") or []) if e.get("kind") == _KIND), None)


def _replace(decision: str, clause: str, new: str) -> str:
    return decision.replace(clause, new) if clause and clause in decision else decision + new

