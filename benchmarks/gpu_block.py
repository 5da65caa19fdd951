"""Block-scaled GEMMs on a lent GPU: does this device run them natively, do the native linears compute what the
emulation computes, and how fast is each (one JSON file).

    python benchmarks/gpu_block.py OUT.json               # on the GPU
    python benchmarks/gpu_block.py OUT.json --dry-run     # on the CPU at tiny sizes (checks the script)

For each preset recipe (``mxfp8``, ``nvfp4``) and output dtype bf16: :func:`mixprec.blockscale.native.recipe_support`
(its probe GEMM, or the reason the GEMMs are emulated: e.g. sm_90, an H100/H200). Where native: one
``BlockScaledLinear`` forward + backward both ways (``gemm="native"`` and ``gemm="emulated"``, the same weights,
input and output gradient), each result's largest difference in units of the fp32 accumulation bound (``2 K 2**-24``
times the row maxima's product, 64x for the quantized magnitudes), which must stay <= 1; then the median time of a
forward + backward (CUDA events, 5 warm-up, 20 timed, interleaved) for native, emulated and a bf16 ``nn.Linear`` at
``M = N = K`` in ``--sizes``. Exit status 1 when a native result exceeds its bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from mixprec.blockscale import BlockScaledLinear, get_block_recipe
from mixprec.blockscale.native import recipe_support


def _pass(linear: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    linear.weight.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = linear(x)
    y.backward(dy)
    return y.detach().float(), x.grad.float(), linear.weight.grad.float()


def agreement(recipe: str, size: int, device: torch.device) -> list[float]:
    """Native vs emulated forward, dgrad, wgrad: the largest |difference| / bound of each."""
    base = get_block_recipe(recipe)
    torch.manual_seed(0)
    emulated = BlockScaledLinear(size, size, recipe=dataclasses.replace(base, gemm="emulated"), device=device)
    native = BlockScaledLinear(size, size, recipe=dataclasses.replace(base, gemm="native"), device=device)
    native.load_state_dict(emulated.state_dict())
    x = torch.randn(size, size, device=device)
    dy = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    want, got = _pass(emulated, x, dy), _pass(native, x, dy)
    w, xa, dya = emulated.weight.detach().abs(), x.abs(), dy.float().abs()
    rows = ((xa.amax(1), w.amax(1)), (dya.amax(1), w.amax(0)), (dya.amax(0), xa.amax(0)))
    worst = []
    for g, e, (a, b) in zip(got, want, rows):
        bound = 2 * size * size * 2.0 ** -24 * 64 * a[:, None] * b[None, :] + e.abs() * 2.0 ** -7
        worst.append(float(((g - e).abs() / bound).max()))
    return worst


def timings(recipe: str, size: int, device: torch.device, rounds: int) -> dict[str, float]:
    """Median ms of a forward + backward for native, emulated and bf16 ``nn.Linear``, interleaved."""
    base = get_block_recipe(recipe)
    linears = {"native": BlockScaledLinear(size, size, recipe=dataclasses.replace(base, gemm="native"), device=device),
               "emulated": BlockScaledLinear(size, size, recipe=dataclasses.replace(base, gemm="emulated"),
                                             device=device),
               "bf16": torch.nn.Linear(size, size, device=device)}
    x = torch.randn(size, size, device=device)
    dy = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    times: dict[str, list[float]] = {k: [] for k in linears}
    for i in range(rounds + 5):
        for name, linear in linears.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _pass(linear, x, dy)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times[name].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--sizes", default="1024,4096,8192")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    sizes = [64] if args.dry_run else [int(s) for s in args.sizes.split(",")]
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "recipes": {}}
    status = 0
    for recipe in ("mxfp8", "nvfp4"):
        support = recipe_support(device, get_block_recipe(recipe), torch.bfloat16)
        entry = out["recipes"][recipe] = {"native": support.available, "reason": support.reason}
        print(f"{recipe}: {support.reason}", flush=True)
        if not support.available:
            continue
        entry["worst_vs_bound"] = {s: agreement(recipe, s, device) for s in sizes[:1]}
        status = status or int(max(entry["worst_vs_bound"][sizes[0]]) > 1.0)
        entry["ms"] = {s: timings(recipe, s, device, rounds=20) for s in sizes}
        print(json.dumps(entry, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
