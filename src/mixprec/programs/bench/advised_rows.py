"""The bench's advised rows: ``advised`` (the numerics advisor's 16-bit policy for this device) and
``advised:<block format>`` (the block policy the inspector advises for a run in that format: the format's recipe
with ``block_keep`` naming the linears to keep in bf16), each replaced by the policy the inspection advises and
then run and judged like any other row.

``advised:nvfp4`` inspects the workload as ``mixprec inspect --formats nvfp4`` does (4 fp32 steps; each linear's
``x``, ``W`` and ``dy`` as the recipe's GEMMs read them) and runs
:func:`mixprec.numerics.block_advice.advise_block`'s policy. Overrides after the name apply to the format's preset
before the inspection, which then judges under that recipe: ``advised:nvfp4,block_disable=sr`` inspects and
runs NVFP4 without stochastic rounding. Requests that need the same inspection share one (``advised`` and every
override-free ``advised:<format>`` inspect once, under fp32). The bench's gate on the row is the evidence that the
advice trains. ``advised+recompute`` and ``advised:nvfp4+recompute`` are the advised policy's ``+recompute`` rows
(the bench maps the suffix; requests here come without it). Under a strategy rank 0 inspects and every rank runs
its rows.

Bad requests raise ``ValueError`` before anything trains: an unknown block format, an elementwise one
(``advised:bf16``: the 16-bit advice is ``advised``), a format no recipe runs (``mxfp4``), overrides that leave
the format (``advised:nvfp4,block=mxfp8``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mixprec.blockscale import BLOCK_RECIPES, get_block_recipe
from mixprec.formats import get_block_format
from mixprec.policy.linears import block_preset_text
from mixprec.policy.policy import Policy

__all__ = ["ADVISED", "ADVISED_BLOCK", "AdvisedRows", "is_advised", "check_requests", "advise_rows", "merged_rows",
           "merged_lines"]

ADVISED = "advised"          # --policies advised: run what `mixprec inspect` recommends for this device
ADVISED_BLOCK = "advised:"   # --policies advised:nvfp4[,overrides]: the block policy it advises for that format
_UNDER_STUDY = "fp32"        # the policy an override-free inspection studies (mixprec inspect's default)


@dataclass(frozen=True)
class AdvisedRows:
    """What the advised requests became: ``names`` maps each request (as given in ``--policies``) to the policy
    text of its row; ``record`` is results.json's ``advice`` (``policy``, ``reasons``, ``initial_loss_scale`` for
    ``advised``; ``block``: one entry per ``advised:<format>`` request; ``merged``: :func:`merged_rows`, when an
    advised policy is a row another request also names) or None when none was asked."""

    names: dict[str, str]
    record: dict[str, Any] | None

    def reasons(self, request: str) -> list[str]:
        """The advice's reasons for ``request`` (one of :attr:`names`)."""
        if request.strip().lower() == ADVISED:
            return list((self.record or {}).get("reasons", []))
        return next(b["reasons"] for b in (self.record or {}).get("block", []) if b["request"] == request)


def is_advised(name: str) -> bool:
    """True for ``advised`` and ``advised:<format>[,overrides]`` (case-insensitive)."""
    key = name.strip().lower()
    return key == ADVISED or key.startswith(ADVISED_BLOCK)


def _block_request(name: str) -> tuple[str, Policy]:
    """``advised:<format>[,overrides]`` → (the block format's name, the base policy the inspection studies)."""
    head, _, overrides = name.strip().partition(",")
    spec = head[len(ADVISED_BLOCK):].strip()
    presets: dict[str, str] = {}   # block format -> the first preset recipe quantizing every operand in it
    for r in BLOCK_RECIPES.values():
        if r.grad_format is None:
            presets.setdefault(get_block_format(r.format).name, r.name)
    hint = f"e.g. advised:nvfp4 (block formats a recipe runs: {', '.join(sorted(presets))})"
    if not spec:
        raise ValueError(f"--policies {name!r}: name a block format after 'advised:', {hint}")
    try:
        fmt = get_block_format(spec).name
    except ValueError:
        raise ValueError(f"--policies {name!r}: {spec!r} is not a block format; {hint}; for the 16-bit "
                         "advice on this device use 'advised'") from None
    preset = presets.get(fmt)
    if preset is None:
        raise ValueError(f"--policies {name!r}: no policy runs {fmt} linears ({hint}); `mixprec inspect --formats "
                         f"{spec}` measures the linears in it without a policy to run")
    base = Policy.parse(block_preset_text(preset) + (f",{overrides}" if overrides.strip() else ""))
    if base.block is None or get_block_format(get_block_recipe(base.block).format).name != fmt:
        raise ValueError(f"--policies {name!r}: the overrides leave {fmt} (block={base.block}); "
                         f"advised:{spec} advises a {fmt} run: drop the block= override")
    return fmt, base


def _groups(requests: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """The inspections to run: the policy under study (text) → its requests ``(name, block format or None)``."""
    groups: dict[str, list[tuple[str, str | None]]] = {}
    for name in requests:
        if name.strip().lower() == ADVISED:
            groups.setdefault(_UNDER_STUDY, []).append((name, None))
            continue
        fmt, base = _block_request(name)
        plain = not name.partition(",")[2].strip()
        groups.setdefault(_UNDER_STUDY if plain else str(base), []).append((name, fmt))
    return groups


def check_requests(requests: list[str]) -> None:
    """Raise ValueError for the first bad advised request (module docstring); nothing is inspected."""
    _groups(requests)


def advise_rows(requests: list[str], inspect_workload, **workload: Any) -> AdvisedRows:
    """Inspect for each advised request (module docstring) and return the rows' policies and the record.

    ``inspect_workload``: :func:`mixprec.numerics.workload.inspect_workload` (passed in, so the planning module
    imports the numerics only when asked); ``workload``: its workload arguments (``workload``, ``config``,
    ``data``, ``device``, ``lora``). ``advised`` reads ``auto``'s speed measurement, block requests do not.

    Raises:
        ValueError: a bad request (module docstring), before any inspection.
    """
    from mixprec.numerics.block_advice import advise_block
    from mixprec.numerics.inspect import DEFAULT_FORMATS

    groups = _groups(requests)   # every request checked before the first inspection
    names: dict[str, str] = {}
    record: dict[str, Any] = {}
    for under_study, group in groups.items():
        formats = tuple(dict.fromkeys(DEFAULT_FORMATS + tuple(f for _, f in group if f)))
        elementwise = any(f is None for _, f in group)
        report = inspect_workload(policy=under_study, formats=formats, speed=elementwise, **workload)
        for name, fmt in group:
            if fmt is None:
                rec = report.recommend()
                names[name] = str(rec.policy)
                record.update(policy=str(rec.policy), reasons=list(rec.reasons),
                              initial_loss_scale=rec.initial_loss_scale)
                continue
            base = None if under_study == _UNDER_STUDY else Policy.parse(under_study)
            advice = advise_block(report, fmt, base=base)
            names[name] = str(advice.policy)
            command = (f"mixprec inspect --formats {fmt}" if base is None else
                       f"mixprec inspect --policy '{base}' --formats {','.join(formats)}")
            record.setdefault("block", []).append({
                "request": name, "format": advice.format, "recipe": advice.recipe, "policy": str(advice.policy),
                "inspected_as": command,
                "kept_in_bf16": list(advice.kept_in_bf16()), "block_keep_added": list(advice.keep),
                "reasons": list(advice.reasons)})
    return AdvisedRows(names, record or None)


def merged_rows(names: list[str], rows: dict[str, str]) -> list[dict[str, Any]]:
    """The advised requests that share their row: ``names`` are the rows asked for (the reference and the
    advised requests included), ``rows`` maps each advised request to its row's name. One entry per advised
    request whose row another of ``names`` also names: ``{request, row, also_asked_as}`` (results.json's
    ``advice.merged``: that row runs once and answers every one of them)."""
    return [{"request": n, "row": row, "also_asked_as": others} for n, row in rows.items()
            if (others := [m for m in names if m != n and rows.get(m, m) == row])]


def merged_lines(results: dict) -> list[str]:
    """The console's line per merged advised request (:func:`merged_rows`): the policy it resolved to and the one
    row that runs for it."""
    lines = []
    for m in (results.get("advice") or {}).get("merged", []):
        also = ("the fp32 reference" if m["row"] == results.get("reference") else
                "also asked for as " + ", ".join(m["also_asked_as"]))
        lines.append(f"{m['request']} resolved to {m['row']} and runs as that row ({also}: it ran once)")
    return lines
