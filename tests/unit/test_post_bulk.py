"""post_many against the per-operation path, on a bare QP (tests/support/bare_qp.py: no emulator): the same work
requests leave the same bytes in the send ring and its search table and ring the same doorbells, in every send-queue
mode (Thor2's variable WQEs, Thor's static ones; the MSN table or the PSN search table), at the ring's end, across it,
with the ring full to the last slot; and a full ring makes both wait, not fail."""
import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric.verbs.post import QueuePair
from aiofabric.verbs.sq_runs import LOCAL_WORD, REMOTE_WORD
from tests.support.bare_qp import MODES, bare_qp, complete, doorbells, region, run, sq_bytes

VERBS = ["write", "read", "send", "write_with_imm", "send_imm"]


class Twin:
    """Two QPs alike: `many` posts each batch with one post_many, `one` posts its work requests one at a time inside
    batch() (one doorbell, as post_many rings)."""

    def __init__(self, mode: str, sq_depth: int = 48, psn: int = 0xFFFF00) -> None:
        self.many, self.one = (bare_qp(mode, sq_depth=sq_depth, psn=psn, mtu=256, max_inline_data=64)
                               for _ in range(2))
        self.local = [region(qp, key=0x101) for qp in (self.many, self.one)]
        self.remote = [region(qp, key=0x202) for qp in (self.many, self.one)]
        assert self.local[0].addr == self.local[1].addr  # alike devices: the same addresses

    @property
    def qps(self) -> tuple[QueuePair, QueuePair]:
        return self.many, self.one

    def batch(self, verb: str, size: int, offsets: list[int], remotes: list[int], marks: set[int]) -> None:
        imm = 0x5A5A if verb in ("write_with_imm", "send_imm") else None
        kind = "send" if verb == "send_imm" else verb
        remote = None if kind == "send" else self.remote[0]
        run(self.many.post_many(kind, self.local[0], remote, size, offsets, remote_offsets=remotes, imm=imm,
                                signal=marks))
        one, local, remote = self.one, self.local[1], self.remote[1]
        with one.batch():
            for i, (offset, far) in enumerate(zip(offsets, remotes)):
                signaled = i in marks or i == len(offsets) - 1
                if kind == "send":
                    run(one.post_send(local, size, local_offset=offset, imm=imm, signaled=signaled))
                elif verb == "write_with_imm":
                    run(one.post_write_with_imm(local, remote, imm, size, local_offset=offset, remote_offset=far,
                                                signaled=signaled))
                elif verb == "read":
                    run(one.post_read(local, remote, size, local_offset=offset, remote_offset=far, signaled=signaled))
                else:
                    run(one.post_write(local, remote, size, local_offset=offset, remote_offset=far,
                                       signaled=signaled))

    def single(self, size: int, offset: int, inline: bool, signaled: bool) -> None:
        """The same per-operation write on both (inline or not): WQEs of other sizes between the batches."""
        for qp, local, remote in zip(self.qps, self.local, self.remote):
            run(qp.post_write(local, remote, size, local_offset=offset, remote_offset=offset, signaled=signaled,
                              inline=inline))

    def complete(self) -> None:
        for qp in self.qps:
            complete(qp)

    def assert_same(self) -> None:
        many, one = self.qps
        assert sq_bytes(many) == sq_bytes(one)
        assert doorbells(many) == doorbells(one)
        fields = ("producer", "consumer", "posted", "retired", "psn", "msn", "unsignaled_run")
        assert [getattr(many.send_queue, f) for f in fields] == [getattr(one.send_queue, f) for f in fields]
        assert many.send_cq.outstanding <= one.send_cq.outstanding  # post_many gives fewer completions


def batches(draw, limit: int) -> tuple:
    count = draw(st.integers(1, limit))
    size = draw(st.sampled_from([0, 1, 64, 255, 256, 257, 4000, draw(st.integers(0, 8192))]))
    offsets = draw(st.lists(st.integers(0, 60_000 - size), min_size=count, max_size=count))
    remotes = draw(st.one_of(st.just(offsets), st.lists(st.integers(0, 60_000 - size), min_size=count,
                                                        max_size=count)))
    marks = set(draw(st.lists(st.integers(0, count - 1), max_size=4)))
    return draw(st.sampled_from(VERBS)), size, offsets, remotes, marks


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_post_many_writes_what_the_per_operation_path_writes(mode, data):
    twin = Twin(mode)
    sq = twin.many.send_queue
    limit = min(sq.max_wqes // 2, sq.slots // 2 // sq.taken(3))
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        step = data.draw(st.sampled_from(["batch", "batch", "single", "complete"]))
        if step == "batch":
            verb, size, offsets, remotes, marks = batches(data.draw, limit)
            if not sq.room(sq.taken(sq.wqe_slots(1 if size else 0)) * len(offsets), len(offsets)):
                twin.complete()
            twin.batch(verb, size, offsets, remotes, marks)
        elif step == "single":
            inline = data.draw(st.booleans())
            size = data.draw(st.integers(1, 64 if inline else 5000))
            if not sq.room(sq.taken(sq.wqe_slots(1, size if inline else 0))):
                twin.complete()
            twin.single(size, data.draw(st.integers(0, 4096)), inline, data.draw(st.booleans()))
        else:
            twin.complete()
        twin.assert_same()
    twin.complete()
    twin.assert_same()


def test_the_comparison_sees_a_misplaced_address():
    """The twin test's own check: a post_many that swapped a WQE's local and remote addresses is caught."""
    twin = Twin("thor2")
    twin.batch("write", 64, [0, 64, 128], [4096, 64, 128], set())
    twin.assert_same()
    words = twin.many.sq.view.cast("Q")  # the first WQE's words, from slot 0
    words[REMOTE_WORD], words[LOCAL_WORD] = words[LOCAL_WORD], words[REMOTE_WORD]
    with pytest.raises(AssertionError):
        twin.assert_same()


def advance(twin: Twin, slots: int) -> None:
    """Move both producers `slots` slots on with single writes of 3 slots and inline ones of 4 (variable WQEs), all
    completed."""
    while slots:
        inline = slots % 3 != 0
        twin.single(20 if inline else 64, 0, inline, True)
        slots -= 4 if inline else 3
        twin.complete()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["ends at the ring's end", "wraps", "starts at slot 0"])
def test_a_batch_at_the_ring_s_end(mode, where):
    """Variable WQEs: the batch wraps inside a WQE (its slots wrap one by one); static ones: between two."""
    twin = Twin(mode)
    sq = twin.many.send_queue
    taken, count = sq.taken(3), 12
    gap = {"ends at the ring's end": taken * count, "wraps": taken * count - (1 if sq.variable else 5 * taken),
           "starts at slot 0": 0}[where]  # the slots left before the ring's end
    if sq.variable:
        advance(twin, sq.slots - gap)
    else:
        for _ in range((sq.slots - gap) // taken):
            twin.single(64, 0, False, True)
            twin.complete()
    assert (sq.slots - sq.producer) % sq.slots == gap
    twin.batch("write", 64, list(range(0, 64 * count, 64)), list(range(64 * count, 0, -64)), {3})
    twin.assert_same()
    assert doorbells(twin.many)[-1][1] == sq.producer // sq.slots & 1  # the epoch of the lap it ends on
    twin.complete()
    twin.assert_same()


def fill(qp: QueuePair, free: int) -> None:
    """Leave exactly `free` WQEs' room in the SQ: post unsignaled writes (no completion retires them yet), then one
    signaled one."""
    sq, local, remote = qp.send_queue, *qp.regions  # type: ignore[attr-defined]
    taken = sq.taken(3)
    room = min((sq.slots - (sq.producer - sq.consumer)) // taken, sq.max_wqes - sq.outstanding)
    for i in range(room - free):
        run(qp.post_write(local, remote, 64, signaled=i == room - free - 1))
    assert sq.room(taken * free, free) and not sq.room(taken * (free + 1), free + 1)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["thor2", "thor"])
@pytest.mark.parametrize("extra", [0, 1])
async def test_a_batch_of_the_free_space_posts_at_once_one_more_waits_as_single_posts_do(mode, extra):
    """A batch of exactly the SQ's free room posts at once; one more work request waits for a completion (as the
    per-operation path waits for room for its last post), then posts the same bytes."""
    twin = Twin(mode, sq_depth=64)
    for qp, local, remote in zip(twin.qps, twin.local, twin.remote):
        qp.regions = (local, remote)  # type: ignore[attr-defined]
    sq = twin.many.send_queue
    free = min(sq.max_wqes // 2, sq.slots // 2 // sq.taken(3)) - 1  # one more is still a batch it takes
    count = free + extra
    for qp in twin.qps:
        fill(qp, free)
    offsets = list(range(0, 64 * count, 64))
    posted: list[QueuePair] = []

    async def post_many() -> None:
        await twin.many.post_many("write", twin.local[0], twin.remote[0], 64, offsets)
        posted.append(twin.many)

    async def post_one_by_one() -> None:
        with twin.one.batch():
            for i, offset in enumerate(offsets):
                await twin.one.post_write(twin.local[1], twin.remote[1], 64, local_offset=offset,
                                          remote_offset=offset, signaled=i == count - 1)
        posted.append(twin.one)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(post_many)
            tasks.start_soon(post_one_by_one)
            while (len(posted) < 2 if not extra else
                   not (twin.many._space_waiters and twin.one._space_waiters)):
                await anyio.sleep(0.001)
            assert len(posted) == (0 if extra else 2)  # one more than the room: both wait
            if extra:
                assert twin.one.send_queue.posted - twin.many.send_queue.posted == free  # all but the last
                twin.complete()  # the completion that frees the room
    if extra:  # the per-operation path announced the posts before its wait (that the NIC may complete them)
        assert doorbells(twin.one)[:-2] + doorbells(twin.one)[-1:] == doorbells(twin.many)
        twin.many.device.doorbells.written[:] = twin.one.device.doorbells.written
    twin.complete()
    twin.assert_same()


def test_an_empty_batch_posts_nothing_and_rings_nothing():
    qp = bare_qp("thor2")
    local, remote = region(qp), region(qp, key=0x99)
    before = sq_bytes(qp)
    assert run(qp.post_many("write", local, remote, 64, [])) == []
    assert run(qp.post_many("send", local, None, 0, range(0))) == []
    assert sq_bytes(qp) == before and doorbells(qp) == [] and qp.send_queue.posted == 0


def test_freeing_the_queue_pair_lets_go_of_the_ring_s_memory():
    """The arrays over the SQ's memory are dropped when it is freed: nothing exports the device's memory after the QP
    and its regions are gone (the bytearray behind it can be resized; an export would make that a BufferError)."""
    qp = bare_qp("thor")  # static WQEs and the PSN search table: written as numpy rows
    local, remote = region(qp), region(qp, key=0x99)
    run(qp.post_many("write", local, remote, 64, range(0, 64 * 30, 64)))
    assert qp.send_queue.runs is not None and qp.send_queue.runs.table is not None  # numpy arrays over it
    qp._free_memory()
    for mr in (local, remote):
        mr._free_memory()
    qp.device.pci.memory.clear()
