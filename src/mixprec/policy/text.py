"""A policy's text form: the ``key=value`` alias table that :meth:`Policy.parse` reads, the long form
``str(policy)`` writes, and parse errors that suggest the closest name ("did you mean").

The functions take the presets as an argument (:data:`mixprec.policy.policy.PRESETS`), so this module
does not import the :class:`~mixprec.policy.policy.Policy` it parses into.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

import torch

from mixprec.formats import get_format
from mixprec.policy.choices import (_COMPUTE_DTYPES, BLOCK_RECIPE_NAMES, FP8_FORMATS, FP8_RECIPES, KERNEL_MODES, OPS_MODES, ROUNDINGS,
                                    SAVED_MODES, STATE_FORMATS, STATE_ROUNDINGS, LossScaleSpec, _dtype_name, default_saved,
                                    default_state_rounding, state_name)

__all__ = ["parse_parts", "canonical_text", "text_items"]


def _did_you_mean(text: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``text`` (difflib), else ""."""
    names = [str(c) for c in choices]
    close = (difflib.get_close_matches(text.lower(), names, n=1, cutoff=0.6)
             or difflib.get_close_matches(text.lower().replace("_", "-"), names, n=1, cutoff=0.6))
    return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_dtype(key: str, text: str, allowed: tuple[torch.dtype, ...], allow_none: bool = False):
    names = [_dtype_name(d) for d in allowed] + (["none"] if allow_none else [])
    if allow_none and text.strip().lower() in ("none", "-", ""):
        return None
    try:
        dtype = get_format(text).dtype
    except ValueError:
        dtype = None
    if dtype not in allowed:
        raise ValueError(f"policy key {key}={text!r} is not allowed{_did_you_mean(text, names)}; choose one of {names}")
    return dtype


def _loss_scale_text(value: LossScaleSpec) -> str:
    return value if isinstance(value, str) else repr(float(value))

def _parse_loss_scale(key: str, text: str) -> LossScaleSpec:
    low = text.lower()
    if low in ("dynamic", "none"):
        return low
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"policy key {key}={text!r} is not allowed; use 'dynamic', 'none' or a number") from None
    return value


def _parse_rounding(key: str, text: str) -> str:
    if text.lower() not in ROUNDINGS:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {ROUNDINGS}")
    return text.lower()


def _parse_state(key: str, text: str) -> torch.dtype:
    low = text.strip().lower()
    if low in STATE_FORMATS:
        return STATE_FORMATS[low]
    try:   # the 16/32-bit formats' aliases (float32, half, ...)
        return _parse_dtype(key, text, _COMPUTE_DTYPES)
    except ValueError:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {list(STATE_FORMATS)}") from None


def _parse_state_rounding(key: str, text: str) -> str:
    if text.lower() not in STATE_ROUNDINGS:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {STATE_ROUNDINGS}")
    return text.lower()


def _parse_keep(key: str, text: str) -> tuple[str, ...]:
    return tuple(p for p in text.split("|") if p)


def _parse_fp8_format(key: str, text: str) -> str:
    if text.lower() not in FP8_FORMATS:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {FP8_FORMATS}")
    return text.lower()


def _parse_fp8_ends(key: str, text: str) -> bool:
    low = text.lower()
    if low not in ("keep", "fp8"):
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose 'keep' (first and last linears stay in "
                         "the compute dtype) or 'fp8' (convert them too)")
    return low == "keep"


def _parse_ops(key: str, text: str) -> str:
    if text.lower() not in OPS_MODES:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {OPS_MODES}")
    return text.lower()


def _parse_kernels(key: str, text: str) -> str:
    if text.lower() not in KERNEL_MODES:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {KERNEL_MODES}")
    return text.lower()


def _parse_saved(key: str, text: str) -> str:
    if text.lower() not in SAVED_MODES:
        raise ValueError(f"policy key {key}={text!r} is not allowed{_did_you_mean(text, SAVED_MODES)}; choose one of "
                         f"{SAVED_MODES} (compute: norms save their input in bf16; rebuild: that, and weight copies and GELU/SiLU "
                         "outputs rebuilt in backward; fp32: as torch.autocast)")
    return text.lower()


def _parse_fp8(key: str, text: str) -> str | None:
    low = text.lower()
    if low in ("none", ""):
        return None
    if low not in FP8_RECIPES:
        raise ValueError(f"policy key {key}={text!r} is not allowed; choose one of {FP8_RECIPES} or none")
    return low


def _parse_block(key: str, text: str) -> str | None:
    low = text.strip().lower().replace("_", "-")
    if low in ("none", ""):
        return None
    if low not in BLOCK_RECIPE_NAMES:
        raise ValueError(f"policy key {key}={text!r} is not allowed{_did_you_mean(low, BLOCK_RECIPE_NAMES)}; choose "
                         f"one of {BLOCK_RECIPE_NAMES} (block-scaled recipes, mixprec.blockscale) or none")
    return low


_KEYS = {
    "params": ("param_dtype", lambda k, v: _parse_dtype(k, v, _COMPUTE_DTYPES)),
    "compute": ("compute_dtype", lambda k, v: _parse_dtype(k, v, _COMPUTE_DTYPES)),
    "output": ("output_dtype", lambda k, v: _parse_dtype(k, v, _COMPUTE_DTYPES)),
    "master": ("master_dtype", lambda k, v: _parse_dtype(k, v, (torch.float32,), allow_none=True)),
    "rounding": ("rounding", _parse_rounding),
    "state": ("state_dtype", _parse_state),
    "state_rounding": ("state_rounding", _parse_state_rounding),
    "loss_scale": ("loss_scale", _parse_loss_scale),
    "keep_fp32": ("keep_fp32", _parse_keep),
    "fp8": ("fp8", _parse_fp8),
    "recipe": ("fp8", _parse_fp8),
    "fp8_format": ("fp8_format", _parse_fp8_format),
    "fp8_ends": ("fp8_keep_ends", _parse_fp8_ends),
    "block": ("block", _parse_block),
    "block_keep": ("block_keep", _parse_keep),
    "block_disable": ("block_disable", lambda k, v: tuple(p.strip().lower() for p in v.split("|")
                                                          if p.strip() and p.strip().lower() != "none")),
    "ops": ("ops", _parse_ops),
    "kernels": ("kernels", _parse_kernels),
    "saved": ("saved", _parse_saved),
}


_PRECISION_FIELDS = {"param_dtype", "compute_dtype"}   # a keys-only text must set one: it says what precision runs


def parse_parts(text: str, presets: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The preset a policy text starts from (``presets["fp32"]`` when it gives only keys, which must then include
    ``params=`` or ``compute=``: ``"saved=fp32"`` alone is refused, not silently fp32) and the field
    changes its ``key=value`` parts make, e.g. ``"bf16-kahan,state=bf16"`` -> (bf16-kahan, {state_dtype:
    torch.bfloat16}). Raises ValueError for an empty text, an unknown preset or key, a key given twice or a
    bad value; the message lists what is allowed."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"policy {text!r} is empty; choose a preset from {sorted(presets)} or 'key=value,...'")
    base, named = presets["fp32"], "=" not in parts[0]
    if named:
        base = _preset(text, parts.pop(0).lower(), parts, presets)
    changes: dict[str, Any] = {}
    seen: set[str] = set()
    for part in parts:
        if "=" not in part:
            raise ValueError(f"policy part {part!r} in {text!r} is not 'key=value'; a preset name "
                             f"may only come first; keys: {sorted(_KEYS)}")
        key, _, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key not in _KEYS:
            raise ValueError(f"policy key {key!r} in {text!r} is not known{_did_you_mean(key, _KEYS)}; "
                             f"choose from {sorted(_KEYS)}")
        field, parse_value = _KEYS[key]
        if field in seen:
            raise ValueError(f"policy {text!r} sets {field} twice (key {key!r}); give each key once")
        seen.add(field)
        changes[field] = parse_value(key, value)
    if not named and not seen & _PRECISION_FIELDS:
        keys = ",".join(parts)
        fits = [f"'{name},{keys}'" for name in ("bf16-mixed", "fp32") if _valid(presets[name], changes)]
        raise ValueError(f"policy {text!r} names no preset and no params=/compute= dtype, so it would silently "
                         f"be the fp32 preset with {keys}; name a preset first"
                         f"{', e.g. ' + ' or '.join(fits) if fits else ''}; presets: {sorted(presets)}")
    return base, changes


def _valid(preset: Any, changes: dict[str, Any]) -> bool:
    """Whether ``changes`` make a valid policy of ``preset`` that differs from it (a suggestion that changes nothing,
    e.g. ``'fp32,saved=fp32'``, is no suggestion)."""
    try:
        return preset.replace(**changes) != preset
    except (ValueError, TypeError):
        return False


def _preset(text: str, name: str, overrides: list[str], presets: Mapping[str, Any]) -> Any:
    """The preset ``name`` that starts ``text``; ValueError for ``auto`` (device-dependent) or an unknown name."""
    if name == "auto" and overrides:
        raise ValueError(f"policy {text!r}: 'auto' takes no overrides; resolve it first, then add them: "
                         "mixprec.Policy.parse(str(mixprec.resolve_policy('auto', device, model=..., "
                         f"example_batch=...)) + {','.join([''] + overrides)!r})")
    if name == "auto":
        raise ValueError("policy 'auto' depends on the device; resolve it with "
                         "mixprec.resolve_policy('auto', device)")
    if name not in presets:   # a bare dtype name (bf16, nvfp4) means its -mixed preset, not the closest spelling
        hint = f" (did you mean {name + '-mixed'!r}?)" if name + "-mixed" in presets else _did_you_mean(name, presets)
        raise ValueError(f"policy preset {name!r} is not known{hint}; choose one of "
                         f"{sorted(presets) + ['auto']} or give 'key=value,...'")
    return presets[name]


def canonical_text(policy: Any, presets: Mapping[str, Any]) -> str:
    """``str(policy)``: a preset's name, else the closest preset plus the keys that differ (when that text
    parses back to ``policy``, e.g. ``"bf16-mixed,kernels=native"``), else every key. Of presets equally close,
    one whose linears are of the policy's kind (fp8, the block recipe's family or neither) is preferred:
    ``"nvfp4-mixed,block=nvfp4-plain"``, ``"fp8-mixed,fp8=delayed"``."""
    for name, preset in presets.items():
        if preset == policy:
            return name
    mine = dict(text_items(policy))

    def distance(item: tuple[str, Any]) -> tuple[int, bool]:
        preset = item[1]
        return (sum(v != mine.get(k) for k, v in text_items(preset)), _linear_kind(preset) != _linear_kind(policy))
    for name, preset in sorted(presets.items(), key=distance):
        diffs = [f"{k}={v}" for k, v in text_items(policy) if dict(text_items(preset)).get(k) != v]
        text = ",".join([name, *diffs])
        if len(diffs) <= 3 and type(policy).parse(text) == policy:
            return text
        break
    return ",".join(f"{k}={v}" for k, v in text_items(policy))


def _linear_kind(policy: Any) -> str:
    """``"fp8"``, the block recipe's family (``"nvfp4"`` for ``nvfp4-plain``) or ``"compute"``."""
    return "fp8" if policy.fp8 is not None else policy.block.split("-")[0] if policy.block is not None else "compute"


def text_items(policy: Any) -> list[tuple[str, str]]:
    """The policy as text keys and values (the long form's order)."""
    items = [
        ("params", _dtype_name(policy.param_dtype)),
        ("compute", _dtype_name(policy.compute_dtype)),
        ("output", _dtype_name(policy.output_dtype)),
        ("master", _dtype_name(policy.master_dtype)),
        ("rounding", policy.rounding),
        ("state", state_name(policy.state_dtype)),
        ("loss_scale", _loss_scale_text(policy.loss_scale)),
        ("keep_fp32", "|".join(policy.keep_fp32)),
        ("fp8", policy.fp8 or "none"),
        ("block", policy.block or "none"),
    ]
    if policy.block_keep:
        items.append(("block_keep", "|".join(policy.block_keep)))
    if policy.block_disable:
        items.append(("block_disable", "|".join(policy.block_disable)))
    if policy.fp8 is not None:
        items.append(("fp8_format", policy.fp8_format))
        items.append(("fp8_ends", "keep" if policy.fp8_keep_ends else "fp8"))
    if policy.state_rounding != default_state_rounding(policy.state_dtype):
        items.append(("state_rounding", policy.state_rounding))
    if policy.ops != "portable":
        items.append(("ops", policy.ops))
    if policy.kernels != "measured":
        items.append(("kernels", policy.kernels))
    if policy.saved != default_saved(policy.compute_dtype):
        items.append(("saved", policy.saved))
    return items
