"""The RoCEv2 codec against itself (round trips), scapy (an independent ICRC), and the reference captures."""
from __future__ import annotations

import dataclasses
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric.sim.codec import (BadPacket, decode, decode_ipv4, encode, encode_into, encode_ipv4, encode_ipv4_header,
                                 encode_segments_into, header_size)
from aiofabric.sim.icrc import icrc
from aiofabric.sim.packets import (ACK_UNLIMITED, HAS_AETH, HAS_ATOMIC_ACK_ETH, HAS_ATOMIC_ETH, HAS_IETH, HAS_IMM,
                                   HAS_PAYLOAD, HAS_RETH, NAK_PSN_SEQ, NAK_REMOTE_ACCESS, RNR_NAK, RNR_TIMER_US,
                                   ROCE_PORT, Op, Packet, Segments, expand, udp_source_port)
from tests.support import CHECKOUT

scapy_all = pytest.importorskip("scapy.all")
roce = pytest.importorskip("scapy.contrib.roce")

DATA = CHECKOUT / "tests" / "data"
SHARED_REFERENCE = CHECKOUT.parent / "shared/reference"

u8, u16, u32, u64 = (st.integers(0, 2**bits - 1) for bits in (8, 16, 32, 64))
u24 = st.integers(0, 2**24 - 1)
ipv4 = st.ip_addresses(v=4).map(str)
BYTE_PATTERN = bytes(range(256)) * 17


@st.composite
def packets(draw: st.DrawFn, opcodes: st.SearchStrategy[Op] = st.sampled_from(Op)) -> Packet:
    """Packets with every field its opcode carries drawn at random (others at their defaults, as decode leaves them)."""
    op = draw(opcodes)
    p = Packet(op, draw(u24), draw(u24), ack_req=draw(st.booleans()), solicited=draw(st.booleans()), pkey=draw(u16),
               fecn=draw(st.booleans()), becn=draw(st.booleans()), migreq=draw(st.booleans()), src_ip=draw(ipv4),
               dst_ip=draw(ipv4), src_port=draw(u16), ip_id=draw(u16), tos=draw(u8), ttl=draw(u8))
    if op in HAS_RETH or op in HAS_ATOMIC_ETH:
        p.remote_addr, p.rkey = draw(u64), draw(u32)
    if op in HAS_RETH:
        p.dma_length = draw(u32)
    if op in HAS_AETH:
        p.syndrome, p.msn = draw(u8), draw(u24)
    if op in HAS_IMM or op in HAS_IETH:
        p.immediate = draw(u32)
    if op in HAS_ATOMIC_ETH:
        p.swap_add, p.compare = draw(u64), draw(u64)
    if op in HAS_ATOMIC_ACK_ETH:
        p.original = draw(u64)
    if op in HAS_PAYLOAD:
        start, length = draw(st.integers(0, 255)), draw(st.integers(0, 4096))
        p.payload = BYTE_PATTERN[start:start + length]
    return p


def reference_icrc_v4(ip_to_end_without_icrc: bytes) -> bytes:
    """The ICRC written out plainly, independently of the codec: mask TOS, TTL, the IP checksum, the UDP checksum and
    the BTH's FECN/BECN byte, prepend eight 0xFF bytes (the masked LRH), CRC-32, stored little-endian."""
    b = bytearray(ip_to_end_without_icrc); ihl = (b[0] & 15) * 4  # noqa: E702
    b[1] = 0xff; b[8] = 0xff; b[10:12] = b"\xff\xff"  # noqa: E702
    b[ihl+6:ihl+8] = b"\xff\xff"
    b[ihl+8+4] = 0xff
    return struct.pack("<I", zlib.crc32(b"\xff"*8 + bytes(b)) & 0xffffffff)


def scapy_icrc(ip_packet: bytes) -> bytes:
    """scapy's ICRC for a whole IPv4 packet: dissect, forget the ICRC, rebuild."""
    dissected = scapy_all.IP(ip_packet)
    dissected[roce.BTH].icrc = None
    return scapy_all.raw(dissected)[-4:]


def ipv4_frames(name: str) -> list[bytes]:
    """The IPv4 packets of an Ethernet capture in tests/data."""
    return [scapy_all.raw(frame)[14:] for frame in scapy_all.rdpcap(str(DATA / name))]


def with_valid_icrc(p: Packet, udp_payload_without_icrc: bytes) -> bytes:
    """A UDP payload (possibly malformed beyond the BTH) with the ICRC it would have on p's IP/UDP header."""
    header = encode_ipv4_header(p, len(udp_payload_without_icrc) + 4)
    return udp_payload_without_icrc + icrc(header + udp_payload_without_icrc)


def test_packet_positional_order_is_the_documented_one():
    # decode builds Packets positionally for speed; this pins the field order it relies on.
    names = [f.name for f in dataclasses.fields(Packet)]
    assert names[:15] == ["opcode", "dest_qp", "psn", "ack_req", "solicited", "pkey", "fecn", "becn", "remote_addr",
                          "rkey", "dma_length", "syndrome", "msn", "immediate", "payload"]
    assert names[15:] == ["src_ip", "dst_ip", "src_port", "dst_port", "ip_id", "tos", "ttl", "migreq", "swap_add",
                          "compare", "original"]


@settings(max_examples=400, deadline=None)
@given(packets())
def test_every_opcode_round_trips(p: Packet):
    udp_payload = encode(p)
    assert len(udp_payload) == header_size(p.opcode) + len(p.payload) + (-len(p.payload) % 4) + 4
    assert len(udp_payload) % 4 == 0
    into = memoryview(bytearray(len(udp_payload) + 10))
    assert encode_into(p, into, 7) == len(udp_payload) and into[7:7 + len(udp_payload)] == udp_payload
    decoded = decode(udp_payload, p.src_ip, p.dst_ip, p.src_port, ROCE_PORT, p.ip_id)
    assert decoded == dataclasses.replace(p, tos=0, ttl=64)  # a UDP socket sees neither
    assert bytes(decoded.payload) == p.payload
    assert decode_ipv4(encode_ipv4(p)) == p


@settings(max_examples=60, deadline=None)
@given(packets())
def test_scapy_parses_our_packets_and_computes_the_same_icrc(p: Packet):
    p.src_port = 0xC000 | p.src_port  # scapy picks the UDP payload class by either port: keep to RoCE's range
    wire = encode_ipv4(p)
    dissected = scapy_all.IP(wire)
    assert dissected[scapy_all.IP].id == p.ip_id and dissected[scapy_all.IP].flags == "DF"
    assert dissected[scapy_all.UDP].dport == ROCE_PORT and dissected[scapy_all.UDP].chksum == 0
    bth = dissected[roce.BTH]
    assert (bth.opcode, bth.dqpn, bth.psn, bth.ackreq, bth.solicited, bth.migreq, bth.pkey, bth.fecn, bth.becn) == (
        p.opcode, p.dest_qp, p.psn, p.ack_req, p.solicited, p.migreq, p.pkey, p.fecn, p.becn)
    assert bth.padcount == -len(p.payload) % 4
    del dissected[scapy_all.IP].chksum
    assert scapy_all.raw(dissected)[:20] == wire[:20], "our IPv4 header checksum differs from scapy's"
    assert scapy_icrc(wire) == wire[-4:] == icrc(wire[:-4]) == reference_icrc_v4(wire[:-4])


MESSAGE_OPCODES = [
    (Op.SEND_MIDDLE, Op.SEND_LAST, Op.SEND_FIRST, Op.SEND_ONLY),
    (Op.SEND_MIDDLE, Op.SEND_LAST_WITH_IMMEDIATE, Op.SEND_FIRST, Op.SEND_ONLY_WITH_IMMEDIATE),
    (Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST, Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_ONLY),
    (Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST_WITH_IMMEDIATE, Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE)]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MESSAGE_OPCODES), st.sampled_from([256, 1024, 4096]), st.integers(0, 5 * 4096), u24, u24,
       st.data())
def test_segments_encode_as_the_packets_they_stand_for(opcodes, mtu: int, length: int, first_psn: int, qpn: int,
                                                       data: st.DataObject):
    npkts = max(1, -(-length // mtu))
    start = data.draw(st.integers(0, npkts - 1))
    count = data.draw(st.integers(1, npkts - start))
    message = bytes(range(251)) * 100  # longer than any message drawn; 251 is prime, so segments differ
    segments = Segments(tuple(map(int, opcodes)), qpn, first_psn, npkts, mtu, memoryview(message)[:length],
                        length, data.draw(u64), data.draw(u32), data.draw(u32), data.draw(st.booleans()), start,
                        count, data.draw(st.integers(0, 2**count - 1)), data.draw(u16), data.draw(ipv4),
                        data.draw(ipv4), data.draw(u16))
    packets = segments.packets()
    assert [p.psn for p in packets] == [(first_psn + k) % 2**24 for k in range(start, start + count)]
    assert b"".join(bytes(p.payload) for p in packets) == message[start * mtu:min(length, (start + count) * mtu)]
    buffer = memoryview(bytearray(count * 4200))
    lengths = encode_segments_into(segments, start, count, buffer, 0, 4200)
    assert [bytes(buffer[i * 4200:i * 4200 + n]) for i, n in enumerate(lengths)] == [encode(p) for p in packets]
    assert expand([packets[0], segments]) == packets[:1] + packets


def test_icrc_over_nonzero_ip_ids_matches_scapy():
    for ip_id in (1, 0x1234, 0xFFFF):
        p = Packet(Op.SEND_ONLY, 0x11, 7, ack_req=True, payload=b"abc", src_ip="10.0.0.1", dst_ip="10.0.0.2",
                   src_port=udp_source_port(0x11, 0x12), ip_id=ip_id)
        wire = encode_ipv4(p)
        assert scapy_icrc(wire) == wire[-4:]
        with pytest.raises(BadPacket, match="ICRC mismatch"):
            decode(wire[28:], p.src_ip, p.dst_ip, p.src_port)  # assuming ID 0 is wrong for this packet
        assert decode(wire[28:], p.src_ip, p.dst_ip, p.src_port, ip_id=ip_id).payload == b"abc"


def test_reference_pcaps_in_tests_data_are_the_shared_ones():
    if not SHARED_REFERENCE.is_dir():
        pytest.skip(f"{SHARED_REFERENCE} is not beside this checkout")
    for name in ("rocev2-golden.pcap", "rocev2-sample.pcap"):
        assert (DATA / name).read_bytes() == (SHARED_REFERENCE / name).read_bytes()


def test_golden_capture_decodes_and_reencodes_bit_exactly():
    frames = ipv4_frames("rocev2-golden.pcap")
    decoded = [decode_ipv4(frame) for frame in frames]
    assert [p.opcode for p in decoded] == [
        Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST_WITH_IMMEDIATE, Op.ACKNOWLEDGE,
        Op.RDMA_READ_REQUEST, Op.RDMA_READ_RESPONSE_FIRST, Op.RDMA_READ_RESPONSE_LAST, Op.SEND_ONLY_WITH_IMMEDIATE,
        Op.ACKNOWLEDGE, Op.ACKNOWLEDGE, Op.ACKNOWLEDGE]
    for frame, p in zip(frames, decoded):
        assert encode_ipv4(p) == frame
        assert decode(frame[28:], p.src_ip, p.dst_ip, p.src_port) == dataclasses.replace(p, tos=0, ttl=64)
    write_first, _, write_last, ack, read, response_first, response_last, send, rnr, access, sequence = decoded
    assert (write_first.remote_addr, write_first.rkey, write_first.dma_length) == (0x7F0000001000, 0x1234, 2148)
    assert write_last.immediate == 0xCAFEBABE and write_last.ack_req and len(write_last.payload) == 100
    assert (ack.syndrome, ack.msn, ack.psn) == (ACK_UNLIMITED, 1, write_last.psn)
    assert read.dma_length == len(response_first.payload) + len(response_last.payload) == 1500
    assert bytes(send.payload) == b"hello" and encode(send)[1] >> 4 & 3 == 3
    assert rnr.syndrome & 0x60 == RNR_NAK and RNR_TIMER_US[rnr.syndrome & 0x1F] == 1280
    assert access.syndrome == NAK_REMOTE_ACCESS and sequence.syndrome == NAK_PSN_SEQ


def test_sample_capture_frame_4_has_a_corrupted_icrc():
    frames = ipv4_frames("rocev2-sample.pcap")
    for frame in frames[:3]:
        decode_ipv4(frame)  # these carry IP ID 1 (scapy's default): the real header makes them check out
    with pytest.raises(BadPacket, match=r"ICRC mismatch: expected 28968318, got 289683e7"):
        decode_ipv4(frames[3])
    assert decode_ipv4(frames[3], check_icrc=False).opcode == Op.RDMA_WRITE_ONLY


def test_61_byte_payload_is_padded_with_3_bytes_that_the_icrc_covers():
    payload = bytes(range(61))
    p = Packet(Op.RDMA_WRITE_ONLY, 0x11, 0x123456, ack_req=True, remote_addr=0x7F0000001000, rkey=0x1234,
               dma_length=61, payload=payload, src_ip="10.0.0.1", dst_ip="10.0.0.2", src_port=49152)
    wire = encode_ipv4(p)
    assert len(wire) == 20 + 8 + 12 + 16 + 61 + 3 + 4
    assert wire[-7:-4] == b"\0\0\0"
    dissected = scapy_all.IP(wire)
    assert dissected[roce.BTH].padcount == 3
    assert scapy_icrc(wire) == wire[-4:]
    assert bytes(decode_ipv4(wire).payload) == payload
    bad_pad = wire[:-5] + b"\1" + wire[-4:]
    with pytest.raises(BadPacket, match="ICRC mismatch"):
        decode_ipv4(bad_pad)


def test_every_truncation_is_rejected():
    p = Packet(Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE, 1, 2, remote_addr=3, rkey=4, dma_length=5, immediate=6,
               payload=b"x" * 37, src_ip="127.0.0.1", dst_ip="127.0.0.2", src_port=50000)
    udp_payload = encode(p)
    for end in range(len(udp_payload)):
        with pytest.raises(BadPacket):
            decode(udp_payload[:end], p.src_ip, p.dst_ip, p.src_port)
    ack = Packet(Op.ACKNOWLEDGE, 1, 2, syndrome=ACK_UNLIMITED, src_ip="127.0.0.1", dst_ip="127.0.0.2", src_port=1)
    wire = encode_ipv4(ack)
    for end in range(len(wire)):
        with pytest.raises(BadPacket):
            decode_ipv4(wire[:end], check_icrc=False)


@pytest.mark.parametrize(("udp_payload_without_icrc", "reason"), [
    (bytes([0x15, 0, 0xFF, 0xFF]) + bytes(8), "unsupported opcode 0x15"),
    (bytes([0x64, 0, 0xFF, 0xFF]) + bytes(8) + bytes(8), "unsupported opcode 0x64"),  # UD SEND_ONLY
    (bytes([0x04, 0x01, 0xFF, 0xFF]) + bytes(8), "version 1"),
    (bytes([0x11, 0x10, 0xFF, 0xFF]) + bytes(8) + bytes(4), "with PadCnt 1"),  # ACK with a pad
    (bytes([0x11, 0x00, 0xFF, 0xFF]) + bytes(8) + bytes(8), "is 20 bytes with PadCnt 0, got 24"),
    (bytes([0x04, 0x00, 0xFF, 0xFF]) + bytes(8) + bytes(5), "not a multiple of 4"),
    (bytes([0x0A, 0x30, 0xFF, 0xFF]) + bytes(8) + bytes(12), "needs at least 35 bytes"),  # WRITE_ONLY, RETH cut
    (bytes([0x0C, 0x00, 0xFF, 0xFF]) + bytes(8) + bytes(8), "is 32 bytes .* got 24"),  # READ request, RETH cut
])
def test_malformed_packets_with_a_valid_icrc_say_what_is_wrong(udp_payload_without_icrc: bytes, reason: str):
    addressing = Packet(0, 0, 0, src_ip="127.0.0.1", dst_ip="127.0.0.2", src_port=50000)
    udp_payload = with_valid_icrc(addressing, udp_payload_without_icrc)
    with pytest.raises(BadPacket, match=reason):
        decode(udp_payload, "127.0.0.1", "127.0.0.2", 50000)


def test_decode_ipv4_rejects_what_is_not_rocev2():
    p = Packet(Op.ACKNOWLEDGE, 1, 2, src_ip="127.0.0.1", dst_ip="127.0.0.2", src_port=50000)
    wire = encode_ipv4(p)
    cases = {
        "not UDP": wire[:9] + b"\x06" + wire[10:],
        "not 4791": wire[:22] + (53).to_bytes(2, "big") + wire[24:],
        "fragment": wire[:6] + b"\x20\x00" + wire[8:],
        "IP options": b"\x46" + wire[1:],
        "disagree": wire[:2] + (len(wire) + 4).to_bytes(2, "big") + wire[4:],
    }
    for reason, packet in cases.items():
        with pytest.raises(BadPacket, match=reason):
            decode_ipv4(packet)
    assert decode_ipv4(wire + bytes(6)).opcode == Op.ACKNOWLEDGE  # Ethernet minimum-frame padding is ignored


def test_encode_refuses_what_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="carries no payload"):
        encode(Packet(Op.ACKNOWLEDGE, 1, 2, payload=b"x", src_ip="127.0.0.1", dst_ip="127.0.0.2"))
    with pytest.raises(ValueError, match="not an RC opcode"):
        encode(Packet(0x64, 1, 2, src_ip="127.0.0.1", dst_ip="127.0.0.2"))


def test_24_bit_fields_wrap_like_the_wire():
    p = Packet(Op.SEND_ONLY, 0x1000012, 0x1000005, src_ip="127.0.0.1", dst_ip="127.0.0.2", src_port=1)
    decoded = decode(encode(p), p.src_ip, p.dst_ip, p.src_port)
    assert (decoded.dest_qp, decoded.psn) == (0x12, 5)


def test_cnp_from_scapy_decodes():
    frame = (scapy_all.IP(src="10.0.0.2", dst="10.0.0.1", flags="DF") / scapy_all.UDP(sport=49152, dport=4791, chksum=0)
             / roce.cnp(0x33))
    p = decode_ipv4(scapy_all.raw(frame))
    assert (p.opcode, p.dest_qp, p.becn) == (Op.CNP, 0x33, True)
    assert encode_ipv4(p) == scapy_all.raw(frame)


def test_header_sizes():
    assert header_size(Op.SEND_MIDDLE) == 12
    assert header_size(Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE) == 12 + 16 + 4
    assert header_size(Op.ATOMIC_ACKNOWLEDGE) == 12 + 4 + 8
    assert header_size(Op.COMPARE_SWAP) == 12 + 28
    assert header_size(Op.CNP) == 12 + 16


@given(u24, u24)
def test_udp_source_port_is_symmetric_and_in_the_roce_range(a: int, b: int):
    assert 49152 <= udp_source_port(a, b) == udp_source_port(b, a) <= 65535


def test_udp_source_port_folds_like_linux():
    assert udp_source_port(0x11, 0x12) == 0xC000 | 0x11 * 0x12  # small products pass straight through
    # 0xABCDEF * 0x123456 = 0xc379a59ba4a; ^= >> 20 -> 0xc379a9ac3ef; ^= >> 40 -> 0xc379a9ac3e3; flow label 0xac3e3;
    # 14-bit fold: 0x3e3 ^ 0x2b = 0x3c8
    assert udp_source_port(0xABCDEF, 0x123456) == 0xC3C8


def test_rnr_timer_table():
    assert len(RNR_TIMER_US) == 32
    assert (RNR_TIMER_US[0], RNR_TIMER_US[1], RNR_TIMER_US[14], RNR_TIMER_US[31]) == (655360, 10, 1280, 491520)
