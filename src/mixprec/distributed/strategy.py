"""How a training step spans processes: one process, DDP, or FSDP2, behind one small interface.

The engine calls the same methods whatever the strategy, so ``MixedPrecision.step`` has no branch on
it. :class:`SingleProcess` does nothing (no collective, the model as given). :class:`DDP` and
:class:`FSDP2` join the torchrun process group, start every rank from rank 0's weights and policy,
wrap the model (:func:`mixprec.distributed.wrapping.wrap_model`), reduce gradients in fp32, and OR the step's
found-inf and non-finite-loss flags across ranks before the step's one host read, so every rank
steps or skips together. Details: :mod:`mixprec.distributed.process`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mixprec.distributed import process as distributed
from mixprec.distributed import replicas, sharded_storage, sharded_switch, sharded_units
from mixprec.optim import contract
from mixprec.policy.resolve import Resolution, resolve
from mixprec.policy.policy import Policy

__all__ = ["SingleProcess", "DDP", "FSDP2", "make_strategy"]


class SingleProcess:
    """One process: no collectives, the model as given, every re-preparation allowed."""

    name: str | None = None
    shards_params = False       # FSDP2 stores params sharded (fp32 masters, or the policy's 16-bit storage)

    def device(self, device: str | torch.device | None) -> str | torch.device | None:
        """This rank's device (joins the process group under a multi-process strategy)."""
        return device

    def agree_resolution(self, resolution: Resolution, device: torch.device) -> Resolution:
        """Every rank runs rank 0's policy (``auto`` may measure differently on each)."""
        return resolution

    def before_casts(self, model: nn.Module, policy: Policy, device: torch.device, keep: dict[str, nn.Module],
                     optimizer: torch.optim.Optimizer) -> None:
        """Called after the model moved to ``device``, before the storage plan is applied."""

    def check_attached(self, optimizer: torch.optim.Optimizer, policy: Policy, device: torch.device) -> None:
        """Called when ``optimizer`` is attached: what the ranks must agree on before a step (the seeds of
        stochastic rounding's stream). One process: nothing."""

    def block_note(self, policy: Policy) -> str:
        """The decision's words on block-scaled linears (``policy.block``) under this strategy ("" when there are
        none to say). One process: none."""
        return ""

    def after_casts(self, model: nn.Module, policy: Policy, device: torch.device) -> nn.Module:
        """Called after the params were cast; returns what users call (``mp.model``)."""
        return model

    def set_gradient_sync(self, model: nn.Module, *, last_micro_batch: bool, has_masters: bool) -> None:
        """Before the next micro-batch: whether its backward reduces gradients across ranks."""

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of ``grads`` (DTensor shards → local tensors)."""
        return grads

    def global_norm(self, norm_fp32: torch.Tensor, *, scaled: bool = False) -> torch.Tensor:
        """The norm over every rank's part, from this rank's ``norm_fp32``; ``scaled``: without squaring
        a large norm (the overflow-proof path of :mod:`mixprec.engine.clipping`)."""
        return norm_fp32

    def agree_on(self, choice: str | None, choices: tuple[str, ...], device: torch.device) -> str | None:
        """The first of ``choices`` any rank chose (:meth:`mixprec.MixedPrecision.agree_on`)."""
        if choice is not None and choice not in choices:
            raise ValueError(f"agree_on: choice={choice!r} is not one of {choices}")
        if self.name is None:   # one process: no collective
            return choice
        flags = torch.tensor([c == choice for c in choices], dtype=torch.float32, device=device)
        agreed = self.agree_flags(flags).tolist()  # syncs
        return next((c for c, flag in zip(choices, agreed) if flag), None)

    def agree_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """Elementwise OR of 0/1 fp32 device ``flags`` over ranks (one all-reduce, no sync)."""
        return flags

    def gathered(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), rank order, on every rank: one ``all_gather_object`` every rank calls
        at the same point. One process: ``[obj]``."""
        return [obj]

    def refuse(self, what: str) -> None:
        """Raise ValueError if ``what`` (``"unfreeze"``, ``"to_fp32"``) cannot run."""

    def check_measured_recompute(self, model: nn.Module, blocks: list[str]) -> None:
        """Raise ValueError if ``recompute="auto"`` cannot measure ``blocks`` (module names of ``model``, already
        wrapped) here. One process and DDP: nothing."""

    def from_main_process(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (a recompute plan with the agreed modes: one plan text on every rank).
        One process: ``text``; else one broadcast every rank calls at the same point."""
        return text

    def before_set_policy(self, old: Policy, new: Policy, optimizer: torch.optim.Optimizer | None) -> str:
        """Called by ``set_policy`` before re-preparing the model from ``old`` to ``new``: raise ValueError (nothing
        changed) if the strategy cannot switch, else make ready what the switch needs and return the event's
        words on it ("" when none). One process: nothing."""
        return ""

    def check_restore(self, old: dict[int, torch.dtype], new: dict[int, torch.dtype], policy: Policy) -> None:
        """Raise ValueError if re-preparing from stored dtypes ``old`` to ``new`` cannot run here."""

    def after_swap(self, model: nn.Module) -> None:
        """Called by ``set_policy`` after modules of the wrapped ``model`` (``mp.model``) were swapped for others
        holding the same parameters (block-scaled linears in or out). One process: nothing."""

    def fp32_value(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s fp32 value before the policy's cast, a new tensor placed as ``p`` (where Kahan compensation
        starts): ``p`` upcast, but under FSDP2 with 16-bit storage, where ``p`` was cast before sharding."""
        return p.detach().float().clone()


class _MultiProcess(SingleProcess):
    def device(self, device):
        return distributed.init_process_group_from_env(device)

    def agree_resolution(self, resolution, device):
        chosen = distributed.from_main_process(str(resolution.policy))
        if chosen == str(resolution.policy):
            return resolution
        resolution = resolve(chosen, device)
        return dataclasses.replace(resolution, decision=f"{resolution.decision} (rank 0's choice)")

    def before_casts(self, model, policy, device, keep, optimizer):
        distributed.sync_module_states(model)

    def check_attached(self, optimizer, policy, device):
        stochastic = [f"{key}=stochastic" for key in ("rounding", "state_rounding") if getattr(policy, key) == "stochastic"]
        if not stochastic:
            return
        what = f"strategy={self.name!r} with policy {policy} ({' and '.join(stochastic)})"
        seeds = [group.get("sr_seed") for group in optimizer.param_groups]
        if None in seeds:   # a torch optimizer (no counter-based stream): torch's global RNG
            replicas.check_same_rng(torch.device(device), what)
        else:
            replicas.check_same_sr_seeds([int(s) for s in seeds], torch.device(device), what)

    def set_gradient_sync(self, model, *, last_micro_batch, has_masters):
        distributed.set_gradient_sync(model, self.name, last_micro_batch)

    def block_note(self, policy):
        if policy.block is None:
            return ""
        stored = "bf16" if sharded_storage.stores_16bit(policy) else "fp32"   # block policies compute in bf16
        gathered = (f"; {self.name.upper()} all-gathers the params as stored ({stored}), so each block-scaled "
                    "linear quantizes its whole weight, as one process" if self.shards_params else "")
        from mixprec.blockscale import get_block_recipe   # the recipe's fields; the policy names it

        if not get_block_recipe(policy.block, disable=policy.block_disable).stochastic_rounding:
            return gathered
        return (f"{gathered}; every rank rounds dy with the same stochastic-rounding stream per linear (one count "
                "per backward call, whatever the rank's tokens)")

    def agree_flags(self, flags):
        return distributed.any_across_ranks(flags)

    def from_main_process(self, text):
        return distributed.from_main_process(text)

    def gathered(self, obj):
        return distributed.gather_from_ranks(obj)

    def refuse(self, what):
        if what == "unfreeze":
            raise ValueError(f"unfreeze under strategy={self.name!r}: the {self.name.upper()} wrapper was built for "
                             "the trainable params it saw (it would not reduce the new ones' gradients); save a "
                             "checkpoint, set requires_grad before building MixedPrecision, and resume")
        if what == "to_fp32":
            raise ValueError(f"unwrap(to_fp32=True) under strategy={self.name!r}: the params are wrapped or "
                             "sharded; save a checkpoint and load it into a plain model instead")


class DDP(_MultiProcess):
    """``DistributedDataParallel`` over the prepared model, fp32 all-reduce (:mod:`mixprec.distributed.process`)."""

    name = "ddp"

    def after_casts(self, model, policy, device):   # after the casts: DDP builds its buckets from the dtypes
        return distributed.wrap_model(model, policy, "ddp", device)

    def set_gradient_sync(self, model, *, last_micro_batch, has_masters):
        # fp32 master grads accumulate outside DDP's view: reduce every micro-batch then
        distributed.set_gradient_sync(model, self.name, last_micro_batch or has_masters)

    def after_swap(self, model):
        """DDP lists the module's buffers when it wraps it and re-lists them at each forward only once it found the
        old list non-empty: a swap that removes every buffer (block-scaled linears back to ``nn.Linear``, their
        Hadamard signs with them) would reach torch's buffer broadcast with none (an internal assert in torch
        2.13). DDP's own re-listing, run now (the same on every rank: every rank swaps alike)."""
        relist = getattr(model, "_assign_modules_buffers", None)   # torch's DistributedDataParallel method
        if relist is not None:
            relist()

    def check_restore(self, old, new, policy):
        if old != new:
            raise ValueError(f"set_policy: {policy} stores parameters in other dtypes than the current policy, but "
                             "DDP built its gradient buckets for the current ones; save a checkpoint and resume "
                             "under it")


class FSDP2(_MultiProcess):
    """``fully_shard`` with params stored sharded: in fp32 and cast by FSDP, or in the policy's 16-bit dtype
    without masters (:mod:`mixprec.distributed.process`, :mod:`mixprec.distributed.sharded_storage`)."""

    name = "fsdp2"
    shards_params = True

    def __init__(self) -> None:
        self._start_fp32: dict[int, torch.Tensor] = {}   # id(sharded param) -> its fp32 value before the cast
        self._built: Policy | None = None                 # the policy the shards are laid out for
        self._model: nn.Module | None = None              # the sharded model

    def before_casts(self, model, policy, device, keep, optimizer):
        super().before_casts(model, policy, device, keep, optimizer)
        self._built, self._model = policy, model
        distributed.check_fsdp_policy(policy)   # before the cast: a refused policy leaves the model as it was
        values = (sharded_storage.cast_for_sharding(model, policy, tuple(keep), keep_values=policy.rounding == "kahan")
                  if sharded_storage.stores_16bit(policy) else {})
        distributed.wrap_model(model, policy, "fsdp2", device, keep_fp32=tuple(keep), optimizer=optimizer,
                               sharded_found_inf=True)
        self._start_fp32 = sharded_storage.shard_like_params(model, values)

    def check_measured_recompute(self, model, blocks):
        """auto measures a block by running its forward and backward outside the step; a module inside it that
        FSDP2 shards on its own (a ``keep_fp32`` module, a BatchNorm kept in fp32) runs its all-gather and
        reduce-scatter hooks in those passes, outside FSDP2's step (seen on torch 2.13: a later pass meets the unit's
        params still sharded, "mixed torch.Tensor and DTensor")."""
        from torch.distributed.fsdp import FSDPModule

        inner = [f"{b}.{n}" for b in blocks for n, m in model.get_submodule(b).named_modules()
                 if n and isinstance(m, FSDPModule)]
        if inner:
            group = blocks[0].rpartition(".")[0]
            pattern = f"{group}.*" if group else "*"
            raise ValueError(f"recompute='auto' under strategy='fsdp2': {inner} inside the measured blocks are FSDP2 "
                             "units of their own (fp32 modules the policy keeps), and auto's measurement cannot run a "
                             "block's forward and backward outside the step through their hooks; name the blocks "
                             f"instead, recompute={pattern!r} (whole) or recompute=['selective:{pattern}'], or keep "
                             "no fp32 module inside them")

    def fp32_value(self, p):
        value = self._start_fp32.pop(id(p), None)
        return super().fp32_value(p) if value is None else value

    def local(self, grads):
        return distributed.local_tensors(grads)

    def global_norm(self, norm_fp32, *, scaled=False):   # sqrt of the squares summed over the shards
        if not scaled:
            return distributed.sum_across_ranks(norm_fp32.square()).sqrt()
        # each rank's norm over the largest one before squaring (as nrm2): no fp32 overflow for finite norms
        largest = distributed.any_across_ranks(norm_fp32)   # all-reduce MAX (norms are >= 0)
        ratio = torch.where(largest > 0, norm_fp32 / largest, torch.zeros_like(norm_fp32))
        return distributed.sum_across_ranks(ratio.square()).sqrt() * largest

    def before_set_policy(self, old, new, optimizer):
        """The optimizer state's precision may change and modules may be kept in fp32
        (:mod:`mixprec.distributed.sharded_switch`): checked, then the units holding newly kept modules resharded
        (:mod:`mixprec.distributed.sharded_units`), 8-bit sharded state dequantized to fp32 where ``new`` keeps
        none and Kahan compensation folded into the local shards (the re-preparation's ``p.data = ...`` does not
        reach a DTensor's shard). Returns the event's words on the resharded units."""
        built = self._built or old
        sharded_switch.check_switch(built, old, new)
        keep = sharded_units.plan_keep(self._model, built, new) if self._model is not None else None
        if optimizer is not None:   # what prepare checks next, before the state changes here
            contract.check(optimizer, new, {p.dtype for g in optimizer.param_groups for p in g["params"]})
        note = sharded_units.apply_keep(self._model, keep, optimizer) if keep is not None else ""
        if optimizer is not None:
            sharded_switch.dequantize_sharded_state_(optimizer, new)
            sharded_switch.fold_compensation_(optimizer, new)
        self._built = new
        return note


def make_strategy(name: str | None) -> Any:
    """The strategy object for ``name`` (None, ``"ddp"`` or ``"fsdp2"``).

    Raises:
        ValueError: another name.
    """
    distributed.check_strategy(name)
    return {None: SingleProcess, "ddp": DDP, "fsdp2": FSDP2}[name]()
