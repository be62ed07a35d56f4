"""The UDP transport (the default): RoCEv2 over one ordinary UDP socket bound to (ip, 4791), and the socket helpers the
raw transport shares. Needs no privileges."""
from __future__ import annotations

import errno
import socket
import sys
from typing import Any

from . import mmsg, native
from .codec import decode, encode_into, encode_ipv4_header, encode_segments_into
from .faults import Faults
from .nativeio import Arrivals, NativeReceiver, NativeSender
from .packets import ROCE_PORT, Outgoing, Packet, Segments, segmented
from .pcap import PcapWriter
from .transport import MAX_DATAGRAM, TX_HEADROOM, ForeignSource, Transport

IP_MTU_DISCOVER = 10  # Linux socket options Python 3.11's socket module does not name
IP_PMTUDISC_DO = 2  # always set DF, never fragment: with it, unconnected UDP sockets send IP ID 0
SO_SNDBUFFORCE = 32  # like SO_SNDBUF/SO_RCVBUF, but past net.core.[wr]mem_max when we have CAP_NET_ADMIN
SO_RCVBUFFORCE = 33
SOCKET_BUFFER = 4 << 20  # the least a port starts with: a window of 128 x 4 KiB packets on a few QPs
MAX_RECEIVE_BUFFER = 512 << 20  # receive_window() stops here: past it, overflow drops are counted, not prevented
SO_MEMINFO = 55  # getsockopt: the socket's memory counters (struct: SK_MEMINFO_VARS u32s)
SK_MEMINFO_DROPS = 8  # ... of which this one counts the datagrams the socket dropped (receive buffer full)
BATCH = 64  # datagrams per sendmmsg/recvmmsg call (and at most this many per receive())
TX_SLOT = 4224  # bytes per transmit slot: a packet of the largest path MTU (4096) with every header fits


class PortTaken(OSError):
    """UDP 4791 of `ip` is bound by another socket: one bound to that address or to the wildcard (port_holder says
    whose)."""

    def __init__(self, ip: str, message: str | None = None) -> None:
        super().__init__(errno.EADDRINUSE, message or f"UDP {ip}:{ROCE_PORT} is taken")
        self.ip = ip


def udp_socket(ip: str, buffer_size: int) -> socket.socket:
    """A blocking UDP socket bound to (ip, 4791) with DF always set (so IP ID 0) and large buffers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        set_buffers(sock, buffer_size)
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


def set_buffers(sock: socket.socket, size: int, send: bool = True) -> None:
    """Socket buffers of `size` bytes: past the sysctl limits when privileged, else as large as they allow."""
    for forced, plain in ((SO_SNDBUFFORCE, socket.SO_SNDBUF), (SO_RCVBUFFORCE, socket.SO_RCVBUF))[0 if send else 1:]:
        try:
            sock.setsockopt(socket.SOL_SOCKET, forced, size)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, plain, size)


def grow_receive_buffer(sock: socket.socket, size: int) -> None:
    size = min(size, MAX_RECEIVE_BUFFER)
    if size * 2 > sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF):  # Linux reports twice what was set
        set_buffers(sock, size, send=False)


def socket_drops(sock: socket.socket) -> int:
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

    For the same reason a datagram from a loopback address (127.0.0.0/8) whose source port is not 4791 is dropped
    (counted as "dropped_source_port"): every emulator on this transport sends from its bound (ip, 4791), which no
    other socket, so no other user, can bind while it holds it, whereas any local user can send from the peer's
    127.0.0.x on another port and pass the QP's source-address check. The raw transport, whose per-QP source ports
    are real, talks to a UDP-transport NIC only across a network (or from 4791).
    """

    def __init__(self, ip: str, faults: Faults | None = None, pcap: PcapWriter | None = None,
                 mac: bytes | None = None, buffer_size: int = SOCKET_BUFFER) -> None:
        super().__init__(ip, faults, pcap, mac)
        self._socket = udp_socket(ip, buffer_size)
        self._tos, self._ttl = 0, self._socket.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
        batched = mmsg.available()
        self._sender = mmsg.Sender(self._socket, BATCH, TX_SLOT) if batched else None
        self._receiver = mmsg.Receiver(self._socket, BATCH) if batched else None
        self._peers: dict[bytes, str] = {}  # source addresses as received -> as Packet.src_ip names them
        core = native.core() if batched else None  # the compiled codec, when it can be had
        self._native_out = NativeSender(core, self._sender, ip) if core and self._sender else None
        self._native_in = NativeReceiver(core, self._receiver, ip) if core and self._receiver else None

    def fileno(self) -> int | None:
        return self._socket.fileno()

    @property
    def rx_overflow(self) -> int:
        return socket_drops(self._socket)

    def receive_window(self, size: int) -> None:
        grow_receive_buffer(self._socket, size)

    def close(self) -> None:
        super().close()
        self._socket.close()

    def _stamp(self, packet: Outgoing) -> None:
        packet.src_ip, packet.src_port, packet.dst_port, packet.ip_id = self.ip, ROCE_PORT, ROCE_PORT, 0
        # TOS and TTL are the socket's: set them when a packet asks for others (DSCP marking), so captures are true.
        if packet.tos != self._tos:
            self._socket.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, packet.tos)
            self._tos = packet.tos
        if packet.ttl != self._ttl:
            self._socket.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, packet.ttl)
            self._ttl = packet.ttl

    def send_all(self, packets: list[Outgoing]) -> None:
        """Encode packets straight into the sender's slots and send each burst with one system call.

        Faults and the pcap tap need each packet on its own, and so does a packet larger than a slot or one asking for
        other socket options (TOS/TTL) than the burst before it: those take the one-at-a-time path.
        """
        sender = self._sender
        if sender is None or self.faulty or self.pcap is not None:
            super().send_all(packets)
            return
        if self._native_out is not None:
            self._send_native(packets, self._native_out)
            return
        view, slot, capacity, room = sender.view, sender.slot_size, sender.count, sender.slot_size - TX_HEADROOM
        ip, tos, ttl = self.ip, self._tos, self._ttl
        run: list[int] = []  # the lengths of the last slots filled, all for `destination`
        staged, destination = 0, ""
        for item in segmented(packets):
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

    def _send_native(self, packets: list[Outgoing], out: NativeSender) -> None:
        """send_all through the compiled core: the packets described, then encoded into the slots and sent a slotful
        at a time. What the core cannot take (socket options other than the burst's, a packet larger than a slot,
        bytes not in writable memory) goes the one-at-a-time way, in order."""
        room, tos, ttl = out.sender.slot_size - TX_HEADROOM, self._tos, self._ttl
        try:
            for item in packets:
                if item.tos != tos or item.ttl != ttl \
                        or (len(item.payload) if isinstance(item, Packet) else item.mtu) > room or not out.add(item):
                    self._send_described(out)
                    super().send_all([item])
                    tos, ttl = self._tos, self._ttl
                elif out.full:
                    self._send_described(out)
            self._send_described(out)
        finally:
            out.clear()
            out.sender.forget_retired()

    def _send_described(self, out: NativeSender) -> None:
        out.start()
        while out.pending:
            filled, refused = out.encode(out.sender.count)
            self._send_slots(out.sender, filled, [], "")
            if refused:
                super().send_all(refused)  # type: ignore[arg-type]
        out.clear()

    def receive(self, budget: int = 64) -> list[Packet]:
        if not self.parsed:
            return super().receive(budget)
        arrivals = self.receive_arrivals(budget)
        return arrivals.packets() if arrivals is not None else []

    def receive_arrivals(self, budget: int = 64) -> Arrivals | None:
        """None when none came (or a socket error lost them); `parsed` while the core is there and no pcap tap needs
        each datagram on its own."""
        assert self._native_in is not None
        self.flush_due()
        try:
            return self._native_in.arrivals(budget, self.counters)
        except OSError as exc:  # e.g. an ICMP error queued on the socket: the packet is gone, not the port
            self._count_error("receive_errors", exc)
            return None

    @property
    def parsed(self) -> bool:
        return self._native_in is not None and self.pcap is None

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
