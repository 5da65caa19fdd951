"""Parameters that are not plain dense real tensors: sparse gradients, complex params, parametrizations.

Each trains through the public API under every preset and lands within the format's rounding of a
plain-torch fp32 reference. Tolerances come from the formats (:func:`_tolerance`); each test also checks
that training moved the weights by far more than the tolerance, so "did not train" cannot pass.
fp16 cases use tiny tensors (fp16 matmuls are slow on some CPUs).

Every preset runs with its own loss scaling. fp16's dynamic scale starts at 2**16, so each loss is
multiplied by ``LOSS_FACTOR = 2**-6`` (scaled gradients then fit fp16 from the first step: no skips)
and SGD's learning rate by ``2**6``: the same SGD trajectory, since powers of two scale exactly.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import mixprec
from mixprec import MixedPrecision
PRESETS = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr"]
STEPS = 4
LOSS_FACTOR = 2.0**-6
LR = 0.2 / LOSS_FACTOR      # SGD: lr x grad as with an unscaled loss and lr 0.2


def _mse(target=0.0):
    return lambda out: LOSS_FACTOR * (out.float() - target).pow(2).mean()


def _tolerance(policy: str, ref: torch.Tensor, init: torch.Tensor, steps: int = STEPS) -> float:
    """How far a weight trained under ``policy`` may sit from the fp32 reference ``ref`` (started at
    ``init``), in ulps of the compute format at ``scale = max|ref| + max|ref - init|``.

    A 16-bit stored weight is within half an ulp of its value (round to nearest), one ulp under stochastic
    rounding: 2 ulps cover that. Each step's update is computed from operands rounded to the format
    (relative error of half an ulp per rounding, a few roundings per chain), so each step adds about one
    ulp of the larger of the weight and its total movement: 1 ulp of ``scale`` per step. Measured
    (``STEPS=4``): at most 2 ulps (bf16-sr), 1 ulp or less elsewhere."""
    fmt = mixprec.get_format(mixprec.Policy.parse(policy).compute_dtype)
    ref, init = _real(ref), _real(init)
    scale = ref.abs().max() + (ref - init).abs().max()
    return float(fmt.ulp(scale.float())) * (2 + steps)


def _optimizer(policy: str, params, stock):
    """The stock torch optimizer ``stock(params)``, or mixprec.optim.SGD where the policy needs it."""
    if mixprec.Policy.parse(policy).rounding != "nearest":
        return mixprec.optim.SGD(params, lr=LR)
    return stock(params)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=LR)


def _train(model, policy, batches, stock=_sgd, loss_of=None, optimizer=None, **engine_kw):
    """``len(batches)`` engine steps; returns the engine."""
    loss_of = loss_of or _mse()
    optimizer = optimizer or _optimizer(policy, model.parameters(), stock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # the bf16/fp16 loss-scale notes and the like
        mp = MixedPrecision(model, optimizer, policy, device="cpu", **engine_kw)
    for x in batches:
        with mp.autocast():
            loss = loss_of(mp.model(mp.cast_inputs(x)))
        mp.backward(loss)
        mp.step()
    return mp


def _reference(model, batches, stock=_sgd, loss_of=None):
    """The same steps in plain fp32 torch; returns the model."""
    loss_of = loss_of or _mse()
    opt = stock(model.parameters())
    for x in batches:
        opt.zero_grad()
        loss_of(model(x)).backward()
        opt.step()
    return model


def _real(t):
    return torch.view_as_real(t.detach()) if t.is_complex() else t.detach()


def _assert_close_to_reference(mp, ref_model, policy, init, *, min_moved=2.0):
    """Every trained weight within :func:`_tolerance` of the reference, which moved each weight tensor
    by more than ``min_moved`` tolerances (so a step lost or not taken would fail)."""
    got = mp.trainable_state_dict()            # fp32 best values (masters, or params plus compensation)
    for name, ref in ref_model.named_parameters():
        tol = _tolerance(policy, ref, init[name])
        err = (_real(got[name]) - _real(ref)).abs().max().item()
        assert err <= tol, f"{policy}: {name} is {err:.3g} off the fp32 reference (tolerance {tol:.3g})"
        moved = (_real(ref) - _real(init[name])).abs().max().item()
        assert moved > min_moved * tol, f"{policy}: {name} moved only {moved:.3g} (tolerance {tol:.3g}): too little to test"


def _init_values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------- sparse gradients
class Bag(nn.Module):
    """A sparse embedding table feeding a tiny dense head."""

    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 4, sparse=sparse)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.emb.weight.mul_(0.1)      # rows of 0.1 move by many ulps in a few steps

    def forward(self, ids):
        return self.head(self.emb(ids).flatten(1))    # (B, 2, 4) -> (B, 8) -> (B, 1)


def _id_batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 12, (6, 2), generator=g) for _ in range(n)]   # repeated ids: duplicate sparse rows


# name: (the torch optimizer, its mixprec.optim equivalent for Kahan / SR policies, or None)
SPARSE_OPTIMIZERS = {
    "sgd": (_sgd, lambda ps: mixprec.optim.SGD(ps, lr=LR)),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
                     lambda ps: mixprec.optim.SGD(ps, lr=LR, momentum=0.9)),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1), None),
}


@pytest.mark.parametrize("policy", PRESETS)
@pytest.mark.parametrize("opt_name", sorted(SPARSE_OPTIMIZERS))
def test_sparse_embedding_trains_under_every_preset_like_the_dense_fp32_model(policy, opt_name):
    stock, own = SPARSE_OPTIMIZERS[opt_name]
    batches = _id_batches()
    ref_model = Bag(sparse=False)
    init = _init_values(ref_model)
    _reference(ref_model, batches, stock, loss_of=_mse(1.0))
    model = Bag(sparse=True)
    if mixprec.Policy.parse(policy).rounding != "nearest":
        if own is None:     # Kahan / SR rounding needs mixprec.optim, which has no Adagrad: refused by name
            with pytest.raises(ValueError, match=r"rounding='(kahan|stochastic)', which Adagrad cannot do; "
                                                 r"mixprec.optim has AdamW and SGD only, nothing with Adagrad's"):
                _train(model, policy, batches, optimizer=stock(model.parameters()), loss_of=_mse(1.0))
            return
        stock = own
    mp = _train(model, policy, batches, optimizer=stock(model.parameters()), loss_of=_mse(1.0))
    assert mp.skipped_total == 0
    _assert_close_to_reference(mp, ref_model, policy, init)
    assert "sparse gradients for emb.weight" in mp.decision


def test_sparse_grads_stay_sparse_and_fp32_on_the_masters():
    model = Bag(sparse=True)
    mp = _train(model, "bf16-pure", [])
    with mp.autocast():
        loss = _mse()(mp.model(mp.cast_inputs(_id_batches(1)[0])))
    mp.backward(loss)
    master = dict(zip([n for n, _ in model.named_parameters()], mp.master_parameters()))["emb.weight"]
    assert master.grad.is_sparse and master.grad.dtype == torch.float32
    assert model.emb.weight.dtype == torch.bfloat16 and model.emb.weight.grad is None
    assert "their fp32 masters get sparse fp32 gradients" in mp.decision


def test_sparse_adam_trains_a_sparse_only_model_under_bf16_pure():
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Embedding(12, 4), nn.Flatten())
    model = copy.deepcopy(ref_model)
    model[0].sparse = True
    batches = _id_batches()
    stock = lambda ps: torch.optim.SparseAdam(list(ps), lr=LR)   # noqa: E731
    init = _init_values(ref_model)
    # the reference: SparseAdam needs sparse grads, so the fp32 reference uses a sparse table too
    ref_model[0].sparse = True
    _reference(ref_model, batches, stock, loss_of=_mse(1.0))
    mp = _train(model, "bf16-pure", batches, stock, loss_of=_mse(1.0))
    assert mp.skipped_total == 0
    _assert_close_to_reference(mp, ref_model, "bf16-pure", init)


@pytest.mark.parametrize("policy", ["fp32", "fp16-mixed", "fp16-pure"])   # fp16: 8x finer than bf16, so
#                                                    the short clipped steps stand out of the rounding
def test_sparse_grads_are_clipped_by_the_norm_of_their_summed_values(policy):
    clip = 0.03 * LOSS_FACTOR
    batches = _id_batches()
    ref_model = Bag(sparse=False)
    init = _init_values(ref_model)
    opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    norms = []
    for x in batches:
        opt.zero_grad()
        _mse()(ref_model(x)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)))
        opt.step()
    assert min(norms) > 1.2 * clip   # every step clips
    model = Bag(sparse=True)
    mp = _train(model, policy, [], max_grad_norm=clip)
    got_norms = []
    for x in batches:
        with mp.autocast():
            loss = _mse()(mp.model(mp.cast_inputs(x)))
        mp.backward(loss)
        got_norms.append(mp.step().grad_norm)
    assert mp.skipped_total == 0
    fmt = mixprec.get_format(mixprec.Policy.parse(policy).compute_dtype)
    for ref_norm, got_norm in zip(norms, got_norms):
        assert abs(got_norm - ref_norm) <= 8 * fmt.eps * ref_norm
    _assert_close_to_reference(mp, ref_model, policy, init, min_moved=0.5)   # clipped steps are short: the
    #                                                                          norms above are the sharp check


def test_fp16_sparse_grad_whose_duplicate_rows_overflow_when_summed_is_an_overflow():
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([[40000.0], [40000.0]]), (3, 1))
    grad = grad.to(torch.float16)              # each value fits fp16; their sum (80000) does not
    assert not grad.is_coalesced()
    found_inf = mixprec.NoLossScale().unscale_([grad])
    assert found_inf.item() == 1.0
    fine = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.tensor([[40000.0], [40000.0]]), (3, 1))
    assert mixprec.NoLossScale().unscale_([fine.to(torch.float16)]).item() == 0.0


def test_unscale_multiplies_every_sparse_value_and_flags_a_non_finite_one():
    ls = mixprec.StaticLossScale(4.0)
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.tensor([[4.0], [8.0], [12.0]]), (3, 1))
    dense = torch.tensor([[4.0, 8.0]])
    assert ls.unscale_([grad, dense]).item() == 0.0
    assert grad.to_dense().flatten().tolist() == [4.0, 0.0, 2.0] and dense.tolist() == [[1.0, 2.0]]
    bad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([[float("nan")]]), (3, 1))
    assert ls.unscale_([bad]).item() == 1.0


@pytest.mark.parametrize("opt_cls", [mixprec.optim.SGD, mixprec.optim.AdamW])
def test_mixprec_optimizers_step_a_sparse_grad_as_its_dense_equivalent(opt_cls):
    dense_grad = torch.zeros(5, 3)
    dense_grad[1] = torch.tensor([1.0, -2.0, 3.0]) + torch.tensor([0.5, 0.5, 0.5])   # rows 1 twice, as sparse
    sparse_grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.5, 0.5]]),
                                          (5, 3))
    results = []
    for grad in (dense_grad, sparse_grad):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5, 3))
        opt = opt_cls([p], lr=0.01)
        for _ in range(3):
            p.grad = grad.clone()
            opt.step()
        results.append(p.detach())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


# ---------------------------------------------------------------------- complex parameters
class ComplexMix(nn.Module):
    """A complex64 weight (complex matmul of the complexified input) feeding a real head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(0.1 * torch.randn(4, 4, dtype=torch.complex64))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        z = x.to(torch.complex64) @ self.w           # (B, 4) complex
        return self.head(torch.view_as_real(z).flatten(1))    # (B, 4, 2) -> (B, 8) -> (B, 1)


def _float_batches(n=STEPS, scale=1.0):
    g = torch.Generator().manual_seed(2)
    return [scale * torch.randn(3, 4, generator=g) for _ in range(n)]


@pytest.mark.parametrize("policy", PRESETS)
def test_complex_param_trains_under_every_preset_like_torch_fp32(policy):
    batches = _float_batches()
    ref_model = ComplexMix()
    init = _init_values(ref_model)
    _reference(ref_model, batches, loss_of=_mse(1.0))
    model = ComplexMix()
    mp = _train(model, policy, batches, loss_of=_mse(1.0))
    assert mp.skipped_total == 0
    assert model.w.dtype == torch.complex64                    # kept as it is, under every policy
    assert any(m is model.w for m in mp.master_parameters())  # no master: it is its own
    assert "complex param(s) w kept as they are" in mp.decision
    _assert_close_to_reference(mp, ref_model, policy, init)


@pytest.mark.parametrize("opt_cls, torch_cls, kwargs", [
    (mixprec.optim.AdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (mixprec.optim.SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9, weight_decay=0.1)),
])
def test_mixprec_optimizers_step_complex64_bit_exactly_like_torch(opt_cls, torch_cls, kwargs):
    torch.manual_seed(0)
    start = torch.randn(3, 2, dtype=torch.complex64)
    grads = [torch.randn(3, 2, dtype=torch.complex64) for _ in range(3)]
    results = []
    for cls, extra in ((opt_cls, {}), (torch_cls, {"foreach": False})):
        p = nn.Parameter(start.clone())
        opt = cls([p], **kwargs, **extra)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach())
    assert torch.equal(results[0], results[1])


def test_complex_moments_stay_complex64_even_with_16_bit_state_dtype():
    p = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    opt = mixprec.optim.AdamW([p], lr=0.01, state_dtype=torch.bfloat16)
    p.grad = torch.randn(3, dtype=torch.complex64)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.complex64


@pytest.mark.parametrize("policy", ["fp32", "bf16-pure", "bf16-kahan"])
def test_complex_model_resumes_bit_exactly_from_a_checkpoint(policy, tmp_path):
    def engine(model):
        cls = mixprec.optim.AdamW if policy == "bf16-kahan" else torch.optim.AdamW
        return _train(model, policy, [], optimizer=cls(model.parameters(), lr=0.01))

    def step(mp, x):
        with mp.autocast():
            loss = _mse(1.0)(mp.model(mp.cast_inputs(x)))
        mp.backward(loss)
        mp.step()

    batches = _float_batches(3)
    straight = engine(ComplexMix())
    for x in batches[:2]:
        step(straight, x)
    mixprec.save_checkpoint(tmp_path, straight)
    resumed = engine(ComplexMix())
    mixprec.load_checkpoint(tmp_path, resumed)
    for mp in (straight, resumed):
        step(mp, batches[2])
    for (name, a), b in zip(straight.trainable_state_dict().items(), resumed.trainable_state_dict().values()):
        assert torch.equal(a, b), name


def test_complex_error_messages_do_not_call_complex64_16_bit():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(2, dtype=torch.complex128))
    with pytest.raises(ValueError, match=r"dtype torch.complex128 .* allowed param dtypes are \['float32', "
                                         r"'bfloat16', 'float16', 'complex64'\]; cast it"):
        mixprec.optim.AdamW([p])
    model = ComplexMix()
    model.w.data = model.w.data.to(torch.complex32)
    with pytest.raises(ValueError, match=r"parameter\(s\) \['w'\] are complex32 .* make them complex64"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=LR), "bf16-mixed", device="cpu")


# ---------------------------------------------------------------------- parametrizations
def _parametrized(kind):
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    layer = {"spectral_norm": parametrizations.spectral_norm, "orthogonal": parametrizations.orthogonal,
             "weight_norm": parametrizations.weight_norm}[kind](layer)
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 1))


@pytest.mark.parametrize("policy", PRESETS)
@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal", "weight_norm"])
def test_parametrized_layer_trains_under_every_preset_like_torch_fp32(kind, policy):
    batches = _float_batches()
    ref_model = _parametrized(kind)
    init = _init_values(ref_model)
    with torch.no_grad():    # read in eval mode: in training mode spectral_norm's read runs a power iteration
        init_weight = _parametrized(kind).eval()[0].weight.clone()
    _reference(ref_model, batches, loss_of=_mse(1.0))
    model = _parametrized(kind)
    mp = _train(model, policy, batches, loss_of=_mse(1.0))
    assert mp.skipped_total == 0
    plist = model[0].parametrizations.weight
    assert all(p.dtype == torch.float32 for p in plist.parameters())          # originals: their own fp32 masters
    assert all(b.dtype == torch.float32 for b in plist.buffers())             # _u, _v, base
    assert all(m is p for m, p in zip(mp.master_parameters(), model.parameters()) if any(m is q for q in plist.parameters()))
    assert "parametrization param(s) 0.parametrizations.weight.original" in mp.decision
    _assert_close_to_reference(mp, ref_model, policy, init)
    with torch.no_grad():    # the weight the layer computes with, also within rounding of the reference's
        weight, ref_weight = model.eval()[0].weight.float(), ref_model.eval()[0].weight
        tol = _tolerance(policy, ref_weight, init_weight)
        assert (weight - ref_weight).abs().max().item() <= tol


def test_parametrization_keeps_the_other_params_16_bit_under_pure():
    model = _parametrized("spectral_norm")
    _train(model, "bf16-pure", [])
    assert model[0].bias.dtype == model[2].weight.dtype == torch.bfloat16
    assert model[0].parametrizations.weight.original.dtype == torch.float32


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure"])
def test_frozen_params_stored_in_bf16_are_named_in_the_decision_with_what_is_lost(policy):
    """Frozen linears are stored in the compute dtype (autocast casts them anyway): the forward is unchanged, the
    fp32 low bits are gone. The decision said "params fp32" and nothing of them; it names them now, and a module
    kept in fp32 keeps its exact values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    w_fp32 = model[0].weight.detach().clone()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model[2].parameters()), policy, device="cpu")
    assert model[0].weight.dtype == torch.bfloat16 and torch.equal(model[0].weight.float(), w_fp32.bfloat16().float())
    assert "2 frozen param(s) stored in bfloat16, their fp32 low bits dropped (0.weight, 0.bias)" in mp.decision
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    mp = MixedPrecision(model, mixprec.optim.AdamW(model[2].parameters()), f"{policy},keep_fp32=0", device="cpu")
    assert torch.equal(model[0].weight, w_fp32) and "frozen param(s) stored in" not in mp.decision


def test_an_evaluation_outside_autocast_meeting_frozen_bf16_weights_is_told_why_it_fails_before_it_does():
    """bf16-mixed stores frozen linears in bf16; a plain no-grad evaluation outside mp.autocast() then fails in
    torch's matmul ("mat1 and mat2 must have the same dtype"), which names neither cause nor fix. A warning
    names both first; inside mp.autocast() the same evaluation runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    mp = MixedPrecision(model, mixprec.optim.AdamW(model[2].parameters()), "bf16-mixed", device="cpu")
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"float32 input outside mp.autocast\(\) while its 2 frozen parameter\(s\) "
                                         r"are stored in bfloat16 .*keep_fp32=<module>"):
        with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
            model(x)
    with torch.no_grad(), mp.autocast():
        assert model(x).shape == (4, 1)


def test_trainable_state_dict_takes_params_written_outside_the_engine_since_its_last_step():
    """A weight average or a best checkpoint written into the model after the last step (SWA, the HF Trainer's
    load_best_model_at_end) under bf16-pure: trainable_state_dict() returned the stale masters, the last step's
    weights, while state_dict() and unwrap() adopted the write. Now all three give the written values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), "bf16-pure", device="cpu")
    x = torch.randn(4, 8)
    for _ in range(2):
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    written = {n: torch.randn_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(written[n])
    with pytest.warns(UserWarning):   # the adoption is said
        exported = mp.trainable_state_dict()
    for n, w in written.items():
        assert torch.equal(exported[n], w.bfloat16().float()), n
