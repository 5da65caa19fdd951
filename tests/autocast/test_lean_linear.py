"""saved=compute's lean Linear (mixprec.autocast.lean_linear): a Linear fed by GELU/SiLU keeps the activation's input,
not its output. Every value is checked against the same ops without it (its marking turned off: the plain autograd
path), bit for bit, since the backward runs the same kernels on the same inputs and the weights' gradients meet at one
shared cast per autocast block, as at autocast's cached copy."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.autocast import lean_linear
from mixprec.autocast.lean_linear import LeanInput
from mixprec.memory.saved import saved_bytes


class _Mlp(nn.Module):
    """LayerNorm -> Linear -> activation -> Linear, twice (GELU, tanh-GELU), then a SiLU one, an fp32 residual."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(3))
        self.down = nn.ModuleList(nn.Linear(3 * width, width) for _ in range(3))
        self.approximate = ("none", "tanh", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down, approximate in zip(self.up, self.down, self.approximate):
            h = up(self.norm(x))
            x = x + down(F.silu(h) if approximate is None else F.gelu(h, approximate=approximate))
        return x


def _unmarked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same engine with nothing marked: every op takes torch's own autograd path."""
    monkeypatch.setattr(lean_linear, "mark", lambda out, x, op, op_kwargs=None: out)


def _grads(policy: str, x: torch.Tensor, *, penalty: bool = False) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = _Mlp()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy)
    x = x.clone().requires_grad_()
    with mp.autocast():
        out, saved = saved_bytes(lambda: mp.model(x).float(), exclude=list(mp.model.parameters()))
    loss = out.pow(2).mean()
    if penalty:   # a gradient penalty: double backward through the Linears' backward
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        loss = loss + gx.pow(2).sum()
    params = [x] + list(mp.model.parameters())
    return [g.clone() for g in torch.autograd.grad(loss, params)], saved.total


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-pure"])
@pytest.mark.parametrize("penalty", [False, True])
def test_gradients_equal_the_plain_path_bit_for_bit_and_the_saved_bytes_drop_by_what_is_not_kept(
        policy, penalty, monkeypatch):
    x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
    lean, lean_saved = _grads(policy, x, penalty=penalty)
    _unmarked(monkeypatch)
    plain, plain_saved = _grads(policy, x, penalty=penalty)
    assert all(torch.equal(a, b) for a, b in zip(lean, plain, strict=True))
    assert all(g.abs().sum() > 0 for g in lean)
    rows, width = 4 * 5, 16
    assert plain_saved - lean_saved == 3 * rows * 3 * width * 2   # three bf16 activation outputs of width 48


def test_the_marked_output_is_a_tensor_to_every_other_op_and_pickles_plain():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
    with mp.autocast():
        g = mp.model[1](mp.model[0](torch.randn(2, 8)))
        assert type(g) is LeanInput and isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16
        assert type(g * 2) is torch.Tensor and type(g[0]) is torch.Tensor and type(g.float()) is torch.Tensor
        assert repr(g).startswith("tensor(")
        with torch.no_grad():   # no backward: nothing marked
            assert type(mp.model[1](mp.model[0](torch.randn(2, 8)))) is torch.Tensor
    buffer = io.BytesIO()
    torch.save(g.detach(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, g.detach())
    assert type(pickle.loads(pickle.dumps(g.detach()))) is torch.Tensor


def test_an_activation_written_in_place_before_the_linear_reads_it_takes_the_plain_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
    x = torch.randn(4, 8)
    params = list(mp.model.parameters())

    def grads(write: bool) -> list[torch.Tensor]:
        with mp.autocast():
            g = mp.model[1](mp.model[0](x))
            if write:
                g.mul_(2.0)
            else:
                g = g * 2.0
            out = mp.model[2](g).float().sum()
        return torch.autograd.grad(out, params)

    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False), strict=True))


def test_a_write_to_the_activations_input_after_the_forward_raises_as_in_plain_torch():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
    with mp.autocast():
        h = mp.model[0](torch.randn(4, 8))
        out = mp.model[2](mp.model[1](h)).float().sum()
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_one_activation_read_by_two_heads_backpropagated_separately(monkeypatch):
    """The first head's Linear keeps GELU's input, the second (the plain path) keeps the output; two backward calls."""

    def grads() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1)])
        mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
        with mp.autocast():
            g = F.gelu(mp.model[0](torch.randn(4, 8, generator=torch.Generator().manual_seed(3))))
            first, second = mp.model[1](g).float().sum(), mp.model[2](g).float().sum()
        first.backward(retain_graph=True)   # as in plain torch: the second pass goes through model[0] again
        second.backward()
        return [p.grad.clone() for p in model.parameters()]

    lean = grads()
    _unmarked(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(lean, grads(), strict=True))


def test_a_checkpointed_region_ending_in_the_activation_and_torch_func(monkeypatch):
    """A torch.utils.checkpoint region whose output is GELU's, read by a Linear outside it; and torch.func.grad of
    the same loss (functorch transforms mark nothing): both equal the plain path's gradients."""

    def run() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
        with mp.autocast():
            g = torch.utils.checkpoint.checkpoint(lambda t: mp.model[1](mp.model[0](t)), x, use_reentrant=False)
            loss = mp.model[2](g).float().sum()
        loss.backward()
        params = dict(mp.model.named_parameters())

        def functional_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            with mp.autocast():
                return torch.func.functional_call(mp.model, p, (x,)).float().sum()

        return [p.grad.clone() for p in model.parameters()], torch.func.grad(functional_loss)(params)

    lean, lean_func = run()
    _unmarked(monkeypatch)
    plain, plain_func = run()
    assert all(torch.equal(a, b) for a, b in zip(lean, plain, strict=True))
    assert all(torch.equal(lean_func[k], plain_func[k]) for k in plain_func)
    assert all(torch.equal(a, lean_func[k]) for a, k in zip(lean, lean_func))


def test_a_compiled_forward_marks_nothing_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
    compiled = torch.compile(mp.model, backend="aot_eager")
    x = torch.randn(4, 8)
    with mp.autocast():
        out = compiled(x)
    assert type(out) is torch.Tensor
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with mp.autocast():
        mp.model(x).float().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_hooks_on_the_activation_output_fire_with_the_plain_gradient_even_registered_after_the_forward(monkeypatch):
    """The Linear sends the input's gradient to the marked output itself (then GELU's own node): a tensor hook and
    retain_grad registered after the whole forward (as interpretability code and FSDP2's pre-backward do) see it."""

    def seen() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
        with mp.autocast():
            g = mp.model[1](mp.model[0](torch.randn(4, 8, generator=torch.Generator().manual_seed(5))))
            out = mp.model[2](g).float().sum()
        hooked = []
        g.register_hook(lambda grad: hooked.append(grad.clone()))
        g.retain_grad()
        out.backward()
        return hooked[0], g.grad

    lean = seen()
    _unmarked(monkeypatch)
    plain = seen()
    assert all(torch.equal(a, b) for a, b in zip(lean, plain, strict=True))


def test_a_discriminator_called_twice_in_one_block_and_a_step_between_two_backwards(monkeypatch):
    """A weight read twice in one mp.autocast() (a GAN's discriminator on real and fake): its two lean reads share one
    cast, so their bf16 gradients meet there, as at autocast's cached copy in the plain path: bit for bit. And a step
    between two backward passes of one retained forward (actor-critic): the lean Linear keeps the cast copy, as the
    plain path does, so the second backward reads the weights the forward used, as there."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        disc = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
        mp = mixprec.MixedPrecision(disc, torch.optim.SGD(disc.parameters(), lr=0.1), "bf16-mixed", device="cpu")
        g = torch.Generator().manual_seed(6)
        real, fake = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        with mp.autocast():
            loss = F.softplus(-mp.model(real)).mean() + F.softplus(mp.model(fake)).mean()
        grads = [t.clone() for t in torch.autograd.grad(loss.float(), list(disc.parameters()), retain_graph=True)]
        mp.backward(loss.float(), retain_graph=True)
        mp.step()
        mp.backward(loss.float() * 2.0)
        return grads + [p.grad.clone() for p in disc.parameters()]

    lean = run()
    _unmarked(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(lean, run(), strict=True))


def test_forward_mode_ad_marks_nothing(monkeypatch):
    import torch.autograd.forward_ad as fwAD

    def tangent() -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        mp = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
        with fwAD.dual_level(), mp.autocast():
            return fwAD.unpack_dual(mp.model(fwAD.make_dual(x, torch.ones_like(x)))).tangent.clone()

    lean = tangent()
    _unmarked(monkeypatch)
    assert torch.equal(lean, tangent())
