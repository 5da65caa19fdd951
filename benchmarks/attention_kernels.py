"""The attention candidates, forward + backward, at a GPT config's training shape: time and backward transient.

Times each candidate of the op plan (``fused``, ``fused-fp32``, ``matmul``, ``blockwise``) on random bf16 q, k, v of
the config's attention shape (B, H, T, D), causal, forward then backward with a random output gradient,
interleaved round by round (A B C D A B C D ...) after one warm-up each, and reports per candidate the median,
p10 and p90 in ms and the ratio of fused's median to it. ``--transient`` also measures each candidate's backward
peak of live tensors above its three gradients (``mixprec.memory.live.peak_live_bytes``: the CPU profiler's memory
events) against the T×T fp32 probabilities. ``matmul`` is left out above ``--matmul-limit-mib`` of fp32 scores,
as the op plan does.

    python benchmarks/attention_kernels.py --config mid --rounds 15
    python benchmarks/attention_kernels.py --config long --rounds 7 --transient
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mixprec.autocast.attention_kernels import CANDIDATES, MATMUL_SCORES_LIMIT
from mixprec.memory.live import peak_live_bytes
from mixprec.workloads.gpt import GPT_CONFIGS


def _shape(config: str, batch: int | None) -> tuple[int, int, int, int]:
    c = GPT_CONFIGS[config]
    return batch or c.batch_size, c.n_head, c.block_size, c.n_embd // c.n_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mid", choices=sorted(GPT_CONFIGS))
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the config's)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--transient", action="store_true", help="also measure each backward's transient bytes")
    args = parser.parse_args()
    B, H, T, D = shape = _shape(args.config, args.batch)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
    names = [n for n in CANDIDATES if n != "matmul" or 4 * B * H * T * T <= MATMUL_SCORES_LIMIT]

    def run(name: str) -> float:
        start = time.perf_counter()
        out = CANDIDATES[name](q, k, v, None, 0.0, True, None, False, torch.bfloat16)
        out.backward(grad)
        return (time.perf_counter() - start) * 1e3
    for name in names:
        run(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run(name))
    fused = statistics.median(times["fused"])
    report: dict = {"config": args.config, "shape_bhtd": list(shape), "threads": torch.get_num_threads(),
                    "rounds": args.rounds, "candidates": {}}
    for name in names:
        ts = sorted(times[name])
        median = statistics.median(ts)
        row = {"median_ms": round(median, 2), "p10_ms": round(ts[len(ts) // 10], 2),
               "p90_ms": round(ts[min(len(ts) - 1, (9 * len(ts)) // 10)], 2),
               "fused_over_this": round(fused / median, 2)}
        if args.transient:
            out = CANDIDATES[name](q, k, v, None, 0.0, True, None, False, torch.bfloat16)
            q.grad = k.grad = v.grad = None
            _, peak = peak_live_bytes(lambda: out.backward(grad), "cpu")
            row["backward_transient_mib"] = round((peak.bytes - 3 * q.numel() * 2) / 2**20, 2)
            row["transient_over_txt_fp32"] = round((peak.bytes - 3 * q.numel() * 2) / (B * H * T * T * 4), 3)
        report["candidates"][name] = row
        print(f"{name:11s} {row['median_ms']:8.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})  "
              f"fused/this {row['fused_over_this']:.2f}x"
              + (f"  backward transient {row['backward_transient_mib']} MiB = {row['transient_over_txt_fp32']} "
                 "of the TxT fp32 probabilities" if args.transient else ""))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
