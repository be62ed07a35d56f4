"""Collectives on a ring of emulated NICs: every collective, dtype and op bit for bit against numpy reduced in the
ring's order, for 2-5 ranks and awkward sizes; replays; a faulty wire; no RNR NAK; ranks that disagree or die."""
import functools
import itertools
import os
import re
import signal
import threading
import time

import anyio
import numpy as np
import pytest

from aiofabric import collectives
from aiofabric.collectives import launch, layout, reference
from aiofabric.collectives.communicator import CollectiveError
from aiofabric.collectives.oneshot import ONESHOT_BYTES
from aiofabric.collectives.reference import ring_reference
from aiofabric.collectives.steps import floating
from aiofabric.sched.reduce import DTYPES, OPS
from tests.support.backends import on

PIECE = 1024  # small messages, so every size above a few hundred elements is cut into several pieces


def ring_reduce(xs, op, chunk_list):
    """What a ring allreduce computes, in its order (checked against numpy's exact integer sums in
    test_cli_collectives.py)."""
    assert chunk_list == layout.chunks(xs[0].size, len(xs))
    return ring_reference(xs, op)


def data(rng, dtype, count):
    if floating(np.dtype(dtype)):  # bfloat16 (ml_dtypes') too
        values = rng.standard_normal(count) * 8
        values[rng.random(count) < 0.02] = np.nan
        return values.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


async def all_ranks(comms, method, *per_rank, **options):
    return await collectives.run_ranks([lambda c=c, args=args: getattr(c, method)(*args, **options)
                                        for c, args in zip(comms, zip(*per_rank))])


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
async def test_every_collective_dtype_and_op_matches_numpy_bit_for_bit(ranks):
    rng = np.random.default_rng(ranks)
    async with collectives.local(ranks, buffer_bytes=1 << 20, piece_bytes=PIECE) as comms:
        for oneshot, dtype, op in itertools.product((ONESHOT_BYTES, 0), DTYPES, OPS):  # allreduce (one-shot, then
            for comm in comms:  # the ring), out of place and in place
                comm.oneshot_bytes = oneshot
            for count in (0, 1, ranks - 1, 1001):
                xs = [data(rng, dtype, count) for _ in range(ranks)]
                expected = ring_reduce(xs, op, layout.chunks(count, ranks))
                outs = [np.zeros(count, dtype) for _ in range(ranks)]
                await all_ranks(comms, "allreduce", xs, outs, op=op)
                assert all(same_bits(out, expected) for out in outs), (dtype, op, count, oneshot)
                await all_ranks(comms, "allreduce", xs, op=op)  # in place
                assert all(same_bits(x, expected) for x in xs), (dtype, op, count, oneshot, "in place")
        xs = [data(rng, np.float32, 100_003) for _ in range(ranks)]  # large: many pieces per chunk
        expected = ring_reduce(xs, "sum", layout.chunks(100_003, ranks))
        await all_ranks(comms, "allreduce", xs)
        assert all(same_bits(x, expected) for x in xs)
        for dtype, op in itertools.product(DTYPES, OPS):  # reduce-scatter
            for count in ((0, 1, 333) if dtype in (np.float16, np.int64) else (333,)):
                xs = [data(rng, dtype, count * ranks) for _ in range(ranks)]
                whole = ring_reduce(xs, op, layout.chunks(count * ranks, ranks))
                outs = [np.zeros(count, dtype) for _ in range(ranks)]
                await all_ranks(comms, "reduce_scatter", xs, outs, op=op)
                for rank, out in enumerate(outs):
                    assert same_bits(out, whole[rank * count:(rank + 1) * count]), (dtype, op, count, rank)
        for dtype, count in [(np.int32, c) for c in (0, 1, ranks - 1, 777)] + [(d, 777) for d in DTYPES]:
            xs = [data(rng, dtype, count) for _ in range(ranks)]  # allgather and broadcast move bytes
            outs = [np.zeros(count * ranks, dtype) for _ in range(ranks)]
            await all_ranks(comms, "allgather", xs, outs)
            assert all(same_bits(out, np.concatenate(xs)) for out in outs), (dtype, count)
            for root in range(ranks):
                xs = [data(rng, dtype, count) for _ in range(ranks)]
                source = xs[root].copy()
                await all_ranks(comms, "broadcast", xs, root=root)
                assert all(same_bits(x, source) for x in xs), (dtype, count, root)
        await all_ranks(comms, "barrier")


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("ranks", [2, 3, 5])
async def test_reduce_gather_scatter_sendrecv_alltoall_and_avg_match_numpy_bit_for_bit(ranks):
    """Every root, out of place and in place (nccl-tests' layouts), counts that are 0, 1 and cut into pieces; a
    reduce's non-root ranks and a gather's keep their out as it was; avg is the ring's sum divided once."""
    rng = np.random.default_rng(ranks)
    async with collectives.local(ranks, buffer_bytes=1 << 16, landing_bytes=1 << 17, piece_bytes=PIECE) as comms:
        for kind, dtype, op, count, root in [
                *(("reduce", d, op, c, root) for d, op, c in [(np.float32, "sum", 1001), (np.float16, "avg", 1001),
                                                               (np.int32, "avg", 333), (np.uint8, "prod", 5),
                                                               (np.int64, "max", 0)] for root in range(ranks)),
                *((kind, d, None, c, root) for kind in ("gather", "scatter") for d, c in
                  [(np.float64, 700), (np.int8, 1)] for root in range(ranks)),
                ("sendrecv", np.int64, None, 1001, 0), ("sendrecv", np.uint8, None, 1, 0),
                ("alltoall", np.float64, None, 700, 0), ("alltoall", np.int8, None, 1, 0),
                *(("allreduce", d, "avg", 1001, 0) for d in (np.float32, np.int64, np.uint32)),
                ("reduce_scatter", np.float64, "avg", 333, 0)]:
            for inplace in (False, True):
                size_in = count * ranks if kind in ("scatter", "reduce_scatter", "alltoall") else count
                size_out = count * ranks if kind in ("gather", "alltoall") else count
                xs = [data(rng, dtype, size_in) for _ in range(ranks)]
                want = reference.expected(kind, [x.copy() for x in xs], op or "sum", root)
                if inplace and kind == "gather":
                    outs = [np.zeros(size_out, dtype) for _ in range(ranks)]
                    for r, (out, x) in enumerate(zip(outs, xs)):
                        out[r * count:(r + 1) * count] = x
                    xs = [out[r * count:(r + 1) * count] for r, out in enumerate(outs)]
                elif inplace and kind in ("scatter", "reduce_scatter"):
                    outs = [x[r * count:(r + 1) * count] for r, x in enumerate(xs)]
                elif inplace:
                    outs = xs
                else:
                    outs = [data(rng, dtype, size_out) for _ in range(ranks)]
                before = [out.copy() for out in outs]
                options = {"op": op} if op else {}
                options |= {"root": root} if kind in ("reduce", "gather", "scatter") else {}
                await collectives.run_ranks([functools.partial(getattr(c, kind), x, None if inplace and kind in (
                    "reduce", "sendrecv", "allreduce", "alltoall") else out, **options) for c, x, out in zip(comms, xs, outs)])
                for rank, (out, expected) in enumerate(zip(outs, want)):
                    assert same_bits(out, before[rank] if expected is None else expected), (
                        kind, dtype, op, count, root, inplace, rank)


@pytest.mark.anyio
async def test_replays_take_new_inputs_and_a_large_allreduce_is_exact():
    """Compiled once, replayed with other arrays (any shape, same size) and other values; 2 MiB per rank is cut into
    64 KiB pieces, so transfers and reductions pipeline."""
    rng = np.random.default_rng(7)
    async with collectives.local(4, buffer_bytes=2 << 20, piece_bytes=64 << 10) as comms:
        for round_ in range(3):
            xs = [rng.integers(-1000, 1000, (512, 512)).astype(np.int64) for _ in range(4)]
            outs = [np.empty((512, 512), np.int64) for _ in range(4)]
            await all_ranks(comms, "allreduce", xs, outs)
            assert all(np.array_equal(out, sum(xs)) for out in outs), round_
        assert len(comms[0]._batches) == 1  # one compile, three runs


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_lossy_reordering_wire_still_gives_exact_results():
    rng = np.random.default_rng(3)
    async with collectives.local(3, buffer_bytes=1 << 20, piece_bytes=8192, loss=0.02, reorder=0.05,
                                 dup=0.02, seed=5, ack_timeout=14) as comms:  # a lost tail: 67 ms, not 4.3 s
        for _ in range(3):
            xs = [rng.integers(-2**31, 2**31, 50_001, dtype=np.int32) for _ in range(3)]
            expected = ring_reduce(xs, "sum", layout.chunks(50_001, 3))
            await all_ranks(comms, "allreduce", xs)
            assert all(np.array_equal(x, expected) for x in xs)
        for _ in range(3):  # one-shot: whole arrays passed on piece by piece, reduced in the ring's order
            xs = [data(rng, np.float32, 3000) for _ in range(3)]
            expected = ring_reduce(xs, "sum", layout.chunks(3000, 3))
            await all_ranks(comms, "allreduce", xs)
            assert all(same_bits(x, expected) for x in xs)
        stats = [await c.nic.pci.debug_client().stats() for c in comms]
        assert sum(s["dropped"] for s in stats) > 0 and sum(s["retransmits"] for s in stats) > 0


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("given,expected", [({}, 20), ({"ack_timeout": 14}, 14)])
async def test_the_ring_qps_wait_for_acks_as_nccl_does_unless_told(given, expected):
    """NCCL's default NCCL_IB_TIMEOUT (20: 4.3 s, 7 retries), where perftest's 67 ms gave up on a peer a loaded host
    kept from running for half a second; the emulated NIC is told what the QP was given."""
    async with collectives.local(3, buffer_bytes=1 << 12, **given) as comms:
        for comm in comms:
            report = (await comm.nic.pci.debug_client().request("datapath"))["qps"]
            for link in (comm.prev, comm.next):
                assert report[str(link.qp.qpn)]["timeout"] == expected


@pytest.mark.anyio
@pytest.mark.loop_agnostic
@pytest.mark.parametrize("value", [32, -1, True, 14.0])
async def test_a_bad_ack_timeout_is_refused_by_name_before_anything_opens(value):
    message = rf"ack_timeout must be an integer in \[0, 31\] \(4\.096 us \* 2\^n\), not {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        async with collectives.local(2, ack_timeout=value):
            pass
    with pytest.raises(ValueError, match=message):
        async with collectives.join(collectives.World(0, 2, "127.0.0.1", 1), ack_timeout=value):
            pass
    with pytest.raises(ValueError, match=message):
        await collectives.connect_ring([], ack_timeout=value)


async def rnr_naks(comms):
    return sum([(await c.nic.pci.debug_client().stats())["rnr_naks"] for c in comms])


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_replays_never_meet_an_rnr_nak(monkeypatch):
    """Receive pools posted before the first run and a ready message per run and link: ranks of different speeds
    never send into a missing receive. Without the pools (tampered), the same replays do meet RNR NAKs."""
    async def replays(comms):
        xs = [np.ones(4096, np.float32) for _ in range(4)]
        for _ in range(10):
            await all_ranks(comms, "allreduce", xs)
        return xs

    async with collectives.local(4, buffer_bytes=1 << 16, piece_bytes=2048) as comms:
        xs = await replays(comms)
        assert all(np.all(x == 4.0 ** 10) for x in xs)
        assert await rnr_naks(comms) == 0

    async def no_pool(qp, depth):
        return None
    monkeypatch.setattr(launch, "receive_pool", no_pool)
    async with collectives.local(4, buffer_bytes=1 << 16, piece_bytes=2048) as comms:
        for _ in range(8):  # a sender must overtake a receiver at least once: timing, so a bounded few tries
            xs = await replays(comms)
            assert all(np.all(x == 4.0 ** 10) for x in xs)  # RNR NAKs cost retransmissions, not bytes
            if await rnr_naks(comms) > 0:
                break
        assert await rnr_naks(comms) > 0


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_ranks_that_disagree_fail_at_the_first_message_naming_the_immediates():
    """163 and 200 elements collided in a 12-bit digest (found by review): the ready message carries 28 bits."""
    async with collectives.local(2, buffer_bytes=1 << 16, timeout=10) as comms:
        with anyio.fail_after(20), pytest.raises(CollectiveError, match=r"rank \d failed: .*expected immediate"):
            await collectives.run_ranks([lambda: comms[0].allreduce(np.ones(163, np.float32)),
                                         lambda: comms[1].allreduce(np.ones(200, np.float32))])
        with pytest.raises(CollectiveError, match="failed earlier"):
            await comms[0].allreduce(np.ones(100, np.float32))


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_small_allreduce_takes_one_message_per_rank_and_link_and_a_large_one_the_ring():
    """Up to ONESHOT_BYTES every rank's whole array goes round the ring (size - 1 messages per link after the ready,
    not the ring's 2 (size - 1)), even with buffers no larger than the array (the CLI's): the landing MR holds every
    rank's. Ranks that chose differently (oneshot_bytes) fail at the ready message, naming the immediates."""
    def messages(comm):
        (batch, _), = comm._batches.values()
        return sum(call.kind == "write_with_imm" for call in batch.calls)

    for count, want in ((256, 4), (ONESHOT_BYTES // 4, 4), (ONESHOT_BYTES // 4 + 1, 7)):
        async with collectives.local(4, buffer_bytes=count * 4) as comms:
            xs = [np.full(count, r + 1.0, np.float32) for r in range(4)]
            await all_ranks(comms, "allreduce", xs)
            assert all(np.all(x == 10.0) for x in xs) and [messages(c) for c in comms] == [want] * 4, count
    async with collectives.local(2, buffer_bytes=1 << 16, timeout=10) as comms:
        comms[0].oneshot_bytes = 0
        with anyio.fail_after(20), pytest.raises(CollectiveError, match=r"rank \d failed: .*expected immediate"):
            await all_ranks(comms, "allreduce", [np.ones(100, np.float32) for _ in comms])


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_local_ranks_share_one_emulator_process_unless_told_not_to():
    """One process for a call's NICs (not another call's), or one per NIC; either way the ring works."""
    async with collectives.local(3, buffer_bytes=4096) as comms, collectives.local(2, buffer_bytes=4096) as others:
        assert len({c.nic.pci.pid for c in comms}) == 1 and len({c.nic.pci.pid for c in others}) == 1
        assert comms[0].nic.pci.pid != others[0].nic.pci.pid
        await all_ranks(comms, "allreduce", [np.ones(4, np.float32) for _ in comms])
    async with collectives.local(3, buffer_bytes=4096, shared_emulator=False) as comms:
        assert len({c.nic.pci.pid for c in comms}) == 3
        xs = [np.ones(4, np.float32) for _ in comms]
        await all_ranks(comms, "allreduce", xs)
        assert all(np.all(x == 3.0) for x in xs)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_rank_whose_nic_dies_fails_every_rank_naming_it():
    async with collectives.local(3, buffer_bytes=4 << 20, piece_bytes=64 << 10, timeout=20,
                                 shared_emulator=False) as comms:  # one NIC dies, not its process's others
        xs = [np.ones(1 << 19, np.float64) for _ in range(3)]
        await all_ranks(comms, "allreduce", xs)

        killer = threading.Timer(0.005, os.kill, (comms[2].nic.pci.pid, signal.SIGKILL))  # mid-run
        killer.start()
        try:
            with anyio.fail_after(30), pytest.raises(CollectiveError, match=r"rank 2 failed: .*(lost|gone|died)"):
                await all_ranks(comms, "allreduce", xs)
        finally:
            killer.join()
        for comm in comms:
            assert comm.broken is not None


@pytest.mark.anyio
@on("trio")  # trio's idle worker threads exit after 10 s
async def test_a_communicator_held_idle_longer_than_a_worker_thread_lives_still_works():
    """Held 13 s, with reductions of 1 MiB, which run in worker threads."""
    async with collectives.local(2, buffer_bytes=4 << 20) as comms:
        xs = [np.full(1 << 20, 2.0, np.float32) for _ in range(2)]
        await all_ranks(comms, "allreduce", xs)
        await anyio.sleep(13)
        await all_ranks(comms, "allreduce", xs)
        assert all(np.all(x == 8.0) for x in xs)
    closed = "ClosedError: .*(destroyed|deregistered)"  # used after close: refused at once, naming what is gone
    with anyio.fail_after(10), pytest.raises(CollectiveError, match=closed):
        await all_ranks(comms, "allreduce", xs)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_bad_arguments_are_refused_naming_them():
    async with collectives.local(2, buffer_bytes=4096) as comms:
        comm = comms[0]
        with pytest.raises(ValueError, match="exceed the communicator's 4096-byte buffers"):
            await comm.allreduce(np.ones(1025, np.float32))
        with pytest.raises(ValueError, match="unknown op 'mean'"):
            await comm.allreduce(np.ones(4, np.float32), op="mean")
        with pytest.raises(TypeError, match="reductions take .* not complex64"):
            await comm.allreduce(np.ones(4, np.complex64))
        with pytest.raises(ValueError, match="x is not C-contiguous"):
            await comm.allreduce(np.ones(8, np.float32)[::2])
        with pytest.raises(ValueError, match="out is read-only"):
            frozen = np.ones(4, np.float32)
            frozen.flags.writeable = False
            await comm.allreduce(np.ones(4, np.float32), frozen)
        with pytest.raises(ValueError, match="x has 5 elements and out 2; x needs size \\(2\\) x out's"):
            await comm.reduce_scatter(np.ones(5, np.float32), np.ones(2, np.float32))
        with pytest.raises(ValueError, match="root must be a rank in \\[0, 1\\]"):
            await comm.broadcast(np.ones(4, np.float32), root=2)
        with pytest.raises(ValueError, match="out overlaps x"):
            x = np.ones(8, np.float32)
            await comm.allreduce(x[:4], x[2:6])
        with pytest.raises(ValueError, match="x has 10 elements and out 12; they must be equal"):
            await comm.allreduce(np.ones(10, np.float32), np.zeros(12, np.float32))
        with pytest.raises(ValueError, match="root must be a rank in \\[0, 1\\], not 5"):
            comm.calls("broadcast", np.ones(4, np.float32), root=5)
        assert comm.broken is None  # refusals do not break it


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_bfloat16_reductions_match_ml_dtypes_in_the_rings_order():
    """bfloat16 (ml_dtypes' type; numpy has none): NaNs, rounding at every step, bit for bit against ml_dtypes'
    ufuncs in the ring's order, for a ring allreduce and a chain reduce."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(11)
    async with collectives.local(3, buffer_bytes=1 << 16, piece_bytes=PIECE) as comms:
        for kind, op in (("allreduce", "sum"), ("allreduce", "max"), ("reduce", "prod"), ("allreduce", "avg")):
            xs = [data(rng, np.float32, 1001).astype(ml_dtypes.bfloat16) for _ in range(3)]
            want = reference.expected(kind, [x.copy() for x in xs], op, 2)
            outs = [np.zeros(1001, ml_dtypes.bfloat16) for _ in range(3)]
            options = {"root": 2} if kind == "reduce" else {}
            await collectives.run_ranks([functools.partial(getattr(c, kind), x, out, op=op, **options)
                                         for c, x, out in zip(comms, xs, outs)])
            for out, expected in zip(outs, want):
                assert expected is None or same_bits(out, expected), (kind, op)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_an_alltoall_is_refused_past_its_landing_memory_and_taken_at_it():
    """Along a ring of 3 an alltoall lands 4 parts per rank (a slot per origin, and one part passing through): for
    a full 1 MiB buffer that is 4/3 MiB, more than the landing MR holds (1 MiB and a page), unless landing_bytes
    says so."""
    count = (1 << 20) // 4 // 3  # floats per rank: x is 1048572 bytes
    xs = [np.full(3 * count, float(r), np.float32) for r in range(3)]
    need = layout.alltoall_landing(3, count) * 4
    async with collectives.local(3, buffer_bytes=1 << 20) as comms:
        assert need == 4 * count * 4 > comms[0].landing_capacity == (1 << 20) + 4096
        with pytest.raises(ValueError, match=rf"^alltoall: {count} elements per rank along a ring of 3 take {need} "
                                             r"bytes of landing memory; the communicator's has 1052672 \(its "
                                             r"landing_bytes\)$"):
            await comms[0].alltoall(xs[0])
        with pytest.raises(ValueError, match="x has 1021 elements and out 1021; both need size \\(3\\) x the"):
            await comms[0].alltoall(np.ones(1021, np.float32))
    async with collectives.local(3, buffer_bytes=1 << 20, landing_bytes=need) as comms:
        await all_ranks(comms, "alltoall", xs)
        assert all(np.array_equal(x, np.repeat(np.arange(3, dtype=np.float32), count)) for x in xs)


def test_ring_layout_covers_every_element_once_and_ends_with_chunk_r_at_rank_r():
    for n, count in itertools.product(range(1, 7), (0, 1, 5, 6, 7, 100)):
        chunk_list = layout.chunks(count, n)
        assert sum(c.length for c in chunk_list) == count and [c.start for c in chunk_list] == sorted(
            c.start for c in chunk_list)
        assert max(c.length for c in chunk_list) - min(c.length for c in chunk_list) <= 1
        for c in chunk_list:
            parts = layout.pieces(c, 4, 12)
            assert sum(p.length for p in parts) == c.length and all(p.length <= 3 for p in parts)
        for r in range(n):  # what rank r receives at step s is what rank r-1 sent
            for s in range(n - 1):
                assert layout.reduce_scatter_chunks(r, n, s)[1] == layout.reduce_scatter_chunks((r - 1) % n, n, s)[0]
                assert layout.allgather_chunks(r, n, s)[1] == layout.allgather_chunks((r - 1) % n, n, s)[0]
            if n > 1:  # the last reduce-scatter step reduces chunk r; allgather step 0 sends it
                assert layout.reduce_scatter_chunks(r, n, n - 2)[1] == r == layout.allgather_chunks(r, n, 0)[0]
    assert layout.tag("allreduce", 5, 1) != layout.tag("allgather", 5, 1) != layout.tag("allreduce", 6, 1)
    assert layout.bus_bandwidth("allreduce", 4, 1.0) == 1.5


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_an_allreduce_inside_a_users_batch_is_ordered_between_its_kernels_and_replays():
    """A training step in one plan: a kernel writes the gradients, the allreduce's calls sum them across ranks, a
    kernel reads the sums; rebinding the step's input replays all of it."""
    from aiofabric import sched
    async with collectives.local(3, buffer_bytes=1 << 16, piece_bytes=1024) as comms:
        batches, inputs, results = [], [], []
        for comm in comms:
            a, grads, result = np.zeros(3000, np.float64), np.zeros(3000, np.float64), np.zeros(3000, np.float64)
            queue = sched.ComputeQueue(f"step {comm.rank}")
            batches.append(sched.compile([
                sched.kernel(lambda g, a: np.multiply(a, 2.0, out=g), [grads], [a], queue=queue, name="gradients"),
                *comm.calls("allreduce", grads),
                sched.kernel(lambda r, g: np.add(g, 1.0, out=r), [result], [grads], queue=queue, name="update"),
            ], inputs={"a": a}))
            inputs.append(a)
            results.append(result)
        for round_ in range(2):
            new = [np.full(3000, 10.0 * round_ + rank, np.float64) for rank in range(3)]
            await collectives.run_ranks([functools.partial(batch.run, {"a": a}) for batch, a in zip(batches, new)])
            assert all(np.all(result == 2 * sum(10.0 * round_ + r for r in range(3)) + 1) for result in results)
        with pytest.raises(ValueError, match="move nothing"):
            comms[0].calls("allreduce", np.zeros(0, np.float32))
        with pytest.raises(ValueError, match="unknown collective 'scan'"):
            comms[0].calls("scan", np.zeros(4, np.float32))


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_barrier_holds_every_rank_until_the_last_enters():
    """Found by review: the barrier was only a handshake with the next rank, so rank 0 left before rank 2 came."""
    async with collectives.local(3, buffer_bytes=4096) as comms:
        await collectives.run_ranks([comm.barrier for comm in comms])
        left = {}
        started = anyio.current_time()

        async def rank(r):
            if r == 2:
                await anyio.sleep(1.0)
            await comms[r].barrier()
            left[r] = anyio.current_time() - started
        await collectives.run_ranks([functools.partial(rank, r) for r in range(3)])
        assert min(left.values()) >= 0.95, left


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_ready_message_waits_for_the_earlier_collective_still_reading_the_buffer(monkeypatch):
    """Found by review: an allreduce then a broadcast in one batch; at the non-root rank the broadcast's ready did
    not wait for the allreduce's copy out, so the root's data overwrote the sum being copied out. The copy out is
    slowed (a preempted thread) to make the race certain."""
    from aiofabric import sched
    count = 1 << 16
    async with collectives.local(2, buffer_bytes=4 * count, piece_bytes=64 << 10) as comms:
        sums, payloads, batches = [], [], []
        for comm in comms:
            g, h = np.zeros(count, np.float32), np.zeros(count, np.float32)
            batches.append(sched.compile([*comm.calls("allreduce", g), *comm.calls("broadcast", h, root=0)],
                                         inputs={"g": g, "h": h}))
            sums.append(g)
            payloads.append(h)
        copy, victim = np.copyto, sums[1].ctypes.data

        def slow_copy_out(dst, src, *args, **kwargs):
            if getattr(dst, "ctypes", None) is not None and dst.ctypes.data == victim and src.ctypes.data != victim:
                time.sleep(0.05)
            return copy(dst, src, *args, **kwargs)
        monkeypatch.setattr(np, "copyto", slow_copy_out)
        for round_ in range(3):
            for r in range(2):
                copy(sums[r], np.full(count, r + 1.0, np.float32))
                copy(payloads[r], np.full(count, 1000.0 + round_ if r == 0 else -1.0, np.float32))
            await collectives.run_ranks([functools.partial(batch.run, {"g": g, "h": h}, timeout=30)
                                         for batch, g, h in zip(batches, sums, payloads)])
            assert all(np.all(g == 3.0) for g in sums) and all(np.all(h == 1000.0 + round_) for h in payloads)
