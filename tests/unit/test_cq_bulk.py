"""A CQ poll retires what it finds in bulk (aiofabric/verbs/cq.py, hw/ring.py's RingEntry.new_entries): every new CQE's
valid bit read at once, across the ring's end and the lap's phase bit, at most the budget, stopping at the first
entry not written yet; their work requests completed in order; one doorbell naming the new consumer."""
import pytest

from aiofabric.autogen import bnxt
from aiofabric.errors import CompletionError
from aiofabric.hw import doorbell, ring
from aiofabric.hw.cqe import CQ_ENTRY, CQE_REQ, CQE_RES_RC
from aiofabric.verbs.cq import CompletionQueue
from tests.support.bare_qp import Poller, bare_qp, region, run

REQ, RES_RC = bnxt.CQ_BASE_CQE_TYPE_REQ, bnxt.CQ_BASE_CQE_TYPE_RES_RC
REMOTE_ACCESS = bnxt.CQ_REQ_STATUS_REMOTE_ACCESS_ERR


def publish(view: memoryview, cqe: bytes, count: int, depth: int) -> None:
    """Write the CQE at free-running `count` as the NIC does (valid bit of its lap, that byte last)."""
    offset = count % depth * CQ_ENTRY.size
    CQ_ENTRY.publish(view[offset:offset + CQ_ENTRY.size], cqe, count, depth)


@pytest.mark.parametrize("depth", [8, 64, 1024])
@pytest.mark.parametrize("start", [0, 5, 7, 60, 64 + 61, 2048 + 1000])  # laps 0, 1 and later
@pytest.mark.parametrize("written", [0, 1, 8, 17, 63, 64, 200, 1024])
@pytest.mark.parametrize("limit", [6, 512])
def test_new_entries_counts_the_entries_written_on_their_lap(depth, start, written, limit):
    """`written` entries from `start` on carry their lap's valid bit; the one after them still the last lap's."""
    written = min(written, depth)
    view = memoryview(bytearray(depth * CQ_ENTRY.size))
    for count in range(start - depth, start + written):  # the lap before: entries already consumed
        if count >= 0:
            publish(view, bytes(CQ_ENTRY.size), count, depth)
    assert CQ_ENTRY.new_entries(view, start, depth, limit) == min(written, limit)
    assert all(CQ_ENTRY.is_new(view, c % depth * CQ_ENTRY.size, c, depth) for c in range(start, start + written))


def test_new_entries_stops_at_a_hole():
    """Entries after one not written yet are not counted, whatever their bit says (each entry's own bit is read)."""
    depth = 64
    view = memoryview(bytearray(depth * CQ_ENTRY.size))
    for count in [*range(60), 60, 61, 62, 63, 65, 66]:  # 64 (slot 0, lap 1) is missing: slot 0 holds lap 0's
        publish(view, bytes(CQ_ENTRY.size), count, depth)
    assert CQ_ENTRY.new_entries(view, 60, depth, 512) == 4


class Cq:
    """A CQ on a bare device, a QP whose send and receive completions land in it, regions to post with."""

    def __init__(self, depth: int) -> None:
        self.qp = qp = bare_qp("thor2", sq_depth=256)
        self.cq = cq = CompletionQueue(qp.device, Poller(), depth)  # type: ignore[arg-type]
        cq.id = 0x33
        qp.send_cq = qp.recv_cq = cq
        cq.qps[qp.handle] = qp
        self.local, self.remote = region(qp), region(qp, key=0x99)
        self.produced = 0

    def requester(self, status: int = 0) -> None:
        """The NIC's CQE for every WQE posted so far (a failed one's names the slot the last WQE starts at)."""
        sq = self.qp.send_queue
        index = sq.posted % sq.geometry.size if not status else (sq.producer - 3) % sq.slots
        self.publish(CQE_REQ.pack(self.qp.handle, index, REQ, status))

    def responder(self, length: int, imm: int | None) -> None:
        flags = bnxt.CQ_RES_RC_FLAGS_IMM if imm is not None else 0
        tag = (self.qp.recv_queue.producer - len(self.qp.recv_queue.pending)) & bnxt.CQ_RES_RC_SRQ_OR_RQ_WR_ID_MASK
        self.publish(CQE_RES_RC.pack(length, imm or 0, self.qp.handle, 0, RES_RC, 0, flags, tag))

    def publish(self, cqe: bytes) -> None:
        publish(self.cq.ring.view, cqe, self.produced, self.cq.depth)
        self.produced += 1

    def write(self, count: int = 1) -> list:
        """Signaled writes; their completions."""
        return [run(self.qp.post_write(self.local, self.remote, 64)) for _ in range(count)]

    def doorbells(self) -> list[tuple[int, int]]:
        """(index, epoch) of every CQ consumer doorbell rung."""
        return [doorbell.decode(v)[2:4] for v in self.qp.device.doorbells.written
                if doorbell.decode(v)[1] == bnxt.DBC_DBC_TYPE_CQ]


@pytest.mark.parametrize("depth, before, count", [(64, 0, 40), (64, 50, 40), (64, 63, 64), (1024, 1000, 300),
                                                  (1024, 1024 + 1020, 100)])
def test_one_poll_retires_every_new_cqe_across_the_ring_s_end(depth, before, count):
    """`before` CQEs consumed earlier put the consumer near the ring's end (or on a later lap); `count` new ones wrap
    it: one poll completes every work request in order and rings one doorbell naming the new consumer."""
    cq = Cq(depth)
    for _ in range(before):  # earlier CQEs, each consumed by its own poll
        cq.write()
        cq.requester()
        assert cq.cq.poll() == 1
    rung = len(cq.doorbells())
    done = []
    for _ in range(count):
        done += cq.write(1)
        cq.requester()
    assert not any(c.done for c in done)
    assert cq.cq.poll() == count
    assert all(c.done and c.error is None for c in done)
    assert cq.cq.ring.consumer == before + count and cq.qp.send_queue.outstanding == 0
    assert cq.doorbells()[rung:] == [ring.position(before + count, depth)]
    assert cq.cq.poll() == 0 and len(cq.doorbells()) == rung + 1  # nothing new: nothing rung


def test_a_poll_takes_its_budget_and_the_next_one_the_rest():
    cq = Cq(64)
    done = cq.write(10)
    for i in range(10):  # a CQE per write, in order
        cq.publish(CQE_REQ.pack(cq.qp.handle, i + 1, REQ, 0))
    assert cq.cq.poll(budget=4) == 4
    assert [c.done for c in done] == [True] * 4 + [False] * 6
    assert cq.cq.poll(budget=0) == 0
    assert cq.cq.poll() == 6 and all(c.done for c in done)
    assert cq.doorbells() == [(4, 0), (10, 0)]


def test_requester_and_responder_cqes_are_handed_out_in_order_and_a_failure_flushes_the_rest():
    cq = Cq(16)
    receives = [run(cq.qp.post_recv(cq.local, 128)) for _ in range(3)]
    first = cq.write(2)
    cq.requester()
    cq.responder(100, 0xABCD)
    cq.responder(0, None)
    failed = cq.write(1)
    cq.requester(REMOTE_ACCESS)
    cq.responder(5, 7)  # after the failure: the QP is in error, its receive was flushed already
    assert cq.cq.poll() == 5
    assert all(c.done and c.error is None for c in first)
    assert [(r.byte_len, r.imm) for r in receives[:2]] == [(100, 0xABCD), (0, None)]
    assert isinstance(failed[0].error, CompletionError) and "REMOTE_ACCESS_ERR" in str(failed[0].error)
    assert isinstance(receives[2].error, CompletionError) and "FLUSH" in str(receives[2].error)
    assert cq.doorbells() == [(5, 0)]
