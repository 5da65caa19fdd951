"""How many copies and casts a training step runs, per preset, at gpt/mid: pinned, so that a change that adds
casts to the step (a round trip, a per-parameter cast where one fused copy does) fails here and says by how many.

Counted with the profiler over one step after two warm-up steps, every ``aten::copy_`` and ``aten::_to_copy`` call
(whatever its size: ~250 of them are the 0-dim step counters and bias corrections of torch's foreach AdamW, in the
fp32 loop as in every other). The attention kernel is pinned (``blockwise``) so the count does not depend on this
machine's measured plan; bf16-lean needs its C kernel (built at first use). The numbers are torch 2.13.0's (the
version CI installs): another torch may decompose ops differently, so they are checked on that version only.
"""

from __future__ import annotations

import collections

import pytest
import torch

from mixprec.autocast import op_plan
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

# preset -> (copy_, _to_copy) per step at gpt/mid; what the bf16 presets add over fp32's 259 / 237, per step:
# bf16-mixed: each Linear's weight and bias cast to bf16 in the forward and its gradient back in the backward
# (autocast's), the activations entering a bf16 matmul from an fp32 norm or residual, the norms' inputs kept in bf16
# for backward (saved=compute) and upcast there, the blockwise attention's per-row columns (saved=rebuild adds each
# Linear's weight cast again in backward instead of its copy kept: 17 weights at mid, 464 / 418);
# bf16-pure: the masters written back to the params (one foreach copy), bf16 grads upcast into the masters' (one
# foreach copy), the optimizer's fp32 view of bf16 state; -kahan / -sr: each bf16 param read in fp32 and written back
# (Kahan: with its compensation); -lean: the C kernel steps bf16 params and 8-bit moments in place.
PINNED = {
    "fp32": (259, 237),
    "bf16-mixed": (447, 401),
    "bf16-pure": (536, 386),
    "bf16-kahan": (849, 699),
    "bf16-sr": (589, 543),
    "bf16-lean": (481, 435),
}


def _counts(policy: str) -> tuple[int, int]:
    workload = get_workload("gpt", config="mid")
    c = workload.config
    stand_in = torch.empty(c.batch_size, c.n_head, c.block_size, c.n_embd // c.n_head)
    op_plan.forget()
    op_plan.pin({op_plan.plan_key(stand_in, stand_in, stand_in, is_causal=True, dtype=torch.bfloat16, grad=True):
                 "blockwise"}, "cpu", source="test")
    mp = build_engine(workload, policy, steps=20, seed=0, device="cpu")
    batches = workload.batches("train", 0)
    for _ in range(2):
        train_step(mp, workload, next(batches))
    with torch.profiler.profile() as prof:
        train_step(mp, workload, next(batches))
    op_plan.forget()
    counted = collections.Counter(e.name for e in prof.events() if e.name in ("aten::copy_", "aten::_to_copy"))
    return counted["aten::copy_"], counted["aten::_to_copy"]


@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.13.0", reason="counts pinned for torch 2.13.0")
@pytest.mark.parametrize("policy", list(PINNED))
def test_a_step_runs_the_pinned_number_of_copies_and_casts(policy, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    if policy == "bf16-lean":
        from mixprec.optim import c_kernels
        if c_kernels.compiler() is None:
            pytest.skip("no C compiler: bf16-lean's moments go through eager torch ops (another count)")
    copies, casts = _counts(policy)
    want_copies, want_casts = PINNED[policy]
    assert (copies, casts) == (want_copies, want_casts), (
        f"{policy}: {copies} copy_ ({copies - want_copies:+d}) and {casts} _to_copy ({casts - want_casts:+d}) per "
        "step at gpt/mid against the pinned count")
