"""Interoperability with an independent RoCEv2 stack (scapy) over raw sockets, and the wire as captured.

The raw transport reads whole IPv4 packets, so it checks the ICRC over the real header, including a nonzero IP ID,
as a foreign stack (Soft-RoCE, hardware) sends it. Needs root (CAP_NET_RAW); skipped with the reason otherwise.
"""
import contextlib
import os
import random
import select
import shutil
import socket
import struct
import subprocess
import time

import anyio
import pytest

pytest.importorskip("scapy")
from scapy.all import IP, UDP, Raw, raw, rdpcap  # noqa: E402
from scapy.contrib.roce import AETH, BTH, opcode  # noqa: E402

from aiofabric import QPInfo, open_nic  # noqa: E402
from aiofabric.driver.device import ipv4_gid  # noqa: E402
from aiofabric.verbs.types import RemoteRegion  # noqa: E402

pytestmark = pytest.mark.anyio
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="raw sockets need root / CAP_NET_RAW")
PEER_IP, PEER_QPN, PEER_MAC = "127.0.0.78", 0x55, "02:00:7f:00:00:4e"


def icrc_is_scapys(packet) -> bool:
    """Recompute the ICRC with scapy over the packet's own header and compare with the one it carries."""
    carried = raw(packet)[-4:]
    again = packet.copy()
    again[BTH].icrc = None
    return raw(again)[-4:] == carried


class ScapyPeer:
    """A foreign RoCEv2 endpoint at PEER_IP: sends IPv4 packets built by scapy, receives raw IPv4/UDP."""

    def __init__(self):
        self.send_socket = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self.receive_socket = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
        self.receive_socket.bind((PEER_IP, 0))  # the kernel then delivers only packets addressed to the peer
        self.sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # keeps the kernel from answering ICMP
        self.sink.bind((PEER_IP, 4791))

    def send(self, packet) -> None:
        self.send_socket.sendto(raw(packet), (packet[IP].dst, 0))

    def receive(self, source, timeout=5.0):
        """The next RoCE packet from `source` (the test's NIC): another run's emulated NIC may still be sending to
        this address (a retransmission to a peer that was at 127.0.0.78), and is not the one under test."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.receive_socket], [], [], left)
            if not ready:
                break
            packet = IP(self.receive_socket.recv(65535))
            if UDP in packet and packet[UDP].dport == 4791 and packet[IP].src == source:
                return packet
        raise TimeoutError(f"no RoCE packet reached the scapy peer within {timeout:g} s")

    def close(self):
        for s in (self.send_socket, self.receive_socket, self.sink):
            s.close()


@contextlib.asynccontextmanager
async def nic_facing_the_peer(name: str, ip: str, psn: int):
    """An emulated NIC on the raw transport with one RC QP connected to the scapy peer, its link up (the peer sends
    each packet once)."""
    async with open_nic(f"sim:{name}", ip=ip, transport="raw") as nic:
        await nic.wait_for_link()
        qp = await nic.create_qp(await nic.create_cq(64))
        await qp.connect(QPInfo(PEER_QPN, ipv4_gid(PEER_IP), PEER_MAC, psn))
        yield nic, qp


@needs_root
async def test_scapy_requester_writes_into_an_aiofabric_memory_region_and_is_acked():
    peer, psn = ScapyPeer(), random.getrandbits(24)
    try:
        async with nic_facing_the_peer("interop-rx", "127.0.0.77", psn) as (nic, qp):
            target = await nic.register_mr(4096)
            payload = bytes(range(61))  # odd length: PadCnt 3, pad inside the ICRC
            reth = struct.pack("!QII", target.addr + 100, target.rkey, len(payload))
            write = (IP(src=PEER_IP, dst=nic.ip, id=0x1234, flags="DF")
                     / UDP(sport=49152, dport=4791, chksum=0)
                     / BTH(opcode=opcode("RC", "RDMA_WRITE_ONLY")[0], dqpn=qp.qpn, psn=psn, ackreq=1, padcount=3)
                     / Raw(reth + payload + bytes(3)))
            peer.send(write)
            ack = await anyio.to_thread.run_sync(peer.receive, nic.ip)
            assert ack[BTH].opcode == opcode("RC", "ACKNOWLEDGE")[0] and ack[BTH].psn == psn
            assert ack[BTH].dqpn == PEER_QPN and AETH in ack and ack[AETH].syndrome & 0x60 == 0
            assert icrc_is_scapys(ack) and ack[IP].flags.DF
            assert bytes(target.view[100:161]) == payload
    finally:
        peer.close()


@needs_root
async def test_aiofabric_writes_into_a_scapy_responder():
    peer, psn = ScapyPeer(), random.getrandbits(24)
    try:
        async with nic_facing_the_peer("interop-tx", "127.0.0.79", psn) as (nic, qp):
            source = await nic.register_mr(4096)
            source.view[:100] = random.randbytes(100)
            completion = await qp.post_write(source, RemoteRegion(0xABC000, 0x4242, 4096), 100)
            request = await anyio.to_thread.run_sync(peer.receive, nic.ip)
            assert icrc_is_scapys(request)
            bth = request[BTH]
            assert bth.opcode == opcode("RC", "RDMA_WRITE_ONLY")[0] and bth.dqpn == PEER_QPN and bth.ackreq
            body = raw(request[BTH])[12:-4]  # after the BTH, before the ICRC
            va, rkey, length = struct.unpack("!QII", body[:16])
            assert (va, rkey, length) == (0xABC000, 0x4242, 100)
            assert body[16:116] == bytes(source.view[:100])
            assert 49152 <= request[UDP].sport <= 65535  # the raw transport uses the per-QP source port
            ack = (IP(src=PEER_IP, dst=nic.ip, id=0x4321, flags="DF") / UDP(sport=49153, dport=4791, chksum=0)
                   / BTH(opcode=opcode("RC", "ACKNOWLEDGE")[0], dqpn=qp.qpn, psn=bth.psn)
                   / AETH(syndrome=0x1F, msn=1))
            peer.send(ack)
            with anyio.fail_after(5):
                await completion
    finally:
        peer.close()


async def test_every_packet_of_a_run_parses_with_scapy_and_carries_its_icrc(tmp_path):
    from aiofabric.tools.bench_config import BenchConfig
    from aiofabric.tools.perftest import run_bench
    capture = tmp_path / "run.pcap"
    result = await run_bench(BenchConfig("write", qps=2, size=3000, iters=20, depth=4, mtu=1024,
                                         pcap=str(capture)))
    assert result["verified"]
    frames = rdpcap(str(capture))
    assert len(frames) >= 2 * 20 * 3  # three 1024-byte segments per message, both QPs
    opcodes = set()
    for frame in frames:
        assert BTH in frame and frame[UDP].dport == 4791
        assert icrc_is_scapys(frame), frame.summary()
        opcodes.add(frame[BTH].opcode)
    assert {0x06, 0x07, 0x08} <= opcodes  # WRITE FIRST / MIDDLE / LAST
    if shutil.which("tshark"):
        out = subprocess.run(["tshark", "-r", str(capture), "-T", "fields", "-e", "infiniband.bth.opcode"],
                             capture_output=True, text=True, timeout=60).stdout.split()
        assert len(out) == len(frames) and {"6", "7", "8"} <= set(out)
