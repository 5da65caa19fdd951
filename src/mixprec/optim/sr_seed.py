"""The seed of an optimizer's stochastic-rounding stream, kept in every param group (``param_groups[i]["sr_seed"]``).

Every stochastic rounding of :class:`mixprec.optim.AdamW` / :class:`mixprec.optim.SGD` draws from the
counter-based stream of :mod:`mixprec.optim.sr_stream`, keyed by its param group's ``sr_seed``: the constructor's
``sr_seed=`` (checked by :func:`check_sr_seed`), else ``torch.initial_seed()``. ``state_dict()`` carries it, so a
load continues the stream bit for bit.

A state dict saved before ``sr_seed`` existed has groups without one; its run drew its rounding bits from torch's
global RNG, a stream this version does not have. Loading it (:func:`seeded_groups`, before anything is loaded):

* into an optimizer that rounds nothing stochastically (neither ``rounding`` nor ``state_rounding`` is
  ``'stochastic'``): each such group takes this optimizer's own seed for that group, as ``add_param_group`` fills a
  group (no stream is being continued);
* into one that rounds stochastically: refused with a ValueError naming the groups, the missing ``sr_seed`` and the
  fix, :func:`adopt_sr_seed`: within its block the loads give those groups the seed passed, and the run goes on
  from the saved state on the seeded stream (not bit for bit with the old run's global-RNG draws).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mixprec.optim.stream_keys import StreamKeys

__all__ = ["check_sr_seed", "adopt_sr_seed", "seeded_groups"]


def check_sr_seed(owner: str, sr_seed: int | None) -> int:
    """The stochastic-rounding seed: ``sr_seed`` checked (an int in ``[0, 2**64)``), else ``torch.initial_seed()``
    (what ``torch.manual_seed`` set; reading it draws nothing from the RNG). Raises ValueError for another value."""
    if sr_seed is None:
        return int(torch.initial_seed()) % 2**64
    if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) or not 0 <= sr_seed < 2**64:
        raise ValueError(f"{owner} sr_seed={sr_seed!r} is not allowed; pass an int in [0, 2**64), e.g. sr_seed=0, "
                         "or None (torch.initial_seed(), what torch.manual_seed set)")
    return sr_seed


@contextlib.contextmanager
def adopt_sr_seed(optimizer: Any, sr_seed: int | None = None) -> Iterator[Any]:
    """Within the block, ``optimizer.load_state_dict`` gives every saved param group without an ``sr_seed`` (a state
    dict saved before the counter-based stream existed) the seed ``sr_seed`` (None: ``torch.initial_seed()``, as the
    constructors' default), whatever does the load::

        with mixprec.optim.adopt_sr_seed(optimizer, sr_seed=1234):
            optimizer.load_state_dict(old_state)        # or mixprec.load_checkpoint(root, mp), a trainer's resume

    Stochastic rounding then continues from the saved state on the stream of ``sr_seed``: not bit for bit with the
    draws the old run took from torch's global RNG. Groups that have an ``sr_seed`` keep theirs. Yields
    ``optimizer``; nothing is loaded by entering or leaving the block.

    Raises:
        TypeError: ``optimizer`` is not a :mod:`mixprec.optim` optimizer (a ``torch.optim`` one has no stream).
        ValueError: ``sr_seed`` is neither None nor an int in ``[0, 2**64)``.
    """
    keys = getattr(optimizer, "stream_keys", None)
    if not isinstance(keys, StreamKeys):
        raise TypeError(f"adopt_sr_seed takes a mixprec.optim optimizer (AdamW, SGD), got {type(optimizer).__name__}: "
                        "a torch.optim optimizer rounds nothing stochastically and needs no sr_seed")
    before, keys.adopted_seed = keys.adopted_seed, check_sr_seed("adopt_sr_seed", sr_seed)
    try:
        yield optimizer
    finally:
        keys.adopted_seed = before


def seeded_groups(optimizer: Any, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``saved`` param groups of a state dict to load into ``optimizer`` (a :mod:`mixprec.optim` one), each
    with an ``sr_seed`` (module docstring): as saved where it has one; else the seed of an enclosing
    :func:`adopt_sr_seed`; else, where ``optimizer`` rounds nothing stochastically, its own group's. New dicts where
    a seed is added; ``saved`` itself is not changed. Group counts that differ are left to torch's load to refuse.

    Raises:
        ValueError: a group without ``sr_seed`` while ``optimizer`` rounds stochastically (``rounding`` or
            ``state_rounding``) outside :func:`adopt_sr_seed`: naming the groups, the missing ``sr_seed`` and the fix.
    """
    missing = [i for i, group in enumerate(saved) if "sr_seed" not in group]
    if not missing:
        return saved
    owner, own, adopted = type(optimizer).__name__, optimizer.param_groups, optimizer.stream_keys.adopted_seed
    stochastic = [f"{k}='stochastic'" for k in ("rounding", "state_rounding") if getattr(optimizer, k) == "stochastic"]
    if stochastic and adopted is None:
        raise ValueError(
            f"{owner}.load_state_dict: saved param group{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} {'have' if len(missing) > 1 else 'has'} no 'sr_seed' (the state "
            "dict was saved before the counter-based stochastic-rounding stream existed, when rounding drew from "
            f"torch's global RNG, a stream this version no longer has), and this {owner} rounds stochastically "
            f"({' and '.join(stochastic)}); it loaded nothing. Give those groups a seed: with "
            "mixprec.optim.adopt_sr_seed(optimizer, sr_seed=<int>): <the same load> (optimizer.load_state_dict(...), "
            "mixprec.load_checkpoint(...)); the run then continues from the saved state on the seeded stream, not bit "
            "for bit with the old run's global-RNG draws")
    if adopted is None and len(saved) != len(own):
        return saved
    return [group if "sr_seed" in group else {**group, "sr_seed": own[i]["sr_seed"] if adopted is None else adopted}
            for i, group in enumerate(saved)]
