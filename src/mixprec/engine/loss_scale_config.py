"""The loss scales' hyperparameters: one frozen dataclass per :mod:`mixprec.engine.loss_scale` type, each
validating itself when built (ValueError naming the field, the value, what it must be and an example).

Every bound is read from ``torch.finfo(torch.float32)``: the scale is an fp32 tensor, so a scale must be a
normal fp32 number (never 0, denormal or inf), and the counters' limits are int32's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NoConfig", "StaticConfig", "DynamicConfig"]

_FP32 = torch.finfo(torch.float32)


def _check(owner: str, name: str, value: Any, ok: bool, allowed: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"{owner} {name}={value!r} is not allowed; it must be {allowed}; {fix}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_scale(x: Any) -> bool:
    """A number whose fp32 value is normal and finite (so the scale is never 0, denormal or inf)."""
    return _is_number(x) and math.isfinite(x) and _FP32.tiny <= x <= _FP32.max


@dataclass(frozen=True)
class NoConfig:
    """``NoLossScale`` has no hyperparameters."""


@dataclass(frozen=True)
class StaticConfig:
    """``scale``: the fixed loss scale (a normal fp32 number > 0)."""

    scale: float

    def __post_init__(self) -> None:
        _check("StaticLossScale", "scale", self.scale, _is_scale(self.scale),
               f"a normal fp32 number in [{_FP32.tiny}, {_FP32.max}]", "e.g. scale=1024.0")


@dataclass(frozen=True)
class DynamicConfig:
    """Hyperparameters of :class:`DynamicLossScale` (see its docstring for the sources)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        own = "DynamicLossScale"
        _check(own, "min_scale", self.min_scale, _is_scale(self.min_scale),
               f"a normal fp32 number > 0 (>= {_FP32.tiny})", "e.g. min_scale=1.0 or 2**-4")
        _check(own, "max_scale", self.max_scale, _is_scale(self.max_scale) and self.max_scale >= self.min_scale,
               f"a finite fp32 number >= min_scale={self.min_scale!r}", "e.g. max_scale=2**24")
        _check(own, "init_scale", self.init_scale,
               _is_number(self.init_scale) and self.min_scale <= self.init_scale <= self.max_scale,
               f"a number in [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}]",
               "e.g. init_scale=2**16, or widen min_scale/max_scale")
        _check(own, "growth_factor", self.growth_factor,
               _is_number(self.growth_factor) and 1.0 < self.growth_factor <= _FP32.max,
               "a finite number > 1", "e.g. growth_factor=2.0")
        _check(own, "backoff_factor", self.backoff_factor,
               _is_number(self.backoff_factor) and 0.0 < self.backoff_factor < 1.0,
               "a number in (0, 1)", "e.g. backoff_factor=0.5")
        for name, example in (("growth_interval", 2000), ("hysteresis", 1)):
            value = getattr(self, name)
            _check(own, name, value, _is_number(value) and isinstance(value, int) and 1 <= value < 2**31,
                   "an int >= 1 (< 2**31: counters are int32)", f"e.g. {name}={example}")
