"""The emulated NIC's wire, opened: its transport by name (transport.py says what they share), on the address it was
given or the first free 127.0.0.x, or in this user's private network namespace (netns.py) when UDP 4791 is taken on
every 127.0.0.x, with whose socket holds it named (`port_holder`)."""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pwd
import sys
from typing import Any, Iterator

from .netns import CLONE_NEWNET, NoPrivateNetns, join_private_netns, private_netns_name, setns
from .packets import ROCE_PORT
from .phy_loopback import LoopbackTransport
from .raw import RawTransport
from .transport import Transport
from .udp import PortTaken, UdpTransport


TRANSPORTS: dict[str, type[Transport]] = {"udp": UdpTransport, "raw": RawTransport, "loopback": LoopbackTransport}


def open_transport(kind: str, ip: str, **kwargs) -> Transport:  # noqa: ANN003 - the chosen class's keywords
    """A transport by name: "udp" (default choice, unprivileged), "raw" (CAP_NET_RAW) or "loopback"."""
    try:
        cls = TRANSPORTS[kind]
    except KeyError:
        raise ValueError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}") from None
    return cls(ip, **kwargs)


LOOPBACK_HOSTS = range(2, 255)  # 127.0.0.2 .. 127.0.0.254: 127.0.0.1 is left to everything else on the host


def open_on_free_loopback(kind: str, first_host: int, **kwargs) -> Transport:  # noqa: ANN003 - as open_transport
    """A transport on the first 127.0.0.x, trying host numbers from `first_host` on (wrapping), whose RoCE port is free.

    The bind is the test, and the socket stays bound: of several processes racing for one address exactly one wins
    and the others move on to the next (probing with a throwaway bind and binding later would let two pick the same).
    """
    count = len(LOOPBACK_HOSTS)
    start = (first_host - LOOPBACK_HOSTS.start) % count
    for i in range(count):
        ip = f"127.0.0.{LOOPBACK_HOSTS[(start + i) % count]}"
        try:
            return open_transport(kind, ip, **kwargs)
        except PortTaken:
            pass
    raise PortTaken(f"127.0.0.{LOOPBACK_HOSTS[start]}", f"UDP port {ROCE_PORT} is taken on every address from "
                    f"127.0.0.{LOOPBACK_HOSTS[0]} to 127.0.0.{LOOPBACK_HOSTS[-1]}")


def port_holder(ip: str) -> str | None:
    """Whose socket keeps UDP (ip, 4791) from being bound in this network namespace, in words: "nc (pid 12, user
    bob)", or None if no socket shows in /proc/net/udp{,6}. Only the owner's processes are looked through, unless root
    (a socket no process holds is the kernel's, such as rdma_rxe's)."""
    wanted = ipaddress.IPv4Address(ip)
    found: tuple[int, int, int] | None = None  # (rank: exact address first, uid, inode)
    for table, width in (("/proc/net/udp", 4), ("/proc/net/udp6", 16)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, port = fields[1].partition(":")
            if int(port, 16) != ROCE_PORT:
                continue
            raw = b"".join(int(address[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, width * 2, 8))
            local = ipaddress.ip_address(raw)
            if isinstance(local, ipaddress.IPv6Address):  # a dual-stack socket: :: or ::ffff:a.b.c.d
                local = local.ipv4_mapped or (ipaddress.IPv4Address(0) if local.is_unspecified else local)
            rank = 0 if local == wanted else 1 if local == ipaddress.IPv4Address(0) else None
            if rank is not None and (found is None or rank < found[0]):
                found = (rank, int(fields[7]), int(fields[9]))
    if found is None:
        return None
    _, uid, inode = found
    user = _user_name(uid)
    owner = _socket_process(inode, uid)
    if owner is not None:
        return f"{owner[1]} (pid {owner[0]}, user {user})"
    if os.geteuid() == 0 and uid == 0:
        return "a socket of no process (the kernel's: rdma_rxe binds 4791 on every address)"
    return f"a socket of user {user} (its process is not one we may look at)"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _socket_process(inode: int, uid: int) -> tuple[int, str] | None:
    """(pid, command) of a process with socket `inode` open among those we may look at, or None."""
    if inode == 0:
        return None
    target = f"socket:[{inode}]"
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid and os.geteuid() != 0:
                continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") == target:
                    with open(f"/proc/{entry}/comm") as f:
                        return int(entry), f.read().strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None


class StartupError(Exception):
    """The emulator cannot start as configured; the message goes to the driver as the reason."""


class Moved:
    """Where this process went when UDP 4791 was unusable on its loopback: every NIC without ip= it serves from then on
    binds in that namespace too (they stay together; an unprivileged process could not move back anyway)."""

    name: str | None = None  # the namespace, once moved
    notice: str | None = None  # what happened and why, in one line
    home: int | None = None  # the network namespace the process started in, and the one it moved to (descriptors)
    away: int | None = None


def open_wire(kind: str, ip: str | None, netns: str | None,
              options: dict[str, Any]) -> tuple[Transport, str | None, str | None]:
    """The NIC's transport, the network namespace it binds in (None: the host's) and the notice if this process had
    to move there. An address the user gave (ip=) is bound where the process started or not at all; without one, the
    first free 127.0.0.x from a pid-derived start (concurrent NICs do not collide), or, when the port is taken on
    all of them (a wildcard socket, rdma_rxe), one in this user's private namespace (netns.join_private_netns)."""
    if ip:
        with _at_home(ip):
            try:
                return open_transport(kind, ip, **options), netns, None
            except PortTaken as exc:
                raise StartupError(f"{exc.strerror} by {port_holder(ip) or 'another socket'}; the NIC was given this "
                                   "address (ip=), so it does not move to another (leave ip= out to let it pick "
                                   "one)") from exc
    first = LOOPBACK_HOSTS.start + os.getpid() % len(LOOPBACK_HOSTS)
    if Moved.name is not None:
        return open_on_free_loopback(kind, first, **options), Moved.name, Moved.notice
    try:
        return open_on_free_loopback(kind, first, **options), netns, None
    except PortTaken as exc:
        holder = port_holder(exc.ip) or "another socket"
        everywhere = f"UDP {ROCE_PORT} is taken on every 127.0.0.x"
        if netns is not None:  # the user's choice of place: not ours to change
            raise StartupError(f"{everywhere} in network namespace {netns} (on {exc.ip} by {holder}); netns= was "
                               "given, so the NIC does not move to another namespace") from exc
        home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            where = join_private_netns()
        except (NoPrivateNetns, OSError) as why:
            os.close(home)
            raise StartupError(f"{everywhere} (on {exc.ip} by {holder}), and no private network namespace can be had "
                               f"instead: {why}. Free the port (rdma_rxe: `modprobe -r rdma_rxe`), run as root, or "
                               "give netns=NAME") from exc
        taken = f"UDP {ROCE_PORT} on {exc.ip} is held by {holder}"
        Moved.name, Moved.home = private_netns_name(), home
        Moved.away = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        Moved.notice = f"{taken}; the emulated NICs of this user run in {where} instead"
        logging.getLogger("aiofabric.sim").info("%s", Moved.notice)
        return open_on_free_loopback(kind, first, **options), Moved.name, Moved.notice


@contextlib.contextmanager
def _at_home(ip: str) -> Iterator[None]:
    """Bind in the network namespace this process started in, back from the private one if it moved there."""
    if Moved.home is None or Moved.away is None:
        yield
        return
    try:
        setns(Moved.home, CLONE_NEWNET)
    except OSError as exc:  # a user namespace's member has no rights over the host's network namespace
        why = (Moved.notice or "").split(";")[0]
        raise StartupError(f"ip={ip}: this emulator process runs its NICs in {Moved.name} ({why}) and cannot bind on "
                           f"the host from there ({exc.strerror}); open this NIC in a process of its own (without "
                           "process=)") from exc
    try:
        yield
    finally:
        setns(Moved.away, CLONE_NEWNET)
