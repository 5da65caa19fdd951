"""One bench row's memory figures without the bench's training and timing: GPT ``small`` (batch 64), a policy and
a recompute plan, after a few training steps, measured by the bench's own function
(:func:`mixprec.programs.bench.step_memory.row_memory`: one untimed step's saved-for-backward and peak live tensor
bytes, and with a budget the largest batch in it from peaks at 32, 64 and 128 rows). For the issue-27 figures when
the whole evidence command (docs/memory.md) cannot finish; the bytes do not depend on the machine's load.

    python benchmarks/recompute_memory.py bf16-lean auto 4GiB 2     # policy, checkpoint, budget|none, steps
    python benchmarks/recompute_memory.py fp32 none none 1
"""

import json
import sys
import time

import torch

import mixprec
import mixprec.optim
from mixprec.programs.bench.step_memory import row_memory
from mixprec.programs.session import train_step
from mixprec.workloads.gpt import GPTWorkload


def main(argv: list[str]) -> dict:
    policy, checkpoint, budget, steps = argv[0], argv[1], argv[2], int(argv[3])
    option = None if checkpoint == "none" else (checkpoint if checkpoint.startswith("auto") else checkpoint.split(","))
    start = time.time()
    workload = GPTWorkload(argv[4] if len(argv) > 4 else "small")
    torch.manual_seed(0)
    model = workload.build_model()
    mp = mixprec.MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-3), policy, device="cpu",
                                checkpoint=option)
    batches = workload.batches("train", seed=0)
    for _ in range(steps):   # auto: measured and chosen in the first
        train_step(mp, workload, next(batches))
    fields = row_memory(mp, workload, next(batches), seed=0, budget=None if budget == "none" else budget)
    plans = [e.get("detail") for e in mp.events if e.get("kind") == "recompute"]
    out = {"policy": policy, "checkpoint": checkpoint, "steps": steps, "wall_s": time.time() - start,
           "saved_mib": fields.get("saved_activation_bytes", 0) / 2**20,
           "peak_live_mib": fields.get("peak_live_bytes", 0) / 2**20, "fields": fields,
           "plan": plans[-1] if plans else None}
    print(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
