"""Saved tensors rebuilt in backward, not kept (mixprec.autocast.saved_rebuilds): autocast's bf16 weight copies
cast again, GELU/SiLU outputs recomputed from their saved input.

Every check compares the same forward and backward with the rebuild on and off: the gradients must be equal bit for
bit (a cast or an elementwise op gives the same bits for the same input) and the bytes saved for backward must drop
by exactly what is rebuilt (2 bytes per element of each distinct Linear weight, biases not being saved by a
matmul's backward; 2 bytes per element of each bf16 GELU output). And torch's in-place check, which torch itself
skips under any saved-tensor hooks, still fires inside ``mp.autocast()``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import mixprec
from mixprec.autocast.saved_rebuilds import rebuild_saved
from mixprec.engine import autocast_scope
from mixprec.memory.saved import saved_bytes


class _TiedNet(nn.Module):
    """Embedding, a Linear over (B, T, C) inputs (a linear saves a view of the bf16 weight), LayerNorm, and a head
    tied to the embedding (one fp32 parameter cast for the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))


def _linear_weight_bytes(model: nn.Module) -> int:
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(2 * w.numel() for w in weights.values())


def _loss(mp: mixprec.MixedPrecision, ids: torch.Tensor) -> torch.Tensor:
    with mp.autocast():
        logits = mp.model(ids)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def _run(recast: bool, monkeypatch: pytest.MonkeyPatch, policy: str = "bf16-mixed,saved=rebuild", steps: int = 3,
         rerun: bool = True) -> dict:
    if not recast:   # the same engine with the recast off (what saved=compute did before)
        monkeypatch.setattr(autocast_scope.AutocastScope, "_recasts", lambda self: False)
    if not rerun:    # and with GELU's output kept
        monkeypatch.setattr(autocast_scope.AutocastScope, "_reruns", lambda self: False)
    torch.manual_seed(0)
    model = _TiedNet()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy)
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    losses, saved = [], None
    for _ in range(steps):
        loss, counted = saved_bytes(lambda: _loss(mp, ids), exclude=list(mp.model.parameters()))
        saved = saved or counted
        mp.backward(loss)
        mp.step()
        losses.append(loss.detach())
    monkeypatch.undo()
    return {"losses": losses, "params": [p.detach().clone() for p in mp.model.parameters()], "saved": saved,
            "weights": _linear_weight_bytes(mp.model)}


def test_bf16_mixed_trains_bit_for_bit_as_before_and_saves_no_weight_copy(monkeypatch):
    on, off = _run(True, monkeypatch), _run(False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(on["losses"], off["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
    assert off["saved"].total - on["saved"].total == on["weights"] == 2 * (32 * 64 + 64 * 32 + 50 * 32)
    assert off["saved"].by_dtype["torch.bfloat16"] - on["saved"].by_dtype["torch.bfloat16"] == on["weights"]


def test_policies_without_fp32_weights_or_with_saved_fp32_are_unchanged(monkeypatch):
    for policy in ("bf16-pure,saved=rebuild", "bf16-mixed", "bf16-mixed,saved=fp32", "fp32"):
        on, off = _run(True, monkeypatch, policy, steps=1), _run(False, monkeypatch, policy, steps=1)
        assert on["saved"] == off["saved"], policy


@pytest.mark.parametrize("switch, activation", [("_recasts", nn.Tanh), ("_reruns", nn.GELU)])
def test_a_gradient_penalty_through_rebuilt_tensors_equals_the_kept_ones(monkeypatch, switch, activation):
    """Double backward: the penalty's graph, built in backward from the recast weight copies (Tanh MLP) or the
    recomputed GELU outputs, reaches the fp32 weights / GELU's input as the kept tensors' did (autograd restores a
    saved tensor's history when a hook unpacks it)."""
    grads = {}
    for rebuilt in (True, False):
        if not rebuilt:
            monkeypatch.setattr(autocast_scope.AutocastScope, switch, lambda self: False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), activation(), nn.Linear(32, 1))
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed,saved=rebuild")
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with mp.autocast():
            out = mp.model(x).float()
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        mp.backward(out.mean() + 10.0 * gx.pow(2).sum(1).mean())
        grads[rebuilt] = [p.grad.clone() for p in mp.model.parameters()]
        monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    assert all(g.abs().sum() > 0 for g in grads[True][:3])


def test_a_weight_changed_between_forward_and_backward_is_refused_not_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="bf16-mixed,saved=rebuild")
    with mp.autocast():
        loss = mp.model(torch.randn(4, 8)).float().sum()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="a parameter changed between the forward and the backward"):
        loss.backward()


def test_an_enclosing_users_hooks_still_see_every_other_saved_tensor():
    """A user's saved_tensors_hooks around the forward (e.g. offloading) keep working: the recast hands every
    tensor that is not a weight copy to them, and unpacks through them."""
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    reference = [p.detach().clone() for p in model.parameters()]
    seen, unpacked = [], []

    def pack(t: torch.Tensor) -> tuple:
        seen.append((tuple(t.shape), t.dtype))
        return ("user", t)

    def unpack(packed: tuple) -> torch.Tensor:
        unpacked.append(packed[0])
        return packed[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), torch.autocast("cpu", dtype=torch.bfloat16), \
            rebuild_saved(list(model.parameters()), activation_outputs=False):
        loss = model(x).float().sum()
    loss.backward()
    weight_shapes = {s for w in (reference[0], reference[2]) for s in (tuple(w.shape), tuple(w.t().shape))}
    assert not [s for s, dtype in seen if dtype == torch.bfloat16 and s in weight_shapes], seen   # (W or W.t())
    assert seen and len(unpacked) == len(seen)   # every other saved tensor went through the user's hooks
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_frozen_weights_are_kept_as_autocast_saves_them():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    model[0].weight.requires_grad_(False)   # frozen: its cast has no autograd history to recast from
    x = torch.randn(4, 8, requires_grad=True)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), rebuild_saved(list(model.parameters()), activation_outputs=False):
            return model(x).float().sum()

    _, with_recast = saved_bytes(forward, exclude=list(model.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, plain = saved_bytes(lambda: model(x).float().sum(), exclude=list(model.parameters()))
    assert plain.total - with_recast.total == 2 * 16 * 1   # the trainable head's copy only; the frozen one stays


def test_a_counter_opened_inside_mp_autocast_counts_what_training_keeps(monkeypatch):
    """The bench's memory step opens its SavedTensorCounter inside ``mp.autocast()`` (innermost hooks are the only
    ones torch applies): the counter hands every tensor to the recast around it, so the copies it recasts are not
    counted, exactly as when the counter is outside."""
    from mixprec.memory.saved import SavedTensorCounter

    counted = {}
    for recast in (True, False):
        if not recast:
            monkeypatch.setattr(autocast_scope.AutocastScope, "_recasts", lambda self: False)
        torch.manual_seed(0)
        model = _TiedNet()
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy="bf16-mixed,saved=rebuild")
        ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
        with mp.autocast(), SavedTensorCounter(exclude=list(mp.model.parameters())) as counter:
            logits = mp.model(ids)
        logits.float().sum().backward()   # the recast copies unpack through the counter's hooks
        counted[recast] = counter.result().total
        monkeypatch.undo()
    assert counted[False] - counted[True] == _linear_weight_bytes(_TiedNet())


def test_a_gelu_output_read_by_a_linear_is_kept_by_neither_path(monkeypatch):
    """_TiedNet's one GELU output (4 x 16 x 64 in bf16) feeds a Linear: saved=compute's lean Linear keeps GELU's input
    instead (mixprec.autocast.lean_linear), so the rebuild's hooks find nothing more to rebuild: the same bytes saved
    with the rerun on and off, and the same losses and weights over 3 AdamW steps, under bf16-mixed and bf16-pure.
    (A GELU/SiLU output read by anything else is rebuilt: test_gelu_tanh_gelu_and_silu_outputs_recomputed...)"""
    for policy in ("bf16-mixed,saved=rebuild", "bf16-pure,saved=rebuild"):
        on, off = _run(True, monkeypatch, policy), _run(True, monkeypatch, policy, rerun=False)
        assert all(torch.equal(a, b) for a, b in zip(on["losses"], off["losses"])), policy
        assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"])), policy
        assert on["saved"] == off["saved"], policy
    fp32 = _run(True, monkeypatch, "bf16-mixed,saved=fp32", steps=1)["saved"]
    compute = _run(True, monkeypatch, "bf16-mixed", steps=1)["saved"]
    # saved=fp32 (torch.autocast's): the GELU output, and the norm's input in fp32 not bf16
    assert fp32.total - compute.total == 2 * 4 * 16 * 64 + 2 * 4 * 16 * 32


class _Mlps(nn.Module):
    """An exact-GELU MLP, a tanh-GELU MLP and a SwiGLU (``silu(a) * b``), over (B, T, C) inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.up1, self.down1 = nn.Linear(16, 48), nn.Linear(48, 16)
        self.up2, self.down2 = nn.Linear(16, 48), nn.Linear(48, 16)
        self.gate, self.value, self.down3 = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down1(torch.nn.functional.gelu(self.up1(x)))
        x = x + self.down2(torch.nn.functional.gelu(self.up2(x), approximate="tanh"))
        return x + self.down3(torch.nn.functional.silu(self.gate(x)) * self.value(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_tanh_gelu_and_silu_outputs_recomputed_under_autocast_and_in_fp32(dtype):
    torch.manual_seed(0)
    model = _Mlps()
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def run(rebuild: bool) -> tuple:
        model.zero_grad()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), \
                (rebuild_saved(weight_copies=False) if rebuild else contextlib.nullcontext()):
            out, saved = saved_bytes(lambda: model(x).float().pow(2).sum(), exclude=list(model.parameters()))
        out.backward()
        return saved.total, [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    kept, grads_kept = run(False)
    rebuilt, grads_rebuilt = run(True)
    assert all(torch.equal(a, b) for a, b in zip(grads_kept, grads_rebuilt, strict=True))
    size = 2 if dtype == torch.bfloat16 else 4
    assert kept - rebuilt == size * 3 * 5 * (48 + 48 + 32)   # two GELU outputs and one SiLU output


@pytest.mark.parametrize("policy", ["bf16-mixed,saved=rebuild", "bf16-pure,saved=rebuild", "bf16-mixed", "fp32"])
@pytest.mark.parametrize("written", ["kept", "gelu output"])
def test_a_saved_activation_written_in_place_before_backward_raises_as_in_plain_torch(policy, written):
    """Torch checks a saved tensor's version at backward only when no saved-tensor hook is active; inside
    mp.autocast() under saved=rebuild the rebuilds' hooks check it themselves, for kept tensors and recomputed
    outputs alike (the default installs no hook: torch's own check). A GELU output read by a Linear under a bf16
    policy is not kept at all (the lean Linear keeps GELU's input, checked as torch does): writing it after the
    Linear read it changes nothing the backward reads, and the gradients are those of the forward that ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy)
    x = torch.randn(4, 8)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        with mp.autocast():
            h = mp.model[0](x)
            a = torch.tanh(h) if written == "kept" else torch.nn.functional.gelu(h)   # tanh saves its output
            return a, mp.model[2](mp.model[1](a)).float().sum()

    a, loss = forward()
    with torch.no_grad():
        a.mul_(2.0)
    if written == "gelu output" and policy != "fp32":
        params = list(mp.model.parameters())
        written_grads = torch.autograd.grad(loss, params)
        plain_grads = torch.autograd.grad(forward()[1], params)   # the same forward, nothing written
        assert all(torch.equal(a, b) for a, b in zip(written_grads, plain_grads, strict=True))
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        mp.backward(loss)


def test_rebuild_is_opt_in_said_in_the_decision_and_bf16_only():
    """The bf16 default (saved=compute) installs no saved-tensor hook (torch.func and checkpoint regions then work
    as under plain autocast); saved=rebuild says what it rebuilds; fp16 compute refuses it by name."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    default = mixprec.MixedPrecision(model, None, "bf16-mixed", device="cpu")
    assert default.policy.saved == "compute" and "rebuilt" not in default.decision
    with default.autocast():
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    rebuild = mixprec.MixedPrecision(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)), None,
                                     "bf16-mixed,saved=rebuild", device="cpu")
    assert "; saved=rebuild: layer_norm and rms_norm compute in fp32" in rebuild.decision
    assert ("weight copies and gelu/silu outputs read by anything else are not kept for backward but rebuilt"
            in rebuild.decision)
    with pytest.raises(ValueError, match=r"saved='rebuild' with compute=fp16"):
        mixprec.Policy.parse("fp16-mixed,saved=rebuild")
