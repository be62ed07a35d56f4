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
import dataclasses
import errno
import logging
import random
import socket
import sys
import time
from types import TracebackType
from typing import Any

from . import mmsg
from .packets import (
    ROCE_PORT, BadPacket, IcrcMismatch, Packet, Segments, decode, decode_ipv4, encode, encode_into,
    encode_ipv4_header, encode_segments_into, expand,
)
from .pcap import PcapWriter

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
        for name in ("loss", "dup", "reorder", "corrupt"):
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
    "dropped_malformed", "send_errors" and "receive_errors" (socket errors: those packets are lost), and one per
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
                raise OSError(e.errno, f"UDP {ip}:{ROCE_PORT} is taken: another emulated NIC has this address, or "
                                       "rdma_rxe is loaded (it binds 4791 on every address)") from e
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


class UdpTransport(Transport):
    """RoCEv2 over an ordinary UDP socket bound to (ip, 4791): no privileges needed.

    The UDP source port is always the bound 4791, not the per-QP port Linux RoCE stacks use: per-QP source ports would
    need a socket per flow. The kernel writes the IP header: with DF forced on an unconnected socket it writes IP ID 0,
    so the ICRC computed for ID 0 is valid on the wire (and in a capture). On receive a plain socket cannot see the IP
    ID, so the ICRC is checked assuming 0: packets from stacks that send other IDs (or from a connect()ed socket) are
    dropped as ICRC failures; use RawTransport to talk to those.
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
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"UDP port {ROCE_PORT} is taken on every address from 127.0.0.{LOOPBACK_HOSTS[0]} "
                                    f"to 127.0.0.{LOOPBACK_HOSTS[-1]} (is rdma_rxe loaded? it binds every address)")
