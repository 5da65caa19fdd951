"""What the Lightning plugins need from Lightning's strategies and profiler: rank 0's values on every rank before the
engine casts them, ``ModelParallelStrategy`` as the engine's own FSDP2,
and the engine's memory measurement held while Lightning's ``PyTorchProfiler`` records.

Source: Lightning 2.6's ``ModelParallelStrategy`` (it runs ``configure_model`` before the precision plugin's
``convert_module``) and ``PyTorchProfiler`` (its schedule opens a ``torch.profiler`` session inside training steps).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from mixprec.memory.live import held

__all__ = ["refuse_resume", "broadcast_from_rank0", "model_parallel", "profiler_hold"]


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


def refuse_resume(path: Any) -> None:
    """Under ``ModelParallelStrategy``: ``fit(ckpt_path=...)`` is refused by name (ValueError) when the checkpoint
    reaches the plugin (Lightning's distributed checkpoint restores the module and optimizer states into the
    strategy's layout, which is not the engine's FSDP2 state: masters, loss scale, 16-bit storage)."""
    raise ValueError(
        f"fit(ckpt_path={str(path)!r}) under ModelParallelStrategy with MixprecPrecision: resuming is not supported "
        "yet (Lightning's distributed checkpoint loads the module and optimizer into its own layout, not the "
        "engine's FSDP2 state of fp32 masters and loss scale). Resume under L.Trainer(strategy='ddp'), or train "
        "with the engine's own loop, MixedPrecision(..., strategy='fsdp2') and mixprec.save_checkpoint / "
        "load_checkpoint, under torchrun")


def profiler_hold(trainer: Any) -> AbstractContextManager[None]:
    """:func:`mixprec.memory.live.held` while the Trainer's profiler is Lightning's ``PyTorchProfiler``: its
    schedule opens its ``torch.profiler`` session inside a training step, where torch refuses a second one, so the
    engine's CPU memory measurement (``memory_budget=``) waits; nothing otherwise."""
    from lightning.pytorch.profilers import PyTorchProfiler

    if isinstance(getattr(trainer, "profiler", None), PyTorchProfiler):
        return held("Lightning's PyTorchProfiler is attached to the Trainer (its schedule opens its torch.profiler "
                    "session inside training steps, where torch allows one session per thread)")
    return nullcontext()
