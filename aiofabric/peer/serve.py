"""`aiofabric serve`: the remote endpoint. Requests arrive as JSON lines on stdin, answers leave on stdout.

`serve_stream` is the request loop over any byte-stream pair: `serve` runs it on stdin/stdout, and
`aiofabric.peer.tcp.serve_tcp` on each accepted TCP connection.

The protocol (messages, operations, handles) is written down in `aiofabric.peer.protocol`. This module is its I/O
shell on the public driver API: each request runs in its own task, so several are in flight and answers leave in
the order they finish. A bad request gets an error answer; nothing a client sends crashes the endpoint. End of input
(the client closed its side, or the SSH connection dropped) closes every NIC (freeing its firmware objects) and
returns, so the process exits 0. Logs go to stderr, which `connect_peer` forwards to the client's logging.

Trust: `aiofabric serve` runs every operation a client asks for, on any NIC, with any emulator option: it is meant
to be started over SSH, whose login is the authentication. An unauthenticated TCP client (`bench --server`) is
served with a `ServerPolicy` instead: only the bench exchange, on the server's own NIC choices, within its limits.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import stat
from typing import Any, Awaitable, Callable

import anyio
import anyio.abc
import numpy

from . import pingpong, protocol
from .policy import ServerPolicy, unmapped
from .protocol import Answer, Ready
from ..errors import LimitError, NotAllowed, ParameterMismatch, ProtocolError
from ..verbs import (ALL_ACCESS, ATOMIC_ACCESS, NIC, CompletionQueue, DmaBudget, MemoryRegion, QPInfo, QueuePair,
                     RemoteRegion, open_nic)
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


class _NicSlot:
    """An open NIC lives in its own task (open_nic's block must be left by the task that entered it)."""

    def __init__(self, spec: str = "") -> None:
        self.spec = spec
        self.nic: NIC | None = None
        self.error: str | None = None  # why it failed after it opened (its block ended with an error)
        self.close_requested = anyio.Event()
        self.closed = anyio.Event()


class _Pong:
    """The server half of a latency ping-pong running in the endpoint (op pong), until pong_wait collects it."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()  # close cancels it
        self.error: Exception | None = None
        self.iterations = 0

    async def run(self, side: pingpong.Side) -> None:
        try:
            with self.scope:
                await pingpong.server(side)
                self.iterations = side.iters
            if self.scope.cancelled_caught:
                self.error = ValueError("pong: closed before it ended")
        except Exception as exc:  # pong_wait answers with it; it never ends the endpoint
            self.error = exc
        finally:
            self.done.set()


class Endpoint:
    """The objects one client created, by handle, and the operations on them. With a `policy` (an unauthenticated
    client at `client_ip`) NICs are the server's choice, their DMA memory is capped, and QPs connect only to the
    client."""

    def __init__(self, tasks: anyio.abc.TaskGroup, *, on_report: Callable[[dict[str, Any], str], Any] | None = None,
                 connection_ip: str | None = None, summary: dict[str, Any] | None = None,
                 policy: ServerPolicy | None = None, client_ip: str | None = None) -> None:
        self.tasks = tasks
        self.on_report, self.connection_ip = on_report, connection_ip
        self.summary = summary if summary is not None else {}
        self.policy, self.client_ip = policy, client_ip
        self.budget = (DmaBudget(policy.limits.memory, "server's limit per client (--max-memory)")
                       if policy is not None else None)
        self._opening = 0  # open_nic requests under way
        self._starting_pong = False  # a pong request under way (its receives being posted)
        self._reporting = 0  # report requests under way
        self.objects: dict[int, Any] = {}  # handle -> _NicSlot | CompletionQueue | QueuePair | MemoryRegion
        self.owner: dict[int, int] = {}  # handle -> handle of its NIC
        self._next_handle = 1

    def _add(self, obj: Any, nic: int | None = None) -> int:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.objects[handle] = obj
        if nic is not None:
            self.owner[handle] = nic
        return handle

    def _get(self, handle: int, kind: type, field: str) -> Any:
        obj = self.objects.get(handle)
        if isinstance(obj, _NicSlot) and kind is NIC:
            return obj.nic
        if not isinstance(obj, kind):
            raise ValueError(f"{field}: no {kind.__name__} with handle {handle}")
        return obj

    async def handle(self, request: protocol.Request) -> dict[str, Any]:
        return await getattr(self, f"op_{request.op}")(**request.args)

    async def op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    async def op_open_nic(self, spec: str = "sim", ip: str | None = None,
                          options: dict[str, Any] | None = None) -> dict[str, Any]:
        options = dict(options or {})
        if self.policy is not None:  # the server's NIC, address and capture file; the client's test faults
            open_nics = self._opening + sum(isinstance(obj, _NicSlot) for obj in self.objects.values())
            if open_nics >= self.policy.limits.nics:
                raise LimitError(f"open_nic: this client has {open_nics} NIC(s) open or opening, the server's "
                                 "limit (--max-nics): close one first")
            spec, ip = self.policy.nic, self.policy.ip or self._reached_address(self.policy.nic)
            options.update(self.policy.nic_options())
        elif ip == "ssh":  # the address the client's SSH connection reached: this host's address on that network
            try:
                ip = os.environ["SSH_CONNECTION"].split()[2]
            except (KeyError, IndexError):
                raise ValueError("open_nic: ip 'ssh' needs SSH_CONNECTION (set by sshd); this endpoint was not "
                                 "started over SSH (over TCP, use ip 'connection')") from None
        elif ip == "connection":  # the address the client's connection reached, whatever the carrier
            ssh = os.environ.get("SSH_CONNECTION", "").split()
            ip = self.connection_ip or (ssh[2] if len(ssh) > 2 else None)
            if ip is None:
                raise ValueError("open_nic: ip 'connection': this endpoint does not know the address its client "
                                 "reached (it runs neither over TCP nor over SSH)")
        slot = _NicSlot(spec)
        self._opening += 1  # counted from here: several opens at once cannot pass the limit together
        try:
            await self.tasks.start(self._run_nic, slot, spec, ip, options)
        finally:
            self._opening -= 1
        nic = slot.nic
        assert nic is not None
        info = nic.info()
        return {"nic": self._add(slot), "ip": info["ip"], "gid": info["gid"], "mac": info["mac"]}

    def _reached_address(self, spec: str) -> str | None:
        """The address the client's connection reached, for the server's NIC; None (a free 127.0.0.x) for an
        emulated NIC reached over loopback, where every server on the host would otherwise want 127.0.0.1."""
        reached = self.connection_ip
        if reached is not None and spec.startswith("sim") and unmapped(reached).is_loopback:
            return None
        return reached

    async def _run_nic(self, slot: _NicSlot, spec: str, ip: str | None, options: dict[str, Any],
                       *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        try:
            async with open_nic(spec, ip=ip, dma_budget=self.budget, **options) as nic:
                slot.nic = nic
                task_status.started()
                started = True
                await slot.close_requested.wait()
        except Exception as exc:
            if not started:
                raise  # the open_nic request answers with it
            slot.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            log.warning("NIC %s failed: %s", spec, exc)
        finally:
            slot.closed.set()

    async def op_create_cq(self, nic: int, depth: int) -> dict[str, Any]:
        cq = await self._get(nic, NIC, "nic").create_cq(depth)
        return {"cq": self._add(cq, nic)}

    async def op_create_qp(self, nic: int, cq: int, sq_depth: int, rq_depth: int,
                           max_inline_data: int) -> dict[str, Any]:
        queue = self._get(cq, CompletionQueue, "cq")
        qp = await self._get(nic, NIC, "nic").create_qp(queue, sq_depth=sq_depth, rq_depth=rq_depth,
                                                        max_inline_data=max_inline_data)
        return {"qp": self._add(qp, nic), "info": qp.info().to_dict()}

    async def op_register_mr(self, nic: int, size: int, atomic: bool) -> dict[str, Any]:
        mr = await self._get(nic, NIC, "nic").register_mr(size, ATOMIC_ACCESS if atomic else ALL_ACCESS)
        return {"mr": self._add(mr, nic), "region": mr.remote().to_dict()}

    def _range(self, mr: int, offset: int, length: int | None) -> memoryview:
        region = self._get(mr, MemoryRegion, "mr")
        length = region.length - offset if length is None else length
        if offset + length > region.length or length < 0:
            raise ValueError(f"{length} bytes at offset {offset} exceed the {region.length}-byte memory region")
        return region.view[offset:offset + length]

    async def op_fill(self, mr: int, seed: int | None, byte: int, offset: int, length: int | None) -> dict[str, Any]:
        view = self._range(mr, offset, length)
        if seed is not None:
            protocol.fill_pattern(view, seed)
        elif not 0 <= byte <= 255:
            raise ValueError(f"fill: byte must be in [0, 255], not {byte}")
        else:
            numpy.frombuffer(view, numpy.uint8)[:] = byte  # in place: no copy the size of the range
        return {"sha256": protocol.sha256_hex(view)}

    async def op_sha256(self, mr: int, offset: int, length: int | None) -> dict[str, Any]:
        return {"sha256": protocol.sha256_hex(self._range(mr, offset, length))}

    async def op_connect_qp(self, qp: int, peer: dict[str, Any], mtu: int, timeout: int,
                            retry_cnt: int, atomic: bool) -> dict[str, Any]:
        queue_pair = self._get(qp, QueuePair, "qp")
        if self.policy is not None:
            self.policy.check_peer(peer["gid"], self.client_ip or "")
        if atomic:
            await queue_pair.to_init(ATOMIC_ACCESS)
        await queue_pair.connect(QPInfo.from_dict(peer), mtu=mtu, timeout=timeout, retry_cnt=retry_cnt)
        return {"state": queue_pair.state.name}

    async def op_post(self, qp: int, verb: str, mr: int, size: int | None, local_offset: int,
                      remote: dict[str, Any] | None, remote_offset: int, imm: int | None,
                      deadline: float | None) -> dict[str, Any]:
        queue_pair, local = self._get(qp, QueuePair, "qp"), self._get(mr, MemoryRegion, "mr")
        with anyio.fail_after(deadline):
            if verb in ("send", "recv"):
                options = {"imm": imm} if verb == "send" else {}
                completion = await getattr(queue_pair, verb)(local, size, local_offset=local_offset, **options)
            else:
                target = RemoteRegion.from_dict(remote or {})
                extra = (imm,) if verb == "write_with_imm" else ()
                completion = await getattr(queue_pair, verb)(local, target, *extra, size, local_offset=local_offset,
                                                             remote_offset=remote_offset)
        return {"byte_len": completion.byte_len, "imm": completion.imm}

    async def op_post_recvs(self, qp: int, mr: int, count: int, size: int, offset: int,
                            stride: int | None) -> dict[str, Any]:
        queue_pair, local = self._get(qp, QueuePair, "qp"), self._get(mr, MemoryRegion, "mr")
        step = size if stride is None else stride
        for i in range(count):  # each waits for receive-queue space, never overwrites; failures show at the sender
            await queue_pair.post_recv(local, size, local_offset=offset + i * step)
        return {"posted": count}

    async def op_close(self, handle: int) -> dict[str, Any]:
        obj = self.objects.get(handle)
        if obj is None:
            raise ValueError(f"close: no object with handle {handle}")
        if isinstance(obj, _NicSlot):
            obj.close_requested.set()
            with anyio.fail_after(30):
                await obj.closed.wait()
            for child in [h for h, owner in self.owner.items() if owner == handle]:
                self.objects.pop(child, None)
                self.owner.pop(child, None)
        elif isinstance(obj, (QueuePair, CompletionQueue)):
            await obj.destroy()
        elif isinstance(obj, _Pong):
            obj.scope.cancel()
            await obj.done.wait()
        else:
            await obj.deregister()
        self.objects.pop(handle, None)
        self.owner.pop(handle, None)
        return {"closed": handle}

    async def op_nic_status(self, nic: int, probe: float) -> dict[str, Any]:
        from ..verbs import silence
        slot = self.objects.get(nic)
        if not isinstance(slot, _NicSlot):
            raise ValueError(f"nic: no NIC with handle {nic}")
        if slot.nic is None:
            return {"nic": slot.spec, "stopped": slot.error or "it is not open"}
        name = slot.nic.pci.address
        if slot.error is not None or slot.closed.is_set():
            return {"nic": name, "stopped": slot.error or "its session ended"}
        return {"nic": name, "stopped": await silence(slot.nic, probe)}

    async def op_lat_params(self, test: str, size: int, mtu: int, iters: int, warmup: int) -> dict[str, Any]:
        if self.policy is not None:
            self.policy.check_params({"test": test, "size": size, "mtu": mtu})
        return {"test": test, "size": size, "mtu": mtu, **(self.policy.expect if self.policy else {})}

    async def op_pong(self, qp: int, mr: int, test: str, size: int, iters: int, wait: float, warmup: int,
                      remote: dict[str, Any] | None, rx_slots: int, inline: bool) -> dict[str, Any]:
        # one server half per client at a time: each is a background task polling a QP until its wait runs out
        if self.policy is not None and (self._starting_pong or any(isinstance(obj, _Pong)
                                                                   for obj in self.objects.values())):
            raise NotAllowed("pong: a ping-pong is already running for this client: pong_wait for it first")
        queue_pair = self._get(qp, QueuePair, "qp")
        if rx_slots > queue_pair.recv_queue.depth:
            raise ValueError(f"pong: {rx_slots} receive slots exceed the QP's receive queue "
                             f"({queue_pair.recv_queue.depth})")
        side = pingpong.Side("server", test, queue_pair, self._get(mr, MemoryRegion, "mr"), size, warmup, iters, wait,
                             None if remote is None else RemoteRegion.from_dict(remote), rx_slots, inline)
        self._starting_pong = True  # from here: two pongs at once cannot both pass the check above
        try:
            with anyio.fail_after(wait):  # posting the receives waits for room only as long as a ping may take
                await side.prepare()
            pong = _Pong()
            self.tasks.start_soon(pong.run, side)
            return {"pong": self._add(pong, self.owner.get(qp))}
        finally:
            self._starting_pong = False

    async def op_pong_wait(self, pong: int) -> dict[str, Any]:
        running = self._get(pong, _Pong, "pong")
        await running.done.wait()
        self.objects.pop(pong, None)
        self.owner.pop(pong, None)
        if running.error is not None:
            raise running.error
        return {"iterations": running.iterations}

    async def op_report(self, result: dict[str, Any]) -> dict[str, Any]:
        # each is printed on the server; a report the server refused (on_report raised) is not counted
        if self.policy is not None and self.summary.get("reports", 0) + self._reporting >= 1:
            raise NotAllowed("report: a client reports its run once")
        self._reporting += 1
        try:
            result = protocol.printable_tree(result)  # whoever shows it shows text, never the client's escape codes
            if self.on_report is None:
                log.info("the client reported: %s", result)
            else:
                outcome = self.on_report(result, self.summary.get("client", ""))
                if inspect.isawaitable(outcome):
                    await outcome
        finally:
            self._reporting -= 1
        self.summary["reports"] = self.summary.get("reports", 0) + 1
        return {"reported": True}

    async def close_all(self) -> None:
        for pong in [obj for obj in self.objects.values() if isinstance(obj, _Pong)]:
            pong.scope.cancel()  # a server half would otherwise poll for pings until its wait ran out
        for slot in [obj for obj in self.objects.values() if isinstance(obj, _NicSlot)]:
            slot.close_requested.set()
        for slot in [obj for obj in self.objects.values() if isinstance(obj, _NicSlot)]:
            await slot.closed.wait()
        self.objects.clear()
        self.owner.clear()


Receive = Callable[[], Awaitable[bytes]]  # the next bytes from the client; b"" at end of input
Send = Callable[[bytes], Awaitable[None]]
_GONE = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)  # the client's side of the carrier is gone


def _reason(exc: BaseException) -> str:
    """One line on why a write failed: anyio's BrokenResourceError says nothing itself; its cause (the socket's
    error) does."""
    cause = exc.__cause__ if not str(exc) and isinstance(exc.__cause__, Exception) else exc
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


async def serve_stream(receive: Receive, send: Send, *, client: str = "", policy: ServerPolicy | None = None,
                       client_ip: str | None = None, on_report: Callable[[dict[str, Any], str], Any] | None = None,
                       connection_ip: str | None = None) -> dict[str, Any]:
    """Serve the endpoint protocol to one client over any byte-stream pair until end of input; then close every
    object it opened and return a summary of the session.

    `receive()` returns the next bytes (b"" at end of input); `send(data)` writes. `client` names the other side in
    logs ("" for stdin). `on_report(result, client)` gets the `result` of each `report` request, every string in it escaped
    (`protocol.printable`); it may be a coroutine function.
    `connection_ip`: the address the client's connection reached, for open_nic's ip "connection".

    `policy` (an unauthenticated TCP client, connected from `client_ip`): only the bench exchange
    (`protocol.BENCH`), NICs as the policy says, within its limits: a request past `in_flight` or a refused one
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
    profile = protocol.PROFILES[policy.tool] if policy is not None else protocol.ENDPOINT
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
