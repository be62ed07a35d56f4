"""`Peer`: the client side of the endpoint protocol over any carrier (an SSH channel, a TCP socket).

It mirrors the local API on the remote host: `open_nic`, `create_cq`, `create_qp`, `register_mr`, `connect_qp`,
`post`, `close`, plus `fill` and `sha256` so bytes are checked where they landed without sending them back. Each
call is one request with its own id; many may be in flight from many tasks, and answers are matched by id.

Failures are `PeerError`s naming the host, the request and the remote exception. A request with no answer within its
timeout fails the whole peer (the endpoint is in an unknown state) and stops the remote process; so does a
disconnect or a crash, and every request in flight fails with it at once.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Awaitable, Callable, Protocol

import anyio

from . import protocol
from .protocol import Answer, ClientState, Ready
from ..errors import PeerError, ProtocolError
from ..verbs import QPInfo, RemoteRegion

HOST_SPEC = re.compile(r"(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s\[\]]+)(?::(?P<port>\d+))?")


def parse_host(spec: str, default_port: int = 22) -> tuple[str | None, str, int]:
    """`[user@]host[:port]` (an IPv6 host in brackets) as (user, host, port), like an MPI hostfile line."""
    match = HOST_SPEC.fullmatch(spec.strip())
    if not match or not 0 < int(match["port"] or default_port) < 65536:
        raise ValueError(f"bad host {spec!r}: use host, host:port or user@host:port")
    return match["user"], match["host"].strip("[]"), int(match["port"] or default_port)


class Carrier(Protocol):
    """Moves bytes to and from an endpoint. `receive` returns b"" at end of input."""

    async def send(self, data: bytes) -> None: ...

    async def receive(self) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class RemoteNIC:
    handle: int
    ip: str
    gid: str
    mac: str


@dataclasses.dataclass(frozen=True)
class RemoteQP:
    handle: int
    info: QPInfo


@dataclasses.dataclass(frozen=True)
class RemoteMR:
    handle: int
    region: RemoteRegion

    @property
    def length(self) -> int:
        return self.region.length or 0

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteRegion:
        """How a local QP names this region (as `MemoryRegion.remote()` does for a local one)."""
        return RemoteRegion(self.region.addr + offset, self.region.rkey,
                            self.length - offset if length is None else length)


def _handle(obj: Any) -> int:
    return obj if isinstance(obj, int) else obj.handle


class _Waiter:
    __slots__ = ("event", "answer")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.answer: Answer | None = None


class Peer:
    """One remote endpoint. Run `reader()` in a task group, await `wait_ready()`, then make requests.

    `stop` is called once when the peer fails (timeout, protocol error): it should make the remote process go away
    (the SSH carrier closes the channel and signals the process)."""

    def __init__(self, carrier: Carrier, host: str, *, command_timeout: float = 60.0,
                 describe_exit: Callable[[], Awaitable[str]] | None = None,
                 stop: Callable[[], None] | None = None) -> None:
        self.carrier, self.host, self.command_timeout = carrier, host, command_timeout
        self.state = ClientState()
        self.failure: PeerError | None = None
        self.ready = anyio.Event()
        self.remote_pid = 0
        self._waiters: dict[int, _Waiter] = {}
        self._send_lock = anyio.Lock()
        self._describe_exit = describe_exit
        self._stop = stop

    # -- plumbing --------------------------------------------------------------------------------------------------
    async def reader(self) -> None:
        """Read answers until end of input or a protocol error; then fail whatever still waits."""
        lines = protocol.LineBuffer()
        try:
            while self.failure is None:
                data = await self.carrier.receive()
                if not data:
                    break
                for line in lines.feed(data):
                    message = self.state.receive(line)
                    if isinstance(message, Ready):
                        self.remote_pid = message.pid
                        self.ready.set()
                    elif message is not None:
                        waiter = self._waiters.get(message.id)  # type: ignore[arg-type]
                        if waiter is not None:
                            waiter.answer = message
                            waiter.event.set()
        except protocol.Refused as exc:
            self.fail(PeerError(f"{self.host}: the endpoint turned this client away: {exc}", host=self.host))
            return
        except ProtocolError as exc:
            self.fail(PeerError(f"{self.host}: the remote endpoint broke the protocol: {exc}", host=self.host))
            return
        except Exception as exc:  # the carrier broke (connection lost)
            self.fail(PeerError(f"{self.host}: connection lost: {type(exc).__name__}: {exc}", host=self.host))
            return
        if self.failure is None:
            how = await self._exit_text()
            when = "after it started" if self.ready.is_set() else "before it was ready"
            self.fail(PeerError(f"{self.host}: the remote endpoint exited {when} ({how})", host=self.host))

    async def _exit_text(self) -> str:
        if self._describe_exit is None:
            return "end of input"
        with anyio.move_on_after(2):
            return await self._describe_exit()
        return "no exit status"

    def fail(self, error: PeerError) -> None:
        """Fail the peer: every waiting and later request raises `error`; the remote process is stopped."""
        if self.failure is not None:
            return
        self.failure = error
        self.ready.set()
        for waiter in self._waiters.values():
            waiter.event.set()
        if self._stop is not None:
            self._stop()

    async def wait_ready(self, timeout: float, *, budget: float | None = None) -> None:
        """Wait for the endpoint's ready message, at most `timeout` s (what is left of a `budget`, for the message)."""
        with anyio.move_on_after(timeout):
            await self.ready.wait()
        if self.failure is not None:
            raise self.failure
        if not self.ready.is_set():
            error = PeerError(f"{self.host}: the remote endpoint did not start within {budget or timeout:g} s", host=self.host)
            self.fail(error)
            raise error

    async def request(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request and await its answer (at most `timeout`, default `command_timeout`, seconds)."""
        if self.failure is not None:
            raise self.failure
        timeout = self.command_timeout if timeout is None else timeout
        request_id, line = self.state.request(op, **args)  # a bad field raises ValueError here, before sending
        waiter = self._waiters[request_id] = _Waiter()
        try:
            with anyio.move_on_after(timeout) as scope:
                async with self._send_lock:
                    await self.carrier.send(line)
                await waiter.event.wait()
        except BaseException:
            self.state.forget(request_id)
            raise
        finally:
            del self._waiters[request_id]
        answer = waiter.answer
        if answer is None:
            if self.failure is not None:
                raise PeerError(f"{self.failure} (while {op}, request {request_id}, was in flight)",
                                host=self.host, op=op) from self.failure
            assert scope.cancelled_caught
            self.state.forget(request_id)
            error = PeerError(f"{self.host}: {op} (request {request_id}) got no answer within {timeout:g} s; "
                              "the remote endpoint was stopped", host=self.host, op=op)
            self.fail(error)
            raise error
        if not answer.ok:
            raise PeerError(f"{self.host}: {op} (request {request_id}) failed on the remote host: "
                            f"{answer.error_type}: {answer.error_message}", host=self.host, op=op,
                            remote_type=answer.error_type, remote_message=answer.error_message)
        return answer.result or {}

    # -- the remote API --------------------------------------------------------------------------------------------
    async def ping(self) -> int:
        return (await self.request("ping"))["pid"]

    async def open_nic(self, spec: str | None = None, *, ip: str | None = None, timeout: float | None = None,
                       **options: Any) -> RemoteNIC:
        """Open a NIC on the remote host (`options`: the emulated NIC's, e.g. netns=, fw_latency_us=). `spec` and
        `ip` None are not sent: the endpoint's defaults ("sim", a free address), or a bench server's own choice
        (it refuses them from a client)."""
        named = {key: value for key, value in (("spec", spec), ("ip", ip)) if value is not None}
        result = await self.request("open_nic", options=options, timeout=timeout, **named)
        return RemoteNIC(result["nic"], result["ip"], result["gid"], result["mac"])

    async def create_cq(self, nic: RemoteNIC | int, depth: int = 256) -> int:
        return (await self.request("create_cq", nic=_handle(nic), depth=depth))["cq"]

    async def create_qp(self, nic: RemoteNIC | int, cq: int, *, sq_depth: int = 128, rq_depth: int = 128,
                        max_inline_data: int = 0) -> RemoteQP:
        result = await self.request("create_qp", nic=_handle(nic), cq=cq, sq_depth=sq_depth, rq_depth=rq_depth,
                                    **({"max_inline_data": max_inline_data} if max_inline_data else {}))
        return RemoteQP(result["qp"], QPInfo.from_dict(result["info"]))

    async def register_mr(self, nic: RemoteNIC | int, size: int, *, atomic: bool = False) -> RemoteMR:
        """A region there (`atomic`: allowing remote atomics too)."""
        result = await self.request("register_mr", nic=_handle(nic), size=size,
                                    **({"atomic": True} if atomic else {}))
        return RemoteMR(result["mr"], RemoteRegion.from_dict(result["region"]))

    async def fill(self, mr: RemoteMR | int, *, seed: int | None = None, byte: int = 0, offset: int = 0,
                   length: int | None = None) -> str:
        """Fill a range with `pattern(seed, n)` (or `byte`); its sha256 (hex)."""
        return (await self.request("fill", mr=_handle(mr), seed=seed, byte=byte, offset=offset,
                                   length=length))["sha256"]

    async def sha256(self, mr: RemoteMR | int, offset: int = 0, length: int | None = None,
                     timeout: float | None = None) -> str:
        return (await self.request("sha256", mr=_handle(mr), offset=offset, length=length,
                                   timeout=timeout))["sha256"]

    async def connect_qp(self, qp: RemoteQP | int, peer: QPInfo, *, mtu: int = 4096, timeout: int = 14,
                         retry_cnt: int = 7, atomic: bool = False) -> str:
        """Connect the QP there to `peer` (`atomic`: answering remote atomics too)."""
        return (await self.request("connect_qp", qp=_handle(qp), peer=peer.to_dict(), mtu=mtu, timeout=timeout,
                                   retry_cnt=retry_cnt, **({"atomic": True} if atomic else {})))["state"]

    async def post(self, qp: RemoteQP | int, verb: str, mr: RemoteMR | int, size: int | None = None, *,
                   local_offset: int = 0, remote: RemoteRegion | None = None, remote_offset: int = 0,
                   imm: int | None = None, deadline: float | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        """Post one work request on the remote QP and await its completion ({"byte_len", "imm"})."""
        return await self.request("post", qp=_handle(qp), verb=verb, mr=_handle(mr), size=size,
                                  local_offset=local_offset, remote=None if remote is None else remote.to_dict(),
                                  remote_offset=remote_offset, imm=imm, deadline=deadline, timeout=timeout)

    async def post_recvs(self, qp: RemoteQP | int, mr: RemoteMR | int, count: int, size: int, *, offset: int = 0,
                         stride: int | None = None) -> int:
        """Post `count` receives on the remote QP (at offset + i * stride) without awaiting their completions."""
        return (await self.request("post_recvs", qp=_handle(qp), mr=_handle(mr), count=count, size=size,
                                   offset=offset, stride=stride))["posted"]

    async def close(self, obj: RemoteNIC | RemoteQP | RemoteMR | int) -> None:
        """Close a remote NIC (and all on it), destroy a QP or CQ, deregister an MR."""
        await self.request("close", handle=_handle(obj))
