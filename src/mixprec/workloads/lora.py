"""LoRA fine-tuning: a :class:`LoraSpec` parsed from ``--lora`` text, applied with ``peft``.

``LoraSpec.parse("r=8,alpha=16,targets=query,value")`` reads comma-separated ``key=value``
tokens; a token without ``=`` continues the list of the key before it, and only ``targets``
is a list. Keys: ``r`` (rank, int >= 1), ``alpha`` (scale numerator: the adapter's update
``B @ A`` is multiplied by ``alpha / r``), ``targets`` (module names, matched as peft does: a
module whose qualified name equals a target or ends with ``"." + target``) and ``dropout``
(on the adapter's input, default 0). ``str(spec)`` gives the text back, and parses to an
equal spec.

:func:`apply_lora` injects the adapters with the ``peft`` library
(``peft.inject_adapter_in_model``, so the model keeps its own class, module names and
``forward`` signature), freezes every base parameter and then unfreezes the parameters named
in ``trainable`` (e.g. a freshly initialised head). ``peft`` is an optional extra:
``pip install 'mixprec[hf]'``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = ["LoraSpec", "apply_lora", "LORA_KEYS"]

LORA_KEYS = ("r", "alpha", "targets", "dropout")
_EXAMPLE = "r=8,alpha=16,targets=query,value"
_HF_EXTRA = "pip install 'mixprec[hf]'"


@dataclass(frozen=True)
class LoraSpec:
    """Rank ``r``, scale ``alpha`` (update multiplied by ``alpha / r``), ``targets`` (module
    names) and input ``dropout`` probability of LoRA adapters (Hu et al. 2021, "LoRA"; peft's
    ``LoraConfig`` fields ``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``). See the
    module docstring for the text form.

    Raises:
        ValueError: ``r`` not an int >= 1, ``alpha`` not a finite number > 0, ``targets`` empty or
            holding an empty name, ``dropout`` outside [0, 1).
    """

    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoraSpec: r={self.r!r} must be an int >= 1 (the adapter rank), e.g. {_EXAMPLE!r}.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoraSpec: alpha={self.alpha!r} must be a finite number > 0, e.g. {_EXAMPLE!r}.")
        if not isinstance(self.targets, tuple) or not self.targets:
            raise ValueError(
                f"LoraSpec: targets={self.targets!r} must be a non-empty tuple of module names, "
                f"e.g. {_EXAMPLE!r}."
            )
        for target in self.targets:
            if not isinstance(target, str) or not target or any(c in target for c in ",= \t\n"):
                raise ValueError(
                    f"LoraSpec: target {target!r} must be a non-empty module name without ',', '=' or "
                    f"spaces, e.g. {_EXAMPLE!r}."
                )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraSpec: dropout={self.dropout!r} must lie in [0, 1).")

    @classmethod
    def parse(cls, text: str | LoraSpec) -> LoraSpec:
        """A spec from ``"r=8,alpha=16,targets=query,value[,dropout=0.1]"`` (a spec passes through).

        Raises:
            ValueError: empty text, an unknown or repeated key, a token without ``=`` that does
                not follow ``targets``, a number that does not parse, a missing ``r``, ``alpha``
                or ``targets``, or a value :class:`LoraSpec` rejects.
        """
        if isinstance(text, LoraSpec):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"--lora {text!r} is empty; give 'key=value,...' with keys {LORA_KEYS}, e.g. {_EXAMPLE!r}."
            )
        values = _key_values(text)
        missing = [k for k in ("r", "alpha", "targets") if k not in values]
        if missing:
            raise ValueError(f"--lora {text!r}: missing {missing}; give r, alpha and targets, e.g. {_EXAMPLE!r}.")

        def number(name: str, kind: type):
            (raw,) = values[name]
            try:
                return kind(raw)
            except ValueError:
                kind_name = "an int" if kind is int else "a number"
                raise ValueError(f"--lora {text!r}: {name}={raw!r} is not {kind_name}, e.g. {_EXAMPLE!r}.") from None

        return cls(
            r=number("r", int),
            alpha=number("alpha", float),
            targets=tuple(values["targets"]),
            dropout=number("dropout", float) if "dropout" in values else 0.0,
        )

    def __str__(self) -> str:
        text = f"r={self.r},alpha={_number_text(self.alpha)},targets={','.join(self.targets)}"
        return text + (f",dropout={_number_text(self.dropout)}" if self.dropout else "")


def _key_values(text: str) -> dict[str, list[str]]:
    """``--lora`` text as key -> its values (one each; ``targets`` a list: a token without ``=`` continues it).
    ValueError for an unknown or repeated key, or a token without ``=`` that does not follow ``targets``."""
    values: dict[str, list[str]] = {}
    key = None
    for token in (t.strip() for t in text.split(",")):
        if "=" in token:
            key, _, value = (s.strip() for s in token.partition("="))
            if key not in LORA_KEYS:
                raise ValueError(
                    f"--lora {text!r}: unknown key {key!r}; allowed keys are {LORA_KEYS}, e.g. {_EXAMPLE!r}."
                )
            if key in values:
                raise ValueError(f"--lora {text!r}: key {key!r} is given twice; give each key once.")
            values[key] = [value]
        elif key == "targets":
            values[key].append(token)
        else:
            raise ValueError(
                f"--lora {text!r}: token {token!r} has no '='; only targets takes a list "
                f"(targets=query,value), every other token is key=value, e.g. {_EXAMPLE!r}."
            )
    return values


def _number_text(x: float) -> str:
    """``16.0 -> "16"``, ``0.1 -> "0.1"``; ``float(text) == x`` exactly."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a target given in a list: the whole name, or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def _check_targets(model: nn.Module, spec: LoraSpec) -> None:
    """ValueError (listing some leaf module names) when a target of ``spec`` matches no module of ``model``."""
    module_names = [name for name, _ in model.named_modules() if name]
    unmatched = [t for t in spec.targets if not any(_matches(name, t) for name in module_names)]
    if unmatched:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if name and not list(m.children())})
        raise ValueError(
            f"--lora targets {unmatched} match no module of {type(model).__name__}; a target names a module "
            f"(or the last parts of its dotted name). Leaf module names here: {leaves[:20]}."
        )


def _trainable_ids(model: nn.Module, trainable: tuple[str, ...]) -> set[int]:
    """The ids of the parameters ``trainable`` names (a parameter's qualified name, or a module's: every parameter
    under it). ValueError (listing some parameter names) for a name that matches none."""
    param_names = [name for name, _ in model.named_parameters()]
    missing = [t for t in trainable if not any(n == t or n.startswith(t + ".") for n in param_names)]
    extra_ids = {id(p) for n, p in model.named_parameters() if any(n == t or n.startswith(t + ".") for t in trainable)}
    if missing:
        raise ValueError(
            f"apply_lora: trainable={missing} name no parameter or module of {type(model).__name__}; "
            f"parameter names look like {param_names[:6]} ... {param_names[-4:]}."
        )
    return extra_ids


def apply_lora(model: nn.Module, spec: LoraSpec | str, trainable: Iterable[str] = ()) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (``peft``) and set what trains; returns it.

    After the call every parameter of ``model`` has ``requires_grad=False`` except the
    adapters' weights (``lora_A``/``lora_B``; ``lora_embedding_A``/``_B`` on an Embedding) and the parameters named in ``trainable``: a name
    selects the parameter of that qualified name (as in ``model.named_parameters()``) or every
    parameter under a module of that name. A parameter shared by two modules (a tied weight)
    is one tensor: it trains or not under its first name. The adapters start with ``B = 0``
    (the model's output is unchanged) and ``A`` from torch's global RNG. The returned module is
    ``model`` itself: same class, same ``forward`` keywords.

    Raises:
        ImportError: ``peft`` is not installed (``pip install 'mixprec[hf]'``).
        ValueError: a target that matches no module, or a ``trainable`` name that matches no
            parameter (both list some names of the model).
    """
    spec = LoraSpec.parse(spec)
    _check_targets(model, spec)
    extra_ids = _trainable_ids(model, tuple(trainable))
    try:
        import peft
    except ImportError as err:
        raise ImportError(f"LoRA needs the peft library ({err}); install it with: {_HF_EXTRA}") from err

    config = peft.LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=spec.dropout, bias="none",
    )
    try:
        model = peft.inject_adapter_in_model(config, model)
    except ValueError as err:   # e.g. a target module type peft cannot adapt (LayerNorm)
        raise ValueError(f"--lora {spec}: peft cannot adapt a target: {err} Target Linear, Conv or Embedding "
                         "modules (e.g. targets=query,value)") from None
    for name, param in model.named_parameters():  # names chosen before peft renamed targets
        # peft's adapter tensors: lora_A/lora_B (Linear, Conv), lora_embedding_A/B (Embedding),
        # lora_magnitude_vector (DoRA)
        is_adapter = any(part.startswith("lora_") for part in name.split("."))
        param.requires_grad_(is_adapter or id(param) in extra_ids)
    return model
