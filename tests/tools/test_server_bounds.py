"""Bounds a `bench|lat --server` sets on what one unauthenticated client's requests start: one server half of a
ping-pong at a time (each is a background task polling a QP until its wait runs out), and one report per client
(each is printed on the server)."""
import contextlib

import anyio
import pytest

from aiofabric.peer import PeerError
from aiofabric.peer.policy import ServerPolicy
from aiofabric.peer.tcp import connect_tcp, serve_tcp

pytestmark = [pytest.mark.anyio, pytest.mark.loop_agnostic]


@contextlib.asynccontextmanager
async def tcp_server(tool: str = "lat", **serve_options):
    """A `lat --server` (write, 64 B, MTU 4096) or `bench --server` in this process on 127.0.0.1: its port."""
    expect = {"test": "write", "size": 64, "mtu": 4096} if tool == "lat" else {}
    policy = ServerPolicy(tool=tool, expect=expect)
    async with anyio.create_task_group() as tasks:
        yield await tasks.start(lambda task_status: serve_tcp("127.0.0.1", 0, forever=True, policy=policy,
                                                              task_status=task_status, **serve_options))
        tasks.cancel_scope.cancel()


async def test_a_client_runs_one_pong_at_a_time():
    """A second pong while the first runs is refused, naming what to do; once the first is closed, the next one
    starts."""
    async with tcp_server() as port, connect_tcp("127.0.0.1", port) as peer:
        nic = await peer.open_nic()
        qp = (await peer.create_qp(nic, await peer.create_cq(nic), rq_depth=128)).handle
        mr = (await peer.register_mr(nic, 4096)).handle
        pong = {"qp": qp, "mr": mr, "test": "write", "size": 64, "iters": 10, "wait": 3600.0,
                "remote": {"addr": 0, "rkey": 1}}  # a server half that would wait an hour for pings
        first = (await peer.request("pong", **pong))["pong"]
        with anyio.fail_after(10), pytest.raises(PeerError) as refused:
            await peer.request("pong", **pong)
        assert str(refused.value).endswith(
            "NotAllowed: pong: a ping-pong is already running for this client: pong_wait for it first"), refused.value
        await peer.request("close", handle=first)
        assert (await peer.request("pong", **pong))["pong"] > first


async def test_a_client_reports_its_run_once():
    """The second report is refused and not shown; a report the server refused (here: its printer raised) does not
    count, so the client's one report can follow it."""
    shown = []

    def show(result, client):
        if result.get("bad"):
            raise ValueError("report: not a table")
        shown.append(result)

    async with tcp_server("bench", on_report=show) as port, connect_tcp("127.0.0.1", port) as peer:
        with pytest.raises(PeerError, match="report: not a table"):
            await peer.request("report", result={"bad": True})
        assert (await peer.request("report", result={"test": "write"}))["reported"]
        with anyio.fail_after(10), pytest.raises(PeerError) as refused:
            await peer.request("report", result={"test": "read"})
        assert str(refused.value).endswith("NotAllowed: report: a client reports its run once"), refused.value
    assert shown == [{"test": "write"}]
