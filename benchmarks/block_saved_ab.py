"""What keeping x's wgrad operand packed costs in step time: gpt/mid steps of one block policy with the packed
operand (A, what BlockScaledLinear does) and with x kept and quantized in backward (B, what it did before),
interleaved in one process (A B, B A, ... so drift hits both). Both arms train the same model from the same seed on
the same batches and give the same bits (tests/blockscale/test_block_linear_saved.py); B is the old path
recovered by swapping ``mixprec.blockscale.linear``'s choice of what to keep during B's steps only.

    python benchmarks/block_saved_ab.py [rounds] [policy]     # default: 9 rounds, nvfp4-mixed

Prints each arm's median step ms with its p10-p90 and the median of the per-round ratios A/B (docs/results-history.md).
"""
import os
import statistics
import sys
import time

import torch

import mixprec.blockscale.linear as block_linear
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
policy = sys.argv[2] if len(sys.argv) > 2 else "nvfp4-mixed"
wl = get_workload("gpt", config="mid")
packed_choice = block_linear._kept_input


def unpacked_choice(x, recipe, signs, wgrad_runs):
    """The old path: x itself whenever wgrad runs (quantized in backward)."""
    return x if wgrad_runs else None


arms = {"packed": packed_choice, "x kept": unpacked_choice}
engines = {n: (build_engine(wl, policy, steps=400, seed=0, device="cpu"), wl.batches("train", 0)) for n in arms}


def step(name: str) -> float:
    mp, batches = engines[name]
    block_linear._kept_input = arms[name]
    try:
        t = time.perf_counter()
        train_step(mp, wl, next(batches))
        return time.perf_counter() - t
    finally:
        block_linear._kept_input = packed_choice


for _ in range(int(os.environ.get("WARMUP", "4"))):
    for n in arms:
        step(n)
times = {n: [] for n in arms}
names = list(arms)
for r in range(rounds):
    for n in names[r % 2:] + names[:r % 2]:
        times[n].append(step(n))
ratios = [a / b for a, b in zip(times["packed"], times["x kept"])]
for n in names:
    q = statistics.quantiles(times[n], n=10, method="inclusive")
    print(f"{policy} {n:7s} median {statistics.median(times[n]) * 1e3:7.1f} ms (p10-p90 {q[0] * 1e3:.1f}-{q[-1] * 1e3:.1f})")
q = statistics.quantiles(ratios, n=10, method="inclusive")
print(f"packed / x kept: median of per-round ratios {statistics.median(ratios):.3f} (p10-p90 {q[0]:.3f}-{q[-1]:.3f})")
