"""The PHY loopback (port_phy_cfg LPBK_LOCAL) as a transport: what the port sends comes back to it, no socket."""
from __future__ import annotations

import collections
from typing import Any

from .codec import decode, decode_ipv4, encode, encode_ipv4_header, encode_segments_into
from .faults import Faults
from .packets import Outgoing, Packet, segmented
from .pcap import PcapWriter
from .transport import TX_HEADROOM, Transport


class LoopbackTransport(Transport):
    """PHY loopback (port_phy_cfg LPBK_LOCAL): every packet sent comes back to receive(), in order, faults applied.

    Packets travel encoded, ICRC and all, and are decoded again, so the codec runs as on a real wire. Without faults
    or a pcap a burst is encoded straight into one buffer and comes back as UDP payloads (the UDP transport's view of
    the wire); otherwise each packet travels as a whole IPv4 packet, decoded with its real header. The emulator's one
    process runs both ends of the link here, so per-packet work counts twice.
    """

    def __init__(self, ip: str, faults: Faults | None = None, pcap: PcapWriter | None = None,
                 mac: bytes | None = None) -> None:
        super().__init__(ip, faults, pcap, mac)
        # whole IPv4 packets, or (UDP payload, source IP, destination IP, source port, destination port, IP ID)
        self._looped: collections.deque[Any] = collections.deque()

    @property
    def pending(self) -> bool:
        return bool(self._looped)

    def send_all(self, packets: list[Outgoing]) -> None:
        if self.faulty or self.pcap is not None:
            super().send_all(packets)
            return
        looped, ip = self._looped, self.ip
        queued = len(looped)
        for item in segmented(packets):
            item.src_ip = ip
            address = (ip, item.dst_ip, item.src_port, item.dst_port, item.ip_id)
            if isinstance(item, Packet):
                looped.append((encode(item), *address))
                continue
            stride = item.mtu + TX_HEADROOM
            view = memoryview(bytearray(item.count * stride))
            lengths = encode_segments_into(item, item.start, item.count, view, 0, stride)
            looped.extend((view[i * stride:i * stride + length], *address) for i, length in enumerate(lengths))
        self.counters["sent"] += len(looped) - queued

    def _transmit(self, packet: Packet, udp_payload: bytes) -> None:
        self._looped.append(encode_ipv4_header(packet, len(udp_payload)) + udp_payload)

    def _receive(self, budget: int) -> list[Any]:
        return [self._looped.popleft() for _ in range(min(budget, len(self._looped)))]

    def _decode(self, datagram: Any) -> Packet:
        if type(datagram) is tuple:
            return decode(*datagram)
        return decode_ipv4(datagram)
