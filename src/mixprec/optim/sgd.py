"""SGD with momentum, fp32 math for any param dtype: a plain update function and a thin shell."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.optim.arguments import check_number, check_torch_options
from mixprec.optim.precision_optimizer import PrecisionOptimizer, grad_fp32
from mixprec.optim.state_codec import as_fp32

__all__ = ["SGD", "sgd_update_"]


def sgd_update_(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, *,
                lr: float, momentum: float, dampening: float, weight_decay: float,
                nesterov: bool) -> torch.Tensor | None:
    """One SGD step on fp32 tensors, in place on ``param`` and ``momentum_buffer``.

    Same op order as ``torch.optim.sgd._single_tensor_sgd``, so fp32 results are bit-identical
    to ``torch.optim.SGD(foreach=False)``. ``grad`` is read, never written. Pass
    ``momentum_buffer=None`` on the first step: the buffer starts as a copy of the (decayed)
    gradient, as in torch. Returns the buffer (new on the first step), or None when
    ``momentum == 0``. All tensors fp32 and of one shape. No host sync.
    """
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if momentum_buffer is None:
            momentum_buffer = grad.detach().clone()
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)
    return momentum_buffer


class SGD(PrecisionOptimizer):
    """SGD with momentum, dampening and Nesterov, computed in fp32 for fp32, bf16 and fp16 params.

    Update rule, per param with gradient ``g`` (all in fp32)::

        g ← g + λ·θ                                          (skipped when λ = 0)
        b ← g on the first step, else μ·b + (1 − τ)·g        (skipped when μ = 0)
        g ← g + μ·b if nesterov else b                       (skipped when μ = 0)
        θ ← θ − lr·g

    then θ is written into the param with ``rounding`` (see :mod:`mixprec.optim.rounding`).
    Defaults and op order follow ``torch.optim.SGD`` (except ``lr=1e-3`` by default): with fp32
    params, ``rounding='nearest'`` and fp32 state the result equals
    ``torch.optim.SGD(foreach=False)`` bit for bit. Kahan compensation follows optimi;
    stochastic rounding follows Gupta et al. 2015.

    Args:
        params: iterable of params or param-group dicts (fp32, bf16, fp16 or complex64 params). A
            complex64 param is stepped in place on its fp32 ``view_as_real``, as ``torch.optim`` does
            (bit-identical to it; no rounding or compensation: it is full precision).
        lr: learning rate >= 0; schedulers may change ``param_groups[i]["lr"]``.
        momentum: μ >= 0.
        dampening: τ >= 0 (must be 0 with Nesterov).
        weight_decay: L2 penalty λ >= 0, added to the gradient.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        rounding: ``"nearest"`` (default when None), ``"kahan"`` or ``"stochastic"`` (bf16 only).
        state_dtype: format of ``momentum_buffer``: fp32 (default when None), bf16, fp16, or 8-bit blockwise
            (``"int8"``: the signed dynamic map; ``"fp8"``: E4M3; :mod:`mixprec.optim.quantized_state`).
        state_rounding: how bf16 and 8-bit state is rounded when stored: ``"nearest"`` or ``"stochastic"``
            (unbiased, so bf16 moments track fp32 ones). Default when None:
            ``"stochastic"`` for bf16 state, else ``"nearest"``. 16-bit state takes no
            extra buffer (the random bits are temporaries); fp16 state is rounded to nearest only.
        sr_seed: seed of stochastic rounding's counter-based stream (:mod:`mixprec.optim.sr_stream`; params and
            state): an int in ``[0, 2**64)``, else ``torch.initial_seed()`` (nothing is drawn). Kept in every
            param group (``param_groups[i]["sr_seed"]``), so ``state_dict()`` resumes the rounding bit for bit;
            torch's global RNG is never used. A state dict saved before ``sr_seed`` existed loads into an optimizer
            that rounds stochastically only under :func:`mixprec.optim.adopt_sr_seed` (:mod:`mixprec.optim.sr_seed`).

    State: ``step`` (float32 scalar, CPU; counts steps for the first-step check),
    ``momentum_buffer`` in ``state_dtype`` when ``momentum != 0`` (complex64 for a complex64 param,
    as torch.optim; upcast to fp32 for the
    math, stored back rounded to nearest), ``kahan_comp`` in the param dtype for 16-bit params
    under ``'kahan'``. Under 8-bit state a param with at least 4096 elements and 2 dimensions holds
    ``momentum_buffer`` as codes plus ``momentum_buffer_absmax`` (fp32, one per 256 elements),
    dequantized into fp32 for :func:`sgd_update_` and requantized after; other params keep it in fp32.

    Host syncs: none, except once on the first step for 16-bit params under ``'nearest'``,
    which counts updates smaller than half an ulp and warns if they are over 50%.

    Sparse COO gradients (``nn.Embedding(sparse=True)``) are upcast to fp32, then densified (duplicate
    rows summed in fp32): the step equals the step on the equivalent dense gradient, at the cost
    of one dense fp32 temporary per sparse param and step.

    Raises:
        ValueError: an invalid hyperparameter, ``rounding``, ``state_dtype`` or ``state_rounding``, a param dtype
            outside fp32/bf16/fp16/complex64 (named with its shape and the fix), or ``'stochastic'``
            with fp16 params.
        TypeError: a ``torch.optim`` option (``foreach``, ``fused``, ``maximize``...) at a value that would change
            the step (``maximize=True``, ``fused=True``...), named with the fix; their no-op values are accepted.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, rounding: str | None = None,
                 state_dtype: torch.dtype | str | None = None, state_rounding: str | None = None,
                 sr_seed: int | None = None, **torch_options: Any) -> None:
        check_torch_options("SGD", torch_options, ("foreach", "fused", "differentiable", "maximize"))
        check_number("SGD", "lr", lr, low=0.0, example="1e-3")
        check_number("SGD", "momentum", momentum, low=0.0, example="0.9")
        check_number("SGD", "dampening", dampening, low=0.0, example="0.0")
        check_number("SGD", "weight_decay", weight_decay, low=0.0, example="1e-4")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD nesterov=True needs momentum > 0 and dampening == 0, got "
                             f"{momentum=}, {dampening=}; set momentum (e.g. 0.9) and dampening=0, "
                             "or nesterov=False")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov)
        super().__init__(params, defaults, rounding=rounding, state_dtype=state_dtype, state_rounding=state_rounding,
                         sr_seed=sr_seed)

    def keeps_moments(self, group: dict[str, Any]) -> bool:
        return group["momentum"] != 0   # no momentum_buffer without momentum

    def state_note(self) -> str:
        """:meth:`PrecisionOptimizer.state_note`, plus how 8-bit momentum steps run (torch ops: the fused
        kernel is AdamW's)."""
        note = super().state_note()
        if self.state_layout()["quantized_tensors"]:
            note += "; 8-bit-state SGD steps: torch ops (the fused C kernel is AdamW's)"
        return note

    @torch.no_grad()
    def step(self, closure=None):
        """One SGD step for every param with a ``.grad``; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lost_counts: list = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                shard, grad, local_state = self.state_codec.local_view(p, state)   # FSDP2: this rank's shard
                param_fp32 = as_fp32(shard)
                buffer_fp32 = self.state_codec.load(local_state, "momentum_buffer") if "momentum_buffer" in local_state else None
                new_buffer_fp32 = sgd_update_(param_fp32, grad_fp32(shard, grad), buffer_fp32, lr=group["lr"],
                                              momentum=group["momentum"], dampening=group["dampening"],
                                              weight_decay=group["weight_decay"],
                                              nesterov=group["nesterov"])
                if buffer_fp32 is not None:
                    self.state_codec.store(shard, local_state, "momentum_buffer", buffer_fp32)
                elif new_buffer_fp32 is not None:
                    self.state_codec.put(shard, local_state, "momentum_buffer", new_buffer_fp32)
                    self.state_codec.publish(p, state, local_state)
                self.write_back.write(shard, param_fp32, local_state, lost_counts)
        self.write_back.warn_if_updates_lost(lost_counts)
        return loss
