"""The measured op plan: an op with several kernels runs, under autocast, in the one measured fastest here.

Which kernel is fastest for an op depends on the device, the dtype and the shape, and no fixed rule gets it
right everywhere. Measured on a 2-core Xeon (AMX, torch 2.13), forward + backward of causal
``scaled_dot_product_attention``: at B16·H4·T128·D64 torch's fused CPU kernel takes 10.5 ms in bf16, 4.4 ms
in fp32 and 4.8 ms as bf16 matmuls with an fp32 softmax; at B64·H6·T256·D64 the fused kernel takes 104 ms in
either dtype and the matmul form 277 ms. Under ``kernels=measured`` (every policy's default),
``mp.autocast()`` enters :func:`planned_kernels`, and each planned op runs as :func:`choose` says for its key;
``kernels=native`` runs what ``torch.autocast`` runs.

Planned op: ``scaled_dot_product_attention`` (autocast dtype bf16 or fp16); its candidates, ``fused``
(torch.autocast's kernel: the default), ``fused-fp32``, ``matmul`` (Hugging Face's "eager" form, bf16 only,
no ``attn_mask``, fp32 scores under :data:`MATMUL_SCORES_LIMIT`) and ``blockwise`` (the fused CPU forward, a
backward recomputing the probabilities block by block: saves what ``fused`` saves), are in
:mod:`mixprec.autocast.attention_kernels`. Softmax statistics are fp32 in all four, and each returns the
autocast dtype, so what follows the op sees the same dtypes whatever was chosen.

The rule: ``fused`` unless another candidate is at least :data:`MARGIN` faster (ties within :data:`MARGIN` of
the fastest go to the more exact), among the candidates that save no more bytes for backward per call than
``fused`` plus the allowance (:mod:`mixprec.autocast.saved_allowance`: +0 MiB unless :func:`allow_extra_saved`
or ``$MIXPREC_ATTENTION_EXTRA_SAVED_MIB`` allow more): a faster kernel does not erase the memory mixed precision
saves unless the user says so. Each candidate's saved bytes are measured with its time (one forward under
:class:`mixprec.memory.saved.SavedTensorCounter`, no backward) and kept in the entry (``saved_bytes``,
``memory``: "matmul skipped: 1.31x faster than fused, +144 MiB saved per call over fused ...").

The key is the op, the shapes of q, k, v, the autocast dtype, ``is_causal``, the mask's dtype and shape,
whether dropout is on, whether ``scale`` is given, ``enable_gqa``, and whether a backward will follow (grad
mode and ``requires_grad``). At the first call with a new key, each candidate is timed on random tensors of
those shapes (:mod:`mixprec.autocast.plan_measurement`; inside :func:`torch.random.fork_rng` with its own generator, so the caller's random stream is
untouched; under identity saved-tensor hooks, so a checkpoint or offload around the op sees none of its
tensors) by :func:`time_candidates` (:mod:`mixprec.autocast.kernel_timing`): one warm-up each, then the best of :data:`REPEATS` interleaved
forward (+ backward) rounds (a candidate over 3x the fastest in two warm-ups is dropped; never the cached choice). Host syncs: at measurement only (a device sync around each run:
:func:`mixprec.machine.timing.time_call`). The plan is cached per process and on disk by machine
(:func:`mixprec.machine.cache.machine_key`: device name, torch version, thread count) and key, so a second run of
the same model measures nothing and chooses the same. A measurement noise could have decided (the verdict of
:mod:`mixprec.autocast.plan_verdict`) is not cached: used in this process only, or the cached entry kept. An entry keeps its
rounds: re-chosen under another allowance, it runs what they agree on, else its measured choice or ``fused``. While torch.compile, a FakeTensor or
another dispatch mode traces the op, the measurement runs on real stand-ins of the traced shapes (outside
the modes) and the graph keeps the chosen kernel; with symbolic shapes nothing is measured (``fused``, and
the entry says so). :func:`entries` lists what was chosen in this process (op, shape, choice, every candidate's
time): the engine's decision names the mechanism, the bench's report.md prints the table. :func:`measured_afresh`
measures every key again (the bench's one plan, pinned for all its workers: :mod:`mixprec.programs.bench.
pinned_plan`); :func:`retarget` moves choices to another dtype's keys; :func:`rechosen` re-applies the rule.
Under a strategy every rank runs rank 0's choice: a key measured here runs ``fused`` until the ranks agree at the
next boundary (:mod:`mixprec.autocast.plan_agreement`, :func:`unagreed`).

Activation checkpointing: a recompute must run the kernel its forward ran. :func:`mixprec.ops.checkpoint`
re-enters the forward's planned state; a backward pass of ``mp.backward()``, ``mp.scale_loss()`` or of any
output of a training forward holds the engine's op lists for that pass (:mod:`mixprec.engine.autocast_scope`,
whatever thread autograd runs it in), so a ``torch.utils.checkpoint`` recompute there is planned; and a call
during a backward takes its key's last choice whatever the allowance there (an engine's own is per thread), or
if none its grad-twin's (a reentrant checkpoint's forward ran under no_grad: ``fwd``; its recompute ``fwd+bwd``).

Under a ``torch.func`` transform (``grad``, ``vmap``) a key whose choice is ``blockwise`` runs ``fused``: blockwise's
autograd function cannot run from the autocast key there (torch raised), and its forward is fused's own kernel (the
same output; the gradients are fused's backward's).

Mechanism: a ``torch.library`` kernel for the op on the device's autocast key (``AutocastCPU``,
``AutocastCUDA``), replacing torch's C++ one (a lower-precision cast, checked to exist by the tests) the
first time a ``kernels=measured`` engine enters autocast on that device. On MPS nothing is planned. Outside :func:`planned_kernels` it does what torch's kernel does (cast the
floating inputs to the autocast dtype and run the op with autocast off).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable

import torch

from mixprec.autocast.plan_agreement import pending, running
from mixprec.autocast.plan_entry import PlanEntry, usable_cached
from mixprec.autocast.attention_kernels import CANDIDATES, MATMUL_SCORES_LIMIT, NOT_FP16
from mixprec.autocast.kernel_timing import MARGIN, NOISY_SPREAD, REPEATS, Timing, speed_choice, time_candidates
from mixprec.autocast.plan_measurement import measure, outside_tracing, traced
from mixprec.autocast.plan_verdict import agreed_times, verdict
from mixprec.autocast.saved_allowance import (allow_extra_saved, count_call, extra_saved_allowed, memory_choice,
                                              mib_words)
from mixprec.autocast.switch import Switch
from mixprec.machine.cache import cache_dir, machine_key, read_json, write_json

__all__ = ["PlanEntry", "planned_kernels", "choose", "entries", "summary", "choices", "pin", "retarget", "measured_afresh",
           "cached", "forget", "time_candidates", "describe", "MARGIN",
           "REPEATS", "MATMUL_SCORES_LIMIT", "NOISY_SPREAD", "Timing", "CANDIDATES", "plan_key",
           "planned_devices", "planned_as", "allow_extra_saved", "extra_saved_allowed", "rechosen", "unagreed"]

_DEFAULT = "fused"
_TRACED = "default (traced, not measured)"
_NOISY = "measured (noisy: this process only, not cached)"
_EXACTNESS = ("fused-fp32", "fused", "blockwise", "matmul")   # most exact first (tests/autocast/test_blockwise_attention.py)
# where torch's autocast has its own sdpa kernel (lower precision) for this one to replace; MPS: not planned
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


_lock = threading.Lock()
_libraries: dict[str, torch.library.Library] = {}
_plans: dict[tuple[str, int], dict[str, PlanEntry]] = {}   # (device type, threads) -> key -> entry (this process)
_disk: dict[tuple[str, int], dict] = {}                    # the same -> what its cache file held when first read
_afresh: list[bool] = [False]                              # inside measured_afresh(): the cache file is not read


# ---------------------------------------------------------------------- keys, timing, cache
def plan_key(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
             dtype: torch.dtype, grad: bool) -> str:
    """The plan's key for a call of ``scaled_dot_product_attention`` (the words :attr:`PlanEntry.shape` holds)."""
    mask = "none" if attn_mask is None else f"{str(attn_mask.dtype)[6:]}{list(attn_mask.shape)}"
    return (f"sdpa q{list(q.shape)} k{list(k.shape)} v{list(v.shape)} {str(dtype)[6:]} causal={is_causal} "
            f"mask={mask} dropout={dropout_p > 0} scale={'given' if scale is not None else 'default'} "
            f"gqa={enable_gqa} {'fwd+bwd' if grad else 'fwd'}")


def _rule(times: dict[str, float | None], saved: dict[str, int | None],
          allowed_mib: float | None) -> tuple[str, str]:
    """The plan's choice and its memory words: the speed rule among the candidates within the allowance."""
    return memory_choice(times, saved, default=_DEFAULT, allowed_mib=allowed_mib,
                         pick=lambda t: speed_choice(t, _DEFAULT, _EXACTNESS))


def _measure(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype, grad,
             allowed_mib: float | None, keep: tuple[str, ...]) -> tuple[Timing, str]:
    """The key measured (:func:`mixprec.autocast.plan_measurement.measure`, outside any tracing; ``keep``, the cached
    choice, timed in every round) and chosen by the rule under ``allowed_mib``; and the measurement's notes."""
    with outside_tracing():
        timing, note = measure(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype, grad,
                               default=_DEFAULT, prefer=_EXACTNESS, keep=keep)
    chosen, memory = _rule(timing.times_ms, timing.saved_bytes, allowed_mib)
    return dataclasses.replace(timing, chosen=chosen, memory=memory), note


def _cache_file(device: torch.device):
    return cache_dir() / f"op-plan-{machine_key(device)}.json"


_OLD_CACHE = "measured again: its cache entry (an older mixprec's) had no saved bytes for the memory rule"


def _chosen_again(times: dict, saved: dict, rounds: dict, allowed_mib: float | None, anchor: str) -> tuple[str, str]:
    """The rule's choice and memory words under ``allowed_mib`` from a measurement (``anchor``: its own choice), where
    its rounds agree on it; else anchor or fused (:func:`mixprec.autocast.plan_verdict.agreed_times`, words added)."""
    usable, why = agreed_times(Timing(anchor, times, 1.0, rounds_ms=rounds),
                               lambda t: _rule(t, saved, allowed_mib)[0], anchor, default=_DEFAULT)
    chosen, memory = _rule(usable, saved, allowed_mib)
    return chosen, "; ".join(filter(None, [memory, why]))


def _from_cache(cached: dict, key: str, allowed_mib: float | None) -> PlanEntry:
    """A usable cache entry, chosen again under the allowance in force (its times, saved bytes and rounds)."""
    times, saved = dict(cached.get("times_ms") or {}), dict(cached.get("saved_bytes") or {})
    rounds = dict(cached.get("rounds_ms") or {})
    chosen, memory = (_chosen_again(times, saved, rounds, allowed_mib, cached["chosen"])
                      if saved and times.get(_DEFAULT) is not None else (cached["chosen"], ""))
    return PlanEntry("scaled_dot_product_attention", key, chosen, times, "cache", str(cached.get("note", "")),
                     saved, memory, allowed_mib, rounds, cached["chosen"])


def _settled(key: str, device: torch.device, where: tuple[str, int], timing: Timing, note: str,
             allowed_mib: float | None) -> PlanEntry:
    """``key``'s new measurement, judged by :func:`mixprec.autocast.plan_verdict.verdict` against the cache file's
    entry: written there when the verdict allows (the entry "measured"); else this process runs the cached
    entry where the file holds a usable one (its note saying why), or the measurement, not cached."""
    with _lock:
        on_disk = read_json(_cache_file(device))
        old = on_disk.get(key)
        usable = old if usable_cached(old, key) else None
        found = verdict(timing, lambda t: _rule(t, timing.saved_bytes, allowed_mib)[0], usable, default=_DEFAULT)
        if found.cache:
            on_disk[key] = {"chosen": timing.chosen, "times_ms": timing.times_ms, "note": note,
                            "saved_bytes": timing.saved_bytes, "rounds_ms": timing.rounds_ms}
            write_json(_cache_file(device), on_disk)
        _disk[where] = on_disk
    if found.keep_cached:
        kept = _from_cache(usable, key, allowed_mib)
        return dataclasses.replace(kept, note="; ".join(filter(None, [kept.note, found.why])))
    older = usable is None and isinstance(old, dict) and usable_cached({**old, "saved_bytes": {}}, key)
    return PlanEntry("scaled_dot_product_attention", key, timing.chosen, timing.times_ms,
                     "measured" if found.cache else _NOISY,
                     "; ".join(filter(None, [note, older * _OLD_CACHE, found.why])), timing.saved_bytes,
                     timing.memory, allowed_mib, timing.rounds_ms, timing.chosen)


def rechosen(entry: PlanEntry, allowed_mib: float | None) -> PlanEntry:
    """``entry`` chosen again from its measurement (its times and saved bytes, nothing measured) under
    ``allowed_mib`` (MiB per call over ``fused``; None: no limit) when that differs from its own (a pin or a
    default: as it is); what its rounds do not agree on runs its measured choice or ``fused`` instead, said in its
    ``memory`` (:func:`mixprec.autocast.plan_verdict.agreed_times`). No host sync."""
    if entry.extra_saved_allowed_mib == allowed_mib or not entry.saved_bytes or entry.times_ms.get(_DEFAULT) is None:
        return entry
    chosen, memory = _chosen_again(entry.times_ms, entry.saved_bytes, entry.rounds_ms, allowed_mib,
                                   entry.measured_choice or entry.chosen)
    return dataclasses.replace(entry, chosen=chosen, memory=memory, extra_saved_allowed_mib=allowed_mib)


def choose(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
           dtype: torch.dtype, grad: bool) -> PlanEntry:
    """The plan's entry for this call of ``scaled_dot_product_attention`` (arguments as the op's; ``dtype``
    the autocast dtype; ``grad`` whether a backward follows), measured at the first call with its key
    (see the module docstring for the key, the timing and the cache). Host syncs: at measurement only."""
    device = q.device
    key = plan_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype=dtype, grad=grad)
    where = (device.type, torch.get_num_threads())
    plan = _plans.setdefault(where, {})
    entry, allowed, in_backward = plan.get(key), extra_saved_allowed(), torch._C._current_graph_task_id() != -1
    if grad:
        count_call(key)   # the calls a step's budget is shared among (saved_allowance.CallCounter)
    if entry is not None and (entry.source != _TRACED or traced(q)):   # in a backward (a recompute): the forward's
        plan[key] = entry = entry if in_backward else rechosen(entry, allowed)        # choice, whatever the allowance
        return entry
    if entry is None and in_backward:
        # in a backward: a checkpoint's recompute. A reentrant one ran its forward under no_grad (the "fwd" key)
        # and recomputes with grad ("fwd+bwd"): the forward's choice, else the recompute differs from it
        twin = plan.get(plan_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype=dtype,
                                 grad=not grad))
        if twin is not None:
            return twin
    with _lock:
        if where not in _disk:
            _disk[where] = read_json(_cache_file(device))
        cached = _disk[where].get(key)
    usable = usable_cached(cached, key)
    if not _afresh[0] and usable:
        entry = _from_cache(cached, key, allowed)
    elif traced(q) and not all(isinstance(d, int) for t in (q, k, v) for d in t.shape):
        entry = PlanEntry("scaled_dot_product_attention", key, _DEFAULT, {}, _TRACED, extra_saved_allowed_mib=allowed)
    else:
        timing, note = _measure(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype, grad, allowed,
                                (cached["chosen"],) if usable else ())
        entry = _settled(key, device, where, timing, note, allowed)
    plan[key] = entry
    return entry


def entries(device_type: str | None = None, *, policy: Any = None) -> list[PlanEntry]:
    """What the plan chose in this process (every device, or ``device_type``'s), in first-use order. With
    ``policy``, only what an engine of that policy uses: none unless it autocasts with ``kernels=measured``,
    and only keys in its compute dtype (an ``auto`` trial's bf16 keys are not an fp32 run's). Each entry as it
    runs (:func:`mixprec.autocast.plan_agreement.running`: a key pending the ranks' agreement runs ``fused``)."""
    if policy is not None and not (policy.is_mixed and policy.kernels == "measured"):
        return []
    dtype = None if policy is None else f" {str(policy.compute_dtype)[6:]} "
    return [running(e) for (d, _), plan in _plans.items() if device_type in (None, d) for e in plan.values()
            if dtype is None or dtype in e.shape]


def unagreed(device_type: str) -> dict[str, str]:
    """key → this rank's own choice, for its keys on ``device_type`` pending the ranks' agreement (measured here,
    not pinned: :func:`mixprec.autocast.plan_agreement.pending`); empty in one process. No host sync."""
    return {e.shape: e.chosen for (d, _), plan in _plans.items() if d == device_type for e in plan.values()
            if pending(e)}


def summary(device_type: str | None = None, *, policy: Any = None) -> list[str]:
    """One line per entry of :func:`entries` (same arguments): the key, the choice, its source, each time (and
    bytes saved for backward per call, where any is), the memory rule's words."""
    def one(e: PlanEntry, name: str, t: float | None) -> str:
        saved = e.saved_bytes.get(name) if any(e.saved_bytes.values()) else None
        return f"{name} {'-' if t is None else f'{t:.2f} ms'}" + ("" if saved is None else f" {mib_words(saved)}")
    def why(e: PlanEntry) -> str:   # a pinned entry has no times of its own: its source alone
        return "; ".join(filter(None, [e.source, ", ".join(one(e, n, t) for n, t in e.times_ms.items()), e.memory]))
    return [f"{e.shape} -> {e.chosen} ({why(e)})" for e in entries(device_type, policy=policy)]


def choices(device_type: str, *, policy: Any = None) -> dict[str, str]:
    """key → chosen candidate, for the keys of :func:`entries` (same arguments) that were not traced defaults (a
    checkpoint saves them, so a resumed run makes the same kernel choices whatever its own cache or a new
    measurement would say)."""
    return {e.shape: e.chosen for e in entries(device_type, policy=policy) if e.source != _TRACED}


def pin(saved: dict[str, str], device_type: str, *, source: str = "checkpoint",
        notes: dict[str, str] | None = None) -> None:
    """Use ``saved`` (:func:`choices` of an earlier run, or of the bench's one measurement) for these keys in this
    process: the entries' source is ``source`` (``"checkpoint"`` for a resumed run, ``"bench"`` for a bench
    worker; the ranks' agreement: :mod:`mixprec.autocast.plan_agreement`), ``notes`` key → the entry's note; keys
    that are not planned or name an unknown candidate are ignored. No host sync."""
    plan = _plans.setdefault((device_type, torch.get_num_threads()), {})
    for key, chosen in (saved or {}).items():
        if isinstance(key, str) and key.startswith("sdpa ") and chosen in CANDIDATES:
            plan[key] = PlanEntry("scaled_dot_product_attention", key, chosen, {}, source, (notes or {}).get(key, ""))


def retarget(saved: dict[str, str], dtype: torch.dtype) -> tuple[dict[str, str], dict[str, str]]:
    """``saved`` (key -> chosen, :func:`choices`) moved to the keys of autocast ``dtype`` (bf16 or fp16: the same
    shapes and flags, another dtype), so a policy computing in ``dtype`` makes the same kernel choices. Returns
    (the moved choices, key -> why the saved choice is not offered under ``dtype``): ``matmul`` under fp16 runs
    the default, ``fused``, instead (not measured) and the second dict says so. No host sync."""
    name = str(dtype)[6:]
    moved: dict[str, str] = {}
    refused: dict[str, str] = {}
    for key, chosen in (saved or {}).items():
        head, sep, tail = key.partition(" causal=")
        new_key = f"{head.rsplit(' ', 1)[0]} {name}{sep}{tail}" if sep else key
        if chosen == "matmul" and dtype == torch.float16:
            moved[new_key] = _DEFAULT
            refused[new_key] = f"matmul {NOT_FP16}: runs {_DEFAULT}, the default (not measured at this key)"
        else:
            moved[new_key] = chosen
    return moved, refused


@contextmanager
def measured_afresh() -> Iterator[None]:
    """Inside, each key is measured again, whatever this process or the cache file holds: the process's plan is
    dropped on entry (:func:`forget`) and the cache file's choice is not used unless the new measurement may not
    replace it (:mod:`mixprec.autocast.plan_verdict`: noisy, not separating its candidates, or on a busier
    machine; the entry's note says so); a measurement that may is written to it.
    What was measured stays this process's plan after the block. Process-wide, not per thread. No host sync of
    its own (the measurements': :func:`choose`)."""
    forget()
    _afresh[0] = True
    try:
        yield
    finally:
        _afresh[0] = False


def cached(device: torch.device | str = "cpu") -> tuple[str, dict[str, dict]]:
    """This machine's cache file for ``device`` (its path) and what it holds: key → chosen, times_ms, note."""
    device = torch.device(device)
    path = _cache_file(device)
    return str(path), read_json(path)


def forget() -> None:
    """Drop this process's plan (the disk cache stays): the next call of each key reads the cache file again."""
    with _lock:
        _plans.clear()
        _disk.clear()


# ---------------------------------------------------------------------- the kernel and its switch
def _kernel(device_type: str) -> Callable:
    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False):
        dtype = torch.get_autocast_dtype(device_type)
        args = (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        name = _DEFAULT
        if _switch.is_on(device_type) and q.dtype in (dtype, torch.float32):
            grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args[:4])
            name = running(choose(*args, dtype=dtype, grad=grad)).chosen   # a pending key: fused (ranks agree)
            if name == "blockwise" and torch._C._functorch.peek_interpreter_stack() is not None:
                name = _DEFAULT   # its autograd function cannot run from this key under torch.func: fused (same forward)
        with torch.autocast(device_type, enabled=False):
            return CANDIDATES[name](*args, dtype)
    return kernel


def _install(device_type: str) -> None:
    with _lock:
        if device_type in _libraries or device_type not in _AUTOCAST_KEYS:
            return
        key_name = _AUTOCAST_KEYS[device_type]
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():   # torch warns that a kernel for this key is replaced: that is the point
            warnings.simplefilter("ignore")
            library.impl("scaled_dot_product_attention", _kernel(device_type), key_name)
        _libraries[device_type] = library


_switch = Switch(_AUTOCAST_KEYS, _install)   # the device types whose planned kernels are on in each thread


def planned_kernels(device_type: str, *, enabled: bool = True) -> AbstractContextManager[None]:
    """Inside, under ``device_type``'s autocast, each planned op runs in the kernel the plan chose for its
    key (a no-op with ``enabled=False`` or for a device type without autocast). Per thread, as autocast;
    ``mp.autocast()`` enters it for ``kernels=measured``; a hand-written loop may enter it to make the same
    choices. No host sync (except at a measurement)."""
    return _switch.turned_on(device_type, enabled=enabled)


def planned_devices() -> tuple[str, ...]:
    """The device types whose planned kernels are on in this thread (:func:`planned_kernels`) now: what
    :func:`mixprec.ops.checkpoint` captures at the forward, so that its recompute (in a backward that may run
    outside ``mp.autocast()``) makes the forward's kernel choices. No host sync."""
    return _switch.on()


def planned_as(devices: tuple[str, ...]) -> AbstractContextManager[None]:
    """Inside, exactly ``devices`` (:func:`planned_devices` of an earlier moment) have their planned kernels on
    in this thread: planned where the forward was, torch's kernel where it was not. No host sync."""
    return _switch.exactly(devices)


def describe(policy: Any, device_type: str) -> str:
    """The decision's words for ``policy.kernels`` on ``device_type`` ("" when autocast is off)."""
    if not policy.is_mixed:
        return ""
    if policy.kernels == "measured":
        allowed = extra_saved_allowed()
        limit = "whatever it saves for backward" if allowed is None else \
            f"saving for backward at most fused's bytes +{allowed:g} MiB per call (the allowance when this was " \
            "decided; the one in force at each call rules)"
        return (f"; kernels=measured (attention in the kernel measured fastest on this {device_type} per shape, "
                f"{limit}: mixprec.autocast.op_plan.entries())")
    return "; kernels=native: torch.autocast's kernels"
