"""Transports on 127.0.0.0/8: real sockets, seeded faults, pcap captures (checked by scapy and, if present, tshark).

Fixed addresses are on 127.0.1.x: the emulators of tests running beside these take 127.0.0.x (sim/wire.py)."""
from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aiofabric.sim import mmsg, native
from aiofabric.sim.codec import decode, decode_ipv4, encode_ipv4
from aiofabric.sim.faults import Faults
from aiofabric.sim.packets import ACK_UNLIMITED, ROCE_PORT, Op, Packet, Segments, udp_source_port
from aiofabric.sim.pcap import PcapWriter
from aiofabric.sim.phy_loopback import LoopbackTransport
from aiofabric.sim.raw import RawTransport
from aiofabric.sim.transport import Transport
from aiofabric.sim.udp import BATCH, IP_MTU_DISCOVER, IP_PMTUDISC_DO, SO_RCVBUFFORCE, UdpTransport
from aiofabric.sim.wire import open_transport

scapy_all = pytest.importorskip("scapy.all")
roce = pytest.importorskip("scapy.contrib.roce")

A, B = "127.0.1.101", "127.0.1.102"
N = 200


def write(psn: int, dst_ip: str = B, payload: bytes = b"0123456789") -> Packet:
    return Packet(Op.RDMA_WRITE_ONLY, 0x12, psn, ack_req=True, remote_addr=0x1000, rkey=0x77,
                  dma_length=len(payload), payload=payload, dst_ip=dst_ip, src_port=udp_source_port(0x11, 0x12))


def pump(transport: Transport, done: Callable[[list[Packet]], bool], timeout: float = 5.0) -> list[Packet]:
    """Receive until done(packets so far) or the timeout: a bounded loop, as the emulator's selector loop runs."""
    packets: list[Packet] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(transport.fileno(), selectors.EVENT_READ)
        while not done(packets) and (remaining := deadline - time.monotonic()) > 0:
            selector.select(remaining)
            # receive() may reuse its buffers on the next call: keep copies of the payloads
            packets += [dataclasses.replace(p, payload=bytes(p.payload)) for p in transport.receive()]
    return packets


def received(count: int) -> Callable[[list[Packet]], bool]:
    return lambda packets: len(packets) >= count


@pytest.fixture(params=["compiled", "python"])
def pair(request, monkeypatch) -> Iterator[tuple[UdpTransport, UdpTransport]]:
    """Two transports, receiving through the compiled core (where it can be built) or the Python codec, each the
    other's check: a rule one of them forgets fails here."""
    if request.param == "python":
        monkeypatch.setattr(native, "_loaded", [None])
    elif native.core() is None:
        pytest.skip("no compiled core here (no C compiler, no private cache, or AIOFABRIC_SIM_NATIVE=0)")
    with UdpTransport(A) as a, UdpTransport(B) as b:
        yield a, b


def loopback_psns(faults: Faults, count: int = N) -> tuple[list[int], LoopbackTransport]:
    with LoopbackTransport(A, faults) as port:
        for psn in range(count):
            port.send(write(psn, dst_ip=A))
        port.flush()
        return [p.psn for p in port.receive(budget=3 * count)], port


def test_udp_transports_exchange_packets_both_ways(pair: tuple[UdpTransport, UdpTransport]):
    a, b = pair
    for psn in range(N):
        a.send(write(psn, B, payload=bytes([psn % 256]) * (psn % 67)))
    ack = Packet(Op.ACKNOWLEDGE, 0x11, N - 1, syndrome=ACK_UNLIMITED, msn=N, dst_ip=A)
    b.send(ack)
    at_b = pump(b, received(N))
    at_a = pump(a, received(1))
    assert [p.psn for p in at_b] == list(range(N))
    assert all(bytes(p.payload) == bytes([p.psn % 256]) * (p.psn % 67) for p in at_b)
    assert (at_b[0].src_ip, at_b[0].src_port, at_b[0].dst_ip, at_b[0].ip_id) == (A, ROCE_PORT, B, 0)
    assert (at_a[0].opcode, at_a[0].syndrome, at_a[0].msn, at_a[0].src_ip) == (Op.ACKNOWLEDGE, ACK_UNLIMITED, N, B)
    assert a.counters["sent"] == b.counters["received"] == N and b.counters["sent"] == a.counters["received"] == 1
    assert not (b.counters["dropped_icrc"] or b.counters["dropped_malformed"])


def test_send_stamps_the_addressing_the_udp_wire_uses(pair: tuple[UdpTransport, UdpTransport]):
    a, _ = pair
    packet = write(1, B)
    a.send(packet)
    assert (packet.src_ip, packet.src_port, packet.dst_port, packet.ip_id) == (A, ROCE_PORT, ROCE_PORT, 0)


@pytest.mark.parametrize("batched", [True, False], ids=["mmsg", "socket-calls"])
def test_send_all_keeps_order_across_bursts_and_loses_only_what_the_socket_refuses(monkeypatch, batched: bool):
    if not batched:
        monkeypatch.setattr(mmsg, "available", lambda: False)
    with UdpTransport("127.0.1.112") as a, UdpTransport("127.0.1.113") as b:
        packets = [write(psn, "127.0.1.113", payload=bytes([psn % 256]) * (psn % 4097))
                   for psn in range(3 * BATCH + 5)]
        packets[7].dst_ip = "255.255.255.255"  # EACCES: a UDP socket without SO_BROADCAST may not send there
        packets[BATCH + 1].tos = 0x68  # DSCP 26, as RoCE is marked: a socket option, so that burst is split there
        a.send_all(packets)
        arrived = pump(b, received(len(packets) - 1))
        assert [p.psn for p in arrived] == [p.psn for p in packets if p.psn != 7]
        assert all(bytes(p.payload) == bytes([p.psn % 256]) * (p.psn % 4097) for p in arrived)
        assert (a.counters["sent"], a.counters["send_errors"]) == (len(packets) - 1, 1)
        assert b.counters["received"] == len(packets) - 1 and not b.counters["dropped_icrc"]


def test_4096_byte_payloads_cross_udp_and_loopback(pair: tuple[UdpTransport, UdpTransport]):
    a, b = pair
    payload = os.urandom(4096)
    a.send(write(7, B, payload))
    (packet,) = pump(b, received(1))
    assert bytes(packet.payload) == payload
    with LoopbackTransport(A) as port:
        port.send(write(8, A, payload))
        (looped,) = port.receive()
        assert bytes(looped.payload) == payload and looped.psn == 8


def test_loopback_returns_what_was_sent_in_order():
    with open_transport("loopback", A) as port:
        assert port.fileno() is None and port.receive() == []
        sent = [write(psn, dst_ip=A) for psn in range(10)]
        for packet in sent:
            port.send(packet)
        assert port.receive(budget=4) == sent[:4]
        assert port.receive() == sent[4:]
        assert port.counters["sent"] == port.counters["received"] == 10


def test_loopback_bursts_come_back_as_the_packets_they_stand_for_and_announce_themselves():
    """send_all encodes a WRITE's Segments in one go; what comes back decodes (ICRC checked) to the same packets. The
    port has no descriptor, so `pending` is what tells the emulator's loop not to sleep while packets wait."""
    data = os.urandom(3 * 1024 + 61)
    burst = Segments(tuple(map(int, (Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST, Op.RDMA_WRITE_FIRST,
                                     Op.RDMA_WRITE_ONLY))), 0x12, 0x100, 4, 1024, memoryview(data), len(data),
                     0x1000, 0x77, 0, False, 0, 4, 0b1010, dst_ip=A, src_port=udp_source_port(0x11, 0x12))
    single = write(0x104, dst_ip=A)
    with LoopbackTransport(A) as port:
        assert not port.pending
        port.send_all([burst, single])
        assert port.pending and port.counters["sent"] == 5
        back = port.receive(budget=100)
        assert not port.pending and port.counters["dropped_icrc"] == 0
        expected = [*burst.packets(), single]
        assert [(p.opcode, p.psn, p.ack_req, p.remote_addr, p.dma_length, bytes(p.payload)) for p in back] == \
               [(p.opcode, p.psn, p.ack_req, p.remote_addr, p.dma_length, bytes(p.payload)) for p in expected]


def test_rx_overflow_counts_what_the_kernel_dropped_and_a_sized_window_drops_nothing():
    with UdpTransport(A) as a, UdpTransport(B, buffer_size=4096) as b:  # the kernel's minimum: a few datagrams
        a.send_all([write(psn, B, bytes(1000)) for psn in range(100)])
        arrived = pump(b, received(100), timeout=0.2)
        assert 0 < b.rx_overflow == 100 - len(arrived)  # on loopback a full buffer drops at once, in sendmmsg
        dropped = b.rx_overflow
        b.receive_window(100 * 2 * (1000 + 128))  # the kernel charges about twice a datagram's size
        a.send_all([write(psn, B, bytes(1000)) for psn in range(100)])
        assert len(pump(b, received(100))) == 100 and b.rx_overflow == dropped
    assert b.rx_overflow == 0  # closed: nothing to ask


def test_faults_are_deterministic_for_a_seed_and_counted():
    faults = Faults(loss=0.2, seed=7)
    first, port = loopback_psns(faults)
    second, _ = loopback_psns(Faults(loss=0.2, seed=7))
    other, _ = loopback_psns(Faults(loss=0.2, seed=8))
    assert first == second != other
    assert len(first) + port.counters["lost"] == N and 0 < port.counters["lost"] < N
    # The decisions do not depend on the other probabilities: adding corruption leaves the loss pattern alone.
    with_corruption, port = loopback_psns(Faults(loss=0.2, corrupt=0.3, seed=7))
    assert set(with_corruption) <= set(first)
    assert len(with_corruption) + port.counters["dropped_icrc"] == len(first)
    assert port.counters["corrupted"] == port.counters["dropped_icrc"] > 0


def test_loss_drops_everything_at_probability_one():
    psns, port = loopback_psns(Faults(loss=1.0))
    assert psns == [] and port.counters["lost"] == N and port.counters["sent"] == 0


def test_dup_sends_everything_twice():
    psns, port = loopback_psns(Faults(dup=1.0), count=3)
    assert psns == [0, 0, 1, 1, 2, 2]
    assert port.counters["duplicated"] == 3 and port.counters["sent"] == 6


def test_reorder_swaps_a_packet_with_its_successor():
    psns, port = loopback_psns(Faults(reorder=1.0), count=5)
    assert psns == [1, 0, 3, 2, 4]  # 4 had no successor: the final flush() sent it
    assert port.counters["reordered"] == 3


def test_a_held_packet_goes_out_alone_after_the_hold_time():
    with LoopbackTransport(A, Faults(reorder=1.0, reorder_hold=0.01)) as port:
        port.send(write(1, dst_ip=A))
        assert port.receive() == [] and port.flush_deadline is not None
        time.sleep(max(0.0, port.flush_deadline - time.monotonic()))
        assert [p.psn for p in port.receive()] == [1]
        assert port.flush_deadline is None


def test_corruption_makes_the_receiver_drop_on_the_icrc(pair: tuple[UdpTransport, UdpTransport]):
    _, b = pair
    with UdpTransport("127.0.1.103", Faults(corrupt=1.0, seed=3)) as a:
        for psn in range(N):
            a.send(write(psn, B))
        assert pump(b, lambda _: b.counters["dropped_icrc"] >= N) == []
    assert a.counters["corrupted"] == b.counters["dropped_icrc"] == N and b.counters["received"] == 0


def test_malformed_datagrams_are_counted_not_raised(pair: tuple[UdpTransport, UdpTransport]):
    _, b = pair
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.bind(("127.0.1.104", ROCE_PORT))  # as an emulator sends: from another port it is refused first
        stranger.sendto(b"\0" * 5, (B, ROCE_PORT))  # shorter than a BTH
        stranger.sendto(b"\0" * 64, (B, ROCE_PORT))  # long enough, but the ICRC cannot match
    pump(b, lambda _: b.counters["dropped_malformed"] + b.counters["dropped_icrc"] >= 2)
    assert (b.counters["dropped_malformed"], b.counters["dropped_icrc"], b.counters["received"]) == (1, 1, 0)


def test_udp_receive_assumes_ip_id_0_like_an_unconnected_df_socket_sends(pair: tuple[UdpTransport, UdpTransport]):
    _, b = pair
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as foreign:
        foreign.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        foreign.bind(("127.0.1.104", ROCE_PORT))
        good = write(1, B)
        good.src_ip, good.src_port = "127.0.1.104", ROCE_PORT
        foreign.sendto(encode_ipv4(good)[28:], (B, ROCE_PORT))
        (packet,) = pump(b, received(1))
        assert (packet.src_ip, packet.src_port, packet.psn) == ("127.0.1.104", ROCE_PORT, 1)


def test_a_loopback_sender_not_on_4791_is_dropped_for_its_port(pair: tuple[UdpTransport, UdpTransport]):
    """Any local user can send from a peer's loopback address on another port; only the emulator holding it sends from
    4791. The same packet from 4791 is taken, so the port alone decides."""
    _, b = pair
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as emulator:
        for sock in (other, emulator):
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        other.bind(("127.0.1.104", 0))
        emulator.bind(("127.0.1.104", ROCE_PORT))
        for sock, psn in ((other, 1), (emulator, 2)):
            packet = write(psn, B)
            packet.src_ip, packet.src_port = "127.0.1.104", sock.getsockname()[1]
            sock.sendto(encode_ipv4(packet)[28:], (B, ROCE_PORT))
        assert [p.psn for p in pump(b, received(1))] == [2]
    assert (b.counters["dropped_source_port"], b.counters["dropped_malformed"], b.counters["received"]) == (1, 0, 1)


def test_pcap_capture_of_both_directions_decodes(tmp_path: Path, pair: tuple[UdpTransport, UdpTransport]):
    a, b = pair
    capture = tmp_path / "wire.pcap"
    with PcapWriter(capture) as pcap:
        a.pcap = b.pcap = pcap
        a.send(write(5, B, payload=bytes(61)))
        b.send(Packet(Op.ACKNOWLEDGE, 0x11, 5, syndrome=ACK_UNLIMITED, msn=1, dst_ip=A))
        a.send(Packet(Op.RDMA_READ_REQUEST, 0x12, 6, ack_req=True, remote_addr=0x2000, rkey=0x77, dma_length=32,
                      dst_ip=B))
        b.send(Packet(Op.RDMA_READ_RESPONSE_ONLY, 0x11, 6, syndrome=ACK_UNLIMITED, msn=2, payload=bytes(32),
                      dst_ip=A))
    frames = scapy_all.rdpcap(str(capture))
    opcodes = [Op.RDMA_WRITE_ONLY, Op.ACKNOWLEDGE, Op.RDMA_READ_REQUEST, Op.RDMA_READ_RESPONSE_ONLY]
    assert [frame[roce.BTH].opcode for frame in frames] == opcodes
    assert [frame[scapy_all.IP].src for frame in frames] == [A, B, A, B]
    assert frames[0][scapy_all.Ether].src == "02:00:7f:00:01:65"
    for frame in frames:
        assert decode_ipv4(scapy_all.raw(frame)[14:]).dst_port == ROCE_PORT  # the ICRC checks out
    # What the capture says went on the wire is what arrived.
    a.pcap = b.pcap = None
    assert [p.psn for p in pump(b, received(2))] == [5, 6]
    if shutil.which("tshark") is None:
        pytest.skip("tshark is not installed: pcap checked with scapy only")
    fields = subprocess.run(["tshark", "-r", str(capture), "-T", "fields", "-e", "frame.protocols",
                             "-e", "infiniband.bth.opcode", "-e", "infiniband.bth.padcnt",
                             "-e", "infiniband.reth.dmalen"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    rows = [line.split("\t") for line in fields]
    assert all(":udp:infiniband" in row[0] for row in rows), rows
    assert [int(row[1]) for row in rows] == opcodes
    assert (rows[0][2], rows[0][3]) == ("3", "61")


def test_open_transport_rejects_unknown_kinds_and_taken_addresses(pair: tuple[UdpTransport, UdpTransport]):
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        open_transport("tcp", A)
    with pytest.raises(OSError, match="is taken"):
        open_transport("udp", A)
    with pytest.raises(ValueError, match="between 0 and 1"):
        Faults(loss=1.5)


def _raw_sockets_allowed() -> bool:
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW).close()
    except PermissionError:
        return False
    return True


needs_raw = pytest.mark.skipif(not _raw_sockets_allowed(), reason="raw sockets need root or CAP_NET_RAW")


@needs_raw
def test_raw_transport_checks_the_icrc_over_a_real_nonzero_ip_id():
    packet = write(9, "127.0.1.105")
    packet.src_ip, packet.ip_id = "127.0.1.106", 0x1234
    with RawTransport("127.0.1.105") as port, \
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as injector:
        injector.sendto(encode_ipv4(packet), ("127.0.1.105", 0))
        scapy_built = (scapy_all.IP(src="127.0.1.106", dst="127.0.1.105", id=0xBEEF, flags="DF")
                       / scapy_all.UDP(sport=udp_source_port(3, 4), dport=ROCE_PORT, chksum=0)
                       / roce.BTH(opcode=Op.SEND_ONLY, dqpn=3, psn=10) / scapy_all.Raw(b"scapy!!!"))
        injector.sendto(scapy_all.raw(scapy_built), ("127.0.1.105", 0))
        first, second = pump(port, received(2))
    assert (first.ip_id, first.src_port, first.psn) == (0x1234, packet.src_port, 9)
    assert (second.ip_id, second.src_port, bytes(second.payload)) == (0xBEEF, udp_source_port(3, 4), b"scapy!!!")
    assert port.counters["dropped_icrc"] == 0


@needs_raw
def test_raw_transport_sends_real_per_qp_source_ports():
    source_port = udp_source_port(0x11, 0x12)
    with RawTransport("127.0.1.107") as sender, RawTransport("127.0.1.108") as receiver:
        sender.send(write(3, "127.0.1.108"))
        (packet,) = pump(receiver, received(1))
        assert (packet.src_ip, packet.src_port, packet.ip_id) == ("127.0.1.107", source_port, 0)
    # A plain socket at the destination sees the same port, and the datagram checks out assuming IP ID 0.
    with RawTransport("127.0.1.107") as sender, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as plain:
        plain.bind(("127.0.1.109", ROCE_PORT))
        plain.settimeout(5)
        sender.send(write(4, "127.0.1.109"))
        data, (src_ip, src_port) = plain.recvfrom(65536)
        assert (src_ip, src_port) == ("127.0.1.107", source_port)
        assert decode(data, src_ip, "127.0.1.109", src_port).psn == 4


@needs_raw
def test_raw_and_udp_transports_interoperate():
    with RawTransport("127.0.1.110") as raw, UdpTransport("127.0.1.111") as udp:
        per_qp = write(1, "127.0.1.111")
        raw.send(per_qp)  # a per-QP source port on loopback: the UDP transport takes only 4791 there
        per_qp.src_port = ROCE_PORT
        raw.send(per_qp)
        udp.send(write(2, "127.0.1.110"))
        assert [p.psn for p in pump(udp, received(1))] == [1]
        assert [p.psn for p in pump(raw, received(1))] == [2]
        assert raw.counters["dropped_icrc"] == udp.counters["dropped_icrc"] == 0
        assert udp.counters["dropped_source_port"] == 1


@needs_raw
def test_bursts_leave_with_ip_id_0_so_the_icrc_holds_on_the_wire():
    """What a capture of the loopback device sees of a sendmmsg burst: DF, IP ID 0, an ICRC valid over that header."""
    count = 60
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003)) as tap, \
            UdpTransport("127.0.1.114") as a, UdpTransport("127.0.1.115") as b:
        try:  # room for everyone's loopback traffic meanwhile (lo shows every frame twice)
            tap.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        except PermissionError:
            tap.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        tap.bind(("lo", 0))
        tap.settimeout(0.2)
        a.send_all([write(psn, "127.0.1.115", payload=bytes(psn % 97)) for psn in range(count)])
        assert len(pump(b, received(count))) == count
        seen = []
        for _ in range(50 * count):  # bounded: other loopback traffic is skipped
            try:
                frame, address = tap.recvfrom(1 << 16)
            except socket.timeout:
                break
            ip = frame[14:]
            if address[2] != socket.PACKET_OUTGOING and ip[12:20] == socket.inet_aton("127.0.1.114") + \
                    socket.inet_aton("127.0.1.115"):
                seen.append(ip)
    assert len(seen) == count
    assert all(ip[4:6] == b"\0\0" and ip[6] & 0x40 for ip in seen)  # IP ID 0, DF
    assert [decode_ipv4(ip).psn for ip in seen] == list(range(count))  # decode_ipv4 checks the ICRC over the real header


def test_one_ports_capture_shows_both_directions(tmp_path: Path, pair: tuple[UdpTransport, UdpTransport]):
    a, b = pair
    capture = tmp_path / "a.pcap"
    with PcapWriter(capture) as pcap:
        a.pcap = pcap
        a.send(write(9, B, payload=bytes(100)))
        assert [p.psn for p in pump(b, received(1))] == [9]
        b.send(Packet(Op.ACKNOWLEDGE, 0x11, 9, syndrome=ACK_UNLIMITED, msn=1, dst_ip=A))
        assert [p.psn for p in pump(a, received(1))] == [9]
        a.pcap = None
    frames = scapy_all.rdpcap(str(capture))
    assert [(f[scapy_all.IP].src, f[roce.BTH].opcode) for f in frames] == [(A, Op.RDMA_WRITE_ONLY),
                                                                          (B, Op.ACKNOWLEDGE)]
    assert frames[1][scapy_all.IP].id == 0 and frames[1][scapy_all.Ether].dst == "02:00:7f:00:01:65"
    for frame in frames:
        decode_ipv4(scapy_all.raw(frame)[14:])  # the ICRC of the arrival holds over the reconstructed header
