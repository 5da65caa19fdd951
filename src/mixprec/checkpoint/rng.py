"""The RNG states a checkpoint restores: torch, CUDA, MPS, numpy's MT19937 and python's ``random``.

Long states go to the checkpoint's tensors (uint8 / int64); the rest is JSON (:mod:`mixprec.checkpoint.tree`).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from mixprec.checkpoint.tree import decode, encode


def rng_state(device: torch.device, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": encode(torch.get_rng_state(), "rng/torch", tensors)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [encode(s, f"rng/cuda/{i}", tensors) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    if device.type == "mps":
        rng["mps"] = encode(torch.mps.get_rng_state(), "rng/mps", tensors)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        rng["numpy"] = {"bit_generator": kind, "key": encode(torch.tensor(key.astype("int64")), "rng/numpy", tensors),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    version, internal, gauss_next = random.getstate()
    rng["python"] = {"version": version, "state": encode(torch.tensor(internal, dtype=torch.int64), "rng/python",
                                                          tensors), "gauss_next": gauss_next}
    return rng


def set_rng_state(rng: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(decode(rng["torch"], tensors, "rng"))
    if "cuda" in rng and torch.cuda.is_available():  # a CUDA checkpoint loaded on CPU/MPS: nothing to restore
        states = [decode(s, tensors, "rng") for s in rng["cuda"]]
        for index, state in enumerate(states[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)
    if "mps" in rng and torch.backends.mps.is_available():
        torch.mps.set_rng_state(decode(rng["mps"], tensors, "rng"))
    if "numpy" in rng:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            n = rng["numpy"]
            key = decode(n["key"], tensors, "rng").numpy().astype(np.uint32)
            np.random.set_state((n["bit_generator"], key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    py = rng["python"]
    random.setstate((py["version"], tuple(decode(py["state"], tensors, "rng").tolist()), py["gauss_next"]))


def rng_snapshot(device: torch.device) -> dict[str, Any]:
    """:func:`rng_state` with its tensors, as a trainer's checkpoint entry carries them: ``{"state", "tensors"}``."""
    tensors: dict[str, torch.Tensor] = {}
    return {"state": rng_state(device, tensors), "tensors": tensors}


def restore_snapshot(snapshot: dict[str, Any] | None) -> None:
    """Set the RNG states of an :func:`rng_snapshot` (None: nothing)."""
    if snapshot is not None:
        set_rng_state(snapshot["state"], snapshot["tensors"])
