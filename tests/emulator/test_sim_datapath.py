"""The emulated NIC's RC data path without any I/O (tests/support/emulator.py's hosts and wire): two firmware
instances, each with its own host memory, driven the way a driver drives them, packets carried by an in-memory wire
with seeded loss, duplication and reordering when a test asks, time a fake clock that jumps to the engine's next
deadline."""
import collections
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.hw.verbs import PATH_MTU_CODES, PSN_MASK, QPState
from aiofabric.hw.wqe import SQ_STATIC_WQE_SLOTS, msn_entry, psn_search_values
from aiofabric.sim import codec, packets as pk
from tests.support.emulator import (FLUSHED, MASK, READ, REQ_OK, RES_FLUSHED, SEND, SEND_IMM, WRITE, WRITE_IMM, Host,
                                    Wire, fill, pair)


# -- transfers -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mtu", [1024, 4096])
def test_write_lands_exactly(mtu):
    a, b, wire = pair(mtu=mtu)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    data = fill(a, src, 1 << 16, 1)
    for size in (0, 1, 61, 4096, 10000):
        b.mem.write(dst, bytes(1 << 15))
        index = a.post(WRITE, [(src, lkey, size)], remote=dst + 7, rkey=rkey)
        wire.run()
        assert a.poll() == [("req", REQ_OK, index, a.fw.rcfw.qps[a.qpn].handle)]
        assert b.mem.read(dst + 7, size) == data[:size]
        assert not any(b.mem.read(dst, 7)) and not any(b.mem.read(dst + 7 + size, 64))
        assert b.poll() == []  # a plain WRITE completes nothing at the responder
    packets = [p for p in wire.log if p.opcode != pk.Op.ACKNOWLEDGE]
    assert len(packets) == sum(max(1, -(-size // mtu)) for size in (0, 1, 61, 4096, 10000))
    assert all(p.ack_req for p in packets if p.opcode in (pk.Op.RDMA_WRITE_LAST, pk.Op.RDMA_WRITE_ONLY))
    assert a.dp.stats["retransmits"] == 0


def test_write_opcodes_reth_and_psns():
    a, b, wire = pair(mtu=1024, sq_psn=0x10)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    a.post(WRITE, [(src, lkey, 3000)], remote=dst, rkey=rkey)
    wire.run()
    requests = [p for p in wire.log if p.src_ip == a.ip]
    assert [(p.opcode, p.psn, p.ack_req, len(p.payload)) for p in requests] == [
        (pk.Op.RDMA_WRITE_FIRST, 0x10, False, 1024), (pk.Op.RDMA_WRITE_MIDDLE, 0x11, False, 1024),
        (pk.Op.RDMA_WRITE_LAST, 0x12, True, 952)]
    assert (requests[0].remote_addr, requests[0].rkey, requests[0].dma_length) == (dst, rkey, 3000)
    assert requests[0].dest_qp == b.qpn and requests[0].src_port == pk.udp_source_port(a.qpn, b.qpn)
    acks = [p for p in wire.log if p.src_ip == b.ip]
    assert [(p.opcode, p.psn, p.syndrome, p.msn) for p in acks] == [(pk.Op.ACKNOWLEDGE, 0x12, 0x1F, 1)]


def test_ack_request_every_64_packets():
    a, b, wire = pair(mtu=256)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    a.post(WRITE, [(src, lkey, 200 * 256)], remote=dst, rkey=rkey)
    wire.run()
    requests = [p for p in wire.log if p.src_ip == a.ip]
    assert len(requests) == 200 and len({p.psn for p in requests}) == 200
    assert [i for i, p in enumerate(requests) if p.ack_req] == [63, 127, 191, 199]
    assert a.poll()[0][1] == REQ_OK


def test_long_messages_in_one_receive_batch_land_and_are_acknowledged_where_asked():
    a, b, wire = pair(mtu=256)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    data = fill(a, src, 1 << 16, 9)
    a.post(WRITE, [(src, lkey, 200 * 256)], remote=dst, rkey=rkey)  # MIDDLE runs broken by AckReq at 63, 127, 191
    wire.run()
    assert a.poll()[0][1] == REQ_OK and b.mem.read(dst, 200 * 256) == data[:200 * 256]
    assert max(p.psn for p in wire.log if p.src_ip == b.ip) == 0x1000 + 199
    # A SEND's MIDDLE packets overrunning the receive buffer: the run stops there and the error is reported as usual.
    inbox, key = b.register(4096)
    b.post_recv([(inbox, key, 600)], tag=3)
    a.post(SEND, [(src, lkey, 4 * 256)])
    wire.run()
    assert [c[1] for c in a.poll()] == [bnxt.CQ_REQ_STATUS_REMOTE_INVALID_REQUEST_ERR]
    assert b.poll() == [("res", bnxt.CQ_RES_RC_STATUS_LOCAL_LENGTH_ERR, 0, 0, 0, 3)]
    assert b.mem.read(inbox, 512) == data[:512]


def test_read():
    a, b, wire = pair(mtu=512)
    local, lkey = a.register(8192)
    remote, rkey = b.register(8192)
    data = fill(b, remote, 8192, 2)
    index = a.post(READ, [(local + 100, lkey, 1000), (local + 2000, lkey, 2000)], remote=remote + 200, rkey=rkey)
    wire.run()
    assert a.poll() == [("req", REQ_OK, index, a.fw.rcfw.qps[a.qpn].handle)]
    assert a.mem.read(local + 100, 1000) == data[200:1200]
    assert a.mem.read(local + 2000, 2000) == data[1200:3200]
    responses = [p.opcode for p in wire.log if p.src_ip == b.ip]
    assert responses == [pk.Op.RDMA_READ_RESPONSE_FIRST] + [pk.Op.RDMA_READ_RESPONSE_MIDDLE] * 4 + \
        [pk.Op.RDMA_READ_RESPONSE_LAST]
    assert b.poll() == []


def test_read_needs_local_write_on_the_landing_region():
    a, b, wire = pair()
    local, lkey = a.register(4096, access=bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_READ)
    remote, rkey = b.register(4096)
    a.post(READ, [(local, lkey, 100)], remote=remote, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [bnxt.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR]
    assert a.fw.rcfw.qps[a.qpn].state == QPState.ERR


def test_send_into_posted_receives():
    a, b, wire = pair(mtu=512)
    src, lkey = a.register(8192)
    inbox, inbox_key = b.register(8192)
    data = fill(a, src, 8192, 3)
    b.post_recv([(inbox, inbox_key, 1000), (inbox + 4096, inbox_key, 1000)], tag=0x11)
    b.post_recv([(inbox + 2048, inbox_key, 64)], tag=0x12)
    a.post(SEND, [(src, lkey, 1500)])
    a.post(SEND_IMM, [(src + 3000, lkey, 61)], imm=0xCAFEBABE)
    wire.run()
    assert [c[:2] for c in a.poll()] == [("req", REQ_OK)] * 2
    assert b.poll() == [("res", 0, 1500, 0, 0, 0x11), ("res", 0, 61, 0xCAFEBABE, bnxt.CQ_RES_RC_FLAGS_IMM, 0x12)]
    assert b.mem.read(inbox, 1000) == data[:1000] and b.mem.read(inbox + 4096, 500) == data[1000:1500]
    assert b.mem.read(inbox + 2048, 61) == data[3000:3061]
    imm_packets = [p for p in wire.log if p.opcode == pk.Op.SEND_ONLY_WITH_IMMEDIATE]
    assert imm_packets[0].immediate == 0xCAFEBABE
    assert codec.encode(imm_packets[0])[12:16] == bytes.fromhex("cafebabe")  # ImmDt is big-endian on the wire


def test_write_with_immediate_consumes_a_receive():
    a, b, wire = pair(mtu=1024)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = fill(a, src, 8192, 4)
    b.post_recv([], tag=0x77)
    a.post(WRITE_IMM, [(src, lkey, 5000)], remote=dst, rkey=rkey, imm=0x01020304)
    wire.run()
    assert [c[:2] for c in a.poll()] == [("req", REQ_OK)]
    flags = bnxt.CQ_RES_RC_FLAGS_RDMA | bnxt.CQ_RES_RC_FLAGS_IMM
    assert b.poll() == [("res", 0, 5000, 0x01020304, flags, 0x77)]
    assert b.mem.read(dst, 5000) == data[:5000]


def test_unsignaled_wqes_are_retired_by_a_later_cqe():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    for i in range(5):
        a.post(WRITE, [(src, lkey, 64)], remote=dst + 64 * i, rkey=rkey, signaled=i == 4, ring=False)
    a.ring_sq()  # one doorbell, five WQEs
    wire.run()
    assert [(c[1], c[2]) for c in a.poll()] == [(REQ_OK, 5)]


def test_wqe_straddling_the_sq_ring_end():
    a, b, wire = pair(sq_slots=256)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    data = fill(a, src, 1 << 16, 5)
    done = []
    for i in range(150):  # 3- and 4-slot WQEs: headers and SGEs land on both sides of the wrap, again and again
        sges = [(src + 100 * i, lkey, 50)] + ([(src + 100 * i + 50, lkey, 50)] if i % 2 else [])
        a.post(WRITE, sges, remote=dst + 100 * i, rkey=rkey)
        wire.run()
        done += a.poll()
    assert [c[1:3] for c in done] == [(REQ_OK, i + 1) for i in range(150)]
    assert a.sq_producer > 2 * 256
    for i in range(150):
        size = 100 if i % 2 else 50
        assert b.mem.read(dst + 100 * i, size) == data[100 * i:100 * i + size]


@pytest.mark.parametrize("variable, sq_slots", [(False, 100 * SQ_STATIC_WQE_SLOTS), (True, 768)])
def test_sq_cons_idx_counts_wqes_modulo_sq_size(variable, sq_slots):
    """A requester CQE names the WQE after the one it completes modulo CREATE_QP's sq_size: 100 static WQEs, or 768
    slots with variable WQEs (still one count per WQE), sizes Linux gives (not powers of two), as
    bnxt_qplib_cq_process_req reduces it. Through several wraps of the index, and past 2^16 WQEs."""
    a, b, wire = pair(sq_slots=sq_slots, variable=variable)
    size = a.geometry.size
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    got = []
    for _ in range(-(-(size + 150) // 50)):  # batches of 50 WQEs of 3 slots, one doorbell each
        for _ in range(50):
            a.post(WRITE, [(src, lkey, 8)], remote=dst, rkey=rkey, ring=False)
        a.ring_sq()
        wire.run()
        got += [c[2] for c in a.poll()]
    assert got == [i % size for i in range(1, a.wqe_count + 1)]
    a.dp.context(a.qpn).requester.sq.fetched = 0xFFFE  # as if 65534 WQEs had gone before
    for _ in range(3):
        a.post(WRITE, [(src, lkey, 8)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[2] for c in a.poll()] == [0xFFFF % size, 0x10000 % size, 0x10001 % size]


@pytest.mark.parametrize("variable, sq_slots", [(False, 100 * SQ_STATIC_WQE_SLOTS), (True, 768)])
def test_an_error_cqe_names_the_failed_wqe_by_its_slot_with_variable_wqes(variable, sq_slots):
    """WQEs of 1 to 4 SGEs wrap the ring, then a WRITE of 2 SGEs to a bad rkey fails and two more flush. With
    variable WQEs every error CQE (the failure and the flushes) names the slot its WQE starts at, modulo the ring's
    slots (bnxt_qplib_get_cqe_sq_cons matches it against each WQE's slot_idx); static WQEs keep the WQE index."""
    a, b, wire = pair(sq_slots=sq_slots, variable=variable)
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    sges = [[(src + 64 * k, lkey, 8) for k in range(1 + i % 4)] for i in range(4)]
    while a.sq_producer < sq_slots + 40:
        for i in range(20):
            a.post(WRITE, sges[i % 4], remote=dst, rkey=rkey, ring=False)
        a.ring_sq()
        wire.run()
        assert [c[1:3] for c in a.poll()] == [(REQ_OK, a.sq_cons_idx(n)) for n in range(a.wqe_count - 19,
                                                                                         a.wqe_count + 1)]
    bad = a.post(WRITE, sges[1], remote=dst, rkey=rkey ^ 0x100)
    a.post(WRITE, sges[2], remote=dst, rkey=rkey)
    a.post(WRITE, sges[0], remote=dst, rkey=rkey)
    wire.run()
    error = bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR
    assert [c[1:3] for c in a.poll()] == [(error, a.sq_cons_idx(bad, error)),
                                          (FLUSHED, a.sq_cons_idx(bad + 1, FLUSHED)),
                                          (FLUSHED, a.sq_cons_idx(bad + 2, FLUSHED))]
    if variable:
        assert a.sq_cons_idx(bad, error) == a.starts[bad - 1] != bad % sq_slots  # a slot, not a WQE index
        assert a.sq_producer > sq_slots  # the slots wrapped before
    else:
        assert a.sq_cons_idx(bad, error) == bad % 100


# -- errors ----------------------------------------------------------------------------------------------------------
def test_bad_rkey_fails_the_wqe_and_flushes_the_rest():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey)
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey ^ 0x100)  # no such key
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey, signaled=False)
    a.post(READ, [(src, lkey, 64)], remote=dst, rkey=rkey)
    wire.run()
    # error CQEs name the slot their (3-slot) WQE starts at
    assert [c[1:3] for c in a.poll()] == [(REQ_OK, 1), (bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR, 3), (FLUSHED, 6),
                                          (FLUSHED, 9)]
    assert a.fw.rcfw.qps[a.qpn].state == QPState.ERR
    (event,) = a.creq_events()
    assert bnxt.creq_qp_error_notification.from_buffer_copy(event).xid == a.qpn
    assert b.fw.rcfw.qps[b.qpn].state == QPState.ERR  # class C error: the responder QP fails too
    # WQEs posted to a QP in ERR complete FLUSHED at once
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey, signaled=False)
    wire.run()
    assert [c[1:3] for c in a.poll()] == [(FLUSHED, 12)]
    assert [p.syndrome for p in wire.log if p.src_ip == b.ip][-1] == pk.NAK_REMOTE_ACCESS


def test_write_beyond_the_region_is_a_remote_access_error():
    a, b, wire = pair()
    src, lkey = a.register(8192)
    dst, rkey = b.register(4096)
    a.post(WRITE, [(src, lkey, 200)], remote=dst + 4000, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR]
    assert not any(b.mem.read(dst, 4096))


def test_bad_lkey_is_a_local_protection_error():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey, signaled=False)
    a.post(WRITE, [(src, lkey + 0x100, 64)], remote=dst, rkey=rkey)
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[1:3] for c in a.poll()] == [(bnxt.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR, 3), (FLUSHED, 6)]  # slots
    assert a.fw.rcfw.qps[a.qpn].state == QPState.ERR
    assert b.fw.rcfw.qps[b.qpn].state == QPState.RTS


def test_send_larger_than_the_receive_is_a_length_error():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    inbox, key = b.register(4096)
    b.post_recv([(inbox, key, 100)], tag=1)
    b.post_recv([(inbox, key, 100)], tag=2)
    a.post(SEND, [(src, lkey, 200)])
    wire.run()
    assert [c[1] for c in a.poll()] == [bnxt.CQ_REQ_STATUS_REMOTE_INVALID_REQUEST_ERR]
    assert b.poll() == [("res", bnxt.CQ_RES_RC_STATUS_LOCAL_LENGTH_ERR, 0, 0, 0, 1), ("res", RES_FLUSHED, 0, 0, 0, 2)]


def test_send_with_empty_rq_gets_rnr_nak_then_succeeds():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    inbox, key = b.register(4096)
    fill(a, src, 4096, 6)
    a.post(SEND, [(src, lkey, 3000)])
    wire.run(until=lambda: any(p.syndrome & 0x60 == pk.RNR_NAK for p in wire.log if p.opcode == pk.Op.ACKNOWLEDGE))
    assert a.poll() == [] and b.poll() == []
    started = wire.now
    b.post_recv([(inbox, key, 4096)], tag=9)
    wire.run()
    assert [c[:2] for c in a.poll()] == [("req", REQ_OK)]
    assert b.poll() == [("res", 0, 3000, 0, 0, 9)]
    assert b.mem.read(inbox, 3000) == a.mem.read(src, 3000)
    assert wire.now - started >= pk.RNR_TIMER_US[1] * 1e-6 * 0.99  # waited for the RNR timer (min_rnr_timer 1)
    assert b.dp.stats["rnr_naks"] >= 1 and a.dp.stats["rnr_naks_received"] >= 1


def test_rnr_retries_exhausted():
    a, b, wire = pair(rnr_retry=2)
    src, lkey = a.register(4096)
    a.post(SEND, [(src, lkey, 10)])
    wire.run()
    assert [c[1] for c in a.poll()] == [bnxt.CQ_REQ_STATUS_RNR_NAK_RETRY_CNT_ERR]
    assert b.dp.stats["rnr_naks"] == 3


def test_retry_exhaustion_on_a_black_hole():
    a, b, wire = pair(timeout=1, retry_cnt=3)
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    a.post(WRITE, [(src, lkey, 3000)], remote=dst, rkey=rkey)
    a.post(WRITE, [(src, lkey, 10)], remote=dst, rkey=rkey, signaled=False)
    wire.black_hole = True
    wire.run()
    assert [c[1] for c in a.poll()] == [bnxt.CQ_REQ_STATUS_TRANSPORT_RETRY_CNT_ERR, FLUSHED]
    interval = 4.096e-6 * 2
    assert a.dp.stats["timeouts"] == 4 and wire.now == pytest.approx(4 * interval)
    assert len([p for p in wire.log if p.src_ip == a.ip]) == 4 * 4  # the original and three retries of 4 packets
    assert a.fw.rcfw.qps[a.qpn].state == QPState.ERR and len(a.creq_events()) == 1


def test_lost_packet_is_recovered_by_nak_sequence():
    a, b, wire = pair(mtu=256)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = fill(a, src, 8192, 7)
    original = b.dp.receive
    dropped = []

    def lose_third_packet(packets, now):
        keep = [p for p in packets if not (p.psn == 0x1002 and not dropped and not dropped.append(p))]
        original(keep, now)
    b.dp.receive = lose_third_packet
    a.post(WRITE, [(src, lkey, 2000)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and b.mem.read(dst, 2000) == data[:2000]
    naks = [p for p in wire.log if p.opcode == pk.Op.ACKNOWLEDGE and p.syndrome == pk.NAK_PSN_SEQ]
    assert [p.psn for p in naks] == [0x1002]  # one NAK for the gap, the rest dropped quietly
    assert a.dp.stats["timeouts"] == 0 and a.dp.stats["retransmits"] == 6


def test_lost_read_responses_are_recovered_by_the_implied_nak():
    a, b, wire = pair(mtu=1024)
    local, lkey = a.register(8192)
    remote, rkey = b.register(8192)
    data = fill(b, remote, 8192, 10)
    original, lost = a.dp.receive, []

    def lose_first_read_responses(packets, now):
        keep = [p for p in packets if not (p.opcode in (pk.Op.RDMA_READ_RESPONSE_FIRST, pk.Op.RDMA_READ_RESPONSE_LAST)
                                           and len(lost) < 2 and not lost.append(p))]
        original(keep, now)
    a.dp.receive = lose_first_read_responses
    a.post(READ, [(local, lkey, 2000)], remote=remote, rkey=rkey)
    a.post(WRITE, [(local + 4096, lkey, 10)], remote=remote + 4096, rkey=rkey)
    wire.run()
    assert [c[1:3] for c in a.poll()] == [(REQ_OK, 1), (REQ_OK, 2)]
    assert a.mem.read(local, 2000) == data[:2000]
    assert a.dp.stats["implied_naks"] == 1 and a.dp.stats["timeouts"] == 0  # the WRITE's ACK told us, not a timer


def test_reads_in_flight_are_limited_by_max_rd_atomic():
    a, b, wire = pair(mtu=256)
    a.modify(QPState.RTS, MASK["MAX_RD_ATOMIC"], max_rd_atomic=1)
    local, lkey = a.register(8192)
    remote, rkey = b.register(8192)
    data = fill(b, remote, 8192, 11)
    for i in range(3):
        a.post(READ, [(local + 2048 * i, lkey, 1000)], remote=remote + 2048 * i, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] * 3
    order = [p.opcode for p in wire.log if p.opcode in (pk.Op.RDMA_READ_REQUEST, pk.Op.RDMA_READ_RESPONSE_LAST)]
    assert order == [pk.Op.RDMA_READ_REQUEST, pk.Op.RDMA_READ_RESPONSE_LAST] * 3  # one READ at a time
    for i in range(3):
        assert a.mem.read(local + 2048 * i, 1000) == data[2048 * i:2048 * i + 1000]


def test_acks_are_coalesced_per_receive_batch():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    for i in range(20):
        a.post(WRITE, [(src, lkey, 8)], remote=dst + 8 * i, rkey=rkey, signaled=False, ring=False)
    a.post(WRITE, [(src, lkey, 8)], remote=dst + 160, rkey=rkey)
    a.ring_sq()
    wire.run()
    acks = [p for p in wire.log if p.opcode == pk.Op.ACKNOWLEDGE]
    assert len(acks) == 1 and acks[0].msn == 21
    assert [c[1:3] for c in a.poll()] == [(REQ_OK, 21)]


def test_psn_wraps_at_2_24():
    a, b, wire = pair(mtu=256, sq_psn=0xFFFFF0, rq_psn=0xFFFFFE, loss=0.1, seed=3)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    data = fill(a, src, 1 << 16, 8)
    for i in range(4):
        a.post(WRITE, [(src + 8192 * i, lkey, 8000)], remote=dst + 8192 * i, rkey=rkey)
    a.post(READ, [(src + 40000, lkey, 3000)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] * 5
    for i in range(4):
        assert b.mem.read(dst + 8192 * i, 8000) == data[8192 * i:8192 * i + 8000]
    assert a.mem.read(src + 40000, 3000) == data[:3000]
    assert a.dp.contexts[a.qpn].requester.next_psn == (0xFFFFF0 + 4 * 32 + 12) & PSN_MASK
    assert min(p.psn for p in wire.log if p.src_ip == a.ip) == 0


def test_modify_qp_to_err_flushes_everything():
    a, b, wire = pair()
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    wire.black_hole = True
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey, signaled=False)
    a.post(READ, [(src, lkey, 64)], remote=dst, rkey=rkey)
    a.post_recv([(src, lkey, 64)], tag=5)
    wire.step()
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey, signaled=False)  # still on the ring
    a.modify(QPState.ERR)
    flushed = a.poll()
    assert sorted(c[1:3] for c in flushed if c[0] == "req") == [(FLUSHED, 0), (FLUSHED, 3), (FLUSHED, 6)]  # slots
    assert [c for c in flushed if c[0] == "res"] == [("res", RES_FLUSHED, 0, 0, 0, 5)]
    assert a.creq_events() == []  # the driver asked for ERR: no error event
    a.post_recv([(src, lkey, 64)], tag=6)
    a.dp.doorbells(wire.now)
    assert a.poll() == [("res", RES_FLUSHED, 0, 0, 0, 6)]
    a.modify(QPState.RESET)
    assert a.qpn not in a.dp.contexts


def test_a_destroyed_qp_stops_retransmitting():
    a, b, wire = pair(timeout=1)
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    wire.black_hole = True
    a.post(WRITE, [(src, lkey, 64)], remote=dst, rkey=rkey)
    wire.step()
    a.command("destroy_qp", qp_cid=a.qpn)
    sent = len(wire.log)
    wire.run()
    assert len(wire.log) == sent and a.poll() == []  # no retransmission, no CQE into a CQ the driver may reuse


def test_wqes_posted_before_rts_wait_for_it():
    a, b = Host("127.0.0.2"), Host("127.0.0.3")
    for host in (a, b):
        host.create_qp(host.create_cq())
    a.connect(b, rts=False)
    b.connect(a, sq_psn=0x2000, rq_psn=0x1000)
    wire = Wire(a, b)
    src, lkey = a.register(4096)
    dst, rkey = b.register(4096)
    fill(a, src, 4096, 9)
    a.post(WRITE, [(src, lkey, 100)], remote=dst, rkey=rkey)
    wire.run()
    assert a.poll() == [] and not any(b.mem.read(dst, 100))
    a.rts()
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and b.mem.read(dst, 100) == a.mem.read(src, 100)


def test_bad_packets_are_dropped_or_nakked_not_raised():
    a, b, wire = pair()
    dst, rkey = b.register(4096)
    ctx = a.dp.context(a.qpn)
    _, pkey, src_ip, dst_ip, sport, _, _ = ctx.address
    mess = [pk.Packet(pk.Op.ACKNOWLEDGE, a.qpn, 0x123, syndrome=0x1F),  # acks nothing ever sent
            pk.Packet(pk.Op.RDMA_READ_RESPONSE_ONLY, a.qpn, 0x1000, payload=b"x"),
            pk.Packet(pk.Op.RDMA_WRITE_ONLY, 0xFFFF, 0, payload=b"x"),  # no such QP
            pk.Packet(pk.Op.RDMA_WRITE_MIDDLE, b.qpn, 0x1000, payload=b"x" * 1024)]  # MIDDLE without FIRST
    for p in mess:
        p.src_ip, p.dst_ip, p.src_port = src_ip, dst_ip, sport
    for p in mess[:2]:  # to a from its peer, or the source check drops them before the requester sees them
        p.src_ip, p.dst_ip = dst_ip, src_ip
    b.dp.receive(mess[2:], 0.0)
    a.dp.receive(mess[:2], 0.0)
    assert a.dp.stats["internal_errors"] == b.dp.stats["internal_errors"] == 0
    assert a.dp.stats["dropped_bad_source"] == b.dp.stats["dropped_bad_source"] == 0
    assert b.dp.stats["dropped_no_qp"] == 1
    assert [p.syndrome for p in pk.expand(b.dp.take_outbox())] == [pk.NAK_INVALID_REQUEST]
    assert b.fw.rcfw.qps[b.qpn].state == QPState.ERR


# -- faults ----------------------------------------------------------------------------------------------------------
OPERATIONS = st.lists(st.tuples(st.sampled_from(["write", "read", "send", "write_imm"]), st.integers(0, 9000),
                                st.booleans()), min_size=1, max_size=40)


# Loss stays at 5%: retry_cnt 7 allows 7 retries without progress, and a round of go-back-N makes no progress when
# the one packet everything waits for (a retransmitted request, the first response to a re-issued READ) is lost. At
# 10-20% loss eight such rounds in a row turn up within a few hundred examples, as they would on hardware.
# Derandomized, so CI sees the same examples every run.
@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS, seed=st.integers(0, 1 << 16), mtu=st.sampled_from([256, 1024, 4096]),
       faults=st.sampled_from([(0.05, 0.1, 0.2), (0.05, 0.0, 0.0), (0.0, 0.3, 0.3), (0.03, 0.05, 0.5)]))
def test_every_byte_arrives_once_under_faults(operations, seed, mtu, faults):
    loss, dup, reorder = faults
    a, b, wire = pair(mtu=mtu, loss=loss, dup=dup, reorder=reorder, seed=seed, timeout=3)
    size = 10000 * (len(operations) + 1)
    src, lkey = a.register(size)
    dst, rkey = b.register(size)
    local = fill(a, src, size, seed)
    remote = fill(b, dst, size, seed + 1)
    expected_local, expected_remote = bytearray(local), bytearray(remote)
    receives = 0
    for i, (kind, length, signaled) in enumerate(operations):
        slot = 10000 * i
        if kind == "read":
            a.post(READ, [(src + slot, lkey, length)], remote=dst + slot, rkey=rkey, signaled=signaled)
            expected_local[slot:slot + length] = expected_remote[slot:slot + length]
        elif kind in ("send", "write_imm"):
            b.post_recv([(dst + slot, rkey, 10000)], tag=i)
            receives += 1
            if kind == "send":
                a.post(SEND, [(src + slot, lkey, length)], signaled=signaled)
            else:
                a.post(WRITE_IMM, [(src + slot, lkey, length)], remote=dst + slot, rkey=rkey, imm=i,
                       signaled=signaled)
            expected_remote[slot:slot + length] = expected_local[slot:slot + length]
        else:
            a.post(WRITE, [(src + slot, lkey, length)], remote=dst + slot, rkey=rkey, signaled=signaled)
            expected_remote[slot:slot + length] = expected_local[slot:slot + length]
    a.post(WRITE, [(src, lkey, 0)], remote=dst, rkey=rkey)  # a final signaled WQE retires everything before it
    wire.run(max_time=600)
    requester = [c for c in a.poll() if c[0] == "req"]
    assert all(c[1] == REQ_OK for c in requester), (requester, a.dp.stats, b.dp.stats)
    assert [c[2] for c in requester] == [i + 1 for i, op in enumerate(operations) if op[2]] + [len(operations) + 1]
    responder = b.poll()
    assert [(c[1], c[5]) for c in responder] == [(0, i) for i, op in enumerate(operations)
                                                 if op[0] in ("send", "write_imm")]
    assert len(responder) == receives
    assert a.mem.read(src, size) == bytes(expected_local)
    assert b.mem.read(dst, size) == bytes(expected_remote)
    assert a.fw.rcfw.qps[a.qpn].state == b.fw.rcfw.qps[b.qpn].state == QPState.RTS
    assert a.dp.stats["internal_errors"] == b.dp.stats["internal_errors"] == 0


# -- placement accounting and deliberate placement bugs (debug "placed" and "fault") --------------------------------
def test_placed_counts_every_message_once_under_loss_dup_and_reorder():
    a, b, wire = pair(mtu=256, loss=0.1, dup=0.2, reorder=0.2, seed=5, timeout=3)
    local, lkey = a.register(1 << 16)
    remote, rkey = b.register(1 << 16)
    fill(a, local, 1 << 16, 21)
    fill(b, remote, 1 << 16, 22)
    writes = [0, 1, 255, 256, 1000, 4000]  # zero-length is a message too
    reads, sends = [3000, 1, 700], [300, 2000]
    for i, size in enumerate(writes):
        a.post(WRITE, [(local + 4096 * i, lkey, size)], remote=remote + 4096 * i, rkey=rkey, signaled=False)
    b.post_recv([(remote + 40000, rkey, 2048)], tag=1)
    a.post(WRITE_IMM, [(local, lkey, 1500)], remote=remote + 30000, rkey=rkey, imm=7, signaled=False)
    for i, size in enumerate(reads):
        a.post(READ, [(local + 50000 + 4096 * i, lkey, size)], remote=remote + 4096 * i, rkey=rkey, signaled=False)
    for i, size in enumerate(sends):
        b.post_recv([(remote + 44000 + 4096 * i, rkey, 4096)], tag=2 + i)
        a.post(SEND, [(local + 4096 * i, lkey, size)], signaled=False)
    a.post(WRITE, [(local, lkey, 0)], remote=remote, rkey=rkey)
    wire.run(max_time=600)
    assert [c[1] for c in a.poll()] == [REQ_OK]
    assert b.dp.stats["duplicates"] > 0 and a.dp.stats["retransmits"] > 0  # the faults did bite
    assert a.dp.placed_report()[str(a.qpn)] == {
        "write_messages": 0, "write_bytes": 0, "send_messages": 0, "send_bytes": 0,
        "read_messages": len(reads), "read_bytes": sum(reads), "atomic_messages": 0, "atomic_bytes": 0}
    assert b.dp.placed_report()[str(b.qpn)] == {
        "write_messages": len(writes) + 2, "write_bytes": sum(writes) + 1500,  # + the WRITE_IMM and the final one
        "send_messages": len(sends), "send_bytes": sum(sends), "read_messages": 0, "read_bytes": 0,
        "atomic_messages": 0, "atomic_bytes": 0}


def test_skip_placement_fault_acknowledges_writes_without_placing_them():
    a, b, wire = pair(mtu=1024)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    data = fill(a, src, 1 << 16, 23)
    b.dp.faults.inject("skip_placement", 2)
    for i, size in enumerate((0, 5000, 100, 300)):  # the zero-length one has nothing to skip: it does not count
        a.post(WRITE, [(src + 8192 * i, lkey, size)], remote=dst + 8192 * i, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] * 4  # acknowledged as if all was well
    assert b.mem.read(dst + 8192, 5000) == bytes(5000) and b.mem.read(dst + 16384, 100) == bytes(100)
    assert b.mem.read(dst + 24576, 300) == data[24576:24876]  # the fault is used up
    placed = b.dp.placed_report()[str(b.qpn)]
    assert (placed["write_messages"], placed["write_bytes"]) == (2, 300)


def test_misplace_fault_shifts_the_payload_and_stays_inside_the_region():
    a, b, wire = pair(mtu=1024)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = fill(a, src, 8192, 24)
    b.dp.faults.inject("misplace", 2, offset=64)
    a.post(WRITE, [(src, lkey, 3000)], remote=dst + 1000, rkey=rkey)
    a.post(WRITE, [(src, lkey, 2000)], remote=dst + 8192 - 2000, rkey=rkey)  # at the end: clamped, lands as asked
    a.post(WRITE, [(src + 4096, lkey, 100)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] * 3
    assert b.mem.read(dst + 1064, 3000) == data[:3000] and b.mem.read(dst + 1000, 64) == bytes(64)
    assert b.mem.read(dst + 8192 - 2000, 2000) == data[:2000]
    assert b.mem.read(dst, 100) == data[4096:4196]
    with pytest.raises(ValueError, match="unknown fault kind"):
        b.dp.faults.inject("lose_everything", 1)


# -- one NAK per sequence gap, one go-back per loss -----------------------------------------------------------------
def sequence_naks(wire: Wire) -> list[int]:
    return [p.psn for p in wire.log if p.opcode == pk.Op.ACKNOWLEDGE and p.syndrome == pk.NAK_PSN_SEQ]


def test_a_reordered_pair_earns_one_nak_and_one_go_back():
    """PSN 0x1005 overtakes 0x1004: NAK(0x1004); 0x1004 arrives and closes the gap, but 0x1005 was dropped meanwhile
    and the requester's later packets race its go-back. rxe would NAK 0x1005 too, and the requester would go back a
    second time for one reordering; the go-back NAK(0x1004) asked for re-sends 0x1005 anyway."""
    a, b, wire = pair(mtu=256)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = fill(a, src, 8192, 31)
    original, swapped = b.dp.receive, []

    def swap_once(packets, now):
        psns = [p.psn for p in packets]
        if not swapped and 0x1004 in psns and 0x1005 in psns:
            i = psns.index(0x1004)
            packets[i], packets[i + 1] = packets[i + 1], packets[i]
            swapped.append(True)
        original(packets, now)
    b.dp.receive = swap_once
    a.post(WRITE, [(src, lkey, 30 * 256)], remote=dst, rkey=rkey)
    wire.run()
    assert swapped and [c[1] for c in a.poll()] == [REQ_OK] and b.mem.read(dst, 30 * 256) == data[:30 * 256]
    assert sequence_naks(wire) == [0x1004]
    assert a.dp.stats["go_backs"] == 1 and a.dp.stats["timeouts"] == 0


def test_a_lost_retransmission_is_a_new_gap_with_its_own_nak():
    """The go-back itself loses a packet: that gap is new (the packets around it are ones the responder saw before),
    so it is NAKed at once rather than left to the retransmission timer."""
    a, b, wire = pair(mtu=256)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = fill(a, src, 8192, 32)
    original, seen = b.dp.receive, collections.Counter()

    def lose(packets, now):
        keep = []
        for p in packets:
            seen[p.psn] += 1
            if (p.psn, seen[p.psn]) not in ((0x1004, 1), (0x1005, 2)):  # 0x1004 lost, then 0x1005's resend
                keep.append(p)
        original(keep, now)
    b.dp.receive = lose
    a.post(WRITE, [(src, lkey, 30 * 256)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and b.mem.read(dst, 30 * 256) == data[:30 * 256]
    assert sequence_naks(wire) == [0x1004, 0x1005]
    assert a.dp.stats["go_backs"] == 2 and a.dp.stats["timeouts"] == 0


@pytest.mark.parametrize("second", ["duplicate NAK", "timeout first"])
def test_the_requester_goes_back_once_per_loss(second):
    """The same NAK twice (the wire duplicated it), or a NAK that arrives after the timer already went back to its
    PSN: one go-back each, not two."""
    a, b, wire = pair(mtu=256, timeout=1)
    src, lkey = a.register(8192)
    dst, rkey = b.register(8192)
    data = fill(a, src, 8192, 33)
    a.post(WRITE, [(src, lkey, 100)], remote=dst, rkey=rkey)  # PSN 0x1000, acknowledged: una moves to 0x1001
    wire.run()
    receive_b, receive_a, lost, held = b.dp.receive, a.dp.receive, [], []

    def lose_first_packet(packets, now):
        receive_b([p for p in packets if not (p.psn == 0x1001 and not lost and not lost.append(p))], now)

    def nak_twice_or_late(packets, now):
        out = []
        for p in packets:
            if p.opcode == pk.Op.ACKNOWLEDGE and p.syndrome == pk.NAK_PSN_SEQ:
                if second == "duplicate NAK":
                    out += [p, dataclasses.replace(p)]
                else:
                    held.append(p)  # delivered once the timer went back on its own
                continue
            out.append(p)
        if held and a.dp.stats["timeouts"]:
            out, held[:] = held + out, []
        receive_a(out, now)
    b.dp.receive, a.dp.receive = lose_first_packet, nak_twice_or_late
    a.post(WRITE, [(src, lkey, 10 * 256)], remote=dst, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK, REQ_OK] and b.mem.read(dst, 2560) == data[:2560]
    assert sequence_naks(wire) == [0x1001] and not held
    assert a.dp.stats["go_backs"] == 1
    assert a.dp.stats["timeouts"] == (1 if second == "timeout first" else 0)


# -- hardware retransmission: a go-back finds its message in the search table the driver wrote ---------------------
TABLES = [("thor2", True), ("thor2", False), ("psn-table", True), ("psn-table", False)]  # (profile, variable WQEs)


def swap_search_table_psns(host: Host) -> None:
    """Every written entry with its start and next PSN swapped: a driver bug the chip would follow."""
    geometry, entry = host.geometry, host.geometry.table_entry
    for index in range(geometry.table_entries):
        address = host.sq + geometry.table_offset + index * entry.size
        values = entry.unpack(host.mem.read(address, entry.size))
        if any(values):
            start, after, start_slot = geometry.entry_fields(values)
            swapped = ((msn_entry(after, start, start_slot),) if geometry.host_msn
                       else psn_search_values(values[0] >> 24, after, start, start_slot))
            host.mem.write(address, entry.pack(*swapped))


def writes_under_loss(swap: bool, **options) -> tuple[Host, bool]:
    """Sixteen WRITEs of unequal sizes (a misnumbered message cannot pass for another) over a lossy wire; (the
    requester, whether every one completed and landed)."""
    a, b, wire = pair(mtu=256, loss=0.1, seed=4, timeout=3, **options)
    src, lkey = a.register(1 << 16)
    dst, rkey = b.register(1 << 16)
    data = fill(a, src, 1 << 16, 9)
    sizes = [1 + i * 1237 % 4000 for i in range(16)]
    for i, size in enumerate(sizes):
        a.post(WRITE, [(src + i * 4096, lkey, size)], remote=dst + i * 4096, rkey=rkey, ring=False)
    if swap:
        swap_search_table_psns(a)
    a.ring_sq()
    wire.run()
    landed = all(b.mem.read(dst + i * 4096, size) == data[i * 4096:i * 4096 + size] for i, size in enumerate(sizes))
    return a, [c[1] for c in a.poll()] == [REQ_OK] * 16 and landed


@pytest.mark.parametrize("profile,variable", TABLES)
def test_a_go_back_resumes_from_the_search_table_the_driver_wrote(profile, variable):
    a, delivered = writes_under_loss(False, profile=profile, variable=variable, hw_retx=True)
    assert delivered and a.dp.stats["go_backs"] > 0 and a.dp.stats["search_table_mismatches"] == 0


@pytest.mark.parametrize("profile,variable", TABLES)
def test_a_wrong_search_table_misleads_the_retransmission(profile, variable):
    """The chip trusts the table: entries with their PSNs swapped send the go-back astray, and the transfer fails."""
    a, delivered = writes_under_loss(True, profile=profile, variable=variable, hw_retx=True)
    assert not delivered and a.dp.stats["search_table_mismatches"] > 0


def test_without_hardware_retransmission_the_firmware_retransmits_from_its_own_context():
    a, delivered = writes_under_loss(True, hw_retx=False)
    assert delivered and a.dp.stats["go_backs"] > 0 and a.dp.stats["search_table_mismatches"] == 0


@pytest.mark.parametrize("rts", [False, True])
def test_a_path_mtu_is_set_on_init_to_rtr_only(rts):
    """ib_modify_qp_is_ok (which bnxt_re_modify_qp applies) takes a path MTU on INIT -> RTR alone: a connected QP's
    MTU never changes under packets already counted at it."""
    a, b, _ = pair(mtu=1024, rts=rts)
    before = QPState.RTS if rts else QPState.RTR
    with pytest.raises(AssertionError, match=f"the path MTU is set on INIT -> RTR only, not on {before.name} -> RTS"):
        a.modify(QPState.RTS, MASK["PATH_MTU"], path_mtu_pingpong_push_enable=PATH_MTU_CODES[4096])
    assert a.fw.rcfw.qps[a.qpn].path_mtu == 1024 and a.fw.rcfw.qps[a.qpn].state == before
