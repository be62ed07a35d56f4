"""The two halves of perftest's latency ping-pong (ib_write_lat, ib_send_lat) over one connected RC QP each.

The client stamps and posts a ping and waits for the pong; the server waits for the ping and answers. Both halves
run in `aiofabric lat` on one host; with a server host, the server half runs in its endpoint (op "pong",
aiofabric/peer/operations.py), so a ping's round trip never crosses the control connection.

- WRITE: each side writes `size` bytes into [size, 2*size) of the other side's region and polls the LAST byte of
  its own [size, 2*size) until it holds the iteration's value (`value(i)`). No receive is involved.
- SEND: the same with SENDs into receives posted ahead (`rx_slots` of them, at [size * (1 + k)) of its region).

Every wait is bounded by `wait` seconds: a message that never arrives ends in a TimeoutError naming the side and the
iteration, never a hang (the message is made only then: the timed path formats nothing). One send in SIGNAL_EVERY is
signaled and awaited SIGNAL_EVERY iterations later, so a failed send raises without putting a completion wait in the
timed path.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Awaitable, Callable

import anyio
import anyio.lowlevel

from ..verbs import Completion, MemoryRegion, QueuePair, RemoteRegion

SIGNAL_EVERY = 16
TESTS = ("write", "send")  # the tests with a server half (READ is one-sided)


def value(i: int) -> int:
    """The last byte of iteration i's message: consecutive iterations differ, and none equals the initial 0 byte."""
    return i % 255 + 1


def stamp(view: memoryview, size: int, i: int) -> None:
    """Make iteration i's message its own: the iteration in its first bytes, value(i) in its last."""
    head = min(4, size - 1)
    if head:
        view[:head] = (i & 0xFFFFFFFF).to_bytes(4, "little")[:head]
    view[size - 1] = value(i)


def iteration(i: int, warmup: int, iters: int) -> str:
    """Message i's name in errors: a warm-up one or a measured one, counted from 1."""
    return f"warm-up iteration {i + 1}/{warmup}" if i < warmup else f"iteration {i - warmup + 1}/{iters}"


def landed(test: str, size: int, total: int, rx_slots: int) -> int:
    """Where a side's last incoming message (of `total`) landed in its region: [size, 2*size) for WRITE, the
    receive slot it used for SEND."""
    return size if test == "write" else size * (1 + (total - 1) % rx_slots)


async def bounded(awaitable: Awaitable[Any], seconds: float, what: Callable[[], str]) -> Any:
    """`await awaitable`, or TimeoutError("<what()> within N s") once `seconds` have passed."""
    with anyio.move_on_after(seconds):
        return await awaitable
    raise TimeoutError(f"{what()} within {seconds:.3g} s")


@dataclasses.dataclass
class Side:
    """One end of the ping-pong: its QP and region, the other side's region (WRITE), the run's shape."""
    name: str  # "client" or "server", in error messages
    test: str  # "write" or "send"
    qp: QueuePair
    mr: MemoryRegion
    size: int
    warmup: int
    iters: int
    wait: float  # seconds one message may take
    theirs: RemoteRegion | MemoryRegion | None = None  # WRITE: where this side's messages land
    rx_slots: int = 0  # SEND: receives posted ahead
    inline: bool = False  # post the messages inline (-I)
    receives: list[Completion] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.test not in TESTS:
            raise ValueError(f"a ping-pong runs {' or '.join(TESTS)}, not {self.test!r}")
        need = self.size * (2 if self.test == "write" else 1 + self.rx_slots)
        if not 1 <= self.size or self.mr.length < need:
            raise ValueError(f"{self.name}: a {self.test} ping-pong of {self.size} B needs a region of {need} "
                             f"bytes, not {self.mr.length}")
        if self.test == "write" and self.theirs is None:
            raise ValueError(f"{self.name}: a write ping-pong needs the other side's region")
        if self.test == "send" and self.rx_slots < 1:
            raise ValueError(f"{self.name}: a send ping-pong needs receive slots")

    @property
    def total(self) -> int:
        return self.warmup + self.iters

    def iteration(self, i: int) -> str:
        return iteration(i, self.warmup, self.iters)

    @property
    def other(self) -> str:
        return "pong" if self.name == "client" else "ping"

    async def prepare(self) -> None:
        """SEND: the receives posted ahead, before either side sends."""
        for i in range(min(self.rx_slots, self.total) if self.test == "send" else 0):
            await self._post_recv(i)

    async def _post_recv(self, i: int) -> None:
        self.receives.append(await self.qp.post_recv(self.mr, self.size,
                                                     local_offset=self.size * (1 + i % self.rx_slots)))

    def post(self, i: int, signaled: bool) -> Awaitable[Completion]:
        if self.test == "write":
            return self.qp.post_write(self.mr, self.theirs, self.size, remote_offset=self.size,  # type: ignore[arg-type]
                                      signaled=signaled, inline=self.inline)
        return self.qp.post_send(self.mr, self.size, signaled=signaled, inline=self.inline)

    async def arrived(self, i: int) -> None:
        """Wait for the other side's message i."""
        if self.test == "write":
            return await poll_last_byte(self.mr.view, 2 * self.size - 1, value(i), self.qp, self.wait,
                                        lambda: f"{self.name}: {self.iteration(i)}: the {self.other} (an RDMA WRITE "
                                                f"into the {self.name}'s buffer) did not arrive")
        completion = await bounded(self.receives[i], self.wait, lambda: f"{self.name}: {self.iteration(i)}: the "
                                                                        f"{self.other} (a SEND) did not arrive")
        if completion.byte_len != self.size:
            raise ValueError(f"{self.name}: {self.iteration(i)}: received {completion.byte_len} bytes, sent "
                             f"{self.size}")
        if i + self.rx_slots < self.total:
            await self._post_recv(i + self.rx_slots)


async def poll_last_byte(view: memoryview, index: int, expected: int, qp: QueuePair, seconds: float,
                         what: Callable[[], str]) -> None:
    """Spin until view[index] == expected, as ib_write_lat polls its buffer, yielding to the event loop and giving
    the CPU away (sched_yield) between reads: a pure spin starves the NIC processes on a machine with few cores (the
    emulated NICs run on the host's CPUs), and its numbers then swing between sub-ms and a scheduler slice.
    TimeoutError past `seconds`."""
    if view[index] == expected:
        return
    checkpoint, clock, give_away = anyio.lowlevel.checkpoint, time.perf_counter, os.sched_yield
    deadline = clock() + seconds
    while view[index] != expected:
        give_away()
        await checkpoint()
        if qp.error is not None:  # the QP failed (retries exhausted, ...): the byte will never come
            raise qp.error
        if clock() > deadline:
            raise TimeoutError(f"{what()} within {seconds:.3g} s (the last byte of the target still holds "
                               f"{view[index]}, expected {expected})")


class _Sends:
    """A side's send completions: one in SIGNAL_EVERY signaled, awaited SIGNAL_EVERY iterations later."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.previous: tuple[int, Any] | None = None

    def signaled(self, i: int) -> bool:
        return i % SIGNAL_EVERY == SIGNAL_EVERY - 1 or i == self.side.total - 1

    async def posted(self, i: int, completion: Any) -> None:
        if not self.signaled(i):
            return
        await self.drain()
        self.previous = (i, completion)

    async def drain(self) -> None:
        if self.previous is not None:
            j, completion = self.previous
            self.previous = None
            await bounded(completion, self.side.wait,
                          lambda: f"{self.side.name}: {self.side.iteration(j)}: the NIC did not complete its send")


async def client(side: Side) -> list[float]:
    """The timed half: stamp and post ping i, wait for pong i. One-way latencies (RTT/2, us) of the measured
    iterations."""
    view, sends, clock, samples = side.mr.view, _Sends(side), time.perf_counter, []
    for i in range(side.total):
        stamp(view, side.size, i)
        started = clock()
        completion = await bounded(side.post(i, sends.signaled(i)), side.wait,
                                   lambda: f"client: {side.iteration(i)}: no room to post the ping")
        await side.arrived(i)
        rtt = clock() - started
        if i >= side.warmup:
            samples.append(rtt / 2 * 1e6)
        await sends.posted(i, completion)
    await sends.drain()
    return samples


async def server(side: Side) -> None:
    """The answering half: wait for ping i, stamp and post pong i."""
    view, sends = side.mr.view, _Sends(side)
    for i in range(side.total):
        await side.arrived(i)
        stamp(view, side.size, i)
        completion = await bounded(side.post(i, sends.signaled(i)), side.wait,
                                   lambda: f"server: {side.iteration(i)}: no room to post the pong")
        await sends.posted(i, completion)
    await sends.drain()
