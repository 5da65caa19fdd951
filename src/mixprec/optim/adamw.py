"""AdamW with fp32 math for any param dtype: a plain update function and a thin Optimizer shell."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.optim import quantized_adamw, sharded, sharded_blocks
from mixprec.optim import quantized_state as qs
from mixprec.optim.arguments import check_number, check_torch_options
from mixprec.optim.precision_optimizer import PrecisionOptimizer, grad_fp32
from mixprec.optim.state_codec import as_fp32

__all__ = ["AdamW", "adamw_update_"]


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  *, step: float, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float) -> None:
    """One AdamW step on fp32 tensors, in place on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    Same op order as ``torch.optim.adam._single_tensor_adam`` (decoupled weight decay,
    non-capturable path), so fp32 results are bit-identical to ``torch.optim.AdamW(foreach=False)``.
    ``grad`` is read, never written. All tensors fp32 and of one shape; ``step`` is the step
    count after incrementing (1 on the first step). No host sync.
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step  # Python floats (fp64), as torch
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)  # eps added in fp32: never 0
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(PrecisionOptimizer):
    """AdamW (Loshchilov & Hutter 2019) computed in fp32 for fp32, bf16 and fp16 params.

    Update rule, per param with gradient ``g`` at step ``t`` (all in fp32)::

        θ ← θ · (1 − lr·λ)                                   (skipped when λ = 0)
        m ← m + (1 − β1)·(g − m)                             (lerp)
        v ← β2·v + (1 − β2)·g²
        θ ← θ − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

    then θ is written into the param with ``rounding`` (see :mod:`mixprec.optim.rounding`).
    Defaults and op order follow ``torch.optim.AdamW``: with fp32 params, ``rounding='nearest'``
    and fp32 state the result equals ``torch.optim.AdamW(foreach=False)`` bit for bit. Kahan
    compensation follows optimi; stochastic rounding follows Gupta et al. 2015. 8-bit state
    (``state_dtype='int8'`` / ``'fp8'``) follows Dettmers et al. 2022 (bitsandbytes ``AdamW8bit``,
    torchao ``AdamW8bit``): ``m`` and ``v`` are dequantized into fp32, updated (so the step uses the fp32
    ``v`` including this step's ``g²``, never a requantized one), and requantized after
    (:mod:`mixprec.optim.quantized_state`), with one rounding per operation of the rule above, fused into
    one C pass per block on a CPU (:mod:`mixprec.optim.quantized_adamw`, the same bits as its torch ops).

    Args:
        params: iterable of params or param-group dicts (fp32, bf16, fp16 or complex64 params). A
            complex64 param is stepped in place on its fp32 ``view_as_real``, as ``torch.optim`` does
            (bit-identical to it; no rounding or compensation: it is full precision).
        lr: learning rate >= 0; schedulers may change ``param_groups[i]["lr"]``.
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        eps: term added to the denominator, >= 0; applied in fp32, so 1e-8 is not lost on fp16.
        weight_decay: decoupled weight decay λ >= 0.
        rounding: ``"nearest"`` (default when None), ``"kahan"`` or ``"stochastic"`` (bf16 only).
        state_dtype: format of ``exp_avg`` / ``exp_avg_sq``: fp32 (default when None), bf16, fp16, or 8-bit
            blockwise: ``torch.int8`` / ``"int8"`` (dynamic-map codes: the signed map for ``exp_avg``, the
            unsigned map of ``sqrt(exp_avg_sq)`` for ``exp_avg_sq``) or ``torch.float8_e4m3fn`` / ``"fp8"``
            (E4M3 ``exp_avg``, E5M2 ``exp_avg_sq``).
        state_rounding: how bf16 and 8-bit state is rounded when stored: ``"nearest"`` or ``"stochastic"``
            (unbiased, so bf16 moments track fp32 ones). Default when None:
            ``"stochastic"`` for bf16 state, else ``"nearest"``. 16-bit state takes no
            extra buffer (the random bits are temporaries); fp16 state is rounded to nearest only.
        sr_seed: seed of stochastic rounding's counter-based stream (:mod:`mixprec.optim.sr_stream`; params and
            state): an int in ``[0, 2**64)``, else ``torch.initial_seed()`` (nothing is drawn). Kept in every
            param group (``param_groups[i]["sr_seed"]``), so ``state_dict()`` resumes the rounding bit for bit;
            torch's global RNG is never used. A state dict saved before ``sr_seed`` existed loads into an optimizer
            that rounds stochastically only under :func:`mixprec.optim.adopt_sr_seed` (:mod:`mixprec.optim.sr_seed`).

    State: ``step`` (float32 scalar, CPU), ``exp_avg`` and ``exp_avg_sq`` in ``state_dtype`` (complex64
    for a complex64 param, as torch.optim)
    (upcast to fp32 for the math, stored back with ``state_rounding``), ``kahan_comp`` in the param
    dtype for 16-bit params under ``'kahan'``. Under 8-bit state a param with at least 4096 elements
    and 2 dimensions holds ``exp_avg`` / ``exp_avg_sq`` as codes (its shape, 1 byte each) plus
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, one per 256 elements); other params keep fp32
    moments (:meth:`state_layout` counts both). A NaN/inf reaching the moments of a quantized param
    turns its block of 256 NaN (:mod:`mixprec.optim.quantized_state`); :class:`mixprec.MixedPrecision`
    skips non-finite steps before the optimizer runs.

    Host syncs: none, except once on the first step for 16-bit params under ``'nearest'``,
    which counts updates smaller than half an ulp and warns if they are over 50%.

    Sparse COO gradients (``nn.Embedding(sparse=True)``) are upcast to fp32, then densified (duplicate
    rows summed in fp32): the step equals the step on the equivalent dense gradient (AdamW's moments then decay on every
    row, as for a dense table; ``torch.optim.SparseAdam`` updates only the rows looked up), at the cost
    of one dense fp32 temporary per sparse param and step.

    Raises:
        ValueError: an invalid hyperparameter, ``rounding``, ``state_dtype`` or ``state_rounding``, a param dtype
            outside fp32/bf16/fp16/complex64 (named with its shape and the fix), or ``'stochastic'``
            with fp16 params.
        TypeError: a ``torch.optim`` option (``foreach``, ``fused``, ``maximize``...) at a value that would change
            the step (``maximize=True``, ``fused=True``...), named with the fix; their no-op values are accepted.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, rounding: str | None = None,
                 state_dtype: torch.dtype | str | None = None, state_rounding: str | None = None,
                 sr_seed: int | None = None, **torch_options: Any) -> None:
        check_torch_options("AdamW", torch_options, ("foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad"))
        check_number("AdamW", "lr", lr, low=0.0, example="1e-3")
        check_number("AdamW", "eps", eps, low=0.0, example="1e-8")
        check_number("AdamW", "weight_decay", weight_decay, low=0.0, example="1e-2")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"AdamW betas={betas!r} is not allowed; pass two numbers in [0, 1), "
                             "e.g. betas=(0.9, 0.999)")
        for name, beta in zip(("betas[0]", "betas[1]"), betas):
            check_number("AdamW", name, beta, low=0.0, high=1.0, high_open=True, example="0.9")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, rounding=rounding, state_dtype=state_dtype, state_rounding=state_rounding,
                         sr_seed=sr_seed)

    _SHARDS_8BIT = True   # steps 8-bit state of FSDP2 shards (mixprec.optim.sharded_blocks)
    _NONNEGATIVE = frozenset({"exp_avg_sq"})   # its 8-bit code: sqrt(v) in the unsigned map (E5M2 under fp8)

    def _unimplemented_options(self, group: dict[str, Any]) -> list[str]:
        found = super()._unimplemented_options(group) + (["amsgrad=True"] if group.get("amsgrad") else [])
        if group.get("decoupled_weight_decay") is False and group.get("weight_decay", 0) != 0:
            found.append("decoupled_weight_decay=False (torch.optim.Adam's L2 weight decay)")
        return found

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every param with a ``.grad``; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lost_counts: list = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, zeros=("exp_avg", "exp_avg_sq"))
                state["step"] += 1
                hyper = dict(step=float(state["step"]),  # CPU scalar: no device sync
                             lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"])
                if "exp_avg" + qs.ABSMAX_SUFFIX in state:   # 8-bit codes (FSDP2: blocks by global index)
                    if sharded.is_sharded(p):
                        sharded_blocks.step_adamw_(self, p, state, hyper, lost_counts)
                    else:
                        self._step_8bit(p, state, hyper, lost_counts)
                    continue
                shard, grad, local_state = self.state_codec.local_view(p, state)   # FSDP2: this rank's shard
                param_fp32 = as_fp32(shard)
                exp_avg_fp32 = self.state_codec.load(local_state, "exp_avg")
                exp_avg_sq_fp32 = self.state_codec.load(local_state, "exp_avg_sq")
                adamw_update_(param_fp32, grad_fp32(shard, grad), exp_avg_fp32, exp_avg_sq_fp32, **hyper)
                self.state_codec.store(shard, local_state, "exp_avg", exp_avg_fp32)
                self.state_codec.store(shard, local_state, "exp_avg_sq", exp_avg_sq_fp32)
                self.write_back.write(shard, param_fp32, local_state, lost_counts)
        self.write_back.warn_if_updates_lost(lost_counts)
        return loss

    def _step_8bit(self, p: torch.Tensor, state: dict[str, Any], hyper: dict[str, float], lost_counts: list) -> None:
        """One step of a param with 8-bit moments: the fused C kernel where it applies, else its torch-op
        reference (:mod:`mixprec.optim.quantized_adamw`; the same bits either way)."""
        m = (state["exp_avg"], state["exp_avg" + qs.ABSMAX_SUFFIX])
        v = (state["exp_avg_sq"], state["exp_avg_sq" + qs.ABSMAX_SUFFIX])
        key = self.stream_keys.key(p, state, "param")
        if not self.write_back.checks_lost_updates(p, state) and quantized_adamw.fusable(p, p.grad, m[0], v[0], rounding=self.rounding):
            quantized_adamw.fused_step_(p, p.grad, m, v, rounding=self.rounding, state_rounding=self.state_rounding,
                                        generator=key, **hyper)
            return
        param_fp32 = as_fp32(p)
        quantized_adamw.reference_update_(param_fp32, grad_fp32(p), m, v, state_rounding=self.state_rounding,
                                          generator=key, **hyper)
        self.write_back.write(p, param_fp32, state, lost_counts)

    def state_note(self) -> str:
        """:meth:`PrecisionOptimizer.state_note`, plus how 8-bit-state steps run: the fused C kernel (CPU),
        or torch ops and why (builds and checks the kernel the first time it is asked)."""
        note = super().state_note()
        quantized = [p for g in self.param_groups for p in g["params"] if self.state_codec.quantized(p)]
        if not quantized:
            return note
        if {p.device.type for p in quantized} != {"cpu"}:
            how = "torch ops (the fused kernel is CPU-only)"
        elif self.rounding == "kahan" and any(p.dtype != torch.float32 for p in quantized):
            how = "torch ops (rounding='kahan' is not fused)"
        elif any(p.dtype not in (torch.float32, torch.bfloat16) for p in quantized):
            how = "torch ops for fp16 params (the fused kernel takes fp32 and bf16)"
        else:
            how = quantized_adamw.kernel_status()
        if any(sharded.is_sharded(p) for p in quantized):
            how += ("; FSDP2 shards: blocks by global index, a block cut by a shard boundary stepped in pieces and its "
                    "absmax agreed by one all-reduce (MAX) of the scales per param and step, so codes and scales are "
                    "one process's at any world size (mixprec.optim.sharded_blocks)")
        return note + f"; 8-bit-state AdamW steps: {how}"
