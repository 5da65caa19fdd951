"""Checkpoints of a run: one save/load for one process or many (DCP), crash-safe.

:func:`save_checkpoint` writes the format the engine's strategy needs (one-process safetensors files,
:mod:`mixprec.checkpoint.local`; DCP shards under FSDP2, :mod:`mixprec.checkpoint.dcp`) through the one
directory layout (:mod:`mixprec.checkpoint.layout`: ``step-N`` directories, fsyncs, atomic renames,
``latest``, keep-K); :func:`load_checkpoint` and :func:`read_manifest` read either format.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from mixprec.checkpoint import dcp, local
from mixprec.checkpoint.layout import LATEST, MANIFEST, CheckpointError, read_manifest_json, resolve_checkpoint
from mixprec.checkpoint.manifest import LoadedExtra, is_dcp
from mixprec.checkpoint.verify import read_weights
from mixprec.distributed.process import world_size
from mixprec.distributed.replicas import block_stream_mismatch
from mixprec.engine.records import Event
from mixprec.messages.location import user_stacklevel

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "read_manifest", "read_weights",
           "load_model_weights", "resolve_checkpoint", "LoadedExtra", "MANIFEST", "LATEST"]


def save_checkpoint(path: str | Path, mp: MixedPrecision, extra: dict | None = None, *, guard: Any = None,
                    keep: int | None = None, data_position: dict | None = None, ema: Any = None) -> Path:
    """Save everything needed to continue ``mp`` bit-exactly as ``path/step-N``; returns that directory.

    Args:
        path: the run's checkpoint root (created if needed). See the module docstring for the layout.
        mp: a :class:`mixprec.MixedPrecision` at a step boundary.
        extra: JSON-serialisable dict stored in the manifest and returned by :func:`load_checkpoint`.
        guard: a :class:`mixprec.Guard` whose counts to save (default: ``mp.guard``, if any).
        keep: keep exactly ``keep`` checkpoints: the new one (which ``latest`` names) and the newest
            ``keep - 1`` others (None: keep all).
        data_position: JSON dict saying where the data stream is (e.g. ``{"batches": 1200}``); stored
            in the manifest's ``data_position`` next to ``boundaries``, and given back by
            :func:`load_checkpoint` (the ``data_position`` of what it returns).
        ema: a :class:`mixprec.EMA` of ``mp`` to save with it (its fp32 shadow and counters), or None.

    The format follows ``mp.strategy``: None, the one-process format (:mod:`mixprec.checkpoint.local`);
    ``"ddp"``, the same, written by rank 0 alone (replicas are identical), ``extra`` getting
    ``{"distributed": {"strategy", "world_size"}}`` and ``data_position`` ``world_size``; ``"fsdp2"``,
    DCP shards from every rank (:mod:`mixprec.checkpoint.dcp`; no ``ema``). Call it on every rank. Under either
    strategy block-scaled linears keep one stochastic-rounding stream per linear, the same on every rank: where the
    ranks' streams differ (some rank ran backward through a linear another number of times), a warning and a
    ``"block-streams"`` event (saved with it) say so before the save (one ``all_gather_object``).

    Crash-safe (see :mod:`mixprec.checkpoint.local`): a process killed at any moment leaves ``latest`` naming a
    complete checkpoint. Host syncs: copies every tensor to the CPU.

    Raises:
        RuntimeError: called between ``backward()`` and the accumulation boundary.
        ValueError: ``keep`` is not a positive int; ``ema`` is not an EMA of ``mp``.
        TypeError: ``extra`` / ``data_position`` are not JSON, or some state cannot be stored without pickle;
            ``path``/``mp`` swapped or not a path and an engine.
    """
    _check_path_and_engine("save_checkpoint", path, mp)
    if mp.strategy is None:
        return local.save_checkpoint(path, mp, extra, guard=guard, keep=keep, data_position=data_position, ema=ema)
    if ema is not None:
        raise ValueError(f"save_checkpoint ema= under strategy={mp.strategy!r} is not supported (the distributed "
                         "checkpoints do not carry an EMA yet); pass ema=None")
    _note_block_streams(mp)
    if mp.strategy != "ddp":
        return dcp.save(path, mp, extra, guard=guard, keep=keep, data_position=data_position)
    dcp.check_boundary(mp, "save_checkpoint")
    info = {"strategy": mp.strategy, "world_size": world_size()}
    position = {"world_size": world_size(), **(data_position or {})}
    saved = dcp.on_main_process(lambda: str(local.save_checkpoint(
        path, mp, extra={**(extra or {}), "distributed": info}, guard=guard, keep=keep, data_position=position)),
        "save_checkpoint")
    return Path(saved)


def _note_block_streams(mp: MixedPrecision) -> None:
    """Warn and record a ``"block-streams"`` event when the ranks' block-scaled stochastic-rounding streams differ
    (:func:`mixprec.distributed.replicas.block_stream_mismatch`; every rank calls it)."""
    why = block_stream_mismatch(mp.module)
    if why is not None:
        warnings.warn(f"mixprec: save_checkpoint under strategy={mp.strategy!r}: {why}", stacklevel=user_stacklevel())
        mp.record(Event(mp.boundaries, "block-streams", None, None, why))


def _check_path_and_engine(call: str, path: Any, mp: MixedPrecision) -> None:
    from mixprec.engine.mixed_precision import MixedPrecision   # checkpoint sits above the engine; lazy for import time
    if not isinstance(path, (str, Path)) or not isinstance(mp, MixedPrecision):
        raise TypeError(f"{call}(path, mp, ...) takes the checkpoint directory first and the MixedPrecision engine "
                        f"second; got path={type(path).__name__}, mp={type(mp).__name__} (swapped? call "
                        f"{call}('runs/ckpt', mp))")


def load_checkpoint(path: str | Path, mp: MixedPrecision, *, guard: Any = None, convert: bool = False,
                    adopt_policy: bool = False, weights_only: bool = False, restore_rng: bool = True,
                    ema: Any = None) -> LoadedExtra:
    """Verify the checkpoint at ``path`` and load it into ``mp``; returns what :func:`save_checkpoint` stored
    for the caller, either format, as a :class:`~mixprec.checkpoint.manifest.LoadedExtra`: a dict equal to the
    saved ``extra``, whose ``.data_position`` is the saved ``data_position`` (the caller's dict with the
    ``boundaries`` the save added, and ``world_size`` from a distributed save), to continue the data stream.

    ``path`` is a checkpoint root (follows ``latest``) or a ``step-N`` directory, of either format:
    a DCP checkpoint (:mod:`mixprec.checkpoint.dcp`) loads into an engine of the same policy with any
    strategy and number of ranks (``convert``, ``weights_only``, ``ema`` and ``restore_rng=False`` do not
    apply to it); every rank calls it. Everything is checked
    (module docstring) before ``mp`` changes. Then the model, masters, optimizer, scheduler,
    loss scale, counters and event log are restored, ``guard`` (default ``mp.guard``) gets its saved
    counts (its in-memory snapshot starts empty), and the torch / CUDA / MPS / numpy / python RNG states
    are restored (``restore_rng=False`` leaves them); ``ema`` (a :class:`mixprec.EMA` of ``mp``) gets the
    saved shadow and counters, exactly. Tensors land on ``mp.device`` whatever device
    they were saved from (CUDA RNG states are skipped where there is no CUDA). Same device and
    policy: continuing is bit-exact with the uninterrupted run.

    **Policy.** A checkpoint saved under another policy than ``mp.policy`` is refused unless ``convert=True``
    (convert to ``mp``'s policy: each param's fp32 value becomes the new param and master, optimizer state moves
    with its tensor, a ``"convert"`` event; the rules: :func:`mixprec.checkpoint.local.load_checkpoint`) or
    ``adopt_policy=True`` (switch ``mp`` to the saved policy and stay there: a run whose guard escalated
    precision, resumed with the engine built under the run's original policy; bit-exact).

    ``weights_only=True`` loads the model and masters only (inference, fine-tuning): the optimizer,
    scheduler, loss scale, counters, RNG and guard of ``mp`` are left alone; with ``convert=True`` each
    param takes the fp32 value (saved master, else saved param), cast to ``mp``'s dtypes.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError (a ValueError): a damaged, incomplete or ill-fitting checkpoint (naming the
            file), or a policy mismatch without ``convert``/``adopt_policy`` (naming the fix).
        CheckpointError: ``ema`` given and the checkpoint holds no EMA state, or another EMA's (decay,
            every, params).
        ValueError: ``convert`` and ``adopt_policy`` together; ``ema`` with ``weights_only``; ``mp``'s device cannot run the saved
            policy (conversion); ``mp`` changes nothing then.
        TypeError: ``path``/``mp`` swapped or not a path and an engine.
    """
    _check_path_and_engine("load_checkpoint", path, mp)
    directory, manifest = read_manifest_json(path)
    if not is_dcp(manifest):
        return local.load_checkpoint(directory, mp, guard=guard, convert=convert, adopt_policy=adopt_policy,
                                     weights_only=weights_only, restore_rng=restore_rng, ema=ema)
    dcp.check_load_options(directory, convert=convert, weights_only=weights_only, restore_rng=restore_rng, ema=ema)
    return dcp.load(directory, manifest, mp, guard=guard)


def read_manifest(path: str | Path) -> dict:
    """The manifest of the checkpoint at ``path`` (a root: follows ``latest``; or a ``step-N`` directory):
    a one-process one verified (every file's size, sha256, tensor dtypes and shapes), a DCP one as parsed.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a damaged or incomplete checkpoint (the message names the file).
    """
    directory, manifest = read_manifest_json(path)
    return manifest if is_dcp(manifest) else local.read_manifest(directory)


def load_model_weights(path: str | Path, model: nn.Module) -> dict:
    """Load only the model weights of the checkpoint at ``path`` (root or ``step-N``) into a plain,
    unwrapped ``model`` in one process, in place (values cast to each tensor's dtype); returns the
    manifest. For inference (``mixprec sample``): a DCP checkpoint (FSDP2, any number of ranks) is
    resharded into the full tensors (its params are the fp32 values the optimizer stepped); a
    one-process-format checkpoint takes the fp32 masters where saved, else the params.

    Raises:
        FileNotFoundError / CheckpointError: no (complete) checkpoint at ``path``.
        RuntimeError: the model's keys or shapes do not match the saved ones (torch's message).
    """
    directory, manifest = read_manifest_json(path)
    if is_dcp(manifest):
        dcp.load_model_weights(directory, model)
    else:
        model.load_state_dict(read_weights(directory))   # verifies this manifest, the hashes and shapes
    return manifest
