"""Guard overhead: MixedPrecision's step time with ``guard=Guard(...)`` against no guard.

Both engines train the same GPT workload from the same seed on the same batches (forward under
autocast, backward, clipping, AdamW, scheduler) and run interleaved in blocks so that machine
drift hits both. The guard reads the loss every ``--check-every`` steps (one host sync) and
deep-copies the engine's state to the CPU every ``--snapshot-every`` applied steps; a healthy
run triggers nothing else. Reports, from this one run:

* ``ratio_median``: median guarded step time / median plain step time (the per-step cost: the
  loss read; the median leaves out the rare snapshot steps, and the stalls of a shared machine);
* ``ratio_paired_median``: the median, over blocks, of guarded block time / the plain block run
  just before it (robust to load that drifts during the run);
* ``after_step_ms_median``: the time spent inside ``guard.after_step`` per step (its own work and
  the loss read; on CUDA the read also waits for the queued kernels, so there the ratios are
  the figure to trust);
* ``snapshot_ms_median``: the time of one snapshot, measured alone (median of 11);
* ``ratio_amortised``: ``(guarded median + snapshot_ms_median / snapshot_every) / plain median``,
  the whole cost of a healthy run. (A ratio of means would include the snapshots directly but,
  on a shared machine, mostly measures which loop a stall happened to hit.)

    python benchmarks/guard_overhead.py --config baby --policy bf16-mixed --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mixprec import Guard
from overhead import _engine_loop  # the same engine loop, with a guard (benchmarks/ is on sys.path)
from mixprec.workloads import get_workload


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step, device, n):
    """Per-step wall times in ms, synchronising before starting and before stopping the clock."""
    times_ms = []
    for _ in range(n):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    return times_ms


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="baby")
    parser.add_argument("--policy", default="bf16-mixed", choices=["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per engine (after warm-up)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--block", type=int, default=1, help="steps per interleaved block (1: strictly alternate)")
    parser.add_argument("--snapshot-every", type=int, default=50)
    parser.add_argument("--check-every", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    workload = get_workload("gpt", config=args.config)
    guard = Guard(snapshot_every=args.snapshot_every, check_every=args.check_every, loss_fn=workload.loss)
    step_plain, mp_plain = _engine_loop(workload, args.policy, device, None)
    step_guarded, mp_guarded = _engine_loop(workload, args.policy, device, guard)
    after_step_ms = []
    judge = guard.after_step

    def timed_after_step(mp, result):
        start = time.perf_counter()
        result = judge(mp, result)
        after_step_ms.append((time.perf_counter() - start) * 1e3)
        return result
    guard.after_step = timed_after_step
    _time(step_plain, device, args.warmup)
    _time(step_guarded, device, args.warmup)
    plain_ms, guarded_ms, paired = [], [], []
    for _ in range(max(1, args.steps // args.block)):
        plain_block_ms = _time(step_plain, device, args.block)
        guarded_block_ms = _time(step_guarded, device, args.block)
        paired.append(sum(guarded_block_ms) / sum(plain_block_ms))
        plain_ms += plain_block_ms
        guarded_ms += guarded_block_ms
    snapshot_ms = []
    for _ in range(11):
        _sync(device)
        start = time.perf_counter()
        guard.take_snapshot(mp_guarded)
        snapshot_ms.append((time.perf_counter() - start) * 1e3)
    if mp_guarded.events:
        raise RuntimeError(f"the guard acted during the benchmark, so the timing is not of a healthy run: "
                           f"{mp_guarded.events}")
    plain_med, guarded_med = statistics.median(plain_ms), statistics.median(guarded_ms)
    snapshot_med = statistics.median(snapshot_ms)
    result = {
        "config": args.config, "policy": str(mp_guarded.policy), "device": str(device),
        "cpu_threads": torch.get_num_threads(),
        "snapshot_every": args.snapshot_every, "check_every": args.check_every,
        "timed_steps_each": len(plain_ms),
        "plain_step_ms_median": round(plain_med, 3), "guarded_step_ms_median": round(guarded_med, 3),
        "ratio_median": round(guarded_med / plain_med, 4),
        "ratio_paired_median": round(statistics.median(paired), 4),
        "after_step_ms_median": round(statistics.median(after_step_ms), 4),
        "snapshot_ms_median": round(snapshot_med, 3),
        "ratio_amortised": round((guarded_med + snapshot_med / args.snapshot_every) / plain_med, 4),
        "snapshots_taken_in_run": 1 + mp_guarded.applied_steps // args.snapshot_every,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
