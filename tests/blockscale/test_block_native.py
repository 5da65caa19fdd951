"""Native block-scaled GEMM operands: the bytes handed to torch's scaled_mm, read back as cuBLAS documents them.

No CPU runs a block-scaled ``scaled_mm`` (torch's CPU kernel takes tensorwise and rowwise float8 scales only), so
these tests check everything up to the call: each :class:`NativeOperand` is decoded here by an independent reader
written from the layout's text (cuBLAS's "1D block scaling factors layout": 128 x 4 scale tiles, scale ``(r, c)``
of a tile at ``(r % 32) * 16 + (r // 32) * 4 + c``; E2M1 two a byte, the first element in the low nibble; element
values from the spec reference's code tables), and must equal the emulation's operand bit for bit, padding zero.
On a Blackwell GPU :func:`native_support`'s probe compares the GEMM itself against the emulation; here the probe
(:func:`probe_gemm`, called directly) runs on the documented stand-in kernel, which it must accept, and on subtly
wrong variants of it, which it must reject.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from blockscale_reference import code_value
import mixprec.blockscale.linear as block_linear
from mixprec.blockscale import BlockScaledLinear, get_block_recipe
from mixprec.blockscale.gemm import gemm_operand, weight_tiles
from mixprec.blockscale.hadamard import random_signs
from mixprec.blockscale.native import NativeOperand, NativeSupport, native_operand, native_support, \
    native_weight_tiles, probe_gemm, swizzle_scales
from mixprec.formats import get_block_format

NATIVE_FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "nvfp4"]


def _unswizzle(flat: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """Scale ``(r, c)`` read from the documented tile layout, one element at a time."""
    tiles_per_band = math.ceil(groups / 4)
    out = torch.empty(rows, groups, dtype=flat.dtype)
    for r in range(rows):
        for c in range(groups):
            tile = (r // 128) * tiles_per_band + c // 4
            within = r % 128
            out[r, c] = flat[tile * 512 + (within % 32) * 16 + (within // 32) * 4 + c % 4]
    return out


def _element_values(data: torch.Tensor, element: str) -> torch.Tensor:
    """fp64 element values ``(R', C'')`` from the codes, by the spec reference's code tables."""
    raw = data.view(torch.uint8)
    bits = 4 if element == "e2m1" else 8
    if bits == 4:
        raw = torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(raw.shape[0], -1)   # low nibble first
    sign = 1 << (bits - 1)   # the top bit; the reference's zeros are unsigned
    table = torch.tensor([math.copysign(float(code_value(element, c & (sign - 1))), -1.0 if c & sign else 1.0)
                          for c in range(2 * sign)], dtype=torch.float64)
    return table[raw.long()]


_ELEMENTS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.float4_e2m1fn_x2: "e2m1"}
_BLOCKS = {"BlockWise1x32": 32, "BlockWise1x16": 16}


def _decode_raw(data: torch.Tensor, scales: list, recipes: list) -> torch.Tensor:
    """fp64 values of a scaled_mm operand ``(rows, C)`` (contraction last) from its codes, its swizzled block scales
    and, with a second scale, its tensor scale."""
    values = _element_values(data, _ELEMENTS[data.dtype])
    rows, width = values.shape
    block = _BLOCKS[recipes[0].name]
    codes = _unswizzle(scales[0].view(torch.uint8), rows, width // block)
    block_scales = torch.exp2(codes.double() - 127) if scales[0].dtype == torch.float8_e8m0fnu else \
        codes.view(torch.float8_e4m3fn).double()
    out = values * block_scales.repeat_interleave(block, dim=1)
    return out * scales[1].double() if len(scales) > 1 else out


def _decode(op: NativeOperand) -> torch.Tensor:
    """The operand's values as the hardware reads them: ``(R', C'')`` fp32 (products exact in fp64, rounded once)."""
    recipes = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise] if op.tensor_scale is not None else \
        [F.ScalingType.BlockWise1x32]
    return _decode_raw(op.data, [op.scales] + ([op.tensor_scale] if op.tensor_scale is not None else []),
                       recipes).float()


def _documented_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None, swizzle_b=None,
                          bias=None, output_dtype=torch.bfloat16, **_):
    """What torch's block-scaled ``scaled_mm`` computes, per its documentation: both operands dequantized by their
    scales (swizzled as cuBLAS lays them out), ``A @ B`` accumulated (here in fp64), rounded once to the output
    dtype. A stand-in for the Blackwell kernel no CPU runs; ``mat_b`` is ``(C, S)`` column-major."""
    assert all(s == F.SwizzleType.SWIZZLE_32_4_4 for s in (swizzle_a[0], swizzle_b[0]))
    _documented_scaled_mm.calls += 1
    a = _decode_raw(mat_a, scale_a, recipe_a)
    b = _decode_raw(mat_b.t(), scale_b, recipe_b)
    return (a @ b.t()).to(output_dtype)


_documented_scaled_mm.calls = 0


def _assert_operand(op: NativeOperand, want_fp32: torch.Tensor) -> None:
    got = _decode(op)
    rows, width = want_fp32.shape
    assert op.rows == rows and got.shape[0] % 16 == 0 and got.shape[1] % (4 * op.format.block_size) == 0
    assert torch.equal(got[:rows, :width].view(torch.int32), want_fp32.view(torch.int32))
    assert not got[rows:].any() and not got[:, width:].any()


def _operand_tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).float())
    t[0, :5] = 0.0
    t[1, 3] = 1e30   # one huge element: its block saturates the rest to small values
    return t


def test_swizzle_follows_the_documented_tile_layout():
    codes = torch.randint(0, 255, (200, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    flat = swizzle_scales(codes)
    assert flat.numel() == 256 * 8
    assert torch.equal(_unswizzle(flat, 200, 6), codes)
    assert torch.equal(_unswizzle(flat, 256, 8)[200:], torch.zeros(56, 8, dtype=torch.uint8))


@pytest.mark.parametrize("name", NATIVE_FORMATS)
def test_native_operand_holds_the_emulated_operand_bit_for_bit(name):
    t = _operand_tensor(37, 5 * get_block_format(name).block_size + 3, seed=2)   # ragged rows and contraction
    _assert_operand(native_operand(t, name), gemm_operand(t, get_block_format(name)))
    _assert_operand(native_operand(t.bfloat16(), name), gemm_operand(t.bfloat16(), get_block_format(name)))


def test_stochastic_rounding_and_hadamard_draw_the_same_bits_as_the_emulation():
    t = _operand_tensor(48, 64, seed=3)
    signs = random_signs(16, seed=5)
    g_native, g_emulated = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    op = native_operand(t.t(), "nvfp4", rounding="stochastic", generator=g_native, signs=signs)
    _assert_operand(op, gemm_operand(t.t(), get_block_format("nvfp4"), rounding="stochastic", generator=g_emulated, signs=signs))
    assert torch.equal(g_native.get_state(), g_emulated.get_state())   # the stream goes on alike


@pytest.mark.parametrize("transposed", [False, True])
def test_2d_weight_tiles_as_rows_of_16_along_either_contraction(transposed):
    recipe = get_block_recipe("nvfp4")
    w = _operand_tensor(48, 80, seed=4)
    want = weight_tiles(w, recipe.weight_tile_format(), 16)
    op = native_weight_tiles(w, recipe.weight_tile_format(), 16, transposed=transposed)
    assert op.format.block_size == 16 and op.format.tensor_scale
    _assert_operand(op, want.t().contiguous() if transposed else want)


def test_formats_the_hardware_cannot_take_are_refused_by_name():
    with pytest.raises(ValueError, match=r"mxfp6_e2m3 .*none of \['MXFP4', 'MXFP8', 'NVFP4'\]"):
        native_operand(torch.ones(4, 32), "mxfp6_e2m3")


def test_no_native_gemm_off_cuda_and_the_reason_says_so():
    support = native_support("cpu", "nvfp4")
    assert not support.available
    assert "cpu" in support.reason and "CUDA only" in support.reason and "10.0" in support.reason


def _linear_pair(recipe: str, monkeypatch) -> tuple[BlockScaledLinear, BlockScaledLinear]:
    """The same linear twice, one emulated, one on "native" GEMMs, whose kernel is :func:`_documented_scaled_mm`."""
    monkeypatch.setattr(F, "scaled_mm", _documented_scaled_mm)
    monkeypatch.setattr(_documented_scaled_mm, "calls", 0)
    monkeypatch.setattr(block_linear, "recipe_support", lambda *args: NativeSupport(True, "documented stand-in"))
    base = get_block_recipe(recipe)
    torch.manual_seed(0)
    emulated = BlockScaledLinear(64, 48, recipe=dataclasses.replace(base, gemm="emulated"), index=2)
    native = BlockScaledLinear(64, 48, recipe=dataclasses.replace(base, gemm="native"), index=2)
    native.load_state_dict(emulated.state_dict())
    return emulated, native


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_a_linear_on_native_gemms_computes_what_its_emulation_computes(recipe, monkeypatch):
    """Every operand in its place (forward, dgrad, wgrad from the kept x, SR bits, Hadamard signs, 2D tiles): the
    three results equal the emulation's within fp32 accumulation (element ``(i, j)`` within ``2 C u`` of ``C``
    times row ``i``'s and row ``j``'s largest quantized magnitudes, which stay below 8x the unquantized ones: SR,
    E4M3-rounded scales, a size-16 Hadamard) where a misplaced operand or bit would be off by the values
    themselves; and the rounding streams advance alike."""
    emulated, native = _linear_pair(recipe, monkeypatch)
    x = _operand_tensor(40, 64, seed=6).div(1e3).requires_grad_()
    dy = torch.randn(40, 48, generator=torch.Generator().manual_seed(7))
    results = []
    for linear in (emulated, native):
        x.grad = None
        y = linear(x)
        y.backward(dy)
        results.append((y.detach(), x.grad.clone(), linear.weight.grad.clone()))
    w, xd = emulated.weight.detach().abs(), x.detach().abs()
    rows = ((xd.amax(1), w.amax(1), 64), (dy.abs().amax(1), w.amax(0), 48), (dy.abs().amax(0), xd.amax(0), 40))
    for got, want, (a_max, b_max, size) in zip(results[1], results[0], rows):
        bound = 2 * size * size * 2.0 ** -24 * (8 * a_max[:, None]) * (8 * b_max[None, :])
        assert (got - want).abs().le(bound).all()
    assert torch.equal(native.get_extra_state(), emulated.get_extra_state())
    assert _documented_scaled_mm.calls == 3   # forward, dgrad, wgrad: on the native path, the emulation's only once


def test_native_gemms_asked_for_where_there_are_none_are_refused_by_name():
    recipe = dataclasses.replace(get_block_recipe("mxfp8"), gemm="native")
    linear = BlockScaledLinear(32, 32, recipe=recipe)
    with pytest.raises(RuntimeError, match=r"gemm='native'.*no native block-scaled GEMM on cpu.*gemm='auto'"):
        linear(torch.ones(2, 32))
    with pytest.raises(ValueError, match=r"gemm='fast' is not one of \('auto', 'emulated', 'native'\)"):
        dataclasses.replace(recipe, gemm="fast")


def test_the_gpu_script_bounds_accept_what_the_documented_kernel_computes(monkeypatch):
    """benchmarks/gpu_block.py's agreement check, run on the stand-in: within its bound on both recipes (it is what
    a Blackwell run reports; a misplaced operand is caught by the linear test above)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import gpu_block

    _linear_pair("mxfp8", monkeypatch)   # installs the stand-in kernel and support
    for recipe in ("mxfp8", "nvfp4"):
        worst = gpu_block.agreement(recipe, 64, torch.device("cpu"))
        assert len(worst) == 3 and max(worst) <= 1.0, worst


# ---------------------------------------------------------------------- the probe, on the documented stand-in

def _swap_nibbles(mat: torch.Tensor) -> torch.Tensor:
    """FP4 codes read high nibble first: a kernel that unpacks E2M1 in the wrong order."""
    if mat.dtype != torch.float4_e2m1fn_x2:
        return mat
    raw = mat.view(torch.uint8)
    return (raw.bitwise_right_shift(4) | raw.bitwise_left_shift(4)).view(mat.dtype)


def _tiles_column_major(scales: list, rows: int) -> list:
    """Block scales read with the 128 x 4 tiles of a column consecutive (tile ``(i, j)`` at ``(j * bands + i) *
    512``), not those of a row band: the same bytes in the documented order as such a kernel would read them."""
    flat, bands = scales[0], -(-rows // 128)
    tiles = flat.numel() // 512 // bands
    moved = flat.view(torch.uint8).view(tiles, bands, 512).transpose(0, 1).reshape(-1).view(flat.dtype)
    return [moved, *scales[1:]]


def _kernel(nibbles_swapped: bool = False, tiles_column_major: bool = False):
    """:func:`_documented_scaled_mm`, or a subtly wrong kernel: ``A``'s FP4 nibbles read swapped (swapped in both
    operands alike they only permute the contraction within a block, which no GEMM result shows), or every
    operand's scale tiles ordered by column (the documented order while an operand fits one 128-row band)."""
    def kernel(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs):
        if nibbles_swapped:
            mat_a = _swap_nibbles(mat_a)
        if tiles_column_major:
            scale_a = _tiles_column_major(scale_a, mat_a.shape[0])
            scale_b = _tiles_column_major(scale_b, mat_b.shape[1])
        return _documented_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs)
    return kernel


PROBED = ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", PROBED)
def test_the_probe_accepts_the_documented_kernel_in_every_output_dtype(name, out_dtype, monkeypatch):
    """Called directly (no CUDA gate), the probe GEMM through the stand-in kernel agrees with the exact product of the
    emulation's operands within its bound, fp16 outputs included (the probe's values stay far below fp16's 65504),
    whatever float32 matmul precision the user set (the reference runs in fp64)."""
    monkeypatch.setattr(F, "scaled_mm", _documented_scaled_mm)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        worst = probe_gemm("cpu", name, name, out_dtype)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert worst <= 1.0, worst


@pytest.mark.parametrize("wrong, names", [({"nibbles_swapped": True}, ["mxfp4_e2m1", "nvfp4"]),
                                          ({"tiles_column_major": True}, PROBED)], ids=["nibbles", "tile_order"])
def test_the_probe_rejects_a_subtly_wrong_kernel(wrong, names, monkeypatch):
    """The probe's job: a kernel that reads the operands otherwise than this module lays them out fails it. The
    tile order only shows with operands of more than one 128-row band (the probe's have two)."""
    monkeypatch.setattr(F, "scaled_mm", _kernel(**wrong))
    for name in names:
        assert probe_gemm("cpu", name, name, torch.bfloat16) > 1.0, name


# ---------------------------------------------------------------------- the decision under torch.compile

def _gemms_run_natively(linear: BlockScaledLinear):
    """A function of ``x`` that asks ``linear`` how its GEMMs run on cuda:0 in bf16, as its forward does."""
    return lambda x: x + 1 if linear._native(torch.device("cuda", 0), torch.bfloat16) else x - 1


def test_a_compiled_forward_reads_the_cached_decision_and_never_traces_the_probe():
    """After gemm_support (what the engine calls at build) a fullgraph compile reads the cached answer; without it
    the support check, which runs the probe eagerly, stops a fullgraph compile with an error naming the fix, and
    breaks the graph once otherwise (then cached). No CUDA is touched but through torch.cuda's queries."""
    cached = BlockScaledLinear(32, 32, recipe="mxfp8")
    support = cached.gemm_support("cuda:0", torch.bfloat16)
    assert cached.__dict__["_native_by"] == {(torch.device("cuda", 0), torch.bfloat16): support}
    x = torch.zeros(2)
    want = x + 1 if support.available else x - 1
    assert torch.equal(torch.compile(_gemms_run_natively(cached), backend="eager", fullgraph=True)(x), want)
    fresh = BlockScaledLinear(32, 32, recipe="mxfp8")
    with pytest.raises(Exception, match=r"gemm_support\(device, compute_dtype\) on each BlockScaledLinear before"):
        torch.compile(_gemms_run_natively(fresh), backend="eager", fullgraph=True)(x)
    assert torch.equal(torch.compile(_gemms_run_natively(fresh), backend="eager")(x), want)
    assert fresh.__dict__["_native_by"] == cached.__dict__["_native_by"]


def test_tf32_matmuls_are_named_in_the_decision_of_an_emulated_nvfp4_recipe_on_cuda(monkeypatch):
    """The emulation is exact only with fp32 matmuls in fp32; NVFP4's operands are not exact in TF32 (MX's are)."""
    import mixprec.blockscale.gemm as gemm
    from mixprec.engine.preparation.prepare import emulation_words

    monkeypatch.setattr(gemm, "tf32_matmuls", lambda: True)
    cuda = torch.device("cuda", 0)
    words = emulation_words(cuda, get_block_recipe("nvfp4"), torch.bfloat16)
    if "emulated" in words:   # no Blackwell GPU here
        assert "fp32 matmuls run in TF32 here" in words and "set_float32_matmul_precision('highest')" in words
    assert "TF32" not in emulation_words(cuda, get_block_recipe("mxfp8"), torch.bfloat16)
    assert "TF32" not in emulation_words(torch.device("cpu"), get_block_recipe("nvfp4"), torch.bfloat16)


def test_tf32_matmuls_follows_either_precision_api():
    script = ("import torch; from mixprec.blockscale.gemm import tf32_matmuls as on; a = on(); "
              "torch.set_float32_matmul_precision('high'); b = on(); "
              "torch.backends.cuda.matmul.fp32_precision = 'ieee'; c = on(); "
              "torch.backends.cuda.matmul.fp32_precision = 'tf32'; print(a, b, c, on())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "False", "True"]
