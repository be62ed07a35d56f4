"""The emulator's compiled core (native.py, wirecodec.c, wirequeues.c) fed what a hostile sender or a careless driver
can hand it: datagrams with a good ICRC over headers that do not fit, WRITE packets whose RETH runs off or wraps
around their region, descriptors and block rows whose packet count was worked out at another path MTU than the one
they are sent at, a WQE whose length overflows 32-bit arithmetic. Each time the core must do what the Python
reference does (codec.py, responder.py, sendqueue.py, packets.Segments) and touch no byte outside what it was given."""
from __future__ import annotations

import array
import dataclasses
import hashlib
import socket
import types
from unittest import mock

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiofabric import QPInfo, open_nic
from aiofabric.hw.verbs import PATH_MTU_CODES, PSN_MASK, QPState, psn_count
from aiofabric.hw.wqe import SGE, SQ_RDMA_HEADER, SQ_SLOT, SQ_WQE_HEADER_SLOTS
from aiofabric.sim import codec, datapath, rcfw, wqeblock, writeruns
from aiofabric.sim import packets as pk
from aiofabric.sim.icrc import icrc
from aiofabric.sim.native import address
from aiofabric.sim.packets import Op
from tests.emulator.test_forged_packets import reachable
from tests.emulator.test_native import MEMORY, DrawnKeys, differences, run_script, twins
from tests.support.emulator import MASK, READ, WRITE, Host, fill
from tests.support.nics import tag
from tests.support.twin import Endpoint, TwinWire, core

A, B = "127.0.0.121", "127.0.0.122"  # the endpoint's address, and the sender's
FIXTURE = HealthCheck.function_scoped_fixture


@pytest.fixture
def endpoint():
    end = Endpoint(A)
    yield end
    end.close()


# -- received datagrams ------------------------------------------------------------------------------------------------
def sealed(body: bytes) -> bytes:
    """`body` with the ICRC a sender at B would have put on it: whatever the headers say, it passes that check."""
    header = codec.encode_ipv4_header(pk.Packet(0, 0, 0, src_ip=B, dst_ip=A, src_port=pk.ROCE_PORT), len(body) + 4)
    return body + icrc(header + body)


def python_verdict(data: bytes) -> tuple[str, pk.Packet | None]:
    try:
        return "", codec.decode(data, B, A, pk.ROCE_PORT)
    except codec.BadPacket as exc:
        return f"dropped_{exc.reason}", None


def same_verdicts(endpoint: Endpoint, bodies: list[bytes]) -> None:
    endpoint.counters.clear()
    arriving = [(sealed(body), B, pk.ROCE_PORT) for body in bodies]
    batch = endpoint.staged(arriving)
    expected = [python_verdict(data) for data, _, _ in arriving]
    as_bytes = [dataclasses.replace(p, payload=bytes(p.payload)) for p in batch.packets()]
    assert as_bytes == [dataclasses.replace(p, payload=bytes(p.payload)) for _, p in expected if p is not None]
    drops = [reason for reason, _ in expected if reason]
    for reason in set(drops):
        assert endpoint.counters[reason] == drops.count(reason), reason
    assert endpoint.counters["received"] == len(bodies) - len(drops)


# Every opcode a header-size's worth around what it needs: an extension header cut anywhere, a pad count larger than
# the payload, a payload not a multiple of 4, opcodes outside the table, any version bits.
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[FIXTURE])
@given(bodies=st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255), st.binary(min_size=10, max_size=60)),
                       min_size=1, max_size=20))
def test_a_good_icrc_over_any_header_gets_the_codecs_verdict(endpoint, bodies):
    same_verdicts(endpoint, [bytes((opcode, flags)) + rest for opcode, flags, rest in bodies])


def test_cut_extension_headers_and_oversized_pads_are_dropped_for_their_length(endpoint):
    bth = bytes(10)  # after opcode and flags
    bodies = [bytes((Op.RDMA_WRITE_ONLY, 0)) + bth,  # the RETH missing altogether
              bytes((Op.RDMA_WRITE_ONLY, 0)) + bth + bytes(15),  # one byte short of it
              bytes((Op.COMPARE_SWAP, 0)) + bth + bytes(27),  # the AtomicETH one byte short
              bytes((Op.ACKNOWLEDGE, 0)) + bth + bytes(3),  # the AETH cut
              bytes((Op.ATOMIC_ACKNOWLEDGE, 0)) + bth + bytes(11),  # the AtomicAckETH cut
              bytes((Op.SEND_ONLY, 0x30)) + bth,  # PadCnt 3 and no payload at all
              bytes((Op.SEND_ONLY, 0x30)) + bth + b"ab",  # PadCnt 3 over 2 bytes
              bytes((Op.RDMA_WRITE_ONLY, 0x20)) + bth + bytes(16) + b"x"]  # a payload plus pad not 4-aligned
    same_verdicts(endpoint, bodies)
    assert endpoint.counters["dropped_length"] == len(bodies)


# -- WRITE runs placed by the core -------------------------------------------------------------------------------------
REGION = 8192


def placed(native_path: bool, forged: list[dict]) -> dict:
    """Host b's memory, stats and answers after the packets `forged` describes (RETH and payload fields over a WRITE
    to b's region) arrive from its peer in one batch: through the core's WRITE runs or the Python responder."""
    (a, b, wire), _ = twins(1024, 0x100, True, {}, 3)
    with mock.patch.object(rcfw, "secrets", DrawnKeys(3)):
        dst, rkey = b.register(REGION)
    fill(b, dst, REGION, 5)
    packets = []
    for i, fields in enumerate([only(0, 4), *forged]):  # the first starts the responder: the core takes runs after
        fields = dict(fields)
        offset, va = fields.pop("addr", 0), fields.pop("va", None)
        va = (dst + offset) % (1 << 64) if va is None else va
        packets.append(pk.Packet(fields.pop("opcode"), b.qpn, (0x100 + i) & PSN_MASK, True, remote_addr=va,
                                 rkey=fields.pop("rkey", rkey), src_ip=a.ip, dst_ip=b.ip, src_port=pk.ROCE_PORT,
                                 **fields))
    datagrams = [(codec.encode(p), a.ip, pk.ROCE_PORT) for p in packets]
    endpoint, taken = Endpoint(b.ip), []

    def counted_run(*args):  # how many datagrams each WRITE run the core placed took
        end = writeruns.place_run(*args)
        taken.append(end - args[3])
        return end

    try:
        if native_path:
            with mock.patch.object(datapath, "place_run", counted_run):
                b.dp.receive_arrivals(endpoint.staged(datagrams), 0.0)
        else:
            b.dp.receive([codec.decode(data, a.ip, b.ip, port) for data, _, port in datagrams], 0.0)
    finally:
        endpoint.close()
    answers = [(p.opcode, p.psn, p.syndrome) for p in pk.expand(b.dp.take_outbox())]
    wire.close()
    return {"memory": hashlib.sha256(b.mem.buffer).hexdigest(), "stats": dict(b.dp.stats), "answers": answers,
            "state": b.dp.describe(), "placed": b.dp.placed_report(), "taken": taken}


def only(addr: int, length: int, size: int | None = None, **fields) -> dict:
    """A WRITE ONLY to the region's byte `addr` (or the absolute `va` in fields) of `length` bytes, `size` sent."""
    payload = memoryview(bytearray(b"\xee" * (length if size is None else size)))
    return dict(opcode=Op.RDMA_WRITE_ONLY, addr=addr, dma_length=length, payload=payload, **fields)


def first(addr: int, length: int, **fields) -> dict:
    return dict(opcode=Op.RDMA_WRITE_FIRST, addr=addr, dma_length=length, payload=memoryview(b"\xee" * 1024),
                **fields)


MIDDLE = {"opcode": Op.RDMA_WRITE_MIDDLE, "payload": memoryview(b"\xdd" * 1024)}


def last(size: int) -> dict:
    return {"opcode": Op.RDMA_WRITE_LAST, "payload": memoryview(b"\xcc" * size)}


HOSTILE_RUNS = {
    "ends exactly at the region's end": [only(REGION - 100, 100), only(0, 4)],
    "one byte past its end": [only(REGION - 99, 100), only(0, 4)],
    "va + length wraps": [only(0, 0x2000, 100, va=(1 << 64) - 0x1000), only(0, 4)],
    "va + length wraps to the region": [first(0, 0x2000, va=(1 << 64) - 0x400), last(0), only(0, 4)],
    "va below the region": [only(-4, 4), only(0, 4)],
    "length 0 with a bad rkey": [only(1 << 40, 0, rkey=0x1234), only(0, 4)],
    "length 0 with a payload": [only(0, 0, 8), only(0, 4)],
    "payload past the path MTU": [only(0, 2048), only(0, 4)],
    "payload shorter than the RETH's length": [only(0, 100, 96), only(0, 4)],
    "a LAST past the RETH's length": [first(0, 2000), last(1000), only(0, 4)],
    "a MIDDLE where the message ends": [first(0, 2048), MIDDLE, last(0)],
    "a message longer than the region": [first(REGION - 1024, 4096), MIDDLE, MIDDLE, last(1024)],
    "a LAST with nothing begun": [last(4), only(0, 4)],
}


@pytest.mark.parametrize("forged", HOSTILE_RUNS.values(), ids=HOSTILE_RUNS.keys())
def test_a_hostile_write_run_lands_and_is_answered_as_the_python_responder_does(forged):
    got, expected = placed(True, forged), placed(False, forged)
    assert got.pop("taken")[1:] and not expected.pop("taken")  # the core was asked to place the run from its head
    found = differences(got, expected)
    assert not found, found


def test_the_core_places_a_write_ending_on_the_regions_last_byte_itself():
    """The boundary the core must take, not leave to Python: length exactly up to the region's end."""
    assert placed(True, HOSTILE_RUNS["ends exactly at the region's end"])["taken"] == [0, 2]
    assert placed(True, HOSTILE_RUNS["one byte past its end"])["taken"][:2] == [0, 0]


# -- messages sent at another path MTU than their packets were counted at ----------------------------------------------
def test_a_segments_at_a_larger_mtu_than_its_count_reads_nothing_past_its_bytes(endpoint):
    """A WRITE fetched at MTU 256 (16 packets of 4096 bytes), sent after MODIFY_QP raised the path MTU to 4096: packet
    1 onwards start past the message's bytes. The codec's packets slice what is there (nothing); the core must not
    read past the buffer to fill them."""
    data = memoryview(bytearray(b"\xab" * 4096))
    items = [pk.Segments((Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST, Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_ONLY), 5, 0,
                         16, 4096, data, 4096, 0x1000, 7, 0, False, start, 16 - start, 0, 0xFFFF, dst_ip=B)
             for start in (0, 3)]
    expected = []
    for item in items:
        for p in pk.expand([dataclasses.replace(item)]):
            p.src_ip, p.src_port, p.dst_port, p.ip_id = A, pk.ROCE_PORT, pk.ROCE_PORT, 0
            expected.append((codec.encode(p), p.dst_ip))
    assert endpoint.encoded(items) == expected


def test_a_segments_of_more_than_64_packets_asks_for_acks_only_where_its_bits_say(endpoint):
    """`acks` has a bit for each of the first 64 packets: past those none asks for an ACK (no shift by 64 or more,
    which C leaves undefined and x86 takes modulo 64)."""
    data = memoryview(bytearray(range(256)) * 100)
    item = pk.Segments((Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST, Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_ONLY), 5, 0, 100,
                       256, data, len(data), 0x1000, 7, 0, False, 0, 100, 1, 0xFFFF, dst_ip=B)
    expected = []
    for p in pk.expand([dataclasses.replace(item)]):
        p.src_ip, p.src_port, p.dst_port, p.ip_id = A, pk.ROCE_PORT, pk.ROCE_PORT, 0
        expected.append((codec.encode(p), p.dst_ip))
    got = endpoint.encoded([item])
    assert [codec.decode(wire, A, B, pk.ROCE_PORT).ack_req for wire, _ in got] == [True] + [False] * 99
    assert got == expected


def test_a_burst_at_a_larger_mtu_than_its_rows_reads_nothing_past_their_bytes(endpoint):
    """The same for a WQE block's rows: a 4096-byte WRITE counted as 16 packets, sent at MTU 4096."""
    core().sq_format(wqeblock.sq_format())
    memory = bytearray(b"\xab" * 4096)
    region = types.SimpleNamespace(whole=memoryview(memory), va=0x10000)
    rows = bytearray(wqeblock.ROW.pack(1, address(memory), 0x2000, 0x10000, 0, 4096, 7, 0, 0, 16, 4096, WRITE, 1, 0,
                                       0, 0))

    def burst() -> wqeblock.Burst:
        return wqeblock.Burst(rows, [region], 0, 16, 0, 64, 4096, (5, 0xFFFF, A, B, pk.ROCE_PORT, 0, 64))

    expected = []
    for p in burst().packets():
        p.src_ip, p.src_port, p.dst_port, p.ip_id = A, pk.ROCE_PORT, pk.ROCE_PORT, 0
        expected.append((codec.encode(p), p.dst_ip))
    assert endpoint.encoded([burst()]) == expected


def test_raising_the_path_mtu_after_a_fetch_sends_what_the_python_path_sends():
    """The path MTU raised (256 -> 4096) between the doorbell that fetched a WRITE and the turn that sends it: the
    compiled path (a WQE block's burst) must put on the wire what the Python requester does. (The firmware refuses
    a path MTU after RTR, as Linux does: the QP's state is changed below it, as a firmware bug would.)"""
    results = []
    for a, b, wire in twins(256, 0x100, True, {}, 9):
        with mock.patch.object(rcfw, "secrets", DrawnKeys(9)):
            src, lkey = a.register(3 * 4096)  # the message's bytes, then more of the region a read past would find
            dst, rkey = b.register(4096)
        fill(a, src, 3 * 4096, 9)
        a.post(WRITE, [(src, lkey, 4096)], remote=dst, rkey=rkey)
        a.dp.doorbells(0.0)
        a.fw.rcfw.qps[a.qpn].path_mtu = 4096
        wire.run(max_time=60)
        wire.close()
        results.append({"datagrams": [hashlib.sha256(data).hexdigest() for data, _ in wire.datagrams],
                        "memory": hashlib.sha256(b.mem.buffer).hexdigest(), "cqes": (a.poll(), b.poll()),
                        "stats": (dict(a.dp.stats), dict(b.dp.stats))})
    found = differences(*results)
    assert not found, found


# -- WQEs off the ring -------------------------------------------------------------------------------------------------
RING, KEY, VA = 8, 0x1234, 0x7000_0000_0000  # the ring's slots; the local region's key and VA


def parse_one(wqe: bytes, at: int = 0, region_size: int = 1 << 33, mtu: int = 4096,
              published: int = SQ_WQE_HEADER_SLOTS + 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The core's fetch of `wqe` (written at ring slot `at`, each slot wrapping on its own, `published` slots
    published) from a ring of RING slots in one piece, the region KEY at VA known (its bytes are never read while
    parsing: any address but 0 does): (the fetch's fields after it, the row)."""
    c = core()
    c.sq_format(wqeblock.sq_format())
    ring = bytearray(RING * SQ_SLOT)
    for i in range(len(wqe) // SQ_SLOT):
        slot = (at + i) % RING * SQ_SLOT
        ring[slot:slot + SQ_SLOT] = wqe[i * SQ_SLOT:(i + 1) * SQ_SLOT]
    pages = array.array("Q", [address(ring)])
    rows = bytearray(wqeblock.ROW.size)
    parse = bytearray(wqeblock.SQ_FIXED.size + wqeblock.SQ_FETCH.size)
    wqeblock.SQ_FIXED.pack_into(parse, 0, pages.buffer_info()[0], (1 << 62) - 1, 62, RING, 1, 8, False)
    wqeblock.SQ_FETCH.pack_into(parse, wqeblock.SQ_FIXED.size, at, at + published, 0, 5, mtu, KEY, VA, region_size,
                                1, 0, address(rows), 1, 0, 0)
    c.sq_parse(address(parse))
    return wqeblock.SQ_FETCH.unpack_from(parse, wqeblock.SQ_FIXED.size), wqeblock.ROW.unpack(rows)


def write_wqe(length: int, va: int = VA, sge_size: int | None = None, key: int = KEY, flags: int = 0,
              size: int = SQ_WQE_HEADER_SLOTS + 1, kind: int = WRITE) -> bytes:
    return SQ_RDMA_HEADER.pack(kind, flags, size, 0, length, 0x2000, 7, 0) + SGE.pack(
        va, key, length if sge_size is None else sge_size)


def test_a_wqe_of_almost_4_gib_takes_the_packets_psn_count_says():
    """length + MTU - 1 overflows 32 bits for a WRITE of 2^32 - 1 bytes: the core must count its packets as the
    Python fetch does (psn_count), not as 0 (which would send none and retire it at once)."""
    length = (1 << 32) - 1
    fetched, row = parse_one(write_wqe(length))
    assert (fetched[-2], fetched[-1]) == (1, wqeblock.FETCHED_ALL)
    assert (row[5], row[9], row[10]) == (length, psn_count(length, 4096), length)
    assert fetched[3] == (5 + psn_count(length, 4096)) & PSN_MASK


def test_a_wqe_whose_sge_ends_on_the_regions_last_byte_is_the_cores_and_one_across_the_rings_end_too():
    for at in (0, RING - 1, RING - 2):  # header and SGE in a row, or wrapping round the ring after any slot
        fetched, row = parse_one(write_wqe(1000, VA + 4096 - 1000), at, region_size=4096)
        assert (fetched[-2], fetched[-1]) == (1, wqeblock.FETCHED_ALL), at
        assert (row[1], row[3], row[4], row[5], row[9]) == (1 + 4096 - 1000, VA + 4096 - 1000, at, 1000, 1)


HOSTILE_WQES = {  # each left to the Python fetch, which fails it or takes it its own way
    "SGE one byte past the region": write_wqe(1000, VA + 4096 - 999),
    "SGE va + size wraps": write_wqe(0x2000, (1 << 64) - 0x1000),
    "SGE below the region": write_wqe(8, VA - 4),
    "SGE size past 2^32 of region": write_wqe(8, VA + 4095, sge_size=0xFFFF_FFFF),
    "length past its SGE": write_wqe(100, sge_size=99),
    "length with an empty SGE": write_wqe(100, sge_size=0),
    "inline": write_wqe(100, flags=wqeblock.INLINE),
    "size 2 slots": write_wqe(100, size=2),
    "size 4 slots": write_wqe(100, size=4),
    "size 255 slots": write_wqe(100, size=255),
    "size 0": write_wqe(100, size=0),
    "an unknown type": write_wqe(100, kind=0x7F),
    "a READ": write_wqe(100, kind=READ),
}


@pytest.mark.parametrize("wqe", HOSTILE_WQES.values(), ids=HOSTILE_WQES.keys())
def test_a_hostile_wqe_is_left_to_the_python_fetch(wqe):
    for at in (0, RING - 1):
        fetched, _ = parse_one(wqe, at, region_size=4096)
        assert (fetched[0], fetched[2], fetched[3], fetched[-2], fetched[-1]) == (at, 0, 5, 0, wqeblock.OTHER_WQE)


def test_a_wqe_larger_than_what_was_published_waits():
    """A one-SGE WQE of which only its header's two slots are published is not read past them."""
    fetched, _ = parse_one(write_wqe(100), published=2)
    assert (fetched[0], fetched[-2], fetched[-1]) == (0, 0, wqeblock.OTHER_WQE)


def test_a_wqe_naming_another_key_is_left_for_its_region_to_be_learned():
    fetched, _ = parse_one(write_wqe(100, key=KEY + 1))
    assert (fetched[0], fetched[-2], fetched[-1]) == (0, 0, wqeblock.OTHER_REGION)


# -- over UDP, to a real emulated NIC ---------------------------------------------------------------------------------
def peer_socket(*taken: str) -> socket.socket:
    """A UDP socket on a free 127.0.0.x:4791: the address a QP of the NIC is connected to, so it takes our packets."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for x in range(254, 1, -1):
        if f"127.0.0.{x}" not in taken:
            try:
                sock.bind((f"127.0.0.{x}", pk.ROCE_PORT))
                return sock
            except OSError:
                continue
    sock.close()
    pytest.skip("no 127.0.0.x with UDP 4791 free")


@pytest.mark.anyio
@pytest.mark.loop_agnostic  # the peer's socket is plain blocking I/O in a thread
async def test_a_peer_writing_up_to_its_regions_end_then_wrapping_past_it_lands_only_the_first():
    """Back to back from the QP's own peer: a WRITE (FIRST + LAST) ending exactly at the region's last byte, then a
    FIRST whose va + length wraps around 2^64. The first lands whole, the second is NAKed (remote access) and touches
    nothing, whichever of the core's WRITE runs or the Python responder takes them."""
    async with open_nic(f"sim:hx{tag()}", fw_latency_us=0) as nic:
        reachable(nic)
        sock = peer_socket(nic.ip)
        try:
            peer = sock.getsockname()[0]
            cq = await nic.create_cq(depth=64)
            qp = await nic.create_qp(cq, sq_depth=16, rq_depth=16)
            await qp.connect(QPInfo(0x99, bytes(10) + b"\xff\xff" + socket.inet_aton(peer), "02:00:00:00:00:09",
                                    0x100), mtu=1024)
            mr = await nic.register_mr(8192)
            mr.view[:8192] = b"\x5a" * 8192
            region = mr.remote()
            base = {"src_ip": peer, "dst_ip": nic.ip, "src_port": pk.ROCE_PORT, "rkey": region.rkey}
            forged = [pk.Packet(Op.RDMA_WRITE_FIRST, qp.qpn, 0x100, remote_addr=region.addr + 8192 - 2048,
                                dma_length=2048, payload=b"\x11" * 1024, **base),
                      pk.Packet(Op.RDMA_WRITE_LAST, qp.qpn, 0x101, True, payload=b"\x22" * 1024, **base),
                      pk.Packet(Op.RDMA_WRITE_FIRST, qp.qpn, 0x102, True, remote_addr=(1 << 64) - 0x400,
                                dma_length=0x2000, payload=b"\xee" * 1024, **base)]
            await nic.wait_for_link()  # packets that arrive before it is up are dropped (a real peer would retry)
            for p in forged:
                sock.sendto(codec.encode(p), (nic.ip, pk.ROCE_PORT))
            sock.settimeout(10)
            answers = []
            while not answers or answers[-1].syndrome >> 5 != 3:  # any ACK, until the NAK
                data, (ip, port) = await anyio.to_thread.run_sync(sock.recvfrom, 4096)
                answers.append(codec.decode(data, ip, peer, port))
            assert (answers[-1].psn, answers[-1].syndrome) == (0x102, pk.NAK_REMOTE_ACCESS)
            assert bytes(mr.view[:8192]) == b"\x5a" * 6144 + b"\x11" * 1024 + b"\x22" * 1024
            assert nic.pci.process.poll() is None
            assert nic.pci.debug({"op": "stats"})["stats"].get("internal_errors", 0) == 0
        finally:
            sock.close()


# -- a small ring, so that WQEs straddle its end -----------------------------------------------------------------------
@pytest.mark.parametrize("variable", [True, False], ids=["variable", "static"])
def test_wqes_across_the_rings_end_are_fetched_as_the_python_path_fetches_them(variable):
    """64 slots: 21 three-slot WQEs (or 8 static ones) fill it, so 30 WRITEs go round it more than once, and WQE
    blocks read headers and SGEs on both sides of its end."""
    operations = [("write", 100 + 300 * i, i % 3 == 0, True) for i in range(30)]
    results, fetched = [], []
    fetch = wqeblock.WqeBlock.fetch

    def counted_fetch(block, psns, produced):  # what the blocks took: (slot it started at, all of it)
        start = block.sq.fetched_slots
        took_all = fetch(block, psns, produced)
        fetched.append((start % 64, took_all))
        return took_all

    for native_path in (True, False):
        a, b = (Host(ip, memory=MEMORY) for ip in (A, B))
        for host in (a, b):
            host.create_qp(host.create_cq(4096), sq_slots=64, variable=variable)
        wire = TwinWire(a, b, native=native_path, seed=4)
        a.connect(b, mtu=1024, sq_psn=0x100, rq_psn=0x200)
        b.connect(a, mtu=1024, sq_psn=0x200, rq_psn=0x100)
        with mock.patch.object(wqeblock.WqeBlock, "fetch", counted_fetch):
            results.append(run_script(a, b, wire, operations, 4))
    found = differences(*results)
    assert not found, found
    assert [cqe[1] for cqe in results[0]["cqes"][0]] == [0] * 11  # the signaled WRITEs all done
    # the core's blocks took every WQE, round the ring's end too (none left to the Python fetch)
    assert fetched and all(took_all for _, took_all in fetched)
