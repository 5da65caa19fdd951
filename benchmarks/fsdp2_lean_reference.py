"""The one-process reference of a ``mixprec train --strategy fsdp2`` run: the same policy, seed and steps, every
step on the global batch of ``--world`` ranks (``mixprec train`` under torchrun gives rank r every W-th batch of
the seeded stream, so global step k holds batches ``W*k .. W*k + W - 1``; here they are concatenated in rank
order). Prints the training-state bytes per parameter (:func:`mixprec.memory.state_bytes`, after step 2's
backward) and the eval loss every ``--eval-every`` steps and at the end, as JSON lines.

    python benchmarks/fsdp2_lean_reference.py --config mid --policy bf16-lean --steps 200 --seed 0 --world 2

The issue-28 measurement (docs/distributed.md, "Training-state bytes per rank") ran this at seeds 0 and 1 (the
seed band) against ``torchrun --nproc-per-node 2 -m mixprec train --strategy fsdp2`` at seed 0.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mixprec.memory import state_bytes
from mixprec.programs.session import build_engine, evaluate, train_step
from mixprec.workloads import get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--config", default="mid")
    parser.add_argument("--policy", default="bf16-lean")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world", type=int, default=2, help="ranks whose batches one step concatenates")
    parser.add_argument("--eval-every", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    workload = get_workload(args.workload, config=args.config)
    mp = build_engine(workload, args.policy, steps=args.steps, seed=args.seed, device="cpu")
    stream, measured = workload.batches("train", args.seed), {}
    for step in range(1, args.steps + 1):
        pair = [next(stream) for _ in range(args.world)]
        batch = {k: torch.cat([b[k] for b in pair]) for k in pair[0]}
        after = (lambda: measured.update(state_bytes(mp.model, mp.optimizer).as_dict())) if step == 2 else None
        train_step(mp, workload, batch, after)
        if step == 2:
            print(json.dumps({"kind": "state", **measured}), flush=True)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            print(json.dumps({"kind": "eval", "step": step, "eval_loss": evaluate(mp, workload)["loss"]}), flush=True)
    print(json.dumps({"kind": "eval", "step": args.steps, "eval_loss": evaluate(mp, workload)["loss"],
                      "seed": args.seed, "world": args.world, "policy": str(mp.policy),
                      "wall_s": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
