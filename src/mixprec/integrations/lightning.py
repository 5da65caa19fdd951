"""mixprec under PyTorch Lightning: :class:`MixprecPrecision`, a precision plugin for ``L.Trainer``
(``L.Trainer(plugins=[MixprecPrecision("bf16-lean")])``), and :class:`MixprecFabricPrecision` for Fabric
(:mod:`mixprec.integrations.lightning_fabric`; docs/integrations.md, "Lightning"). Importing this module imports Lightning (``pip install mixprec[lightning]``).

Lightning's hooks, mapped onto the engine's phases (docs/engine.md):

* ``convert_module``, which every strategy calls before it wraps the model (DDP buckets, FSDP shards): the
  engine is built on the LightningModule with ``optimizer=None`` (an evaluation engine: autocast and input
  casts), so a wrapper sees the prepared params; under several processes rank 0's fp32 values are broadcast
  first, so every rank's masters start equal. validate/test/predict before ``fit`` run on it as it is. Under
  Lightning's ``ModelParallelStrategy`` (an empty ``configure_model``) the engine is built with
  ``strategy="fsdp2"`` and shards the module itself.
* the first training step (or a checkpoint load): ``mp.attach(optimizer, scheduler)`` with the one optimizer
  Lightning built and its step-interval scheduler, which the engine then steps after applied steps only
  (Lightning's ``lr_scheduler_step`` for it does nothing); epoch-interval and plateau schedulers stay
  Lightning's.
* ``forward_context`` (the train/val/test/predict steps): ``mp.autocast()``; ``convert_input``:
  ``mp.cast_inputs``.
* ``backward``: ``mp.backward(loss, join=True)``. Lightning divides the loss by ``accumulate_grad_batches``
  itself, so the engine is built with ``accumulation_steps=1`` and each micro-batch joins the window in
  progress; Lightning's ``optimizer_step`` is the boundary (an epoch's short last window included).
* ``optimizer_step``: Lightning's closure (forward, backward), ``mp.unscale_and_check()``, then Lightning's
  ``on_before_optimizer_step`` and ``configure_gradient_clipping`` on the unscaled gradients the optimizer
  steps (fp32 on the params under ``-mixed``, on the masters under ``-pure``: read them from the optimizer;
  clipping by norm is the engine's fp32 clip), then ``mp.apply_or_skip(check)``.
* ``state_dict``/``load_state_dict``: the engine's state less what Lightning's checkpoint holds already
  (model, optimizer): masters, loss scale, scheduler, counters, events, and the global RNG states (Lightning
  saves none; stochastic rounding draws from them), and the block-scaled linears' streams, moved out of Lightning's
  ``state_dict`` (:meth:`MixprecPrecision.on_save_checkpoint`); ``fit(ckpt_path=...)`` resumes bit for bit. A
  checkpoint Lightning takes inside an accumulation window holds the open window too (:mod:`mixprec.engine.open_group`),
  and one written without this plugin (``precision="32-true"``) is adopted
  (:meth:`MixprecPrecision.on_load_checkpoint`).

Source: Lightning's own ``MixedPrecision`` (AMP) plugin, whose hook order this follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from mixprec.checkpoint.adopt import adopt_fp32_run
from mixprec.checkpoint.rng import restore_snapshot, rng_snapshot
from mixprec.engine.boundary import StepCheck, StepResult
from mixprec.engine.clipping import clip_
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.open_group import check_group
from mixprec.engine.ownership import hand_over, record_hand_over
from mixprec.integrations.block_state import allow_absent_block_state, split_block_state, with_block_state
from mixprec.integrations.lightning_fabric import MixprecFabricPrecision
from mixprec.integrations.lightning_inputs import cast_batch, check_keep, check_options
from mixprec.integrations.lightning_strategies import (broadcast_from_rank0, model_parallel, profiler_hold,
                                                       resumed_parts)
from mixprec.integrations.replica_checks import (DEFAULT_EVERY, ReplicaChecks, check_accumulation, follow_accumulation,
                                                gather_windows, own_window)
from mixprec.integrations.resume import load_resumed
from mixprec.policy.policy import Policy

__all__ = ["MixprecPrecision", "MixprecFabricPrecision"]

#: Engine options the trainer owns, and where to set them instead.
_TRAINER_OWNS = {
    "accumulation_steps": "Trainer(accumulate_grad_batches=N): Lightning divides the loss and calls the step",
    "max_grad_norm": "Trainer(gradient_clip_val=...): clipping by norm runs the engine's fp32 clip",
    "strategy": "Trainer(strategy='ddp', ...): the strategy wraps the module the plugin prepared",
    "device": "Trainer(accelerator=..., devices=...): the engine runs on the strategy's root device",
    "scheduler": "return it from configure_optimizers (interval 'step': the engine steps it on applied steps)",
    "compile": "torch.compile a submodule inside your LightningModule (Lightning calls its methods, not mp.model)",
}


def _several_optimizers(count: int, module: Any) -> str:
    """The refusal of ``count`` optimizers: one loss stepping several param sets goes into one optimizer with
    param groups; networks stepped in turn from their own losses (a GAN, manual optimization) need one engine
    each, which one precision plugin cannot hold."""
    text = (f"MixprecPrecision runs one engine with one optimizer; configure_optimizers gave {count}. If one loss "
            "trains all of them (different lr or weight decay per part), put the params in one optimizer with param "
            "groups.")
    if not getattr(module, "automatic_optimization", True):
        text += (" Networks stepped in turn from their own losses (a GAN's generator and discriminator) need one "
                 "engine each (each its loss scale, fp32 masters and skip decision; param groups would step both "
                 "from each loss), which one Lightning precision plugin cannot hold yet: write that loop with one "
                 "MixedPrecision per network (docs/loops.md, 'Several engines in one loop': mp_d.backward(d_loss); "
                 "mp_d.step(); mp_g.backward(g_loss, inputs=list(G.parameters())); mp_g.step()), in plain PyTorch "
                 "or Fabric without the plugin")
    return text


class _SteppedByEngine:
    """A step-interval scheduler as Lightning sees it once the engine steps it: ``step()`` does nothing (the
    engine steps the scheduler after each applied optimizer step); everything else is the scheduler's
    (``state_dict``, ``optimizer``, ``get_last_lr``, ...), so Lightning's checkpoint and LR monitor still work."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name == "_scheduler":
            raise AttributeError(name)
        return getattr(self._scheduler, name)


class MixprecPrecision(Precision):
    """A Lightning precision plugin running the mixprec engine (``L.Trainer(plugins=[MixprecPrecision(policy)])``):
    ``policy`` as :class:`mixprec.MixedPrecision` (``"auto"``, a preset, ``key=value`` text, a :class:`Policy`),
    ``engine_options`` its keyword options but those the trainer owns (ValueError naming the Trainer argument).
    ``engine`` is the :class:`MixedPrecision` after the strategy's setup (None before); ``step_check`` the open
    :class:`StepCheck` inside ``on_before_optimizer_step``/``configure_gradient_clipping`` (None elsewhere);
    ``last_result`` the last step's :class:`StepResult`. ``precision`` (``trainer.precision``) is the policy's
    text. Several processes (``strategy="ddp"``): every rank takes rank 0's stochastic-rounding seeds when the
    optimizer is attached, ``accumulate_grad_batches`` is re-read at every micro-batch, and every
    ``verify_replicas_every`` steps (default 100, 0: off) the replicas are compared by fingerprint
    (:mod:`mixprec.integrations.replica_checks`). Host syncs: the engine's (one per step), one per check. Errors:
    RuntimeError for a second model, a second ``fit`` with new optimizers, a step outside the order or replicas
    that differ; ValueError for several optimizers, an overridden ``LightningModule.backward`` or
    ``lr_scheduler_step`` beside a step-interval scheduler, accumulation with fp32 masters on several processes,
    and under ``ModelParallelStrategy`` (the engine's own ``strategy="fsdp2"``) a model sharded in ``configure_model``
    or accumulation with 16-bit params without masters. Source: Lightning's ``MixedPrecision`` plugin (hook order)."""

    def __init__(self, policy: str | Policy = "auto", *, keep_inputs: tuple = (),
                 verify_replicas_every: int = DEFAULT_EVERY, **engine_options: Any) -> None:
        super().__init__()
        check_options(engine_options, _TRAINER_OWNS, "MixprecPrecision")
        self.policy, self.engine_options = policy, engine_options
        self.keep_inputs = check_keep(keep_inputs, "MixprecPrecision")
        self.replicas = ReplicaChecks(verify_replicas_every, "MixprecPrecision")
        self._accumulate: int | None = None   # Lightning's accumulate_grad_batches at the last micro-batch
        self.engine: MixedPrecision | None = None
        self.step_check: StepCheck | None = None   # and last_result: the boundary's StepCheck and StepResult
        self.last_result: StepResult | None = None
        self._trainer: Any = None
        self._checkpoint_parts: dict[str, Any] = {}   # Lightning's own model and optimizer states, at a load
        self._pending: dict[str, Any] | None = None   # an engine state loaded before the optimizer was attached
        self._open_group: tuple | None = None   # a loaded open window (counters, group), for the first training step
        self._replay_rng: dict[str, Any] | None = None   # RNG states at the start of a training step that raised

    @property
    def precision(self) -> str:   # type: ignore[override]
        """The policy's text (``trainer.precision``): the engine's resolved policy once built."""
        return str(self.engine.policy) if self.engine is not None else str(self.policy)

    # ------------------------------------------------------------------ setup
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Build the engine on ``module`` (the LightningModule, before any wrapper) with ``optimizer=None``; the
        same module again (validate after fit) keeps its engine. TypeError for a wrapper, RuntimeError for
        another model."""
        if self.engine is not None:
            if module is not self.engine.module:
                raise RuntimeError(f"MixprecPrecision got a second model ({type(module).__name__}) after preparing "
                                   f"{type(self.engine.module).__name__}: use one plugin per model")
            return module
        if not isinstance(module, LightningModule):
            raise TypeError(f"MixprecPrecision.convert_module got a {type(module).__name__}, not the LightningModule: "
                            "the strategy wrapped it first, so its buckets or shards would hold the fp32 params; "
                            "this strategy is not supported")
        self._trainer = module.trainer
        fsdp2 = model_parallel(self._trainer.strategy, module)   # the engine shards (it syncs rank 0's values)
        if not fsdp2:
            broadcast_from_rank0(module)
        note = hand_over(module, "MixprecPrecision")   # an earlier Trainer's engine on this module: unwrapped
        self.engine = MixedPrecision(module, None, self.policy, device=self._trainer.strategy.root_device,
                                     **({"strategy": "fsdp2"} if fsdp2 else {}), **self.engine_options)
        record_hand_over(self.engine, note)
        allow_absent_block_state(module)   # a later restore (test(ckpt_path=...)): the block state travels apart
        return module

    def _built(self, what: str) -> MixedPrecision:
        if self.engine is None:
            raise RuntimeError(f"MixprecPrecision: {what} before the strategy's setup built the engine; pass the "
                               "plugin as L.Trainer(plugins=[MixprecPrecision(policy)])")
        return self.engine

    def _attach(self) -> MixedPrecision:
        """The engine with Lightning's optimizer attached (at the first training step), and a pending load."""
        engine = self._built("a training step")
        optimizers = list(self._trainer.strategy.optimizers)
        if engine.optimizer is None:
            if len(optimizers) != 1:
                raise ValueError(_several_optimizers(len(optimizers), engine.module))
            module, trainer = engine.module, self._trainer
            check_accumulation(trainer.accumulate_grad_batches, trainer.world_size, engine.policy,
                               sharded=engine.strategy == "fsdp2")
            if is_overridden("backward", module, LightningModule):
                raise ValueError(f"{type(module).__name__}.backward is overridden, but MixprecPrecision backpropagates "
                                 "through the engine (loss scaling, fp32 master gradients); remove the override")
            engine.attach(optimizers[0], self._take_scheduler(module))
            self.replicas.agree_seeds(engine)   # several processes: rank 0's sr_seed on every rank
        elif optimizers and optimizers[0] is not engine.optimizer:
            raise RuntimeError("a second fit() built a new optimizer, but the engine's fp32 masters and loss scale "
                               "belong to the first: build a new model and MixprecPrecision, or resume through "
                               "fit(ckpt_path=...)")
        if self._pending is not None:
            state, self._pending = self._pending, None
            rng, group = state.pop("rng", None), state.pop("open_group", None)
            check_group(engine, group)   # before anything changes
            load_resumed(engine, state, "MixprecPrecision", open_window=bool(group))   # another policy's: converted
            # an open window goes back at the first training step: Lightning zeroes the module's gradients
            # between the checkpoint's load and the first batch (Trainer._run_stage)
            self._open_group = (state["counters"], group) if group else None
            restore_snapshot(rng)
            self.replicas.agree_seeds(engine, when="after the checkpoint load")
        return engine

    def _take_scheduler(self, module: LightningModule) -> Any:
        """The step-interval scheduler the engine will step (Lightning's ``step()`` of it becomes a no-op)."""
        if not module.automatic_optimization:
            return None   # manual optimization: the user steps schedulers (`if plugin.last_result.applied`)
        configs = [c for c in self._trainer.strategy.lr_scheduler_configs
                   if c.interval == "step" and not c.reduce_on_plateau]
        if not configs:
            return None
        if len(configs) > 1 or configs[0].frequency != 1:
            raise ValueError(f"MixprecPrecision steps one step-interval scheduler with frequency=1 after each "
                             f"applied step; got {len(configs)} with frequencies {[c.frequency for c in configs]}: "
                             "chain them (torch.optim.lr_scheduler.SequentialLR) or use interval='epoch'")
        if is_overridden("lr_scheduler_step", module, LightningModule):
            raise ValueError(f"{type(module).__name__}.lr_scheduler_step is overridden, but the engine steps the "
                             "step-interval scheduler itself (after applied steps only); remove the override or "
                             "use interval='epoch'")
        scheduler = configs[0].scheduler
        configs[0].scheduler = _SteppedByEngine(scheduler)
        return scheduler

    # ------------------------------------------------------------------ forward
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """``mp.autocast()`` around a train/val/test/predict step."""
        with self._built("a forward").autocast():
            yield

    @contextmanager
    def train_step_context(self) -> Iterator[None]:
        """The training step's forward: attach the optimizer first (once), restore a loaded checkpoint's open
        accumulation window (once), then :meth:`forward_context`."""
        engine = self._attach()
        if self._open_group is not None:
            (counters, group), self._open_group = self._open_group, None
            engine.restore_progress(counters, None, group)
        self._replay_rng, before = None, rng_snapshot(engine.device)   # a step that raises is replayed: saved then
        try:
            with profiler_hold(self._trainer), self.forward_context():
                yield
        except BaseException:
            self._replay_rng = before
            raise

    def convert_input(self, data: Any) -> Any:
        """``mp.cast_inputs(data, keep=keep_inputs)``: to the device, floating tensors in the param dtype but the
        ``keep_inputs`` targets (as they come), token ids exact."""
        return data if self.engine is None else cast_batch(self.engine, data, self.keep_inputs)

    # ------------------------------------------------------------------ backward and step
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``mp.backward(tensor, join=True)``: Lightning's loss, already divided by ``accumulate_grad_batches``,
        joins the window in progress (``retain_graph``/``inputs`` pass through)."""
        if args:
            raise TypeError(f"MixprecPrecision.backward takes retain_graph=/inputs= by keyword only, got {args!r}")
        engine, trainer = self._attach(), self._trainer
        # re-read at every micro-batch (a GradientAccumulationScheduler changes it): recorded, or refused before
        # this micro-batch's gradients join the window
        self._accumulate = follow_accumulation(engine, trainer.accumulate_grad_batches, trainer.world_size,
                                               was=self._accumulate, where=f"at epoch {trainer.current_epoch}")
        engine.backward(tensor, join=True, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run ``closure`` (forward, backward), then the engine's boundary: unscale_and_check, Lightning's
        ``on_before_optimizer_step`` and clipping on the unscaled fp32 gradients, apply_or_skip (the scheduler
        steps on applied steps only). Returns the closure's result."""
        engine = self._attach()
        if kwargs:
            raise TypeError(f"MixprecPrecision.optimizer_step takes no optimizer.step() arguments, got {kwargs}")
        if optimizer is not engine.optimizer:
            raise RuntimeError(f"optimizer_step for a {type(optimizer).__name__} the engine does not step")
        closure_result = closure()
        automatic = isinstance(model, LightningModule) and model.automatic_optimization
        if automatic and engine.micro_step == 0:   # every training_step of the window returned None: no gradient
            return closure_result                 # to step (a torch optimizer skips params without one)
        self.step_check = engine.unscale_and_check()
        self._agree_on_skip(self.step_check)
        self._after_closure(model, optimizer)   # on_before_optimizer_step, configure_gradient_clipping
        check, self.step_check = self.step_check, None
        self.last_result = engine.apply_or_skip(check)
        self.replicas.at_boundary(engine)   # several processes: every verify_replicas_every steps
        return closure_result

    def _agree_on_skip(self, check: StepCheck) -> None:
        """Under several processes the ranks' skip decisions must agree (DDP reduced the gradients, but a
        non-finite loss is each rank's own): one all-reduce of one flag per step; RuntimeError otherwise."""
        strategy = self._trainer.strategy
        if strategy.world_size < 2:
            return
        any_skipped = strategy.reduce_boolean_decision(check.skipped, all=False)
        if any_skipped != check.skipped:
            raise RuntimeError(f"rank {strategy.global_rank} {'skips' if check.skipped else 'applies'} step "
                               f"{self.engine.boundaries} but another rank does not (a non-finite loss on one rank "
                               "with finite reduced gradients); the ranks would drift apart: check the loss")

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Clip the step's unscaled fp32 gradients to ``clip_val`` by their fp32 norm (the engine's clip, as
        ``MixedPrecision(max_grad_norm=clip_val)``). RuntimeError outside the step's gradient hooks."""
        if self.step_check is None:
            raise RuntimeError("clip_gradients outside on_before_optimizer_step/configure_gradient_clipping: the "
                               "engine's unscaled gradients exist only there (between manual_backward and opt.step() "
                               "they are still scaled, and on the fp32 masters under -pure). In manual optimization "
                               "call self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm="
                               "'norm') from on_before_optimizer_step(self, optimizer), which opt.step() runs on the "
                               "unscaled gradients; or pass gradient_clip_val to the Trainer (automatic optimization)")
        clip_(list(self.step_check.grads), self.step_check.grad_norm_t, float(clip_val))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The engine's :meth:`~MixedPrecision.state_dict` less ``model`` and ``optimizer`` (Lightning saves
        them), with its events and the global RNG states (torch, CUDA, numpy, python: stochastic rounding, dropout
        and data order go on as in an uninterrupted run); inside an accumulation window also the open window
        (``open_group``: its gradients as copies; on several processes every rank's, ``open_group_ranks``, gathered
        by a collective that Lightning's checkpointing runs on every rank); empty before the optimizer is attached.
        Other tensors are references."""
        engine = self.engine
        if engine is None or engine.optimizer is None:
            return {}
        state = {k: v for k, v in engine.state_dict().items() if k not in ("model", "optimizer")}
        state["events"], state["rng"] = [e.to_dict() for e in engine.events], self._replay_rng or rng_snapshot(engine.device)
        return gather_windows(state)   # several processes inside a window: every rank's (a collective)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Move the block-scaled linears' signs and stochastic-rounding streams out of ``checkpoint["state_dict"]``
        into this plugin's entry (``"block_state"``): Lightning restores ``state_dict`` into the module before
        ``convert_module`` swaps its linears (:mod:`mixprec.integrations.block_state`); ``load_from_checkpoint``
        then loads the weights without the plugin too; and under a policy with fp32 masters (``-pure``) write the
        masters' fp32 values over the 16-bit params there, so ``load_from_checkpoint`` without the plugin gets
        the trained fp32 weights (a resume with it rounds them back to the same stored bits). Kept where the
        strategy restores after its setup (``ModelParallelStrategy``: the module is converted by then)."""
        if self.engine is None or self._trainer.strategy.restore_checkpoint_after_setup:
            return
        weights = checkpoint.get("state_dict") or {}
        block_state = split_block_state(self.engine.module, weights)
        if block_state:
            checkpoint.setdefault(type(self).__qualname__, {})["block_state"] = block_state
        masters, copies = {p.data_ptr(): m for p, m in self.engine.masters.pairs}, {}   # by storage: tied names
        for name, value in list(weights.items()):                                   # (wte, lm_head): one param
            master = masters.get(value.data_ptr()) if isinstance(value, torch.Tensor) and value.numel() else None
            if master is not None and master.shape == value.shape:   # fp32, not the 16-bit rounding
                weights[name] = copies.setdefault(value.data_ptr(), master.detach().clone())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep Lightning's model and optimizer states of ``checkpoint`` for :meth:`load_state_dict`. When fitting
        from a checkpoint without this plugin's state (a run under ``precision="32-true"``, or Lightning's AMP),
        adopt it: its fp32 weights and optimizer state converted to the policy as ``set_policy`` would
        (:func:`mixprec.checkpoint.adopt.adopt_fp32_run`: an ``"adopt-checkpoint"`` event), and Lightning's
        ``optimizer_states`` entry replaced by the converted state, which Lightning loads next. ValueError for
        16-bit weights or several optimizers. Under ``ModelParallelStrategy``:
        :func:`~mixprec.integrations.lightning_strategies.resumed_parts` (it refuses what it cannot resume)."""
        if self.engine is not None and self.engine.strategy == "fsdp2" and self._trainer.state.fn == "fit":
            # ModelParallelStrategy loaded the module and the optimizer into the engine's shards already
            self._checkpoint_parts = resumed_parts(checkpoint, type(self).__qualname__, self._trainer, self._attach)
            return
        optimizers = checkpoint.get("optimizer_states") or [None]
        block_state = (checkpoint.get(type(self).__qualname__) or {}).get("block_state") or {}
        model = checkpoint.get("state_dict")
        self._checkpoint_parts = {"model": None if model is None else with_block_state(model, block_state),
                                  "optimizer": optimizers[0]}
        if (type(self).__qualname__ in checkpoint or self._trainer is None or self._trainer.state.fn != "fit"
                or optimizers[0] is None or not optimizers[0].get("state")):   # no optimizer step: nothing to adopt
            return
        if len(optimizers) != 1:
            raise ValueError(f"the checkpoint holds {len(optimizers)} optimizer states; MixprecPrecision adopts a run "
                             "of one optimizer (param groups for several parts)")
        engine = self._attach()
        adopt_fp32_run(engine, checkpoint["state_dict"], optimizers[0], steps=int(checkpoint.get("global_step", 0)),
                       source=f"Lightning checkpoint (epoch {checkpoint.get('epoch')}, global_step "
                              f"{checkpoint.get('global_step')})")
        checkpoint["optimizer_states"] = [engine.optimizer.state_dict()]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` with the model and optimizer states of Lightning's checkpoint, exactly
        (:meth:`MixedPrecision.load_state_dict`), when fitting; outside ``fit`` Lightning restores the weights
        only and the engine's state is left (several processes: each rank its own open window). ValueError for a
        checkpoint without optimizer states, or saved inside a window by another number of processes."""
        state_dict = {k: v for k, v in state_dict.items() if k != "block_state"}   # in the model's, on_load_checkpoint
        if not state_dict or self._trainer is None or self._trainer.state.fn != "fit":
            return
        state_dict = own_window(state_dict, type(self).__name__)   # several processes: this rank's open window
        parts = self._checkpoint_parts
        if parts.get("model") is None or parts.get("optimizer") is None:
            raise ValueError("MixprecPrecision.load_state_dict needs Lightning's full checkpoint (state_dict and "
                             "optimizer_states); this one was saved with weights_only=True")
        self._pending = {**state_dict, **parts}
        self._attach()
