"""The engine's features behind one interface (src/mixprec/engine/feature.py): a new feature is a subclass of
``Feature`` and, for a developer's own, one entry in ``MixedPrecision.feature_types``; the engine file is untouched.

The toy feature below counts what the engine calls it with, keeps a count in the engine's state and refuses a
state it cannot continue; each test drives a real engine (a two-layer MLP under bf16-mixed, SGD, two micro-batches
a step) and asserts the counts the step's lifecycle implies.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

import mixprec
from mixprec.engine.feature import Feature


class Toy(Feature):
    """Counts the points of the step; saves the boundaries it saw under ``"toy"``."""

    key = "toy"
    note = "; toy feature on"
    built: list[Toy] = []   # every toy built, to find an engine's

    def __init__(self, mp) -> None:
        self.mp, self.calls, self.boundaries, self.removed, self.depth = mp, [], 0, False, 0
        Toy.built.append(self)

    def install(self, mp) -> None:
        self.calls.append(("install", mp is self.mp))

    @contextmanager
    def scope(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def before_backward(self, first: bool) -> None:
        self.calls.append(("before_backward", first, self.depth))

    def after_backward(self) -> None:
        self.calls.append(("after_backward", self.mp.micro_step))

    def at_boundary(self, mp) -> None:
        self.boundaries += 1
        self.calls.append(("at_boundary", mp.boundaries, mp.micro_step))

    def state(self) -> int:
        return self.boundaries

    def check(self, state) -> None:
        if state.get("toy", 0) < 0:
            raise ValueError(f"toy: a negative count {state['toy']}")

    def load(self, state) -> None:
        if "toy" in state:
            self.boundaries = state["toy"]

    def remove(self) -> None:
        self.removed = True


class WithToy(mixprec.MixedPrecision):
    feature_types = (Toy,)


def _engine(cls=WithToy) -> mixprec.MixedPrecision:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return cls(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed", accumulation_steps=2)


def _micro_batch(mp, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    with mp.autocast():
        loss = mp.model(x).float().square().mean()
        assert _toy(mp).depth == 1   # entered around the forward inside mp.autocast()
    mp.backward(loss)
    mp.step()


def _toy(mp) -> Toy:
    (toy,) = [t for t in Toy.built if t.mp is mp]
    return toy


def test_a_toy_feature_is_called_at_every_point_of_the_step_in_order():
    mp = _engine()
    toy = _toy(mp)
    assert toy.calls == [("install", True)] and mp.decision.endswith("; toy feature on")
    for seed in range(4):   # two boundaries of two micro-batches
        _micro_batch(mp, seed)
    assert toy.calls[1:] == [
        ("before_backward", True, 0), ("after_backward", 1),
        ("before_backward", False, 0), ("after_backward", 2), ("at_boundary", 1, 0),
        ("before_backward", True, 0), ("after_backward", 1),
        ("before_backward", False, 0), ("after_backward", 2), ("at_boundary", 2, 0)]
    assert mp.applied_steps == 2


def test_a_toy_features_state_is_saved_checked_and_loaded_with_the_engines():
    mp = _engine()
    for seed in range(4):
        _micro_batch(mp, seed)
    state = mp.state_dict()
    assert state["toy"] == 2
    other = _engine()
    with pytest.raises(ValueError, match="negative count -1"):
        other.load_state_dict({**state, "toy": -1})
    assert other.applied_steps == 0   # refused before anything changed
    other.load_state_dict(state)
    assert _toy(other).boundaries == 2 and other.applied_steps == 2


def test_a_toy_feature_is_removed_with_the_engines_hooks_and_adds_nothing_to_the_plain_engine():
    mp = _engine()
    mp.unwrap()
    assert _toy(mp).removed
    plain = _engine(mixprec.MixedPrecision)
    assert not [t for t in Toy.built if t.mp is plain] and "toy" not in plain.state_dict()


def test_the_toy_feature_leaves_the_training_numbers_alone():
    """The same run with and without the feature: bit-equal weights."""
    a, b = _engine(), _engine(mixprec.MixedPrecision)
    for mp in (a, b):
        for seed in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
            with mp.autocast():
                loss = mp.model(x).float().square().mean()
            mp.backward(loss)
            mp.step()
    assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))
