"""What this process trusts on a host it shares with other users: directories and files only it can write.

A kernel library loaded from a cache, a device lock and a network namespace's holder all live in a directory that
another local user must not have made first or be able to write: such a user could plant a library that then runs as
us, or point us at a namespace of theirs. Every check goes through a descriptor opened without following a symlink,
so what was checked is what is used. Standard library only: the emulator's processes use it too.
"""
from __future__ import annotations

import errno
import os
import stat

RUNTIME_ENV = "XDG_RUNTIME_DIR"  # /run/user/UID in a login session: the user's own (systemd's pam_systemd makes it)
RUNTIME_FIX = f"in a login session (it sets {RUNTIME_ENV} to /run/user/UID, a directory only you can write)"


class NotPrivate(Exception):
    """Directory or file `path` cannot be trusted: `detail` says why ("is owned by uid 1001, not by us (uid 1000)");
    `owner` is its uid when it exists (None: it could not be made or opened)."""

    def __init__(self, path: str, detail: str, owner: int | None = None) -> None:
        super().__init__(f"{path} {detail}")
        self.path, self.detail, self.owner = path, detail, owner


def problem(info: os.stat_result, kind: str = "directory", closed: bool = False) -> str:
    """"" when `info` is a `kind` ("directory", or "file": a regular one) owned by our effective uid and writable by
    nobody else (`closed`: not even readable or enterable by anyone else), else what is wrong with it."""
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not is_kind(info.st_mode):
        return "is a symlink" if stat.S_ISLNK(info.st_mode) else \
            f"is not a {'regular file' if kind == 'file' else kind}"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by us (uid {os.geteuid()})"
    mode = stat.S_IMODE(info.st_mode)
    bits = ((0o070, "group"), (0o007, "others")) if closed else ((0o020, "group"), (0o002, "others"))
    who = [name for bit, name in bits if mode & bit]
    if who:
        return f"is {'open to' if closed else 'writable by'} {' and '.join(who)} (mode {mode:o})"
    return ""


def open_directory(path: str, mode: int | None = 0o700, closed: bool = False) -> int:
    """A descriptor of directory `path`, made (with its parents) with `mode` when missing (None: never made), never
    opened through a symlink; NotPrivate when it cannot be made or opened, or `problem` finds it untrustworthy."""
    made = False
    if mode is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(path, mode)
            made = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise NotPrivate(path, f"cannot be made ({exc.strerror or exc})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY may say ENOTDIR of a symlink
            info = os.lstat(path)
            raise NotPrivate(path, problem(info) or "is not a directory", info.st_uid) from None
        raise NotPrivate(path, f"cannot be opened ({exc.strerror or exc})") from None
    info = os.fstat(fd)
    if made and mode is not None and info.st_uid == os.geteuid():
        os.fchmod(fd, mode)  # whatever the umask
        return fd
    wrong = problem(info, closed=closed)
    if wrong:
        os.close(fd)
        raise NotPrivate(path, wrong, info.st_uid)
    return fd


def user_directory() -> tuple[str, int]:
    """This user's own directory, $XDG_RUNTIME_DIR/aiofabric (0700, closed to others; $XDG_RUNTIME_DIR itself must
    be ours and writable by nobody else), and a descriptor of it. Never a name under /tmp, which another user could
    take first: without $XDG_RUNTIME_DIR, NotPrivate says so (path "$XDG_RUNTIME_DIR")."""
    runtime = os.environ.get(RUNTIME_ENV, "")
    if not os.path.isabs(runtime):
        raise NotPrivate(f"${RUNTIME_ENV}", "is not set")
    os.close(open_directory(runtime, None))
    return os.path.join(runtime, "aiofabric"), open_directory(os.path.join(runtime, "aiofabric"), 0o700, closed=True)
