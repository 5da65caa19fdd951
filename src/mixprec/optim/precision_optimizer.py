"""The optimizer shell that the fp32-computing optimizers share.

:class:`PrecisionOptimizer` is the ``torch.optim.Optimizer`` base of :class:`mixprec.optim.AdamW` and
:class:`mixprec.optim.SGD`: it holds the precision settings (``rounding`` / ``state_dtype`` / ``state_rounding``,
checked by :mod:`mixprec.optim.arguments`), the engine's contract (``set_precision``, ``move_state``,
``compensation``) and the format-converting ``load_state_dict``, over two halves: the state codec (how moments are
stored and converted: :mod:`mixprec.optim.state_codec`) and the write-back (how the fp32 result reaches a 16-bit
param, and the lost-update check: :mod:`mixprec.optim.write_back`), which share the stochastic-rounding stream keys
(:mod:`mixprec.optim.stream_keys`).
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any

import torch

from mixprec.optim.arguments import _FLOAT_DTYPES, _check_rounding, _check_state_dtype, _check_state_rounding
from mixprec.optim.state_codec import StateCodec, as_fp32
from mixprec.optim.stream_keys import StreamKeys
from mixprec.optim.write_back import HALF_DTYPES, WriteBack

__all__ = ["grad_fp32", "PrecisionOptimizer"]

_SETTINGS = ("rounding", "state_dtype", "state_rounding", "_explicit", "_precision_explicit")   # kept by a pickle
_PARAM_DTYPES = _FLOAT_DTYPES + (torch.complex64,)   # complex64: two fp32 values, stepped on its real view


def grad_fp32(p: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """``p.grad`` as a dense fp32 tensor of :func:`~mixprec.optim.state_codec.as_fp32`'s shape, for the update math
    (read, never written). A sparse COO gradient (``nn.Embedding(sparse=True)``) is upcast to fp32 *then* densified,
    so duplicate rows are summed in fp32; the step then equals the step on the dense gradient (AdamW's
    moments decay on every row, as with a dense table: not ``torch.optim.SparseAdam``'s lazy update).
    Costs one dense fp32 temporary of the param's size. ``grad``: the gradient to use instead of ``p.grad`` (a
    sharded param's local gradient, :meth:`~mixprec.optim.state_codec.StateCodec.local_view`). No host sync."""
    grad = p.grad if grad is None else grad
    if grad.is_sparse:
        grad = grad.to(torch.complex64 if grad.is_complex() else torch.float32).to_dense()
    return as_fp32(grad)


def _check_sr_seed(owner: str, sr_seed: int | None) -> int:
    """The stochastic-rounding seed: ``sr_seed`` checked, else ``torch.initial_seed()`` (what
    ``torch.manual_seed`` set; reading it draws nothing from the RNG)."""
    if sr_seed is None:
        return int(torch.initial_seed()) % 2**64
    if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) or not 0 <= sr_seed < 2**64:
        raise ValueError(f"{owner} sr_seed={sr_seed!r} is not allowed; pass an int in [0, 2**64), e.g. sr_seed=0, "
                         "or None (torch.initial_seed(), what torch.manual_seed set)")
    return sr_seed


class PrecisionOptimizer(torch.optim.Optimizer):
    """Shared shell: precision settings and the engine's contract over a state codec (:attr:`state_codec`) and a
    write-back (:attr:`write_back`) sharing the stream keys (:attr:`stream_keys`).

    Subclasses implement ``step`` with :meth:`_state` (a param's state, created), ``state_codec.local_view`` /
    ``load`` / ``store`` / ``put`` / ``publish`` and ``write_back.write`` / ``warn_if_updates_lost``, and name their
    moments known to be >= 0 in ``_NONNEGATIVE`` (the nonnegative 8-bit code, :func:`mixprec.optim.quantized_state.code_for`).

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
        self._parts()
        self._precision_explicit = rounding is not None or state_dtype is not None or state_rounding is not None
        self.rounding: str = _check_rounding(owner, rounding)
        self.state_dtype: torch.dtype = _check_state_dtype(owner, state_dtype)
        self.state_rounding: str = _check_state_rounding(owner, state_rounding, self.state_dtype)
        written = {"rounding": rounding, "state_dtype": state_dtype, "state_rounding": state_rounding}
        self._explicit = {k: getattr(self, k) for k, v in written.items() if v is not None}
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param groups) and the precision settings, which torch's drops (a deep copy
        or a pickle then had no ``rounding`` to step with)."""
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in _SETTINGS if k in self.__dict__}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (also an optimizer pickled before the stream existed: its groups have no ``sr_seed``, so it
        keeps the legacy global-RNG stream, :attr:`sr_stream`)."""
        super().__setstate__(state)
        if "stream_keys" not in self.__dict__:
            self._parts()

    def _parts(self) -> None:
        """The two halves (a state codec, a write-back) and the stream keys they share."""
        self.stream_keys = StreamKeys(self)
        self.state_codec = StateCodec(self, self.stream_keys, nonnegative=self._NONNEGATIVE,
                                      shards_8bit=self._SHARDS_8BIT)
        self.write_back = WriteBack(self, self.stream_keys)

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
            if rounding == "stochastic" and p.dtype in HALF_DTYPES and p.dtype != torch.bfloat16:
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
            self.state[new] = self.state_codec.restored(new, state, copy=False)

    def start_compensation(self, residuals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the Kahan compensation of each 16-bit ``p`` to ``residual`` (fp32, what rounding ``p`` to its
        dtype lost), stored in ``p``'s dtype (:func:`mixprec.optim.contract.start_compensation`). No sync."""
        for p, residual in residuals:
            self.state[p]["kahan_comp"] = residual.to(p.dtype)

    def state_layout(self) -> dict[str, int]:
        """How moment state lays out over the tensors this optimizer steps (:meth:`StateCodec.layout`)."""
        return self.state_codec.layout()

    def state_note(self) -> str:
        """The engine decision's words on 8-bit state, "" under a 16/32-bit ``state_dtype`` (:meth:`StateCodec.note`)."""
        return self.state_codec.note()

    def keeps_moments(self, group: dict[str, Any]) -> bool:
        """Whether this optimizer keeps moment state for the params of ``group`` (AdamW: always)."""
        return True

    @property
    def sr_stream(self) -> str:
        """Where stochastic rounding draws its bits, in words (:meth:`StreamKeys.words`)."""
        return self.stream_keys.words()

    def _state(self, p: torch.Tensor, *, zeros: tuple[str, ...] = ()) -> dict[str, Any]:
        """``self.state[p]`` with ``step``, the ``zeros`` moments and (if needed) ``kahan_comp``."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in zeros:
            if key not in state:
                self.state_codec.put(p, state, key, None)
        if self.rounding == "kahan" and p.dtype in HALF_DTYPES and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

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
                self.state[p] = self.state_codec.restored(p, state_dict["state"][saved_id], copy=True)
