"""What one RC QP's requester and responder need from the data path around them: the `QpPort`.

The requester (requester.py, completer.py) and responder (responder.py) are sans-IO engines of one QP. The data path
(datapath.py) owns them, one pair per QP inside a `QpContext`, and that context is their port: the QP and the host
memory they work on, where their packets go, the counters they keep, and the few things only the data path can do
(schedule a timer, post a CQE, fail the QP, collect an owed ACK). A CQE goes straight to the data path's `post_cqe`,
an owed ACK onto its `acks_due`: no call in between. They import this module, never the data path.

`PlacedCounts` (what a QP placed in memory) and `PlacementFaults` (deliberate placement bugs for tests, placement.py)
are shared through the port too; the data path reports the one and arms the other from its debug channel.
"""
from __future__ import annotations

import collections
from typing import Callable, Protocol

from .memory import BusMemory
from .native import Core
from .objects import CompletionQueue, MemoryRegion, QueuePair
from .packets import Outgoing
from .pcie import PcieFunction
from .placement import PlacedCounts, PlacementFaults

# what every packet of a QP carries: dest QP, P_Key, source and destination IPv4, UDP source port, TOS, TTL
Address = tuple[int, int, str, str, int, int, int]


class PostCqe(Protocol):
    def __call__(self, cq: CompletionQueue, cqe: bytes, solicited: bool = False) -> None:
        """Write a CQE (counting a CQ overflow, and reporting it once, if it does not fit)."""


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
    pcie: PcieFunction  # the function's PCIe side: whether an atomic may reach host memory
    post_cqe: PostCqe  # the data path's own
    acks_due: list[Callable[[], None]]  # where the responder puts its flush_ack when it owes an ACK at the batch's end
    core: Core | None  # the compiled core the requester's WQE blocks use (native.py), if there is one

    def wake(self) -> None:
        """The requester may have packets to send: schedule it for the next pump."""

    def schedule(self, when: float) -> None:
        """Call the requester's on_timer no later than `when`."""

    def fail_qp(self, req_reason: int = 0, res_reason: int = 0) -> None:
        """Move the QP to ERR for a protocol or memory error: flush it, tell the driver on the CREQ with these
        creq_qp_error_notification reasons."""
