"""What a new-user trial found in the recompute plan (issue 27, trial 11), each fixed kind with its test.

Every comparison is bit for bit against the same run without recompute (on the CPU every op here is deterministic;
recompute changes what is kept for backward, never a value): BatchNorm running statistics and
``num_batches_tracked`` after ``recompute="auto"``'s measuring and after whole-block or selective recompute, and a
buffer the block's output reads (the recompute must read what the forward read). A frozen block keeps nothing for
backward (autograd saves no tensor when nothing requires grad): auto's plan measures it 0 B in every mode.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import mixprec
import mixprec.optim
from mixprec import MixedPrecision
from mixprec.memory.recompute import RecomputePlan, match_blocks, parse_request
from mixprec.memory.saved import saved_bytes

D = 8


class BNBlock(nn.Module):
    """Linear, BatchNorm (running stats: forward side effects) and a buffer the output reads and the forward
    bumps (a recompute reading the bumped value would compute another output and other gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(D, D), nn.BatchNorm1d(D)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + torch.relu(self.bn(self.fc(x))) * (1 + self.calls)
        if self.training:
            with torch.no_grad():
                self.calls.add_(0.5)
        return out


class Net(nn.Module):
    def __init__(self, block: type = BNBlock, layers: int = 3, drop: int | None = None) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList([block() for _ in range(layers)])
        self.drop = drop   # layerdrop: this block never runs in training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if not (self.training and i == self.drop):
                h = b(h)
        return self.out(h)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _engine(checkpoint, model=None, **kwargs):
    torch.manual_seed(0)
    model = Net() if model is None else model
    return MixedPrecision(model, mixprec.optim.SGD(model.parameters(), lr=0.1), "fp32", device="cpu",
                          recompute=checkpoint, **kwargs)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 4, generator=torch.Generator().manual_seed(step))


def _train(mp, steps=3):
    grads = []
    for step in range(steps):
        with mp.autocast():
            loss = mp.model(_batch(step)).float().pow(2).mean()
        mp.backward(loss)
        grads.append([None if p.grad is None else p.grad.clone() for p in mp.module.parameters()])
        assert mp.step().applied
    return grads


def _plan(mp) -> RecomputePlan:
    return RecomputePlan.from_text([e for e in mp.events if e.get("kind") == "recompute"][-1].get("detail"))


# ------------------------------------------------------------------ 1. buffers: measuring and recompute
@pytest.mark.parametrize("checkpoint", ["auto", "auto:100", "blocks.*", "selective:blocks.*"])
def test_buffers_and_gradients_equal_the_run_without_recompute(checkpoint):
    """Fails on main: auto's ~30 measuring forwards each update BatchNorm (num_batches_tracked 36 for 3 steps) and
    a recompute updates it once more per step (6); the bumped buffer then changes the recomputed gradients."""
    ref, got = _engine(None), _engine(checkpoint)
    ref_grads, got_grads = _train(ref), _train(got)
    for want, have in zip(ref_grads, got_grads):
        for a, b in zip(want, have, strict=True):
            assert torch.equal(a, b)
    ref_buffers, got_buffers = dict(ref.module.named_buffers()), dict(got.module.named_buffers())
    assert ref_buffers["blocks.0.bn.num_batches_tracked"].item() == 3
    for name, buffer in ref_buffers.items():
        assert torch.equal(got_buffers[name], buffer), name
    if checkpoint.startswith("auto"):
        assert _plan(got).blocks[0].saved_bytes is not None   # measured


def test_named_recompute_really_recomputes():
    """The bit-exact runs above are not vacuous: with blocks.* the graph keeps less than without recompute."""
    sizes = []
    for checkpoint in (None, "blocks.*"):
        mp = _engine(checkpoint)
        with mp.autocast():
            _, saved = saved_bytes(lambda: mp.model(_batch(0)), exclude=list(mp.module.parameters()))
        sizes.append(saved.total)
    assert sizes[1] < sizes[0]


# ------------------------------------------------------------------ 2. double backward through selective
def test_double_backward_through_selective_names_checkpoint_the_block_and_the_fix():
    """Fails on main with torch's bare 'Trying to backward an extra time ... selective activation checkpoint'."""
    mp = _engine("selective:blocks.*", Net(Plain))
    x = _batch(0).requires_grad_(True)
    with mp.autocast():
        out = mp.model(x)
    (g,) = torch.autograd.grad(out.float().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"recompute: block 'blocks\.2' .*recompute='blocks\.\*'"):
        mp.backward(g.pow(2).sum())


def test_double_backward_through_whole_block_recompute_equals_no_recompute():
    results = []
    for checkpoint in (None, "blocks.*"):
        mp = _engine(checkpoint, Net(Plain))
        x = _batch(0).requires_grad_(True)
        with mp.autocast():
            out = mp.model(x)
        (g,) = torch.autograd.grad(out.float().sum(), x, create_graph=True)
        mp.backward(g.pow(2).sum() + out.float().mean())
        results.append([p.grad.clone() for p in mp.module.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ 3. frozen blocks
def test_frozen_blocks_keep_nothing_and_auto_leaves_them_none():
    """Fails on main: the measurement made the frozen blocks' input require grad, so they appeared to keep bytes
    and auto recomputed them (a plan whose saving was never real)."""
    torch.manual_seed(0)
    model = Net(Plain, layers=4)
    for module in (model.inp, model.blocks[0], model.blocks[1]):
        module.requires_grad_(False)
    mp = MixedPrecision(model, mixprec.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                        "fp32", device="cpu", recompute="auto:100")
    _train(mp, steps=1)
    blocks = {b.name: b for b in _plan(mp).blocks}
    for name in ("blocks.0", "blocks.1"):
        assert blocks[name].saved_bytes == (0, 0, 0) and blocks[name].mode == "none"
    assert blocks["blocks.2"].saved_bytes[0] > 0   # a trained block keeps its activations


# ------------------------------------------------------------------ 4. saved_bytes around the measuring step
def test_saved_bytes_on_the_measuring_step_counts_only_the_real_forward():
    """Fails on main: an outer saved_bytes counted every measuring pass (50 MiB vs 3.4 in the trial)."""
    mp = _engine("auto:100", Net(Plain))
    totals = []
    for step in range(2):
        with mp.autocast():
            loss, saved = saved_bytes(lambda: mp.model(_batch(0)).float().pow(2).mean(),
                                      exclude=list(mp.module.parameters()))
        mp.backward(loss)
        mp.step()
        totals.append(saved.total)
    assert totals[0] == totals[1]


# ------------------------------------------------------------------ 5. a block that never runs in training
def test_plan_completes_at_the_first_boundary_when_a_block_never_runs():
    """Fails on main: the decision stayed 'pending' and state_dict()["recompute"] None (a resume measured again)."""
    mp = _engine("auto:100", Net(Plain, layers=4, drop=2))
    _train(mp, steps=1)
    state = mp.state_dict()["recompute"]
    assert state is not None
    plan = RecomputePlan.from_text(state["text"])
    dropped = {b.name: b for b in plan.blocks}["blocks.2"]
    assert dropped.mode == "none" and dropped.saved_bytes is None
    assert "pending" not in mp.decision and "['blocks.2'] none, not measured" in mp.decision
    events = len(mp.events)
    mp.module.drop = None   # the block runs now: unmeasured, as the plan says, nothing re-planned
    _train(mp, steps=1)
    assert len(mp.events) == events and _plan(mp) == plan


# ------------------------------------------------------------------ 6. loading another plan; overlapping globs
def test_loading_a_saved_plan_over_an_explicit_request_warns_and_records_both():
    """Fails on main: the loaded plan replaced recompute='selective:blocks.*' (and turned a None engine's recompute
    on) silently."""
    saved = _engine("auto:100", Net(Plain))
    _train(saved, steps=1)
    state = saved.state_dict()
    for checkpoint, asked in (("selective:blocks.*", "'selective:blocks.*'"), (None, "None")):
        mp = _engine(checkpoint, Net(Plain))
        with pytest.warns(UserWarning, match=rf"plan 'auto:100.0' .*replaces this engine's recompute={asked}"):
            mp.load_state_dict(state)
        assert _plan(mp) == _plan(saved)   # the saved plan wins: a bit-exact resume
        assert [e for e in mp.events if e.get("kind") == "recompute-replaced"]


def test_loading_the_same_plan_does_not_warn(recwarn):
    saved = _engine("blocks.*", Net(Plain))
    state = saved.state_dict()
    _engine("blocks.*", Net(Plain)).load_state_dict(state)
    assert not [w for w in recwarn if "replaces" in str(w.message)]


def test_overlapping_globs_giving_one_module_two_modes_are_refused():
    """Fails on main: 'layers.*' silently overrode 'selective:layers.1' (blocks.1 ran full)."""
    model = Net(Plain)
    with pytest.raises(ValueError, match=r"'selective:blocks\.1' makes blocks\.1 selective and 'blocks\.\*' makes it full"):
        match_blocks(model, parse_request(["selective:blocks.1", "blocks.*"]).patterns)
    assert match_blocks(model, parse_request(["blocks.1", "blocks.*"]).patterns) == dict.fromkeys(
        ["blocks.0", "blocks.1", "blocks.2"], "full")


# ------------------------------------------------------------------ 7. messages
@pytest.mark.parametrize("value", ["Auto", "AUTO:1.5", "None", "Selective:blocks.*"])
def test_a_capitalised_word_asks_did_you_mean(value):
    """Fails on main: 'Auto' was taken as a module glob (and 'Selective:' refused without the hint)."""
    with pytest.raises(ValueError, match=rf"recompute={re.escape(repr(value))}: .*did you mean "
                                         rf"{re.escape(repr(value.lower()))}"):
        parse_request(value)


def test_cli_recompute_errors_name_the_flag(capsys, tmp_path):
    from mixprec.programs.cli import main

    assert main(["train", "--steps", "1", "--out", str(tmp_path / "a"), "--recompute", "auto:0.5"]) == 2
    err = capsys.readouterr().err
    assert "--recompute='auto:0.5'" in err and "checkpoint" not in err.split("error:")[1].split(";")[0]
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "b"), "--recompute", "blocks.*.x"]) == 2
    err = capsys.readouterr().err
    assert "--recompute 'blocks.*.x': 'blocks.*.x' matches no module" in err
