"""The RoCEv2 codec: `Packet` <-> bytes, with the ICRC. Sans-IO, like h11's readers and writers.

Only RC opcodes (plus the CNP) exist here because the emulated NIC speaks RC. The layout of every packet is a table
lookup: each opcode maps to one precompiled `struct.Struct` covering BTH and its extension headers, so encoding is
one `pack_into`, a payload copy and one CRC-32 over the packet (`encode_into` writes straight into a transmit
buffer), and decoding is the mirror image. `icrc()` is the ICRC rule written plainly (RoCEv2 annex: a CRC-32 over the
packet with its variant fields masked, as rxe's rxe_icrc.c computes it); the hot paths
compute the same CRC without building the masked copy it describes, and the tests hold the two (and scapy) equal:
- the masked IPv4/UDP pseudo header only depends on the addresses, ports, IP ID and length, so the CRC state after it
  is remembered per header (`_icrc_basis`);
- the CRC runs over the packet as sent, with BTH byte 4 (FECN/BECN) unmasked, and is then corrected: CRC-32 is
  affine, so replacing that byte by 0xFF changes the result by a constant that only depends on the byte's value and
  on how many bytes follow it (`_mask_byte4`; the one for the usual value 0 is remembered with the header's state).

Addresses and ports live on the `Packet` because the ICRC covers the IPv4 and UDP headers: a packet's bytes are only
meaningful together with the header the wire gives it.
"""
from __future__ import annotations

import dataclasses
import enum
import operator
import socket
import struct
import zlib

try:  # ISA-L's CRC-32 is the same function, ~7x faster on 4 KiB packets (0.10 vs 0.73 us); zlib is the fallback
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without isal wheels
    from zlib import crc32
from collections.abc import Callable
from typing import Any

from ..hw.verbs import PSN_MASK

ROCE_PORT = 4791
QPN_MASK = 0xFFFFFF
MSN_MASK = 0xFFFFFF  # the AETH's message sequence number

BTH_SIZE = 12
ICRC_SIZE = 4
IPV4_HEADER_SIZE = 20
UDP_HEADER_SIZE = 8
IPV4_DONT_FRAGMENT = 0x4000  # RoCE stacks always set DF; Linux then writes IP ID 0 for unconnected sockets


class BadPacket(ValueError):
    """A datagram that is not a well-formed RoCEv2 packet, or whose ICRC does not match. The message says why;
    `reason` names the check that failed, for per-reason drop counters: one of DROP_REASONS."""

    reason = "malformed"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class IcrcMismatch(BadPacket):
    """The ICRC does not match the packet: it was corrupted in flight, or the IP header assumed for it is wrong."""

    reason = "icrc"


# Why decode() refuses a datagram: not IPv4/UDP to 4791 (raw transport only), shorter than BTH + ICRC, ICRC
# mismatch, an opcode outside RC and CNP, a BTH transport version other than 0, a length its opcode and pad disallow.
DROP_REASONS = ("ipv4", "short", "icrc", "opcode", "version", "length")


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
# Message boundaries: FIRST/ONLY packets start a message, LAST/ONLY packets end one. Single-packet operations
# (READ request, atomics, acknowledgements) are both.
STARTS_MESSAGE = frozenset(op for op in Op if "_MIDDLE" not in op.name and "_LAST" not in op.name)
ENDS_MESSAGE = frozenset(op for op in Op if "_FIRST" not in op.name and "_MIDDLE" not in op.name)

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


@dataclasses.dataclass(slots=True)
class Packet:
    """One RoCEv2 packet: BTH fields, the extension-header fields its opcode carries, payload, and the IP/UDP header.

    Fields of headers the opcode does not carry are ignored by `encode` and left at their defaults by `decode`.
    24-bit fields (dest_qp, psn, msn) are taken modulo 2**24 as the wire does, so callers may let PSNs run on.
    """

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
    src_ip: str = ""
    dst_ip: str = ""
    src_port: int = 0
    dst_port: int = ROCE_PORT
    ip_id: int = 0
    tos: int = 0
    ttl: int = 64
    migreq: bool = False  # BTH M bit (path migration); RoCE stacks differ in what they send, so it round-trips
    swap_add: int = 0  # AtomicETH: the swap value (COMPARE_SWAP) or the addend (FETCH_ADD)
    compare: int = 0  # AtomicETH: the compare value (COMPARE_SWAP)
    original: int = 0  # AtomicAckETH: the remote value before the atomic operation


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    """How one opcode is laid out: BTH plus extension headers as one struct, and the Packet fields that fill them."""

    header: struct.Struct  # BTH + extension headers
    fields: tuple[str, ...]  # Packet attributes for the extension headers, in wire order (AETH handled apart)
    get_fields: Callable[[Any], tuple[int, ...]]  # those attributes' values (of a Packet, or alike-named Segments)
    aeth: bool
    payload: bool

    def set_fields(self, p: Packet, values: tuple[int, ...]) -> None:
        """Set p's extension-header fields from the values `header` unpacked (the BTH's five first)."""
        if self.fields is _RETH_FIELDS:  # WRITE FIRST/ONLY and READ requests: most packets with extension headers
            p.remote_addr, p.rkey, p.dma_length = values[5], values[6], values[7]
            return
        ext = values[5:]
        if self.aeth:
            p.syndrome, p.msn = ext[0] >> 24, ext[0] & MSN_MASK
            ext = ext[1:]
        for name, value in zip(self.fields, ext):
            setattr(p, name, value)


_BTH_FORMAT = "BBHII"  # opcode, SE|M|PadCnt|TVer, P_Key, FECN|BECN|resv6|DestQP, A|resv7|PSN
_PSEUDO_FORMAT = "BBHHHBBH4s4sHHHH"  # IPv4: ver/IHL, TOS, length, ID, flags, TTL, proto, checksum, src, dst; UDP
_BTH = struct.Struct(">" + _BTH_FORMAT)
_IPV4_UDP = struct.Struct(">" + _PSEUDO_FORMAT)
_ICRC = struct.Struct("<I")  # the CRC-32 is stored little-endian: rxe writes its u32 in host order (x86)
# crc32 state after the masked LRH rxe folds into its seed 0xdebb20e3: eight 0xFF bytes (rxe_icrc.c).
_ICRC_SEED = zlib.crc32(b"\xff" * 8)
_PADS = (b"", b"\0", b"\0\0", b"\0\0\0")
_FECN_BECN_BYTE = 4  # the BTH byte the ICRC masks to 0xFF
_CACHE_LIMIT = 4096  # entries per memo below; a run uses a handful (peers x packet sizes), so this only bounds abuse
_ICRC_BASES: dict[tuple, tuple[int, int]] = {}
_BYTES_UP_TO_BYTE4 = UDP_HEADER_SIZE + _FECN_BECN_BYTE + 1 + ICRC_SIZE  # UDP length - bytes after BTH byte 4 (ICRC out)
_BYTE4_MASKS: dict[int, int] = {}
_ADDRESSES: dict[str, bytes] = {}


def _icrc_basis(src: str | bytes, dst: str | bytes, src_port: int, dst_port: int, ip_id: int, flags_fragment: int,
                udp_length: int) -> tuple[int, int]:
    """For a packet of `udp_length` under this IPv4/UDP header: the ICRC's crc32 state after the seed and the masked
    header (TOS, TTL and checksums all ones), and the XOR that masks its BTH byte 4 when that byte is 0 (as it is
    unless FECN/BECN are set).

    Addresses are dotted strings (as packets name them) or 4 bytes (as headers carry them), whichever the caller has.
    """
    key = (src, dst, src_port, dst_port, ip_id, flags_fragment, udp_length)
    basis = _ICRC_BASES.get(key)
    if basis is None:
        if len(_ICRC_BASES) >= _CACHE_LIMIT:
            _ICRC_BASES.clear()
        basis = _ICRC_BASES[key] = (zlib.crc32(_IPV4_UDP.pack(
            0x45, 0xFF, IPV4_HEADER_SIZE + udp_length, ip_id, flags_fragment, 0xFF, socket.IPPROTO_UDP, 0xFFFF,
            _aton(src) if isinstance(src, str) else src, _aton(dst) if isinstance(dst, str) else dst, src_port,
            dst_port, udp_length, 0xFFFF), _ICRC_SEED), _mask_byte4(0, udp_length - _BYTES_UP_TO_BYTE4))
    return basis


def _mask_byte4(value: int, following: int) -> int:
    """What to XOR into a crc32 computed with BTH byte 4 = `value` to get the one with byte 4 = 0xFF, when
    `following` bytes come after it: crc32(a, s) ^ crc32(b, s) = crc32 of (a ^ b) from a zero register, and a ^ b is
    one nonzero byte followed by zeros."""
    key = following << 8 | value
    mask = _BYTE4_MASKS.get(key)
    if mask is None:
        if len(_BYTE4_MASKS) >= _CACHE_LIMIT:
            _BYTE4_MASKS.clear()
        mask = _BYTE4_MASKS[key] = zlib.crc32(bytes((value ^ 0xFF,)) + bytes(following), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return mask


def _aton(ip: str) -> bytes:
    """socket.inet_aton, remembered: packets name their addresses as strings, the ICRC needs the 4 bytes."""
    address = _ADDRESSES.get(ip)
    if address is None:
        if len(_ADDRESSES) >= _CACHE_LIMIT:
            _ADDRESSES.clear()
        address = _ADDRESSES[ip] = socket.inet_aton(ip)
    return address


_RETH_FIELDS = ("remote_addr", "rkey", "dma_length")


def _one_field(name: str) -> Callable[[Any], tuple[Any, ...]]:
    get = operator.attrgetter(name)
    return lambda p: (get(p),)


def _no_fields(p: Any) -> tuple[()]:
    return ()


def _layout(op: Op) -> _Layout:
    formats: list[str] = []
    names: list[str] = []
    if op in HAS_RETH or op in HAS_ATOMIC_ETH:
        formats.append("QI")
        names += ["remote_addr", "rkey"]
    if op in HAS_RETH:
        formats.append("I")
        names.append("dma_length")
    if op in HAS_AETH:
        formats.append("I")  # syndrome << 24 | msn, packed by the codec
    if op in HAS_IMM or op in HAS_IETH:
        formats.append("I")
        names.append("immediate")
    if op in HAS_ATOMIC_ETH:
        formats.append("QQ")
        names += ["swap_add", "compare"]
    if op in HAS_ATOMIC_ACK_ETH:
        formats.append("Q")
        names.append("original")
    if op == Op.CNP:
        formats.append("16x")
    ext = "".join(formats)
    get_fields: Callable[[Any], tuple[Any, ...]]
    if len(names) > 1:
        get_fields = operator.attrgetter(*names)
    else:  # attrgetter returns a bare value for one name and needs at least one
        get_fields = _one_field(names[0]) if names else _no_fields
    fields = _RETH_FIELDS if tuple(names) == _RETH_FIELDS else tuple(names)  # set_fields knows this one by identity
    return _Layout(struct.Struct(">" + _BTH_FORMAT + ext), fields, get_fields, op in HAS_AETH, op in HAS_PAYLOAD)


_LAYOUTS: dict[int, _Layout] = {op.value: _layout(op) for op in Op}


def header_size(opcode: int) -> int:
    """Bytes of BTH plus extension headers for `opcode` (without payload, pad and ICRC)."""
    return _LAYOUTS[opcode].header.size


def _wire_fields(p: Packet, layout: _Layout, pad: int) -> tuple[int, ...]:
    """BTH words and extension-header values of `p` as `layout.header` packs them (BTH byte 4 unmasked)."""
    bth: tuple[int, ...] = (p.opcode, p.solicited << 7 | p.migreq << 6 | pad << 4, p.pkey,
           p.fecn << 31 | p.becn << 30 | p.dest_qp & QPN_MASK, p.ack_req << 31 | p.psn & PSN_MASK)
    if layout.aeth:
        bth += ((p.syndrome & 0xFF) << 24 | p.msn & MSN_MASK,)
    return bth + layout.get_fields(p)


def encode(p: Packet) -> bytes:
    """The UDP payload of `p`: BTH, extension headers, payload, pad and ICRC.

    The ICRC covers the IPv4/UDP header this packet will travel in: p.src_ip/dst_ip/src_port/dst_port/ip_id with DF
    set (TOS, TTL and checksums are masked out). For a plain unconnected DF socket the kernel writes IP ID 0, which is
    why ip_id defaults to 0.
    """
    layout = _LAYOUTS.get(p.opcode)
    size = (layout.header.size if layout is not None else 0) + len(p.payload) + 3 + ICRC_SIZE
    buffer = bytearray(size)
    return bytes(memoryview(buffer)[:encode_into(p, memoryview(buffer))])


def encode_into(p: Packet, buffer: memoryview, offset: int = 0) -> int:
    """Write the UDP payload of `p` (as `encode` makes it) into the writable byte view `buffer` at `offset`; returns
    its length. For transmit buffers: the payload is copied once, into the buffer, and nothing is allocated."""
    layout = _LAYOUTS.get(p.opcode)
    if layout is None:
        raise ValueError(f"cannot encode opcode {p.opcode:#x}: not an RC opcode")
    payload = p.payload
    size = len(payload)
    if size and not layout.payload:
        raise ValueError(f"{Op(p.opcode).name} carries no payload, got {size} bytes")
    pad = -size % 4
    header = layout.header
    header.pack_into(buffer, offset, *_wire_fields(p, layout, pad))
    start = offset + header.size
    end = start + size + pad  # where the ICRC goes
    buffer[start:start + size] = payload
    if pad:
        buffer[end - pad:end] = _PADS[pad]
    length = end - offset
    crc_start, mask = _icrc_basis(p.src_ip, p.dst_ip, p.src_port, p.dst_port, p.ip_id, IPV4_DONT_FRAGMENT,
                                  UDP_HEADER_SIZE + length + ICRC_SIZE)
    byte4 = buffer[offset + _FECN_BECN_BYTE]
    if byte4:
        mask = _mask_byte4(byte4, length - _FECN_BECN_BYTE - 1)
    _ICRC.pack_into(buffer, end, crc32(buffer[offset:end], crc_start) ^ mask)
    return length + ICRC_SIZE


Opcodes = tuple[int, int, int, int]  # a message's opcodes by position: middle, last, first, only


@dataclasses.dataclass(slots=True)
class Segments:
    """Packets `start` .. `start + count - 1` of one WRITE or SEND message, described once instead of as Packets.

    A message of `dma_length` bytes at path MTU `mtu` travels as `npkts` packets (hw.verbs.psn_count): packet k has PSN
    first_psn + k, opcode opcodes[(k is the first) << 1 | (k is the last)] and the bytes data[k * mtu:][:mtu]. The
    first carries the RETH (remote_addr, rkey, dma_length) when its opcode has one, the last the solicited bit, and
    every packet whose opcode has an ImmDt the immediate. Bit i of `acks` sets AckReq on packet start + i. Addressing
    fields are as on Packet, and transports stamp them the same way.

    The requester queues its bulk output like this so that a transport can encode it straight into its transmit
    buffers (`encode_segments_into`), without a Packet per packet; `packets()` spells it out wherever Packets are
    wanted (faults, the pcap tap, tests).
    """

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
    src_ip: str = ""
    dst_ip: str = ""
    src_port: int = 0
    dst_port: int = ROCE_PORT
    ip_id: int = 0
    tos: int = 0
    ttl: int = 64

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


def encode_segments_into(s: Segments, k: int, count: int, buffer: memoryview, offset: int, stride: int) -> list[int]:
    """Write packets k .. k + count - 1 of `s`'s message (as `encode(s.packet(k))` makes each) into `buffer` at
    offset, offset + stride, ...; their lengths.

    One loop for the whole burst: MIDDLE packets, most of a long message, share their length and so the ICRC's start
    (BTH byte 4 is always 0 here), which is looked up once per length.
    """
    if count == 1 and s.npkts == 1:
        return [_encode_only_into(s, buffer, offset)]
    mtu, npkts, data, dma_length, acks, start = s.mtu, s.npkts, s.data, s.dma_length, s.acks, s.start
    opcodes, qpn, pkey, first_psn = s.opcodes, s.dest_qp & QPN_MASK, s.pkey, s.first_psn
    solicited = s.solicited << 7
    lengths = []
    known_length = crc_start = mask = 0  # the ICRC basis of the last length seen
    for k in range(k, k + count):
        last = k == npkts - 1
        opcode = opcodes[(k == 0) << 1 | last]
        layout = _LAYOUTS[opcode]
        header = layout.header
        begin = k * mtu
        end = dma_length if last else begin + mtu
        pad = (begin - end) & 3
        flags = (solicited if last else 0) | pad << 4
        psn_word = (acks >> (k - start) & 1) << 31 | (first_psn + k) & PSN_MASK
        fields = layout.fields
        if fields is _RETH_FIELDS:  # WRITE FIRST/ONLY: spelled out, a third cheaper than through get_fields
            header.pack_into(buffer, offset, opcode, flags, pkey, qpn, psn_word, s.remote_addr, s.rkey, dma_length)
        elif fields:  # the ..._WITH_IMMEDIATE ones: their fields are named alike on Segments
            header.pack_into(buffer, offset, opcode, flags, pkey, qpn, psn_word, *layout.get_fields(s))
        else:
            header.pack_into(buffer, offset, opcode, flags, pkey, qpn, psn_word)
        payload_at = offset + header.size
        icrc_at = payload_at + end - begin + pad
        buffer[payload_at:icrc_at - pad] = data[begin:end]
        if pad:
            buffer[icrc_at - pad:icrc_at] = _PADS[pad]
        length = icrc_at - offset + ICRC_SIZE
        if length != known_length:
            known_length, (crc_start, mask) = length, _icrc_basis(s.src_ip, s.dst_ip, s.src_port, s.dst_port, s.ip_id,
                                                                  IPV4_DONT_FRAGMENT, UDP_HEADER_SIZE + length)
        _ICRC.pack_into(buffer, icrc_at, crc32(buffer[offset:icrc_at], crc_start) ^ mask)
        lengths.append(length)
        offset += stride
    return lengths


def _encode_only_into(s: Segments, buffer: memoryview, offset: int) -> int:
    """encode_segments_into for a one-packet message (the usual small WRITE or SEND), without the burst's loop."""
    opcode = s.opcodes[3]
    layout = _LAYOUTS[opcode]
    header, fields, length = layout.header, layout.fields, s.dma_length
    pad = -length & 3
    flags, qpn, psn_word = s.solicited << 7 | pad << 4, s.dest_qp & QPN_MASK, (s.acks & 1) << 31 | s.first_psn & PSN_MASK
    if fields is _RETH_FIELDS:
        header.pack_into(buffer, offset, opcode, flags, s.pkey, qpn, psn_word, s.remote_addr, s.rkey, length)
    elif fields:
        header.pack_into(buffer, offset, opcode, flags, s.pkey, qpn, psn_word, *layout.get_fields(s))
    else:
        header.pack_into(buffer, offset, opcode, flags, s.pkey, qpn, psn_word)
    payload_at = offset + header.size
    icrc_at = payload_at + length + pad
    buffer[payload_at:icrc_at - pad] = s.data[:length]
    if pad:
        buffer[icrc_at - pad:icrc_at] = _PADS[pad]
    crc_start, mask = _icrc_basis(s.src_ip, s.dst_ip, s.src_port, s.dst_port, s.ip_id, IPV4_DONT_FRAGMENT,
                                  UDP_HEADER_SIZE + icrc_at - offset + ICRC_SIZE)
    _ICRC.pack_into(buffer, icrc_at, crc32(buffer[offset:icrc_at], crc_start) ^ mask)
    return icrc_at - offset + ICRC_SIZE


def expand(items: list[Packet | Segments]) -> list[Packet]:
    """The Packets a list of Packets and Segments stands for, in order."""
    packets: list[Packet] = []
    for item in items:
        if isinstance(item, Packet):
            packets.append(item)
        else:
            packets += item.packets()
    return packets


def encode_ipv4_header(p: Packet, udp_payload_length: int) -> bytes:
    """The 28-byte IPv4 (DF, correct checksum) and UDP (checksum 0, as RoCE sends) headers in front of a UDP payload."""
    total = IPV4_HEADER_SIZE + UDP_HEADER_SIZE + udp_payload_length
    src, dst = socket.inet_aton(p.src_ip), socket.inet_aton(p.dst_ip)
    # The one's-complement sum of the header's 16-bit words, from the fields rather than from packed bytes.
    addresses = int.from_bytes(src, "big") + int.from_bytes(dst, "big")
    checksum = ((0x45 << 8 | p.tos) + total + p.ip_id + IPV4_DONT_FRAGMENT + (p.ttl << 8 | socket.IPPROTO_UDP)
                + (addresses >> 16) + (addresses & 0xFFFF))
    while checksum > 0xFFFF:
        checksum = (checksum & 0xFFFF) + (checksum >> 16)
    return _IPV4_UDP.pack(0x45, p.tos, total, p.ip_id, IPV4_DONT_FRAGMENT, p.ttl, socket.IPPROTO_UDP, ~checksum & 0xFFFF,
                          src, dst, p.src_port, p.dst_port, UDP_HEADER_SIZE + udp_payload_length, 0)


def encode_ipv4(p: Packet) -> bytes:
    """The whole IPv4 packet of `p` (header, UDP with checksum 0, BTH .. ICRC): for raw sockets and pcaps."""
    udp_payload = encode(p)
    return encode_ipv4_header(p, len(udp_payload)) + udp_payload


def decode(udp_payload: bytes | bytearray | memoryview, src_ip: str, dst_ip: str, src_port: int,
           dst_port: int = ROCE_PORT, ip_id: int = 0, *, check_icrc: bool = True) -> Packet:
    """Parse a UDP payload received from src_ip:src_port at dst_ip:dst_port. Raises `BadPacket`.

    The ICRC is checked over the IPv4 header the sender is assumed to have written: DF set and `ip_id`, which a plain
    UDP socket cannot see (hence the default 0, what Linux writes for unconnected DF sockets). The returned payload is
    a view into `udp_payload`: do not reuse that buffer while the packet is alive.
    """
    view = udp_payload if type(udp_payload) is memoryview else memoryview(udp_payload)
    return _decode(view, src_ip, dst_ip, src_port, dst_port, ip_id, IPV4_DONT_FRAGMENT, check_icrc, src_ip, dst_ip, 0,
                   64)


def decode_ipv4(packet: bytes | bytearray | memoryview, *, check_icrc: bool = True) -> Packet:
    """Parse a whole IPv4 packet (as a raw socket receives it), checking the ICRC over its real header."""
    view = memoryview(packet)
    if len(view) < IPV4_HEADER_SIZE + UDP_HEADER_SIZE:
        raise BadPacket(f"too short for IPv4 + UDP: {len(view)} bytes", "ipv4")
    (version_ihl, tos, total, ip_id, flags_fragment, ttl, protocol, _, src, dst,
     src_port, dst_port, udp_length, _) = _IPV4_UDP.unpack_from(view)
    if version_ihl != 0x45:
        raise BadPacket(f"not a plain IPv4 header (version/IHL byte {version_ihl:#04x}; RoCEv2 uses no IP options)",
                        "ipv4")
    if protocol != socket.IPPROTO_UDP:
        raise BadPacket(f"IP protocol {protocol}, not UDP", "ipv4")
    if flags_fragment & 0x3FFF:
        raise BadPacket("IPv4 fragment: RoCEv2 packets are never fragmented", "ipv4")
    if dst_port != ROCE_PORT:
        raise BadPacket(f"UDP destination port {dst_port}, not {ROCE_PORT}", "ipv4")
    if not IPV4_HEADER_SIZE + UDP_HEADER_SIZE <= total <= len(view) or udp_length != total - IPV4_HEADER_SIZE:
        raise BadPacket(f"IPv4 length {total} and UDP length {udp_length} disagree with the {len(view)} bytes "
                        f"received", "ipv4")
    return _decode(view[IPV4_HEADER_SIZE + UDP_HEADER_SIZE:total], src, dst, src_port, dst_port, ip_id,
                   flags_fragment, check_icrc, socket.inet_ntoa(src), socket.inet_ntoa(dst), tos, ttl)


def _decode(view: memoryview, src: str | bytes, dst: str | bytes, src_port: int, dst_port: int, ip_id: int,
            flags_fragment: int, check_icrc: bool, src_ip: str, dst_ip: str, tos: int, ttl: int) -> Packet:
    size = len(view)
    if size < BTH_SIZE + ICRC_SIZE:
        raise BadPacket(f"too short for BTH + ICRC: {size} bytes", "short")
    if check_icrc:  # first, so that a corrupted packet is reported as such and not as whatever the flip looks like
        crc_start, mask = _icrc_basis(src, dst, src_port, dst_port, ip_id, flags_fragment, UDP_HEADER_SIZE + size)
        byte4 = view[_FECN_BECN_BYTE]
        if byte4:
            mask = _mask_byte4(byte4, size - ICRC_SIZE - _FECN_BECN_BYTE - 1)
        crc = crc32(view[:size - ICRC_SIZE], crc_start) ^ mask
        (got,) = _ICRC.unpack_from(view, size - ICRC_SIZE)
        if crc != got:
            raise IcrcMismatch(f"ICRC mismatch: expected {_ICRC.pack(crc).hex()}, got {_ICRC.pack(got).hex()} "
                               f"(wire bytes; assumed IP ID {ip_id})")
    opcode, flags = view[0], view[1]
    layout = _LAYOUTS.get(opcode)
    if layout is None:
        raise BadPacket(f"unsupported opcode {opcode:#04x} (only RC opcodes and CNP)", "opcode")
    if flags & 0x0F:
        raise BadPacket(f"BTH transport header version {flags & 0x0F}, expected 0", "version")
    pad = flags >> 4 & 3
    header_end = layout.header.size
    payload_end = size - ICRC_SIZE - pad
    if not layout.payload:
        if pad or size != header_end + ICRC_SIZE:
            raise BadPacket(f"{Op(opcode).name} is {header_end + ICRC_SIZE} bytes with PadCnt 0, got {size} bytes "
                            f"with PadCnt {pad}", "length")
    elif payload_end < header_end:
        raise BadPacket(f"{Op(opcode).name} needs at least {header_end + pad + ICRC_SIZE} bytes (headers, pad {pad}, "
                        f"ICRC), got {size}", "length")
    elif (size - header_end) % 4:
        raise BadPacket(f"payload plus pad is {size - header_end - ICRC_SIZE} bytes, not a multiple of 4 "
                        f"(PadCnt {pad})", "length")
    values = layout.header.unpack_from(view)
    pkey, qpn_word, psn_word = values[2], values[3], values[4]
    # Positional (extension-header fields zero, set below): twice as fast as keywords on this per-packet path;
    # comparisons make the flag bools without a bool() call each.
    p = Packet(opcode, qpn_word & QPN_MASK, psn_word & PSN_MASK, psn_word >= 0x80000000, flags >= 0x80, pkey,
               qpn_word >= 0x80000000, qpn_word & 0x40000000 != 0, 0, 0, 0, 0, 0, 0, view[header_end:payload_end],
               src_ip, dst_ip, src_port, dst_port, ip_id, tos, ttl, flags & 0x40 != 0)
    if layout.fields or layout.aeth:
        layout.set_fields(p, values)
    return p


def icrc(ip_packet_without_icrc: bytes | bytearray | memoryview) -> bytes:
    """The 4 ICRC wire bytes of an IPv4 RoCEv2 packet (IP header onwards, ICRC not yet appended), by the plain rule.

    Mask what routers may change (TOS, TTL, IP checksum, UDP checksum, BTH byte 4 with FECN/BECN), prepend the eight
    0xFF bytes of the masked LRH that InfiniBand's ICRC also covers, and take the CRC-32. The length fields must
    already count the 4 ICRC bytes.
    """
    masked = bytearray(ip_packet_without_icrc)
    ihl = (masked[0] & 0x0F) * 4 if masked else 0
    if len(masked) < ihl + UDP_HEADER_SIZE + BTH_SIZE or ihl < IPV4_HEADER_SIZE:
        raise ValueError(f"not an IPv4 RoCEv2 packet: {len(masked)} bytes, IHL {ihl} (the ICRC needs IPv4, UDP and "
                         f"a BTH)")
    masked[1] = masked[8] = 0xFF
    masked[10:12] = masked[ihl + 6:ihl + 8] = b"\xff\xff"
    masked[ihl + UDP_HEADER_SIZE + 4] = 0xFF
    return _ICRC.pack(zlib.crc32(masked, _ICRC_SEED))


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
