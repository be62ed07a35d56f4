"""The raw transport: RoCEv2 as whole IPv4 packets through raw sockets (root or CAP_NET_RAW), the wire exactly as a
NIC makes it."""
from __future__ import annotations

import socket

from .codec import decode_ipv4, encode_ipv4_header
from .faults import Faults
from .packets import ROCE_PORT, Packet
from .pcap import PcapWriter
from .transport import MAX_DATAGRAM, Transport
from .udp import SOCKET_BUFFER, grow_receive_buffer, set_buffers, socket_drops, udp_socket


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
            set_buffers(self._sender, buffer_size)
            set_buffers(self._receiver, buffer_size)
            self._receiver.bind((ip, 0))  # the kernel then delivers only packets addressed to ip
            self._sink = udp_socket(ip, 0)  # the kernel rounds a zero buffer up to its minimum
        except BaseException:
            self._close_sockets()
            raise

    def fileno(self) -> int | None:
        return self._receiver.fileno()

    @property
    def rx_overflow(self) -> int:
        return socket_drops(self._receiver)  # not the sink's: it is there to drop (see the class notes)

    def receive_window(self, size: int) -> None:
        grow_receive_buffer(self._receiver, size)

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
