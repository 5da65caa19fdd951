"""The engine's side of the ranks' agreement on the measured op plan (:mod:`mixprec.autocast.plan_agreement`).

Under ``strategy="ddp"``/``"fsdp2"`` with ``kernels=measured``, a key a rank measured runs ``fused`` on every rank
until the next accumulation boundary; there :meth:`KernelAgreement.at_boundary` runs, on every rank at the same
point: one all-reduce of one flag (does any rank have a pending key?) and its host read, and only when one does,
one ``all_gather_object`` of each rank's pending keys and choices, pinned as rank 0's choice on every rank
(:func:`mixprec.autocast.plan_agreement.settle`) and recorded (an ``"op-plan"`` event, cause ``"agreed"``, the
same words on every rank: each key, the kernel every rank now runs and what each rank had measured). No
collective runs in a forward: eval or rank-dependent code meeting a new key cannot hang, it runs ``fused``
(the same on every rank) until the next boundary. One process, or a strategy's group of one rank: nothing (no
collective, no event, no clause; the measured choice runs at once, as in one process).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.autocast import op_plan, plan_agreement
from mixprec.distributed.process import world_size
from mixprec.engine.feature import Feature
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event

__all__ = ["KernelAgreement", "KIND"]

KIND = "op-plan"


class KernelAgreement(Feature):
    """Built by the engine with its strategy (``name`` None: one process) and policy; ``note`` is the decision's
    clause ("" in one process or without ``kernels=measured``)."""

    def __init__(self, strategy: Any, policy: Any) -> None:
        self._strategy = strategy
        world = world_size() if strategy.name is not None else 0
        self._world = world if world > 1 else 0   # a group of one rank: no one to agree with
        if self._world:
            plan_agreement.require(self._world)
        self.note = "" if not (self._world and _measured(policy)) else (
            f"; under {strategy.name} every rank runs rank 0's measured attention kernel per key, agreed by the "
            f"{self._world} ranks at the accumulation boundary after the key's first call (fused on every rank "
            "until then)")

    def at_boundary(self, mp: Engine) -> None:
        """Agree on every rank's pending keys (module docstring); every rank calls it at the same boundary.
        Host sync: one read of the flag (under a strategy with ``kernels=measured`` only)."""
        if not self._world or not _measured(mp.policy):
            return
        own = op_plan.unagreed(mp.device.type)
        flag = self._strategy.agree_flags(torch.tensor([float(bool(own))], device=mp.device))
        if not flag.item():   # syncs
            return
        gathered = self._strategy.gathered(own)
        settled = plan_agreement.settle(gathered)
        for source in sorted({s for _, s in settled.values()}):
            chosen = {k: c for k, (c, s) in settled.items() if s == source}
            notes = {k: _measured_words(gathered, k) for k in chosen}
            op_plan.pin(chosen, mp.device.type, source=source, notes=notes)
        keys = "; ".join(f"{k} -> {c} ({_measured_words(gathered, k)})" for k, (c, _) in settled.items())
        mp.record(Event(mp.boundaries, KIND, "agreed", None,
                        f"attention kernels agreed by {len(gathered)} ranks: every rank runs rank 0's choice from "
                        f"here on (fused on every rank before): {keys}"))


def _measured(policy: Any) -> bool:
    return bool(policy.is_mixed and policy.kernels == "measured")


def _measured_words(gathered: list[dict[str, str]], key: str) -> str:
    """What each rank had measured for ``key`` ("rank 0 measured matmul, rank 1 fused-fp32, rank 2 -")."""
    return "measured: " + ", ".join(f"rank {r} {own.get(key, '-')}" for r, own in enumerate(gathered))
