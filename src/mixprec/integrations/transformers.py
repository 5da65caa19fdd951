"""mixprec inside the Hugging Face ``Trainer``: :class:`MixprecTrainer` (docs/integrations.md).

``MixprecTrainer(model, args, policy="bf16-pure", train_dataset=...)`` is a ``transformers.Trainer`` whose
precision is a :class:`mixprec.MixedPrecision` engine, ``trainer.engine``. Built in ``__init__`` (an evaluation
engine: ``evaluate``/``predict`` work before ``train``), it gets its optimizer and scheduler in
``create_scheduler``; from then on:

* ``training_step`` casts the batch (``engine.cast_inputs``), runs the forward under ``engine.autocast()``
  (``compute_loss_context_manager``, which ``prediction_step`` uses too) and ``engine.backward``; after the last
  micro-batch of an accumulation it runs ``engine.unscale_and_check()``, so the grad norm the Trainer logs and
  what ``on_pre_optimizer_step`` callbacks see are the unscaled fp32 gradients.
* The Trainer's ``optimizer.step()`` is the engine's ``apply_or_skip``: ``trainer.optimizer`` is a view
  (:class:`EngineOptimizer`) of the real optimizer (``trainer.engine.optimizer``), and ``trainer.lr_scheduler``
  a view (:class:`EngineScheduler`) whose ``step()`` does nothing: the engine steps the real scheduler once per
  *applied* step, so a skipped fp16 overflow step never moves the learning rate.
* ``args.max_grad_norm`` moves into the engine (it clips the unscaled fp32 norm; the Trainer's copy of the
  arguments says 0); ``bf16=True``/``fp16=True`` are adopted when the policy computes in that dtype
  (``policy=None`` takes ``bf16-mixed``/``fp16-mixed`` from them), refused otherwise, and turned off in the
  Trainer's Accelerator either way (one autocast: the engine's). The adoption is an event and a decision clause.
* Checkpoints: the Trainer saves model, optimizer, scheduler and RNG as always; next to them
  :data:`PRECISION_STATE_NAME` holds only what the engine adds (policy, fp32 masters, loss scale, counters,
  events). ``train(resume_from_checkpoint=...)`` loads it after the Trainer's own loads: bit-exact resume. A
  plain ``transformers.Trainer``'s checkpoint (fp32, no such file) is adopted: :func:`adopt_plain_checkpoint`.
  The Trainer saves at optimizer steps only (``save_steps`` counts them), so the state never holds an open window.
  ``save_model()`` (and each checkpoint's model file) holds the fp32 masters under ``-pure`` policies
  (:func:`fp32_state_dict`), the trained weights, not their bf16 copies.
* An epoch that would end on a short accumulation step is refused at ``train()`` start (ValueError).
* Under torchrun (several processes, DDP): the engine is built with ``strategy="ddp"`` (rank 0's weights, the
  model wrapped in DDP after the policy's casts, gradients reduced in fp32, the ranks' skip decisions agreed) and
  the Trainer trains that wrapper instead of wrapping the model itself; the engine, not the Trainer's
  ``no_sync``, decides which micro-batches reduce (every one under fp32 masters); every rank takes rank 0's
  stochastic-rounding seeds when the optimizer is attached, and the replicas are compared by fingerprint every
  ``verify_replicas_every`` steps (:mod:`mixprec.integrations.replica_checks`). Bit for bit the engine's own
  ``strategy="ddp"`` loop on the same global batches.

Not supported yet (ValueError naming it): FSDP and DeepSpeed through the Trainer, DataParallel, ``model_init``,
``torch_compile``, ``bf16_full_eval``/``fp16_full_eval`` (they cast the model). Source: transformers 5.24 ``Trainer``
(public hooks ``training_step``, ``compute_loss_context_manager``, ``prediction_step``, ``create_optimizer``,
``create_scheduler``, callbacks ``on_train_begin``/``on_save``; one private: :meth:`MixprecTrainer._get_grad_norm`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from mixprec.engine.boundary import StepCheck
from mixprec.engine.mixed_precision import MixedPrecision
from mixprec.engine.ownership import hand_over, record_hand_over
from mixprec.engine.records import Event
from mixprec.integrations.block_state import split_block_state, with_block_state
from mixprec.integrations.replica_checks import DEFAULT_EVERY, ReplicaChecks
from mixprec.integrations.resume import load_resumed, restore_replaced_params
from mixprec.integrations.transformers_files import PRECISION_STATE_NAME, adopt_plain_checkpoint, load_best_fp32
from mixprec.integrations.transformers_arguments import (FLAG_POLICY, check_flag, check_whole_steps, engine_arguments,
                                                         own_optimizer, record_adopted_flag, refuse_unsupported)
from mixprec.policy.policy import Policy

__all__ = ["MixprecTrainer", "EngineOptimizer", "EngineScheduler", "PRECISION_STATE_NAME", "fp32_state_dict",
           "adopt_plain_checkpoint"]

#: The file next to the Trainer's own in each ``checkpoint-N`` folder: the engine's state minus model,
#: optimizer and scheduler (which the Trainer saves itself).
_SAVED_BY_HF = ("model", "optimizer", "scheduler")


class EngineOptimizer:
    """``trainer.optimizer``: the Trainer's handle on the engine's optimizer. ``step()`` finishes the boundary
    the last ``training_step`` opened (``engine.apply_or_skip``); ``zero_grad()`` does nothing (the engine
    zeroes); everything else (``param_groups``, ``state_dict``, ``load_state_dict``...) is the real optimizer's.
    Not a ``torch.optim.Optimizer``, so Accelerate's ``prepare`` leaves it unwrapped."""

    def __init__(self, trainer: MixprecTrainer, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._trainer = weakref.ref(trainer)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise TypeError("MixprecTrainer's optimizer.step() takes no closure: the engine steps once per boundary")
        self._trainer().apply_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes the gradients after each step (a zero_grad mid-accumulation would lose them)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The real optimizer's, but for a plain Trainer's checkpoint being resumed (no :data:`PRECISION_STATE_NAME`):
        :func:`adopt_plain_checkpoint` loads that one converted, at ``on_train_begin``."""
        trainer = self._trainer()
        folder = None if trainer is None else trainer.resume_dir
        if folder is None or os.path.isfile(os.path.join(folder, PRECISION_STATE_NAME)):
            self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class EngineScheduler:
    """``trainer.lr_scheduler``: the real scheduler (``trainer.engine.scheduler``) whose ``step()`` does nothing,
    because the engine steps it once per applied step; ``get_last_lr``, ``state_dict``... are the real one's."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine stepped the scheduler if (and only if) the optimizer step was applied."""

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class _PrecisionState(TrainerCallback):
    """Saves :data:`PRECISION_STATE_NAME` next to each checkpoint (``on_save``) and loads it when ``train``
    resumes (``on_train_begin``: after the Trainer loaded model, optimizer and scheduler)."""

    def __init__(self, trainer: MixprecTrainer) -> None:
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.load_precision_state()

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()   # after the Trainer's load_best_model_at_end: its fp32 values into the masters
        if trainer is not None and args.load_best_model_at_end and state.best_model_checkpoint:
            load_best_fp32(trainer.engine, state.best_model_checkpoint)

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None and args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            trainer.save_precision_state(folder)


class MixprecTrainer(Trainer):
    """A ``transformers.Trainer`` trained by a :class:`mixprec.MixedPrecision` engine (module docstring), reachable
    as :attr:`engine`. ``policy``: a preset, ``key=value`` text, a :class:`~mixprec.Policy` or ``"auto"``; None
    takes ``bf16-mixed``/``fp16-mixed`` from ``args.bf16``/``args.fp16``, else ``"auto"``. ``loss_scale``,
    ``guard``, ``allow_fallback``, ``max_stuck_skips``: as :class:`~mixprec.MixedPrecision`; ``max_grad_norm`` and
    ``accumulation_steps`` come from ``args``. ``optim="adamw_torch*"`` (the default) and ``"sgd"`` build
    :mod:`mixprec.optim`'s AdamW / SGD with the Trainer's groups and hyperparameters (an event says so); a
    ``ReduceLROnPlateau`` (``lr_scheduler_type="reduce_lr_on_plateau"``) the Trainer steps on evals. Under torchrun
    the engine runs ``strategy="ddp"`` (module docstring); ``verify_replicas_every``: the steps between two
    fingerprint checks that the replicas are equal (0: off). Errors: ValueError for ``args`` that contradict the
    policy or that it does not support yet (named, with the fix); RuntimeError for a second ``train()`` on one
    trainer or replicas that differ. Host syncs: the engine's, one per boundary, and one per replica check."""

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *trainer_args: Any,
                 policy: str | Policy | None = None, loss_scale: Any = None, guard: Any = None,
                 allow_fallback: bool = False, max_stuck_skips: int = 20, verify_replicas_every: int = DEFAULT_EVERY,
                 **trainer_kwargs: Any) -> None:
        if trainer_kwargs.get("model_init") is not None:
            raise ValueError("MixprecTrainer(model_init=...) is not supported: the engine prepares one model once; "
                             "pass model=model_init()")
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        refuse_unsupported(args)
        replicas = ReplicaChecks(verify_replicas_every, "MixprecTrainer")
        flag = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        policy = FLAG_POLICY.get(flag, "auto") if policy is None else policy
        check_flag(flag, policy, args.device)   # before anything changes the model
        strategy = "ddp" if args.world_size > 1 else None
        super().__init__(model, engine_arguments(args, strategy), *trainer_args, **trainer_kwargs)
        note = hand_over(self.model, "MixprecTrainer")   # an earlier MixprecTrainer's engine on it: unwrapped
        self.engine = record_hand_over(MixedPrecision(
            self.model, None, policy, device=self.args.device, strategy=strategy, loss_scale=loss_scale, guard=guard,
            max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None, max_stuck_skips=max_stuck_skips,
            accumulation_steps=args.gradient_accumulation_steps, allow_fallback=allow_fallback), note)
        self.replicas = replicas
        self.model_wrapped = self.engine.model   # under DDP the engine's wrapper: the Trainer wraps nothing again
        if flag is not None:
            record_adopted_flag(self.engine, flag, args.max_grad_norm)
        self.engine_optimizer: torch.optim.Optimizer | None = None
        self.open_check: StepCheck | None = None
        self.stepped_lr: float | None = None   # the lr of the step just applied, for the Trainer's log
        self.resume_dir: str | None = None
        self.add_callback(_PrecisionState(self))

    # ------------------------------------------------------------------ optimizer and scheduler
    def create_optimizer(self, model: Any = None) -> EngineOptimizer:
        """The Trainer's optimizer (``optimizers=`` or built from ``args``; ``adamw_torch*`` / ``sgd`` become
        :class:`mixprec.optim.AdamW` / ``SGD``), returned as the :class:`EngineOptimizer` view the Trainer steps."""
        if isinstance(self.optimizer, EngineOptimizer):
            return self.optimizer
        restore_replaced_params(self.engine.module, getattr(self, "engine_params", None) or {})   # a resume's load
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            own = own_optimizer(*self.get_optimizer_cls_and_kwargs(self.args, self.model if model is None else model),
                                self.args.optim)
            if own is not None:   # torch's AdamW / SGD -> mixprec.optim's (their policy's state and rounding)
                self.optimizer_cls_and_kwargs = own[:2]
                self.engine.record(Event(step=self.engine.boundaries, kind="hf-optimizer", cause="MixprecTrainer",
                                         module=None, detail=own[2]))
        self.engine_optimizer = super().create_optimizer(model)
        self.optimizer = EngineOptimizer(self, self.engine_optimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> EngineScheduler:
        """The Trainer's scheduler on the real optimizer, attached with it to the engine (which steps it on
        applied steps only); returned as the :class:`EngineScheduler` view. RuntimeError on a second train()."""
        if self.engine.optimizer is not None:
            raise RuntimeError("MixprecTrainer.train() a second time on one trainer: its engine already owns an "
                               "optimizer and scheduler. Build a new MixprecTrainer (train(resume_from_checkpoint=...) "
                               "continues a saved run)")
        if self.engine_optimizer is None:
            self.create_optimizer()
        scheduler = super().create_scheduler(num_training_steps, optimizer=self.engine_optimizer)
        self.replicas.agree_seeds(self.engine, self.engine_optimizer)   # under torchrun: rank 0's sr_seed everywhere
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)   # the Trainer steps it on evals
        self.engine.attach(self.engine_optimizer, None if plateau else scheduler)
        self.lr_scheduler = scheduler if plateau else EngineScheduler(scheduler)
        return self.lr_scheduler

    # ------------------------------------------------------------------ the step
    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The engine's autocast (``training_step`` and ``prediction_step`` compute under it)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.engine.autocast())
        return stack

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch: cast inputs, forward under the engine's autocast, ``engine.backward``; at the
        accumulation boundary ``engine.unscale_and_check()`` (its one host read). Returns the detached loss the
        Trainer logs (divided by the accumulation steps as the Trainer's own, unless already normalised)."""
        mp = self.engine
        if self.current_gradient_accumulation_steps != mp.accumulation_steps:
            raise RuntimeError(f"this optimizer step has {self.current_gradient_accumulation_steps} micro-batches but "
                               f"gradient_accumulation_steps={mp.accumulation_steps} (the epoch's last, short step): "
                               "make the batches per epoch a multiple of it (dataloader_drop_last=True, or max_steps)")
        model.train()
        inputs = self._cast(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled_for_ga = self.loss_is_scaled_for_ga if getattr(self, "loss_is_scaled_for_ga", None) is not None else (
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None)
        n = mp.accumulation_steps
        mp.backward(loss * n if scaled_for_ga and n > 1 else loss)   # the engine divides by n itself
        if mp.micro_step == n:
            self.open_check = mp.unscale_and_check()
        else:
            mp.step()   # None mid-accumulation; under DDP it sets whether the next micro-batch reduces
        return loss.detach() if scaled_for_ga else loss.detach() / n

    def apply_step(self) -> None:
        """``trainer.optimizer.step()``: ``engine.apply_or_skip`` on the boundary ``training_step`` checked.
        RuntimeError when no boundary is open (an optimizer step the engine did not prepare)."""
        if self.open_check is None:
            raise RuntimeError("trainer.optimizer.step() with no accumulation boundary open: MixprecTrainer's "
                               "training_step runs engine.unscale_and_check() after the last micro-batch; a step "
                               "anywhere else would apply scaled, unchecked gradients")
        check, self.open_check = self.open_check, None
        self.stepped_lr = self.engine_optimizer.param_groups[0]["lr"]   # the lr this step uses (logged)
        self.engine.apply_or_skip(check)
        self.replicas.at_boundary(self.engine)   # under torchrun: every verify_replicas_every steps

    def _get_learning_rate(self) -> float:
        """The private hook the Trainer logs ``learning_rate`` from (transformers 5.24 ``_inner_training_loop``
        reads it right after ``optimizer.step()``, "before update" of the scheduler): the lr the step just made
        used, since the engine stepped the scheduler inside that ``optimizer.step()`` already (the scheduler's
        ``get_last_lr()`` is the next step's). Elsewhere (evaluation logs) the Trainer's own."""
        lr, self.stepped_lr = self.stepped_lr, None
        return super()._get_learning_rate() if lr is None else lr

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> torch.Tensor | None:
        """The private hook the Trainer logs ``grad_norm`` from (transformers 5.24 ``_inner_training_loop`` →
        ``_get_grad_norm``; no public one exists): the engine's unscaled fp32 norm of this boundary (pre-clip,
        as the Trainer's own) instead of a norm of the model's gradients, which are scaled under fp16 and
        absent under ``-pure`` (they are on the masters)."""
        return None if self.open_check is None else self.open_check.grad_norm_t

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple:
        """The Trainer's ``prediction_step`` on ``engine.cast_inputs(inputs)``, under the engine's autocast."""
        return super().prediction_step(model, self._cast(inputs), prediction_loss_only, ignore_keys)

    def _cast(self, inputs: Any) -> Any:
        """``engine.cast_inputs(inputs)`` keeping ``labels`` as they come (moved only): a target by the Trainer's
        own convention, never rounded to the param dtype (float regression labels stay fp32; token ids are exact)."""
        keep = ("labels",) if isinstance(inputs, Mapping) and "labels" in inputs else ()
        return self.engine.cast_inputs(inputs, keep=keep)

    def get_train_dataloader(self) -> Any:
        """The Trainer's training dataloader (built once per ``train()``), refused when an epoch would end on a
        short accumulation step (:func:`~mixprec.integrations.transformers_arguments.check_whole_steps`): at
        ``train()`` start, not after an epoch's training."""
        dataloader = super().get_train_dataloader()
        check_whole_steps(dataloader, self.args)
        return dataloader

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``Trainer._save`` (what ``save_model()`` and each checkpoint write, through ``save_pretrained``), with
        the engine's fp32 masters in place of the 16-bit params they train under ``-pure`` policies
        (:func:`fp32_state_dict`): the trained weights an HF user expects, loadable with ``from_pretrained``."""
        if state_dict is None and self.engine.masters.pairs:
            state_dict = fp32_state_dict(self.engine)
        super()._save(output_dir, state_dict=state_dict)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resumed run also loads :data:`PRECISION_STATE_NAME` (after the Trainer's loads)."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self.resume_dir = resume_from_checkpoint or None
        self.engine_params = dict(self.engine.module.named_parameters()) if self.resume_dir else None   # peft swaps
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_precision_state(self, folder: str) -> str:
        """Write the engine's state minus what the Trainer saves (model, optimizer, scheduler) with its events and
        ``"block_state"`` (block-scaled linears' signs and SR streams: the Trainer's load of the model is not strict)
        to ``folder/``:data:`PRECISION_STATE_NAME`; returns the path. RuntimeError if ``folder`` does not exist."""
        if not os.path.isdir(folder):
            raise RuntimeError(f"the Trainer's checkpoint folder {folder} does not exist (hyperparameter search "
                               "runs save elsewhere): MixprecTrainer saves its precision state next to it")
        engine_state = self.engine.state_dict()
        state = {k: v for k, v in engine_state.items() if k not in _SAVED_BY_HF}
        state["events"] = [e.to_dict() for e in self.engine.events]
        state["block_state"] = split_block_state(self.engine.module, engine_state["model"])
        path = os.path.join(folder, PRECISION_STATE_NAME)
        torch.save(state, path)
        return path

    def load_precision_state(self) -> None:
        """When ``train`` resumes: the saved precision state with the model, optimizer and scheduler the Trainer
        loaded and the saved ``"block_state"``, into the engine (:func:`~mixprec.integrations.resume.load_resumed`:
        exactly, or converted from another policy with a ``"convert"`` event; ValueError as it). A checkpoint
        without it (a plain ``transformers.Trainer``'s) is adopted: :func:`adopt_plain_checkpoint`."""
        if self.resume_dir is None:
            return
        path = os.path.join(self.resume_dir, PRECISION_STATE_NAME)
        if not os.path.isfile(path):
            adopt_plain_checkpoint(self.engine, self.resume_dir, steps=self.state.global_step)
            self.resume_dir = None
            return
        device = self.engine.device   # under DDP on CPUs accelerate names it cpu:0, which torch.load cannot map to
        saved = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=True)
        mp, block_state = self.engine, saved.pop("block_state", None)   # None: a file saved without it
        own = mp.module.state_dict()   # the weights the Trainer loaded; the saved streams replace the module's
        model = own if block_state is None else with_block_state(own, block_state, module=mp.module)
        load_resumed(mp, {**saved, "model": model, "optimizer": mp.optimizer.state_dict(),
                          "scheduler": None if mp.scheduler is None else mp.scheduler.state_dict()}, "MixprecTrainer")
        self.resume_dir = None




def fp32_state_dict(mp: MixedPrecision) -> dict[str, torch.Tensor]:
    """``mp.module.state_dict()`` with each trainable param that has an fp32 master replaced by the master
    (an fp32 CPU copy, bit for bit; tied names share one tensor, so ``save_pretrained`` keeps its de-duplication);
    buffers, frozen params and params without a master as they are. Syncs (the copies)."""
    with_master = {id(p) for p, _ in mp.masters.pairs}
    fp32 = mp.trainable_state_dict()
    by_id = {id(p): fp32[n] for n, p in mp.module.named_parameters() if id(p) in with_master and n in fp32}
    state = mp.module.state_dict()
    for name, p in mp.module.named_parameters(remove_duplicate=False):
        if id(p) in by_id and name in state:
            state[name] = by_id[id(p)]
    return state
