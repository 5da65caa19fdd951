"""``MixedPrecision(..., memory_budget=...)`` (issue 27): one training step's peak live tensor bytes measured against
the budget; over it a warning, an event and the fixes; with headroom the engine's own attention allowance (half the
headroom over the step's planned calls), the measured keys chosen again from their measurement, the choice's MiB
per call and per step said. Timings are planted through the plan's cache file (no wall-clock dependence); saved
bytes are asserted against each candidate graph's tensors, element by element."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace

import pytest
import torch

from mixprec.autocast import kernel_timing, op_plan, plan_verdict
from mixprec.autocast.saved_allowance import ENV, CallCounter, mib_words, scoped_allowance
from mixprec.engine.memory_budget import SHARE, size_words
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.machine.cache import machine_key
from mixprec.memory.saved import saved_bytes
from mixprec.programs.session import precision_optimizer, train_step
from mixprec.policy.resolve import resolve_policy
from mixprec.workloads.gpt import GPT_CONFIGS, GPTWorkload

MIB = 2**20
CONFIG = replace(GPT_CONFIGS["baby"], batch_size=2)
B, H, T, D = 2, CONFIG.n_head, CONFIG.block_size, CONFIG.n_embd // CONFIG.n_head


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", math.inf)
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 0.0)   # and rounds that disagree
    op_plan.forget()
    yield
    op_plan.forget()


def _saved_per_call() -> dict[str, int]:
    """Bytes each candidate keeps for bf16 q, k, v of (B, H, T, D), causal (tests/autocast/test_op_plan_memory.py's
    arithmetic): fused q, k, v, out + fp32 logsumexp; fused-fp32 their fp32 copies; matmul q·scale, k, v, the
    bool causal mask, fp32 and bf16 probabilities."""
    n, rows, probs = B * H * T * D, B * H * T, B * H * T * T
    return {"fused": 4 * n * 2 + rows * 4, "fused-fp32": 4 * n * 4 + rows * 4,
            "matmul": 3 * n * 2 + T * T + probs * (4 + 2)}


def _plant(tmp_path, times: dict[str, float]) -> str:
    """A cache file holding the training key's timings (and the saved bytes above): nothing is timed."""
    q = torch.empty(B, H, T, D)
    key = op_plan.plan_key(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)
    value = {"chosen": "fused", "times_ms": times, "note": "", "saved_bytes": _saved_per_call()}
    (tmp_path / f"op-plan-{machine_key(torch.device('cpu'))}.json").write_text(json.dumps({key: value}))
    return key


MATMUL_FASTER = {"fused": 2.0, "fused-fp32": 4.0, "matmul": 1.0}
FUSED_FASTEST = {"fused": 1.0, "fused-fp32": 4.0, "matmul": 2.0}


def _engine(budget, policy: str = "bf16-mixed") -> tuple[MixedPrecision, GPTWorkload]:
    workload = GPTWorkload(CONFIG)
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = precision_optimizer(workload.make_optimizer(model), resolve_policy(policy, "cpu"))
    return MixedPrecision(model, optimizer, policy, device="cpu", memory_budget=budget), workload


def _steps(mp: MixedPrecision, workload: GPTWorkload, n: int) -> None:
    batches = workload.batches("train", 0)
    for _ in range(n):
        train_step(mp, workload, next(batches))


def _forward_saved(mp: MixedPrecision, workload: GPTWorkload) -> int:
    """Bytes a training forward of ``mp``'s model saves for backward, parameters left out."""
    batch = mp.cast_inputs(next(workload.batches("train", 0)))
    with mp.autocast():
        loss, saved = saved_bytes(lambda: workload.loss(mp.model, batch), exclude=list(mp.model.parameters()))
    del loss
    return saved.total


def _budget_events(mp: MixedPrecision) -> list:
    return [e for e in mp.events if e.kind == "memory-budget"]


def test_without_a_budget_nothing_changes():
    mp, workload = _engine(None)
    assert "memory_budget" not in mp.decision
    _steps(mp, workload, 3)
    assert _budget_events(mp) == [] and mp.state_dict()["memory_budget"] is None


def test_a_budget_that_changes_no_kernel_trains_bit_for_bit_as_none(tmp_path):
    """The measured step (under the profiler) and the scoped allowance change no numerics: fused stays fastest."""
    _plant(tmp_path, FUSED_FASTEST)
    plain, workload = _engine(None)
    _steps(plain, workload, 3)
    budget, workload = _engine("1TiB")
    assert "memory_budget 1 TiB: pending" in budget.decision
    _steps(budget, workload, 3)
    (event,) = _budget_events(budget)
    assert event.cause == "measured" and "every training key stays fused" in budget.decision
    for a, b in zip(plain.module.parameters(), budget.module.parameters()):
        assert torch.equal(a, b)


def test_a_large_budget_lets_the_faster_kernel_save_more_and_says_its_mib(tmp_path):
    key = _plant(tmp_path, MATMUL_FASTER)
    mp, workload = _engine("1TiB")
    fused_saved = _forward_saved(mp, workload)          # the default allowance: fused, as torch.autocast
    _steps(mp, workload, 2)                             # the second step is measured; the decision after it
    (event,) = _budget_events(mp)
    state = mp.state_dict()["memory_budget"]
    n_layer, saved = CONFIG.n_layer, _saved_per_call()
    extra = saved["matmul"] - saved["fused"]
    assert event.cause == "measured" and state["calls"] == n_layer    # one planned call per layer and step
    assert state["budget_bytes"] == 2**40 and 0 < state["peak_bytes"] < 2**40
    assert state["allowed_mib"] == (2**40 - state["peak_bytes"]) * SHARE / n_layer / MIB
    assert (f"{key} -> matmul ({mib_words(extra, signed=True)} per call x {n_layer} calls = "
            f"{mib_words(extra * n_layer, signed=True)} per step)") in event.detail
    assert f"{key} -> matmul ({mib_words(extra, signed=True)} per call)" in mp.decision
    assert f"peak {size_words(state['peak_bytes'])}, headroom {size_words(2**40 - state['peak_bytes'])}" in mp.decision
    # from the next step on the model saves more, by the candidate's figure per layer (+ the q third of the shared
    # qkv projection that matmul's saved k and v keep alive in the model: 2·B·H·T·D bytes, docs/op-plan.md)
    assert _forward_saved(mp, workload) - fused_saved == n_layer * (extra + 2 * B * H * T * D)
    # another engine in the process, without a budget, still runs fused at the same key: nothing leaked
    other, _ = _engine(None)
    assert _forward_saved(other, workload) == fused_saved
    _steps(mp, workload, 1)                              # measured once only
    assert len(_budget_events(mp)) == 1


def test_a_budget_below_the_peak_warns_records_and_keeps_fused(tmp_path):
    _plant(tmp_path, MATMUL_FASTER)
    mp, workload = _engine("1MiB")                      # the fp32 params alone take 3.1 MiB
    fused_saved = _forward_saved(mp, workload)
    with pytest.warns(RuntimeWarning, match=r"memory_budget 1 MiB: peak .* MiB is .* MiB OVER the budget"):
        _steps(mp, workload, 2)
    (event,) = _budget_events(mp)
    state = mp.state_dict()["memory_budget"]
    over = size_words(state["peak_bytes"] - 2**20)
    assert event.cause == "over" and state["allowed_mib"] == 0.0
    assert f"is {over} OVER the budget" in mp.decision and 'recompute="auto"' in mp.decision
    assert "a smaller batch" in mp.decision
    assert _forward_saved(mp, workload) == fused_saved


def test_the_state_carries_the_decision_and_a_load_reapplies_it_unmeasured(tmp_path):
    _plant(tmp_path, MATMUL_FASTER)
    mp, workload = _engine("1TiB")
    fused_saved = _forward_saved(mp, workload)
    _steps(mp, workload, 2)
    state = mp.state_dict()
    resumed, _ = _engine(None)
    resumed.load_state_dict(state)
    (event,) = _budget_events(resumed)
    assert event.cause == "loaded" and resumed.state_dict()["memory_budget"] == state["memory_budget"]
    assert "memory_budget 1 TiB (loaded):" in resumed.decision
    assert _forward_saved(resumed, workload) == _forward_saved(mp, workload) > fused_saved
    _steps(resumed, workload, 3)                         # never measured again
    assert [e.cause for e in _budget_events(resumed)] == ["loaded"]
    # a checkpoint's event log alone (the local and DCP formats carry events) re-applies it too
    from_events, _ = _engine(None)
    from_events.load_state_dict({**state, "memory_budget": None, "events": [e.to_dict() for e in mp.events]})
    assert from_events.state_dict()["memory_budget"] == state["memory_budget"]
    resumed.load_state_dict(resumed.state_dict())        # the same decision again (a guard's rollback): nothing new
    assert [e.cause for e in _budget_events(resumed)] == ["loaded"] and resumed.decision.count("memory_budget") == 1


def test_a_checkpoint_carries_the_decision(tmp_path):
    import mixprec
    _plant(tmp_path, MATMUL_FASTER)
    mp, workload = _engine("1TiB")
    _steps(mp, workload, 2)
    mixprec.save_checkpoint(tmp_path / "run", mp)
    resumed, _ = _engine(None)
    mixprec.load_checkpoint(tmp_path / "run", resumed)
    assert resumed.state_dict()["memory_budget"] == mp.state_dict()["memory_budget"]
    assert _budget_events(resumed)[-1].cause == "loaded" and "memory_budget 1 TiB (loaded):" in resumed.decision
    assert _forward_saved(resumed, workload) == _forward_saved(mp, workload)


@pytest.mark.parametrize("bad, error, words", [
    ("lots", ValueError, "memory_budget='lots' is not a memory size"),
    (-5, ValueError, "memory_budget=-5 is not a memory size"),
    (4.5e9, TypeError, "memory_budget=4500000000.0: allowed are None"),
    (True, TypeError, "memory_budget=True: allowed are None"),
])
def test_a_bad_budget_is_refused_by_name(bad, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        _engine(bad)


def test_the_scoped_allowance_is_per_thread_and_wins_over_the_process_one(tmp_path):
    """What keeps one engine's budget out of another's lookups: the scope holds in its own thread only."""
    _plant(tmp_path, MATMUL_FASTER)
    q = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)

    def chosen() -> str:
        return op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True).chosen
    seen = {}
    with scoped_allowance(None):
        assert chosen() == "matmul"
        other = threading.Thread(target=lambda: seen.setdefault("other", chosen()))
        other.start()
        other.join()
        with op_plan.allow_extra_saved(0):
            assert chosen() == "matmul"
    assert seen["other"] == "fused" and chosen() == "fused"
    with op_plan.allow_extra_saved(None), scoped_allowance(0):
        assert chosen() == "fused"


def test_the_call_counter_counts_planned_training_lookups():
    q = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
    counter = CallCounter()
    op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)   # before start: not counted
    counter.start()
    for _ in range(3):
        entry = op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)
    op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=False)  # no backward follows: nothing saved
    counter.stop()
    op_plan.choose(q, q, q, is_causal=True, dtype=torch.bfloat16, grad=True)
    assert dict(counter.counts) == {entry.shape: 3}


def test_an_engine_dropped_inside_its_measured_step_stops_the_profiler_and_the_next_engine_measures(tmp_path):
    """`del mp` between the measured step's forward and its boundary left the CPU profiler recording: every later
    budget in the process read "deferred ... a profiler session was recording"."""
    _plant(tmp_path, FUSED_FASTEST)
    mp, workload = _engine("8GiB")
    _steps(mp, workload, 1)
    batch = mp.cast_inputs(next(workload.batches("train", 1)))
    with mp.autocast():   # the second training step's first scope: the measured window opens
        loss = workload.loss(mp.model, batch)
    assert torch.autograd._profiler_enabled()   # the meter's own session
    del mp, loss
    assert not torch.autograd._profiler_enabled()
    again, workload = _engine("8GiB")
    _steps(again, workload, 2)
    (event,) = _budget_events(again)
    assert event.cause == "measured" and again.state_dict()["memory_budget"]["peak_bytes"] > 0


def test_a_measured_step_that_raises_ends_its_window_and_the_next_step_is_measured(tmp_path):
    """The exception kept by the caller (a retry loop's last error) holds the engine: the finalizer cannot run, so
    the window must end where the exception leaves the engine's scope."""
    _plant(tmp_path, FUSED_FASTEST)
    mp, workload = _engine("8GiB")
    _steps(mp, workload, 1)
    batch = mp.cast_inputs(next(workload.batches("train", 1)))
    kept = None
    try:
        with mp.autocast():
            workload.loss(mp.model, batch)
            raise ValueError("a bad batch")
    except ValueError as err:
        kept = err
    assert kept is not None and not torch.autograd._profiler_enabled() and not _budget_events(mp)
    _steps(mp, workload, 1)   # the next step is the measured one
    (event,) = _budget_events(mp)
    assert event.cause == "measured" and event.step == 2   # the failed step reached no boundary
