"""A param group added to the attached optimizer mid-run (``optimizer.add_param_group``), under every policy.

Once attached, the optimizer's ``add_param_group`` routes to the engine's :class:`GroupWatch` (an instance
attribute set at ``mp.attach``; ``mp.unwrap()`` removes it, a pickled or copied optimizer drops it).
A call is checked first and refused there, nothing changed (:func:`check_group`):

* mid-accumulation, or between ``unscale_and_check`` and ``apply_or_skip`` (RuntimeError: add it at a boundary);
* a param the optimizer steps already, itself or through its fp32 master (ValueError, torch's own check);
* a scheduler attached to the engine (ValueError: torch's schedulers size their per-group lists when built, and
  the next scheduler step would fail on the new group, after the optimizer stepped);
* params frozen when the engine was built, under a strategy or several processes (DDP wrapped the model without them, so
  their gradients would never be reduced), and any group under FSDP2 (sharded params).

Then torch adds the group and the engine adopts its params (:func:`adopt_group`), each by what it was:

* trainable at build, but the optimizer lacked it: it is stored as the policy says already (``-pure``: 16-bit
  with an fp32 master copied from its fp32 value at build; ``-kahan``: its compensation, what storing it in
  16 bits lost at build, kept by the engine until now); the optimizer steps that master / compensation;
* frozen at build (stored without master, in the compute dtype where that only changes its rounding) and
  requiring grad now (Lightning's ``BaseFinetuning.make_trainable`` runs first): stored as trainable ones are,
  with a fresh fp32 master from its *stored* value under ``-pure`` (its low fp32 bits were rounded away at
  build; exact upcast under ``-mixed``), Kahan compensation from zero;
* frozen at build and still not requiring grad: held as it is (no master, no state, no gradient) until it
  requires grad (below);
* a tensor not of the model: stepped as it is, as at ``attach``.

Params frozen at build that the optimizer holds and that require grad later (``requires_grad_(True)`` alone, or
Lightning's ``make_trainable`` on params already in a group) are adopted the same way before the model's next
forward at a boundary (:meth:`GroupWatch.refresh`; a 16-bit one reaching ``backward()`` unadopted, its forward
run without the model's own (a submodule called directly), still meets the "frozen when built" RuntimeError),
and so are those an optimizer attached later already holds (:meth:`GroupWatch.install`: the Lightning plugin
attaches at the first step, after ``BaseFinetuning`` may have unfrozen at epoch 0).

Optimizer state (moments, 8-bit blocks) starts at the param's first step, as for any torch param group; under
``-sr`` its rounding stream is keyed by its index in the optimizer's param order, as if the group had been there
from the start. One ``"param-group"`` event, whose words the decision also takes. Under ``-pure`` the new group
holds the params as passed until the next forward, ``backward()``, ``set_policy`` or ``state_dict``
(:meth:`GroupWatch.rebind` then points it at their masters): Lightning's ``BaseFinetuning`` maps the new group's
params to their names right after adding it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.engine.masters import MasterWeights, claim
from mixprec.engine.feature import Feature
from mixprec.engine.protocol import Engine
from mixprec.engine.records import Event
from mixprec.engine.regions import Regions, keep_fp32_modules
from mixprec.engine.storage import FrozenParams, StoragePlan, dtype_text, plan_storage
from mixprec.optim import contract
from mixprec.policy.policy import Policy

__all__ = ["GroupParams", "GroupWatch", "MID_STEP", "SCHEDULED", "check_group", "check_thaw", "adopt_group",
           "group_words", "several_processes"]

log = logging.getLogger("mixprec")


@dataclass(frozen=True)
class GroupParams:
    """The tensors of a new param group, by what they are to the engine: ``thaw`` (frozen at build, requiring
    grad now), ``frozen`` (frozen at build, still not requiring grad: names), ``lacked`` (trainable at build, not
    held by the optimizer), ``other`` (tensors not of the model: how many); ``names``: id → param name."""

    thaw: tuple[nn.Parameter, ...]
    frozen: tuple[str, ...]
    lacked: tuple[nn.Parameter, ...]
    other: int
    names: dict[int, str]


def check_thaw(call: str, thawed: list[str], strategy: str | None) -> None:
    """Raise ValueError if params frozen at build (``thawed``: names) would start training under a strategy or
    several processes, where the wrapper was built without them."""
    if thawed and (strategy is not None or several_processes()):
        where = f"strategy={strategy!r}" if strategy is not None else "several processes"
        raise ValueError(f"{call} under {where}: {_listed(thawed)} were frozen when the model was prepared and "
                         "wrapped, so DDP does not reduce their gradients and each rank would train its own copy; "
                         "make them trainable before the trainer's strategy wraps the model (freeze nothing in "
                         "setup, hold them at lr=0 in their own group and raise its lr later), or finetune on one "
                         "process")


def several_processes() -> bool:
    """True under an initialized process group of more than one rank (a trainer's DDP: Lightning, Accelerate)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_group(module: nn.Module, optimizer: torch.optim.Optimizer, masters: MasterWeights, frozen: FrozenParams,
                param_group: Any, policy: Policy, strategy: str | None) -> GroupParams:
    """Classify ``param_group``'s tensors (module docstring) before anything changes; ``param_group["params"]``
    becomes a list (as torch's ``add_param_group`` makes it: a generator is read once).

    Raises:
        TypeError: ``param_group`` is not a dict with ``"params"``, or its params are a set (torch's rules).
        ValueError: a param the optimizer steps already (itself or its master); params frozen at build under
            several processes or a strategy; any group under FSDP2.
    """
    if not isinstance(param_group, dict) or "params" not in param_group:
        raise TypeError(f"optimizer.add_param_group takes a dict with 'params' (e.g. {{'params': list(module."
                        f"parameters()), 'lr': 1e-4}}), got {type(param_group).__name__}")
    params = param_group["params"]
    if isinstance(params, set):
        raise TypeError("optimizer.add_param_group: params in a set have no fixed order (torch refuses them too); "
                        "pass a list, e.g. list(module.parameters())")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    param_group["params"] = params
    if strategy == "fsdp2":
        raise ValueError("optimizer.add_param_group under strategy='fsdp2': the params are sharded and the optimizer "
                         "steps each rank's shards as FSDP2 laid them out at build; build the optimizer on every param "
                         "it will train (a param frozen until later gets no state while requires_grad is False)")
    names = {id(p): n for n, p in module.named_parameters()}
    stepped_of = {id(p): t for p, t in zip(masters.params, masters.masters)}
    held = {id(t) for g in optimizer.param_groups for t in g["params"]}
    members = {id(p) for p in frozen.members}
    twice = [names.get(id(t), "a master") for t in params
             if id(t) in held or id(stepped_of.get(id(t), t)) in held]
    if twice:
        raise ValueError(f"optimizer.add_param_group: the optimizer steps {_listed(twice)} already"
                         f"{' (through their fp32 masters under ' + str(policy) + ')' if masters.pairs else ''}, and a "
                         "param in two groups would be stepped twice (torch refuses it too); leave them out of the "
                         "new group, or change the settings of the group that holds them (optimizer.param_groups[i])")
    thaw = tuple(t for t in params if id(t) in members and t.requires_grad)
    check_thaw("optimizer.add_param_group", [names[id(p)] for p in thaw], strategy)
    return GroupParams(
        thaw=thaw, frozen=tuple(names[id(t)] for t in params if id(t) in members and not t.requires_grad),
        lacked=tuple(t for t in params if id(t) in names and id(t) not in members),
        other=sum(1 for t in params if id(t) not in names), names=names)


SCHEDULED = ("optimizer.add_param_group with a scheduler attached to the engine ({name}): torch's schedulers size "
             "their per-group lists when built, and its next step would fail on the new group; build the optimizer "
             "(and then the scheduler) with this group from the start, its params frozen (requires_grad_(False): "
             "no state, no update) until they should train: the engine adopts them once they require grad "
             "(under Lightning: put them in configure_optimizers' optimizer; BaseFinetuning then only makes them "
             "trainable; under the Hugging Face Trainer, which builds its optimizer from the params that require grad: "
             "pass MixprecTrainer(..., optimizers=(mixprec.optim.AdamW(groups including the frozen params), None)) "
             "and set requires_grad_(True) from your callback)")
MID_STEP = ("optimizer.add_param_group after {n} micro-batch(es) of this step's backward(): the step's gradients are "
            "accumulating, and a group joining now would start mid-step; add it at a boundary: in a hand loop after "
            "mp.step() returns a result, under Lightning from on_train_epoch_start (where BaseFinetuning adds its "
            "groups) or from on_train_batch_start when batch_idx % accumulate_grad_batches == 0")


@torch.no_grad()
def adopt_group(module: nn.Module, policy: Policy, masters: MasterWeights, frozen: FrozenParams,
                keep: dict[str, nn.Module], found: GroupParams) -> StoragePlan | None:
    """Adopt the params of a group torch just added (module docstring), in place: thaw ``found.thaw`` (``frozen``,
    the engine's set, and its stored dtypes follow) and store them as the policy stores trainable ones, with
    fresh fp32 ``masters`` where it has masters; every other param keeps its storage, master object and optimizer
    state. ``keep``: the fp32 regions. Returns the new storage plan (None when nothing was thawed). No host sync
    (one per thawed param checked against fp16, as at build)."""
    if not found.thaw:
        return None
    frozen.thaw(list(found.thaw))
    plan = plan_storage(module, policy, masters.params, keep, frozen.ids())
    for p in found.thaw:
        if p.is_floating_point() and p.dtype != plan.dtype_of(p):
            p.data = p.data.to(plan.dtype_of(p))   # frozen16 under -mixed: bf16 -> fp32, exact
    masters.add_masters({id(p) for p in found.thaw if id(p) in plan.half} if policy.has_masters else set())
    frozen.store(plan)
    return plan


def group_words(found: GroupParams, policy: Policy, head: str, kahan: bool) -> str:
    """The ``"param-group"`` event's words after ``head`` (which group, when; ``kahan``: compensation kept from
    build started for the params the optimizer lacked)."""
    parts = []
    if found.thaw:
        stored = "/".join(sorted({dtype_text(p.dtype) for p in found.thaw}))
        parts.append(f"{len(found.thaw)} param(s) frozen at build now trained "
                     f"({_listed([found.names[id(p)] for p in found.thaw])}), stored in {stored}"
                     + (" with fp32 masters from their stored values" if policy.has_masters else "")
                     + (", Kahan compensation from zero" if policy.rounding == "kahan" else ""))
    if found.lacked:
        how = ("through the fp32 masters made at build" if policy.has_masters else
               "with the Kahan compensation kept from build" if kahan else "as stored")
        parts.append(f"{len(found.lacked)} trainable param(s) the optimizer lacked now stepped {how} "
                     f"({_listed([found.names[id(p)] for p in found.lacked])})")
    if found.frozen:
        parts.append(f"{len(found.frozen)} frozen param(s) held without state while they require no grad "
                     f"({_listed(list(found.frozen))})")
    if found.other:
        parts.append(f"{found.other} tensor(s) not of the model stepped as they are")
    return f"{head}: " + "; ".join(parts or ["no params"]) + "; their optimizer state starts at their first step"


def _resnapshot(mp: Engine) -> None:
    """A guard's snapshot holds the optimizer's old groups and the old frozen set: take a new one (no rollback into
    the old layout), as an unfreeze or an adopted model edit does."""
    if mp.guard is not None and hasattr(mp.guard, "take_snapshot"):
        mp.guard.take_snapshot(mp)


class _AddParamGroup:
    """The attached optimizer's ``add_param_group`` (an instance attribute): its engine's :class:`GroupWatch`, held
    weakly (a dropped engine leaves torch's own ``original``); a copied or pickled one holds neither."""

    def __init__(self, watch: GroupWatch, original: Any) -> None:
        self._watch = weakref.ref(watch)
        # torch's bound add_param_group held as its function and a weak optimizer: this object is an attribute of
        # the optimizer, so the bound method would keep the optimizer in a reference cycle
        bound = getattr(original, "__self__", None) is not None
        self._original = original.__func__ if bound else original
        self._optimizer = weakref.ref(original.__self__) if bound else None

    def __getstate__(self) -> dict:
        return {"_watch": None, "_original": None, "_optimizer": None}

    def __call__(self, param_group: dict[str, Any]) -> None:
        watch = None if self._watch is None else self._watch()
        if watch is None or not watch.add(param_group):
            if self._optimizer is None:
                self._original(param_group)
            else:
                self._original(self._optimizer(), param_group)


class GroupWatch(Feature):
    """One engine's watch on its optimizer's param groups: ``optimizer.add_param_group`` routed to :meth:`add`
    (:meth:`install`, :meth:`remove`), the Kahan compensation waiting for params the optimizer lacks, and
    :meth:`rebind`."""

    def __init__(self) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._engine: Any = None   # a weak reference to the engine, set at install
        self._frozen: FrozenParams | None = None
        self._regions: Regions | None = None
        self._kahan_pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._key: tuple = ()
        self._unheld: list[torch.Tensor] = []   # masters the optimizer does not step (rebind)

    def attach(self, mp: Engine, optimizer: torch.optim.Optimizer, kahan_from: list, frozen: FrozenParams,
                regions: Regions) -> str:
        """At ``mp.attach``: route ``optimizer.add_param_group`` to :meth:`add` (``frozen``, ``regions``: the
        engine's), and start Kahan compensation from ``kahan_from`` ((param, fp32 value) pairs) for the params
        ``optimizer`` holds; the others' waits here until a group adds them. Params frozen at build that require
        grad now and that ``optimizer`` holds (a callback unfroze them before the first step: Lightning's
        ``BaseFinetuning`` at epoch 0) are adopted as :meth:`add` adopts them. Returns the decision's words on
        those ("" when none)."""
        held = {id(t) for g in optimizer.param_groups for t in g["params"]}
        contract.start_compensation(optimizer, mp.policy, [(p, v) for p, v in kahan_from if id(p) in held])
        self._kahan_pending = {id(p): (p, v) for p, v in kahan_from if id(p) not in held}
        self._engine, self._frozen, self._regions = weakref.ref(mp), frozen, regions
        self._optimizer = optimizer
        optimizer.add_param_group = _AddParamGroup(self, optimizer.add_param_group)
        thawed = tuple(p for p in frozen.members if p.requires_grad and id(p) in held)
        if not thawed:
            return ""
        names = {id(p): n for n, p in mp.module.named_parameters()}
        event = self._adopt(mp, optimizer, GroupParams(thaw=thawed, frozen=(), lacked=(), other=0, names=names),
                            "at attach, the optimizer holds params frozen at build that require grad now")
        mp.record(event)   # the caller adds the words to the decision
        return "; " + event.detail

    def remove(self) -> None:
        """Give the optimizer torch's ``add_param_group`` back (``mp.unwrap()``)."""
        opt, self._optimizer = self._optimizer, None
        if opt is not None and isinstance(opt.__dict__.get("add_param_group"), _AddParamGroup):
            del opt.__dict__["add_param_group"]

    def add(self, param_group: Any) -> bool:
        """``optimizer.add_param_group(param_group)`` on the engine's optimizer: check, torch's add, adopt, and the
        ``"param-group"`` event (also in the decision). Returns False, doing nothing, when the engine is gone
        (torch's add then runs alone). Errors as :func:`check_group`; RuntimeError mid-step (:data:`MID_STEP`);
        ValueError with a scheduler attached to the engine (:data:`SCHEDULED`)."""
        mp = None if self._engine is None else self._engine()
        if mp is None:
            return False
        if mp.micro_step:   # includes the window between unscale_and_check and apply_or_skip
            raise RuntimeError(MID_STEP.format(n=mp.micro_step))
        if mp.scheduler is not None:   # torch's schedulers size their per-group lists when built: the next step fails
            raise ValueError(SCHEDULED.format(name=type(mp.scheduler).__name__))
        found = check_group(mp.module, mp.optimizer, mp.masters, self._frozen, param_group, mp.policy, mp.strategy)
        type(mp.optimizer).add_param_group(mp.optimizer, param_group)   # torch's (its checks and defaults)
        group = mp.optimizer.param_groups[-1]
        options = ", ".join(f"{k}={group[k]}" for k in ("lr", "weight_decay") if k in group)
        event = self._adopt(mp, mp.optimizer, found, f"param group {len(mp.optimizer.param_groups) - 1} ({options}) "
                                                     f"added at boundary {mp.boundaries}")
        mp.record(event, decision=f"{mp.decision}; {event.detail}")
        _resnapshot(mp)
        return True

    def _adopt(self, mp: Engine, optimizer: torch.optim.Optimizer, found: GroupParams, head: str) -> Event:
        """Adopt ``found`` (:func:`adopt_group`) and start the Kahan compensation waiting for them; returns the
        ``"param-group"`` event for the caller to record."""
        keep = keep_fp32_modules(mp.module, mp.policy) if found.thaw else {}
        plan = adopt_group(mp.module, mp.policy, mp.masters, self._frozen, keep, found)
        if plan is not None:
            self._regions.remove()
            self._regions.wrap(mp.module, mp.policy, mp.device.type, keep, set(plan.frozen16))
            claim(mp, list(mp.module.named_parameters()), {id(p) for p in found.thaw if id(p) in plan.half})
        kahan = [self._kahan_pending.pop(id(p)) for p in found.lacked if id(p) in self._kahan_pending]
        contract.start_compensation(optimizer, mp.policy, kahan)
        detail = group_words(found, mp.policy, head, bool(kahan))
        log.info("mixprec: %s", detail)
        return Event(step=mp.boundaries, kind="param-group", cause="optimizer.add_param_group", module=None,
                     detail=detail)

    def refresh(self, mp: Engine) -> None:
        """Before a forward, a ``backward()`` or a re-prepare: at a boundary, adopt the params frozen at build that
        ``mp``'s optimizer holds and that require grad now (``requires_grad_(True)`` by hand or by a callback on
        params already in a group: Lightning's ``make_trainable`` when ``filter_on_optimizer`` finds them held),
        as :meth:`add` adopts a group's; then :meth:`rebind`, and at a boundary drop the gradients of masters the
        optimizer does not step (they would add up for nothing). Nothing to do is one pass over the frozen params and
        one over the groups' lengths; no host sync. ValueError under a strategy or several processes."""
        optimizer = mp.optimizer
        if optimizer is not None and self._frozen is not None and mp.micro_step == 0:
            thawed = [p for p in self._frozen.members if p.requires_grad]
            held = {id(t) for g in optimizer.param_groups for t in g["params"]} if thawed else set()
            thawed = tuple(p for p in thawed if id(p) in held)
            if thawed:
                names = {id(p): n for n, p in mp.module.named_parameters()}
                check_thaw("requires_grad_(True)", [names[id(p)] for p in thawed], mp.strategy)
                event = self._adopt(mp, optimizer, GroupParams(thaw=thawed, frozen=(), lacked=(), other=0,
                                                               names=names),
                                    f"at boundary {mp.boundaries}, params frozen at build that the optimizer holds "
                                    "require grad now")
                mp.record(event, decision=f"{mp.decision}; {event.detail}")
                _resnapshot(mp)
        if mp.micro_step == 0:   # masters the optimizer did not step keep no gradient across boundaries
            for m in self._unheld:
                m.grad = None
        self.rebind(optimizer, mp.masters, mp.policy)

    def rebind(self, optimizer: torch.optim.Optimizer | None, masters: MasterWeights, policy: Policy) -> int:
        """Point ``optimizer``'s groups at the fp32 master of every 16-bit param they hold directly (a group added
        mid-run, a param unfrozen in a group, ``param_groups`` assigned by a callback), moving any state it had,
        and note the masters it does not step (their gradients are dropped at each boundary: :meth:`refresh`).
        Checks only when the groups or the masters changed since the last call (their objects and lengths: one
        pass over the groups). Returns how many tensors were swapped. No host sync."""
        if optimizer is None or not masters.pairs:
            self._unheld = []
            return 0
        key = (id(masters), id(masters.pairs),
               *((id(g), id(g["params"]), len(g["params"])) for g in optimizer.param_groups))
        if key == self._key:
            return 0
        master_of = {id(p): m for p, m in masters.pairs}
        moves = []
        for group in optimizer.param_groups:
            if any(id(t) in master_of for t in group["params"]):
                moves += [(t, master_of[id(t)]) for t in group["params"] if id(t) in master_of]
                group["params"] = [master_of.get(id(t), t) for t in group["params"]]
        if any(optimizer.state.get(t) for t, _ in moves):
            contract.move_state(optimizer, moves, policy)
        held = {id(t) for g in optimizer.param_groups for t in g["params"]}
        self._unheld = [m for _, m in masters.pairs if id(m) not in held]
        self._key = (id(masters), id(masters.pairs),
                     *((id(g), id(g["params"]), len(g["params"])) for g in optimizer.param_groups))
        return len(moves)
