"""A run's checkpoint root on disk: ``step-N`` directories, the ``latest`` pointer, crash-safe writes.

Both checkpoint formats (:mod:`mixprec.checkpoint.local`, one process; the DCP format of
:mod:`mixprec.distributed.process`) write through this module, so they share the layout, the crash safety
and the pruning; only what goes inside a ``step-N`` directory differs::

    ROOT/
      latest                  "step-120\\n": the newest complete checkpoint (replaced atomically)
      step-100/  step-120/    complete checkpoints, each with a manifest.json; a second save at the
                              same N is named step-N.1, step-N.2, ...
      superseded/step-140/    a checkpoint at or ahead of a later save's step: the run went back (a
                              resume from an earlier checkpoint, a rollback) and this is the future it
                              left; moved here, said, never pruned nor loaded from the root
      .tmp-step-140-PID-XXXX  a save in progress (or one killed mid-way: never loaded, removed by
                              the next save once process PID is gone)
      .trash-... .latest-...  a pruned checkpoint being deleted, a pointer being written (same rule)

**Writing.** :func:`begin_checkpoint` removes the leftovers of dead processes, names the new
checkpoint and makes its temporary directory; the caller writes any files (any tree) into
``pending.tmp``; :func:`commit_checkpoint` fsyncs every file and directory in it, renames it to
``step-N`` (atomic), fsyncs the root, and only then replaces ``latest`` (written to a temporary
name, fsynced, ``os.replace``'d, root fsynced); then it moves each other checkpoint of the new
one's step or above into ``superseded/`` (a warning names them: the run went back, so they are a
future it abandoned, and pruning by step would have kept them over the checkpoint it resumed from);
last it prunes to ``keep`` checkpoints, each renamed to ``.trash-...`` (atomic) before being
deleted. :func:`abort_checkpoint` deletes the temporary directory of a save that failed.
:func:`new_checkpoint` is the three as a context manager, for one writing process. A process
killed at any moment therefore leaves ``latest`` naming a complete checkpoint: the previous one, or
the new one. One writer per root (under torch.distributed: rank 0 begins and commits, every rank
writes into ``pending.tmp``).

**Reading.** :func:`resolve_checkpoint` turns a root (following ``latest``) or a ``step-N`` path
into the checkpoint directory; :func:`read_manifest_json` also parses its ``manifest.json`` (the
format's reader checks what it holds).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.messages.location import user_stacklevel

__all__ = ["CheckpointError", "LATEST", "MANIFEST", "SUPERSEDED", "PendingCheckpoint", "begin_checkpoint",
           "commit_checkpoint", "abort_checkpoint", "new_checkpoint", "note_loaded", "resolve_checkpoint",
           "read_manifest_json", "step_dirs"]

LATEST = "latest"
SUPERSEDED = "superseded"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_WORK_RE = re.compile(r"^\.(?:tmp|trash|latest)-.*?-(\d+)-[0-9a-f]{8}$")  # .<kind>-<what>-<pid>-<token>


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete or does not fit the engine; the message names the file."""


# ---------------------------------------------------------------------------------------------- fsync
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory (Windows): rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(top: Path) -> None:
    """fsync every file under ``top``, then each directory (deepest first, ``top`` last)."""
    for directory, _, files in os.walk(top, topdown=False):
        for name in files:
            _fsync_file(Path(directory, name))
        _fsync_dir(Path(directory))


# ---------------------------------------------------------------------------------------------- the root
def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's live process
        return True
    return True


def _work_name(kind: str, what: str) -> str:
    return f".{kind}-{what}-{os.getpid()}-{secrets.token_hex(4)}"


def _remove_stale(root: Path) -> None:
    """Delete leftovers (temporary and trash directories, pointer temp files) of dead processes."""
    for entry in root.iterdir():
        match = _WORK_RE.match(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def step_dirs(root: str | Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first (by N, then by suffix)."""
    found = []
    for entry in Path(root).iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            found.append(((int(match.group(1)), int(match.group(2) or 0)), entry))
    return [entry for _, entry in sorted(found)]


def _next_name(root: Path, step: int) -> str:
    """``step-N``, or past the highest suffix of that step's names here (``step-N.k``, k counting up: a later save
    sorts after an earlier one even when the earlier plain ``step-N`` was moved away)."""
    taken = [int(m.group(2) or 0) for e in root.iterdir() if (m := _STEP_RE.match(e.name)) and int(m.group(1)) == step]
    return f"step-{step}" if not taken else f"step-{step}.{max(taken) + 1}"


def _check_keep(keep: int | None, caller: str) -> None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"{caller} keep={keep!r} is not allowed; pass an int >= 1 or None (keep all)")


# ---------------------------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: ``tmp`` becomes ``root/name`` on :func:`commit_checkpoint`,
    which then keeps the newest ``keep`` checkpoints (None: all)."""

    root: Path
    name: str
    tmp: Path
    keep: int | None = None

    @property
    def path(self) -> Path:
        """Where the checkpoint will be once committed: ``root/name``."""
        return self.root / self.name


def begin_checkpoint(root: str | Path, step: int, *, keep: int | None = None,
                     caller: str = "save_checkpoint") -> PendingCheckpoint:
    """Start a checkpoint of step ``step`` under ``root`` (created if needed); write into ``.tmp``.

    Removes the leftovers of dead processes, names it ``step-N`` (``step-N.1``, ... if taken) and
    creates the empty temporary directory ``pending.tmp``.

    Raises:
        ValueError: ``keep`` is not a positive int or None, or ``root`` is a file (``caller`` names the function).
    """
    _check_keep(keep, caller)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{caller}: path {str(root)!r} is a file, not a directory; pass a directory (the checkpoint "
                         "root: created if needed, each save a step-N directory in it)")
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    name = _next_name(root, step)
    tmp = root / _work_name("tmp", name)
    tmp.mkdir()
    return PendingCheckpoint(root, name, tmp, keep)


def commit_checkpoint(pending: PendingCheckpoint) -> Path:
    """Make ``pending`` the newest complete checkpoint; returns its directory ``root/step-N``.

    fsync every file and directory in ``pending.tmp``, rename it to ``step-N`` (atomic), fsync
    the root, replace ``latest`` (temporary name, fsync, ``os.replace``, fsync the root), then
    move the other checkpoints of step N or above into ``superseded/`` (warning), then prune: keep the
    new checkpoint and the newest ``keep - 1`` others, so exactly ``keep``. A failure before the
    rename deletes ``pending.tmp`` and leaves the root as it was.
    """
    root, name = pending.root, pending.name
    try:
        _fsync_tree(pending.tmp)
        os.rename(pending.tmp, root / name)   # atomic: step-N is complete or absent
    except BaseException:
        abort_checkpoint(pending)
        raise
    _fsync_dir(root)
    pointer = root / _work_name("latest", name)
    with open(pointer, "wb") as f:
        f.write(f"{name}\n".encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)  # atomic: latest names the old or the new complete checkpoint
    _fsync_dir(root)
    _set_aside_future(root, name)
    _PARENT[root.resolve()] = (root / name).resolve()
    if pending.keep is not None:
        others = [d for d in step_dirs(root) if d.name != name]
        for old in others[:max(0, len(others) - (pending.keep - 1))]:
            trash = root / _work_name("trash", old.name)
            os.rename(old, trash)     # atomic: never a half-deleted step-N
            shutil.rmtree(trash, ignore_errors=True)
    return root / name


def _step_of(name: str) -> int:
    return int(_STEP_RE.match(name).group(1))


_PARENT: dict[Path, Path] = {}   # root -> the step-N directory this process last loaded from or saved there


def note_loaded(directory: str | Path) -> None:
    """Record that this process loaded the checkpoint ``directory`` (a ``step-N`` of its root): a later save under
    that root descends from it, so the set-aside below keeps it."""
    directory = Path(directory).resolve()
    _PARENT[directory.parent] = directory


def _set_aside_future(root: Path, name: str) -> None:
    """Move into ``root/superseded/`` (atomic renames within the root), with a warning naming them, the complete
    checkpoints of a step above ``name``'s, and those of its step other than the one this run descends from (the
    checkpoint it last loaded or saved there: :func:`note_loaded`): a run that went back and reached the step again
    (resumed from step-10, saving at 15 as the abandoned run did) supersedes that step's earlier checkpoint too,
    while a second save at the same step, or a resume from it, keeps it."""
    step, parent = _step_of(name), _PARENT.get(root.resolve())
    ahead = [d for d in step_dirs(root) if d.name != name and (_step_of(d.name) > step or (
        _step_of(d.name) == step and d.resolve() != parent))]
    if not ahead:
        return
    aside = root / SUPERSEDED
    aside.mkdir(exist_ok=True)
    moved = []
    for d in ahead:
        target = aside / _next_name(aside, _step_of(d.name))
        os.rename(d, target)
        moved.append(f"{d.name} -> {SUPERSEDED}/{target.name}")
    _fsync_dir(aside)
    _fsync_dir(root)
    warnings.warn(f"mixprec: checkpoint {name} saved under {str(root)!r}, at or behind the step of {len(moved)} "
                  f"checkpoint(s) there: the run went back (a resume from an earlier checkpoint, or a rollback), so "
                  f"they are a future it left (or an earlier save at this step). Moved aside, not pruned by keep and "
                  f"not loaded from the root: {', '.join(moved)}; delete {str(aside)!r} when you no longer need them",
                  stacklevel=user_stacklevel())


def abort_checkpoint(pending: PendingCheckpoint) -> None:
    """Delete the temporary directory of a checkpoint that will not be committed."""
    shutil.rmtree(pending.tmp, ignore_errors=True)


@contextlib.contextmanager
def new_checkpoint(root: str | Path, step: int, *, keep: int | None = None,
                   caller: str = "save_checkpoint") -> Iterator[PendingCheckpoint]:
    """:func:`begin_checkpoint`, then :func:`commit_checkpoint` when the block ends, or
    :func:`abort_checkpoint` (and re-raise) when it raises. For one writing process."""
    pending = begin_checkpoint(root, step, keep=keep, caller=caller)
    try:
        yield pending
    except BaseException:
        abort_checkpoint(pending)
        raise
    commit_checkpoint(pending)


# ---------------------------------------------------------------------------------------------- reading
def _read_latest(root: Path) -> str:
    text = (root / LATEST).read_text(encoding="utf-8", errors="replace").strip()
    if not _STEP_RE.match(text):
        raise CheckpointError(f"checkpoint root {str(root)!r}: {LATEST} holds {text[:60]!r}, not a step-N name; "
                              f"point it at one of {[d.name for d in step_dirs(root)]} or load that directory")
    return text


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` stands for: a root (follows ``latest``) or a ``step-N`` dir.

    Raises:
        FileNotFoundError: no checkpoint there (no ``latest`` pointer and no manifest), or
            ``latest`` names a directory that does not exist.
        CheckpointError: ``latest`` is garbled, or ``path`` looks like a checkpoint directory
            whose manifest is missing (half-written or damaged).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}: not a directory; pass a checkpoint root "
                                "(mixprec train writes OUT/checkpoints) or one of its step-N directories")
    if (path / LATEST).is_file():
        target = path / _read_latest(path)
        if not target.is_dir():
            raise FileNotFoundError(f"checkpoint root {str(path)!r}: {LATEST} names {target.name}, which does not "
                                    f"exist; complete checkpoints here: {[d.name for d in step_dirs(path)]}")
        return target
    if (path / MANIFEST).is_file():
        return path
    if _STEP_RE.match(path.name) or _WORK_RE.match(path.name) or any(path.glob("*.safetensors")):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is missing (a half-written or damaged "
                              "checkpoint); load another checkpoint of the run")
    steps = [d.name for d in step_dirs(path)]
    hint = f"; it holds {steps} but no {LATEST} pointer: load one of them" if steps else ""
    raise FileNotFoundError(f"no checkpoint at {str(path)!r}: no {LATEST} pointer and no {MANIFEST}{hint}")


def read_manifest_json(path: str | Path) -> tuple[Path, Any]:
    """The checkpoint directory ``path`` stands for (:func:`resolve_checkpoint`) and its parsed
    ``manifest.json``, unchecked (any JSON value: the format's reader checks it).

    Raises:
        FileNotFoundError / CheckpointError: as :func:`resolve_checkpoint`; CheckpointError also
            when ``manifest.json`` is not JSON (truncated or corrupt).
    """
    directory = resolve_checkpoint(path)
    try:
        return directory, json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(directory)!r}: {MANIFEST} cannot be read as JSON ({err}); it is "
                              "truncated or corrupt") from None
