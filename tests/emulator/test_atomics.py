"""RDMA atomics (FETCH_AND_ADD, COMPARE_AND_SWAP): the WQE the driver's codec writes, the packets on the wire, the
results against a model, exactly-once execution when packets are lost and duplicated (and that this check fails for
a responder that executes a duplicate again), and what is refused where: bad arguments by the driver before anything
is posted, a misaligned address or missing REMOTE_ATOMIC access by the responder, and an atomic the responding
function may not issue on PCIe (AtomicOp Requester Enable clear, or a path that does not complete AtomicOps).

The protocol tests run the emulator's data path in-process (tests/support/emulator.py's hosts and wire, with the
driver's SendQueueCodec writing the WQEs), so a test can lose one chosen packet or tamper with the responder; the
others go through `open_nic` and the emulator processes."""
import contextlib
import random

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import device
from aiofabric.hw.verbs import PSN_MASK, MRAccess, QPAccess, QPState
from aiofabric.hw.wqe import ATOMIC_SIZE, MSN_ENTRY, SqGeometry, msn_fields
from aiofabric.sim import codec
from aiofabric.sim import packets as pk
from aiofabric.sim.atomics import execute
from aiofabric.sim.pcie import PCIE_PATHS
from aiofabric.sim.responder import Responder
from aiofabric.errors import CompletionError
from aiofabric.pci.atomic_ops import AtomicOps
from aiofabric.verbs.types import ALL_ACCESS, Access
from aiofabric.verbs.workqueue import SIGNAL, SendQueueCodec
from tests.support import emulator
from tests.support.nics import connect, tag

CS, FA = bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_CS, bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_FA
WRITE = bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE
MASK64 = (1 << 64) - 1
ATOMIC_ACCESS = ALL_ACCESS | Access.REMOTE_ATOMIC


def u64(view, offset: int = 0) -> int:
    return int.from_bytes(view[offset:offset + ATOMIC_SIZE], "little")


# -- the WQE -------------------------------------------------------------------------------------------------------
def test_the_codec_writes_sq_atomic_hdr_and_one_sge_taking_one_psn():
    hdr, rdma = bnxt.sq_atomic_hdr, bnxt.sq_rdma_hdr  # a device finds type, flags and size where other WQEs keep them
    assert (hdr.wqe_type.offset, hdr.flags.offset, hdr.reserved16.offset) == (rdma.wqe_type.offset,
                                                                              rdma.flags.offset, rdma.wqe_size.offset)
    geometry = SqGeometry(True, 256, True)
    sq = SendQueueCodec(geometry, memoryview(bytearray(geometry.table_offset + geometry.table_entries
                                                       * MSN_ENTRY.size)), max_unsignaled=8)
    sq.psn = PSN_MASK  # an atomic takes one PSN: the next one wraps to 0
    sq.post(CS, [(0x1000, 7, ATOMIC_SIZE)], ATOMIC_SIZE, 0x2008, 0x55, 0, True, "token", swap=MASK64, compare=3)
    wqe = hdr.from_buffer_copy(sq.view[:32])
    assert (wqe.wqe_type, wqe.flags, sq.view[rdma.wqe_size.offset], wqe.remote_key, wqe.remote_va, wqe.swap_data,
            wqe.cmp_data) == (CS, SIGNAL, 3, 0x55, 0x2008, MASK64, 3)
    sge = bnxt.sq_sge.from_buffer_copy(sq.view[32:48])
    assert (sge.va_or_pa, sge.l_key, sge.size) == (0x1000, 7, ATOMIC_SIZE)
    assert msn_fields(MSN_ENTRY.unpack_from(sq.view, geometry.table_offset)[0]) == (PSN_MASK, 0, 0)
    assert (sq.psn, sq.producer, sq.retire(1, 0)) == (0, 3, ([], "token"))


# -- the protocol, in-process ---------------------------------------------------------------------------------------
class Driver:
    """The driver's send-queue codec writing into an in-process host's SQ, as QueuePair drives it."""

    def __init__(self, host: emulator.Host) -> None:
        geometry = host.geometry
        self.host = host
        self.sq = SendQueueCodec(geometry, host.mem.view(host.sq, geometry.table_offset + geometry.table_entries
                                                         * geometry.table_entry.size), max_unsignaled=1 << 16)
        self.sq.psn, self.sq.mtu = host.psn, host.mtu

    def post(self, kind: int, sge: tuple[int, int, int], remote: int, rkey: int, swap: int = 0,
             compare: int = 0) -> None:
        self.sq.post(kind, [sge], sge[2], remote, rkey, 0, True, None, swap=swap, compare=compare)
        self.host.doorbell(bnxt.DBC_DBC_TYPE_SQ, *self.sq.doorbell())


def atomic_pair(**options):
    """In-process hosts a and b (tests/support/emulator.py) whose QPs take atomics, a's driver, a's 64 KiB region for
    results (address, key) and b's 4 KiB counter region (address, key)."""
    a, b, wire = emulator.pair(sq_slots=1024, **options)
    for host in (a, b):
        host.modify(QPState.RTS, emulator.MASK["ACCESS"], access=emulator.ALL_QP_ACCESS | QPAccess.REMOTE_ATOMIC)
    return (a, b, wire, Driver(a), a.register(1 << 16),
            b.register(4096, emulator.ALL_MR_ACCESS | MRAccess.REMOTE_ATOMIC))


def carry(items: list) -> list[pk.Packet]:
    """Packets through the codec, as the wire carries them."""
    return [codec.decode(codec.encode(p), p.src_ip, p.dst_ip, p.src_port) for p in pk.expand(items)]


def executed(host: emulator.Host) -> int:
    return host.dp.placed_report()[str(host.qpn)]["atomic_messages"]


def statuses(host: emulator.Host) -> list[int]:
    return [cqe[1] for cqe in host.poll()]


def test_atomics_on_the_wire_and_their_results():
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair(sq_psn=PSN_MASK - 1)
    b.mem.write(counter + 8, (MASK64 - 2).to_bytes(8, "little"))
    driver.post(FA, (results, lkey, 8), counter + 8, rkey, swap=5)  # wraps: 2^64 - 3 + 5 = 2
    driver.post(CS, (results + 8, lkey, 8), counter + 8, rkey, swap=7, compare=2)  # a hit: 2 -> 7
    driver.post(CS, (results + 16, lkey, 8), counter + 8, rkey, swap=9, compare=2)  # a miss: stays 7
    wire.run()
    assert statuses(a) == [emulator.REQ_OK] * 3 and statuses(b) == []
    assert [u64(a.mem.read(results + 8 * i, 8)) for i in range(3)] == [MASK64 - 2, 2, 7]
    assert u64(b.mem.read(counter, 16), 8) == 7 and u64(b.mem.read(counter, 8)) == 0
    requests = [p for p in wire.log if p.src_ip == a.ip]
    assert [(p.opcode, p.psn, p.ack_req, p.remote_addr, p.rkey, p.swap_add, p.compare) for p in requests] == [
        (pk.Op.FETCH_ADD, PSN_MASK - 1, True, counter + 8, rkey, 5, 0),
        (pk.Op.COMPARE_SWAP, PSN_MASK, True, counter + 8, rkey, 7, 2),
        (pk.Op.COMPARE_SWAP, 0, True, counter + 8, rkey, 9, 2)]  # one PSN each, wrapping at 2^24
    answers = [p for p in wire.log if p.src_ip == b.ip]
    assert [(p.opcode, p.psn, p.syndrome, p.msn, p.original) for p in answers] == [
        (pk.Op.ATOMIC_ACKNOWLEDGE, PSN_MASK - 1, pk.ACK_UNLIMITED, 1, MASK64 - 2),
        (pk.Op.ATOMIC_ACKNOWLEDGE, PSN_MASK, pk.ACK_UNLIMITED, 2, 2),
        (pk.Op.ATOMIC_ACKNOWLEDGE, 0, pk.ACK_UNLIMITED, 3, 7)]
    assert b.dp.placed_report()[str(b.qpn)] == {**dict.fromkeys(
        ("write_messages", "write_bytes", "send_messages", "send_bytes", "read_messages", "read_bytes"), 0),
        "atomic_messages": 3, "atomic_bytes": 24}


def test_atomics_in_flight_are_limited_by_max_rd_atomic():
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair()  # the hosts connect with max_rd_atomic 4
    for i in range(8):
        driver.post(FA, (results + 8 * i, lkey, 8), counter, rkey, swap=1)
    a.dp.doorbells(0.0)
    a.dp.pump(0.0)
    assert [p.opcode for p in pk.expand(a.dp.take_outbox())] == [pk.Op.FETCH_ADD] * 4
    wire.run()
    assert statuses(a) == [emulator.REQ_OK] * 8 and u64(b.mem.read(counter, 8)) == 8


def test_a_lost_atomic_acknowledge_is_answered_from_the_saved_result():
    """The atomic executed, its answer was lost: the requester's timeout sends it again, and the responder answers
    the duplicate with the value it saved, without adding a second time."""
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair()
    b.mem.write(counter, (40).to_bytes(8, "little"))
    driver.post(FA, (results, lkey, 8), counter, rkey, swap=2)
    a.dp.doorbells(0.0)
    a.dp.pump(0.0)
    b.dp.receive(carry(a.dp.take_outbox()), 0.0)
    assert [p.opcode for p in pk.expand(b.dp.take_outbox())] == [pk.Op.ATOMIC_ACKNOWLEDGE]  # lost
    wire.run()
    assert statuses(a) == [emulator.REQ_OK]
    assert (u64(a.mem.read(results, 8)), u64(b.mem.read(counter, 8))) == (40, 42)
    assert (a.dp.stats["timeouts"], b.dp.stats["atomic_replays"], executed(b)) == (1, 1, 1)


def test_an_ack_past_an_unanswered_atomic_is_an_implied_nak():
    """A later WRITE's ACK arrives, the atomic's answer did not: the atomic was lost (or its answer was), and the
    requester goes back to it at once, without waiting for its timeout."""
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair()
    driver.post(FA, (results, lkey, 8), counter, rkey, swap=3)
    driver.post(WRITE, (results + 64, lkey, 100), counter + 1024, rkey)
    a.dp.doorbells(0.0)
    a.dp.pump(0.0)
    b.dp.receive(carry(a.dp.take_outbox()), 0.0)
    answers = carry(b.dp.take_outbox())
    assert [p.opcode for p in answers] == [pk.Op.ATOMIC_ACKNOWLEDGE, pk.Op.ACKNOWLEDGE]
    a.dp.receive(answers[1:], 0.0)  # the atomic's answer is lost
    assert a.dp.stats["implied_naks"] == 1
    wire.run()
    assert statuses(a) == [emulator.REQ_OK] * 2 and a.dp.stats["timeouts"] == 0
    assert (u64(a.mem.read(results, 8)), u64(b.mem.read(counter, 8)), executed(b)) == (0, 3, 1)
    assert b.mem.read(counter + 1024, 100) == a.mem.read(results + 64, 100)


def test_a_replayed_answer_leaves_the_ack_owed_for_a_later_psn():
    """A duplicate atomic answered from its saved result in the same receive batch as a new WRITE: the WRITE's ACK
    still goes out (a replayed answer names an older PSN, and acknowledges nothing after it)."""
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair()
    driver.post(FA, (results, lkey, 8), counter, rkey, swap=1)
    wire.run()
    driver.post(WRITE, (results + 64, lkey, 100), counter + 1024, rkey)
    a.dp.doorbells(wire.now)
    a.dp.pump(wire.now)
    write = carry(a.dp.take_outbox())
    atomic = carry([p for p in wire.log if p.opcode == pk.Op.FETCH_ADD])
    b.dp.receive(write + atomic, wire.now)
    assert [(p.opcode, p.psn) for p in pk.expand(b.dp.take_outbox())] == [
        (pk.Op.ATOMIC_ACKNOWLEDGE, atomic[0].psn), (pk.Op.ACKNOWLEDGE, write[0].psn)]
    assert executed(b) == 1


def test_a_duplicate_whose_result_was_given_up_is_dropped_not_executed():
    """The responder keeps max_dest_rd_atomic (4 here) results. A duplicate of a later atomic is answered from its
    result; a duplicate of an older one, whose result is gone, is dropped without an answer, as rxe drops it, never
    executed again."""
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair()
    for i in range(6):
        driver.post(FA, (results + 8 * i, lkey, 8), counter, rkey, swap=1 << i)
    wire.run()
    assert statuses(a) == [emulator.REQ_OK] * 6
    requests = [p for p in wire.log if p.opcode == pk.Op.FETCH_ADD]
    b.dp.receive(carry([requests[0]]), wire.now)
    assert b.dp.take_outbox() == [] and b.dp.stats["dropped_atomic_unsaved"] == 1
    b.dp.receive(carry([requests[-1]]), wire.now)
    assert [(p.opcode, p.original) for p in pk.expand(b.dp.take_outbox())] == [(pk.Op.ATOMIC_ACKNOWLEDGE, 31)]
    assert (u64(b.mem.read(counter, 8)), executed(b)) == (63, 6)


def fetch_adds_over_a_faulty_wire(count: int = 60, seed: int = 9) -> tuple[list[str], dict[str, int]]:
    """`count` FETCH_ADDs of distinct addends onto one counter (starting near 2^64, so the sum wraps) over a wire that
    loses, duplicates and reorders packets: what departs from exactly-once execution, and the counters that say the
    faults bit."""
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair(loss=0.05, dup=0.2, reorder=0.1, seed=seed,
                                                                       timeout=3)
    start = MASK64 - 1000
    b.mem.write(counter, start.to_bytes(8, "little"))
    addends = random.Random(seed).sample(range(1, 1 << 20), count)
    for i, add in enumerate(addends):
        driver.post(FA, (results + 8 * i, lkey, 8), counter, rkey, swap=add)
    wire.run(max_time=600)
    originals = [u64(a.mem.read(results + 8 * i, 8)) for i in range(count)]
    problems = model_problems(start, addends, originals, u64(b.mem.read(counter, 8)))
    if statuses(a) != [emulator.REQ_OK] * count:
        problems.append("not every atomic completed")
    if executed(b) != count:
        problems.append(f"the responder executed {executed(b)} atomics for {count} posted")
    faults = {name: stats[name] for stats, name in ((a.dp.stats, "retransmits"), (b.dp.stats, "duplicates"),
                                                    (b.dp.stats, "atomic_replays"))}
    return problems, faults


def model_problems(start: int, addends: list[int], originals: list[int], final: int) -> list[str]:
    """How fetch-adds of `addends` onto `start`, answered `originals` and leaving `final`, depart from some order of
    executing each exactly once: following the chain start -> start + add (mod 2^64) through the originals must use
    every atomic once and end at `final`."""
    by_original = dict(zip(originals, addends))
    if len(by_original) != len(originals):
        return [f"{len(originals) - len(by_original)} originals repeat"]
    value, problems = start, []
    for _ in addends:
        if value not in by_original:
            return [f"no atomic saw {value:#x}: the chain breaks"]
        value = (value + by_original.pop(value)) & MASK64
    if value != final:
        problems.append(f"the counter ends at {final:#x}, the model at {value:#x}")
    return problems


def test_every_atomic_is_executed_once_under_loss_duplication_and_reordering():
    problems, faults = fetch_adds_over_a_faulty_wire()
    assert problems == []
    assert all(faults.values()), faults  # the faults did bite: retransmitted, duplicated, answered from saved results


def test_the_exactly_once_check_sees_a_responder_that_executes_duplicates_again(monkeypatch):
    """Tamper with the responder: a duplicate atomic is executed again (and its new result sent). The check above
    must fail."""
    def execute_again(self: Responder, p: pk.Packet) -> None:
        original = execute(self._atomic_target(p), p.opcode, p.swap_add, p.compare)
        self.port.placed.atomic_messages += 1
        self._atomic_acknowledge(p.psn, original)

    monkeypatch.setattr(Responder, "_duplicate_atomic", execute_again)
    problems, _ = fetch_adds_over_a_faulty_wire()
    assert any(problem.startswith("the responder executed") for problem in problems), problems
    assert any("counter ends at" in problem or "chain breaks" in problem for problem in problems), problems


@pytest.mark.parametrize("case, syndrome, status", [
    ("misaligned", pk.NAK_INVALID_REQUEST, bnxt.CQ_REQ_STATUS_REMOTE_INVALID_REQUEST_ERR),
    ("beyond the region", pk.NAK_REMOTE_ACCESS, bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR),
    ("region without REMOTE_ATOMIC", pk.NAK_REMOTE_ACCESS, bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR),
    ("QP without REMOTE_ATOMIC", pk.NAK_REMOTE_ACCESS, bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR),
    ("ATOMIC_REQ clear", pk.NAK_INVALID_REQUEST, bnxt.CQ_REQ_STATUS_REMOTE_INVALID_REQUEST_ERR),
    ("a path without AtomicOps", pk.NAK_REMOTE_OPERATIONAL, bnxt.CQ_REQ_STATUS_REMOTE_OPERATION_ERR)])
def test_what_the_responder_refuses_is_nakked_and_fails_the_atomic(case, syndrome, status):
    a, b, wire, driver, (results, lkey), (counter, rkey) = atomic_pair()
    b.fw.pcie.atomic_requests = case != "ATOMIC_REQ clear"  # the function may issue no PCIe AtomicOp
    if case == "a path without AtomicOps":  # ATOMIC_REQ set by a driver that did not walk the path
        b.fw.pcie.path = PCIE_PATHS["no-completer"]
    remote = {"misaligned": counter + 4, "beyond the region": counter + 4096}.get(case, counter)
    if case == "region without REMOTE_ATOMIC":
        counter, rkey = b.register(4096)
        remote = counter
    if case == "QP without REMOTE_ATOMIC":
        b.modify(QPState.RTS, emulator.MASK["ACCESS"], access=emulator.ALL_QP_ACCESS)
    driver.post(FA, (results, lkey, 8), remote, rkey, swap=1)
    wire.run()
    assert statuses(a) == [status]
    assert [p.syndrome for p in wire.log if p.src_ip == b.ip] == [syndrome]
    assert u64(b.mem.read(counter, 8)) == 0 and executed(b) == 0
    assert b.fw.rcfw.qps[b.qpn].state == QPState.ERR  # a class C error, as rxe's
    if case == "ATOMIC_REQ clear":
        assert b.fw.last_error == "atomic refused: AtomicOp Requester Enable (DEVCTL2 ATOMIC_REQ) is clear: the " \
                                  "function may issue no PCIe AtomicOp"
    if case == "a path without AtomicOps":
        assert b.fw.last_error.startswith("atomic refused: the PCIe path (no-completer: ")


# -- through the driver and the emulator processes ------------------------------------------------------------------
@contextlib.asynccontextmanager
async def nics(count: int, **options):
    """`count` emulated NICs, each with a CQ."""
    suffix = tag()
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(open_nic(f"sim:{name}{suffix}", **options))
                  for name in "abcdef"[:count]]
        yield [(nic, await nic.create_cq(1024)) for nic in opened]


async def connected(requester, responder, access: Access = ATOMIC_ACCESS):
    """A connected QP pair between two (NIC, CQ)s; the responder's QP has `access`."""
    (nic_a, cq_a), (nic_b, cq_b) = requester, responder
    qa, qb = await nic_a.create_qp(cq_a, sq_depth=256), await nic_b.create_qp(cq_b, sq_depth=64)
    await qb.to_init(access)
    await connect(qa, qb, timeout=14)  # ~67 ms: a loaded 2-core machine never times an ACK out
    return qa, qb


def random_operation(rng: random.Random, value: int) -> tuple[str, int, int]:
    """("add", addend, 0) or ("swap", compare, swap): values near 0 and near 2^64, half the swaps hitting `value`."""
    def near_an_end() -> int:
        return rng.choice([rng.randrange(1 << 8), MASK64 - rng.randrange(1 << 8), rng.getrandbits(64)])
    if rng.random() < 0.5:
        return "add", near_an_end(), 0
    return "swap", value if rng.random() < 0.5 else near_an_end(), near_an_end()


def apply(operation: tuple[str, int, int], value: int) -> int:
    kind, first, second = operation
    if kind == "add":
        return (value + first) & MASK64
    return second if value == first else value


@pytest.mark.anyio
async def test_results_and_memory_follow_a_model():
    """Awaited one by one (the conveniences return the original), then 300 posted at once and awaited after: on one
    QP they execute in order, so every original and the final value are the model's."""
    rng = random.Random(4)
    async with nics(2) as (a, b):
        qa, _ = await connected(a, b)
        results, counter = await a[0].register_mr(1 << 16), await b[0].register_mr(4096, ATOMIC_ACCESS)
        value = MASK64 - 5
        counter.view[:8] = value.to_bytes(8, "little")
        with anyio.fail_after(20):
            for i in range(20):  # locally a region or a raw SGE; remotely the peer's RemoteRegion or its region
                local = results if i % 2 else results.sge(8 * i, 8)
                kind, first, second = operation = random_operation(rng, value)
                if kind == "add":
                    got = await qa.fetch_add(local, counter.remote(), first, local_offset=8 * i if i % 2 else 0)
                else:
                    got = await qa.compare_swap(local, counter, first, second, local_offset=8 * i if i % 2 else 0)
                assert got == value
                value = apply(operation, value)
            operations = [random_operation(rng, value) for _ in range(300)]
            posted = []
            for i, (kind, first, second) in enumerate(operations):
                post = qa.post_fetch_add(results, counter, first, local_offset=8 * i) if kind == "add" else \
                    qa.post_compare_swap(results, counter, first, second, local_offset=8 * i)
                posted.append(await post)
            for completion in posted:
                await completion
        for i, operation in enumerate(operations):
            assert u64(results.view, 8 * i) == value, (i, operation)
            value = apply(operation, value)
        assert u64(counter.view) == value


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_fetch_adds_from_several_qps_and_nics_onto_one_counter_sum_exactly():
    """Two requester NICs, two QPs each, 60 FETCH_ADDs per QP posted at once onto one counter, concurrently: the
    originals returned are all distinct and chain from the start through every addend to the final value."""
    async with nics(3) as (target, *requesters):
        counter = await target[0].register_mr(4096, ATOMIC_ACCESS)
        start = 1 << 40
        counter.view[:8] = start.to_bytes(8, "little")
        flows = []  # (QP, its results region, where its results start)
        for requester in requesters:
            results = await requester[0].register_mr(4096)
            flows += [((await connected(requester, target))[0], results, 2048 * i) for i in range(2)]
        addends = random.Random(5).sample(range(1, 1 << 30), 60 * len(flows))
        shares = [addends[i::len(flows)] for i in range(len(flows))]

        async def run(flow, share: list[int]) -> None:
            qp, results, base = flow
            posted = [await qp.post_fetch_add(results, counter.remote(), add, local_offset=base + 8 * i)
                      for i, add in enumerate(share)]
            for completion in posted:
                await completion

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                for flow, share in zip(flows, shares):
                    group.start_soon(run, flow, share)
        originals = [u64(results.view, base + 8 * i) for (_, results, base), share in zip(flows, shares)
                     for i in range(len(share))]
        assert model_problems(start, [add for share in shares for add in share], originals, u64(counter.view)) == []


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_every_atomic_is_executed_once_across_a_lossy_duplicating_wire():
    """The emulated wire loses and duplicates packets both ways: every FETCH_ADD still applies exactly once (the
    responder's own count of executed atomics says so too) and the originals chain through every addend."""
    async with nics(2, loss=0.05, dup=0.1, seed=12) as (a, b):
        qa, qb = await connected(a, b)
        results, counter = await a[0].register_mr(4096), await b[0].register_mr(4096, ATOMIC_ACCESS)
        addends = random.Random(6).sample(range(1, 1 << 40), 200)
        with anyio.fail_after(30):
            posted = [await qa.post_fetch_add(results, counter, add, local_offset=8 * i)
                      for i, add in enumerate(addends)]
            for completion in posted:
                await completion
        originals = [u64(results.view, 8 * i) for i in range(len(addends))]
        assert model_problems(0, addends, originals, u64(counter.view)) == []
        placed = (await b[0].pci.debug_client().placed())[qb.qpn]
        assert placed.of("atomic") == (200, 8 * 200)
        stats = await b[0].pci.debug_client().stats()
        assert stats["duplicates"] > 0 and stats["wire_lost"] + stats["wire_duplicated"] > 0  # the faults did bite


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_the_responder_refuses_a_misaligned_address_and_missing_atomic_access():
    """Not refused by the driver, as hardware does not: the responder NAKs, and the completion names the status
    (REMOTE_INVALID_REQUEST_ERR for a misaligned address, REMOTE_ACCESS_ERR for a region or a QP without
    REMOTE_ATOMIC). Each fails its QP; the counter is never touched."""
    async with nics(2) as (a, b):
        results = await a[0].register_mr(4096)
        counter, plain = await b[0].register_mr(4096, ATOMIC_ACCESS), await b[0].register_mr(4096)
        cases = [(ATOMIC_ACCESS, counter, 4, "REMOTE_INVALID_REQUEST_ERR"),
                 (ATOMIC_ACCESS, plain, 0, "REMOTE_ACCESS_ERR"),
                 (ALL_ACCESS, counter, 0, "REMOTE_ACCESS_ERR")]
        for access, region, offset, reason in cases:
            qa, _ = await connected(a, b, access)
            with anyio.fail_after(10), pytest.raises(CompletionError) as failed:
                await qa.fetch_add(results, region, 1, remote_offset=offset)
            assert (failed.value.reason, failed.value.status) == (reason, getattr(bnxt, "CQ_REQ_STATUS_" + reason))
            with anyio.fail_after(10), pytest.raises(CompletionError, match="FLUSH"):
                await qa.compare_swap(results, counter, 0, 1)  # the QP is in ERR now
        assert u64(counter.view) == u64(plain.view) == 0


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_bad_arguments_are_refused_before_anything_is_posted():
    async with nics(2) as (a, b):
        qa, _ = await connected(a, b)
        results, counter = await a[0].register_mr(4096), await b[0].register_mr(4096, ATOMIC_ACCESS)
        cases = [
            (qa.post_fetch_add, (results.sge(0, 4), counter, 1), {}, ValueError, "8-byte original value, not 4"),
            (qa.post_fetch_add, (results.sge(0, 16), counter, 1), {}, ValueError, "not 16 bytes"),
            (qa.post_fetch_add, (results, counter, 1), {"local_offset": 4092}, ValueError, "exceed the 4096-byte"),
            (qa.post_fetch_add, ([results.sge(0, 8)], counter, 1), {}, TypeError, "MemoryRegion or a LocalBuffer"),
            (qa.post_fetch_add, (results, counter, -1), {}, ValueError, rf"add must be an integer in \[0, {MASK64}\]"),
            (qa.post_fetch_add, (results, counter, 1 << 64), {}, ValueError, "add must be"),
            (qa.post_fetch_add, (results, counter, 1.0), {}, ValueError, "add must be"),
            (qa.post_compare_swap, (results, counter, 1 << 64, 0), {}, ValueError, "compare must be"),
            (qa.post_compare_swap, (results, counter, 0, -1), {}, ValueError, "swap must be"),
            (qa.post_compare_swap, (results, counter.remote(0, 8), 0, 1), {"remote_offset": 8}, ValueError,
             "exceed the 8-byte remote region")]
        psn = qa.psn
        for verb, args, keywords, error, message in cases:
            with pytest.raises(error, match=message):
                await verb(*args, **keywords)
        assert (qa.send_queue.posted, qa.psn) == (0, psn)  # nothing reached the ring
        with anyio.fail_after(10):
            assert await qa.fetch_add(results.sge(8, 8), counter, 5) == 0  # still usable
        assert u64(results.view, 8) == 0 and u64(counter.view) == 5


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_driver_that_offers_atomics_without_setting_atomic_req_meets_a_nak(monkeypatch):
    """A driver that skips the AtomicOps walk (it offers atomics, ATOMIC_REQ stays clear in DEVCTL2): the responding
    NIC may not issue the PCIe AtomicOp, so it NAKs the request and the counter is never touched."""
    monkeypatch.setattr(device, "determine_atomics", lambda pci, path: AtomicOps(True, "not walked"))
    async with nics(2) as (a, b):
        qa, _ = await connected(a, b)
        results, counter = await a[0].register_mr(4096), await b[0].register_mr(4096, ATOMIC_ACCESS)
        with anyio.fail_after(10), pytest.raises(CompletionError) as failed:
            await qa.fetch_add(results, counter, 1)
        assert failed.value.reason == "REMOTE_INVALID_REQUEST_ERR" and u64(counter.view) == 0
        assert b[0].pci.debug({"op": "stats"})["stats"]["atomics_refused_pcie"] == 1
