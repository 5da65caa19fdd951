"""The optimizer shell that the fp32-computing optimizers share.

:class:`PrecisionOptimizer` is the ``torch.optim.Optimizer`` base of :class:`mixprec.optim.AdamW` and
:class:`mixprec.optim.SGD`: it holds the precision settings (``rounding`` / ``state_dtype`` / ``state_rounding``,
checked by :mod:`mixprec.optim.arguments`), the engine's contract (``set_precision``, ``move_state``,
``compensation``) and the format-converting ``load_state_dict``, over two halves: the state codec (how moments are
stored and converted: :mod:`mixprec.optim.state_codec`) and the write-back (how the fp32 result reaches a 16-bit
param, Kahan compensation and the lost-update check: :mod:`mixprec.optim.write_back`), which share the
stochastic-rounding stream keys (:mod:`mixprec.optim.stream_keys`; the seed in every param group, and a load of a
state dict saved without one: :mod:`mixprec.optim.sr_seed`).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.optim.arguments import check_param_dtypes, check_precision, check_saved_options
from mixprec.optim.sr_seed import check_sr_seed, seeded_groups
from mixprec.optim.state_codec import StateCodec, as_fp32
from mixprec.optim.stream_keys import StreamKeys
from mixprec.optim.write_back import WriteBack

__all__ = ["grad_fp32", "PrecisionOptimizer"]

_SETTINGS = ("rounding", "state_dtype", "state_rounding", "_explicit", "_precision_explicit")   # kept by a pickle


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


class PrecisionOptimizer(torch.optim.Optimizer):
    """Shared shell: precision settings and the engine's contract over a state codec (:attr:`state_codec`: the
    state per param, how it is stored and converted) and a write-back (:attr:`write_back`: the fp32 result into
    the param, Kahan compensation), sharing the stream keys (:attr:`stream_keys`; seeds: :mod:`mixprec.optim.sr_seed`).

    Subclasses implement ``step`` with :meth:`_state` (a param's state, created), ``state_codec.local_view`` /
    ``load`` / ``store`` / ``put`` / ``publish`` and ``write_back.write`` / ``warn_if_updates_lost``, and name their
    moments known to be >= 0 in ``_NONNEGATIVE`` (the nonnegative 8-bit code, :func:`mixprec.optim.quantized_state.code_for`).
    """

    _NONNEGATIVE: frozenset[str] = frozenset()
    _SHARDS_8BIT = False   # whether step() handles 8-bit state of FSDP2 shards (mixprec.optim.sharded_blocks)

    def __init__(self, params, defaults: dict[str, Any], *, rounding: str | None,
                 state_dtype: torch.dtype | str | None, state_rounding: str | None = None,
                 sr_seed: int | None = None) -> None:
        owner = type(self).__name__
        defaults = {**defaults, "sr_seed": check_sr_seed(owner, sr_seed)}
        self._parts()
        self._precision_explicit = rounding is not None or state_dtype is not None or state_rounding is not None
        self.rounding, self.state_dtype, self.state_rounding = check_precision(owner, (), rounding, state_dtype,
                                                                               state_rounding)
        written = {"rounding": rounding, "state_dtype": state_dtype, "state_rounding": state_rounding}
        self._explicit = {k: getattr(self, k) for k, v in written.items() if v is not None}
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param groups) and the precision settings, which torch's drops (a deep copy
        or a pickle then had no ``rounding`` to step with)."""
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in _SETTINGS if k in self.__dict__}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle: torch's state and the precision settings, then new halves (:meth:`_parts`)."""
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_param_dtypes(type(self).__name__, self.param_groups[-1]["params"], self.rounding)

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
        self.rounding, self.state_dtype, self.state_rounding = check_precision(
            type(self).__name__, self.param_groups, rounding, state_dtype, state_rounding)

    # ---------------------------------------------------------------- the engine's contract
    def compensation(self, p: torch.Tensor) -> torch.Tensor | None:
        """The Kahan compensation buffer of ``p`` (param dtype, shape of ``p``), or None. No sync."""
        return self.write_back.compensation(p)

    def move_state(self, moves: list[tuple[torch.Tensor, torch.Tensor | None]], *, rounding: str,
                   state_dtype: torch.dtype | str, state_rounding: str | None = None) -> None:
        """Re-key state after the engine swapped the tensors this optimizer steps (``(old, new)`` per tensor,
        ``new=None`` drops ``old``'s state; moments converted only where their format changes, Kahan compensation
        dropped: :meth:`StateCodec.rekey`), and adopt a new precision, but for the settings passed to the
        constructor (:attr:`explicit_precision`), which stay. No sync.

        Raises:
            ValueError: invalid ``rounding`` / ``state_dtype`` / ``state_rounding``, or ``'stochastic'``
                with fp16 params. Nothing has changed then.
        """
        e = self._explicit   # settings not passed to the constructor follow the policy
        self.rounding, self.state_dtype, self.state_rounding = check_precision(
            type(self).__name__, self.param_groups, e.get("rounding", rounding), e.get("state_dtype", state_dtype),
            e.get("state_rounding", state_rounding))
        self.state_codec.rekey(moves)

    def start_compensation(self, residuals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the Kahan compensation of each 16-bit ``p`` to ``residual`` (:meth:`WriteBack.start_compensation`)."""
        self.write_back.start_compensation(residuals)

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
        """``self.state[p]`` with ``step``, the ``zeros`` moments (:meth:`StateCodec.start`) and, if the write-back
        needs it, ``kahan_comp`` (:meth:`WriteBack.prepare`)."""
        state = self.state_codec.start(p, self.state[p], zeros)
        self.write_back.prepare(p, state)
        return state

    def _unimplemented_options(self, group: dict[str, Any]) -> list[str]:
        """The ``torch.optim`` options of a saved param ``group`` this optimizer's math lacks, as ``name=value``."""
        return ["maximize=True"] if group.get("maximize") else []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but keep this optimizer's state formats and stream: torch
        casts every floating state tensor to its param's dtype, which would truncate fp32 moments of bf16 params
        (and turn 8-bit codes into floats); here each moment is restored as saved where its format is this
        optimizer's, else converted through fp32 (:meth:`StateCodec.restored_states`: copies, never aliases of
        ``state_dict``, so ``load_state_dict(state_dict())`` is exact). A saved group without ``sr_seed`` takes one
        as :func:`mixprec.optim.sr_seed.seeded_groups` says (``state_dict`` itself is not changed).

        Raises:
            ValueError: a saved param group was made with a ``torch.optim`` option this optimizer does not
                implement (``maximize=True``; for AdamW ``amsgrad=True`` or ``torch.optim.Adam``'s L2 weight
                decay), which would load and then step differently; or has no ``sr_seed`` while this optimizer
                rounds stochastically, outside :func:`mixprec.optim.adopt_sr_seed` (the message names the groups
                and the fix). Nothing is loaded then.
        """
        check_saved_options(type(self).__name__, state_dict["param_groups"], self._unimplemented_options)
        state_dict = {**state_dict, "param_groups": seeded_groups(self, state_dict["param_groups"])}
        super().load_state_dict(state_dict)
        self.state.update(self.state_codec.restored_states(state_dict))
