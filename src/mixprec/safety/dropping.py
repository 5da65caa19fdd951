"""Which failures the guard answers by dropping the batch instead of rolling back: :func:`drop_reason`.

A step the engine skipped as non-finite applied nothing: params, masters, optimizer state and loss scale are as
the last healthy step left them. Rolling back to the snapshot (up to ``snapshot_every`` applied steps earlier)
then throws away healthy updates for a fault that may sit in one batch. The guard drops the batch instead when
the skip is the first non-finite one in a row (the words say whether :func:`mixprec.locate_nonfinite` found the
batch itself at fault); a second in a row, data or state, rolls back. A drop is still a failure at the place:
it counts towards escalation (a layer that overflows on every other batch is kept in fp32) and towards the
diagnosis that ends the run (a stream of bad batches, in a row or not, ends in an error naming them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["drop_reason"]


def drop_reason(result: Any, cause: str, report: Any, streak: int) -> str:
    """Why the failure of ``result`` (a :class:`~mixprec.engine.boundary.StepResult`) with ``cause`` needs no
    rollback, in words ("" when it does). ``report``: the localisation's
    :class:`~mixprec.numerics.localise.NonFiniteReport` or None; ``streak``: consecutive boundaries skipped as
    non-finite since the last applied step, this one included (rollbacks do not reset it). Pure: no host sync."""
    if result.applied or cause != "nonfinite" or streak != 1:
        return ""
    if report is not None and report.where == "input":
        return ("the batch itself holds non-finite values: dropped; nothing was applied, so no rollback (a second "
                "non-finite step in a row rolls back)")
    return ("the step was skipped and the state left as it was: its batch dropped, no rollback (a second "
            "non-finite step in a row rolls back)")
