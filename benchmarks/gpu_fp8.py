"""fp8 on a CUDA GPU: is the ``_scaled_mm`` path right, and is it faster than bf16?

Four parts, one table each, all written to one JSON file:

1. **check** -- for each recipe, a Float8Linear forward+backward with ``torch._scaled_mm`` on the
   GPU against the exact emulation on the CPU (same weights, inputs, gradients), with fp32
   outputs and with bf16 outputs (autocast). The fp8 operands must be bit-identical across
   devices; the three GEMM outputs must agree within the fp32 summation bound
   ``2 (K + 2) 2**-24 (|A| @ |B|)`` (plus one bf16 rounding for bf16 outputs); ``ratio`` =
   worst |diff| / tolerance, pass when <= 1. Combinations ``_scaled_mm`` refuses are listed
   (not failures: auto emulates them), with which GEMMs auto sends to ``_scaled_mm``.
   Exit status 1 if any check that ran on CUDA failed. (On CPU, ``--cpu``, the rowwise
   bf16-output row fails: the CPU ``_scaled_mm`` rowwise kernel does not round once from an
   fp32 accumulator -- an exactly-zero output came back as 6e-4 -- one more reason auto never
   uses ``_scaled_mm`` on CPU; the CPU run exits 0, it only checks this script.)
2. **matmul** -- the kernels alone at the same sizes: fp32, bf16 ``mm`` and fp8 ``_scaled_mm``
   (e4m3 x e4m3 -> bf16): the ceiling the fp8 linear could reach.
3. **linear** -- an ``M = K = N = n`` linear, forward + backward (both grads), for n in 4096,
   8192, 16384: ``nn.Linear`` under bf16 autocast against Float8Linear per recipe (auto
   backend), fp32 params, bf16 activations. Median ms after warm-up, synchronized;
   TFLOP/s = ``6 n**3 / time``. Eager mode: the casts are unfused elementwise kernels.
4. **gpt** -- one training step (forward, backward, AdamW) of the ``small`` GPT workload
   (10.8M params, 64 x 256 tokens) under bf16 autocast, plain and converted with
   ``convert_to_float8`` (tensorwise), median ms and tokens/s, plus the first-step losses.

Runs in well under 5 minutes on an H100/H200 (a ``--budget-s`` guard skips what is left
when time runs out and says so). Without CUDA it prints a message and exits 0; ``--cpu``
runs tiny sizes on the CPU to check the script itself (its CPU timings are not fp8 numbers:
on CPU Float8Linear emulates in fp32).

    python benchmarks/gpu_fp8.py --out gpu_fp8.json
    python benchmarks/gpu_fp8.py --cpu
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time

import torch
from torch import nn

from mixprec.fp8 import Float8Linear, Float8Recipe, convert_to_float8, fp8_available
from mixprec.fp8.linear import _scaled_mm_error  # diagnostics only: which GEMMs auto sends to _scaled_mm
from mixprec.workloads import get_workload
from mixprec.workloads.base import move_batch

RECIPES = ("tensorwise", "rowwise", "delayed")


class Budget:
    """Wall-clock guard: ``ok()`` is False once ``seconds`` have passed since construction."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def ok(self) -> bool:
        return time.perf_counter() < self.deadline


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------- 1. check
def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, *, autocast: bool) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    layer.weight.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(grad_y.to(y.dtype))
    return [y.detach().float(), x.grad, layer.weight.grad]


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 summation-order bound for two evaluations of ``a @ b`` (see tests/fp8/test_fp8.py)."""
    return 2 * (a.shape[-1] + 2) * 2.0 ** -24 * (a.abs() @ b.abs())


def _auto_backends(device: torch.device, recipe: Float8Recipe, out_dtype: torch.dtype) -> dict[str, str]:
    """Which backend ``use_scaled_mm=None`` picks for each GEMM (outputs in ``out_dtype``)."""
    fwd, bwd = recipe.format_for("input").dtype, recipe.format_for("grad_output").dtype
    rowwise = recipe.name == "rowwise"
    if not fp8_available(device)[0]:
        return {g: "emulation" for g in ("forward", "grad_input", "grad_weight")}
    combos = {"forward": (fwd, fwd), "grad_input": (bwd, fwd), "grad_weight": (bwd, fwd)}
    errors = {g: _scaled_mm_error(device, a, b, rowwise, out_dtype) for g, (a, b) in combos.items()}
    return {g: "_scaled_mm" if err is None else f"emulation ({err})" for g, err in errors.items()}


def check(device: torch.device, m: int, k: int, n: int) -> list[dict]:
    """Device ``_scaled_mm`` (forced) vs CPU emulation, per recipe, with fp32 outputs (autocast off:
    tolerance = the fp32 bound) and bf16 outputs (autocast on: plus one bf16 rounding, 2**-7 |y|).
    ``passed`` is None where ``_scaled_mm`` refuses the dtype combination (auto then emulates)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    grad_y = torch.randn(m, n, generator=gen) * 1e-4
    reference = nn.Linear(k, n, bias=False)  # the bias is not part of the fp8 GEMM (and would add a rounding)
    nn.init.normal_(reference.weight, std=0.02, generator=gen)
    weight = reference.weight.detach()
    fp32_bounds = (_bound(x, weight.t()), _bound(grad_y, weight), _bound(grad_y.t(), x))
    for name in RECIPES:
        recipe = Float8Recipe(name=name)
        cast_cpu = recipe.make_scaling().cast(x, role="input", axis=-1)
        cast_dev = recipe.make_scaling().to(device).cast(x.to(device), role="input", axis=-1)
        bitwise = bool(torch.equal(cast_cpu.data.view(torch.uint8), cast_dev.data.cpu().view(torch.uint8))
                       and torch.equal(cast_cpu.scale, cast_dev.scale.cpu()))
        for autocast in (False, True):
            row = {"recipe": name, "outputs": "bf16" if autocast else "fp32", "m": m, "k": k, "n": n,
                   "fp8_operand_bitwise_equal": bitwise}
            if autocast:
                row["auto_backend"] = _auto_backends(device, recipe, torch.bfloat16)
            emulated = Float8Linear.from_linear(copy.deepcopy(reference), recipe=recipe, use_scaled_mm=False)
            on_device = Float8Linear.from_linear(copy.deepcopy(reference).to(device), recipe=recipe,
                                                 use_scaled_mm=True)
            try:
                got = [t.cpu() for t in _fwd_bwd(on_device, x.to(device), grad_y.to(device), autocast=autocast)]
            except RuntimeError as err:
                row.update(scaled_mm="refused", error=str(err).splitlines()[0], passed=None)
                rows.append(row)
                continue
            want = _fwd_bwd(emulated, x, grad_y, autocast=autocast)
            tolerances = [b + (2.0 ** -7 * w.abs() if autocast else 0) for b, w in zip(fp32_bounds, want)]
            ratios = [((g - w).abs() / t).max().item() for g, w, t in zip(got, want, tolerances)]
            row.update(scaled_mm="ran", ratio_forward=ratios[0], ratio_grad_input=ratios[1],
                       ratio_grad_weight=ratios[2], passed=bitwise and max(ratios) <= 1.0)
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- 2. raw matmul
def time_matmul(device: torch.device, size: int, variant: str, warmup: int, iters: int) -> dict:
    """The kernels alone: ``a (n, n) @ b (n, n)`` in fp32, bf16, or fp8 ``_scaled_mm`` (bf16 out)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen)
    b = torch.randn(size, size, device=device, generator=gen)
    if variant == "fp8_scaled_mm":
        a_fp8, b_fp8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()  # b column-major
        one = torch.ones((), device=device)
        fn = lambda: torch._scaled_mm(a_fp8, b_fp8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        dtype = torch.float32 if variant == "fp32" else torch.bfloat16
        a_hp, b_hp = a.to(dtype), b.to(dtype)
        fn = lambda: a_hp @ b_hp  # noqa: E731
    ms = _median_ms(fn, device, warmup, iters)
    return {"size": size, "variant": variant, "ms": ms, "tflops": 2 * size ** 3 / (ms * 1e-3) / 1e12}


# --------------------------------------------------------------------------- 3. linear timing
def time_linear(device: torch.device, size: int, variant: str, warmup: int, iters: int) -> dict:
    torch.manual_seed(0)
    layer = nn.Linear(size, size, bias=False, device=device)
    if variant != "bf16":
        layer = Float8Linear.from_linear(layer, recipe=variant)
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def step():
        layer.weight.grad = None
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grad_y)

    ms = _median_ms(step, device, warmup, iters)
    return {"size": size, "variant": variant, "ms": ms, "tflops": 6 * size ** 3 / (ms * 1e-3) / 1e12}


# --------------------------------------------------------------------------- 4. GPT step
def time_gpt(device: torch.device, config: str, warmup: int, iters: int) -> list[dict]:
    workload = get_workload("gpt", config=config)
    torch.manual_seed(0)
    base = workload.build_model()
    rows = []
    for variant in ("bf16", "fp8-tensorwise"):
        model = copy.deepcopy(base)
        report = None
        if variant != "bf16":
            report = convert_to_float8(model, recipe="tensorwise")
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        batches = workload.batches("train", seed=0)
        losses = []

        def step():
            batch = move_batch(next(batches), device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = workload.loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        ms = _median_ms(step, device, warmup, iters)
        tokens = workload.config.batch_size * workload.config.block_size
        rows.append({"config": config, "variant": variant, "ms": ms, "tokens_per_s": tokens / (ms * 1e-3),
                     "first_loss": losses[0].item(), "last_loss": losses[-1].item(),
                     "converted": None if report is None else len(report.converted),
                     "kept": None if report is None else [name for name, _ in report.skipped]})
    return rows


# --------------------------------------------------------------------------- main
def _table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU, to check this script")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="linear sizes (default 4096 8192 16384)")
    parser.add_argument("--out", default="gpu_fp8.json", help="JSON results path")
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip remaining parts after this long")
    args = parser.parse_args(argv)

    if args.cpu:
        device = torch.device("cpu")
        sizes, check_shape, gpt_config, warmup, iters = args.sizes or [64, 128], (40, 64, 32), "tiny", 2, 3
        matmul_sizes = [256]  # CPU _scaled_mm is a reference kernel (~0.1 GFLOP/s): keep it tiny
    else:
        if not torch.cuda.is_available():
            print("gpu_fp8.py: no CUDA device here, nothing measured (use --cpu to check the script on tiny sizes)")
            return 0
        device = torch.device("cuda")
        sizes, check_shape, gpt_config = args.sizes or [4096, 8192, 16384], (256, 512, 384), "small"
        warmup, iters, matmul_sizes = 5, 20, sizes
    budget = Budget(args.budget_s)
    available, reason = fp8_available(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"date": datetime.date.today().isoformat(), "device": str(device), "device_name": device_name,
            "torch": torch.__version__, "fp8_available": available, "fp8_reason": reason}
    print(f"# gpu_fp8 {meta['date']}  {meta['device_name']}  torch {meta['torch']}\n# {reason}")
    results: dict = {"meta": meta, "check": [], "matmul": [], "linear": [], "gpt": [], "skipped": []}

    results["check"] = check(device, *check_shape)
    print("\n## check: device _scaled_mm vs CPU emulation (ratio = max |diff| / tolerance; pass <= 1)")
    print(_table(results["check"], ["recipe", "outputs", "scaled_mm", "fp8_operand_bitwise_equal", "ratio_forward",
                                    "ratio_grad_input", "ratio_grad_weight", "passed", "error"]))
    for row in results["check"]:
        if "auto_backend" in row:
            print(f"  auto backend under bf16 autocast, {row['recipe']}: {row['auto_backend']}")

    for size in matmul_sizes:
        for variant in ("fp32", "bf16", "fp8_scaled_mm"):
            if budget.ok():
                results["matmul"].append(time_matmul(device, size, variant, warmup, iters))
            else:
                results["skipped"].append(f"matmul {size} {variant}: time budget spent")
    print("\n## raw matmul n x n x n, median ms (TFLOP/s = 2 n^3 / time; fp32 = TF32 off unless enabled)")
    print(_table(results["matmul"], ["size", "variant", "ms", "tflops"]))

    for size in sizes:
        for variant in ("bf16", *RECIPES):
            if not budget.ok():
                results["skipped"].append(f"linear {size} {variant}: time budget spent")
                continue
            try:
                results["linear"].append(time_linear(device, size, variant, warmup, iters))
            except RuntimeError as err:  # e.g. out of memory, or a _scaled_mm combination refused
                results["linear"].append({"size": size, "variant": variant, "error": str(err).splitlines()[0]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    bf16_ms = {r["size"]: r["ms"] for r in results["linear"] if r["variant"] == "bf16" and "ms" in r}
    for r in results["linear"]:
        if "ms" in r and r["size"] in bf16_ms:
            r["speedup_vs_bf16"] = bf16_ms[r["size"]] / r["ms"]
    print("\n## linear M=K=N=size, forward+backward, median ms (TFLOP/s = 6 size^3 / time)")
    print(_table(results["linear"], ["size", "variant", "ms", "tflops", "speedup_vs_bf16", "error"]))

    if budget.ok():
        results["gpt"] = time_gpt(device, gpt_config, warmup, iters)
        base = results["gpt"][0]["ms"]
        for r in results["gpt"]:
            r["speedup_vs_bf16"] = base / r["ms"]
    else:
        results["skipped"].append(f"gpt {gpt_config}: time budget spent")
    print(f"\n## GPT '{gpt_config}' training step (bf16 autocast; AdamW), median ms")
    print(_table(results["gpt"], ["config", "variant", "ms", "tokens_per_s", "speedup_vs_bf16", "first_loss",
                                  "last_loss", "converted"]))
    if results["skipped"]:
        print("\nskipped:", "; ".join(results["skipped"]))

    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    failed = [f"{r['recipe']}/{r['outputs']}" for r in results["check"] if r["passed"] is False]
    if failed:
        print(f"check FAILED: {failed}")
    return 1 if failed and device.type == "cuda" else 0


if __name__ == "__main__":
    sys.exit(main())
