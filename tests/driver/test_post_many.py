"""Many work requests per call, SGE lists and inline data, end to end on emulated NICs: what lands, what completes,
and what is refused (the codec itself is tested without an emulator in tests/unit/test_workqueue.py)."""
import collections
import contextlib
import random

import anyio
import pytest

from aiofabric import ClosedError, QPStateError, open_nic
from aiofabric.errors import CompletionError
from aiofabric.verbs.types import LocalBuffer, RemoteRegion
from tests.support.nics import connected_qps, tag

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def pair(sq_depth=64, profile="thor2", **qp_options):
    """Two emulated NICs (of firmware `profile`) with one connected RC QP each, and a 64 KiB MR on each."""
    name = tag()
    async with open_nic(f"sim:a{name}", profile=profile) as a, open_nic(f"sim:b{name}", profile=profile) as b:
        qa, qb = await connected_qps(a, b, 1024, {"sq_depth": sq_depth, "rq_depth": 256, **qp_options},
                                     timeout=14)  # ~67 ms: a loaded 2-core machine never times an ACK out
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        source.view[:] = random.Random(7).randbytes(1 << 16)
        yield qa, qb, source, target


@pytest.mark.parametrize("count", [20, 100])  # 100: a run long enough to be written at once (VECTOR_RUN)
async def test_post_many_writes_land_and_complete_where_asked(count):
    async with pair(sq_depth=256) as (qa, qb, source, target):
        offsets = range(0, count * 100, 100)  # writes of 100 bytes, remote placed in reverse order
        remotes = [60_000 - o for o in offsets]
        with anyio.fail_after(10):
            done = await qa.post_many("write", source, target, 100, offsets, remote_offsets=remotes, signal=[3, 17])
            assert len(done) == 3
            for completion in done:
                await completion
        for o, r in zip(offsets, remotes):
            assert bytes(target.view[r:r + 100]) == bytes(source.view[o:o + 100])
        assert qa.send_cq.outstanding == 0 and qa.send_queue.outstanding == 0


@pytest.mark.loop_agnostic
async def test_post_many_reads_sends_and_writes_with_immediate():
    async with pair() as (qa, qb, source, target):
        target.view[:] = random.Random(8).randbytes(1 << 16)
        offsets = range(0, 8 * 512, 512)
        with anyio.fail_after(10):
            await (await qa.post_many("read", source, target, 512, offsets, remote_offsets=range(8192, 12288, 512)))[-1]
        assert bytes(source.view[:4096]) == bytes(target.view[8192:12288])
        receives = [await qb.post_recv(target, 256, local_offset=16384 + 256 * i) for i in range(8)]
        with anyio.fail_after(10):
            await (await qa.post_many("send", source, None, 256, range(0, 2048, 256), imm=0xABC))[-1]
            for i, receive in enumerate(receives):
                got = await receive
                assert (got.byte_len, got.imm) == (256, 0xABC)
                assert bytes(target.view[16384 + 256 * i:][:256]) == bytes(source.view[256 * i:][:256])
        receives = [await qb.post_recv(target, 0) for _ in range(5)]
        with anyio.fail_after(10):
            await (await qa.post_many("write_with_imm", source, target, 64, range(0, 320, 64), imm=7))[-1]
            assert [(await r).imm for r in receives] == [7] * 5
        assert bytes(target.view[:320]) == bytes(source.view[:320])


async def test_a_failure_inside_a_batch_fails_the_completion_after_it_and_flushes_the_rest():
    async with pair() as (qa, qb, source, target):
        bad = RemoteRegion(target.addr, target.rkey ^ 0x100, 1 << 16)
        with anyio.fail_after(10):
            done = await qa.post_many("write", source, bad, 64, range(0, 640, 64), signal=[4])
            with pytest.raises(CompletionError, match="REMOTE_ACCESS_ERR"):
                await done[0]  # WQE 0 (unsignaled) failed: the first completion at or after it names the error
            with pytest.raises(CompletionError, match="FLUSH") as flushed:
                await done[1]
        assert "REMOTE_ACCESS_ERR" in str(flushed.value)  # the flush names its root cause
        assert qa.send_cq.outstanding == 0


async def test_post_many_waits_for_room_and_crosses_the_16_bit_wqe_index():
    """70,000 writes in batches of 32 through a 64-deep send queue: batches wait for room, completions keep coming
    after the WQE count passes 65,536 (sq_cons_idx wraps at sq_size, hundreds of times), every byte of the last round
    lands."""
    async with pair(sq_depth=64) as (qa, qb, source, target):
        offsets = range(0, 32 * 64, 64)
        pending = []
        with anyio.fail_after(60):
            for round_ in range(70_000 // 32 + 1):
                source.view[:8] = round_.to_bytes(8, "little")
                pending.append((await qa.post_many("write", source, target, 64, offsets))[-1])
                if len(pending) > 4:
                    await pending.pop(0)
            for completion in pending:
                await completion
        assert qa.send_queue.posted > 65_536 and qa.send_queue.outstanding == 0
        assert bytes(target.view[:2048]) == bytes(source.view[:2048])


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", ["thor2", "thor-bs-v2"])  # variable WQEs; static ones
@pytest.mark.parametrize("sq_depth", [100, 3000])
async def test_completions_name_their_work_requests_through_many_wraps_of_the_index(profile, sq_depth):
    """Signaled writes, twice the send queue's sq_size and more (the index CQEs carry wraps at sq_size: 128 or 4096
    static WQEs, 512 or 16384 slots with variable ones, as Linux's bnxt_qplib_cq_process_req reads it), through a
    queue whose depth is no power of two: every completion arrives, in order, once its own write landed, and none is
    left over."""
    async with pair(sq_depth=sq_depth, profile=profile) as (qa, qb, source, target):
        sq = qa.send_queue
        total, batch = 2 * sq.geometry.size + 77, min(128, sq.max_wqes // 4)
        in_flight: collections.deque = collections.deque()
        posted = 0
        with anyio.fail_after(120):
            while posted < total or in_flight:
                if posted < total:
                    numbers = range(posted, min(total, posted + batch))
                    offsets = [8 * (k % 4096) for k in numbers]  # 3 batches in flight never share an offset
                    for k, offset in zip(numbers, offsets):
                        source.view[offset:offset + 8] = k.to_bytes(8, "little")
                    in_flight.append((numbers, offsets, await qa.post_many("write", source, target, 8, offsets,
                                                                          signal=range(len(numbers)))))
                    posted += len(numbers)
                if len(in_flight) == 3 or posted == total:
                    numbers, offsets, done = in_flight.popleft()
                    for k, offset, completion in zip(numbers, offsets, done, strict=True):
                        await completion
                        assert int.from_bytes(target.view[offset:offset + 8], "little") == k
        assert sq.posted == total and sq.outstanding == 0 and qa.send_cq.outstanding == 0


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", ["thor2", "thor-bs-v2"])
async def test_an_error_completion_blames_its_own_work_request_among_wqes_of_many_sizes(profile):
    """Writes of 1 to 4 SGEs, and inline ones, run past the send queue's sq_size (128 static WQEs; with variable WQEs
    1024 slots, which they wrap), then a write of 2 SGEs to a bad rkey goes between two good ones. Its completion
    fails REMOTE_ACCESS_ERR: with variable WQEs the error CQE names the slot the WQE starts at, not its index
    (Linux bnxt_qplib_get_cqe_sq_cons). The write before it succeeds, the one after flushes."""
    async with pair(sq_depth=100, profile=profile, max_send_sge=4, max_inline_data=48) as (qa, qb, source, target):
        def write(i, remote=target):
            if i % 5 == 2:
                return qa.post_write(source, remote, 1 + i % 48, local_offset=64 * i, remote_offset=64 * i,
                                     inline=True)
            sges = [source.sge(64 * i + 16 * k, 8) for k in range(1 + i % 4)]
            return qa.post_write(sges, remote, remote_offset=64 * i)

        sq = qa.send_queue
        pending = []
        with anyio.fail_after(60):
            for i in range(400):
                pending.append(await write(i))
                if len(pending) > 20:
                    await pending.pop(0)
            for completion in pending:
                await completion
            assert sq.posted > sq.geometry.size or sq.producer > sq.slots
            before = await write(400)
            bad = await write(401, RemoteRegion(target.addr, target.rkey ^ 0x100, 1 << 16))
            after = await write(402)
            await before
            with pytest.raises(CompletionError, match="REMOTE_ACCESS_ERR"):
                await bad
            with pytest.raises(CompletionError, match="FLUSH"):
                await after
        assert bytes(target.view[64 * 400:64 * 400 + 8]) == bytes(source.view[64 * 400:64 * 400 + 8])
        assert qa.send_cq.outstanding == 0


async def test_post_many_refuses_what_it_cannot_post():
    async with pair(sq_depth=16) as (qa, qb, source, target):
        cases = [
            (("fetch_add", source, target, 8, [0]), "verb must be one of"),
            (("write", source, target, 64, [0, 65536]), "exceed the 65536-byte memory region"),
            (("write", source, target, 64, [-64]), "exceed"),
            (("write", source, target.remote(0, 128), 64, [0, 128]), "remote region"),
            (("write", source, None, 64, [0]), "needs a remote region"),
            (("send", source, target, 64, [0]), "a send has no remote region"),
            (("read", source, target, 64, [0], {"imm": 1}), "imm goes with"),
            (("write_with_imm", source, target, 64, [0]), "needs imm="),
            (("write", source, target, 64, [0, 64], {"remote_offsets": [0]}), "1 remote offsets for 2"),
            (("write", source, target, 64, [0, 64], {"signal": [2]}), r"signal indexes must be in \[0, 2\)"),
            (("write", source, target, 8, list(range(0, 8 * 1000, 8))), "do not fit QP"),
        ]
        for args, message in cases:
            *positional, keywords = args if isinstance(args[-1], dict) else (*args, {})
            with pytest.raises(ValueError, match=message):
                await qa.post_many(*positional, **keywords)
        assert await qa.post_many("write", source, target, 64, []) == []
        await (await qa.post_many("write", source, target, 64, [0]))[-1]  # still usable after every refusal
        await qa.destroy()
        with pytest.raises(ClosedError):
            await qa.post_many("write", source, target, 64, [0])


async def test_post_many_before_connect_is_refused_naming_the_state():
    async with open_nic(f"sim:c{tag()}") as nic:
        qp = await nic.create_qp(await nic.create_cq(64))
        mr = await nic.register_mr(4096)
        with pytest.raises(QPStateError, match="INIT"):
            await qp.post_many("write", mr, mr, 64, [0])


@pytest.mark.loop_agnostic
async def test_scatter_gather_lists_gather_sends_and_scatter_receives():
    async with pair(max_send_sge=3, max_recv_sge=2) as (qa, qb, source, target):
        sges = [source.sge(1000, 10), source.sge(0, 30), source.sge(5000, 60)]
        with anyio.fail_after(10):
            await qa.write(sges, target, remote_offset=100)
        assert bytes(target.view[100:200]) == bytes(source.view[1000:1010]) + bytes(source.view[:30]) + bytes(
            source.view[5000:5060])
        receive = await qb.post_recv([target.sge(8000, 40), target.sge(9000, 100)])
        with anyio.fail_after(10):
            await qa.send(source, 70, local_offset=300)
            assert (await receive).byte_len == 70
        assert bytes(target.view[8000:8040]) + bytes(target.view[9000:9030]) == bytes(source.view[300:370])
        with pytest.raises(ValueError, match="1 to 3 SGEs"):
            await qa.post_write([source.sge(0, 1)] * 4, target)
        with pytest.raises(ValueError, match="size 5 is not the 10 bytes"):
            await qa.post_write([source.sge(0, 10)], target, 5)
        with pytest.raises(TypeError, match="LocalBuffers"):
            await qa.post_write([(source.addr, source.lkey, 4)], target)
        with pytest.raises(ValueError, match="exceed the 65536-byte"):
            source.sge(65530, 10)


@pytest.mark.loop_agnostic
async def test_inline_data_is_copied_when_posted():
    """The WQE carries the bytes: changing the buffer right after posting changes nothing at the peer."""
    async with pair(max_inline_data=96) as (qa, qb, source, target):
        source.view[:96] = b"A" * 96
        with anyio.fail_after(10):
            posted = await qa.post_write(source, target, 96, inline=True)
            source.view[:96] = b"B" * 96
            await posted
        assert bytes(target.view[:96]) == b"A" * 96
        receive = await qb.post_recv(target, 64, local_offset=1000)
        with anyio.fail_after(10):
            await qa.send(source, 40, inline=True)
            assert (await receive).byte_len == 40
        assert bytes(target.view[1000:1040]) == b"B" * 40
        with pytest.raises(ValueError, match="97 bytes exceed QP .* max_inline_data \\(96"):
            await qa.post_write(source, target, 97, inline=True)


async def test_inline_and_sges_beyond_the_device_are_refused_at_create():
    async with open_nic(f"sim:d{tag()}") as nic:
        cq = await nic.create_cq(64)
        assert nic.caps["max_inline_data"] == 96 and nic.caps["max_sge"] == 6
        with pytest.raises(ValueError, match=r"max_inline_data must be an integer in \[0, 96\]"):
            await nic.create_qp(cq, max_inline_data=97)
        with pytest.raises(ValueError, match=r"max_send_sge must be an integer in \[1, 6\]"):
            await nic.create_qp(cq, max_send_sge=7)
        qp = await nic.create_qp(cq)  # the default QP takes no inline data
        mr = await nic.register_mr(4096)
        await qp.connect(qp.info())
        with pytest.raises(ValueError, match=r"max_inline_data \(0"):
            await qp.post_write(mr, mr, 8, inline=True)


async def test_hostile_arguments_are_refused_before_anything_is_posted():
    """Each refusal leaves the QP as it was (found by review: a run that failed halfway left a completion behind, and
    the next good write never completed; a float signal index lost the batch's completions)."""
    async with pair() as (qa, qb, source, target):
        far = RemoteRegion(2**64 - 4096, target.rkey)  # a peer's region of unknown length, near the top
        cases = [
            ((source, target, 64, [0, 64.0]), {}, TypeError, "offsets must be integers, not float"),
            ((source, target, 64, [0, True]), {}, TypeError, "not booleans"),
            ((source, target, 64, [0, 64]), {"signal": [0.5]}, TypeError, "signal must be integers"),
            ((source, target, 64, [0]), {"remote_offsets": ["0"]}, TypeError, "remote_offsets must be integers"),
            ((source, far, 64, [0, 64], ), {"remote_offsets": [0, 8192]}, ValueError, "remote address"),
            ((source, far, 64, [0]), {"remote_offsets": [-2**70]}, ValueError, "is negative"),
            ((LocalBuffer(source.addr, source.lkey, 4096), target, 64, [0, 4096]), {}, ValueError,
             "exceed the 4096-byte buffer"),
        ]
        for args, keywords, kind, message in cases:
            before = (qa.send_queue.posted, len(qa.send_queue.pending), qa.send_cq.outstanding)
            with pytest.raises(kind, match=message):
                await qa.post_many("write", *args, **keywords)
            assert (qa.send_queue.posted, len(qa.send_queue.pending), qa.send_cq.outstanding) == before
        with pytest.raises(ValueError, match="rkey must be an integer"):
            RemoteRegion(target.addr, 1 << 32)
        with anyio.fail_after(10):
            await (await qa.post_many("write", source, target, 64, [0, 64], signal=[0]))[-1]
            await qa.write(source, target, 64)
        assert qa.send_cq.outstanding == 0 and qa.send_queue.outstanding == 0


async def test_a_batch_takes_at_most_half_the_ring_so_an_unsignaled_tail_cannot_block_it():
    """Unsignaled writes no completion retires yet sit at the ring's tail: a batch of up to half the ring still gets
    room (found by review: a batch of most of the ring waited forever behind them)."""
    async with pair(sq_depth=64) as (qa, qb, source, target):
        sq = qa.send_queue
        for i in range(10):
            await qa.post_write(source, target, 64, local_offset=64 * i, remote_offset=64 * i, signaled=False)
        half = sq.slots // 2 // 3
        with pytest.raises(ValueError, match="at most half"):
            await qa.post_many("write", source, target, 64, range(0, 64 * (half + 1), 64))
        with anyio.fail_after(10):
            await (await qa.post_many("write", source, target, 64, range(0, 64 * half, 64)))[-1]
        assert sq.outstanding == 0


async def test_a_receive_never_scatters_into_sges_an_earlier_receive_left_in_its_slot():
    """RQ depth 1: every receive reuses slot 0. A two-SGE receive, then a one-SGE receive of 100 bytes: a 150-byte
    send must fail, not spill into the earlier receive's second SGE (found by review)."""
    async with pair(max_recv_sge=2) as (qa, qb, source, target):
        first = await qb.post_recv([target.sge(0, 100), target.sge(4096, 100)])
        with anyio.fail_after(10):
            await qa.send(source, 200)
            assert (await first).byte_len == 200
        target.view[:] = bytes(len(target.view))
        second = await qb.post_recv(target.sge(1000, 100))
        with anyio.fail_after(20):
            with pytest.raises(CompletionError):
                await qa.send(source, 150)
            with pytest.raises(CompletionError):
                await second
        assert not any(target.view[4096:4196])


async def test_a_send_queue_the_search_table_cannot_index_is_refused_at_create():
    async with open_nic(f"sim:e{tag()}") as nic:
        cq = await nic.create_cq(64)
        with pytest.raises(ValueError, match="sq_depth 30000 needs 131072 send-queue slots.* 16 bits, so at most 65536"):
            await nic.create_qp(cq, sq_depth=30000)
        assert (await nic.create_qp(cq, sq_depth=21845)).sq_slots == 65536


async def test_a_batch_waiting_for_room_cancelled_from_outside_posts_nothing():
    """The third half-ring batch waits for room; cancelled there, it leaves the queue as the first two left it, and
    those two complete."""
    async with pair(sq_depth=64) as (qa, qb, source, target):
        sq = qa.send_queue
        half = range(0, 64 * (sq.slots // 2 // 3), 64)
        first = [await qa.post_many("write", source, target, 64, half) for _ in range(2)]
        posted = sq.posted
        with anyio.move_on_after(0) as scope:
            await qa.post_many("write", source, target, 64, half)
        assert scope.cancelled_caught and sq.posted == posted and qa._space_waiters == 0
        with anyio.fail_after(10):
            for done in first:
                await done[-1]
        assert sq.outstanding == 0 and qa.send_cq.outstanding == 0


async def test_a_batch_posted_to_a_failed_qp_completes_flushed_where_it_would_have_completed():
    async with pair() as (qa, qb, source, target):
        with anyio.fail_after(10), pytest.raises(CompletionError, match="REMOTE_ACCESS_ERR"):
            await qa.write(source, RemoteRegion(target.addr, target.rkey ^ 0x100), 64)
        done = await qa.post_many("write", source, target, 64, range(0, 640, 64), signal=[2, 5])
        assert len(done) == 3
        for completion in done:
            with pytest.raises(CompletionError, match="FLUSH"):
                await completion


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", ["thor2", "psn-table", "thor-bs-v2"])
async def test_batches_under_loss_are_retransmitted_intact_from_the_search_entries_they_wrote(profile):
    """Batches of 48 writes (long enough to be written at once) of 1.5 KiB (two packets each at MTU 1024) from a NIC
    losing 5% of what it sends: with hardware retransmission (thor2: the MSN table, psn-table: the PSN search table)
    the chip resumes from the search-table entries post_many wrote, so a wrong one fails the batch or misplaces its
    bytes; thor-bs-v2's static WQEs are retransmitted by its firmware, from its own context."""
    name = tag()
    async with open_nic(f"sim:a{name}", profile=profile, loss=0.05, seed=13) as a, \
            open_nic(f"sim:b{name}", profile=profile) as b:
        qa, qb = await connected_qps(a, b, 1024, {"sq_depth": 256, "rq_depth": 16}, timeout=14)
        source, target = await a.register_mr(1 << 18), await b.register_mr(1 << 18)
        source.view[:] = random.Random(9).randbytes(1 << 18)
        with anyio.fail_after(60):
            for round_ in range(3):
                offsets = range(round_ * 48 * 1536, (round_ + 1) * 48 * 1536, 1536)
                await (await qa.post_many("write", source, target, 1536, offsets,
                                          remote_offsets=offsets[::-1]))[-1]
        assert a.pci.debug({"op": "stats"})["stats"]["go_backs"] > 0  # the loss was recovered by retransmission
        for round_ in range(3):
            offsets = range(round_ * 48 * 1536, (round_ + 1) * 48 * 1536, 1536)
            for local, remote in zip(offsets, offsets[::-1]):
                assert target.view[remote:remote + 1536] == source.view[local:local + 1536]
