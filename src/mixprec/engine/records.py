"""The engine's typed records: :class:`Event`, one entry of ``mp.events``.

Every action the engine or a collaborator takes on a run (a policy switch, a rollback, an adopted
edit, auto's decision, ...) is one frozen :class:`Event`. JSON lives only at the edge: checkpoints,
``events.jsonl`` and ``results.json`` write :meth:`Event.to_dict` (the keys they always had) and read
:meth:`Event.of`. An event also reads like the dict it replaces (``event["kind"]``,
``event.get("to")``), so loops written against the dict form keep working.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mixprec.policy.policy import state_name

__all__ = ["Decision", "Event", "policy_event"]

# JSON key -> field, for the keys whose field name differs (``from`` is a Python keyword)
_KEYS = {"step": "step", "kind": "kind", "cause": "cause", "module": "module", "detail": "detail",
         "from": "from_policy", "to": "to_policy", "to_step": "to_step"}
_WITH_TO_STEP = ("rollback", "skip")   # the guard's kinds, which always say where they went back to


@dataclass(frozen=True)
class Event:
    """One recorded action on a run.

    ``step``: boundaries reached when it happened; ``kind``: what happened (``"set_policy"``,
    ``"escalate"``, ``"convert"``, ``"unfreeze"``, ``"adopt"``, ``"model-edit"``, ``"auto"``,
    ``"rollback"``, ``"skip"``, ``"diverged"``, a loop check's kind); ``cause``: why (None where
    none applies); ``module``: the module it concerns (None: the whole model); ``detail``: the text
    shown to people. ``from_policy``/``to_policy``: a policy change's two policies (JSON ``from``/``to``);
    ``to_step``: the applied step a rollback restored (None when nothing was restored).
    """

    step: int
    kind: str
    cause: str | None
    module: str | None
    detail: str
    from_policy: str | None = None
    to_policy: str | None = None
    to_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``step, kind, cause, module, detail``, plus ``from``/``to`` for a policy change and
        ``to_step`` for a rollback or skip."""
        out = {key: getattr(self, _KEYS[key]) for key in ("step", "kind", "cause", "module", "detail")}
        if self.from_policy is not None or self.to_policy is not None:
            out["from"], out["to"] = self.from_policy, self.to_policy
        if self.kind in _WITH_TO_STEP or self.to_step is not None:
            out["to_step"] = self.to_step
        return out

    @classmethod
    def of(cls, value: Event | Mapping[str, Any]) -> Event:
        """``value`` as an Event: an Event as it is, or a :meth:`to_dict` mapping (a checkpoint's events).
        Raises ValueError for a mapping without ``step``/``kind`` or with a key an event does not have."""
        if isinstance(value, Event):
            return value
        unknown = sorted(set(value) - set(_KEYS))
        if unknown or "step" not in value or "kind" not in value:
            raise ValueError(f"an event needs 'step' and 'kind' and takes only {sorted(_KEYS)}; got keys "
                             f"{sorted(value)}")
        return cls(**{"cause": None, "module": None, "detail": "",
                      **{_KEYS[k]: v for k, v in value.items()}})

    # ---------------------------------------------------------------- read like the dict it replaces
    def __getitem__(self, key: str) -> Any:
        if key not in self.to_dict():
            raise KeyError(key)
        return getattr(self, _KEYS[key])

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self.to_dict() else default

    def keys(self) -> Iterator[str]:
        return iter(self.to_dict())


@dataclass(frozen=True)
class Decision:
    """The engine's decision line (``mp.decision`` is its text): ``head``, what the policy resolved to on the
    device (or the switch it made), and ``clauses``, each ``"; ..."`` or "" (storage, fp8, compile, loss
    scaling, upcasts, kernels, optimizer state, fp32 regions), in the order they are read."""

    head: str
    clauses: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.head + "".join(self.clauses)


def policy_event(step: int, kind: str, cause: str | None, module: str | None, old: Any, new: Any, carried: int,
                 scale_note: str) -> Event:
    """The event of a policy change at boundary ``step`` from ``old`` to ``new`` (:class:`mixprec.Policy`):
    ``carried`` optimizer-state tensors moved, ``scale_note`` what became of the loss scale."""
    formats = (state_name(old.state_dtype), state_name(new.state_dtype))
    state_move = f" (converted {formats[0]} → {formats[1]})" if formats[0] != formats[1] else ""
    return Event(step=step, kind=kind, cause=cause, module=module,
                 detail=f"{old} → {new}: params re-cast from their fp32 values (frozen and just-unfrozen ones from "
                        f"their stored values), optimizer state of {carried} tensor(s) carried over{state_move}, "
                        f"{scale_note}", from_policy=str(old), to_policy=str(new))

