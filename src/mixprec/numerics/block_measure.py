"""Measuring linears in block formats for :func:`mixprec.numerics.inspect`: each GEMM operand quantized as the
recipe's GEMMs read it, counted on the device (:mod:`mixprec.numerics.block_stats` states what is counted).

The quantization is :mod:`mixprec.blockscale`'s own (:func:`~mixprec.blockscale.quantize`, the padding, Hadamard
transform and 2D tiles of :mod:`mixprec.blockscale.gemm`), so the statistics are those of the values a
:class:`~mixprec.blockscale.BlockScaledLinear` would multiply. :class:`BlockRecorder` hooks every ``nn.Linear``
leaf of the inspector's reference copy: its forward hook reads ``x`` and ``W``, a hook on its output reads ``dy``.
No host sync until :meth:`BlockRecorder.to_stats`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from mixprec.blockscale.convert import plan_block_conversion
from mixprec.blockscale.gemm import operand_blocks, tile_blocks
from mixprec.blockscale.hadamard import random_signs
from mixprec.blockscale.linear import shape_problems
from mixprec.blockscale.quantize import BlockQuantized, quantize
from mixprec.blockscale.recipe import BLOCK_RECIPES, OPERANDS, BlockRecipe, get_block_recipe, preset_name
from mixprec.formats import BlockFormat, get_block_format
from mixprec.numerics.block_stats import BlockFormatStats, BlockStats, LinearBlockStats
from mixprec.policy.policy import Policy

__all__ = ["recipe_for_format", "read_counts", "operand_counts", "reference_stats", "BlockRecorder"]

# operand -> its reads: (the GEMM, whether it reads the operand transposed); wgrad's reads are the transformed ones
_READS = {
    "x": (("forward", False), ("wgrad", True)),      # x (M, K) along K; x^T (K, M) along M
    "W": (("forward", False), ("dgrad", True)),      # W (N, K) along K; W^T (K, N) along N
    "dy": (("dgrad", False), ("wgrad", True)),       # dy (M, N) along N; dy^T (N, M) along M
}
_FIELDS = 6   # blocks, saturated blocks, non-zero elements, flushed elements, signal, noise


def recipe_for_format(fmt: BlockFormat | str, policy: Policy) -> BlockRecipe:
    """The recipe ``fmt`` is inspected under: ``policy``'s own block recipe (its ``block_disable`` applied) when
    it quantizes in ``fmt``, else the first preset of :data:`~mixprec.blockscale.BLOCK_RECIPES` that does
    (``mxfp8`` for ``mxfp8_e4m3``, ``nvfp4`` for ``nvfp4``), else ``BlockRecipe(name=fmt.name, format=fmt.name)``
    (1D blocks, no transform, no stochastic rounding, first and last linears kept)."""
    fmt = get_block_format(fmt)
    own = [get_block_recipe(policy.block, disable=policy.block_disable)] if policy.block is not None else []
    for recipe in own + list(BLOCK_RECIPES.values()):
        if get_block_format(recipe.format).name == fmt.name and recipe.grad_format is None:
            return recipe
    return BlockRecipe(name=fmt.name, format=fmt.name)


def read_counts(values: torch.Tensor, q: BlockQuantized) -> torch.Tensor:
    """One read's counts, fp64 ``(6,)``: blocks, blocks with a saturated element, non-zero elements, those flushed
    to zero, ``sum values**2`` and ``sum (values - dequantized)**2`` (conventions:
    :mod:`mixprec.numerics.block_stats`). ``values``: what was quantized into ``q``, ``(..., C)``. The scaled
    magnitude of an element is ``|value| / s`` in fp32, ``s`` the block's scale (times the tensor scale), as
    :mod:`mixprec.blockscale.quantize` divides. No host sync."""
    values_fp32 = values.float()
    x_hat = q.dequantize()
    divisor = q.scale_values() if q.tensor_scale is None else q.scale_values() * q.tensor_scale
    scaled = values_fp32.unflatten(-1, (-1, q.format.block_size)).abs() / divisor.unsqueeze(-1)
    saturated = (scaled > q.format.element.max_normal).any(-1)   # a NaN scale (NaN block) compares False
    nonzero = values_fp32 != 0
    values_fp64 = values_fp32.double()
    return torch.stack([torch.tensor(float(divisor.numel()), dtype=torch.float64, device=values.device),
                        saturated.sum().double(), nonzero.sum().double(), (nonzero & (x_hat == 0)).sum().double(),
                        values_fp64.square().sum(), (values_fp64 - x_hat.double()).square().sum()])


@torch.no_grad()
def operand_counts(operand: str, t: torch.Tensor, recipe: BlockRecipe, *, signs: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """The counts of ``operand`` (``"x"`` ``(M, K)``, ``"W"`` ``(N, K)`` or ``"dy"`` ``(M, N)``) summed over the
    reads of ``recipe``'s quantized GEMMs, fp64 ``(6,)`` as :func:`read_counts`: its format and rounding
    (stochastic from ``generator``), wgrad's reads transformed with ``signs`` (the recipe's Hadamard signs, or
    None), ``W`` read once in 2D tiles under ``weight_blocks="2d"``. No host sync."""
    fmt = recipe.operand_format(operand)
    reads = [(gemm, transposed) for gemm, transposed in _READS[operand] if gemm in recipe.quantized_gemms]
    total = torch.zeros(_FIELDS, dtype=torch.float64, device=t.device)
    if operand == "W" and recipe.weight_blocks == "2d":
        tiles = tile_blocks(t.float(), recipe.block_size)   # one quantized W serves forward and dgrad
        return total + read_counts(tiles, quantize(tiles, recipe.weight_tile_format())) if reads else total
    rounding = recipe.rounding(operand)
    for gemm, transposed in reads:
        values = operand_blocks(t.t() if transposed else t, fmt.block_size, signs if gemm == "wgrad" else None)
        q = quantize(values, fmt, rounding=rounding, generator=generator if rounding == "stochastic" else None)
        total = total + read_counts(values, q)
    return total


def _stats(counts: list[float]) -> BlockStats:
    blocks, saturated, nonzero, flushed, signal, noise = counts
    return BlockStats(int(blocks), int(saturated), int(nonzero), int(flushed), signal, noise)


def reference_stats(recipe: BlockRecipe) -> dict[str, BlockStats]:
    """Per operand, the statistics ``recipe`` gives i.i.d. standard normal ``x``, ``W`` and ``dy`` of 256 x 256
    (fp32, a CPU generator seeded 0; stochastic rounding from one seeded with ``recipe.seed``): what the format does
    to well-behaved data (:mod:`mixprec.numerics.block_stats`). Computed once per recipe (a host read); a new dict
    each call."""
    return dict(_reference_stats(recipe))


@functools.cache
def _reference_stats(recipe: BlockRecipe) -> dict[str, BlockStats]:
    g = torch.Generator().manual_seed(0)
    tensors = {operand: torch.randn(256, 256, generator=g) for operand in OPERANDS}
    signs = random_signs(recipe.hadamard_size, recipe.seed) if recipe.hadamard else None
    sr = torch.Generator().manual_seed(recipe.seed)
    return {operand: _stats(operand_counts(operand, t, recipe, signs=signs, generator=sr).tolist())
            for operand, t in tensors.items()}


class BlockRecorder:
    """Hooks and device counters measuring every ``nn.Linear`` leaf of ``model`` in each block format of
    ``formats``, under :func:`recipe_for_format` (``policy``: the policy under study; its ``block_keep`` counts
    in the kept reasons when its recipe is the one used). A linear of a shape the recipe cannot scale is not
    measured (its ``kept`` says why)."""

    def __init__(self, model: nn.Module, formats: list[BlockFormat], policy: Policy) -> None:
        self.recipes = {f.name: recipe_for_format(f, policy) for f in formats}
        self.plans = {f: plan_block_conversion(model, r, keep=policy.block_keep if policy.block == r.name else ())
                      for f, r in self.recipes.items()}
        self.linears = {n: m for n, m in model.named_modules()
                        if isinstance(m, nn.Linear) and not any(True for _ in m.children())}
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self.signs = {f: random_signs(r.hadamard_size, r.seed, device=device) if r.hadamard else None
                      for f, r in self.recipes.items()}
        self.generators = {f: torch.Generator(device=device).manual_seed(r.seed) for f, r in self.recipes.items()}
        self.counts: dict[tuple[str, str, str], torch.Tensor] = {}

    def _measured(self, fmt: str, module: nn.Linear) -> bool:
        return not shape_problems(module.in_features, module.out_features, self.recipes[fmt])

    def install(self) -> list[Any]:
        """Forward hooks on the linears (the caller removes the handles)."""
        return [m.register_forward_hook(functools.partial(self._post, n)) for n, m in self.linears.items()]

    def _add(self, fmt: str, name: str, operand: str, t: torch.Tensor) -> None:
        recipe = self.recipes[fmt]
        counts = operand_counts(operand, t.detach().float(), recipe, signs=self.signs[fmt],
                                generator=self.generators[fmt])
        key = (fmt, name, operand)
        self.counts[key] = counts if key not in self.counts else self.counts[key] + counts

    def _post(self, name: str, module: nn.Linear, args: tuple, output: Any) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        for fmt in self.recipes:
            if self._measured(fmt, module):
                self._add(fmt, name, "x", x.reshape(-1, module.in_features))
                self._add(fmt, name, "W", module.weight)
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            output.register_hook(functools.partial(self._grad, name, module))

    def _grad(self, name: str, module: nn.Linear, grad: torch.Tensor) -> None:
        for fmt in self.recipes:
            if self._measured(fmt, module):
                self._add(fmt, name, "dy", grad.reshape(-1, module.out_features))

    def to_stats(self) -> tuple[BlockFormatStats, ...]:
        """Everything measured, per format in the given order (one host read)."""
        keys = list(self.counts)
        values = torch.stack([self.counts[k] for k in keys]).tolist() if keys else []
        host = dict(zip(keys, values))
        out = []
        for fmt, recipe in self.recipes.items():
            kept = dict(self.plans[fmt].kept)
            linears = {name: LinearBlockStats(name, (m.out_features, m.in_features),
                                              {op: _stats(host[(fmt, name, op)]) for op in OPERANDS
                                               if (fmt, name, op) in host}, kept.get(name, ""))
                       for name, m in self.linears.items()}
            out.append(BlockFormatStats(fmt, str(recipe), preset_name(recipe), reference_stats(recipe), linears))
        return tuple(out)
