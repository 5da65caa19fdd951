"""The step's states in one table (src/mixprec/engine/step_state.py): every public call is refused, with the
table's message, in exactly the phases the table leaves out, on a real engine driven into each phase.

Phases are reached the way a loop reaches them (a two-layer MLP, SGD, bf16-mixed, accumulation_steps=2):
IDLE (built, or after a boundary), PENDING (after a backward), RETAINED (after backward(retain_graph=True)),
BETWEEN (after a step() inside the group), CHECKED (after unscale_and_check() at the boundary).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.engine.step_state import CALLS, Phase


def _engine() -> mixprec.MixedPrecision:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed",
                                  accumulation_steps=2)


def _loss(mp: mixprec.MixedPrecision) -> torch.Tensor:
    with mp.autocast():
        return mp.model(torch.randn(3, 4)).float().square().mean()


def _in(phase: Phase) -> mixprec.MixedPrecision:
    mp = _engine()
    if phase is Phase.IDLE:
        return mp
    if phase is Phase.RETAINED:
        mp.backward(_loss(mp), retain_graph=True)
        return mp
    mp.backward(_loss(mp))
    if phase is Phase.PENDING:
        return mp
    assert mp.step() is None   # BETWEEN: inside the group of two
    if phase is Phase.CHECKED:
        mp.backward(_loss(mp))
        mp.unscale_and_check()
    return mp


CALLERS = {
    "mp.backward()": lambda mp: mp.backward(_loss(mp)),
    "mp.step()": lambda mp: mp.step(),
    "mp.unscale_and_check()": lambda mp: mp.unscale_and_check(end_group=True),
    "mp.end_group_next()": lambda mp: mp.end_group_next(),
    "mp.state_dict()": lambda mp: mp.state_dict(),
    "set_policy()": lambda mp: mp.set_policy("bf16-mixed"),
    "restore_progress()": lambda mp: mp.restore_progress({"applied_steps": 0, "skipped_total": 0, "boundaries": 0},
                                                         None),
    "unwrap(to_fp32=True)": lambda mp: mp.unwrap(to_fp32=True),
}


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name)
@pytest.mark.parametrize("call", list(CALLERS))
def test_a_call_is_refused_with_the_tables_message_exactly_outside_its_phases(call, phase):
    mp = _in(phase)
    rule = CALLS[call]
    refusal = rule.refusal.format(call=call, n=mp.micro_step, what=rule.what)
    try:
        CALLERS[call](mp)
    except RuntimeError as err:   # another check may refuse inside an allowed phase (no backward to step, say)
        assert (str(err) == refusal) == (phase not in rule.phases), (call, phase, str(err))
    else:
        assert phase in rule.phases, f"{call} ran in {phase.name}, which the table refuses"


def test_the_table_names_every_phase_and_each_refusal_says_what_to_do():
    assert {phase for rule in CALLS.values() for phase in rule.phases} == set(Phase)
    assert all(rule.refusal for rule in CALLS.values() if rule.phases != frozenset(Phase))
    assert Phase.PENDING.awaits_step and Phase.RETAINED.awaits_step and not Phase.CHECKED.awaits_step


def test_an_evaluation_engine_and_an_unwrapped_one_refuse_the_training_calls_by_name():
    model = nn.Linear(4, 2)
    evaluation = mixprec.MixedPrecision(model, None, "bf16-mixed")
    with pytest.raises(RuntimeError, match=r"mp.backward\(\) on an evaluation engine .* mp.attach\(optimizer"):
        evaluation.backward(_loss(evaluation))
    with evaluation.autocast():   # evaluation runs
        evaluation.model(torch.randn(1, 4))
    mp = _engine()
    mp.unwrap()
    with pytest.raises(RuntimeError, match=r"mp.autocast\(\) after mp.unwrap\(\)"):
        with mp.autocast():
            pass


class _Fails(torch.autograd.Function):
    """Identity forward whose backward raises (an anomaly check, an OOM the loop catches)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_backward_that_raises_keeps_the_earlier_micro_batchs_pending_step():
    """accumulation_steps=3, the loop that backpropagates each micro-batch then steps once: the second backward
    raising inside autograd left the engine as if no backward awaited its step (step() then raised "without
    backward()"); the first micro-batch's backward still awaits it, as before the state table."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed", accumulation_steps=3)
    mp.backward(_loss(mp))
    with pytest.raises(RuntimeError, match="on purpose"):
        mp.backward(_Fails.apply(_loss(mp)))
    assert mp.step() is None and mp.micro_step == 2
    mp.backward(_loss(mp))
    assert mp.step() is not None and mp.applied_steps == 1


def test_a_plain_loss_backward_is_named_as_bypassing_the_engine():
    """``loss.backward()`` then ``mp.step()``: the refusal says the plain backward bypassed the engine and what to
    call instead (it said only 'without backward()', which the user had just called)."""
    mp = _engine()
    _loss(mp).backward()
    with pytest.raises(RuntimeError, match=r"step\(\) called without backward\(\) since the last step; call "
                                           r"mp\.backward\(loss\) first: a plain loss\.backward\(\) bypasses the "
                                           r"engine .* call mp\.backward\(loss\) instead of loss\.backward\(\)"):
        mp.step()
