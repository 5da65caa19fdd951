"""How an fp32 optimizer result lands in a parameter.

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

:func:`lost_update_counts` counts the updates round-to-nearest loses. The optimizer shell that calls
these is :class:`mixprec.optim.precision_optimizer.PrecisionOptimizer`.
"""

from __future__ import annotations

import torch

from mixprec.formats import get_format
from mixprec.optim.sr_stream import SRKey, noise16
from mixprec.policy.policy import ROUNDINGS

__all__ = ["ROUNDINGS", "stochastic_round_to_bf16", "write_back_", "lost_update_counts"]

_LOW_16_BITS = 0xFFFF  # bf16 is the top half of an fp32 bit pattern


def stochastic_round_to_bf16(x_fp32: torch.Tensor, *, generator: torch.Generator | SRKey | None = None) -> torch.Tensor:
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
        generator: where the random bits come from: an :class:`mixprec.optim.sr_stream.SRKey` (the
            counter-based stream the optimizers use: element ``j`` of ``x_fp32``, row-major, takes the bits of
            global index ``key.offset + j``; no RNG moves), a ``torch.Generator``, or ``None``: torch's global
            RNG (for standalone use: restoring ``torch.get_rng_state()`` reproduces the result bitwise; the
            optimizers always pass their stream's key).

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
    if isinstance(generator, SRKey):
        noise_int32 = noise16(generator, x_fp32.shape, x_fp32.device)
    else:
        noise_int32 = torch.empty(x_fp32.shape, dtype=torch.int32, device=x_fp32.device).random_(generator=generator)
    rounded_int32 = noise_int32.bitwise_and_(_LOW_16_BITS).add_(x_fp32.view(torch.int32)).bitwise_and_(~_LOW_16_BITS)
    rounded_fp32 = rounded_int32.view(torch.float32)  # low 16 bits zero: exact in bf16
    # +-inf stay +-inf (the mask clears what the noise added); only a NaN's bits could carry into another pattern
    return torch.where(torch.isnan(x_fp32), x_fp32, rounded_fp32).to(torch.bfloat16)


def write_back_(param: torch.Tensor, value_fp32: torch.Tensor, *, rounding: str,
                kahan_comp: torch.Tensor | None = None,
                generator: torch.Generator | SRKey | None = None) -> None:
    """Store the fp32 result ``value_fp32`` into ``param`` (in place) with ``rounding``.

    Args:
        param: the parameter, fp32 / bf16 / fp16. An fp32 param takes ``value_fp32`` exactly
            (no rounding is needed, whatever ``rounding`` says).
        value_fp32: the new value, fp32, shape of ``param``.
        rounding: ``"nearest"``, ``"kahan"`` or ``"stochastic"`` (bf16 params only).
        kahan_comp: compensation buffer in ``param.dtype``, updated in place; required for
            ``"kahan"`` on 16-bit params (start it at zeros).
        generator: the random bits of ``"stochastic"``: an ``SRKey`` (counter-based stream), a
            ``torch.Generator``, or ``None``: torch's global RNG, for standalone use
            (:func:`stochastic_round_to_bf16`).

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

