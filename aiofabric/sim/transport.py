"""The emulated NIC's Ethernet port, the part every transport shares: `Transport` moves `Packet`s between NICs, with
the wire's faults (faults.py) and a pcap tap.

This is the thin I/O shell around the sans-IO codec (codec.py). A transport is driven from the emulator's selector
loop: register `fileno()`, call `receive()` when it is readable, `send_all()` whatever the protocol engine emits, and
call `flush()` once `flush_deadline` passes. Nothing here blocks except sending on a full socket buffer, which is
the backpressure a real NIC gets from its transmit queue. A socket error loses the packet (like a wire would) and is
counted ("send_errors", "receive_errors"), never raised into the emulator.

Three transports, opened by name (wire.open_transport):
* `udp.UdpTransport` (default): one UDP socket on (ip, 4791). Needs no privileges; the ICRC assumes IP ID 0. Bursts
  go out and come in many datagrams per system call (mmsg.py).
* `raw.RawTransport`: whole IPv4 packets through raw sockets. Needs CAP_NET_RAW; real per-QP source ports and IP IDs.
* `phy_loopback.LoopbackTransport`: the PHY loopback of port_phy_cfg LPBK_LOCAL; what is sent comes back, no socket.

`send()` stamps the addressing the wire actually uses onto the packet (its source IP is always the port's, and the UDP
transport also forces its bound source port and IP ID 0) because the ICRC covers those header fields.
"""
from __future__ import annotations

import collections
import logging
import socket
import time
from types import TracebackType
from typing import Any

from .codec import BadPacket, IcrcMismatch, encode, encode_ipv4_header
from .faults import FaultInjector, Faults
from .nativeio import Arrivals
from .packets import Outgoing, Packet, expand
from .pcap import PcapWriter

log = logging.getLogger("aiofabric.sim")

MAX_DATAGRAM = 65536
TX_HEADROOM = 64  # BTH + extension headers + pad + ICRC never take more than this


def mac_for_ip(ip: str) -> bytes:
    """A locally administered unicast MAC derived from an IPv4 address: 02:00:a:b:c:d.

    The emulated wire has no ARP; MACs derived from addresses keep the two ends of a flow apart in a capture.
    """
    return b"\x02\x00" + socket.inet_aton(ip)


class ForeignSource(ValueError):
    """A datagram from this host's loopback that no emulator on the UDP transport sent (see udp.UdpTransport)."""


class Transport:
    """A NIC port owning one IPv4 address. Subclasses move datagrams; this class encodes, injects faults and taps.

    counters: "sent" (datagrams put on the wire, duplicates included), "received" (packets decoded), "dropped_icrc",
    "dropped_malformed", "dropped_source_port" (UdpTransport: a loopback sender not on 4791), "send_errors" and
    "receive_errors" (socket errors: those packets are lost), and the FaultInjector's, one per fault injected: "lost",
    "duplicated", "reordered", "corrupted".
    """

    def __init__(self, ip: str, faults: Faults | None = None, pcap: PcapWriter | None = None,
                 mac: bytes | None = None) -> None:
        self.ip = ip
        self.faults = faults or Faults()
        self.pcap = pcap  # owned by the caller, which closes it
        self.mac = mac or mac_for_ip(ip)
        self.counters: collections.Counter[str] = collections.Counter()
        self.faulty = self.faults.active  # else packets go straight to the wire
        self.injector = FaultInjector(self.faults, self.counters, self._put)

    def fileno(self) -> int | None:
        """The descriptor that becomes readable when packets arrive; None: call receive() every loop iteration."""
        return None

    @property
    def rx_overflow(self) -> int:
        """Datagrams the kernel dropped because this port's receive buffer was full (not the protocol's drops)."""
        return 0

    def receive_window(self, size: int) -> None:
        """Let the receive buffer hold `size` bytes of queued datagrams (it only grows, to udp.MAX_RECEIVE_BUFFER)."""

    @property
    def pending(self) -> bool:
        """Packets are waiting to be received that no descriptor will announce (select() cannot see them)."""
        return False

    @property
    def flush_deadline(self) -> float | None:
        """time.monotonic() by which flush() must be called to release a held (reordered) packet, if one is held."""
        held = self.injector.held
        return held.deadline if held is not None else None

    def send(self, packet: Packet) -> None:
        """Encode `packet` and put it on the wire, subject to the faults."""
        self._stamp(packet)
        udp_payload = encode(packet)
        if self.faulty:
            self.injector.send(packet, udp_payload)
        else:
            self._put(packet, udp_payload)

    def send_all(self, packets: list[Outgoing]) -> None:
        """Send `packets` in order. One the socket refuses (unreachable, too big for DF, ...) is lost and counted."""
        for packet in expand(packets):
            try:
                self.send(packet)
            except OSError as exc:
                self._send_failed(exc)

    def flush(self) -> None:
        """Send the packet the reorder fault is holding back, if any."""
        self.injector.flush()

    def flush_due(self) -> None:
        """flush() if the held packet's time has come."""
        held = self.injector.held
        if held is not None and time.monotonic() >= held.deadline:
            self.flush()

    def receive(self, budget: int = 64) -> list[Packet]:
        """Up to `budget` packets that have arrived, without waiting. Bad packets are counted and dropped.

        A packet's payload may be a view of a receive buffer that the next receive() reuses: use it before then.
        """
        self.flush_due()
        packets: list[Packet] = []
        try:
            datagrams = self._receive(budget)
        except OSError as exc:  # e.g. an ICMP error queued on the socket: the packet is gone, not the port
            self._count_error("receive_errors", exc)
            return packets
        pcap = self.pcap
        for datagram in datagrams:
            if pcap is not None:  # the capture shows both directions, corrupted arrivals included
                frame = self._arrived_frame(datagram)
                if frame is not None:
                    pcap.write(frame, mac_for_ip(socket.inet_ntoa(frame[12:16])), self.mac)
            try:
                packets.append(self._decode(datagram))
            except IcrcMismatch:
                self.counters["dropped_icrc"] += 1
            except ForeignSource:
                self.counters["dropped_source_port"] += 1
            except BadPacket as exc:
                self.counters["dropped_malformed"] += 1
                self.counters[f"dropped_{exc.reason}"] += 1  # by the decode check that refused it (DROP_REASONS)
        self.counters["received"] += len(packets)
        return packets

    @property
    def parsed(self) -> bool:
        """receive_arrivals() may be called: the compiled core parses what arrives (udp.UdpTransport only)."""
        return False

    def receive_arrivals(self, budget: int = 64) -> Arrivals | None:
        """Like receive(), the datagrams as the compiled core parsed them; only while `parsed`."""
        raise NotImplementedError

    def close(self) -> None:
        """Send any held packet and release the port."""
        self.flush()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    # What subclasses provide.

    def _stamp(self, packet: Outgoing) -> None:
        """Set the header fields this transport's wire will actually carry, which the ICRC covers."""
        packet.src_ip = self.ip

    def _transmit(self, packet: Packet, udp_payload: bytes) -> None:
        """Put one datagram on the wire."""
        raise NotImplementedError

    def _receive(self, budget: int) -> list[Any]:
        """Up to `budget` datagrams that have arrived, in whatever form this transport's `_decode` takes."""
        raise NotImplementedError

    def _decode(self, datagram: Any) -> Packet:
        """Decode one datagram from `_receive`, raising BadPacket."""
        raise NotImplementedError

    def _arrived_frame(self, datagram: Any) -> bytes | None:
        """The IPv4 packet as it crossed the wire into this port, for the pcap (None: already captured on send)."""
        return None

    # Helpers.

    def _put(self, packet: Packet, udp_payload: bytes) -> None:
        self._transmit(packet, udp_payload)
        self.counters["sent"] += 1
        if self.pcap is not None:
            self.pcap.write(encode_ipv4_header(packet, len(udp_payload)) + udp_payload, self.mac,
                            mac_for_ip(packet.dst_ip))

    def _send_failed(self, exc: OSError) -> None:
        self._count_error("send_errors", exc)

    def _count_error(self, counter: str, exc: OSError) -> None:
        self.counters[counter] += 1
        if self.counters[counter] == 1:
            log.warning("wire %s: %s failed: %s (counted as %s)", self.ip, counter.split("_")[0], exc, counter)
