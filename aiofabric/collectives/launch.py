"""Making communicators: N ranks in this process, one NIC each (emulated, or PCI functions), connected in a ring
(`local`); one rank of a job of processes or hosts, through the TCP rendezvous (`join`); and `run_ranks`, which runs
one coroutine per rank of this process and, when a rank fails, stops the others and names it. Both connect the same
`Endpoint`s, so a ring in one process is wired exactly as a ring across hosts."""
from __future__ import annotations

import contextlib
import errno
import itertools
import socket
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio

from .communicator import PIECE_BYTES, RUN_TIMEOUT, CollectiveError, Communicator, Link
from .oneshot import ONESHOT_BYTES
from .steps import MAX_PIECES
from .rendezvous import FAREWELL, RendezvousClient, RendezvousError, RendezvousServer
from .world import World
from ..sched import receive_pool
from ..util.taskgroups import own_task_group, run_in
from ..verbs import NIC, MemoryRegion, QPInfo, QueuePair, RemoteRegion, open_nic

T = TypeVar("T")
DEFAULT_BUFFER = 16 << 20
RENDEZVOUS_TIMEOUT = 60.0  # seconds for every rank to come and connect
# The ring QPs' local ACK timeout exponent: NCCL's default NCCL_IB_TIMEOUT, 4.096 us * 2^20 = 4.3 s, with 7 retries.
# perftest's 14 (67 ms) gives up once a peer has been kept from running for half a second, which a loaded host (more
# busy processes than cores) does; a wire that loses packets wants a smaller one, or a lost tail costs that long.
ACK_TIMEOUT = 20


def check_ack_timeout(ack_timeout: int) -> None:
    """Refused before anything is opened, under its own name (the QP's connect calls it `timeout`)."""
    if not isinstance(ack_timeout, int) or isinstance(ack_timeout, bool) or not 0 <= ack_timeout <= 31:
        raise ValueError(f"ack_timeout must be an integer in [0, 31] (4.096 us * 2^n), not {ack_timeout!r}")
_locals = itertools.count()  # local() calls of this process: each names its own emulator process


def pool_depth(size: int) -> int:
    """Receives kept posted per QP: one run's messages on a link (at most 2 (size - 1) MAX_PIECES) and the ready."""
    return 2 * max(size - 1, 1) * MAX_PIECES + 2


@contextlib.asynccontextmanager
async def local(size: int, *, nics: Sequence[str] | None = None, buffer_bytes: int = DEFAULT_BUFFER,
                landing_bytes: int = 0, piece_bytes: int = PIECE_BYTES, timeout: float = RUN_TIMEOUT,
                shared_emulator: bool = True, ack_timeout: int = ACK_TIMEOUT,
                **nic_options: Any) -> AsyncIterator[list[Communicator]]:
    """`size` communicators, rank r on its own NIC: emulated ones (`nic_options` are open_nic's: wire faults,
    pcap...), or the PCI functions `nics` (one per rank). Each rank registers two buffers of `buffer_bytes` (the
    largest collective it will run, in bytes of its largest array), the landing one at least `landing_bytes` (what
    an alltoall passes through: layout.alltoall_landing). The emulated NICs share one emulator process unless
    `shared_emulator` is off (or open_nic's `process` names one): a message between two ranks then wakes no other
    process, and on a machine with more busy processes than cores fewer of them wait for a CPU (bench/RESULTS.md,
    "Collectives without dead time"). `ack_timeout` is the ring QPs' local ACK timeout exponent (ACK_TIMEOUT: NCCL's
    default). Everything is closed when the block exits."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be a positive integer, not {size!r}")
    check_ack_timeout(ack_timeout)
    if nics is not None and len(nics) != size:
        raise ValueError(f"nics names {len(nics)} NICs for {size} ranks")
    for name, value in (("buffer_bytes", buffer_bytes), ("landing_bytes", landing_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
    if nics is None and shared_emulator and "process" not in nic_options:
        nic_options = {**nic_options, "process": f"ranks{next(_locals)}"}  # this call's NICs, not another's
    async with contextlib.AsyncExitStack() as stack:
        opened: list[NIC] = []
        for rank in range(size):
            spec = nics[rank] if nics is not None else "sim"
            opened.append(await stack.enter_async_context(open_nic(spec, **rank_capture(nic_options, rank))))
        yield await connect_ring(opened, buffer_bytes=buffer_bytes, landing_bytes=landing_bytes,
                                 piece_bytes=piece_bytes, timeout=timeout, ack_timeout=ack_timeout)


def rank_capture(nic_options: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank N > 0 captures to FILE.N, as bench's NIC N does: a capture is never shared (nor overwritten)."""
    if rank == 0 or not nic_options.get("pcap"):
        return nic_options
    return {**nic_options, "pcap": f"{nic_options['pcap']}.{rank}"}


class Endpoint:
    """One rank's half of the ring before it is connected: its CQ, work and landing MRs, and two QPs with receive
    pools (posted before either end can send, so the first run's messages find receives): `to_next` for the link to
    rank + 1, `from_prev` for the link from rank - 1. `card()` is what the other ranks need of it."""

    def __init__(self, nic: NIC, size: int, work: MemoryRegion, landing: MemoryRegion, to_next: QueuePair,
                 from_prev: QueuePair) -> None:
        self.nic, self.size, self.work, self.landing = nic, size, work, landing
        self.to_next, self.from_prev = to_next, from_prev

    @classmethod
    async def create(cls, nic: NIC, size: int, buffer_bytes: int, landing_bytes: int = 0) -> Endpoint:
        depth = pool_depth(size)
        cq = await nic.create_cq(4 * depth + 1024)
        # the landing MR holds size - 1 chunks of at most ceil(count / size) elements: a little more than the work MR
        # (an alltoall's parts passing through take more: landing_bytes; a one-shot allreduce, every rank's array)
        work = await nic.register_mr(max(buffer_bytes, 64))
        landing = await nic.register_mr(max(max(buffer_bytes, 64) + 16 * size, landing_bytes,
                                            size * min(buffer_bytes, ONESHOT_BYTES)))
        qps = [await nic.create_qp(cq, sq_depth=256, rq_depth=2 * depth) for _ in range(2)]
        for qp in qps:
            await receive_pool(qp, depth)
        return cls(nic, size, work, landing, *qps)

    def card(self) -> dict[str, Any]:
        return {"to_next": self.to_next.info().to_dict(), "from_prev": self.from_prev.info().to_dict(),
                "work": self.work.remote().to_dict(), "landing": self.landing.remote().to_dict(),
                "path_mtu": self.nic.path_mtu}

    async def connect(self, rank: int, cards: Sequence[dict[str, Any]], *, piece_bytes: int,
                      timeout: float, ack_timeout: int = ACK_TIMEOUT) -> Communicator:
        """Connect both QPs to the neighbours' (at 4096 unless a port is smaller: a quarter of 1024's packets) and
        make rank `rank`'s communicator. The neighbours must be connected before anyone sends (a barrier)."""
        size = self.size
        after, before = (rank + 1) % size, (rank - 1) % size
        mtu = min(int(card["path_mtu"]) for card in cards)
        await self.to_next.connect(QPInfo.from_dict(cards[after]["from_prev"]), mtu=mtu, timeout=ack_timeout)
        await self.from_prev.connect(QPInfo.from_dict(cards[before]["to_next"]), mtu=mtu, timeout=ack_timeout)
        remote = RemoteRegion.from_dict
        return Communicator(rank, size, self.work, self.landing,
                            Link(self.to_next, after, remote(cards[after]["work"]), remote(cards[after]["landing"])),
                            Link(self.from_prev, before, remote(cards[before]["work"]),
                                 remote(cards[before]["landing"])),
                            nic=self.nic, piece_bytes=piece_bytes, timeout=timeout)


async def connect_ring(nics: Sequence[NIC], *, buffer_bytes: int = DEFAULT_BUFFER, landing_bytes: int = 0,
                       piece_bytes: int = PIECE_BYTES, timeout: float = RUN_TIMEOUT,
                       ack_timeout: int = ACK_TIMEOUT) -> list[Communicator]:
    """Communicators over open NICs of this process, rank r on nics[r]. The NICs' close frees it all."""
    check_ack_timeout(ack_timeout)
    size = len(nics)
    if size == 1:
        return [Communicator(0, 1, None, None, None, None, nic=nics[0], piece_bytes=piece_bytes, timeout=timeout)]
    endpoints = [await Endpoint.create(nic, size, buffer_bytes, landing_bytes) for nic in nics]
    cards = [endpoint.card() for endpoint in endpoints]
    return [await endpoint.connect(rank, cards, piece_bytes=piece_bytes, timeout=timeout, ack_timeout=ack_timeout)
            for rank, endpoint in enumerate(endpoints)]


@contextlib.asynccontextmanager
async def join(world: World, *, nic: str = "sim", ip: str | None = None, buffer_bytes: int = DEFAULT_BUFFER,
               landing_bytes: int = 0, piece_bytes: int = PIECE_BYTES, timeout: float = RUN_TIMEOUT,
               rendezvous_timeout: float = RENDEZVOUS_TIMEOUT, ack_timeout: int = ACK_TIMEOUT,
               **nic_options: Any) -> AsyncIterator[Communicator]:
    """This process's rank of `world` (`World(rank, size, addr, port)`, or `world.from_environment(os.environ)`
    under torchrun, mpirun or srun), on NIC `nic`. Rank 0 serves the rendezvous at addr:port; every rank publishes
    its QPs and buffer keys there, connects to its neighbours, and waits for all to be connected. A rank that does
    not come within `rendezvous_timeout` fails every rank with an error naming it. The connection to the rendezvous
    stays open while the block runs: a rank whose process ends without leaving its block is reported to the others,
    whose collectives then fail naming it at once. A rank that fails (in `join` or in its block, an exception or a
    cancellation) tells the others why, and they fail at once naming it and its reason; the block's exception then
    leaves `join` as itself, never wrapped in an ExceptionGroup (as `open_nic`'s). Rank 0 (serving) leaves its
    block once every rank left theirs."""
    check_ack_timeout(ack_timeout)
    size, rank = world.size, world.rank
    async with contextlib.AsyncExitStack() as stack:
        group = await stack.enter_async_context(own_task_group())
        server: RendezvousServer | None = None
        stopped = anyio.Event()
        if rank == 0 and world.serve:
            try:
                listener = await anyio.create_tcp_listener(local_host=world.addr, local_port=world.port)
            except socket.gaierror as error:
                raise RendezvousError(f"rank 0 cannot serve the rendezvous at {world.addr}:{world.port}: the host "
                                      f"{world.addr!r} ({world.addr_from}) cannot be resolved: "
                                      f"{error.strerror or error}") from None
            except OSError as error:
                advice = (f"{world.addr} ({world.addr_from}) is not this host, where rank 0 runs: set MASTER_ADDR "
                          "to rank 0's host" if error.errno == errno.EADDRNOTAVAIL else
                          "set AIOFABRIC_RENDEZVOUS_PORT to a free port (the same for every rank)")
                raise RendezvousError(f"rank 0 cannot serve the rendezvous at {world.addr}:{world.port}: "
                                      f"{error.strerror or error}; {advice}") from None
            server = RendezvousServer(size, rendezvous_timeout)

            async def serve(server: RendezvousServer) -> None:
                try:
                    await server.serve(listener)
                finally:
                    stopped.set()
            group.start_soon(serve, server)
        client = RendezvousClient(world.addr, world.port, rank, size, rendezvous_timeout)

        async def failed(error: BaseException) -> None:
            """Tell the others why this rank fails (unless the rendezvous itself failed it, and knows); a serving
            rank 0 whose job failed before it started lets its server tell the ranks why (it stops once they were
            told, or at its deadline)."""
            if client.stream is not None or not isinstance(error, RendezvousError):
                await client.fail(_reason(error))
            if server is not None and server.failure is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(rendezvous_timeout + FAREWELL + 1):
                    await stopped.wait()
        stack.push_async_callback(client.goodbye)  # after the NIC's close: the last thing this rank does
        try:
            opened = await stack.enter_async_context(open_nic(nic, ip=ip, **rank_capture(nic_options, rank)))
            endpoint = await Endpoint.create(opened, size, buffer_bytes, landing_bytes) if size > 1 else None
            cards = await client.allgather(endpoint.card() if endpoint is not None else {})
            if endpoint is None:
                comm = Communicator(0, 1, None, None, None, None, nic=opened, piece_bytes=piece_bytes,
                                    timeout=timeout)
            else:
                try:
                    comm = await endpoint.connect(rank, cards, piece_bytes=piece_bytes, timeout=timeout,
                                                  ack_timeout=ack_timeout)
                except (KeyError, TypeError, ValueError, OverflowError) as error:
                    raise RendezvousError(f"rank {rank}: a neighbour's card is malformed: {error!r}") from None
            await client.allgather({"connected": True})  # nobody sends before its neighbour's QP is ready
        except BaseException as error:
            await failed(error)  # no goodbye: the others are told this rank failed, and why
            raise

        watched = anyio.Event()

        async def watch() -> None:
            try:
                comm.peer_failed(await client.watch())
            finally:
                watched.set()
        watcher = anyio.CancelScope()
        stack.callback(watcher.cancel)
        group.start_soon(run_in, watcher, watch)
        try:
            yield comm
        except GeneratorExit:
            raise
        except BaseException as error:
            watcher.cancel()  # the connection is fail()'s now: it reads the server's close
            with anyio.CancelScope(shield=True):
                await watched.wait()
            await failed(error)  # before the NIC's close: the others learn of it at once
            raise


def _reason(error: BaseException) -> str:
    """What a failing rank tells the others: the exception's type and message on one line."""
    message = " ".join(str(error).split())
    if isinstance(error, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


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


__all__ = ["Endpoint", "connect_ring", "join", "local", "pool_depth", "run_ranks"]
