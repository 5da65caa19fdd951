"""mixprec's C kernels: built at first use with the system's C compiler, cached, loaded with :mod:`ctypes`.

A kernel is one C file shipped in the package (e.g. ``mixprec/optim/quantized_adamw.c``). :func:`load`
compiles it once per source, compiler, flags and CPU into ``cache_dir()/c-kernels/<name>-<digest>.so``
(:func:`mixprec.machine.cache.cache_dir`; written atomically, so concurrent processes never load a half-written
file, with its SHA-256 beside it in ``<name>-<digest>.so.sha256``: a cached file that does not match is
rebuilt, never loaded) and returns the loaded library, or None with the reason in :func:`status`. The flags keep IEEE
arithmetic exact (``-O3 -ffp-contract=off``, never fast-math: no fused multiply-add, no reassociation)
and tune for this CPU (``-march=native``, dropped if the compiler refuses it; the CPU's flags are in the
digest, so a cache shared between machines never runs code built for another CPU).

The compiler is ``$CC``, else the first of ``cc``, ``gcc``, ``clang`` on the PATH. ``MIXPREC_C_KERNELS=0``
turns every kernel off (callers then use their torch-op reference, which gives the same bits); a missing
compiler or a failed build does the same, and the reason is shown where the kernel's user reports its
choice (e.g. ``MixedPrecision.decision``). Nothing here raises: a kernel is only ever a faster way to the
same result.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

from mixprec.machine.cache import cache_dir, cpu_flags

__all__ = ["FLAGS", "compiler", "library_path", "load", "reject", "status"]

log = logging.getLogger("mixprec")

FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11", "-fPIC", "-shared", "-pthread")
_NATIVE = "-march=native"
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}
_paths: dict[str, Path] = {}   # source -> the cached library file loaded from it


def compiler() -> list[str] | None:
    """The C compiler command: ``$CC`` (split as a shell would), else ``cc``, ``gcc`` or ``clang`` on the PATH."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _cpu_flags() -> str:
    """This CPU's feature flags, else what :mod:`platform` knows: part of the digest."""
    return " ".join(cpu_flags()) or f"{platform.machine()} {platform.processor()}"


def _compiler_identity(cc: list[str]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
        return f"{cc} {out.stdout.splitlines()[0] if out.stdout else out.returncode}"
    except (OSError, subprocess.SubprocessError) as err:
        return f"{cc} {err}"


def _named(cc: list[str]) -> str:
    """The compiler as the reason names it: ``CC=<value>`` when it came from ``$CC`` (the user's to fix)."""
    return f"CC={' '.join(cc)}" if os.environ.get("CC") else " ".join(cc)


def _fix(cc: list[str]) -> str:
    """What to do about a compiler that cannot build: the fix for ``$CC``, or for the compiler found."""
    return ("; unset CC or point it at a working C compiler" if os.environ.get("CC") else
            "; set CC to a working C compiler")


def _build(source: Path, cc: list[str]) -> tuple[Path | None, str]:
    """Compile ``source`` into the cache (or find it there): (library path, "") or (None, why not)."""
    text = source.read_bytes()
    identity = _compiler_identity(cc)
    for flags in ((*FLAGS, _NATIVE), FLAGS):
        digest = hashlib.sha256(b"\0".join([text, identity.encode(), " ".join(flags).encode(), platform.machine().encode(),
                                             _cpu_flags().encode()])).hexdigest()[:20]
        target = cache_dir() / "c-kernels" / f"{source.stem}-{digest}.so"
        if _intact(target):
            return target, ""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return None, (f"the cache directory {target.parent} is not writable: {err}; set MIXPREC_CACHE_DIR to a "
                          "writable directory")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            run = subprocess.run([*cc, *flags, "-o", str(tmp), str(source)], capture_output=True, text=True,
                                 timeout=_BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as err:
            tmp.unlink(missing_ok=True)
            return None, f"{_named(cc)} could not run: {err}{_fix(cc)}"
        if run.returncode == 0:
            try:
                _publish(tmp, target)
            except OSError as err:
                tmp.unlink(missing_ok=True)
                return None, f"could not write {target}: {err}"
            log.info("mixprec: built the C kernel %s (%s %s)", target, " ".join(cc), " ".join(flags))
            return target, ""
        tmp.unlink(missing_ok=True)
        error = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
    return None, f"{_named(cc)} failed to build {source.name}: {error}{_fix(cc)}"


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether ``library`` is the file a build here wrote: its SHA-256 is the one recorded beside it. A
    truncated or otherwise damaged file (a crash after the rename, a partly copied cache) must not reach
    ``dlopen``: a truncated ELF file passes it and the process dies of SIGBUS on the first missing page."""
    try:
        return _digest_path(library).read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError:
        return False


def _publish(tmp: Path, target: Path) -> None:
    """Move the built ``tmp`` to ``target`` (atomically, its bytes on disk first), then record its digest
    (a reader between the two renames finds no matching digest and builds the same file itself)."""
    data = tmp.read_bytes()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    digest_tmp = _digest_path(tmp)
    digest_tmp.write_text(hashlib.sha256(data).hexdigest() + "\n")
    os.replace(digest_tmp, _digest_path(target))


def load(source: Path) -> ctypes.CDLL | None:
    """The C kernel built from ``source`` (a ``.c`` file), loaded; None when it cannot be (the reason is
    :func:`status`'s). Builds at most once per process and source (thread-safe); later calls return the
    same library. Takes a compiler run (about a second) the first time on a machine, then only a load."""
    key = str(source)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        library, reason = None, ""
        if os.environ.get("MIXPREC_C_KERNELS", "1") == "0":
            reason = "turned off by MIXPREC_C_KERNELS=0"
        elif (cc := compiler()) is None:
            reason = "no C compiler (set CC, or install cc, gcc or clang)"
        else:
            path, reason = _build(source, cc)
            if path is not None:
                try:
                    library = ctypes.CDLL(str(path))
                    _paths[key] = path
                except OSError as err:
                    reason = f"could not load {path}: {err}"
        if library is None:
            log.info("mixprec: C kernel %s not used: %s", source.name, reason)
        _loaded[key], _reasons[key] = library, reason
        return library


def status(source: Path) -> str:
    """Why :func:`load` gave None for ``source`` ("" when it loaded or was not tried yet)."""
    return _reasons.get(str(source), "")


def library_path(source: Path) -> Path | None:
    """The cached library file :func:`load` loaded for ``source`` in this process (None when it did not, or
    after :func:`reject`)."""
    return _paths.get(str(source)) if _loaded.get(str(source)) is not None else None


def reject(source: Path, reason: str) -> None:
    """Stop using the kernel of ``source`` in this process (e.g. it failed its caller's check against the
    reference): :func:`load` returns None from now on and :func:`status` says ``reason``."""
    with _lock:
        _loaded[str(source)], _reasons[str(source)] = None, reason
    log.warning("mixprec: C kernel %s not used: %s", source.name, reason)
