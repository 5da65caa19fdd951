"""Reading a one-process checkpoint, verified: the manifest's checksum, every file's size and sha256, every
tensor's dtype and shape, then whether it fits an engine (model, masters, optimizer, scheduler), all
before anything changes. A failure raises :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from mixprec.blockscale import block_state_keys
from mixprec.checkpoint.layout import MANIFEST, CheckpointError, read_manifest_json
from mixprec.checkpoint.manifest import FORMAT, VERSION
from mixprec.checkpoint.tree import STATE_FILE, canonical, decode, dtype_name
from mixprec.optim.quantized_state import state_shape

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

MODEL_FILE, MASTERS_FILE = "model.safetensors", "masters.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint in memory: its directory, manifest and tensors per file."""

    path: Path
    manifest: dict
    files: dict[str, dict[str, torch.Tensor]]


def read(path: str | Path) -> Checkpoint:
    directory, manifest = read_manifest_json(path)
    where = f"checkpoint {str(directory)!r}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {MANIFEST} is not a mixprec checkpoint manifest (format="
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, want {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{where}: {MANIFEST} has version {manifest.get('version')!r}; this mixprec reads "
                              f"version {VERSION} (re-save the run with this version)")
    if manifest.get("checksum") != hashlib.sha256(canonical(manifest)).hexdigest():
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
            if dtype_name(t.dtype) != info["dtype"] or list(t.shape) != info["shape"]:
                raise CheckpointError(f"{where}: {name} tensor {key!r} is {dtype_name(t.dtype)} {list(t.shape)}, the "
                                      f"manifest says {info['dtype']} {info['shape']}")
        files[name] = tensors
    for required in (MODEL_FILE, STATE_FILE):
        if required not in files:
            raise CheckpointError(f"{where}: {MANIFEST} lists no {required}")
    return Checkpoint(directory, manifest, files)


def read_manifest(path: str | Path) -> dict:
    """The verified manifest of the checkpoint at ``path`` (a root or a ``step-N`` directory).

    Every file is checked (sizes, sha256, tensor dtypes and shapes), as by :func:`load_checkpoint`.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a damaged or incomplete checkpoint (the message names the file).
    """
    return read(path).manifest


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The saved model weights of the checkpoint at ``path`` (a root or a ``step-N`` directory), by
    state-dict name: the fp32 masters where saved, else the stored params and buffers, tied names
    (stored once) filled in. Verified as by :func:`read_manifest`; the tensors are on the CPU.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a damaged or incomplete checkpoint (the message names the file).
    """
    return best_weights(read(path))


def qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def stepped_names(mp: MixedPrecision) -> list[str | None]:
    """The model's name of each tensor the optimizer steps, in its param-group order (None: not a model param)."""
    names: dict[int, str] = {}
    for (name, p), stepped in zip(mp.module.named_parameters(), mp.master_parameters()):
        names[id(p)] = names[id(stepped)] = name
    return [names.get(id(t)) for g in mp.optimizer.param_groups for t in g["params"]]


def check_state_names(where: str, saved: list, own: list) -> None:
    """Raise CheckpointError unless the optimizer state saved at each index is for the param stepped there now:
    the model loads by name but the optimizer by index (same-shaped params registered in another order)."""
    for i, (saved_name, name) in enumerate(zip(saved, own)):
        if saved_name is not None and name is not None and saved_name != name:
            raise CheckpointError(f"{where}: the optimizer state of param {i} was saved for {saved_name!r}, but the "
                                  f"engine's optimizer steps {name!r} at that index; build the optimizer over the "
                                  "params in the run's order (or pass weights_only=True)")


# ---------------------------------------------------------------------------------------------- fitting an engine
def check_fits(ck: Checkpoint, mp: MixedPrecision, *, weights_only: bool) -> None:
    """Raise CheckpointError unless ``ck`` can be loaded into ``mp``: model keys and shapes, masters,
    optimizer class / groups / state shapes, scheduler and loss-scale presence. Touches nothing."""
    m = ck.manifest
    where = f"checkpoint {str(ck.path)!r}"
    model_saved = ck.files[MODEL_FILE]
    aliases = m["model"]["aliases"]
    own = mp.module.state_dict()
    # block-scaled linears' own state (signs, SR streams) comes and goes with the policy: set_policy swaps it
    saved_keys = (set(model_saved) | set(aliases) | set(m["model"].get("extra_state") or {})) - set(
        m["model"].get("block_state") or ())
    own_keys = set(own) - block_state_keys(mp.module)
    if saved_keys != own_keys:
        missing, unexpected = sorted(own_keys - saved_keys), sorted(saved_keys - own_keys)
        raise CheckpointError(f"{where}: {MODEL_FILE} does not fit the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}; build the same model (workload and config) before loading")
    for key, tensor in own.items():
        saved = model_saved.get(aliases.get(key, key))
        if saved is not None and torch.is_tensor(tensor) and saved.shape != tensor.shape:
            raise CheckpointError(f"{where}: {MODEL_FILE} tensor {key!r} has shape {list(saved.shape)}, the model's "
                                  f"is {list(tensor.shape)}; build the same model before loading")
    params = dict(mp.module.named_parameters())
    for key in m["model"]["masters"]:
        if key not in params or ck.files[MASTERS_FILE][key].shape != params[key].shape:
            raise CheckpointError(f"{where}: {MASTERS_FILE} tensor {key!r} matches no parameter of the model")
    if weights_only:
        return
    opt = m["optimizer"]
    if opt["class"] != qualname(mp.optimizer):
        raise CheckpointError(f"{where}: the optimizer state is from {opt['class']}, the engine's optimizer is "
                              f"{qualname(mp.optimizer)}; build the run's optimizer (or pass weights_only=True)")
    opt_state = decode(opt["state"], ck.files[STATE_FILE], where)
    groups = [len(g["params"]) for g in opt_state["param_groups"]]
    if groups != [len(g["params"]) for g in mp.optimizer.param_groups]:
        raise CheckpointError(f"{where}: the optimizer state has param groups of sizes {groups}, the engine's "
                              f"optimizer {[len(g['params']) for g in mp.optimizer.param_groups]}")
    check_state_names(where, opt.get("param_names") or [], stepped_names(mp))   # absent: an older checkpoint
    stepped = [t for g in mp.optimizer.param_groups for t in g["params"]]
    index = [i for g in opt_state["param_groups"] for i in g["params"]]
    check_state_shapes(where, opt_state["state"], {i: stepped[n].shape for n, i in enumerate(index)})
    if (m["scheduler"] is None) != (mp.scheduler is None):
        have = "has" if m["scheduler"] is not None else "has no"
        raise CheckpointError(f"{where}: the checkpoint {have} scheduler state but the engine "
                              f"{'has none' if mp.scheduler is None else 'has one'}; build the engine as the run did "
                              "(or pass weights_only=True)")
    if m["scheduler"] is not None and m["scheduler"]["class"] != qualname(mp.scheduler):
        raise CheckpointError(f"{where}: the scheduler state is from {m['scheduler']['class']}, the engine's "
                              f"scheduler is {qualname(mp.scheduler)}")


def check_state_shapes(where: str, state: dict, shape_of: dict) -> None:
    """Raise CheckpointError unless every optimizer-state tensor of param ``i`` has the shape it must have for
    ``shape_of[i]``: the param's (8-bit codes too), or one scale per block of 256 for an 8-bit ``*_absmax``."""
    for i, entry in state.items():
        for key, value in entry.items():
            want = state_shape(key, shape_of[i]) if i in shape_of else None
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want:
                raise CheckpointError(f"{where}: optimizer state {key!r} of param {i} has shape {list(value.shape)}, "
                                      f"the engine's param has {list(shape_of.get(i, ()))} (so {want} for this key)")


def model_extra_state(ck: Checkpoint) -> dict[str, Any]:
    """The saved model state dict's entries that are not tensors (a module's ``get_extra_state()`` other than a
    tensor; a block-scaled linear's stream is a tensor, in the model file), by key; {} for a checkpoint without any."""
    return decode(ck.manifest["model"].get("extra_state") or {}, ck.files[STATE_FILE], f"checkpoint {str(ck.path)!r}")


def model_state(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """The saved model state dict's tensors, tied weights (stored once) filled in under every name (the entries
    that are not tensors: :func:`model_extra_state`)."""
    state = dict(ck.files[MODEL_FILE])
    for key, target in ck.manifest["model"]["aliases"].items():
        state[key] = state[target]
    return state


def best_weights(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """The saved model state (tied names filled in) with the fp32 masters in place of their rounded 16-bit params, under
    every name of a tied weight (masters are keyed by one of its names)."""
    masters = ck.files.get(MASTERS_FILE, {})
    state = {**model_state(ck), **masters}
    for key, target in ck.manifest["model"]["aliases"].items():
        state[key] = state[target] = masters.get(target, masters.get(key, state[target]))
    return state
