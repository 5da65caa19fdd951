"""Gradient accumulation under 16-bit params without fp32 masters (bf16-kahan, -sr, -lean) sums the micro-batches
in fp32 and rounds once (src/mixprec/engine/grad_sums.py).

Before, autograd added each micro-batch's bf16 gradient into the bf16 ``.grad``: with micro-batch gradients 1 and
three of 2^-9 (each under half a bf16 ulp of 1, 2^-8) the window's gradient came out 1, where the fp32 sum
1 + 3·2^-9 rounds once to 1 + 2^-7. The values are exact in bf16 and fp32, so the test asserts them exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec

MICRO = [1.0, 2.0 ** -9, 2.0 ** -9, 2.0 ** -9]   # each micro-batch's gradient of the one weight (before the 1/4)
ONCE = torch.tensor(sum(MICRO) / 4, dtype=torch.float32).bfloat16()            # the fp32 sum, rounded once
IN_BF16 = torch.tensor(0.25, dtype=torch.bfloat16)                              # what bf16 sums gave


def _engine(policy: str, accumulation_steps: int) -> mixprec.MixedPrecision:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    optimizer = mixprec.optim.SGD(model.parameters(), lr=1.0)
    return mixprec.MixedPrecision(model, optimizer, policy, accumulation_steps=accumulation_steps)


def _window(mp: mixprec.MixedPrecision, values, *, join: bool) -> None:
    for value in values:
        with mp.autocast():
            loss = mp.model(torch.tensor([[value]])).float().sum()   # d loss / d w = value
        mp.backward(loss / len(MICRO), join=True) if join else mp.backward(loss)


@pytest.mark.parametrize("policy", ["bf16-kahan", "bf16-sr", "bf16-lean"])
@pytest.mark.parametrize("join", [False, True], ids=["accumulation_steps", "join"])
def test_a_windows_16_bit_gradients_are_summed_in_fp32_and_rounded_once(policy, join):
    assert ONCE.item() == 0.25 * (1 + 2.0 ** -7) and ONCE != IN_BF16   # the case: bf16 sums lose the three
    mp = _engine(policy, 1 if join else len(MICRO))
    _window(mp, MICRO, join=join)
    check = mp.unscale_and_check()
    (grad,) = check.grads
    assert grad.dtype == torch.bfloat16 and grad.item() == ONCE.item()
    mp.apply_or_skip(check)
    assert [e.kind for e in mp.events].count("accumulation") == 1
    assert "summed in fp32, rounded once" in next(e.detail for e in mp.events if e.kind == "accumulation")


def test_one_micro_batch_windows_keep_autograds_gradient_and_say_nothing():
    mp = _engine("bf16-kahan", 1)
    _window(mp, [2.0 ** -9], join=False)
    (grad,) = mp.unscale_and_check().grads
    assert grad.item() == 2.0 ** -9 and not [e for e in mp.events if e.kind == "accumulation"]


def test_a_window_saved_open_resumes_with_its_fp32_sums_bit_for_bit():
    """state_dict() after two of four micro-batches holds the fp32 sum of the first (the second is in .grad); a new
    engine loading it and taking the last two gives the uninterrupted window's gradient, 1 + 2^-7 (over 4)."""
    whole = _engine("bf16-kahan", len(MICRO))
    _window(whole, MICRO, join=False)
    (want,) = whole.unscale_and_check().grads
    first = _engine("bf16-kahan", len(MICRO))
    _window(first, MICRO[:2], join=False)
    state = first.state_dict()
    assert set(state["open_group"]["grad_sums"]) == {"weight"}
    assert state["open_group"]["grad_sums"]["weight"].dtype == torch.float32
    resumed = _engine("bf16-kahan", len(MICRO))
    resumed.load_state_dict(state)
    _window(resumed, MICRO[2:], join=False)
    (got,) = resumed.unscale_and_check().grads
    assert torch.equal(got, want) and got.item() == ONCE.item()


def test_discarding_a_window_drops_its_sums():
    mp = _engine("bf16-kahan", len(MICRO))
    _window(mp, MICRO[:3], join=False)
    mp.discard_gradients()
    _window(mp, [2.0 ** -9] * 4, join=False)
    (grad,) = mp.unscale_and_check().grads
    assert grad.item() == 2.0 ** -9   # four micro-batches of 2^-9, over 4: the discarded 1 is not in it


def _ddp_window_rank(rank: int, out, policy: str) -> tuple[float, list[bool]]:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    mp = mixprec.MixedPrecision(model, mixprec.optim.SGD(model.parameters(), lr=1.0), policy, device="cpu",
                                accumulation_steps=len(MICRO), strategy="ddp")
    reduces = []   # DDP's flag at each micro-batch's forward (what no_sync clears)
    for value in MICRO:   # the same micro-batches on both ranks: their mean is each one
        reduces.append(bool(mp.model.require_backward_grad_sync))
        _window(mp, [value], join=False)
        if len(reduces) < len(MICRO):
            assert mp.step() is None   # inside the window
    (grad,) = mp.unscale_and_check().grads
    return grad.item(), reduces


@pytest.mark.parametrize("policy, reduces", [("bf16-kahan", [True] * 4), ("bf16-mixed", [False] * 3 + [True])])
def test_under_the_engines_ddp_each_micro_batch_is_reduced_then_summed_in_fp32(tmp_path, policy, reduces):
    """strategy="ddp" skipped the reduction of a window's earlier micro-batches (DDP's no_sync) and summed them in
    bf16 locally; with the sums on it reduces every micro-batch (in fp32, rounded into the bf16 bucket) and sums
    those in fp32, giving the one-process value exactly on 2 gloo ranks. fp32 params (bf16-mixed) reduce at the
    window's last micro-batch only, as before."""
    from ranks import run_ranks

    want = ONCE.item() if policy == "bf16-kahan" else sum(MICRO) / 4
    assert run_ranks(_ddp_window_rank, tmp_path, policy) == [(want, reduces)] * 2



def test_a_group_ended_early_is_the_mean_of_its_micro_batches_within_one_bf16_ulp():
    """k=3 of N=4 micro-batches, mp.step(end_group=True), gradients 1 and two of 3*2^-10 (over 4: each 0.375 ulp of
    the running bf16 sum 0.25, so bf16 sums drop both). The fp32 sum 0.25 + 0.75*2^-9 rounds to 129*2^-9, then the
    N/k = 4/3 scale rounds again in bf16 (documented): 172*2^-9, within 1 ulp (2^-9 on [0.25, 0.5)) of the fp32
    mean; bf16 sums gave 171*2^-9."""
    micro = [1.0, 3 * 2.0 ** -10, 3 * 2.0 ** -10]
    mp = _engine("bf16-kahan", len(MICRO))
    _window(mp, micro, join=False)
    (grad,) = mp.unscale_and_check(end_group=True).grads
    mean = sum(micro) / 3
    assert grad.dtype == torch.bfloat16 and grad.item() == 172 * 2.0 ** -9 and abs(grad.item() - mean) <= 2.0 ** -9
    assert round(0.25 * 4 / 3 / 2.0 ** -9) == 171   # what autograd's bf16 sums gave
