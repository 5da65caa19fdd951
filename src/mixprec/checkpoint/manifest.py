"""The manifest of a checkpoint: what both writers record about the run, written in one place.

``manifest.json`` of either format holds :class:`Manifest`'s keys (``to_json`` keeps the JSON names):
``format, version`` ("mixprec-checkpoint", 2 for the one-process safetensors format; "mixprec-dcp", 1 for
``torch.distributed.checkpoint``), ``name`` ("step-N"), ``step`` (mp.boundaries), ``policy``,
``world_size``, ``device``, ``versions``, ``counters``, ``guard``, ``events``, ``op_plan`` (the kernels
chosen, pinned again on resume: :func:`pin_op_plan`), ``data_position``, ``extra``; a DCP manifest
also ``strategy``; the one-process format adds its own keys (``state``: loss_scale, optimizer,
scheduler, ema, rng, model, tensors, files, and the checksum over all).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

from mixprec.autocast import op_plan
from mixprec.engine.records import Event

if TYPE_CHECKING:
    from mixprec.engine.mixed_precision import MixedPrecision

FORMAT, VERSION = "mixprec-checkpoint", 2   # one process: safetensors files (mixprec.checkpoint.local)
DCP_FORMAT, DCP_VERSION = "mixprec-dcp", 1   # torch.distributed.checkpoint shards (mixprec.checkpoint.dcp)
_COMMON = ("format", "version", "name", "step", "policy", "world_size", "device", "versions", "counters",
           "guard", "events", "op_plan", "data_position", "extra")


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's record of its run (module docstring); ``state``: the format's own keys, as JSON."""

    format: str
    version: int
    name: str | None
    step: int
    policy: str
    world_size: int
    device: str
    versions: dict[str, str]
    counters: dict[str, int]
    guard: Any
    events: list[dict]
    op_plan: dict
    data_position: dict
    extra: dict
    strategy: str | None = None
    state: dict = field(default_factory=dict)

    @classmethod
    def of(cls, mp: MixedPrecision, *, format: str, counters: dict[str, int], guard: Any, world_size: int = 1,
           data_position: dict | None = None, extra: dict | None = None, strategy: str | None = None,
           state: dict | None = None) -> Manifest:
        """The manifest of ``mp`` at a step boundary (``name`` None until the writer names the directory).
        ``guard``: the guard's state as JSON; ``data_position``: the caller's, ``boundaries`` added."""
        versions = _versions(safetensors=format == FORMAT)
        events = json.loads(json.dumps([Event.of(e).to_dict() for e in mp.events], default=str))
        return cls(format=format, version=VERSION if format == FORMAT else DCP_VERSION, name=None,
                   step=mp.boundaries, policy=str(mp.policy), world_size=world_size, device=str(mp.device),
                   versions=versions, counters=counters, guard=guard, events=events,
                   op_plan=op_plan.choices(mp.device.type, policy=mp.policy),   # a resumed run pins them (bitwise)
                   data_position={"boundaries": mp.boundaries, **(data_position or {})}, extra=extra or {},
                   strategy=strategy, state=state or {})

    def named(self, name: str, **state: Any) -> Manifest:
        """This manifest as the writer names it (``step-N``), with more format keys (``tensors``, ``files``)."""
        return replace(self, name=name, state={**self.state, **state})

    def to_json(self) -> dict[str, Any]:
        """The ``manifest.json`` keys (``strategy`` in DCP manifests only)."""
        out = {key: getattr(self, key) for key in _COMMON}
        if self.format == DCP_FORMAT:
            out["strategy"] = self.strategy
        return {**out, **self.state}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """A parsed ``manifest.json`` (older ones lack ``op_plan``: empty); unknown keys go to ``state``."""
        common = {key: data.get(key) for key in _COMMON}
        common["op_plan"] = common["op_plan"] or {}
        state = {k: v for k, v in data.items() if k not in _COMMON and k != "strategy"}
        return cls(**common, strategy=data.get("strategy"), state=state)


class LoadedExtra(dict):
    """What :func:`mixprec.load_checkpoint` returns: the saved ``extra`` (this dict: its items, and equal to
    it) and, as ``.data_position``, the saved data position: ``save_checkpoint``'s ``data_position`` with the
    ``boundaries`` (and, from a distributed save, ``world_size``) it added, ``{}`` from a manifest without one."""

    def __init__(self, extra: Mapping[str, Any] | None = None, data_position: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra or {})
        self.data_position: dict[str, Any] = dict(data_position or {})

    def __repr__(self) -> str:
        return f"LoadedExtra({dict.__repr__(self)}, data_position={self.data_position!r})"


def is_dcp(manifest: Any) -> bool:
    """Whether a parsed ``manifest.json`` is a DCP one (else the one-process format's, verified by its reader)."""
    return isinstance(manifest, Mapping) and manifest.get("format") == DCP_FORMAT


def pin_op_plan(manifest: Mapping[str, Any], device_type: str) -> None:
    """Pin the kernels the saved run chose (``manifest["op_plan"]``) when it ran on ``device_type``'s kind
    of device, so the resumed run computes with the same kernels (bitwise resume); else nothing."""
    if str(manifest.get("device", "")).split(":")[0] == device_type:
        op_plan.pin(manifest.get("op_plan") or {}, device_type)


def _versions(*, safetensors: bool) -> dict[str, str]:
    try:
        version = metadata.version("mixprec")
    except metadata.PackageNotFoundError:
        version = "unknown"
    out = {"mixprec": version, "torch": torch.__version__}
    if safetensors:
        import safetensors as st

        out["safetensors"] = st.__version__
    return {**out, "python": sys.version.split()[0]}
