"""The emulated NIC's Ethernet port: moves `Packet`s between NICs over real sockets, with seeded faults and a pcap tap.

This is the thin I/O shell around the sans-IO codec in `packets`. A transport is driven from the emulator's selector
loop: register `fileno()`, call `receive()` when it is readable, `send_all()` whatever the protocol engine emits, and
call `flush()` once `flush_deadline` passes. Nothing here blocks except sending on a full socket buffer, which is
the backpressure a real NIC gets from its transmit queue. A socket error loses the packet (like a wire would) and is
counted ("send_errors", "receive_errors"), never raised into the emulator.

Three transports:
* `UdpTransport` (default): one UDP socket on (ip, 4791). Needs no privileges; the ICRC assumes IP ID 0. Bursts go
  out and come in many datagrams per system call (mmsg.py).
* `RawTransport`: whole IPv4 packets through raw sockets. Needs CAP_NET_RAW; real per-QP source ports and IP IDs.
* `LoopbackTransport`: the PHY loopback of port_phy_cfg LPBK_LOCAL; what is sent comes back, no socket.

`send()` stamps the addressing the wire actually uses onto the packet (its source IP is always the port's, and the UDP
transport also forces its bound source port and IP ID 0) because the ICRC covers those header fields.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import ipaddress
import logging
import os
import pwd
import random
import select
import socket
import stat
import struct
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

from . import mmsg
from .options import FAULTS
from .packets import (ROCE_PORT, BadPacket, IcrcMismatch, Packet, Segments, decode, decode_ipv4, encode, encode_into,
                      encode_ipv4_header, encode_segments_into, expand)
from .pcap import PcapWriter
from ..util import private

log = logging.getLogger("aiofabric.sim")

IP_MTU_DISCOVER = 10  # Linux socket options Python 3.11's socket module does not name
IP_PMTUDISC_DO = 2  # always set DF, never fragment: with it, unconnected UDP sockets send IP ID 0
SO_SNDBUFFORCE = 32  # like SO_SNDBUF/SO_RCVBUF, but past net.core.[wr]mem_max when we have CAP_NET_ADMIN
SO_RCVBUFFORCE = 33
SOCKET_BUFFER = 4 << 20  # the least a port starts with: a window of 128 x 4 KiB packets on a few QPs
MAX_RECEIVE_BUFFER = 512 << 20  # receive_window() stops here: past it, overflow drops are counted, not prevented
SO_MEMINFO = 55  # getsockopt: the socket's memory counters (struct: SK_MEMINFO_VARS u32s)
SK_MEMINFO_DROPS = 8  # ... of which this one counts the datagrams the socket dropped (receive buffer full)
MAX_DATAGRAM = 65536
BATCH = 64  # datagrams per sendmmsg/recvmmsg call (and at most this many per receive())
TX_SLOT = 4224  # bytes per transmit slot: a packet of the largest path MTU (4096) with every header fits
TX_HEADROOM = 64  # BTH + extension headers + pad + ICRC never take more than this
_FECN_BECN_BYTE = 4  # byte of the BTH masked out of the ICRC: a bit flip there would go unnoticed


def mac_for_ip(ip: str) -> bytes:
    """A locally administered unicast MAC derived from an IPv4 address: 02:00:a:b:c:d.

    The emulated wire has no ARP; MACs derived from addresses keep the two ends of a flow apart in a capture.
    """
    return b"\x02\x00" + socket.inet_aton(ip)


@dataclasses.dataclass
class Faults:
    """What the wire does to packets, as independent per-packet probabilities; deterministic for a given seed.

    Every packet sent consumes the same four draws (loss, dup, reorder, corrupt) whatever the probabilities, so with
    a fixed seed and traffic the loss pattern does not change when, say, the corruption rate does.
    """

    loss: float = 0.0  # the packet never arrives
    dup: float = 0.0  # it arrives twice
    reorder: float = 0.0  # it is held back and sent after the next packet (or after reorder_hold); one at a time
    corrupt: float = 0.0  # one bit flips after the ICRC was computed, so the receiver drops it
    seed: int = 0
    reorder_hold: float = 0.001  # how long a held packet waits for a successor before it goes out alone

    def __post_init__(self) -> None:
        for name in FAULTS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fault probability {name}={getattr(self, name)} is not between 0 and 1")

    @property
    def active(self) -> bool:
        return bool(self.loss or self.dup or self.reorder or self.corrupt)


@dataclasses.dataclass(slots=True)
class _Held:
    """A packet the reorder fault holds back, with the bytes and copy count decided when it was sent."""

    packet: Packet
    udp_payload: bytes
    copies: int
    deadline: float


class Transport:
    """A NIC port owning one IPv4 address. Subclasses move datagrams; this class encodes, injects faults and taps.

    counters: "sent" (datagrams put on the wire, duplicates included), "received" (packets decoded), "dropped_icrc",
    "dropped_malformed", "dropped_source_port" (UdpTransport: a loopback sender not on 4791), "send_errors" and
    "receive_errors" (socket errors: those packets are lost), and one per
    fault injected: "lost", "duplicated", "reordered", "corrupted".
    """

    def __init__(self, ip: str, faults: Faults | None = None, pcap: PcapWriter | None = None,
                 mac: bytes | None = None) -> None:
        self.ip = ip
        self.faults = faults or Faults()
        self.pcap = pcap  # owned by the caller, which closes it
        self.mac = mac or mac_for_ip(ip)
        self.counters: collections.Counter[str] = collections.Counter()
        self._faulty = self.faults.active
        self._decisions = random.Random(self.faults.seed)
        self._bit_flips = random.Random(f"{self.faults.seed}/bit flips")  # apart, so flips do not shift decisions
        self._held: _Held | None = None

    def fileno(self) -> int | None:
        """The descriptor that becomes readable when packets arrive; None: call receive() every loop iteration."""
        return None

    @property
    def rx_overflow(self) -> int:
        """Datagrams the kernel dropped because this port's receive buffer was full (not the protocol's drops)."""
        return 0

    def receive_window(self, size: int) -> None:
        """Let the receive buffer hold `size` bytes of queued datagrams (it only grows; capped at MAX_RECEIVE_BUFFER)."""

    @property
    def pending(self) -> bool:
        """Packets are waiting to be received that no descriptor will announce (select() cannot see them)."""
        return False

    @property
    def flush_deadline(self) -> float | None:
        """time.monotonic() by which flush() must be called to release a held (reordered) packet, if one is held."""
        return self._held.deadline if self._held is not None else None

    def send(self, packet: Packet) -> None:
        """Encode `packet` and put it on the wire, subject to the faults."""
        self._stamp(packet)
        udp_payload = encode(packet)
        if not self._faulty:
            self._put(packet, udp_payload)
            return
        faults, draw = self.faults, self._decisions.random
        lost, duplicated, reordered, corrupted = (draw() < faults.loss, draw() < faults.dup, draw() < faults.reorder,
                                                  draw() < faults.corrupt)
        held, self._held = self._held, None
        if lost:
            self.counters["lost"] += 1
        else:
            if corrupted:
                udp_payload = self._flip_a_bit(udp_payload)
                self.counters["corrupted"] += 1
            copies = 2 if duplicated else 1
            if duplicated:
                self.counters["duplicated"] += 1
            if reordered and held is None:
                # A copy: the caller may reuse its Packet before this one goes out.
                deadline = time.monotonic() + faults.reorder_hold
                self._held = _Held(dataclasses.replace(packet), udp_payload, copies, deadline)
                self.counters["reordered"] += 1
            else:
                for _ in range(copies):
                    self._put(packet, udp_payload)
        if held is not None:
            self._release(held)

    def send_all(self, packets: list[Packet | Segments]) -> None:
        """Send `packets` in order. One the socket refuses (unreachable, too big for DF, ...) is lost and counted."""
        for packet in expand(packets):
            try:
                self.send(packet)
            except OSError as exc:
                self._send_failed(exc)

    def flush(self) -> None:
        """Send the packet the reorder fault is holding back, if any."""
        held, self._held = self._held, None
        if held is not None:
            self._release(held)

    def receive(self, budget: int = 64) -> list[Packet]:
        """Up to `budget` packets that have arrived, without waiting. Bad packets are counted and dropped.

        A packet's payload may be a view of a receive buffer that the next receive() reuses: use it before then.
        """
        if self._held is not None and time.monotonic() >= self._held.deadline:
            self.flush()
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

    def close(self) -> None:
        """Send any held packet and release the port."""
        self.flush()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    # What subclasses provide.

    def _stamp(self, packet: Packet | Segments) -> None:
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

    def _release(self, held: _Held) -> None:
        for _ in range(held.copies):
            self._put(held.packet, held.udp_payload)

    def _send_failed(self, exc: OSError) -> None:
        self._count_error("send_errors", exc)

    def _count_error(self, counter: str, exc: OSError) -> None:
        self.counters[counter] += 1
        if self.counters[counter] == 1:
            log.warning("wire %s: %s failed: %s (counted as %s)", self.ip, counter.split("_")[0], exc, counter)

    def _flip_a_bit(self, udp_payload: bytes) -> bytes:
        """Flip one bit anywhere the ICRC covers (so anywhere but BTH byte 4), ICRC bytes included."""
        corrupted = bytearray(udp_payload)
        index = self._bit_flips.randrange(len(corrupted) - 1)
        index += index >= _FECN_BECN_BYTE
        corrupted[index] ^= 1 << self._bit_flips.randrange(8)
        return bytes(corrupted)


class PortTaken(OSError):
    """UDP 4791 of `ip` is bound by another socket: one bound to that address or to the wildcard (port_holder says
    whose)."""

    def __init__(self, ip: str, message: str | None = None) -> None:
        super().__init__(errno.EADDRINUSE, message or f"UDP {ip}:{ROCE_PORT} is taken")
        self.ip = ip


def _udp_socket(ip: str, buffer_size: int) -> socket.socket:
    """A blocking UDP socket bound to (ip, 4791) with DF always set (so IP ID 0) and large buffers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        _set_buffers(sock, buffer_size)
        try:
            sock.bind((ip, ROCE_PORT))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortTaken(ip) from e
            if e.errno == errno.EADDRNOTAVAIL:
                raise OSError(e.errno, f"{ip} is not an address of this host (use 127.0.0.x or a veth address)") from e
            raise
    except BaseException:
        sock.close()
        raise
    return sock


def _set_buffers(sock: socket.socket, size: int, send: bool = True) -> None:
    """Socket buffers of `size` bytes: past the sysctl limits when privileged, else as large as they allow."""
    for forced, plain in ((SO_SNDBUFFORCE, socket.SO_SNDBUF), (SO_RCVBUFFORCE, socket.SO_RCVBUF))[0 if send else 1:]:
        try:
            sock.setsockopt(socket.SOL_SOCKET, forced, size)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, plain, size)


def _grow_receive_buffer(sock: socket.socket, size: int) -> None:
    size = min(size, MAX_RECEIVE_BUFFER)
    if size * 2 > sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF):  # Linux reports twice what was set
        _set_buffers(sock, size, send=False)


def _socket_drops(sock: socket.socket) -> int:
    """The kernel's count of datagrams `sock` dropped (sk_drops: a full receive buffer, for our sockets)."""
    try:
        counters = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
    except OSError:  # before Linux 3.x, or closed
        return 0
    return int.from_bytes(counters[4 * SK_MEMINFO_DROPS:4 * SK_MEMINFO_DROPS + 4], sys.byteorder)


class ForeignSource(ValueError):
    """A datagram from this host's loopback that no emulator on the UDP transport sent (see UdpTransport)."""


class UdpTransport(Transport):
    """RoCEv2 over an ordinary UDP socket bound to (ip, 4791): no privileges needed.

    The UDP source port is always the bound 4791, not the per-QP port Linux RoCE stacks use: per-QP source ports would
    need a socket per flow. The kernel writes the IP header: with DF forced on an unconnected socket it writes IP ID 0,
    so the ICRC computed for ID 0 is valid on the wire (and in a capture). On receive a plain socket cannot see the IP
    ID, so the ICRC is checked assuming 0: packets from stacks that send other IDs (or from a connect()ed socket) are
    dropped as ICRC failures; use RawTransport to talk to those.

    For the same reason a datagram from a loopback address (127.0.0.0/8) whose source port is not 4791 is dropped
    (counted as "dropped_source_port"): every emulator on this transport sends from its bound (ip, 4791), which no
    other socket, so no other user, can bind while it holds it, whereas any local user can send from the peer's
    127.0.0.x on another port and pass the QP's source-address check. The raw transport, whose per-QP source ports
    are real, talks to a UDP-transport NIC only across a network (or from 4791).
    """

    def __init__(self, ip: str, faults: Faults | None = None, pcap: PcapWriter | None = None,
                 mac: bytes | None = None, buffer_size: int = SOCKET_BUFFER) -> None:
        super().__init__(ip, faults, pcap, mac)
        self._socket = _udp_socket(ip, buffer_size)
        self._tos, self._ttl = 0, self._socket.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
        batched = mmsg.available()
        self._sender = mmsg.Sender(self._socket, BATCH, TX_SLOT) if batched else None
        self._receiver = mmsg.Receiver(self._socket, BATCH) if batched else None
        self._peers: dict[bytes, str] = {}  # source addresses as received -> as Packet.src_ip names them

    def fileno(self) -> int | None:
        return self._socket.fileno()

    @property
    def rx_overflow(self) -> int:
        return _socket_drops(self._socket)

    def receive_window(self, size: int) -> None:
        _grow_receive_buffer(self._socket, size)

    def close(self) -> None:
        super().close()
        self._socket.close()

    def _stamp(self, packet: Packet | Segments) -> None:
        packet.src_ip, packet.src_port, packet.dst_port, packet.ip_id = self.ip, ROCE_PORT, ROCE_PORT, 0
        # TOS and TTL are the socket's: set them when a packet asks for others (DSCP marking), so captures are true.
        if packet.tos != self._tos:
            self._socket.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, packet.tos)
            self._tos = packet.tos
        if packet.ttl != self._ttl:
            self._socket.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, packet.ttl)
            self._ttl = packet.ttl

    def send_all(self, packets: list[Packet | Segments]) -> None:
        """Encode packets straight into the sender's slots and send each burst with one system call.

        Faults and the pcap tap need each packet on its own, and so does a packet larger than a slot or one asking for
        other socket options (TOS/TTL) than the burst before it: those take the one-at-a-time path.
        """
        sender = self._sender
        if sender is None or self._faulty or self.pcap is not None:
            super().send_all(packets)
            return
        view, slot, capacity, room = sender.view, sender.slot_size, sender.count, sender.slot_size - TX_HEADROOM
        ip, tos, ttl = self.ip, self._tos, self._ttl
        run: list[int] = []  # the lengths of the last slots filled, all for `destination`
        staged, destination = 0, ""
        for item in packets:
            if item.tos != tos or item.ttl != ttl \
                    or (len(item.payload) if isinstance(item, Packet) else item.mtu) > room:
                staged, run = self._send_slots(sender, staged, run, destination), []
                super().send_all([item])
                tos, ttl = self._tos, self._ttl
                continue
            if item.dst_ip != destination:
                if run:
                    sender.stage(staged - len(run), run, destination, ROCE_PORT)
                    run = []
                destination = item.dst_ip
            item.src_ip, item.src_port, item.dst_port, item.ip_id = ip, ROCE_PORT, ROCE_PORT, 0  # as _stamp does
            if isinstance(item, Packet):
                run.append(encode_into(item, view, staged * slot))
                staged += 1
            else:
                k, end = item.start, item.start + item.count
                while k < end:
                    count = min(end - k, capacity - staged)
                    run += encode_segments_into(item, k, count, view, staged * slot, slot)
                    k += count
                    staged += count
                    if staged == capacity:
                        staged, run = self._send_slots(sender, staged, run, destination), []
            if staged == capacity:
                staged, run = self._send_slots(sender, staged, run, destination), []
        self._send_slots(sender, staged, run, destination)

    def _send_slots(self, sender: mmsg.Sender, staged: int, run: list[int], destination: str) -> int:
        """Send the `staged` slots, the last len(run) of which (not staged yet) are for `destination`; 0."""
        if run:
            sender.stage(staged - len(run), run, destination, ROCE_PORT)
        if staged:
            errors = sender.send(staged)
            self.counters["sent"] += staged - len(errors)
            for exc in errors:
                self._send_failed(exc)
        return 0

    def _transmit(self, packet: Packet, udp_payload: bytes) -> None:
        self._socket.sendto(udp_payload, (packet.dst_ip, ROCE_PORT))

    def _receive(self, budget: int) -> list[tuple[Any, bytes, int]]:
        """(data, source address as 4 bytes, source port) per datagram."""
        if self._receiver is not None:
            return self._receiver.receive(budget)
        datagrams = []
        recvfrom = self._socket.recvfrom
        try:
            for _ in range(budget):
                data, (src_ip, src_port) = recvfrom(MAX_DATAGRAM, socket.MSG_DONTWAIT)
                datagrams.append((data, socket.inet_aton(src_ip), src_port))
        except BlockingIOError:
            pass
        return datagrams

    def _decode(self, datagram: tuple[Any, bytes, int]) -> Packet:
        data, source, src_port = datagram
        if src_port != ROCE_PORT and source[0] == 127:
            raise ForeignSource(f"{socket.inet_ntoa(source)}:{src_port}")
        src_ip = self._peers.get(source)
        if src_ip is None:
            if len(self._peers) >= 1024:  # peers come and go over a long life; their names need not stay
                self._peers.clear()
            src_ip = self._peers[source] = socket.inet_ntoa(source)
        return decode(data, src_ip, self.ip, src_port)

    def _arrived_frame(self, datagram: tuple[Any, bytes, int]) -> bytes:
        # A UDP socket hides the IPv4 header; the sender's kernel wrote it with ID 0 and DF (see the class notes).
        data, source, src_port = datagram
        header = Packet(0, 0, 0, src_ip=socket.inet_ntoa(source), dst_ip=self.ip, src_port=src_port)
        return encode_ipv4_header(header, len(data)) + bytes(data)


class RawTransport(Transport):
    """RoCEv2 as whole IPv4 packets through raw sockets (root or CAP_NET_RAW): the wire exactly as a NIC makes it.

    Sends carry the packet's own UDP source port (per QP, see packets.udp_source_port) and IP ID, and receives check
    the ICRC over the real IPv4 header, so foreign RoCE stacks interoperate whatever IP IDs they send. The kernel's
    UDP stack sees the same incoming packets; a plain UDP socket bound to (ip, 4791) absorbs them (and is drained
    here) so the kernel answers none of them with ICMP port unreachable.
    """

    def __init__(self, ip: str, faults: Faults | None = None, pcap: PcapWriter | None = None,
                 mac: bytes | None = None, buffer_size: int = SOCKET_BUFFER) -> None:
        super().__init__(ip, faults, pcap, mac)
        try:
            self._sender = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        except PermissionError as e:
            raise PermissionError(f"the raw transport needs root or CAP_NET_RAW ({e.strerror}); "
                                  "the 'udp' transport needs no privileges") from e
        self._receiver = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
        self._sink = None
        try:
            self._sender.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
            _set_buffers(self._sender, buffer_size)
            _set_buffers(self._receiver, buffer_size)
            self._receiver.bind((ip, 0))  # the kernel then delivers only packets addressed to ip
            self._sink = _udp_socket(ip, 0)  # the kernel rounds a zero buffer up to its minimum
        except BaseException:
            self._close_sockets()
            raise

    def fileno(self) -> int | None:
        return self._receiver.fileno()

    @property
    def rx_overflow(self) -> int:
        return _socket_drops(self._receiver)  # not the sink's: it is there to drop (see the class notes)

    def receive_window(self, size: int) -> None:
        _grow_receive_buffer(self._receiver, size)

    def close(self) -> None:
        super().close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._sender, self._receiver, self._sink):
            if sock is not None:
                sock.close()

    def _transmit(self, packet: Packet, udp_payload: bytes) -> None:
        # With DF set Linux keeps an IP ID of 0 as written (it would pick one for a non-DF packet with ID 0).
        self._sender.sendto(encode_ipv4_header(packet, len(udp_payload)) + udp_payload, (packet.dst_ip, 0))

    def _receive(self, budget: int) -> list[bytes]:
        datagrams = []
        try:
            for _ in range(budget):
                datagram = self._receiver.recv(MAX_DATAGRAM, socket.MSG_DONTWAIT)
                if _is_roce(datagram):  # the raw socket sees all UDP to this address
                    datagrams.append(datagram)
        except BlockingIOError:
            pass
        sink = self._sink
        if sink is not None:  # drained for the kernel's sake: it answers nothing it delivered there
            try:
                for _ in range(budget):
                    sink.recv(MAX_DATAGRAM, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        return datagrams

    def _decode(self, datagram: bytes) -> Packet:
        return decode_ipv4(datagram)

    def _arrived_frame(self, datagram: bytes) -> bytes:
        return bytes(datagram)


def _is_roce(ipv4_packet: bytes) -> bool:
    """Whether an IPv4/UDP packet is addressed to UDP port 4791 (anything else is not ours to count)."""
    udp = (ipv4_packet[0] & 0x0F) * 4
    return len(ipv4_packet) >= udp + 4 and ipv4_packet[udp + 2] << 8 | ipv4_packet[udp + 3] == ROCE_PORT


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

    def send_all(self, packets: list[Packet | Segments]) -> None:
        if self._faulty or self.pcap is not None:
            super().send_all(packets)
            return
        looped, ip = self._looped, self.ip
        queued = len(looped)
        for item in packets:
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


# -- When UDP 4791 is taken on loopback ------------------------------------------------------------------------------
# A socket bound to 0.0.0.0:4791 (a user's, or rdma_rxe's in the kernel) denies every 127.0.0.x of the host, and would
# receive what our NICs send there. An emulator that picks its own address then runs in a network namespace of this
# user instead (join_private_netns), where no other user can bind anything: root's is `ip netns` aiofabric-0, another
# user's a user+net namespace that a small process holds (hold_netns). All emulators of the user that fall back join
# the same one, so NICs of different processes still reach each other there.

NETNS_DIR = "/run/netns"  # iproute2's: `ip netns add` bind-mounts its namespaces here (writable by root only)
ROOT_NETNS_LOCK = "/run/aiofabric-netns.lock"  # root's: serializes creating the namespace
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
HOLDER_POLL = 5.0  # seconds between a holder's looks for members; it exits after two looks that found none
HOLD_NETNS = "hold-netns"  # `python -m aiofabric.sim.wire hold-netns DIR`: a user namespace's holder
_libc = ctypes.CDLL(None, use_errno=True)


class NoPrivateNetns(Exception):
    """No private network namespace can be had here; the message says why."""


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


def _user_netns_dir() -> str:
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
    directory = _user_netns_dir()
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
