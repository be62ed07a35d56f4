"""What one RC QP's requester and responder need from the data path around them: the `QpPort`.

The requester (requester.py) and responder (responder.py) are sans-IO engines of one QP. The data path (datapath.py)
owns them, one pair per QP inside a `QpContext`, and that context is their port: the QP and the host memory they
work on, where their packets go, the counters they keep, and the few things only the data path can do (schedule a
timer, post a CQE, fail the QP, collect an owed ACK). They import this module, never the data path.

`PlacedCounts` (what a QP placed in memory) and `PlacementFaults` (deliberate placement bugs for tests) are shared
through the port too; the data path reports the one and arms the other from its debug channel.
"""
from __future__ import annotations

import collections
from typing import Protocol, Union

from .memory import BusMemory
from .objects import CompletionQueue, MemoryRegion, QueuePair
from .packets import Packet, Segments

# what every packet of a QP carries: dest QP, P_Key, source and destination IPv4, UDP source port, TOS, TTL
Address = tuple[int, int, str, str, int, int, int]
Outgoing = Union[Packet, Segments]


class PlacedCounts:
    """What one QP placed in memory since it was created, each message counted once, when its last packet landed
    (duplicates and retransmissions never count twice). Responder side: WRITE (with or without immediate) and SEND
    payloads, and the atomics it executed (8 bytes each; a duplicate answered from its saved result is not executed
    again); requester side: READ response payloads."""

    FIELDS = ("write_messages", "write_bytes", "send_messages", "send_bytes", "read_messages", "read_bytes",
              "atomic_messages", "atomic_bytes")
    __slots__ = ("qp", *FIELDS)

    def __init__(self, qp: QueuePair | None = None) -> None:
        self.qp = qp
        self.write_messages = self.write_bytes = self.send_messages = self.send_bytes = 0
        self.read_messages = self.read_bytes = self.atomic_messages = self.atomic_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}


PLACEMENT_FAULTS = ("skip_placement", "misplace")


class PlacementFaults:
    """Deliberate placement bugs, so tests can prove a verification fails when it should: the next `count` WRITE
    messages carrying data are acknowledged as usual but not placed ("skip_placement"), or placed `misplace_offset`
    bytes off ("misplace"). Each one taken counts in stats as faulted_<kind>."""

    def __init__(self, stats: collections.Counter[str]) -> None:
        self.stats = stats
        self.counts = dict.fromkeys(PLACEMENT_FAULTS, 0)
        self.misplace_offset = 0
        self.armed = False  # any count left: an attribute, as the responder looks at it per WRITE message

    def inject(self, kind: str, count: int, offset: int = 0) -> None:
        """Arm `count` faults of `kind` (replacing any pending count of that kind; 0 cancels it)."""
        if kind not in PLACEMENT_FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}; choose one of {', '.join(PLACEMENT_FAULTS)}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"fault count must be a non-negative integer, not {count!r}")
        if kind == "misplace":
            if not isinstance(offset, int) or not offset:
                raise ValueError(f"misplace needs a non-zero integer offset, not {offset!r}")
            self.misplace_offset = offset
        self.counts[kind] = count
        self.armed = any(self.counts.values())

    def take(self) -> str | None:
        """The fault the WRITE message starting now suffers, if any (and one fewer is left)."""
        for kind in PLACEMENT_FAULTS:
            if self.counts[kind]:
                self.counts[kind] -= 1
                self.armed = any(self.counts.values())
                self.stats[f"faulted_{kind}"] += 1
                return kind
        return None


class QpPort(Protocol):
    """One QP's view of the data path (implemented by datapath.QpContext)."""

    qp: QueuePair
    address: Address  # refreshed when MODIFY_QP changes the path
    peer_ip: str  # the source address every packet of this QP must carry (the data path drops others)
    placed: PlacedCounts
    mem: BusMemory
    mrs: dict[int, MemoryRegion]  # the function's memory regions by key
    stats: collections.Counter[str]  # the data path's counters
    outbox: list[Outgoing]  # packets to transmit
    faults: PlacementFaults

    def wake(self) -> None:
        """The requester may have packets to send: schedule it for the next pump."""

    def schedule(self, when: float) -> None:
        """Call the requester's on_timer no later than `when`."""

    def post_cqe(self, cq: CompletionQueue, cqe: bytes, solicited: bool = False) -> None:
        """Write a CQE (counting a CQ overflow, and reporting it once, if it does not fit)."""

    def fail_qp(self, req_reason: int = 0, res_reason: int = 0) -> None:
        """Move the QP to ERR for a protocol or memory error: flush it, tell the driver on the CREQ with these
        creq_qp_error_notification reasons."""

    def owe_ack(self) -> None:
        """The responder owes a coalesced ACK: call its flush_ack at the end of this receive batch."""
