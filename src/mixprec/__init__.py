"""mixprec: mixed-precision training for PyTorch — policies, loss scaling, master weights,
low-precision optimizers, and the evidence to trust them."""

from mixprec import fp8, ops, optim
from mixprec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mixprec.machine.capability import probe
from mixprec.policy.resolve import resolve_policy
from mixprec.ema import EMA
from mixprec.engine.mixed_precision import DivergenceError, MixedPrecision, StepResult
from mixprec.formats import Format, get_format
from mixprec.guard import Guard
from mixprec.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale
from mixprec.numerics import NumericsReport, Recommendation, inspect, locate_nonfinite
from mixprec.policy.policy import PRESETS, Policy

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DivergenceError",
    "DynamicLossScale",
    "EMA",
    "Format",
    "Guard",
    "MixedPrecision",
    "NoLossScale",
    "PRESETS",
    "NumericsReport",
    "Policy",
    "Recommendation",
    "StaticLossScale",
    "StepResult",
    "fp8",
    "get_format",
    "inspect",
    "load_checkpoint",
    "locate_nonfinite",
    "ops",
    "optim",
    "probe",
    "resolve_policy",
    "save_checkpoint",
]
