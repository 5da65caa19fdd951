"""mixprec under Lightning Fabric: :class:`MixprecFabricPrecision` (``L.Fabric(plugins=[plugin])``;
docs/integrations.md, "Lightning"). Importing this module imports Lightning (``pip install mixprec[lightning]``);
the Trainer's plugin is :class:`mixprec.integrations.lightning.MixprecPrecision` (this class is importable from
there too).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from torch import nn

from mixprec.checkpoint.rng import restore_snapshot, rng_snapshot
from mixprec.engine.boundary import StepCheck, StepResult
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.ownership import hand_over, record_hand_over
from mixprec.integrations.lightning_inputs import cast_batch, check_keep, check_options
from mixprec.integrations.lightning_strategies import broadcast_from_rank0
from mixprec.integrations.replica_checks import DEFAULT_EVERY, ReplicaChecks, gather_windows, own_window
from mixprec.integrations.resume import load_resumed
from mixprec.policy.policy import Policy

__all__ = ["MixprecFabricPrecision"]

#: Engine options Fabric and the training loop own, and where to set them instead.
_FABRIC_OWNS = {
    "accumulation_steps": "fabric.backward(loss / N) for each micro-batch, then optimizer.step() once (they join)",
    "scheduler": "plugin.attach(optimizer, scheduler): the engine steps it on applied steps",
    "strategy": "L.Fabric(strategy='ddp', ...): the strategy wraps the module the plugin prepared",
    "compile": "torch.compile the module Fabric returns (fabric.setup re-applies a compile)",
}


class MixprecFabricPrecision(FabricPrecision):
    """The engine under Lightning Fabric (``L.Fabric(plugins=[plugin])``): ``fabric.setup(model, optimizer)``
    prepares ``model`` before the strategy wraps it (``convert_module``), then one line the plugin cannot do
    for you, as Fabric shows a precision plugin no optimizer before the first step: ``plugin.attach(optimizer,
    scheduler=None)`` (the engine steps ``scheduler`` after applied steps only). The model's forward runs
    under ``mp.autocast()`` with ``mp.cast_inputs``; ``fabric.backward(loss)`` is ``mp.backward(loss,
    join=True)`` (divide by the micro-batch count yourself, as in Fabric); ``fabric.clip_gradients`` sees the
    unscaled gradients; ``optimizer.step()`` is the boundary. ``policy``/``engine_options`` as
    :class:`MixprecPrecision` (``device``: the engine's, default the current CUDA device else CPU, as Fabric's
    default). ``fabric.save(path, {"mixprec": plugin})`` holds the engine's whole state and the RNG states;
    ``fabric.load`` restores it exactly. Several processes: rank 0's stochastic-rounding seeds at ``attach``, the
    replicas compared every ``verify_replicas_every`` steps (as :class:`MixprecPrecision`). Errors as
    :class:`MixprecPrecision`."""

    def __init__(self, policy: str | Policy = "auto", *, keep_inputs: tuple = (),
                 verify_replicas_every: int = DEFAULT_EVERY, **engine_options: Any) -> None:
        super().__init__()
        check_options(engine_options, _FABRIC_OWNS, "MixprecFabricPrecision")
        self.policy, self.engine_options = policy, engine_options
        self.keep_inputs = check_keep(keep_inputs, "MixprecFabricPrecision")
        self.replicas = ReplicaChecks(verify_replicas_every, "MixprecFabricPrecision")
        self.engine: MixedPrecision | None = None
        self.step_check: StepCheck | None = None   # and last_result: the boundary's StepCheck and StepResult
        self.last_result: StepResult | None = None

    @property
    def precision(self) -> str:   # type: ignore[override]
        """The policy's text (``fabric`` reports it): the engine's resolved policy once built."""
        return str(self.engine.policy) if self.engine is not None else str(self.policy)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Build the engine on ``module`` (before the strategy wraps it) with ``optimizer=None``; rank 0's fp32
        values first under several processes. RuntimeError for a second model."""
        if self.engine is not None:
            if module is not self.engine.module:
                raise RuntimeError("MixprecFabricPrecision got a second model: use one plugin (and Fabric) per model")
            return module
        broadcast_from_rank0(module)
        note = hand_over(module, "MixprecFabricPrecision")   # an earlier Fabric's engine on this module: unwrapped
        self.engine = MixedPrecision(module, None, self.policy, **self.engine_options)
        record_hand_over(self.engine, note)
        return module

    def attach(self, optimizer: Any, scheduler: Any = None) -> None:
        """``mp.attach`` the optimizer ``fabric.setup`` returned (or the one it wraps) and ``scheduler``."""
        engine = self._engine("plugin.attach(optimizer)")
        device = next((p.device for p in engine.module.parameters()), engine.device)
        if device.type != engine.device.type:
            raise RuntimeError(f"Fabric moved the model to {device}, the engine runs on {engine.device}: pass "
                               f"MixprecFabricPrecision(..., device='{device.type}')")
        engine.attach(getattr(optimizer, "optimizer", optimizer), scheduler)
        self.replicas.agree_seeds(engine)   # several processes: rank 0's sr_seed on every rank

    def _engine(self, what: str) -> MixedPrecision:
        if self.engine is None:
            raise RuntimeError(f"MixprecFabricPrecision: {what} before fabric.setup(model, ...) built the engine")
        return self.engine

    def forward_context(self) -> Any:
        """``mp.autocast()`` around the model's forward."""
        return self._engine("a forward").autocast()

    def convert_input(self, data: Any) -> Any:
        """``mp.cast_inputs(data, keep=keep_inputs)`` (as :class:`MixprecPrecision`)."""
        return cast_batch(self._engine("a forward"), data, self.keep_inputs)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """``mp.backward(tensor, join=True)``: micro-batches until ``optimizer.step()`` form one step."""
        if args:
            raise TypeError(f"MixprecFabricPrecision.backward takes retain_graph=/inputs= by keyword, got {args!r}")
        self._engine("fabric.backward").backward(tensor, join=True, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        """The boundary's first phase (``fabric.clip_gradients`` calls it): ``mp.unscale_and_check()``, once."""
        if self.step_check is None:
            self.step_check = self._engine("fabric.clip_gradients").unscale_and_check()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The boundary: :meth:`unscale_gradients` unless done, then ``mp.apply_or_skip``; returns None."""
        if kwargs:
            raise TypeError(f"MixprecFabricPrecision.optimizer_step takes no optimizer.step() arguments, got {kwargs}")
        self.unscale_gradients(optimizer)
        check, self.step_check = self.step_check, None
        engine = self._engine("optimizer.step()")
        self.last_result = engine.apply_or_skip(check)
        self.replicas.at_boundary(engine)
        return None

    def state_dict(self) -> dict[str, Any]:
        """The engine's whole :meth:`~MixedPrecision.state_dict` with its events and the RNG states; inside an
        accumulation window on several processes every rank's window (``fabric.save`` runs it on every rank)."""
        engine = self._engine("state_dict()")
        return gather_windows({**engine.state_dict(), "events": [event.to_dict() for event in engine.events],
                               "rng": rng_snapshot(engine.device)})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly (after :meth:`attach`; each rank its own open window). ValueError for a
        window saved by another number of processes."""
        state = own_window(dict(state_dict), "MixprecFabricPrecision")
        rng = state.pop("rng", None)
        load_resumed(self._engine("load_state_dict()"), state, "MixprecFabricPrecision")
        restore_snapshot(rng)
