"""Where an fp8 training step's time goes: torch.profiler over a few steps of the GPT workload, bf16 autocast
against the same model with its linears converted to fp8 (tensorwise), as ``gpu_fp8.py``'s GPT row times them.

    python benchmarks/gpu_fp8_profile.py OUT_DIR [--config small] [--cpu] [--compiled]

Writes ``OUT_DIR/fp8_profile.txt``: per variant, the step's wall time and the top ops by device time and by host
time (self), with their call counts per step, so launch-bound work (many small kernels, host syncs) shows.
``--compiled`` instead times (median of 20 steps after warm-up, no profiler) bf16 and fp8 eager and under
``torch.compile(model)``, interleaved per round of 5 steps, into ``OUT_DIR/fp8_compiled.txt``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mixprec.fp8 import convert_to_float8
from mixprec.workloads import get_workload
from mixprec.workloads.base import move_batch


def training_step(workload, base: torch.nn.Module, variant: str, device: torch.device, *, compiled: bool = False):
    """One training step (bf16 autocast, fused AdamW) of a copy of ``base``, its linears in fp8 (tensorwise) unless
    ``variant`` is ``"bf16"``; ``compiled``: the forward through ``torch.compile(model)``."""
    model = copy.deepcopy(base)
    if variant != "bf16":
        convert_to_float8(model, recipe="tensorwise")
    model.to(device)
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batches = workload.batches("train", seed=0)

    def step() -> None:
        batch = move_batch(next(batches), device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = workload.loss(run, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def profile_variant(device: torch.device, config: str, variant: str, steps: int) -> str:
    workload = get_workload("gpt", config=config)
    torch.manual_seed(0)
    step = training_step(workload, workload.build_model(), variant, device)
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / steps
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return (f"## {config} {variant}: {ms:.2f} ms/step under the profiler ({steps} steps)\n\n### by device time\n{table}\n\n"
            f"### by host time\n{host}\n")


def timed_steps(device: torch.device, config: str, rounds: int) -> str:
    """ms/step of bf16 and fp8 (tensorwise), eager and compiled, rounds of 5 steps taking turns."""
    workload = get_workload("gpt", config=config)
    torch.manual_seed(0)
    base = workload.build_model()
    steps: dict[str, object] = {}
    for variant in ("bf16", "fp8-tensorwise"):
        for compiled in (False, True):
            step = training_step(workload, base, variant, device, compiled=compiled)
            start = time.perf_counter()
            for _ in range(3):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            steps[f"{variant} {'compiled' if compiled else 'eager'}"] = (step, time.perf_counter() - start)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, _) in steps.items():
            start = time.perf_counter()
            for _ in range(5):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3 / 5)
    lines = [f"## {config}: ms/step, median of {rounds} rounds of 5 steps (min-max), interleaved; warm-up incl. compile s"]
    for name, values in times.items():
        values.sort()
        lines.append(f"{name:28s} {values[len(values) // 2]:8.2f}  ({values[0]:.2f}-{values[-1]:.2f})  "
                     f"warm-up {steps[name][1]:.1f} s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="the tiny config on the CPU, to check this script")
    parser.add_argument("--compiled", action="store_true", help="time eager and compiled, bf16 and fp8")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    config = "tiny" if args.cpu else args.config
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compiled:
        text = timed_steps(device, config, 2 if args.cpu else 4)
        (out / "fp8_compiled.txt").write_text(text)
        print(text)
        return 0
    text = "".join(profile_variant(device, config, v, 2 if args.cpu else args.steps) for v in ("bf16", "fp8-tensorwise"))
    (out / "fp8_profile.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
