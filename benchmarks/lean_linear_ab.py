"""A/B: bf16-mixed at gpt/mid with mixprec.autocast.lean_linear on and off, steps interleaved in one process (the
arms take turns in rotating order). `python benchmarks/lean_linear_ab.py [rounds]` prints the median step ms per arm
and the median per-round ratio on/off with its p10-p90 (docs/policies.md)."""
import statistics, sys, time, torch
from mixprec.autocast import lean_linear
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

torch.set_num_threads(2)
mark = lean_linear.mark
arms = {"on": mark, "off": lambda out, x, op, op_kwargs=None: out}
wl = get_workload("gpt", config="mid")
engines = {n: (build_engine(wl, "bf16-mixed", steps=400, seed=0, device="cpu"), wl.batches("train", 0)) for n in arms}


def step(name):
    lean_linear.mark = arms[name]
    mp, batches = engines[name]
    t = time.perf_counter()
    train_step(mp, wl, next(batches))
    return time.perf_counter() - t


for _ in range(3):
    for n in arms:
        step(n)
times = {n: [] for n in arms}
names = list(arms)
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 24):
    for n in names[r % len(names):] + names[:r % len(names)]:   # rotate the order so drift hits every arm alike
        times[n].append(step(n))
ratios = [a / b for a, b in zip(times["on"], times["off"])]
q = statistics.quantiles(ratios, n=10)
print(f"on: {statistics.median(times['on']) * 1e3:.1f} ms, off {statistics.median(times['off']) * 1e3:.1f} ms, "
      f"on/off median {statistics.median(ratios):.4f} (p10-p90 {q[0]:.3f}-{q[-1]:.3f})")
