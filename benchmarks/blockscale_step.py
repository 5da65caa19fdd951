"""gpt/mid training steps under bf16-mixed, mxfp8-mixed and nvfp4-mixed, interleaved in one process (the arms take
turns in rotating order). `python benchmarks/blockscale_step.py [rounds] [policies]` prints each arm's median step
ms with its p10-p90 and the median per-round ratio to the first policy (docs/results-history.md)."""
import os, statistics, sys, time, torch
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16-mixed", "mxfp8-mixed", "nvfp4-mixed"]
wl = get_workload("gpt", config="mid")
engines = {n: (build_engine(wl, n, steps=400, seed=0, device="cpu"), wl.batches("train", 0)) for n in names}


def step(name):
    mp, batches = engines[name]
    t = time.perf_counter()
    train_step(mp, wl, next(batches))
    return time.perf_counter() - t


warm = {n: [step(n) for _ in range(int(os.environ.get("WARMUP", "8")))] for n in names}   # the op plan measures
print("warm-up ms:", {n: [round(t * 1e3) for t in ts] for n, ts in warm.items()}, flush=True)
times = {n: [] for n in names}
for r in range(rounds):
    for n in names[r % len(names):] + names[:r % len(names)]:   # rotate the order so drift hits every arm alike
        times[n].append(step(n))
for n in names:
    ratios = [a / b for a, b in zip(times[n], times[names[0]])]
    q = statistics.quantiles(times[n], n=10, method="inclusive")
    print(f"{n:12s} median {statistics.median(times[n]) * 1e3:7.1f} ms (p10-p90 {q[0] * 1e3:.1f}-{q[-1] * 1e3:.1f})"
          f"  ratio to {names[0]} {statistics.median(ratios):5.2f}")
