"""A module kept in fp32 mid-run under FSDP2 (issue 28: the guard's first rung, ``set_policy`` with ``keep_fp32``
added): the FSDP2 unit holding it is resharded in place (:mod:`mixprec.distributed.sharded_units`).

2 gloo ranks, a model with three blocks (``blocks.N``: a ``Linear(64, 64)`` of 4096 elements, so 8-bit state
quantizes it, and a GELU), each its own FSDP2 unit, between an input and a head layer owned by the root unit.
Every rank gets the same batch, so the reduced gradient is one process's exactly (tests/distributed/test_fsdp2_quantized.py).

* After one step, ``set_policy(policy + keep_fp32=blocks.1)``, three more steps: the params (dtypes and values)
  and every optimizer state tensor equal, bit for bit, one process that ran the same step, ``set_policy`` and
  steps — for ``bf16-mixed`` (fp32 storage, bf16 all-gather: the unit now all-gathers fp32), ``bf16-lean`` (bf16
  storage, SR, 8-bit state: the unit is re-stored in fp32 from its bf16 values) and ``bf16-kahan`` (its
  compensation folded into the fp32 value as one process folds it). The block's params are fp32 on every rank,
  the event names the unit resharded.
* A DCP checkpoint after the escalation resumes under the escalated policy (``keep_fp32`` re-applied at build):
  two more steps equal the uninterrupted run bit for bit.
* A module that shares the root unit with other 16-bit stored params is refused under bf16-lean, named; under
  bf16-mixed the root unit all-gathers fp32 as a whole and the note says so.
* The guard's ladder under FSDP2 (:func:`mixprec.guard.next_policy` with ``sharded=True``): a named module is
  kept in fp32 (rung 1), the dtype rungs are still skipped, named.
* The guard under FSDP2: ``blocks.1.0``'s output turns inf on rank 1 only; every rank re-runs its batch forward,
  they agree on the module, keep it in fp32 and continue like one process (bf16-mixed, bf16-lean).
* At 4 ranks the kept block's 5 rows are sharded 2, 2, 1 and 0: the re-stored fp32 shards (bf16-kahan, bf16-sr)
  still give one process's bits.
* The torch internals :func:`mixprec.distributed.sharded_units.param_group` relies on are still there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.optim
from mixprec import MixedPrecision, Policy
from mixprec import checkpoint as ckpt
from ranks import run_ranks
from test_fsdp2_quantized import _full, _step   # one step, one gather of a DTensor

POLICIES = ("bf16-mixed", "bf16-lean", "bf16-kahan")
KEPT = "blocks.1"
BEFORE, AFTER = 1, 3


class _Flaky(nn.Linear):
    """A Linear whose output turns inf while ``poisoned`` (the guard test's fault on one rank)."""

    poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * float("inf") if self.poisoned else y


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.ModuleList([nn.Sequential(_Flaky(64, 64), nn.GELU()) for _ in range(3)])
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _engine(policy: str, strategy: str | None) -> MixedPrecision:
    torch.manual_seed(0)   # also the optimizer's sr_seed on every rank
    model = _Net()
    return MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), policy,
                          device="cpu", strategy=strategy)


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(4, 16, generator=g), "y": torch.randn(4, 5, generator=g)}


def _snapshot(mp: MixedPrecision) -> dict:
    params = dict(mp.module.named_parameters())
    state = {f"{n}.{k}": _full(v) for n, p in params.items() for k, v in mp.optimizer.state[p].items()
             if torch.is_tensor(v) and k != "step"}
    return {"params": {n: _full(p) for n, p in params.items()}, "state": state}


def _kept(policy: str, kept: str = KEPT) -> str:
    p = Policy.parse(policy)
    return str(p.replace(keep_fp32=(*p.keep_fp32, kept)))


def _escalated_run(policy: str, strategy: str | None, tmp: Path | None = None) -> dict:
    mp, batch = _engine(policy, strategy), _batch()
    for _ in range(BEFORE):
        _step(mp, batch)
    event = mp.set_policy(_kept(policy), kind="escalate")
    for _ in range(AFTER):
        _step(mp, batch)
    out = {"event": event.detail, "policy": str(mp.policy), "snapshot": _snapshot(mp)}
    if tmp is not None:   # DCP after the escalation, then two more steps: the uninterrupted reference
        ckpt.save_checkpoint(tmp / policy.replace(",", "_"), mp)
        for _ in range(2):
            _step(mp, batch)
        out["continued"] = _snapshot(mp)
    return out


def _resumed(policy: str, tmp: Path) -> dict:
    mp, batch = _engine(_kept(policy), "fsdp2"), _batch()
    ckpt.load_checkpoint(tmp / policy.replace(",", "_"), mp)
    for _ in range(2):
        _step(mp, batch)
    return _snapshot(mp)


def _worker(rank: int, out: Path) -> dict:
    got = {policy: _escalated_run(policy, "fsdp2", out) for policy in POLICIES}
    for policy in POLICIES:
        got[policy]["resumed"] = _resumed(policy, out)
    return got


def _assert_equal(got: dict, want: dict, what: tuple) -> None:
    assert got["params"].keys() == want["params"].keys() and got["state"].keys() == want["state"].keys(), what
    for part in ("params", "state"):
        for name, value in want[part].items():
            g = got[part][name]
            assert g.dtype == value.dtype, (*what, part, name, g.dtype, value.dtype)
            assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g,
                               value.view(torch.uint8) if value.dtype.itemsize == 1 else value), (*what, part, name)


@pytest.mark.timeout(600)
def test_fsdp2_keep_fp32_mid_run_equals_one_process_and_resumes_from_dcp(tmp_path):
    ranks = run_ranks(_worker, tmp_path, world=2, timeout_s=400)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {policy: _escalated_run(policy, None) for policy in POLICIES}
    finally:
        torch.set_num_threads(threads)
    for policy, ref in refs.items():
        for r, got in enumerate(ranks):
            res = got[policy]
            assert res["policy"] == ref["policy"] == _kept(policy), (policy, r)
            assert f"kept {KEPT} in fp32 (its FSDP2 unit: {KEPT}" in res["event"], (policy, r, res["event"])
            assert res["snapshot"]["params"][f"{KEPT}.0.weight"].dtype == torch.float32, (policy, r)
            _assert_equal(res["snapshot"], ref["snapshot"], (policy, r))
            _assert_equal(res["resumed"], res["continued"], (policy, r, "resumed"))
        if policy != "bf16-mixed":   # 16-bit storage: the kept block is fp32, the others stay bf16
            assert ref["snapshot"]["params"]["blocks.0.0.weight"].dtype == torch.bfloat16, policy


# ---------------------------------------------------------------------- a module inside the root unit
def _root_worker(rank: int, out: Path) -> dict:
    lean, batch = _engine("bf16-lean", "fsdp2"), _batch()
    _step(lean, batch)
    before = _snapshot(lean)
    try:
        lean.set_policy(_kept("bf16-lean", "head"))
        refused = ""
    except ValueError as err:
        refused = str(err)
    after = _snapshot(lean)
    _step(lean, batch)   # training goes on under the policy it had
    return {"refused": refused, "lean_policy": str(lean.policy), "before": before, "after": after,
            "mixed": _escalated_root("fsdp2")}


def _escalated_root(strategy: str | None) -> dict:
    mp, batch = _engine("bf16-mixed", strategy), _batch()
    _step(mp, batch)
    with torch.no_grad(), mp.autocast():   # an evaluation forward: FSDP2 leaves the root unit unsharded
        mp.model(mp.cast_inputs(batch, keep=("y",))["x"])
    event = mp.set_policy(_kept("bf16-mixed", "head"), kind="escalate", module="head")
    for _ in range(AFTER):
        _step(mp, batch)
    return {"event": event.detail, "module": event.module, "snapshot": _snapshot(mp)}


@pytest.mark.timeout(300)
def test_fsdp2_keep_fp32_in_the_root_unit_escalates_the_unit_or_is_refused_under_16bit_storage(tmp_path):
    ranks = run_ranks(_root_worker, tmp_path, world=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _escalated_root(None)
    finally:
        torch.set_num_threads(threads)
    for r, got in enumerate(ranks):
        # bf16-lean: the root unit also holds inp's bf16-stored params; FSDP2 stores one dtype per unit
        assert "two dtypes" in got["refused"] and "'the root'" in got["refused"] and "inp.weight" in got["refused"], r
        assert got["lean_policy"] == str(Policy.parse("bf16-lean")), r
        _assert_equal(got["after"], got["before"], (r, "refused: nothing changed"))
        # bf16-mixed: the root unit all-gathers fp32 as a whole; inp still computes in bf16 under autocast
        mixed = got["mixed"]
        assert "kept head in fp32 (its FSDP2 unit: the root, all-gathered in fp32 from now; its other modules' " \
               "params (the root) all-gather fp32 too)" in mixed["event"], (r, mixed["event"])
        assert mixed["module"] == "head", r
        _assert_equal(mixed["snapshot"], ref["snapshot"], (r, "bf16-mixed root"))


# ---------------------------------------------------------------------- the guard's ladder, the torch internals
def test_next_policy_under_fsdp2_keeps_a_named_module_and_skips_dtype_rungs():
    from mixprec.guard import next_policy

    lean = Policy.parse("bf16-lean")
    new, why = next_policy(lean, "blocks.1", bf16_ok=True, sharded=True)
    assert new == lean.replace(keep_fp32=("blocks.1",)) and why == "keep 'blocks.1' in fp32"
    new, why = next_policy(lean, None, bf16_ok=True, sharded=True)   # bf16 → fp32 skipped: the state rung
    assert new == lean.replace(state_dtype=torch.float32, state_rounding="nearest"), why
    assert "'bf16 → fp32' refused under strategy='fsdp2'" in why
    new, why = next_policy(Policy.parse("bf16-mixed"), None, bf16_ok=True, sharded=True)
    assert new is None and "would re-run fully_shard" in why


def _internals_worker(rank: int, out: Path) -> dict:
    from mixprec.distributed.sharded_units import fsdp_units

    mp = _engine("bf16-mixed", "fsdp2")
    _step(mp, _batch())
    units = fsdp_units(mp.module)
    params = {id(p) for p in mp.module.parameters()}   # FSDPParam.sharded_param: the model's own parameters
    return {name: ([fp.param_dtype for fp in g.fsdp_params], g.mp_policy.param_dtype,
                   all(id(fp.sharded_param) in params for fp in g.fsdp_params),
                   all(hasattr(fp, "_unsharded_param") and fp.all_gather_outputs for fp in g.fsdp_params))
            for name, g in units.items()}


@pytest.mark.timeout(300)
def test_the_fsdp2_internals_sharded_units_relies_on_are_still_there(tmp_path):
    """If torch renames ``_fsdp_param_group``, ``FSDPParam.param_dtype``, ``all_gather_outputs`` or
    ``_unsharded_param`` (what :func:`mixprec.distributed.sharded_units.param_group` reads and resets), this fails."""
    for r, units in enumerate(run_ranks(_internals_worker, tmp_path, world=2)):
        assert sorted(units) == ["", "blocks.0", "blocks.1", "blocks.2"], r
        for name, (dtypes, group_dtype, own, gathered) in units.items():
            assert dtypes == [torch.bfloat16] * len(dtypes) and group_dtype == torch.bfloat16, (r, name)
            assert own, (r, name)
            assert gathered, (r, name)   # made at the first all-gather: apply_keep drops them


# ---------------------------------------------------------------------- the guard's rung 1 under FSDP2
FAULTS, GUARD_STEPS = (1, 2), 5
FLAKY = "blocks.1.0"


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"].float())


def _guarded(policy: str, rank: int) -> dict:
    from mixprec import Guard

    torch.manual_seed(0)
    model = _Net()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), policy,
                        device="cpu", strategy="fsdp2", guard=Guard(snapshot_every=1, loss_fn=_loss))
    flaky, batch, outcomes = mp.module.get_submodule(FLAKY), _batch(), []
    for step in range(GUARD_STEPS):
        flaky.poisoned = rank == 1 and step in FAULTS   # inf out of one module, on one rank
        x = mp.cast_inputs(batch, keep=("y",))
        with mp.autocast():
            loss = _loss(mp.model, x)
        mp.backward(loss)
        result = mp.step()
        flaky.poisoned = False
        outcomes.append((result.applied, result.rolled_back, result.escalated))
    escalations = [e for e in mp.events if e.get("kind") == "escalate"]
    return {"outcomes": outcomes, "policy": str(mp.policy), "snapshot": _snapshot(mp),
            "escalations": [(e.get("step"), e.get("module"), e.get("detail")) for e in escalations]}


def _guard_worker(rank: int, out: Path) -> dict:
    return {policy: _guarded(policy, rank) for policy in ("bf16-mixed", "bf16-lean")}


def _one_process_escalated(policy: str) -> dict:
    mp, batch = _engine(policy, None), _batch()
    _step(mp, batch)
    mp.set_policy(_kept(policy, FLAKY), kind="escalate")
    for _ in range(GUARD_STEPS - 1 - len(FAULTS)):
        _step(mp, batch)
    return _snapshot(mp)


@pytest.mark.timeout(300)
def test_fsdp2_guard_keeps_the_failing_module_in_fp32_and_continues_like_one_process(tmp_path):
    """Rank 1's ``blocks.1.0`` outputs inf at steps 1 and 2: every rank drops step 1's batch (the first non-finite
    step in a row: nothing was applied) and rolls back at step 2; at that second failure
    every rank re-runs its batch forward only, they agree on ``blocks.1.0`` (found on rank 1 alone) and keep it
    in fp32 (its unit ``blocks.1`` resharded); two more steps equal one process that ran step 0, the same
    ``set_policy`` and two steps, bit for bit."""
    ranks = run_ranks(_guard_worker, tmp_path, world=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {policy: _one_process_escalated(policy) for policy in ranks[0]}
    finally:
        torch.set_num_threads(threads)
    for policy, ref in refs.items():
        for r, got in enumerate(ranks):
            g = got[policy]
            assert g["outcomes"] == [(True, False, False), (False, False, False), (False, True, True),
                                     (True, False, False), (True, False, False)], (policy, r)
            assert g["policy"] == _kept(policy, FLAKY), (policy, r)
            assert g["escalations"] == ranks[0][policy]["escalations"] and len(g["escalations"]) == 1, (policy, r)
            step, module, detail = g["escalations"][0]
            assert module == FLAKY and f"keep '{FLAKY}' in fp32" in detail, (policy, r, detail)
            assert f"kept {FLAKY} in fp32 (its FSDP2 unit: blocks.1, all-gathered" in detail, (policy, r, detail)
            _assert_equal(g["snapshot"], ref, (policy, r))


# ---------------------------------------------------------------------- uneven and empty shards at W = 4
class _Odd(nn.Module):
    """The kept block's weight has 5 rows: FSDP2 splits them 2, 2, 1 and an empty shard over 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()), nn.Sequential(nn.Linear(16, 5))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def _odd_run(policy: str, strategy: str | None) -> dict:
    torch.manual_seed(0)
    model = _Odd()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), policy,
                        device="cpu", strategy=strategy)
    batch = _batch()
    _step(mp, batch)
    event = mp.set_policy(_kept(policy), kind="escalate")
    for _ in range(2):
        _step(mp, batch)
    return {"event": event.detail, "snapshot": _snapshot(mp)}


def _odd_worker(rank: int, out: Path) -> dict:
    return {policy: _odd_run(policy, "fsdp2") for policy in ("bf16-kahan", "bf16-sr")}


@pytest.mark.timeout(300)
def test_fsdp2_keep_fp32_restores_uneven_and_empty_shards_at_4_ranks(tmp_path):
    ranks = run_ranks(_odd_worker, tmp_path, world=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {policy: _odd_run(policy, None) for policy in ranks[0]}
    finally:
        torch.set_num_threads(threads)
    for policy, ref in refs.items():
        for r, got in enumerate(ranks):
            assert f"its FSDP2 unit: {KEPT}, all-gathered and stored in fp32" in got[policy]["event"], (policy, r)
            assert got[policy]["snapshot"]["params"][f"{KEPT}.0.weight"].dtype == torch.float32, (policy, r)
            _assert_equal(got[policy]["snapshot"], ref["snapshot"], (policy, r))
