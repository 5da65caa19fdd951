"""How the bench says the plain-autocast peer (:mod:`mixprec.programs.bench.peer`): the console's lines and report.md's
section, read from results.json (its ``peer`` and each row's ``speedup_vs_peer``, ``saved_activation_ratio_vs_peer``,
``peak_live_ratio_vs_peer``)."""

from __future__ import annotations

from mixprec.programs.bench.figures import fmt
from mixprec.programs.bench.peer import PEER, label

__all__ = ["peer_lines", "peer_markdown"]

_WHAT = (f"`{PEER}` is not a mixprec policy: it is the loop a user writes instead of mixprec, trained and timed like a "
         "policy (same model, seed, batches, schedule and clipping; its own quality and timing workers, interleaved "
         "with the policies): the fp32 model under plain `torch.autocast`, the workload's torch optimizer, "
         "`clip_grad_norm_`, a `GradScaler` only in fp16, torch's own kernels. Its verdict is the quality gate alone. "
         "*speed* is its median step time over the row's (above 1: the row is faster); *saved* and *peak live* are the "
         "row's bytes over its (below 1: the row keeps less).")


def _comparisons(results: dict) -> list[tuple[str, str]]:
    """(row label, its figures against the peer) for every other row with at least one of them."""
    out = []
    for name, e in results["policies"].items():
        if name == PEER:   # 1.00x against itself
            continue
        figures = [e.get("speedup_vs_peer"), e.get("saved_activation_ratio_vs_peer"), e.get("peak_live_ratio_vs_peer")]
        if any(f is not None for f in figures):
            noisy = " (TIMINGS NOISY: unreliable)" if (results.get("timing") or {}).get("noisy") and figures[0] else ""
            out.append((label(name), f"speed {fmt(figures[0], '.2f', 'x')}{noisy}, saved {fmt(figures[1], '.2f', 'x')}, "
                                     f"peak live {fmt(figures[2], '.2f', 'x')}"))
    return out


def _state(results: dict) -> str | None:
    """One sentence on the peer when it has no comparisons to show (off under a strategy, SKIPPED, failed); None when
    it ran, or the run had ``--no-peer``."""
    peer = results.get("peer")
    if not peer:
        return None
    if peer.get("row") is None:
        return f"{PEER} peer: {peer.get('note')}"
    row = results["policies"].get(PEER) or {}
    if row.get("verdict") in ("SKIPPED", "FAIL") and row.get("step_time_ms_median") is None:
        return f"{label(PEER)}: {row['verdict']}: {row.get('reason')}"
    return None


def peer_lines(results: dict) -> list[str]:
    """The console's lines: what the peer ran, and every row's speed and saved bytes against it (empty under
    ``--no-peer``)."""
    state = _state(results)
    if state is not None:
        return [state]
    rows = _comparisons(results)
    if not rows:
        return []
    peer = results["policies"][PEER]
    return [f"{label(PEER)}: {peer.get('decision')}; each row against it (speed: its step time / the row's; saved, "
            "peak live: the row's bytes / its):", *(f"  {name}: {words}" for name, words in rows)]


def peer_markdown(results: dict) -> list[str]:
    """report.md's section on the peer: what it is, what it ran, each row against it."""
    state = _state(results)
    rows = _comparisons(results)
    if state is None and not rows:
        return []
    ran = (results["policies"].get(PEER) or {}).get("decision")
    return [f"## The `{PEER}` peer", "", _WHAT, "", *([f"It ran: {ran}.", ""] if ran else []),
            *([f"{state}.", ""] if state else []), *(f"- {name}: {words}" for name, words in rows),
            *([""] if rows else [])]
