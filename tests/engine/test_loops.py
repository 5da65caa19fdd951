"""The loops people write around the engine: several losses, several engines, gradient penalties, a model
edited after build, and the silent mistakes a loop makes (now loud).

References are hand-written torch loops with explicit ``zero_grad`` calls, the recipe torch.amp documents.
Under fp16 the engine runs a static power-of-two loss scale and the reference multiplies and divides by the
same power of two: both are exact in binary floating point, so the two loops make the same roundings and
agree bitwise.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision
POLICIES = ["fp32", "bf16-mixed", "fp16-mixed"]
SCALE = 256.0   # the fp16 runs' static loss scale (a power of two)


def _engine(model, policy, lr=0.05, **kw):
    scale = SCALE if policy.startswith("fp16") else None
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=lr), policy=policy, device="cpu",
                          loss_scale=scale, **kw)


def _autocast(policy):
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(policy)
    return torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)


def _hand_backward(loss, policy, **kw):
    """loss.backward() with the fp16 runs' static scale, then unscaled in place (exact: a power of two)."""
    scale = SCALE if policy.startswith("fp16") else 1.0
    (loss * scale).backward(**kw)
    return scale


def _hand_step(opt, scale):
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(1.0 / scale)
    opt.step()


def _mlp(n_in, n_out, seed, hidden=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out))


def _clone(model):
    import copy
    return copy.deepcopy(model)


def _params_equal(a, b):
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------- a GAN: two engines, no zero_grad calls
def _gan_data(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g) + 1.0, torch.randn(6, 4, generator=g)) for _ in range(n)]


def _gan_losses(G, D, real, z, which):
    if which == "d":
        fake = G(z)
        return F.softplus(-D(real).float()).mean() + F.softplus(D(fake.detach()).float()).mean()
    return F.softplus(-D(G(z)).float()).mean()


@pytest.mark.parametrize("policy", POLICIES)
def test_gan_with_two_engines_equals_a_hand_loop_with_zero_grads(policy):
    G0, D0 = _mlp(4, 3, seed=0), _mlp(3, 1, seed=1)
    G_ref, D_ref = _clone(G0), _clone(D0)
    mp_g, mp_d = _engine(G0, policy), _engine(D0, policy)
    opt_g, opt_d = torch.optim.SGD(G_ref.parameters(), lr=0.05), torch.optim.SGD(D_ref.parameters(), lr=0.05)
    caught = []
    for real, z in _gan_data(4):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with mp_d.autocast():
                d_loss = _gan_losses(mp_g.model, mp_d.model, real, z, "d")
            mp_d.backward(d_loss)
            assert mp_d.step().applied
            with mp_g.autocast():
                g_loss = _gan_losses(mp_g.model, mp_d.model, real, z, "g")
            mp_g.backward(g_loss)
            assert mp_g.step().applied
        caught += [str(x.message) for x in w if "were not produced by its backward" in str(x.message)]
        # the reference: explicit zero_grads, as torch's DCGAN example
        opt_d.zero_grad()
        with _autocast(policy):
            loss = _gan_losses(G_ref, D_ref, real, z, "d")
        _hand_step(opt_d, _hand_backward(loss, policy))
        opt_g.zero_grad()
        with _autocast(policy):
            loss = _gan_losses(G_ref, D_ref, real, z, "g")
        _hand_step(opt_g, _hand_backward(loss, policy))
        assert _params_equal(mp_d.module, D_ref) and _params_equal(mp_g.module, G_ref)
    assert len(caught) == 1   # said once
    assert [e["kind"] for e in mp_d.events] == ["foreign-gradients"] and mp_g.events == []


def test_gan_without_the_discard_trains_the_discriminator_on_the_generator_gradients():
    """The check can fail: keeping the generator's leftover gradients gives another discriminator."""
    G, D = _mlp(4, 3, seed=0), _mlp(3, 1, seed=1)
    opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=0.05), torch.optim.SGD(D.parameters(), lr=0.05)
    D_ref, G_ref = _clone(D), _clone(G)
    ref_d, ref_g = torch.optim.SGD(D_ref.parameters(), lr=0.05), torch.optim.SGD(G_ref.parameters(), lr=0.05)
    for real, z in _gan_data(3):
        for GG, DD, og, od, zero in ((G, D, opt_g, opt_d, False), (G_ref, D_ref, ref_g, ref_d, True)):
            if zero:
                od.zero_grad()
            _gan_losses(GG, DD, real, z, "d").backward()
            od.step()
            od.zero_grad() if not zero else None
            og.zero_grad()
            _gan_losses(GG, DD, real, z, "g").backward()
            og.step()
    assert not _params_equal(D, D_ref)


# ---------------------------------------------------------------- distillation: the student's loss reaches the teacher
@pytest.mark.parametrize("policy", POLICIES)
def test_co_distillation_with_two_engines_equals_a_hand_loop(policy):
    teacher0, student0 = _mlp(5, 4, seed=2), _mlp(5, 4, seed=3)
    t_ref, s_ref = _clone(teacher0), _clone(student0)
    mp_t, mp_s = _engine(teacher0, policy), _engine(student0, policy)
    opt_t, opt_s = torch.optim.SGD(t_ref.parameters(), lr=0.05), torch.optim.SGD(s_ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g)

        def losses(T, S):
            t_logits = T(x).float()   # not detached: the student's KL reaches the teacher
            kl = F.kl_div(F.log_softmax(S(x).float(), -1), F.log_softmax(t_logits, -1), log_target=True,
                          reduction="batchmean")
            return kl, F.cross_entropy(t_logits, y)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with mp_s.autocast():
                kl, _ = losses(mp_t.model, mp_s.model)
            mp_s.backward(kl)
            mp_s.step()
            with mp_t.autocast():
                _, ce = losses(mp_t.model, mp_s.model)
            mp_t.backward(ce)
            mp_t.step()
        opt_s.zero_grad()
        with _autocast(policy):
            kl, _ = losses(t_ref, s_ref)
        _hand_step(opt_s, _hand_backward(kl, policy))
        opt_t.zero_grad()
        with _autocast(policy):
            _, ce = losses(t_ref, s_ref)
        _hand_step(opt_t, _hand_backward(ce, policy))
        assert _params_equal(mp_t.module, t_ref) and _params_equal(mp_s.module, s_ref)


# ---------------------------------------------------------------- actor-critic: two losses through one graph
class _ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.trunk, self.actor, self.critic = nn.Linear(6, 16), nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.actor(h), self.critic(h)


def _ac_losses(model, obs, actions, returns):
    logits, value = model(obs)
    value = value.float().squeeze(-1)
    advantage = (returns - value).detach()
    logp = F.log_softmax(logits.float(), -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * advantage).mean(), F.mse_loss(value, returns)


@pytest.mark.parametrize("policy", POLICIES)
def test_actor_critic_two_backward_calls_make_one_micro_batch(policy):
    model = _ActorCritic()
    ref = _clone(model)
    mp = _engine(model, policy, accumulation_steps=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(6)
    for step in range(2):
        for micro in range(2):
            obs, returns = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
            actions = torch.randint(0, 3, (8,), generator=g)
            with mp.autocast():
                actor_loss, critic_loss = _ac_losses(mp.model, obs, actions, returns)
            mp.backward(actor_loss, retain_graph=True)
            mp.backward(critic_loss)
            result = mp.step()
            assert (result is None) == (micro == 0)
            with _autocast(policy):
                actor_loss_r, critic_loss_r = _ac_losses(ref, obs, actions, returns)
            scale = _hand_backward(actor_loss_r / 2, policy, retain_graph=True)
            _hand_backward(critic_loss_r / 2, policy)
        _hand_step(opt, scale)
        opt.zero_grad()
        assert result.applied and result.step == step + 1 and mp.boundaries == step + 1
        assert _params_equal(mp.module, ref)
        # the boundary loss: per micro-batch the sum of its losses, averaged over the micro-batches
        assert torch.isfinite(mp.boundary_loss)


def test_backward_inputs_restricts_which_parameters_get_gradients():
    model = _ActorCritic()
    mp = _engine(model, "bf16-pure")
    obs, returns = torch.randn(8, 6), torch.randn(8)
    with mp.autocast():
        actor_loss, _ = _ac_losses(mp.model, mp.cast_inputs(obs), torch.zeros(8, dtype=torch.long), returns)
    mp.backward(actor_loss, inputs=list(model.actor.parameters()))
    with pytest.warns(UserWarning, match="received no gradient"):
        assert mp.step().applied
    masters = dict(zip((n for n, _ in model.named_parameters()), mp.master_parameters()))
    # the critic and the trunk got no gradient, so their masters did not move; the actor's did
    assert mp.events[-1]["kind"] == "missing-gradients" and "trunk.weight" in mp.events[-1]["detail"]
    assert "actor.weight" not in mp.events[-1]["detail"]
    assert masters["actor.weight"].dtype == torch.float32


# ---------------------------------------------------------------- gradient penalties
class _Critic(nn.Module):
    """A critic whose input gradients are ~1e-7: below fp16's smallest normal (6.1e-5)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x).float() * 1e-7


def _penalty_grads(mp_or_none, model, x, *, scaled=True):
    """The input gradient dD/dx and WGAN-GP's penalty mean((|dD/dx| - 1)^2) built from it."""
    x = x.clone().requires_grad_(True)
    if mp_or_none is None:
        out = model(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    else:
        mp = mp_or_none
        with mp.autocast():
            out = mp.model(x)
        if scaled:
            (g,) = mp.unscale(torch.autograd.grad(mp.scale_loss(out.sum()), x, create_graph=True))
        else:
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = ((g.float().norm(dim=1) - 1.0) ** 2).mean()   # WGAN-GP (Gulrajani et al., 2017)
    return g.detach().float(), penalty


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_gradient_penalty_under_fp16_equals_fp32_within_one_percent():
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(8))
    ref = _Critic()
    g_ref, pen_ref = _penalty_grads(None, ref, x)
    pen_ref.backward()
    grads_ref = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None])   # not the last bias

    model = _Critic()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), policy="fp16-mixed", device="cpu")
    g, penalty = _penalty_grads(mp, model, x)
    assert _rel(g, g_ref) < 0.01
    mp.backward(penalty)
    scale = float(mp.loss_scale.scale)
    assert len(mp.gradients()) == 3
    grads = torch.cat([g.flatten() for g in mp.gradients()]) / scale
    assert _rel(grads, grads_ref) < 0.01
    with pytest.warns(UserWarning, match=r"received no gradient .*net.2.bias"):   # a penalty needs no bias
        assert mp.step().applied

    # without scale_loss/unscale the same input gradients underflow in fp16: the recipe is what fixes it
    model2 = _Critic()
    mp2 = MixedPrecision(model2, torch.optim.SGD(model2.parameters(), lr=1e-3), policy="fp16-mixed", device="cpu")
    g_unscaled, _ = _penalty_grads(mp2, model2, x, scaled=False)
    assert _rel(g_unscaled, g_ref) > 0.05


def test_unscale_feeds_non_finite_penalty_gradients_into_the_skip_decision():
    model = _Critic()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), policy="fp16-mixed", device="cpu")
    x = torch.randn(4, 3).requires_grad_(True)
    with mp.autocast():
        out = mp.model(x)
    (g,) = mp.unscale(torch.autograd.grad(mp.scale_loss(out.sum()), x, create_graph=True))
    assert g.dtype == torch.float32
    before = [p.detach().clone() for p in model.parameters()]
    mp.unscale([torch.full((2,), float("inf"), dtype=torch.float16), None])   # a penalty term that overflowed
    mp.backward(((g.norm(dim=1) - 1) ** 2).mean())
    result = mp.step()
    assert not result.applied and result.skipped_reason == "overflow"
    assert float(mp.loss_scale.scale) == result.loss_scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with mp.autocast():   # the flag belongs to that boundary only
        out = mp.model(x)
    (g,) = mp.unscale(torch.autograd.grad(mp.scale_loss(out.sum()), x, create_graph=True))
    mp.backward(((g.norm(dim=1) - 1) ** 2).mean())
    assert mp.step().applied


# ---------------------------------------------------------------- the silent traps, made loud
def test_zero_grad_or_optimizer_step_inside_the_engine_step_is_refused():
    model = _mlp(4, 1, seed=9)
    mp = _engine(model, "bf16-pure")
    x = torch.randn(5, 4)
    with mp.autocast():
        mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) called between mp.backward\(\) and mp.step\(\)"):
        mp.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    mp.optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"that mp.backward\(\) produced are gone at mp.step\(\)"):
        mp.step()
    with mp.autocast():   # the loop goes on after the fix
        mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
    assert mp.step().applied
    mp.optimizer.step()   # outside the engine's step: nothing to protect (no gradients)


def test_forward_outside_autocast_under_mixed_warns_once():
    model = _mlp(4, 1, seed=10)
    mp = _engine(model, "bf16-mixed")
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"outside mp.autocast\(\) under bf16-mixed: it computed in fp32"):
        out = mp.model(x)
    assert out.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.model(x)                        # said once
        with torch.no_grad():              # evaluation outside autocast is a choice, not a trap
            mp.model(x)
        with mp.autocast():
            mp.model(x)
    assert [e["kind"] for e in mp.events] == ["forward"]
    pure = _engine(_mlp(4, 1, seed=10), "bf16-pure")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pure.model(pure.cast_inputs(x))    # pure policies compute in bf16 without autocast


@pytest.mark.parametrize("policy", ["bf16-pure", "bf16-lean"])
def test_fp32_input_outside_autocast_under_16_bit_params_is_named_before_the_dtype_error(policy):
    model = _mlp(4, 1, seed=10)
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), policy=policy, device="cpu")
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"float32 input outside mp.autocast\(\) while its parameters are bfloat16"):
        with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():   # evaluation, as a user writes it
            mp.model(x)
    assert [e["kind"] for e in mp.events] == ["forward"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            mp.model(mp.cast_inputs(x))          # bf16 inputs run outside autocast: no word
            with mp.autocast():
                mp.model(x)                      # inside autocast: no word


def test_cast_inputs_warns_about_a_rounded_target_and_keeps_tuple_indices():
    mp = _engine(_mlp(4, 1, seed=11), "bf16-pure")
    target = torch.tensor([1000.25, 3.0])
    with pytest.warns(UserWarning, match=r"cast_inputs rounded the floating field\(s\) \['y'\] to bfloat16"):
        out = mp.cast_inputs({"x": torch.ones(2, 4), "y": target})
    assert out["y"].dtype == torch.bfloat16 and float(out["y"][0]) == 1000.0   # what the warning is about
    mp2 = _engine(_mlp(4, 1, seed=11), "bf16-pure")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = mp2.cast_inputs((torch.ones(2, 4), target), keep=(1,))
        assert x.dtype == torch.bfloat16 and y.dtype == torch.float32 and torch.equal(y, target)
        ids = mp2.cast_inputs({"tokens": torch.arange(3), "x": torch.ones(2)})   # one float field: an input
        assert ids["tokens"].dtype == torch.long
    with pytest.raises(ValueError, match=r"\[5\] not found"):
        mp2.cast_inputs((torch.ones(2, 4), target), keep=(5,))


def test_cast_inputs_turns_numpy_arrays_into_tensors():
    mp = _engine(_mlp(4, 1, seed=12), "bf16-pure")
    batch = mp.cast_inputs({"x": np.ones((2, 4), dtype=np.float64), "ids": np.arange(3)})
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.bfloat16
    assert batch["ids"].dtype == torch.int64 and batch["ids"].tolist() == [0, 1, 2]
    fp32 = _engine(_mlp(4, 1, seed=12), "fp32")
    assert fp32.cast_inputs(np.float32(2.5)).dtype == torch.float32


def test_missing_gradients_are_named_once():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x):
            return self.used(x)

    model = TwoHeads()
    mp = _engine(model, "bf16-mixed")
    for i in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with mp.autocast():
                mp.backward(mp.model(torch.randn(2, 3)).sum())
            mp.step()
        said = [str(x.message) for x in w if "received no gradient" in str(x.message)]
        assert len(said) == (1 if i == 0 else 0)
    kinds = [e for e in mp.events if e["kind"] == "missing-gradients"]
    assert len(kinds) == 1 and "(unused.weight, unused.bias)" in kinds[0]["detail"]


def test_loss_without_grad_lists_the_likely_causes():
    model = nn.Linear(3, 1)
    model.requires_grad_(False)
    model.weight.requires_grad_(True)
    mp = _engine(model, "fp32")
    with torch.no_grad():
        loss = mp.model(torch.randn(2, 3)).sum()
    with pytest.raises(ValueError, match=r"reentrant activation checkpointing .*use_reentrant=False"):
        mp.backward(loss)


# ---------------------------------------------------------------- a model edited after build
@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "bf16-pure", "bf16-kahan"])
def test_a_layer_replaced_after_build_is_adopted_and_trains(policy):
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = (torch.optim.AdamW if policy != "bf16-kahan" else __import__("mixprec").optim.AdamW)(
        model.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, policy=policy, device="cpu")
    x = torch.randn(6, 4)
    for _ in range(2):
        with mp.autocast():
            mp.backward(mp.model(mp.cast_inputs(x)).float().pow(2).mean())
        mp.step()
    model[2] = nn.Linear(8, 3)                      # a new head, fp32, another shape
    new_w = model[2].weight
    start = new_w.detach().float().clone()
    with pytest.warns(UserWarning, match=r"edited after MixedPrecision was built .*adopted"):
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().pow(2).mean()
        mp.backward(loss)
    assert mp.step().applied
    assert new_w.dtype == mp.policy.param_dtype
    assert not torch.equal(new_w.detach().float(), start)       # the new head trains
    assert mp.events[-1]["kind"] == "model-edit" and "2.weight" in mp.events[-1]["detail"]
    held = {id(t) for g in mp.optimizer.param_groups for t in g["params"]}
    assert len(held) == len(list(model.parameters()))           # the old head's tensors are gone


def test_resize_token_embeddings_after_build_keeps_training_the_resized_table():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=24, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(14)
    model = transformers.GPT2LMHeadModel(cfg)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    ids = torch.randint(0, 24, (2, 8))
    with mp.autocast():
        mp.backward(mp.model(input_ids=ids, labels=ids).loss)
    mp.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.resize_token_embeddings(28)
    table = model.get_input_embeddings().weight
    assert table.shape[0] == 28
    ids = torch.randint(20, 28, (2, 8))              # the new tokens
    before = table.detach().float().clone()
    with pytest.warns(UserWarning, match="edited after MixedPrecision was built"):
        for _ in range(2):
            with mp.autocast():
                mp.backward(mp.model(input_ids=ids, labels=ids).loss)
            assert mp.step().applied
    after = table.detach().float()
    assert table.dtype == torch.bfloat16 and not torch.equal(after[24:], before[24:])   # new rows train
    master = dict(zip((n for n, _ in model.named_parameters()), mp.master_parameters()))["transformer.wte.weight"]
    assert master.shape == (28, 16) and master.dtype == torch.float32
    assert torch.equal(master.to(torch.bfloat16), table.detach())


def test_a_new_parameter_with_several_param_groups_is_refused_by_name():
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}], lr=0.01)
    mp = MixedPrecision(model, opt, policy="bf16-pure", device="cpu")
    model.add_module("extra", nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"gained parameter\(s\) \['extra.weight', 'extra.bias'\]"):
        mp.model(mp.cast_inputs(torch.randn(2, 4)))


def test_reentrant_checkpointing_with_a_frozen_input_names_the_adapters_it_cut_off():
    from torch.utils.checkpoint import checkpoint

    class Adapted(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(16)
            self.embed, self.block, self.adapter, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), \
                nn.Linear(8, 8), nn.Linear(8, 2)
            self.embed.requires_grad_(False)
            self.block.requires_grad_(False)

        def forward(self, ids, reentrant):
            h = self.embed(ids)
            h = checkpoint(lambda t: self.block(t) + self.adapter(t), h, use_reentrant=reentrant)
            return self.head(h)

    for reentrant in (True, False):
        model = Adapted()
        mp = _engine(model, "bf16-mixed")
        before = model.adapter.weight.detach().clone()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with mp.autocast():
                mp.backward(mp.model(torch.tensor([[1, 2, 3]]), reentrant).float().sum())
            mp.step()
        said = [str(x.message) for x in w if "received no gradient" in str(x.message)]
        if reentrant:   # torch's reentrant checkpoint gives no gradient to anything inside when no input requires grad
            assert len(said) == 1 and "adapter.weight" in said[0] and "use_reentrant=False" in said[0]
            assert torch.equal(model.adapter.weight, before)
        else:
            assert said == [] and not torch.equal(model.adapter.weight, before)


# ---------------------------------------------------------------- found by trying to break it
def test_another_engines_gradients_added_mid_accumulation_are_refused():
    """D accumulates two micro-batches; G's backward between them adds to D's own gradients."""
    G, D = _mlp(4, 3, seed=0), _mlp(3, 1, seed=1)
    mp_g, mp_d = _engine(G, "fp32"), _engine(D, "fp32", accumulation_steps=2)
    real, z = _gan_data(1)[0]
    mp_d.backward(_gan_losses(mp_g.model, mp_d.model, real, z, "d"))
    assert mp_d.step() is None
    mp_g.backward(_gan_losses(mp_g.model, mp_d.model, real, z, "g"))   # reaches D's params
    mp_g.step()
    with pytest.raises(RuntimeError, match=r"changed before the next micro-batch's backward\(\) .*inputs="):
        mp_d.backward(_gan_losses(mp_g.model, mp_d.model, real, z, "d"))
    # with inputs= the generator's backward stays off D: D's accumulation stays its own, and nothing is said
    G2, D2 = _mlp(4, 3, seed=0), _mlp(3, 1, seed=1)
    mp_g, mp_d = _engine(G2, "fp32"), _engine(D2, "fp32", accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for micro in range(2):
            mp_d.backward(_gan_losses(mp_g.model, mp_d.model, real, z, "d"))
            d_grads = [p.grad.clone() for p in D2.parameters()]
            result = mp_d.step()
            mp_g.backward(_gan_losses(mp_g.model, mp_d.model, real, z, "g"), inputs=list(G2.parameters()))
            if micro == 0:
                assert all(torch.equal(p.grad, g) for p, g in zip(D2.parameters(), d_grads))
            mp_g.step()
    assert result.applied


def test_gradients_changed_between_backward_and_step_are_said_once():
    model = _mlp(4, 1, seed=20)
    mp = _engine(model, "fp32")
    x = torch.randn(3, 4)
    for i in range(2):
        mp.backward(mp.model(x).sum())
        with torch.no_grad():
            model[0].weight.grad.mul_(0.5)        # an in-place edit: a known practice, kept
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert mp.step().applied
        assert len([x for x in w if "changed between mp.backward() and mp.step()" in str(x.message)]) == (i == 0)
    assert [e["kind"] for e in mp.events] == ["changed-gradients"]


def test_the_documented_penalty_recipe_recovers_from_the_first_fp16_overflow():
    """Scaled by 2**16, the gradient of out.sum() exceeds fp16's max (65504): g is inf and the loss NaN.
    That is an overflow of the penalty's own backward: the scale must back off, not stop the run."""
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), policy="fp16-mixed", device="cpu")
    g_data = torch.Generator().manual_seed(22)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(6):
            x, y = torch.randn(8, 16, generator=g_data).requires_grad_(True), torch.randn(8, 1, generator=g_data)
            with mp.autocast():
                out = mp.model(x)
            (g,) = mp.unscale(torch.autograd.grad(mp.scale_loss(out.sum()), x, create_graph=True))
            with mp.autocast():
                loss = F.mse_loss(out.float(), y) + 0.1 * ((g.norm(dim=1) - 1) ** 2).mean()
            mp.backward(loss)
            results.append(mp.step())
    assert results[0].skipped_reason == "overflow" and results[0].loss_scale == 2.0 ** 16
    assert float(mp.loss_scale.scale) < 2.0 ** 16 and results[-1].applied


def test_kahan_compensation_starts_with_the_residual_and_survives_a_re_prepare():
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    w_fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    import mixprec
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), policy="bf16-kahan", device="cpu")
    export = mp.trainable_state_dict()   # param + compensation, before any step
    for n, w in w_fp32.items():
        residual = w - w.to(torch.bfloat16).float()
        assert bool(((export[n] - w).abs() <= residual.abs() * 2.0 ** -8).all())   # the residual's bf16 rounding
        assert not torch.equal(export[n], w.to(torch.bfloat16).float()) or torch.equal(residual, torch.zeros_like(w))
    x = torch.randn(4, 6)
    for _ in range(3):
        mp.backward(mp.model(mp.cast_inputs(x)).float().pow(2).mean())
        mp.step()
    before = mp.trainable_state_dict()
    mp.set_policy(mp.policy)   # a no-op re-prepare (as a model edit or unfreeze runs): the values stay
    after = mp.trainable_state_dict()
    for n in before:
        assert bool(((after[n] - before[n]).abs() <= (before[n] - before[n].to(torch.bfloat16).float()).abs()
                     * 2.0 ** -8).all())


def test_an_edit_then_save_then_load_into_an_engine_built_on_the_edited_model(tmp_path):
    import mixprec
    torch.manual_seed(24)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    x = torch.randn(3, 4)
    mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
    mp.step()
    model[2] = nn.Linear(8, 3)
    with pytest.warns(UserWarning, match="edited after MixedPrecision was built"):
        mixprec.save_checkpoint(tmp_path, mp)   # the edit is adopted first
    torch.manual_seed(24)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    mp2 = MixedPrecision(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), policy="bf16-pure", device="cpu")
    mixprec.load_checkpoint(tmp_path, mp2)
    for a, b in zip(mp.master_parameters(), mp2.master_parameters()):
        assert torch.equal(a, b)


def test_a_guard_rollback_after_a_model_edit_rolls_back_to_the_new_layout():
    import mixprec
    torch.manual_seed(25)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-2), policy="bf16-pure", device="cpu",
                        guard=mixprec.Guard(snapshot_every=50))
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
            mp.step()
        model[2] = nn.Linear(8, 3)
        mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
        mp.step()
        kept = [p.detach().clone() for p in model.parameters()]
        mp.backward(mp.model(mp.cast_inputs(x)).float().sum() * float("nan"))
        result = mp.step()
    assert not result.applied and model[2].weight.shape == (3, 8)
    assert all(a.shape == b.shape for a, b in zip(kept, model.parameters()))


def test_fp8_edit_closure_optimizer_and_shared_params_are_refused_by_name():
    torch.manual_seed(26)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    mp = MixedPrecision(net, torch.optim.AdamW(net.parameters()), policy="fp8-mixed", device="cpu")
    net[2] = nn.Linear(32, 32)   # would run in bf16 while the fp8 report says fp8
    with pytest.raises(RuntimeError, match=r"under an fp8 policy"):
        with mp.autocast():
            mp.model(torch.randn(2, 32))
    model = nn.Linear(3, 1)
    with pytest.raises(TypeError, match=r"optimizer=LBFGS needs a closure"):
        MixedPrecision(model, torch.optim.LBFGS(model.parameters()), policy="bf16-mixed", device="cpu")
    trunk = nn.Linear(4, 4)
    actor, critic = nn.Sequential(trunk, nn.Linear(4, 2)), nn.Sequential(trunk, nn.Linear(4, 1))
    mp_a = MixedPrecision(actor, torch.optim.SGD(actor.parameters(), lr=0.1), policy="bf16-pure", device="cpu")
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] are already stored in 16 bits by another"):
        MixedPrecision(critic, torch.optim.SGD(critic.parameters(), lr=0.1), policy="bf16-pure", device="cpu")
    mp_a.unwrap(to_fp32=True)   # released: a new engine may take them
    MixedPrecision(critic, torch.optim.SGD(critic.parameters(), lr=0.1), policy="bf16-pure", device="cpu")


@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-pure", "bf16-kahan"])
def test_hook_based_spectral_norm_trains_under_pure_policies(policy):
    import mixprec
    torch.manual_seed(27)
    model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 1))
    opt = (mixprec.optim.AdamW if "kahan" in policy else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    mp = MixedPrecision(model, opt, policy=policy, device="cpu", loss_scale=SCALE if "fp16" in policy else None)
    assert model[0].weight_orig.dtype == torch.float32
    before = model[0].weight_orig.detach().clone()
    x = torch.randn(3, 4)
    for _ in range(3):
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().pow(2).mean()
        mp.backward(loss)
        assert mp.step().applied
    assert not torch.equal(model[0].weight_orig, before)


def test_a_layer_frozen_after_build_is_not_reported_missing():
    model = _mlp(4, 1, seed=28)
    mp = _engine(model, "bf16-pure")
    x = torch.randn(3, 4)
    mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
    mp.step()
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mp.autocast():
            mp.backward(mp.model(mp.cast_inputs(x)).float().sum())
        mp.step()


def test_a_backward_per_micro_batch_then_one_step_still_accumulates():
    """The loop that calls backward() for each of A micro-batches and step() once (no retain_graph): each
    backward() is a micro-batch, so the boundary comes at that step, with the mean gradient."""
    torch.manual_seed(29)
    model = nn.Linear(4, 1)
    ref = _clone(model)
    mp = _engine(model, "fp32", lr=0.1, accumulation_steps=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(30)
    for _ in range(2):
        xs = [torch.randn(3, 4, generator=g) for _ in range(4)]
        for x in xs:
            mp.backward(mp.model(x).pow(2).mean())
        result = mp.step()
        opt.zero_grad()
        for x in xs:
            (ref(x).pow(2).mean() / 4).backward()
        opt.step()
        assert result is not None and result.applied
        assert _params_equal(mp.module, ref)


# ---------------------------------------------------------------- a model cast mid-run (issue 25)
def _cast_run(policy, steps, between=None, lr=0.05, freeze=False):
    """``steps`` SGD steps of a tiny MLP under ``policy``; ``between(model, mp)`` runs after the second."""
    model = _mlp(4, 2, seed=3)
    if freeze:
        model[0].requires_grad_(False)
    mp = MixedPrecision(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr),
                        policy=policy, device="cpu", loss_scale=SCALE if policy.startswith("fp16") else None)
    torch.manual_seed(7)
    xs = [torch.randn(3, 4) for _ in range(steps)]
    for i, x in enumerate(xs):
        if i == 2 and between is not None:
            between(model, mp)
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(x)).float().square().mean()
        mp.backward(loss)
        mp.step()
    return model, mp


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_model_half_between_steps_under_mixed_is_refused_by_name(policy):
    with pytest.raises(RuntimeError) as err:
        _cast_run(policy, 3, between=lambda model, mp: model.half())
    text = str(err.value)
    for part in ("4 parameter(s)", "0.weight", "are float16 but", f"{policy} stores them in float32",
                 "model.float()", "low bits", "copy.deepcopy(model).half()"):
        assert part in text, part


def test_model_to_bf16_under_bf16_mixed_warns_at_evaluation_and_refuses_training():
    model, mp = _cast_run("bf16-mixed", 2)
    model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="stores them in float32"), torch.no_grad(), mp.autocast():
        mp.model(torch.randn(3, 4, dtype=torch.bfloat16))
    assert [e.kind for e in mp.events].count("model-cast") == 1
    with mp.autocast():
        out = None
        with pytest.raises(RuntimeError, match=r"are bfloat16 but bf16-mixed stores them in float32"):
            out = mp.model(torch.randn(3, 4))
    assert out is None
    model.float()   # cast back: training goes on (from the rounded values)
    with mp.autocast():
        loss = mp.model(torch.randn(3, 4)).float().square().mean()
    mp.backward(loss)
    assert mp.step().applied


def test_a_cast_between_backward_and_step_is_refused_and_the_step_discarded():
    model, mp = _cast_run("bf16-mixed", 1)
    with mp.autocast():
        loss = mp.model(torch.randn(3, 4)).float().square().mean()
    mp.backward(loss)
    model.half()
    with pytest.raises(RuntimeError, match="cast after MixedPrecision was built"):
        mp.step()
    assert all(p.grad is None for p in model.parameters()) and mp.micro_step == 0
    model.float()
    with mp.autocast():
        loss = mp.model(torch.randn(3, 4)).float().square().mean()
    with pytest.raises(RuntimeError, match="without backward"):
        mp.step()
    mp.backward(loss)
    assert mp.step().applied


@pytest.mark.parametrize("cast, found, fix", [(lambda m: m.half(), "float16", "model.to(torch.bfloat16)"),
                                              (lambda m: m.float(), "float32", "model.to(torch.bfloat16)")])
def test_a_cast_under_bf16_pure_is_refused_by_name(cast, found, fix):
    with pytest.raises(RuntimeError) as err:
        _cast_run("bf16-pure", 3, between=lambda model, mp: cast(model))
    assert f"are {found} but bf16-pure stores them in bfloat16" in str(err.value)
    assert fix in str(err.value) and "low bits" not in str(err.value)


def test_a_cast_of_frozen_params_is_refused_with_a_per_param_fix():
    # bf16-mixed stores frozen params in bf16 and trainable ones in fp32: model.float() casts the frozen ones
    with pytest.raises(RuntimeError) as err:
        _cast_run("bf16-mixed", 3, between=lambda model, mp: model.float(), freeze=True)
    text = str(err.value)
    assert "2 parameter(s) of the model (0.weight, 0.bias) are float32 but bf16-mixed stores them in bfloat16" in text
    assert "p.data = p.data.to(dtype)" in text


@pytest.mark.parametrize("policy, there, back", [
    ("bf16-mixed", lambda m: m.double(), lambda m: m.float()),
    ("bf16-pure", lambda m: m.float(), lambda m: m.to(torch.bfloat16))])
def test_an_evaluation_cast_undone_before_the_next_step_trains_bit_identically(policy, there, back):
    def evaluate(model, mp):
        there(model)
        with warnings.catch_warnings(record=True) as said, torch.no_grad(), mp.autocast():
            warnings.simplefilter("always")
            mp.model(torch.randn(3, 4, dtype=next(model.parameters()).dtype))
        assert any("evaluation forward runs on the cast params" in str(w.message) for w in said)
        back(model)

    reference, _ = _cast_run(policy, 4)
    model, mp = _cast_run(policy, 4, between=evaluate)
    assert _params_equal(model, reference)
    assert [e.kind for e in mp.events].count("model-cast") == 1
