"""Large transfers: a READ's responses never outrun the requester, and a 1 GiB message fits an emulated NIC.

The requester asks for a long READ a segment of READ_SEGMENT responses at a time, each segment a READ request of its
own, never more than the window (128 PSNs) ahead of what has arrived: its receive buffer, sized for a window, cannot
overflow however large the READ or however loaded the machine. Sans-IO tests check the requests on the wire (the
in-memory wire of tests/support/emulator.py); end-to-end tests move 128 MiB, and (slow) 1 GiB, between emulator
processes.
"""
import contextlib
import hashlib
import os
import random
import struct
import sys

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.hw.verbs import QPState
from aiofabric.sim import packets as pk
from aiofabric.sim.completer import READ_SEGMENT
from aiofabric.sim.requester import WINDOW
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.perftest import run_bench
from tests.support.backends import on
from tests.support.emulator import MASK, READ, REQ_OK, WRITE, fill, pair
from tests.support.nics import connected_qps

RESPONSES = (pk.Op.RDMA_READ_RESPONSE_FIRST, pk.Op.RDMA_READ_RESPONSE_MIDDLE, pk.Op.RDMA_READ_RESPONSE_LAST,
             pk.Op.RDMA_READ_RESPONSE_ONLY)
FIRST_PSN = 0x1000  # pair()'s sq_psn


def read_requests(wire) -> list[tuple[int, int, int]]:
    """(PSN, VA, DMA length) of every READ request put on the wire."""
    return [(p.psn, p.remote_addr, p.dma_length) for p in wire.log if p.opcode == pk.Op.RDMA_READ_REQUEST]


# -- the requests on the wire (sans-IO) --------------------------------------------------------------------------------
def test_a_long_read_is_asked_for_a_segment_at_a_time_within_the_window():
    a, b, wire = pair(mtu=1024)
    npkts = 9 * READ_SEGMENT + 13
    size = (npkts - 1) * 1024 + 100
    local, lkey = a.register(size)
    remote, rkey = b.register(size)
    data = fill(b, remote, size, 1)
    a.post(READ, [(local, lkey, size)], remote=remote, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and a.mem.read(local, size) == data
    segment = READ_SEGMENT * 1024
    assert read_requests(wire) == [(FIRST_PSN + i * READ_SEGMENT, remote + i * segment,
                                    min(segment, size - i * segment)) for i in range(10)]
    arrived = 0  # on this clean wire every response logged before a request has reached the requester
    for p in wire.log:
        if p.opcode == pk.Op.RDMA_READ_REQUEST:
            assert p.psn + -(-p.dma_length // 1024) - (FIRST_PSN + arrived) <= WINDOW
        elif p.opcode in RESPONSES:
            arrived += 1
    responses = [p for p in wire.log if p.opcode in RESPONSES]
    assert [p.opcode for p in responses[:READ_SEGMENT]] == [pk.Op.RDMA_READ_RESPONSE_FIRST] + \
        [pk.Op.RDMA_READ_RESPONSE_MIDDLE] * (READ_SEGMENT - 2) + [pk.Op.RDMA_READ_RESPONSE_LAST]
    assert [p.psn for p in responses] == list(range(FIRST_PSN, FIRST_PSN + npkts))
    assert responses[-1].msn == 10  # each request is a message of its own to the responder
    assert a.dp.stats["retransmits"] == 0 and a.dp.contexts[a.qpn].requester.reads == 0


def test_each_read_request_holds_an_orrq_entry():
    a, b, wire = pair(mtu=256)
    a.modify(QPState.RTS, MASK["MAX_RD_ATOMIC"], max_rd_atomic=1)
    size = 3 * READ_SEGMENT * 256
    local, lkey = a.register(size)
    remote, rkey = b.register(size)
    data = fill(b, remote, size, 2)
    a.post(READ, [(local, lkey, size)], remote=remote, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and a.mem.read(local, size) == data
    order = [p.opcode for p in wire.log if p.opcode in (pk.Op.RDMA_READ_REQUEST, pk.Op.RDMA_READ_RESPONSE_LAST)]
    assert order == [pk.Op.RDMA_READ_REQUEST, pk.Op.RDMA_READ_RESPONSE_LAST] * 3  # one request in flight at a time


def test_a_lost_response_is_asked_for_again_up_to_its_requests_end():
    """Go-back-N from the gap: the rest of the segment, then the later segments again, each within what the responder
    was asked for before (a duplicate it answers from memory), never a request straddling two."""
    a, b, wire = pair(mtu=1024)
    size = 4 * READ_SEGMENT * 1024
    local, lkey = a.register(size)
    remote, rkey = b.register(size)
    data = fill(b, remote, size, 3)
    lost = FIRST_PSN + READ_SEGMENT + 8
    original = a.dp.receive

    def lose_one_response(packets, now):
        original([p for p in packets if p.psn != lost or p.opcode not in RESPONSES or a.dp.stats["go_backs"]], now)
    a.dp.receive = lose_one_response
    a.post(READ, [(local, lkey, size)], remote=remote, rkey=rkey)
    a.post(WRITE, [(local, lkey, 10)], remote=remote, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK, REQ_OK] and a.mem.read(local, size) == data
    segment = READ_SEGMENT * 1024
    again = [(lost, remote + (READ_SEGMENT + 8) * 1024, segment - 8 * 1024)] + \
        [(FIRST_PSN + i * READ_SEGMENT, remote + i * segment, segment) for i in (2, 3)]
    assert read_requests(wire) == [(FIRST_PSN + i * READ_SEGMENT, remote + i * segment, segment)
                                   for i in range(4)] + again
    assert a.dp.stats["go_backs"] == 1 and a.dp.stats["retransmits"] == 3 and b.dp.stats["duplicates"] == 3
    assert a.dp.stats["dropped_malformed"] == b.dp.stats["dropped_malformed"] == 0
    assert a.dp.contexts[a.qpn].requester.reads == 0


def test_a_lost_read_request_is_nakked_and_asked_for_again_from_its_psn():
    a, b, wire = pair(mtu=1024)
    size = 4 * READ_SEGMENT * 1024
    local, lkey = a.register(size)
    remote, rkey = b.register(size)
    data = fill(b, remote, size, 4)
    lost = FIRST_PSN + READ_SEGMENT
    original = b.dp.receive

    def lose_the_second_request(packets, now):
        original([p for p in packets if p.psn != lost or b.dp.stats["naks"]], now)
    b.dp.receive = lose_the_second_request
    a.post(READ, [(local, lkey, size)], remote=remote, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and a.mem.read(local, size) == data
    naks = [p.psn for p in wire.log if p.opcode == pk.Op.ACKNOWLEDGE and p.syndrome == pk.NAK_PSN_SEQ]
    assert naks == [lost]  # the third request arrived past the lost one: one NAK-sequence naming it
    segment = READ_SEGMENT * 1024
    assert read_requests(wire)[4:] == [(FIRST_PSN + i * READ_SEGMENT, remote + i * segment, segment)
                                       for i in (1, 2, 3)]
    assert a.dp.stats["go_backs"] == 1 and a.dp.stats["timeouts"] == 0 and b.dp.stats["duplicates"] == 0


def test_a_lost_last_response_times_out_and_is_asked_for_alone():
    a, b, wire = pair(mtu=1024)
    size = 2 * READ_SEGMENT * 1024 - 10
    local, lkey = a.register(size)
    remote, rkey = b.register(size)
    data = fill(b, remote, size, 5)
    last = FIRST_PSN + 2 * READ_SEGMENT - 1
    original = a.dp.receive

    def lose_the_last_response(packets, now):
        original([p for p in packets if p.psn != last or a.dp.stats["timeouts"]], now)
    a.dp.receive = lose_the_last_response
    a.post(READ, [(local, lkey, size)], remote=remote, rkey=rkey)
    wire.run()
    assert [c[1] for c in a.poll()] == [REQ_OK] and a.mem.read(local, size) == data
    assert read_requests(wire)[2:] == [(last, remote + (2 * READ_SEGMENT - 1) * 1024, 1024 - 10)]
    assert a.dp.stats["timeouts"] == a.dp.stats["go_backs"] == 1 and b.dp.stats["duplicates"] == 1
    assert [p.opcode for p in wire.log][-1] == pk.Op.RDMA_READ_RESPONSE_ONLY


@pytest.mark.parametrize("seed", range(6))
def test_long_reads_and_writes_arrive_exactly_under_faults(seed):
    a, b, wire = pair(mtu=256, loss=0.03, dup=0.05, reorder=0.2, seed=seed, timeout=3)
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 300 * 256) for _ in range(6)]
    local, lkey = a.register(sum(sizes))
    remote, rkey = b.register(sum(sizes))
    mine, theirs = fill(a, local, sum(sizes), seed), fill(b, remote, sum(sizes), seed + 1)
    expected_local, expected_remote, offset = bytearray(mine), bytearray(theirs), 0
    for i, size in enumerate(sizes):  # READs and WRITEs alternate, each over its own bytes
        if i % 2 == 0:
            a.post(READ, [(local + offset, lkey, size)], remote=remote + offset, rkey=rkey)
            expected_local[offset:offset + size] = theirs[offset:offset + size]
        else:
            a.post(WRITE, [(local + offset, lkey, size)], remote=remote + offset, rkey=rkey)
            expected_remote[offset:offset + size] = mine[offset:offset + size]
        offset += size
    wire.run(max_time=600)
    assert [c[1] for c in a.poll()] == [REQ_OK] * len(sizes), (a.dp.stats, b.dp.stats)
    assert a.mem.read(local, offset) == expected_local and b.mem.read(remote, offset) == expected_remote
    assert a.dp.stats["retransmits"] > 0 and a.dp.contexts[a.qpn].requester.reads == 0


# -- between emulator processes ------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def connected(size: int):
    """Two emulated NICs, one RC QP each (MTU 4096; a 1 s ACK timeout, so a loaded machine causes no spurious
    go-back), and a `size`-byte MR on each: (requester NIC, responder NIC, requester QP, local MR, remote MR)."""
    async with open_nic() as a, open_nic() as b:
        qa, _ = await connected_qps(a, b, 64, mtu=4096, timeout=18)
        yield a, b, qa, await a.register_mr(size), await b.register_mr(size)


def fill_view(view: memoryview, seed: int) -> None:
    rng = random.Random(seed)
    for start in range(0, len(view), 1 << 20):
        view[start:start + (1 << 20)] = rng.randbytes(min(1 << 20, len(view) - start))


def digest(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def assert_clean(*nics) -> None:
    """Nothing was lost or sent twice: no socket overflow, no gap, no go-back."""
    for nic in nics:
        stats = nic.pci.debug({"op": "stats"})["stats"]
        assert {key: stats.get(key, 0) for key in ("rx_overflow", "out_of_sequence", "go_backs", "retransmits")} == \
            dict.fromkeys(("rx_overflow", "out_of_sequence", "go_backs", "retransmits"), 0), stats


@pytest.mark.anyio
async def test_a_128_mib_read_completes_without_overflow():
    size = 128 << 20  # one READ of this size used to overflow the requester's socket and fail after 7 go-backs
    async with connected(size) as (a, b, qa, local, remote):
        fill_view(remote.view, 4)
        with anyio.fail_after(60):
            await qa.read(local, remote, size)
        assert digest(local.view) == digest(remote.view)
        assert_clean(a, b)
        assert a.pci.debug({"op": "placed"})["qps"][str(qa.qpn)]["read_bytes"] == size


@on("asyncio")
@pytest.mark.anyio
async def test_a_long_read_on_the_wire_is_valid_rc_to_scapy(anyio_backend, tmp_path):
    """Captured at the requester and parsed by an independent stack: every ICRC holds, the READ requests' RETHs walk
    the region a segment at a time over contiguous PSNs, and each is answered FIRST, MIDDLE..., LAST with its MSN."""
    roce = pytest.importorskip("scapy.contrib.roce")
    from scapy.all import Raw, raw, rdpcap
    size, segment = 1 << 20, READ_SEGMENT * 4096
    capture = tmp_path / "read.pcap"
    async with open_nic(pcap=str(capture)) as a, open_nic() as b:
        qa, qb = await connected_qps(a, b, 64, mtu=4096)
        local, remote = await a.register_mr(size), await b.register_mr(size)
        fill_view(remote.view, 7)
        with anyio.fail_after(30):
            await qa.read(local, remote, size)
        assert digest(local.view) == digest(remote.view)
        base = remote.remote().addr
    frames = [frame[roce.BTH] for frame in rdpcap(str(capture))]
    for frame in frames:
        again = frame.copy()
        again.icrc = None
        assert raw(again)[-4:] == raw(frame)[-4:], frame.summary()
    requests = [f for f in frames if f.opcode == pk.Op.RDMA_READ_REQUEST]
    psn = requests[0].psn
    for i, request in enumerate(requests):
        va, _, length = struct.unpack("!QII", request[Raw].load[:16])
        assert (request.psn, va, length) == (psn + i * READ_SEGMENT, base + i * segment, segment)
    responses = [f for f in frames if f.opcode in RESPONSES]
    assert [f.psn for f in responses] == list(range(psn, psn + size // 4096))
    for i in range(len(requests)):
        answer = responses[i * READ_SEGMENT:(i + 1) * READ_SEGMENT]
        assert [f.opcode for f in answer] == [pk.Op.RDMA_READ_RESPONSE_FIRST] + \
            [pk.Op.RDMA_READ_RESPONSE_MIDDLE] * (READ_SEGMENT - 2) + [pk.Op.RDMA_READ_RESPONSE_LAST]
        assert int.from_bytes(answer[-1][Raw].load[1:4], "big") == i + 1  # the AETH's MSN: one message per request


@on("asyncio")
@pytest.mark.anyio
async def test_a_read_and_a_write_beside_other_traffic_and_a_cpu_hog(anyio_backend):
    size = 128 << 20
    hog = await anyio.open_process([sys.executable, "-c", "while True: pass"])
    try:
        async with connected(size) as (a, b, qa, local, remote), \
                connected(size) as (c, d, qc, source, target):
            fill_view(remote.view, 5)
            fill_view(source.view, 6)
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(qa.read, local, remote, size)
                    tg.start_soon(qc.write, source, target, size)
            assert digest(local.view) == digest(remote.view) and digest(source.view) == digest(target.view)
            assert_clean(a, b, c, d)
    finally:
        hog.kill()
        await hog.aclose()


# -- a 1 GiB message -----------------------------------------------------------------------------------------------
def resident_shared_memory() -> int:
    """Bytes of shared memory (the DMA arenas' touched pages) this process has resident."""
    with open(f"/proc/{os.getpid()}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssShmem:"))


@on("asyncio")
@pytest.mark.anyio
async def test_a_1_gib_region_fits_beside_the_rings_and_its_memory_is_returned(anyio_backend):
    async with open_nic() as nic:
        cq = await nic.create_cq(256)
        await nic.create_qp(cq, sq_depth=1024, rq_depth=1024)
        before = resident_shared_memory()
        region = await nic.register_mr(1 << 30)
        assert resident_shared_memory() - before >= 1 << 30  # allocated like a pinned MR: every page is there
        await region.deregister()
        assert resident_shared_memory() - before < 16 << 20  # freed pages go back to the host, not at close


def test_bench_takes_a_1_gib_message():
    BenchConfig(test="read", size=1 << 30, iters=1).check()
    with pytest.raises(ValueError, match=r"--size 1073741825: must be in \[1, 1073741824\]"):
        BenchConfig(test="read", size=(1 << 30) + 1, iters=1).check()


@pytest.mark.slow
@pytest.mark.parametrize("test", ["read", "write"])
@on("asyncio")
@pytest.mark.anyio
async def test_a_1_gib_bench_message_is_verified(test, anyio_backend):
    result = await run_bench(BenchConfig(test=test, size=1 << 30, iters=1, timeout=18))
    assert result["verified"] and result["bytes"] == 1 << 30, result
    assert result["rx_overflow"] == result["retransmits"] == 0, result
