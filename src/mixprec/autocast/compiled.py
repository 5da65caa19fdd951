"""Compiling a prepared model under a policy: ``torch.compile`` with eager's dtypes.

:func:`compile_request` reads ``MixedPrecision(..., compile=...)`` (``False``, ``True`` or a dict of
``torch.compile`` keyword arguments) and a model the user compiled already (``torch.compile`` returns
an ``OptimizedModule``; the engine prepares the module inside it, ``_orig_mod``, since torch 2.13
exposes no public unwrap; or ``model.compile()``, which compiles in place and is recorded). The :class:`CompileRequest` it returns compiles the prepared model once
the params are cast and the regions installed (:meth:`CompileRequest.apply`), and says what it did in
the engine's decision (:meth:`CompileRequest.note`).

:func:`eager_dtypes` is the context ``mp.autocast()`` enters, so that any forward compiled inside it
(the engine's, or ``torch.compile(mp.model)`` by the user) gets the backward eager would run:

* ``torch._functorch.config.backward_pass_autocast = "off"``. torch 2.13 defaults to
  ``"same_as_forward"``: the compiled backward is traced under the forward's autocast state, as if
  ``loss.backward()`` ran inside ``with autocast():``, so a layer the model runs with autocast off
  (an fp32 region, a ``torch.autocast(enabled=False)`` block) gets a 16-bit backward. The engine's
  loop calls ``mp.backward(loss)`` after the ``with mp.autocast():`` block, where eager's backward
  runs each op in the dtypes its forward saw: that is ``"off"``.
* fp16 compute: inductor's ``emulate_precision_casts = True`` (it keeps the fp16 roundings eager
  makes between fused ops, where inductor would keep fp32 intermediates that do not overflow), and
  ``torch._functorch.config.force_non_lazy_backward_lowering = True`` so the backward is compiled
  with the forward, under this same setting, instead of lazily at the first backward outside it.

A function compiled around ``mp.autocast()`` (``torch.compile(step)`` with the ``with`` block inside) does not
enter this context: its backward is traced after the block, under the caller's autocast state, which is eager's;
under fp16 the engine keeps the eager path there (a graph break at ``mp.autocast()``), so that the body compiles
inside this context with ``emulate_precision_casts`` (:mod:`mixprec.engine.autocast_scope`).

A ``torch.compile`` option the user passes (``options={"emulate_precision_casts": ...}``) wins over
ours and is named in the decision. The settings are patched only while ``torch._dynamo`` is loaded
(no compiled model can exist before), so an eager run imports nothing. Shapes, dtypes and host syncs
are those of the uncompiled model: compilation changes none of them, it runs on the first call and
again for each recompilation (new shapes, dtypes or autocast state), see the ``torch.compile`` docs.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.policy.policy import Policy

__all__ = ["CompileRequest", "compile_request", "eager_dtypes", "is_compiled_module"]

# the settings eager_dtypes pins, and why (the decision names them)
BACKWARD_AUTOCAST = "off"


def is_compiled_module(model: Any) -> bool:
    """True for what ``torch.compile(module)`` returns (torch's ``OptimizedModule``, holding ``_orig_mod``)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")   # not loaded: nothing was compiled
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def _compile_parameters() -> tuple[str, ...]:
    return tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def _backend_name(backend: Any) -> str:
    if isinstance(backend, str):
        return backend
    return getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or type(backend).__name__


def _user_backend(model: nn.Module) -> str:
    """The backend name of a user's ``OptimizedModule`` (read from torch's private wrapper; 'unknown' if absent)."""
    from torch._dynamo.eval_frame import innermost_backend

    callback = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    return _backend_name(innermost_backend(callback)) if callback is not None else "unknown"


@dataclass(frozen=True)
class CompileRequest:
    """What the engine compiles: ``kwargs`` for ``torch.compile`` when it compiles itself (None: it does
    not), or ``user_compiled``, the user's compiled model, to keep as ``mp.model``."""

    kwargs: dict[str, Any] | None = None
    user_compiled: nn.Module | None = field(default=None, repr=False)
    backend: str = ""
    compiled_in_place: bool = False   # the user called ``model.compile()`` (nn.Module's in-place compile) first

    @property
    def active(self) -> bool:
        return self.kwargs is not None or self.user_compiled is not None or self.compiled_in_place

    def apply(self, model: nn.Module) -> nn.Module:
        """What users call (``mp.model``): ``torch.compile(model, **kwargs)``, the user's compiled model
        (it holds the module the engine prepared in place), or ``model`` itself. Compiles nothing yet:
        torch compiles at the first call (inside ``mp.autocast()``)."""
        if self.kwargs is not None:
            return torch.compile(model, **self.kwargs)
        return self.user_compiled if self.user_compiled is not None else model

    def note(self, policy: Policy) -> str:
        """The decision's words for this request under ``policy`` ("" when nothing is compiled)."""
        if not self.active:
            return ""
        who = ("by the engine" if self.kwargs is not None else "by you (model.compile() before MixedPrecision)"
               if self.compiled_in_place else "by you (torch.compile before MixedPrecision)")
        text = (f"; compiled (backend {self.backend}, {who}; in mp.autocast() the compiled backward is traced with "
                f"autocast off as eager's backward after the with block: torch._functorch.config."
                f"backward_pass_autocast={BACKWARD_AUTOCAST!r}")
        if policy.compute_dtype == torch.float16:
            options = (self.kwargs or {}).get("options") or {}
            if "emulate_precision_casts" in options:
                text += (f"; inductor emulate_precision_casts={options['emulate_precision_casts']!r} as you passed "
                         "in options")
            else:
                text += ("; fp16: inductor emulate_precision_casts=True so fused kernels round to fp16 where eager "
                         "does and overflow as eager, backward compiled with the forward")
        return text + ")"


def _check_options(kwargs: dict[str, Any]) -> None:
    """ValueError for ``torch.compile`` options it refuses (an unknown backend or mode, ``mode`` with
    ``options``): ``torch.compile`` of a stand-in module checks them when called, compiling nothing until a
    forward, so a bad option is refused before the engine changes the model."""
    try:
        torch.compile(nn.Identity(), **kwargs)
    except Exception as error:   # noqa: BLE001 - torch raises its own types (InvalidBackend, RuntimeError)
        raise ValueError(f"compile={kwargs!r}: torch.compile refuses it ({type(error).__name__}: {error}); e.g. "
                         "compile={'backend': 'inductor', 'mode': 'max-autotune'}") from error


def compile_request(model: nn.Module, compile: Any, strategy: str | None) -> tuple[nn.Module, CompileRequest]:
    """Read ``MixedPrecision``'s ``compile`` argument for ``model``; returns the module to prepare (the
    user's module, ``_orig_mod`` of a compiled one) and the :class:`CompileRequest`.

    Raises:
        TypeError: ``compile`` is not a bool or a dict.
        ValueError: a dict key that ``torch.compile`` does not take, or a value it refuses; a compiled model with
            ``compile=`` set (it would compile twice); compiling under a ``strategy`` (not supported).
    """
    if isinstance(compile, bool):
        kwargs = {} if compile else None
    elif isinstance(compile, dict):
        allowed = _compile_parameters()
        unknown = sorted(str(k) for k in compile if k not in allowed)
        if unknown:
            raise ValueError(f"compile={compile!r}: {unknown} are not torch.compile arguments; it takes {list(allowed)}, "
                             "e.g. compile={'backend': 'inductor', 'mode': 'max-autotune'}")
        kwargs = dict(compile)
        _check_options(kwargs)
    else:
        raise TypeError(f"compile={compile!r} ({type(compile).__name__}) must be False, True or a dict of "
                        "torch.compile keyword arguments, e.g. compile={'mode': 'reduce-overhead'}")
    user_compiled = model if is_compiled_module(model) else None
    in_place = getattr(model, "_compiled_call_impl", None) is not None   # nn.Module.compile() (torch's own field)
    if (user_compiled is not None or in_place) and kwargs is not None:
        raise ValueError(f"compile={compile!r} but the model is already compiled (torch.compile returned an "
                         "OptimizedModule); pass the plain model with compile=..., or the compiled one with compile=False")
    if strategy is not None and (kwargs is not None or user_compiled is not None or in_place):
        raise ValueError(f"compile={compile!r} (or a compiled model) with strategy={strategy!r}: mixprec does not "
                         "compile a DDP/FSDP2-wrapped model yet; pass the plain model and compile=False")
    if user_compiled is not None:
        return user_compiled._orig_mod, CompileRequest(user_compiled=user_compiled, backend=_user_backend(model))
    if kwargs is None:
        return model, CompileRequest(compiled_in_place=in_place, backend="as you chose" if in_place else "")
    return model, CompileRequest(kwargs=kwargs, backend=_backend_name(kwargs.get("backend", "inductor")))


@contextmanager
def eager_dtypes(policy: Policy) -> Iterator[None]:
    """Pin the compile settings that give a forward compiled in this context eager's dtypes (module
    docstring). A no-op while ``torch._dynamo`` is not loaded; no host sync."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    import torch._functorch.config as functorch_config

    with ExitStack() as stack:
        stack.enter_context(functorch_config.patch(backward_pass_autocast=BACKWARD_AUTOCAST))
        if policy.compute_dtype == torch.float16:
            import torch._inductor.config as inductor_config

            stack.enter_context(functorch_config.patch(force_non_lazy_backward_lowering=True))
            stack.enter_context(inductor_config.patch(emulate_precision_casts=True))
        yield
