"""How an fp32 optimizer result lands in a parameter, and the optimizer shell that shares it.

Every optimizer here computes the new parameter value in fp32 (``value_fp32``). For an fp32
parameter that *is* the parameter (updated in place, bit-identical to ``torch.optim``). For a
16-bit parameter :func:`write_back_` stores it with one of three roundings:

==============  ===============================================================================
``nearest``     ``param.copy_(value_fp32)``: round to nearest even. Updates smaller than half an
                ulp of the parameter are lost (bf16 weights at 1.0 never move with lr 1e-4).
``kahan``       compensated summation: a buffer in the param dtype carries what rounding lost
                into the next step (optimi; Zamirai et al. 2020, "Revisiting BFloat16 Training").
``stochastic``  round up with probability equal to the distance to the lower neighbour, in units
                of the spacing: unbiased in expectation (Gupta et al. 2015). bf16 params only.
==============  ===============================================================================

:class:`PrecisionOptimizer` is the ``torch.optim.Optimizer`` base of :class:`mixprec.optim.AdamW`
and :class:`mixprec.optim.SGD`: it validates ``rounding`` / ``state_dtype``, creates the common
state (``step``, ``kahan_comp``), moves state between its storage dtype and fp32, and runs the
lost-update check (steps 1, 10, 100, ...).
"""

from __future__ import annotations

import math
import warnings
from itertools import chain
from typing import Any

import torch

from mixprec.formats import get_format
from mixprec.policy import ROUNDINGS

__all__ = ["ROUNDINGS", "STATE_DTYPES", "stochastic_round_to_bf16", "write_back_", "grad_fp32",
           "lost_update_counts", "PrecisionOptimizer"]

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = STATE_DTYPES + (torch.complex64,)   # complex64: two fp32 values, stepped on its real view
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_LOW_16_BITS = 0xFFFF  # bf16 is the top half of an fp32 bit pattern


def stochastic_round_to_bf16(x_fp32: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 to bf16 stochastically: unbiased, ``E[result] = x`` for finite ``x``.

    View the fp32 bits as int32, add a uniform random integer in ``[0, 2**16)`` (the low 16 bits of a
    full-range ``random_()`` draw) and zero the low 16 bits. The carry into bit 16 happens with probability ``low16(x) / 2**16``, i.e. the
    distance from the truncated value in units of the bf16 spacing, so ``x = lo + f*(hi - lo)``
    rounds to ``hi`` with probability ``f``. fp32 is sign-magnitude, so the addition acts on the
    magnitude and negative numbers round symmetrically (``-x`` rounds to ``-result`` for the same
    random draw). Values already representable in bf16 are unchanged; a carry past the largest
    finite bf16 gives inf, as it should; +-inf stay +-inf. NaN inputs are passed through (the integer
    add could wrap a NaN pattern to a finite one).

    Args:
        x_fp32: fp32 tensor, any shape.
        generator: RNG for the random bits; ``None`` uses torch's global RNG, so restoring
            ``torch.get_rng_state()`` reproduces the result bitwise.

    Returns:
        bf16 tensor of the shape and device of ``x_fp32``. No host sync.

    Raises:
        ValueError: ``x_fp32`` is not fp32.
    """
    if x_fp32.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16 x_fp32.dtype={x_fp32.dtype} is not allowed; "
                         "pass an fp32 tensor (x.float())")
    # 16 uniform bits: the low half of torch's full-range int32 draw (one draw, no bounded-range rejection;
    # measured ~40 % cheaper on a CPU than randint(0, 2**16)), then the add and the mask in place on it
    noise_int32 = torch.empty(x_fp32.shape, dtype=torch.int32, device=x_fp32.device).random_(generator=generator)
    rounded_int32 = noise_int32.bitwise_and_(_LOW_16_BITS).add_(x_fp32.view(torch.int32)).bitwise_and_(~_LOW_16_BITS)
    rounded_fp32 = rounded_int32.view(torch.float32)  # low 16 bits zero: exact in bf16
    # +-inf stay +-inf (the mask clears what the noise added); only a NaN's bits could carry into another pattern
    return torch.where(torch.isnan(x_fp32), x_fp32, rounded_fp32).to(torch.bfloat16)


def write_back_(param: torch.Tensor, value_fp32: torch.Tensor, *, rounding: str,
                kahan_comp: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> None:
    """Store the fp32 result ``value_fp32`` into ``param`` (in place) with ``rounding``.

    Args:
        param: the parameter, fp32 / bf16 / fp16. An fp32 param takes ``value_fp32`` exactly
            (no rounding is needed, whatever ``rounding`` says).
        value_fp32: the new value, fp32, shape of ``param``.
        rounding: ``"nearest"``, ``"kahan"`` or ``"stochastic"`` (bf16 params only).
        kahan_comp: compensation buffer in ``param.dtype``, updated in place; required for
            ``"kahan"`` on 16-bit params (start it at zeros).
        generator: RNG for ``"stochastic"``; ``None`` uses torch's global RNG.

    No host sync.

    Raises:
        ValueError: unknown ``rounding``; ``"stochastic"`` on a non-bf16 16-bit param;
            ``"kahan"`` without ``kahan_comp``.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"write_back_ rounding={rounding!r} is not allowed; choose one of {ROUNDINGS}")
    if param.dtype == torch.float32:
        if value_fp32 is not param:
            param.copy_(value_fp32)
        return
    if rounding == "nearest":
        param.copy_(value_fp32)
    elif rounding == "stochastic":
        if param.dtype != torch.bfloat16:
            raise ValueError(f"rounding='stochastic' needs bf16 params, got param dtype {param.dtype}; "
                             "use rounding='kahan' for fp16 params")
        param.copy_(stochastic_round_to_bf16(value_fp32, generator=generator))
    else:
        if kahan_comp is None:
            raise ValueError("write_back_ rounding='kahan' needs kahan_comp (a zero-initialised "
                             f"buffer of dtype {param.dtype}); pass kahan_comp=torch.zeros_like(param)")
        param_fp32 = param.float()
        # (1) add the carried compensation to the fp32 update
        update_fp32 = (value_fp32 - param_fp32).add_(kahan_comp)
        # (2) add it to the param and round to the param dtype
        param.copy_(param_fp32 + update_fp32)
        # (3) store what rounding lost back in the compensation buffer
        kahan_comp.copy_(update_fp32.sub_(param.float() - param_fp32))


def lost_update_counts(param: torch.Tensor, value_fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count elements whose update ``value_fp32 - param`` is lost to round-to-nearest.

    Returns ``(lost, changed)``, int64 scalars on ``param.device``: ``changed`` counts nonzero
    updates, ``lost`` those among them smaller than half an ulp of the param in its dtype
    (:meth:`mixprec.formats.Format.ulp`). No host sync.
    """
    update_fp32 = value_fp32 - param.float()
    half_ulp_fp32 = 0.5 * get_format(param.dtype).ulp(param)
    changed = update_fp32 != 0
    lost = changed & (update_fp32.abs() < half_ulp_fp32)
    return lost.sum(), changed.sum()


def _check_rounding(owner: str, rounding: str | None) -> str:
    if rounding is None:
        return "nearest"
    if rounding not in ROUNDINGS:
        raise ValueError(f"{owner} rounding={rounding!r} is not allowed; choose one of {ROUNDINGS} "
                         "or None (= 'nearest')")
    return rounding


def _check_state_dtype(owner: str, state_dtype: torch.dtype | None) -> torch.dtype:
    if state_dtype is None:
        return torch.float32
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{owner} state_dtype={state_dtype!r} is not allowed; choose one of "
                         f"{list(STATE_DTYPES)} or None (= torch.float32)")
    return state_dtype


def check_number(owner: str, name: str, value: Any, *, low: float, high: float = math.inf,
                 high_open: bool = False, example: str) -> None:
    """Raise ValueError unless ``low <= value <= high`` (``< high`` when ``high_open``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    ok = low <= number and (number < high if high_open else number <= high)
    if not ok:
        upper = "" if high == math.inf else (f" and < {high}" if high_open else f" and <= {high}")
        raise ValueError(f"{owner} {name}={value!r} is not allowed; it must be a number >= {low}{upper} "
                         f"(e.g. {name}={example})")


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when fp32 (so in-place math hits the stored tensor), its ``view_as_real`` when
    complex64 (an fp32 alias: in-place math hits the stored tensor too, as ``torch.optim`` steps complex
    params), else an fp32 copy."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t if t.dtype == torch.float32 else t.float()


def grad_fp32(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` as a dense fp32 tensor of :func:`_as_fp32`'s shape, for the update math (read, never
    written). A sparse COO gradient (``nn.Embedding(sparse=True)``) is upcast to fp32 *then* densified,
    so duplicate rows are summed in fp32; the step then equals the step on the dense gradient (AdamW's
    moments decay on every row, as with a dense table: not ``torch.optim.SparseAdam``'s lazy update).
    Costs one dense fp32 temporary of the param's size. No host sync."""
    grad = p.grad
    if grad.is_sparse:
        grad = grad.to(torch.complex64 if grad.is_complex() else torch.float32).to_dense()
    return _as_fp32(grad)


def _is_check_step(step: int) -> bool:
    """1, 10, 100, 1000, ...: where the lost-update check runs (one host sync per decade of steps)."""
    while step >= 10 and step % 10 == 0:
        step //= 10
    return step == 1


class PrecisionOptimizer(torch.optim.Optimizer):
    """Shared shell: precision settings, state creation and storage, write-back, warnings.

    Subclasses implement ``step`` with :meth:`_state`, :meth:`_load`, :meth:`_store`,
    :meth:`_write_back` and :meth:`_warn_if_updates_lost`.

    State per param: ``step`` (float32 scalar on the CPU, as torch.optim), every moment
    (``exp_avg``, ``momentum_buffer``...) in ``state_dtype``, and ``kahan_comp`` in the param
    dtype for 16-bit params under ``rounding='kahan'``.
    """

    def __init__(self, params, defaults: dict[str, Any], *, rounding: str | None,
                 state_dtype: torch.dtype | None) -> None:
        owner = type(self).__name__
        self._precision_explicit = rounding is not None or state_dtype is not None
        self.rounding: str = _check_rounding(owner, rounding)
        self.state_dtype: torch.dtype = _check_state_dtype(owner, state_dtype)
        super().__init__(params, defaults)

    @property
    def precision_explicit(self) -> bool:
        """True when ``rounding`` or ``state_dtype`` was passed to the constructor."""
        return self._precision_explicit

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

    def set_precision(self, *, rounding: str, state_dtype: torch.dtype) -> None:
        """Adopt a policy's ``rounding`` and ``state_dtype``; call before the first step.

        Raises:
            RuntimeError: optimizer state already exists (a step was taken or a state dict loaded).
            ValueError: invalid ``rounding`` / ``state_dtype``, or ``'stochastic'`` with non-bf16
                16-bit params.
        """
        owner = type(self).__name__
        if any(len(s) > 0 for s in self.state.values()):
            raise RuntimeError(f"{owner}.set_precision must be called before the first step: state "
                               "already exists; build a new optimizer to change precision")
        rounding = _check_rounding(owner, rounding)
        self._check_param_dtypes(chain.from_iterable(g["params"] for g in self.param_groups), rounding)
        self.state_dtype = _check_state_dtype(owner, state_dtype)
        self.rounding = rounding

    # ---------------------------------------------------------------- the engine's contract
    def compensation(self, p: torch.Tensor) -> torch.Tensor | None:
        """The Kahan compensation buffer of ``p`` (param dtype, shape of ``p``), or None. No sync."""
        return self.state[p].get("kahan_comp") if p in self.state else None

    def move_state(self, moves: list[tuple[torch.Tensor, torch.Tensor | None]], *, rounding: str,
                   state_dtype: torch.dtype) -> None:
        """Re-key state after the engine swapped the tensors this optimizer steps, and adopt a new precision.

        ``moves``: ``(old, new)`` per tensor; ``new=None`` drops ``old``'s state. Moments keep their
        values, cast to ``state_dtype``; Kahan compensation is dropped (the engine folded it into the
        params first) and restarts at zero where ``rounding`` is still ``'kahan'``; ``step`` is kept.
        ``rounding``/``state_dtype`` are adopted unless they were passed to the constructor. No sync.

        Raises:
            ValueError: invalid ``rounding`` / ``state_dtype``, or ``'stochastic'`` with fp16 params.
        """
        owner = type(self).__name__
        if not self.precision_explicit:
            rounding = _check_rounding(owner, rounding)
            self._check_param_dtypes(chain.from_iterable(g["params"] for g in self.param_groups), rounding)
            state_dtype = _check_state_dtype(owner, state_dtype)
        states = [(new, self.state.pop(old, None)) for old, new in moves]   # all out first: old and new may alias
        for new, state in states:
            if not state or new is None:
                continue
            state.pop("kahan_comp", None)
            self.state[new] = {k: v.to(state_dtype) if (k != "step" and torch.is_tensor(v) and v.is_floating_point()
                                                        and v.shape == new.shape) else v
                               for k, v in state.items()}
        if not self.precision_explicit:
            self.rounding, self.state_dtype = rounding, state_dtype

    def start_compensation(self, residuals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the Kahan compensation of each 16-bit ``p`` to ``residual`` (fp32, what rounding ``p`` to its
        dtype lost), stored in ``p``'s dtype (:func:`mixprec.optim.contract.start_compensation`). No sync."""
        for p, residual in residuals:
            self.state[p]["kahan_comp"] = residual.to(p.dtype)

    # ---------------------------------------------------------------- state helpers
    def _state(self, p: torch.Tensor, *, zeros: tuple[str, ...] = ()) -> dict[str, Any]:
        """``self.state[p]`` with ``step``, the ``zeros`` moments and (if needed) ``kahan_comp``."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in zeros:   # a complex64 param's moments are complex64, as torch.optim's (state_dtype is for reals)
            if key not in state:
                dtype = p.dtype if p.is_complex() else self.state_dtype
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if self.rounding == "kahan" and p.dtype in _HALF_DTYPES and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _load(state: dict[str, Any], key: str) -> torch.Tensor:
        return _as_fp32(state[key])

    @staticmethod
    def _store(state: dict[str, Any], key: str, value_fp32: torch.Tensor) -> None:
        if state[key] is not value_fp32 and not state[key].is_complex():   # complex: updated through its real view
            state[key].copy_(value_fp32)  # round to nearest into the storage dtype

    @staticmethod
    def _new_state(p: torch.Tensor, value_fp32: torch.Tensor, state_dtype: torch.dtype) -> torch.Tensor:
        """A state tensor first computed as ``value_fp32`` (of :func:`_as_fp32`'s shape), in ``p``'s storage:
        complex64 for a complex ``p``, else ``state_dtype``."""
        return torch.view_as_complex(value_fp32.contiguous()) if p.is_complex() else value_fp32.to(state_dtype)

    def _write_back(self, p: torch.Tensor, param_fp32: torch.Tensor, state: dict[str, Any],
                    lost_counts: list) -> None:
        if param_fp32 is p or p.is_complex():
            return  # fp32 param (or complex64 through its real view), updated in place
        step = int(state["step"])  # CPU scalar: no device sync
        if self.rounding == "nearest" and _is_check_step(step) and not getattr(self, "_lost_warned", False):
            lost_counts.append(lost_update_counts(p, param_fp32))
            self._lost_step = step
        write_back_(p, param_fp32, rounding=self.rounding, kahan_comp=state.get("kahan_comp"))

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but keep this optimizer's state dtypes.

        torch casts every floating state tensor to its param's dtype, which would truncate fp32
        moments of bf16 params. Here moments are copied in ``state_dtype``, ``kahan_comp`` in the
        param dtype and ``step`` as saved (all copies, never aliases of ``state_dict``).
        """
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if not torch.is_tensor(value):
                    continue
                if key == "step":
                    self.state[p][key] = value.clone()
                else:
                    dtype = p.dtype if key == "kahan_comp" or p.is_complex() else self.state_dtype
                    self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)
