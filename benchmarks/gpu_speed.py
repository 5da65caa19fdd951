"""Speed on a CUDA GPU: torch.compile vs eager, attention kernels, and the engine's overhead.

Three groups of cases, each one entry of :data:`CASES` (a :class:`Case`: a name, a group, and a function
of the run's :class:`Context` returning a dict of numbers). Every case fails soft: an exception is
recorded with the case (``error``, first line; ``traceback``, last lines) and the next case runs. Cases
run in list order while the wall-clock budget (``--budget-s``) lasts; the rest are listed as skipped.
Adding a measurement is one more ``Case(...)`` line in :data:`CASES`; the ``op plan`` cases time a
bf16-mixed engine with ``kernels=measured`` (mixprec.autocast.op_plan) against ``kernels=native``, eager.

1. **attention** -- ``F.scaled_dot_product_attention`` forward + backward, causal, at B16·H4·T128·D64
   and B64·H6·T256·D64, in fp32, bf16 (torch picks the fused kernel: flash / efficient / cuDNN), and a
   matmul formulation (bf16 ``q @ kᵀ`` and ``p @ v``, the softmax in fp32 with the causal mask).
   Timed with CUDA events, **best** of ``k`` after warm-up; ``tflops`` counts the causal fwd+bwd as
   ``7 B H T² D`` (forward ``2 B H T² D``, backward 2.5x). ``max_abs_diff_vs_fp32``: of the output.
2. **overhead** -- ``benchmarks/overhead.py``'s measurement (MixedPrecision's step against a hand
   ``torch.autocast`` loop, interleaved in blocks, median of each, ratio), on the GPU, at GPT ``mid``.
3. **compile** -- GPT ``mid`` and ``small`` training steps through ``MixedPrecision(..., compile=...)``
   under fp32 and bf16-mixed, eager and compiled (inductor), median step ms after warm-up (each step
   synchronized), ``compile_s`` = what the warm-up steps took beyond that median (the compilation),
   first and last loss. Compiled cases are last: they are the slow ones.

Output: ``OUT/gpu_speed.json`` (meta, one record per case, skipped) and ``OUT/gpu_speed.md`` (the
tables). Sized to finish in about 5 minutes on an H100/H200 (budget 270 s by default).
Without CUDA it exits 0 after saying so; ``--device cpu`` (``--dry-run`` implies it) runs every case
at tiny sizes on the CPU -- compiled cases with ``backend="eager"`` (dynamo only, no inductor) -- to
check the script end to end in well under a minute; its numbers are not GPU numbers.

    python benchmarks/gpu_speed.py OUT_DIR
    python benchmarks/gpu_speed.py --dry-run OUT_DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/overhead.py

import overhead  # noqa: E402

from mixprec import MixedPrecision  # noqa: E402
from mixprec.programs.bench.measure import time_steps  # noqa: E402
from mixprec.workloads import get_workload  # noqa: E402


@dataclass
class Context:
    """What every case gets: the device, whether this is the tiny CPU check, the warm-up and timed counts."""

    device: torch.device
    dry_run: bool
    warmup: int
    iters: int
    notes: list[str] = field(default_factory=list)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    run: Callable[[Context], dict]


# --------------------------------------------------------------------------- timing
def best_ms(ctx: Context, fn: Callable[[], Any], warmup: int | None = None, iters: int | None = None) -> float:
    """Best time of ``fn()`` in ms over ``iters`` calls after ``warmup`` calls: CUDA events on a GPU,
    ``perf_counter`` on the CPU."""
    for _ in range(ctx.warmup if warmup is None else warmup):
        fn()
    ctx.sync()
    times = []
    for _ in range(ctx.iters if iters is None else iters):
        if ctx.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


# --------------------------------------------------------------------------- 1. attention
ATTENTION_SHAPES = ((16, 4, 128, 64), (64, 6, 256, 64))   # (B, H, T, D)
DRY_ATTENTION_SHAPES = ((2, 2, 16, 8), (2, 3, 32, 8))


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with bf16 matmuls and an fp32 softmax (the scores upcast, masked, normalised,
    rounded to bf16 for ``p @ v``)."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return probs.to(q.dtype) @ v


def _attention_inputs(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, grad = (torch.randn(*shape, generator=gen) for _ in range(4))
    leaves = [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v)]
    return leaves, grad.to(device=device, dtype=dtype), (q, k, v)


def attention_case(shape: tuple[int, ...], variant: str) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        if ctx.dry_run:
            shape_here = DRY_ATTENTION_SHAPES[ATTENTION_SHAPES.index(shape)]
        else:
            shape_here = shape
        dtype = torch.float32 if variant == "fp32_sdpa" else torch.bfloat16
        (q, k, v), grad, cpu_qkv = _attention_inputs(shape_here, ctx.device, dtype)
        if variant == "bf16_matmul_fp32_softmax":
            attend = _matmul_attention
        else:
            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def step():
            for t in (q, k, v):
                t.grad = None
            attend(q, k, v).backward(grad)

        ms = best_ms(ctx, step)
        with torch.no_grad():   # accuracy of the output against fp32 SDPA on the same inputs
            ref = F.scaled_dot_product_attention(*(t.to(ctx.device) for t in cpu_qkv), is_causal=True)
            diff = (attend(q, k, v).float() - ref).abs().max().item()
        b, h, t, d = shape_here
        return {"shape": "B{}·H{}·T{}·D{}".format(*shape_here), "variant": variant, "dtype": str(dtype)[6:],
                "ms_best": ms, "tflops": 7 * b * h * t * t * d / (ms * 1e-3) / 1e12, "max_abs_diff_vs_fp32": diff}
    return run


# --------------------------------------------------------------------------- 2. overhead
def overhead_case(config: str, policy: str) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        args = ["--config", "tiny" if ctx.dry_run else config, "--policy", policy, "--device", str(ctx.device)]
        args += ["--steps", "4", "--block", "2", "--warmup", "1"] if ctx.dry_run else ["--steps", "60", "--block", "5"]
        return overhead.main(args)
    return run


# --------------------------------------------------------------------------- 3. compile vs eager
def compile_case(config: str, policy: str, compiled: bool) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        workload = get_workload("gpt", config="tiny" if ctx.dry_run else config)
        torch.manual_seed(0)
        model = workload.build_model()
        opt = workload.make_optimizer(model)
        compile_arg: Any = False
        if compiled:
            compile_arg = {"backend": "eager"} if ctx.dry_run else True
        mp = MixedPrecision(model, opt, policy=policy, device=ctx.device, max_grad_norm=workload.max_grad_norm,
                            scheduler=workload.make_scheduler(opt, 10_000), compile=compile_arg)
        batches = workload.batches("train", seed=0)
        losses: list[torch.Tensor] = []

        def step():
            batch = mp.cast_inputs(next(batches))
            with mp.autocast():
                loss = workload.loss(mp.model, batch)
            mp.backward(loss)
            mp.step()
            losses.append(loss.detach())

        warmup = 2 if ctx.dry_run else 5
        warm = time_steps(step, ctx.device, warmup)
        timed = time_steps(step, ctx.device, 4 if ctx.dry_run else 30)
        median = statistics.median(timed)
        tokens = workload.config.batch_size * workload.config.block_size
        return {"config": config, "ran": "gpt tiny (dry run)" if ctx.dry_run else f"gpt {config}", "policy": policy,
                "mode": ("compiled (backend=eager)" if ctx.dry_run else "compiled") if compiled else "eager",
                "step_ms_median": median, "tokens_per_s": tokens / (median * 1e-3),
                "compile_s": max(0.0, sum(warm) - warmup * median) / 1e3 if compiled else 0.0,
                "first_loss": losses[0].item(), "last_loss": losses[-1].item()}
    return run


# --------------------------------------------------------------------------- the case list
ATTENTION_VARIANTS = ("fp32_sdpa", "bf16_sdpa", "bf16_matmul_fp32_softmax")

CASES: list[Case] = [
    *(Case(f"attention {'x'.join(map(str, s))} {v}", "attention", attention_case(s, v))
      for s in ATTENTION_SHAPES for v in ATTENTION_VARIANTS),
    Case("overhead mid bf16-mixed", "overhead", overhead_case("mid", "bf16-mixed")),
    Case("overhead mid fp32", "overhead", overhead_case("mid", "fp32")),
    *(Case(f"op plan {c} {p}", "compile", compile_case(c, p, False))      # kernels=measured vs native, eager
      for c in ("mid", "small") for p in ("bf16-mixed", "bf16-mixed,kernels=native")),
    *(Case(f"compile {c} {p} {'compiled' if m else 'eager'}", "compile", compile_case(c, p, m))
      for c in ("mid", "small") for p in ("fp32", "bf16-mixed") for m in (False, True)),
]

COLUMNS = {
    "attention": ["shape", "variant", "ms_best", "tflops", "max_abs_diff_vs_fp32"],
    "overhead": ["config", "policy", "torch_autocast_step_ms_median", "mixprec_step_ms_median",
                 "ratio_mixprec_over_torch"],
    "compile": ["config", "ran", "policy", "mode", "step_ms_median", "speedup_vs_eager", "tokens_per_s", "compile_s",
                "first_loss", "last_loss"],
}


# --------------------------------------------------------------------------- running and reporting
def run_cases(cases: list[Case], ctx: Context, budget_s: float) -> tuple[list[dict], list[str]]:
    deadline = time.perf_counter() + budget_s
    records, skipped = [], []
    for case in cases:
        if time.perf_counter() > deadline:
            skipped.append(f"{case.name}: time budget ({budget_s:.0f} s) spent")
            continue
        t0 = time.perf_counter()
        record: dict = {"case": case.name, "group": case.group}
        try:
            record.update(case.run(ctx))
        except Exception as err:   # fail soft: record it, go on with the next case
            record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            record["traceback"] = traceback.format_exc().splitlines()[-6:]
        record["wall_s"] = round(time.perf_counter() - t0, 2)
        records.append(record)
        print(f"{case.name}: {record.get('error') or 'ok'} ({record['wall_s']} s)", flush=True)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    eager = {(r.get("config"), r.get("policy")): r["step_ms_median"] for r in records
             if r["group"] == "compile" and r.get("mode") == "eager" and "step_ms_median" in r}
    for r in records:
        if r["group"] == "compile" and "step_ms_median" in r and (r["config"], r["policy"]) in eager:
            r["speedup_vs_eager"] = eager[(r["config"], r["policy"])] / r["step_ms_median"]
    return records, skipped


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)


def markdown(meta: dict, records: list[dict], skipped: list[str]) -> str:
    lines = [f"# gpu_speed {meta['date']}: {meta['device_name']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, device `{meta['device']}`"
             + (" — **dry run** (tiny sizes on the CPU: checks the script, not GPU numbers)" if meta["dry_run"] else ""),
             ""]
    for group, columns in COLUMNS.items():
        rows = [r for r in records if r["group"] == group]
        if not rows:
            continue
        lines += [f"## {group}", "", "| " + " | ".join(columns) + " | error |",
                  "|" + "---|" * (len(columns) + 1)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + f" | {r.get('error', '')} |" for r in rows]
        lines.append("")
    if skipped:
        lines += ["## skipped", "", *(f"- {s}" for s in skipped), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory (gpu_speed.json, gpu_speed.md)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny sizes: a check of the script)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (implies --device cpu)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip the cases left after this long")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    dry_run = args.dry_run or device.type == "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_speed.py: no CUDA device here, nothing measured (use --dry-run to check the script on the CPU)")
        return 0
    ctx = Context(device=device, dry_run=dry_run, warmup=2 if dry_run else 10, iters=3 if dry_run else 20)
    cases = [c for c in CASES if args.only is None or args.only in c.name]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "dry_run": dry_run,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "budget_s": args.budget_s,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "timing": {"attention": "CUDA events, best of %d after %d warm-up" % (ctx.iters, ctx.warmup),
                       "overhead": "benchmarks/overhead.py (median, interleaved blocks)",
                       "compile": "median step, each synchronized"}}
    print(f"# gpu_speed {meta['date']}  {meta['device_name']}  torch {meta['torch']}  dry_run={dry_run}", flush=True)
    records, skipped = run_cases(cases, ctx, args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_speed.json").write_text(json.dumps({"meta": meta, "cases": records, "skipped": skipped}, indent=2))
    (out / "gpu_speed.md").write_text(markdown(meta, records, skipped))
    print(markdown(meta, records, skipped))
    print(f"wrote {out / 'gpu_speed.json'} and {out / 'gpu_speed.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
