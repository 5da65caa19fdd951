"""Crash-safe, verified, portable checkpoints of a :class:`mixprec.MixedPrecision` run.

A run's checkpoint **root** directory holds one directory per checkpoint and a ``latest``
pointer::

    ROOT/
      latest                  "step-120\\n": the newest complete checkpoint (replaced atomically)
      step-100/  step-120/    complete checkpoints, N = mp.boundaries (step boundaries reached);
                              a second save at the same N is named step-N.1, step-N.2, ...
      .tmp-step-140-PID-XXXX  a save in progress (or one killed mid-way: never loaded, removed
                              by the next save once process PID is gone)

Each ``step-N/`` directory::

    model.safetensors    model.state_dict() as stored (16-bit params stay 16-bit; buffers too); a
                         tensor sharing storage with an earlier one (a tied head) is stored once
                         and listed in manifest["model"]["aliases"]
    masters.safetensors  fp32 masters keyed by parameter name (policies with masters only)
    state.safetensors    every other tensor with more than one element: optimizer state
                         ("optimizer/state/<i>/<key>"; 8-bit state as it is held: the codes, uint8 or
                         fp8, under <key> and their fp32 scales under <key>_absmax), scheduler tensors, an EMA's fp32 shadow
                         ("ema/shadow/<param name>"), torch / CUDA / MPS RNG
                         states ("rng/torch", "rng/cuda/<d>", "rng/mps", uint8), the numpy MT19937
                         key and python ``random`` state ("rng/numpy", "rng/python", int64)
    manifest.json        everything else, as JSON (no pickle anywhere)

``manifest.json`` keys::

    format, version       "mixprec-checkpoint", 2
    name, step            "step-120", mp.boundaries
    policy                str(mp.policy): the text parses back to the policy
    world_size, device    1, where it was saved (informative: loading maps to mp.device)
    versions              mixprec, torch, safetensors, python
    counters              micro_step (always 0), applied_steps, skipped_total, boundaries
    loss_scale            LossScale.state_dict(): type, config, state (0-dim tensors inline)
    optimizer, scheduler  {"class": module.qualname, "state": encoded state_dict()} (scheduler null if none);
                          the optimizer's also "param_names": the model's name of each param it steps, by index
    guard                 Guard.state_dict() (config and counts; the in-memory snapshot is not saved) or null
    ema                   EMA.state_dict() (decay, every, counters; the shadow as tensor references) or null
    events                mp.events (the run's event log)
    rng                   torch / cuda / mps, numpy {bit_generator, key, pos, has_gauss, cached_gaussian},
                          python {version, state, gauss_next} (long states as tensor references)
    data_position         {"boundaries": mp.boundaries, ...what the caller passed}: e.g. mixprec
                          train stores {"split", "seed", "batches"} (batches drawn from the stream)
    model                 {"aliases": {name: stored name}, "masters": [param names], "frozen": [param names],
                          "extra_state": the model state dict's entries that are not tensors (a module's
                          get_extra_state(); tensors referenced), "block_state": the keys block-scaled linears
                          hold besides their params (a checkpoint of another policy may lack them)}
    tensors               {file: {tensor name: {"dtype", "shape"}}} for every safetensors file
    files                 {file: {"bytes", "sha256"}}
    extra                 the caller's JSON (mixprec train: workload, vocabulary, command, ...)
    checksum              sha256 of the canonical JSON (sorted keys, compact) of all other keys

Encoded state trees are JSON with tagged leaves: ``{"$tensor": name}`` (in state.safetensors),
``{"$scalar": value, "dtype": name}`` (0-dim tensor, exact: a Python float holds any fp32, bf16 or
fp16 value), ``{"$tuple": [...]}``, ``{"$items": [[key, value], ...]}`` (a dict with non-string keys,
e.g. optimizer state keyed by param index) and ``{"$dtype": name}``.

**Crash safety.** :func:`save_checkpoint` writes through :mod:`mixprec.checkpoint.layout` (which also
names the step directories, resolves ``latest`` and prunes): every file goes into ``.tmp-...``;
each file and the directory are fsynced, it is renamed to ``step-N`` (atomic), the root is
fsynced, and only then is ``latest`` replaced (written to a temporary name, fsynced,
``os.replace``'d, root fsynced). Old checkpoints beyond ``keep`` are renamed to ``.trash-...``
(atomic) before being deleted. A process killed at any moment therefore leaves ``latest`` naming
a complete checkpoint: the previous one, or the new one. One writer per root.

**Verification.** :func:`load_checkpoint` (and :func:`read_manifest`) check the manifest's
checksum, then every file's byte size and sha256, parse each safetensors file from the bytes that
were hashed, and compare every tensor's dtype and shape with the manifest, then with ``mp`` (model
keys and shapes, masters, optimizer class, param groups and state shapes, scheduler, loss-scale
type), all **before anything in ``mp`` changes**. A failure raises :class:`CheckpointError` (a
``ValueError``) naming the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from mixprec.auto.pending import adopted_decision, pending_note
from mixprec.checkpoint.layout import (LATEST, MANIFEST, CheckpointError, new_checkpoint, note_loaded,
                                      resolve_checkpoint)
from mixprec.checkpoint.manifest import FORMAT, LoadedExtra, Manifest, pin_op_plan
from mixprec.checkpoint.rng import rng_state, set_rng_state
from mixprec.checkpoint.tree import STATE_FILE, canonical, decode, dtype_name, encode, write_file
from mixprec.blockscale import block_state_keys
from mixprec.checkpoint.verify import (MASTERS_FILE, MODEL_FILE, Checkpoint, best_weights, check_fits,
                                       model_extra_state, model_state, qualname, read, read_manifest, read_weights,
                                       stepped_names)
from mixprec.engine.step_state import MID_ACCUMULATION

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "read_manifest", "read_weights",
           "resolve_checkpoint", "MANIFEST", "LATEST"]


# ---------------------------------------------------------------------------------------------- saving
def _unique_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU copies of ``state``, each shared tensor once; aliases map the rest to it."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return stored, aliases

def save_checkpoint(path: str | Path, mp: MixedPrecision, extra: dict | None = None, *, guard: Any = None,
                    keep: int | None = None, data_position: dict | None = None, ema: Any = None) -> Path:
    """Save ``mp`` as ``path/step-N`` in the one-process format (module docstring); returns that directory.
    Documented at :func:`mixprec.checkpoint.save_checkpoint`, which routes here."""
    _check_save_args(mp, extra, data_position, ema)
    guard = getattr(mp, "guard", None) if guard is None else guard
    manifest, payload = _contents(mp, guard, ema, extra, data_position)
    with new_checkpoint(path, mp.boundaries, keep=keep) as pending:   # files, fsyncs, rename, latest, keep
        index, files = {}, {}
        for file, tensors in payload.items():
            index[file] = {k: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for k, t in tensors.items()}
            files[file] = write_file(pending.tmp / file, safetensors.torch.save(tensors))
        body = manifest.named(pending.name, tensors=index, files=files).to_json()
        body["checksum"] = hashlib.sha256(canonical(body)).hexdigest()
        write_file(pending.tmp / MANIFEST, json.dumps(body, indent=1, allow_nan=True).encode())
    return pending.path


def _check_save_args(mp: MixedPrecision, extra: Any, data_position: Any, ema: Any) -> None:
    if mp.micro_step != 0:
        raise RuntimeError(MID_ACCUMULATION.format(call="save_checkpoint()", n=mp.micro_step, what="save"))
    for label, value in (("extra", extra), ("data_position", data_position)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"save_checkpoint {label} must be a dict or None, got {type(value).__name__}")
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise TypeError(f"save_checkpoint {label} must be JSON-serialisable: {err}") from None
    _check_ema(ema, mp, "save_checkpoint")


def _contents(mp: MixedPrecision, guard: Any, ema: Any, extra: dict | None,
              data_position: dict | None) -> tuple[Manifest, dict[str, dict[str, torch.Tensor]]]:
    """The manifest (unnamed, without ``tensors``/``files``) and the tensors of each safetensors file."""
    sd = mp.state_dict()   # first: it raises mid-accumulation, and masters adopt params edited outside
    model_sd = mp.module.state_dict()
    model_tensors, aliases = _unique_tensors({k: v for k, v in model_sd.items() if torch.is_tensor(v)})
    masters = {name: m.to("cpu", copy=True).contiguous() for name, m in sd["masters"].items()}
    state: dict[str, torch.Tensor] = {}
    extra_state = encode({k: v for k, v in model_sd.items() if not torch.is_tensor(v)}, "model_extra", state)
    own = {
        "loss_scale": encode(sd["loss_scale"], "loss_scale", state),
        "optimizer": {"class": qualname(mp.optimizer), "state": encode(sd["optimizer"], "optimizer", state),
                      "param_names": stepped_names(mp)},
        "scheduler": None if mp.scheduler is None else
        {"class": qualname(mp.scheduler), "state": encode(sd["scheduler"], "scheduler", state)},
        "ema": None if ema is None else encode(ema.state_dict(), "ema", state),
        "rng": rng_state(mp.device, state),
        "model": {"aliases": aliases, "masters": list(masters), "frozen": sd.get("frozen"),
                  "extra_state": extra_state, "block_state": sorted(block_state_keys(mp.module))},
    }
    manifest = Manifest.of(mp, format=FORMAT, counters=sd["counters"],
                           guard=None if guard is None else encode(guard.state_dict(), "guard", state),
                           data_position=data_position, extra=extra, state=own)
    payload = {MODEL_FILE: model_tensors, STATE_FILE: state}
    if masters:
        payload[MASTERS_FILE] = masters
    return manifest, payload




# ---------------------------------------------------------------------------------------------- loading
def _load_weights(ck: Checkpoint, mp: MixedPrecision) -> None:
    """Model tensors and masters only; fp32 values (saved master, else saved param) feed any policy. Block-scaled
    linears' own state is the checkpoint's where both hold it, else the engine's (check_fits matched the rest)."""
    own, saved = mp.module.state_dict(), {**model_state(ck), **model_extra_state(ck)}
    fitted = {k: saved.get(k, v) for k, v in own.items()}
    mp.masters.load_weights(mp.module, fitted, ck.files.get(MASTERS_FILE, {}))


def load_checkpoint(path: str | Path, mp: MixedPrecision, *, guard: Any = None, convert: bool = False,
                    adopt_policy: bool = False, weights_only: bool = False, restore_rng: bool = True,
                    ema: Any = None) -> LoadedExtra:
    """Verify the one-process checkpoint at ``path`` and load it into ``mp``; returns the manifest's ``extra``
    with its ``data_position`` (:class:`~mixprec.checkpoint.manifest.LoadedExtra`).
    Documented at :func:`mixprec.checkpoint.load_checkpoint`, which routes here; its policy rules in full:

    A checkpoint saved under another policy than ``mp.policy`` is refused unless:

    * ``convert=True``: convert to ``mp``'s policy. The engine is switched to the saved policy
      (:meth:`MixedPrecision.set_policy`), the state is loaded exactly, then ``set_policy`` goes back to
      ``mp``'s policy, whose rules apply: each param's fp32 value (the master where one exists, else
      the param plus any Kahan compensation) becomes the new param (cast) and the new master. So a
      bf16-mixed run resumed as bf16-pure builds its masters from the fp32 params; a bf16-pure run
      resumed as fp32 takes the masters as params; optimizer state moves with its tensor (moments
      cast to the new ``state_dtype``; 8-bit codes dequantized into fp32 state, fp32 state quantized into
      ``state=int8``/``fp8``, each a single rounding, the event's detail says which); the loss scale is kept when both policies name the same loss
      scaling, else built fresh. A ``"convert"`` event is appended to ``mp.events``.
    * ``adopt_policy=True``: switch ``mp`` to the saved policy and stay there (a run whose guard
      escalated precision, resumed with the engine built under the run's original policy). Bit-exact.
    """
    _check_load_args(mp, convert=convert, adopt_policy=adopt_policy, weights_only=weights_only, ema=ema)
    ck = read(path)
    ema_state = None if ema is None else _ema_state(ck, ema)
    _check_unchanged(ck, mp, convert=convert, adopt_policy=adopt_policy, weights_only=weights_only)
    check_fits(ck, mp, weights_only=weights_only)
    frozen_before, frozen = mp.frozen_names(), ck.manifest["model"].get("frozen")
    if not weights_only and frozen is not None:
        try:   # params the run unfroze (mp.unfreeze, no new param group) are unfrozen here too
            mp.match_frozen(frozen)
        except ValueError as err:
            raise CheckpointError(f"checkpoint {str(ck.path)!r}: {err}") from None
    thawed = [n for n in frozen_before if n not in set(mp.frozen_names())]
    try:
        extra = _load_state(ck, mp, guard=guard, convert=convert, adopt_policy=adopt_policy,
                            weights_only=weights_only, restore_rng=restore_rng)
    except (CheckpointError, ValueError):
        mp.refreeze(thawed)   # a refused load leaves the engine as it was given
        raise
    if ema is not None:
        ema.load_state_dict(ema_state)
    return LoadedExtra(extra, ck.manifest.get("data_position"))


def _check_load_args(mp: MixedPrecision, *, convert: bool, adopt_policy: bool, weights_only: bool, ema: Any) -> None:
    if convert and adopt_policy:
        raise ValueError("load_checkpoint: pass convert=True (to mp's policy) or adopt_policy=True (to the saved "
                         "policy), not both")
    _check_ema(ema, mp, "load_checkpoint")
    if ema is not None and weights_only:
        raise ValueError("load_checkpoint: ema= restores a run's averaged weights with its state; weights_only=True "
                         "loads the model alone. Drop one of them (for the averaged weights alone: "
                         "model.load_state_dict(ema.shadow, strict=False) after loading the EMA)")


def _check_unchanged(ck: Checkpoint, mp: MixedPrecision, *, convert: bool, adopt_policy: bool,
                     weights_only: bool) -> None:
    """The checks that change nothing: the policy, a run that unfroze into a new param group, frozen values
    vs fp16. Raises CheckpointError."""
    m = ck.manifest
    saved_policy, target = m["policy"], str(mp.policy)
    adopted = not weights_only and adopted_decision(mp.decision, target, saved_policy, m.get("events"), convert=convert)
    if saved_policy != target and not (convert or adopt_policy or adopted):   # pending auto adopts a decided run's
        raise CheckpointError(f"checkpoint {str(ck.path)!r} was saved under policy {saved_policy!r}, the engine "
                              f"runs {target!r}{pending_note(mp.decision)}; build the engine with "
                              f"policy={saved_policy!r}, or pass convert=True to convert the state to {target!r} "
                              f"(adopt_policy=True to switch the engine to {saved_policy!r})")
    try:
        if not weights_only and m["model"].get("frozen") is not None:
            mp.match_frozen(m["model"]["frozen"], check_only=True)
        mp.check_frozen_values(best_weights(ck))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(ck.path)!r}: {err}") from None


def _check_ema(ema: Any, mp: MixedPrecision, call: str) -> None:
    if ema is not None and getattr(ema, "mp", None) is not mp:
        raise ValueError(f"{call}: ema= must be a mixprec.EMA built on this engine (EMA(mp, ...)), got "
                         f"{type(ema).__name__}" + (" of another engine" if hasattr(ema, "mp") else ""))


def _ema_state(ck: Checkpoint, ema: Any) -> dict:
    """The checkpoint's EMA state, checked against ``ema`` (nothing changes). Raises CheckpointError."""
    where = f"checkpoint {str(ck.path)!r}"
    if ck.manifest.get("ema") is None:
        raise CheckpointError(f"{where} holds no EMA state (saved without ema=); pass ema=None to load it, and "
                              "build a new EMA(mp, ...) afterwards to start averaging from its weights")
    state = decode(ck.manifest["ema"], ck.files[STATE_FILE], where)
    try:
        ema.load_state_dict(state, check_only=True)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    return state


def _load_state(ck: Checkpoint, mp: MixedPrecision, *, guard: Any, convert: bool, adopt_policy: bool, weights_only: bool,
                restore_rng: bool) -> dict:
    """The mutating part of :func:`load_checkpoint`, after its checks: the engine's own
    ``load_state_dict`` (which converts or adopts the policy), then the guard and the RNG states."""
    m = ck.manifest
    if weights_only:
        _load_weights(ck, mp)
        return m["extra"]
    where = f"checkpoint {str(ck.path)!r}"
    tensors = ck.files[STATE_FILE]
    state = {
        "policy": m["policy"],
        "frozen": None,   # matched by load_checkpoint before
        "model": {**model_state(ck), **model_extra_state(ck)},
        "masters": ck.files.get(MASTERS_FILE, {}),
        "optimizer": decode(m["optimizer"]["state"], tensors, where),
        "scheduler": None if m["scheduler"] is None else decode(m["scheduler"]["state"], tensors, where),
        "loss_scale": decode(m["loss_scale"], tensors, where),
        "counters": m["counters"],
        "events": m["events"],
    }
    guard = mp.guard if guard is None else guard
    guard_state = None if guard is None or m["guard"] is None else decode(m["guard"], tensors, where)
    try:
        if guard_state is not None:
            guard.check_state_dict(guard_state)   # refused before anything of the engine loads
        mp.load_state_dict(state, convert=convert and m["policy"] != str(mp.policy),
                           adopt_policy=adopt_policy and m["policy"] != str(mp.policy))
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    if guard_state is not None:
        guard.load_state_dict(guard_state)
    note_loaded(ck.path)   # the run's next save under that root descends from it (checkpoint/layout.py)
    if restore_rng:
        set_rng_state(m["rng"], tensors)
    pin_op_plan(m, mp.device.type)
    return m["extra"]