"""The engine's autocast scope: ``mp.autocast()``'s settings wherever the engine's graphs run, and fresh casts.

``mp.autocast()`` enters ``torch.autocast`` in the policy's compute dtype (off for fp32), the policy's op lists
(``ops=portable``: :mod:`mixprec.autocast.portable`; ``kernels=measured``: :mod:`mixprec.autocast.op_plan`;
``saved=compute``: :mod:`mixprec.autocast.saved_dtype`),
the compile settings of :func:`mixprec.autocast.compiled.eager_dtypes` and, while ``policy="auto"`` is
pending, its block. :class:`AutocastScope` makes those settings hold wherever the engine's graphs run:

* **Every backward pass** through the model's outputs, ``mp.scale_loss(loss)`` or ``mp.backward(loss)`` runs a
  ``torch.utils.checkpoint`` recompute with the forward's op lists (:func:`mixprec.autocast.switch.
  hold_in_backward`): ``torch.autograd.grad`` of a gradient penalty, a plain ``loss.backward()``, and on CUDA
  the backward in autograd's device thread. Before, only ``mp.backward`` turned them on (in its own thread),
  so a penalty through checkpointed blocks recomputed with torch's per-device lists and raised
  ``CheckpointError: Recomputed values ... have different metadata`` (an fp32 layer_norm saved, a bf16 one
  recomputed).
* **A compiled function** that enters ``mp.autocast()`` traces it with no graph break: ``torch.autocast`` (which
  dynamo captures in the graph) and a ``torch.fx.traceback.annotate`` of the op lists, under which the
  kernels that run while dynamo and AOTAutograd trace the graph make the eager choices
  (:func:`mixprec.autocast.switch.traced_annotation`). ``eager_dtypes``' backward setting is not needed there
  (the backward of such a function is traced after the ``with`` block, under the caller's autocast state, as
  eager's runs); the call keeps the eager path (a graph break, as before) where the traced block cannot give
  eager's numerics: under fp16 (inductor's ``emulate_precision_casts`` can only be set around a compilation),
  while ``auto`` is pending, or for op lists never entered eagerly (a ``set_policy`` just before).
  Backends that run dynamo's graph without AOTAutograd (``backend="eager"``) do not trace the kernels: their
  op lists are those of the calling thread.
* **The cast cache**: ``torch.autocast`` keeps the 16-bit cast of each fp32 leaf that requires grad (a
  ``-mixed`` policy's parameters) until its outermost block exits. A parameter written in place inside
  the block (``model.load_state_dict``, ``p.copy_`` under ``no_grad``) kept its old cast: the next forward
  computed with the old weights where autocast casts them (a mix of old and new). :meth:`AutocastScope.refresh_casts`, called before each eager forward of
  the model, compares the parameters' version counters with the last forward's and clears torch's cache
  when one moved (an ``autocast-cache`` event, once). Writes through ``p.data`` bump no version counter and
  are not seen (nor by the masters' edit adoption): write under ``torch.no_grad()`` instead, or call
  ``torch.clear_autocast_cache()``.

No host sync anywhere (version counters and hooks are host-side).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.utils._pytree import tree_leaves

from mixprec.autocast.compiled import eager_dtypes
from mixprec.autocast.op_plan import planned_as, planned_kernels
from mixprec.autocast.portable import portable_as, portable_ops
from mixprec.autocast.saved_dtype import saved_as, saved_in_compute
from mixprec.autocast.switch import SwitchState, captured, hold_in_backward, traced_annotation
from mixprec.autocast.saved_rebuilds import rebuild_saved
from mixprec.engine.feature import HeldEngine
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event

__all__ = ["AutocastScope"]

log = logging.getLogger("mixprec")


class AutocastScope:
    """The autocast scope of ``owner`` (the engine; module docstring). Builds the policy's op-list state once
    per (ops, kernels, device type), eagerly: entering them installs their kernels, so a graph traced before
    any eager ``mp.autocast()`` has them."""

    owner = HeldEngine()   # weakly: the engine owns this

    def __init__(self, owner: Engine) -> None:
        self.owner = owner
        self._states: dict[tuple[str, str, str, str], SwitchState] = {}
        self._annotations: dict[tuple[str, str, str, str], dict] = {}
        self._versions: list[int] | None = None   # the params' version counters at the last eager forward
        self._epoch: tuple[int, int, int] = (0, 0, 0)   # and the engine's boundaries, events and masters then
        self._spoken = False
        self.state()

    def _key(self) -> tuple[str, str, str, str]:
        policy = self.owner.policy
        return policy.ops, policy.kernels, policy.saved, self.owner.device.type

    def state(self) -> SwitchState:
        """The switches the policy's op lists turn on (just those: entered inside an empty state)."""
        key = self._key()
        state = self._states.get(key)
        if state is None:
            with portable_as(()), planned_as(()), saved_as(()), self.op_lists():
                state = self._states[key] = captured()
            self._annotations[key] = traced_annotation(state)
        return state

    def op_lists(self) -> AbstractContextManager[None]:
        """The policy's op lists on in this thread (``mp.backward()``'s context)."""
        return _op_lists(self.owner.policy, self.owner.device.type)

    @contextmanager
    def autocast(self, pending: AbstractContextManager[None] | None) -> Iterator[None]:
        """``mp.autocast()``: eager, or traced with no graph break (module docstring). ``pending``: auto's
        block while its decision is pending, else None."""
        policy, device_type = self.owner.policy, self.owner.device.type
        traceable = (pending is None and policy.compute_dtype != torch.float16   # fp16: eager_dtypes' inductor option
                     and hasattr(fx_traceback, "annotate"))   # older torch: the eager path (one graph break)
        annotation = self._annotations.get(self._key()) if traceable else None
        if annotation is not None and torch.compiler.is_compiling():
            with torch.autocast(device_type, dtype=policy.compute_dtype, enabled=policy.is_mixed), \
                    fx_traceback.annotate(annotation):
                yield
            return
        self.state()
        with torch.autocast(device_type, dtype=policy.compute_dtype, enabled=policy.is_mixed), \
                _op_lists(policy, device_type), eager_dtypes(policy), pending or _nothing(), \
                self.rebuilds():
            yield

    def rebuilds(self) -> AbstractContextManager[None]:
        """The saved tensors ``mp.autocast()`` rebuilds in backward instead of keeping, as a context
        (:func:`mixprec.autocast.saved_rebuilds.rebuild_saved` with the policy's choices; the recompute plan measures
        its blocks under it)."""
        return rebuild_saved(self.owner.masters.params, weight_copies=self._recasts(),
                             activation_outputs=self._reruns())

    def _recasts(self) -> bool:
        """Whether autocast's 16-bit weight copies are cast again in backward instead of kept
        (:mod:`mixprec.autocast.saved_rebuilds`): ``saved=rebuild`` over fp32 params under a 16-bit compute dtype,
        eager, not under FSDP2 (whose unsharded params are not the engine's)."""
        policy = self.owner.policy
        return (policy.saved == "rebuild" and policy.is_mixed and policy.param_dtype == torch.float32
                and self.owner.strategy != "fsdp2" and not torch.compiler.is_compiling())

    def _reruns(self) -> bool:
        """Whether saved ``gelu``/``silu`` outputs are recomputed in backward from their saved input instead of kept
        (:mod:`mixprec.autocast.saved_rebuilds`): ``saved=rebuild``, eager."""
        return self.owner.policy.saved == "rebuild" and not torch.compiler.is_compiling()

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, its backward passes holding the policy's op lists (``scale_loss``, ``backward``; a traced
        call holds nothing: a compiled graph's backward recomputes nothing eagerly)."""
        if not torch.compiler.is_compiling():
            hold_in_backward(self.state(), [tensor])
        return tensor

    def after_forward(self, output: Any) -> None:
        """After an eager forward of the model: its outputs' backward passes hold the op lists it ran with."""
        if torch.is_grad_enabled():
            hold_in_backward(captured(), [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)])

    def refresh_casts(self) -> None:
        """Before an eager forward of the model: clear torch's autocast cache if a parameter was written in
        place since the last forward (module docstring)."""
        if not (torch.is_autocast_enabled(self.owner.device.type) and torch.is_autocast_cache_enabled()):
            return
        mp = self.owner
        versions, epoch = [p._version for p in mp.masters.params], (mp.boundaries, len(mp.events), id(mp.masters))
        if self._versions is not None and versions != self._versions:
            torch.clear_autocast_cache()
            if epoch == self._epoch and not self._spoken:   # not the engine's own write (a step, a set_policy)
                self._spoken = True
                detail = ("parameters were written in place since the model's last forward (model.load_state_dict, "
                          "p.copy_ under no_grad): torch.autocast's cached 16-bit casts, kept until the outermost "
                          "autocast block exits, were dropped so that this forward uses the new values (said once)")
                mp.record(Event(step=mp.boundaries, kind="autocast-cache", cause="parameter write", module=None,
                                detail=detail))
                log.info("mixprec: %s", detail)
        self._versions, self._epoch = versions, epoch


@contextmanager
def _op_lists(policy: Any, device_type: str) -> Iterator[None]:
    with portable_ops(device_type, enabled=policy.ops == "portable"), \
            planned_kernels(device_type, enabled=policy.kernels == "measured"), \
            saved_in_compute(device_type, enabled=policy.saved in ("compute", "rebuild")):
        yield


@contextmanager
def _nothing() -> Iterator[None]:
    yield
