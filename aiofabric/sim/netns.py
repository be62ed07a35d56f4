"""When UDP 4791 is taken on loopback: the network namespace this user's emulators share instead.

A socket bound to 0.0.0.0:4791 (a user's, or rdma_rxe's in the kernel) denies every 127.0.0.x of the host, and would
receive what our NICs send there. An emulator that picks its own address then runs in a network namespace of this
user instead (join_private_netns, called by wire.open_wire), where no other user can bind anything: root's is `ip
netns` aiofabric-0, another user's a user+net namespace that a small process holds (hold_netns). All emulators of the
user that fall back join the same one, so NICs of different processes still reach each other there.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import time

from ..util import private

NETNS_DIR = "/run/netns"  # iproute2's: `ip netns add` bind-mounts its namespaces here (writable by root only)
ROOT_NETNS_LOCK = "/run/aiofabric-netns.lock"  # root's: serializes creating the namespace
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
HOLDER_POLL = 5.0  # seconds between a holder's looks for members; it exits after two looks that found none
HOLD_NETNS = "hold-netns"  # `python -m aiofabric.sim.netns hold-netns DIR`: a user namespace's holder
_libc = ctypes.CDLL(None, use_errno=True)


class NoPrivateNetns(Exception):
    """No private network namespace can be had here; the message says why."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, kind: int) -> None:
    _check(_libc.setns(fd, kind), "setns")


def _loopback_up() -> None:
    """Bring `lo` of the current network namespace up (a new namespace starts with it down: 127.0.0.x unbindable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack_from("16xH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[0]
        if not flags & _IFF_UP:
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def private_netns_name() -> str:
    return f"aiofabric-{os.geteuid()}"


def join_private_netns() -> str:
    """Move this (single-threaded) process into the network namespace that this user's emulators share when UDP 4791
    is unusable on the host's loopback, creating it if need be; its description for the warning. NoPrivateNetns
    with the reason when there is none to be had. Sockets already open stay where they are."""
    name = private_netns_name()
    if os.geteuid() == 0:
        _join_root_netns(name)
        return f"network namespace {name}"
    holder = _join_user_netns()
    return f"network namespace {name} (a user namespace held by pid {holder}: `nsenter -t {holder} -U -n`)"


def _join_root_netns(name: str) -> None:
    """Join `ip netns` `name`, creating it with `lo` up. Only root can create entries in NETNS_DIR, so a namespace
    found there is root's: checked, as are the directory's owner and mode."""
    os.makedirs(NETNS_DIR, mode=0o755, exist_ok=True)
    info = os.stat(NETNS_DIR)
    if info.st_uid != 0 or info.st_mode & 0o022:
        raise NoPrivateNetns(f"{NETNS_DIR} is not root's alone (owner uid {info.st_uid}, mode "
                             f"{stat.S_IMODE(info.st_mode):o})")
    # Our emulators create it one at a time (the lock goes with the descriptor). Not a lock on NETNS_DIR itself:
    # `ip netns add` waits for that one.
    lock = os.open(ROOT_NETNS_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = os.path.join(NETNS_DIR, name)
        if not os.path.exists(path):
            done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
            if done.returncode != 0:
                raise NoPrivateNetns(f"`ip netns add {name}` failed: {done.stderr.strip()}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_uid != 0:
                raise NoPrivateNetns(f"{path} is not root's (owner uid {os.fstat(fd).st_uid})")
            try:
                setns(fd, CLONE_NEWNET)
            except OSError as exc:  # EINVAL: a file that is no namespace (`ip netns add` interrupted)
                raise NoPrivateNetns(f"cannot join {path} ({exc.strerror}; `ip netns del {name}` removes it)") from exc
        finally:
            os.close(fd)
        _loopback_up()
    finally:
        os.close(lock)


def user_netns_dir() -> str:
    """This user's private directory for the holder's pid file and lock ($XDG_RUNTIME_DIR/aiofabric): refused unless
    it is ours and closed to others (another user could otherwise create it first and point us at a namespace of
    theirs), and never a name under /tmp."""
    try:
        path, fd = private.user_directory()
    except private.NotPrivate as exc:
        raise NoPrivateNetns(f"no directory for this user's namespace holder: {exc.path} {exc.detail}; "
                             f"run {private.RUNTIME_FIX}, or remove what is wrong") from None
    os.close(fd)
    return path


def _join_user_netns() -> int:
    """Join the user+net namespace this user's holder process keeps (starting one if none runs); the holder's pid."""
    directory = user_netns_dir()
    lock = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # against other emulators and the holder deciding to exit
        pid_file = os.path.join(directory, "netns.pid")
        pid = _live_holder(pid_file)
        if pid is None:
            pid = _start_holder(directory)
            with open(pid_file + ".new", "w") as f:
                f.write(f"{pid}\n")
            os.replace(pid_file + ".new", pid_file)
        user = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            setns(user, CLONE_NEWUSER)  # the namespace's owner (us) has every capability in it: enough to join its net
            setns(net, CLONE_NEWNET)
        except OSError as exc:
            raise NoPrivateNetns(f"cannot join the namespace of pid {pid} ({exc.strerror})") from exc
        finally:
            os.close(user)
            os.close(net)
        return pid
    finally:
        os.close(lock)


def _live_holder(pid_file: str) -> int | None:
    """The pid in `pid_file` if it is still a holder process of this user (not a reused pid)."""
    try:
        with open(pid_file) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None
    return pid if owner == os.geteuid() and HOLD_NETNS.encode() in command else None


def _start_holder(directory: str) -> int:
    """Start a holder (hold_netns) and wait, bounded, until it has its namespace up; its pid."""
    holder = subprocess.Popen([sys.executable, "-m", __name__, HOLD_NETNS, directory], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    assert holder.stdout is not None
    ready, _, _ = select.select([holder.stdout], [], [], 20)
    answer = holder.stdout.readline().decode().strip() if ready else "no answer in 20 s"
    holder.stdout.close()
    if answer != "ready":
        holder.kill()
        holder.wait()
        raise NoPrivateNetns(f"cannot create a user and network namespace: {answer or 'the holder exited'} "
                            "(see user.max_user_namespaces, kernel.unprivileged_userns_clone)")
    return holder.pid


def hold_netns(directory: str) -> None:
    """The holder: a new user namespace (this user mapped to itself) and network namespace with `lo` up, kept for as
    long as other processes are in it. Exits after two looks HOLDER_POLL apart found nobody else, under the lock, so
    an emulator never joins one on its way out."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        _loopback_up()
    except OSError as exc:
        print(f"{exc.strerror or exc}", flush=True)
        return
    print("ready", flush=True)
    os.close(1)
    own = os.stat("/proc/self/ns/net").st_ino
    lock = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_NOFOLLOW)
    idle = 0
    while idle < 2:
        time.sleep(HOLDER_POLL)
        fcntl.flock(lock, fcntl.LOCK_EX)
        idle = 0 if _others_in_netns(own) else idle + 1
        if idle < 2:
            fcntl.flock(lock, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):  # still holding the lock: nobody reads it before it is gone
        os.unlink(os.path.join(directory, "netns.pid"))


def _others_in_netns(inode: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    return True
    return False


if __name__ == "__main__" and sys.argv[1:2] == [HOLD_NETNS]:
    hold_netns(sys.argv[2])
