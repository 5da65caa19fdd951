"""A training run's logs: ``metrics.jsonl`` records, ``events.jsonl`` lines and TensorBoard scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path

from mixprec.engine.records import Event

__all__ = ["add_scalars", "event_lines", "finite", "keep_records_until", "tensorboard"]


def finite(x: float) -> float | None:
    """``x``, or None when it is not finite (JSON has no inf or nan)."""
    return x if math.isfinite(x) else None


def tensorboard(out: Path):
    """A TensorBoard SummaryWriter in ``out/tensorboard``, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def add_scalars(writer, prefix: str, values: dict, step: int) -> None:
    """Each finite number of ``values`` as the TensorBoard scalar ``<prefix>/<key>`` at ``step`` (no writer: nothing)."""
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)


def keep_records_until(path: Path, step: int) -> None:
    """Drop the records of ``path`` (JSON lines with a "step") after ``step``: they are redone."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def event_lines(events: list) -> list[str]:
    """``events`` as ``events.jsonl`` lines, one JSON object each."""
    return [json.dumps(Event.of(e).to_dict(), default=str) + "\n" for e in events]
