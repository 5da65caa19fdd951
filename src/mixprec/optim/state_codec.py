"""How a precision optimizer stores its moment state, and converts it: the storage half of
:class:`~mixprec.optim.precision_optimizer.PrecisionOptimizer` (the write-back is the other,
:mod:`mixprec.optim.write_back`).

A moment (``exp_avg``, ``momentum_buffer``, ...) of a param is held in the optimizer's ``state_dtype`` (fp32, bf16,
fp16), or under an 8-bit ``state_dtype`` (``torch.int8``, ``torch.float8_e4m3fn``) as blockwise codes plus fp32
absmax scales (:mod:`mixprec.optim.quantized_state`) for a tensor that :func:`~mixprec.optim.quantized_state.quantizes`
(fp32 otherwise), complex64 for a complex param. The step reads a moment as fp32 (:meth:`StateCodec.load`), writes it
back (:meth:`StateCodec.store`: requantized, stochastically rounded into bf16 under ``state_rounding='stochastic'``,
else to nearest), and a loaded or re-keyed state is converted through fp32 where its format differs
(:meth:`StateCodec.restored`). An FSDP2-sharded param is stepped on its local shard (:meth:`StateCodec.local_view`).
No host sync.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

from mixprec.optim import quantized_adamw
from mixprec.optim import quantized_state as qs
from mixprec.optim import sharded
from mixprec.optim.rounding import stochastic_round_to_bf16
from mixprec.optim.sr_stream import SRKey
from mixprec.optim.stream_keys import StreamKeys
from mixprec.policy.policy import QUANTIZED_STATE_DTYPES, state_name

__all__ = ["StateCodec", "as_fp32", "stochastic_round_into"]


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when fp32 (so in-place math hits the stored tensor), its ``view_as_real`` when
    complex64 (an fp32 alias: in-place math hits the stored tensor too, as ``torch.optim`` steps complex
    params), else an fp32 copy."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t if t.dtype == torch.float32 else t.float()


def stochastic_round_into(out_bf16: torch.Tensor, value_fp32: torch.Tensor, key: SRKey) -> None:
    """``out_bf16`` := ``value_fp32`` stochastically rounded with the bits of ``key``'s stream: one C pass on a CPU
    where the kernel applies, else the torch ops (the same bits). No host sync."""
    if not quantized_adamw.stochastic_round_into_(out_bf16, value_fp32, key):
        out_bf16.copy_(stochastic_round_to_bf16(value_fp32, generator=key))


class StateCodec:
    """The state formats of ``optimizer`` (its ``state_dtype`` and ``state_rounding`` read when used: a policy may
    change them before the first step). ``nonnegative``: moments known to be >= 0 (the unsigned 8-bit code);
    ``shards_8bit``: whether the optimizer's step handles 8-bit state of FSDP2 shards; ``keys``: the stochastic
    rounding streams.

    State per param: ``step`` (float32 scalar on the CPU, as torch.optim), every moment (``exp_avg``,
    ``momentum_buffer``...) in ``state_dtype``, and ``kahan_comp`` in the param dtype for 16-bit params under
    ``rounding='kahan'`` (:mod:`mixprec.optim.write_back`). Under an 8-bit ``state_dtype`` (``torch.int8``,
    ``torch.float8_e4m3fn``) a moment of a tensor :func:`mixprec.optim.quantized_state.quantizes` is two entries:
    ``state[key]`` (codes, the param's shape, one byte each) and ``state[key + "_absmax"]`` (fp32, one per block of
    256), both plain tensors, so ``state_dict()``, checkpoints and the bench's tensor census see them; other
    tensors' moments stay fp32 (:meth:`layout` counts both kinds).
    """

    def __init__(self, optimizer: Any, keys: StreamKeys, *, nonnegative: frozenset[str], shards_8bit: bool) -> None:
        self._opt, self._keys = optimizer, keys
        self._nonnegative, self._shards_8bit = nonnegative, shards_8bit

    def quantized(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s moments are stored in 8-bit codes under the optimizer's ``state_dtype``."""
        return self._opt.state_dtype in QUANTIZED_STATE_DTYPES and not t.is_complex() and qs.quantizes(t)

    def format(self, p: torch.Tensor, key: str) -> tuple[torch.dtype, bool]:
        """How moment ``key`` of ``p`` is stored: (storage dtype, quantized)."""
        if p.is_complex():
            return p.dtype, False
        if self.quantized(p):
            return qs.code_for(self._opt.state_dtype, nonnegative=key in self._nonnegative).storage_dtype, True
        return (torch.float32 if self._opt.state_dtype in QUANTIZED_STATE_DTYPES else self._opt.state_dtype), False

    def start(self, p: torch.Tensor, state: dict[str, Any], zeros: tuple[str, ...]) -> dict[str, Any]:
        """``state`` (``p``'s, updated in place and returned) with ``step`` (a float32 0 on the CPU where it has none)
        and each moment of ``zeros`` it lacks, zero in this format (:meth:`put`)."""
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in zeros:
            if key not in state:
                self.put(p, state, key, None)
        return state

    def put(self, p: torch.Tensor, state: dict[str, Any], key: str, value_fp32: torch.Tensor | None) -> None:
        """Create moment ``key`` of ``p`` in this format from ``value_fp32`` (of :func:`as_fp32`'s shape; None:
        zeros): complex64 for a complex ``p`` (as torch.optim; ``state_dtype`` is for reals), 8-bit codes and
        scales where :meth:`quantized`, else ``state_dtype`` (fp32 under 8-bit state)."""
        if p.is_complex():
            state[key] = torch.zeros_like(p) if value_fp32 is None else torch.view_as_complex(value_fp32.contiguous())
            return
        storage, quantized = self.format(p, key)
        if quantized and sharded.is_sharded(p):
            self._put_sharded_8bit(p, state, key, value_fp32)
        elif quantized:
            code = qs.code_for(self._opt.state_dtype, nonnegative=key in self._nonnegative)
            state[key], state[key + qs.ABSMAX_SUFFIX] = (
                qs.zeros(p.shape, code, p.device) if value_fp32 is None else
                qs.quantize(value_fp32, code, rounding=self._opt.state_rounding,
                            generator=self._keys.key(p, state, key)))
        elif value_fp32 is None:
            state[key] = torch.zeros_like(p, dtype=storage, memory_format=torch.preserve_format)
        else:
            state[key] = value_fp32.to(storage)

    def _put_sharded_8bit(self, p: torch.Tensor, state: dict[str, Any], key: str, value_fp32: torch.Tensor | None
                          ) -> None:
        """Zero 8-bit moment ``key`` of the sharded ``p`` (:mod:`mixprec.optim.sharded_blocks`): codes a ``DTensor``
        placed as ``p``, the scales of all its blocks a plain fp32 tensor (the same on every rank). Raises
        ValueError for an optimizer without a sharded 8-bit step, or for values to convert into codes."""
        owner, state_dtype = type(self._opt).__name__, self._opt.state_dtype
        if not self._shards_8bit:
            raise ValueError(f"{owner} state_dtype={state_name(state_dtype)} on a param sharded by FSDP2 (shape "
                             f"{tuple(p.shape)}) is not supported: only mixprec.optim.AdamW steps 8-bit state by global "
                             "blocks; use AdamW, or state=fp32 / bf16 for this optimizer under FSDP2")
        if value_fp32 is not None:
            raise ValueError(f"{owner}: converting a moment of another format into {state_name(state_dtype)} codes "
                             f"of a param sharded by FSDP2 (shape {tuple(p.shape)}) is not supported; load a state "
                             "saved with the same state format, or convert it in one process")
        code = qs.code_for(state_dtype, nonnegative=key in self._nonnegative)
        codes, _ = qs.zeros(sharded.local(p).shape, code, p.device)
        state[key] = sharded.like_param(codes, p)
        state[key + qs.ABSMAX_SUFFIX] = torch.zeros(qs.state_shape(qs.ABSMAX_SUFFIX, p.shape), dtype=torch.float32,
                                                    device=p.device)

    def load(self, state: dict[str, Any], key: str) -> torch.Tensor:
        """Moment ``key`` in fp32: the stored tensor itself when fp32 (in-place math updates it), its real
        view when complex, else a new fp32 tensor (upcast, or dequantized codes)."""
        absmax = state.get(key + qs.ABSMAX_SUFFIX)
        if absmax is None:
            return as_fp32(state[key])
        return qs.dequantize(state[key], absmax, qs.code_of(state[key], nonnegative=key in self._nonnegative))

    def store(self, p: torch.Tensor, state: dict[str, Any], key: str, value_fp32: torch.Tensor) -> None:
        """Write ``value_fp32`` back into moment ``key`` of ``p``: requantized (``state_rounding``) into its
        codes and scales, stochastically rounded into bf16 under ``state_rounding='stochastic'`` (random bits
        from the stream of purpose ``key``), else rounded to nearest into its dtype (nothing to do for an fp32
        alias)."""
        absmax = state.get(key + qs.ABSMAX_SUFFIX)
        if absmax is not None:
            code = qs.code_of(state[key], nonnegative=key in self._nonnegative)
            qs.quantize(value_fp32, code, rounding=self._opt.state_rounding, generator=self._keys.key(p, state, key),
                        out=(state[key], absmax))
        elif state[key] is value_fp32 or state[key].is_complex():   # fp32 alias; complex: through its real view
            return
        elif state[key].dtype == torch.bfloat16 and self._opt.state_rounding == "stochastic":
            stochastic_round_into(state[key], value_fp32, self._keys.key(p, state, key))   # unbiased
        else:
            state[key].copy_(value_fp32)  # round to nearest into the storage dtype

    def restored(self, p: torch.Tensor, saved: dict[str, Any], *, copy: bool) -> dict[str, Any]:
        """``saved`` (a state of ``p``'s shape) as this format's state for ``p``: each moment as it is where its
        storage format is this one (codes and scales bit for bit), else through fp32 into it; ``copy``: every
        tensor a copy on ``p``'s device (``kahan_comp`` in ``p``'s dtype, ``step`` as saved)."""
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
            if self.format(p, key) == (value.dtype, absmax is not None):
                out[key] = value
                if absmax is not None:
                    out[key + qs.ABSMAX_SUFFIX] = absmax
            else:
                self.put(p, out, key, self.load(saved, key))
        return out

    def rekey(self, moves: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Re-key the optimizer's state after the engine swapped the tensors it steps: ``moves`` holds ``(old,
        new)`` per tensor, ``new=None`` dropping ``old``'s state. Moments keep their values: as they are where the
        storage format is unchanged (8-bit codes and scales bit for bit), else through fp32 into this format (cast,
        or quantized / dequantized: one rounding); Kahan compensation is dropped (the engine folded it into the
        params first; the write-back restarts it at zero where ``rounding`` is still ``'kahan'``); ``step`` is
        kept. No sync."""
        state = self._opt.state
        moved = [(new, state.pop(old, None)) for old, new in moves]   # all out first: old and new may alias
        for new, saved in moved:
            if saved and new is not None:
                saved.pop("kahan_comp", None)
                state[new] = self.restored(new, saved, copy=False)

    def restored_states(self, state_dict: dict[str, Any]) -> dict[torch.Tensor, dict[str, Any]]:
        """The saved states of a ``torch.optim`` state dict (``state`` by param id, ``param_groups`` in the
        optimizer's param order) by the optimizer's params, each :meth:`restored` as copies, never aliases of
        ``state_dict``: each moment as saved where its storage format is this one (8-bit codes and their absmax
        scales bit for bit), else converted through fp32 into it (e.g. a ``torch.optim.AdamW`` state into 8-bit
        codes); ``kahan_comp`` in the param dtype, ``step`` as saved. A param without saved state is left out."""
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self._opt.param_groups)
        return {p: self.restored(p, state_dict["state"][saved_id], copy=True)
                for saved_id, p in zip(saved_ids, params) if saved_id in state_dict["state"]}

    def local_view(self, p: torch.Tensor, state: dict[str, Any]
                   ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """What a step of ``p`` works on: ``(param, grad, state)``, the local shards of a sharded (``DTensor``)
        ``p`` (sharing storage: in-place math writes through; :mod:`mixprec.optim.sharded`), its stream keys at
        the shard's global offset; ``p``, ``p.grad`` and ``state`` themselves otherwise. Entries the step adds
        are placed back by :meth:`publish`. No comm."""
        if not sharded.is_sharded(p):
            return p, p.grad, state
        if self.quantized(p) and not self._shards_8bit:
            self._put_sharded_8bit(p, {}, "", None)   # raises: no sharded 8-bit step here
        p_local = p.to_local()
        self._keys.stepping_shard(p_local, p, sharded.global_offset(p))
        return p_local, sharded.local(p.grad), {k: sharded.local(v) if torch.is_tensor(v) else v
                                                for k, v in state.items()}

    def publish(self, p: torch.Tensor, state: dict[str, Any], local_state: dict[str, Any]) -> None:
        """Put the entries a step added to ``local_state`` (:meth:`local_view`) into ``state``, a local tensor of
        the shard's shape as a ``DTensor`` placed as ``p``. Nothing to do for a plain ``p``."""
        if local_state is state:
            return
        for key, value in local_state.items():
            if key not in state:
                state[key] = (sharded.like_param(value, p) if torch.is_tensor(value) and value.dim()
                              and value.shape == sharded.local(p).shape else value)

    def layout(self) -> dict[str, int]:
        """How the optimizer lays out moment state over the tensors it steps, from their shapes (valid before the
        first step): ``quantized_tensors`` / ``quantized_elements`` held in 8-bit codes (0 unless ``state_dtype``
        is 8-bit) and ``full_tensors`` / ``full_elements`` kept in ``state_dtype``, or in fp32 under 8-bit state
        (fewer than 4096 elements, 1-D or complex). Groups that keep no moments (SGD without momentum) are not
        counted."""
        stepped = list(chain.from_iterable(g["params"] for g in self._opt.param_groups if self._opt.keeps_moments(g)))
        quantized = [t for t in stepped if self.quantized(t)]
        full = [t for t in stepped if not self.quantized(t)]
        return {"quantized_tensors": len(quantized), "quantized_elements": sum(t.numel() for t in quantized),
                "full_tensors": len(full), "full_elements": sum(t.numel() for t in full)}

    def note(self) -> str:
        """The engine decision's words on 8-bit state ("" under a 16/32-bit ``state_dtype``): which format,
        and how many tensors and elements it quantizes and keeps in fp32 (by design, not a fallback)."""
        state_dtype = self._opt.state_dtype
        if state_dtype not in QUANTIZED_STATE_DTYPES:
            return ""
        n = self.layout()
        if not n["quantized_tensors"] and not n["full_tensors"]:
            return (f"; optimizer state {state_name(state_dtype)}: none is kept ({type(self._opt).__name__} without "
                    f"momentum holds no moment buffers), so {state_name(state_dtype)} state changes nothing")
        rounding = ("codes stochastically rounded" if self._opt.state_rounding == "stochastic" else
                    "codes rounded to nearest")   # the state's rounding, not the params' (policy.rounding)
        return (f"; optimizer state {state_name(state_dtype)} blockwise ({qs.BLOCK_SIZE}-element "
                f"blocks, fp32 absmax, {rounding}) for {n['quantized_tensors']} tensor(s) ({n['quantized_elements']:,} "
                f"elements); {n['full_tensors']} tensor(s) ({n['full_elements']:,} elements) keep fp32 state by design "
                f"(fewer than {qs.MIN_QUANTIZED_NUMEL} elements or 1-D)"
                + ("" if n["quantized_tensors"] or not n["full_tensors"] else
                   f": no tensor here is large enough, so every moment is fp32 and {state_name(state_dtype)} "
                   "state saves nothing on this model"))
