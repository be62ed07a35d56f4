"""Kernels: C source built with the system compiler into a cache and called through ctypes (which releases the GIL,
so two compute queues run in parallel threads), and the 0-d/1-d argument rule every kernel call obeys."""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CompilerNotFoundError, KernelBuildError

DEFAULT_FLAGS = ("-O2", "-shared", "-fPIC")
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def cache_dir() -> Path:
    """Where built kernels live: $AIOFABRIC_CACHE, else ~/.cache/aiofabric/kernels, else a temporary directory."""
    for candidate in (os.environ.get("AIOFABRIC_CACHE"), Path.home() / ".cache" / "aiofabric" / "kernels"):
        if candidate:
            path = Path(candidate)
            try:
                path.mkdir(parents=True, exist_ok=True)
                if os.access(path, os.W_OK):
                    return path
            except OSError:
                pass
    path = Path(tempfile.gettempdir()) / f"aiofabric-kernels-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


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
        library = cache_dir() / f"{name}-{digest}.so"
        cached = library.exists()
        if not cached:
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                c_file, so_file = Path(scratch) / f"{name}.c", Path(scratch) / f"{name}.so"
                c_file.write_text(source)
                process = subprocess.run([path, *self.flags, "-o", str(so_file), str(c_file)],
                                         capture_output=True, text=True)
                if process.returncode != 0:
                    raise KernelBuildError(f"C kernel {name!r}: {cc} {' '.join(self.flags)} failed:\n"
                                           f"{process.stderr.strip()}")
                os.replace(so_file, library)  # atomic: concurrent builders never see half a file
        self.build = {"compiler": path, "flags": list(self.flags), "library": str(library), "cached": cached}
        try:
            self.function = getattr(ctypes.CDLL(str(library)), name)
        except AttributeError:
            raise KernelBuildError(f"C kernel {name!r}: the source defines no function {name!r}") from None
        self.function.restype = None

    def __repr__(self) -> str:
        return f"CKernel({self.name!r})"


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
