"""An accumulation window saved open: what ``mp.state_dict()`` adds when it is called between boundaries (a
trainer's checkpoint after a validation that falls mid-window, on an exception, on a timer), and what
``mp.load_state_dict`` puts back, so the window goes on exactly as in the run that did not save.

The rest of ``state_dict()`` is the state of the last boundary (model, masters, optimizer, scheduler, loss
scale, counters): nothing of it changes inside a window. The open window adds ``state["open_group"]`` (None
at a boundary):

* ``grads``: each param's gradient so far, by name, as ``backward()`` left it (times the loss scale, in the
  param's dtype, summed by autograd); ``master_grads``: under ``-pure`` the fp32 masters' (the 16-bit ones were
  added into them and freed); ``grad_sums``: under 16-bit params without masters, the fp32 sums of the earlier
  micro-batches' gradients (:mod:`mixprec.engine.grad_sums`; absent in a state saved before them);
* ``micro_step``; ``pending``: 1 when a ``backward()`` awaits its ``step()`` (a trainer's joined micro-batches),
  2 after ``backward(retain_graph=True)``, else 0; ``end_next``: ``mp.end_group_next()`` was called;
* ``losses``: the window's loss tally (:meth:`~mixprec.engine.boundary.BoundaryLosses.state_dict`), so the
  boundary's mean loss and its skip decision see every micro-batch.

The gradients are copies (the next ``backward()`` adds into the live ones in place). Not saved: a guard's
kept micro-batches (``mp.step_batches``), so after a resume the guard's diagnosis of that window sees only
those after the load. Under ``strategy=`` each rank's gradients of an open window are its own and not yet
reduced: saving there is refused (RuntimeError), as before, but under FSDP2 with ``accumulation_steps=1`` (a
trainer's joined micro-batches: Lightning's ``ModelParallelStrategy``), where every micro-batch is reduce-scattered
into the params' sharded ``.grad``: then ``grads`` holds this rank's local shards (``"sharded": True``), the caller
gathers every rank's, and each rank puts its own back as DTensors of its params' placements. No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mixprec.engine.boundary import BoundaryLosses
from mixprec.engine.grad_sums import GradSums
from mixprec.engine.protocol import Engine
from mixprec.engine.step_state import MID_ACCUMULATION, Phase

__all__ = ["capture_group", "check_group", "restore_group"]


def capture_group(mp: Engine, phase: Phase, end_next: bool, losses: BoundaryLosses,
                  sums: GradSums) -> dict[str, Any] | None:
    """``state["open_group"]`` of ``mp`` (module docstring): None at a boundary, else the window's gradients
    (copies), counts and loss tally; ``phase``/``end_next``/``losses``/``sums``: the engine's. RuntimeError
    mid-window under a strategy. No host sync."""
    if mp.micro_step == 0 and not end_next:
        return None
    if mp.strategy is not None and not _sharded_window(mp):
        raise RuntimeError(MID_ACCUMULATION.format(call="state_dict()", n=mp.micro_step, what=(
            f"under strategy={mp.strategy!r} each rank's gradients of the open window are its own; take it")))
    named = list(mp.module.named_parameters())
    name_of = {id(p): n for n, p in named}
    return {"micro_step": mp.micro_step, "pending": {Phase.RETAINED: 2, Phase.PENDING: 1}.get(phase, 0),
            "end_next": bool(end_next), "sharded": mp.strategy is not None,
            "grads": {n: _local(p.grad).detach().clone() for n, p in named if p.grad is not None},
            "master_grads": {name_of[id(p)]: m.grad.detach().clone() for p, m in mp.masters.pairs
                             if m.grad is not None},
            "grad_sums": sums.captured(name_of), "losses": losses.state_dict()}


def check_group(mp: Engine, saved: dict[str, Any] | None) -> None:
    """Raise ValueError, before anything changes, unless ``saved`` (a :func:`capture_group`) fits ``mp``'s
    params and masters (each gradient names a param and has its shape and dtype, fp32 for a master's) and
    ``mp`` runs one process."""
    if not saved:
        return
    if (mp.strategy is not None) != bool(saved.get("sharded")) or (mp.strategy and not _sharded_window(mp)):
        raise ValueError(f"the state was saved mid-accumulation {'by FSDP2' if saved.get('sharded') else 'by one process'}"
                         f"; under strategy={mp.strategy!r} with accumulation_steps={mp.accumulation_steps} it does not "
                         "fit (each rank's window is its own): load a state saved at an optimizer-step boundary")
    named = {n: _local(p) for n, p in mp.module.named_parameters()}
    with_master = {id(p) for p, _ in mp.masters.pairs}
    wrong = [f"{n} ({_text(g)})" for key, fp32 in (("grads", False), ("master_grads", True), ("grad_sums", True))
             for n, g in saved.get(key, {}).items()
             if n not in named or g.shape != named[n].shape or g.dtype != (torch.float32 if fp32 else named[n].dtype)
             or (key == "master_grads" and id(named[n]) not in with_master)
             or (key == "grad_sums" and named[n].dtype == torch.float32)]
    if wrong:
        raise ValueError(f"the state was saved mid-accumulation ({saved['micro_step']} micro-batch(es) of an open "
                         f"window) and its gradients {wrong[:4]} do not fit this model under {mp.policy} (another "
                         "model or policy): load it into the model and policy that saved it, or load a state saved "
                         "at an optimizer-step boundary")


def restore_group(mp: Engine, saved: dict[str, Any], losses: BoundaryLosses,
                  sums: GradSums) -> tuple[int, Phase, bool]:
    """Put the window's gradients of ``saved`` (checked by :func:`check_group`) back on ``mp``'s params, masters
    and ``sums`` (copies, on ``mp.device``) and its tally into ``losses``; returns ``(micro_step, phase,
    end_next)`` for the engine to assign. No host sync."""
    named = dict(mp.module.named_parameters())
    master_of = {id(p): m for p, m in mp.masters.pairs}
    for key, holder in (("grads", lambda p: p), ("master_grads", lambda p: master_of[id(p)])):
        for name, grad in saved[key].items():
            holder(named[name]).grad = _placed(grad.detach().to(mp.device, copy=True), named[name])
    sums.restore(named, saved.get("grad_sums", {}))
    losses.load_state_dict(saved["losses"], mp.device)
    micro_step = int(saved["micro_step"])
    phase = {2: Phase.RETAINED, 1: Phase.PENDING}.get(int(saved["pending"]), Phase.BETWEEN if micro_step else Phase.IDLE)
    return micro_step, phase, bool(saved["end_next"])


def _sharded_window(mp: Engine) -> bool:
    """FSDP2 reduce-scattering every micro-batch (``accumulation_steps=1``: a trainer joins its micro-batches)."""
    return mp.strategy == "fsdp2" and mp.accumulation_steps == 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _placed(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` as ``p``'s gradient: a DTensor of ``p``'s mesh and placements where ``p`` is one."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _text(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
