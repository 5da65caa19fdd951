"""The numerics contract (issue 14), each case against an fp32/fp64 reference: an overflow-proof global
gradient norm, fp32 accumulation of embedding backward into 16-bit tables, and modules with no kernel
for the param dtype on the device kept fp32 at build. CPU, small, seeded."""

import math

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.engine.clipping import global_norm_fp32


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


# ---------------------------------------------------------------- embedding backward summed in fp32
PURE = ["bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr"]


def _optimizer(model, policy):
    from mixprec.optim import SGD
    return torch.optim.SGD(model.parameters(), lr=0.0) if policy.endswith("pure") else SGD(model.parameters(), lr=0.0)


def _repeated_token_grads(dtype, n=10_000, width=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    idx = torch.zeros(n, dtype=torch.long)
    idx[::50] = torch.randint(1, 20, (n // 50,), generator=g)      # token 0 repeated 9,800 times, a few others
    grad_out = (torch.randn(n, width, generator=g) * 0.01 + 0.01).to(dtype)   # exact 16-bit terms, mostly positive
    ref = torch.zeros(20, width).index_add_(0, idx, grad_out.float())        # the fp32 sum
    return idx, grad_out, ref


@pytest.mark.parametrize("policy", PURE)
def test_repeated_token_embedding_grad_is_the_fp32_sum_rounded_once(policy):
    from mixprec import get_format
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 1))
    mp = MixedPrecision(model, _optimizer(model, policy), policy=policy, device="cpu")
    dtype = mp.policy.param_dtype
    assert "embedding backward sums repeated tokens in fp32" in mp.decision and "['0']" in mp.decision
    idx, grad_out, ref = _repeated_token_grads(dtype)
    fmt = get_format(dtype)

    plain = nn.Embedding(20, 8).to(dtype)                       # torch's own backward: sums in the 16-bit dtype
    plain(idx).backward(grad_out)
    far = (plain.weight.grad[0].float() - ref[0]).abs()
    assert (far > 8 * fmt.ulp(ref[0])).all()                    # today: far off (the sum stalls)

    with mp.autocast():
        out = mp.model[0](idx)
    assert out.dtype == dtype
    out.backward(grad_out)
    got = model[0].weight.grad
    assert got.dtype == dtype
    assert ((got.float() - ref).abs() <= fmt.ulp(ref)).all()      # the fp32 sum rounded once (≤ 1 ulp)


def test_engine_backward_gives_the_fp32_master_the_fp32_sum_under_bf16_pure():
    from mixprec import get_format
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 1))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="bf16-pure", device="cpu")
    idx, grad_out, ref = _repeated_token_grads(torch.bfloat16)
    with mp.autocast():
        loss = (mp.model[0](idx).float() * grad_out.float()).sum()
    mp.backward(loss)
    master_grad = mp.gradients()[0]
    assert master_grad.dtype == torch.float32 and master_grad.shape == (20, 8)
    assert ((master_grad - ref).abs() <= get_format("bf16").ulp(ref)).all()


def test_fp32_summed_embedding_matches_torch_for_padding_freq_scaling_and_max_norm():
    torch.manual_seed(0)
    for kwargs in ({"padding_idx": 3}, {"scale_grad_by_freq": True}, {"max_norm": 1.0}):
        model = nn.Sequential(nn.Embedding(10, 4, **kwargs), nn.Linear(4, 1))
        plain = nn.Embedding(10, 4, **kwargs).to(torch.bfloat16)     # torch's bf16 lookup (and renorm)
        plain.weight.data.copy_(model[0].weight.data)
        ref = nn.Embedding(10, 4, **{k: v for k, v in kwargs.items() if k != "max_norm"})   # fp32 gradient sum
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="bf16-pure", device="cpu")
        idx = torch.tensor([[1, 3, 3, 7], [7, 7, 0, 3]])
        grad_out = torch.randn(2, 4, 4).bfloat16()
        ref(idx).backward(grad_out.float())
        with mp.autocast():   # the same autocast (portable ops: max_norm's renorm computes its norms in fp32)
            out = mp.model[0](idx)
            expected = plain(idx)
        out.backward(grad_out)
        assert torch.equal(out, expected) and torch.equal(model[0].weight.detach(), plain.weight.detach())
        assert torch.equal(model[0].weight.grad, ref.weight.grad.bfloat16()), kwargs


def test_summed_embedding_pickles_is_removed_by_unwrap_and_sparse_embeddings_still_train():
    import copy
    import pickle
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-pure", device="cpu")
    assert "forward" in model[0].__dict__
    clone = pickle.loads(pickle.dumps(model))
    assert clone[0](torch.tensor([1, 2])).dtype == torch.bfloat16
    copy.deepcopy(model)
    mp.unwrap()
    assert "forward" not in model[0].__dict__

    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    mp = MixedPrecision(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1), policy="bf16-pure", device="cpu")
    assert "forward" not in sparse[0].__dict__ and "embedding backward sums" not in mp.decision
    before = sparse[0].weight.detach().clone()
    with mp.autocast():
        loss = mp.model(torch.tensor([1, 1, 2])).float().sum()
    mp.backward(loss)
    assert mp.step().applied and not torch.equal(before, sparse[0].weight)


@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-pure"])
def test_repeated_token_embedding_bag_grad_is_the_fp32_sum_rounded_once(policy):
    from mixprec import get_format
    model = nn.Sequential(nn.EmbeddingBag(20, 8, mode="sum"), nn.Linear(8, 1))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy=policy, device="cpu")
    dtype = mp.policy.param_dtype
    assert "rounded once to" in mp.decision and "['0']" in mp.decision
    idx, grad_out, ref = _repeated_token_grads(dtype, n=10_000)
    bags = idx.view(100, 100)                                   # 100 bags of 100 lookups, token 0 dominant
    grad_bags = grad_out[:100]                                  # one output gradient per bag
    ref = torch.zeros(20, 8).index_add_(0, idx, grad_bags.float().repeat_interleave(100, dim=0))
    plain = nn.EmbeddingBag(20, 8, mode="sum").to(dtype)
    plain(bags).backward(grad_bags)
    fmt = get_format(dtype)
    assert ((plain.weight.grad[0].float() - ref[0]).abs() > 8 * fmt.ulp(ref[0])).all()   # today: far off
    with mp.autocast():
        out = mp.model[0](bags)
    out.backward(grad_bags)
    assert ((model[0].weight.grad.float() - ref).abs() <= fmt.ulp(ref)).all()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_fp32_summed_embedding_bag_matches_torch_with_offsets_and_per_sample_weights(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(10, 4, mode=mode, padding_idx=2), nn.Linear(4, 1))
    ref = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=2)
    ref.weight.data = model[0].weight.data.bfloat16().float()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy="bf16-pure", device="cpu")
    idx, offsets = torch.tensor([1, 2, 4, 4, 9, 1, 3]), torch.tensor([0, 3, 5])
    psw = torch.rand(7).bfloat16().requires_grad_() if mode == "sum" else None
    psw_ref = None if psw is None else psw.detach().float().requires_grad_()
    grad_out = torch.randn(3, 4).bfloat16()
    ref(idx, offsets, psw_ref).backward(grad_out.float())
    with mp.autocast():
        out = mp.model[0](idx, offsets, psw)
    out.backward(grad_out)
    assert out.dtype == torch.bfloat16
    assert torch.equal(model[0].weight.grad, ref.weight.grad.bfloat16())
    if psw is not None:
        assert psw.grad.dtype == torch.bfloat16 and torch.equal(psw.grad, psw_ref.grad.bfloat16())


# ---------------------------------------------------------------- modules with no kernel for the dtype
class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.rnn = nn.LSTM(4, 4, batch_first=True)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])


def _train(mp, steps=4):
    results = []
    for _ in range(steps):
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(torch.randint(0, 10, (2, 3)))).float().square().mean()
        mp.backward(loss)
        results.append(mp.step())
    return results


def test_fp16_pure_lstm_with_no_fp16_kernel_is_kept_fp32_named_and_trains(monkeypatch):
    real = nn.LSTM.forward

    def no_fp16_kernel(self, input, hx=None):   # a CPU whose oneDNN has no fp16 LSTM primitive
        if input.dtype == torch.float16:
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        return real(self, input, hx)

    monkeypatch.setattr(nn.LSTM, "forward", no_fp16_kernel)
    model = Recurrent()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-pure", device="cpu")
    assert "rnn (LSTM) kept fp32: its kernel fails on cpu under params=float16" in mp.decision
    assert "could not create a primitive descriptor" in mp.decision
    assert all(p.dtype == torch.float32 for p in model.rnn.parameters()) and model.out.weight.dtype == torch.float16
    results = _train(mp)
    assert any(r.applied for r in results) and all(math.isfinite(r.grad_norm) or not r.applied for r in results)


@pytest.mark.parametrize("policy", ["fp16-pure", "fp16-mixed", "bf16-mixed"])
def test_an_lstm_trains_under_16bit_policies_on_this_cpu_and_the_probe_decides_what_is_kept(policy):
    from mixprec import Policy
    from mixprec.engine.regions import no_kernel_reason
    reason = no_kernel_reason(nn.LSTM(2, 2), Policy.parse(policy))      # fp16-mixed fails on this CPU's oneDNN
    model = Recurrent()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    assert ("rnn (LSTM) kept fp32" in mp.decision) == (reason is not None)
    assert any(r.applied for r in _train(mp))


def test_the_probe_leaves_the_rng_alone_and_skips_fp32_and_non_rnn_modules():
    from mixprec import Policy
    from mixprec.engine.regions import no_kernel_reason
    gru = nn.GRU(3, 3, bidirectional=True)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    no_kernel_reason(gru, Policy.parse("fp16-pure"))
    assert torch.equal(torch.rand(3), expected)
    assert no_kernel_reason(nn.LSTM(2, 2), Policy.parse("fp32")) is None
    assert no_kernel_reason(nn.Linear(2, 2), Policy.parse("fp16-pure")) is None
