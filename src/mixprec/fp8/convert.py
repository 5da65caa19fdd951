"""Swap a model's eligible ``nn.Linear`` modules for :class:`~mixprec.fp8.linear.Float8Linear`, in place.

A linear is converted when it is a plain ``nn.Linear`` (subclasses such as attention's
``NonDynamicallyQuantizableLinear`` are used through their weights, not their forward), the
filter accepts it, and both ``in_features`` and ``out_features`` are multiples of 16 (the fp8
GEMM's alignment). By default (``keep_first_last=True``) the network's first and last
``nn.Linear`` (in registration order) stay in high precision, the usual fp8 practice: the
first sees raw inputs, the last produces logits. Everything left alone is listed in the report with its
reasons. The converted modules reuse the original ``weight``/``bias`` Parameter objects, so an
optimizer (or a ``MixedPrecision`` engine) built before conversion keeps working; a swapped
module's hooks are carried over (:func:`mixprec.blockscale.swap.replace_modules`, the one swap
block-scaled linears use too). A linear already running its own GEMMs (a ``Float8Linear`` or a
block-scaled one, told by ``linear_kind``) is kept as built, its reason saying so.
:func:`revert_float8` swaps fp8 linears back to plain ``nn.Linear`` (the same Parameter objects).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mixprec.blockscale.swap import replace_modules
from mixprec.fp8.linear import Float8Linear
from mixprec.fp8.recipes import Float8Recipe

__all__ = ["ConversionReport", "convert_to_float8", "revert_float8"]

_DIM_MULTIPLE = 16

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert_to_float8` did.

    Attributes:
        recipe: the recipe every converted linear uses.
        converted: qualified names of the linears now :class:`Float8Linear`.
        skipped: ``(qualified name, reason)`` of every ``nn.Linear`` left as it was.
    """

    recipe: Float8Recipe
    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"fp8 conversion ({self.recipe}): {len(self.converted)} converted, {len(self.skipped)} kept"]
        lines += [f"  fp8   {name}" for name in self.converted]
        lines += [f"  kept  {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _first_last_reasons(linear_names: list[str]) -> dict[str, str]:
    """Reasons for keeping the first and the last ``nn.Linear`` of the network."""
    if not linear_names:
        return {}
    hint = ("kept in high precision; convert it with policy key fp8_ends=fp8 "
            "(convert_to_float8(..., keep_first_last=False))")
    reasons = {linear_names[0]: f"first Linear of the network ({hint})"}
    reasons.setdefault(linear_names[-1], f"last Linear of the network ({hint})")
    return reasons


def _skip_reasons(name: str, module: nn.Module, first_last: dict[str, str],
                  module_filter: ModuleFilter | None) -> list[str]:
    kind = getattr(module, "linear_kind", None)
    if type(module) is not nn.Linear and isinstance(kind, str):
        return [f"already {kind}, left as built"]
    reasons = []
    if type(module) is not nn.Linear:
        reasons.append(f"{type(module).__name__} is a subclass of nn.Linear; only plain nn.Linear is swapped")
    if not name:
        reasons.append("the root module cannot be replaced in place; wrap it in a container")
    if name in first_last:
        reasons.append(first_last[name])
    if module_filter is not None and not module_filter(module, name):
        reasons.append("rejected by module_filter")
    bad_dims = [f"{dim}={getattr(module, dim)}" for dim in ("in_features", "out_features")
                if getattr(module, dim) % _DIM_MULTIPLE]
    if bad_dims:
        reasons.append(f"{', '.join(bad_dims)} not a multiple of {_DIM_MULTIPLE} (fp8 GEMM alignment)")
    return reasons


def convert_to_float8(model: nn.Module, recipe: str | Float8Recipe = "tensorwise",
                      module_filter: ModuleFilter | None = None, fp8_format: str | None = None, *,
                      keep_first_last: bool = True, use_scaled_mm: bool | None = None) -> ConversionReport:
    """Replace eligible ``nn.Linear`` modules of ``model`` by :class:`Float8Linear`, in place.

    Args:
        model: the model; its Parameter objects are kept (optimizers stay valid).
        recipe: ``"tensorwise"``, ``"rowwise"``, ``"delayed"`` or a :class:`Float8Recipe`.
        module_filter: ``(module, qualified_name) -> bool``, False to keep a linear as it is
            (e.g. the engine's ``keep_fp32`` modules); applied on top of ``keep_first_last``.
        fp8_format: ``"hybrid"`` (default for recipe names) or ``"e4m3"``.
        keep_first_last: keep the first and the last ``nn.Linear`` (registration order) in high
            precision (the default filter).
        use_scaled_mm: passed to every :class:`Float8Linear` (None = auto per device).

    Returns:
        A :class:`ConversionReport` listing converted linears and each kept one with its reasons.
    """
    resolved = Float8Recipe.resolve(recipe, fp8_format)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    first_last = _first_last_reasons([name for name, _ in linears]) if keep_first_last else {}
    replacements: dict[nn.Module, Float8Linear] = {}
    converted, skipped = [], []
    for name, module in linears:
        reasons = _skip_reasons(name, module, first_last, module_filter)
        if reasons:
            skipped.append((name, "; ".join(reasons)))
            continue
        replacements[module] = Float8Linear.from_linear(module, recipe=resolved, use_scaled_mm=use_scaled_mm)
        replacements[module].qualified_name = name
        converted.append(name)
    replace_modules(model, replacements)   # under every parent holding a converted module (shared ones too)
    return ConversionReport(recipe=resolved, converted=tuple(converted), skipped=tuple(skipped))


def revert_float8(model: nn.Module, module_filter: ModuleFilter | None = None) -> dict[str, Float8Linear]:
    """Replace every :class:`Float8Linear` of ``model`` (``module_filter(module, name)`` True, if given) by a plain
    ``nn.Linear`` holding the same ``weight`` and ``bias`` Parameter objects, in place (training mode and hooks
    kept; the scaling state, e.g. delayed scaling's amax history, is dropped with the module). Returns the replaced
    modules by qualified name. No tensor is copied; no host sync."""
    found = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear) and name
             and (module_filter is None or module_filter(m, name))}
    replacements: dict[nn.Module, nn.Module] = {}
    for module in found.values():
        if module not in replacements:
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            linear.weight, linear.bias = module.weight, module.bias
            replacements[module] = linear.train(module.training)
    replace_modules(model, replacements)
    return found
