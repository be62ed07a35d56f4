"""The emulated NIC's debug channel, driver side: a typed client that never blocks the event loop.

The channel is a stream socket to the emulator process (made by `SimPCIDevice`, answered by aiofabric/sim/debug.py):
each request is one JSON line and gets one JSON line back, in order. Replies carry no request id, so a request given up
on (its timeout passed, or its caller was cancelled) still owes a reply; the next request skips it.

`DebugClient`'s coroutines wait for the socket with anyio (asyncio, uvloop or trio) and give up after their timeout;
`request_blocking` serves the synchronous `SimPCIDevice.debug` of tests and tools through the same state, so the two
never read each other's replies. Everything here runs in the driver's process, never in the emulator's.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import select
import socket
import time
from typing import Any, Callable, Generator

import anyio

from ..errors import PCIError

TIMEOUT = 5.0  # seconds for one request, the wait for the channel included
_READ_CHUNK = 1 << 16
_READABLE, _WRITABLE = "readable", "writable"  # what an exchange waits for


@dataclasses.dataclass(frozen=True)
class Ping:
    pid: int  # the emulator process
    name: str  # the NIC's name (SimPCIDevice.name)


@dataclasses.dataclass(frozen=True)
class Placed:
    """What one RC QP placed in memory since it was created, each message counted once however often it was
    retransmitted: WRITE (with or without immediate) and SEND by the responder, READ responses by the requester, and
    the atomics the responder executed (8 bytes each: a duplicate is answered, never executed again)."""
    write_messages: int = 0
    write_bytes: int = 0
    send_messages: int = 0
    send_bytes: int = 0
    read_messages: int = 0
    read_bytes: int = 0
    atomic_messages: int = 0
    atomic_bytes: int = 0

    def of(self, verb: str) -> tuple[int, int]:
        """(messages, bytes) placed by `verb`: "write", "send", "read" or "atomic" (atomics executed)."""
        return getattr(self, f"{verb}_messages"), getattr(self, f"{verb}_bytes")


class DebugClient:
    """The debug channel of emulated NIC `address` over `sock` (made non-blocking here). `exit_status()` is the
    emulator's exit status, or None while it runs (named in the error when the channel ends).

    Requests run one at a time (a lock in the event loop that first uses the client). Errors are `PCIError`s naming
    the NIC and the request: no answer within the timeout, the emulator gone, or the emulator's own refusal."""

    def __init__(self, sock: socket.socket, address: str, exit_status: Callable[[], int | None]) -> None:
        sock.setblocking(False)
        self.address = address
        self._sock, self._exit_status = sock, exit_status
        self._lock = anyio.Lock()
        self._buffer = b""
        self._unanswered = 0  # requests sent whose replies have not been read yet
        self._torn = ""  # why the channel is out of step for good (a request line cut off mid-way)

    # -- typed requests --------------------------------------------------------------------------------------------
    async def ping(self) -> Ping:
        reply = await self.request("ping")
        return Ping(reply["pid"], reply["name"])

    async def objects(self) -> collections.Counter[str]:
        """The firmware objects alive, by kind."""
        return collections.Counter((await self.request("objects"))["objects"])

    async def stats(self) -> collections.Counter[str]:
        """Every counter of the emulator by name (aiofabric/sim/debug.py lists them: packets_sent, retransmits, dropped,
        rx_overflow, ...; among the drops' reasons dropped_bad_source, packets to a QP from an address other than its
        peer's); a counter it does not report reads 0."""
        return collections.Counter((await self.request("stats"))["stats"])

    async def placed(self) -> collections.defaultdict[int, Placed]:
        """`Placed` per live RC QP, by QPN; a QPN it does not report (a destroyed QP) reads as nothing placed."""
        fields = [field.name for field in dataclasses.fields(Placed)]
        report = (await self.request("placed"))["qps"]
        return collections.defaultdict(Placed, {int(qpn): Placed(**{name: counts.get(name, 0) for name in fields})
                                                for qpn, counts in report.items()})

    async def inject(self, command: str, status: int, count: int = 1) -> None:
        """The next `count` firmware commands named `command` fail with `status`."""
        await self.request("inject", command=command, status=status, count=count)

    async def fault(self, kind: str, count: int = 1, offset: int = 0) -> None:
        """A deliberate placement bug for the next `count` incoming WRITE messages: "skip_placement" (ACKed, not
        placed) or "misplace" (placed `offset` bytes off). Verification must catch either."""
        await self.request("fault", kind=kind, count=count, offset=offset)

    # -- any request -------------------------------------------------------------------------------------------------
    async def request(self, op: str, timeout: float = TIMEOUT, **fields: Any) -> dict[str, Any]:
        """One request {"op": op, **fields} and its reply; the loop runs on while the emulator answers."""
        request = {"op": op, **fields}
        what = self._what(request)
        with anyio.move_on_after(timeout):
            async with self._lock:
                steps = self._exchange(request, what)
                try:
                    waiting = next(steps)
                    while True:
                        await (anyio.wait_readable if waiting == _READABLE else anyio.wait_writable)(self._sock)
                        waiting = next(steps)
                except StopIteration as done:
                    return done.value
                finally:
                    steps.close()
        raise PCIError(f"{what}: no answer within {timeout:g} s")

    def request_blocking(self, request: dict[str, Any], timeout: float = TIMEOUT) -> dict[str, Any]:
        """`request` (with its "op") and its reply, blocking the calling thread up to `timeout` seconds."""
        what = self._what(request)
        if self._lock.locked():
            raise PCIError(f"{what}: another request is under way on this channel (from the event loop)")
        deadline = time.monotonic() + timeout
        steps = self._exchange(request, what)
        try:
            waiting = next(steps)
            while True:
                sockets = [self._sock]
                ready = select.select(*((sockets, []) if waiting == _READABLE else ([], sockets)), [],
                                      max(0.0, deadline - time.monotonic()))
                if not any(ready):
                    raise PCIError(f"{what}: no answer within {timeout:g} s")
                waiting = next(steps)
        except StopIteration as done:
            return done.value
        finally:
            steps.close()

    # -- the exchange, apart from how it waits -----------------------------------------------------------------------
    def _what(self, request: dict[str, Any]) -> str:
        return f"{self.address}: debug request {request.get('op')!r}"

    def _exchange(self, request: dict[str, Any], what: str) -> Generator[str, None, dict[str, Any]]:
        """Send `request` and read its reply, yielding _READABLE or _WRITABLE whenever the socket must be waited for.
        Closed early (given up on), it leaves the channel in step: a reply still owed is skipped by the next one."""
        if self._torn:
            raise PCIError(f"{what}: the debug channel is out of step ({self._torn})")
        line = json.dumps(request).encode() + b"\n"
        sent = 0
        try:
            try:
                while sent < len(line):
                    try:
                        sent += self._sock.send(line[sent:])
                    except BlockingIOError:
                        yield _WRITABLE
            except BaseException:
                if sent:  # the emulator would read the rest of the line as the start of the next request
                    self._torn = f"a {request.get('op')!r} request was cut off after {sent} of {len(line)} bytes"
                raise
            self._unanswered += 1
            while True:
                while b"\n" in self._buffer:  # the replies of requests given up on come first
                    reply, self._buffer = self._buffer.split(b"\n", 1)
                    self._unanswered -= 1
                    if not self._unanswered:
                        return self._decode(reply, what)
                try:
                    data = self._sock.recv(_READ_CHUNK)
                except BlockingIOError:
                    yield _READABLE
                    continue
                if not data:
                    raise self._exited(what)
                self._buffer += data
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise self._exited(what) from exc
        except OSError as exc:
            raise PCIError(f"{what}: the debug channel failed ({exc})") from exc

    def _exited(self, what: str) -> PCIError:
        return PCIError(f"{what}: the emulator exited (status {self._exit_status()})")

    @staticmethod
    def _decode(line: bytes, what: str) -> dict[str, Any]:
        try:
            reply = json.loads(line)
        except ValueError:
            raise PCIError(f"{what}: the emulator answered something other than JSON: {line[:80]!r}") from None
        if "error" in reply:
            raise PCIError(f"{what} failed: {reply['error']}")
        return reply
