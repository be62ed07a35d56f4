"""Many work requests per call, SGE lists and inline data, end to end on emulated NICs: what lands, what completes,
and what is refused (the codec itself is tested without an emulator in tests/test_workqueue.py)."""
import contextlib
import os
import random

import anyio
import pytest

from aiofabric import ClosedError, QPStateError, open_nic
from aiofabric.completions import CompletionError
from aiofabric.queues import RemoteRegion

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def pair(sq_depth=64, **qp_options):
    """Two emulated NICs with one connected RC QP each, and a 64 KiB MR on each."""
    tag = f"{os.getpid()}-{random.getrandbits(20)}"
    async with open_nic(f"sim:a{tag}") as a, open_nic(f"sim:b{tag}") as b:
        cq_a, cq_b = await a.create_cq(1024), await b.create_cq(1024)
        qa = await a.create_qp(cq_a, sq_depth=sq_depth, rq_depth=256, **qp_options)
        qb = await b.create_qp(cq_b, sq_depth=sq_depth, rq_depth=256, **qp_options)
        await qa.connect(qb.info(), timeout=8)
        await qb.connect(qa.info(), timeout=8)
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        source.view[:] = random.Random(7).randbytes(1 << 16)
        yield qa, qb, source, target


async def test_post_many_writes_land_and_complete_where_asked():
    async with pair() as (qa, qb, source, target):
        offsets = range(0, 40 * 100, 100)  # 40 writes of 100 bytes, remote placed in reverse order
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
    after sq_cons_idx wraps at 65,536, every byte of the last round lands."""
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
    tag = f"{os.getpid()}-{random.getrandbits(20)}"
    async with open_nic(f"sim:c{tag}") as nic:
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
    tag = f"{os.getpid()}-{random.getrandbits(20)}"
    async with open_nic(f"sim:d{tag}") as nic:
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
