"""Loss scaling: one interface, three value types (No, Static and Dynamic ``LossScale``).

The training loop never branches on "fp16 or not"; it always does::

    loss_scale.scale_loss(loss).backward()
    found_inf = loss_scale.unscale_(grads)   # fp32 () device tensor, 1.0 if any grad is non-finite
    ...skip the optimizer step where found_inf (on device)...
    loss_scale.update(found_inf)

Scale convention: ``scale`` is an fp32 tensor of shape ``()`` on the device; the loss is
*multiplied* by it and gradients by its fp32 reciprocal (exact for powers of two). All scale
arithmetic is fp32, never float64 (MPS has no float64: pytorch#142397). No method here syncs
host and device (no ``.item()``/``.cpu()``); ``found_inf`` stays a device tensor.

Each object holds a frozen ``config`` dataclass (hyperparameters, validated when built:
:mod:`mixprec.engine.loss_scale_config`; change them by building a new object) and a ``state``
dataclass of 0-dim device tensors (fp32 ``scale``, int32 counters) that the methods update in place.
``state_dict()`` is derived from ``dataclasses.fields``::

    {"type": "DynamicLossScale",
     "config": {field: python number, ...},      # every config field
     "state": {field: 0-dim tensor, ...}}        # every state field, cloned, on the scale's device
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mixprec.engine.gradients import grouped_values, summed_values
from mixprec.engine.loss_scale_config import DynamicConfig, NoConfig, StaticConfig, _is_number
from mixprec.messages.location import user_stacklevel

__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "from_spec", "from_state_dict", "for_policy", "for_switch",
           "unscale_grads"]


@dataclass
class ScaleState:
    """Device state of every loss scale: fp32 ``scale`` and int32 ``consecutive_skips``, shape ``()``.

    ``consecutive_skips`` counts the consecutive steps whose gradients were non-finite.
    """

    scale: torch.Tensor
    consecutive_skips: torch.Tensor


@dataclass
class DynamicState(ScaleState):
    """Adds int32 ``growth_tracker`` (clean steps since the last change), ``hysteresis_left``
    (overflows still tolerated before backing off) and ``floor_skips`` (consecutive skipped
    steps that started with the scale already at ``min_scale``)."""

    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    floor_skips: torch.Tensor


class LossScale:
    """The interface shared by the three loss scales; no method syncs host and device."""

    dynamic: ClassVar[bool] = False
    enabled: ClassVar[bool] = True
    config: Any
    state: ScaleState

    def to(self, device: torch.device | str) -> "LossScale":
        """Move the state tensors to ``device`` (once, at setup); returns ``self``."""
        self.state = type(self.state)(**{f.name: getattr(self.state, f.name).to(device)
                                         for f in dataclasses.fields(self.state)})
        return self

    @property
    def scale(self) -> torch.Tensor:
        """The current scale: fp32, shape ``()``, on the device."""
        return self.state.scale

    @property
    def consecutive_skips(self) -> torch.Tensor:
        """int32 ``()`` device tensor: consecutive steps with non-finite grads (read-only view)."""
        return self.state.consecutive_skips

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (same dtype and device as ``loss``)."""
        return loss * self.state.scale

    def _lowest_scale(self) -> float:
        """The lowest value the scale can take (host-side, from the config)."""
        raise NotImplementedError

    def unscale_(self, grads: list[torch.Tensor | None], factor: float = 1.0) -> torch.Tensor:
        """Multiply ``grads`` in place by the fp32 ``factor/scale`` (``factor``: the engine's N/k for an
        accumulation group ended after k of N micro-batches, in the same multiply); return ``found_inf``.

        ``found_inf`` is an fp32 ``()`` tensor on the scale's device, 1.0 if any element of any
        grad is non-finite. ``None`` entries are skipped. Grads are grouped by (device, dtype) for
        torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` (a plain foreach fallback
        runs where it is missing). The fused op checks *before* multiplying, so when the scale
        can go below ``factor`` each group is checked again after unscaling. No host sync.

        Sparse COO grads are unscaled through their values and complex ones through their real
        view (:mod:`mixprec.engine.gradients`; the fused op takes neither). An fp16 sparse grad is also
        checked after coalescing, as ``torch.amp.GradScaler`` does: duplicate indices summed in fp16
        can overflow where each value fits. Unlike GradScaler the grad is not replaced by its
        coalesced copy: the (unscaled) values are summed later by the optimizer.
        """
        home = self.state.scale.device
        found_inf = torch.zeros((), dtype=torch.float32, device=home)
        inv_scale = self.state.scale.reciprocal()  # fp32: exact for powers of two
        if factor != 1.0:
            inv_scale = inv_scale * factor   # fp32(factor) times a power of two: exact
        recheck = self._lowest_scale() < factor
        for (device, _), group in grouped_values(grads).items():
            here = device == home   # the check only ever sets its flag: the groups on the scale's device share one
            found_dev = found_inf if here else torch.zeros((), dtype=torch.float32, device=device)
            inv_dev = inv_scale if here else inv_scale.to(device)
            _check_and_unscale_(group, found_dev, inv_dev)
            if recheck:  # values may have overflowed while being multiplied by 1/scale > 1
                _check_and_unscale_(group, found_dev, torch.ones_like(inv_dev))
            if not here:
                found_inf = torch.maximum(found_inf, found_dev.to(home))
        sums = [summed_values(g) for g in grads if g is not None and g.is_sparse and g.dtype == torch.float16]
        if sums:   # the unscaled fp16 sums the optimizer will add: overflow there is an overflow too
            finite = torch.stack([v.isfinite().all().to(found_inf.device) for v in sums]).all()
            found_inf = torch.where(finite, found_inf, 1.0)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        """Count consecutive skipped steps (the scale is fixed). On device, no sync."""
        skips = self.state.consecutive_skips
        skips.copy_(torch.where(found_inf > 0, skips + 1, 0))

    def at_floor(self) -> torch.Tensor:
        """bool ``()`` device tensor: True when the scale cannot back off any further
        (always, for a fixed scale)."""
        return torch.ones((), dtype=torch.bool, device=self.state.scale.device)

    def state_dict(self) -> dict[str, Any]:
        """``{"type", "config", "state"}`` (module docstring); state tensors are cloned. No sync."""
        return {"type": type(self).__name__,
                "config": {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)},
                "state": {f.name: getattr(self.state, f.name).clone() for f in dataclasses.fields(self.state)}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore config and state bit-exactly from :meth:`state_dict` output.

        Everything is validated before anything changes; ``state_dict`` is not modified and
        shares no storage with ``self`` afterwards (values are copied into the existing state
        tensors, which keep their device).

        Raises:
            ValueError: a state dict of another class, missing/extra keys, or a state value that
                is not a 0-dim tensor of the expected dtype.
        """
        own = type(self).__name__
        kind = state_dict.get("type") if isinstance(state_dict, dict) else type(state_dict).__name__
        if kind != own:
            raise ValueError(f"cannot load a {kind!r} state dict into {own}; "
                             f"build a {kind} (e.g. with from_spec) and load it there")
        for part, obj in (("config", self.config), ("state", self.state)):
            want, got = {f.name for f in dataclasses.fields(obj)}, set(state_dict.get(part, {}))
            if want != got:
                raise ValueError(f"{own}.load_state_dict: {part} keys {sorted(got)} do not match "
                                 f"{sorted(want)} (missing {sorted(want - got)}, extra {sorted(got - want)})")
        config = type(self.config)(**state_dict["config"])  # re-validates
        for name, value in state_dict["state"].items():
            current = getattr(self.state, name)
            if not (isinstance(value, torch.Tensor) and value.dtype == current.dtype and value.dim() == 0):
                raise ValueError(f"{own}.load_state_dict: state {name}={value!r} is not allowed; "
                                 f"it must be a 0-dim {current.dtype} tensor; save it with state_dict()")
        self.config = config
        for name, value in state_dict["state"].items():
            getattr(self.state, name).copy_(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


def _check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, *,
                        use_fused: bool | None = None) -> None:
    """Torch's fused check-and-unscale (``grads``: one device and dtype), or a foreach equivalent (the same bits:
    the check before the multiply, the product in fp32 rounded once) where the op is missing or lacks the dtype:
    its CUDA kernel takes fp32 and fp16 only, so bf16 grads (16-bit params without masters: bf16-kahan, -sr,
    -lean) failed there with NotImplementedError. ``use_fused``: force either path (tests)."""
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if use_fused is None:
        use_fused = fused is not None and (grads[0].device.type == "cpu" or grads[0].dtype != torch.bfloat16)
    if use_fused:
        fused(grads, found_inf, inv_scale)
        return
    finite = torch.stack([g.isfinite().all() for g in grads]).all()
    found_inf.copy_(torch.where(finite, found_inf, 1.0))
    torch._foreach_mul_(grads, inv_scale)


class NoLossScale(LossScale):
    """No loss scaling (scale 1.0). ``unscale_`` still checks finiteness: the engine skips
    non-finite steps under every policy."""

    enabled: ClassVar[bool] = False

    def __init__(self) -> None:
        self.config = NoConfig()
        self.state = ScaleState(scale=torch.tensor(1.0), consecutive_skips=torch.tensor(0, dtype=torch.int32))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Returns ``loss`` itself (no multiply)."""
        return loss

    def _lowest_scale(self) -> float:
        return 1.0


class StaticLossScale(LossScale):
    """A fixed loss scale; ``update`` only counts ``consecutive_skips``."""

    def __init__(self, scale: float) -> None:
        self.config = StaticConfig(scale=scale)
        self.state = ScaleState(scale=torch.tensor(scale, dtype=torch.float32),
                                consecutive_skips=torch.tensor(0, dtype=torch.int32))

    def _lowest_scale(self) -> float:
        return float(self.config.scale)


class DynamicLossScale(LossScale):
    """Dynamic loss scaling, all on device (fp32 scale, int32 counters, no host sync).

    Defaults follow ``torch.amp.GradScaler`` (init 2**16, x2 every 2000 clean steps, x0.5 on
    overflow); the floor ``min_scale`` and ceiling ``max_scale`` follow Apex; ``hysteresis``
    follows DeepSpeed (its ``consecutive_hysteresis=True`` variant). With ``hysteresis=1`` and
    the scale inside [min_scale, max_scale] it matches GradScaler exactly. Every overflowing
    step is skipped by the engine, whether or not the scale backs off. The update rule::

        was_at_floor = scale <= min_scale
        if found_inf:
            consecutive_skips += 1
            growth_tracker = 0
            hysteresis_left -= 1
            if hysteresis_left <= 0:
                scale = max(scale * backoff_factor, min_scale)
                hysteresis_left = hysteresis
            if was_at_floor:
                floor_skips += 1
        else:
            consecutive_skips = 0
            floor_skips = 0
            hysteresis_left = hysteresis
            growth_tracker += 1
            if growth_tracker >= growth_interval:
                scale = min(scale * growth_factor, max_scale)
                growth_tracker = 0
    """

    dynamic: ClassVar[bool] = True

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: float = 1.0,
                 max_scale: float = 2.0**24) -> None:
        self.config = DynamicConfig(init_scale=init_scale, growth_factor=growth_factor,
                                    backoff_factor=backoff_factor, growth_interval=growth_interval,
                                    hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale)
        zero = torch.tensor(0, dtype=torch.int32)
        self.state = DynamicState(scale=torch.tensor(init_scale, dtype=torch.float32), consecutive_skips=zero,
                                  growth_tracker=zero.clone(), hysteresis_left=torch.full_like(zero, hysteresis),
                                  floor_skips=zero.clone())

    def _lowest_scale(self) -> float:
        return float(self.config.min_scale)

    @property
    def floor_skips(self) -> torch.Tensor:
        """int32 ``()`` device tensor: consecutive skips with the scale at ``min_scale``."""
        return self.state.floor_skips

    def at_floor(self) -> torch.Tensor:
        """bool ``()`` device tensor: ``scale <= min_scale``. No sync."""
        return self.state.scale <= self.config.min_scale

    def update(self, found_inf: torch.Tensor) -> None:
        """Apply the rule in the class docstring with tensor ops, in place. No sync."""
        c, s = self.config, self.state
        overflow = found_inf > 0
        was_at_floor = s.scale <= c.min_scale
        hysteresis_left = torch.where(overflow, s.hysteresis_left - 1, c.hysteresis)
        backoff = overflow & (hysteresis_left <= 0)
        growth_tracker = torch.where(overflow, 0, s.growth_tracker + 1)
        grow = growth_tracker >= c.growth_interval
        scale_down = torch.clamp(s.scale * c.backoff_factor, min=c.min_scale)
        scale_up = torch.clamp(s.scale * c.growth_factor, max=c.max_scale)
        s.scale.copy_(torch.where(backoff, scale_down, torch.where(grow, scale_up, s.scale)))
        s.hysteresis_left.copy_(torch.where(backoff, c.hysteresis, hysteresis_left))
        s.growth_tracker.copy_(torch.where(grow, 0, growth_tracker))
        s.floor_skips.copy_(torch.where(overflow, s.floor_skips + was_at_floor.to(torch.int32), 0))
        super().update(found_inf)  # consecutive_skips


def from_spec(spec: str | float, **overrides: Any) -> LossScale:
    """Build the loss scale a ``Policy.loss_scale`` value names: ``"dynamic"``, ``"none"`` or a
    positive number (static). ``overrides`` are ``DynamicLossScale`` keywords (dynamic only).

    Raises:
        ValueError: unknown spec, or overrides for a non-dynamic spec.
    """
    if isinstance(spec, str) and spec == "dynamic":
        return DynamicLossScale(**overrides)
    if overrides:
        raise ValueError(f"loss scale overrides {sorted(overrides)} apply only to spec='dynamic'; "
                         f"got spec={spec!r}; drop them or use 'dynamic'")
    if isinstance(spec, str) and spec == "none":
        return NoLossScale()
    if _is_number(spec):
        return StaticLossScale(float(spec))
    raise ValueError(f"loss scale spec={spec!r} is not allowed; use 'dynamic', 'none' or a positive number")


def from_state_dict(state: dict[str, Any]) -> LossScale:
    """A new loss scale of the type a :meth:`LossScale.state_dict` names, holding that state exactly.

    Raises:
        ValueError: an unknown ``type``, or a state the type refuses.
    """
    kinds = {cls.__name__: cls for cls in (NoLossScale, StaticLossScale, DynamicLossScale)}
    if not isinstance(state, dict) or state.get("type") not in kinds:
        raise ValueError(f"loss_scale state type {state.get('type') if isinstance(state, dict) else state!r} is "
                         f"unknown; expected one of {sorted(kinds)}")
    kind = kinds[state["type"]]
    ls = kind() if kind is not StaticLossScale else StaticLossScale(float(state["config"].get("scale", 1.0)))
    ls.load_state_dict(state)
    return ls


def for_policy(policy: Any, override: Any, device: torch.device) -> LossScale:
    """The loss scale ``policy`` (a :class:`mixprec.Policy`) names, or ``override`` (a spec as :func:`from_spec`
    takes, or a LossScale), on ``device``; warns when scaling is on under bf16 compute (it does nothing useful)."""
    spec = policy.loss_scale if override is None else override
    ls = spec if hasattr(spec, "unscale_") else from_spec(spec)
    if ls.enabled and policy.compute_dtype == torch.bfloat16 and policy.param_dtype != torch.float16:
        warnings.warn(f"loss scaling is on ({type(ls).__name__}) under a bf16 policy ({policy}): bf16 has "
                      "fp32's exponent range, so scaling does nothing useful; drop loss_scale=...",
                      stacklevel=user_stacklevel())
    return ls.to(device)


def for_switch(old: Any, new: Any, override: Any, current: LossScale, device: torch.device) -> tuple[LossScale, str]:
    """The loss scale after a policy change ``old`` → ``new`` (:class:`mixprec.Policy`): ``override`` if given,
    else ``current`` kept when both policies name the same scaling, else ``new``'s; with the event's words."""
    if override is None and new.loss_scale == old.loss_scale:
        return current, "loss scale kept"
    scale = for_policy(new, override, device)
    return scale, f"loss scale now {type(scale).__name__}"


def unscale_grads(grads: Any, scale: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """``g.float() * (1/scale)`` for each gradient of ``grads`` (None stays None; differentiable) and the
    overflow flag of the results (fp32 0-dim on ``scale``'s device, 1.0 if any is non-finite; None without
    a gradient). No host sync. Source: torch.amp's gradient-penalty recipe."""
    inv_scale = scale.detach().reciprocal()
    out = [None if g is None else g.float() * inv_scale.to(g.device) for g in grads]
    checked = [torch.isfinite(g).all().to(inv_scale.device) for g in out if g is not None]
    return out, (~torch.stack(checked).all()).float() if checked else None

