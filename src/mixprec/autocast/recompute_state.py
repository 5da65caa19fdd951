"""The autocast state a checkpointed forward ran under, captured at its call and re-entered for its recompute.

:func:`mixprec.ops.checkpoint` hands torch's non-reentrant checkpoint the ``context_fn`` that
:func:`recompute_context_fn` builds: at the call it captures the autocast ``(device type, enabled, dtype,
cache_enabled)`` of ``cpu``, of every device type of the tensor arguments and of the current accelerator, and
which devices have :mod:`~mixprec.autocast.op_plan`'s planned kernels, :mod:`~mixprec.autocast.portable`'s op
lists and :mod:`~mixprec.autocast.saved_dtype`'s ``saved=compute`` on; the recompute re-enters exactly those
states innermost and checks that they took effect. No host sync anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from mixprec.autocast.op_plan import planned_as, planned_devices
from mixprec.autocast.portable import portable_as, portable_devices
from mixprec.autocast.saved_dtype import saved_as, saved_devices

__all__ = ["AutocastState", "autocast_state", "recompute_context_fn"]

AutocastState = tuple[str, bool, torch.dtype, bool]  # (device_type, enabled, dtype, cache_enabled)

#: What a checkpoint's ``context_fn`` returns: the forward's context and the recompute's.
Contexts = tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]


def autocast_state(device_type: str) -> AutocastState:
    """``device_type``'s autocast state now: (device_type, enabled, dtype, cache_enabled)."""
    return (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


def _autocast_device_types(args: tuple, kwargs: dict) -> list[str]:
    """``cpu``, the device types of the tensor arguments, and the current accelerator (if any)."""
    types = ["cpu"]
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.device.type not in types:
            types.append(leaf.device.type)
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None and accelerator.type not in types:
        types.append(accelerator.type)
    return [t for t in types if torch.amp.is_autocast_available(t)]


class _RestoreAutocast:
    """Re-enter the captured autocast states for the recompute, then check they took effect.

    Entered innermost during recompute (torch's ``context_fn`` recompute context), so it wins over
    whatever state the backward pass runs under.
    """

    def __init__(self, states: list[AutocastState], planned: tuple[str, ...] = (),
                 portable: tuple[str, ...] = (), saved: tuple[str, ...] = ()) -> None:
        self.states, self.planned, self.portable, self.saved = states, planned, portable, saved
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        self._stack.enter_context(planned_as(self.planned))
        self._stack.enter_context(portable_as(self.portable))
        self._stack.enter_context(saved_as(self.saved))
        for device_type, enabled, dtype, cache_enabled in self.states:
            self._stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                     cache_enabled=cache_enabled))
        now = [autocast_state(s[0]) for s in self.states]
        if now != self.states:
            self._stack.close()
            raise RuntimeError(f"checkpoint recompute could not restore the forward's autocast state: forward "
                               f"ran under {self.states}, recompute would run under {now} (device_type, enabled, "
                               "dtype, cache_enabled); run backward where the forward's autocast device is available")

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


class _UncachedCasts:
    """The forward's autocast states with the cast cache off (entered around the checkpointed forward)."""

    def __init__(self, states: list[AutocastState]) -> None:
        self.states = states
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        for device_type, enabled, dtype, cache_enabled in self.states:
            if enabled:
                self._stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled))

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


class _Both:
    """``outer`` then ``inner``, entered each time the region runs (not when ``context_fn`` builds them): a double
    backward recomputes the region twice, each time through a fresh context."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        self._stack.enter_context(self.outer)
        self._stack.enter_context(self.inner)

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


def recompute_context_fn(args: tuple, kwargs: dict, selective: Callable[..., Any] | None) -> Callable[[], Contexts]:
    """The ``context_fn`` of a non-reentrant ``torch.utils.checkpoint.checkpoint`` of a call on ``args`` and
    ``kwargs``, with the autocast states and switches captured now (module docstring). ``selective``: a
    selective-checkpoint policy (``create_selective_checkpoint_contexts``'s), whose contexts are combined with
    these; its region's forward and recompute then run with autocast's cast cache off. Each call of the returned
    function builds fresh contexts. No host sync."""
    states = [autocast_state(t) for t in _autocast_device_types(args, kwargs)]
    planned = planned_devices()   # kernels=measured: the recompute makes the forward's kernel choices
    portable = portable_devices()   # ops=portable: and casts as the forward did
    saved = saved_devices()   # saved=compute: and saves what the forward saved

    if selective is not None:
        # A selective region casts afresh in its forward and its recompute (autocast's cast cache off inside it): a
        # cast the cache holds from an earlier forward in the same autocast region is skipped by the forward but
        # done by the recompute, and selective checkpointing's per-op invocation counts then disagree.
        states = [(device_type, enabled, dtype, False) for device_type, enabled, dtype, _ in states]

    def context_fn() -> Contexts:
        restore = _RestoreAutocast(states, planned, portable, saved)
        if selective is None:
            return contextlib.nullcontext(), restore
        keep_fwd, keep_recompute = torch.utils.checkpoint.create_selective_checkpoint_contexts(selective)
        return _Both(_UncachedCasts(states), keep_fwd), _Both(keep_recompute, restore)

    return context_fn
