"""Minimal checkpoints: model tensors in safetensors plus a JSON manifest, written atomically.

A checkpoint is a directory::

    model.safetensors    the model's state_dict as stored (16-bit params stay 16-bit), contiguous
                         CPU tensors; a tensor that shares storage with an earlier one (a tied
                         head) is stored once and listed in the manifest's "aliases"
    masters.safetensors  fp32 master copies keyed by parameter name (policies with masters only)
    manifest.json        {"format": 1, "policy": text, "steps": applied optimizer steps,
                          "versions": {mixprec, torch, safetensors, python},
                          "files": {name: sha256 hex}, "aliases": {name: stored name},
                          "extra": caller's JSON (workload, config, vocabulary, ...)}

Everything is written to a temporary sibling directory first and moved into place with
``os.replace``, so a crash never leaves a half-written checkpoint under ``path``.
Loading checks every file's sha256 first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "read_manifest", "MANIFEST"]

MANIFEST = "manifest.json"
FORMAT = 1


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
        stored[name] = tensor.detach().to("cpu").contiguous()
    return stored, aliases


def save_checkpoint(path: str | Path, mp: Any, extra: dict | None = None) -> Path:
    """Save ``mp``'s model (and fp32 masters) to the directory ``path``; returns ``path``.

    ``mp`` is a :class:`mixprec.MixedPrecision`; ``extra`` is any JSON-serialisable dict stored
    in the manifest (``mixprec train`` puts the workload description and vocabulary there).
    An existing checkpoint at ``path`` is replaced. Host syncs: copies every tensor to the CPU.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model_tensors, aliases = _unique_tensors(mp.model.state_dict())
    save_file(model_tensors, str(tmp / "model.safetensors"))
    names = {id(p): n for n, p in mp.model.named_parameters()}
    masters = {names[id(p)]: m.detach().to("cpu").contiguous() for p, m in mp.masters.pairs}
    if masters:
        save_file(masters, str(tmp / "masters.safetensors"))
    manifest = {
        "format": FORMAT,
        "policy": str(mp.policy),
        "steps": mp.applied_steps,
        "versions": {"mixprec": metadata.version("mixprec"), "torch": torch.__version__,
                     "safetensors": safetensors.__version__, "python": sys.version.split()[0]},
        "files": {f.name: _sha256(f) for f in sorted(tmp.iterdir())},
        "aliases": aliases,
        "extra": extra or {},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def read_manifest(path: str | Path) -> dict:
    """The manifest of the checkpoint directory ``path``, with every file's sha256 verified.

    Raises:
        FileNotFoundError: ``path`` holds no manifest.json.
        ValueError: a listed file is missing or its sha256 differs (a corrupt checkpoint).
    """
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no {MANIFEST}; pass the directory that "
                                "save_checkpoint wrote (mixprec train writes OUT/checkpoint)")
    manifest = json.loads((path / MANIFEST).read_text())
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file() or _sha256(file) != expected:
            raise ValueError(f"checkpoint {str(path)!r}: {name} is missing or its sha256 does not match the "
                             "manifest (corrupt or partly copied); restore it or save the checkpoint again")
    return manifest


def load_checkpoint(path: str | Path, mp: Any) -> dict:
    """Load a checkpoint into ``mp`` (a :class:`mixprec.MixedPrecision`); returns the manifest's ``extra``.

    Params are copied into the model in its own dtypes (a bf16 checkpoint loads exactly into an
    fp32 model). Saved fp32 masters go into ``mp``'s masters, or straight into fp32 params when
    ``mp`` keeps none; without saved masters, ``mp``'s masters are rebuilt from the params.

    Raises:
        FileNotFoundError / ValueError: see :func:`read_manifest`; a model whose tensor names or
            shapes differ from the checkpoint's (from ``load_state_dict``, as RuntimeError).
    """
    path = Path(path)
    manifest = read_manifest(path)
    state = load_file(str(path / "model.safetensors"))
    for name, target in manifest["aliases"].items():
        state[name] = state[target]
    mp.model.load_state_dict(state)
    saved_masters = load_file(str(path / "masters.safetensors")) if "masters.safetensors" in manifest["files"] else {}
    master_of = {id(p): m for p, m in mp.masters.pairs}
    with torch.no_grad():
        for name, param in mp.model.named_parameters():
            master = master_of.get(id(param))
            if name in saved_masters and master is not None:
                master.copy_(saved_masters[name])
            elif name in saved_masters and param.dtype == torch.float32:
                param.copy_(saved_masters[name])  # fp32 masters beat the rounded 16-bit copy
            elif master is not None:
                master.copy_(param)  # no saved master: rebuild it from the param
    return manifest["extra"]
