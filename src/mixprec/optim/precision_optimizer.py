"""The optimizer shell that the fp32-computing optimizers share.

:class:`PrecisionOptimizer` is the ``torch.optim.Optimizer`` base of :class:`mixprec.optim.AdamW`
and :class:`mixprec.optim.SGD`: it validates ``rounding`` / ``state_dtype`` / ``state_rounding``
(:mod:`mixprec.optim.arguments`), creates the common state (``step``, ``kahan_comp``), moves state between
its storage format (a 16/32-bit dtype, or blockwise 8-bit codes and scales: :mod:`mixprec.optim.quantized_state`)
and fp32, writes results back (:mod:`mixprec.optim.rounding`) and runs the lost-update check (steps 1, 10,
100, ...).
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any

import torch

from mixprec.optim import quantized_adamw
from mixprec.optim import quantized_state as qs
from mixprec.optim.arguments import _FLOAT_DTYPES, _check_rounding, _check_state_dtype, _check_state_rounding
from mixprec.optim import sharded
from mixprec.optim.rounding import lost_update_counts, stochastic_round_to_bf16, write_back_
from mixprec.optim.sr_stream import SRKey
from mixprec.policy.policy import QUANTIZED_STATE_DTYPES, state_name

__all__ = ["grad_fp32", "PrecisionOptimizer"]

_PARAM_DTYPES = _FLOAT_DTYPES + (torch.complex64,)   # complex64: two fp32 values, stepped on its real view
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when fp32 (so in-place math hits the stored tensor), its ``view_as_real`` when
    complex64 (an fp32 alias: in-place math hits the stored tensor too, as ``torch.optim`` steps complex
    params), else an fp32 copy."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t if t.dtype == torch.float32 else t.float()


def grad_fp32(p: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """``p.grad`` as a dense fp32 tensor of :func:`_as_fp32`'s shape, for the update math (read, never
    written). A sparse COO gradient (``nn.Embedding(sparse=True)``) is upcast to fp32 *then* densified,
    so duplicate rows are summed in fp32; the step then equals the step on the dense gradient (AdamW's
    moments decay on every row, as with a dense table: not ``torch.optim.SparseAdam``'s lazy update).
    Costs one dense fp32 temporary of the param's size. ``grad``: the gradient to use instead of ``p.grad`` (a
    sharded param's local gradient, :meth:`PrecisionOptimizer._local_view`). No host sync."""
    grad = p.grad if grad is None else grad
    if grad.is_sparse:
        grad = grad.to(torch.complex64 if grad.is_complex() else torch.float32).to_dense()
    return _as_fp32(grad)


def _stochastic_round_into(out_bf16: torch.Tensor, value_fp32: torch.Tensor, key: SRKey | None) -> None:
    """``out_bf16`` := ``value_fp32`` stochastically rounded (``key``'s stream; None: torch's global RNG, the legacy
    stream): one C pass on a CPU where the kernel applies, else the torch ops (the same bits). No host sync."""
    if key is None or not quantized_adamw.stochastic_round_into_(out_bf16, value_fp32, key):
        out_bf16.copy_(stochastic_round_to_bf16(value_fp32, generator=key))


def _check_sr_seed(owner: str, sr_seed: int | None) -> int:
    """The stochastic-rounding seed: ``sr_seed`` checked, else ``torch.initial_seed()`` (what
    ``torch.manual_seed`` set; reading it draws nothing from the RNG)."""
    if sr_seed is None:
        return int(torch.initial_seed()) % 2**64
    if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) or not 0 <= sr_seed < 2**64:
        raise ValueError(f"{owner} sr_seed={sr_seed!r} is not allowed; pass an int in [0, 2**64), e.g. sr_seed=0, "
                         "or None (torch.initial_seed(), what torch.manual_seed set)")
    return sr_seed


def _is_check_step(step: int) -> bool:
    """1, 10, 100, 1000, ...: where the lost-update check runs (one host sync per decade of steps)."""
    while step >= 10 and step % 10 == 0:
        step //= 10
    return step == 1


class PrecisionOptimizer(torch.optim.Optimizer):
    """Shared shell: precision settings, state creation and storage, write-back, warnings.

    Subclasses implement ``step`` with :meth:`_state`, :meth:`_load`, :meth:`_store`, :meth:`_put`,
    :meth:`_write_back` and :meth:`_warn_if_updates_lost`, and name their moments known to be >= 0 in
    ``_NONNEGATIVE`` (they get the nonnegative 8-bit code, :func:`mixprec.optim.quantized_state.code_for`).

    State per param: ``step`` (float32 scalar on the CPU, as torch.optim), every moment
    (``exp_avg``, ``momentum_buffer``...) in ``state_dtype``, and ``kahan_comp`` in the param
    dtype for 16-bit params under ``rounding='kahan'``. Under an 8-bit ``state_dtype`` (``torch.int8``,
    ``torch.float8_e4m3fn``) a moment of a tensor :func:`mixprec.optim.quantized_state.quantizes` is two
    entries: ``state[key]`` (codes, the param's shape, one byte each) and ``state[key + "_absmax"]``
    (fp32, one per block of 256), both plain tensors, so ``state_dict()``, checkpoints and the bench's
    tensor census see them; other tensors' moments stay fp32 (:meth:`state_layout` counts both kinds).
    """

    _NONNEGATIVE: frozenset[str] = frozenset()
    _SHARDS_8BIT = False   # whether step() handles 8-bit state of FSDP2 shards (mixprec.optim.sharded_blocks)

    def __init__(self, params, defaults: dict[str, Any], *, rounding: str | None,
                 state_dtype: torch.dtype | str | None, state_rounding: str | None = None,
                 sr_seed: int | None = None) -> None:
        owner = type(self).__name__
        defaults = {**defaults, "sr_seed": _check_sr_seed(owner, sr_seed)}
        self._param_index: dict[int, int] = {}   # id(param) -> its index in the param order (the stream's key)
        self._flat_params: list[torch.Tensor] = []
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}   # id(local shard) -> (it, param, offset)
        self._precision_explicit = rounding is not None or state_dtype is not None or state_rounding is not None
        self.rounding: str = _check_rounding(owner, rounding)
        self.state_dtype: torch.dtype = _check_state_dtype(owner, state_dtype)
        self.state_rounding: str = _check_state_rounding(owner, state_rounding, self.state_dtype)
        written = {"rounding": rounding, "state_dtype": state_dtype, "state_rounding": state_rounding}
        self._explicit = {k: getattr(self, k) for k, v in written.items() if v is not None}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (also an optimizer pickled before the stream existed: its groups have no ``sr_seed``, so it
        keeps the legacy global-RNG stream, :attr:`sr_stream`)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_param_index", {})
        self.__dict__.setdefault("_flat_params", [])
        self.__dict__.setdefault("_shards", {})

    @property
    def precision_explicit(self) -> bool:
        """True when ``rounding``, ``state_dtype`` or ``state_rounding`` was passed to the constructor."""
        return self._precision_explicit

    @property
    def explicit_precision(self) -> dict[str, Any]:
        """The precision settings passed to the constructor (``rounding`` / ``state_dtype`` / ``state_rounding``,
        checked values): a policy must agree with these; the others are the policy's to set."""
        return dict(self._explicit)

    def _with_explicit(self, rounding: str, state_dtype: torch.dtype | str, state_rounding: str | None
                       ) -> tuple[str, torch.dtype | str, str | None]:
        """A policy's settings with the constructor's explicit ones in their place."""
        e = self._explicit
        return (e.get("rounding", rounding), e.get("state_dtype", state_dtype), e.get("state_rounding", state_rounding))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_param_dtypes(self.param_groups[-1]["params"], self.rounding)

    def _check_param_dtypes(self, params, rounding: str) -> None:
        owner = type(self).__name__
        for p in params:
            if p.dtype not in _PARAM_DTYPES:
                raise ValueError(f"{owner} got a param of dtype {p.dtype} (shape {tuple(p.shape)}); allowed param "
                                 f"dtypes are {[str(d).replace('torch.', '') for d in _PARAM_DTYPES]}; cast it to one "
                                 "of them (e.g. a complex128 or complex32 param to complex64), or use torch.optim")
            if rounding == "stochastic" and p.dtype in _HALF_DTYPES and p.dtype != torch.bfloat16:
                raise ValueError(f"{owner} rounding='stochastic' needs bf16 params, got param dtype "
                                 f"{p.dtype}; use rounding='kahan' (or cast the params to bf16)")

    def _checked(self, rounding: str, state_dtype: torch.dtype | str, state_rounding: str | None
                 ) -> tuple[str, torch.dtype, str]:
        owner = type(self).__name__
        rounding = _check_rounding(owner, rounding)
        self._check_param_dtypes(chain.from_iterable(g["params"] for g in self.param_groups), rounding)
        state_dtype = _check_state_dtype(owner, state_dtype)
        return rounding, state_dtype, _check_state_rounding(owner, state_rounding, state_dtype)

    def set_precision(self, *, rounding: str, state_dtype: torch.dtype | str, state_rounding: str | None = None) -> None:
        """Adopt a policy's ``rounding``, ``state_dtype`` and ``state_rounding``; call before the first step.

        Raises:
            RuntimeError: optimizer state already exists (a step was taken or a state dict loaded).
            ValueError: invalid ``rounding`` / ``state_dtype`` / ``state_rounding``, or ``'stochastic'``
                with non-bf16 16-bit params.
        """
        if any(len(s) > 0 for s in self.state.values()):
            raise RuntimeError(f"{type(self).__name__}.set_precision must be called before the first step: state "
                               "already exists; build a new optimizer to change precision")
        self.rounding, self.state_dtype, self.state_rounding = self._checked(rounding, state_dtype, state_rounding)

    # ---------------------------------------------------------------- the engine's contract
    def compensation(self, p: torch.Tensor) -> torch.Tensor | None:
        """The Kahan compensation buffer of ``p`` (param dtype, shape of ``p``), or None. No sync."""
        return self.state[p].get("kahan_comp") if p in self.state else None

    def move_state(self, moves: list[tuple[torch.Tensor, torch.Tensor | None]], *, rounding: str,
                   state_dtype: torch.dtype | str, state_rounding: str | None = None) -> None:
        """Re-key state after the engine swapped the tensors this optimizer steps, and adopt a new precision.

        ``moves``: ``(old, new)`` per tensor; ``new=None`` drops ``old``'s state. Moments keep their
        values: as they are where the storage format is unchanged (8-bit codes and scales bit for bit),
        else through fp32 into the new format (cast, or quantized / dequantized: one rounding); Kahan
        compensation is dropped (the engine folded it into the params first) and restarts at zero where
        ``rounding`` is still ``'kahan'``; ``step`` is kept. The precision is adopted, but for the settings
        passed to the constructor (:attr:`explicit_precision`), which stay. No sync.

        Raises:
            ValueError: invalid ``rounding`` / ``state_dtype`` / ``state_rounding``, or ``'stochastic'``
                with fp16 params. Nothing has changed then.
        """
        self.rounding, self.state_dtype, self.state_rounding = self._checked(
            *self._with_explicit(rounding, state_dtype, state_rounding))   # settings not passed follow the policy
        states = [(new, self.state.pop(old, None)) for old, new in moves]   # all out first: old and new may alias
        for new, state in states:
            if not state or new is None:
                continue
            state.pop("kahan_comp", None)
            self.state[new] = self._restored(new, state, copy=False)

    def start_compensation(self, residuals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the Kahan compensation of each 16-bit ``p`` to ``residual`` (fp32, what rounding ``p`` to its
        dtype lost), stored in ``p``'s dtype (:func:`mixprec.optim.contract.start_compensation`). No sync."""
        for p, residual in residuals:
            self.state[p]["kahan_comp"] = residual.to(p.dtype)

    def state_layout(self) -> dict[str, int]:
        """How this optimizer lays out moment state over the tensors it steps, from their shapes (valid
        before the first step): ``quantized_tensors`` / ``quantized_elements`` held in 8-bit codes (0 unless
        ``state_dtype`` is 8-bit) and ``full_tensors`` / ``full_elements`` kept in ``state_dtype``, or in fp32
        under 8-bit state (fewer than 4096 elements, 1-D or complex). Groups that keep no moments (SGD
        without momentum) are not counted."""
        stepped = list(chain.from_iterable(g["params"] for g in self.param_groups if self._keeps_moments(g)))
        quantized = [t for t in stepped if self._quantized(t)]
        full = [t for t in stepped if not self._quantized(t)]
        return {"quantized_tensors": len(quantized), "quantized_elements": sum(t.numel() for t in quantized),
                "full_tensors": len(full), "full_elements": sum(t.numel() for t in full)}

    def state_note(self) -> str:
        """The engine decision's words on 8-bit state ("" under a 16/32-bit ``state_dtype``): which format,
        and how many tensors and elements it quantizes and keeps in fp32 (by design, not a fallback)."""
        if self.state_dtype not in QUANTIZED_STATE_DTYPES:
            return ""
        n = self.state_layout()
        if not n["quantized_tensors"] and not n["full_tensors"]:
            return (f"; optimizer state {state_name(self.state_dtype)}: none is kept ({type(self).__name__} without "
                    f"momentum holds no moment buffers), so {state_name(self.state_dtype)} state changes nothing")
        rounding = ("codes stochastically rounded" if self.state_rounding == "stochastic" else
                    "codes rounded to nearest")   # the state's rounding, not the params' (policy.rounding)
        return (f"; optimizer state {state_name(self.state_dtype)} blockwise ({qs.BLOCK_SIZE}-element "
                f"blocks, fp32 absmax, {rounding}) for {n['quantized_tensors']} tensor(s) ({n['quantized_elements']:,} "
                f"elements); {n['full_tensors']} tensor(s) ({n['full_elements']:,} elements) keep fp32 state by design "
                f"(fewer than {qs.MIN_QUANTIZED_NUMEL} elements or 1-D)"
                + ("" if n["quantized_tensors"] or not n["full_tensors"] else
                   f": no tensor here is large enough, so every moment is fp32 and {state_name(self.state_dtype)} "
                   "state saves nothing on this model"))

    # ---------------------------------------------------------------- state helpers
    def _keeps_moments(self, group: dict[str, Any]) -> bool:
        """Whether this optimizer keeps moment state for the params of ``group`` (AdamW: always)."""
        return True

    def _quantized(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s moments are stored in 8-bit codes under this optimizer's ``state_dtype``."""
        return self.state_dtype in QUANTIZED_STATE_DTYPES and not t.is_complex() and qs.quantizes(t)

    def _format(self, p: torch.Tensor, key: str) -> tuple[torch.dtype, bool]:
        """How moment ``key`` of ``p`` is stored here: (storage dtype, quantized)."""
        if p.is_complex():
            return p.dtype, False
        if self._quantized(p):
            return qs.code_for(self.state_dtype, nonnegative=key in self._NONNEGATIVE).storage_dtype, True
        return (torch.float32 if self.state_dtype in QUANTIZED_STATE_DTYPES else self.state_dtype), False

    def _state(self, p: torch.Tensor, *, zeros: tuple[str, ...] = ()) -> dict[str, Any]:
        """``self.state[p]`` with ``step``, the ``zeros`` moments and (if needed) ``kahan_comp``."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in zeros:
            if key not in state:
                self._put(p, state, key, None)
        if self.rounding == "kahan" and p.dtype in _HALF_DTYPES and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _put(self, p: torch.Tensor, state: dict[str, Any], key: str, value_fp32: torch.Tensor | None) -> None:
        """Create moment ``key`` of ``p`` in this optimizer's format from ``value_fp32`` (of :func:`_as_fp32`'s
        shape; None: zeros): complex64 for a complex ``p`` (as torch.optim; ``state_dtype`` is for reals),
        8-bit codes and scales where :meth:`_quantized`, else ``state_dtype`` (fp32 under 8-bit state)."""
        if p.is_complex():
            state[key] = torch.zeros_like(p) if value_fp32 is None else torch.view_as_complex(value_fp32.contiguous())
            return
        storage, quantized = self._format(p, key)
        if quantized and sharded.is_sharded(p):
            self._put_sharded_8bit(p, state, key, value_fp32)
        elif quantized:
            code = qs.code_for(self.state_dtype, nonnegative=key in self._NONNEGATIVE)
            state[key], state[key + qs.ABSMAX_SUFFIX] = (
                qs.zeros(p.shape, code, p.device) if value_fp32 is None else
                qs.quantize(value_fp32, code, rounding=self.state_rounding, generator=self._sr_key(p, state, key)))
        elif value_fp32 is None:
            state[key] = torch.zeros_like(p, dtype=storage, memory_format=torch.preserve_format)
        else:
            state[key] = value_fp32.to(storage)

    def _put_sharded_8bit(self, p: torch.Tensor, state: dict[str, Any], key: str, value_fp32: torch.Tensor | None
                          ) -> None:
        """Zero 8-bit moment ``key`` of the sharded ``p`` (:mod:`mixprec.optim.sharded_blocks`): codes a ``DTensor``
        placed as ``p``, the scales of all its blocks a plain fp32 tensor (the same on every rank). Raises
        ValueError for an optimizer without a sharded 8-bit step, or for values to convert into codes."""
        owner = type(self).__name__
        if not self._SHARDS_8BIT:
            raise ValueError(f"{owner} state_dtype={state_name(self.state_dtype)} on a param sharded by FSDP2 (shape "
                             f"{tuple(p.shape)}) is not supported: only mixprec.optim.AdamW steps 8-bit state by global "
                             "blocks; use AdamW, or state=fp32 / bf16 for this optimizer under FSDP2")
        if value_fp32 is not None:
            raise ValueError(f"{owner}: converting a moment of another format into {state_name(self.state_dtype)} codes "
                             f"of a param sharded by FSDP2 (shape {tuple(p.shape)}) is not supported; load a state "
                             "saved with the same state format, or convert it in one process")
        code = qs.code_for(self.state_dtype, nonnegative=key in self._NONNEGATIVE)
        codes, _ = qs.zeros(sharded.local(p).shape, code, p.device)
        state[key] = sharded.like_param(codes, p)
        state[key + qs.ABSMAX_SUFFIX] = torch.zeros(qs.state_shape(qs.ABSMAX_SUFFIX, p.shape), dtype=torch.float32,
                                                    device=p.device)

    def _load(self, state: dict[str, Any], key: str) -> torch.Tensor:
        """Moment ``key`` in fp32: the stored tensor itself when fp32 (in-place math updates it), its real
        view when complex, else a new fp32 tensor (upcast, or dequantized codes)."""
        absmax = state.get(key + qs.ABSMAX_SUFFIX)
        if absmax is None:
            return _as_fp32(state[key])
        return qs.dequantize(state[key], absmax, qs.code_of(state[key], nonnegative=key in self._NONNEGATIVE))

    def _store(self, p: torch.Tensor, state: dict[str, Any], key: str, value_fp32: torch.Tensor) -> None:
        """Write ``value_fp32`` back into moment ``key`` of ``p``: requantized (``state_rounding``) into its
        codes and scales, stochastically rounded into bf16 under ``state_rounding='stochastic'`` (random bits
        from :meth:`_sr_key`'s stream under purpose ``key``), else rounded to nearest into its dtype (nothing
        to do for an fp32 alias)."""
        absmax = state.get(key + qs.ABSMAX_SUFFIX)
        if absmax is not None:
            code = qs.code_of(state[key], nonnegative=key in self._NONNEGATIVE)
            qs.quantize(value_fp32, code, rounding=self.state_rounding, generator=self._sr_key(p, state, key),
                        out=(state[key], absmax))
        elif state[key] is value_fp32 or state[key].is_complex():   # fp32 alias; complex: through its real view
            return
        elif state[key].dtype == torch.bfloat16 and self.state_rounding == "stochastic":
            _stochastic_round_into(state[key], value_fp32, self._sr_key(p, state, key))   # unbiased
        else:
            state[key].copy_(value_fp32)  # round to nearest into the storage dtype

    def _restored(self, p: torch.Tensor, saved: dict[str, Any], *, copy: bool) -> dict[str, Any]:
        """``saved`` (a state of ``p``'s shape) as this optimizer's state for ``p``: each moment as it is where
        its storage format is this optimizer's (codes and scales bit for bit), else through fp32 into it;
        ``copy``: every tensor a copy on ``p``'s device (``kahan_comp`` in ``p``'s dtype, ``step`` as saved)."""
        if copy:
            saved = {k: v.clone() if k == "step" else
                     v.to(device=p.device, dtype=p.dtype if k == "kahan_comp" else v.dtype, copy=True)
                     if torch.is_tensor(v) else v for k, v in saved.items()}
        out: dict[str, Any] = {}
        for key, value in saved.items():
            if key.endswith(qs.ABSMAX_SUFFIX):
                continue
            if key in ("step", "kahan_comp") or not torch.is_tensor(value):
                out[key] = value
                continue
            absmax = saved.get(key + qs.ABSMAX_SUFFIX)
            if self._format(p, key) == (value.dtype, absmax is not None):
                out[key] = value
                if absmax is not None:
                    out[key + qs.ABSMAX_SUFFIX] = absmax
            else:
                self._put(p, out, key, self._load(saved, key))
        return out

    def _local_view(self, p: torch.Tensor, state: dict[str, Any]
                    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """What a step of ``p`` works on: ``(param, grad, state)``, the local shards of a sharded (``DTensor``)
        ``p`` (sharing storage: in-place math writes through; :mod:`mixprec.optim.sharded`), remembered so that
        :meth:`_sr_key` keys the local shard's rounding by its global offset; ``p``, ``p.grad`` and ``state``
        themselves otherwise. Entries the step adds are placed back by :meth:`_publish`. No comm, no sync."""
        if not sharded.is_sharded(p):
            return p, p.grad, state
        if self._quantized(p) and not self._SHARDS_8BIT:
            self._put_sharded_8bit(p, {}, "", None)   # raises: no sharded 8-bit step here
        p_local = p.to_local()
        self._shards = {id(p_local): (p_local, p, sharded.global_offset(p))}   # the param being stepped only
        return p_local, sharded.local(p.grad), {k: sharded.local(v) if torch.is_tensor(v) else v
                                                for k, v in state.items()}

    def _publish(self, p: torch.Tensor, state: dict[str, Any], local_state: dict[str, Any]) -> None:
        """Put the entries a step added to ``local_state`` (:meth:`_local_view`) into ``state``, a local tensor of
        the shard's shape as a ``DTensor`` placed as ``p``. Nothing to do for a plain ``p``."""
        if local_state is state:
            return
        for key, value in local_state.items():
            if key not in state:
                state[key] = (sharded.like_param(value, p) if torch.is_tensor(value) and value.dim()
                              and value.shape == sharded.local(p).shape else value)

    def _sr_key(self, p: torch.Tensor, state: dict[str, Any], purpose: str) -> SRKey | None:
        """Where stochastic rounding of ``p``'s ``purpose`` (``"param"`` or a state key) at this step draws its
        bits: the counter-based stream of ``(group's sr_seed, p's index in the param order, state step,
        purpose)`` (:mod:`mixprec.optim.sr_stream`), or None (torch's global RNG, the legacy stream) when
        ``p``'s group has no ``sr_seed`` (a state dict saved before it). ``p`` a sharded param's local shard
        (:meth:`_local_view`): the param's key at the shard's global offset. No host sync (``step`` is on the CPU)."""
        offset = 0
        shard = self._shards.get(id(p))
        if shard is not None and shard[0] is p:
            p, offset = shard[1], shard[2]
        index = self._param_index.get(id(p))
        if index is None or self._flat_params[index] is not p:   # first use, or the engine swapped tensors
            self._flat_params = [q for g in self.param_groups for q in g["params"]]
            self._param_index = {id(q): i for i, q in enumerate(self._flat_params)}
            index = self._param_index[id(p)]
        seed = self._group_of(index).get("sr_seed")
        if seed is None:
            return None
        return SRKey(seed, index, int(state.get("step", 0)), purpose, offset)

    def _group_of(self, index: int) -> dict[str, Any]:
        for group in self.param_groups:
            if index < len(group["params"]):
                return group
            index -= len(group["params"])
        raise IndexError(index)

    @property
    def sr_stream(self) -> str:
        """Where stochastic rounding draws its bits, in words: the counter-based stream and its seed(s), or torch's
        global RNG for groups loaded from a state dict saved before ``sr_seed`` existed (the legacy stream)."""
        seeds = [g.get("sr_seed") for g in self.param_groups]
        if any(s is None for s in seeds):
            return ("torch's global RNG (legacy: a state dict saved before sr_seed; it continues bit for bit only "
                    "where torch's RNG state is restored too)")
        return f"counter-based stream, sr_seed={sorted(set(seeds))[0] if len(set(seeds)) == 1 else sorted(set(seeds))}"

    def _checks_lost_updates(self, p: torch.Tensor, state: dict[str, Any]) -> bool:
        """Whether :meth:`_write_back` counts this step's lost updates of ``p`` (16-bit, ``'nearest'``, a check
        step, not warned yet): it needs the fp32 result beside the rounded param."""
        return (p.dtype in _HALF_DTYPES and self.rounding == "nearest" and _is_check_step(int(state["step"]))
                and not getattr(self, "_lost_warned", False))

    def _write_back(self, p: torch.Tensor, param_fp32: torch.Tensor, state: dict[str, Any],
                    lost_counts: list) -> None:
        if param_fp32 is p or p.is_complex():
            return  # fp32 param (or complex64 through its real view), updated in place
        step = int(state["step"])  # CPU scalar: no device sync
        if self._checks_lost_updates(p, state):
            lost_counts.append(lost_update_counts(p, param_fp32))
            self._lost_step = step
        key = self._sr_key(p, state, "param") if self.rounding == "stochastic" else None
        if key is not None and p.dtype == torch.bfloat16:
            _stochastic_round_into(p, param_fp32, key)
            return
        write_back_(p, param_fp32, rounding=self.rounding, kahan_comp=state.get("kahan_comp"), generator=key)

    def _warn_if_updates_lost(self, lost_counts: list) -> None:
        """Warn (once) when > 50% of a check step's 16-bit updates were rounded away. Check steps are
        1, 10, 100, ... (one per decade: updates shrink as the learning rate decays, so a run that
        starts fine can stop training later); one host sync on each."""
        if not lost_counts:
            return
        device = lost_counts[0][0].device
        lost, changed = torch.stack([torch.stack(c).to(device) for c in lost_counts]).sum(0).tolist()
        if changed and lost / changed > 0.5:
            self._lost_warned = True
            warnings.warn(
                f"{type(self).__name__}: {lost / changed:.1%} of step {self._lost_step}'s nonzero updates to "
                "16-bit params are smaller than half an ulp of the param and were rounded away "
                "(rounding='nearest'), so those weights do not train. Fix: keep fp32 master weights "
                "(policy 'bf16-pure'), or use rounding='kahan' or rounding='stochastic'.",
                UserWarning, stacklevel=5)  # here < step < no_grad < torch's step hooks < caller

    def _unimplemented_options(self, group: dict[str, Any]) -> list[str]:
        """The ``torch.optim`` options of a saved param ``group`` this optimizer's math lacks, as ``name=value``."""
        return ["maximize=True"] if group.get("maximize") else []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but keep this optimizer's state formats.

        torch casts every floating state tensor to its param's dtype, which would truncate fp32
        moments of bf16 params (and turn 8-bit codes into floats). Here each moment is copied as saved
        where its storage format is this optimizer's (8-bit codes and their absmax scales bit for bit, so
        ``load_state_dict(state_dict())`` is exact), else converted through fp32 into it (e.g. a
        ``torch.optim.AdamW`` state into 8-bit codes); ``kahan_comp`` in the param dtype and ``step``
        as saved (all copies, never aliases of ``state_dict``).

        Raises:
            ValueError: a saved param group was made with a ``torch.optim`` option this optimizer does not
                implement (``maximize=True``; for AdamW ``amsgrad=True`` or ``torch.optim.Adam``'s L2 weight
                decay), which would load and then step differently; nothing is loaded.
        """
        owner = type(self).__name__
        for i, group in enumerate(state_dict["param_groups"]):
            if found := self._unimplemented_options(group):
                raise ValueError(f"{owner}.load_state_dict: saved param group {i} was made with {', '.join(found)}, "
                                 f"which {owner} does not implement (it would step differently); keep training it "
                                 "with the torch.optim optimizer that saved it, or save it without those options")
        super().load_state_dict(state_dict)
        if (self.rounding == "stochastic" or self.state_rounding == "stochastic") and any(
                "sr_seed" not in g for g in self.param_groups):
            warnings.warn(f"{owner}.load_state_dict: the state dict predates sr_seed, so stochastic rounding continues "
                          "its legacy stream, torch's global RNG (bit for bit only where torch's RNG state is "
                          "restored too, as mixprec checkpoints do); a state dict this version saves carries the seed "
                          f"of the counter-based stream ({owner}.sr_stream says which is in use)", UserWarning,
                          stacklevel=2)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            if saved_id in state_dict["state"]:
                self.state[p] = self._restored(p, state_dict["state"][saved_id], copy=True)
