"""Where mixprec keeps its measurements between processes: one JSON file per measurement kind and machine.

``cache_dir()`` is ``$MIXPREC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixprec``, else ``~/.cache/mixprec``.
A measurement is only valid for the hardware, the torch build and the thread count it was taken with,
so :func:`machine_key` names all three and every cache file carries it in its name. Files are written
atomically (a temporary file, then ``os.replace``); a file that cannot be read is treated as empty, and a
cache that cannot be written only costs the measurement again in the next process (logged at INFO).
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import torch

__all__ = ["cache_dir", "cpu_flags", "cpu_name", "machine_key", "read_json", "write_json"]

log = logging.getLogger("mixprec")


def cache_dir() -> Path:
    """``$MIXPREC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixprec``, else ``~/.cache/mixprec``."""
    root = os.environ.get("MIXPREC_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "mixprec"


def cpu_name() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s ``flags`` / ``Features`` line), [] where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return value.split()
    except OSError:
        pass
    return []


def machine_key(device: torch.device) -> str:
    """``<device name>-torch<version>-threads<n>``, safe as a file name: what a timing depends on."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = f"mps-{platform.machine()}"
    else:
        name = f"{platform.machine()}-{cpu_name()}"
    key = f"{name}-torch{torch.__version__}-threads{torch.get_num_threads()}"
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in key)


def read_json(path: Path) -> dict:
    """The JSON object at ``path``, or ``{}`` when it is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_json(path: Path, value: dict) -> None:
    """Write ``value`` to ``path`` atomically; a failure is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        log.info("mixprec: could not write the cache file %s (%s)", path, err)
