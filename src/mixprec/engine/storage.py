"""Where each parameter lives: the storage plan of a policy, and the frozen set.

Trainable parameters follow the policy (16-bit ``param_dtype`` under pure policies, fp32 otherwise).
*Frozen* parameters (``requires_grad=False`` when the engine is built: a pretrained base, a LoRA base)
get no master, gradient or optimizer state and are stored in the policy's *compute* dtype, rounded to
nearest once, where that changes only their rounding:

* never for params of fp32 regions (``keep_fp32``, BatchNorm under 16-bit params), nor under FSDP2
  (sharded fp32, cast by FSDP; a 16-bit policy without masters has its trainable params cast before sharding:
  :mod:`mixprec.distributed.sharded_storage`);
* under ``-mixed`` policies only where autocast casts the op's operands anyway: Linear / Conv weights
  (and transformers' ``Conv1D``) and Embedding tables (whose lookups are returned in fp32, see
  :mod:`mixprec.engine.regions`); a norm gain meeting fp32 activations stays fp32;
* under fp16, only values that fit: nothing finite overflows and at most 1 % of the nonzeros flush to
  zero (else fp32 under ``-mixed``, recorded in the engine's decision; refused under ``-pure``).

Parameters that are not plain dense real tensors, under every policy (each recorded in the decision):

* **complex** params (complex64/complex128) are kept as they are, with no master: complex64 is two
  fp32 numbers, already full precision, and autocast leaves complex ops alone. Their gradients are
  unscaled, checked, measured and clipped through their real view (:mod:`mixprec.engine.gradients`).
* **parametrized** tensors (``torch.nn.utils.parametrize``: ``spectral_norm``, ``orthogonal``,
  ``weight_norm``...): the originals (``parametrizations.<name>.original*``) and any parameter of the
  parametrization itself stay fp32, their own fp32 masters (no 16-bit copy: the parametrization would
  only upcast it), and the parametrization's buffers (spectral_norm's ``_u``/``_v``, orthogonal's
  ``base``) stay fp32 as every buffer does. So the parametrization computes the weight from fp32
  values — power iteration, normalisation or matrix exponential in fp32, where 16-bit rounding makes
  ``spectral_norm`` fail on mixed dtypes and ``orthogonal`` lose orthogonality and diverge — and the
  layer's matmul/conv casts that fp32 weight to the compute dtype under autocast, as it does every
  weight under ``-mixed``. Ops *inside* the parametrization follow autocast like any op (on CPU its
  matmuls, e.g. ``orthogonal``'s ``base @ Q``, run in the compute dtype). A layer whose op autocast
  does not cast (a hand-written ``x * self.weight``) then sees an fp32 weight and promotes to fp32.
  Memory: 4 bytes per original element instead of 2 + 4 with a master.
* **sparse gradients** (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): the table is
  stored as any param; its fp32 master (``-pure``) gets sparse fp32 gradients
  (:meth:`mixprec.engine.masters.MasterWeights.accumulate_grads`), and the optimizer must take sparse
  gradients (``torch.optim.SGD``, ``Adagrad``, ``SparseAdam``, or :mod:`mixprec.optim`, which densifies).
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mixprec.policy.policy import Policy

__all__ = ["StoragePlan", "FrozenParams", "plan_storage", "fits", "dtype_text", "held_by", "check_new_group", "check_held",
           "parametrized_ids", "sparse_grad_ids"]

log = logging.getLogger("mixprec")

_AUTOCAST_MODULES = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)   # not EmbeddingBag: it reduces in its dtype


def dtype_text(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).replace("torch.", "")


def _autocast_casts(module: nn.Module) -> bool:
    """Autocast casts this module's weights to the compute dtype anyway (GPT-2's ``Conv1D`` is an addmm)."""
    return isinstance(module, _AUTOCAST_MODULES) or type(module).__name__ == "Conv1D"


@torch.no_grad()
def fits(p: torch.Tensor, dtype: torch.dtype) -> bool:
    """``p`` survives rounding to ``dtype``: nothing finite overflows, and at most 1 % of its nonzero
    values flush to zero. Only fp16 can fail. One host sync per call (fp16 only)."""
    if dtype != torch.float16 or p.dtype == dtype:
        return True
    rounded = p.detach().to(dtype)
    nonzero = p.ne(0)
    overflow, flushed, n_nonzero = torch.stack([(torch.isinf(rounded) & torch.isfinite(p)).sum(),
                                                (rounded.eq(0) & nonzero).sum(), nonzero.sum()]).tolist()
    return overflow == 0 and flushed <= 0.01 * max(1, n_nonzero)


@dataclass(frozen=True)
class StoragePlan:
    """Parameter ids stored in the 16-bit ``param_dtype`` (``half``: trainable) and in the compute
    dtype (``frozen16``: frozen; ``frozen16_names`` their names); every other floating param is fp32.
    ``unfit``: names of frozen params kept in fp32 because their values do not fit fp16."""

    policy: Policy
    half: frozenset[int]
    frozen16: frozenset[int]
    unfit: tuple[str, ...] = ()
    special: tuple[str, ...] = ()   # the decision's notes on complex, parametrized and sparse-gradient params
    frozen16_names: tuple[str, ...] = ()   # the frozen16 params' qualified names, for the decision

    def note(self) -> str:
        """The decision's notes: frozen params stored in 16 bits, frozen params kept in fp32 (logs a warning
        then) and params that are not plain dense tensors (complex, parametrized, sparse gradients); "" when
        there are none."""
        notes = "".join(f"; {n}" for n in self.special)
        if self.frozen16:
            compute = dtype_text(self.policy.compute_dtype)
            notes = (f"; {len(self.frozen16)} frozen param(s) stored in {compute}, their fp32 low bits dropped ("
                     f"{_listed(list(self.frozen16_names))}): the forward computes them in {compute} anyway, so it is unchanged and "
                     f"their bytes halve, but an export or a later unfreeze starts from the rounded values; "
                     f"keep_fp32=<module> keeps a module's in fp32" + notes)
        if not self.unfit:
            return notes
        log.warning("mixprec: frozen parameter(s) %s kept in fp32: their values do not fit %s",
                    ", ".join(self.unfit[:5]), self.policy.compute_dtype)
        return (f"; {len(self.unfit)} frozen param(s) kept in fp32, their values do not fit "
                f"{dtype_text(self.policy.compute_dtype)} ({_listed(list(self.unfit))})" + notes)

    def dtype_of(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` is stored in under this plan (its own dtype when not floating)."""
        if not p.is_floating_point():
            return p.dtype
        return (self.policy.param_dtype if id(p) in self.half else
                self.policy.compute_dtype if id(p) in self.frozen16 else torch.float32)

    @torch.no_grad()
    def apply(self, params: list[nn.Parameter]) -> None:
        """Cast ``params`` in place (the same Parameter objects: optimizers stay valid)."""
        for p in params:
            if p.is_floating_point() and p.dtype != self.dtype_of(p):
                p.data = p.data.to(self.dtype_of(p))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def parametrized_ids(model: nn.Module) -> set[int]:
    """Ids of the params under ``model``'s parametrizations (``<module>.parametrizations.*``: the
    ``original*`` tensors and any parameter of a parametrization module), and the ``<name>_orig`` of the
    hook-based ``torch.nn.utils.spectral_norm`` (its power iteration mixes it with fp32 buffers), which
    every policy keeps fp32."""
    from torch.nn.utils.spectral_norm import SpectralNorm   # the older hook API: ``<name>_orig`` + fp32 ``_u``/``_v``

    ids = {id(q) for m in model.modules() if parametrize.is_parametrized(m) for q in m.parametrizations.parameters()}
    for m in model.modules():
        for hook in m._forward_pre_hooks.values():
            if isinstance(hook, SpectralNorm) and isinstance(getattr(m, hook.name + "_orig", None), nn.Parameter):
                ids.add(id(getattr(m, hook.name + "_orig")))
    return ids


def sparse_grad_ids(model: nn.Module) -> set[int]:
    """Ids of the weights that get sparse COO gradients (``Embedding`` / ``EmbeddingBag`` with ``sparse=True``)."""
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and isinstance(m.weight, nn.Parameter)}


def _special_notes(model: nn.Module, policy: Policy, parametrized: set[int]) -> tuple[str, ...]:
    """What the decision says about params that are not plain dense real tensors (module docstring)."""
    named = list(model.named_parameters())
    complex_ = [n for n, p in named if p.is_complex()]
    kept = [n for n, p in named if id(p) in parametrized]
    sparse_ids = sparse_grad_ids(model)
    sparse = [n for n, p in named if id(p) in sparse_ids and p.requires_grad]
    notes = []
    if complex_:
        notes.append(f"complex param(s) {_listed(complex_)} kept as they are (complex64 is full precision: no "
                     "master, autocast leaves complex ops alone)")
    if kept:
        notes.append(f"parametrization param(s) {_listed(kept)} kept fp32 (their own masters): the "
                     "parametrization computes the weight from fp32 values and fp32 buffers"
                     + (", the layer casts it under autocast" if policy.is_mixed else ""))
    if sparse:
        grads = "their fp32 masters get sparse fp32 gradients" if policy.has_masters else "gradients stay sparse"
        notes.append(f"sparse gradients for {_listed(sparse)} ({grads}; unscaled, checked and clipped through "
                     "their values; the optimizer must take sparse gradients)")
    return tuple(notes)


def plan_storage(model: nn.Module, policy: Policy, params: list[nn.Parameter], keep: dict[str, nn.Module],
                 frozen_now: set[int], *, sharded: bool = False) -> StoragePlan:
    """The :class:`StoragePlan` of ``policy`` for ``model`` (rules in the module docstring).

    ``frozen_now``: ids of the frozen params; ``keep``: the fp32 regions; ``sharded``: FSDP2 (fp32, or the 16-bit params cast before sharding).
    Host syncs: one per frozen param checked against fp16.

    Raises:
        ValueError: under a *pure* fp16 policy, a frozen param whose values do not fit fp16 (named,
            with the fix: a bf16 policy or keep_fp32 for its module).
    """
    parametrized = parametrized_ids(model)
    special = _special_notes(model, policy, parametrized)
    if sharded:   # FSDP2 cast before sharding: 16-bit storage without masters (distributed/sharded_storage)
        half = {id(p) for p in params if p.is_floating_point() and p.requires_grad and p.dtype == policy.param_dtype
                and policy.param_dtype != torch.float32 and not policy.has_masters}
        if half:
            special = special + (
                f"FSDP2: {len(half)} param(s) stored sharded in {dtype_text(policy.param_dtype)} (cast before "
                f"fully_shard), gradients reduce-scattered in fp32 and rounded into {dtype_text(policy.param_dtype)}; "
                f"the optimizer steps each rank's shard ({policy.rounding} rounding"
                + (", keyed by the element's global index: the same bits at any world size" if "stochastic" in
                   (policy.rounding, policy.state_rounding) else "") + ")",)
        return StoragePlan(policy, frozenset(half), frozenset(), special=special)
    keep_params = {id(p) for m in keep.values() for p in m.parameters()} | parametrized
    free = [p for p in params if id(p) not in keep_params and p.is_floating_point()]
    half = {id(p) for p in free if id(p) not in frozen_now and policy.param_dtype != torch.float32}
    candidates = [p for p in free if id(p) in frozen_now and policy.compute_dtype != torch.float32]
    if policy.param_dtype == torch.float32:   # mixed: only where autocast casts the op's operands
        owners: dict[int, list[nn.Module]] = defaultdict(list)
        for m in model.modules():
            for q in m.parameters(recurse=False):
                owners[id(q)].append(m)
        candidates = [p for p in candidates if owners[id(p)] and all(_autocast_casts(m) for m in owners[id(p)])]
    frozen16 = {id(p) for p in candidates if fits(p, policy.compute_dtype)}
    names = {id(q): n for n, q in model.named_parameters()}
    unfit = tuple(names.get(id(p), "?") for p in candidates if id(p) not in frozen16)
    if unfit and policy.param_dtype != torch.float32:
        raise ValueError(f"policy {policy} stores every param in {dtype_text(policy.param_dtype)}, but frozen "
                         f"parameter(s) {list(unfit[:3])} hold values that do not fit it (beyond its range, or "
                         "mostly flushed to zero); use a bf16 policy, or keep their modules in fp32 (policy "
                         "keep_fp32=<module>)")
    return StoragePlan(policy, frozenset(half), frozenset(frozen16), unfit, special,
                       tuple(names.get(id(p), "?") for p in candidates if id(p) in frozen16))


class FrozenParams:
    """The parameters frozen when the engine was built (``requires_grad=False``), less those unfrozen
    since through the engine, and which of them are stored in 16 bits (no fp32 master)."""

    def __init__(self, model: nn.Module, *, watch_casts: bool = True) -> None:
        self.model, self.watch_casts = model, watch_casts   # False under FSDP2: it replaces the params itself
        self.members = [p for p in model.parameters() if p.is_floating_point() and not p.requires_grad]
        self.stored16: list[nn.Parameter] = []
        self.stored: list[nn.Parameter] = []
        self.stored_dtypes: list[torch.dtype] = []

    def ids(self) -> set[int]:
        """Ids of the members still frozen (a member made trainable by hand is not)."""
        return {id(p) for p in self.members if not p.requires_grad}

    def names(self) -> list[str]:
        """Names of the frozen parameters, in model order."""
        frozen = self.ids()
        return [n for n, p in self.model.named_parameters() if id(p) in frozen]

    def store(self, plan: StoragePlan) -> None:
        """Record which members ``plan`` stores in 16 bits, and the dtype every floating param of the model
        is stored in now that ``plan`` is applied (for :meth:`recast`; none when not ``watch_casts``)."""
        self.stored16 = [p for p in self.model.parameters() if id(p) in plan.frozen16]
        self.stored = [p for p in self.model.parameters() if p.is_floating_point() and self.watch_casts]
        self.stored_dtypes = [p.dtype for p in self.stored]

    def recast(self) -> list[tuple[nn.Parameter, torch.dtype]]:
        """The params (trainable and frozen) whose dtype is no longer the one :meth:`store` recorded, each with
        that dtype: the model was cast since (``model.half()``, ``model.to(torch.bfloat16)``, ``model.float()``).
        One Python pass over the dtypes, no host sync."""
        if [p.dtype for p in self.stored] == self.stored_dtypes:
            return []
        return [(p, d) for p, d in zip(self.stored, self.stored_dtypes) if p.dtype != d]

    def follow(self, added: list[nn.Parameter]) -> None:
        """After a model edit: drop the members no longer in the model, and take ``added`` params that
        are frozen as members."""
        now = {id(p) for p in self.model.parameters()}
        self.members = [p for p in self.members if id(p) in now] + [
            p for p in added if p.is_floating_point() and not p.requires_grad and all(p is not q for q in self.members)]

    def check_not_thawed(self) -> None:
        """Raise RuntimeError if a param stored frozen (16-bit, no master) was unfrozen by hand."""
        thawed = [p for p in self.stored16 if p.requires_grad]
        if thawed:
            names = {id(p): n for n, p in self.model.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in thawed[:5])
            raise RuntimeError(
                f"parameter(s) {listed}{' and more' if len(thawed) > 5 else ''} had requires_grad=False when "
                f"MixedPrecision was built, so they are stored in {dtype_text(thawed[0].dtype)} with no fp32 "
                "master, gradient or optimizer state, but they now require grad; training them as they are would "
                "step a 16-bit tensor. Fix: at a boundary, before the step's forward, add them to the optimizer "
                "(optimizer.add_param_group({'params': [...]}): the engine stores them as trainable ones; already "
                "in a group, they are adopted before the model's next forward), or mp.unfreeze('<name pattern>') "
                "(sets requires_grad, builds the fp32 masters from the stored values and adds them to the "
                "optimizer), or set requires_grad before building MixedPrecision")

    def check_values(self, values: dict[str, torch.Tensor]) -> None:
        """Raise ValueError if a value for a frozen param stored in fp16 does not fit fp16. One sync per
        checked tensor; nothing to check unless something is stored in fp16."""
        stored = {id(p) for p in self.stored16 if p.dtype == torch.float16}
        if not stored:
            return
        names = {n for n, p in self.model.named_parameters() if id(p) in stored}
        unfit = [n for n, v in values.items() if n in names and not fits(v.float(), torch.float16)]
        if unfit:
            raise ValueError(f"values for frozen parameter(s) {unfit[:3]} do not fit fp16, where this engine stores "
                             "them (chosen from the values it was built with); load these weights into the model "
                             "before building MixedPrecision (they then stay fp32), or use a bf16 policy")

    def select(self, patterns: tuple[str, ...]) -> list[tuple[str, nn.Parameter]]:
        """The frozen ``(name, param)`` pairs matching any ``fnmatch`` pattern.

        Raises:
            ValueError: a pattern matches no frozen parameter (the frozen names are listed).
        """
        frozen = self.ids()
        named = [(n, p) for n, p in self.model.named_parameters() if id(p) in frozen]
        unmatched = [pat for pat in patterns if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named)]
        if unmatched:
            raise ValueError(f"unfreeze: patterns {unmatched} match no frozen parameter; frozen parameters look "
                             f"like {[n for n, _ in named][:8]}")
        return [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]

    def thaw(self, params: list[nn.Parameter]) -> None:
        """Make ``params`` trainable members no more (``requires_grad=True``)."""
        ids = {id(p) for p in params}
        for p in params:
            p.requires_grad_(True)
        self.members = [p for p in self.members if id(p) not in ids]

    def refreeze(self, params: list[nn.Parameter]) -> None:
        """Undo :meth:`thaw` of ``params``."""
        for p in params:
            p.requires_grad_(False)
            if all(p is not q for q in self.members):
                self.members.append(p)

    def to_unfreeze(self, saved: list[str]) -> list[str]:
        """The names a run that saved the frozen set ``saved`` had unfrozen, which are frozen here.

        Raises:
            ValueError: ``saved`` names an unknown param, or keeps frozen one this engine trains.
        """
        current = self.names()
        known = {n for n, _ in self.model.named_parameters()}
        unknown = [n for n in saved if n not in known]
        to_freeze = [n for n in saved if n not in current and n in known]
        if unknown or to_freeze:
            what = (f"unknown parameter(s) {unknown[:3]}" if unknown else
                    f"{to_freeze[:3]} frozen, which this engine trains; call requires_grad_(False) on them before "
                    "building MixedPrecision")
            raise ValueError(f"the saved run kept {what}")
        return [n for n in current if n not in set(saved)]


def held_by(optimizer: torch.optim.Optimizer, masters: Any, params: list[nn.Parameter]) -> dict[int, bool]:
    """Per param id: does ``optimizer`` hold it (or its fp32 master, ``masters``: MasterWeights)?"""
    stepped_of = {id(p): t for p, t in zip(masters.params, masters.masters)}
    held_ids = {id(t) for g in optimizer.param_groups for t in g["params"]}
    return {id(p): id(stepped_of.get(id(p), p)) in held_ids for p in params}


def check_new_group(chosen: list[tuple[str, nn.Parameter]], held: dict[int, bool], group_options: dict,
                    scheduler: Any) -> list[nn.Parameter]:
    """The params of ``chosen`` (to unfreeze) that need a new param group; ValueError when options are
    given for params the optimizer holds, or a new group would be added under a scheduler."""
    held_names = [n for n, p in chosen if held[id(p)]]
    if held_names and group_options:
        raise ValueError(f"unfreeze(..., {', '.join(f'{k}={v!r}' for k, v in group_options.items())}): the "
                         f"optimizer already holds {held_names[:3]}, so they train with their group's settings; "
                         "drop the options, or build the optimizer on the trainable params only so unfreeze adds "
                         "them as a new group with these options")
    new_params = [p for _, p in chosen if not held[id(p)]]
    if new_params and scheduler is not None:
        raise ValueError(f"unfreeze: the optimizer does not hold {[n for n, p in chosen if not held[id(p)]][:3]}, "
                         f"and adding a param group under the attached scheduler {type(scheduler).__name__} "
                         "breaks it (its per-group state was sized when it was built). Build the optimizer on "
                         "model.parameters() (frozen params included: they get no state while frozen) before "
                         "MixedPrecision")
    return new_params


def check_held(names: list[str], held: dict[int, bool], named: dict[str, nn.Parameter]) -> None:
    """Raise ValueError if a run unfroze ``names`` into a param group this optimizer lacks."""
    missing = [n for n in names if not held[id(named[n])]]
    if missing:
        raise ValueError(f"the saved run unfroze {missing[:3]} into a param group this optimizer lacks; call "
                         f"mp.unfreeze(...) with the run's group options (e.g. lr=) before loading, as the run did, "
                         "or build the optimizer on model.parameters() (frozen params included)")
