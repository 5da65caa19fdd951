"""What the Lightning plugins need from Lightning's strategies and profiler: rank 0's values on every rank before the
engine casts them, ``ModelParallelStrategy`` as the engine's own FSDP2,
and the engine's memory measurement held while Lightning's ``PyTorchProfiler`` records.

Source: Lightning 2.6's ``ModelParallelStrategy`` (it runs ``configure_model`` before the precision plugin's
``convert_module``) and ``PyTorchProfiler`` (its schedule opens a ``torch.profiler`` session inside training steps).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.records import Event
from mixprec.memory.live import held

__all__ = ["resumed_parts", "reload_optimizer", "broadcast_from_rank0", "model_parallel", "profiler_hold"]


def broadcast_from_rank0(module: nn.Module) -> None:
    """Every rank takes rank 0's fp32 params and buffers (before the engine casts them), as DDP would after
    the cast: masters and Kahan compensations start equal on every rank. One broadcast per tensor."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size() < 2:
        return
    with torch.no_grad():
        for tensor in module.state_dict(keep_vars=True).values():
            torch.distributed.broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, src=0)


def model_parallel(strategy: Any, module: nn.Module) -> bool:
    """Whether ``strategy`` is Lightning's ``ModelParallelStrategy``, under which the engine builds its own FSDP2
    (``strategy="fsdp2"``: it shards the module itself). That strategy runs the user's ``configure_model`` before
    ``convert_module``: a module sharded there (DTensor params) is refused by name, its shards not the engine's."""
    from lightning.pytorch import strategies

    model_parallel = getattr(strategies, "ModelParallelStrategy", None)
    if model_parallel is None or not isinstance(strategy, model_parallel):
        return False
    from torch.distributed.tensor import DTensor

    sharded = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"L.Trainer(strategy={type(strategy).__name__}(...)) with MixprecPrecision: configure_model sharded the "
            f"model already ({len(sharded)} DTensor params, e.g. {sharded[0]!r}); the engine lays out its own FSDP2 "
            "shards (strategy='fsdp2': fp32 masters, 16-bit storage and fp32 gradient reduction per policy). Leave "
            "configure_model empty (tensor parallelism is not supported), or use L.Trainer(strategy='ddp')")
    return True


def resumed_parts(checkpoint: dict[str, Any], owner: str, trainer: Any,
                  attach: Callable[[], MixedPrecision]) -> dict[str, Any]:
    """Resuming under ``ModelParallelStrategy``: the model and optimizer states for the plugin's load (``owner``:
    its key in ``checkpoint``), after the engine has attached the optimizer (``attach``) on a cleared state and
    the optimizer has been loaded again (:func:`reload_optimizer`). A checkpoint written without the plugin (a
    ``32-true`` or Lightning AMP run) is adopted where the engine's shards are fp32 (``-mixed``, ``-pure``: Lightning
    loaded its fp32 weights into them exactly): its steps become the engine's counters, an ``"adopt-checkpoint"``
    event says so. ValueError for one under 16-bit storage (``-kahan``, ``-sr``, ``-lean``) or a single-file
    checkpoint. Every rank calls it."""
    trainer.strategy.optimizers[0].state.clear()   # set_precision needs an empty state; reloaded below
    engine = attach()
    adopting = owner not in checkpoint
    if adopting and engine.policy.param_dtype != torch.float32 and not engine.policy.has_masters:
        raise ValueError(f"fit(ckpt_path={str(trainer.ckpt_path)!r}) under ModelParallelStrategy: the checkpoint was "
                         f"written without MixprecPrecision, and {engine.policy} stores the shards in 16 bits, which "
                         "Lightning's load would round without the policy's conversion (Kahan compensation, 8-bit "
                         "state); adopt it under L.Trainer(strategy='ddp') or one process, or under a -mixed or -pure "
                         "policy here, then continue under ModelParallelStrategy")
    saved = None if adopting else checkpoint[owner].get("policy")
    if saved not in (None, str(engine.policy)):   # before the reload, whose entries would not match the saved ones
        raise ValueError(f"fit(ckpt_path={str(trainer.ckpt_path)!r}) under ModelParallelStrategy: the checkpoint was "
                         f"saved under {owner}({saved!r}), this plugin runs {engine.policy}; a policy change on resume "
                         f"is not supported there (the shards' layout and optimizer state are the saved policy's): "
                         f"resume with {owner}({saved!r}), or change the policy under L.Trainer(strategy='ddp')")
    reload_optimizer(engine.module, engine.optimizer, trainer.ckpt_path)
    if adopting:
        steps = int(checkpoint.get("global_step", 0))
        engine.restore_progress({"applied_steps": steps, "skipped_total": 0, "boundaries": steps}, None)
        detail = (f"Lightning checkpoint {str(trainer.ckpt_path)!r} (epoch {checkpoint.get('epoch')}, global_step "
                  f"{steps}): a run without mixprec state adopted under ModelParallelStrategy, its fp32 weights and "
                  f"{type(engine.optimizer).__name__} state loaded into the engine's fp32 shards as saved")
        engine.record(Event(step=steps, kind="adopt-checkpoint", cause=str(trainer.ckpt_path), module=None,
                            detail=detail, from_policy="fp32", to_policy=str(engine.policy)),
                      decision=f"{engine.decision}; adopted a run without mixprec state (fp32 → {engine.policy})")
    return {"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}


def reload_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, path: Any) -> None:
    """Load ``optimizer``'s state from the distributed checkpoint ``path`` that Lightning's
    ``ModelParallelStrategy`` wrote (a directory: DCP shards under ``"optimizer_0"``), into the entries the
    optimizer creates under its policy's precision. Lightning loads it before the engine has attached the optimizer,
    into the entries torch's defaults create (fp32 moments, no Kahan compensation): an entry it lacks would not be
    loaded. Every rank calls it (DCP reads collectively). ValueError for a single-file checkpoint
    (``save_distributed_checkpoint=False``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not Path(path).is_dir():
        raise ValueError(
            f"fit(ckpt_path={str(path)!r}) under ModelParallelStrategy with MixprecPrecision: a single-file checkpoint "
            "(save_distributed_checkpoint=False) is not supported; save with ModelParallelStrategy's default "
            "(save_distributed_checkpoint=True), or train with the engine's own loop, MixedPrecision(..., "
            "strategy='fsdp2') and mixprec.save_checkpoint / load_checkpoint, under torchrun")
    optimizer.state.clear()   # the entries come from one zero-lr step of the policy's optimizer (torch's DCP helper)
    state = {"optimizer_0": get_optimizer_state_dict(module, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(module, optimizer, optim_state_dict=state["optimizer_0"])


def profiler_hold(trainer: Any) -> AbstractContextManager[None]:
    """:func:`mixprec.memory.live.held` while the Trainer's profiler is Lightning's ``PyTorchProfiler``: its
    schedule opens its ``torch.profiler`` session inside a training step, where torch refuses a second one, so the
    engine's CPU memory measurement (``memory_budget=``) waits; nothing otherwise."""
    from lightning.pytorch.profilers import PyTorchProfiler

    if isinstance(getattr(trainer, "profiler", None), PyTorchProfiler):
        return held("Lightning's PyTorchProfiler is attached to the Trainer (its schedule opens its torch.profiler "
                    "session inside training steps, where torch allows one session per thread)")
    return nullcontext()
