"""Engine overhead: MixedPrecision's step time against a hand-written torch.autocast loop.

Both loops train the same GPT workload from the same seed on the same batches: forward under
autocast, backward, global-norm clipping, AdamW, LR scheduler, zero_grad (plus a GradScaler in
the hand loop for fp16). The hand loop makes the engine's op choices: CUDA's autocast op lists
(``portable_ops``), the measured attention kernel (``planned_kernels``) and, under bf16, norm inputs saved in
bf16 (``saved_in_compute``: the engine's ``saved=compute``; without it the ratio counted that memory feature's
casts as overhead). The two run interleaved in blocks so that machine drift hits both.
Reports the median step time of each (ms, after warm-up) and their ratio from this one run.

Under a ``-pure`` policy the hand loop is the same ``torch.autocast`` loop in the compute dtype over fp32
params: the ratio then compares two different recipes (16-bit params and fp32 masters against fp32
params), not overhead alone; compare its ``mixprec_step_ms_median`` across code changes instead.

    python benchmarks/overhead.py --config mid --policy bf16-mixed --steps 40

``--reference fp32`` also interleaves an engine loop in that policy and reports ``speedup_vs_reference`` (its
median step time over the policy's): an in-process check of ``mixprec bench``'s interleaved speedup, which
``--bench DIR/results.json`` compares (``bench_speedup`` and their relative difference).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mixprec import MixedPrecision
from mixprec.programs.bench.measure import time_steps
from mixprec.autocast.op_plan import planned_kernels
from mixprec.autocast.portable import portable_ops
from mixprec.autocast.saved_dtype import saved_in_compute
from mixprec.workloads import get_workload


def _hand_loop(workload, dtype, device):
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    opt = workload.make_optimizer(model)
    sched = workload.make_scheduler(opt, 10_000)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    batches = workload.batches("train", seed=0)

    def step():
        batch = {k: v.to(device) for k, v in next(batches).items()}
        # the same op choices as the engine's defaults: ops=portable, kernels=measured (mixprec.autocast.op_plan),
        # saved=compute (norm inputs kept in bf16 for backward: mixprec.autocast.saved_dtype)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32), portable_ops(device.type), \
                planned_kernels(device.type), saved_in_compute(device.type, enabled=dtype == torch.bfloat16):
            loss = workload.loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), workload.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return step


def _engine_loop(workload, policy, device, guard=None):
    torch.manual_seed(0)
    model = workload.build_model()
    opt = workload.make_optimizer(model)
    mp = MixedPrecision(model, opt, policy=policy, device=device, scheduler=workload.make_scheduler(opt, 10_000),
                        max_grad_norm=workload.max_grad_norm, guard=guard)
    batches = workload.batches("train", seed=0)

    def step():
        batch = mp.cast_inputs(next(batches))
        with mp.autocast():
            loss = workload.loss(mp.model, batch)
        mp.backward(loss)
        mp.step()
    return step, mp


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="mid")
    parser.add_argument("--policy", default="bf16-mixed", choices=["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per loop (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=5, help="steps per interleaved block")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reference", default=None, help="also time an engine loop in this policy (e.g. fp32), "
                        "interleaved, and report speedup_vs_reference")
    parser.add_argument("--bench", default=None, help="a mixprec bench results.json to compare the speedup with")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    workload = get_workload("gpt", config=args.config)
    step_engine, mp = _engine_loop(workload, args.policy, device)
    dtype = mp.policy.compute_dtype
    step_hand = _hand_loop(workload, dtype, device)
    loops = {"hand": step_hand, "engine": step_engine}
    if args.reference:
        loops["reference"] = _engine_loop(workload, args.reference, device)[0]
    times = {name: [] for name in loops}
    for name, step in loops.items():
        time_steps(step, device, args.warmup)
    for _ in range(max(1, args.steps // args.block)):
        for name, step in loops.items():
            times[name] += time_steps(step, device, args.block)
    hand_ms, engine_ms = statistics.median(times["hand"]), statistics.median(times["engine"])
    result = {"config": args.config, "policy": str(mp.policy), "device": str(device),
              "torch_autocast_step_ms_median": round(hand_ms, 2), "mixprec_step_ms_median": round(engine_ms, 2),
              "ratio_mixprec_over_torch": round(engine_ms / hand_ms, 4), "timed_steps_each": len(times["hand"])}
    if args.reference:
        reference_ms = statistics.median(times["reference"])
        result.update(reference=args.reference, reference_step_ms_median=round(reference_ms, 2),
                      speedup_vs_reference=round(reference_ms / engine_ms, 4))
        if args.bench:
            with open(args.bench, encoding="utf-8") as f:
                bench = json.load(f)["policies"][args.policy]["speedup_vs_fp32"]
            result.update(bench_speedup=round(bench, 4),
                          bench_over_in_process=round(bench / result["speedup_vs_reference"], 4))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
