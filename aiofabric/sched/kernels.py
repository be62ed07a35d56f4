"""Kernels: C source built with the system compiler into a cache and called through ctypes (which releases the GIL,
so two compute queues run in parallel threads), and the 0-d/1-d argument rule every kernel call obeys."""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CompilerNotFoundError, KernelBuildError
from ..util import c_build, private

DEFAULT_FLAGS = ("-O2", "-shared", "-fPIC")
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built kernels live: $AIOFABRIC_CACHE, else ~/.cache/aiofabric/kernels, else a fresh private temporary
    directory (this process's only; never a fixed name in the shared temp dir, which another user could make first). A directory is used only if it is private:
    not a symlink, owned by us, writable by nobody else (a kernel found there runs as us). $AIOFABRIC_CACHE that is
    not is an error naming it; a default that is not is skipped, with the reason logged."""
    configured = os.environ.get(c_build.CACHE_ENV)
    if configured:
        problem = _make_private(Path(configured))
        if problem:
            raise KernelBuildError(f"C kernel cache $AIOFABRIC_CACHE={configured} {problem}: refusing to build or "
                                   "load kernels there (point it at a directory only you can write)")
        return Path(configured)
    home = c_build.home_cache()
    if home is not None:
        problem = _make_private(home)
        if not problem:
            return home
        log.info("C kernel cache %s skipped: it %s", home, problem)
    global _private_fallback
    if _private_fallback is None:  # made 0700 by mkdtemp, under a name nobody could take first
        _private_fallback = Path(tempfile.mkdtemp(prefix="aiofabric-kernels-"))
        atexit.register(shutil.rmtree, _private_fallback, ignore_errors=True)
    return _private_fallback


_private_fallback: Path | None = None


def _make_private(path: Path) -> str:
    """Make `path` (mode 0700) if missing; "" when it is a private directory, else what is wrong with it ("is
    owned by uid 1001, not by us (uid 1000)")."""
    try:
        os.close(private.open_directory(str(path)))
    except private.NotPrivate as exc:
        return exc.detail
    return ""


class CKernel:
    """A C function `void name(...)` built from `source`. Its arguments are the call's buffers (outs, then ins) as
    pointers to their first element, then the scalars (Python int -> int64_t, float -> double).

    The shared object is cached by the hash of compiler, flags and source, so a second process (or a replay)
    never compiles again; `build` records the compiler, the flags, the path and whether the cache was hit.

    The kernel runs inside this process, in a worker thread, with the process's memory (MRs and rings included):
    nothing checks what it does. One that crashes (a bad pointer's SIGSEGV, an abort) kills the whole process at
    once, the event loop and every open NIC with it; no exception is raised, so no `CallError` or `except` can catch
    it (the emulators notice the driver died and exit). Try a new or untrusted kernel in a child process first:
    build and run it alone on inputs of the real sizes (`subprocess.run([sys.executable, "-c", ...])` or
    multiprocessing's "spawn" context), or run the whole batch there; the parent then sees the child's exit status
    (-SIGSEGV) and lives on."""

    def __init__(self, source: str, name: str, *, flags: tuple[str, ...] = DEFAULT_FLAGS,
                 compiler: str | None = None) -> None:
        # the name is the symbol ctypes looks up and part of the cached file's name: a C identifier has no "/" or
        # "..", so the library cannot land outside the cache
        if not isinstance(name, str) or not C_IDENTIFIER.fullmatch(name):
            raise ValueError(f"C kernel name must be a C identifier (ASCII letters, digits and _, not starting with a "
                             f"digit), not {name!r}")
        self.source, self.name, self.flags = source, name, tuple(flags)
        cc = compiler or os.environ.get("CC", "cc")
        path = shutil.which(cc)
        if path is None:
            raise CompilerNotFoundError(f"C kernel {name!r}: no C compiler {cc!r} on PATH (install gcc or clang, or "
                                        "set CC); numpy kernels work without one")
        digest = hashlib.sha256("\0".join((path, *self.flags, source)).encode()).hexdigest()[:24]
        cache = cache_dir()
        library = cache / f"{name}-{digest}.so"
        # The directory is opened once and everything below goes through that descriptor, so the files checked,
        # written and loaded are in the directory checked, even if its path is made to point elsewhere meanwhile.
        directory = _open_private_directory(cache)
        try:
            problem = c_build.library_problem(library.name, directory)
            cached = not problem
            if problem:  # missing, or not one we may load (planted, writable by others): build it (again)
                if problem != c_build.MISSING:
                    log.warning("C kernel %r: %s %s: not loading it, building it again", name, library, problem)
                self._compile(path, cc, library.name, directory)
                problem = c_build.library_problem(library.name, directory)
                if problem:
                    raise KernelBuildError(f"C kernel {name!r}: {library} {problem} after building it; refusing to "
                                           "load it")
            self.build = {"compiler": path, "flags": list(self.flags), "library": str(library), "cached": cached}
            # Only we (and root) can change the file now: its directory is ours alone and pinned by the descriptor.
            # (dlopen reuses a loaded library of the same path; the digest in the name stands for its content.)
            handle = ctypes.CDLL(f"/proc/self/fd/{directory}/{library.name}")
        finally:
            os.close(directory)
        try:
            self.function = getattr(handle, name)
        except AttributeError:
            raise KernelBuildError(f"C kernel {name!r}: the source defines no function {name!r}") from None
        self.function.restype = None

    def _compile(self, compiler: str, cc: str, filename: str, directory: int) -> None:
        c_file = f"{self.name}.c"
        try:
            c_build.build_into(lambda scratch: [compiler, *self.flags, "-o", str(scratch / filename),
                                                str(scratch / c_file)], {c_file: self.source}, filename, directory)
        except c_build.BuildFailed as failed:
            raise KernelBuildError(f"C kernel {self.name!r}: {cc} {' '.join(self.flags)} failed:\n{failed.stderr}") \
                from None

    def __repr__(self) -> str:
        return f"CKernel({self.name!r})"


def _open_private_directory(path: Path) -> int:
    """A descriptor of the cache directory `path`, checked private again through it (it was when cache_dir chose
    it; this pins the directory the checks hold for)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KernelBuildError(f"C kernel cache {path} cannot be opened ({exc.strerror}): refusing to use it") from exc
    problem = private.problem(os.fstat(fd))
    if problem:
        os.close(fd)
        raise KernelBuildError(f"C kernel cache {path} {problem}: refusing to build or load kernels there")
    return fd


def c_scalar(value: Any, call: str, index: int) -> Any:
    if isinstance(value, (bool, int, np.integer)):
        if not -1 << 63 <= int(value) < 1 << 63:  # ctypes would wrap it silently
            raise ValueError(f"{call}: scalar {index} = {value} does not fit a C int64_t")
        return ctypes.c_int64(int(value))
    if isinstance(value, (float, np.floating)):
        return ctypes.c_double(float(value))
    raise TypeError(f"{call}: scalar {index} is {type(value).__name__}; C kernels take int or float scalars")


def check_flat(array: Any, call: str, argument: str) -> np.ndarray:
    """The low-rank rule: kernel buffers are 0-d or 1-d numpy arrays. Anything else is refused, naming the call and
    the argument (flat buffers keep every kernel's indexing trivial and its byte range one interval)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{call}: argument {argument} is a {type(array).__name__}, not a numpy array")
    if array.ndim > 1:
        raise ValueError(f"{call}: argument {argument} is {array.ndim}-d (shape {array.shape}); kernel arguments "
                         "must be 0-d or 1-d: pass sched.flatten(x), a 1-d view whose writes land in x")
    return array


def flatten(*arrays: np.ndarray) -> np.ndarray | tuple[np.ndarray, ...]:
    """1-d views of n-d contiguous arrays: a kernel writing the view writes the original, so the result is already
    "reshaped back" (read it through the n-d array)."""
    views = []
    for i, array in enumerate(arrays):
        if not (array.flags.c_contiguous or array.ndim <= 1):
            raise ValueError(f"flatten: argument {i} (shape {array.shape}) is not C-contiguous; a flat view would be "
                             "a copy, whose writes never reach it (pass np.ascontiguousarray(x) and read that)")
        views.append(array.reshape(-1))
    return views[0] if len(views) == 1 else tuple(views)
