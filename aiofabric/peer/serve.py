"""`aiofabric serve`: the remote endpoint. Requests arrive as JSON lines on stdin, answers leave on stdout.

`serve_stream` is the request loop over any byte-stream pair: `serve` runs it on stdin/stdout, and
`aiofabric.peer.tcp.serve_tcp` on each accepted TCP connection.

The protocol is written down in `aiofabric.peer.protocol` (messages, handles) and `aiofabric.peer.operations` (what
a request may ask); each request is run by an `Endpoint` (`aiofabric.peer.endpoint`, the handlers). This module is
the session around them: each request runs in its own task, so several are in flight and answers leave in the
order they finish. A bad request gets an error answer; nothing a client sends crashes the endpoint. End of input
(the client closed its side, or the SSH connection dropped) closes every NIC (freeing its firmware objects) and
returns, so the process exits 0. Logs go to stderr, which `connect_peer` forwards to the client's logging.

Trust: `aiofabric serve` runs every operation a client asks for, on any NIC, with any emulator option: it is meant
to be started over SSH, whose login is the authentication. An unauthenticated TCP client (`bench --server`) is
served with a `ServerPolicy` instead: only the bench exchange, on the server's own NIC choices, within its limits.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
from typing import Any, Awaitable, Callable

import anyio
import anyio.abc

from . import protocol
from .endpoint import Endpoint, OnReport
from .operations import ENDPOINT, PROFILES
from .policy import ServerPolicy
from .protocol import Answer, Ready
from ..errors import LimitError, NotAllowed, ParameterMismatch, ProtocolError
from ..version import __version__

log = logging.getLogger("aiofabric.serve")
READ_CHUNK = 1 << 16
EOF_GRACE = 1.0  # seconds the requests in flight at the end of input get to finish and be answered
LOGGED_REFUSALS = 20  # per client


class _Fd:
    """A pipe, socket or terminal fd read and written without blocking the event loop (any anyio backend).
    A regular file (stdin redirected from one) cannot be polled: it is read in a worker thread instead."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pollable = not stat.S_ISREG(os.fstat(fd).st_mode)
        if self.pollable:
            os.set_blocking(fd, False)

    async def read(self) -> bytes:
        if not self.pollable:
            return await anyio.to_thread.run_sync(os.read, self.fd, READ_CHUNK, abandon_on_cancel=True)
        while True:
            try:
                return os.read(self.fd, READ_CHUNK)
            except BlockingIOError:
                await anyio.wait_readable(self.fd)

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                await anyio.wait_writable(self.fd)


Receive = Callable[[], Awaitable[bytes]]  # the next bytes from the client; b"" at end of input
Send = Callable[[bytes], Awaitable[None]]
_GONE = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)  # the client's side of the carrier is gone


def _reason(exc: BaseException) -> str:
    """One line on why a write failed: anyio's BrokenResourceError says nothing itself; its cause (the socket's
    error) does."""
    cause = exc.__cause__ if not str(exc) and isinstance(exc.__cause__, Exception) else exc
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


async def serve_stream(receive: Receive, send: Send, *, client: str = "", policy: ServerPolicy | None = None,
                       client_ip: str | None = None, on_report: OnReport | None = None,
                       connection_ip: str | None = None) -> dict[str, Any]:
    """Serve the endpoint protocol to one client over any byte-stream pair until end of input; then close every
    object it opened and return a summary of the session.

    `receive()` returns the next bytes (b"" at end of input); `send(data)` writes. `client` names the other side in
    logs ("" for stdin). `on_report(result, client)` gets the `result` of each `report` request, every string in it
    escaped (`protocol.printable`); it may be a coroutine function. `connection_ip`: the address the client's
    connection reached, for open_nic's ip "connection".

    `policy` (an unauthenticated TCP client, connected from `client_ip`): only the bench exchange
    (`operations.BENCH`), NICs as the policy says, within its limits: a request past `in_flight` or a refused one
    gets an error answer (and a log line); a client that sends no request, or reads no answer, for `idle` seconds
    is dropped, and so is one that sends bytes that are not JSON-object lines (after their error answer); a
    disconnect with objects open is logged as a warning.

    Requests in flight when the session ends are answered "Cancelled" (unless the client cannot read).

    Summary: {"client", "outcome" ("end of input", "disconnected mid-run", "non-protocol bytes", "connection lost",
    "cannot answer", "idle", "not reading"), "error" (a one-line description, or None), "requests", "errors", "refused",
    "reports", "objects_closed", "objects_left"}.
    """
    strict = policy is not None
    limits = policy.limits if policy is not None else None
    profile = PROFILES[policy.tool] if policy is not None else ENDPOINT
    max_depth = limits.depth if limits is not None else protocol.MAX_DEPTH
    write_lock = anyio.Lock()
    stop = anyio.Event()
    in_flight = [0]
    unanswered: dict[int, protocol.Request] = {}  # by a token of ours (a client may reuse ids): answered at the end
    tokens = itertools.count()
    drained = [anyio.Event()]  # set while nothing is unanswered
    drained[0].set()
    last_request = [anyio.current_time()]
    written = [anyio.Event()]  # set while no answer is being written
    written[0].set()
    summary: dict[str, Any] = {"client": client, "outcome": "end of input", "error": None, "requests": 0,
                               "errors": 0, "refused": 0, "reports": 0, "objects_closed": 0, "objects_left": 0}
    who = f"client {client}" if client else "the client"

    def finish(outcome: str, error: str | None = None) -> None:
        if not stop.is_set():
            summary["outcome"], summary["error"] = outcome, error
            stop.set()

    async def send_line(line: bytes) -> None:
        async with write_lock:
            if limits is None:
                await send(line)
                return
            written[0] = anyio.Event()  # the idle clock stops: the server is not reading meanwhile
            try:
                with anyio.move_on_after(limits.idle) as waited:  # a client that reads nothing cannot hold us
                    await send(line)
            finally:
                last_request[0] = anyio.current_time()
                written[0].set()
            if waited.cancelled_caught:
                finish("not reading", f"{who} read no answer for {limits.idle:g} s; dropped it")

    def refused(request_id: int | None, exc: BaseException) -> None:
        summary["refused"] += 1  # the log shows the first few: a client cannot flood the server's log
        if summary["refused"] <= LOGGED_REFUSALS:
            log.warning("%s: refused request %s: %s%s", who, request_id, protocol.printable(str(exc), 400),
                        "; further refusals are counted, not logged" * (summary["refused"] == LOGGED_REFUSALS))

    async def answer_error(request_id: int | None, exc: BaseException) -> None:
        summary["errors"] += 1
        if isinstance(exc, (NotAllowed, LimitError)):
            refused(request_id, exc)
        try:
            await send_line(protocol.encode(protocol.error_answer(request_id, exc)))
        except _GONE as gone:
            finish("cannot answer", f"{who}: cannot answer: {_reason(gone)}")

    def answered(token: int) -> None:
        unanswered.pop(token, None)
        if not unanswered:
            last_request[0] = anyio.current_time()  # the idle clock restarts once the client has its last answer
            drained[0].set()

    async def run(endpoint: Endpoint, request: protocol.Request, token: int) -> None:
        # in flight until its answer is written: a client that reads no answers then meets --max-requests, and the
        # server stops reading it, instead of holding a task and an answer for every line it sends
        try:
            await respond(endpoint, request, token)
        finally:
            in_flight[0] -= 1

    async def respond(endpoint: Endpoint, request: protocol.Request, token: int) -> None:
        try:
            answer = Answer(request.id, True, await endpoint.handle(request))
        except Exception as exc:  # every failure is an answer, never a crash
            log.debug("request %d (%s) failed", request.id, request.op, exc_info=True)
            if isinstance(exc, (NotAllowed, LimitError)):
                refused(request.id, exc)
            answer = protocol.error_answer(request.id, exc)
        if not answer.ok:
            summary["errors"] += 1
        try:
            line = protocol.encode(answer)
        except (ProtocolError, TypeError, ValueError) as exc:
            line = protocol.encode(protocol.error_answer(request.id, exc))
        try:
            await send_line(line)
        except _GONE as exc:  # the client is gone (broken pipe): stop as at end of input
            if not strict:
                log.warning("cannot answer request %d: %s; stopping", request.id, _reason(exc))
            if endpoint.objects:  # what reading would have found a moment later (which side notices first is luck)
                finish("disconnected mid-run", f"{who} disconnected mid-run (cannot answer request {request.id}: "
                                               f"{_reason(exc)}; {len(endpoint.objects)} object(s) open); "
                                               "closed them")
            else:
                finish("cannot answer", f"{who}: cannot answer request {request.id}: {_reason(exc)}")
        if answer.error_type == ParameterMismatch.__name__:  # told the client; the two cannot run this test together
            finish("parameters differ", answer.error_message)
        answered(token)  # or never will be: the session ends without answers

    async def watch_idle(idle: float) -> None:
        """Drop a client that sends no complete request for `idle` s (bytes that never end a line do not count) while
        none of its requests is running and no answer is being written: one the server is still working on (an
        open_nic on a loaded host) is not the client's idleness, and each request's own waits are bounded; nor is a
        write the client does not take (the server reads nothing meanwhile): send_line's own clock drops that client
        ("read no answer"), so one clock, not the first of two, names what happened."""
        while not stop.is_set():
            if unanswered:
                await drained[0].wait()
                continue
            if not written[0].is_set():
                await written[0].wait()
                continue
            left = last_request[0] + idle - anyio.current_time()
            if left <= 0:
                finish("idle", f"{who} sent no request for {idle:g} s; dropped it")
                return
            await anyio.sleep(left)

    async def read_until_end(requests: anyio.abc.TaskGroup, endpoint: Endpoint) -> None:
        lines = protocol.LineBuffer(limits.line if limits is not None else protocol.MAX_LINE)
        while not stop.is_set():
            try:
                data = await receive()
            except _GONE as exc:
                finish("connection lost", f"{who}: connection lost: {type(exc).__name__}: {exc}")
                return
            if not data:
                break
            while True:  # the lines of `data`; after an overlong one, those behind it
                try:
                    batch, overlong = lines.feed(data), None
                except protocol.NotProtocolError as exc:
                    batch, overlong = exc.lines, exc
                if not await handle_lines(requests, endpoint, batch):
                    return
                if overlong is None or stop.is_set():
                    break
                await answer_error(None, overlong)
                if strict:
                    finish("non-protocol bytes", f"{who} sent non-protocol bytes ({overlong}); dropped it")
                    return
                data = b""
        with anyio.move_on_after(EOF_GRACE):  # a client that only closed its sending side still reads its answers
            await drained[0].wait()
        if endpoint.objects or unanswered:
            finish("disconnected mid-run", f"{who} disconnected mid-run ({len(unanswered)} request(s) in flight, "
                                           f"{len(endpoint.objects)} object(s) open); closed them")
        finish("end of input")

    async def handle_lines(requests: anyio.abc.TaskGroup, endpoint: Endpoint, batch: list[bytes]) -> bool:
        """Start a task per request in `batch`, answering the bad ones; False once the client is to be dropped (or
        the session is over: an answer that cannot be written ends it, and the rest of a batch is not read)."""
        for line in batch:
            if stop.is_set():
                return False
            last_request[0] = anyio.current_time()
            try:
                request = protocol.decode_request(line, profile, max_depth)
            except ProtocolError as exc:
                await answer_error(exc.request_id, exc)
                if strict and isinstance(exc, protocol.NotProtocolError):
                    finish("non-protocol bytes", f"{who} sent non-protocol bytes ({exc}); dropped it")
                    return False
                continue
            summary["requests"] += 1
            if limits is not None and in_flight[0] >= limits.in_flight:
                await answer_error(request.id, LimitError(
                    f"{request.op}: {in_flight[0]} requests of this client are in flight, the server's limit "
                    "(--max-requests): wait for their answers"))
                continue
            in_flight[0] += 1
            token = next(tokens)
            unanswered[token] = request
            if drained[0].is_set():
                drained[0] = anyio.Event()
            requests.start_soon(run, endpoint, request, token)
        return True

    async with anyio.create_task_group() as nics:  # NIC tasks outlive request tasks: closed last
        endpoint = Endpoint(nics, on_report=on_report, connection_ip=connection_ip, summary=summary, policy=policy,
                            client_ip=client_ip)
        try:
            async with anyio.create_task_group() as requests:
                ready = Ready(protocol.PROTOCOL_VERSION, __version__, os.getpid(),
                              limits.idle if limits is not None else None)
                try:
                    await send_line(protocol.encode(ready))
                except _GONE as exc:
                    log.warning("cannot write to the client: %s", _reason(exc))
                    finish("cannot answer", f"{who}: cannot write to it: {_reason(exc)}")
                    return summary
                requests.start_soon(read_until_end, requests, endpoint)
                if limits is not None:
                    requests.start_soon(watch_idle, limits.idle)
                await stop.wait()
                requests.cancel_scope.cancel()
            if summary["outcome"] not in ("connection lost", "cannot answer", "not reading"):
                why = summary["error"] or "the client ended its input"
                with anyio.move_on_after(1), contextlib.suppress(*_GONE):  # best effort: the client may be gone
                    for request in unanswered.values():
                        await send(protocol.encode(Answer(request.id, False, None, "Cancelled",
                                                          f"{request.op} was cut short: {why}")))
        finally:
            summary["objects_closed"] = len(endpoint.objects)
            with anyio.CancelScope(shield=True), anyio.move_on_after(60), contextlib.suppress(Exception):
                await endpoint.close_all()
            summary["objects_left"] = len(endpoint.objects)
            nics.cancel_scope.cancel()
    if summary["error"] and (strict or summary["outcome"] == "connection lost"):
        log.warning("%s", summary["error"])  # one line: who, what happened, that its objects were closed
    log.debug("%s: every object closed", summary["outcome"])
    return summary


async def serve(input_fd: int = 0, output_fd: int = 1) -> None:
    """Answer requests from `input_fd` on `output_fd` until end of input, then close every object and return."""
    reader, writer = _Fd(input_fd), _Fd(output_fd)
    await serve_stream(reader.read, writer.write)
