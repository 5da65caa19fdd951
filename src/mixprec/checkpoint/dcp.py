"""Checkpoints written with ``torch.distributed.checkpoint`` (DCP): sharded state, any number of ranks.

:func:`save` writes ``root/step-N`` and ``root/latest`` through :mod:`mixprec.checkpoint.layout`, as
:mod:`mixprec.checkpoint.local` does (same names, fsyncs, atomic renames, ``latest`` pointer and
pruning): rank 0 starts the checkpoint's temporary directory, every rank writes its shards into it
(``dcp/``: model, optimizer, loss-scale state, scheduler), and after a barrier rank 0 writes
``manifest.json`` (:class:`mixprec.checkpoint.manifest.Manifest`, format ``"mixprec-dcp"``) and commits it.
Any number of ranks loads it (:func:`load`: DCP reshards, 2 FSDP2 ranks → 1 process, 4 → 2, ...), as
long as the engine's optimizer steps the model's own parameters (FSDP2 always; in one process, a
policy without masters). RNG states are not saved (each rank has its own).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from mixprec.auto.pending import pending_note
from mixprec.checkpoint.layout import (MANIFEST, CheckpointError, PendingCheckpoint, abort_checkpoint,
                                       begin_checkpoint, commit_checkpoint, note_loaded)
from mixprec.checkpoint.manifest import DCP_FORMAT, LoadedExtra, Manifest, pin_op_plan
from mixprec.distributed.process import from_main_process, is_main_process, world_size
from mixprec.engine.records import Event
from mixprec.engine.step_state import MID_ACCUMULATION

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["save", "load", "check_load_options", "load_model_weights", "on_main_process", "reshard_note", "check_fits"]


def _state(mp: MixedPrecision) -> dict[str, Any]:
    """What DCP saves and loads in place: model and optimizer by parameter name (DTensor shards
    under FSDP2), the loss-scale state tensors and the scheduler's state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if mp.masters.pairs:
        raise ValueError(f"a DCP checkpoint holds the fp32 values of the parameters the optimizer steps, but this "
                         f"engine steps separate fp32 masters (policy {mp.policy}, strategy={mp.strategy!r}); "
                         "use strategy='fsdp2' (any number of processes, also one) or a policy without masters")
    model_sd, optim_sd = get_state_dict(mp.module, mp.optimizer)
    engine: dict[str, Any] = {"loss_scale": mp.loss_scale.state_dict()["state"]}
    if mp.scheduler is not None:
        engine["scheduler"] = mp.scheduler.state_dict()
    return {"model": model_sd, "optim": optim_sd, "engine": engine}


@contextlib.contextmanager
def _one_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process without a group: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def on_main_process(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` run on rank 0, its result on every rank (a broadcast). When it raises, rank 0
    re-raises and every other rank raises RuntimeError naming the error, instead of waiting in
    the next collective."""
    result, error, failure = None, None, None
    if is_main_process():
        try:
            result = fn()
        except Exception as err:
            failure, error = err, f"{type(err).__name__}: {err}"
    result, error = from_main_process((result, error))
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"{what} failed on rank 0: {error}")
    return result


def save(root: str | Path, mp: MixedPrecision, extra: dict | None = None, *, guard: Any = None,
         keep: int | None = None, data_position: dict | None = None) -> Path:
    """Save ``mp`` as ``root/step-N`` with DCP (module docstring); call it on every rank. ``guard``:
    whose counts to save (default ``mp.guard``). ``data_position`` gets ``world_size`` added.

    Collective (barriers, broadcasts); copies tensors to the host (syncs). Returns ``root/step-N``.

    Raises:
        RuntimeError: called between ``backward()`` and the accumulation boundary; on ranks other
            than 0, when rank 0 failed to start or finish the checkpoint (rank 0 raises its error).
        ValueError: ``keep`` is not a positive int or None; an engine that steps separate fp32 masters.
    """
    import torch.distributed.checkpoint as dcp

    check_boundary(mp, "save_checkpoint")
    guard = getattr(mp, "guard", None) if guard is None else guard
    parts = _state(mp)
    pending: PendingCheckpoint = on_main_process(
        lambda: begin_checkpoint(root, mp.boundaries, keep=keep, caller="save_checkpoint"), "save_checkpoint")
    try:
        with _one_process_ok():
            dcp.save(parts, checkpoint_id=str(pending.tmp / "dcp"), no_dist=not dist.is_initialized())
    except BaseException:
        if is_main_process():
            abort_checkpoint(pending)
        raise
    _barrier()   # every rank's shards are written before rank 0 fsyncs and renames them

    def finish() -> Path:   # rank 0
        try:
            manifest = Manifest.of(mp, format=DCP_FORMAT, counters=mp.state_dict()["counters"],
                                   guard=None if guard is None else guard.state_dict(), world_size=world_size(),
                                   data_position={"world_size": world_size(), **(data_position or {})},
                                   extra=extra, strategy=mp.strategy)
            body = manifest.named(pending.name).to_json()
            (pending.tmp / MANIFEST).write_text(json.dumps(body, indent=1, allow_nan=True))
        except BaseException:
            abort_checkpoint(pending)
            raise
        return commit_checkpoint(pending)   # fsyncs, rename, latest, keep

    return on_main_process(finish, "save_checkpoint")


def check_boundary(mp: MixedPrecision, call: str) -> None:
    """Raise RuntimeError unless ``mp`` is at an accumulation boundary."""
    if mp.micro_step != 0:
        raise RuntimeError(MID_ACCUMULATION.format(call=call, n=mp.micro_step, what="save or load"))


def check_load_options(directory: Path, *, convert: bool, weights_only: bool, restore_rng: bool, ema: Any) -> None:
    """Raise ValueError for a :func:`mixprec.checkpoint.load_checkpoint` option that does not apply to the DCP
    checkpoint in ``directory`` (sharded state, no RNG or EMA): each must keep its default."""
    for name, value, default in (("convert", convert, False), ("weights_only", weights_only, False),
                                 ("restore_rng", restore_rng, True), ("ema", ema, None)):
        if value is not default:
            raise ValueError(f"load_checkpoint {name}={value!r} does not apply to the DCP checkpoint "
                             f"{str(directory)!r} (sharded state, no RNG or EMA); pass {name}={default!r}")


def load(directory: Path, manifest: dict, mp: MixedPrecision, *, guard: Any = None) -> LoadedExtra:
    """Load the DCP checkpoint in ``directory`` (its parsed ``manifest``) into ``mp``; returns its ``extra`` with
    its ``data_position`` (:class:`~mixprec.checkpoint.manifest.LoadedExtra`).
    Every rank calls it. Restored: model, optimizer, loss scale, scheduler, counters, events, the guard's
    counts (``guard``, default ``mp.guard``) and the op-plan pin.

    Raises:
        ValueError: another policy than ``mp``'s (the fix as fits one process or a sharded run); an engine with
            separate masters.
        CheckpointError: the saved model's names or shapes differ from ``mp``'s (:func:`check_fits`, the first
            mismatches named), before anything changes.
        RuntimeError: called between ``backward()`` and the accumulation boundary.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    check_boundary(mp, "load_checkpoint")
    if manifest["policy"] != str(mp.policy):
        raise ValueError(_policy_words(directory, manifest, mp))
    check_fits(directory, mp)
    checked = getattr(mp, "guard", None) if guard is None else guard
    if checked is not None and manifest.get("guard") is not None:
        checked.check_state_dict(manifest["guard"])   # refused before anything of the engine loads
    if mp.optimizer is not None:
        # DCP loads the keys the target state holds, and torch creates the moments only for an empty state: an
        # engine that started Kahan compensation at build holds that alone, so its moments would not be loaded.
        # Every entry is loaded from the checkpoint (saved under this policy), so nothing is lost here.
        mp.optimizer.state.clear()
    parts = _state(mp)
    with _one_process_ok():
        dcp.load(parts, checkpoint_id=str(directory / "dcp"), no_dist=not dist.is_initialized())
    set_state_dict(mp.module, mp.optimizer, model_state_dict=parts["model"], optim_state_dict=parts["optim"])
    mp.loss_scale.load_state_dict({**mp.loss_scale.state_dict(), "state": parts["engine"]["loss_scale"]})
    if mp.scheduler is not None:
        mp.scheduler.load_state_dict(parts["engine"]["scheduler"])
    saved = Manifest.from_json(manifest)
    mp.restore_progress(saved.counters, saved.events)  # saved at a boundary, as here
    if saved.world_size not in (None, world_size()):
        mp.record(Event(mp.boundaries, "reshard", None, None, reshard_note(saved.world_size, world_size())))
    guard = getattr(mp, "guard", None) if guard is None else guard
    if guard is not None and saved.guard is not None:
        guard.load_state_dict(saved.guard)
    pin_op_plan(manifest, mp.device.type)
    note_loaded(directory)   # the run's next save under that root descends from it (checkpoint/layout.py)
    return LoadedExtra(saved.extra, saved.data_position)


def _policy_words(directory: Path, manifest: dict, mp: MixedPrecision) -> str:
    """Why a DCP checkpoint of another policy is refused, and what to do, as fits ``mp``'s strategy."""
    saved, head = manifest["policy"], f"checkpoint {str(directory)!r} was saved under policy {manifest['policy']!r}"
    head += f" ({DCP_FORMAT}, {manifest.get('world_size') or 1} rank(s)), this engine runs {mp.policy}"
    if mp.strategy is None:   # one plain process: no shards, but DCP still loads in place under the saved policy
        return (f"{head}{pending_note(mp.decision)}; a DCP checkpoint loads in place, under the policy it was saved "
                f"with (load_checkpoint's convert=True is for the one-process format): build the engine with "
                f"policy={saved!r}, load, then mp.set_policy({str(mp.policy)!r}) converts the loaded state as "
                "convert=True would")
    return (f"{head}{pending_note(mp.decision)}; build the engine with policy={saved!r} (a sharded run cannot "
            "change policy while loading)")


def check_fits(directory: Path, mp: MixedPrecision) -> None:
    """Raise CheckpointError unless the DCP checkpoint in ``directory`` holds the model ``mp`` runs: the same
    parameter and buffer names and global shapes (read from DCP's metadata; nothing loaded, nothing changed)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    where = f"checkpoint {str(directory)!r}"
    meta = FileSystemReader(str(directory / "dcp")).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
    own = get_model_state_dict(mp.module)
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{where}: its DCP model state does not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}; build the same model (workload and config) before loading")
    shapes = [(k, list(saved[k].size), list(t.shape)) for k, t in own.items()
              if isinstance(t, torch.Tensor) and isinstance(saved[k], TensorStorageMetadata)
              and tuple(saved[k].size) != tuple(t.shape)]
    if shapes:
        raise CheckpointError(f"{where}: its DCP model state does not fit the model: " + "; ".join(
            f"tensor {k!r} has shape {s}, the model's is {m}" for k, s, m in shapes[:3])
            + f"{f' (and {len(shapes) - 3} more)' if len(shapes) > 3 else ''}; build the same model before loading")


def reshard_note(saved_world: int, world: int) -> str:
    """The event text of a DCP checkpoint loaded at another world size."""
    return (f"DCP checkpoint saved at {saved_world} rank(s), loaded at {world}: params, moments, Kahan compensation "
            "and 8-bit codes resharded by DCP (each element keeps its global index), the 8-bit scales loaded whole; "
            "stochastic rounding is keyed by global index, so the run continues as it would have at "
            f"{saved_world} rank(s) on the same gradients")


def load_model_weights(directory: Path, model: nn.Module) -> None:
    """Load the model weights of the DCP checkpoint in ``directory`` into a plain ``model``, in place
    (resharded into the full tensors: the fp32 values the optimizer stepped)."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(directory / "dcp"), no_dist=not dist.is_initialized())
    model.load_state_dict(state)
