"""The interface every engine feature implements: the points of a training step at which it may act.

A feature is one concern the engine runs beside its own step (the loop checks, the fp32 gradient sums, a pending
``auto``, the recompute plan, the memory budget, the ranks' kernel agreement, the fp32 regions, the param-group
watch). ``MixedPrecision`` holds its features in one :class:`Features`, in a fixed order (docs/architecture.md
"Features"), which calls each at every point below in that order; a feature that does nothing at a point inherits
the no-op. So a new feature is a subclass and one entry in the built-in tuple (:mod:`mixprec.engine.construction`;
or, for a developer's own, in ``MixedPrecision.feature_types``: built as ``factory(mp)`` after the built-in ones);
the engine's phases are untouched. A warning a feature raises at any point points at the user's call into the
engine, however deep the feature raises it (:mod:`mixprec.messages.location`).

The points, in a step's order: :meth:`install` (the engine is built), :meth:`scope` (around every forward inside
``mp.autocast()`` and every ``mp.backward()``), :meth:`before_backward`, :meth:`after_backward`,
:meth:`at_boundary` (after the optimizer step, the gradients zeroed: before the guard), then :meth:`state` /
:meth:`check` / :meth:`load` (``mp.state_dict()`` under :attr:`key`, ``mp.load_state_dict()``,
``mp.restore_progress()``) and :meth:`remove` (``mp.unwrap()``). A feature holds the engine it needs weakly
(:class:`HeldEngine`) and changes it only through its public methods (``mp.record``, ``mp.set_policy``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from mixprec.engine.protocol import Engine

__all__ = ["Feature", "Features", "HeldEngine", "entered", "held_method"]


class HeldEngine:
    """A class attribute holding the engine of a collaborator the engine owns, weakly: ``self._mp = mp`` stores a
    ``weakref.ref``, ``self._mp`` returns the engine itself (ReferenceError once it is gone). A strong
    back-reference would put the engine in a reference cycle, so ``del mp`` would free nothing (the model, a DDP
    module and its reducer) until the cyclic garbage collector ran: on an accelerator its memory stays taken, and
    under DDP ``del mp`` before ``destroy_process_group()`` would not free the DDP module before the group (torch
    aborts an exit now and then when a DDP module outlives its gloo group: docs/distributed.md)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_held_{name}"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        engine = obj.__dict__[self._slot]()
        if engine is None:
            raise ReferenceError(f"{type(obj).__name__}: its MixedPrecision engine was deleted")
        return engine

    def __set__(self, obj: Any, engine: Engine) -> None:
        obj.__dict__[self._slot] = weakref.ref(engine)


def held_method(method: Callable[..., None]) -> Callable[..., None]:
    """A bound method held as :class:`HeldEngine` holds the engine (weakly): calling it calls the method, with the
    same arguments, while its object lives, and does nothing after (e.g. a hook the object's own collaborator
    holds)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)
    return call


class Feature:
    """A feature of the engine (module docstring); every method here does nothing. ``key``: the entry of
    ``mp.state_dict()`` that :meth:`state` fills (None: the feature saves nothing); ``note``: its clause of
    ``mp.decision`` ("" for none), read once the engine is built."""

    key: str | None = None
    note: str = ""

    def install(self, mp: Engine) -> None:
        """The engine is built (model prepared, optimizer attached if given): register hooks here."""

    def scope(self) -> AbstractContextManager[None]:
        """Entered around each forward inside ``mp.autocast()`` and each ``mp.backward()``."""
        return nullcontext()

    def before_backward(self, first: bool) -> None:
        """``mp.backward()`` starts a micro-batch's backward (``first``: the accumulation group's first)."""

    def after_backward(self) -> None:
        """``mp.backward()`` ended (gradients accumulated, masters' included)."""

    def at_boundary(self, mp: Engine) -> None:
        """A boundary ended (optimizer stepped or skipped, gradients zeroed), before the guard runs."""

    def state(self) -> Any:
        """What ``mp.state_dict()`` saves under :attr:`key` (references are fine: the caller copies)."""
        return None

    def check(self, state: dict[str, Any]) -> None:
        """Before ``mp.load_state_dict(state)`` changes anything: ValueError for a ``state`` this feature cannot
        continue."""

    def load(self, state: dict[str, Any]) -> None:
        """After the engine loaded ``state`` (a whole ``mp.state_dict()``, or ``{"events": [...]}`` from
        ``mp.restore_progress``): take this feature's part back."""

    def remove(self) -> None:
        """``mp.unwrap()``: remove every hook this feature installed."""


@dataclass(frozen=True)
class Features:
    """An engine's features, ``members``, in their call order: each method runs that point of the step on every
    member in turn (:meth:`scope`: their scopes entered in order). :attr:`note`: their clauses of ``mp.decision``."""

    members: tuple[Feature, ...]

    @property
    def note(self) -> str:
        return "".join(feature.note for feature in self.members)

    def install(self, mp: Engine) -> None:
        for feature in self.members:
            feature.install(mp)

    def scope(self) -> AbstractContextManager[None]:
        return entered(self.members)

    def before_backward(self, first: bool) -> None:
        for feature in self.members:
            feature.before_backward(first)

    def after_backward(self) -> None:
        for feature in self.members:
            feature.after_backward()

    def at_boundary(self, mp: Engine) -> None:
        for feature in self.members:
            feature.at_boundary(mp)

    def states(self) -> dict[str, Any]:
        """Each member's :meth:`~Feature.state` under its :attr:`~Feature.key` (those with one)."""
        return {feature.key: feature.state() for feature in self.members if feature.key is not None}

    def check(self, state: dict[str, Any]) -> None:
        for feature in self.members:
            feature.check(state)

    def load(self, state: dict[str, Any]) -> None:
        for feature in self.members:
            feature.load(state)

    def remove(self) -> None:
        for feature in self.members:
            feature.remove()


def entered(features: Sequence[Feature]) -> AbstractContextManager[None]:
    """Each of ``features``' :meth:`~Feature.scope` that is not the no-op, entered in order (exited in reverse); one
    such scope is returned as it is (torch.compile traces it without an ``ExitStack``)."""
    scoped = [feature for feature in features if type(feature).scope is not Feature.scope]
    return nullcontext() if not scoped else scoped[0].scope() if len(scoped) == 1 else _stacked(scoped)


@contextmanager
def _stacked(features: Sequence[Feature]) -> Iterator[None]:
    with ExitStack() as stack:
        for feature in features:
            stack.enter_context(feature.scope())
        yield
