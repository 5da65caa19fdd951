"""Block-scaled formats: MXFP8 / MXFP6 / MXFP4 (OCP Microscaling v1.0) and NVFP4, quantized bit for bit, and
linears that train in them: by emulation, and natively on NVIDIA Blackwell.

The formats are data in :mod:`mixprec.formats` (:class:`~mixprec.formats.BlockFormat`, presets
``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e2m3``, ``mxfp6_e3m2``, ``mxfp4_e2m1``, ``nvfp4``). Here:
:func:`quantize` cuts a tensor's last dim into blocks and returns a :class:`BlockQuantized` (element codes,
block scale codes, NVFP4's tensor scale), whose :meth:`~BlockQuantized.dequantize` (or :func:`dequantize`) gives
fp32 back; :func:`round_to_element` rounds fp32 values onto an element format's grid (nearest-even or
stochastic), :func:`encode` / :func:`decode` convert element values and codes; :func:`fake_quantize` gives
``quantize(...).dequantize()``'s values bit for bit without the codes, in a few passes (the GEMMs' path). The algorithms and the
conventions chosen where the specs are silent are stated in :mod:`mixprec.blockscale.quantize` and
:mod:`mixprec.blockscale.scales`.

Training: a :class:`BlockRecipe` (presets ``"mxfp8"``, ``"nvfp4"``, ``"nvfp4-plain"`` by
:func:`get_block_recipe`; :mod:`mixprec.blockscale.recipe` cites where each default comes from) says which
format each GEMM operand takes along which dim, 1D or 2D weight blocks, the random Hadamard transform of the
wgrad GEMM's inputs (:func:`hadamard_transform`), stochastic rounding of gradients, and which layers stay in the
compute dtype. :class:`BlockScaledLinear` runs a linear's three GEMMs that way (quantize, dequantize, fp32 GEMM:
:mod:`mixprec.blockscale.gemm`; between forward and backward it keeps ``x``'s wgrad operand packed in the format's
bytes, :mod:`mixprec.blockscale.packing`), and :func:`convert_to_block_scaled` swaps a model's linears, reporting what it
kept and why (:func:`plan_block_conversion`: the same report, nothing swapped; :func:`revert_block_scaled` swaps
them back). The emulation is fp32 tensor arithmetic: any device, no host sync,
``torch.compile``-able (CPU speed is emulation speed). On a device whose ``torch.nn.functional.scaled_mm`` runs
the formats (CUDA capability 10.0+) the same quantized operands go to it instead, once a probe GEMM matched the
emulation (:mod:`mixprec.blockscale.native`; ``BlockRecipe.gemm`` chooses).
"""

from mixprec.blockscale.convert import (BlockConversionReport, block_state_keys, check_keep_patterns,
                                        convert_to_block_scaled, find_blocks, plan_block_conversion,
                                        revert_block_scaled)
from mixprec.blockscale.elements import decode, encode, round_to_element
from mixprec.blockscale.fakequant import fake_quantize
from mixprec.blockscale.hadamard import (hadamard_matrix, hadamard_transform, inverse_hadamard_transform,
                                         random_signs, sylvester)
from mixprec.blockscale.linear import BlockScaledLinear, shape_problems
from mixprec.blockscale.quantize import BlockQuantized, dequantize, quantize
from mixprec.blockscale.recipe import BLOCK_RECIPES, GEMMS, RECIPE_PARTS, BlockRecipe, get_block_recipe

__all__ = ["BLOCK_RECIPES", "GEMMS", "RECIPE_PARTS",
           "BlockConversionReport", "BlockQuantized", "BlockRecipe", "BlockScaledLinear",
           "block_state_keys", "check_keep_patterns", "convert_to_block_scaled", "decode", "dequantize", "encode",
           "fake_quantize",            "find_blocks", "get_block_recipe", "hadamard_matrix", "hadamard_transform", "inverse_hadamard_transform",
           "plan_block_conversion", "quantize", "random_signs", "revert_block_scaled", "round_to_element",
           "shape_problems", "sylvester"]
