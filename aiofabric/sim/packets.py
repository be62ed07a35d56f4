"""What a RoCEv2 RC packet is: the opcodes and the headers each carries, the AETH syndromes, and the two forms the
emulator handles packets in: `Packet` (one packet, as decoded or to be encoded) and `Segments` (a run of one
message's packets, described once). Sans-IO; codec.py turns them into bytes and back, icrc.py computes their ICRC.

Addresses and ports live on the packet (`IpUdpFields`) because the ICRC covers the IPv4 and UDP headers: a packet's
bytes are only meaningful together with the header the wire gives it.
"""
from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Sequence
from typing import Any, Protocol, Union

from ..hw.verbs import PSN_MASK

ROCE_PORT = 4791
QPN_MASK = 0xFFFFFF
MSN_MASK = 0xFFFFFF  # the AETH's message sequence number

BTH_SIZE = 12
ICRC_SIZE = 4
IPV4_HEADER_SIZE = 20
UDP_HEADER_SIZE = 8
IPV4_DONT_FRAGMENT = 0x4000  # RoCE stacks always set DF; Linux then writes IP ID 0 for unconnected sockets
FECN_BECN_BYTE = 4  # the BTH byte the ICRC masks to 0xFF: a bit flipped there goes unnoticed
# IPv4 (version/IHL, TOS, length, ID, flags, TTL, protocol, checksum, source, destination), then UDP (ports, length,
# checksum)
IPV4_UDP = struct.Struct(">BBHHHBBH4s4sHHHH")


class Op(enum.IntEnum):
    """BTH opcodes of the RC transport (the InfiniBand spec's OpCode table), plus the RoCEv2 congestion notification
    packet."""

    SEND_FIRST = 0x00
    SEND_MIDDLE = 0x01
    SEND_LAST = 0x02
    SEND_LAST_WITH_IMMEDIATE = 0x03
    SEND_ONLY = 0x04
    SEND_ONLY_WITH_IMMEDIATE = 0x05
    RDMA_WRITE_FIRST = 0x06
    RDMA_WRITE_MIDDLE = 0x07
    RDMA_WRITE_LAST = 0x08
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RDMA_WRITE_ONLY = 0x0A
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    RDMA_READ_REQUEST = 0x0C
    RDMA_READ_RESPONSE_FIRST = 0x0D
    RDMA_READ_RESPONSE_MIDDLE = 0x0E
    RDMA_READ_RESPONSE_LAST = 0x0F
    RDMA_READ_RESPONSE_ONLY = 0x10
    ACKNOWLEDGE = 0x11
    ATOMIC_ACKNOWLEDGE = 0x12
    COMPARE_SWAP = 0x13
    FETCH_ADD = 0x14
    SEND_LAST_WITH_INVALIDATE = 0x16
    SEND_ONLY_WITH_INVALIDATE = 0x17
    CNP = 0x81  # congestion notification: BTH with BECN set, then 16 reserved zero bytes


# Which headers follow the BTH, per opcode (the InfiniBand spec's OpCode table). The order on the wire is RETH|AETH,
# ImmDt|IETH, AtomicETH|AtomicAckETH, payload.
HAS_RETH = frozenset({Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_ONLY, Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                      Op.RDMA_READ_REQUEST})
HAS_AETH = frozenset({Op.RDMA_READ_RESPONSE_FIRST, Op.RDMA_READ_RESPONSE_LAST, Op.RDMA_READ_RESPONSE_ONLY,
                      Op.ACKNOWLEDGE, Op.ATOMIC_ACKNOWLEDGE})
HAS_IMM = frozenset({Op.SEND_LAST_WITH_IMMEDIATE, Op.SEND_ONLY_WITH_IMMEDIATE, Op.RDMA_WRITE_LAST_WITH_IMMEDIATE,
                     Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE})
HAS_IETH = frozenset({Op.SEND_LAST_WITH_INVALIDATE, Op.SEND_ONLY_WITH_INVALIDATE})  # R_Key in Packet.immediate
HAS_ATOMIC_ETH = frozenset({Op.COMPARE_SWAP, Op.FETCH_ADD})  # VA/R_Key in remote_addr/rkey, plus swap_add, compare
HAS_ATOMIC_ACK_ETH = frozenset({Op.ATOMIC_ACKNOWLEDGE})  # Packet.original
HAS_PAYLOAD = frozenset(op for op in Op if op <= Op.RDMA_READ_RESPONSE_ONLY and op != Op.RDMA_READ_REQUEST) | HAS_IETH

# The opcodes the RC engines test per packet, as plain ints: comparing an IntEnum member costs more
SEND_FIRST, SEND_MIDDLE, SEND_LAST_IMM, SEND_ONLY, SEND_ONLY_IMM = (
    int(Op.SEND_FIRST), int(Op.SEND_MIDDLE), int(Op.SEND_LAST_WITH_IMMEDIATE), int(Op.SEND_ONLY),
    int(Op.SEND_ONLY_WITH_IMMEDIATE))
WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST_IMM, WRITE_ONLY, WRITE_ONLY_IMM = (
    int(Op.RDMA_WRITE_FIRST), int(Op.RDMA_WRITE_MIDDLE), int(Op.RDMA_WRITE_LAST_WITH_IMMEDIATE),
    int(Op.RDMA_WRITE_ONLY), int(Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE))
READ_REQUEST, RESPONSE_FIRST, RESPONSE_MIDDLE, RESPONSE_LAST, RESPONSE_ONLY = (
    int(Op.RDMA_READ_REQUEST), int(Op.RDMA_READ_RESPONSE_FIRST), int(Op.RDMA_READ_RESPONSE_MIDDLE),
    int(Op.RDMA_READ_RESPONSE_LAST), int(Op.RDMA_READ_RESPONSE_ONLY))
ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE, COMPARE_SWAP, FETCH_ADD = (
    int(Op.ACKNOWLEDGE), int(Op.ATOMIC_ACKNOWLEDGE), int(Op.COMPARE_SWAP), int(Op.FETCH_ADD))
# AETH syndrome (InfiniBand spec): bit 7 reserved, bits 6:5 the type, bits 4:0 a value whose meaning depends on it.
SYNDROME_TYPE_MASK = 0x60
ACK = 0x00  # type; the value is a credit count
ACK_UNLIMITED = 0x1F  # "credits invalid/unlimited": the only ACK rxe sends
RNR_NAK = 0x20  # type; syndrome = RNR_NAK | timer code, the delay is RNR_TIMER_US[code]
NAK = 0x60  # type; the value is one of the codes below
NAK_PSN_SEQ = 0x60
NAK_INVALID_REQUEST = 0x61
NAK_REMOTE_ACCESS = 0x62
NAK_REMOTE_OPERATIONAL = 0x63
# RNR NAK timer code -> delay in microseconds. Code 0 is the longest, not the shortest.
RNR_TIMER_US = (655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120,
                7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520)


@dataclasses.dataclass
class IpUdpFields:
    """The IPv4 and UDP header fields a packet travels under, defined once for `Packet` and `Segments`.

    Both list this class first among their bases: a dataclass takes its bases' fields from the last base to the
    first, so these come after the other base's (_PacketFields, _MessageFields) and both classes keep their positional
    order. No slots of its own: the classes built on it have them all."""

    __slots__ = ()
    src_ip: str = ""
    dst_ip: str = ""
    src_port: int = 0
    dst_port: int = ROCE_PORT
    ip_id: int = 0
    tos: int = 0
    ttl: int = 64


@dataclasses.dataclass
class _PacketFields:
    """Packet's fields before the IP/UDP header's."""

    __slots__ = ()
    opcode: int
    dest_qp: int
    psn: int
    ack_req: bool = False
    solicited: bool = False
    pkey: int = 0xFFFF
    fecn: bool = False
    becn: bool = False
    remote_addr: int = 0  # RETH or AtomicETH virtual address
    rkey: int = 0  # RETH or AtomicETH R_Key
    dma_length: int = 0  # RETH: the length of the whole message, not of this packet
    syndrome: int = 0  # AETH
    msn: int = 0  # AETH: the responder's count of completed messages
    immediate: int = 0  # ImmDt, or the IETH R_Key to invalidate
    payload: bytes | memoryview = b""  # without pad; after decode, a view into the received datagram


@dataclasses.dataclass(slots=True)
class Packet(IpUdpFields, _PacketFields):
    """One RoCEv2 packet: BTH fields, the extension-header fields its opcode carries, payload, the IP/UDP header
    (`IpUdpFields`), then the fields added last.

    Fields of headers the opcode does not carry are ignored by `encode` and left at their defaults by `decode`.
    24-bit fields (dest_qp, psn, msn) are taken modulo 2**24 as the wire does, so callers may let PSNs run on.
    """

    migreq: bool = False  # BTH M bit (path migration); RoCE stacks differ in what they send, so it round-trips
    swap_add: int = 0  # AtomicETH: the swap value (COMPARE_SWAP) or the addend (FETCH_ADD)
    compare: int = 0  # AtomicETH: the compare value (COMPARE_SWAP)
    original: int = 0  # AtomicAckETH: the remote value before the atomic operation


Opcodes = tuple[int, int, int, int]  # a message's opcodes by position: middle, last, first, only


@dataclasses.dataclass
class _MessageFields:
    """Segments' fields before the IP/UDP header's."""

    __slots__ = ()
    opcodes: Opcodes
    dest_qp: int
    first_psn: int
    npkts: int
    mtu: int
    data: Any  # the message's memory: a memoryview or anything else with len() and slicing
    dma_length: int
    remote_addr: int
    rkey: int
    immediate: int
    solicited: bool
    start: int
    count: int
    acks: int
    pkey: int = 0xFFFF


@dataclasses.dataclass(slots=True)
class Segments(IpUdpFields, _MessageFields):
    """Packets `start` .. `start + count - 1` of one WRITE or SEND message, described once instead of as Packets.

    A message of `dma_length` bytes at path MTU `mtu` travels as `npkts` packets (hw.verbs.psn_count): packet k has PSN
    first_psn + k, opcode opcodes[(k is the first) << 1 | (k is the last)] and the bytes data[k * mtu:][:mtu]. The
    first carries the RETH (remote_addr, rkey, dma_length) when its opcode has one, the last the solicited bit, and
    every packet whose opcode has an ImmDt the immediate. Bit i of `acks` sets AckReq on packet start + i. The
    IP/UDP header (`IpUdpFields`) is as on Packet, and transports stamp it the same way.

    The requester queues its bulk output like this so that a transport can encode it straight into its transmit
    buffers (codec.encode_segments_into), without a Packet per packet; `packets()` spells it out wherever Packets are
    wanted (faults, the pcap tap, tests).
    """

    def packet(self, k: int) -> Packet:
        """Packet k of the message, as a Packet."""
        first, last = k == 0, k == self.npkts - 1
        begin = k * self.mtu
        return Packet(self.opcodes[first << 1 | last], self.dest_qp, (self.first_psn + k) & PSN_MASK,
                      bool(self.acks >> (k - self.start) & 1), last and self.solicited, self.pkey, False, False,
                      self.remote_addr if first else 0, self.rkey if first else 0, self.dma_length if first else 0,
                      0, 0, self.immediate, self.data[begin:self.dma_length if last else begin + self.mtu],
                      self.src_ip, self.dst_ip, self.src_port, self.dst_port, self.ip_id, self.tos, self.ttl)

    def packets(self) -> list[Packet]:
        return [self.packet(k) for k in range(self.start, self.start + self.count)]


class MessageRun(Protocol):
    """Packets of several messages described at once (wqeblock.Burst, a requester's turn over its plain WQEs): what a
    transport needs of them besides spelling them out, as the Segments the requester would otherwise have queued or as
    Packets."""

    src_ip: str
    dst_ip: str
    src_port: int
    dst_port: int
    ip_id: int
    tos: int
    ttl: int
    mtu: int
    count: int

    def segments(self) -> list[Segments]: ...

    def packets(self) -> list[Packet]: ...


Outgoing = Union[Packet, Segments, MessageRun]  # what the data path queues for the wire


def segmented(items: Sequence[Outgoing]) -> list[Packet | Segments]:
    """`items` with every MessageRun spelled out as its Segments."""
    out: list[Packet | Segments] = []
    for item in items:
        if isinstance(item, (Packet, Segments)):
            out.append(item)
        else:
            out += item.segments()
    return out


def expand(items: list[Outgoing]) -> list[Packet]:
    """The Packets a list of Packets, Segments and MessageRuns stands for, in order."""
    packets: list[Packet] = []
    for item in items:
        if isinstance(item, Packet):
            packets.append(item)
        else:
            packets += item.packets()
    return packets


def udp_source_port(local_qpn: int, remote_qpn: int) -> int:
    """The UDP source port Linux RoCE drivers use for a QP pair: symmetric, in 49152..65535.

    rdma_flow_label_to_udp_sport(rdma_calc_flow_label(lqpn, rqpn)) from include/rdma/ib_verbs.h: fold the product of
    the QPNs to a 20-bit flow label, then fold that to 14 bits. Switches hash on it (ECMP), so distinct QPs spread.
    """
    v = local_qpn * remote_qpn
    v ^= v >> 20
    v ^= v >> 40
    flow_label = v & 0xFFFFF
    return (flow_label & 0x3FFF ^ flow_label >> 14) | 0xC000
