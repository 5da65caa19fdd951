"""Block-scaled linear emulation speed on CPU: one linear's forward + backward, x (2048, 256) -> 1024 features,
fp32 ``nn.Linear`` against ``BlockScaledLinear`` (mxfp8, nvfp4 recipes) under bf16 autocast, arms interleaved in
rotating order. ``python benchmarks/blockscale_speed.py [repeats] [--profile ARM]`` prints each arm's median ms,
its p10-p90 and its median ratio to fp32 (docs/results-history.md)."""
import statistics, sys, time, torch
from torch import nn
from mixprec.blockscale import BlockScaledLinear

torch.set_num_threads(int(__import__("os").environ.get("THREADS", "2")))
torch.manual_seed(0)
x0 = torch.randn(2048, 256)
base = nn.Linear(256, 1024)
arms = {"fp32": (base, False), "bf16": (nn.Linear(256, 1024), True),
        "mxfp8": (BlockScaledLinear.from_linear(nn.Linear(256, 1024), recipe="mxfp8"), True),
        "nvfp4": (BlockScaledLinear.from_linear(nn.Linear(256, 1024), recipe="nvfp4"), True)}


def step(name):
    layer, autocast = arms[name]
    x = x0.clone().requires_grad_()
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.float().square().mean().backward()
    return time.perf_counter() - t


if "--profile" in sys.argv:
    name = sys.argv[sys.argv.index("--profile") + 1]
    for _ in range(2):
        step(name)
    with torch.profiler.profile() as prof:
        for _ in range(3):
            step(name)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    sys.exit()
names = list(arms)
for _ in range(2):
    for n in names:
        step(n)
times = {n: [] for n in names}
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 9
for r in range(repeats):
    for n in names[r % len(names):] + names[:r % len(names)]:
        times[n].append(step(n))
for n in names:
    ratios = [a / b for a, b in zip(times[n], times["fp32"])]
    q = statistics.quantiles(times[n], n=10) if repeats > 2 else [min(times[n]), max(times[n])]
    print(f"{n:6s} median {statistics.median(times[n]) * 1e3:7.1f} ms (p10-p90 {q[0] * 1e3:.1f}-{q[-1] * 1e3:.1f})"
          f"  ratio to fp32 {statistics.median(ratios):5.2f}")
