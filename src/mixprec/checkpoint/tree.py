"""Checkpoint state trees as JSON with tagged leaves (no pickle), and the canonical bytes a manifest's checksum hashes.

Leaves: ``{"$tensor": name}`` (a tensor with dims, stored in a safetensors file under ``name``),
``{"$scalar": value, "dtype": name}`` (a 0-dim tensor, exact), ``{"$tuple": [...]}``,
``{"$items": [[key, value], ...]}`` (a dict with non-string keys) and ``{"$dtype": name}``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.layout import CheckpointError

STATE_FILE = "state.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return dtype


def encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON; tensors with more than 0 dims go to ``tensors`` under ``path``."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return {"$scalar": obj.item(), "dtype": dtype_name(obj.dtype)}
        tensors[path] = obj.detach().to("cpu", copy=True).contiguous()
        return {"$tensor": path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"$dtype": dtype_name(obj)}
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        return {"$items": [[encode(k, f"{path}/key", {}), encode(v, f"{path}/{k}", tensors)]
                           for k, v in obj.items()]}
    raise TypeError(f"save_checkpoint: {path} holds a {type(obj).__name__}, which cannot be stored without "
                    "pickle; checkpoints hold tensors, numbers, strings, None, lists, tuples, dicts and dtypes")


def decode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$tensor" in obj:
        if obj["$tensor"] not in tensors:
            raise CheckpointError(f"{where}: tensor {obj['$tensor']!r} is missing from {STATE_FILE}")
        return tensors[obj["$tensor"]]
    if "$scalar" in obj:
        return torch.tensor(obj["$scalar"], dtype=dtype_from(obj["dtype"], where))
    if "$dtype" in obj:
        return dtype_from(obj["$dtype"], where)
    if "$tuple" in obj:
        return tuple(decode(v, tensors, where) for v in obj["$tuple"])
    if "$items" in obj:
        return {decode(k, tensors, where): decode(v, tensors, where) for k, v in obj["$items"]}
    return {k: decode(v, tensors, where) for k, v in obj.items()}


def canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` (the writer fsyncs it on commit); return its ``{"bytes", "sha256"}``."""
    path.write_bytes(data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
