"""`aiofabric lat` across two hosts: perftest's server/client over TCP (`lat --server` / `lat SERVER_HOST`) and the
server side on a peer over SSH (`lat --peer`), the parameter exchange that refuses a mismatch on both sides, and
what a hostile client can make a `lat --server` do."""
import contextlib
import json
import subprocess

import anyio
import pytest

from aiofabric.peer import PeerError, operations, protocol
from aiofabric.peer.policy import ServerPolicy
from aiofabric.peer.tcp import connect_tcp, serve_tcp
from tests.support.backends import on
from tests.support.processes import CLI, free_port
from tests.support.ssh_servers import assert_no_leftovers

ASYNCIO_ONLY = on("asyncio")


def last_json(text: str):
    return json.loads(text.strip().splitlines()[-1])


def start_server(*argv):
    port = str(free_port())
    process = subprocess.Popen([*CLI, "lat", *argv, "--server", "--bind", "127.0.0.1", "--port", port],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "waiting for a client" in process.stderr.readline()
    return process, port


def finish(process):
    try:
        return process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("test", ["write", "send", "read", "atomic"])
def test_lat_server_and_client_over_tcp(test):
    size = "8" if test == "atomic" else "100"
    listener, port = start_server(test, "-s", size)
    client = subprocess.run([*CLI, "lat", test, "127.0.0.1", "-p", port, "-s", size, "-n", "150", "--json"],
                            capture_output=True, text=True, timeout=120)
    out, err = finish(listener)
    result = last_json(client.stdout)
    assert client.returncode == 0 and result["ok"] and result["verified"], client.stderr[-3000:]
    assert result["iterations"] == 150 and result["remote_host"] == f"127.0.0.1:{port}"
    assert result["t_min_us"] <= result["t_typical_us"] <= result["t_max_us"]
    assert result["verification"].endswith("(the server's by sha256 there) and the client NIC's placement counts")
    assert listener.returncode == 0, err[-3000:]
    assert "Latency Test" in out and "verified: yes" in out and f" {size} " in out  # the client's table, there too


@pytest.mark.parametrize("server_args,client_args,what", [
    (["write", "-s", "64"], ["write", "-s", "2"], "the client runs size 2, the server size 64"),
    (["write"], ["send"], "the client runs test send, the server test write"),
    (["read", "-m", "1024"], ["read", "-m", "4096"], "the client runs mtu 4096, the server mtu 1024"),
], ids=["size", "test", "mtu"])
def test_a_mismatch_is_refused_with_one_line_on_both_sides(server_args, client_args, what):
    listener, port = start_server(*server_args, "--json")
    client = subprocess.run([*CLI, "lat", *client_args, "127.0.0.1", "-p", port, "-n", "20", "--json"],
                            capture_output=True, text=True, timeout=120)
    out, _ = finish(listener)
    mine, theirs = last_json(client.stdout), last_json(out)
    assert client.returncode == 1 and not mine["ok"] and what in mine["error"] and "\n" not in mine["error"]
    assert listener.returncode == 1 and not theirs["ok"] and what in theirs["error"]
    assert theirs["error"].startswith("the two sides' parameters differ")


def test_the_servers_nic_is_its_own_choice():
    """The server's own --nic decides its NIC; a client cannot name one (it is refused, not ignored)."""
    listener, port = start_server("write", "--nic", "sim:latsrv")
    client = subprocess.run([*CLI, "lat", "write", "127.0.0.1", "-p", port, "--remote-nic", "sim:other", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert client.returncode == 2 and "the server chooses its NIC" in last_json(client.stdout)["error"]
    listener.kill()
    finish(listener)


@ASYNCIO_ONLY
@pytest.mark.anyio
@pytest.mark.parametrize("test", ["write", "send", "read", "atomic"])
async def test_lat_with_the_server_side_on_a_peer_over_ssh(server, test):
    with anyio.fail_after(120):
        process = await anyio.run_process([*CLI, "lat", test, "--peer", "127.0.0.1", *server.cli_flags(), "-n", "100",
                                           *(["-s", "4K"] if test != "atomic" else []), "--json"], check=False)
    result = last_json(process.stdout.decode())
    assert process.returncode == 0 and result["ok"] and result["verified"], process.stderr.decode()[-3000:]
    assert result["remote_host"] == f"127.0.0.1:{server.port}" and result["iterations"] == 100
    await assert_no_leftovers(server.port)


@ASYNCIO_ONLY
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["FETCH_AND_ADD", "CMP_AND_SWAP"])
async def test_bench_atomic_with_the_counters_on_a_peer(server, kind):
    """The peer's region and QP allow remote atomics only when asked (register_mr / connect_qp atomic); the
    counters there are checked by sha256."""
    with anyio.fail_after(120):
        process = await anyio.run_process([*CLI, "bench", "atomic", "-A", kind, "--peer", "127.0.0.1",
                                           *server.cli_flags(), "-q", "2", "-n", "200", "--json"], check=False)
    result = last_json(process.stdout.decode())
    assert process.returncode == 0 and result["ok"] and result["verified"], process.stderr.decode()[-3000:]
    assert result["iterations"] == 2 * 200 and result["remote_host"] == f"127.0.0.1:{server.port}"  # -n x -q
    await assert_no_leftovers(server.port)


# -- what a TCP client of `lat --server` may send ----------------------------------------------------------------
PONG = {"qp": 1, "mr": 2, "test": "write", "size": 64, "iters": 10, "wait": 1.0}


@pytest.mark.parametrize("field,value", [
    ("test", "read"), ("test", "atomic"), ("size", 0), ("size", 1 << 31), ("iters", 0), ("iters", 10 ** 9),
    ("wait", 0), ("wait", 1e9), ("wait", True), ("warmup", -1), ("rx_slots", 10 ** 6), ("inline", 1),
    ("remote", {"addr": -1, "rkey": 1}), ("qp", 0), ("mr", "x"),
])
def test_every_hostile_pong_field_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=f"pong: field '{field}' must be"):
        operations.check_args("pong", {**PONG, field: value}, operations.LAT)


def test_the_lat_profile_is_the_latency_exchange_only():
    for op in ("post", "post_recvs"):
        with pytest.raises(protocol.NotAllowed, match="latency exchange"):
            operations.check_args(op, {}, operations.LAT)
    with pytest.raises(protocol.NotAllowed, match="server's to choose"):
        operations.check_args("open_nic", {"options": {"pcap": "/etc/x"}}, operations.LAT)
    with pytest.raises(protocol.NotAllowed):
        operations.check_args("open_nic", {"spec": "0000:41:00.0"}, operations.LAT)
    assert operations.check_args("pong", PONG, operations.LAT)["rx_slots"] == 0
    with pytest.raises(protocol.NotAllowed):  # and a bench server does not run pongs
        operations.check_args("pong", PONG, operations.BENCH)


@contextlib.asynccontextmanager
async def lat_server(test="write", **serve_options):
    """A `lat --server` in this process on 127.0.0.1 (test, 64 B, MTU 4096): its port."""
    policy = ServerPolicy(tool="lat", expect={"test": test, "size": 64, "mtu": 4096})
    async with anyio.create_task_group() as tasks:
        yield await tasks.start(lambda task_status: serve_tcp("127.0.0.1", 0, forever=True, policy=policy,
                                                              task_status=task_status, **serve_options))
        tasks.cancel_scope.cancel()


async def server_objects(peer, rq_depth=128, size=4096):
    """A NIC, CQ, QP and MR opened by a client there: the QP's and MR's handles."""
    nic = await peer.open_nic()
    qp = await peer.create_qp(nic, await peer.create_cq(nic), rq_depth=rq_depth)
    return qp.handle, (await peer.register_mr(nic, size)).handle


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_pong_left_running_by_a_client_that_vanishes_is_stopped():
    """A client starts a server half that would poll for pings for an hour, then disconnects: the server stops it
    and closes everything at once, and answers the next client."""
    sessions = []
    async with lat_server(on_session=sessions.append) as port:
        async with connect_tcp("127.0.0.1", port) as peer:
            qp, mr = await server_objects(peer)
            started = await peer.request("pong", qp=qp, mr=mr, test="write", size=64, iters=10, wait=3600.0,
                                         remote={"addr": 0, "rkey": 1})
            assert started["pong"] > 0
        with anyio.fail_after(20):  # not the hour the pong would have waited
            while not sessions:
                await anyio.sleep(0.05)
        assert sessions[0]["objects_left"] == 0 and sessions[0]["outcome"] == "disconnected mid-run", sessions
        async with connect_tcp("127.0.0.1", port) as peer:  # the next client is served
            assert (await peer.request("lat_params", test="write", size=64, mtu=4096, iters=5))["size"] == 64


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_pong_that_could_never_be_ready_is_refused_at_once_and_strange_names_never_reach_the_log(caplog):
    """More receive slots than the QP's receive queue holds would wait forever for room: refused, naming both. A
    test name with escape sequences is not a name."""
    async with lat_server("send") as port, connect_tcp("127.0.0.1", port) as peer:
        qp, mr = await server_objects(peer, rq_depth=16, size=1 << 20)
        with anyio.fail_after(10), pytest.raises(PeerError, match="4096 receive slots exceed the QP's receive"):
            await peer.request("pong", qp=qp, mr=mr, test="send", size=64, iters=10, wait=600.0, rx_slots=4096)
        with pytest.raises((ValueError, PeerError), match="field 'test' must be a name"):  # checked here too
            await peer.request("lat_params", test="write\x1b[2J", size=64, mtu=4096, iters=5)
    assert "\x1b" not in caplog.text


def test_inline_pongs_across_the_tcp_pair():
    listener, port = start_server("send", "-s", "64")
    client = subprocess.run([*CLI, "lat", "send", "127.0.0.1", "-p", port, "-s", "64", "-I", "64", "-n", "100",
                             "--json"], capture_output=True, text=True, timeout=120)
    finish(listener)
    result = last_json(client.stdout)
    assert client.returncode == 0 and result["ok"] and result["verified"], client.stderr[-2000:]


@pytest.mark.anyio
async def test_a_pong_closed_by_its_client_answers_its_waiter_and_frees_the_qp():
    """Closing a running server half (cancelled from outside) answers the pong_wait in flight with why, and the QP
    under it is usable again (closed, then destroyed, with no pong left holding it)."""
    async with lat_server() as port, connect_tcp("127.0.0.1", port) as peer:
        qp, mr = await server_objects(peer)
        pong = (await peer.request("pong", qp=qp, mr=mr, test="write", size=64, iters=10, wait=600.0,
                                   remote={"addr": 0, "rkey": 1}))["pong"]
        errors = []

        async def wait_for_it():
            try:
                await peer.request("pong_wait", pong=pong, timeout=30)
            except PeerError as exc:
                errors.append(str(exc))
        with anyio.fail_after(20):
            async with anyio.create_task_group() as waiting:
                waiting.start_soon(wait_for_it)
                await anyio.sleep(0.2)
                await peer.close(pong)
        assert len(errors) == 1 and "closed before it ended" in errors[0], errors
        await peer.close(qp)  # nothing holds it any more
        assert await peer.ping() > 0
