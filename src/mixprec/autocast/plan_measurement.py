"""One key of the op plan measured: the attention candidates timed and their saved bytes counted, on stand-ins.

:func:`measure` runs at the first call of a new key (:func:`mixprec.autocast.op_plan.choose`): each candidate of
:mod:`mixprec.autocast.attention_kernels` on random tensors of the call's shapes, dtypes and device, timed by
:func:`mixprec.autocast.kernel_timing.time_candidates` and, when a backward follows, its bytes saved for backward
per call counted (one forward). The caller's random streams, autocast state and saved-tensor hooks are left as
they were; :func:`outside_tracing` lets it run real kernels while torch.compile, a FakeTensor or another dispatch
mode traces the op, or inside a ``torch.func`` transform (:func:`traced` says when a call is traced). The plan's
rule (which candidate runs) is :mod:`mixprec.autocast.op_plan`'s. Host syncs: a device sync around each timed run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch

from mixprec.autocast.attention_kernels import CANDIDATES, offered, saved_per_call
from mixprec.autocast.kernel_timing import Timing, time_candidates

__all__ = ["measure", "traced", "outside_tracing"]


def _own_saved_tensors() -> Any:
    """Identity saved-tensor hooks; none where hooks are disabled (torch.func.grad: no caller's hooks either)."""
    if torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
        return nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def measure(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtype, grad, *, default: str,
            prefer: tuple[str, ...], keep: tuple[str, ...] = ()) -> tuple[Timing, str]:
    """Every candidate offered for this call of ``scaled_dot_product_attention`` (arguments as the op's; ``dtype``
    the autocast dtype; ``grad`` whether a backward follows) timed, with ``saved_bytes`` (candidate → bytes saved
    for backward per call; 0 without a backward, None where not offered) and ``chosen`` the speed rule's
    (``default``, ``prefer``, ``keep``: :func:`mixprec.autocast.kernel_timing.time_candidates`); and the notes: why a
    candidate is not offered (whether it may be cached: :mod:`mixprec.autocast.plan_verdict`)."""
    device = q.device
    why_not = offered(q, k, attn_mask, dtype, dropout_p=dropout_p, scale=scale)
    # the innermost saved-tensor hooks are the only ones applied: identity ones keep the stand-ins' saved tensors
    # out of the caller's (a non-reentrant checkpoint around the op counted them as its own: CheckpointError)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.autocast(device.type, enabled=False), _own_saved_tensors():
        gen = torch.Generator(device=device).manual_seed(0)

        def like(t):   # a stand-in of the same shape, dtype and device (a traced tensor has no data)
            return torch.randn(tuple(t.shape), dtype=t.dtype, device=device, generator=gen).requires_grad_(grad)
        mask = None if attn_mask is None else (
            torch.zeros if attn_mask.is_floating_point() else torch.ones)(tuple(attn_mask.shape), dtype=attn_mask.dtype,
                                                                         device=device)
        args = (like(q), like(k), like(v), mask, dropout_p, is_causal, scale, enable_gqa)

        def runner(fn: Callable) -> Callable[[], None]:
            def run() -> None:
                with torch.enable_grad() if grad else torch.no_grad():
                    out = fn(*args, dtype)
                    if grad:
                        torch.autograd.backward(out, torch.ones_like(out))
            return run
        timing = time_candidates({n: None if why_not[n] else runner(fn) for n, fn in CANDIDATES.items()},
                                 default=default, device=device, prefer=prefer, keep=keep)

        def forward(fn: Callable) -> Callable[[], Any]:
            return lambda: fn(*args, dtype)
        saved = saved_per_call({n: None if why_not[n] else forward(fn) for n, fn in CANDIDATES.items()}) if grad \
            else {n: None if why_not[n] else 0 for n in CANDIDATES}       # no backward follows: nothing is saved
    timing = dataclasses.replace(timing, saved_bytes=saved)
    return timing, "; ".join(f"{n} {w}" for n, w in why_not.items() if w)


def traced(q: torch.Tensor) -> bool:
    """Whether this call runs while torch.compile, a FakeTensor or another dispatch mode traces it."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode
    return type(q) is not torch.Tensor or torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


@contextmanager
def outside_tracing() -> Iterator[None]:
    """Real tensors while torch.compile / a dispatch mode traces (the measurement runs real kernels), and outside
    torch.func transforms (grad, vjp, vmap: the stand-ins' requires_grad_, random draws and saved-tensor hooks
    are refused inside them)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes
    with temporarily_clear_interpreter_stack(), unset_fake_temporarily(), _disable_current_modes(), \
            torch._C._DisablePythonDispatcher():
        yield
