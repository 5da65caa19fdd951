"""Compiled models under the engine (mixprec.regions, mixprec.compiled): inductor against eager.

Tolerances come from the formats' arithmetic, not from one machine's numbers. Inductor fuses
pointwise ops and keeps their fp32 intermediates where eager rounds each op's output to 16 bits, and
reorders reductions, so a compiled 16-bit run is not bitwise eager; fp32 runs differ by reduction
order only.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision

BF16, FP16, FP32 = (mixprec.get_format(f) for f in ("bf16", "fp16", "fp32"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean dynamo cache (no guard or recompile limit carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(mp, call, batches, loss_fn):
    """Eager-style loop through ``call`` (mp.model or a compiled wrapper); the fp32 losses, every step applied."""
    losses = []
    for batch in batches:
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = loss_fn(call, batch)
        mp.backward(loss)
        result = mp.step()
        assert result.applied, f"step {len(losses)} skipped: {result.skipped_reason}"
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _images(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (8,), generator=g)} for _ in range(n)]


def _cnn_loss(call, batch):
    return F.cross_entropy(call(batch["x"]).float(), batch["y"])


def test_user_compiled_cnn_with_batchnorm_regions_matches_eager_under_bf16_pure():
    """BatchNorm is an fp32 region under bf16-pure; torch.compile(mp.model) used to crash in its hooks."""
    batches = _images(20)
    eager_model = _cnn()
    eager = MixedPrecision(eager_model, mixprec.optim.AdamW(eager_model.parameters(), lr=1e-2), policy="bf16-pure",
                           device="cpu")
    eager_losses = _train(eager, eager.model, batches, _cnn_loss)
    model = _cnn()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    compiled_losses = _train(mp, torch.compile(mp.model), batches, _cnn_loss)
    # The loss is an fp32 mean of terms computed from bf16 activations; the two graphs round each
    # op's output differently by at most half a bf16 ulp (inductor keeps fused fp32 intermediates),
    # and the updates those differences make land on bf16 weights: allow two bf16 ulps of the loss.
    tolerance = 2 * BF16.ulp(eager_losses)
    assert ((compiled_losses - eager_losses).abs() <= tolerance).all(), (compiled_losses, eager_losses)
    assert compiled_losses[-1] < compiled_losses[0]   # it trains
    # the regions still pickle, deep-copy and come off without a trace
    x = mp.cast_inputs(batches[0])["x"]
    with mp.autocast():
        y = mp.model(x)
        for clone in (pickle.loads(pickle.dumps(mp.model)), copy.deepcopy(mp.model)):
            assert torch.equal(clone(x), y)
    assert mp.unwrap() is model and "forward" not in vars(model[1]) and not model[1]._forward_hooks
