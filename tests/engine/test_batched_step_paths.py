"""The step's batched paths give bit for bit what the per-tensor code they replace gave.

``MasterWeights.accumulate_grads`` adds 16-bit gradients into existing fp32 master gradients with one
``_foreach_add_``; ``LossScale.unscale_`` and ``clip_`` group gradients with
:func:`mixprec.engine.gradients.grouped_values` (groups on the scale's device share one found-inf flag);
``global_norm_fp32`` skips the value views for plain dense gradients; the loop checks cache their tensor
list. Each is compared here with the per-tensor reference, on mixed dtypes, sparse and complex tensors.
"""

import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.engine.clipping import clip_, global_norm_fp32
from mixprec.engine.gradients import grouped_values, plain, summed_values, value_views
from mixprec.engine.loss_scale import DynamicLossScale
from mixprec.engine.masters import MasterWeights

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _reference_accumulate(pairs):
    for p, m in pairs:
        if p.grad is None:
            continue
        grad_fp32 = p.grad.to(FP32)
        if m.grad is None:
            m.grad = grad_fp32
        elif m.grad.is_sparse:
            m.grad = grad_fp32.add_(m.grad) if not grad_fp32.is_sparse else m.grad + grad_fp32
        else:
            m.grad.add_(grad_fp32)
        p.grad = None


def _sparse(shape, dtype):
    idx = torch.tensor([[0, 1, 1, 2]])
    return torch.sparse_coo_tensor(idx, torch.randn(4, *shape[1:]), shape).to(dtype)


def _setup(seed):
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(5, 3)) for _ in range(5)]
    masters = MasterWeights(params, {id(p) for p in params})
    for p in params:
        p.data = p.data.to(BF16)
    first = [torch.randn(5, 3), torch.randn(5, 3), None, _sparse((5, 3), FP32), _sparse((5, 3), FP32)]
    second = [torch.randn(5, 3).to(BF16) * 1e-3, None, torch.randn(5, 3).to(BF16), _sparse((5, 3), BF16),
              torch.randn(5, 3).to(BF16)]
    for (p, m), g in zip(masters.pairs, first):
        m.grad = g
    for p, g in zip(params, second):
        p.grad = g
    return masters


def test_accumulate_grads_matches_the_per_pair_reference_bitwise():
    ours, ref = _setup(0), _setup(0)
    ours.accumulate_grads()
    _reference_accumulate(ref.pairs)
    for (p, m), (rp, rm) in zip(ours.pairs, ref.pairs):
        assert p.grad is None and rp.grad is None
        assert (m.grad is None) == (rm.grad is None)
        if m.grad is not None:
            assert m.grad.is_sparse == rm.grad.is_sparse and m.grad.dtype == FP32
            a, b = (m.grad.to_dense(), rm.grad.to_dense()) if m.grad.is_sparse else (m.grad, rm.grad)
            assert torch.equal(a, b)


def _grads():
    torch.manual_seed(1)
    return [torch.randn(7) * 300, torch.randn(3, 4).to(BF16), torch.randn(6).to(FP16), torch.randn(2, dtype=torch.float64),
            torch.randn(4, dtype=torch.complex64), _sparse((5, 2), FP32), torch.randn(9)]


def _reference_unscale(grads, scale):
    inv = torch.tensor(scale).reciprocal()
    found = torch.zeros(())
    for g in grads:
        v = value_views(g)
        f = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([v], f, inv)
        found = torch.maximum(found, f)
    return found


def test_unscale_matches_per_tensor_unscaling_and_shares_one_flag_on_one_device():
    for poison in (None, 0, 1, 5):
        ours, ref = _grads(), _grads()
        if poison is not None:
            for gs in (ours, ref):
                value_views(gs[poison]).view(-1)[0] = float("inf")
        found = DynamicLossScale(init_scale=2.0**10).unscale_([*ours, None])
        want = _reference_unscale(ref, 2.0**10)
        assert found.dtype == FP32 and found.shape == () and torch.equal(found, want)
        for a, b in zip(ours, ref):
            assert torch.equal(summed_values(a), summed_values(b))


def test_grouping_and_plain():
    grads = _grads()
    groups = grouped_values([None, *grads])
    assert [k[1] for k in groups] == [FP32, BF16, FP16, torch.float64]
    assert len(groups[(torch.device("cpu"), FP32)]) == 4   # two dense, the complex view, the sparse values
    assert not plain(grads) and plain([g for g in grads if not (g.is_sparse or g.is_complex())])


def test_norm_and_clip_match_torch_on_plain_grads_bitwise():
    torch.manual_seed(2)
    grads = [torch.randn(s) * 10 for s in (3, 40, 7, 1)]
    copies = [g.clone() for g in grads]
    norm = global_norm_fp32(grads, torch.device("cpu"))
    params = [nn.Parameter(torch.zeros_like(g)) for g in copies]
    for p, g in zip(params, copies):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert torch.equal(norm, want)
    clip_(grads, norm, 1.0)
    for g, p in zip(grads, params):
        assert torch.equal(g, p.grad)


def test_loop_checks_see_an_optimizer_param_swapped_in_place():
    """The cached tensor list follows a param group edited in place (same list, another tensor)."""
    torch.manual_seed(3)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision(model, opt, "fp32")
    checks = mp._checks
    first = checks._tensors()
    extra = nn.Parameter(torch.zeros(3))
    opt.param_groups[0]["params"].append(extra)
    assert any(t is extra for t in checks._tensors()) and not any(t is extra for t in first)
    opt.param_groups[0]["params"].pop()
    assert [id(t) for t in checks._tensors()] == [id(t) for t in first]


def test_discard_gradients_clears_every_model_grad_with_and_without_registrations_since():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[1].weight.requires_grad_(False)
    mp = MixedPrecision(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), "bf16-pure")
    for registered_elsewhere in (False, True):
        if registered_elsewhere:
            nn.Linear(2, 2)   # a registration anywhere: the model is walked again
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        mp.discard_gradients()
        assert all(p.grad is None for p in model.parameters())
        assert all(m.grad is None for _, m in mp.masters.pairs)
