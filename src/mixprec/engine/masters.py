"""fp32 master copies of 16-bit parameters, owned by the engine (Apex O2 style).

The model keeps its parameters in the 16-bit ``param_dtype`` (what forward and backward
use); the optimizer sees fp32 masters instead. The user's optimizer, built on
``model.parameters()`` before any step, is rebound in place: every 16-bit parameter in its
``param_groups`` is replaced by its master. After backward, 16-bit gradients are added into
fp32 master gradients (accumulation happens in fp32); after an applied optimizer step the
masters are rounded to nearest into the 16-bit parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.optim import contract

__all__ = ["MasterWeights", "best_fp32_values", "check_claim", "claim", "release"]

_holders: dict[int, Any] = {}   # id(param) -> weakref to the engine storing it in 16 bits (none to the param)


def _stores(engine: Any, p: nn.Parameter) -> bool:
    """Whether ``engine`` (alive) still has ``p`` itself among its module's params: an id is reused once its
    param is gone. The registry keeps no reference to a param, not even a weak one: ``nn.Module._apply`` swaps
    the tensors of a DTensor (FSDP2) param and refuses one that has a weakref."""
    return engine is not None and any(q is p for q in engine.module.parameters())


def check_claim(owner: Any, named: list[tuple[str, nn.Parameter]], stored16: set[int]) -> None:
    """:func:`claim`'s ValueError, recording nothing: a build calls it before any cast with every param that
    its policy may store in 16 bits."""
    for key in [k for k, o_ref in _holders.items() if o_ref() is None]:
        del _holders[key]   # dropped engines hold nothing
    shared = []
    for n, p in named:
        held = _holders.get(id(p))
        other = None if held is None else held()
        if id(p) in stored16 and other is not None and other is not owner and _stores(other, p):
            shared.append(n)
    if shared:
        raise ValueError(f"parameter(s) {shared[:4]} are already stored in 16 bits by another MixedPrecision "
                         "engine: two engines sharing a parameter would each keep their own fp32 master (or Kahan "
                         "compensation) and overwrite each other's writes. Build one engine over one optimizer "
                         "holding both models' params (param groups for different settings), use a '-mixed' "
                         "policy (fp32 params, nothing to keep apart), or call other_mp.unwrap() first")


def claim(owner: Any, named: list[tuple[str, nn.Parameter]], stored16: set[int]) -> None:
    """Record that ``owner`` (an engine, with the params in ``owner.module``) stores the params ``stored16``
    (ids) of ``named`` in 16 bits.

    Raises:
        ValueError: one is already stored in 16 bits by another live engine (two engines sharing a
            parameter would each keep their own fp32 master and overwrite each other's writes).
    """
    check_claim(owner, named, stored16)
    ref = weakref.ref(owner)
    for _, p in named:
        if id(p) in stored16:
            _holders[id(p)] = ref


def release(owner: Any) -> None:
    """Forget what ``owner`` claimed (:meth:`mixprec.MixedPrecision.unwrap`), and entries of dropped engines."""
    for key, o_ref in list(_holders.items()):
        if o_ref() in (None, owner):
            del _holders[key]


class MasterWeights:
    """fp32 masters for the 16-bit parameters of ``model`` (shapes as the params, dtype fp32).

    Args:
        params: the model's parameters in ``model.parameters()`` order, still in fp32 (the
            masters are exact copies made before the model is cast).
        half_params: which of ``params`` will be stored in 16 bits (others are their own masters).

    No host syncs.
    """

    def __init__(self, params: list[nn.Parameter], half_params: set[int]) -> None:
        self.params = params
        self.masters: list[torch.Tensor] = []
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (param_16, master_fp32)
        for p in params:
            if id(p) in half_params:
                master = nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
                self.pairs.append((p, master))
                self.masters.append(master)
            else:
                self.masters.append(p)

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` at the masters instead of the 16-bit params.

        State an optimizer creates in its constructor (``torch.optim.Adagrad``'s ``sum``, at step 0) moves
        to the masters, cast to fp32: it was built from the fp32 params, which the masters copy exactly.

        Raises:
            RuntimeError: the optimizer already stepped (a state with a nonzero ``step``) before the
                engine was built.
        """
        stepped = [s for s in optimizer.state.values()
                   if not (isinstance(s, dict) and torch.is_tensor(s.get("step", 0)) and float(s.get("step", 0)) == 0)]
        if stepped:
            raise RuntimeError("the optimizer already has state: build MixedPrecision(model, optimizer, ...) "
                               "before the first optimizer.step(), so masters can replace the params")
        swap = {id(p): m for p, m in self.pairs}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        for p, m in self.pairs:
            if p in optimizer.state:
                optimizer.state[m] = {k: v.to(torch.float32) if torch.is_tensor(v) and v.is_floating_point()
                                      and v.shape == m.shape else v for k, v in optimizer.state.pop(p).items()}

    def unbind(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` back at the params, each master's state (fp32) moved to its param: the reverse of
        :meth:`rebind`, when the engine lets the model go (``unwrap``), so the optimizer steps the model again."""
        swap = {id(m): p for p, m in self.pairs}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(t), t) for t in group["params"]]
        for p, m in self.pairs:
            if m in optimizer.state:
                optimizer.state[p] = optimizer.state.pop(m)

    def accumulate_grads(self) -> None:
        """Add each 16-bit gradient into its master's fp32 gradient and free the 16-bit one.

        Each 16-bit gradient is converted to fp32 *before* anything is summed, so accumulation is in
        fp32. A sparse COO gradient (``nn.Embedding(sparse=True)``) stays sparse: its master gets a
        sparse fp32 gradient (uncoalesced, its values the fp32 upcasts of the 16-bit ones, duplicate
        indices summed in fp32 by whoever coalesces it), exactly what autograd gives an fp32 table, so
        the optimizers that take sparse gradients (``torch.optim.SGD``, ``Adagrad``, ``SparseAdam``)
        step it, and memory stays proportional to the rows looked up. A dense and a sparse gradient
        for one master (a table also used densely) add up to a dense one. No host sync."""
        into, added = [], []   # dense master grads and the dense 16-bit grads added into them (one foreach add)
        fresh, upcast = [], []   # masters without a gradient and the dense 16-bit ones they take (one foreach copy)
        for p, m in self.pairs:
            grad = p.grad
            if grad is None:
                continue
            p.grad = None
            if m.grad is None and not grad.is_sparse:
                fresh.append(m)
                upcast.append(grad)
            elif m.grad is None:
                m.grad = grad.to(torch.float32)
            elif m.grad.is_sparse:
                grad_fp32 = grad.to(torch.float32)
                m.grad = grad_fp32.add_(m.grad) if not grad_fp32.is_sparse else m.grad + grad_fp32
            elif grad.is_sparse:
                m.grad.add_(grad.to(torch.float32))
            else:
                into.append(m.grad)
                added.append(grad)
        if into:   # fp32 += 16-bit: each 16-bit value is upcast exactly, then added in fp32 (as add_ of its fp32 copy)
            torch._foreach_add_(into, added)
        if fresh:  # exact upcasts, one fused copy instead of a cast per parameter
            grads_fp32 = [torch.empty_like(g, dtype=torch.float32) for g in upcast]
            torch._foreach_copy_(grads_fp32, upcast)
            for m, g in zip(fresh, grads_fp32):
                m.grad = g

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Round each master to nearest into its 16-bit parameter."""
        if self.pairs:
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])
        self.record_versions()

    def record_versions(self) -> None:
        """Remember each pair's tensor version counters (bumped by every in-place write), after the
        engine itself wrote params or masters, so :meth:`adopt_edited_params` can tell a user's edit."""
        self._versions = [(p._version, m._version) for p, m in self.pairs]
        self._param_versions = [v for v, _ in self._versions]

    @torch.no_grad()
    def adopt_edited_params(self) -> list[int]:
        """Masters take the value of params written in place outside the engine since the last
        :meth:`record_versions` (e.g. ``model.load_state_dict(...)`` or ``p.copy_(...)`` under
        ``no_grad`` after the engine was built), whose masters were not written: without this the
        next step would copy the stale masters back over the edit. Only the elements whose 16-bit
        value changed are adopted (a reload of the same values keeps the fp32 masters). Returns the
        indices of the pairs adopted (into :attr:`pairs`). Writes made through ``p.data`` bypass version counters and are not seen.
        """
        versions = getattr(self, "_versions", None)
        if versions is None or len(versions) != len(self.pairs):
            return []
        if [p._version for p, _ in self.pairs] == self._param_versions:
            return []   # no param written since (the common case: one pass, no per-pair comparison)
        edited = [i for i, ((p, m), (v_p, v_m)) in enumerate(zip(self.pairs, versions))
                  if p._version != v_p and m._version == v_m]
        adopted = []
        for i in edited:
            p, m = self.pairs[i]
            changed = p.ne(m.to(p.dtype))           # elements the edit changed (a reload of the same values
            if bool(changed.any()):                 # changes none); one host sync per edited tensor
                m.copy_(torch.where(changed, p.to(m.dtype), m))
                adopted.append(i)
        if edited:
            self.record_versions()
        return adopted

    @torch.no_grad()
    def fp32_values(self, compensation: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: None
                    ) -> list[torch.Tensor]:
        """Each param's best fp32 value, as a new fp32 tensor, in :attr:`params` order: its master where
        one exists (full precision), else the param plus ``compensation(param)`` (Kahan rounding's
        carried remainder, or None), else the param upcast (exact). Non-floating params are cloned.
        No host sync."""
        values = []
        for p, t in zip(self.params, self.masters):
            if not p.is_floating_point():
                values.append(p.detach().clone())
                continue
            value_fp32 = t.detach().to(torch.float32, copy=True)
            comp = compensation(p) if t is p else None
            if comp is not None:
                value_fp32 += comp.float()
            values.append(value_fp32)
        return values

    def adopt_edits(self, names: Callable[[], dict[int, str]]) -> str:
        """:meth:`adopt_edited_params`; returns what was adopted in words ("" when nothing was), naming
        the params (``names()``: id → name, called only when something was adopted). Host syncs: one per
        edited tensor."""
        adopted = self.adopt_edited_params()
        if not adopted:
            return ""
        name_of = names()
        listed = [name_of.get(id(self.pairs[i][0]), "?") for i in adopted]
        dtype = str(self.pairs[0][0].dtype).replace("torch.", "")
        return (f"{len(listed)} parameter(s) ({', '.join(listed[:5])}{', ...' if len(listed) > 5 else ''}) were "
                f"written outside the engine (e.g. model.load_state_dict after MixedPrecision was built); their "
                f"fp32 masters now take those values, as stored in {dtype}")

    def write_fp32(self, values_fp32: list[torch.Tensor]) -> None:
        """Make every floating param fp32 in place with its value in ``values_fp32`` (:meth:`fp32_values`
        order), where it is 16-bit or has a master (the engine's ``unwrap(to_fp32=True)``). No host sync."""
        has_master = {id(p) for p, _ in self.pairs}
        for p, value_fp32 in zip(self.params, values_fp32):
            if p.is_floating_point() and (p.dtype != torch.float32 or id(p) in has_master):
                p.data = value_fp32

    def named(self, named_parameters: Any) -> dict[str, torch.Tensor]:
        """The masters by their param's name (``model.named_parameters()``), detached references."""
        names = {id(p): n for n, p in named_parameters}
        return {names[id(p)]: m.detach() for p, m in self.pairs}

    def by_name(self, saved: Any, named: dict[str, nn.Parameter]) -> list[torch.Tensor]:
        """``saved`` masters (a :meth:`named` dict, or a list in :attr:`pairs` order) as a list in
        :attr:`pairs` order. Raises ValueError unless they are exactly the masters this policy needs."""
        names = {id(p): n for n, p in named.items()}
        needed = [names[id(p)] for p, _ in self.pairs]
        if isinstance(saved, dict) and set(saved) == set(needed):
            return [saved[n] for n in needed]
        if not isinstance(saved, dict) and len(saved) == len(needed):
            return list(saved)
        have = sorted(saved)[:5] if isinstance(saved, dict) else f"{len(saved)} tensors"
        raise ValueError(f"the state holds masters {have}, this policy needs {sorted(needed)[:5]}")

    @torch.no_grad()
    def load_weights(self, model: nn.Module, model_state: dict[str, torch.Tensor],
                     masters_fp32: dict[str, torch.Tensor]) -> None:
        """Load ``model_state`` into ``model`` (cast to each tensor's dtype), then give every param its
        best saved value: a saved fp32 master (by param name) beats the rounded 16-bit copy; a param with
        a master here gets the master, rounded. No host sync."""
        names = {id(p): n for n, p in model.named_parameters()}
        model.load_state_dict(model_state)
        master_of = {id(p): master for p, master in self.pairs}
        for p in self.params:
            value_fp32 = masters_fp32.get(names.get(id(p)))
            master = master_of.get(id(p))
            if master is not None:
                master.copy_(value_fp32 if value_fp32 is not None else p)
                p.copy_(master)   # the param is the master rounded, as after a step
            elif value_fp32 is not None:
                p.copy_(value_fp32)
        self.record_versions()

    def add_masters(self, new_half: set[int]) -> None:
        """Give the params whose ids are in ``new_half`` fresh fp32 masters (copies of their stored values: a param
        the optimizer takes mid-run, :mod:`mixprec.engine.param_groups`), in place. Every existing pair keeps its
        master object (the optimizer holding it stays valid) and its recorded versions (an edit made since is
        still adopted); pairs stay in :attr:`params` order. No host sync."""
        master_of = {id(p): m for p, m in self.pairs}
        versions = dict(zip(master_of, getattr(self, "_versions", [])))
        for p in self.params:
            if id(p) in new_half and id(p) not in master_of:
                master_of[id(p)] = nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
        self.masters = [master_of.get(id(p), p) for p in self.params]
        self.pairs = [(p, master_of[id(p)]) for p in self.params if id(p) in master_of]
        self._versions = [versions.get(id(p), (p._version, m._version)) for p, m in self.pairs]
        self._param_versions = [v for v, _ in self._versions]

    def with_params(self, params: list[nn.Parameter], keep: set[int]) -> MasterWeights:
        """Masters for a new parameter list (a model edited after build): the pairs whose param id is in
        ``keep`` keep their fp32 master (the same object, so an optimizer holding it stays valid); every
        other param is its own master until the engine re-prepares. No host sync."""
        out = MasterWeights([], set())
        master_of = {id(p): m for p, m in self.pairs if id(p) in keep}
        out.params = list(params)
        out.masters = [master_of.get(id(p), p) for p in params]
        out.pairs = [(p, master_of[id(p)]) for p in params if id(p) in master_of]
        out.record_versions()
        return out


def best_fp32_values(masters: MasterWeights, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Each param's best fp32 value (:meth:`MasterWeights.fp32_values`): its master, else the param plus what
    ``optimizer``'s Kahan rounding owes it (:func:`mixprec.optim.contract.compensation`; nothing without an
    optimizer or outside a Kahan policy). New tensors; no host sync."""
    return masters.fp32_values(lambda p: contract.compensation(optimizer, p))
