"""Training workloads: a model, its batches, its loss and its evaluation, engine-agnostic.

:func:`get_workload` resolves a spec: a built-in name (``"gpt"``, ``"digits"``) or a user
factory ``"package.module:function"`` that returns a :class:`Workload`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable

from mixprec.workloads.base import OptimizerConfig, Workload, move_batch
from mixprec.workloads.corpus import Corpus, load_corpus
from mixprec.workloads.digits import DIGITS_CONFIGS, DigitsConfig, DigitsWorkload
from mixprec.workloads.gpt import GPT, GPT_CONFIGS, GPTConfig, GPTWorkload, generate
from mixprec.workloads.lora import LoraSpec, apply_lora
from mixprec.workloads.minilm import MINILM_CONFIGS, MiniLMConfig, MiniLMWorkload

__all__ = [
    "BUILTIN_WORKLOADS",
    "Corpus",
    "DigitsConfig",
    "DigitsWorkload",
    "GPT",
    "GPTConfig",
    "GPTWorkload",
    "LoraSpec",
    "MiniLMConfig",
    "MiniLMWorkload",
    "OptimizerConfig",
    "Workload",
    "apply_lora",
    "generate",
    "get_workload",
    "load_corpus",
    "move_batch",
]

BUILTIN_WORKLOADS = ("gpt", "digits", "minilm")
LORA_WORKLOADS = ("minilm",)  # built-ins that take lora=
_SPEC_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _builtin(name: str, config: str | None, data: str | None, lora: LoraSpec | str | None) -> Workload:
    configs = {"gpt": GPT_CONFIGS, "digits": DIGITS_CONFIGS, "minilm": MINILM_CONFIGS}[name]
    if isinstance(config, str) and config not in configs:   # a name (--config): the names only, no config class
        raise ValueError(f"{name} workload: config={config!r} is unknown; choose one of {sorted(configs)}")
    if lora is not None and name not in LORA_WORKLOADS:
        raise ValueError(
            f"--lora {str(lora)!r} needs a transformers workload ({', '.join(LORA_WORKLOADS)}); the {name} "
            "workload trains its own model from scratch. Drop --lora or use --workload minilm."
        )
    if name == "minilm":
        return MiniLMWorkload(config=config or "default", data=data, lora=lora)
    if name == "gpt":
        return GPTWorkload(config=config or "baby", data=data)
    if data is not None:
        raise ValueError(
            f"digits workload: {data=} is not supported (it uses scikit-learn's bundled "
            "8x8 digits); drop --data."
        )
    return DigitsWorkload(config=config or "default")


def _import_factory(spec: str) -> Callable[..., Workload]:
    """The function ``"package.module:function"`` names, imported. ImportError (naming ``spec``) when the module
    does not import; ValueError when it has no such callable."""
    module_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise type(err)(
            f"get_workload: cannot import module {module_name!r} of {spec=}: {err}. Make sure it "
            "is importable (run from its directory or add it to PYTHONPATH).",
            name=err.name,
        ) from err
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise ValueError(
            f"get_workload: module {module_name!r} has no callable {func_name!r}; expected "
            "'package.module:function' naming a function that returns a Workload."
        )
    return factory


def get_workload(spec: str, config: str | None = None, data: str | None = None,
                 lora: LoraSpec | str | None = None) -> Workload:
    """Build the workload named by ``spec`` with an optional config name, data path and LoRA spec.

    ``spec`` is a built-in name (``"gpt"``, ``"digits"``, ``"minilm"``) or
    ``"package.module:function"``. A factory is called with the keywords ``config=``, ``data=``
    and ``lora=`` that were given (not ``None``); passing one its signature does not accept
    raises ``ValueError``. ``lora`` (a :class:`LoraSpec` or its text) is accepted by the
    ``minilm`` built-in only; for ``gpt``/``digits`` it raises ``ValueError`` naming ``--lora``.
    """
    if spec in BUILTIN_WORKLOADS:
        return _builtin(spec, config, data, lora)
    if ":" not in spec:
        raise ValueError(
            f"get_workload: {spec=} is not a built-in workload {BUILTIN_WORKLOADS} and not of "
            "the form 'package.module:function'; pick a built-in or name your factory."
        )
    if not _SPEC_RE.match(spec):
        raise ValueError(
            f"get_workload: {spec=} is malformed; expected 'package.module:function', e.g. "
            "'my_project.workloads:make_workload'."
        )
    factory = _import_factory(spec)
    kwargs = {k: v for k, v in (("config", config), ("data", data), ("lora", lora)) if v is not None}
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if not takes_any and key not in params:
            raise ValueError(
                f"get_workload: {spec} does not accept {key}=, but {key}={kwargs[key]!r} was "
                f"given; drop --{key} or add a {key!r} parameter to the factory."
            )
    workload = factory(**kwargs)
    if not isinstance(workload, Workload):
        raise TypeError(
            f"get_workload: {spec} returned {type(workload).__name__}, not a "
            "mixprec.workloads.Workload; subclass Workload and return an instance."
        )
    return workload
