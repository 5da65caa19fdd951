"""benchmarks/gpu_speed.py runs end to end in its CPU dry mode (tiny sizes; no GPU needed): every case of
its list gives a record without an error, and the JSON and markdown are written."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_speed_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_speed.py"), "--dry-run", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_speed.json").read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert [r["case"] for r in result["cases"]] == [c.name for c in gpu_speed.CASES]
    assert not result["skipped"]
    errors = {r["case"]: r["error"] for r in result["cases"] if "error" in r}
    assert not errors, errors
    assert result["meta"]["dry_run"] is True
    groups = {r["group"] for r in result["cases"]}
    assert groups == {"attention", "overhead", "compile"}
    md = (tmp_path / "gpu_speed.md").read_text()
    assert "## attention" in md and "## compile" in md and "dry run" in md
