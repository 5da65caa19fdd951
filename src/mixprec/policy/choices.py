"""The allowed values of a :class:`~mixprec.policy.policy.Policy`'s fields, and the text names of dtypes.

``STATE_FORMATS`` maps the text names of optimizer-state formats to dtypes; :func:`state_name` reads it
back. The other tuples are the allowed strings of ``rounding``, ``state_rounding``, ``fp8``, ``fp8_format``,
``block``, ``ops``, ``kernels`` and ``saved``. ``BLOCK_RECIPE_NAMES`` are the names of
:data:`mixprec.blockscale.BLOCK_RECIPES` and ``BLOCK_RECIPE_PARTS`` the parts each has on (the policy layer does
not import the layer it describes; tests/policy checks they agree).
"""

from __future__ import annotations

from typing import Union

import torch

from mixprec.formats import get_format

__all__ = ["ROUNDINGS", "STATE_FORMATS", "QUANTIZED_STATE_DTYPES", "STATE_ROUNDINGS", "FP8_RECIPES", "FP8_FORMATS",
           "BLOCK_RECIPE_NAMES", "BLOCK_RECIPE_PARTS", "BLOCK_COMPUTE_DTYPES",
           "OPS_MODES", "KERNEL_MODES", "SAVED_MODES", "LossScaleSpec",
           "state_name", "default_state_rounding", "SR_STATE_DTYPES", "default_saved"]

ROUNDINGS = ("nearest", "kahan", "stochastic")
# optimizer-state formats by text name. int8 and fp8 are markers for the blockwise 8-bit formats of
# mixprec.optim.quantized_state (int8: dynamic-map codes, stored as uint8 indices; fp8: E4M3 first moment,
# E5M2 second), not plain casts: Policy.state_dtype holds torch.int8 / torch.float8_e4m3fn for them
STATE_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                 "int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANTIZED_STATE_DTYPES = (torch.int8, torch.float8_e4m3fn)
STATE_ROUNDINGS = ("nearest", "stochastic")   # how 8-bit and bf16 state is rounded when stored
SR_STATE_DTYPES = QUANTIZED_STATE_DTYPES + (torch.bfloat16,)   # the state formats state_rounding applies to
FP8_RECIPES = ("tensorwise", "rowwise", "delayed")
FP8_FORMATS = ("hybrid", "e4m3")
BLOCK_RECIPE_NAMES = ("mxfp8", "nvfp4", "nvfp4-plain")   # mixprec.blockscale.BLOCK_RECIPES' keys
# the parts each recipe has on, which block_disable may turn off (mixprec.blockscale.recipe.RECIPE_PARTS' keys)
BLOCK_RECIPE_PARTS = {"mxfp8": ("ends",), "nvfp4": ("hadamard", "sr", "2d", "tail", "ends"),
                      "nvfp4-plain": ("2d", "ends")}
BLOCK_COMPUTE_DTYPES = (torch.bfloat16,)   # block-scaled linears train under bf16 compute (the recipes' own)
OPS_MODES = ("portable", "native")     # mixprec.autocast.portable: which autocast op lists mp.autocast() uses
KERNEL_MODES = ("measured", "native")  # mixprec.autocast.op_plan: whether mp.autocast() runs the measured op plan
SAVED_MODES = ("compute", "rebuild", "fp32")   # mixprec.autocast.saved_dtype (+ saved_rebuilds for "rebuild")
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF_DTYPES = (torch.bfloat16, torch.float16)

LossScaleSpec = Union[str, float]

def _dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else get_format(dtype).name


def state_name(dtype: torch.dtype) -> str:
    """The text name of an optimizer-state dtype (a :data:`STATE_FORMATS` value): ``"int8"`` for
    ``torch.int8``, ``"fp8"`` for ``torch.float8_e4m3fn``, ``"fp32"``... Raises ValueError for another dtype."""
    for name, value in STATE_FORMATS.items():
        if value == dtype:
            return name
    raise ValueError(f"state dtype {dtype!r} is not an optimizer-state format; choose one of {list(STATE_FORMATS)}")



def default_state_rounding(dtype: torch.dtype) -> str:
    """How state of format ``dtype`` is rounded when a policy or optimizer leaves ``state_rounding`` unset:
    ``"stochastic"`` for bf16 (round-to-nearest loses Adam's second-moment increments below half a bf16
    ulp: with beta2 = 0.999, ``exp_avg_sq`` stops growing at ~1/4 of its fp32 value), else ``"nearest"``."""
    return "stochastic" if dtype == torch.bfloat16 else "nearest"


def default_saved(compute_dtype: torch.dtype) -> str:
    """What a policy's norms save for backward when ``saved`` is unset: ``"compute"`` (the bf16 input, fp32
    statistics; :mod:`mixprec.autocast.saved_dtype`) under bf16 compute, else ``"fp32"`` (fp16's range cannot
    hold every fp32 norm input; under fp32 compute there is nothing lower to save)."""
    return "compute" if compute_dtype == torch.bfloat16 else "fp32"
