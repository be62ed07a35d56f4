"""The emulated NIC's Ethernet port: its link and MTU as the firmware reports them (PORT_PHY_QCFG, FUNC_QCFG), and
what the wire does with them. Its PHY (phy.py) brings the link up and down. A port whose link is down carries nothing,
either way, until it is up again (it starts down: a driver brings it up); one whose
MTU a packet exceeds drops it, as a real port (or the switch behind it) drops an oversized frame: a path MTU of 4096
on a 1500-byte fabric loses every full packet and the requester retries until it gives up (sans-IO).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .codec import header_size
from .packets import ICRC_SIZE, IPV4_HEADER_SIZE, UDP_HEADER_SIZE, Op, Outgoing, Packet, Segments, segmented
from ..hw.verbs import PATH_MTU_BYTES

DEFAULT_MTU = 9000  # a jumbo-frame fabric: every path MTU fits (4096 needs 4192, Linux's iboe_get_mtu)
MIN_MTU, MAX_MTU = 576, 9500  # the datagram every IPv4 host takes; bnxt_en's BNXT_MAX_MTU
_LARGEST_FRAME = (IPV4_HEADER_SIZE + UDP_HEADER_SIZE + max(header_size(op) for op in Op) + max(PATH_MTU_BYTES.values())
                  + 3 + ICRC_SIZE)  # no packet is longer: a port with this MTU never looks at one
Item = TypeVar("Item", Packet, Outgoing)


def check_mtu(mtu: Any, name: str = "port_mtu") -> int:
    """`mtu` if it is a port MTU this emulator takes; ValueError naming `name` if not."""
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not MIN_MTU <= mtu <= MAX_MTU:
        raise ValueError(f"{name}={mtu!r}: must be an integer in [{MIN_MTU}, {MAX_MTU}] bytes")
    return mtu


def frame_size(item: Packet | Segments) -> int:
    """The IPv4 total length of `item`, or of the longest packet of a Segments (its first: it carries the RETH)."""
    if isinstance(item, Segments):
        header, payload = header_size(item.opcodes[2 | (item.npkts == 1)]), min(item.mtu, item.dma_length)
    else:
        header, payload = header_size(item.opcode), len(item.payload)
    return IPV4_HEADER_SIZE + UDP_HEADER_SIZE + header + (payload + 3 & ~3) + ICRC_SIZE


@dataclass
class Port:
    """The port's state; its drops are counted in `stats` (the firmware's counters): dropped_link_down,
    dropped_oversize."""
    stats: collections.Counter[str] = field(default_factory=collections.Counter)
    mtu: int = DEFAULT_MTU
    up: bool = False  # the one attribute the data path reads per batch of packets
    speed: int = 0  # PORT_PHY_QCFG's link_speed code while the link is up

    @property
    def carries_all(self) -> bool:
        """carried() would return whatever it is given: the link is up and no packet is too long for the port."""
        return self.up and self.mtu >= _LARGEST_FRAME

    def carried(self, items: list[Item]) -> list[Item]:
        """What of `items` (packets sent or received) the port carries."""
        if not self.up:
            self.stats["dropped_link_down"] += len(items)
            return []
        if self.mtu >= _LARGEST_FRAME:
            return items
        fitting: list[Any] = [item for item in segmented(list(items)) if frame_size(item) <= self.mtu]
        self.stats["dropped_oversize"] += len(items) - len(fitting)
        return fitting
