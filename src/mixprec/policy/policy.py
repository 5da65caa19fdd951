"""Precision policies: which dtype holds the parameters, which one computes, and how updates land.

A :class:`Policy` is a frozen dataclass. Build one from a preset name or a ``key=value`` text
with :meth:`Policy.parse`; ``str(policy)`` gives canonical text that parses back to an equal
policy. The design follows jmp's ``Policy`` (param / compute / output dtypes, string constructor)
and adds the fields mixed-precision training needs: master weights, rounding of updates,
optimizer-state format, loss scaling, modules kept in fp32 and an fp8 recipe.

Presets (bytes per parameter of training state with AdamW: params + grads + masters + the two
moments + any compensation buffer; :meth:`Policy.bytes_per_param`):

==============  ======  =======  ======  ==========  =====  ==========  ===========
preset          params  compute  master  rounding    state  loss scale  bytes/param
==============  ======  =======  ======  ==========  =====  ==========  ===========
``fp32``        fp32    fp32     --      nearest     fp32   none        16
``bf16-mixed``  fp32    bf16     --      nearest     fp32   none        16
``fp16-mixed``  fp32    fp16     --      nearest     fp32   dynamic     16
``bf16-pure``   bf16    bf16     fp32    nearest     fp32   none        18 (2 + 4 grad_fp32 + 4 + 8)
``fp16-pure``   fp16    fp16     fp32    nearest     fp32   dynamic     18
``bf16-kahan``  bf16    bf16     --      kahan       fp32   none        14 (2 + 2 + 8 + 2 compensation)
``bf16-sr``     bf16    bf16     --      stochastic  fp32   none        12 (2 + 2 + 8)
``bf16-lean``   bf16    bf16     --      stochastic  int8   none        6.03 (2 + 2 + 2 x (1 + 4/256))
``fp8-mixed``   fp32    bf16 + fp8 linears  --  nearest  fp32  none     16
``mxfp8-mixed`` fp32    bf16 + MXFP8 linears (block=mxfp8)  --  nearest  fp32  none  16
``nvfp4-mixed`` fp32    bf16 + NVFP4 linears (block=nvfp4)  --  nearest  fp32  none  16
``auto``        resolved per device by :func:`mixprec.resolve_policy`
==============  ======  =======  ======  ==========  =====  ==========  ===========

``state=int8`` (and ``state=fp8``) store each moment of a large tensor blockwise-quantized: one byte
per element plus one fp32 absmax per block of 256 (:mod:`mixprec.optim.quantized_state`); tensors
under 4096 elements and 1-D ones (norms, biases) keep fp32 state, as bitsandbytes and torchao do, so a
model's measured bytes/param (the bench's tensor census) sits a little above the table's.
``bf16-kahan,state=int8`` is 8.03.

Text form: a preset name, optionally followed by overrides, e.g. ``"bf16-kahan,state=bf16"``,
or only keys: ``"params=bf16,compute=bf16,master=fp32"`` (unspecified keys take the ``fp32``
preset's values; such a text must set ``params`` or ``compute``: ``"saved=fp32"`` alone is a ValueError asking
for a preset first, e.g. ``"bf16-mixed,saved=fp32"``). Keys: ``params``, ``compute``, ``output``, ``master``, ``rounding``,
``state`` (``fp32``, ``bf16``, ``fp16``, ``int8``, ``fp8``), ``state_rounding`` (``nearest`` or
``stochastic``: how bf16 and 8-bit state is rounded when it is stored; default ``stochastic`` for
``state=bf16``, else ``nearest``), ``loss_scale``, ``keep_fp32`` (glob
patterns joined by ``|``), ``fp8`` (recipe name,
alias ``recipe``), ``fp8_format`` (``hybrid`` or ``e4m3``), ``fp8_ends`` (``keep``: the network's
first and last linears stay in the compute dtype, the default; ``fp8``: convert them too), ``ops``
(``portable``, the default: CUDA's autocast op lists on every device; ``native``: the device's own,
see :mod:`mixprec.autocast.portable`), ``kernels`` (``measured``, the default: ops with several kernels run in
the one measured fastest on the device at their shape; ``native``: torch.autocast's; see :mod:`mixprec.autocast.op_plan`),
``saved`` (``compute``, the default under bf16 compute: norms computed in fp32 save their input for backward in
bf16; ``fp32``: as torch.autocast, the fp32 input; see :mod:`mixprec.autocast.saved_dtype`), ``block`` (a
block-scaled recipe of :data:`mixprec.blockscale.BLOCK_RECIPES`, or ``none``, the default: ``mxfp8``, ``nvfp4``
(Hadamard transform of wgrad, stochastic rounding of gradients, 2D weight scales, the last 15 % of blocks and the
first/last linears in bf16), ``nvfp4-plain`` (NVFP4 without the transform, the SR and the tail: the ablation,
``"nvfp4-mixed,block=nvfp4-plain"``); needs bf16 compute, excludes ``fp8``; native GEMMs on NVIDIA Blackwell, emulated
elsewhere, where its speed is not representative; see docs/policies.md), ``block_keep`` (glob patterns joined by ``|`` of linears, or
modules holding them, that stay in the compute dtype under ``block``, e.g. ``"nvfp4-mixed,block_keep=blocks.*.fc2"``:
what ``mixprec inspect --formats nvfp4`` advises), ``block_disable`` (parts of the ``block`` recipe turned off,
joined by ``|``: ``hadamard``, ``sr``, ``2d``, ``tail``, ``ends``, e.g. ``"nvfp4-mixed,block_disable=sr"``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.policy.cast import cast_floating
from mixprec.policy.choices import (_COMPUTE_DTYPES, _HALF_DTYPES, BLOCK_RECIPE_NAMES, FP8_FORMATS, FP8_RECIPES,
                                    KERNEL_MODES, OPS_MODES, QUANTIZED_STATE_DTYPES, ROUNDINGS, SAVED_MODES,
                                    SR_STATE_DTYPES, STATE_FORMATS, STATE_ROUNDINGS, LossScaleSpec, _dtype_name,
                                    default_saved, default_state_rounding, state_name)
from mixprec.policy.linears import canonical_disable, check_linear_fields, check_linear_needs
from mixprec.policy.text import canonical_text, parse_parts

__all__ = ["Policy", "PRESETS", "ROUNDINGS", "STATE_FORMATS", "QUANTIZED_STATE_DTYPES", "STATE_ROUNDINGS",
           "FP8_RECIPES", "FP8_FORMATS", "BLOCK_RECIPE_NAMES", "cast_floating", "state_name"]


@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy (frozen; use :meth:`replace` to derive a new one).

    Attributes:
        param_dtype: dtype the model's parameters are stored in (fp32, bf16, fp16).
        compute_dtype: dtype autocast computes matmuls/convs in (fp32 = autocast off).
        output_dtype: dtype the model's floating outputs are returned in.
        master_dtype: ``torch.float32`` to keep an fp32 master copy of 16-bit params
            (Apex O2 style), or ``None``.
        rounding: how an fp32 update is written into 16-bit params without a master copy:
            ``"nearest"``, ``"kahan"`` (compensated summation) or ``"stochastic"`` (bf16 only).
        state_dtype: format of optimizer state (moments, momentum): fp32 (default), bf16, fp16, or a
            marker for blockwise 8-bit state (:mod:`mixprec.optim.quantized_state`): ``torch.int8``
            (text ``state=int8``: dynamic-map codes, one byte per element + one fp32 absmax per 256) or
            ``torch.float8_e4m3fn`` (``state=fp8``: E4M3 first moment, E5M2 second moment, per-block scales).
        state_rounding: how bf16 and 8-bit state is rounded when it is stored: ``"nearest"`` or
            ``"stochastic"`` (unbiased: its expectation tracks fp32 state; needs ``state_dtype`` bf16, int8 or
            fp8). Default None: ``"stochastic"`` for bf16 state (round-to-nearest loses Adam's second-moment
            increments below half a bf16 ulp, so ``exp_avg_sq`` stalls), else ``"nearest"``; resolved at
            construction. ``parse`` and :meth:`replace` re-resolve it when they change ``state_dtype`` and the
            text/call does not set it (a non-default rounding is kept).
        loss_scale: ``"dynamic"``, ``"none"`` or a positive number (static scale). Default ``"auto"``:
            ``"dynamic"`` when params or compute are fp16 (fp16 unscaled flushes small gradients to zero;
            torch.amp's GradScaler recipe), else ``"none"``; resolved at construction, so the field always
            holds one of the three. ``parse`` and :meth:`replace` re-resolve it when they change a dtype
            and the text/call does not set it; an explicit ``"none"`` under fp16 is kept and
            :meth:`scaling_note` says so in the engine's decision.
        keep_fp32: glob patterns of module qualified names that keep fp32 params and run
            with autocast disabled.
        fp8: ``None`` or an fp8 recipe name (``"tensorwise"``, ``"rowwise"``, ``"delayed"``)
            for linears (see :mod:`mixprec.fp8`).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients; Transformer Engine's HYBRID) or
            ``"e4m3"`` (E4M3 everywhere); only meaningful with ``fp8`` set.
        fp8_keep_ends: keep the first and the last linear (registration order: usually the input
            projection and the LM head, the most quantisation-sensitive GEMMs) out of fp8, as
            torchao's float8 guidance advises (default True; text key ``fp8_ends=keep|fp8``).
        block: ``None`` or a block-scaled recipe name (``"mxfp8"``, ``"nvfp4"``, ``"nvfp4-plain"``: the keys of
            :data:`mixprec.blockscale.BLOCK_RECIPES`, which say the formats, the Hadamard transform, stochastic
            rounding and the layers kept in bf16): eligible linears become
            :class:`~mixprec.blockscale.BlockScaledLinear`: native block-scaled GEMMs where the device runs
            them (NVIDIA Blackwell, probed), emulated (exact dequantize + fp32 GEMM) elsewhere. Needs bf16 compute (params fp32 or bf16); excludes ``fp8``.
        block_keep: glob patterns (``fnmatch``) of linears, or of modules holding them, that stay ``nn.Linear`` in
            the compute dtype under ``block`` on top of the recipe's own keeps
            (:func:`mixprec.blockscale.convert_to_block_scaled`'s ``keep``); needs ``block``. Each pattern must
            match a linear of the model (the build raises otherwise); the decision names what each kept.
        block_disable: parts of the ``block`` recipe turned off, each a documented override of its default
            (:data:`mixprec.blockscale.recipe.RECIPE_PARTS`: ``"hadamard"``, ``"sr"``, ``"2d"``, ``"tail"``,
            ``"ends"``; text ``block_disable=sr|hadamard``); each must be on in the recipe. Recorded in the decision.
        ops: ``"portable"`` (default): inside ``mp.autocast()`` every device runs CUDA's autocast op
            lists (``exp``, ``cumsum``, ``softmax``, norms, losses in fp32); ``"native"``: the device's own
            lists (:mod:`mixprec.autocast.portable`).
        kernels: ``"measured"`` (default): inside ``mp.autocast()`` an op with several kernels (attention)
            runs in the one measured fastest on this device at its shape (:mod:`mixprec.autocast.op_plan`);
            ``"native"``: the kernels ``torch.autocast`` runs.
        saved: what a norm (``layer_norm``, ``rms_norm``) that autocast computes in fp32 saves for backward:
            ``"compute"`` its input rounded to bf16 plus fp32 row statistics (the output is unchanged; the
            gradient moves within bf16's rounding of the input, exactly nothing where the input is bf16), or
            ``"fp32"`` its fp32 input, as ``torch.autocast`` (:mod:`mixprec.autocast.saved_dtype`); under
            ``"rebuild"`` (opt-in) norms as ``"compute"``, and autocast's bf16 copies of fp32 weights and the outputs
            of ``gelu``/``silu`` are not kept either: the backward casts / computes them again, to the same bits
            (:mod:`mixprec.autocast.saved_rebuilds`; its limits there). Default
            ``"auto"``: ``"compute"`` under bf16 compute, else ``"fp32"``; resolved at construction, and
            re-resolved by ``parse`` and :meth:`replace` when they change the compute dtype and leave it unset.
            ``"compute"`` and ``"rebuild"`` need bf16 compute.

    Raises:
        ValueError: an inconsistent combination, naming the field, the value and the fix.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype | None = None
    rounding: str = "nearest"
    state_dtype: torch.dtype = torch.float32
    state_rounding: str | None = None
    loss_scale: LossScaleSpec = "auto"
    keep_fp32: tuple[str, ...] = ()
    fp8: str | None = None
    fp8_format: str = "hybrid"
    fp8_keep_ends: bool = True
    block: str | None = None
    block_keep: tuple[str, ...] = ()
    block_disable: tuple[str, ...] = ()
    ops: str = "portable"
    kernels: str = "measured"
    saved: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.loss_scale, str) and self.loss_scale == "auto":
            object.__setattr__(self, "loss_scale", "dynamic" if torch.float16 in (self.param_dtype, self.compute_dtype)
                               else "none")
        if self.state_rounding is None:   # unset: the state format's default (stochastic for bf16)
            object.__setattr__(self, "state_rounding", default_state_rounding(self.state_dtype))
        if self.saved == "auto":   # unset: the compute dtype's default (bf16: saved in bf16)
            object.__setattr__(self, "saved", default_saved(self.compute_dtype))
        self._check_dtypes()
        self._check_rounding()
        self._check_loss_scale()
        self._check_keep_fp32()
        check_linear_fields(self)
        self._check_modes()
        check_linear_needs(self)
        object.__setattr__(self, "block_disable", canonical_disable(self.block_disable))   # one order, one policy

    # ------------------------------------------------------------------ validation (in this order)
    def _check_dtypes(self) -> None:
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, name)
            if value not in _COMPUTE_DTYPES:
                raise ValueError(f"Policy {name}={value!r} is not allowed; "
                                 f"choose one of {[_dtype_name(d) for d in _COMPUTE_DTYPES]}")
        self._check_state()
        if self.param_dtype in _HALF_DTYPES and self.compute_dtype != self.param_dtype:
            raise ValueError(f"Policy params={_dtype_name(self.param_dtype)} with compute="
                             f"{_dtype_name(self.compute_dtype)}: 16-bit params must compute in their own dtype "
                             f"(mixing bf16 and fp16 tensors breaks autocast's promotion); set compute="
                             f"{_dtype_name(self.param_dtype)}")
        if self.master_dtype not in (None, torch.float32):
            raise ValueError(f"Policy master_dtype={self.master_dtype!r} is not allowed; "
                             "use torch.float32 (fp32 master weights) or None")
        if self.master_dtype is not None and self.param_dtype == torch.float32:
            raise ValueError("Policy master_dtype=fp32 with param_dtype=fp32 is redundant: "
                             "fp32 params are their own masters; set master=none")

    def _check_rounding(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"Policy rounding={self.rounding!r} is not allowed; choose one of {ROUNDINGS}")
        if self.rounding != "nearest":
            if self.param_dtype not in _HALF_DTYPES:
                raise ValueError(f"Policy rounding={self.rounding!r} needs 16-bit params, got "
                                 f"params={_dtype_name(self.param_dtype)}; use rounding=nearest")
            if self.master_dtype is not None:
                raise ValueError(f"Policy rounding={self.rounding!r} replaces master weights; "
                                 "set master=none or rounding=nearest")
        if self.rounding == "stochastic" and self.param_dtype != torch.bfloat16:
            raise ValueError("Policy rounding='stochastic' is implemented for bf16 params only; "
                             f"got params={_dtype_name(self.param_dtype)}; use rounding=kahan")

    def _check_loss_scale(self) -> None:
        if isinstance(self.loss_scale, bool) or not isinstance(self.loss_scale, (str, int, float)):
            raise TypeError(f"Policy loss_scale={self.loss_scale!r} must be 'dynamic', 'none' or a number")
        if isinstance(self.loss_scale, str) and self.loss_scale not in ("dynamic", "none"):
            raise ValueError(f"Policy loss_scale={self.loss_scale!r} is not allowed; "
                             "use 'dynamic', 'none' or a positive number")
        if not isinstance(self.loss_scale, str):
            fp32 = torch.finfo(torch.float32)
            if not (math.isfinite(self.loss_scale) and fp32.smallest_normal <= self.loss_scale <= fp32.max):
                raise ValueError(f"Policy loss_scale={self.loss_scale!r} must be a finite number > 0 and a normal "
                                 f"fp32 value ({fp32.smallest_normal:g} .. {fp32.max:g}), e.g. 1024")

    def _check_keep_fp32(self) -> None:
        if not isinstance(self.keep_fp32, tuple) or not all(isinstance(p, str) and p for p in self.keep_fp32):
            raise TypeError(f"Policy keep_fp32={self.keep_fp32!r} must be a tuple of non-empty "
                            "glob strings, e.g. ('head', 'blocks.*.ln*')")
        for pattern in self.keep_fp32:
            if any(c in pattern for c in ",=| "):
                raise ValueError(f"Policy keep_fp32 pattern {pattern!r} may not contain ',', '=', '|' or spaces")

    def _check_modes(self) -> None:
        if self.ops not in OPS_MODES:
            raise ValueError(f"Policy ops={self.ops!r} is not allowed; choose one of {OPS_MODES}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"Policy kernels={self.kernels!r} is not allowed; choose one of {KERNEL_MODES}")
        if self.saved not in SAVED_MODES:
            raise ValueError(f"Policy saved={self.saved!r} is not allowed; choose one of {SAVED_MODES}")
        if self.saved in ("compute", "rebuild") and self.compute_dtype != torch.bfloat16:
            raise ValueError(f"Policy saved={self.saved!r} with compute={_dtype_name(self.compute_dtype)}: saving norm inputs "
                             "in the compute dtype is offered under bf16 compute only (fp16's range, 65504, cannot hold "
                             "every fp32 norm input; fp32 has nothing lower to save); set saved=fp32 or compute=bf16")

    def _check_state(self) -> None:
        if self.state_dtype not in STATE_FORMATS.values():
            raise ValueError(f"Policy state_dtype={self.state_dtype!r} is not allowed; choose one of "
                             f"{list(STATE_FORMATS.values())} (text state={'|'.join(STATE_FORMATS)})")
        if self.state_rounding not in STATE_ROUNDINGS:
            raise ValueError(f"Policy state_rounding={self.state_rounding!r} is not allowed; choose one of "
                             f"{STATE_ROUNDINGS}")
        if self.state_rounding != "nearest" and self.state_dtype not in SR_STATE_DTYPES:
            raise ValueError(f"Policy state_rounding={self.state_rounding!r} rounds bf16 or 8-bit optimizer state, but "
                             f"state={state_name(self.state_dtype)}; set state=bf16 (or int8, fp8), or "
                             "state_rounding=nearest")

    # ------------------------------------------------------------------ derived facts
    @property
    def is_mixed(self) -> bool:
        """True when the compute dtype differs from fp32 (autocast is on)."""
        return self.compute_dtype != torch.float32

    @property
    def has_masters(self) -> bool:
        return self.master_dtype is not None and self.param_dtype != torch.float32

    @property
    def quantized_state(self) -> bool:
        """True when optimizer state is blockwise 8-bit (``state=int8`` or ``state=fp8``)."""
        return self.state_dtype in QUANTIZED_STATE_DTYPES

    def bytes_per_param(self, optimizer_states: int = 2) -> float:
        """Training-state bytes per (trainable) parameter, from the policy alone.

        ``optimizer_states`` is the number of state tensors per parameter (AdamW: 2, SGD with
        momentum: 1, plain SGD: 0). Gradients live in fp32 whenever masters exist (they are
        accumulated there); compensation buffers add one param-dtype tensor under Kahan. 8-bit
        state counts one byte per element and moment plus its share of one fp32 absmax per block of
        256 elements (4/256 = 0.015625 bytes), i.e. as if every tensor were quantized and a whole
        number of blocks: tensors under 4096 elements and 1-D ones keep fp32 state (4 bytes) and a short
        last block costs a whole scale, so the bench's tensor census of a real model reads a little higher.
        """
        p = self.param_dtype.itemsize
        if self.has_masters:
            total = p + 4 + self.master_dtype.itemsize
        else:
            total = p + p  # params + grads in param dtype
        state = 1 + 4 / 256 if self.quantized_state else self.state_dtype.itemsize
        total += optimizer_states * state
        if self.rounding == "kahan":
            total += p
        return total

    def replace(self, **changes: Any) -> "Policy":
        """A copy with ``changes`` applied (validated like the constructor); a dtype change without a
        ``loss_scale`` re-resolves a default one (``"auto"``: dynamic under fp16); a static scale is kept."""
        default = "dynamic" if torch.float16 in (self.param_dtype, self.compute_dtype) else "none"
        if "loss_scale" not in changes and {"param_dtype", "compute_dtype"} & set(changes) and self.loss_scale == default:
            changes["loss_scale"] = "auto"   # the old dtypes' default follows the new dtypes; a chosen scale stays
        if ("state_rounding" not in changes and "state_dtype" in changes
                and self.state_rounding == default_state_rounding(self.state_dtype)):
            changes["state_rounding"] = None   # likewise the state format's default rounding; a chosen one stays
        if ("saved" not in changes and "compute_dtype" in changes
                and self.saved == default_saved(self.compute_dtype)):
            changes["saved"] = "auto"   # and what norms save: the new compute dtype's default; a chosen one stays
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """What this policy stores and computes in, in words: e.g. bf16-lean's ``"params bf16, compute bf16,
        no fp32 masters: updates stochastically rounded into bf16, optimizer state int8"`` (the engine's
        decision starts with it)."""
        half = self.param_dtype != torch.float32
        parts = [f"params {_dtype_name(self.param_dtype)}",
                 f"compute {_dtype_name(self.compute_dtype)}" + (" (autocast)" if self.is_mixed and not half else "")]
        if self.fp8 is not None:
            parts[-1] += f", eligible linears fp8 ({self.fp8}, {self.fp8_format})"
        if self.block is not None:
            keep = f"; block_keep {'|'.join(self.block_keep)}" if self.block_keep else ""
            off = f" without {'+'.join(self.block_disable)}" if self.block_disable else ""
            parts[-1] += f", eligible linears block-scaled ({self.block} recipe{off}{keep})"
        if half:
            how = {"stochastic": "stochastically rounded", "kahan": "Kahan-compensated",
                   "nearest": "rounded to nearest"}[self.rounding]
            parts.append(f"fp32 masters rounded to nearest into {_dtype_name(self.param_dtype)}" if self.has_masters
                         else f"no fp32 masters: updates {how} into {_dtype_name(self.param_dtype)}")
        parts.append(f"optimizer state {state_name(self.state_dtype)}" + (
            "" if self.state_dtype != torch.bfloat16 else " (stochastically rounded)" if self.state_rounding == "stochastic"
            else " (rounded to nearest: second-moment increments under half a bf16 ulp are lost)"))
        if self.loss_scale != "none":
            parts.append(f"{self.loss_scale} loss scale" if self.loss_scale == "dynamic" else
                         f"static loss scale {self.loss_scale}")
        if self.keep_fp32:
            parts.append(f"fp32 modules {'|'.join(self.keep_fp32)}")
        return ", ".join(parts)

    def scaling_note(self) -> str:
        """The decision's words when fp16 runs unscaled because ``loss_scale=none`` was written ("" else)."""
        if self.loss_scale == "none" and torch.float16 in (self.param_dtype, self.compute_dtype):
            return ("; fp16 without loss scaling (loss_scale=none, as written): gradients below fp16's smallest "
                    "subnormal (6e-8) flush to zero; drop loss_scale=none for dynamic scaling")
        return ""

    # ------------------------------------------------------------------ text form (mixprec.policy.text)
    @classmethod
    def parse(cls, text: "str | Policy") -> "Policy":
        """Parse a preset name and/or ``key=value`` overrides (see the module docstring).

        Raises:
            ValueError: unknown preset or key, bad value; the message lists what is allowed.
            TypeError: ``text`` is neither a string nor a Policy.
        """
        if isinstance(text, Policy):
            return text
        if not isinstance(text, str):
            raise TypeError(f"policy must be a preset name, 'key=value,...' text or a Policy; got {text!r}")
        base, changes = parse_parts(text, PRESETS)
        return base.replace(**changes)

    def __str__(self) -> str:
        """The canonical text: a preset's name, else the closest preset plus the keys that differ (when that text
        parses back to this policy, e.g. ``"bf16-mixed,kernels=native"``), else every key."""
        return canonical_text(self, PRESETS)


_bf16, _fp16, _fp32 = torch.bfloat16, torch.float16, torch.float32
PRESETS: dict[str, Policy] = {
    "fp32": Policy(),
    "bf16-mixed": Policy(compute_dtype=_bf16),
    "fp16-mixed": Policy(compute_dtype=_fp16, loss_scale="dynamic"),
    "bf16-pure": Policy(param_dtype=_bf16, compute_dtype=_bf16, master_dtype=_fp32),
    "fp16-pure": Policy(param_dtype=_fp16, compute_dtype=_fp16, master_dtype=_fp32, loss_scale="dynamic"),
    "bf16-kahan": Policy(param_dtype=_bf16, compute_dtype=_bf16, rounding="kahan"),
    "bf16-sr": Policy(param_dtype=_bf16, compute_dtype=_bf16, rounding="stochastic"),
    "bf16-lean": Policy(param_dtype=_bf16, compute_dtype=_bf16, rounding="stochastic", state_dtype=torch.int8),
    "fp8-mixed": Policy(compute_dtype=_bf16, fp8="tensorwise"),
    "mxfp8-mixed": Policy(compute_dtype=_bf16, block="mxfp8"),
    "nvfp4-mixed": Policy(compute_dtype=_bf16, block="nvfp4"),
}

