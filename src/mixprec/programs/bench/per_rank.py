"""The bench's figures per rank under a strategy (``mixprec bench --strategy fsdp2|ddp`` under torchrun).

Every worker rank measures its own training-state bytes (:func:`mixprec.memory.state.state_bytes`: under FSDP2
its local shards, the 8-bit scales it holds whole) and its own peak live tensor bytes (the extra untimed step of
:mod:`mixprec.programs.bench.step_memory`); :func:`per_rank_fields` gathers them to every rank
(``all_gather_object``, one collective after the memory step) and rank 0's row carries them, in rank order, with
the max over ranks (the rank that bounds the device each needs): results.json keys
``state_bytes_per_param_per_rank``, ``state_bytes_per_param_per_rank_max``, ``peak_live_bytes_per_rank``,
``peak_live_bytes_per_rank_max`` (only under a strategy). The row's ``state_bytes_per_param`` and
``peak_live_bytes`` stay rank 0's own: under a strategy the table says "rank 0" and :func:`per_rank_lines` gives
every rank's, labelled per rank, in the console and report.md. Bytes per parameter per rank divide a rank's bytes
by the *global* parameter count (at 2 FSDP2 ranks about half of one process's figure).
"""

from __future__ import annotations

from typing import Any

from mixprec.distributed.rank_state import gather_per_rank

__all__ = ["per_rank_fields", "per_rank_lines", "per_rank_markdown", "rank0_tag"]


def _max(values: list) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def per_rank_fields(state_per_param: float, peak_live_bytes: int | None) -> dict[str, Any]:
    """This rank's bytes per parameter and peak live tensor bytes (None: not measured) gathered from every rank:
    the row's :data:`~mixprec.programs.bench.results.PER_RANK_KEYS` (a collective: every worker rank calls it at
    the same point)."""
    gathered = gather_per_rank((state_per_param, peak_live_bytes))
    state = [s for s, _ in gathered]
    live = [b for _, b in gathered]
    return {"state_bytes_per_param_per_rank": state, "state_bytes_per_param_per_rank_max": _max(state),
            "peak_live_bytes_per_rank": live, "peak_live_bytes_per_rank_max": _max(live)}


def rank0_tag(results: dict, label: str) -> str:
    """``label`` (e.g. ``" (rank 0)"``) for a table header or title whose figure is rank 0's own under a strategy;
    ``""`` in one process."""
    return label if (results.get("settings") or {}).get("strategy") else ""


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.2f} MiB"


def per_rank_lines(results: dict) -> list[str]:
    """Under a strategy: what the per-rank figures are, then per policy every rank's training-state bytes per
    parameter and peak live tensor bytes, and their max over ranks (console and report.md). Empty in one
    process."""
    settings = results.get("settings") or {}
    rows = {name: e for name, e in results["policies"].items() if e.get("state_bytes_per_param_per_rank")}
    if settings.get("strategy") is None or not rows:
        return []
    world = settings.get("world_size")
    lines = [f"per rank ({settings['strategy']}, {world} ranks; each rank's own tensors, a DTensor by its local "
             "shard; bytes per parameter = the rank's training-state bytes / the global parameter count; the "
             "table's figures are rank 0's):"]
    for name, e in rows.items():
        state = ", ".join(f"{v:.2f} (rank {r})" for r, v in enumerate(e["state_bytes_per_param_per_rank"]))
        live = ", ".join(f"{_mib(v)} (rank {r})" for r, v in enumerate(e.get("peak_live_bytes_per_rank") or []))
        lines.append(f"  {name}: training state per rank {state} B/param, max "
                     f"{e['state_bytes_per_param_per_rank_max']:.2f}; peak live tensor bytes per rank {live}, max "
                     f"{_mib(e.get('peak_live_bytes_per_rank_max'))}")
    return lines


def per_rank_markdown(results: dict) -> list[str]:
    """report.md's section "Per rank" (:func:`per_rank_lines` as a list); empty in one process."""
    lines = per_rank_lines(results)
    if not lines:
        return []
    return ["## Per rank", "", lines[0][0].upper() + lines[0][1:], "", *(f"- {line.strip()}" for line in lines[1:]),
            ""]
