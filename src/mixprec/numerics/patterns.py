"""Glob patterns naming a set of modules, as the advice writes them into a policy (``keep_fp32``, ``block_keep``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

__all__ = ["covering_patterns"]


def covering_patterns(names: list[str], module_names: tuple[str, ...], *, allowed: Iterable[str] = ()
                      ) -> tuple[str, ...]:
    """Glob patterns covering every name of ``names`` and no module outside ``names`` and ``allowed``.

    A name whose numeric path parts (``blocks.3.fc``) can be replaced by ``*`` is generalised (``blocks.*.fc``)
    when every module the pattern matches (as the engine matches: ``fnmatchcase`` over all ``module_names``) is
    in ``names`` or ``allowed`` (modules that may be covered too, e.g. linears a recipe keeps anyway); otherwise
    the exact name is kept. Pure; order follows ``names``.
    """
    wanted = set(names) | set(allowed)
    patterns: list[str] = []
    covered: set[str] = set()
    for name in names:
        if name in covered:
            continue
        general = ".".join("*" if part.isdigit() else part for part in name.split("."))
        matches = {n for n in module_names if n and fnmatch.fnmatchcase(n, general)}
        if general != name and matches <= wanted:
            patterns.append(general)
            covered |= matches
        else:
            patterns.append(name)
            covered.add(name)
    return tuple(patterns)
