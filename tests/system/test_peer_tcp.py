"""The endpoint protocol over TCP (aiofabric.peer.tcp): an in-process server on 127.0.0.1 (an OS-chosen port), real
benches through it, and each failure: garbage, a mid-run disconnect, a busy server, a taken port, no server."""
import contextlib
import logging
import os
import socket
import time

import anyio
import pytest

from aiofabric.peer import PeerError
from aiofabric.peer.tcp import connect_tcp, serve_tcp
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.bench_report import format_table
from aiofabric.tools.perftest import open_bench_nics, run_bench
from tests.support.backends import only
from tests.support.ssh_servers import assert_no_leftovers

pytestmark = pytest.mark.anyio
SHAPE = {"qps": 2, "iters": 200, "size": 4096}


@pytest.fixture(params=only("asyncio", "trio"))
def anyio_backend(request):
    return request.param


class Server:
    """serve_tcp in a task: its port, the reports and per-client summaries it collected."""

    def __init__(self) -> None:
        self.port = 0
        self.reports: list[dict] = []
        self.sessions: list[dict] = []
        self.gone = anyio.Event()
        self.result: dict | None = None

    def on_session(self, summary: dict) -> None:
        self.sessions.append(summary)
        self.gone.set()
        self.gone = anyio.Event()

    async def wait_sessions(self, count: int, within: float = 20) -> None:
        with anyio.fail_after(within):
            while len(self.sessions) < count:
                await self.gone.wait()


async def _start(tasks, server: Server, forever: bool) -> None:
    async def run(*, task_status):
        server.result = await serve_tcp("127.0.0.1", 0, forever=forever, on_report=lambda result, client: server.reports.append(result),
                                        on_session=server.on_session, ready=task_status.started)
    server.port = await tasks.start(run)


@contextlib.asynccontextmanager
async def _client(port: int):
    """What `aiofabric bench TEST 127.0.0.1` does: the NIC here first, then a connection from its address (the
    server's QPs talk only to the address a connection comes from)."""
    async with open_bench_nics(BenchConfig(server_host="127.0.0.1")) as nics, \
            connect_tcp("127.0.0.1", port, local_host=nics[0].ip) as peer:
        yield peer, nics


async def _bench(client, test: str, report: bool = True) -> dict:
    peer, nics = client
    config = BenchConfig(test=test, remote=peer, **SHAPE)
    result = await run_bench(config, nics)
    assert result["verified"], result
    assert result["remote_host"] == peer.host and result["ops"] == SHAPE["qps"] * SHAPE["iters"]
    if report:
        await peer.request("report", result=result)
    return result


async def test_benches_through_a_tcp_peer_and_the_server_prints_the_report():
    server = Server()
    async with anyio.create_task_group() as tasks:
        await _start(tasks, server, forever=False)
        with anyio.fail_after(30):
            async with _client(server.port) as client:
                peer = client[0]
                assert peer.host == f"127.0.0.1:{server.port}" and peer.remote_pid == os.getpid()
                for test in ("write", "read", "send"):
                    await _bench(client, test, report=test == "send")  # a client reports its run once
    assert server.result is not None and server.result["outcome"] == "end of input"
    assert server.result["port"] == server.port and server.result["reports"] == 1
    assert server.result["objects_left"] == 0 and server.result["error"] is None
    assert [r["test"] for r in server.reports] == ["send"]
    for report in server.reports:  # the server can print the client's table from the report alone
        shape = {k: report[k] for k in ("test", "qps", "size", "depth", "mtu", "nics")}
        table = format_table(report, BenchConfig(**shape, iters=report["iterations"] // report["qps"]))
        assert "verified: yes" in table
    await assert_no_leftovers(drivers=[os.getpid()])


async def _raw_client(port: int, data: bytes, eof: bool = False) -> bytes:
    """Connect, send `data` (then end of input, if `eof`), read until the server closes (or 10 s)."""
    received = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        if eof:
            await stream.send_eof()
        with anyio.move_on_after(10):
            while True:
                try:
                    received += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return received


async def test_garbage_is_answered_and_dropped_then_the_next_client_runs_a_verified_bench(caplog):
    caplog.set_level(logging.INFO, "aiofabric.serve")
    server = Server()
    async with anyio.create_task_group() as tasks:
        await _start(tasks, server, forever=True)
        with anyio.fail_after(30):
            # a client that opened a NIC, made a protocol error (answered), then sends garbage: dropped, NIC closed
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                await stream.send(b'{"id": 1, "op": "open_nic", "args": {}}\n{"id": 2, "op": "bogus"}\n')
                received = b""
                while received.count(b"\n") < 3:
                    received += await stream.receive()
                assert b'"ready":true' in received and b"unknown op 'bogus'" in received
                assert b'"id":1,"ok":true' in received
                await stream.send(b"\x00\xff garbage\n")
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    while True:
                        received += await stream.receive()
                assert b"not JSON" in received.splitlines()[-1]
            await server.wait_sessions(1)
            received = await _raw_client(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b'"id":null' in received and b"not JSON" in received
            await server.wait_sessions(2)
            received = await _raw_client(server.port, bytes(range(256)) * 16 + b"\n")
            assert b'"id":null' in received
            await server.wait_sessions(3)
            async with _client(server.port) as client:  # forever: the next client is served
                await _bench(client, "write")
            await server.wait_sessions(4)
        tasks.cancel_scope.cancel()
    first, http, binary, good = server.sessions
    assert first["objects_closed"] == 1 and first["requests"] == 1  # its NIC
    assert first["outcome"] == http["outcome"] == binary["outcome"] == "non-protocol bytes"
    assert all(s["objects_left"] == 0 for s in server.sessions)
    assert good["outcome"] == "end of input" and good["reports"] == 1 and good["error"] is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sent non-protocol bytes (not JSON" in w and "dropped it" in w for w in warnings), warnings
    assert all("\n" not in w for w in warnings)
    await assert_no_leftovers(drivers=[os.getpid()])


async def test_a_client_that_disconnects_mid_run_leaves_nothing_on_the_server(caplog):
    server = Server()
    async with anyio.create_task_group() as tasks:
        await _start(tasks, server, forever=True)
        with anyio.fail_after(40):
            async with _client(server.port) as (peer, nics):
                async with anyio.create_task_group() as client:
                    failed: list[BaseException] = []

                    async def bench():
                        try:
                            await run_bench(BenchConfig(test="send", remote=peer, qps=2, iters=200_000, size=4096),
                                            nics)
                        except Exception as exc:
                            failed.append(exc)

                    client.start_soon(bench)
                    while peer.state._next_id < 16:  # set up, and receives being posted there: mid-run
                        await anyio.sleep(0.05)
                    peer.fail(PeerError("test: the client vanishes"))  # shuts the socket down, as a crash would
                    with anyio.move_on_after(10):
                        await server.wait_sessions(1)
                    client.cancel_scope.cancel()
            await server.wait_sessions(1)
            async with connect_tcp("127.0.0.1", server.port) as peer:  # and it serves the next one
                assert await peer.ping() == os.getpid()
            await server.wait_sessions(2)
        tasks.cancel_scope.cancel()
    dropped = server.sessions[0]
    assert dropped["outcome"] == "disconnected mid-run", dropped
    assert dropped["objects_closed"] >= 6 and dropped["objects_left"] == 0  # NIC, CQ, 2 QPs, 2 MRs
    assert "disconnected mid-run" in dropped["error"] and "closed them" in dropped["error"]
    assert any(dropped["error"] == r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    await assert_no_leftovers(drivers=[os.getpid()])


async def test_a_second_client_is_turned_away_while_one_is_served():
    server = Server()
    async with anyio.create_task_group() as tasks:
        await _start(tasks, server, forever=False)
        with anyio.fail_after(20):
            async with connect_tcp("127.0.0.1", server.port) as first:
                await first.ping()
                with pytest.raises(PeerError, match=r"turned this client away: Busy: the server at 127\.0\.0\.1:"
                                                    r"\d+ is busy with a client from 127\.0\.0\.1:\d+"):
                    async with connect_tcp("127.0.0.1", server.port):
                        pass
    assert server.result["refused"] == 1 and server.result["outcome"] == "end of input"


async def test_a_taken_port_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PeerError, match=rf"^port {port} is taken on 127\.0\.0\.1"):
            await serve_tcp("127.0.0.1", port)


async def test_no_server_is_a_peer_error_within_the_timeout():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(PeerError) as caught:
        async with connect_tcp("127.0.0.1", port, connect_timeout=3):
            pass
    assert str(caught.value) == f"no aiofabric server (bench or lat --server) at 127.0.0.1:{port} (connection refused)"
    assert caught.value.host == f"127.0.0.1:{port}" and time.monotonic() - started < 3


async def test_a_listener_that_never_says_ready_fails_within_the_connect_timeout():
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
    async with listener:  # the kernel accepts; nobody answers
        started = time.monotonic()
        with pytest.raises(PeerError, match=rf"127\.0\.0\.1:{port}: .*no aiofabric ready message within 1 s"):
            async with connect_tcp("127.0.0.1", port, connect_timeout=1):
                pass
        assert time.monotonic() - started < 3
