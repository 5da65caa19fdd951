"""The checks of an optimizer's arguments: the precision settings (``rounding``, ``state_dtype``,
``state_rounding``) and the param dtypes they can write, numbers in range, and the ``torch.optim`` options
accepted only where they change nothing (as arguments, or in the param groups of a saved state dict). Errors name
the optimizer, the argument, the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

from mixprec.policy.choices import SR_STATE_DTYPES, default_state_rounding
from mixprec.policy.policy import QUANTIZED_STATE_DTYPES, ROUNDINGS, STATE_FORMATS, STATE_ROUNDINGS

__all__ = ["STATE_DTYPES", "check_precision", "check_param_dtypes", "check_torch_options", "check_saved_options",
           "check_number"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = _FLOAT_DTYPES + QUANTIZED_STATE_DTYPES   # int8 / fp8: markers of the blockwise 8-bit formats
_PARAM_DTYPES = _FLOAT_DTYPES + (torch.complex64,)   # complex64: two fp32 values, stepped on its real view


def _check_rounding(owner: str, rounding: str | None) -> str:
    if rounding is None:
        return "nearest"
    if rounding not in ROUNDINGS:
        raise ValueError(f"{owner} rounding={rounding!r} is not allowed; choose one of {ROUNDINGS} "
                         "or None (= 'nearest')")
    return rounding


def _check_state_dtype(owner: str, state_dtype: torch.dtype | str | None) -> torch.dtype:
    """``state_dtype`` as a torch dtype: None is fp32, a name of :data:`mixprec.policy.policy.STATE_FORMATS`
    (``"int8"``, ``"fp8"``, ``"bf16"``...) its dtype."""
    if state_dtype is None:
        return torch.float32
    if isinstance(state_dtype, str) and state_dtype.strip().lower() in STATE_FORMATS:
        return STATE_FORMATS[state_dtype.strip().lower()]
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{owner} state_dtype={state_dtype!r} is not allowed; choose one of "
                         f"{list(STATE_DTYPES)}, a name of {list(STATE_FORMATS)} (e.g. state_dtype='int8'), "
                         "or None (= torch.float32)")
    return state_dtype


def _check_state_rounding(owner: str, state_rounding: str | None, state_dtype: torch.dtype) -> str:
    """``state_rounding`` checked; None is the state format's default (:func:`default_state_rounding`:
    ``"stochastic"`` for bf16 state, else ``"nearest"``)."""
    if state_rounding is None:
        return default_state_rounding(state_dtype)
    if state_rounding not in STATE_ROUNDINGS:
        raise ValueError(f"{owner} state_rounding={state_rounding!r} is not allowed; choose one of "
                         f"{STATE_ROUNDINGS} or None (= 'stochastic' for bf16 state, else 'nearest')")
    if state_rounding != "nearest" and state_dtype not in SR_STATE_DTYPES:
        raise ValueError(f"{owner} state_rounding={state_rounding!r} rounds bf16 or 8-bit state, but state_dtype="
                         f"{state_dtype}; pass state_dtype='bf16' (or 'int8', 'fp8'), or state_rounding='nearest'")
    return state_rounding


def check_param_dtypes(owner: str, params: Iterable[torch.Tensor], rounding: str) -> None:
    """Raise ValueError for a param of a dtype the optimizers here do not step, or an fp16 param under
    ``rounding='stochastic'`` (bf16 only), naming its dtype, shape and the fix."""
    for p in params:
        if p.dtype not in _PARAM_DTYPES:
            raise ValueError(f"{owner} got a param of dtype {p.dtype} (shape {tuple(p.shape)}); allowed param "
                             f"dtypes are {[str(d).replace('torch.', '') for d in _PARAM_DTYPES]}; cast it to one "
                             "of them (e.g. a complex128 or complex32 param to complex64), or use torch.optim")
        if rounding == "stochastic" and p.dtype == torch.float16:
            raise ValueError(f"{owner} rounding='stochastic' needs bf16 params, got param dtype "
                             f"{p.dtype}; use rounding='kahan' (or cast the params to bf16)")


def check_precision(owner: str, param_groups: Iterable[dict[str, Any]], rounding: str | None,
                    state_dtype: torch.dtype | str | None, state_rounding: str | None) -> tuple[str, torch.dtype, str]:
    """``(rounding, state_dtype, state_rounding)`` checked, None as each one's default (``'nearest'``, fp32, the
    state format's rounding), and the params of ``param_groups`` (the optimizer's) checked for that ``rounding``
    (:func:`check_param_dtypes`). Raises ValueError, naming the fix, for the first setting that is not allowed."""
    rounding = _check_rounding(owner, rounding)
    check_param_dtypes(owner, chain.from_iterable(g["params"] for g in param_groups), rounding)
    state_dtype = _check_state_dtype(owner, state_dtype)
    return rounding, state_dtype, _check_state_rounding(owner, state_rounding, state_dtype)


_TORCH_ONLY = "; use torch.optim for it (CUDA graphs, a differentiable step)"
_TORCH_OPTIONS = {   # torch.optim option: (values that change nothing here, the fix for another value)
    "foreach": ((None, False), "; drop it (each tensor is stepped in fp32; there is no multi-tensor kernel)"),
    "fused": ((None, False), "; drop it (each tensor is stepped in fp32; there is no fused kernel)"),
    "capturable": ((False,), _TORCH_ONLY), "differentiable": ((False,), _TORCH_ONLY),
    "maximize": ((False,), "; negate the loss instead (maximize f = minimize -f)"),
    "amsgrad": ((False,), "; use torch.optim.AdamW(amsgrad=True) under an fp32-master policy (e.g. bf16-mixed)"),
}


def check_torch_options(owner: str, options: dict[str, Any], known: tuple[str, ...]) -> None:
    """Raise TypeError for a keyword that is not one of ``known`` torch.optim options, or one whose value
    would change the step (maximize=True, amsgrad=True, fused=True...), naming it and the fix."""
    for name, value in options.items():
        if name not in known:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        noops, fix = _TORCH_OPTIONS[name]
        if value not in noops:
            raise TypeError(f"{owner} {name}={value!r} is a torch.optim option {owner} does not implement (it accepts "
                            f"{name}={' or '.join(map(repr, noops))}){fix}")


def check_saved_options(owner: str, groups: list[dict[str, Any]], unimplemented: Callable[[dict], list[str]]) -> None:
    """Raise ValueError when a saved param group (of a state dict to load) was made with ``torch.optim`` options
    this optimizer does not implement (``unimplemented(group)``: them as ``name=value``), which would load and then
    step differently."""
    for i, group in enumerate(groups):
        if found := unimplemented(group):
            raise ValueError(f"{owner}.load_state_dict: saved param group {i} was made with {', '.join(found)}, "
                             f"which {owner} does not implement (it would step differently); keep training it "
                             "with the torch.optim optimizer that saved it, or save it without those options")


def check_number(owner: str, name: str, value: Any, *, low: float, high: float = math.inf,
                 high_open: bool = False, example: str) -> None:
    """Raise ValueError unless ``low <= value <= high`` (``< high`` when ``high_open``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    ok = low <= number and (number < high if high_open else number <= high)
    if not ok:
        upper = "" if high == math.inf else (f" and < {high}" if high_open else f" and <= {high}")
        raise ValueError(f"{owner} {name}={value!r} is not allowed; it must be a number >= {low}{upper} "
                         f"(e.g. {name}={example})")

