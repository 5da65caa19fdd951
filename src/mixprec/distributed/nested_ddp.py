"""The engine's DDP run inside another data-parallel wrapper: refused at its forward.

Under ``strategy="ddp"`` ``mp.model`` is the engine's ``DistributedDataParallel``: it reduces gradients in fp32,
agrees on skips and checks the ranks' rounding seeds. Handing ``mp.model`` to a framework that wraps models for
several processes (``accelerator.prepare(mp.model)`` under ``accelerate launch``, a trainer's DDP) puts a second
DDP around it: every gradient is then reduced twice, and the outer wrapper's ``no_sync`` and reduction dtype are
the framework's, not the policy's. Torch records the DDP whose forward is running
(``DistributedDataParallel._get_active_ddp_module()``, saved and restored for nested DDPs); a forward pre-hook on
the engine's DDP finds another one there and raises ValueError naming the route, before anything runs. No host
sync, no collective.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["refuse_outer_ddp"]


def refuse_outer_ddp(ddp: DistributedDataParallel) -> Any:
    """Register the pre-hook on ``ddp`` (the engine's); returns its handle."""
    def before_forward(module: nn.Module, args: Any) -> None:
        active = DistributedDataParallel._get_active_ddp_module()
        if active is not None and active is not module:
            raise ValueError(
                f"mp.model (the engine's DistributedDataParallel, strategy='ddp') runs inside another "
                f"{type(active).__name__} (accelerator.prepare(mp.model) under several processes, or a trainer's DDP): "
                "every gradient would be reduced twice, and the outer wrapper's no_sync and reduction dtype are not "
                "the policy's. Call mp.model itself, and pass only the dataloader to accelerator.prepare "
                "(loader = accelerator.prepare(loader))")
    return ddp.register_forward_pre_hook(before_forward)
