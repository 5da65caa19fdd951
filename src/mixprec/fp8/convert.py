"""Swap a model's eligible ``nn.Linear`` modules for :class:`~mixprec.fp8.linear.Float8Linear`, in place.

A linear is converted when it is a plain ``nn.Linear`` (subclasses such as attention's
``NonDynamicallyQuantizableLinear`` are used through their weights, not their forward), the
filter accepts it, and both ``in_features`` and ``out_features`` are multiples of 16 (the fp8
GEMM's alignment). By default (``keep_first_last=True``) the network's first and last
``nn.Linear`` (in registration order) stay in high precision, the usual fp8 practice: the
first sees raw inputs, the last produces logits. Everything left alone is listed in the report with its
reasons. The converted modules reuse the original ``weight``/``bias`` Parameter objects, so an
optimizer (or a ``MixedPrecision`` engine) built before conversion keeps working; forward
hooks of a swapped module are not carried over, so convert before installing hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mixprec.fp8.linear import Float8Linear
from mixprec.fp8.recipes import Float8Recipe

__all__ = ["ConversionReport", "convert_to_float8"]

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
        converted.append(name)
    # swap under every parent that holds a converted module (a shared module has several)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child in replacements:
                setattr(parent, child_name, replacements[child])
    return ConversionReport(recipe=resolved, converted=tuple(converted), skipped=tuple(skipped))
