"""The endpoint protocol over TCP: perftest's server/client mode (`bench --server` / `bench SERVER_HOST`).

`serve_tcp` listens on a port (perftest's 18515 by default) and serves one client at a time with the same request
loop as `aiofabric serve` (`serve.serve_stream`); `connect_tcp` yields a `Peer` talking to it, the same `Peer` that
`connect_peer` yields over SSH, so everything that drives a peer (`perftest.run_bench` with `config.remote`) runs
unchanged. anyio only: any backend (asyncio, uvloop, trio), no asyncssh.

Failures, each one line:
  * the port is taken: `PeerError` "port 18515 is taken on 0.0.0.0 ...";
  * a client sends bytes that are not protocol lines: the server answers the error, logs it, closes that client's
    objects and the connection, and (forever=True) accepts the next client;
  * a client disconnects mid-run: the server logs it and closes every object that client opened;
  * a second client while one is served: it is turned away at once with an error naming the busy server;
  * nothing listens at HOST:PORT: `PeerError` "no aiofabric bench server at HOST:PORT (connection refused)"; no
    answer (a firewall drops the SYN, or something that is not an aiofabric server): `PeerError` within
    `connect_timeout`.

Security: the server runs whatever requests a client sends on its NICs (no authentication, like perftest): listen
on a trusted network only.
"""
from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import socket
import time
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.abc

from . import PeerError, protocol
from ..taskgroups import own_task_group
from .client import Peer
from .serve import READ_CHUNK, serve_stream


log = logging.getLogger("aiofabric.serve")
DEFAULT_PORT = 18515  # perftest's


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address(stream: anyio.abc.SocketStream, attribute: Any) -> tuple[str, int]:
    address = stream.extra(attribute)
    return str(address[0]), int(address[1])


class _StreamCarrier:
    """A TCP connection as a `Carrier`: `receive` returns b"" at end of input."""

    def __init__(self, stream: anyio.abc.SocketStream, where: str = "") -> None:
        self.stream, self.where = stream, where

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            if not self.where:
                raise
            raise PeerError(f"{self.where}: connection lost: {type(exc).__name__}: {exc}".rstrip(": "),
                            host=self.where) from None

    async def receive(self) -> bytes:
        try:
            return await self.stream.receive(READ_CHUNK)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return b""

    def shutdown(self) -> None:
        """End the connection now, from synchronous code: the server sees end of input and frees everything."""
        with contextlib.suppress(Exception):
            self.stream.extra(anyio.abc.SocketAttribute.raw_socket).shutdown(socket.SHUT_RDWR)


async def serve_tcp(host: str = "0.0.0.0", port: int = DEFAULT_PORT, *, forever: bool = False,
                    ready: Callable[[int], Any] | None = None,
                    on_report: Callable[[dict[str, Any]], Any] | None = None,
                    on_session: Callable[[dict[str, Any]], Any] | None = None,
                    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> dict[str, Any]:
    """Listen on `host`:`port` and serve the endpoint protocol to one client at a time.

    `port` 0 lets the OS choose; the bound port goes to `ready(port)` once listening (and to `task_status`, so
    `port = await tasks.start(serve_tcp, "127.0.0.1", 0)` works). `on_report(result)` gets each result a client
    hands over with the `report` op (a coroutine function is awaited); `on_session(summary)` gets each client's
    summary when it is gone (see `serve_stream`: client, outcome, error, requests, errors, reports, objects_closed,
    objects_left). When a client leaves, for whatever reason, every object it opened is closed.

    forever=False: return after the first client, its summary plus {"port", "refused"} (clients turned away while
    it was served). forever=True: serve the next client, until cancelled.

    A taken port raises `PeerError` "port PORT is taken on HOST ...".
    """
    where = _where(host, port)
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PeerError(f"port {port} is taken on {host}: another server (aiofabric bench --server?) listens "
                            "there; stop it or pick another port (--port)", host=where) from None
        raise PeerError(f"cannot listen on {where}: {exc.strerror or exc}", host=where) from None
    bound = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
    where = _where(host, bound)
    busy_with: list[str] = []  # the client being served (at most one)
    refused = 0
    last: dict[str, Any] = {}
    done = anyio.Event()

    async def turn_away(stream: anyio.abc.SocketStream, client: str) -> None:
        nonlocal refused
        refused += 1
        log.warning("client %s turned away: busy with %s", client, busy_with[0])
        message = (f"the server at {where} is busy with a client from {busy_with[0]} (one client at a time); "
                   "try again when its run is over")
        with contextlib.suppress(Exception), anyio.move_on_after(2):
            await stream.send(protocol.encode(protocol.Answer(None, False, None, "Busy", message)))

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            client = _where(*_address(stream, anyio.abc.SocketAttribute.remote_address))
            if busy_with or done.is_set():
                await turn_away(stream, client)
                return
            busy_with.append(client)
            try:
                log.info("client %s connected", client)
                carrier = _StreamCarrier(stream)
                local_ip = _address(stream, anyio.abc.SocketAttribute.local_address)[0]
                summary = await serve_stream(carrier.receive, carrier.send, client=client, strict=True,
                                             on_report=on_report, connection_ip=local_ip)
            finally:
                busy_with.clear()
            log.info("client %s gone (%s): %d request(s), %d object(s) closed", client, summary["outcome"],
                     summary["requests"], summary["objects_closed"])
            last.clear()
            last.update(summary)
            if on_session is not None:
                outcome = on_session(summary)
                if inspect.isawaitable(outcome):
                    await outcome
            if not forever:
                done.set()

    async def handle_safely(stream: anyio.abc.SocketStream) -> None:
        try:
            await handle(stream)
        except Exception as exc:  # nothing a client does stops the server
            log.warning("client session failed: %s: %s", type(exc).__name__, exc)
            if not forever:
                done.set()

    async with listener, own_task_group() as tasks:
        log.info("aiofabric bench server listening on %s", where)
        if ready is not None:
            ready(bound)
        task_status.started(bound)
        tasks.start_soon(listener.serve, handle_safely, tasks)
        await done.wait()
        tasks.cancel_scope.cancel()
    return {**last, "port": bound, "refused": refused}


class TCPPeer(Peer):
    """A `Peer` over a TCP connection to `serve_tcp`. `handshake_s`: connect + ready message, in seconds."""

    def __init__(self, carrier: _StreamCarrier, host: str, command_timeout: float) -> None:
        self.handshake_s = 0.0
        super().__init__(carrier, host, command_timeout=command_timeout, describe_exit=self._closed,
                         stop=carrier.shutdown)

    async def _closed(self) -> str:
        return "the server closed the connection"


@contextlib.asynccontextmanager
async def connect_tcp(host: str, port: int = DEFAULT_PORT, *, connect_timeout: float = 10,
                      command_timeout: float = 60) -> AsyncIterator[TCPPeer]:
    """Connect to `serve_tcp` at `host`:`port` and talk to it as a `Peer` (`peer.host` is "HOST:PORT").

    `connect_timeout` bounds the TCP connect and the server's ready message; `command_timeout` each request.
    Nothing listening: `PeerError` "no aiofabric bench server at HOST:PORT (connection refused)"; no answer within
    `connect_timeout`: `PeerError` naming HOST:PORT and the timeout. Leaving the block (or cancelling it) closes the
    connection, and the server closes whatever this client left open.
    """
    where = _where(host, port)
    started = time.perf_counter()
    try:
        with anyio.fail_after(connect_timeout):
            stream = await anyio.connect_tcp(host, port)
    except TimeoutError:
        raise PeerError(f"no answer from {where} within {connect_timeout:g} s (connection timed out): is the "
                        "host up and the port open?", host=where) from None
    except OSError as exc:
        cause = exc if exc.errno is not None else (exc.__cause__ or exc)
        if isinstance(cause, ConnectionRefusedError):
            raise PeerError(f"no aiofabric bench server at {where} (connection refused)", host=where) from None
        reason = getattr(cause, "strerror", None) or cause
        raise PeerError(f"cannot reach {where}: {reason}", host=where) from None
    carrier = _StreamCarrier(stream, where)
    peer = TCPPeer(carrier, where, command_timeout)
    async with stream, own_task_group() as tasks:
        try:
            tasks.start_soon(peer.reader)
            left = max(0.1, connect_timeout - (time.perf_counter() - started))
            try:
                await peer.wait_ready(left, budget=connect_timeout)
            except PeerError as exc:
                if "did not start within" in str(exc):
                    raise PeerError(f"{where}: something accepted the connection but sent no aiofabric ready "
                                    f"message within {connect_timeout:g} s: not an aiofabric bench server?",
                                    host=where) from None
                raise
            peer.handshake_s = time.perf_counter() - started
            yield peer
        finally:
            carrier.shutdown()  # the server sees end of input and closes what is left
            tasks.cancel_scope.cancel()
