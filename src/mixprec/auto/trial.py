"""``auto`` decided on the model: time a few training steps of each candidate policy on the model itself.

A 512^3 matmul probe (:func:`mixprec.machine.capability.probe`) says whether a device's 16-bit matmuls are fast; it
does not say whether *this model* trains faster under autocast (a small model's step is dominated by the
casts autocast adds and the ops it does not lower; on 2 CPU cores the ``tiny`` GPT ran bf16-mixed at 0.72x
fp32 although the probe called bf16 fast). :func:`choose` answers that question by measurement:

* candidates are ``-mixed`` policies and fp32 (fp32 params in every one: the same storage, so the trial
  changes no parameter): the model's forward runs under ``torch.autocast(device, dtype, enabled)`` plus
  :func:`mixprec.autocast.portable.portable_ops` and :func:`mixprec.autocast.op_plan.planned_kernels` as the
  policy's ``ops`` and ``kernels`` say (what ``mp.autocast()`` enters), then the backward of a
  scalar: ``loss_fn(output)``, else the fp32 sum of the output's floating tensors;
* ``warmup`` untimed steps per candidate, then ``blocks`` interleaved blocks (A B A B ...) of ``steps``
  timed steps each, so slow drift (another process, clock changes) hits every candidate alike; the
  median step time per candidate is compared;
* a 16-bit candidate is chosen only when it is faster than fp32 by :data:`MARGIN` (3 %), else fp32;
* the model is left as it was found (:func:`preserved`): gradients, buffers (BatchNorm running stats),
  every global random stream (torch's CPU/CUDA/MPS, numpy's, python's ``random``) and every module's
  train/eval mode;
* the result is cached in-process and on disk (``$MIXPREC_CACHE_DIR``, default ``~/.cache/mixprec``),
  (:mod:`mixprec.machine.cache`), keyed by :func:`cache_key`: device, torch version, thread count, the model's fingerprint and the batch's
  shapes and dtypes; a trial whose block medians spread more than :data:`NOISY_SPREAD` (a busy machine) is kept in
  this process only, never on disk (the op plan's and ``mixprec doctor``'s rule), and its decision says so.

Cost: ``(warmup + blocks * steps) * len(candidates)`` forward+backward steps (14 by default for two
candidates). Host syncs: one device sync before and after each timed step on CUDA/MPS; none of its own
on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.machine.cache import cache_dir, machine_key, read_json, write_json
from mixprec.machine.random_streams import forked_streams
from mixprec.machine.timing import time_calls
from mixprec.autocast.op_plan import planned_kernels
from mixprec.policy.policy import PRESETS, Policy
from mixprec.autocast.portable import portable_ops
from mixprec.policy.tree import map_tensors, tensors

__all__ = ["MARGIN", "NOISY_SPREAD", "Trial", "TrialFailed", "cache_key", "choose", "preserved", "split_batch", "time_candidates"]

MARGIN = 1.03          #: a 16-bit candidate must run at >= 1.03x fp32's speed to be chosen
NOISY_SPREAD = 1.5     #: a candidate's slowest block median over its fastest above which the trial is not cached
WARMUP, BLOCKS, STEPS = 1, 3, 2

_MEMORY: dict[str, Trial] = {}   # cache_key → the trial's result, this process


@dataclass(frozen=True)
class Trial:
    """The outcome of :func:`choose`. ``median_ms``: candidate → median step time in ms (forward +
    backward); ``ratios``: candidate → fp32's median / its median (> 1: faster than fp32)."""

    choice: str
    median_ms: dict[str, float] = field(default_factory=dict)
    blocks: int = BLOCKS
    steps: int = STEPS
    margin: float = MARGIN
    cached: bool = False
    noisy: bool = False   # its block medians spread above NOISY_SPREAD: kept in this process only

    @property
    def ratios(self) -> dict[str, float]:
        fp32 = self.median_ms["fp32"]
        return {name: fp32 / ms if ms > 0 else float("inf") for name, ms in self.median_ms.items() if name != "fp32"}

    def decision(self, device_type: str) -> str:
        """The decision in one line, e.g. ``auto → fp32: measured on this model (3 interleaved blocks of
        2 steps): bf16-mixed 0.74x fp32; fp16 is never chosen on a CPU``."""
        measured = ", ".join(f"{name} {ratio:.2f}x fp32" for name, ratio in self.ratios.items())
        why = (f"needs >= {self.margin:.2f}x" if self.choice == "fp32" else f"faster than fp32 by >= {self.margin:.2f}x")
        text = (f"auto → {self.choice}: measured on this model ({self.blocks} interleaved blocks of {self.steps} "
                f"steps{', cached' if self.cached else ''}"
                f"{', noisy: a busy machine, not cached' if self.noisy else ''}): {measured} ({why})")
        return text + ("; fp16 is never chosen on a CPU" if device_type == "cpu" else "")


class TrialFailed(RuntimeError):
    """The model's forward or backward raised under one candidate of the trial (``candidate``; ``error``, the
    exception, is also the ``__cause__``): whatever its type, the model cannot run that candidate here. Its
    message is ``"<error type>: <error>"``."""

    def __init__(self, candidate: str, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.candidate, self.error = candidate, error


def _guarded(candidate: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as err:   # any type: a ValueError from the model is not "nothing to backpropagate"
        raise TrialFailed(candidate, err) from err


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def split_batch(example_batch: Any) -> tuple[tuple, dict]:
    """How :func:`mixprec.policy.resolve.resolve` calls the model on ``example_batch``: a tuple is the positional
    arguments (``model(*batch)``), a dict the keyword arguments (``model(**batch)``), anything else the one
    argument (``model(batch)``)."""
    if isinstance(example_batch, tuple) and not hasattr(example_batch, "_fields"):
        return example_batch, {}
    if type(example_batch) is dict:
        return (), dict(example_batch)
    return (example_batch,), {}


def _describe_leaf(x: Any) -> str:
    if isinstance(x, (bool, int, float, str, type(None))) and len(repr(x)) <= 64:
        return repr(x)
    return type(x).__qualname__


def cache_key(model: nn.Module, args: tuple, kwargs: dict, device: torch.device,
              candidates: tuple[str, ...], loss_fn: Callable | None = None) -> str:
    """A 20-hex-digit key for a trial: device (and GPU name), torch version, thread count, the model's
    fingerprint (param and buffer names, shapes, dtypes, requires_grad; module class names; train/eval
    mode), the batch's tensor shapes, dtypes and devices (small scalar arguments by value, other leaves by
    type), ``loss_fn``'s name, the candidates and the trial's size. No host sync."""
    parts = {
        "device": str(device), "machine": machine_key(device),   # device name, torch version, threads
        "params": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "modules": [f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()],
        "training": [m.training for m in model.modules()],
        "batch": repr(map_tensors((args, kwargs), lambda t: (tuple(t.shape), str(t.dtype), str(t.device)),
                                  leaf=_describe_leaf)),
        "loss_fn": None if loss_fn is None else getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__),
        "candidates": list(candidates), "trial": [WARMUP, BLOCKS, STEPS, MARGIN],
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


@contextmanager
def preserved(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside, the model's gradients are None; on exit everything a training step touches is as it was:
    each param's ``.grad`` (the same tensor, or None), each buffer (the same tensor object, its values
    copied back: BatchNorm running stats and counters), each module's ``training`` flag, and every global
    random stream (:func:`mixprec.machine.random_streams.forked_streams`: torch's CPU, CUDA and MPS ones,
    numpy's and python's). The params themselves are not written by a forward and backward. No host sync (the
    buffer copies are device copies)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
               if b is not None]
    modes = [(m, m.training) for m in model.modules()]
    for p in params:
        p.grad = None
    try:
        with forked_streams(device):
            yield
    finally:
        with torch.no_grad():
            for m, name, b, saved in buffers:
                b.copy_(saved)
                m._buffers[name] = b
        for p, g in zip(params, grads):
            p.grad = g
        for m, mode in modes:
            m.training = mode
        torch.clear_autocast_cache()


def _scalar(output: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn returned {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}; "
                             "it must return a scalar tensor (reduce it with .mean())")
        return loss.float()
    floats = [t.float().sum() for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError(f"the model's output ({type(output).__name__}) holds no floating tensor that requires grad, "
                         "so auto has nothing to backpropagate; pass loss_fn=lambda out: ... returning a scalar loss")
    return torch.stack(floats).sum()


def _plain_mixed(policy: Policy) -> bool:
    """fp32 params under 16-bit autocast, linears in the compute dtype: what ``auto`` may time."""
    return policy.is_mixed and policy.param_dtype == torch.float32 and policy.fp8 is None and policy.block is None


def _candidate_policies(candidates: tuple[str, ...]) -> dict[str, Policy]:
    """Each candidate's preset. ValueError for one that is not fp32 or a ``-mixed`` preset (fp32 params, no fp8 or
    block-scaled linears: their emulated speed says nothing of a native run)."""
    policies = {}
    for name in candidates:
        policy = PRESETS.get(name)
        if policy is None or not (name == "fp32" or _plain_mixed(policy)):
            raise ValueError(f"auto trial candidate {name!r} must be 'fp32' or a '-mixed' preset "
                             f"({[n for n, p in PRESETS.items() if _plain_mixed(p)]})")
        policies[name] = policy
    return policies


def time_candidates(model: nn.Module, args: tuple, kwargs: dict, device: torch.device, candidates: tuple[str, ...], *,
                    loss_fn: Callable | None = None, timer: Callable[[], float] = time.perf_counter,
                    warmup: int = WARMUP, blocks: int = BLOCKS, steps: int = STEPS) -> dict[str, list[float]]:
    """Step times in ms per candidate (``blocks * steps`` each, interleaved A B A B after ``warmup`` untimed
    steps per candidate) of ``model(*args, **kwargs)`` under the candidate's autocast and portable ops,
    then the backward of :func:`choose`'s scalar into the params that require grad (the inputs are detached:
    nothing flows into the caller's graph). ``candidates``: preset
    names of ``-mixed`` policies or ``"fp32"``. ``timer``: seconds (injectable for tests). The model is left
    as found (:func:`preserved`); a profiler session of the caller's shows the passes inside one range,
    ``mixprec: auto trial (fp32 vs bf16-mixed)``. Host syncs: around each timed step on CUDA/MPS.

    Raises:
        ValueError: a candidate that is not fp32 or a ``-mixed`` preset; an output with nothing to
            backpropagate (pass ``loss_fn``).
        TrialFailed: the model's forward or backward raised (any exception type) under a candidate.
    """
    policies = _candidate_policies(candidates)
    trainable = [p for p in model.parameters() if p.requires_grad]
    args, kwargs = map_tensors((args, kwargs), lambda t: t.detach())   # never backpropagate into the caller's graph

    def step(name: str) -> None:
        policy = policies[name]
        # the backward too inside the ops and kernels (not autocast), as mp.backward(): a torch.utils.checkpoint
        # recompute in it casts and chooses as its forward (else CheckpointError, and the trial "failed": fp32)
        with portable_ops(device.type, enabled=policy.ops == "portable"), \
                planned_kernels(device.type, enabled=policy.kernels == "measured"):
            with torch.autocast(device.type, dtype=policy.compute_dtype, enabled=policy.is_mixed):
                loss = _scalar(_guarded(name, model, *args, **kwargs), loss_fn)
            if trainable and loss.requires_grad:
                _guarded(name, torch.autograd.backward, loss, inputs=trainable)
        for p in trainable:
            p.grad = None

    times: dict[str, list[float]] = {name: [] for name in candidates}
    # identity saved-tensor hooks (the innermost are the only ones applied): a checkpoint or offload around the
    # forward that runs the trial sees none of its tensors (a non-reentrant checkpoint raised CheckpointError)
    with preserved(model, device), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
            torch.profiler.record_function(f"mixprec: auto trial ({' vs '.join(candidates)})"):   # named in a trace
        for _ in range(warmup):
            for name in candidates:
                step(name)
        for _ in range(blocks):
            for name in candidates:
                times[name] += [s * 1e3 for s in time_calls(partial(step, name), device, steps, clock=timer)]
    return times


def _block_spread(times: dict[str, list[float]], steps: int = STEPS) -> float:
    """The largest, over the candidates, of the slowest block's median step time over the fastest block's."""
    spreads = []
    for ts in times.values():
        medians = [statistics.median(ts[i:i + steps]) for i in range(0, len(ts), steps)]
        spreads.append(max(medians) / min(medians) if min(medians) > 0 else float("inf"))
    return max(spreads, default=1.0)


def _disk_path(key: str) -> Path:
    return cache_dir() / f"auto-trial-{key}.json"


def choose(model: nn.Module, args: tuple, kwargs: dict, device: torch.device, candidates: tuple[str, ...], *,
           loss_fn: Callable | None = None, timer: Callable[[], float] | None = None, cache: bool = True) -> Trial:
    """The fastest candidate on this model (module docstring): fp32 unless a 16-bit candidate's median step
    is faster than fp32's by :data:`MARGIN`. ``candidates`` must include ``"fp32"``. ``cache``: read and
    write the in-process and disk caches (an injected ``timer`` never does). Host syncs: those of
    :func:`time_candidates` on a cache miss.

    Raises:
        ValueError: ``candidates`` without ``"fp32"``; see :func:`time_candidates`.
    """
    if "fp32" not in candidates:
        raise ValueError(f"choose: candidates={candidates!r} must include 'fp32', the reference")
    use_cache = cache and timer is None
    key = cache_key(model, args, kwargs, device, candidates, loss_fn) if use_cache else ""
    if use_cache and key in _MEMORY:
        return _MEMORY[key]
    saved = read_json(_disk_path(key)) if use_cache else {}
    median = saved.get("median_ms")
    usable = (isinstance(median, dict) and set(median) == set(candidates)   # else: an edited or foreign file
              and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in median.values()))
    if usable and saved.get("choice") in candidates:
        _MEMORY[key] = trial = Trial(choice=saved["choice"], median_ms=dict(saved["median_ms"]), cached=True)
        return trial
    times = time_candidates(model, args, kwargs, device, candidates, loss_fn=loss_fn,
                            timer=timer or time.perf_counter)
    median_ms = {name: statistics.median(ts) for name, ts in times.items()}
    fastest = min((n for n in candidates if n != "fp32"), key=lambda n: median_ms[n], default="fp32")
    choice = fastest if fastest != "fp32" and median_ms["fp32"] >= MARGIN * median_ms[fastest] else "fp32"
    trial = Trial(choice=choice, median_ms=median_ms, noisy=_block_spread(times) > NOISY_SPREAD)
    if use_cache:
        _MEMORY[key] = trial
        if not trial.noisy:
            write_json(_disk_path(key), {"choice": choice, "median_ms": median_ms})
    return trial
