"""Gradient penalties through activation-checkpointed blocks (mixprec.engine.autocast_scope, autocast.switch).

The documented recipe (docs/loops.md): ``torch.autograd.grad(mp.scale_loss(loss), x, create_graph=True)``, then
``mp.unscale``. A ``torch.utils.checkpoint`` block recomputes its forward during that call; the recompute must
cast as the forward did (ops=portable: CUDA's op lists; kernels=measured: the planned attention kernel). Before,
those lists were on only inside ``mp.backward``, so the recompute ran CPU autocast's own lists and torch raised
``CheckpointError`` (layer_norm saved fp32, recomputed bf16). A recompute with the forward's dtypes and kernels
recomputes the forward's values exactly (same kernels, same inputs, CPU), so the checkpointed model's input
gradients, penalty and parameter gradients equal the same model's without checkpointing, bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec import MixedPrecision

SCALE = 256.0   # fp16's static loss scale (a power of two: the scaled and unscaled runs round alike)


class _Block(nn.Module):
    """LayerNorm (CUDA's fp32 list, which CPU autocast lacks), a linear, a softmax and a tanh; with
    ``attention``, softmax attention over the rows (a planned kernel; torch has no double backward for its
    fused CPU kernel, so it serves the first-order checks only)."""

    def __init__(self, attention: bool) -> None:
        super().__init__()
        self.ln, self.qkv, self.out = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)
        self.attention = attention

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.attention:
            return h + torch.tanh(self.out(self.qkv(self.ln(h))[:, :8].softmax(-1)))
        q, k, v = self.qkv(self.ln(h)).view(1, h.shape[0], 3, 2, 4).permute(2, 0, 3, 1, 4)   # (1, heads, rows, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 2, 1, 3).reshape(h.shape)
        return h + torch.tanh(self.out(a))


class _Critic(nn.Module):
    def __init__(self, how: str, attention: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(3, 8), nn.Linear(8, 1)
        self.blocks = nn.ModuleList([_Block(attention), _Block(attention)])
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.how == "torch":
                h = checkpoint(block, h, use_reentrant=False)
            elif self.how == "reentrant":
                h = checkpoint(block, h, use_reentrant=True)
            elif self.how == "mixprec":
                h = mixprec.ops.checkpoint(block, h)
            else:
                h = block(h)
        return self.head(h).float()


def _engine(how: str, policy: str, attention: bool = False) -> MixedPrecision:
    model = _Critic(how, attention)
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-2), policy, device="cpu",
                          loss_scale=SCALE if policy.startswith("fp16") else None)


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g) + 1.0) for _ in range(n)]


def _penalty(mp: MixedPrecision, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """WGAN-GP's penalty at ``x`` by the documented recipe: (input gradient, penalty)."""
    x = mp.cast_inputs(x).requires_grad_(True)
    with mp.autocast():
        out = mp.model(x)
    (g,) = mp.unscale(torch.autograd.grad(mp.scale_loss(out.sum()), x, create_graph=True))
    return g, ((g.norm(dim=1) - 1.0) ** 2).mean()


def _wgan_gp_steps(mp: MixedPrecision, steps: int) -> list[torch.Tensor]:
    """A WGAN-GP critic loop: Wasserstein loss on real and fake points plus 10 x the penalty at their mix."""
    penalties = []
    for i, (real, fake) in enumerate(_data(steps)):
        eps = torch.rand(4, 1, generator=torch.Generator().manual_seed(10 + i))
        _, penalty = _penalty(mp, eps * real + (1 - eps) * fake)
        with mp.autocast():
            loss = mp.model(mp.cast_inputs(fake)).mean() - mp.model(mp.cast_inputs(real)).mean() + 10.0 * penalty
        mp.backward(loss)
        assert mp.step().applied
        penalties.append(penalty.detach())
    return penalties


def _params(mp: MixedPrecision) -> list[torch.Tensor]:
    return [p.detach().clone() for p in mp.master_parameters()]


@pytest.mark.parametrize("how", ["torch", "mixprec"])
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_the_penalty_recipe_through_checkpointed_blocks_equals_the_plain_model(policy, how):
    x = _data(1)[0][0]
    plain, ckpt = _engine("none", policy, attention=True), _engine(how, policy, attention=True)
    assert plain.policy.ops == "portable" and plain.policy.kernels == "measured"   # the defaults
    g_ref, pen_ref = _penalty(plain, x)
    g, pen = _penalty(ckpt, x)
    assert g.dtype == torch.float32 and torch.equal(g, g_ref) and torch.equal(pen, pen_ref)
    plain, ckpt = _engine("none", policy), _engine(how, policy)   # the penalty's own gradients: no attention
    (g_ref, pen_ref), (g, pen) = _penalty(plain, x), _penalty(ckpt, x)
    assert torch.equal(g, g_ref) and torch.equal(pen, pen_ref)
    for mp, p in ((plain, pen_ref), (ckpt, pen)):
        mp.backward(p)
    for a, b in zip(plain.gradients(), ckpt.gradients(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_a_wgan_gp_loop_through_checkpointed_blocks_trains_as_the_plain_model(policy):
    plain, ckpt = _engine("none", policy), _engine("torch", policy)
    before = _params(plain)
    pens_ref, pens = _wgan_gp_steps(plain, 3), _wgan_gp_steps(ckpt, 3)
    assert all(torch.equal(a, b) for a, b in zip(pens, pens_ref))
    after = _params(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(after, _params(plain)))
    assert any(not torch.equal(a, b) for a, b in zip(after, before))   # it trained


def test_a_gradient_call_without_scale_loss_and_in_another_thread_recomputes_as_the_forward():
    """Any backward pass through the model's outputs holds the op lists, in whatever thread autograd runs it
    (CUDA runs it in a device thread, where the caller's thread-local switches are off): a bare
    ``torch.autograd.grad`` (bf16: no scale needed) run in a fresh thread."""
    plain, ckpt = _engine("none", "bf16-mixed", attention=True), _engine("torch", "bf16-mixed", attention=True)
    grads = []
    for mp in (plain, ckpt):
        x = _data(1)[0][0].requires_grad_(True)
        with mp.autocast():
            out = mp.model(x)
        thread = threading.Thread(target=lambda: grads.append(torch.autograd.grad(out.sum(), x)[0]))
        thread.start()
        thread.join()
    assert len(grads) == 2 and torch.equal(grads[0], grads[1])


def test_reentrant_checkpointing_is_refused_by_torch_for_gradient_calls():
    """torch's reentrant checkpoint does not support ``torch.autograd.grad`` at all (docs/loops.md says to use
    ``use_reentrant=False`` or mixprec.ops.checkpoint); ``mp.backward`` through it still recomputes as the
    forward did."""
    mp = _engine("reentrant", "bf16-mixed")
    x = _data(1)[0][0].requires_grad_(True)
    with mp.autocast():
        out = mp.model(x)
    with pytest.raises(RuntimeError, match=r"use_reentrant=True, .* incompatible with \.grad\(\)"):
        torch.autograd.grad(mp.scale_loss(out.sum()), x, create_graph=True)
    plain = _engine("none", "bf16-mixed")
    for engine in (mp, plain):
        with engine.autocast():
            loss = engine.model(_data(1)[0][0]).square().mean()
        engine.backward(loss)
    assert all(torch.equal(a, b) for a, b in zip(mp.gradients(), plain.gradients(), strict=True))
