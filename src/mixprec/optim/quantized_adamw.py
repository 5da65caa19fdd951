"""AdamW's step on a param with 8-bit blockwise moments: a torch-op reference and a fused CPU kernel.

Both compute, per element in fp32 (``m``, ``v`` decoded from their codes, :mod:`mixprec.optim.quantized_state`)::

    θ ← θ · (1 − lr·λ)                      (skipped when λ = 0)
    m ← m + (g − m) · (1 − β1)
    v ← v · β2 + ((1 − β2) · g) · g
    θ ← θ + (−lr / (1 − β1^t)) · m / (√v · (1 / √(1 − β2^t)) + ε)

then requantize ``m`` and ``v`` blockwise (``state_rounding``) and round θ into the param. This is
``torch.optim.AdamW``'s update with one separately rounded operation per step of the formula: no fused
multiply-add (``torch.lerp`` and ``addcmul`` use one on a CPU), no division by a scalar (a CUDA kernel
multiplies by the reciprocal instead) and a correctly rounded square root
(:func:`mixprec.optim.quantized_state.sqrt_fp32`: torch's CPU ``sqrt`` is not), so that the torch ops give
the same bits on any device with IEEE fp32 arithmetic (checked on CPUs only: no GPU has run them yet), and
the fused kernel gives the same bits as the torch ops. The
result differs from :func:`mixprec.optim.adamw.adamw_update_`'s (torch.optim's op order) by a few ulps of
the update, which the 8-bit codes rarely resolve (tests bound it).

:func:`reference_update_` is the torch-op version (any device, any 8-bit code, fp32 math; ``AdamW`` uses
it where the kernel does not apply).
:func:`fused_step_` is the same step in one C pass per block of 256 for int8 and fp8 state on a CPU
(``mixprec/optim/quantized_adamw.c``, built at first use by :mod:`mixprec.optim.c_kernels`): it reads the bf16
or fp32 param and gradient, the codes and the scales once and writes them once, where the torch ops take
about 15 passes over fp32 temporaries per moment. On first use in a process it is checked against the
reference on random inputs, bit for bit, and refused (the reference used, the reason in
:func:`kernel_status`) if they differ. Random numbers come from the counter-based stream of the param's
:class:`~mixprec.optim.sr_stream.SRKey` (what the optimizers pass; hashed in the kernel) or from a ``torch.Generator``
in the reference's order (state rounding's uniforms for ``m``, then ``v``, then the param's 16 bits per element),
so both paths take the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import threading
from pathlib import Path

import torch

from mixprec.optim import c_kernels
from mixprec.optim import quantized_state as qs
from mixprec.optim.rounding import stochastic_round_to_bf16
from mixprec.optim.sr_stream import SRKey, noise16, uniform
from mixprec.policy.policy import STATE_ROUNDINGS

__all__ = ["KERNEL_SOURCE", "reference_update_", "update_fp32_", "fusable", "fused_step_", "kernel_status"]

KERNEL_SOURCE = Path(__file__).with_name("quantized_adamw.c")
_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _hyper(step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> dict[str, float]:
    """The scalars of one step (Python floats, rounded to fp32 where an fp32 op takes them, as torch does)."""
    return dict(decay=1 - lr * weight_decay if weight_decay != 0 else 1.0, one_minus_beta1=1 - beta1, beta2=beta2,
                one_minus_beta2=1 - beta2, inv_bc2_sqrt=1 / (1 - beta2**step) ** 0.5, eps=eps,
                neg_step_size=-(lr / (1 - beta1**step)))


def reference_update_(param_fp32: torch.Tensor, grad_fp32: torch.Tensor, m: tuple[torch.Tensor, torch.Tensor],
                      v: tuple[torch.Tensor, torch.Tensor], *, step: float, lr: float, beta1: float, beta2: float,
                      eps: float, weight_decay: float, state_rounding: str = "nearest",
                      generator: torch.Generator | SRKey | None = None) -> None:
    """One AdamW step (module docstring) in torch ops: ``param_fp32`` updated in place, ``m`` / ``v`` (each
    ``(codes, absmax)`` of :func:`quantized_state.quantize`) requantized in place with ``state_rounding``.

    ``param_fp32`` and ``grad_fp32``: fp32, one shape; the codes of that shape (any 8-bit code; ``v``'s is the
    nonnegative one), ``step`` the count after incrementing. Rounding ``param_fp32`` into a 16-bit param is
    the caller's. Under ``state_rounding="stochastic"`` takes ``2 * nblocks * 256`` uniforms: from the
    counter-based stream when ``generator`` is an :class:`mixprec.optim.sr_stream.SRKey` (the param's key:
    ``m`` draws under purpose ``"exp_avg"``, ``v`` under ``"exp_avg_sq"``; no RNG moves), else from
    ``generator`` (a ``torch.Generator``, or None: torch's global RNG, for standalone use; the optimizers always pass
    their stream's key); none otherwise. No host sync.
    """
    m_code = qs.code_of(m[0], nonnegative=False)
    v_code = qs.code_of(v[0], nonnegative=True)
    m_fp32 = qs.dequantize(*m, m_code)
    v_fp32 = qs.dequantize(*v, v_code)
    update_fp32_(param_fp32, grad_fp32, m_fp32, v_fp32, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay)
    keyed = isinstance(generator, SRKey)
    qs.quantize(m_fp32, m_code, rounding=state_rounding, generator=generator.of("exp_avg") if keyed else generator, out=m)
    qs.quantize(v_fp32, v_code, rounding=state_rounding, generator=generator.of("exp_avg_sq") if keyed else generator,
                out=v)


def update_fp32_(param_fp32: torch.Tensor, grad_fp32: torch.Tensor, m_fp32: torch.Tensor, v_fp32: torch.Tensor, *,
                 step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """The fp32 part of :func:`reference_update_` (module docstring), in place on ``param_fp32``, ``m_fp32`` and
    ``v_fp32`` (the decoded moments; quantizing them is the caller's): element-wise, so a slice of a tensor steps
    as in the whole. All fp32 tensors of one shape. No host sync."""
    h = _hyper(step, lr, beta1, beta2, eps, weight_decay)
    if weight_decay != 0:
        param_fp32.mul_(h["decay"])
    m_fp32.add_((grad_fp32 - m_fp32).mul_(h["one_minus_beta1"]))
    v_fp32.mul_(h["beta2"]).add_(grad_fp32.mul(h["one_minus_beta2"]).mul_(grad_fp32))
    denom = qs.sqrt_fp32(v_fp32).mul_(h["inv_bc2_sqrt"]).add_(h["eps"])
    param_fp32.add_(m_fp32.mul(h["neg_step_size"]).div_(denom))


# ------------------------------------------------------------------------------------------- fused kernel
class _Lookup(ctypes.Structure):
    _fields_ = [("shift", ctypes.c_int), ("mask", ctypes.c_uint32), ("counts", ctypes.c_void_p), ("bound", ctypes.c_void_p)]


class _Codec(ctypes.Structure):   # codec_t in quantized_adamw.c
    _fields_ = [("decode", ctypes.c_void_p), ("table", ctypes.c_void_p), ("bytes", ctypes.c_void_p),
                ("nearest", _Lookup), ("neighbours", _Lookup), ("table_len", ctypes.c_int), ("qmax", ctypes.c_float),
                ("floor", ctypes.c_float), ("lowest", ctypes.c_float)]


_SCALARS = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "inv_bc2_sqrt", "eps", "neg_step_size")


class _Args(ctypes.Structure):   # step_args in quantized_adamw.c, field for field
    _fields_ = ([("n", ctypes.c_int64), ("param", ctypes.c_void_p), ("param_bf16", ctypes.c_int),
                 ("grad", ctypes.c_void_p), ("grad_bf16", ctypes.c_int), ("m_codes", ctypes.c_void_p),
                 ("m_absmax", ctypes.c_void_p), ("v_codes", ctypes.c_void_p), ("v_absmax", ctypes.c_void_p),
                 ("m_codec", _Codec), ("v_codec", _Codec), ("fp8", ctypes.c_int), ("m_rand", ctypes.c_void_p),
                 ("v_rand", ctypes.c_void_p), ("p_noise", ctypes.c_void_p)]
                + [(name, ctypes.c_float) for name in _SCALARS]
                + [("block_begin", ctypes.c_int64), ("block_end", ctypes.c_int64), ("state_keyed", ctypes.c_int),
                   ("param_keyed", ctypes.c_int)]
                + [(name, ctypes.c_uint32) for name in ("m_k1", "m_k2", "v_k1", "v_k2", "p_k1", "p_k2", "offset")])


# the two code pairs the kernel takes: (m's code, v's code), keyed by m's storage dtype
_PAIRS = {torch.uint8: (qs.CODES["dynamic-signed"], qs.CODES["dynamic-sqrt"]),
          torch.float8_e4m3fn: (qs.CODES["e4m3"], qs.CODES["e5m2"])}


def _lookup_struct(code: qs.Code, kind: str) -> _Lookup:
    lookup = qs.bin_lookup(code, kind)
    return _Lookup(lookup.shift, lookup.mask, lookup.counts.data_ptr(), lookup.bound.data_ptr())


@functools.cache
def _codec(name: str) -> tuple[_Codec, tuple[torch.Tensor, ...]]:
    """The kernel's description of code ``name`` and the CPU tensors it points into (kept alive here)."""
    code = qs.CODES[name]
    table = code.table()
    if code.indexed:
        decode, code_bytes = table, torch.arange(table.numel(), dtype=torch.uint8)
    else:
        decode = torch.arange(256, dtype=torch.uint8).view(code.storage_dtype).float()   # every byte's value
        code_bytes = table.to(code.storage_dtype).view(torch.uint8)                        # exact: fp8 values
    lowest = float(-table[0]) if name == "dynamic-signed" else 0.0
    codec = _Codec(decode.data_ptr(), table.data_ptr(), code_bytes.data_ptr(),
                   _lookup_struct(code, "midpoints" if code.indexed else "magnitudes"), _lookup_struct(code, "table"),
                   table.numel(), code.qmax, code.qmax * torch.finfo(torch.float32).tiny, lowest)
    return codec, (decode, table, code_bytes)


_library: ctypes.CDLL | None = None    # the kernel, once checked (None: unusable)
_ready = False
_candidate: ctypes.CDLL | None = None  # the kernel under its check (seen only by the checking thread)
_lock = threading.RLock()


def _kernel() -> ctypes.CDLL | None:
    """The loaded kernel, checked once per process against :func:`reference_update_`; None when unusable.
    Thread-safe: other threads wait for the first one's build and check, and never run an unchecked kernel."""
    global _library, _ready
    if _ready:
        return _library
    with _lock:
        if not _ready:
            if _candidate is not None:   # re-entered from _self_check's fused_step_ (this thread holds the lock)
                return _candidate
            _library, _ready = _load_and_check(), True
        return _library


def _load_and_check() -> ctypes.CDLL | None:
    global _candidate
    library = c_kernels.load(KERNEL_SOURCE)
    if library is None:
        return None
    try:
        library.mixprec_adamw8bit_step.argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
        library.mixprec_adamw8bit_step.restype = ctypes.c_int
        library.mixprec_adamw8bit_args_size.restype = ctypes.c_int64
        library.mixprec_sr_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32,
                                            ctypes.c_uint32, ctypes.c_uint32]
        library.mixprec_sr_bf16.restype = None
    except AttributeError as err:   # a library without the kernel's symbols
        c_kernels.reject(KERNEL_SOURCE, f"it lacks a symbol: {err}")
        return None
    if library.mixprec_adamw8bit_args_size() != ctypes.sizeof(_Args):
        c_kernels.reject(KERNEL_SOURCE, f"its argument struct is {library.mixprec_adamw8bit_args_size()} bytes, "
                                        f"the caller's {ctypes.sizeof(_Args)}")
        return None
    _candidate = library
    try:
        mismatch = _self_check() or _check_stochastic_round()
    finally:
        _candidate = None
    if mismatch:
        c_kernels.reject(KERNEL_SOURCE, f"it differs from the torch-op reference ({mismatch})")
        return None
    return library


def kernel_status() -> str:
    """How 8-bit-state AdamW steps run on a CPU in this process: ``"fused C kernel"``, or ``"torch ops: <why and
    the fix> (<what it costs>)"`` (building and checking the kernel first if that has not happened yet)."""
    if _kernel() is not None:
        return "fused C kernel"
    return (f"torch ops: {c_kernels.status(KERNEL_SOURCE) or 'the C kernel is not available'} ({FALLBACK_COST})")


FALLBACK_COST = "the same bits as the kernel, a 2-4x slower optimizer step"


def library_path() -> Path | None:
    """The cached, checked kernel library this process steps with (None when the torch ops run)."""
    return c_kernels.library_path(KERNEL_SOURCE) if _kernel() is not None else None


def fusable(param: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, v_codes: torch.Tensor, *,
            rounding: str) -> bool:
    """Whether :func:`fused_step_` takes this param: a CPU fp32 or bf16 param with a dense gradient of
    either dtype, all contiguous, int8 or fp8 codes (E4M3 ``m``, E5M2 ``v``), ``rounding`` nearest or stochastic for a bf16
    param (any for an fp32 one: it takes the result exactly), and the kernel available (builds and checks
    it on the first call)."""
    return _takes(param, grad, m_codes, v_codes, rounding=rounding) and _kernel() is not None


def _takes(param: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, v_codes: torch.Tensor, *,
           rounding: str) -> bool:
    """:func:`fusable` but for the kernel's availability."""
    return (param.device.type == "cpu" and param.dtype in _FUSED_DTYPES and grad.dtype in _FUSED_DTYPES
            and grad.layout == torch.strided and grad.device.type == "cpu" and grad.shape == param.shape
            and param.is_contiguous() and grad.is_contiguous() and m_codes.dtype in _PAIRS
            and v_codes.dtype == _PAIRS[m_codes.dtype][1].storage_dtype and m_codes.device.type == "cpu"
            and v_codes.device.type == "cpu"
            and m_codes.is_contiguous() and v_codes.is_contiguous()
            and (param.dtype == torch.float32 or rounding in ("nearest", "stochastic"))
            and grad.untyped_storage().data_ptr() != param.untyped_storage().data_ptr())   # the kernel's restrict


def fused_step_(param: torch.Tensor, grad: torch.Tensor, m: tuple[torch.Tensor, torch.Tensor],
                v: tuple[torch.Tensor, torch.Tensor], *, step: float, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, rounding: str = "nearest", state_rounding: str = "nearest",
                generator: torch.Generator | SRKey | None = None) -> None:
    """:func:`reference_update_` followed by rounding θ into ``param`` (``rounding``: nearest even, or stochastic
    for bf16 as :func:`mixprec.optim.rounding.stochastic_round_to_bf16`), in one C pass; everything in place.

    Takes what :func:`fusable` accepts (call it first: it raises nothing, this raises RuntimeError when the
    kernel is unavailable, ValueError when ``m`` / ``v`` do not fit ``param``: codes of its shape, one fp32
    scale per block, as the torch ops would refuse them, instead of reading or writing past their ends). Runs on ``torch.get_num_threads()`` threads (at least 16 blocks each). Takes the
    reference's random numbers: ``2 * nblocks * 256`` uniforms under stochastic state rounding, then
    ``param.numel()`` int32 under stochastic param rounding, from the counter-based stream when ``generator``
    is an ``SRKey`` (the param's key; its purpose ``"param"`` for the param's bits), else drawn from
    ``generator`` in that order (a ``torch.Generator``, or None: torch's global RNG, for standalone use; the
    optimizers always pass their stream's key). No host sync (CPU only).
    """
    library = _kernel()
    if library is None:
        raise RuntimeError(f"fused_step_ needs the C kernel, which is unavailable: {kernel_status()}")
    _check_buffers(param, grad, m, v)
    m_code, v_code = _PAIRS[m[0].dtype]
    nblocks = m[1].numel()
    m_rand = v_rand = noise = None
    # the stream's bits are hashed in the kernel while the run of indices stays below 2**32 (its key words
    # fold in the index's high word), else drawn here and passed in, as a torch generator's are
    keyed = isinstance(generator, SRKey)
    in_kernel = keyed and (generator.offset >> 32) == ((generator.offset + nblocks * qs.BLOCK_SIZE - 1) >> 32)
    state_sr = state_rounding == "stochastic"
    param_sr = rounding == "stochastic" and param.dtype == torch.bfloat16
    if state_sr and not in_kernel:
        blocks = (nblocks, qs.BLOCK_SIZE)
        m_rand = uniform(generator.of("exp_avg"), blocks) if keyed else torch.rand(blocks, generator=generator)
        v_rand = uniform(generator.of("exp_avg_sq"), blocks) if keyed else torch.rand(blocks, generator=generator)
    if param_sr and not in_kernel:
        noise = (noise16(generator.of("param"), param.shape) if keyed else
                 torch.empty(param.shape, dtype=torch.int32).random_(generator=generator))
    words = [0] * 6
    if in_kernel:
        high = generator.offset >> 32
        words = [*generator.of("exp_avg").words(high), *generator.of("exp_avg_sq").words(high),
                 *generator.of("param").words(high)]
    h = _hyper(step, lr, beta1, beta2, eps, weight_decay)
    args = _Args(param.numel(), param.data_ptr(), param.dtype == torch.bfloat16, grad.data_ptr(),
                 grad.dtype == torch.bfloat16, m[0].data_ptr(), m[1].data_ptr(), v[0].data_ptr(), v[1].data_ptr(),
                 _codec(m_code.name)[0], _codec(v_code.name)[0], not m_code.indexed,
                 None if m_rand is None else m_rand.data_ptr(), None if v_rand is None else v_rand.data_ptr(),
                 None if noise is None else noise.data_ptr(), *(h[name] for name in _SCALARS), 0, 0,
                 state_sr and in_kernel, param_sr and in_kernel, *words, generator.offset & 0xFFFFFFFF if in_kernel else 0)
    library.mixprec_adamw8bit_step(ctypes.byref(args), torch.get_num_threads())


def stochastic_round_into_(out_bf16: torch.Tensor, x_fp32: torch.Tensor, key: SRKey) -> bool:
    """``out_bf16.copy_(stochastic_round_to_bf16(x_fp32, generator=key))`` in one C pass (the kernel's copy of the
    stream's hash: no noise tensor), where it applies: CPU, contiguous, fp32 into bf16 of one shape, the run of
    indices below the next multiple of ``2**32``, the kernel available. Returns False (nothing done) otherwise:
    the caller then runs the torch ops (the same bits). No host sync."""
    n = x_fp32.numel()
    if not (x_fp32.device.type == "cpu" and out_bf16.device.type == "cpu" and x_fp32.dtype == torch.float32
            and out_bf16.dtype == torch.bfloat16 and x_fp32.shape == out_bf16.shape and x_fp32.is_contiguous()
            and out_bf16.is_contiguous() and (key.offset >> 32) == ((key.offset + max(n, 1) - 1) >> 32)):
        return False
    library = _kernel()
    if library is None:
        return False
    k1, k2 = key.words(key.offset >> 32)
    library.mixprec_sr_bf16(x_fp32.data_ptr(), out_bf16.data_ptr(), n, k1, k2, key.offset & 0xFFFFFFFF)
    return True


def _check_buffers(param: torch.Tensor, grad: torch.Tensor, m: tuple[torch.Tensor, torch.Tensor],
                   v: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise ValueError unless every buffer the kernel reads or writes through a raw pointer holds what it
    assumes: the param's element count, its layout and dtype (else it would run past an end: e.g. the state
    of another model's param loaded by mistake, which the torch ops refuse with a shape error)."""
    nblocks = -(-param.numel() // qs.BLOCK_SIZE)
    problems = [] if _takes(param, grad, m[0], v[0], rounding="nearest") else ["a layout fusable() refuses"]
    for name, (codes, absmax) in (("exp_avg", m), ("exp_avg_sq", v)):
        if codes.shape != param.shape:
            problems.append(f"{name} codes of shape {tuple(codes.shape)}")
        if absmax.dtype != torch.float32 or absmax.device.type != "cpu" or not absmax.is_contiguous() \
                or absmax.numel() != nblocks:
            problems.append(f"{name} absmax of dtype {absmax.dtype}, shape {tuple(absmax.shape)} (want fp32 ({nblocks},))")
    if problems:
        raise ValueError(f"fused_step_ got a param of shape {tuple(param.shape)} ({param.dtype}) with "
                         f"{'; '.join(problems)}: the state does not belong to this param (loaded from another "
                         "model's checkpoint?)")


def _check_stochastic_round() -> str:
    """:func:`stochastic_round_into_` against the torch ops on random values, +-0, +-inf, NaNs, the largest
    finite fp32 values and bf16-exact ones, at an offset: "" when every bit agrees, else what differed."""
    gen = torch.Generator().manual_seed(1)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 3.4028235e38, -3.4028235e38, 1.0,
                            -2.0, 1e-40, -1e-40])
    x = torch.cat([torch.randn(1000, generator=gen) * 10.0 ** torch.randint(-30, 30, (1000,), generator=gen), special])
    key = SRKey(int(torch.randint(0, 2**62, (1,), generator=gen)), 2, 5, "param")
    for offset in (0, 2**32 - 1100, 2**33 + 3):
        got = torch.empty(x.shape, dtype=torch.bfloat16)
        if not stochastic_round_into_(got, x, key.at(offset)):
            return "stochastic rounding to bf16 with the counter-based stream refused its inputs"
        if not torch.equal(got.view(torch.int16), stochastic_round_to_bf16(x, generator=key.at(offset)).view(torch.int16)):
            return "stochastic rounding to bf16 with the counter-based stream"
    return ""


def _self_check() -> str:
    """Run both paths on random inputs (every dtype pair, both roundings, random bits from a torch generator
    and from the counter-based stream, hashed in C, a short last block, an all-zero
    block, a negative block maximum, a NaN block); "" when they agree bit for bit in every finite block (a
    non-finite block: NaN scales in both), else what differed. Uses its own generators: the caller's RNG
    does not move."""
    gen = torch.Generator().manual_seed(0)
    n = 5 * qs.BLOCK_SIZE + 37
    hyper = dict(step=3.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    for (m_code, v_code), p_dtype, g_dtype, state_rounding, keyed in itertools.product(
            _PAIRS.values(), _FUSED_DTYPES, _FUSED_DTYPES, STATE_ROUNDINGS, (False, True)):
        rounding = "stochastic" if p_dtype == torch.bfloat16 and state_rounding == "stochastic" else "nearest"
        param = torch.randn(n, generator=gen).to(p_dtype)
        grad = (torch.randn(n, generator=gen) * 1e-3).to(g_dtype)
        grad[2 * qs.BLOCK_SIZE + 5] = -1.0                           # a negative block maximum
        grad[4 * qs.BLOCK_SIZE + 1] = math.nan                       # a poisoned block
        m_fp32, v_fp32 = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
        m_fp32[: qs.BLOCK_SIZE] = v_fp32[: qs.BLOCK_SIZE] = grad[: qs.BLOCK_SIZE] = 0   # an all-zero block
        m = qs.quantize(m_fp32, m_code)
        v = qs.quantize(v_fp32, v_code)
        want = [param.clone(), m[0].clone(), m[1].clone(), v[0].clone(), v[1].clone()]
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        key = SRKey(seed, 3, 3, "param", offset=seed % 2**20) if keyed else None
        ref_gen = key or torch.Generator().manual_seed(seed)
        want_fp32 = want[0].float()
        reference_update_(want_fp32, grad.float(), (want[1], want[2]), (want[3], want[4]),
                          state_rounding=state_rounding, generator=ref_gen, **hyper)
        want[0].copy_(stochastic_round_to_bf16(want_fp32, generator=ref_gen) if rounding == "stochastic"
                      else want_fp32)
        fused_step_(param, grad, m, v, rounding=rounding, state_rounding=state_rounding,
                    generator=key or torch.Generator().manual_seed(seed), **hyper)
        finite = (torch.isfinite(want[2]) & torch.isfinite(want[4])).repeat_interleave(qs.BLOCK_SIZE)[:n]
        for name, got, expected in zip(("param", "m codes", "m absmax", "v codes", "v absmax"),
                                       (param, m[0], m[1], v[0], v[1]), want):
            if got.numel() == n:
                same = torch.equal(got[finite].view(torch.uint8), expected[finite].view(torch.uint8))
            else:
                same = torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
            if not same:
                return (f"{name} for {m_code.name}/{v_code.name} codes, {p_dtype} params, {g_dtype} grads, "
                        f"rounding={rounding!r}, state_rounding={state_rounding!r}"
                        + (", the counter-based stream" if keyed else ""))
    return ""
