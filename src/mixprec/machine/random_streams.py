"""The process's global random streams, forked around a measurement the engine runs inside a user's training.

A measurement that runs the user's model (``auto``'s trial, ``recompute="auto"``'s block timings) draws from
whatever streams the model draws from: torch's dropout, but also python's ``random`` and numpy's global
generator (a LayerDrop written as ``random.uniform(0, 1) < p``, an augmentation in ``forward``). Inside
:func:`forked_streams` it may draw freely: on exit every stream is where it was on entry, so the run's random
sequence is the one it would be without the measurement.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["forked_streams"]


@contextmanager
def forked_streams(device: torch.device | str | None = None) -> Iterator[None]:
    """Inside, draws from the global streams are the measurement's own; on exit (an exception included) each is
    as on entry: torch's CPU generator, every CUDA device's (when CUDA is initialised), MPS's (``device`` of type
    mps), numpy's global generator (``np.random``) and python's ``random``. Generators the caller made
    (``torch.Generator``, ``np.random.default_rng``) are not global and not touched. No host sync (the CUDA
    states are read into host tensors)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    torch_cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    mps = torch.mps.get_rng_state() if device.type == "mps" else None
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if mps is not None:
            torch.mps.set_rng_state(mps)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
