"""The divergence guard (and the engine's set_policy it escalates with), through the public API.

Each test trains a tiny regression net on the CPU for at most ~150 steps. The cases are issue 4's
"Must show" bullets for the guard, plus cases 1, 2 and 11 of shared/cases/cases.md.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import DivergenceError, Guard, MixedPrecision
from mixprec.engine.loss_scale import DynamicLossScale
from engine_loops import _linear, _one_step


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run faster (and steadier on a loaded machine) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Growing(nn.Linear):
    """A linear whose effective weight is ``weight * gain``: set ``gain`` to make it "grow"."""

    gain = 1.0

    def forward(self, x):
        return F.linear(x, self.weight * self.gain, self.bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.hot = Growing(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.norm(self.hot(self.act(self.inp(x)))))


def batches(n, seed=1):
    """y = tanh(x·w / 4) + noise (std 0.1): the validation loss floor is about 0.01."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append({"x": x, "y": torch.tanh(x @ w / 4) + 0.1 * torch.randn(32, 1, generator=g)})
    return out


def loss_fn(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"].float())


def build(policy="bf16-mixed", guard=None, **kwargs):
    torch.manual_seed(0)
    model = Net()
    return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), policy=policy, device="cpu",
                          guard=guard, **kwargs)


def train(mp, data, before_step=None, scale_loss_at=None):
    """``before_step(i, batch)`` may corrupt step i (1-based); ``scale_loss_at = (i, factor)``."""
    results = []
    for i, batch in enumerate(data, start=1):
        if before_step is not None:
            before_step(i, batch)
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = loss_fn(mp.model, batch)
        if scale_loss_at is not None and i == scale_loss_at[0]:
            loss = loss * scale_loss_at[1]
        mp.backward(loss)
        results.append(mp.step())
    return results


def val_loss(mp):
    with torch.no_grad(), mp.autocast():
        return sum(float(loss_fn(mp.model, mp.cast_inputs(b))) for b in batches(8, seed=99)) / 8


def nan_in_x(at):
    def corrupt(i, batch):
        if (i == at) if isinstance(at, int) else (i >= at.start):
            batch["x"][3, 5] = float("nan")
    return corrupt


# ---------------------------------------------------------------- rollback + skip (case 1, bf16)
def test_nan_batch_at_step_k_is_dropped_without_a_rollback_and_the_run_ends_near_a_clean_run():
    # The engine skips the NaN step: nothing is applied, so the guard drops the batch and keeps the state (a
    # rollback to the snapshot of applied step 61 threw away 8 healthy updates for one bad batch).
    k = 70
    clean = build()
    train(clean, batches(120))
    mp = build(guard=Guard(snapshot_every=20, loss_fn=loss_fn))
    seen = {}

    def corrupt_and_keep(i, batch):
        nan_in_x(k)(i, batch)
        if i == k:
            seen["before"] = [p.detach().clone() for p in mp.module.parameters()]
    results = train(mp, batches(k), before_step=corrupt_and_keep)
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], mp.module.parameters()))   # state as it was

    bad = results[k - 1]
    assert not bad.rolled_back and not bad.applied and bad.skipped_reason == "nonfinite" and bad.step == k - 1
    (event,) = mp.events
    assert (event["step"], event["kind"], event["cause"], event["module"]) == (k, "skip", "nonfinite", "inp")
    assert "the batch itself holds nan (first read by 'inp' (Linear))" in event["detail"]
    assert "dropped; nothing was applied, so no rollback" in event["detail"]
    results += train(mp, batches(120)[k:])
    assert (mp.boundaries, mp.applied_steps, mp.skipped_total) == (120, 119, 1)
    assert all(r.applied for r in results[k:])  # training continues
    # stated tolerance: losing 1 of 120 updates moves the validation loss by under 10 %
    clean_loss, guarded_loss = val_loss(clean), val_loss(mp)
    assert math.isfinite(guarded_loss)
    assert abs(guarded_loss - clean_loss) / clean_loss < 0.10


def test_a_second_nan_step_in_a_row_rolls_back_even_without_a_loss_fn():
    # Without loss_fn the guard cannot tell data from state: the first non-finite step is dropped, the second in
    # a row suggests the state and rolls back to the snapshot.
    mp = build(guard=Guard(snapshot_every=20, escalate_after=3))
    results = train(mp, batches(45), before_step=lambda i, batch: (nan_in_x(i)(i, batch) if i in (41, 42) else None))
    assert [(e["step"], e["kind"], e.get("to_step")) for e in mp.events] == [(41, "skip", None), (42, "rollback", 21)]
    assert mp.guard.state.failures_here == 2   # the drop counted at the place too
    assert not results[40].rolled_back and results[41].rolled_back
    assert (mp.boundaries, mp.applied_steps) == (45, 24)   # 21 restored, then steps 43-45


# ---------------------------------------------------------------- a layer that overflows fp16 later (case 11)
def test_layer_that_outgrows_fp16_is_localised_and_kept_in_fp32_and_the_run_finishes():
    k = 30

    def run(guard):
        mp = build("fp16-mixed", guard=guard, max_stuck_skips=5)

        def grow_at_k(i, batch):
            if i == k:
                mp.model.hot.gain = 3e5   # max |w·gain| ~ 37500 still fits fp16; the outputs (~4e5) do not
        return mp, grow_at_k

    # without the guard: every step from k has a non-finite loss (the forward overflows fp16), which
    # loss scaling cannot fix; the engine's stuck check stops the run after 5 such steps
    plain, grow_plain = run(None)
    with pytest.raises(DivergenceError, match=r"5 consecutive steps with a non-finite loss.*loss scaling cannot fix"):
        train(plain, batches(80), before_step=grow_plain)
    assert plain.boundaries >= k + 3 and plain.applied_steps <= k - 1   # skipped every step from k, then died

    guard = Guard(snapshot_every=10, loss_fn=loss_fn)
    mp, grow_guarded = run(guard)
    results = train(mp, batches(80), before_step=grow_guarded)
    kinds = [(e["step"], e["kind"], e["module"]) for e in mp.events]
    assert kinds == [(k, "skip", "hot"), (k + 1, "rollback", "hot"),
                     (k + 1, "escalate", "hot")]   # the first non-finite step in a row only drops its batch
    first = mp.events[0]["detail"]
    assert "'hot' (Growing) produced inf in fp16 from finite inputs" in first
    assert "above fp16's max 65504: an overflow" in first
    assert mp.policy.keep_fp32 == ("hot",) and mp.policy.compute_dtype == torch.float16  # only 'hot' left fp16
    assert mp.events[2]["from"] == "fp16-mixed" and "keep_fp32=hot" in mp.events[2]["to"]
    assert results[k].escalated and results[k].rolled_back   # step k + 1
    assert all(r.applied for r in results[k + 1:])       # the run finishes, every later step applies
    assert math.isfinite(float(mp.last_loss)) and float(mp.last_loss) < 0.1
    assert guard.counts["nonfinite"] == 2 and guard.counts["escalate"] == 1


# ---------------------------------------------------------------- persistent NaN: the ladder ends in an error
def test_nan_in_every_batch_raises_after_max_rollbacks_naming_the_module():
    mp = build(guard=Guard(snapshot_every=5, max_rollbacks=3, loss_fn=loss_fn))
    with pytest.raises(DivergenceError) as err:
        train(mp, batches(40), before_step=nan_in_x(range(11, 40)))
    msg = str(err.value)
    assert msg.startswith("mixprec.Guard gave up at step 14 (6 applied): nonfinite")
    assert "the batch itself holds nan (first read by 'inp' (Linear))" in msg
    assert "Tried: 3 rollback(s) or dropped batch(es) at the snapshot of applied step 6" in msg
    assert "escalations: none: the batch itself holds non-finite values" in msg    # data: no precision change
    assert [e["kind"] for e in mp.events] == ["skip"] + ["rollback"] * 2 + ["diverged"]   # step 11: dropped
    assert str(mp.policy) == "bf16-mixed"


class NaNAfter(nn.Module):
    """log(x - 100): NaN in every precision once ``on`` is set."""

    on = False

    def forward(self, x):
        return torch.log(x - 100.0) if self.on else x


def test_nan_source_in_every_precision_climbs_the_whole_ladder_then_raises():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(16, 8))
    model.add_module("bad", NaNAfter())
    model.add_module("head", nn.Linear(8, 1))
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="fp16-mixed", device="cpu",
                        guard=Guard(escalate_after=1, max_rollbacks=4, snapshot_every=5, loss_fn=loss_fn))

    def switch_on(i, batch):
        model.bad.on = i >= 8

    with pytest.raises(DivergenceError) as err:
        train(mp, batches(30), before_step=switch_on)
    msg = str(err.value)
    assert "'bad' (NaNAfter) produced nan" in msg and "non-finite in fp32 too: not a range problem" in msg
    ladder = [mixprec.Policy.parse("fp16-mixed,keep_fp32=bad")]
    if mixprec.probe("cpu").bf16:           # fp16 → bf16 only where the device runs bf16
        ladder.append(mixprec.Policy.parse("bf16-mixed,keep_fp32=bad"))
    ladder.append(mixprec.Policy.parse("fp32"))
    escalations = [e for e in mp.events if e["kind"] == "escalate"]
    assert [mixprec.Policy.parse(e["to"]) for e in escalations] == ladder
    assert "Tried: 4 rollback(s)" in msg and "none: the policy is fp32 already" in msg
    assert mp.events[-1]["kind"] == "diverged" and mp.events[-1]["module"] == "bad"


# ---------------------------------------------------------------- fp16 stuck at the floor (case 2)
def test_gradients_overflowing_at_the_scale_floor_escalate_fp16_to_bf16():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)

    def big_loss(m, x):
        return 1e5 * m(x).sum()   # d loss / d out = 1e5 > fp16 max at any scale >= 1

    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-6), device="cpu", policy="fp16-mixed",
                        loss_scale=DynamicLossScale(init_scale=4.0, min_scale=1.0),
                        guard=Guard(loss_fn=big_loss))
    x = torch.randn(2, 4)
    results = []
    for _ in range(6):
        xb = mp.cast_inputs(x)
        with mp.autocast():
            loss = big_loss(mp.model, xb)
        mp.backward(loss)
        results.append(mp.step())
    assert [r.skipped_reason for r in results[:3]] == ["overflow"] * 3
    assert [e["kind"] for e in mp.events] == ["skip", "skip", "escalate"]   # no healthy step yet: nothing to restore
    assert mp.events[0]["cause"] == "overflow" and "at its floor 1" in mp.events[0]["detail"]
    # the engine casts the model's output to fp32; casting its gradient back to fp16 overflows
    assert "backward: the model (Linear) turned a finite fp32 gradient" in mp.events[1]["detail"]
    assert mp.events[2]["module"] == "" and "fp16 → bf16" in mp.events[2]["detail"]   # "": the model itself
    assert mp.policy == mixprec.Policy.parse("bf16-mixed") and not mp.loss_scale.enabled
    assert all(r.applied for r in results[3:])


# ---------------------------------------------------------------- loss spikes
def test_a_loss_spike_is_rolled_back_counted_and_the_run_continues():
    k = 40
    guard = Guard(snapshot_every=10, spike_warmup=10, loss_fn=loss_fn)
    mp = build(guard=guard)
    results = train(mp, batches(60), scale_loss_at=(k, 50.0))
    (event,) = mp.events
    assert (event["step"], event["kind"], event["cause"], event["module"]) == (k, "rollback", "spike", None)
    assert "x the running mean" in event["detail"]
    assert guard.counts["spike"] == 1 and guard.counts["rollback"] == 1
    assert results[k - 1].rolled_back and results[k - 1].step == 31
    assert all(r.applied for r in results[k:]) and mp.applied_steps == 60 - 9
    assert math.isfinite(val_loss(mp))


def test_a_spike_in_the_first_micro_batch_of_an_accumulated_step_is_seen():
    """The guard judges the step's loss (mean over its micro-batches), not the last micro-batch's."""
    guard = Guard(snapshot_every=10, spike_warmup=10)
    mp = build(guard=guard, accumulation_steps=2)
    data = batches(60)
    for i in range(30):
        for j, batch in enumerate(data[2 * i:2 * i + 2]):
            with mp.autocast():
                loss = loss_fn(mp.model, mp.cast_inputs(batch))
            if (i, j) == (20, 0):
                loss = loss * 50.0          # only the first micro-batch of boundary 21 spikes
            mp.backward(loss)
            mp.step()
    assert [(e["step"], e["cause"]) for e in mp.events] == [(21, "spike")]
    assert float(mp.boundary_loss) < 0.5


def test_zscore_spike_rule():
    guard = Guard(snapshot_every=10, spike_window=10, spike_warmup=10, spike_factor=None, spike_zscore=4.0)
    mp = build(guard=guard)
    train(mp, batches(40), scale_loss_at=(30, 3.0))
    assert [(e["step"], e["cause"]) for e in mp.events] == [(30, "spike")]
    assert "standard deviations above the running mean" in mp.events[0]["detail"]


def test_check_every_reads_the_loss_only_on_check_steps():
    def spike_at(k):
        mp = build(guard=Guard(snapshot_every=100, check_every=4, spike_warmup=5))
        train(mp, batches(30), scale_loss_at=(k, 50.0))
        return [(e["step"], e["cause"]) for e in mp.events]

    assert spike_at(26) == []                # 26 is not a multiple of 4: not read, not seen
    assert spike_at(28) == [(28, "spike")]


# ---------------------------------------------------------------- cost: nothing when off, no effect when healthy
def test_guard_off_adds_nothing_and_on_a_healthy_run_changes_nothing():
    def hooks(model):
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    off = build()
    on = build(guard=Guard(snapshot_every=5, loss_fn=loss_fn))
    assert hooks(off.model) == hooks(on.model)           # the guard installs no hook
    train(off, batches(30))
    train(on, batches(30))
    assert off.step_batches == () and off.guard is None and off.events == []
    assert on.events == [] and on.step_batches == ()     # batches are let go at each boundary
    assert hooks(on.model) == hooks(off.model)
    for a, b in zip(off.model.parameters(), on.model.parameters()):
        assert torch.equal(a, b)                           # bit for bit: the guard only reads


def test_one_guard_watches_one_engine():
    guard = Guard()
    a, b = build(guard=guard), build(guard=guard)
    train(a, batches(1))
    with pytest.raises(RuntimeError, match="already watched another MixedPrecision engine"):
        train(b, batches(1))


def test_guard_state_dict_round_trips_every_field():
    guard = Guard(snapshot_every=5, spike_warmup=5)
    train(build(guard=guard), batches(12), scale_loss_at=(11, 50.0))
    fresh = Guard()
    fresh.load_state_dict(guard.state_dict())
    assert fresh.config == guard.config and fresh.state == guard.state and fresh.counts["spike"] == 1
    with pytest.raises(ValueError, match="state keys"):
        fresh.load_state_dict({"config": {}, "state": {"counts": {}}})


# ---------------------------------------------------------------- engine: set_policy mid-run
@pytest.mark.parametrize("start,end,optimizer", [
    ("fp16-pure", "bf16-pure", torch.optim.AdamW),     # masters kept exactly, scale dropped
    ("bf16-pure", "fp32", torch.optim.AdamW),          # the masters become the params
    ("fp32", "bf16-pure", torch.optim.AdamW),
    ("bf16-kahan", "fp32", mixprec.optim.AdamW),       # Kahan compensation folded into the params
    ("bf16-mixed", "bf16-kahan", mixprec.optim.AdamW),
])
def test_set_policy_keeps_values_and_optimizer_state(start, end, optimizer):
    mp = build(start, max_grad_norm=1.0) if optimizer is torch.optim.AdamW else None
    if mp is None:
        torch.manual_seed(0)
        model = Net()
        mp = MixedPrecision(model, optimizer(model.parameters(), lr=3e-3), policy=start, device="cpu")
    opt = mp.optimizer
    train(mp, batches(4))
    stepped = list(mp.master_parameters())
    values_fp32 = [t.detach().float() + (opt.state[t]["kahan_comp"].float() if "kahan_comp" in opt.state[t] else 0)
                   for t in stepped]
    moments = [opt.state[t]["exp_avg"].float().clone() for t in stepped]
    event = mp.set_policy(end, cause="test", module=None)

    assert mp.policy == mixprec.Policy.parse(end) and mp.events[-1] is event
    assert (event["kind"], event["from"], event["step"]) == ("set_policy", str(mixprec.Policy.parse(start)), 4)
    now = list(mp.master_parameters())
    assert all(t.dtype == torch.float32 or end != "fp32" for t in now)
    for t, value_fp32, m in zip(now, values_fp32, moments):
        assert torch.equal(t.float(), value_fp32.to(t.dtype).float())      # exact when t is fp32
        assert torch.equal(opt.state[t]["exp_avg"].float(), m)             # fp32 state: carried unchanged
        if end == "bf16-kahan":   # the compensation starts with what the cast lost (not at zero)
            assert torch.equal(opt.state[t]["kahan_comp"], (value_fp32 - t.float()).to(t.dtype))
            off = (t.float() + opt.state[t]["kahan_comp"].float() - value_fp32).abs()
            assert bool((off <= (value_fp32 - t.float()).abs() * 2.0 ** -8).all())   # the residual's own bf16 rounding
        else:
            assert "kahan_comp" not in opt.state[t]
    assert {p.dtype for p in mp.model.parameters()} == {mixprec.Policy.parse(end).param_dtype}
    applied = mp.applied_steps
    results = train(mp, batches(3, seed=5))
    assert all(r.applied for r in results) and mp.applied_steps == applied + 3


def test_set_policy_refuses_mid_accumulation_and_bad_policies_without_changing_anything():
    mp = build("fp16-mixed", accumulation_steps=2)
    batch = mp.cast_inputs(batches(1)[0])
    with mp.autocast():
        mp.backward(loss_fn(mp.model, batch))
    assert mp.step() is None
    with pytest.raises(RuntimeError, match=r"set_policy\(\) called after 1 micro-batch\(es\) of backward\(\)"):
        mp.set_policy("bf16-mixed")
    with mp.autocast():
        mp.backward(loss_fn(mp.model, batch))
    mp.step()
    before = [p.detach().clone() for p in mp.model.parameters()]
    with pytest.raises(ValueError, match=r"keep_fp32 patterns \['nope'\] match no module"):
        mp.set_policy("fp16-mixed,keep_fp32=nope")
    with pytest.raises(ValueError, match=r"would keep its state in .*bfloat16"):
        mp.set_policy("params=bf16,compute=bf16")    # a torch optimizer on 16-bit params, no masters
    assert str(mp.policy) == "fp16-mixed" and mp.events == []
    assert all(torch.equal(a, b) for a, b in zip(before, mp.model.parameters()))


# ================================================================ case 1 with the guard


def test_case01_guard_names_the_bad_batch_and_does_not_escalate_for_it():
    loss_fn = lambda model, batch: model(batch).float().sum()   # noqa: E731
    model = _linear(4, 3)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed", device="cpu",
                        guard=Guard(loss_fn=loss_fn, max_rollbacks=2))
    x = torch.randn(2, 4)
    x[1, 2] = float("nan")
    with pytest.raises(DivergenceError, match=r"first non-finite: the batch itself holds nan"):
        for _ in range(50):
            _one_step(mp, x)
    assert [e["kind"] for e in mp.events] == ["skip", "skip", "diverged"]   # the first: dropped
    assert mp.guard.state.escalations[-1] == "none: the batch itself holds non-finite values"


def test_a_layer_overflowing_on_every_other_batch_is_still_kept_in_fp32():
    """Each non-finite step is the first in a row (a healthy one between), so each only drops its batch; the drops
    still count at the place: the second escalates ('hot' kept in fp32), as consecutive failures do. Before
    counting them, half the batches were dropped for the whole run and nothing escalated."""
    mp = build("fp16-mixed", guard=Guard(snapshot_every=100, loss_fn=loss_fn))

    def flaky(i, batch):
        mp.model.hot.gain = 3e5 if i >= 10 and i % 2 == 0 and "hot" not in mp.policy.keep_fp32 else 1.0
    results = train(mp, batches(30), before_step=flaky)
    kinds = [(e["step"], e["kind"]) for e in mp.events]
    assert kinds == [(10, "skip"), (12, "skip"), (12, "escalate")]
    assert mp.policy.keep_fp32 == ("hot",) and all(r.applied for r in results[12:])


def test_max_rollbacks_0_raises_at_the_first_failure_even_a_dropped_one():
    mp = build(guard=Guard(snapshot_every=5, max_rollbacks=0, loss_fn=loss_fn))
    with pytest.raises(DivergenceError, match="gave up at step 8"):
        train(mp, batches(12), before_step=nan_in_x(8))


def test_a_guard_state_saved_before_nonfinite_streak_existed_loads_and_a_foreign_one_is_refused():
    """Checkpoints written before the drop rule carry no nonfinite_streak: they were refused (after the engine had
    loaded). The missing field starts at 0; an unknown key is still refused, before a checkpoint load changes
    anything."""
    guard = Guard(snapshot_every=7)
    old = guard.state_dict()
    del old["state"]["nonfinite_streak"]
    again = Guard()
    again.load_state_dict(old)
    assert again.state.nonfinite_streak == 0 and again.config.snapshot_every == 7
    old["state"]["made_up"] = 1
    with pytest.raises(ValueError, match="do not match"):
        Guard.check_state_dict(old)
