"""An engine is freed when its last reference goes (``del mp``), not at the cyclic garbage collector's next run:
no collaborator it owns (loop checks, autocast scope, gradient sums, recompute plan, memory budget, a guard) holds
it strongly (mixprec.engine.feature.HeldEngine). Before, each did, so ``del mp`` freed nothing (the model, the
optimizer state, a DDP module) until a collection, and a DDP run that called ``destroy_process_group()`` aborted at
interpreter exit about 1 run in 8 ("terminate called without an active exception", the reducer torn down late).
The checks run with the collector disabled, so only reference counts can free the engine."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import mixprec
from mixprec import MixedPrecision
from ranks import run_ranks


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), _Block(), _Block(), nn.Linear(32, 32))


def _trained_then_dropped(policy: str, steps: int = 3, **kwargs) -> tuple[weakref.ref, weakref.ref]:
    """Train ``steps`` steps, drop every reference; return weak references to the engine and the model (not to the
    optimizer: torch's own AdamW, like mixprec's, keeps itself in a reference cycle)."""
    model = _net()
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-3)
    mp = MixedPrecision(model, opt, policy=policy, device="cpu", **kwargs)
    for step in range(steps):
        with mp.autocast():
            loss = mp.model(torch.randn(8, 32)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    refs = weakref.ref(mp), weakref.ref(model)
    del mp, model, opt, loss
    return refs


@pytest.fixture
def no_collector():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if enabled:
        gc.enable()


@pytest.mark.parametrize("policy,kwargs", [
    ("fp32", {}), ("bf16-mixed", {}), ("bf16-pure", {}), ("bf16-sr", {}), ("fp16-mixed", {}),
    ("bf16-lean", {}), ("nvfp4-mixed", {}), ("fp8-mixed", {}),
    ("bf16-mixed", {"guard": "guard"}), ("bf16-mixed", {"recompute": "auto"}),
    ("bf16-mixed", {"memory_budget": "1GiB"}), ("bf16-mixed", {"accumulation_steps": 2}),
    ("bf16-mixed", {"max_grad_norm": 1.0}),
])
def test_del_frees_the_engine_and_its_model_at_once(no_collector, policy, kwargs):
    if kwargs.get("guard") == "guard":
        kwargs = {"guard": mixprec.Guard()}
    engine, model = _trained_then_dropped(policy, **kwargs)
    assert engine() is None and model() is None


def test_del_frees_the_engine_after_set_policy_and_unwrap(no_collector):
    model = _net()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy="nvfp4-mixed", device="cpu")
    with mp.autocast():
        loss = mp.model(torch.randn(8, 32)).float().pow(2).mean()
    mp.backward(loss)
    mp.step()
    mp.set_policy("bf16-pure")
    plain = mp.unwrap(to_fp32=True)
    engine = weakref.ref(mp)
    del mp, loss
    assert engine() is None
    assert isinstance(plain, nn.Module) and torch.isfinite(plain(torch.randn(2, 32))).all()   # the model lives on


def test_a_model_that_outlives_its_engine_still_runs_forward(no_collector):
    model = _net()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy="bf16-mixed", device="cpu")
    with mp.autocast():
        expected = mp.model(torch.randn(4, 32))
    engine = weakref.ref(mp)
    del mp
    assert engine() is None
    out = model(torch.randn(4, 32))   # the engine's hooks left with it: a plain fp32 forward
    assert out.dtype == torch.float32 and expected.shape == out.shape


def test_a_recompute_plan_left_pending_by_a_deleted_engine_gives_the_blocks_their_forward_back(no_collector):
    model = _net()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy="bf16-mixed", device="cpu",
                        recompute="auto")   # the plan is chosen at the first training forward: never here
    del mp
    x = torch.randn(4, 32)
    out = model(x)
    out.sum().backward()
    assert "forward" not in vars(model[1]) and torch.equal(out, model(x))
    model.zero_grad(set_to_none=True)
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy="bf16-mixed", device="cpu",
                        recompute="auto")   # a second engine on the same model plans and trains
    with mp.autocast():
        loss = mp.model(x).float().pow(2).mean()
    mp.backward(loss)
    assert mp.step().applied and "recompute" in mp.decision


def test_a_guard_without_after_step_or_a_guard_class_is_refused_at_the_build():
    model = _net()
    with pytest.raises(TypeError, match=r"guard=True has no after_step\(mp, result\): pass a mixprec.Guard"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-mixed", guard=True)
    with pytest.raises(TypeError, match=r"guard=Guard is a class: pass an instance, e.g. guard=Guard\(\)"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-mixed", guard=mixprec.Guard)


def test_a_guard_of_a_deleted_engine_is_refused_by_the_next_one_saying_so():
    guard = mixprec.Guard()
    engine, _ = _trained_then_dropped("bf16-mixed", steps=1, guard=guard)
    assert engine() is None
    model = _net()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy="bf16-mixed", guard=guard)
    with mp.autocast():
        loss = mp.model(torch.randn(8, 32)).float().pow(2).mean()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match=r"already watched another MixedPrecision engine \(since deleted\)"):
        mp.step()


def _ddp_engine_freed_before_the_group_goes(rank: int, out, policy: str) -> bool:
    gc.disable()
    model = _net()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters()), policy=policy, strategy="ddp")
    for _ in range(2):
        with mp.autocast():
            loss = mp.model(torch.randn(8, 32)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    ddp = weakref.ref(mp.model)
    del mp, model, loss
    return ddp() is None   # the DDP module and its reducer, freed while the process group still exists


@pytest.mark.parametrize("policy", ["bf16-mixed", "nvfp4-mixed"])
def test_ddp_engines_free_their_ddp_module_on_del(tmp_path, policy):
    assert run_ranks(_ddp_engine_freed_before_the_group_goes, tmp_path, policy) == [True, True]


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_del_frees_a_torch_optimizer_its_params_and_state_and_an_ema(no_collector, optimizer):
    """With a torch optimizer nothing of the run outlives ``del``: the engine's ``add_param_group`` route holds the
    optimizer weakly, an EMA's step hook holds the EMA weakly. (mixprec's own optimizers keep themselves in a
    reference cycle, freed by the collector.)"""
    model = _net()
    opt = optimizer(model.parameters(), lr=1e-3)
    mp = MixedPrecision(model, opt, policy="bf16-mixed", device="cpu")
    ema = mixprec.EMA(mp, decay=0.9)
    for _ in range(2):
        with mp.autocast():
            loss = mp.model(torch.randn(8, 32)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    assert ema.updates == 2
    refs = [weakref.ref(x) for x in (mp, model, opt, ema, model[0].weight)]
    refs += [weakref.ref(t) for t in opt.state[model[0].weight].values() if isinstance(t, torch.Tensor)]
    del mp, model, opt, ema, loss
    assert all(r() is None for r in refs)
