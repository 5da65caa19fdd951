"""``auto`` decided on the model (mixprec.auto.trial, mixprec.auto.pending): the trial picks the faster
candidate, leaves the model as found, caches by the right key; the engine decides at its first forward."""

import json
import sys
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.auto import trial as auto_policy
from mixprec.autocast import op_plan
from mixprec.auto.trial import cache_key, choose, preserved, time_candidates
from mixprec.machine.capability import Capability
from mixprec.policy.resolve import auto_candidates, resolve

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    auto_policy._MEMORY.clear()
    yield
    auto_policy._MEMORY.clear()


class Clock:
    """A fake timer: the model's forward advances it by a fixed amount per autocast state."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Ticking(nn.Module):
    """Forward costs ``cost16`` fake seconds under autocast, ``cost32`` without; BatchNorm and dropout so
    buffers and RNG are touched."""

    def __init__(self, clock: Clock, cost16: float, cost32: float) -> None:
        super().__init__()
        self.clock, self.cost16, self.cost32 = clock, cost16, cost32
        self.lin, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)

    def forward(self, x):
        self.clock.now += self.cost16 if torch.is_autocast_enabled("cpu") else self.cost32
        return self.drop(self.bn(self.lin(x)))


@pytest.mark.parametrize("cost16,expected", [(5.0, "fp32"), (0.5, "bf16-mixed"), (0.99, "fp32")])
def test_the_trial_picks_the_faster_candidate_by_a_margin(cost16, expected):
    clock = Clock()
    model = Ticking(clock, cost16=cost16, cost32=1.0)
    trial = choose(model, (torch.randn(4, 8),), {}, CPU, ("fp32", "bf16-mixed"), timer=clock)
    assert trial.choice == expected          # 0.99 is 1 % faster: under the 3 % margin, fp32
    assert trial.median_ms == pytest.approx({"fp32": 1000.0, "bf16-mixed": cost16 * 1000})
    text = trial.decision("cpu")
    assert text.startswith(f"auto → {expected}: measured on this model (3 interleaved blocks of 2 steps)")
    assert f"bf16-mixed {1 / cost16:.2f}x fp32" in text and text.endswith("fp16 is never chosen on a CPU")


def test_the_trial_interleaves_blocks_after_warmup():
    order = []

    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            order.append("b" if torch.is_autocast_enabled("cpu") else "f")
            return self.lin(x)

    times = time_candidates(Recording(), (torch.randn(3, 2),), {}, CPU, ("fp32", "bf16-mixed"), blocks=2, steps=2)
    assert "".join(order) == "fb" + "ffbb" * 2
    assert [len(t) for t in times.values()] == [4, 4]


def test_the_trial_leaves_the_model_as_found():
    clock = Clock()
    model = Ticking(clock, 1.0, 1.0)
    model.bn.running_mean.fill_(0.25)
    existing = torch.full_like(model.lin.weight, 3.0)
    model.lin.weight.grad = existing
    model.drop.eval()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    buffer_objects = [id(b) for b in model.buffers()]
    modes = [m.training for m in model.modules()]
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    choose(model, (x,), {}, CPU, ("fp32", "bf16-mixed"), timer=clock)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert [id(b) for b in model.buffers()] == buffer_objects
    assert model.lin.weight.grad is existing and torch.equal(existing, torch.full_like(existing, 3.0))
    assert model.lin.bias.grad is None and model.bn.weight.grad is None
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


def test_preserved_restores_even_when_the_forward_raises():
    model = nn.BatchNorm1d(3)
    before = model.running_var.clone()
    with pytest.raises(RuntimeError, match="boom"), preserved(model, CPU):
        model(torch.randn(5, 3) * 10)
        raise RuntimeError("boom")
    assert torch.equal(model.running_var, before)


def test_the_cache_key_changes_with_model_batch_and_threads(monkeypatch):
    x = torch.randn(4, 8)
    key = lambda m, batch=x: cache_key(m, (batch,), {}, CPU, ("fp32", "bf16-mixed"))  # noqa: E731
    assert key(nn.Linear(8, 8)) == key(nn.Linear(8, 8))              # the values do not matter
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 16))             # shapes do
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 8).double())     # dtypes do
    assert key(nn.Sequential(nn.Linear(8, 8))) != key(nn.Linear(8, 8))   # module classes do
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 8), torch.randn(16, 8))   # batch shapes do
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 8), x.double())
    frozen = nn.Linear(8, 8).requires_grad_(False)
    assert key(frozen) != key(nn.Linear(8, 8))
    base = key(nn.Linear(8, 8))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1234)
    assert key(nn.Linear(8, 8)) != base


def test_the_result_is_cached_in_process_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(auto_policy, "NOISY_SPREAD", float("inf"))   # any spread is quiet: the cache path, always
    calls = []

    class Counting(nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x)

    x = torch.randn(4, 8)
    first = choose(Counting(8, 8), (x,), {}, CPU, ("fp32", "bf16-mixed"))
    n = len(calls)
    assert n == 14 and not first.cached and list(tmp_path.glob("auto-trial-*.json"))
    assert choose(Counting(8, 8), (x,), {}, CPU, ("fp32", "bf16-mixed")) is first and len(calls) == n
    auto_policy._MEMORY.clear()
    again = choose(Counting(8, 8), (x,), {}, CPU, ("fp32", "bf16-mixed"))
    assert again.cached and again.choice == first.choice and len(calls) == n
    assert ", cached)" in again.decision("cpu")


def test_candidates_per_device():
    cap = lambda dev, **kw: Capability(device=dev, **{"bf16": True, "fp16": True, "bf16_fast": True,  # noqa: E731
                                                      "fp16_native": True, **kw})
    assert auto_candidates(cap("cpu", bf16_fast=False)) == ("fp32", "bf16-mixed")   # never fp16 on a CPU
    assert auto_candidates(cap("cuda:0")) == ("fp32", "bf16-mixed")
    assert auto_candidates(cap("cuda:0", bf16_fast=False)) == ("fp32", "fp16-mixed")   # sm_75
    assert auto_candidates(cap("mps", bf16=False, bf16_fast=False)) == ("fp32", "fp16-mixed")


def test_resolve_with_a_model_times_it_and_without_keeps_the_probe():
    class SlowUnderAutocast(nn.Linear):
        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                time.sleep(0.02)
            return super().forward(x)

    res = resolve("auto", "cpu", model=SlowUnderAutocast(8, 8), example_batch=torch.randn(4, 8))
    assert str(res.policy) == "fp32" and "measured on this model" in res.decision
    assert "matmul probe" in resolve("auto", "cpu").decision
    assert mixprec.resolve_policy("fp32", "cpu", model=nn.Linear(2, 2)) == mixprec.PRESETS["fp32"]
    with pytest.raises(ValueError, match="needs example_batch"):
        resolve("auto", "cpu", model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="loss_fn"):   # an int output: nothing to backpropagate
        resolve("auto", "cpu", model=nn.Embedding(4, 2), example_batch=torch.tensor([1]),
                loss_fn=lambda out: out)


def test_resolve_calls_the_model_with_args_and_kwargs():
    seen = []

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale=1.0):
            seen.append(scale)
            return self.lin(x) * scale

    resolve("auto", "cpu", model=TwoInputs(), example_batch={"x": torch.randn(2, 4), "scale": 2.0},
            loss_fn=lambda out: out.pow(2).mean())
    assert seen and set(seen) == {2.0}


# ---------------------------------------------------------------- the engine decides at the first forward
CLOCK = Clock()


@pytest.fixture
def fake_time(monkeypatch):
    """The engine's trial reads auto_policy's clock: a fake one that only the models below advance, so no
    decision depends on how loaded the machine is."""
    monkeypatch.setattr(auto_policy, "time", types.SimpleNamespace(perf_counter=CLOCK))


class SleepNet(nn.Module):
    """bf16 slower by construction: the forward costs 20 (fake) ms under autocast, 1 ms without."""

    slow_under_autocast = True

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        CLOCK.now += 0.02 if torch.is_autocast_enabled("cpu") == self.slow_under_autocast else 0.001
        return self.out(torch.relu(self.lin(x)))


class FastUnderAutocast(SleepNet):
    """bf16 faster by construction: 20 (fake) ms without autocast, 1 ms under it."""

    slow_under_autocast = False


def _first_step(cls, policy):
    torch.manual_seed(0)
    model = cls()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, device="cpu")
    build_decision = mp.decision
    x = torch.randn(4, 8)
    with mp.autocast():
        loss = mp.model(x).float().pow(2).mean()
    mp.backward(loss)
    result = mp.step()
    return mp, build_decision, loss.detach(), result


@pytest.mark.usefixtures("fake_time")
def test_engine_auto_ends_fp32_where_bf16_is_slower():
    mp, build, loss, _ = _first_step(SleepNet, "auto")
    assert build.startswith("auto: pending — timed on this model at its first forward")
    assert str(mp.policy) == "fp32"
    assert mp.decision.startswith("auto → fp32: measured on this model") and "bf16-mixed 0.05x fp32" in mp.decision
    assert [e["kind"] for e in mp.events] == ["auto"] and mp.events[0]["to"] == "fp32"
    _, _, fp32_loss, _ = _first_step(SleepNet, "fp32")
    assert torch.equal(loss, fp32_loss)


@pytest.mark.usefixtures("fake_time")
def test_engine_auto_switches_to_bf16_before_the_first_forward_bitwise():
    mp, _, loss, _ = _first_step(FastUnderAutocast, "auto")
    assert str(mp.policy) == "bf16-mixed" and mp.decision.startswith("auto → bf16-mixed: measured on this model")
    assert mp.events[-1]["kind"] == "auto" and mp.events[-1]["to"] == "bf16-mixed"
    ref, _, ref_loss, _ = _first_step(FastUnderAutocast, "bf16-mixed")
    _, _, fp32_loss, _ = _first_step(FastUnderAutocast, "fp32")
    assert torch.equal(loss, ref_loss) and not torch.equal(loss, fp32_loss)
    assert all(torch.equal(a, b) for a, b in zip(mp.module.parameters(), ref.module.parameters()))
    with mp.autocast():   # later blocks run the chosen policy's autocast as usual
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.usefixtures("fake_time")
def test_engine_auto_without_a_forward_through_mp_model_falls_back_to_the_probe():
    torch.manual_seed(0)
    model = SleepNet()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    with torch.no_grad():
        mp.model(torch.randn(2, 8))            # not a training forward: still pending
    assert mp.decision.startswith("auto: pending")
    loss = SleepNet.forward(mp.module, torch.randn(2, 8)).pow(2).mean()   # around mp.model's hooks
    with pytest.warns(UserWarning, match="still pending at mp.backward"):
        mp.backward(loss)
    assert str(mp.policy) == "fp32"            # this boundary trains as built
    mp.step()
    probe = resolve("auto", "cpu")
    assert mp.policy == probe.policy and "auto fell back to the matmul probe" in mp.decision
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # once
        with mp.autocast():
            loss = mp.model(torch.randn(2, 8)).float().mean()
        mp.backward(loss)


@pytest.mark.usefixtures("fake_time")
def test_the_pending_auto_warning_raised_inside_mp_backward_points_at_the_users_line():
    """The warning comes from a feature's ``before_backward``, several mixprec frames below ``mp.backward``: it
    names the line of this file that called ``mp.backward``, not the library."""
    model = SleepNet()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    loss = SleepNet.forward(mp.module, torch.randn(2, 8)).pow(2).mean()   # around mp.model's hooks: still pending
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        mp.backward(loss)
    pending = [w for w in caught if "still pending at mp.backward" in str(w.message)]
    assert [(w.filename, w.lineno) for w in pending] == [(__file__, line)]


@pytest.mark.usefixtures("fake_time")
def test_an_explicit_set_policy_ends_the_pending_auto():
    model = SleepNet()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    mp.set_policy("bf16-mixed")
    with mp.autocast():
        mp.model(torch.randn(2, 8))
    assert str(mp.policy) == "bf16-mixed" and "set_policy" in mp.decision
    assert not any(e["kind"] == "auto" for e in mp.events)


@pytest.mark.usefixtures("fake_time")
def test_auto_under_a_strategy_keeps_the_probe_rule():
    from mixprec.auto.pending import pending_resolution

    probe = resolve("auto", "cpu")
    res, candidates = pending_resolution("auto", probe, strategy="ddp", compiled_in_place=False)
    assert candidates == () and res.policy == probe.policy and "strategy='ddp'" in res.decision
    res, candidates = pending_resolution("bf16-mixed", probe, strategy=None, compiled_in_place=False)
    assert candidates == () and res is probe


@pytest.mark.usefixtures("fake_time")
def test_engine_auto_under_compile_decides_before_compiling():
    torch.manual_seed(0)
    model = FastUnderAutocast()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                                compile={"backend": "eager"})
    with mp.autocast():
        loss = mp.model(torch.randn(4, 8)).float().pow(2).mean()
        assert torch.is_autocast_enabled("cpu")   # switched on for the rest of the block
    mp.backward(loss)
    mp.step()
    assert str(mp.policy) == "bf16-mixed" and "measured on this model" in mp.decision and "compiled" in mp.decision
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.usefixtures("fake_time")
def test_a_loaded_run_keeps_its_auto_decision():
    first, _, _, _ = _first_step(SleepNet, "auto")
    state = {**first.state_dict(), "events": list(first.events)}
    model = SleepNet()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    mp.load_state_dict(state)
    assert mp.decision.startswith("fp32 as loaded: the saved run's decision (auto → fp32: measured")
    with mp.autocast():
        mp.model(torch.randn(2, 8))          # no second trial
    assert [e["kind"] for e in mp.events] == ["auto"]


def _continue(mp, x):
    with mp.autocast():
        loss = mp.model(x).float().pow(2).mean()
    mp.backward(loss)
    mp.step()
    return loss.detach()


@pytest.mark.usefixtures("fake_time")
def test_a_pending_auto_engine_adopts_the_policy_of_a_run_that_decided(tmp_path):
    """Issue 25: resuming a run whose auto chose bf16-mixed into MixedPrecision(model, opt, policy="auto") was
    refused as "the engine runs 'fp32'" while its own decision was pending. Both loads adopt the saved policy,
    say so, time nothing again and continue as an engine built under that policy."""
    first, _, _, _ = _first_step(FastUnderAutocast, "auto")
    assert str(first.policy) == "bf16-mixed"
    mixprec.save_checkpoint(tmp_path / "ck", first)
    state = {**first.state_dict(), "events": list(first.events)}
    x = torch.randn(4, 8)
    for load in (lambda mp: mixprec.load_checkpoint(tmp_path / "ck", mp), lambda mp: mp.load_state_dict(state)):
        engines = []
        for policy in ("auto", "bf16-mixed"):
            model = FastUnderAutocast()
            engines.append(mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy,
                                                  device="cpu"))
            load(engines[-1])
        resumed, reference = engines
        assert str(resumed.policy) == "bf16-mixed" and resumed.decision.startswith(
            "bf16-mixed as loaded: the saved run's decision (auto → bf16-mixed: measured on this model")
        assert torch.equal(_continue(resumed, x), _continue(reference, x))
        assert all(torch.equal(a, b) for a, b in zip(resumed.module.parameters(), reference.module.parameters()))
        assert [e["kind"] for e in resumed.events] == ["auto"] and str(resumed.policy) == "bf16-mixed"


@pytest.mark.usefixtures("fake_time")
def test_a_pending_auto_engine_refuses_another_policy_naming_the_pending_decision(tmp_path):
    torch.manual_seed(0)
    model = FastUnderAutocast()
    chosen = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed", device="cpu")
    mixprec.save_checkpoint(tmp_path / "ck", chosen)   # no auto decision in its events: nothing to adopt
    model = FastUnderAutocast()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    with pytest.raises(mixprec.CheckpointError, match="runs 'fp32' only until its policy='auto' decides .still"):
        mixprec.load_checkpoint(tmp_path / "ck", mp)
    with pytest.raises(ValueError, match="runs fp32 only until its policy='auto' decides"):
        mp.load_state_dict(chosen.state_dict())
    assert str(mp.policy) == "fp32" and mp.decision.startswith("auto: pending")
    mixprec.load_checkpoint(tmp_path / "ck", mp, adopt_policy=True)
    assert str(mp.policy) == "bf16-mixed" and mp.decision.startswith("bf16-mixed on cpu")


@pytest.mark.usefixtures("fake_time")
def test_a_candidate_failing_on_the_model_leaves_fp32():
    class NoBf16(SleepNet):
        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("no bf16 kernel for this op")
            return super().forward(x)

    model = NoBf16()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    with mp.autocast():
        mp.model(torch.randn(2, 8))   # the user's forward still runs, in fp32
    assert str(mp.policy) == "fp32" and "the trial failed on this model (RuntimeError: no bf16 kernel" in mp.decision


@pytest.mark.usefixtures("fake_time")
def test_a_deep_copy_of_the_pending_model_does_not_decide_for_the_engine():
    import copy

    model = FastUnderAutocast()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    teacher = copy.deepcopy(mp.module)       # as an EMA or a teacher is made
    teacher(torch.randn(2, 8))
    assert mp.decision.startswith("auto: pending") and not mp.events


@pytest.mark.usefixtures("fake_time")
@pytest.mark.parametrize("error", [ValueError, AssertionError, TypeError])
def test_a_candidate_failing_with_any_exception_type_leaves_fp32(error):
    # a model's own dtype check may raise anything: a ValueError is not "nothing to backpropagate" (which
    # fell back to the probe's bf16-mixed, so the first real forward raised), others escaped the trial
    class Fp32Only(SleepNet):
        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                raise error("this model needs fp32")
            return super().forward(x)

    model = Fp32Only()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    with mp.autocast():
        mp.model(torch.randn(2, 8))   # the user's forward runs, in fp32
    assert str(mp.policy) == "fp32"
    assert f"the trial failed on this model ({error.__name__}: this model needs fp32)" in mp.decision


@pytest.mark.usefixtures("fake_time")
def test_the_trial_inside_a_checkpointed_forward_keeps_out_of_its_saved_tensors():
    # the first training forward of mp.model inside a non-reentrant checkpoint runs the trial there: its
    # 14 steps' saved tensors went through the checkpoint's pack hook (CheckpointError at backward)
    # (fp32 wins here: a switch to bf16 inside the checkpointed call is a limit, docs in pending_auto)
    torch.manual_seed(0)
    model = SleepNet()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    x = torch.randn(4, 8, requires_grad=True)
    with mp.autocast():
        loss = mixprec.ops.checkpoint(mp.model, x).float().sum()
    mp.backward(loss)
    mp.step()
    assert str(mp.policy) == "fp32" and "measured on this model" in mp.decision and x.grad is not None


@pytest.mark.parametrize("median_ms", [[["fp32", 1.0], ["bf16-mixed", 2.0]], {"fp32": "1", "bf16-mixed": "2"},
                                       [[1], [2]], None])
def test_a_malformed_trial_file_is_timed_again_not_raised(tmp_path, median_ms):
    # an edited or foreign cache file: set() of a list of lists raised TypeError, strings failed in decision()
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    key = auto_policy.cache_key(model, (x,), {}, CPU, ("fp32", "bf16-mixed"))
    (tmp_path / f"auto-trial-{key}.json").write_text(json.dumps({"choice": "fp32", "median_ms": median_ms}))
    trial = choose(model, (x,), {}, CPU, ("fp32", "bf16-mixed"))
    assert not trial.cached and "measured on this model" in trial.decision("cpu")


def test_the_trial_backward_recomputes_a_torch_checkpoint_in_the_forwards_kernels():
    # the trial's backward ran outside planned_kernels: a torch.utils.checkpoint around attention recomputed in
    # torch's kernel where its forward ran the plan's (matmul here): CheckpointError, the trial "failed", fp32
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def attend(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.attend, x, use_reentrant=False).float().pow(2).mean()
    shape = torch.empty(2, 2, 8, 8)
    op_plan.forget()
    op_plan.pin({op_plan.plan_key(shape, shape, shape, is_causal=True, dtype=torch.bfloat16, grad=True): "matmul"},
                "cpu")
    try:
        times = auto_policy.time_candidates(Checkpointed(), (torch.randn(2, 8, 16),), {}, CPU, ("fp32", "bf16-mixed"))
    finally:
        op_plan.forget()
    assert len(times["bf16-mixed"]) == auto_policy.BLOCKS * auto_policy.STEPS


def test_a_noisy_trial_is_kept_in_this_process_only_and_says_so(tmp_path, monkeypatch):
    """A trial timed on a busy machine (block medians spreading above NOISY_SPREAD) is not written to disk, as the
    op plan and doctor never cache a noisy timing: a new user's busy-machine 3.95x for a tiny MLP had been kept."""
    monkeypatch.setattr(auto_policy, "NOISY_SPREAD", 0.99)   # every spread is >= 1: noisy, deterministically
    x = torch.randn(4, 8)
    first = choose(nn.Linear(8, 8), (x,), {}, CPU, ("fp32", "bf16-mixed"))
    assert first.noisy and not list(tmp_path.glob("auto-trial-*.json"))
    assert "noisy: a busy machine, not cached" in first.decision("cpu")
    assert choose(nn.Linear(8, 8), (x,), {}, CPU, ("fp32", "bf16-mixed")) is first   # this process keeps it
    auto_policy._MEMORY.clear()
    again = choose(nn.Linear(8, 8), (x,), {}, CPU, ("fp32", "bf16-mixed"))
    assert again is not first and not again.cached   # timed again, not read from a disk it never reached
