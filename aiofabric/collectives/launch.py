"""N ranks in this process, one NIC each (emulated, or PCI functions), connected in a ring; and `run_ranks`, which
runs one coroutine per rank and, when a rank fails, stops the others and names it."""
from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio

from ..nic import NIC, open_nic
from ..sched import receive_pool
from .communicator import MAX_PIECES, PIECE_BYTES, RUN_TIMEOUT, CollectiveError, Communicator, Link

T = TypeVar("T")
DEFAULT_BUFFER = 16 << 20


def pool_depth(size: int) -> int:
    """Receives kept posted per QP: one run's messages on a link (at most 2 (size - 1) MAX_PIECES) and the ready."""
    return 2 * max(size - 1, 1) * MAX_PIECES + 2


@contextlib.asynccontextmanager
async def local(size: int, *, nics: Sequence[str] | None = None, buffer_bytes: int = DEFAULT_BUFFER,
                piece_bytes: int = PIECE_BYTES, timeout: float = RUN_TIMEOUT,
                **nic_options: Any) -> AsyncIterator[list[Communicator]]:
    """`size` communicators, rank r on its own NIC: emulated ones (`nic_options` are open_nic's: wire faults,
    pcap...), or the PCI functions `nics` (one per rank). Each rank registers two buffers of `buffer_bytes` (the
    largest collective it will run, in bytes of its largest array). Everything is closed when the block exits."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be a positive integer, not {size!r}")
    if nics is not None and len(nics) != size:
        raise ValueError(f"nics names {len(nics)} NICs for {size} ranks")
    if not isinstance(buffer_bytes, int) or buffer_bytes < 0:
        raise ValueError(f"buffer_bytes must be a non-negative integer, not {buffer_bytes!r}")
    async with contextlib.AsyncExitStack() as stack:
        opened: list[NIC] = []
        for rank in range(size):
            spec = nics[rank] if nics is not None else "sim"
            opened.append(await stack.enter_async_context(open_nic(spec, **nic_options)))
        yield await connect_ring(opened, buffer_bytes=buffer_bytes, piece_bytes=piece_bytes, timeout=timeout)


async def connect_ring(nics: Sequence[NIC], *, buffer_bytes: int = DEFAULT_BUFFER, piece_bytes: int = PIECE_BYTES,
                       timeout: float = RUN_TIMEOUT) -> list[Communicator]:
    """Communicators over open NICs (rank r on nics[r]): a CQ, a work and a landing MR per rank, and per link r -> r+1
    a connected QP at each end with a receive pool. The NICs' close frees it all."""
    size = len(nics)
    if size == 1:
        return [Communicator(0, 1, None, None, None, None, nic=nics[0], piece_bytes=piece_bytes, timeout=timeout)]
    depth = pool_depth(size)
    mtu = min(nic.path_mtu for nic in nics)  # 4096 unless a port is smaller: a quarter of 1024's packets
    cqs = [await nic.create_cq(4 * depth + 1024) for nic in nics]
    # the landing MR holds size - 1 chunks of at most ceil(count / size) elements: a little more than the work MR
    works = [await nic.register_mr(max(buffer_bytes, 64)) for nic in nics]
    landings = [await nic.register_mr(max(buffer_bytes, 64) + 16 * size) for nic in nics]
    to_next, from_prev = [], []
    for rank in range(size):
        after = (rank + 1) % size
        a = await nics[rank].create_qp(cqs[rank], sq_depth=256, rq_depth=2 * depth)
        b = await nics[after].create_qp(cqs[after], sq_depth=256, rq_depth=2 * depth)
        for qp in (a, b):  # posted before either end can send: the first run's messages find receives
            await receive_pool(qp, depth)
        await a.connect(b.info(), mtu=mtu)
        await b.connect(a.info(), mtu=mtu)
        to_next.append(a)
        from_prev.append(b)  # from_prev[rank] is rank + 1's QP from rank
    comms = []
    for rank in range(size):
        after, before = (rank + 1) % size, (rank - 1) % size
        comms.append(Communicator(
            rank, size, works[rank], landings[rank],
            Link(to_next[rank], after, works[after].remote(), landings[after].remote()),
            Link(from_prev[before], before, works[before].remote(), landings[before].remote()),
            nic=nics[rank], piece_bytes=piece_bytes, timeout=timeout))
    return comms


async def run_ranks(work: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run `work[r]()` for every rank r at once and return their results. When one fails, the others are cancelled
    (they would wait for it until their timeout) and a `CollectiveError` names the first rank that failed."""
    results: list[Any] = [None] * len(work)
    failed: list[tuple[int, BaseException]] = []

    async with anyio.create_task_group() as group:
        async def one(rank: int) -> None:
            try:
                results[rank] = await work[rank]()
            except Exception as error:
                failed.append((rank, error))
                group.cancel_scope.cancel()

        for rank in range(len(work)):
            group.start_soon(one, rank)
    if failed:
        rank, error = failed[0]
        if isinstance(error, CollectiveError):  # it names its rank
            raise error
        raise CollectiveError(f"rank {rank} failed: {error}") from error
    return results


__all__ = ["connect_ring", "local", "pool_depth", "run_ranks"]
