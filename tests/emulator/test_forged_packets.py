"""Forged RoCE packets: a connected RC QP takes packets only from the peer it was connected to (rxe_recv.c
check_addr), and only in a state that receives (check_type_state); what a forger must guess (the MR key byte, the
initial PSN) is drawn unpredictably.

The forger is a plain UDP socket on another loopback address's 4791 (or, where a test says so, on the peer's
address with another port, which the UDP transport drops for its port before the QP sees it) sending a correctly built RoCEv2 packet: right QPN, rkey, address and even the right PSN, read from the
QP objects. A source check that lets it through is caught by the MR's bytes and by the real WRITE that follows it
(which a forgery at its PSN would turn into a silently dropped duplicate)."""
import contextlib
import dataclasses
import random
import socket

import anyio
import numpy as np
import pytest

from aiofabric import QPState, collectives, open_nic
from aiofabric.sim import codec
from aiofabric.sim import packets as pk
from aiofabric.sim.udp import IP_MTU_DISCOVER, IP_PMTUDISC_DO
from tests.support import emulator
from tests.support.nics import connect, connected_qps, tag

pytestmark = pytest.mark.anyio
FORGED = b"\xee" * 64


@contextlib.asynccontextmanager
async def pair():
    """Two emulated NICs with one RC QP each, connected with the driver's defaults."""
    async with open_nic(f"sim:fa{tag()}") as a, open_nic(f"sim:fb{tag()}") as b:
        qa, qb = await connected_qps(a, b, 64)
        yield a, b, qa, qb


def forger_address(*taken: str) -> str:
    """A loopback address that is none of `taken` (the forger binds port 0 on it: it never collides)."""
    return next(ip for ip in (f"127.0.0.{x}" for x in range(254, 1, -1)) if ip not in taken)


def send_forged(dest_ip: str, source_ip: str, dest_qp: int, psn: int, addr: int, rkey: int,
                payload: bytes = FORGED) -> None:
    """One RDMA WRITE_ONLY from (source_ip, 4791) as an emulator sends, or from an ephemeral port where 4791 of that
    address is an emulator's; its ICRC right for the header it travels in (DF set: the kernel then writes IP ID 0,
    which the UDP transport assumes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        try:
            sock.bind((source_ip, pk.ROCE_PORT))
        except OSError:
            sock.bind((source_ip, 0))
        packet = pk.Packet(pk.Op.RDMA_WRITE_ONLY, dest_qp, psn, ack_req=True, remote_addr=addr, rkey=rkey,
                           dma_length=len(payload), payload=payload, src_ip=source_ip, dst_ip=dest_ip,
                           src_port=sock.getsockname()[1])
        sock.sendto(codec.encode(packet), (dest_ip, pk.ROCE_PORT))


async def stat_reaches(nic, names: tuple[str, ...], value: int, memory: memoryview, timeout: float = 10.0) -> dict:
    """The NIC's stats once counters `names` add up to `value`, or at once when `memory` is no longer all zeros (the
    forgery landed: the caller's check of it says so); the emulator handles the packet in its own time."""
    with anyio.fail_after(timeout):
        while True:
            stats = nic.pci.debug({"op": "stats"})["stats"]
            if sum(stats.get(name, 0) for name in names) >= value or any(memory):
                return stats
            await anyio.sleep(0.01)


def reachable(*nics) -> None:
    """Skip unless the NICs' wire is this network namespace's loopback, where the forger's socket is."""
    moved = {nic.pci.netns for nic in nics} - {None}
    if moved:
        pytest.skip(f"the emulated NICs run in network namespace {sorted(moved)} (UDP 4791 is taken here): a forger "
                    "in this one cannot reach them")


def placed_writes(nic, qpn: int) -> int:
    return nic.pci.debug({"op": "placed"})["qps"][str(qpn)]["write_messages"]


# -- the source check, end to end ----------------------------------------------------------------------------------
@pytest.mark.loop_agnostic  # the forger's socket is a plain blocking send, outside the event loop
async def test_a_forged_write_from_another_address_is_dropped_and_the_next_real_write_lands():
    async with pair() as (a, b, qa, qb):
        reachable(a, b)
        source, target = await a.register_mr(8192), await b.register_mr(8192)
        source.view[:] = random.Random(1).randbytes(8192)
        with anyio.fail_after(10):
            await qa.write(source, target, 3000)  # three packets: the MIDDLE fast path takes the real peer's
        assert bytes(target.view[:3000]) == bytes(source.view[:3000])
        expected = b.pci.debug({"op": "datapath"})["qps"][str(qb.qpn)]["epsn"]
        assert expected == qa.psn  # what a forger needs, from the QP object as from the debug channel
        before = b.pci.debug({"op": "stats"})["stats"]
        send_forged(b.ip, forger_address(a.ip, b.ip), qb.qpn, qa.psn, target.addr + 4096, target.rkey)
        stats = await stat_reaches(b, ("dropped_bad_source",), 1, target.view[4096:])
        assert not any(target.view[4096:]) and placed_writes(b, qb.qpn) == 1
        assert stats["dropped_bad_source"] == 1 and stats["dropped"] > before["dropped"]
        with anyio.fail_after(10):  # the real WRITE at that PSN: executed, not taken for a duplicate
            await qa.write(source, target, 100, remote_offset=4096)
        assert bytes(target.view[4096:4196]) == bytes(source.view[:100])
        assert not any(target.view[4196:])
        assert b.pci.debug({"op": "stats"})["stats"]["dropped_bad_source"] == 1
        assert placed_writes(b, qb.qpn) == 2


@pytest.mark.loop_agnostic
async def test_a_forged_write_to_a_qp_not_yet_receiving_is_dropped_even_from_the_right_address():
    async with open_nic(f"sim:fa{tag()}") as a, open_nic(f"sim:fb{tag()}") as b:
        reachable(a, b)
        qa, qb = await a.create_qp(await a.create_cq(64)), await b.create_qp(await b.create_cq(64))
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = random.Random(2).randbytes(4096)
        # RESET, then INIT: rq_psn is still 0 there, and the source would be the peer's own address
        for count, step in enumerate((None, qb.to_init), start=1):
            if step is not None:
                await step()
            send_forged(b.ip, a.ip, qb.qpn, 0, target.addr, target.rkey)
            stats = await stat_reaches(b, ("dropped_qp_state", "dropped_bad_source", "dropped_source_port"), count,
                                       target.view)
            assert not any(target.view)
            assert stats["dropped_source_port"] == count  # a's 4791 is a's emulator's: the forger's is another port
        await connect(qb, qa)
        with anyio.fail_after(10):
            await qa.write(source, target, 4096)
        assert bytes(target.view) == bytes(source.view)


@pytest.mark.loop_agnostic
async def test_after_a_reconnect_to_another_peer_the_new_one_lands_and_the_old_one_is_refused():
    async with pair() as (a, b, qa, qb), open_nic(f"sim:fc{tag()}") as c:
        reachable(a, b, c)
        qc = await c.create_qp(await c.create_cq(64))
        from_a, from_c, target = await a.register_mr(4096), await c.register_mr(4096), await b.register_mr(4096)
        from_a.view[:] = b"\xaa" * 4096
        from_c.view[:] = random.Random(3).randbytes(4096)
        with anyio.fail_after(10):
            await qa.write(from_a, target, 64)
        assert bytes(target.view[:64]) == b"\xaa" * 64
        await qb.modify(QPState.RESET)
        await connect(qb, qc)
        with anyio.fail_after(10):
            await qc.write(from_c, target, 1000, remote_offset=1000)  # the new peer: no false drop
        assert bytes(target.view[1000:2000]) == bytes(from_c.view[:1000])
        # the old peer's address with everything else right: its 4791 is free once a's QP is gone, yet a's NIC is
        # still there, so the forger takes another port; both checks refuse it
        send_forged(b.ip, a.ip, qb.qpn, qc.psn, target.addr + 2048, target.rkey)
        await stat_reaches(b, ("dropped_bad_source", "dropped_source_port"), 1, target.view[2048:])
        assert not any(target.view[2048:])
        with anyio.fail_after(10):
            await qc.write(from_c, target, 1000, local_offset=1000, remote_offset=2048)
        assert bytes(target.view[2048:3048]) == bytes(from_c.view[1000:2000])


@pytest.mark.loop_agnostic
async def test_collectives_connect_every_qp_to_the_rank_the_rendezvous_named():
    """A forger that learnt a ring's QPNs, PSNs and keys (as every rank does at the rendezvous) cannot write into a
    rank's buffers from an address that is not its neighbour's."""
    async with collectives.local(2, buffer_bytes=4096, timeout=10) as comms:
        victim, neighbour = comms[1], comms[0]
        reachable(victim.nic, neighbour.nic)
        assert victim.prev is not None and neighbour.next is not None and victim.work is not None
        victim.work.view[:] = bytes(victim.work.length)
        send_forged(victim.nic.ip, forger_address(victim.nic.ip, neighbour.nic.ip), victim.prev.qp.qpn,
                    neighbour.next.qp.psn, victim.work.addr, victim.work.rkey)
        stats = await stat_reaches(victim.nic, ("dropped_bad_source",), 1, victim.work.view)
        assert not any(victim.work.view) and stats["dropped_bad_source"] == 1
        xs = [np.arange(256, dtype=np.float32) * (rank + 1) for rank in range(2)]
        with anyio.fail_after(20):
            results = await collectives.run_ranks([lambda c=c, x=x: c.allreduce(x.copy()) for c, x in zip(comms, xs)])
        for result in results:
            np.testing.assert_array_equal(result, np.arange(256, dtype=np.float32) * 3)


# -- unpredictable identifiers -------------------------------------------------------------------------------------
@pytest.mark.loop_agnostic
async def test_memory_keys_and_initial_psns_differ_between_nics_even_with_random_seeded():
    async with open_nic(f"sim:ka{tag()}") as a, open_nic(f"sim:kb{tag()}") as b:
        keys = []
        for nic in (a, b):
            regions = [await nic.register_mr(4096) for _ in range(4)]
            keys.append([region.rkey for region in regions])
        # the same allocations on two NICs: the same context indices, not the same key bytes
        assert [key >> 8 for key in keys[0]] == [key >> 8 for key in keys[1]]
        assert [key & 0xFF for key in keys[0]] != [key & 0xFF for key in keys[1]]
        psns, state = [], random.getstate()
        try:
            for nic in (a, b):
                cq = await nic.create_cq(16)
                random.seed(7)  # a program seeding `random` must not make PSNs predictable
                psns.append((await nic.create_qp(cq)).psn)
        finally:
            random.setstate(state)
        assert psns[0] != psns[1]


def test_a_reused_key_index_gets_another_key_byte_and_the_stale_key_is_refused():
    a, b, wire = emulator.pair()
    src, lkey = a.register(4096)
    dst, key = b.register(4096)
    for _ in range(20):
        b.command("deregister_mr", lkey=key)
        stale = key
        dst, key = b.register(4096)
        assert key >> 8 == stale >> 8 and key != stale  # the lowest free index again, never the same byte twice
    a.post(emulator.WRITE, [(src, lkey, 64)], remote=dst, rkey=stale)
    wire.run()
    assert [p.syndrome for p in wire.log if p.src_ip == b.ip] == [pk.NAK_REMOTE_ACCESS]


def test_two_firmware_instances_draw_different_key_bytes():
    first, second = emulator.Host("127.0.0.2"), emulator.Host("127.0.0.3")
    keys = [[host.register(4096)[1] for _ in range(4)] for host in (first, second)]
    assert [key >> 8 for key in keys[0]] == [key >> 8 for key in keys[1]] == [1, 2, 3, 4]
    assert [key & 0xFF for key in keys[0]] != [key & 0xFF for key in keys[1]]


# -- the source check in the data path, packet by packet -----------------------------------------------------------
def _write_packets(a, b, size: int):
    """The packets of one WRITE of `size` bytes from a to b, as b would receive them; and the data written."""
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = emulator.fill(a, src, 8192, 4)
    a.post(emulator.WRITE, [(src, lkey, size)], remote=dst, rkey=rkey)
    a.dp.doorbells(0.0)
    a.dp.pump(0.0)
    packets = [codec.decode(codec.encode(p), p.src_ip, p.dst_ip, p.src_port) for p in pk.expand(a.dp.take_outbox())]
    return packets, dst, data[:size]


def test_a_forged_middle_packet_in_the_real_peers_batch_is_dropped_not_copied():
    """The responder copies a long message's MIDDLE packets in a tight loop: a forged one among them stops it."""
    a, b, wire = emulator.pair(mtu=1024)
    packets, dst, data = _write_packets(a, b, 3000)
    assert [p.opcode for p in packets] == [pk.Op.RDMA_WRITE_FIRST, pk.Op.RDMA_WRITE_MIDDLE, pk.Op.RDMA_WRITE_LAST]
    forged = dataclasses.replace(packets[1], src_ip="127.0.0.9", payload=b"\xee" * 1024)
    b.dp.receive([packets[0], forged, *packets[1:]], 0.0)
    assert b.mem.read(dst, 3000) == data
    assert (b.dp.stats["dropped_bad_source"], b.dp.stats["duplicates"]) == (1, 0)
    wire.run()
    assert [c[1] for c in a.poll()] == [emulator.REQ_OK]


@pytest.mark.parametrize("field, value", [("src_ip", "127.0.0.9"), ("dst_ip", "127.0.0.9")])
def test_a_packet_not_between_the_qp_and_its_peer_is_dropped(field, value):
    """rxe's check_addr compares both: the source with the QP's destination, the destination with its source."""
    a, b, wire = emulator.pair(mtu=1024)
    (packet,), dst, data = _write_packets(a, b, 100)
    b.dp.receive([dataclasses.replace(packet, **{field: value})], 0.0)
    assert not any(b.mem.read(dst, 100)) and b.dp.stats["dropped_bad_source"] == 1
    assert pk.expand(b.dp.take_outbox()) == []  # silently: no ACK or NAK for it
    b.dp.receive([packet], 0.0)
    assert b.mem.read(dst, 100) == data and b.dp.stats["duplicates"] == 0


def test_a_forged_acknowledgement_completes_nothing():
    """The requester's side too: an ACK from elsewhere for a WRITE the responder never got retires no work."""
    a, b, wire = emulator.pair(mtu=1024)
    (packet,), _, _ = _write_packets(a, b, 100)
    ack = pk.Packet(pk.Op.ACKNOWLEDGE, a.qpn, packet.psn, syndrome=pk.ACK_UNLIMITED, msn=1, src_ip="127.0.0.9",
                    dst_ip=a.ip, src_port=packet.src_port)
    a.dp.receive([ack], 0.0)
    assert a.poll() == [] and a.dp.stats["dropped_bad_source"] == 1
    a.dp.receive([dataclasses.replace(ack, src_ip=b.ip)], 0.0)  # the same from the peer: it counts
    assert [c[1] for c in a.poll()] == [emulator.REQ_OK]


def test_a_packet_from_the_peer_to_a_qp_that_does_not_receive_is_dropped_for_its_state():
    """rxe's check_type_state, before the address: the right peer's packet to a QP back in RESET or INIT."""
    a, b, wire = emulator.pair(mtu=1024)
    (packet,), dst, data = _write_packets(a, b, 100)
    for state in (QPState.RESET, QPState.INIT):
        b.modify(state)
        b.dp.receive([packet], 0.0)
        assert not any(b.mem.read(dst, 100)) and pk.expand(b.dp.take_outbox()) == []
    assert (b.dp.stats["dropped_qp_state"], b.dp.stats["dropped_bad_source"]) == (2, 0)
