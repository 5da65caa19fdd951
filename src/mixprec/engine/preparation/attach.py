"""An optimizer attached to a prepared model (``MixedPrecision(model, optimizer)`` or ``mp.attach``): checked
against the engine, and rebound to the fp32 masters where the policy has them, before the engine configures its
state and watches its param groups.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.engine.misuse.arguments import check_optimizer
from mixprec.engine.protocol import Engine
from mixprec.engine.storage import FrozenParams
from mixprec.optim import contract

__all__ = ["bind_optimizer"]


def bind_optimizer(mp: Engine, optimizer: torch.optim.Optimizer, scheduler: Any, strategy: Any,
                   frozen: FrozenParams) -> None:
    """Check ``optimizer`` and ``scheduler`` for the engine ``mp`` (:func:`~mixprec.engine.misuse.arguments.
    check_optimizer`; one rounding stream on every rank of ``strategy``), rebind ``optimizer`` to ``mp``'s fp32
    masters under a policy with masters, then check the policy's optimizer contract on the tensors it steps
    (:func:`mixprec.optim.contract.check`; ``frozen``'s params stored in 16 bits are not stepped). No host sync.

    Raises:
        TypeError, ValueError: as the engine's constructor does for a bad optimizer or scheduler.
    """
    check_optimizer(mp.module, optimizer, scheduler)
    strategy.check_attached(optimizer, mp.policy, mp.device)   # every rank: one rounding stream
    stored16 = {id(p) for p in frozen.stored16}
    if mp.policy.has_masters:
        mp.masters.rebind(optimizer)
    contract.check(optimizer, mp.policy, {p.dtype for g in optimizer.param_groups for p in g["params"]
                                          if id(p) not in stored16})
