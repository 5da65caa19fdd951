"""The numerics contract (issue 14), each case against an fp32/fp64 reference: an overflow-proof global
gradient norm, fp32 accumulation of embedding backward into 16-bit tables, and modules with no kernel
for the param dtype on the device kept fp32 at build. CPU, small, seeded."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.clipping import global_norm_fp32


class KeepGrads:
    """A guard that keeps clones of the step's (unscaled, clipped) gradients."""

    def __init__(self):
        self.grads = None

    def after_step(self, mp, result):
        self.grads = [g.detach().clone() for g in mp.step_gradients]
        return result


# ---------------------------------------------------------------- overflow-proof gradient norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_norm_of_finite_huge_grads_matches_fp64_where_the_plain_norm_is_inf(dtype):
    g = torch.Generator().manual_seed(3)
    grads = [(torch.randn(300, generator=g) * 1e30).to(dtype), torch.randn(7, 5, generator=g).to(dtype),
             torch.zeros(4, dtype=dtype), (torch.randn(50, generator=g) * 3e37).to(dtype)]
    ref = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in grads]))
    assert not torch.isfinite(global_norm_fp32(grads, torch.device("cpu")))          # today's plain norm: inf
    scaled = global_norm_fp32(grads, torch.device("cpu"), scaled=True)
    assert scaled.dtype == torch.float32 and math.isclose(float(scaled), float(ref), rel_tol=1e-5)


def test_scaled_norm_keeps_the_plain_bits_where_nothing_overflows_and_inf_stays_inf():
    grads = [torch.randn(100), torch.randn(3, 3).bfloat16(), torch.randn(5).half()]
    cpu = torch.device("cpu")
    assert torch.equal(global_norm_fp32(grads, cpu), global_norm_fp32(grads, cpu, scaled=True))
    bad = [torch.randn(10), torch.tensor([1.0, float("inf")])]
    assert global_norm_fp32(bad, cpu, scaled=True).isinf()
    nan = [torch.tensor([float("nan"), 1e30])]
    assert global_norm_fp32(nan, cpu, scaled=True).isnan()


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "bf16-pure"])
def test_clipping_finite_grads_near_1e30_keeps_the_fp64_direction_and_norm(policy):
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    ref = nn.Linear(64, 8).double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(16, 64)
    big = 1e30
    loss_of = lambda out: out.float().square().mean() * big    # noqa: E731  grads ~1e30 per element
    (ref(x.double()).square().mean() * big).backward()
    g64 = torch.cat([p.grad.flatten() for p in ref.parameters()])                 # fp64 reference gradient
    guard = KeepGrads()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu",
                        max_grad_norm=1.0, guard=guard)
    with mp.autocast():
        loss = loss_of(mp.model(mp.cast_inputs(x)))
    mp.backward(loss)
    result = mp.step()
    assert result.applied and math.isfinite(result.grad_norm)
    tol = 1e-5 if policy == "fp32" else 5e-2                                     # bf16 compute: ~2^-8 per product
    assert math.isclose(result.grad_norm, float(g64.norm()), rel_tol=tol)       # ~1e31, where the plain norm is inf
    clipped = torch.cat([g.double().flatten() for g in guard.grads])
    assert math.isclose(float(clipped.norm()), 1.0, rel_tol=1e-5)               # clipped to max_grad_norm, not to 0
    cos = float(clipped @ g64 / (clipped.norm() * g64.norm()))
    assert cos > 1 - (1e-6 if policy == "fp32" else 1e-3)                        # the fp64 gradient's direction
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed"])
def test_a_genuinely_inf_gradient_still_skips(policy):
    model = nn.Linear(4, 2)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu",
                        max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.register_hook(lambda g: g + float("inf"))
    with mp.autocast():
        loss = mp.model(mp.cast_inputs(torch.randn(3, 4))).float().sum() * 1e30
    mp.backward(loss)
    result = mp.step()
    assert not result.applied and result.skipped_reason == "nonfinite" and not math.isfinite(result.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
