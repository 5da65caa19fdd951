"""Where a mixprec warning points: the user's line that called into mixprec, however deep the warning is raised.

``warnings.warn(..., stacklevel=n)`` blames the frame ``n`` levels up from its call. A fixed ``n`` is right for
one call path only: the same warning reached through ``mp.step()`` instead of ``mp.apply_or_skip()``, from a
forward hook under ``nn.Module.__call__``, or from an optimizer step under torch's step hooks would point into the
library. :func:`user_stacklevel` counts the levels at the call instead: up to the first frame whose file is
neither mixprec's nor torch's (``nn.Module.__call__``, the optimizer's step hooks, ``torch.no_grad``'s wrapper,
``Tensor.backward``) nor :mod:`contextlib`'s (a ``with`` of one of mixprec's context managers). This is
``warnings.warn(..., skip_file_prefixes=...)`` of Python 3.12, which earlier versions lack. When every frame up
the stack is skipped (a program of mixprec's own run as a script, a hook on a thread of torch's), the warning
points at the line that raises it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

__all__ = ["user_stacklevel"]

_MIXPREC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CONTEXTLIB = contextlib.contextmanager.__code__.co_filename   # the name its frames carry


def _skipped(filename: str) -> bool:
    return filename.startswith((_MIXPREC_DIR, _TORCH_DIR)) or filename == _CONTEXTLIB


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` blame the first frame outside mixprec, torch and contextlib
    (module docstring), for the function that calls ``warnings.warn(..., stacklevel=user_stacklevel())`` (1: that
    function's own line, when no such frame is up the stack). No host sync."""
    frame, level = sys._getframe(1), 1   # the function that warns: stacklevel 1
    while frame is not None and _skipped(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
