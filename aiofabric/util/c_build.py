"""C built into a private cache: the scheduler's kernels (sched/kernels.py) and the emulator's compiled core
(sim/native.py) are shared objects kept in a directory only we can write (util.private), since a library found there
runs as us. A library is checked before it is loaded and installed by an atomic rename, so a concurrent builder or
loader never sees half a file. Standard library only: the emulator's processes use it too."""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from . import private

MISSING = "is missing"
CACHE_ENV = "AIOFABRIC_CACHE"  # the cache's directory, when set


def home_cache() -> Path | None:
    """~/.cache/aiofabric/kernels, or None when there is no home (no $HOME and no passwd entry, or a home that does
    not exist, such as a service user's HOME=/nonexistent: a home is never made)."""
    try:
        home = Path.home()
    except RuntimeError:
        return None
    return home / ".cache" / "aiofabric" / "kernels" if home.is_dir() else None


class BuildFailed(Exception):
    """The compiler said no: `stderr` is what it printed."""

    def __init__(self, stderr: str) -> None:
        super().__init__(stderr)
        self.stderr = stderr


def library_problem(filename: str, directory: int) -> str:
    """"" when `filename` in `directory` is a regular file (not a symlink) owned by us that nobody else can write;
    MISSING when there is none; else what is wrong with it."""
    try:
        fd = os.open(filename, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,  # NONBLOCK: a FIFO too
                     dir_fd=directory)
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
    try:
        return private.problem(os.fstat(fd), "file")
    finally:
        os.close(fd)


def build_into(command: Callable[[Path], list[str]], sources: dict[str, str], filename: str, directory: int,
               timeout: float | None = None) -> None:
    """Write `sources` ({file name: text}) into a fresh private scratch directory, run `command(scratch)` (it writes
    `filename` there; run in this process's working directory, where a user's relative flags such as -Iinclude
    mean what they say), then copy the result into `directory` under a temporary name and rename it into place.
    BuildFailed if the compiler fails."""
    with tempfile.TemporaryDirectory(prefix="aiofabric-build-") as scratch:
        for file, text in sources.items():
            (Path(scratch) / file).write_text(text)
        done = subprocess.run(command(Path(scratch)), capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise BuildFailed(done.stderr.strip())
        partial = f".{filename}.{os.getpid()}.{secrets.token_hex(4)}"
        # 0755 whatever the umask: a group-writable library would not be loaded
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o755,
                     dir_fd=directory)
        try:
            try:
                os.fchmod(fd, 0o755)
                with open(fd, "wb", closefd=False) as out:
                    out.write((Path(scratch) / filename).read_bytes())
            finally:
                os.close(fd)
            os.replace(partial, filename, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=directory)
            raise
