"""The inspector's block-format statistics, as plain data: how each linear's GEMM operands fare in a block format.

Conventions (the one place they are stated; :mod:`mixprec.numerics.block_measure` measures them):

* **operands**: a linear ``y = x @ W^T`` has three, ``x`` (its input, ``(M, K)`` with the leading dims flattened
  into ``M``), ``W`` (``(N, K)``) and ``dy`` (the gradient of its output, ``(M, N)``). Each is measured as every
  GEMM of the recipe that quantizes it reads it (:data:`mixprec.blockscale.recipe.GEMMS`, the recipe's
  ``quantized_gemms``), from the fp32 reference: ``x`` along K (forward) and along M (wgrad, after the recipe's
  Hadamard transform), ``W`` along K (forward) and along N (dgrad), or once in ``b x b`` tiles under 2D weight
  blocks, ``dy`` along N (dgrad) and along M (wgrad, transformed), with the recipe's rounding (stochastic for
  ``dy`` where the recipe says so, from a generator seeded with the recipe's seed). Counts and sums add up over
  these reads, every call and every inspected step.
* **saturated**: share of the blocks holding an element whose scaled magnitude ``|x| / s`` exceeds the element
  format's largest normal (``s``: the block's scale, times NVFP4's tensor scale): the quantizer clamped it (or,
  without saturation, overflowed it). Blocks include the zero padding that fills a contraction to whole blocks.
* **underflow**: share of the non-zero elements that dequantize to zero (flushed).
* **SQNR**: ``10 log10(sum x**2 / sum (x - x_hat)**2)`` in dB, ``x`` the fp32 values the quantizer read (after
  padding and the transform, which is orthonormal: the ratio is the operand's own, up to fp32 rounding), ``x_hat``
  the dequantized ones; ``inf``: exact, ``-inf``: a non-finite ``x_hat``.
* **reference**: per operand, the statistics the same reads give i.i.d. standard normal ``x``, ``W`` and ``dy``
  (256 x 256 each, seeded): what the format and recipe do to well-behaved data (NVFP4 saturates about half its
  blocks there: its E4M3 block scale rounds ``amax / 6`` to nearest, down half the time), whose SQNR the advice
  (:mod:`mixprec.numerics.block_advice`) judges each linear against.

Everything is a Python number: no tensors, no device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BlockStats", "LinearBlockStats", "BlockFormatStats"]


@dataclass(frozen=True)
class BlockStats:
    """One operand of one linear in one block format, summed over its reads (module docstring): counts, and the
    squared norms in fp64 (``signal``: of the values read, ``noise``: of their quantization error)."""

    blocks: int
    saturated_blocks: int
    nonzero: int
    flushed: int
    signal: float
    noise: float

    @property
    def saturated(self) -> float:
        """Share of blocks with a saturated element (0.0 without blocks)."""
        return self.saturated_blocks / self.blocks if self.blocks else 0.0

    @property
    def underflow(self) -> float:
        """Share of non-zero elements flushed to zero (0.0 without any)."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def sqnr_db(self) -> float:
        """SQNR in dB (``inf`` when exact, ``-inf`` for a non-finite error or an all-zero signal with an error)."""
        if math.isnan(self.noise) or math.isinf(self.noise):
            return -math.inf
        if self.noise == 0:
            return math.inf
        return -math.inf if self.signal == 0 else 10 * math.log10(self.signal / self.noise)


@dataclass(frozen=True)
class LinearBlockStats:
    """One ``nn.Linear`` in one block format: ``shape`` its weight's ``(out_features, in_features)``; ``operands``
    ``"x"``, ``"W"``, ``"dy"`` -> :class:`BlockStats` (empty when its shape is one the recipe cannot scale, or it
    was never called); ``kept``: why the recipe's conversion keeps it in the compute dtype
    (:func:`mixprec.blockscale.plan_block_conversion`'s reasons), ``""`` when the recipe converts it."""

    name: str
    shape: tuple[int, int]
    operands: dict[str, BlockStats]
    kept: str

    def worst(self) -> tuple[str, float] | None:
        """``(operand, SQNR dB)`` of the operand with the lowest SQNR (None without operands)."""
        if not self.operands:
            return None
        operand = min(self.operands, key=lambda k: self.operands[k].sqnr_db)
        return operand, self.operands[operand].sqnr_db


@dataclass(frozen=True)
class BlockFormatStats:
    """Every linear of the model in one block format under one recipe.

    ``format``: the block format's name (:func:`mixprec.formats.get_block_format`); ``recipe``: the recipe's text
    (``str(BlockRecipe)``); ``recipe_name``: its name when it is a preset of
    :data:`mixprec.blockscale.BLOCK_RECIPES` (a policy's ``block=`` runs it), ``""`` for the recipe built for a
    format no preset uses (1D blocks, no transform, no stochastic rounding); ``reference``: per operand, the
    statistics of normal data (module docstring); ``linears``: by qualified name, in model order.
    """

    format: str
    recipe: str
    recipe_name: str
    reference: dict[str, BlockStats]
    linears: dict[str, LinearBlockStats]

    @property
    def reference_sqnr_db(self) -> dict[str, float]:
        """Per operand, the reference SQNR in dB."""
        return {operand: s.sqnr_db for operand, s in self.reference.items()}
