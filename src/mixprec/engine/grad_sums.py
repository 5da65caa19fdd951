"""fp32 sums of 16-bit gradients over an accumulation window, for the params an optimizer steps in 16 bits.

Under a 16-bit-param policy without fp32 masters (``bf16-kahan``, ``bf16-sr``, ``bf16-lean``) autograd leaves a
micro-batch's gradient in the param's dtype and adds the next one into it there: summed in bf16, each add rounds
to 8 significant bits, and a micro-batch's share loses what lies below the running sum's ulp (with 16 micro-batches
about 4 of its 8 bits). DeepSpeed's bf16 accumulation had the same flaw (deepspeed#2352, #2768); the master
policies add each 16-bit gradient into an fp32 one (:mod:`mixprec.engine.masters`). Here, before each backward of
a window but its first, the 16-bit gradients so far are added into fp32 sums and freed, so autograd leaves the
next micro-batch's alone; at the boundary the last one is added and the sum rounded once, to nearest, into the
16-bit ``.grad`` the optimizer reads (torch keeps a gradient in its param's dtype). A window of one micro-batch
costs nothing; a longer one holds 4 bytes per 16-bit param until its boundary. Sparse gradients are left to
autograd. A short group's N/k and an fp16 unscale multiply the rounded gradient (one more rounding, within 1 ulp);
between backwards ``.grad`` holds the last micro-batch's gradient alone.

Off under FSDP2 (its reduce-scatter sums the window's unsharded gradients in fp32 already) and under a trainer's own
DDP (its ``no_sync`` reduces only the gradient it finds at the window's last micro-batch, so the earlier ones must
stay in ``.grad``: summed in bf16 there, said in an event). Under the engine's ``strategy="ddp"`` every micro-batch
is reduced while the sums are on (:attr:`GradSums.enabled`), as for masters. The first fold (or, off, the first
window that sums in 16 bits) is recorded as an ``"accumulation"`` event. No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.distributed.process import world_size
from mixprec.engine.feature import Feature, HeldEngine
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event

__all__ = ["GradSums"]

_16_BIT = (torch.bfloat16, torch.float16)


class GradSums(Feature):
    """The window's fp32 sums (each shaped as its param) of the 16-bit gradients of the params ``mp``'s optimizer
    steps: on in one process and under ``strategy="ddp"`` (:attr:`enabled`), events recorded on ``mp``."""

    _mp = HeldEngine()   # weakly: the engine owns this

    def __init__(self, mp: Engine) -> None:
        self._mp, self._said = mp, False
        self._sums: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    @property
    def enabled(self) -> bool:
        """The engine's DDP, or one process (read when used: a trainer may start its process group after the
        engine is built)."""
        return self._mp.strategy == "ddp" or (self._mp.strategy is None and world_size() == 1)

    def reduces_each(self) -> bool:
        """Whether the engine's DDP must reduce every micro-batch: the sums are on and the policy stores 16-bit
        params that the optimizer steps (no masters)."""
        policy = self._mp.policy
        return self.enabled and policy.param_dtype != torch.float32 and not policy.has_masters

    def before_backward(self, first: bool) -> None:
        """Before a backward: unless it is the window's ``first``, add each 16-bit dense gradient into its fp32
        sum and free it."""
        optimizer = self._mp.optimizer
        if first:   # a new window: what a discarded one summed goes (mp.discard_gradients(), a rollback)
            self._sums.clear()
        if first or optimizer is None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and p.dtype in _16_BIT and not p.grad.is_sparse]
        if not params:
            return
        if not self._said:
            self._said, dtype = True, _name(params[0].dtype)
            words = (f"the window's {dtype} gradients summed in fp32, rounded once at the boundary" if self.enabled
                     else f"the window's {dtype} gradients summed in {dtype} by autograd (a trainer's DDP reduces "
                          "the gradient it finds at the window's last micro-batch)")
            self._mp.record(Event(self._mp.boundaries, "accumulation", None, None, words))
        if not self.enabled:
            return
        held = [p for p in params if id(p) in self._sums]
        if held:
            torch._foreach_add_([self._sums[id(p)][1] for p in held], [p.grad for p in held])
        for p in params:
            if id(p) not in self._sums:
                self._sums[id(p)] = (p, p.grad.to(torch.float32))
            p.grad = None

    def close(self) -> None:
        """At the boundary: each sum plus the last micro-batch's gradient, rounded into the param's ``.grad``."""
        for p, sum_fp32 in self._sums.values():
            if p.grad is not None:
                sum_fp32.add_(p.grad)
            p.grad = sum_fp32.to(p.dtype)
        self._sums.clear()

    def captured(self, name_of: dict[int, str]) -> dict[str, torch.Tensor]:
        """The open window's sums by param name (copies), for its checkpoint."""
        return {name_of[key]: s.detach().clone() for key, (_, s) in self._sums.items()}

    def restore(self, named: dict[str, nn.Parameter], saved: dict[str, Any]) -> None:
        """Put a checkpoint's sums back (checked by :func:`mixprec.engine.open_group.check_group`)."""
        self._sums = {id(named[n]): (named[n], s.to(named[n].device, torch.float32).clone()) for n, s in saved.items()}


def _name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
