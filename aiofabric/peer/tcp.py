"""The endpoint protocol over TCP: perftest's server/client mode (`bench|lat --server` / `bench|lat SERVER_HOST`).

`serve_tcp` listens on a port (perftest's 18515 by default) and serves one client at a time with the same request
loop as `aiofabric serve` (`serve.serve_stream`); `connect_tcp` yields a `Peer` talking to it, the same `Peer` that
`connect_peer` yields over SSH, so everything that drives a peer (`perftest.run_bench` with `config.remote`) runs
unchanged. anyio only: any backend (asyncio, uvloop, trio), no asyncssh.

Failures, each one line:
  * the port is taken: `PeerError` "port 18515 is taken on 0.0.0.0 ...";
  * a client sends bytes that are not protocol lines: the server answers the error, logs it, closes that client's
    objects and the connection, and (forever=True) accepts the next client;
  * a client disconnects mid-run, or sends no request for the idle timeout: the server logs it and closes every
    object that client opened;
  * a second client while one is served: it is turned away at once with an error naming the busy server (at
    most TURNED_AWAY_HELD of them get that goodbye at once; a flood beyond it is closed without one);
  * accept fails for want of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM: a flood of connections): the server
    logs it once, waits ACCEPT_BACKOFF and accepts again; the client being served is not disturbed;
  * nothing listens at HOST:PORT: `PeerError` "no aiofabric server (bench or lat --server) at HOST:PORT (connection
    refused)"; no answer (a firewall drops the SYN, or something that is not an aiofabric server): `PeerError`
    within `connect_timeout`.

Security: there is no authentication (like perftest), so a client runs only the test. The server's
`ServerPolicy` (aiofabric.peer.policy) decides its NIC, addresses and capture files and bounds each client (NICs,
DMA memory, requests in flight, line length, JSON nesting, idle time); a client may send only the bench exchange
(`operations.BENCH`), and a server QP connects only to the address the client's connection came from.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import ipaddress
import logging
import socket
import time
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.abc

from . import protocol
from .client import Peer
from .endpoint import OnReport
from .policy import ServerPolicy
from .serve import READ_CHUNK, serve_stream
from ..errors import PeerError
from ..util.taskgroups import own_task_group, run_in

log = logging.getLogger("aiofabric.serve")
DEFAULT_PORT = 18515  # perftest's
# accept(2) errors that say "not now" rather than "never" (trio's and anyio's serve loops leave them to the caller):
# out of descriptors (per process, system-wide) or kernel memory. The connections wait in the backlog meanwhile.
ACCEPT_RETRY = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_BACKOFF = 0.1  # seconds between accept attempts while they fail so
SEND_BUFFER = 64 << 10  # SO_SNDBUF of a served connection (the kernel doubles it): answers written ahead of the client
TURNED_AWAY_HELD = 16  # turned-away connections held at once for their goodbye; beyond, closed at once
LOGGED_TURNED_AWAY = 20  # turned-away clients logged one by one; then counted


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cause(exc: OSError) -> OSError:
    """The error behind anyio's connect failure (which wraps the per-address errors of a multi-address connect)."""
    cause = exc if exc.errno is not None else (exc.__cause__ or exc)
    return cause if isinstance(cause, OSError) else exc


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


def _read_on_demand(stream: anyio.abc.SocketStream) -> None:
    """Make an accepted connection read only while the server asks for bytes, and write ahead little.

    anyio's asyncio backend pauses a connected stream's transport (connect_tcp) but not an accepted one: that one
    reads whatever the client sends into an unbounded queue in memory until a `receive` first has to wait, which a
    client sending faster than the server parses never lets happen. The server's memory then grows without bound and
    the client's sends never block (the kernel's buffers stay empty), so a client that reads no answers is never
    caught. Paused, the transport reads at most a chunk per `receive`, and the kernel's buffers push back instead
    (trio's streams read only when asked anyway). A small send buffer makes an unread client's answers fill it
    soon, so `send` blocks and the server's idle clock runs, instead of after megabytes of answers."""
    transport = getattr(stream, "_transport", None)  # anyio's asyncio SocketStream; no public handle on it
    if transport is not None and callable(getattr(transport, "pause_reading", None)) and transport.is_reading():
        transport.pause_reading()
    with contextlib.suppress(Exception):
        stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                                       SEND_BUFFER)


async def _linger(stream: anyio.abc.SocketStream) -> None:
    """End our side, then read and drop what the client still sends (at most 1 s, 1 MiB): closing with unread
    bytes would reset the connection, and the reset can destroy our last answer before the client reads it."""
    with anyio.move_on_after(1), contextlib.suppress(Exception):
        await stream.send_eof()
        dropped = 0
        while dropped < 1 << 20:
            dropped += len(await stream.receive(READ_CHUNK))


async def serve_tcp(host: str = "0.0.0.0", port: int = DEFAULT_PORT, *, forever: bool = False,
                    policy: ServerPolicy | None = None, ready: Callable[[int], Any] | None = None,
                    on_report: OnReport | None = None,
                    on_session: Callable[[dict[str, Any]], Any] | None = None,
                    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> dict[str, Any]:
    """Listen on `host`:`port` and serve the endpoint protocol to one client at a time.

    `policy` (default `ServerPolicy()`: an emulated NIC at the address each connection reached, the default
    limits) is what every client runs under. `port` 0 lets the OS choose; the bound port goes to `ready(port)` once listening (and to `task_status`, so
    `port = await tasks.start(serve_tcp, "127.0.0.1", 0)` works). `on_report(result, client)` gets each result a
    client hands over with the `report` op, its text escaped (a coroutine function is awaited); `on_session(summary)` gets each client's
    summary when it is gone (see `serve_stream`: client, outcome, error, requests, errors, reports, objects_closed,
    objects_left). When a client leaves, for whatever reason, every object it opened is closed.

    forever=False: return after the first client, its summary plus {"port", "refused"} (clients turned away while
    it was served). forever=True: serve the next client, until cancelled.

    A taken port raises `PeerError` "port PORT is taken on HOST ...".
    """
    policy = ServerPolicy() if policy is None else policy
    where = _where(host, port)
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PeerError(f"port {port} is taken on {host}: another server (aiofabric bench or lat --server?) "
                            "listens there; stop it or pick another port (--port)", host=where) from None
        raise PeerError(f"cannot listen on {where}: {exc.strerror or exc}", host=where) from None
    bound = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
    where = _where(host, bound)
    busy_with: list[str] = []  # the client being served (at most one)
    refused = 0
    last: dict[str, Any] = {}
    done = anyio.Event()

    holding = [0]  # turned-away connections in their goodbye

    async def turn_away(stream: anyio.abc.SocketStream, client: str) -> None:
        nonlocal refused
        refused += 1
        if refused <= LOGGED_TURNED_AWAY:
            log.warning("client %s turned away: busy with %s%s", client, busy_with[0] if busy_with else "no one",
                        "; further ones are counted, not logged" * (refused == LOGGED_TURNED_AWAY))
        if holding[0] >= TURNED_AWAY_HELD:  # a flood: each goodbye holds a descriptor for up to 3 s
            return
        holding[0] += 1
        try:
            message = (f"the server at {where} is busy with a client from {busy_with[0] if busy_with else '?'} "
                       "(one client at a time); try again when its run is over")
            with contextlib.suppress(Exception), anyio.move_on_after(2):
                await stream.send(protocol.encode(protocol.Answer(None, False, None, "Busy", message)))
            await _linger(stream)
        finally:
            holding[0] -= 1

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                client = _where(*_address(stream, anyio.abc.SocketAttribute.remote_address))
            except OSError:  # it went away between accept and now: nothing to serve
                return
            if busy_with or done.is_set():
                await turn_away(stream, client)
                return
            busy_with.append(client)
            try:
                log.info("client %s connected", client)
                carrier = _StreamCarrier(stream)
                local_ip = _address(stream, anyio.abc.SocketAttribute.local_address)[0]
                client_ip = _address(stream, anyio.abc.SocketAttribute.remote_address)[0]
                summary = await serve_stream(carrier.receive, carrier.send, client=client, policy=policy,
                                             client_ip=client_ip, on_report=on_report, connection_ip=local_ip)
            finally:
                busy_with.clear()
            if summary["outcome"] != "not reading":  # that client takes no last answer: closed at once (a reset)
                await _linger(stream)
            log.info("client %s gone (%s): %d request(s), %d refused, %d object(s) closed", client,
                     summary["outcome"], summary["requests"], summary["refused"], summary["objects_closed"])
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
        for one in listener.listeners:
            assert isinstance(one, anyio.abc.SocketListener)  # create_tcp_listener's are
            tasks.start_soon(_accept_forever, one, handle_safely, tasks, where)
        await done.wait()
        tasks.cancel_scope.cancel()
    return {**last, "port": bound, "refused": refused}


async def _accept_forever(listener: anyio.abc.SocketListener,
                          handler: Callable[[anyio.abc.SocketStream], Any], tasks: anyio.abc.TaskGroup,
                          where: str) -> None:
    """anyio's `serve`, except that an accept failing for want of a resource (ACCEPT_RETRY) is waited out: logged
    once per stretch of failures, retried every ACCEPT_BACKOFF s. Any other accept error ends the server."""
    failures = 0
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in ACCEPT_RETRY:
                raise
            if not failures:
                log.warning("%s: accept failed: %s; retrying every %g s (further failures are counted)", where,
                            exc.strerror or exc, ACCEPT_BACKOFF)
            failures += 1
            await anyio.sleep(ACCEPT_BACKOFF)
            continue
        _read_on_demand(stream)
        if failures:
            log.warning("%s: accepting again after %d failed accept(s)", where, failures)
            failures = 0
        tasks.start_soon(handler, stream)


class TCPPeer(Peer):
    """A `Peer` over a TCP connection to `serve_tcp`. `handshake_s`: connect + ready message, in seconds."""

    def __init__(self, carrier: _StreamCarrier, host: str, command_timeout: float) -> None:
        self.handshake_s = 0.0
        super().__init__(carrier, host, command_timeout=command_timeout, describe_exit=self._closed,
                         stop=carrier.shutdown)

    async def _closed(self) -> str:
        return "the server closed the connection"


async def source_address(host: str, port: int = DEFAULT_PORT) -> str | None:
    """This host's IPv4 address on the route to `host` (the kernel's choice; nothing is sent), or None when `host`
    is this host (a loopback or own address), where emulated NICs pick their own 127.0.0.x."""
    try:
        family, kind, proto, _, destination = (await anyio.getaddrinfo(host, port, family=socket.AF_INET,
                                                                       type=socket.SOCK_DGRAM))[0]
    except OSError as exc:
        raise PeerError(f"cannot resolve {host}: {exc.strerror or exc}", host=_where(host, port)) from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.connect(destination)  # a UDP connect only picks the route
        except OSError as exc:
            raise PeerError(f"no route to {host}: {exc.strerror or exc}", host=_where(host, port)) from None
        source = probe.getsockname()[0]
    local = ipaddress.ip_address(source)
    if local.is_loopback or source == destination[0]:
        return None
    return str(local)


async def _keep_alive(peer: TCPPeer, idle: float) -> None:
    """Ping three times per `idle` period: a run whose requests are all sent (the RDMA traffic is between the
    NICs) is not mistaken for an idle client. A ping that fails has failed the peer; the next request says so."""
    while peer.failure is None:
        await anyio.sleep(idle / 3)
        with contextlib.suppress(PeerError):
            await peer.request("ping", timeout=idle / 3)


@contextlib.asynccontextmanager
async def connect_tcp(host: str, port: int = DEFAULT_PORT, *, local_host: str | None = None,
                      connect_timeout: float = 10, command_timeout: float = 60) -> AsyncIterator[TCPPeer]:
    """Connect to `serve_tcp` at `host`:`port` and talk to it as a `Peer` (`peer.host` is "HOST:PORT").

    `local_host`: the address to connect from: the local NIC's, since the server's QPs talk only to the address a
    connection comes from (if it is not an address of this host, the kernel's choice is used).
    `connect_timeout` bounds the TCP connect and the server's ready message; `command_timeout` each request.
    Nothing listening: `PeerError` "no aiofabric server (bench or lat --server) at HOST:PORT (connection refused)";
    no answer within `connect_timeout`: `PeerError` naming HOST:PORT and the timeout. Leaving the block (or
    cancelling it) closes the connection, and the server closes whatever this client left open. While the block
    runs, the peer pings a server that drops idle clients often enough to stay served.
    """
    where = _where(host, port)
    started = time.perf_counter()
    try:
        with anyio.fail_after(connect_timeout):
            try:
                stream = await anyio.connect_tcp(host, port, local_host=local_host)
            except OSError as exc:
                if local_host is None or _cause(exc).errno != errno.EADDRNOTAVAIL:
                    raise
                log.info("%s is not an address of this host: connecting from the kernel's choice", local_host)
                stream = await anyio.connect_tcp(host, port)
    except TimeoutError:
        raise PeerError(f"no answer from {where} within {connect_timeout:g} s (connection timed out): is the "
                        "host up and the port open?", host=where) from None
    except OSError as exc:
        cause = _cause(exc)
        if isinstance(cause, ConnectionRefusedError):
            raise PeerError(f"no aiofabric server (bench or lat --server) at {where} (connection refused)",
                            host=where) from None
        reason = getattr(cause, "strerror", None) or cause
        raise PeerError(f"cannot reach {where}: {reason}", host=where) from None
    carrier = _StreamCarrier(stream, where)
    peer = TCPPeer(carrier, where, command_timeout)
    # The reader and the pings are shielded from the caller's cancellation (Ctrl-C in the CLI): its shielded
    # clean-up (closing the server's objects) still needs its answers read. They end when these scopes are cancelled.
    background = [anyio.CancelScope(shield=True), anyio.CancelScope(shield=True)]
    async with stream, own_task_group() as tasks:
        try:
            tasks.start_soon(run_in, background[0], peer.reader)
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
            idle = peer.state.ready.idle_timeout if peer.state.ready is not None else None
            if idle is not None:
                tasks.start_soon(run_in, background[1], functools.partial(_keep_alive, peer, idle))
            yield peer
        finally:
            carrier.shutdown()  # the server sees end of input and closes what is left
            for scope in background:
                scope.cancel()
            tasks.cancel_scope.cancel()
