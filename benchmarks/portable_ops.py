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

from mixprec.programs.bench.portable_cost import measure_portable_cost


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="mid")
    parser.add_argument("--compute", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per loop (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=5, help="steps per interleaved block")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    result = {"config": args.config, "device": args.device,
              **measure_portable_cost("gpt", f"{args.compute}-mixed", args.device, config=args.config,
                                      steps=args.steps, block=args.block, warmup=args.warmup)}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
