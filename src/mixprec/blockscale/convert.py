"""Swap a model's eligible ``nn.Linear`` modules for :class:`~mixprec.blockscale.linear.BlockScaledLinear`, in place.

A linear is converted when it is a plain ``nn.Linear`` (subclasses are used through their weights, not their
forward), not the root, not kept by the recipe, accepted by the filter, and of dimensions the recipe can scale
(:func:`~mixprec.blockscale.linear.shape_problems`). The recipe keeps, in the compute dtype:

* the network's first and last ``nn.Linear`` in registration order (``keep_first_last``): the first sees raw
  inputs, the last produces the logits;
* every linear matched by a ``keep`` pattern (a policy's ``block_keep``): ``fnmatch`` glob patterns on the
  linear's qualified name or the name of a module holding it (``"blocks.*.attn.proj"``, ``"blocks.3"``), e.g. the
  linears :mod:`mixprec.numerics` advises to keep; a pattern that matches nothing is a ValueError, never ignored;
* every linear inside the last ``ceil(n * bf16_tail_fraction)`` of the model's ``n`` blocks (torchtitan's NVFP4
  recipe keeps the last 15 % of transformer blocks). The blocks are the entries of the ``nn.ModuleList`` (or
  ``nn.Sequential``) named by ``blocks=``, by default the ``nn.ModuleList`` whose entries hold the most
  ``nn.Linear`` (a transformer's ``layers`` / ``h`` / ``blocks``); a model without one counts each linear as its
  own block, in registration order.

Everything kept is named in the :class:`BlockConversionReport` with every reason that applies. Converted
linears reuse the original ``weight``/``bias`` Parameter objects, so an optimizer built before conversion keeps
working; they are numbered ``index = 0, 1, ...`` in registration order (their stochastic rounding streams are
seeded ``recipe.seed + index``). A swapped module's hooks are carried over to its replacement
(:func:`mixprec.blockscale.swap.replace_modules`). A linear that already runs its own GEMMs (a
:class:`BlockScaledLinear` or a :class:`mixprec.fp8.Float8Linear`, told by their ``linear_kind``) is left as built
and named in the report's ``as_built``, never among the kept. :func:`revert_block_scaled` swaps block-scaled
linears back to plain ``nn.Linear`` (the same Parameter objects again).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mixprec.blockscale.linear import BlockScaledLinear, shape_problems
from mixprec.blockscale.recipe import BlockRecipe, get_block_recipe
from mixprec.blockscale.swap import replace_modules

__all__ = ["BlockConversionReport", "block_state_keys", "check_keep_patterns", "convert_to_block_scaled", "find_blocks",
           "plan_block_conversion", "revert_block_scaled"]

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class BlockConversionReport:
    """What :func:`convert_to_block_scaled` did.

    Attributes:
        recipe: the recipe every converted linear uses.
        converted: qualified names of the linears now :class:`BlockScaledLinear`, in index order.
        kept: ``(qualified name, reasons)`` of every ``nn.Linear`` left as it was.
        blocks: the qualified name of the container whose entries are the blocks (None when each linear
            counted as its own block).
        tail: the blocks (or linears) kept by ``bf16_tail_fraction``.
        as_built: ``(qualified name, what)`` of every linear that already ran its own GEMMs (block-scaled or fp8)
            and was left as it was built, e.g. ``("2", "already block-scaled (recipe nvfp4), left as built")``.
    """

    recipe: BlockRecipe
    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]
    blocks: str | None
    tail: tuple[str, ...]
    as_built: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        built = f", {len(self.as_built)} left as built" if self.as_built else ""
        lines = [f"block-scaled conversion ({self.recipe}): {len(self.converted)} converted, {len(self.kept)} kept"
                 + built]
        lines += [f"  {self.recipe.format:<11} {name}" for name in self.converted]
        lines += [f"  kept        {name}: {reason}" for name, reason in self.kept]
        lines += [f"  as built    {name}: {what}" for name, what in self.as_built]
        return "\n".join(lines)


def find_blocks(model: nn.Module) -> str | None:
    """The qualified name of ``model``'s ``nn.ModuleList`` whose entries hold the most ``nn.Linear`` in all (ties:
    the first registered), or None if no ModuleList holds one."""
    best, best_count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            count = sum(isinstance(m, nn.Linear) for entry in module for m in entry.modules())
            if count > best_count:
                best, best_count = name, count
    return best


def _in_block(name: str, block: str) -> bool:
    return name == block or name.startswith(block + ".")


def _tail_reasons(model: nn.Module, linear_names: list[str], recipe: BlockRecipe,
                  blocks: str | None) -> tuple[str | None, dict[str, str], tuple[str, ...]]:
    """``(container, {linear name: tail reason}, tail block names)``; container None: each linear is a block."""
    container = blocks if blocks is not None else find_blocks(model)
    if container is None:
        entries = list(linear_names)
        what = "linears (no nn.ModuleList of blocks found)"
    else:
        holder = model.get_submodule(container)
        if not isinstance(holder, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"convert_to_block_scaled: blocks={container!r} is a {type(holder).__name__}, not an "
                             f"nn.ModuleList or nn.Sequential")
        prefix = f"{container}." if container else ""
        entries = [f"{prefix}{key}" for key, _ in holder.named_children()]
        what = f"blocks of {container!r}"
    n_tail = recipe.tail_blocks(len(entries))
    tail = tuple(entries[len(entries) - n_tail:])
    reason = (f"in the bf16 tail: the last {n_tail} of {len(entries)} {what} stay in the compute dtype "
              f"(bf16_tail_fraction={recipe.bf16_tail_fraction:g})")
    reasons = {name: reason for name in linear_names if any(_in_block(name, block) for block in tail)}
    return container, reasons, tail


def _first_last_reasons(linear_names: list[str]) -> dict[str, str]:
    if not linear_names:
        return {}
    hint = "kept in the compute dtype by the recipe's keep_first_last"
    reasons = {linear_names[0]: f"first Linear of the network ({hint})"}
    reasons.setdefault(linear_names[-1], f"last Linear of the network ({hint})")
    return reasons


def _holders(name: str) -> list[str]:
    """``name`` and the qualified names of the modules holding it: ``"a.b.c"`` -> ``["a.b.c", "a.b", "a"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _keep_reasons(linear_names: list[str], keep: tuple[str, ...]) -> dict[str, str]:
    """``{linear name: reason}`` for the linears a ``keep`` pattern matches (module docstring)."""
    reasons = {}
    for name in linear_names:
        hits = [pat for pat in keep if any(fnmatch.fnmatchcase(h, pat) for h in _holders(name))]
        if hits:
            reasons[name] = (f"kept by block_keep pattern {hits[0]!r} (the policy's list of linears to keep in the "
                             "compute dtype)")
    return reasons


def check_keep_patterns(model: nn.Module, keep: tuple[str, ...]) -> None:
    """Raise ValueError, naming them and the model's linears, for ``keep`` patterns (a policy's ``block_keep``) that
    match no ``nn.Linear`` of ``model`` (block-scaled ones included) nor a module holding one; a tuple of non-empty
    strings is expected (TypeError otherwise). Changes nothing; no host sync."""
    if not isinstance(keep, tuple) or not all(isinstance(p, str) and p for p in keep):
        raise TypeError(f"keep={keep!r} must be a tuple of non-empty glob patterns, e.g. ('blocks.*.attn.proj',)")
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    holders = {h for name in names for h in _holders(name)}
    unmatched = [pat for pat in keep if not any(fnmatch.fnmatchcase(h, pat) for h in holders)]
    if unmatched:
        raise ValueError(f"block_keep pattern(s) {unmatched} match no nn.Linear of the model nor a module holding "
                         f"one; its linears are {names[:8]}{' ...' if len(names) > 8 else ''}: fix or drop the "
                         "pattern")


def _skip_reasons(name: str, module: nn.Module, recipe: BlockRecipe, kept_by_recipe: list[dict[str, str]],
                  module_filter: ModuleFilter | None) -> list[str]:
    reasons = []
    if type(module) is not nn.Linear:
        reasons.append(f"{type(module).__name__} is a subclass of nn.Linear; only plain nn.Linear is swapped")
    if not name:
        reasons.append("the root module cannot be replaced in place; wrap it in a container")
    reasons += [table[name] for table in kept_by_recipe if name in table]
    if module_filter is not None and not module_filter(module, name):
        reasons.append("rejected by module_filter")
    reasons += [f"shape: {p}" for p in shape_problems(module.in_features, module.out_features, recipe)]
    return reasons


def plan_block_conversion(model: nn.Module, recipe: str | BlockRecipe = "mxfp8",
                          module_filter: ModuleFilter | None = None, *, blocks: str | None = None,
                          keep: tuple[str, ...] = ()) -> BlockConversionReport:
    """What :func:`convert_to_block_scaled` would convert and keep, with the same arguments, changing nothing (e.g.
    to tell which linears a recipe runs in a block format before converting). Raises as it does."""
    resolved = get_block_recipe(recipe)
    check_keep_patterns(model, keep)
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    container, tail_reasons, tail = _tail_reasons(model, names, resolved, blocks)
    kept_by_recipe = [_first_last_reasons(names) if resolved.keep_first_last else {}, _keep_reasons(names, keep),
                      tail_reasons]
    converted, kept, as_built = [], [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        kind = getattr(module, "linear_kind", None)
        if type(module) is not nn.Linear and isinstance(kind, str):
            as_built.append((name, f"already {kind}, left as built"))
            continue
        reasons = _skip_reasons(name, module, resolved, kept_by_recipe, module_filter)
        if reasons:
            kept.append((name, "; ".join(reasons)))
        else:
            converted.append(name)
    return BlockConversionReport(resolved, tuple(converted), tuple(kept), container, tail, tuple(as_built))


def convert_to_block_scaled(model: nn.Module, recipe: str | BlockRecipe = "mxfp8",
                            module_filter: ModuleFilter | None = None, *, blocks: str | None = None,
                            keep: tuple[str, ...] = ()) -> BlockConversionReport:
    """Replace eligible ``nn.Linear`` modules of ``model`` by :class:`BlockScaledLinear`, in place (module
    docstring for which).

    Args:
        model: the model; its Parameter objects are kept (optimizers stay valid).
        recipe: ``"mxfp8"``, ``"nvfp4"``, ``"nvfp4-plain"`` or a :class:`BlockRecipe`.
        module_filter: ``(module, qualified_name) -> bool``, False to keep a linear as it is; applied on top of
            the recipe's first/last and tail rules.
        blocks: the qualified name of the ``nn.ModuleList`` / ``nn.Sequential`` of blocks the tail counts
            (default: :func:`find_blocks`).
        keep: glob patterns of linears (or of modules holding them) kept in the compute dtype (a policy's
            ``block_keep``); each must match one.

    Returns:
        A :class:`BlockConversionReport` naming every converted linear and every kept one with its reasons.

    Raises:
        ValueError: ``blocks`` names a module that is not a ModuleList or Sequential; a ``keep`` pattern matches
            no linear (nothing is converted then).
    """
    report = plan_block_conversion(model, recipe, module_filter, blocks=blocks, keep=keep)
    named = dict(model.named_modules())
    replacements: dict[nn.Module, BlockScaledLinear] = {}
    for index, name in enumerate(report.converted):
        replacements[named[name]] = BlockScaledLinear.from_linear(named[name], recipe=report.recipe, index=index)
        replacements[named[name]].qualified_name = name
    replace_modules(model, replacements)   # under every parent holding a converted module (shared ones too)
    return report


def revert_block_scaled(model: nn.Module, module_filter: ModuleFilter | None = None) -> dict[str, BlockScaledLinear]:
    """Replace every :class:`BlockScaledLinear` of ``model`` (``module_filter(module, name)`` True, if given) by a
    plain ``nn.Linear`` holding the same ``weight`` and ``bias`` Parameter objects, in place (its training mode and
    hooks kept: :func:`~mixprec.blockscale.swap.replace_modules`). Returns the replaced modules by qualified name
    (their recipe, index and stochastic rounding state, e.g. to continue a stream after converting again). No
    tensor is copied; no host sync."""
    found = {name: m for name, m in model.named_modules() if isinstance(m, BlockScaledLinear) and name
             and (module_filter is None or module_filter(m, name))}
    replacements: dict[nn.Module, nn.Module] = {}
    for module in found.values():
        if module in replacements:
            continue
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        linear.weight, linear.bias = module.weight, module.bias
        replacements[module] = linear.train(module.training)
    replace_modules(model, replacements)
    return found


def block_state_keys(model: nn.Module) -> set[str]:
    """The ``model.state_dict()`` keys that block-scaled linears hold besides their parameters: each
    :class:`BlockScaledLinear`'s ``hadamard_signs`` (with the transform) and ``_extra_state`` (its stochastic rounding
    stream), e.g. ``{"blocks.0.fc1._extra_state", ...}``; a checkpoint of another policy lacks or adds just these."""
    return {f"{name}.{key}" for name, module in model.named_modules() if isinstance(module, BlockScaledLinear)
            for key in module.state_dict(keep_vars=True) if key not in ("weight", "bias")}
