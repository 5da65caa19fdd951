"""The step-time cost of portable autocast: ``ops=portable`` (the default) against ``ops=native``.

Two engines train the same GPT workload from the same seed on the same batches, one with CUDA's op
lists ported to this device (``bf16-mixed``), one with torch's own (``bf16-mixed,ops=native``). They run
interleaved in blocks (alternating which goes first) so that drift on a shared machine hits both;
reports each median step time (ms, after warm-up) and their ratio.

    python benchmarks/portable_ops.py --config mid --steps 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mixprec import MixedPrecision
from mixprec.workloads import get_workload


def _engine_loop(workload, policy, device):
    torch.manual_seed(0)
    model = workload.build_model()
    opt = workload.make_optimizer(model)
    mp = MixedPrecision(model, opt, policy=policy, device=device, scheduler=workload.make_scheduler(opt, 10_000),
                        max_grad_norm=workload.max_grad_norm)
    batches = workload.batches("train", seed=0)

    def step():
        batch = mp.cast_inputs(next(batches))
        with mp.autocast():
            loss = workload.loss(mp.model, batch)
        mp.backward(loss)
        mp.step()
    return step


def _time(step, device, n):
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="mid")
    parser.add_argument("--compute", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per loop (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=5, help="steps per interleaved block")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    workload = get_workload("gpt", config=args.config)
    preset = f"{args.compute}-mixed"
    step_portable = _engine_loop(workload, preset, device)
    step_native = _engine_loop(workload, f"{preset},ops=native", device)
    _time(step_portable, device, args.warmup)
    _time(step_native, device, args.warmup)
    portable, native = [], []
    for block in range(max(1, args.steps // args.block)):     # alternate which loop goes first
        first, second = (native, portable) if block % 2 == 0 else (portable, native)
        first += _time(step_native if first is native else step_portable, device, args.block)
        second += _time(step_native if second is native else step_portable, device, args.block)
    portable_ms, native_ms = statistics.median(portable), statistics.median(native)
    result = {"config": args.config, "policy": preset, "device": str(device),
              "native_step_ms_median": round(native_ms, 2), "portable_step_ms_median": round(portable_ms, 2),
              "ratio_portable_over_native": round(portable_ms / native_ms, 4), "timed_steps_each": len(native)}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
