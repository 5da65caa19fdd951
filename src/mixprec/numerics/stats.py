"""The statistics :func:`mixprec.numerics.inspect` measures, as plain data.

:class:`NumericsStats` holds, per leaf module (:class:`ModuleStats`) and per trainable parameter
(:class:`ParamStats`), how each recorded tensor fits each candidate format (:class:`RangeStats`),
the error of running the module in each format (:class:`ModuleError`) and the lost-update counts
of each parameter, with the two queries the advice reads (:meth:`NumericsStats.scale_index`,
:meth:`NumericsStats.lost_update`). Everything is a Python number: no tensors, no device.

Block formats (:attr:`NumericsStats.block`, one :class:`~mixprec.numerics.block_stats.BlockFormatStats` each) are
measured per linear and per GEMM operand; their conventions are :mod:`mixprec.numerics.block_stats`'s.

:class:`mixprec.numerics.NumericsReport` is these statistics with their views (flags,
recommendation, markdown, JSON, heatmap). The conventions (scale, overflow, subnormal, flushed,
lost update, error) are stated once, in :mod:`mixprec.numerics.report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mixprec.formats import get_block_format, get_format
from mixprec.numerics.block_stats import BlockFormatStats
from mixprec.policy.policy import Policy

__all__ = ["RangeStats", "ModuleError", "ModuleStats", "ParamStats", "MeasuredSpeed", "NumericsStats"]


@dataclass(frozen=True)
class RangeStats:
    """How one tensor role fits one format at one scale (fractions in [0, 1]; conventions in
    :mod:`mixprec.numerics.report`).

    ``amax`` is the largest ``|x|`` before scaling, over every recorded step. ``subnormal_energy``
    and ``flushed_energy`` are the shares of the squared L2 norm (sum of ``x**2``) that the
    subnormal and the flushed elements carry.
    """

    scale: float
    amax: float
    overflow: float
    subnormal: float
    flushed: float
    subnormal_energy: float
    flushed_energy: float


@dataclass(frozen=True)
class ModuleError:
    """Error of a module's output in a format against fp32: SQNR in dB (``inf``: exact;
    ``-inf``: non-finite output) and relative L2 error."""

    sqnr_db: float
    rel_error: float


@dataclass(frozen=True)
class ModuleStats:
    """Statistics of one leaf module, keyed by canonical format name (``"e4m3fn"``, not ``"e4m3"``).

    ``activation``: forward outputs at scale 1; ``activation_scaled``: fp8 formats only, at the
    best per-tensor scale. ``grad_output``: gradients of the outputs (fp32 reference, loss scale 1)
    evaluated at each of the report's ``loss_scales`` (same order); ``grad_output_scaled``: fp8
    formats at the best per-tensor scale. ``error``: measured on the last step. ``params``: the
    qualified names of the module's trainable parameters (a tied parameter is named once, by its
    first owner, as ``named_parameters()`` does).
    """

    name: str
    kind: str
    calls: int
    numel: int
    activation: dict[str, RangeStats]
    activation_scaled: dict[str, RangeStats]
    grad_output: dict[str, tuple[RangeStats, ...]]
    grad_output_scaled: dict[str, RangeStats]
    error: dict[str, ModuleError]
    params: tuple[str, ...]


@dataclass(frozen=True)
class ParamStats:
    """Statistics of one trainable parameter (same conventions as :class:`ModuleStats`).

    ``weight``: the values entering each step's forward, at scale 1. ``lost``: per storage format
    (the 16- and 32-bit formats), the number of lost updates summed over steps; ``updated``: the
    number of intended updates (the denominator).
    """

    name: str
    module: str
    shape: tuple[int, ...]
    weight: dict[str, RangeStats]
    weight_scaled: dict[str, RangeStats]
    grad: dict[str, tuple[RangeStats, ...]]
    grad_scaled: dict[str, RangeStats]
    lost: dict[str, int]
    updated: int

    def lost_update(self, fmt: str) -> float:
        """Lost-update fraction in ``fmt`` (0.0 when nothing was to be updated)."""
        key = _key(fmt, self.lost, "lost-update counts")
        return self.lost[key] / self.updated if self.updated else 0.0


def _key(fmt: str, table: dict[str, Any], what: str) -> str:
    name = get_format(fmt).name
    if name not in table:
        raise ValueError(f"format {fmt!r} has no {what} in this report; it holds {sorted(table)} "
                         "(pass it in inspect(..., formats=...))")
    return name


@dataclass(frozen=True)
class MeasuredSpeed:
    """How fast the model trains under each policy ``auto`` times on this device, as ``auto`` measured it
    (:func:`mixprec.auto.trial.choose`, its cache included: :func:`mixprec.numerics.workload.measure_speed`):
    ``choice`` the policy ``auto`` picks by its rule, ``ratios`` candidate -> fp32's median step time over its
    own (> 1: faster than fp32), ``decision`` auto's decision line (what it measured, in words), ``noisy`` its
    timing spread over auto's limit (a busy machine: the choice holds for this process only)."""

    choice: str
    ratios: dict[str, float]
    decision: str
    noisy: bool = False


@dataclass(frozen=True)
class NumericsStats:
    """The fields and queries of a :class:`~mixprec.numerics.NumericsReport` (its docstring lists
    the attributes), without the views: what :mod:`mixprec.numerics.advice` reads."""

    formats: tuple[str, ...]
    storage_formats: tuple[str, ...]
    policy: Policy
    steps: int
    optimizer: str
    lr: float | None
    losses: tuple[float, ...]
    loss_scales: tuple[float, ...]
    policy_loss_scale: float
    grad_amax: float
    loss_scale_margin: float
    max_safe_loss_scale: float
    recommended_loss_scale: float
    module_names: tuple[str, ...]
    modules: dict[str, ModuleStats]
    params: dict[str, ParamStats]
    speed: MeasuredSpeed | None = None
    block: tuple[BlockFormatStats, ...] = ()

    @property
    def block_formats(self) -> tuple[str, ...]:
        """The names of the inspected block formats (those of :attr:`block`, in order)."""
        return tuple(b.format for b in self.block)

    def block_stats(self, fmt: str) -> BlockFormatStats:
        """The statistics of block format ``fmt`` (a name :func:`mixprec.formats.get_block_format` knows).

        Raises:
            ValueError: ``fmt`` was not inspected (the message lists those that were).
        """
        name = get_block_format(fmt).name
        for stats in self.block:
            if stats.format == name:
                return stats
        raise ValueError(f"block format {fmt!r} was not inspected; this report holds {list(self.block_formats)} "
                         "(pass it in inspect(..., formats=...))")

    # ------------------------------------------------------------------ queries
    def scale_index(self, loss_scale: float) -> int:
        """Position of ``loss_scale`` in :attr:`loss_scales`.

        Raises:
            ValueError: the report has no statistics at that scale (the message lists them).
        """
        for i, s in enumerate(self.loss_scales):
            if s == loss_scale:
                return i
        raise ValueError(f"loss_scale={loss_scale!r} was not evaluated; this report has gradient statistics "
                         f"at {list(self.loss_scales)}")

    def lost_update(self, fmt: str) -> float:
        """Lost-update fraction in ``fmt`` over all parameters (weighted by intended updates)."""
        updated = sum(p.updated for p in self.params.values())
        lost = sum(p.lost[_key(fmt, p.lost, "lost-update counts")] for p in self.params.values())
        return lost / updated if updated else 0.0
