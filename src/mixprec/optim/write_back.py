"""How a precision optimizer writes its fp32 result into a 16-bit param: the write-back half of
:class:`~mixprec.optim.precision_optimizer.PrecisionOptimizer` (the state codec is the other,
:mod:`mixprec.optim.state_codec`).

The optimizer's ``rounding`` decides: ``"nearest"`` (a plain cast), ``"kahan"`` (the rounding error kept in the
param's ``kahan_comp`` and added back next step; this half creates that buffer, gives it to the engine and starts
it where the engine casts a param) or ``"stochastic"`` (unbiased rounding into bf16 from the counter-based stream,
:mod:`mixprec.optim.stream_keys`); :mod:`mixprec.optim.rounding` holds the arithmetic. Under
``"nearest"`` the lost-update check counts, at steps 1, 10, 100, ..., the updates rounded away and warns once when
more than half were (one host sync on those steps).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec.messages.location import user_stacklevel
from mixprec.optim.rounding import lost_update_counts, write_back_
from mixprec.optim.state_codec import stochastic_round_into
from mixprec.optim.stream_keys import StreamKeys

__all__ = ["WriteBack", "HALF_DTYPES"]

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _is_check_step(step: int) -> bool:
    """1, 10, 100, 1000, ...: where the lost-update check runs (one host sync per decade of steps)."""
    while step >= 10 and step % 10 == 0:
        step //= 10
    return step == 1


class WriteBack:
    """The write-back of ``optimizer`` (its ``rounding`` read when used), drawing stochastic rounding from ``keys``."""

    def __init__(self, optimizer: Any, keys: StreamKeys) -> None:
        self._opt, self._keys = optimizer, keys
        self._lost_warned, self._lost_step = False, 0

    def prepare(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Give ``state`` (``p``'s) the Kahan compensation :meth:`write` needs: zeros in ``p``'s dtype and shape for a
        16-bit ``p`` under ``rounding='kahan'``, where it has none yet."""
        if self._opt.rounding == "kahan" and p.dtype in HALF_DTYPES and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def compensation(self, p: torch.Tensor) -> torch.Tensor | None:
        """The Kahan compensation buffer of ``p`` (param dtype, shape of ``p``), or None. No sync."""
        return self._opt.state[p].get("kahan_comp") if p in self._opt.state else None

    def start_compensation(self, residuals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the Kahan compensation of each 16-bit ``p`` to ``residual`` (fp32, what rounding ``p`` to its dtype
        lost), stored in ``p``'s dtype (:func:`mixprec.optim.contract.start_compensation`). No sync."""
        for p, residual in residuals:
            self._opt.state[p]["kahan_comp"] = residual.to(p.dtype)

    def checks_lost_updates(self, p: torch.Tensor, state: dict[str, Any]) -> bool:
        """Whether :meth:`write` counts this step's lost updates of ``p`` (16-bit, ``'nearest'``, a check step, not
        warned yet): it needs the fp32 result beside the rounded param."""
        return (p.dtype in HALF_DTYPES and self._opt.rounding == "nearest" and _is_check_step(int(state["step"]))
                and not self._lost_warned)

    def write(self, p: torch.Tensor, param_fp32: torch.Tensor, state: dict[str, Any], lost_counts: list) -> None:
        """``p`` := ``param_fp32`` under the optimizer's ``rounding`` (nothing for an fp32 or complex ``p``, updated in
        place); on a check step, the lost-update counts appended to ``lost_counts``. No host sync."""
        if param_fp32 is p or p.is_complex():
            return  # fp32 param (or complex64 through its real view), updated in place
        step = int(state["step"])  # CPU scalar: no device sync
        if self.checks_lost_updates(p, state):
            lost_counts.append(lost_update_counts(p, param_fp32))
            self._lost_step = step
        if self._opt.rounding == "stochastic" and p.dtype == torch.bfloat16:
            stochastic_round_into(p, param_fp32, self._keys.key(p, state, "param"))
            return
        write_back_(p, param_fp32, rounding=self._opt.rounding, kahan_comp=state.get("kahan_comp"))

    def warn_if_updates_lost(self, lost_counts: list) -> None:
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
                f"{type(self._opt).__name__}: {lost / changed:.1%} of step {self._lost_step}'s nonzero updates to "
                "16-bit params are smaller than half an ulp of the param and were rounded away "
                "(rounding='nearest'), so those weights do not train. Fix: keep fp32 master weights "
                "(policy 'bf16-pure'), or use rounding='kahan' or rounding='stochastic'.",
                UserWarning, stacklevel=user_stacklevel())
