"""Block-scaled training recipes: which GEMM operands go to which block format, and the tricks that make them train.

A linear ``y = x @ W^T`` with ``x (M, K)`` (``M`` tokens, ``K = in_features``), ``W (N, K)`` (``N =
out_features``) and the output gradient ``dy (M, N)`` runs three GEMMs. A block format scales blocks of
consecutive elements along one dim, and a GEMM can only use scales that are constant along its contraction, so
each operand is quantized along the dim its GEMM contracts (:data:`GEMMS`)::

    forward  y  = x  @ W^T    contracts K    x along K,  W along K
    dgrad    dx = dy @ W      contracts N    dy along N, W along N
    wgrad    dW = dy^T @ x    contracts M    dy along M, x along M   (M: the tokens)

``x``, ``W`` and ``dy`` are each quantized twice, once per GEMM that reads them (``W`` once with 2D blocks),
always from high precision, never a quantized tensor requantized (Transformer Engine's NVFP4 recipe states the
same: the rowwise and columnwise copies are both computed from the high-precision input). A :class:`BlockRecipe`
says:

* ``format`` (``x``, ``W``) and ``grad_format`` (``dy``; None: the same), block format names for
  :func:`~mixprec.formats.get_block_format`, and ``scale_rounding``, an override of the formats' E8M0 rounding;
* ``weight_blocks``: ``"1d"`` (blocks along the contraction, so ``W`` is quantized once along K and once along N)
  or ``"2d"`` (square ``block_size x block_size`` tiles of ``W`` share one scale, so a single quantized ``W`` is
  valid along K and along N and serves forward and dgrad);
* ``hadamard``: a random Hadamard transform (:mod:`mixprec.blockscale.hadamard`) of the wgrad GEMM's two inputs
  along M, in blocks of ``hadamard_size``, with the same random signs on both so ``dy^T x`` is unchanged in exact
  arithmetic while an outlier is spread over ``hadamard_size`` tokens before they are quantized;
* ``stochastic_rounding``: ``dy`` rounded stochastically (elements; the scales as always) in dgrad and wgrad;
* ``bf16_tail_fraction``: the last ``ceil(n * fraction)`` of the model's ``n`` blocks stay in the compute dtype;
  ``keep_first_last``: so do the network's first and last ``nn.Linear``
  (:func:`~mixprec.blockscale.convert.convert_to_block_scaled` applies both);
* ``quantized_gemms``: the GEMMs that run block-scaled (the others are fp32 GEMMs of the unquantized operands);
* ``gemm``: how the quantized GEMMs run: ``"auto"`` natively where the device runs the formats' GEMMs
  (:func:`~mixprec.blockscale.native.recipe_support`: NVIDIA Blackwell through torch's ``scaled_mm``, after a
  probe against the emulation), emulated elsewhere; ``"emulated"`` always emulated (exact dequantize + fp32 GEMM:
  the same values on every device); ``"native"`` native or a RuntimeError naming why not;
* ``seed``: the random Hadamard signs come from it, each linear's stochastic-rounding stream from
  ``seed + index`` (its position among the converted linears). The signs are the same in every linear and on
  every rank, as Transformer Engine's one fixed wgrad sign vector and torchtitan's hardcoded one are (under
  tensor parallelism both operands' shards must use the same signs); here they are drawn from the seed.

Presets (:data:`BLOCK_RECIPES`, by :func:`get_block_recipe`), and where each default comes from:

``"mxfp8"``
    MXFP8 with E4M3 elements for ``x``, ``W`` *and* ``dy``, blocks of 32 along the contraction, E8M0 scales by
    ``rceil`` (round ``amax / 448`` up to a power of two), no transform, no SR, no tail. This is what torchao
    trains with and torchtitan's MXFP8 converter runs: torchao/prototype/moe_training/mxfp8_linear.py sets
    ``in_elem_dtype = w_elem_dtype = grad_elem_dtype = torch.float8_e4m3fn`` with ``block_size = 32``, and its
    ``MXFP8TrainingRecipe.MXFP8_RCEIL`` (moe_training/config.py; ``MXFP8Linear``'s default) computes scales by
    ``ScaleCalculationMode.RCEIL``, whose docstring calls the OCP spec's ``floor`` "bad for gradient
    quantization" (it saturates the block's largest elements). E5M2 gradients (as fp8's ``hybrid``) are one
    override away: ``grad_format="mxfp8_e5m2"``. First and last linears kept, mixprec's fp8
    default (torchtitan's float8 docs keep the ``output`` head the same way, ``filter_fqns=["output"]``).
``"nvfp4"``
    Transformer Engine's ``NVFP4BlockScaling`` recipe (transformer_engine/common/recipe/__init__.py): NVFP4
    everywhere; 16x16 2D scales for weights (``fp4_quant_fwd_weight``: ``fp4_2d_quantization``); a random
    Hadamard transform of size 16 on the inputs of the wgrad GEMM only ("RHT is currently only applied to
    column-wise usage so that it can be used for wgrad GEMM"; ``fp4_quant_fwd_inp`` and ``fp4_quant_bwd_grad``
    carry ``random_hadamard_transform``); stochastic rounding of gradients only (``fp4_quant_bwd_grad``), in both
    backward GEMMs. The last 15 % of blocks in bf16 is torchtitan's NVFP4 setting
    (torchtitan/models/llama3/config_registry.py ``_NVFP4_BF16_TAIL_FRACTION = 0.15``, counted as
    ``ceil(n_layers * fraction)`` in components/quantization/nvfp4.py ``nvfp4_bf16_tail_fqns``), which also keeps
    the LM head in bf16; first and last linears kept.
``"nvfp4-plain"``
    The same NVFP4 format and 2D weight scales without the transform, without SR and without the tail: the
    ablation that shows what those three buy (``weight_blocks="1d"`` drops the 2D scales too).

Parts of a recipe can be turned off one at a time (:data:`RECIPE_PARTS`, Transformer Engine's
``NVFP4BlockScaling(disable_rht=..., disable_stochastic_rounding=..., disable_2d_quantization=...)`` in the same
spirit): ``get_block_recipe("nvfp4", disable=("sr",))`` is ``nvfp4`` with round-to-nearest ``dy``; a policy says it
as ``"nvfp4-mixed,block_disable=sr"``. Frozen: other variants are ``dataclasses.replace(get_block_recipe("nvfp4"),
hadamard_size=4)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mixprec.formats import BlockFormat, get_block_format

__all__ = ["GEMMS", "OPERANDS", "RECIPE_PARTS", "BlockRecipe", "BLOCK_RECIPES", "get_block_recipe", "preset_name", "recipe_parts"]

# GEMM -> (operand, dim it is quantized along) for its two inputs; the output is the GEMM's name
GEMMS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "forward": (("x", "K"), ("W", "K")),
    "dgrad": (("dy", "N"), ("W", "N")),
    "wgrad": (("dy", "M"), ("x", "M")),
}
OPERANDS = ("x", "W", "dy")
WEIGHT_BLOCKS = ("1d", "2d")
SCALE_ROUNDINGS = (None, "floor", "rceil")
GEMM_BACKENDS = ("auto", "emulated", "native")
# a recipe's parts that ``disable`` turns off: part -> (field, the value without it)
RECIPE_PARTS: dict[str, tuple[str, object]] = {
    "hadamard": ("hadamard", False),               # the random Hadamard transform of wgrad's inputs
    "sr": ("stochastic_rounding", False),          # stochastic rounding of dy: round-to-nearest instead
    "2d": ("weight_blocks", "1d"),                 # 16x16 weight tiles: 1D blocks along each contraction instead
    "tail": ("bf16_tail_fraction", 0.0),           # the last blocks in bf16: block-scaled too
    "ends": ("keep_first_last", False),            # the first and last linears in bf16: block-scaled too
}


@dataclass(frozen=True)
class BlockRecipe:
    """How block-scaled linears quantize their GEMMs (module docstring for the fields and the presets).

    Raises:
        ValueError: a field outside its allowed set, naming the field, the value and the choices: an unknown
            format, formats of different block sizes, ``scale_rounding`` for a format without E8M0 scales, a
            Hadamard size that is not a power of 4 dividing the block size, a fraction outside ``[0, 1)``, an
            unknown GEMM, a negative seed.
    """

    name: str = "custom"
    format: str = "mxfp8_e4m3"
    grad_format: str | None = None
    scale_rounding: str | None = None
    weight_blocks: str = "1d"
    hadamard: bool = False
    hadamard_size: int = 16
    stochastic_rounding: bool = False
    bf16_tail_fraction: float = 0.0
    keep_first_last: bool = True
    quantized_gemms: tuple[str, ...] = tuple(GEMMS)
    seed: int = 0
    gemm: str = "auto"

    def __post_init__(self) -> None:
        fmt = self._checked_formats()
        if self.weight_blocks not in WEIGHT_BLOCKS:
            raise ValueError(f"BlockRecipe weight_blocks={self.weight_blocks!r} is not one of {WEIGHT_BLOCKS}")
        size = self.hadamard_size
        power_of_4 = isinstance(size, int) and size >= 4 and not size & (size - 1) and size.bit_length() % 2 == 1
        if isinstance(size, bool) or not power_of_4:
            raise ValueError(f"BlockRecipe hadamard_size={size!r} must be a power of 4 (4, 16, 64, ...): its "
                             f"1/sqrt(size) normalization is then exact in fp32")
        if self.hadamard and fmt.block_size % size:
            raise ValueError(f"BlockRecipe hadamard_size={size} does not divide {fmt.name}'s block size "
                             f"{fmt.block_size}: the transformed blocks must tile the quantized ones")
        fraction = self.bf16_tail_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise ValueError(f"BlockRecipe bf16_tail_fraction={fraction!r} must be a number in [0, 1)")
        unknown = [g for g in self.quantized_gemms if g not in GEMMS]
        if unknown or not isinstance(self.quantized_gemms, tuple):
            raise ValueError(f"BlockRecipe quantized_gemms={self.quantized_gemms!r}: a tuple of {tuple(GEMMS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"BlockRecipe seed={self.seed!r} must be an int >= 0")
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"BlockRecipe gemm={self.gemm!r} is not one of {GEMM_BACKENDS}")
        for flag in ("hadamard", "stochastic_rounding", "keep_first_last"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"BlockRecipe {flag}={getattr(self, flag)!r} must be True or False")

    def _checked_formats(self) -> BlockFormat:
        """``format`` resolved, after checking ``grad_format`` and ``scale_rounding`` against it."""
        fmt = self._resolve("format", self.format)
        grad = fmt if self.grad_format is None else self._resolve("grad_format", self.grad_format)
        if grad.block_size != fmt.block_size:
            raise ValueError(f"BlockRecipe grad_format={grad.name!r} has blocks of {grad.block_size}, format="
                             f"{fmt.name!r} of {fmt.block_size}: dgrad contracts dy with W, whose blocks must match")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"BlockRecipe scale_rounding={self.scale_rounding!r} is not one of {SCALE_ROUNDINGS}")
        if self.scale_rounding is not None and not (fmt.is_mx and grad.is_mx):
            other = grad if fmt.is_mx else fmt
            raise ValueError(f"BlockRecipe scale_rounding={self.scale_rounding!r} is for E8M0 scales (MX formats); "
                             f"{other.name} has {other.scale_format} scales")
        return fmt

    @staticmethod
    def _resolve(field: str, name: str) -> BlockFormat:
        try:
            return get_block_format(name)
        except (TypeError, ValueError) as err:
            raise ValueError(f"BlockRecipe {field}={name!r}: {err}") from None

    def _with_rounding(self, fmt: BlockFormat) -> BlockFormat:
        if self.scale_rounding is None or self.scale_rounding == fmt.scale_rounding:
            return fmt
        return dataclasses.replace(fmt, name=f"{fmt.name}_{self.scale_rounding}", scale_rounding=self.scale_rounding)

    def operand_format(self, operand: str) -> BlockFormat:
        """The block format of ``"x"``, ``"W"`` or ``"dy"`` (with ``scale_rounding`` applied)."""
        if operand not in OPERANDS:
            raise ValueError(f"operand={operand!r} is not one of {OPERANDS}")
        name = self.grad_format if operand == "dy" and self.grad_format is not None else self.format
        return self._with_rounding(get_block_format(name))

    @property
    def block_size(self) -> int:
        """Elements per block along the contraction (the same for every operand)."""
        return get_block_format(self.format).block_size

    def weight_tile_format(self) -> BlockFormat:
        """``W``'s format with one scale per ``block_size x block_size`` tile (``weight_blocks="2d"``): the tile's
        elements flattened into one block of ``block_size**2``, so the tile shares its amax, its scale and, for
        NVFP4, the tensor scale of all of ``W``."""
        fmt = self.operand_format("W")
        side = fmt.block_size
        return dataclasses.replace(fmt, name=f"{fmt.name}_{side}x{side}", block_size=side * side)

    def rounding(self, operand: str) -> str:
        """``"stochastic"`` for ``dy`` under ``stochastic_rounding``, else ``"nearest"``."""
        return "stochastic" if operand == "dy" and self.stochastic_rounding else "nearest"

    def tail_blocks(self, n_blocks: int) -> int:
        """How many of ``n_blocks`` blocks, the last ones, stay in the compute dtype: ``ceil(n * fraction)`` (as
        torchtitan counts, but of the product rounded to 9 decimals, so ``100 * 0.15`` is 15, not 16)."""
        return math.ceil(round(n_blocks * self.bf16_tail_fraction, 9))

    def __str__(self) -> str:
        parts = [self.format + (f"/{self.grad_format}" if self.grad_format else "")]
        parts += [f"scales={self.scale_rounding}"] if self.scale_rounding else []
        parts += [f"W={self.weight_blocks}"]
        parts += [f"rht{self.hadamard_size}(wgrad)"] if self.hadamard else []
        parts += ["sr(dy)"] if self.stochastic_rounding else []
        parts += [f"bf16_tail={self.bf16_tail_fraction:g}"] if self.bf16_tail_fraction else []
        parts += ["first/last kept"] if self.keep_first_last else []
        parts += [f"gemms={'+'.join(self.quantized_gemms)}"] if self.quantized_gemms != tuple(GEMMS) else []
        parts += [f"gemm={self.gemm}"] if self.gemm != "auto" else []
        return f"{self.name}({', '.join(parts)})"


BLOCK_RECIPES: dict[str, BlockRecipe] = {
    r.name: r
    for r in (
        BlockRecipe("mxfp8", format="mxfp8_e4m3", scale_rounding="rceil"),
        BlockRecipe("nvfp4", format="nvfp4", weight_blocks="2d", hadamard=True, hadamard_size=16,
                    stochastic_rounding=True, bf16_tail_fraction=0.15),
        BlockRecipe("nvfp4-plain", format="nvfp4", weight_blocks="2d"),
    )
}


def recipe_parts(recipe: BlockRecipe) -> tuple[str, ...]:
    """The :data:`RECIPE_PARTS` that ``recipe`` has on, in that order (``nvfp4``: all five; ``mxfp8``: ``ends``)."""
    return tuple(part for part, (field, off) in RECIPE_PARTS.items() if getattr(recipe, field) != off)


def preset_name(recipe: BlockRecipe) -> str:
    """The :data:`BLOCK_RECIPES` key ``recipe`` comes from (``"nvfp4"`` for ``get_block_recipe("nvfp4",
    disable=("sr",))``, named ``"nvfp4 without sr"``), or ``""`` for a recipe built otherwise."""
    base = recipe.name.split(" without ")[0]
    return base if base in BLOCK_RECIPES else ""


def get_block_recipe(spec: str | BlockRecipe, disable: tuple[str, ...] = ()) -> BlockRecipe:
    """A recipe by name (``"mxfp8"``, ``"nvfp4"``, ``"nvfp4-plain"``; ``_`` for ``-`` accepted) or the
    :class:`BlockRecipe` itself, with the parts named in ``disable`` (keys of :data:`RECIPE_PARTS`) turned off; the
    result is named for it, e.g. ``"nvfp4 without sr"``, so the decision and the linears say what ran.

    Raises:
        ValueError: an unknown name (the message lists the known ones); a part of ``disable`` that is unknown,
            repeated, or not on in the recipe (the message lists the parts it has).
        TypeError: ``spec`` neither a string nor a BlockRecipe; ``disable`` not a tuple of strings.
    """
    if isinstance(spec, BlockRecipe):
        recipe = spec
    elif not isinstance(spec, str):
        raise TypeError(f"get_block_recipe: spec={spec!r} must be a recipe name or a BlockRecipe")
    else:
        key = spec.strip().lower().replace("_", "-")
        if key not in BLOCK_RECIPES:
            raise ValueError(f"block recipe {spec!r} is not known; choose one of {sorted(BLOCK_RECIPES)} "
                             f"(or build a BlockRecipe)")
        recipe = BLOCK_RECIPES[key]
    if not isinstance(disable, tuple) or not all(isinstance(part, str) for part in disable):
        raise TypeError(f"get_block_recipe: disable={disable!r} must be a tuple of part names from "
                        f"{tuple(RECIPE_PARTS)}")
    if not disable:
        return recipe
    has = recipe_parts(recipe)
    for i, part in enumerate(disable):
        if part not in has or part in disable[:i]:
            why = "is repeated" if part in disable[:i] else (
                "is not a recipe part" if part not in RECIPE_PARTS else f"is not on in recipe {recipe.name!r}")
            raise ValueError(f"block recipe disable part {part!r} {why}; recipe {recipe.name!r} has "
                             f"{', '.join(has) or 'no parts'} to disable (parts: {', '.join(RECIPE_PARTS)})")
    changes = {RECIPE_PARTS[part][0]: RECIPE_PARTS[part][1] for part in disable}
    ordered = [part for part in RECIPE_PARTS if part in disable]
    return dataclasses.replace(recipe, name=f"{recipe.name} without {'+'.join(ordered)}", **changes)
