"""The GPU checks for a lent H100/H200/B200, one command: ``gpu_fp8.py``, ``gpu_speed.py`` then ``gpu_block.py``,
each in its own process (a crash in one keeps the others' results), writing into one output directory.

    python benchmarks/gpu_all.py OUT_DIR                 # all three, ~5 minutes each on an H200 (block: seconds
                                                         # there, where it records why the GEMMs are emulated)
    python benchmarks/gpu_all.py OUT_DIR --only speed    # or --only fp8, --only block
    python benchmarks/gpu_all.py OUT_DIR --dry-run       # both on the CPU at tiny sizes (checks the scripts)

Exit status: the first non-zero status of the scripts run (0 when all passed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands(out: Path, dry_run: bool, budget_s: float) -> dict[str, list[str]]:
    fp8 = [sys.executable, str(HERE / "gpu_fp8.py"), "--out", str(out / "gpu_fp8.json"), "--budget-s", str(budget_s)]
    speed = [sys.executable, str(HERE / "gpu_speed.py"), str(out), "--budget-s", str(budget_s)]
    block = [sys.executable, str(HERE / "gpu_block.py"), str(out / "gpu_block.json")]
    return {"fp8": fp8 + (["--cpu"] if dry_run else []), "speed": speed + (["--dry-run"] if dry_run else []),
            "block": block + (["--dry-run"] if dry_run else [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--only", choices=["fp8", "speed", "block"], default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--budget-s", type=float, default=270.0, help="each script's own time budget")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name, cmd in commands(out, args.dry_run, args.budget_s).items():
        if args.only not in (None, name):
            continue
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        try:
            rc = subprocess.run(cmd, timeout=args.budget_s + 180).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            print(f"== {name}: timed out", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
