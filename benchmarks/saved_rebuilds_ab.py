"""A/B: bf16-mixed at gpt/mid with saved=compute's backward rebuilds on and off, steps interleaved in one process:
"on" (saved=rebuild: weight copies cast again, GELU outputs recomputed), "no-rerun" (GELU outputs kept), "off" (both kept). `python benchmarks/saved_rebuilds_ab.py [rounds]` prints
the median step ms per arm and the median per-round ratio against "off" with its p10-p90 (docs/policies.md)."""
import statistics, sys, time, torch
from mixprec.engine import autocast_scope
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

torch.set_num_threads(2)
scope = autocast_scope.AutocastScope
recasts, reruns = scope._recasts, scope._reruns
arms = {"on": (recasts, reruns), "no-rerun": (recasts, lambda self: False),
        "off": (lambda self: False, lambda self: False)}
wl = get_workload("gpt", config="mid")
engines = {n: (build_engine(wl, "bf16-mixed,saved=rebuild", steps=400, seed=0, device="cpu"), wl.batches("train", 0)) for n in arms}


def step(name):
    scope._recasts, scope._reruns = arms[name]
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
for n in ("on", "no-rerun"):
    ratios = [a / b for a, b in zip(times[n], times["off"])]
    q = statistics.quantiles(ratios, n=10)
    print(f"{n}: {statistics.median(times[n]) * 1e3:.1f} ms, off {statistics.median(times['off']) * 1e3:.1f} ms, "
          f"{n}/off median {statistics.median(ratios):.4f} (p10-p90 {q[0]:.3f}-{q[-1]:.3f})")
