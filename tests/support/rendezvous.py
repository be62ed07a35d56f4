"""A collectives rendezvous in this process (`serving`), and ranks that meet there and leave (`meet`)."""
import contextlib
from typing import Any, AsyncIterator

import anyio
import anyio.abc

from aiofabric.collectives.rendezvous import RendezvousClient, RendezvousServer


@contextlib.asynccontextmanager
async def serving(size: int, timeout: float = 10) -> AsyncIterator[tuple[RendezvousServer, int]]:
    """A rendezvous for `size` ranks on a free port of 127.0.0.1: (server, port). It stops with the block if it has
    not stopped before."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    server = RendezvousServer(size, timeout)
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve, listener)
        yield server, listener.extra(anyio.abc.SocketAttribute.local_port)
        group.cancel_scope.cancel()


async def meet(port: int, size: int, timeout: float) -> list[Any]:
    """`size` ranks (clients with `timeout`) meet at the rendezvous on `port`: each gathers the cards {"me": rank},
    then an empty round, and leaves. The cards each rank got."""
    cards: list[Any] = [None] * size

    async def rank(r: int) -> None:
        client = RendezvousClient("127.0.0.1", port, r, size, timeout)
        try:
            cards[r] = await client.allgather({"me": r})
            await client.allgather({})
        finally:
            await client.aclose()
    async with anyio.create_task_group() as job:
        for r in range(size):
            job.start_soon(rank, r)
    return cards
