"""A/B: bf16-mixed at gpt/mid with the weight-copy recast (saved=compute) on and off, steps interleaved in one process: `python benchmarks/weight_copies_ab.py` prints the median per-step ratio (docs/policies.md)."""
import statistics, time, torch
from mixprec.engine import autocast_scope
from mixprec.programs.session import build_engine, train_step
from mixprec.workloads import get_workload

orig = autocast_scope.AutocastScope._recasts   # the switch (saved=fp32 would change the norms too)
wl = get_workload("gpt", config="mid")
engines = {}
for name in ("on", "off"):
    engines[name] = (build_engine(wl, "bf16-mixed", steps=400, seed=0, device="cpu"), wl.batches("train", 0))
def step(name):
    autocast_scope.AutocastScope._recasts = orig if name == "on" else (lambda self: False)
    mp, b = engines[name]
    t = time.perf_counter(); train_step(mp, wl, next(b)); return time.perf_counter() - t
for _ in range(3):
    for n in engines: step(n)
times = {n: [] for n in engines}
for r in range(25):
    order = ("on", "off") if r % 2 == 0 else ("off", "on")
    for n in order:
        times[n].append(step(n))
ratios = [a / b for a, b in zip(times["on"], times["off"])]
print({n: round(statistics.median(t) * 1e3, 1) for n, t in times.items()}, "on/off median ratio", round(statistics.median(ratios), 4),
      "p10-p90", [round(x, 3) for x in statistics.quantiles(ratios, n=10)[::8]])
