"""``BlockScaledLinear``: a drop-in ``nn.Linear`` whose three GEMMs run in a block format, emulated or native.

For ``x (M, K)`` and ``W (N, K)`` the GEMMs of :mod:`mixprec.blockscale.recipe` (``GEMMS``), each an
``A @ B^T`` of :mod:`mixprec.blockscale.gemm` with both operands quantized along the contraction::

    forward  y  = GEMM(q(x),           q(W))              A = x (M, K),     B = W (N, K)
    dgrad    dx = GEMM(q(dy; SR),      q(W^T))            A = dy (M, N),    B = W^T (K, N)
    wgrad    dW = GEMM(q(RHT(dy^T); SR), q(RHT(x^T)))     A = dy^T (N, M),  B = x^T (K, M)

``q`` pads the contraction to a multiple of the block size, quantizes in the recipe's format (``dy`` in its
``grad_format``), and dequantizes. With ``weight_blocks="2d"``, ``q(W)`` is
:func:`~mixprec.blockscale.gemm.weight_tiles` (``b x b`` tiles) in forward and its transpose in dgrad (recomputed
in backward from the same ``W``: the same bits, weights rounding to nearest). ``SR`` (``stochastic_rounding``) rounds ``dy`` stochastically,
its bits drawn from this module's :class:`~mixprec.blockscale.streams.RoundingStream`, whose generator each backward
call seeds afresh from ``(sr_seed, calls)``: first for dgrad's ``dy``, then for wgrad's ``dy^T`` (only the GEMMs
whose gradient autograd asks for draw). ``RHT`` (``hadamard``) transforms both wgrad operands along
``M`` with this module's ``hadamard_signs``. A GEMM left out of ``recipe.quantized_gemms`` is an fp32 GEMM of the
unquantized operands.

What backward keeps (``ctx.save_for_backward``): ``W`` and the signs by reference (no copy), and of ``x`` only what
wgrad reads. With a quantized wgrad GEMM that is ``q(RHT(x^T))``, computed in forward (round to nearest, no random
draw: the bits backward computed from ``x`` before) and kept packed in its format's bytes
(:mod:`mixprec.blockscale.packing`): NVFP4 E2M1 codes two a byte, an E4M3 byte per 16 and a 4-byte tensor scale,
``0.5 + 1/16`` bytes per element of ``x`` (tokens padded to whole blocks); MXFP8 E4M3 codes a byte each and an E8M0
byte per 32, ``1 + 1/32``; where ``x`` itself took 4 bytes an element (fp32, a LayerNorm's output under bf16
autocast) or 2 (bf16), and bf16 autocast's ``nn.Linear`` keeps 2 (its bf16 copy of ``x``) and a bf16 copy of ``W``.
Backward unpacks and multiplies as :func:`~mixprec.blockscale.fakequant.fake_quantize` does, so ``dW`` is bit for
bit the same. Nothing of ``x`` is kept when the weight needs no gradient (a frozen base weight) or grad mode is off;
``x`` itself with an fp32 wgrad (``quantized_gemms`` without it) or a format that overflows instead of saturating.

Native GEMMs (``recipe.gemm``, "auto" by default): on a device where
:func:`~mixprec.blockscale.native.recipe_support` finds every quantized GEMM's formats native (CUDA capability 10.0+,
probed once per device and output dtype, cached on the module by :meth:`BlockScaledLinear.gemm_support`), each operand
is quantized to the same values with the same random bits (:func:`~mixprec.blockscale.native.native_operand`, 2D
tiles by :func:`~mixprec.blockscale.native.native_weight_tiles`) and the GEMM is ``torch.nn.functional.scaled_mm``;
forward keeps ``q(RHT(x^T))`` as that operand (the format's bytes plus the scale tiles' padding). Results differ from
the emulation's only by the order of the fp32 accumulation. ``gemm="native"`` raises (RuntimeError, at the first
call) where the GEMMs cannot run natively, naming why.

Dtypes, as :class:`~mixprec.fp8.linear.Float8Linear`'s: each GEMM accumulates in fp32 and rounds its output once
to the compute dtype (the autocast dtype when autocast is on, else the input's); ``dx`` and ``dW`` are then cast to
the input's and the weight's dtypes (fp32 master weights get a bf16-rounded gradient under bf16 autocast, as an
autocast ``nn.Linear`` gives them). The input is quantized from its own dtype (an fp32 input under autocast is
not rounded to bf16 first). The bias is added outside the GEMM, in the compute dtype.

State (in ``state_dict``, so a resumed run continues bitwise; tensors only, so DCP and FSDP2 state dicts hold it
as they hold a buffer): ``hadamard_signs`` (a buffer, with ``hadamard``), random ±1 from ``recipe.seed``, the same in
every linear and on every rank; and ``_extra_state``, the stochastic-rounding stream ``[sr_seed, calls]`` (int64,
``sr_seed = recipe.seed + index``; ``calls`` stays 0 without stochastic rounding). The stream is the same on every
rank of a data-parallel run, and its state does not depend on the device (:mod:`mixprec.blockscale.streams`: why,
and what that costs). The block scales are not state: every GEMM computes them from its operands (the weight's from
the whole weight, the fp32 master under FSDP2 too: :mod:`mixprec.distributed.wrapping`). No host sync in forward
or backward. Under ``torch.compile`` a recipe without stochastic rounding traces whole (``fullgraph=True``); with
it, dynamo cannot take the ``torch.Generator`` argument (torch 2.13) and breaks the graph at the linear, which then
runs eagerly with the same bits. On CUDA the compiled forward reads the native-GEMM decision cached on the module;
where none is cached the probe, which runs eagerly, breaks the graph (an error under ``fullgraph=True``): call
:meth:`BlockScaledLinear.gemm_support` before compiling (``MixedPrecision`` does it at build).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mixprec.autocast.first_order import first_order_backward
from mixprec.blockscale.gemm import block_gemm, gemm_operand, plain_gemm, weight_tiles
from mixprec.blockscale.hadamard import random_signs
from mixprec.blockscale.native import NativeOperand, NativeSupport, native_gemm, native_operand, \
    native_weight_tiles, recipe_support
from mixprec.blockscale.packing import PackedOperand, pack_operand, unpack_operand
from mixprec.blockscale.recipe import BlockRecipe, get_block_recipe
from mixprec.blockscale.streams import RoundingStream

__all__ = ["BlockScaledLinear", "shape_problems"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shape_problems(in_features: int, out_features: int, recipe: BlockRecipe) -> list[str]:
    """Why a linear of these dimensions cannot be block-scaled under ``recipe`` (empty: it can): ``in_features``
    must be a multiple of the block size (forward contracts K in whole blocks), and with 2D weight blocks
    ``out_features`` too (the tiles cover ``W``). ``out_features`` with 1D blocks and the token count are padded."""
    size = recipe.block_size
    fmt = recipe.format
    problems = []
    if in_features % size:
        problems.append(f"in_features={in_features} not a multiple of {fmt}'s block size {size}")
    if recipe.weight_blocks == "2d" and out_features % size:
        problems.append(f"out_features={out_features} not a multiple of {size} ({size}x{size} 2D weight blocks)")
    return problems


def _operand(t: torch.Tensor, fmt, native: bool, **kw) -> torch.Tensor | NativeOperand:
    """``t``'s GEMM operand: :func:`~mixprec.blockscale.native.native_operand` (native) or ``gemm_operand``."""
    return native_operand(t, fmt, **kw) if native else gemm_operand(t, fmt, **kw)


def _gemm(a: torch.Tensor | NativeOperand, b: torch.Tensor | NativeOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` on the device's block-scaled GEMM (native operands) or by emulation."""
    return native_gemm(a, b, out_dtype) if isinstance(a, NativeOperand) else block_gemm(a, b, out_dtype)


def _weight_along_k(weight: torch.Tensor, recipe: BlockRecipe, native: bool) -> torch.Tensor | NativeOperand:
    """``q(W)``, ``(N, K)``, valid along K: 1D blocks along K, or the 2D tiles."""
    if recipe.weight_blocks == "2d":
        if native:
            return native_weight_tiles(weight, recipe.weight_tile_format(), recipe.block_size, transposed=False)
        return weight_tiles(weight, recipe.weight_tile_format(), recipe.block_size)
    return _operand(weight, recipe.operand_format("W"), native)


def _weight_along_n(weight: torch.Tensor, recipe: BlockRecipe, native: bool) -> torch.Tensor | NativeOperand:
    """``q(W^T)``, ``(K, N')``, valid along N: 1D blocks along N, or the 2D tiles transposed."""
    if recipe.weight_blocks == "2d":
        if native:
            return native_weight_tiles(weight, recipe.weight_tile_format(), recipe.block_size, transposed=True)
        return weight_tiles(weight, recipe.weight_tile_format(), recipe.block_size).t()
    return _operand(weight.t(), recipe.operand_format("W"), native)


def _dgrad(dy: torch.Tensor, weight: torch.Tensor, recipe: BlockRecipe, generator: torch.Generator | None,
           out_dtype: torch.dtype, native: bool) -> torch.Tensor:
    """``dx = dy @ W``, ``(M, K)`` in ``out_dtype``."""
    if "dgrad" not in recipe.quantized_gemms:
        return plain_gemm(dy, weight.t(), out_dtype)
    a = _operand(dy, recipe.operand_format("dy"), native, rounding=recipe.rounding("dy"), generator=generator)
    return _gemm(a, _weight_along_n(weight, recipe, native), out_dtype)


def _wgrad(dy: torch.Tensor, x_kept: torch.Tensor | PackedOperand | NativeOperand, recipe: BlockRecipe,
           signs: torch.Tensor | None, generator: torch.Generator | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``dW = dy^T @ x``, ``(N, K)`` in ``out_dtype``, from what forward kept of ``x`` (:func:`_kept_input`)."""
    if "wgrad" not in recipe.quantized_gemms:
        return plain_gemm(dy.t(), x_kept.t(), out_dtype)
    native = isinstance(x_kept, NativeOperand)
    a = _operand(dy.t(), recipe.operand_format("dy"), native, rounding=recipe.rounding("dy"), generator=generator,
                 signs=signs)
    if native:
        return native_gemm(a, x_kept, out_dtype)
    if isinstance(x_kept, PackedOperand):
        return block_gemm(a, unpack_operand(x_kept), out_dtype)
    return block_gemm(a, gemm_operand(x_kept.t(), recipe.operand_format("x"), signs=signs), out_dtype)


def _kept_input(x: torch.Tensor, recipe: BlockRecipe, signs: torch.Tensor | None, wgrad_runs: bool,
                native: bool) -> torch.Tensor | PackedOperand | NativeOperand | None:
    """What backward keeps of ``x (M, K)``: nothing when wgrad will not run; wgrad's operand quantized (round to
    nearest, no random draw: the value backward would compute) when wgrad is quantized, as the native GEMM takes
    it or packed (:func:`~mixprec.blockscale.packing.pack_operand` of ``x^T``, in a saturating format); else
    ``x`` itself."""
    if not wgrad_runs:
        return None
    fmt = recipe.operand_format("x")
    if "wgrad" in recipe.quantized_gemms and native:
        return native_operand(x.t(), fmt, signs=signs)
    if "wgrad" in recipe.quantized_gemms and fmt.saturate:
        return pack_operand(x.t(), fmt, signs=signs)
    return x


def _save_kept(ctx, kept, weight: torch.Tensor, signs: torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` of ``x`` (or None), ``W``, the signs, and a quantized ``x``'s tensors; the
    quantized operand's description on ``ctx.x_kept`` (None for ``x`` itself)."""
    quantized = isinstance(kept, (PackedOperand, NativeOperand))
    ctx.save_for_backward(None if quantized else kept, weight, signs, *(kept.tensors() if quantized else ()))
    ctx.x_kept = (kept.layout if isinstance(kept, PackedOperand) else
                  dataclasses.replace(kept, data=None, scales=None, tensor_scale=None) if quantized else None)


def _restore_kept(ctx, x: torch.Tensor | None, tensors: tuple) -> torch.Tensor | PackedOperand | NativeOperand:
    """What :func:`_save_kept` kept of ``x``, from the saved tensors."""
    if ctx.x_kept is None:
        return x
    if isinstance(ctx.x_kept, NativeOperand):
        return dataclasses.replace(ctx.x_kept, data=tensors[0], scales=tensors[1], tensor_scale=tensors[2])
    return PackedOperand(ctx.x_kept, *tensors)


class _BlockScaledMatmul(torch.autograd.Function):
    """``y = x @ W^T`` with the three GEMMs block-scaled per the recipe (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: BlockRecipe, signs: torch.Tensor | None,
                generator: torch.Generator | None, stream: RoundingStream | None, out_dtype: torch.dtype,
                grad_enabled: bool, native: bool, name: str | None) -> torch.Tensor:
        if "forward" in recipe.quantized_gemms:
            a = _operand(x, recipe.operand_format("x"), native)
            y = _gemm(a, _weight_along_k(weight, recipe, native), out_dtype)  # (M, N)
        else:
            y = plain_gemm(x, weight, out_dtype)
        kept = _kept_input(x, recipe, signs, grad_enabled and ctx.needs_input_grad[1], native)
        _save_kept(ctx, kept, weight, signs)
        ctx.recipe, ctx.generator, ctx.stream, ctx.out_dtype = recipe, generator, stream, out_dtype
        ctx.x_dtype, ctx.native, ctx.name = x.dtype, native, name
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # dy: (M, N); first order only (mixprec.autocast.first_order)
        saved = ctx.saved_tensors
        what = f"a block-scaled linear ({ctx.recipe.name})"
        return first_order_backward(what, lambda: _BlockScaledMatmul._grads(ctx, dy, *saved),
                                    (dy, saved[1], saved[0]), ctx.name) + (None,) * 8

    @staticmethod
    def _grads(ctx, dy: torch.Tensor, x, weight, signs, *kept) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        recipe, generator, out_dtype = ctx.recipe, ctx.generator, ctx.out_dtype
        if generator is not None:   # this call's bits: the stream's next key
            generator = ctx.stream.serve(generator)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _dgrad(dy, weight, recipe, generator, out_dtype, ctx.native).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy, _restore_kept(ctx, x, kept), recipe, signs, generator, out_dtype).to(weight.dtype)
        return dx, dw


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``x``'s device, else ``x``'s dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class BlockScaledLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in a block format (module docstring).

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        recipe: ``"mxfp8"``, ``"nvfp4"``, ``"nvfp4-plain"`` or a :class:`~mixprec.blockscale.recipe.BlockRecipe`.
        index: this linear's position among a model's block-scaled linears; its stochastic rounding stream is
            seeded with ``recipe.seed + index`` (:func:`~mixprec.blockscale.convert.convert_to_block_scaled`
            numbers them in registration order).

    Build from an existing linear, sharing its ``Parameter`` objects (optimizers and checkpoints keep working),
    with :meth:`from_linear`. ``built_by``: the policy text of the ``MixedPrecision`` engine that swapped this
    linear in (its ``unwrap()`` swaps it back), None for one built by the caller (an engine runs it as built).
    ``qualified_name``: its name in the model it was converted in (:func:`~mixprec.blockscale.convert_to_block_scaled`
    sets it; None otherwise), for messages.

    Raises:
        ValueError: dimensions the recipe cannot scale (:func:`shape_problems`), a negative ``index``.
    """

    built_by: str | None = None
    qualified_name: str | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: str | BlockRecipe = "mxfp8", index: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = get_block_recipe(recipe)
        problems = shape_problems(in_features, out_features, self.recipe)
        if problems:
            raise ValueError(f"BlockScaledLinear({in_features}, {out_features}) under {self.recipe.name}: "
                             + "; ".join(problems))
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"BlockScaledLinear index={index!r} must be an int >= 0")
        self.index = index
        signs = random_signs(self.recipe.hadamard_size, self.recipe.seed, device=self.weight.device)
        self.register_buffer("hadamard_signs", signs if self.recipe.hadamard else None)
        self._stream = RoundingStream(self.sr_seed) if self.recipe.stochastic_rounding else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: str | BlockRecipe = "mxfp8",
                    index: int = 0) -> "BlockScaledLinear":
        """A BlockScaledLinear holding ``linear``'s own ``weight``/``bias`` Parameter objects (no copy); signs on the
        weight's device."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe, index=index)
        new.weight = linear.weight
        new.bias = linear.bias
        if new.hadamard_signs is not None:
            new.hadamard_signs = random_signs(new.recipe.hadamard_size, new.recipe.seed, device=linear.weight.device)
        new.train(linear.training)
        return new

    @property
    def linear_kind(self) -> str:
        """What runs this linear's GEMMs, in words: ``"block-scaled (recipe nvfp4)"``."""
        return f"block-scaled (recipe {self.recipe.name})"

    @property
    def sr_seed(self) -> int:
        """The seed of this linear's stochastic rounding stream: ``recipe.seed + index``."""
        return self.recipe.seed + self.index

    def _apply(self, fn, recurse: bool = True):
        """``.to()`` / ``.cuda()`` / ``to_empty()``: signs that were on the meta device (or left uninitialized by
        ``to_empty``) are drawn again from the seed (the stream keeps a generator per device the weight is on)."""
        signs_were_meta = self.hadamard_signs is not None and self.hadamard_signs.is_meta
        out = super()._apply(fn, recurse)
        if signs_were_meta and not self.hadamard_signs.is_meta:
            fresh = random_signs(self.recipe.hadamard_size, self.recipe.seed, device=self.hadamard_signs.device)
            self.hadamard_signs = fresh.to(self.hadamard_signs.dtype)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """As ``nn.Linear``'s, and a loaded ``hadamard_signs`` must be the recipe's (drawn from ``recipe.seed``): other
        values (a damaged or foreign checkpoint; zeros would silently zero the weight gradient) are a load error,
        which ``load_state_dict`` raises, the module keeping its own signs. One host read (a load)."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        signs, key = self.hadamard_signs, prefix + "hadamard_signs"
        if signs is None or signs.is_meta or key not in state_dict:
            return
        own = random_signs(self.recipe.hadamard_size, self.recipe.seed, device=signs.device).to(signs.dtype)
        if signs.shape != own.shape or not torch.equal(signs, own):
            with torch.no_grad():
                signs.copy_(own)   # the module keeps its own signs
            error_msgs.append(f"{key}: not the random Hadamard signs of recipe {self.recipe.name} (seed "
                              f"{self.recipe.seed}); a damaged checkpoint or another recipe's: load the checkpoint "
                              "the run wrote, under the policy it ran")

    def get_extra_state(self) -> torch.Tensor:
        """The stochastic-rounding stream: ``[sr_seed, calls]``, int64 on the CPU (``calls`` 0 without stochastic
        rounding; :meth:`~mixprec.blockscale.streams.RoundingStream.state`)."""
        if self._stream is None:
            return torch.tensor([self.sr_seed, 0], dtype=torch.int64)
        return self._stream.state()

    def set_extra_state(self, state: torch.Tensor) -> None:
        """Continue the saved stochastic-rounding stream (a load: one host read).

        Raises:
            ValueError: ``state`` is not an int64 ``[sr_seed, calls]``, or was saved by a linear of another
                ``sr_seed`` (another recipe seed or index).
        """
        owner = f"BlockScaledLinear(index={self.index}, {self.recipe.name})"
        if self._stream is None:
            RoundingStream(self.sr_seed).load(state, owner)   # checked all the same
        else:
            self._stream.load(state, owner)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in _INPUT_DTYPES:
            raise TypeError(f"BlockScaledLinear: input dtype {input.dtype}; allowed: {_INPUT_DTYPES}")
        out_dtype = _compute_dtype(input)
        x = input.reshape(-1, self.in_features)  # (M, K)
        stream = self._stream
        generator = None if stream is None or self.weight.is_meta else stream.generator(self.weight.device)
        y = _BlockScaledMatmul.apply(x, self.weight, self.recipe, self.hadamard_signs, generator, stream, out_dtype,
                                     torch.is_grad_enabled(), self._native(x.device, out_dtype), self.qualified_name)
        y = y.reshape(*input.shape[:-1], self.out_features)  # (..., N)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y

    def gemm_support(self, device: torch.device | str, out_dtype: torch.dtype) -> NativeSupport:
        """Whether this linear's GEMMs run natively on ``device`` with ``out_dtype`` outputs, and why
        (:func:`~mixprec.blockscale.native.recipe_support`: on CUDA a probe GEMM, once per process), cached on the
        module, where its forward reads it. Call it before ``torch.compile(..., fullgraph=True)`` on CUDA, with the
        device and the compute dtype the forward runs in (the probe runs eagerly, outside any graph);
        ``MixedPrecision`` does it for the linears it converts."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cache = self.__dict__.setdefault("_native_by", {})   # (device, out dtype) -> NativeSupport
        if (device, out_dtype) not in cache:
            cache[(device, out_dtype)] = recipe_support(device, self.recipe, out_dtype)
        return cache[(device, out_dtype)]

    def _native(self, device: torch.device, out_dtype: torch.dtype) -> bool:
        """Whether this call's GEMMs run natively (``recipe.gemm``; :meth:`gemm_support`, cached: under
        ``torch.compile`` the cached answer is read, or the probe breaks the graph). RuntimeError for
        ``gemm="native"`` where they cannot, naming why."""
        if self.recipe.gemm == "emulated" or (device.type != "cuda" and self.recipe.gemm == "auto"):
            return False
        support = self.__dict__.get("_native_by", {}).get((device, out_dtype))
        if support is None:
            support = self.gemm_support(device, out_dtype)
        if self.recipe.gemm == "native" and not support.available:
            raise RuntimeError(f"BlockScaledLinear(index={self.index}, {self.recipe.name}) asks for native GEMMs "
                               f"(recipe gemm='native'), and {support.reason}; use gemm='auto' to emulate them there")
        return support.available

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, index={self.index}"
