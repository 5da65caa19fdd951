"""Issue 27's must-show for the memory-aware attention plan: per GPT config, the attention kernel a bf16-mixed
training step runs and the bytes its training forward saves for backward, with no ``memory_budget`` (the plan's
default: never more than ``fused``) and with a large one (``MixedPrecision(..., memory_budget=...)``: the faster
kernel may save more, within half the headroom), next to ``kernels=native`` (torch.autocast's fused kernel).

Each engine trains ``--steps`` steps of the config's workload from one seed (the second step is the budget's
measured step); the plan is measured once per process by the first engine and reused by the others, so every
row chooses from the same timings. Saved bytes (``mixprec.memory.saved``, parameters left out) do not depend on
the machine's load; the candidates' times do.

    python benchmarks/attention_budget.py --configs baby mid --budget 64GiB
"""

from __future__ import annotations

import argparse
import json

import torch

from mixprec.autocast import op_plan
from mixprec.autocast.saved_allowance import mib_words
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.memory.saved import saved_bytes
from mixprec.policy.resolve import resolve_policy
from mixprec.programs.session import precision_optimizer, train_step
from mixprec.workloads.gpt import GPTWorkload


def _engine(config: str, policy: str, budget: str | None) -> tuple[MixedPrecision, GPTWorkload]:
    workload = GPTWorkload(config)
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = precision_optimizer(workload.make_optimizer(model), resolve_policy(policy, "cpu"))
    return MixedPrecision(model, optimizer, policy, device="cpu", memory_budget=budget), workload


def _row(config: str, policy: str, budget: str | None, steps: int) -> dict:
    mp, workload = _engine(config, policy, budget)
    batches = workload.batches("train", 0)
    for _ in range(steps):
        train_step(mp, workload, next(batches))
    batch = mp.cast_inputs(next(batches))
    with mp.autocast():
        loss, saved = saved_bytes(lambda: workload.loss(mp.model, batch), exclude=list(mp.model.parameters()))
    del loss
    train = [e for e in op_plan.entries("cpu") if e.shape.endswith(" fwd+bwd")]
    kernel = "fused (kernels=native)" if policy.endswith("native") else \
        ", ".join(sorted({op_plan.rechosen(e, _allowance(mp)).chosen for e in train}))
    event = next((e.detail for e in mp.events if e.kind == "memory-budget"), "")
    return {"config": config, "policy": policy, "memory_budget": budget, "kernel": kernel,
            "forward_saved_bytes": saved.total, "budget_event": event,
            "times_ms": {e.shape: e.times_ms for e in train}}


def _allowance(mp: MixedPrecision) -> float:
    state = mp.state_dict()["memory_budget"]
    return 0.0 if state is None else state["allowed_mib"]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["baby", "mid"])
    parser.add_argument("--budget", default="64GiB")
    parser.add_argument("--steps", type=int, default=3, help="training steps per engine (>= 2: the second is measured)")
    args = parser.parse_args(argv)
    rows = []
    for config in args.configs:
        op_plan.forget()
        for policy, budget in (("bf16-mixed", None), ("bf16-mixed,kernels=native", None),
                               ("bf16-mixed", args.budget)):
            row = _row(config, policy, budget, args.steps)
            rows.append(row)
            print(f"{config:5s} {policy:26s} memory_budget={str(budget):6s} attention {row['kernel']:22s} "
                  f"forward saves {mib_words(row['forward_saved_bytes'])} ({row['forward_saved_bytes']} B)")
        for shape, times in rows[-1]["times_ms"].items():
            print(f"      {shape}: " + ", ".join(f"{n} {t} ms" for n, t in times.items()) + " (under load)")
        print(f"      budget: {rows[-1]['budget_event']}")
    print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
