"""DDP / FSDP2 wrapping under a policy: which modules are sharded, in which dtypes, every gradient collective in fp32.

:func:`wrap_model` wraps a prepared model for ``strategy="ddp"`` or ``"fsdp2"``; :func:`gradient_reduce_dtypes`
reports the dtypes its gradient collectives ran in (a collective in another dtype raises). The process group, the
data shards and the agreed decisions are :mod:`mixprec.distributed.process`'s (which re-exports these names).

**Policy → strategy mapping.**

* ``"ddp"``: the engine prepares the model exactly as in one process (16-bit params and fp32
  masters where the policy says so, autocast for compute), then wraps it in
  ``DistributedDataParallel``. DDP's buckets hold gradients in the parameters' dtype; a comm
  hook casts each bucket to fp32, all-reduces the average in fp32 and writes it back (one
  rounding into a 16-bit bucket under 16-bit-param policies). Accumulation: micro-batches
  before the boundary skip the reduction (what ``DDP.no_sync()`` sets) and gradients
  accumulate locally as in one process, except under master-weight policies (``bf16-pure``,
  ``fp16-pure``), whose fp32 master gradients accumulate outside DDP's view: there every
  micro-batch is reduced. Either way every reduction runs in fp32.
  Stochastic rounding (``bf16-sr``, ``bf16-lean``, ``state_rounding=stochastic``) draws its noise from
  the optimizer's counter-based stream, so the engine refuses to build unless every rank's ``sr_seed`` is
  rank 0's (:mod:`mixprec.distributed.replicas`): seeded per rank, the replicas would round differently
  and drift apart.
* ``"fsdp2"``: ``fully_shard`` on each block (every element of each direct child
  ``nn.ModuleList``, e.g. GPT blocks, or ``block_filter``), on each ``keep_fp32`` module and
  on the root. Parameters are stored **sharded in fp32** (they are the masters: the engine
  casts nothing and keeps no separate master copy; but under 16-bit storage without masters, below) and FSDP's
  ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32, output_dtype)`` casts them when it
  all-gathers them:

  ============================  =================  ======================================
  policy                        param_dtype        notes
  ============================  =================  ======================================
  ``fp32``                      None (fp32)
  ``bf16-mixed``                bf16               compute dtype; all-gathers in bf16
  ``bf16-pure``                 bf16               same numerics as 16-bit params + fp32
                                                   masters: the shard is the master
  ``fp16-mixed`` / ``-pure``    fp16               needs the engine's sharded overflow
                                                   check (``sharded_found_inf=True``)
  ``bf16-kahan`` / ``bf16-sr``  None (bf16 stored) params cast to bf16 before sharding,
  (16-bit storage, no masters)                     stored and all-gathered in bf16
                                                   (:mod:`~mixprec.distributed.sharded_storage`)
  ``state=bf16`` / ``fp16``     as above           moments of the shard's shape
  ``state=int8`` / ``fp8``      as above           codes of the shard's shape, blocks by global
  (``bf16-lean``)                                  index (:mod:`~mixprec.optim.sharded_blocks`)
  ``block=`` (``mxfp8-mixed``,  None (fp32; the    every unit all-gathers the stored params:
  ``nvfp4-mixed``)              stored 16 bits     block-scaled linears quantize the whole
                                without masters)   weight, as one process does (below)
  keep_fp32 modules             None (fp32)        their own ``fully_shard`` group
  ============================  =================  ======================================

  Under a block policy (``block=``) FSDP2 all-gathers the params as stored (fp32 under ``mxfp8-mixed`` and
  ``nvfp4-mixed``) and autocast alone picks each op's dtype, as in one process: a
  :class:`~mixprec.blockscale.BlockScaledLinear` then quantizes the whole fp32 weight after the all-gather, so its
  block scales (MX's E8M0 exponents, NVFP4's E4M3 block scales over 16 elements or 16x16 tiles and its fp32 tensor
  scale, the amax of the whole weight) are one process's at any world size: sharding-invariant by construction,
  with nothing of them kept between steps or sharded. A bf16 all-gather would quantize bf16-rounded weights (two
  roundings, another NVFP4 tensor amax) and run the model's other ops on bf16 params, unlike one process. The cost
  is an fp32 all-gather (twice bf16's bytes); a native path could all-gather the quantized weight instead (not done:
  the native GEMMs quantize the all-gathered fp32 weight as the emulation does). The gradients are the linear's bf16-rounded ``dW`` in fp32, reduce-scattered in fp32.

  Under 16-bit storage FSDP2 reduce-scatters the gradients in fp32 and rounds the reduced shard into the
  parameter's bf16 (in ``foreach_reduce``), so the optimizer sees a bf16 gradient shard, as one process sees
  the bf16 gradient autograd leaves on a bf16 parameter (it cannot take the fp32 shard: FSDP2 casts before
  the gradient is assigned). The optimizer steps each rank's local shard (:mod:`mixprec.optim.sharded`):
  stochastic rounding is keyed by the element's global index (the shard's first row × row size), Kahan
  compensation and 16-bit moments are DTensors of the parameter's placements (saved sharded by DCP).

  A block's first positional input (its hidden state) is cast to ``param_dtype``, as FSDP's
  ``cast_forward_inputs`` would; FSDP's own input cast is off, so every other input (a RoPE table,
  an additive mask, keyword arguments, the root's inputs) keeps its dtype, as in one process.
  ``output_dtype`` is the policy's, on the root. Autocast stays on (``mp.autocast()``):
  FSDP casts the parameters, autocast still picks each op's dtype (fp32 for softmax, losses
  and the other ops on its fp32 list; keep_fp32 regions switch it off). Unlike autocast alone,
  ops outside autocast's lists (residual adds, norms in some builds) then also run in the
  compute dtype, as in any FSDP ``param_dtype=bf16`` setup. Gradients: reduce-scattered in
  fp32, also on accumulation micro-batches (``set_requires_gradient_sync(False)``: FSDP then
  accumulates the unsharded gradients in fp32 and reduce-scatters them at the boundary).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.nested_ddp import refuse_outer_ddp
from mixprec.distributed.sharded_storage import cast_for_sharding, stores_16bit
from mixprec.policy.policy import Policy

__all__ = ["STRATEGIES", "check_strategy", "wrap_model", "set_gradient_sync", "local_tensors", "gradient_reduce_dtypes",
           "check_fsdp_policy", "CastHiddenState"]

STRATEGIES = ("ddp", "fsdp2")
_REDUCE_DTYPE = torch.float32   # every gradient collective, every policy (none asks otherwise)


def check_strategy(strategy: str | None) -> None:
    """Raise ValueError unless ``strategy`` is None or one of :data:`STRATEGIES`."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not allowed; choose None (one process) or one of {STRATEGIES}")


# ---------------------------------------------------------------------- what the gradient collectives saw
@dataclass
class _ReduceRecord:
    """The dtypes gradient collectives of one wrapped model ran in; refuses any but ``expected``."""

    expected: torch.dtype
    seen: set = field(default_factory=set)

    def saw(self, dtype: torch.dtype, where: str) -> None:
        self.seen.add(dtype)
        if dtype != self.expected:
            raise RuntimeError(f"mixprec: a gradient {where} ran in {dtype}, not {self.expected}: the reduction "
                               "precision differs from the one set at wrap time; report this with "
                               "the model and policy")


_RECORDS: "weakref.WeakKeyDictionary[nn.Module, _ReduceRecord]" = weakref.WeakKeyDictionary()


def gradient_reduce_dtypes(model: nn.Module) -> frozenset[torch.dtype]:
    """The dtypes the gradient collectives of a model returned by :func:`wrap_model` have run in
    so far (empty before the first reduction): ``{torch.float32}`` for every policy."""
    record = _RECORDS.get(model)
    return frozenset() if record is None else frozenset(record.seen)


def _fp32_allreduce_hook(record, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP comm hook: average the bucket over ranks in fp32, write it back into the bucket;
    returns a future of the bucket (``dist.GradBucket`` → ``Future[Tensor]``)."""
    buffer = bucket.buffer()
    grad_fp32 = buffer.to(torch.float32) / dist.get_world_size()  # a new tensor (the bucket is untouched)
    record.saw(grad_fp32.dtype, "all-reduce")
    fut = dist.all_reduce(grad_fp32, async_op=True).get_future()

    def write_back(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])  # one rounding where the bucket is 16-bit
        return buffer

    return fut.then(write_back)


try:  # the FSDP2 custom-collective interface (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older torch: the reduce dtype is then only checked at setup
    _ReduceScatter = None  # type: ignore[assignment,misc]

if _ReduceScatter is not None:
    class _CheckedReduceScatter(_ReduceScatter):  # type: ignore[misc,valid-type]
        """FSDP2's default reduce-scatter, recording (and checking) the dtype it reduces in."""

        def __init__(self, record: _ReduceRecord) -> None:
            self.record = record

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False):
            self.record.saw(input_tensor.dtype, "reduce-scatter")
            return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                              async_op=async_op)


# ---------------------------------------------------------------------- wrapping
def _fsdp_param_dtype(policy: Policy, *, sharded_found_inf: bool) -> torch.dtype | None:
    """The FSDP2 ``param_dtype`` for ``policy`` (None: fp32), or ValueError (module docstring table)."""
    half = policy.compute_dtype if policy.compute_dtype != torch.float32 else None
    if half == torch.float16 and not sharded_found_inf:
        raise ValueError(f"policy {policy} computes in fp16 under FSDP2: each rank only sees its shard of the "
                         "gradients, so a local overflow check lets other ranks step on inf/NaN or underflow "
                         "silently. Use MixedPrecision(..., strategy='fsdp2'), which ORs the found-inf "
                         "flag across ranks, or pass sharded_found_inf=True if your loop does that itself")
    if stores_16bit(policy) or policy.block is not None:   # 16-bit storage: the stored dtype; block: fp32
        return None
    return half


def check_fsdp_policy(policy: Policy, *, sharded_found_inf: bool = True) -> None:
    """Raise ValueError (named, with the fix) if FSDP2 cannot run ``policy``: fp16 compute without the cross-rank
    found-inf check. Nothing is changed. (8-bit optimizer state runs: :mod:`mixprec.optim.sharded_blocks`.)"""
    _fsdp_param_dtype(policy, sharded_found_inf=sharded_found_inf)


class CastHiddenState:
    """A block's forward pre-hook under FSDP2: its first positional input (the hidden state) in the
    all-gather dtype, as FSDP's ``cast_forward_inputs`` would; every other input (a RoPE table, a mask,
    keyword arguments) keeps its dtype, as in one process. Picklable."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point() and args[0].dtype != self.dtype:
            return (args[0].to(self.dtype), *args[1:]), kwargs
        return None


def _default_blocks(model: nn.Module) -> list[str]:
    return [f"{name}.{i}" for name, child in model.named_children() if isinstance(child, nn.ModuleList)
            for i in range(len(child))]


def wrap_model(model: nn.Module, policy: Policy, strategy: str, device: torch.device, *,
               block_filter: Callable[[str, nn.Module], bool] | None = None, keep_fp32: Iterable[str] = (),
               optimizer: torch.optim.Optimizer | None = None, sharded_found_inf: bool = False) -> nn.Module:
    """Wrap ``model`` (already on ``device``, in the process group) for ``strategy``.

    ``"ddp"``: returns ``DistributedDataParallel(model)`` with the fp32 all-reduce comm hook;
    call it after the policy's casts (DDP builds its buckets from the parameters' dtypes).
    ``"fsdp2"``: applies ``fully_shard`` in place (module docstring: which modules, which
    ``MixedPrecisionPolicy``) and returns ``model``. ``block_filter(name, module)`` picks the
    blocks (default: every element of each direct child ``nn.ModuleList``); ``keep_fp32``
    names modules sharded on their own with fp32 params. ``fully_shard`` replaces every
    parameter by a sharded DTensor parameter: ``optimizer`` (built on the old ones, no state
    yet) is pointed at the new ones. fp16 compute is refused unless ``sharded_found_inf`` says
    the caller ORs the found-inf flag across ranks (the engine does).

    Every gradient collective then runs in fp32 (:func:`gradient_reduce_dtypes` reports it,
    and a collective in another dtype raises RuntimeError).

    Raises:
        ValueError: an unknown strategy; a policy the strategy cannot run (named, with the fix);
            a ``keep_fp32`` name that is not a submodule; an optimizer that already has state.
    """
    check_strategy(strategy)
    if strategy is None:
        raise ValueError("wrap_model needs strategy='ddp' or 'fsdp2'; with strategy=None use the model as it is")
    record = _ReduceRecord(expected=_REDUCE_DTYPE)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        ddp.register_comm_hook(record, _fp32_allreduce_hook)
        refuse_outer_ddp(ddp)   # mp.model wrapped again (accelerator.prepare(mp.model)): refused at its forward
        _RECORDS[ddp] = record
        return ddp

    return _shard_fsdp2(model, policy, record, block_filter=block_filter, keep_fp32=tuple(keep_fp32),
                        optimizer=optimizer, sharded_found_inf=sharded_found_inf)


def _fsdp2_blocks(model: nn.Module, block_filter: Callable[[str, nn.Module], bool] | None,
                  keep: tuple[str, ...]) -> list[str]:
    """The modules sharded as blocks (``block_filter`` or the default); raises ValueError for a ``keep`` name
    that is no submodule."""
    for name in keep:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"wrap_model: keep_fp32 name {name!r} is not a submodule of the model; names look "
                             f"like {[n for n, _ in model.named_modules() if n][:8]}") from None
    if block_filter is None:
        return _default_blocks(model)
    return [name for name, m in model.named_modules() if name and block_filter(name, m)]


def _shard_fsdp2(model: nn.Module, policy: Policy, record: _ReduceRecord, *,
                 block_filter: Callable[[str, nn.Module], bool] | None, keep_fp32: tuple[str, ...],
                 optimizer: torch.optim.Optimizer | None, sharded_found_inf: bool) -> nn.Module:
    """:func:`wrap_model`'s ``"fsdp2"``: ``fully_shard`` on the blocks, the ``keep_fp32`` modules and the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = _fsdp_param_dtype(policy, sharded_found_inf=sharded_found_inf)
    if optimizer is not None and len(optimizer.state) > 0:
        raise ValueError("wrap_model(strategy='fsdp2') replaces the parameters; build the optimizer's state after "
                         "wrapping (the optimizer already stepped)")
    blocks = _fsdp2_blocks(model, block_filter, keep_fp32)
    if stores_16bit(policy):   # no-op when the strategy cast them already (it keeps Kahan's fp32 start values)
        cast_for_sharding(model, policy, keep_fp32, keep_values=False)
    old_by_name = dict(model.named_parameters())
    # FSDP's cast_forward_inputs would cast every floating input to param_dtype, side inputs too (a RoPE
    # table, an additive mask): a block's hidden state (its first positional input) is cast, nothing else
    mp_fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=_REDUCE_DTYPE)
    mp_block = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_REDUCE_DTYPE, cast_forward_inputs=False)
    mp_root = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_REDUCE_DTYPE,
                                   output_dtype=policy.output_dtype, cast_forward_inputs=False)
    targets = {name: mp_fp32 for name in keep_fp32}
    targets.update({name: mp_block for name in blocks if name not in targets})
    for name in sorted(targets, key=lambda n: -n.count(".")):  # innermost first
        if targets[name] is mp_block and param_dtype is not None:
            model.get_submodule(name).register_forward_pre_hook(CastHiddenState(param_dtype), with_kwargs=True)
        fully_shard(model.get_submodule(name), mp_policy=targets[name])
    fully_shard(model, mp_policy=mp_root)
    if _ReduceScatter is not None:
        comm = _CheckedReduceScatter(record)
        for module in model.modules():
            if hasattr(module, "set_custom_reduce_scatter"):
                module.set_custom_reduce_scatter(comm)
    _RECORDS[model] = record
    if optimizer is not None:
        new_of = {id(old_by_name[name]): p for name, p in model.named_parameters()}
        for group in optimizer.param_groups:
            group["params"] = [new_of.get(id(p), p) for p in group["params"]]
    return model


def set_gradient_sync(model: nn.Module, strategy: str | None, enabled: bool) -> None:
    """Whether the next backward reduces gradients across ranks (False: accumulate locally).

    DDP reads the flag in ``forward`` (it is what ``DDP.no_sync()`` sets), FSDP2 in backward
    (``set_requires_gradient_sync``); the engine sets it before each micro-batch. No-op for None.
    """
    if strategy == "ddp":
        model.require_backward_grad_sync = enabled
    elif strategy == "fsdp2":
        model.set_requires_gradient_sync(enabled)


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of ``tensors`` (DTensors → their local tensors, sharing storage, so
    in-place ops write through); plain tensors pass unchanged. No communication."""
    out = []
    for t in tensors:
        to_local = getattr(t, "to_local", None)
        out.append(t.to_local() if to_local is not None else t)
    return out
