"""The RoCEv2 codec: `Packet` <-> bytes, with the ICRC. Sans-IO, like h11's readers and writers.

Only RC opcodes (plus the CNP) exist here because the emulated NIC speaks RC. The layout of every packet is a table
lookup: each opcode maps to one precompiled `struct.Struct` covering BTH and its extension headers, so encoding is
one `pack_into`, a payload copy and one CRC-32 over the packet (`encode_into` writes straight into a transmit
buffer, `encode_segments_into` a burst of one message's packets), and decoding is the mirror image. The ICRC is
computed incrementally (icrc.py says how, and gives the plain rule the tests hold it to).
"""
from __future__ import annotations

import dataclasses
import operator
import socket
import struct

try:  # ISA-L's CRC-32 is the same function, ~7x faster on 4 KiB packets (0.10 vs 0.73 us); zlib is the fallback
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without isal wheels
    from zlib import crc32
from collections.abc import Callable
from typing import Any

from .icrc import ICRC, icrc_basis, mask_byte4
from .packets import (BTH_SIZE, FECN_BECN_BYTE, HAS_AETH, HAS_ATOMIC_ACK_ETH, HAS_ATOMIC_ETH, HAS_IETH, HAS_IMM,
                      HAS_PAYLOAD, HAS_RETH, ICRC_SIZE, IPV4_DONT_FRAGMENT, IPV4_HEADER_SIZE, IPV4_UDP, MSN_MASK,
                      QPN_MASK, ROCE_PORT, UDP_HEADER_SIZE, Op, Packet, Segments)
from ..hw.verbs import PSN_MASK


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
_PADS = (b"", b"\0", b"\0\0", b"\0\0\0")


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
    crc_start, mask = icrc_basis(p.src_ip, p.dst_ip, p.src_port, p.dst_port, p.ip_id, IPV4_DONT_FRAGMENT,
                                  UDP_HEADER_SIZE + length + ICRC_SIZE)
    byte4 = buffer[offset + FECN_BECN_BYTE]
    if byte4:
        mask = mask_byte4(byte4, length - FECN_BECN_BYTE - 1)
    ICRC.pack_into(buffer, end, crc32(buffer[offset:end], crc_start) ^ mask)
    return length + ICRC_SIZE


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
            known_length, (crc_start, mask) = length, icrc_basis(s.src_ip, s.dst_ip, s.src_port, s.dst_port, s.ip_id,
                                                                  IPV4_DONT_FRAGMENT, UDP_HEADER_SIZE + length)
        ICRC.pack_into(buffer, icrc_at, crc32(buffer[offset:icrc_at], crc_start) ^ mask)
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
    crc_start, mask = icrc_basis(s.src_ip, s.dst_ip, s.src_port, s.dst_port, s.ip_id, IPV4_DONT_FRAGMENT,
                                  UDP_HEADER_SIZE + icrc_at - offset + ICRC_SIZE)
    ICRC.pack_into(buffer, icrc_at, crc32(buffer[offset:icrc_at], crc_start) ^ mask)
    return icrc_at - offset + ICRC_SIZE


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
    return IPV4_UDP.pack(0x45, p.tos, total, p.ip_id, IPV4_DONT_FRAGMENT, p.ttl, socket.IPPROTO_UDP, ~checksum & 0xFFFF,
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
     src_port, dst_port, udp_length, _) = IPV4_UDP.unpack_from(view)
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
        crc_start, mask = icrc_basis(src, dst, src_port, dst_port, ip_id, flags_fragment, UDP_HEADER_SIZE + size)
        byte4 = view[FECN_BECN_BYTE]
        if byte4:
            mask = mask_byte4(byte4, size - ICRC_SIZE - FECN_BECN_BYTE - 1)
        crc = crc32(view[:size - ICRC_SIZE], crc_start) ^ mask
        (got,) = ICRC.unpack_from(view, size - ICRC_SIZE)
        if crc != got:
            raise IcrcMismatch(f"ICRC mismatch: expected {ICRC.pack(crc).hex()}, got {ICRC.pack(got).hex()} "
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


