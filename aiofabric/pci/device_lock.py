"""Taking a PCI function for this process: the pre-flight's verdict at open (`claim`) and the per-device lock.

`claim` runs the pre-flight checks (`preflight`): it refuses the function when its identity or binding is wrong or
another process holds it, logs every other failure as a warning, and takes the lock, held until the device closes.
"""
from __future__ import annotations

import fcntl
import logging
import os

from .preflight import (LOCK_DIR, Access, Finding, Host, Target, check_function, check_quiesced, read_number, read_text,
                        refusal)
from ..errors import PCIError
from ..util import private

log = logging.getLogger("aiofabric.pci.preflight")  # its warnings are the pre-flight's
FATAL_AT_OPEN = ("present", "device_id", "driver")  # the lock too: without these the open refuses the function


class _NoLockDirectory(Exception):
    """No directory we may keep device locks in: why (`detail`) and what fixes it (`fix`)."""

    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail, self.fix = detail, fix


def _lock_directory(preferred: str) -> tuple[str, int]:
    """The directory device locks live in, and a descriptor of it that every check went through: `preferred`
    (/run/aiofabric, which only root can make) when we can make or use it, else, for a user who cannot, their own
    $XDG_RUNTIME_DIR/aiofabric (0700). Locks need not be shared across users: only root can reach a function
    through sysfs, and VFIO lets one process at a time open a group. Never a shared name under /tmp, which another
    user could take first; a directory we did not just make must be ours and writable by nobody else (a user
    finding root's /run/aiofabric goes to their own)."""
    try:
        return preferred, private.open_directory(preferred, 0o755)
    except private.NotPrivate as exc:
        if os.geteuid() == 0 or exc.owner not in (None, 0):  # root's own, or someone else's: not to go around
            fix = f"mkdir -m 755 {preferred}" if exc.owner is None else \
                f"remove it unless it was made so on purpose (rm -r {preferred}); aiofabric makes it again"
            raise _NoLockDirectory(f"the device-lock directory {preferred} {exc.detail}", fix) from None
        why = f"{preferred} {exc.detail}"  # a user cannot make /run/aiofabric, or it is root's: use their own
    fix = f"run as root, or {private.RUNTIME_FIX}"
    try:
        return private.user_directory()
    except private.NotPrivate as exc:
        if exc.path == f"${private.RUNTIME_ENV}":
            raise _NoLockDirectory(f"no directory for device locks: {why}, and {private.RUNTIME_ENV} is not set (a "
                                   f"user's locks live in ${private.RUNTIME_ENV}/aiofabric, never under a name in "
                                   "/tmp another user could take first)", fix) from None
        raise _NoLockDirectory(f"no directory for device locks: {why}, and {exc.path} {exc.detail}", fix) from None


def _take(address: str, directory: str) -> tuple[int, str, int | None]:
    """Try to lock `address`: (fd, path, None) when taken, (-1, path, the pid its holder wrote, if any) when not.
    Raises _NoLockDirectory when no directory may hold locks."""
    parent, parent_fd = _lock_directory(directory)
    path = os.path.join(parent, f"{address}.lock")
    try:
        fd = os.open(f"{address}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644,
                     dir_fd=parent_fd)
    except OSError as e:
        raise PCIError(f"cannot open the lock file of {address} ({path}): {e.strerror}") from e
    finally:
        os.close(parent_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_number(os.pread(fd, 32, 0).decode(errors="replace").strip())
        os.close(fd)
        return -1, path, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, path, None


def _busy(address: str, path: str, pid: int | None) -> Finding:
    if pid is None:  # its holder has not written its pid yet
        return Finding("lock", False, f"{address} is in use by another process (lock {path})", f"fuser -v {path}",
                       address=address)
    name = read_text(f"/proc/{pid}/comm") or "gone"
    return Finding("lock", False, f"{address} is in use by pid {pid} ({name}) (lock {path})",
                   f"kill {pid}  # or wait for it to close the device", address=address)


class DeviceLock:
    """An exclusive flock on `<directory>/<address>.lock`, held from a device's open to its close: a second open of
    the same function, by another process or this one, fails at once naming the holder. The kernel drops a flock when
    its holder dies, so the file a killed process leaves behind blocks nobody. The seam's backends take one."""

    def __init__(self, address: str, directory: str = LOCK_DIR) -> None:
        try:
            self._fd, self.path, holder = _take(address, directory)
        except _NoLockDirectory as exc:
            raise refusal(Finding("lock", False, exc.detail, exc.fix, address=address)) from None
        if self._fd < 0:
            raise refusal(_busy(address, self.path, holder))

    def release(self) -> None:
        """Let the function go (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def check_lock(address: str, host: Host) -> Finding:
    """Whether the function is free, without keeping it."""
    try:
        fd, path, holder = _take(address, host.locks)
    except _NoLockDirectory as exc:
        return Finding("lock", False, exc.detail, exc.fix, address=address)
    if fd < 0:
        return _busy(address, path, holder)
    os.close(fd)
    return Finding("lock", True, f"no other process holds {address} (lock {path})", address=address)


def claim(address: str, host: Host = Host(), access: Access = "vfio") -> DeviceLock:
    """The pre-flight of a seam's open: refuse the function when it is absent, not a supported chip, bound to the
    wrong driver or held by another process; log every other failed check; take its lock, to hold until close."""
    for finding in check_function(address, host, access):
        if finding.ok:
            continue
        if finding.name in FATAL_AT_OPEN:
            raise refusal(finding)
        log.warning("%s: pre-flight %s", address, finding.line())
    lock = DeviceLock(address, host.locks)
    quiesced = check_quiesced(Target.of(address, host, access))
    if not quiesced.ok:
        log.warning("%s: pre-flight %s", address, quiesced.line())
    return lock
