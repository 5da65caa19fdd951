"""The numerics report: plain data measured by :func:`mixprec.numerics.inspect`, and its views.

A :class:`NumericsReport` holds, per leaf module (:class:`ModuleStats`) and per trainable
parameter (:class:`ParamStats`), how each recorded tensor fits each candidate format
(:class:`RangeStats`), the error of running the module in each format (:class:`ModuleError`)
and the lost-update counts of each parameter. Everything is a Python number: no tensors, no
device. The data classes live in :mod:`mixprec.numerics.stats` (re-exported here), so the
advice reads them without depending on the views. The views are :meth:`NumericsReport.flagged`,
:meth:`~NumericsReport.recommend` (both delegate to the pure rules in :mod:`mixprec.numerics.advice`),
:meth:`~NumericsReport.to_markdown`, :meth:`~NumericsReport.to_json` /
:meth:`~NumericsReport.from_json` (derived from the dataclass fields, so a new field
round-trips without extra code) and :meth:`~NumericsReport.heatmap`.

Conventions (the one place they are stated):

* **scale**: a stored value is ``x * scale``. Gradient statistics are given at each loss scale
  in :attr:`NumericsReport.loss_scales`; activations and weights at scale 1 ("raw"); fp8
  statistics also at the *best per-tensor scale* ``scale = fmt.max / amax`` (current, i.e.
  just-in-time, tensorwise scaling: each step's counts use that step's amax; the reported
  ``scale`` uses the amax over all steps).
* **overflow**: share of *all* elements with ``|x * scale| > fmt.max`` (non-finite values count
  as overflow).
* **subnormal**: share of *non-zero* elements with ``|x * scale| < fmt.smallest_normal``; it
  includes the flushed ones.
* **flushed**: share of *non-zero* elements with ``|x * scale| < fmt.smallest_subnormal / 2``:
  they round to zero.
* **subnormal_energy** / **flushed_energy**: the share of ``sum(x**2)`` those elements carry
  (near 0 when they are fp32 rounding noise around an exact zero).
* **lost update**: share of a parameter's elements with an intended update (a non-zero fp32
  step delta or a non-zero gradient) whose fp32 step delta is smaller than half an ulp
  (:meth:`mixprec.formats.Format.ulp`) of the weight in that format: what storing the weight
  in that format without fp32 master weights would silently drop. The ``fp32`` entry counts
  updates the fp32 step itself dropped (non-zero gradient, zero delta): the master-weight case.
* **error**: SQNR ``10 log10(sum ref**2 / sum (ref - out)**2)`` in dB and relative error
  ``||ref - out|| / ||ref||`` of the module's output in a format against fp32 (see
  :mod:`mixprec.numerics.inspect` for how a module is run in a format).
* **block formats** (saturated blocks, underflow and SQNR of each linear's operands): stated in
  :mod:`mixprec.numerics.block_stats`.

JSON: non-finite floats are written as the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (strict
JSON has no infinities) and the policy as its text form; :meth:`NumericsReport.from_json`
reads both back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from mixprec.formats import get_format
from mixprec.numerics import advice
from mixprec.numerics.block_advice import BLOCK_SQNR_SLACK_DB, BlockAdvice, advise_block, block_risk
from mixprec.numerics.block_report import block_markdown
from mixprec.numerics.figures import count, num, pct, pow2
from mixprec.numerics.stats import ModuleError, ModuleStats, NumericsStats, ParamStats, RangeStats
from mixprec.policy.policy import Policy

__all__ = ["RangeStats", "ModuleError", "ModuleStats", "ParamStats", "NumericsReport"]


@dataclass(frozen=True)
class NumericsReport(NumericsStats):
    """What :func:`mixprec.numerics.inspect` measured (plain data; module docstring for conventions)
    and its views. The fields and the queries :meth:`scale_index` and :meth:`lost_update` come from
    :class:`~mixprec.numerics.stats.NumericsStats`.

    Attributes:
        formats: canonical names of the inspected formats.
        storage_formats: formats with lost-update counts (the 16/32-bit ones, always ``fp32``).
        policy: the policy under study (the advice starts from it; ``fp32`` = no preference).
        steps, optimizer, lr: the reference run (``lr`` of the first parameter group).
        losses: the fp32 reference loss of each step.
        loss_scales: the loss scales gradient statistics are given at (ascending; always 1.0, the
            policy's scale, the dynamic default initial scale and the recommended scale).
        policy_loss_scale: the loss scale the policy would start with (1.0 without loss scaling).
        grad_amax: the largest ``|gradient|`` (module outputs and parameters) at scale 1.
        loss_scale_margin: the headroom factor of ``max_safe_loss_scale``.
        max_safe_loss_scale: largest power of two ``s`` with ``grad_amax * s * margin <= fp16 max``.
        recommended_loss_scale: ``max_safe_loss_scale`` clamped to the dynamic loss scale's
            ``[min_scale, max_scale]``.
        module_names: every module name of the model (``named_modules``), to check glob patterns.
        modules, params: per leaf module and per trainable parameter, in model order.
        speed: how fast the model trains under each policy ``auto`` times, as ``auto`` measured it
            (:class:`~mixprec.numerics.stats.MeasuredSpeed`; None: not measured, e.g. :func:`mixprec.numerics.inspect`
            called directly). The advice follows auto's rule on it (:func:`mixprec.numerics.advice.recommend`).
        block: per inspected block format, every linear's operands in it
            (:class:`~mixprec.numerics.block_stats.BlockFormatStats`); :attr:`block_formats` names them.
    """

    # ------------------------------------------------------------------ advice
    def flagged(self, fmt: str, *, loss_scale: float | None = None) -> list[advice.Flag]:
        """Modules unsafe in ``fmt``, each with the reason (rules in :mod:`mixprec.numerics.advice`).

        ``loss_scale``: judge gradients as multiplied by it (one of :attr:`loss_scales`); ``None``
        takes the scale the advice would use: :attr:`recommended_loss_scale` for fp16, 1.0 else.
        """
        return advice.flags(self, fmt, loss_scale=loss_scale)

    def recommend(self) -> advice.Recommendation:
        """The advised policy, initial loss scale and reasons (:func:`mixprec.numerics.advice.recommend`)."""
        return advice.recommend(self)

    def block_advice(self, fmt: str, *, slack_db: float = BLOCK_SQNR_SLACK_DB) -> BlockAdvice:
        """The linears to keep in bf16 under block format ``fmt`` and the policy that does
        (:func:`mixprec.numerics.block_advice.advise_block`; ``slack_db``: how far below the format's reference
        SQNR an operand may fall)."""
        return advise_block(self, fmt, slack_db=slack_db)

    # ------------------------------------------------------------------ serialisation
    def to_json(self, indent: int | None = 1) -> str:
        """The whole report as JSON (module docstring: non-finite floats, policy text)."""
        return json.dumps(_encode(self), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "NumericsReport":
        """Read :meth:`to_json` output back into an equal report."""
        return _decode(cls, json.loads(text))

    # ------------------------------------------------------------------ markdown
    def to_markdown(self) -> str:
        """A human report: recommendation, flags per format, loss scale, then the tables."""
        rec = self.recommend()
        loss_text = " → ".join(num(x) for x in (self.losses[0], self.losses[-1])) if self.losses else "-"
        lines = [
            "# mixprec numerics report",
            "",
            f"Reference: {self.steps} fp32 training steps ({self.optimizer}, lr {num(self.lr)}), loss {loss_text}. "
            f"Policy under study: `{self.policy}`. Formats: {', '.join(self.formats + self.block_formats)}.",
            "",
            "## Recommendation",
            "",
            f"Policy on this device (as it trains here now): `{rec.policy}`" + (f"; initial loss scale {pow2(rec.initial_loss_scale)}"
                                         if rec.initial_loss_scale is not None else ""),
            "",
            *(f"- {r}" for r in rec.reasons),
            "",
            "## Flags",
            "",
        ]
        for fmt in self.formats:
            flags = self.flagged(fmt)
            scale = self.recommended_loss_scale if fmt == "fp16" else 1.0
            lines.append(f"### {fmt} ({count(len({f.module for f in flags}), 'module')} flagged; gradients at "
                         f"loss scale {pow2(scale)})")
            lines.append("")
            if flags:
                lines += ["| module | kind | value | reason |", "|---|---|---|---|"]
                lines += [f"| {f.module} | {f.kind} | {num(f.value)} | {f.reason} |" for f in flags]
            else:
                lines.append("No module flagged.")
            lines.append("")
        lines += self._loss_scale_section() + self._activation_table() + self._error_table()
        lines += self._gradient_table() + self._lost_update_table() + block_markdown(self)
        return "\n".join(lines) + "\n"

    def _loss_scale_section(self) -> list[str]:
        lines = ["## Loss scale (fp16 gradients)", "",
                 f"Largest |gradient| {num(self.grad_amax)}. Largest power-of-two loss scale with |gradient| x scale x "
                 f"{num(self.loss_scale_margin)} (margin) <= fp16 max: {pow2(self.max_safe_loss_scale)}; recommended "
                 f"initial scale {pow2(self.recommended_loss_scale)}.", ""]
        if "fp16" not in self.formats:
            return lines
        lines += ["| loss scale | modules flagged for flushed gradients | largest flushed share among them "
                  "| modules with overflowing gradients |", "|---|---|---|---|"]
        for scale in self.loss_scales:
            found = self.flagged("fp16", loss_scale=scale)
            flushed = [f for f in found if f.kind == "grad underflow"]
            worst = max((f.value for f in flushed), default=0.0)
            over = {f.module for f in found if f.kind == "grad overflow"}
            lines.append(f"| {pow2(scale)} | {len({f.module for f in flushed})} | {pct(worst)} | {len(over)} |")
        return lines + [""]

    def _activation_table(self) -> list[str]:
        if not self.formats:   # block formats only: their section has the linears
            return []
        head = ["module", "type", "amax"]
        for fmt in self.formats:
            head += [f"{fmt} ovf", f"{fmt} sub", f"{fmt} flush"] if fmt not in _fp8(self) else [
                f"{fmt} ovf raw", f"{fmt} flush @best"]
        rows = []
        for m in self.modules.values():
            row = [m.name, m.kind, num(next(iter(m.activation.values())).amax)]
            for fmt in self.formats:
                a = m.activation[fmt]
                row += [pct(a.overflow), pct(a.subnormal), pct(a.flushed)] if fmt not in _fp8(self) else [
                    pct(a.overflow), pct(m.activation_scaled[fmt].flushed)]
            rows.append(row)
        return ["## Activations (forward outputs)", "", *_table(head, rows), ""]

    def _error_table(self) -> list[str]:
        if not self.formats:
            return []
        head = ["module", *(f"{fmt} SQNR dB" for fmt in self.formats), *(f"{fmt} rel err" for fmt in self.formats)]
        rows = [[m.name, *(_db(m.error[f].sqnr_db) for f in self.formats),
                 *(num(m.error[f].rel_error) for f in self.formats)] for m in self.modules.values()]
        return ["## Module error against fp32 (last step)", "", *_table(head, rows), ""]

    def _gradient_table(self) -> list[str]:
        if "fp16" not in self.formats:
            return []
        head = ["module", "grad amax", *(f"fp16 flush @{pow2(s)}" for s in self.loss_scales),
                *(f"fp16 ovf @{pow2(s)}" for s in self.loss_scales)]
        rows = [[m.name, num(m.grad_output["fp16"][0].amax), *(pct(s.flushed) for s in m.grad_output["fp16"]),
                 *(pct(s.overflow) for s in m.grad_output["fp16"])] for m in self.modules.values()]
        rows += [[p.name, num(p.grad["fp16"][0].amax), *(pct(s.flushed) for s in p.grad["fp16"]),
                  *(pct(s.overflow) for s in p.grad["fp16"])] for p in self.params.values()]
        return ["## Gradients of module outputs and parameters (fp32 reference)", "", *_table(head, rows), ""]

    def _lost_update_table(self) -> list[str]:
        head = ["parameter", "shape", *(f"{fmt} lost" for fmt in self.storage_formats)]
        rows = [["all", "", *(pct(self.lost_update(f)) for f in self.storage_formats)]]
        rows += [[p.name, "x".join(map(str, p.shape)), *(pct(p.lost_update(f)) for f in self.storage_formats)]
                 for p in self.params.values()]
        return ["## Lost updates (weights stored in the format without fp32 master weights)", "",
                *_table(head, rows), ""]

    # ------------------------------------------------------------------ heatmap
    def heatmap(self, path: str | Path) -> Path:
        """Write a PNG: leaf modules (rows) x formats (columns), colour = worst risk.

        Risk per cell (:func:`mixprec.numerics.advice.risk`; block formats:
        :func:`mixprec.numerics.block_advice.block_risk`, linears only): 0 fine, 1 marginal, 2 flagged; the
        cell text names the worst flag kind or the SQNR. fp16 gradients are judged at the
        recommended loss scale, and in an extra column at loss scale 1. Uses matplotlib's Agg
        canvas directly (no pyplot, no global backend change). Returns the path.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure

        names = list(self.modules)
        columns = [(fmt, fmt, None) for fmt in self.formats]
        if "fp16" in self.formats and self.recommended_loss_scale != 1.0:
            columns.insert(self.formats.index("fp16") + 1, ("fp16\nloss scale 1", "fp16", 1.0))
        cells = [[advice.risk(self, name, fmt, loss_scale=scale) for _, fmt, scale in columns]
                 + [block_risk(self, name, fmt) for fmt in self.block_formats] for name in names]
        columns += [(fmt, fmt, None) for fmt in self.block_formats]
        values = [[level for level, _ in row] for row in cells]   # -1: a block-format cell of no linear (grey)
        fig = Figure(figsize=(2.0 + 1.3 * len(columns), 1.2 + 0.28 * max(1, len(names))))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        cmap = ListedColormap(["#e4e4e4", "#9ed9a0", "#f5d36b", "#e0675f"])
        ax.imshow(values or [[0] * len(columns)], cmap=cmap, vmin=-1, vmax=2, aspect="auto")
        ax.set_xticks(range(len(columns)), labels=[label for label, _, _ in columns])
        ax.set_yticks(range(len(names)), labels=names, fontsize=7)
        ax.xaxis.tick_top()
        for i, row in enumerate(cells):
            for j, (_, text) in enumerate(row):
                ax.text(j, i, text, ha="center", va="center", fontsize=6)
        fig.suptitle("worst risk per module and format: green fine, yellow marginal, red flagged\n"
                     "cells: the flag, or the output's SQNR vs fp32 in dB; fp16 gradients at the recommended "
                     f"loss scale {pow2(self.recommended_loss_scale)} unless noted"
                     + ("; block formats: linears' worst operand SQNR, grey: no linear" if self.block else ""),
                     fontsize=8, wrap=True)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
        return out


# ---------------------------------------------------------------------- helpers
def _fp8(report: NumericsReport) -> set[str]:
    return {f for f in report.formats if get_format(f).bits == 8}


def _db(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else str(x)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _encode(value: Any) -> Any:
    if isinstance(value, Policy):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(tp: Any, value: Any) -> Any:
    """Rebuild a value of type ``tp`` (a dataclass, Policy, float, dict/tuple/Optional of them)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        return _decode(next(a for a in args if a is not type(None)), value)
    if tp is Policy:
        return Policy.parse(value)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _decode(hints[f.name], value[f.name]) for f in dataclasses.fields(tp)
                     if f.name in value or f.default is dataclasses.MISSING})   # a later field: its default
    if tp is float:
        return float(value)
    if origin is dict:
        return {k: _decode(args[1], v) for k, v in value.items()}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value))
    return value
