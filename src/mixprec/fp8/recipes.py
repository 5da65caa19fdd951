"""fp8 recipes: which formats each GEMM operand uses and how its scale is chosen.

A :class:`Float8Recipe` is a frozen config. ``recipe.make_scaling()`` builds the object a
:class:`~mixprec.fp8.linear.Float8Linear` casts through, ``scaling.cast(t_hp, role=, axis=)``,
which returns a :class:`~mixprec.fp8.scaling.ScaledFloat8` (scale convention stated there):

* ``tensorwise`` -- current scaling: one scale from the amax of this tensor now, shape ``()``.
* ``rowwise`` -- current scaling per row along the GEMM's contraction axis, shape ``(R, 1)``
  (or ``(1, C)`` when the contraction runs along dim 0); each operand is cast again along the
  other axis for the backward GEMMs.
* ``delayed`` -- Transformer Engine's delayed scaling: the scale used now was computed from an
  amax history of the previous ``history_len`` steps (``max`` of the history or its
  ``most_recent`` entry, with ``margin``). The history and scales are buffers, so they travel
  in ``model.state_dict()`` and checkpoints.

Formats: ``hybrid`` (default) = E4M3 (e4m3fn) for inputs and weights, E5M2 for gradients
(TE's ``Format.HYBRID``); ``e4m3`` = e4m3fn everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from mixprec.formats import Format, get_format
from mixprec.fp8.scaling import AMAX_FLOOR, ScaledFloat8, amax, scale_from_amax, to_fp8

__all__ = ["Float8Recipe", "CurrentScaling", "DelayedScaling", "RECIPES", "FP8_FORMATS", "ROLES"]

RECIPES = ("tensorwise", "rowwise", "delayed")
FP8_FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE = ("max", "most_recent")
ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Float8Recipe:
    """How fp8 linears scale their operands (frozen; build new ones with ``dataclasses.replace``).

    Attributes:
        name: ``"tensorwise"``, ``"rowwise"`` or ``"delayed"`` (see the module docstring).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
        margin: scales are divided by ``2**margin`` (headroom below ``fmt.max``); every recipe.
        history_len: amax history length (``delayed`` only).
        amax_compute: ``"max"`` of the history or its ``"most_recent"`` entry (``delayed`` only).

    Raises:
        ValueError: a field outside its allowed set, naming the field, the value and the choices.
    """

    name: str = "tensorwise"
    fp8_format: str = "hybrid"
    margin: int = 0
    history_len: int = 16
    amax_compute: str = "max"

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"Float8Recipe name={self.name!r} is not known; choose one of {RECIPES}")
        if self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"Float8Recipe fp8_format={self.fp8_format!r} is not known; choose one of {FP8_FORMATS}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"Float8Recipe margin={self.margin!r} must be an int >= 0")
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"Float8Recipe history_len={self.history_len!r} must be an int >= 1")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(f"Float8Recipe amax_compute={self.amax_compute!r} is not known; "
                             f"choose one of {AMAX_COMPUTE}")

    @classmethod
    def resolve(cls, recipe: "str | Float8Recipe", fp8_format: str | None = None) -> "Float8Recipe":
        """A recipe from a name (with ``fp8_format``, default ``"hybrid"``) or a recipe object.

        Raises:
            ValueError: ``fp8_format`` contradicts the format inside a recipe object.
            TypeError: ``recipe`` is neither a name nor a Float8Recipe.
        """
        if isinstance(recipe, Float8Recipe):
            if fp8_format is not None and fp8_format != recipe.fp8_format:
                raise ValueError(f"{fp8_format=} contradicts the recipe's fp8_format={recipe.fp8_format!r}; "
                                 "set it in the Float8Recipe only")
            return recipe
        if isinstance(recipe, str):
            return cls(name=recipe.strip().lower(), fp8_format=fp8_format or "hybrid")
        raise TypeError(f"recipe={recipe!r} must be one of {RECIPES} or a Float8Recipe")

    def format_for(self, role: str) -> Format:
        """The fp8 format of an operand role: ``"input"``, ``"weight"`` or ``"grad_output"``."""
        if role not in ROLES:
            raise ValueError(f"{role=} is not known; choose one of {ROLES}")
        if role == "grad_output" and self.fp8_format == "hybrid":
            return get_format("e5m2")
        return get_format("e4m3fn")

    def make_scaling(self, device: torch.device | str | None = None) -> "CurrentScaling | DelayedScaling":
        """The scaling object for one linear (delayed: fresh, empty amax histories on ``device``)."""
        if self.name == "delayed":
            return DelayedScaling(self, device=device)
        return CurrentScaling(self, device=device)

    def __str__(self) -> str:
        extra = f",history_len={self.history_len},amax_compute={self.amax_compute}" if self.name == "delayed" else ""
        return f"{self.name}(format={self.fp8_format},margin={self.margin}{extra})"


class _NeverEmpty(nn.Module):
    """Scaling state that never holds uninitialised memory. ``model.to_empty(device=...)`` (materialising a
    model built on the meta device, or moving one without copying) gives each buffer of this module its
    value back instead of ``torch.empty``'s: the fresh value (``_FRESH``) where it was a meta tensor, else
    the value it held. Without it a counter read ~1e14 and a delayed scale was garbage, marked initialised.
    A ``load_state_dict`` afterwards sets the persistent buffers as usual; ``state_dict`` keys are unchanged."""

    _FRESH: ClassVar[dict[str, float]] = {}

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _NeverEmpty:
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        with torch.no_grad():
            for name, old in before.items():
                new = self._buffers.get(name)
                if old is None or new is None or new is old or new.is_meta:
                    continue
                if old.is_meta:
                    new.fill_(self._FRESH[name])
                else:
                    new.copy_(old)   # .to(): the same values again; to_empty: the values, not empty memory
        return self


class _ClampCounter(_NeverEmpty):
    """Diagnostics shared by the scaling classes: ``clamped``, an int64 ``(3,)`` buffer (one entry
    per role of :data:`ROLES`) counting the scales that the amax floor clamped -- casts of an
    all-zero or subnormal tensor (per row under rowwise) since the counter was built or
    :meth:`reset_clamped` (0 after ``to_empty`` of a meta model). Not persistent (never in ``state_dict``);
    updated on device, no sync."""

    _FRESH = {"clamped": 0}

    def _init_counter(self, device: torch.device | str | None) -> None:
        self.register_buffer("clamped", torch.zeros(len(ROLES), dtype=torch.int64, device=device), persistent=False)

    @torch.no_grad()
    def _count(self, role: str, t_amax: torch.Tensor) -> None:
        self.clamped[ROLES.index(role)] += (t_amax < AMAX_FLOOR).sum()

    def reset_clamped(self) -> None:
        self.clamped.zero_()


class CurrentScaling(_ClampCounter):
    """``tensorwise``/``rowwise`` current scaling: the scale comes from the tensor being cast.

    Stateless (nothing in ``state_dict``; the ``clamped`` diagnostics counter is not persistent).
    No host sync.
    """

    def __init__(self, recipe: Float8Recipe, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.recipe = recipe
        self._init_counter(device)

    def cast(self, t_hp: torch.Tensor, *, role: str, axis: int) -> ScaledFloat8:
        """Cast the 2-D ``t_hp`` for a GEMM that contracts along ``axis`` (0 or -1).

        Scale shape ``()`` for tensorwise; for rowwise ``(R, 1)`` when ``axis=-1`` and
        ``(1, C)`` when ``axis=0`` (see :class:`ScaledFloat8`).
        """
        fmt = self.recipe.format_for(role)
        t_amax = amax(t_hp, dim=axis if self.recipe.name == "rowwise" else None)
        self._count(role, t_amax)
        scale = scale_from_amax(t_amax, fmt, self.recipe.margin)
        return ScaledFloat8(to_fp8(t_hp, scale, fmt), scale)

    def extra_repr(self) -> str:
        return str(self.recipe)


class AmaxHistory(_NeverEmpty):
    """Delayed-scaling state of one operand role: amax history, the scale for the next cast.

    Buffers (all in ``state_dict``): ``amax_history`` ``(history_len,)`` fp32, newest first;
    ``scale`` ``()`` fp32, computed from the history after the last record; ``initialized``
    ``()`` bool. Until the first record the cast uses the current amax (as torchao's delayed
    scaling did), so step one is not cast with an arbitrary scale. Fresh again after ``to_empty``
    of a meta model (:class:`_NeverEmpty`).
    """

    _FRESH = {"amax_history": 0.0, "scale": 1.0, "initialized": False}

    def __init__(self, fmt: Format, recipe: Float8Recipe, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.fmt = fmt
        self.margin = recipe.margin
        self.amax_compute = recipe.amax_compute
        self.register_buffer("amax_history", torch.zeros(recipe.history_len, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool, device=device))

    @torch.no_grad()
    def scale_for_cast(self, amax_now: torch.Tensor) -> torch.Tensor:
        """The stored (delayed) scale, or the current one before the first record; NaN when this
        tensor's amax is not finite, so an overflow upstream yields NaN (as with current scaling)
        instead of saturating quietly. No host sync."""
        scale = torch.where(self.initialized, self.scale, scale_from_amax(amax_now, self.fmt, self.margin))
        return torch.where(torch.isfinite(amax_now), scale, torch.nan)

    @torch.no_grad()
    def record(self, amax_now: torch.Tensor) -> None:
        """Push ``amax_now`` into the history (newest at index 0) and recompute ``scale``.

        A non-finite amax (an overflow this step; the cast already produced NaN, so the engine
        skips the step) is not recorded -- the newest finite amax is repeated instead -- so one bad
        step does not poison the next ``history_len`` scales. Zeros are recorded; the amax floor
        keeps their scales finite. No host sync.
        """
        newest = torch.where(torch.isfinite(amax_now), amax_now, self.amax_history[0])
        self.amax_history.copy_(torch.cat([newest.view(1), self.amax_history[:-1]]))
        reduced = self.amax_history.amax() if self.amax_compute == "max" else self.amax_history[0]
        self.scale.copy_(scale_from_amax(reduced, self.fmt, self.margin))
        self.initialized.fill_(True)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, history_len={self.amax_history.numel()}, amax_compute={self.amax_compute}"


class DelayedScaling(_ClampCounter):
    """Delayed scaling: one :class:`AmaxHistory` per role (submodules ``input``, ``weight``,
    ``grad_output``). Each cast uses the scale from earlier steps and then records this
    tensor's amax -- in training mode only, so evaluation does not move the scales.

    The cast saturates (see :func:`~mixprec.fp8.scaling.to_fp8`): a tensor whose amax grew past
    the stale scale clamps at ``±fmt.max`` instead of overflowing. Scales are per tensor, shape
    ``()``. No host sync. Gradient checkpointing that re-runs a forward records twice.
    """

    def __init__(self, recipe: Float8Recipe, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.recipe = recipe
        self.input = AmaxHistory(recipe.format_for("input"), recipe, device)
        self.weight = AmaxHistory(recipe.format_for("weight"), recipe, device)
        self.grad_output = AmaxHistory(recipe.format_for("grad_output"), recipe, device)
        self._init_counter(device)

    def cast(self, t_hp: torch.Tensor, *, role: str, axis: int) -> ScaledFloat8:
        """Cast ``t_hp`` with the delayed scale of ``role`` (shape ``()``; ``axis`` is unused)."""
        history: AmaxHistory = getattr(self, role)
        amax_now = amax(t_hp)
        self._count(role, amax_now)
        scale = history.scale_for_cast(amax_now)
        t_fp8 = ScaledFloat8(to_fp8(t_hp, scale, history.fmt), scale)
        if self.training:
            history.record(amax_now)
        return t_fp8

    def extra_repr(self) -> str:
        return str(self.recipe)
