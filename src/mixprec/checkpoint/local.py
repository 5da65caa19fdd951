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
    model                 {"aliases": {name: stored name}, "masters": [param names], "frozen": [param names]}
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
import random
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from mixprec.autocast import op_plan
from mixprec.optim.quantized_state import state_shape
from mixprec.engine.records import Event
from mixprec.checkpoint.layout import (LATEST, MANIFEST, CheckpointError, new_checkpoint, read_manifest_json,
                                    resolve_checkpoint)

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "read_manifest", "read_weights",
           "resolve_checkpoint", "MANIFEST", "LATEST"]

FORMAT = "mixprec-checkpoint"
VERSION = 2
MODEL_FILE, MASTERS_FILE, STATE_FILE = "model.safetensors", "masters.safetensors", "state.safetensors"


# ---------------------------------------------------------------------------------------------- JSON trees
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return dtype


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON; tensors with more than 0 dims go to ``tensors`` under ``path``."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return {"$scalar": obj.item(), "dtype": _dtype_name(obj.dtype)}
        tensors[path] = obj.detach().to("cpu", copy=True).contiguous()
        return {"$tensor": path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"$dtype": _dtype_name(obj)}
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        return {"$items": [[_encode(k, f"{path}/key", {}), _encode(v, f"{path}/{k}", tensors)]
                           for k, v in obj.items()]}
    raise TypeError(f"save_checkpoint: {path} holds a {type(obj).__name__}, which cannot be stored without "
                    "pickle; checkpoints hold tensors, numbers, strings, None, lists, tuples, dicts and dtypes")


def _decode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$tensor" in obj:
        if obj["$tensor"] not in tensors:
            raise CheckpointError(f"{where}: tensor {obj['$tensor']!r} is missing from {STATE_FILE}")
        return tensors[obj["$tensor"]]
    if "$scalar" in obj:
        return torch.tensor(obj["$scalar"], dtype=_dtype_from(obj["dtype"], where))
    if "$dtype" in obj:
        return _dtype_from(obj["$dtype"], where)
    if "$tuple" in obj:
        return tuple(_decode(v, tensors, where) for v in obj["$tuple"])
    if "$items" in obj:
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in obj["$items"]}
    return {k: _decode(v, tensors, where) for k, v in obj.items()}


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def _write(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` (the writer fsyncs it on commit); return its ``{"bytes", "sha256"}``."""
    path.write_bytes(data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ---------------------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Checkpoint:
    """A verified checkpoint in memory: its directory, manifest and tensors per file."""

    path: Path
    manifest: dict
    files: dict[str, dict[str, torch.Tensor]]


def _read(path: str | Path) -> _Checkpoint:
    directory, manifest = read_manifest_json(path)
    where = f"checkpoint {str(directory)!r}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {MANIFEST} is not a mixprec checkpoint manifest (format="
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, want {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{where}: {MANIFEST} has version {manifest.get('version')!r}; this mixprec reads "
                              f"version {VERSION} (re-save the run with this version)")
    if manifest.get("checksum") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointError(f"{where}: {MANIFEST} does not match its own checksum: it was edited or corrupted "
                              "after saving; load another checkpoint of the run")
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, expect in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{where}: {name} is missing (listed in {MANIFEST}); the checkpoint is incomplete")
        data = file.read_bytes()
        if len(data) != expect["bytes"]:
            raise CheckpointError(f"{where}: {name} has {len(data)} bytes, the manifest says {expect['bytes']} "
                                  "(truncated or partly copied)")
        if hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise CheckpointError(f"{where}: {name} does not match its sha256 in {MANIFEST} (corrupt); "
                                  "load another checkpoint of the run")
        try:
            tensors = safetensors.torch.load(data)
        except Exception as err:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{where}: {name} is not a readable safetensors file: {err}") from None
        index = manifest["tensors"].get(name, {})
        if set(index) != set(tensors):
            raise CheckpointError(f"{where}: {name} holds tensors {sorted(set(tensors) ^ set(index))[:5]} that "
                                  f"differ from {MANIFEST}'s index")
        for key, info in index.items():
            t = tensors[key]
            if _dtype_name(t.dtype) != info["dtype"] or list(t.shape) != info["shape"]:
                raise CheckpointError(f"{where}: {name} tensor {key!r} is {_dtype_name(t.dtype)} {list(t.shape)}, the "
                                      f"manifest says {info['dtype']} {info['shape']}")
        files[name] = tensors
    for required in (MODEL_FILE, STATE_FILE):
        if required not in files:
            raise CheckpointError(f"{where}: {MANIFEST} lists no {required}")
    return _Checkpoint(directory, manifest, files)


def read_manifest(path: str | Path) -> dict:
    """The verified manifest of the checkpoint at ``path`` (a root or a ``step-N`` directory).

    Every file is checked (sizes, sha256, tensor dtypes and shapes), as by :func:`load_checkpoint`.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a damaged or incomplete checkpoint (the message names the file).
    """
    return _read(path).manifest


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The saved model weights of the checkpoint at ``path`` (a root or a ``step-N`` directory), by
    state-dict name: the fp32 masters where saved, else the stored params and buffers, tied names
    (stored once) filled in. Verified as by :func:`read_manifest`; the tensors are on the CPU.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a damaged or incomplete checkpoint (the message names the file).
    """
    return _best_weights(_read(path))


# ---------------------------------------------------------------------------------------------- saving
def _rng_state(device: torch.device, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": _encode(torch.get_rng_state(), "rng/torch", tensors)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [_encode(s, f"rng/cuda/{i}", tensors) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    if device.type == "mps":
        rng["mps"] = _encode(torch.mps.get_rng_state(), "rng/mps", tensors)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        rng["numpy"] = {"bit_generator": kind, "key": _encode(torch.tensor(key.astype("int64")), "rng/numpy", tensors),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    version, internal, gauss_next = random.getstate()
    rng["python"] = {"version": version, "state": _encode(torch.tensor(internal, dtype=torch.int64), "rng/python",
                                                          tensors), "gauss_next": gauss_next}
    return rng


def _set_rng_state(rng: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(_decode(rng["torch"], tensors, "rng"))
    if "cuda" in rng and torch.cuda.is_available():  # a CUDA checkpoint loaded on CPU/MPS: nothing to restore
        states = [_decode(s, tensors, "rng") for s in rng["cuda"]]
        for index, state in enumerate(states[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)
    if "mps" in rng and torch.backends.mps.is_available():
        torch.mps.set_rng_state(_decode(rng["mps"], tensors, "rng"))
    if "numpy" in rng:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            n = rng["numpy"]
            key = _decode(n["key"], tensors, "rng").numpy().astype(np.uint32)
            np.random.set_state((n["bit_generator"], key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    py = rng["python"]
    random.setstate((py["version"], tuple(_decode(py["state"], tensors, "rng").tolist()), py["gauss_next"]))


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


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _stepped_names(mp: Any) -> list[str | None]:
    """The model's name of each tensor the optimizer steps, in its param-group order (None: not a model param)."""
    names: dict[int, str] = {}
    for (name, p), stepped in zip(mp.module.named_parameters(), mp.master_parameters()):
        names[id(p)] = names[id(stepped)] = name
    return [names.get(id(t)) for g in mp.optimizer.param_groups for t in g["params"]]


def _check_state_names(where: str, saved: list, own: list) -> None:
    """Raise CheckpointError unless the optimizer state saved at each index is for the param stepped there now:
    the model loads by name but the optimizer by index (same-shaped params registered in another order)."""
    for i, (saved_name, name) in enumerate(zip(saved, own)):
        if saved_name is not None and name is not None and saved_name != name:
            raise CheckpointError(f"{where}: the optimizer state of param {i} was saved for {saved_name!r}, but the "
                                  f"engine's optimizer steps {name!r} at that index; build the optimizer over the "
                                  "params in the run's order (or pass weights_only=True)")


def _versions() -> dict[str, str]:
    try:
        version = metadata.version("mixprec")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"mixprec": version, "torch": torch.__version__, "safetensors": safetensors.__version__,
            "python": sys.version.split()[0]}


def save_checkpoint(path: str | Path, mp: Any, extra: dict | None = None, *, guard: Any = None,
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
            in the manifest's ``data_position`` next to ``boundaries``.
        ema: a :class:`mixprec.EMA` of ``mp`` to save with it (its fp32 shadow and counters), or None.

    Crash-safe (see the module docstring): a process killed at any moment leaves ``latest`` naming a
    complete checkpoint. Host syncs: copies every tensor to the CPU.

    Raises:
        RuntimeError: called between ``backward()`` and the accumulation boundary.
        ValueError: ``keep`` is not a positive int; ``ema`` is not an EMA of ``mp``.
        TypeError: ``extra`` / ``data_position`` are not JSON, or some state cannot be stored without pickle.
    """
    if mp.micro_step != 0:
        raise RuntimeError(f"save_checkpoint() called after {mp.micro_step} micro-batch(es) of backward() without "
                           "reaching the step boundary; save at an accumulation boundary (after mp.step() returns a result)")
    for label, value in (("extra", extra), ("data_position", data_position)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"save_checkpoint {label} must be a dict or None, got {type(value).__name__}")
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise TypeError(f"save_checkpoint {label} must be JSON-serialisable: {err}") from None
    guard = getattr(mp, "guard", None) if guard is None else guard
    _check_ema(ema, mp, "save_checkpoint")

    sd = mp.state_dict()   # first: it raises mid-accumulation, and masters adopt params edited outside
    model_tensors, aliases = _unique_tensors(mp.module.state_dict())
    masters = {name: m.to("cpu", copy=True).contiguous() for name, m in sd["masters"].items()}
    state: dict[str, torch.Tensor] = {}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "name": None,
        "step": mp.boundaries,
        "policy": str(mp.policy),
        "world_size": 1,
        "device": str(mp.device),
        "versions": _versions(),
        "counters": sd["counters"],
        "loss_scale": _encode(sd["loss_scale"], "loss_scale", state),
        "optimizer": {"class": _qualname(mp.optimizer), "state": _encode(sd["optimizer"], "optimizer", state),
                      "param_names": _stepped_names(mp)},
        "scheduler": None if mp.scheduler is None else
        {"class": _qualname(mp.scheduler), "state": _encode(sd["scheduler"], "scheduler", state)},
        "guard": None if guard is None else _encode(guard.state_dict(), "guard", state),
        "ema": None if ema is None else _encode(ema.state_dict(), "ema", state),
        "events": json.loads(json.dumps([Event.of(e).to_dict() for e in mp.events], default=str)),
        "rng": _rng_state(mp.device, state),
        "op_plan": op_plan.choices(mp.device.type, policy=mp.policy),   # the kernels chosen: a resumed run pins them (bitwise resume)
        "data_position": {"boundaries": mp.boundaries, **(data_position or {})},
        "model": {"aliases": aliases, "masters": list(masters), "frozen": sd.get("frozen")},
        "tensors": {},
        "files": {},
        "extra": extra or {},
    }
    payload = {MODEL_FILE: model_tensors, STATE_FILE: state}
    if masters:
        payload[MASTERS_FILE] = masters

    with new_checkpoint(path, mp.boundaries, keep=keep) as pending:   # files, fsyncs, rename, latest, keep
        manifest["name"] = pending.name
        for file, tensors in payload.items():
            manifest["tensors"][file] = {k: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
                                         for k, t in tensors.items()}
            manifest["files"][file] = _write(pending.tmp / file, safetensors.torch.save(tensors))
        manifest["checksum"] = hashlib.sha256(_canonical(manifest)).hexdigest()
        _write(pending.tmp / MANIFEST, json.dumps(manifest, indent=1, allow_nan=True).encode())
    return pending.path


# ---------------------------------------------------------------------------------------------- loading
def _check_fits(ck: _Checkpoint, mp: Any, *, weights_only: bool) -> None:
    """Raise CheckpointError unless ``ck`` can be loaded into ``mp``: model keys and shapes, masters,
    optimizer class / groups / state shapes, scheduler and loss-scale presence. Touches nothing."""
    m = ck.manifest
    where = f"checkpoint {str(ck.path)!r}"
    model_saved = ck.files[MODEL_FILE]
    aliases = m["model"]["aliases"]
    own = mp.module.state_dict()
    saved_keys = set(model_saved) | set(aliases)
    if saved_keys != set(own):
        missing, unexpected = sorted(set(own) - saved_keys), sorted(saved_keys - set(own))
        raise CheckpointError(f"{where}: {MODEL_FILE} does not fit the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}; build the same model (workload and config) before loading")
    for key, tensor in own.items():
        saved = model_saved[aliases.get(key, key)]
        if saved.shape != tensor.shape:
            raise CheckpointError(f"{where}: {MODEL_FILE} tensor {key!r} has shape {list(saved.shape)}, the model's "
                                  f"is {list(tensor.shape)}; build the same model before loading")
    params = dict(mp.module.named_parameters())
    for key in m["model"]["masters"]:
        if key not in params or ck.files[MASTERS_FILE][key].shape != params[key].shape:
            raise CheckpointError(f"{where}: {MASTERS_FILE} tensor {key!r} matches no parameter of the model")
    if weights_only:
        return
    opt = m["optimizer"]
    if opt["class"] != _qualname(mp.optimizer):
        raise CheckpointError(f"{where}: the optimizer state is from {opt['class']}, the engine's optimizer is "
                              f"{_qualname(mp.optimizer)}; build the run's optimizer (or pass weights_only=True)")
    opt_state = _decode(opt["state"], ck.files[STATE_FILE], where)
    groups = [len(g["params"]) for g in opt_state["param_groups"]]
    if groups != [len(g["params"]) for g in mp.optimizer.param_groups]:
        raise CheckpointError(f"{where}: the optimizer state has param groups of sizes {groups}, the engine's "
                              f"optimizer {[len(g['params']) for g in mp.optimizer.param_groups]}")
    _check_state_names(where, opt.get("param_names") or [], _stepped_names(mp))   # absent: an older checkpoint
    stepped = [t for g in mp.optimizer.param_groups for t in g["params"]]
    index = [i for g in opt_state["param_groups"] for i in g["params"]]
    _check_state_shapes(where, opt_state["state"], {i: stepped[n].shape for n, i in enumerate(index)})
    if (m["scheduler"] is None) != (mp.scheduler is None):
        have = "has" if m["scheduler"] is not None else "has no"
        raise CheckpointError(f"{where}: the checkpoint {have} scheduler state but the engine "
                              f"{'has none' if mp.scheduler is None else 'has one'}; build the engine as the run did "
                              "(or pass weights_only=True)")
    if m["scheduler"] is not None and m["scheduler"]["class"] != _qualname(mp.scheduler):
        raise CheckpointError(f"{where}: the scheduler state is from {m['scheduler']['class']}, the engine's "
                              f"scheduler is {_qualname(mp.scheduler)}")


def _check_state_shapes(where: str, state: dict, shape_of: dict) -> None:
    """Raise CheckpointError unless every optimizer-state tensor of param ``i`` has the shape it must have for
    ``shape_of[i]``: the param's (8-bit codes too), or one scale per block of 256 for an 8-bit ``*_absmax``."""
    for i, entry in state.items():
        for key, value in entry.items():
            want = state_shape(key, shape_of[i]) if i in shape_of else None
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want:
                raise CheckpointError(f"{where}: optimizer state {key!r} of param {i} has shape {list(value.shape)}, "
                                      f"the engine's param has {list(shape_of.get(i, ()))} (so {want} for this key)")


def _model_state(ck: _Checkpoint) -> dict[str, torch.Tensor]:
    """The saved model state dict, tied weights (stored once) filled in under every name."""
    state = dict(ck.files[MODEL_FILE])
    for key, target in ck.manifest["model"]["aliases"].items():
        state[key] = state[target]
    return state


def _best_weights(ck: _Checkpoint) -> dict[str, torch.Tensor]:
    """The saved model state (tied names filled in) with the fp32 masters in place of their rounded 16-bit params, under
    every name of a tied weight (masters are keyed by one of its names)."""
    masters = ck.files.get(MASTERS_FILE, {})
    state = {**_model_state(ck), **masters}
    for key, target in ck.manifest["model"]["aliases"].items():
        state[key] = state[target] = masters.get(target, masters.get(key, state[target]))
    return state


def _load_weights(ck: _Checkpoint, mp: Any) -> None:
    """Model tensors and masters only; fp32 values (saved master, else saved param) feed any policy."""
    mp.masters.load_weights(mp.module, _model_state(ck), ck.files.get(MASTERS_FILE, {}))


def load_checkpoint(path: str | Path, mp: Any, *, guard: Any = None, convert: bool = False,
                    adopt_policy: bool = False, weights_only: bool = False, restore_rng: bool = True,
                    ema: Any = None) -> dict:
    """Verify the checkpoint at ``path`` and load it into ``mp``; returns the manifest's ``extra``.

    ``path`` is a checkpoint root (follows ``latest``) or a ``step-N`` directory. Everything is checked
    (module docstring) before ``mp`` changes. Then the model, masters, optimizer, scheduler,
    loss scale, counters and event log are restored, ``guard`` (default ``mp.guard``) gets its saved
    counts (its in-memory snapshot starts empty), and the torch / CUDA / MPS / numpy / python RNG states
    are restored (``restore_rng=False`` leaves them); ``ema`` (a :class:`mixprec.EMA` of ``mp``) gets the
    saved shadow and counters, exactly. Tensors land on ``mp.device`` whatever device
    they were saved from (CUDA RNG states are skipped where there is no CUDA). Same device and
    policy: continuing is bit-exact with the uninterrupted run.

    **Policy.** A checkpoint saved under another policy than ``mp.policy`` is refused unless:

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
    """
    if convert and adopt_policy:
        raise ValueError("load_checkpoint: pass convert=True (to mp's policy) or adopt_policy=True (to the saved "
                         "policy), not both")
    _check_ema(ema, mp, "load_checkpoint")
    if ema is not None and weights_only:
        raise ValueError("load_checkpoint: ema= restores a run's averaged weights with its state; weights_only=True "
                         "loads the model alone. Drop one of them (for the averaged weights alone: "
                         "model.load_state_dict(ema.shadow, strict=False) after loading the EMA)")
    ck = _read(path)
    m = ck.manifest
    ema_state = None if ema is None else _ema_state(ck, ema)
    saved_policy, target = m["policy"], str(mp.policy)
    if saved_policy != target and not (convert or adopt_policy):
        raise CheckpointError(f"checkpoint {str(ck.path)!r} was saved under policy {saved_policy!r}, the engine "
                              f"runs {target!r}; build the engine with policy={saved_policy!r}, or pass convert=True "
                              f"to convert the state to {target!r} (adopt_policy=True to switch the engine to "
                              f"{saved_policy!r})")
    try:   # checks that change nothing: a run that unfroze into a new param group; frozen values vs fp16
        if not weights_only and m["model"].get("frozen") is not None:
            mp.match_frozen(m["model"]["frozen"], check_only=True)
        mp.check_frozen_values(_best_weights(ck))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(ck.path)!r}: {err}") from None
    _check_fits(ck, mp, weights_only=weights_only)
    frozen_before = mp.frozen_names()
    if not weights_only and m["model"].get("frozen") is not None:
        try:   # params the run unfroze (mp.unfreeze, no new param group) are unfrozen here too
            mp.match_frozen(m["model"]["frozen"])
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
    return extra


def _check_ema(ema: Any, mp: Any, call: str) -> None:
    if ema is not None and getattr(ema, "mp", None) is not mp:
        raise ValueError(f"{call}: ema= must be a mixprec.EMA built on this engine (EMA(mp, ...)), got "
                         f"{type(ema).__name__}" + (" of another engine" if hasattr(ema, "mp") else ""))


def _ema_state(ck: _Checkpoint, ema: Any) -> dict:
    """The checkpoint's EMA state, checked against ``ema`` (nothing changes). Raises CheckpointError."""
    where = f"checkpoint {str(ck.path)!r}"
    if ck.manifest.get("ema") is None:
        raise CheckpointError(f"{where} holds no EMA state (saved without ema=); pass ema=None to load it, and "
                              "build a new EMA(mp, ...) afterwards to start averaging from its weights")
    state = _decode(ck.manifest["ema"], ck.files[STATE_FILE], where)
    try:
        ema.load_state_dict(state, check_only=True)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    return state


def _load_state(ck: _Checkpoint, mp: Any, *, guard: Any, convert: bool, adopt_policy: bool, weights_only: bool,
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
        "model": _model_state(ck),
        "masters": ck.files.get(MASTERS_FILE, {}),
        "optimizer": _decode(m["optimizer"]["state"], tensors, where),
        "scheduler": None if m["scheduler"] is None else _decode(m["scheduler"]["state"], tensors, where),
        "loss_scale": _decode(m["loss_scale"], tensors, where),
        "counters": m["counters"],
        "events": m["events"],
    }
    try:
        mp.load_state_dict(state, convert=convert and m["policy"] != str(mp.policy),
                           adopt_policy=adopt_policy and m["policy"] != str(mp.policy))
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    guard = mp.guard if guard is None else guard
    if guard is not None and m["guard"] is not None:
        guard.load_state_dict(_decode(m["guard"], tensors, where))
    if restore_rng:
        _set_rng_state(m["rng"], tensors)
    if m.get("device", "").split(":")[0] == mp.device.type:
        op_plan.pin(m.get("op_plan") or {}, mp.device.type)
    return m["extra"]