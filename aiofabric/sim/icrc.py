"""The RoCEv2 ICRC: the rule written plainly (`icrc`), and the pieces the codec's hot paths compute it from.

`icrc()` is the rule of the RoCEv2 annex: a CRC-32 over the packet with its variant fields masked, as rxe's
rxe_icrc.c computes it. The codec (codec.py) computes the same CRC without building the masked copy it describes, and
the tests hold the two (and scapy) equal:
- the masked IPv4/UDP pseudo header only depends on the addresses, ports, IP ID and length, so the CRC state after it
  is remembered per header (`icrc_basis`);
- the CRC runs over the packet as sent, with BTH byte 4 (FECN/BECN) unmasked, and is then corrected: CRC-32 is
  affine, so replacing that byte by 0xFF changes the result by a constant that only depends on the byte's value and
  on how many bytes follow it (`mask_byte4`; the one for the usual value 0 is remembered with the header's state).
"""
from __future__ import annotations

import socket
import struct
import zlib

from .packets import BTH_SIZE, FECN_BECN_BYTE, ICRC_SIZE, IPV4_HEADER_SIZE, IPV4_UDP, UDP_HEADER_SIZE

ICRC = struct.Struct("<I")  # the CRC-32 is stored little-endian: rxe writes its u32 in host order (x86)
# crc32 state after the masked LRH rxe folds into its seed 0xdebb20e3: eight 0xFF bytes (rxe_icrc.c).
_ICRC_SEED = zlib.crc32(b"\xff" * 8)
_CACHE_LIMIT = 4096  # entries per memo below; a run uses a handful (peers x packet sizes), so this only bounds abuse
_ICRC_BASES: dict[tuple, tuple[int, int]] = {}
_BYTES_UP_TO_BYTE4 = UDP_HEADER_SIZE + FECN_BECN_BYTE + 1 + ICRC_SIZE  # UDP length - bytes after BTH byte 4 (ICRC out)
_BYTE4_MASKS: dict[int, int] = {}
_ADDRESSES: dict[str, bytes] = {}


def icrc_basis(src: str | bytes, dst: str | bytes, src_port: int, dst_port: int, ip_id: int, flags_fragment: int,
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
        basis = _ICRC_BASES[key] = (zlib.crc32(IPV4_UDP.pack(
            0x45, 0xFF, IPV4_HEADER_SIZE + udp_length, ip_id, flags_fragment, 0xFF, socket.IPPROTO_UDP, 0xFFFF,
            _aton(src) if isinstance(src, str) else src, _aton(dst) if isinstance(dst, str) else dst, src_port,
            dst_port, udp_length, 0xFFFF), _ICRC_SEED), mask_byte4(0, udp_length - _BYTES_UP_TO_BYTE4))
    return basis


def mask_byte4(value: int, following: int) -> int:
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
    return ICRC.pack(zlib.crc32(masked, _ICRC_SEED))
