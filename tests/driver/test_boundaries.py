"""Limits tested at the boundary, not near it: a size equal to the compiled one or to a buffer's capacity, a call or
an IOVA block ending exactly at its region's end, the last sequence number a message can carry, an immediate of 0,
an allocator after a free, odd sizes, and the exact text of each refusal. Each test kills a mutant of
bench/mutants.py that the suite let live before (it names them)."""
import errno
import functools
import mmap
import re

import anyio
import numpy as np
import pytest

from aiofabric import DmaBudget, QPState, collectives, open_nic, sched
from aiofabric.collectives import launch, layout
from aiofabric.collectives.steps import MAX_PIECES
from aiofabric.errors import ImmediateMismatchError
from aiofabric.pci import PAGE_SIZE, PCIError
from aiofabric.pci.dma_pool import SLAB_SIZE, DmaPool
from aiofabric.pci.iommu import IommuWindows, IovaSpace
from aiofabric.peer.policy import Limits
from aiofabric.sched.pool import pool_of
from aiofabric.sim.freed import FreedMemory
from aiofabric.tools import cli
from tests.support.nics import connect, connected_qps


# A QP pair on a clean wire, with perftest's ACK timeout (67 ms, the driver's default): eight 1 ms ones can run out
# while an emulator waits for a CPU on a loaded machine.
connected = functools.partial(connected_qps, qp={"sq_depth": 64})


# -- the scheduler ---------------------------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_an_expected_immediate_of_0_is_checked_and_0xffffffff_is_the_largest():
    """imm=0 is a value, not "no check": a peer's other immediate fails the wait, naming both."""
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        source, landing = await a.register_mr(64), await b.register_mr(64)
        sched.wait_imm(qb, imm=0xFFFFFFFF)
        with pytest.raises(ValueError, match=r"^wait_imm: imm must be an integer in \[0, 0xffffffff\], not 4294967296$"):
            sched.wait_imm(qb, imm=1 << 32)
        waiter = sched.compile([sched.wait_imm(qb, imm=0, name="wait for 0")])
        failures = []
        for sent in (0, 5):
            sender = sched.compile([sched.write_with_imm(qa, source, landing, sent, 64)])
            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    group.start_soon(sender.run)
                    try:
                        await waiter.run(timeout=10)
                    except sched.CallError as error:
                        failures.append(error)
        assert len(failures) == 1 and "call 0 (wait for 0)" in str(failures[0]), failures  # the 5, not the 0
        cause = failures[0].__cause__ or failures[0].__context__
        assert isinstance(cause, ImmediateMismatchError) and str(cause) == "expected immediate 0x0, got 0x5"


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_an_rdma_size_rebinds_to_exactly_its_compiled_size_and_a_call_may_end_at_its_regions_end():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, _ = await connected(a, b)
        source, landing = await a.register_mr(8192), await b.register_mr(8192)
        source.view[:] = bytes(range(256)) * 32
        nbytes = sched.Scalar("bytes", 8000)
        batch = sched.compile([sched.write(qa, source, landing.remote(), nbytes, local_offset=192,
                                           remote_offset=192)])  # 192 + 8000 = 8192: the regions' last byte
        with anyio.fail_after(20):
            await batch.run({"bytes": 16})
            assert bytes(landing.view[192:208]) == bytes(source.view[192:208]) and not any(landing.view[208:])
            await batch.run({"bytes": 8000})  # back up to the compiled size: allowed
        assert bytes(landing.view[192:]) == bytes(source.view[192:]) and not any(landing.view[:192])
        with pytest.raises(sched.BindingError, match=r"^scalar 'bytes' sizes an RDMA call: it must be in \[0, 8000\] "
                                                     r"\(the compiled size, whose bytes the plan ordered\), not 8001;"):
            await batch.run({"bytes": 8001})


def test_memory_next_to_a_constant_or_another_input_is_not_an_overlap():
    """Rebinding checks overlaps: touching is not overlapping (two halves of one array are separate memory)."""
    whole, other = np.zeros(8), np.zeros(4)
    x, y = np.zeros(4), np.zeros(4)
    batch = sched.compile([sched.kernel(lambda o: o.fill(1.0), [whole[:4]], queue=sched.ComputeQueue("A")),
                           sched.kernel(lambda o, i: np.copyto(o, i), [y], [x], queue=sched.ComputeQueue("B"))],
                          inputs={"x": x, "y": y})
    batch.bind({"x": whole[4:]})  # right after the constant whole[:4]
    batch.bind({"x": other, "y": np.zeros(4)})  # fresh arrays: no overlap at all
    pair = np.arange(8.0)
    batch.bind({"x": pair[:4], "y": pair[4:]})  # two inputs side by side
    anyio.run(batch.run)
    assert pair.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0] and whole[:4].tolist() == [1.0] * 4
    with pytest.raises(sched.BindingError, match=r"input 'x': its new memory overlaps argument 0 of call 0"):
        batch.bind({"x": whole[3:7]})


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_receive_pool_is_as_deep_as_asked_after_a_reset_and_never_as_deep_as_its_queue():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        with pytest.raises(ValueError, match=rf"^receive_pool: depth must be an integer in \[1, {qb.rq.depth - 1}\] "
                                             rf"\(the QP's receive queue holds {qb.rq.depth}\), not {qb.rq.depth}$"):
            await sched.receive_pool(qb, qb.rq.depth)
        pool = await sched.receive_pool(qb, 8)
        assert len(pool.posted) == 8
        source, landing = await a.register_mr(64), await b.register_mr(64)
        waiter = sched.compile([sched.wait_imm(qb, imm=7, name="wait")])
        with pytest.raises(sched.BatchTimeoutError):
            await waiter.run(timeout=0.3)  # nobody sends: the QP goes to ERR, its pooled receives are flushed
        for qp in (qa, qb):
            await qp.modify(QPState.RESET)
        await connect(qa, qb)
        sender = sched.compile([sched.write_with_imm(qa, source, landing, 7, 64)])
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(sender.run)
                await waiter.run(timeout=10)
        assert len(pool.posted) == 8 and not any(c.done for c in pool.posted)  # all live again, none flushed
        assert (await sched.receive_pool(qb, qb.rq.depth - 1)).depth == qb.rq.depth - 1  # the deepest allowed


# -- collectives -----------------------------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_collective_of_exactly_the_buffers_capacity_runs():
    async with collectives.local(2, buffer_bytes=4096) as comms:
        xs = [np.full(1024, float(r + 1), np.float32) for r in range(2)]  # 4096 bytes: the whole buffer
        with anyio.fail_after(30):
            await collectives.run_ranks([lambda c=c, x=x: c.allreduce(x) for c, x in zip(comms, xs)])
        assert all(np.all(x == 3.0) for x in xs)
        with pytest.raises(ValueError, match=r"^allreduce: 4100 bytes exceed the communicator's 4096-byte buffers "
                                             r"\(its buffer_bytes\)$"):
            await comms[0].allreduce(np.ones(1025, np.float32))


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_runs_messages_on_a_link_fit_the_receive_pool_whatever_the_count():
    """Pieces per chunk are at most MAX_PIECES (a broadcast's pieces 2 (size - 1) MAX_PIECES), rounding up: one
    more and a rank that runs ahead could find its neighbour's pool empty. Counts just past a multiple are where
    rounding down would cut one piece too many."""
    async with collectives.local(2, buffer_bytes=1 << 16, piece_bytes=4) as comms:
        comm = comms[0]
        depth = pool_of(comm.prev.qp).depth
        assert depth == launch.pool_depth(2) == 2 * MAX_PIECES + 2
        for kind, count in (("allreduce", 2 * (MAX_PIECES * 33 + 1)), ("allreduce", 2 * MAX_PIECES + 2),
                            ("broadcast", 2 * MAX_PIECES * 2 + 1), ("broadcast", 2 * MAX_PIECES * 7 + 3)):
            x = np.zeros(count, np.float32)
            calls = comm.calls(kind, x)
            data = [c for c in calls if c.kind == "write_with_imm" and c.name != "ready to prev"]
            bound = MAX_PIECES * (2 if kind == "allreduce" else 2 * (comm.size - 1))
            assert len(data) <= bound, (kind, count, len(data))
            assert len(data) + 1 <= depth, (kind, count, len(data), depth)  # and the ready


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_every_collectives_messages_on_a_link_fit_the_receive_pool():
    """reduce, gather, scatter, sendrecv and alltoall grow their pieces too: with 4-byte pieces, counts just past a
    multiple of the pool's share, no rank's run sends more messages on its link than the receive pool holds (beside
    the ready)."""
    async with collectives.local(3, buffer_bytes=1 << 16, landing_bytes=1 << 18, piece_bytes=4) as comms:
        depth = launch.pool_depth(3)
        for kind, count in (("reduce", 4 * MAX_PIECES * 3 + 1), ("sendrecv", 4 * MAX_PIECES * 5 + 3),
                            ("gather", 2 * MAX_PIECES * 7 + 1), ("scatter", 2 * MAX_PIECES * 3 + 1),
                            ("alltoall", 4 * MAX_PIECES + 1), ("alltoall", 4 * MAX_PIECES * 9 // 3 + 2)):
            for comm in comms:
                x = np.zeros(count * (3 if kind in ("scatter", "alltoall") else 1), np.float32)
                out = np.zeros(count * (3 if kind in ("gather", "alltoall") else 1), np.float32)
                options = {"root": 1} if kind in ("reduce", "gather", "scatter") else {}
                calls = comm.calls(kind, x, out, **options)
                data = [c for c in calls if c.kind == "write_with_imm" and c.name != "ready to prev"]
                assert len(data) + 1 <= depth, (kind, count, comm.rank, len(data), depth)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_run_that_times_out_names_the_rank_it_waits_for():
    """Rank 2 never comes. Alone, rank 0 waits first to send to rank 1 (its ready is missing); with rank 1 running,
    ranks 0 and 1 both wait on a receive from rank 2: each names the rank it waits for, as a timeout, not as a failed
    link."""
    async with collectives.local(3, buffer_bytes=4096, timeout=0.5) as comms:
        with anyio.fail_after(20), pytest.raises(collectives.CollectiveError) as failed:
            await comms[0].allreduce(np.ones(4, np.float32))
        assert str(failed.value).startswith("rank 0 failed: allreduce of 4 x float32 (waiting for rank 1): "), \
            str(failed.value)
    async with collectives.local(3, buffer_bytes=4096, timeout=0.5) as comms:
        errors = {}

        async def run(rank):
            try:
                await comms[rank].allreduce(np.ones(4, np.float32))
            except collectives.CollectiveError as error:
                errors[rank] = str(error)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                for rank in (0, 1):
                    group.start_soon(run, rank)
        for rank in (0, 1):
            assert errors[rank].startswith(f"rank {rank} failed: allreduce of 4 x float32 (waiting for rank 2): "), \
                errors


def test_the_last_sequence_number_a_message_can_carry_is_0xffff():
    assert layout.tag("allreduce", 0xABC, 0xFFFF) & 0xFFFF == 0xFFFF
    for seq in (0, 0x10000):
        with pytest.raises(ValueError, match=rf"^allreduce: {seq} messages on one link exceed the 65535 a run can "
                                             r"name$"):
            layout.tag("allreduce", 0xABC, seq)


# -- memory ------------------------------------------------------------------------------------------------------------
def test_freed_ranges_split_where_memory_is_allocated_again():
    """The emulator's record of freed memory: allocating the middle of a freed range keeps both remnants watched
    (a device write into either still counts) and the middle is the driver's again (its writes do not)."""
    arena = mmap.mmap(-1, 8 * PAGE_SIZE, flags=mmap.MAP_SHARED)
    freed = FreedMemory(arena)
    arena[:] = b"\x01" * len(arena)
    arena.madvise(mmap.MADV_REMOVE, 0, 6 * PAGE_SIZE)  # what the driver does with freed pages
    freed.unmapped(0, 6 * PAGE_SIZE)
    freed.mapped(2 * PAGE_SIZE, 2 * PAGE_SIZE)  # pages 2 and 3 allocated again
    assert freed.written_pages() == 0
    arena[2 * PAGE_SIZE:4 * PAGE_SIZE] = b"\x02" * (2 * PAGE_SIZE)  # the new owner's writes
    assert freed.written_pages() == 0
    arena[PAGE_SIZE] = 3  # the left remnant
    assert freed.written_pages() == 1
    arena[5 * PAGE_SIZE + 7] = 3  # the right remnant
    assert freed.written_pages() == 2
    arena[6 * PAGE_SIZE] = 3  # never freed
    assert freed.written_pages() == 2
    del freed
    arena.close()


def test_an_iova_block_may_end_on_a_ranges_last_byte_and_a_freed_block_is_handed_out_once():
    space = IovaSpace([(SLAB_SIZE, 3 * SLAB_SIZE - 1)])  # room for exactly two blocks
    first, second = space.alloc(PAGE_SIZE), space.alloc(SLAB_SIZE)
    assert (first, second) == (SLAB_SIZE, 2 * SLAB_SIZE)
    with pytest.raises(PCIError, match=r"^no IOVA space left for a 0x1000-byte DMA window$"):
        space.alloc(PAGE_SIZE)
    space.free(first, PAGE_SIZE)
    assert space.alloc(SLAB_SIZE) == first
    with pytest.raises(PCIError, match="no IOVA space left"):  # not the same block again
        space.alloc(SLAB_SIZE)


class FailingOnce:
    """A VfioApi whose first VFIO_IOMMU_MAP_DMA fails as a locked-memory limit makes it fail."""

    def __init__(self) -> None:
        self.maps: list[int] = []

    def map_dma(self, container, vaddr, iova, size):
        self.maps.append(iova)
        if len(self.maps) == 1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

    def unmap_dma(self, container, iova, size):
        return size


def test_the_iova_of_a_failed_mapping_serves_the_next():
    api = FailingOnce()
    windows = IommuWindows(api, 3, [(SLAB_SIZE, (1 << 32) - 1)], "nic0")
    with pytest.raises(PCIError, match=rf"^nic0: VFIO_IOMMU_MAP_DMA of 0x200000 bytes at IOVA {SLAB_SIZE:#x} failed "
                                       r"\(Cannot allocate memory\): raise the locked-memory limit"):
        windows.map(0x7f0000000000, SLAB_SIZE)
    assert windows.map(0x7f0000000000, SLAB_SIZE)[0] == SLAB_SIZE and api.maps == [SLAB_SIZE, SLAB_SIZE]


def test_a_dma_buffers_last_byte_has_a_bus_address_and_the_byte_past_it_none():
    class Scattered:
        pins = True

        def __init__(self):
            self.space = IovaSpace([(SLAB_SIZE, 1 << 40)])

        def map(self, address, size):
            base = self.space.alloc(size)
            return list(reversed(range(base, base + size, PAGE_SIZE)))

        def unmap(self, bus_address, size):
            pass

    buffer = DmaPool(Scattered(), "test").alloc(2 * PAGE_SIZE + 1, False)  # 3 pages, not contiguous on the bus
    assert buffer.size == 3 * PAGE_SIZE and not buffer.contiguous
    assert buffer.bus_address_of(buffer.size - 1) == buffer.bus_addrs[2] + PAGE_SIZE - 1
    with pytest.raises(ValueError, match=r"^offset 0x3000 outside DMA buffer of 0x3000 bytes$"):
        buffer.bus_address_of(buffer.size)
    buffer.free()


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_dma_budget_counts_odd_sizes_in_whole_pages_and_takes_exactly_its_limit():
    budget = DmaBudget(256 << 20, "test budget")
    async with open_nic(dma_budget=budget) as nic:
        before = budget.in_use
        odd = nic.pci.alloc_dma(100)
        assert budget.in_use == before + PAGE_SIZE  # what the pool holds for it: a whole page
        odd.free()
        assert budget.in_use == before
        budget.limit = before + 2 * PAGE_SIZE
        exact = nic.pci.alloc_dma(PAGE_SIZE + 1)  # two pages: exactly the limit
        with pytest.raises(MemoryError, match=rf"^{re.escape(nic.pci.address)}: 4096 more bytes of DMA memory would "
                                              rf"make {before + 3 * PAGE_SIZE}, over the test budget of "
                                              rf"{before + 2 * PAGE_SIZE}$"):
            nic.pci.alloc_dma(1)
        exact.free()
        budget.limit = 256 << 20


# -- servers' policy -------------------------------------------------------------------------------------------------
def test_server_limits_take_their_smallest_values_and_refuse_zero():
    Limits(nics=1, memory=1, in_flight=1, line=1, depth=1, idle=0.001)
    with pytest.raises(ValueError, match=r"^limit idle must be a positive number of seconds, not 0$"):
        Limits(idle=0)
    with pytest.raises(ValueError, match=r"^limit in_flight must be at least 1, not 0$"):
        Limits(in_flight=0)


# -- perftest's flags --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [(["bench", "write", "-q0"], "-q 0: must be at least 1"),
                                          (["bench", "write", "-u40"], "-u 40: must be in [0, 31]"),
                                          (["bench", "write", "-t0"], "-t 0: must be at least 1")])
def test_a_flag_with_its_value_joined_is_named_as_typed(capsys, argv, message):
    """perftest's users write -q0 as often as -q 0: the error names -q, not --qps."""
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"aiofabric bench: error: {message}")
