"""What an unauthenticated client of `bench --server` may make the server do: pure, no I/O.

A TCP client is anyone who can reach the port, so the server decides everything that touches its host (which NIC,
its address, capture files, namespaces: `ServerPolicy`), bounds what one client can hold (`Limits`), and lets its
QPs talk only to the client that asked (`check_peer`). The request loop (`serve.serve_stream`) applies them; the
requests themselves are narrowed to the bench exchange by `operations.BENCH`.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
from typing import Any, Union

from .protocol import MAX_DEPTH, MAX_LINE, printable
from ..errors import NotAllowed, ParameterMismatch

log = logging.getLogger(__name__)
# A --forever server's captures: at most PCAP_MAX_FILES files (FILE, FILE.1, ...) of at most PCAP_MAX_BYTES each, so
# clients cannot fill the server's disk (16 GiB at worst). A default bench write run (5000 x 65536 bytes) captures
# about 350 MB, so a file holds a default run a few times over; 16 files are a session's first clients.
PCAP_MAX_BYTES = 1 << 30
PCAP_MAX_FILES = 16

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per client. `nics`: NICs open at once (perftest uses one); `memory`: DMA memory its NICs hold (registered
    memory, queue rings and each NIC's own, in bytes); `in_flight`: requests running at once; `line`: bytes per
    request line; `depth`: JSON nesting; `idle`: seconds without a request (or without reading an answer) before
    the client is dropped, so the next one is served."""
    nics: int = 1
    memory: int = 1 << 30
    in_flight: int = 64
    line: int = MAX_LINE
    depth: int = MAX_DEPTH
    idle: float = 60.0

    def __post_init__(self) -> None:
        for name in ("nics", "memory", "in_flight", "line", "depth"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"limit {name} must be at least 1, not {getattr(self, name)}")
        if not self.idle > 0:
            raise ValueError(f"limit idle must be a positive number of seconds, not {self.idle}")


@dataclasses.dataclass
class ServerPolicy:
    """The server's own choices for its clients' NICs. `nic`: the NIC spec every client's `open_nic` opens; `ip`:
    its address (None: the address the client's connection reached; over loopback, a free 127.0.0.x); `pcap`: a
    capture file (the first NIC writes FILE, later ones FILE.1, FILE.2, ..., up to `pcap_max_files` files of at most
    `pcap_max_bytes` bytes each; NICs past the last file are not captured); `allow_peers`: networks a server QP may
    connect to besides the client's own address (for NICs whose RoCE address is not the one the TCP connection comes
    from)."""
    nic: str = "sim"
    ip: str | None = None
    pcap: str | None = None
    pcap_max_bytes: int = PCAP_MAX_BYTES
    pcap_max_files: int = PCAP_MAX_FILES
    allow_peers: tuple[Network, ...] = ()
    limits: Limits = dataclasses.field(default_factory=Limits)
    tool: str = "bench"  # the exchange clients may run (operations.PROFILES): "bench" or "lat"
    expect: dict[str, Any] = dataclasses.field(default_factory=dict)  # the parameters clients must run with
    flags: dict[str, str] = dataclasses.field(default_factory=dict)  # how `expect`'s names are spelled, for errors
    _opened: itertools.count = dataclasses.field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if self.pcap_max_files < 1:
            raise ValueError(f"pcap_max_files must be at least 1, not {self.pcap_max_files}")
        if self.pcap_max_bytes < 24:  # the pcap file header
            raise ValueError(f"pcap_max_bytes must be at least 24 (the pcap file header), not {self.pcap_max_bytes}")

    def nic_options(self) -> dict[str, Any]:
        """The emulator options of the next NIC a client opens (a PCI NIC takes none)."""
        if not self.nic.startswith("sim") or self.pcap is None:
            return {}
        number = next(self._opened)
        if number >= self.pcap_max_files:
            if number == self.pcap_max_files:
                log.warning("%s: %d capture files written (the server's --pcap-max-files); the NICs of later "
                            "clients are not captured", self.pcap, self.pcap_max_files)
            return {}
        return {"pcap": self.pcap if number == 0 else f"{self.pcap}.{number}", "pcap_max_bytes": self.pcap_max_bytes}

    def check_params(self, params: dict[str, Any]) -> None:
        """Refuse (ParameterMismatch, one line naming both sides) a client whose parameters differ from the ones
        this server was started with (`expect`: lat's test, size and MTU; bench's symmetric flags), as perftest's
        two sides refuse each other."""
        differ = [name for name, mine in self.expect.items() if params.get(name) != mine]
        if differ:  # the client's values are escaped: the message is printed and logged on the server
            theirs = printable(", ".join(f"{name} {params.get(name)}" for name in differ))
            ours = ", ".join(f"{name} {self.expect[name]}" for name in differ)
            spelled = [self.flags.get(name, name) for name in self.expect]
            raise ParameterMismatch(f"the two sides' parameters differ: the client runs {theirs}, the server "
                                    f"{ours}; start both with the same {', '.join(spelled[:-1])} and {spelled[-1]}")

    def check_peer(self, gid: str, client: str) -> None:
        """Refuse (NotAllowed) a QP peer whose GID (32 hex digits) is neither the address `client` connected from
        nor inside `allow_peers`: the server's packets go only to whoever asked for them."""
        peer = ipaddress.IPv6Address(bytes.fromhex(gid))
        address = unmapped(str(peer))
        if address == unmapped(client) or any(address in network for network in self.allow_peers):
            return
        raise NotAllowed(f"connect_qp: the peer's address {address} (its GID) is not the one this client connected from "
                         f"({client}): a server QP talks only to the client that asked for it (the server's "
                         "--allow-peer NETWORK widens this)")


def unmapped(address: str) -> Address:
    """`address` as IPv4 when it is IPv4 or an IPv4-mapped IPv6 address (a dual-stack socket's view of one)."""
    parsed = ipaddress.ip_address(address)
    return parsed.ipv4_mapped or parsed if isinstance(parsed, ipaddress.IPv6Address) else parsed
