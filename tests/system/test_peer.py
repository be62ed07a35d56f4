"""Remote peers: the pure protocol, the `serve` endpoint, and real SSH (an asyncssh server on 127.0.0.1 that runs
each command with /bin/sh in a subprocess, tests/support/sshd.py; where marked, OpenSSH's sshd too,
tests/support/openssh.py): the
`connect` flow and each failure, with a clear error within its timeout and no process left on either side."""
import glob
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric.peer import PeerError, operations, protocol
from aiofabric.peer.protocol import Answer, ClientState, LineBuffer, ProtocolError, Ready, Request
from tests.support import CHECKOUT, sshd
from tests.support.backends import on, only
from tests.support.processes import CLI
from tests.support.results import assert_valid
from tests.support.ssh_servers import BOTH_SERVERS, assert_no_leftovers


pytestmark = pytest.mark.anyio


# -- the protocol, pure -----------------------------------------------------------------------------------------------

def test_requests_round_trip_with_defaults_filled_in():
    line = protocol.encode(Request(7, "create_qp", {"nic": 1, "cq": 2}))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    request = protocol.decode_request(line.rstrip(b"\n"))
    assert request == Request(7, "create_qp", {"nic": 1, "cq": 2, "sq_depth": 128, "rq_depth": 128,
                                                   "max_inline_data": 0})


@pytest.mark.parametrize("line, message, request_id", [
    (b'{"id": 3, "op": "nope"}', "unknown op 'nope'", 3),
    (b'{"id": 4, "op": "create_cq", "args": {}}', "create_cq: missing field 'nic'", 4),
    (b'{"id": 5, "op": "create_cq", "args": {"nic": "1"}}', "create_cq: field 'nic' must be an integer", 5),
    (b'{"id": 6, "op": "create_cq", "args": {"nic": 0}}', "must be a handle", 6),
    (b'{"id": 7, "op": "ping", "args": {"x": 1}}', "ping: unknown field(s) x", 7),
    (b'{"id": 8, "op": "post", "args": {"qp": 1, "verb": "write", "mr": 2}}', "needs field 'remote'", 8),
    (b'{"id": 9, "op": "post", "args": {"qp": 1, "verb": "jump", "mr": 2}}', "one of write, read", 9),
    (b'{"id": 10, "op": "connect_qp", "args": {"qp": 1, "peer": {"qpn": 1}}}', "a QP info", 10),
    (b'{"id": 11, "op": "close", "args": {"handle": true}}', "close: field 'handle' must be an integer, not True", 11),
    (b'{"id": 12, "op": "create_cq", "args": {"nic": 1, "depth": false}}', "field 'depth' must be an integer", 12),
    (b'{"id": 13, "op": "post", "args": {"qp": 1, "verb": "send", "mr": 2, "deadline": true}}',
     "field 'deadline' must be a positive number of seconds, not True", 13),
    (b'{"id": true, "op": "ping"}', "without a valid id", None),
    (b'[1, 2]', "not a JSON object", None),
    (b'{"id": 1, "op": "ping"', "not JSON", None),
])
def test_bad_requests_name_what_is_wrong_and_keep_their_id(line, message, request_id):
    with pytest.raises(ProtocolError, match=None) as caught:
        protocol.decode_request(line)
    assert message in str(caught.value) and caught.value.request_id == request_id


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "op", "args", "x"]),
                       st.one_of(st.integers(-2, 3), st.text(max_size=5), st.sampled_from(list(operations.OPS)),
                                 st.dictionaries(st.sampled_from(["nic", "mr", "qp", "verb", "size", "remote"]),
                                                 st.one_of(st.integers(-1, 3), st.text(max_size=3), st.none())))))
def test_any_object_decodes_or_raises_protocol_error_only(data):
    try:
        protocol.decode_request(json.dumps(data).encode())
    except ProtocolError:
        pass


def test_client_matches_answers_out_of_order_and_drops_forgotten_ones():
    client = ClientState()
    with pytest.raises(ProtocolError, match="before the ready"):
        client.receive(protocol.encode(Answer(1, True, {})))
    assert client.receive(protocol.encode(Ready(1, "0.1.0", 42))) == Ready(1, "0.1.0", 42)
    first, _ = client.request("ping")
    second, _ = client.request("sha256", mr=3)
    third, _ = client.request("ping")
    assert client.receive(protocol.encode(Answer(second, False, None, "ValueError", "bad"))).error_message == "bad"
    assert client.receive(protocol.encode(Answer(first, True, {"pid": 1}))).result == {"pid": 1}
    client.forget(third)
    assert client.receive(protocol.encode(Answer(third, True, {}))) is None  # late answer: dropped
    with pytest.raises(ProtocolError, match="not in flight"):
        client.receive(protocol.encode(Answer(99, True, {})))
    with pytest.raises(ValueError, match="sha256: missing field 'mr'"):
        client.request("sha256")  # checked before it leaves


def test_client_refuses_another_protocol_version():
    with pytest.raises(ProtocolError, match="protocol 2"):
        ClientState().receive(b'{"ready": true, "protocol": 2, "version": "9", "pid": 1}')


def test_line_buffer_joins_chunks_and_survives_an_overlong_line():
    lines = LineBuffer(max_line=16)
    assert lines.feed(b'{"a"') == [] and lines.feed(b': 1}\n{"b": 2}\n\n{"c"') == [b'{"a": 1}', b'{"b": 2}']
    with pytest.raises(ProtocolError, match="longer than 16"):
        lines.feed(b"x" * 40)
    assert lines.feed(b"yyy\n" + b'{"d": 4}\n') == [b'{"d": 4}']  # the rest of the long line is skipped


def test_pattern_is_deterministic():
    assert protocol.pattern(5, 1000) == protocol.pattern(5, 1000) != protocol.pattern(6, 1000)


# -- the endpoint over a local pipe (no SSH): every backend -----------------------------------------------------------

@pytest.mark.parametrize("serve_backend", ["asyncio", "trio"])
async def test_serve_answers_bad_requests_out_of_order_and_exits_0_at_end_of_input(serve_backend):
    async with await anyio.open_process([*CLI, "--backend", serve_backend, "serve"]) as process:
        buffer, lines = LineBuffer(), []

        async def next_message():
            while not lines:
                lines.extend(buffer.feed(await process.stdout.receive()))
            return json.loads(lines.pop(0))

        with anyio.fail_after(30):
            ready = await next_message()
            assert ready["ready"] and ready["protocol"] == protocol.PROTOCOL_VERSION
            await process.stdin.send(b'{"id": 1, "op": "open_nic", "args": {}}\n{"id": 2, "op": "bogus"}\n'
                                     b'garbage\n{"id": 3, "op": "close", "args": {"handle": 77}}\n')
            answers = [await next_message() for _ in range(4)]
            by_id = {answer["id"]: answer for answer in answers}
            assert [answer["id"] for answer in answers][-1] == 1  # the slow one answers last: not in order asked
            assert by_id[2]["error"]["message"].startswith("unknown op 'bogus'")
            assert by_id[None]["error"]["message"].startswith("not JSON")
            assert by_id[3]["error"] == {"type": "ValueError", "message": "close: no object with handle 77"}
            nic = by_id[1]["result"]["nic"]
            await process.stdin.send(json.dumps({"id": 4, "op": "register_mr", "args": {"nic": nic, "size": 8192}})
                                     .encode() + b"\n")
            mr = (await next_message())["result"]["mr"]
            await process.stdin.send(json.dumps({"id": 5, "op": "fill", "args": {"mr": mr, "seed": 9}}).encode()
                                     + b"\n")
            assert (await next_message())["result"]["sha256"] == protocol.sha256_hex(protocol.pattern(9, 8192))
            await process.stdin.aclose()
            assert await process.wait() == 0
    await assert_no_leftovers(drivers=[process.pid])


# -- real SSH -----------------------------------------------------------------------------------------------------

ASYNCIO_ONLY = on("asyncio")


@pytest.fixture(params=only("asyncio", "uvloop"))
def anyio_backend(request):
    return request.param  # asyncssh is asyncio-only (trio: see test_connect_peer_on_trio_says_it_needs_asyncio)


async def test_two_hosts_through_ssh_with_requests_in_flight_and_remote_errors_named(server):
    from aiofabric import connect_peer
    from aiofabric.peer.connect import two_hosts
    async with connect_peer("127.0.0.1", server.port, **server.options()) as peer:
        assert 0 < peer.handshake_s < 20 and peer.remote_pid > 0
        result = await two_hosts(peer, size=300_000)
        assert result["verified"] and result["bytes"] == 300_000 and result["local_ip"] != result["remote_ip"]
        async with anyio.create_task_group() as tasks:  # several requests in flight from several tasks
            for _ in range(5):
                tasks.start_soon(peer.ping)
        with pytest.raises(PeerError) as caught:
            await peer.create_cq(99)
        message = str(caught.value)
        assert f"127.0.0.1:{server.port}" in message and "create_cq (request" in message
        assert "ValueError: nic: no NIC with handle 99" in message and caught.value.remote_type == "ValueError"
        await peer.ping()  # an error answer does not break the peer
        remote_pid = peer.remote_pid
    await assert_no_leftovers(server.port, [os.getpid(), remote_pid])


async def _cli(*args, timeout=60):
    started = time.monotonic()
    with anyio.fail_after(timeout):
        process = await anyio.run_process([*CLI, *args], check=False)
    stdout = process.stdout.decode()
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    return process.returncode, json.loads(last) if last.startswith("{") else None, process, time.monotonic() - started


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
@BOTH_SERVERS
async def test_cli_connect_and_ring_json(server):
    code, result, process, _ = await _cli("connect", "127.0.0.1", *server.cli_flags(), "--size", "1048576", "--json")
    assert code == 0, process.stderr.decode()
    assert result["ok"] and result["verified"] and result["bytes"] == 1048576
    assert result["remote_host"] == f"127.0.0.1:{server.port}" and result["handshake_ms"] > result["transfer_ms"] > 0
    assert_valid(result)
    hosts = ",".join([f"127.0.0.1:{server.port}"] * 3)
    code, result, process, _ = await _cli("--backend", "uvloop", "connect", "--hosts", hosts, *server.cli_flags(),
                                          "--size", "5000", "--json")
    assert code == 0 and result["verified"] and len(set(result["remote_ips"])) == 3, process.stderr.decode()
    assert_valid(result)
    await assert_no_leftovers(server.port)


@ASYNCIO_ONLY
@pytest.mark.parametrize("test,shape", [("write", ("--iters", "200", "--size", "4096")),
                                        ("read", ("--iters", "200", "--size", "4096")),
                                        ("send", ("--iters", "200", "--size", "4096")),
                                        ("write", ("--iters", "1100", "--size", "65536", "--depth", "16"))],
                         ids=["write", "read", "send", "write-reused-slots"])
async def test_bench_with_the_server_side_on_a_peer(server, test, shape):
    code, result, process, _ = await _cli("bench", test, "--peer", "127.0.0.1", *server.cli_flags(), "--qps", "2",
                                          *shape, "--json", timeout=120)
    assert code == 0 and result["ok"] and result["verified"], process.stderr.decode()[-3000:]
    assert result["remote_host"] == f"127.0.0.1:{server.port}" and result["ops"] == 2 * int(shape[1])
    assert result["verification"].endswith("bytes") or "placement counts" in result["verification"]
    await assert_no_leftovers(server.port)


@ASYNCIO_ONLY
@BOTH_SERVERS
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
async def test_bench_peer_interrupted_or_killed_mid_run_leaves_nothing_on_either_side(server, signum, tmp_path):
    """Ctrl-C: the client stops the remote endpoint. A killed client cannot: its endpoint exits at the end of its
    input, which sshd closes (OpenSSH signals nothing), and every emulator follows its driver."""
    pcap = tmp_path / "wire.pcap"
    async with await anyio.open_process([*CLI, "bench", "write", "--peer", "127.0.0.1", *server.cli_flags(),
                                         "--duration", "60", "--pcap", str(pcap), "--json"]) as process:
        with anyio.fail_after(30):  # moving data: the local NIC's capture holds packets
            while not (pcap.exists() and pcap.stat().st_size > 24):
                assert process.returncode is None, (await process.stderr.receive()).decode()
                await anyio.sleep(0.05)
        process.send_signal(signum)
        with anyio.fail_after(10):
            code = await process.wait()
    assert code == (130 if signum == signal.SIGINT else -signal.SIGKILL)
    await assert_no_leftovers(server.port, [process.pid])


@ASYNCIO_ONLY
async def test_bench_through_a_peer_refuses_what_needs_the_emulators_debug_channel(server):
    code, result, _, _ = await _cli("bench", "write", "--peer", "127.0.0.1", *server.cli_flags(), "--inject-fault",
                                    "skip_placement:1", "--json")
    assert code == 2 and "--inject-fault skip_placement:1: needs the emulator's debug channel" in result["error"]


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_cli_failure_is_one_json_line_naming_the_host(server):
    code, result, _, seconds = await _cli("connect", "127.0.0.1", *server.cli_flags(), "--known-hosts",
                                          str(server.directory / "missing"), "--json")
    assert code == 1 and not result["ok"] and seconds < 20
    assert result["error"].startswith(f"PeerError: 127.0.0.1:{server.port}: host key unknown")
    code, result, _, _ = await _cli("connect", "--json", *server.cli_flags())
    assert code == 2 and result["error"] == "usage: give one HOST or --hosts FILE|h1,h2 (not both)"


async def _expect_peer_error(server, within, match, **options):
    from aiofabric import connect_peer
    started = time.monotonic()
    with pytest.raises(PeerError) as caught:
        async with connect_peer("127.0.0.1", server.port, **server.options(**options)) as peer:
            await peer.ping()
    assert time.monotonic() - started < within
    for text in ([match] if isinstance(match, str) else match):
        assert text in str(caught.value), str(caught.value)
    await assert_no_leftovers(server.port, [os.getpid()])
    return caught.value


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_wrong_host_key_is_refused_as_a_possible_impersonation(server):
    other = server.directory / "other"
    other.mkdir()
    wrong = sshd.make_keys(str(other))["host"]
    server.known_hosts.write_text(sshd.known_hosts_line("127.0.0.1", server.port, wrong))
    await _expect_peer_error(server, 10, ["host key does NOT match", str(server.known_hosts)])
    assert server.commands_started() == 0  # nothing ran on the server


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_unknown_host_key_is_refused_with_how_to_trust_it(server):
    server.known_hosts.write_text("")
    await _expect_peer_error(server, 10, ["host key unknown", f"ssh-keyscan -p {server.port} 127.0.0.1"])


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_known_hosts_none_connects_and_warns(server, caplog):
    from aiofabric import connect_peer
    async with connect_peer("127.0.0.1", server.port, **server.options(known_hosts=None)) as peer:
        await peer.ping()
    assert "host key NOT checked" in caplog.text


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_refused_authentication(server):
    stranger = server.directory / "stranger"
    stranger.mkdir()
    key = sshd.make_keys(str(stranger))["client"]
    await _expect_peer_error(server, 10, ["authentication refused", key], identity=key)


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_unreachable_port(server):
    with anyio.fail_after(5):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        await listener.aclose()  # nothing listens there now
    from aiofabric import connect_peer
    started = time.monotonic()
    with pytest.raises(PeerError, match=f"127.0.0.1:{port}: cannot reach the SSH server"):
        async with connect_peer("127.0.0.1", port, **server.options(connect_timeout=5)):
            pass
    assert time.monotonic() - started < 6


def _python_with(directory: Path, *paths: str) -> str:
    """A remote `python` that imports from `paths` only, after whatever PYTHONPATH the caller set (push prepends its
    dir): -S skips site, and with it the site-packages and the editable install's finder."""
    wrapper = directory / "python-with-some"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{":".join(paths)}" '
                       f'exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _python_without_aiofabric(directory: Path) -> str:
    """A remote `python` that has aiofabric's dependencies (this one's site-packages) but not aiofabric: a copy of
    site-packages made of links to everything in it but aiofabric itself (installed there, unless editable)."""
    import site
    mirror = directory / "site-packages-without-aiofabric"
    mirror.mkdir(exist_ok=True)
    for packages in map(Path, site.getsitepackages()):
        for entry in packages.iterdir():
            if not entry.name.lower().startswith(("aiofabric", "__editable__")) and \
                    not (mirror / entry.name).exists():
                (mirror / entry.name).symlink_to(entry)
    return _python_with(directory, str(mirror))


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
@BOTH_SERVERS
async def test_remote_without_aiofabric_fails_clearly_then_push_works(server):
    python = _python_without_aiofabric(server.directory)
    error = await _expect_peer_error(server, 20, f"127.0.0.1:{server.port}: the remote endpoint exited before it "
                                                 f"was ready: the remote python ({python}) has no module named "
                                                 "aiofabric: install aiofabric there or use push=True", python=python)
    assert "\n" not in str(error) and "Traceback" not in str(error)
    from aiofabric import connect_peer
    async with connect_peer("127.0.0.1", server.port, **server.options(python=python, push=True)) as peer:
        pushed = peer.pushed_to
        assert pushed and (os.stat(pushed).st_mode & 0o777) == 0o700
        environ = Path(f"/proc/{peer.remote_pid}/environ").read_bytes().split(b"\0")
        assert any(entry.startswith(f"PYTHONPATH={pushed}".encode()) for entry in environ)
        nic = await peer.open_nic()
        mr = await peer.register_mr(nic, 4096)
        assert await peer.fill(mr, seed=1, length=4096) == protocol.sha256_hex(protocol.pattern(1, 4096))
    assert not os.path.exists(pushed)  # removed on the way out
    await assert_no_leftovers(server.port, [os.getpid()])


def _pushed_dirs() -> set[str]:
    """Pushed dirs on this host (the remote python's temp dir: the test's, or /tmp under OpenSSH's environment)."""
    return {path for where in (tempfile.gettempdir(), "/tmp") for path in glob.glob(f"{where}/aiofabric-push.*")}


async def assert_no_new_pushed_dirs(before: set[str]) -> None:
    """No pushed dir left behind. Another worker's push test (the other SSH server's variant) may hold a dir of its
    own for a while: wait for dirs that came after `before` to go, up to 30 s, rather than fail on theirs."""
    with anyio.move_on_after(30):
        while _pushed_dirs() - before:
            await anyio.sleep(0.2)
    assert _pushed_dirs() - before == set()


@ASYNCIO_ONLY
@BOTH_SERVERS
async def test_push_to_a_python_without_the_dependencies_copies_them_too(server, tmp_path):
    """A fresh venv's python lacks aiofabric and everything it needs: --push copies the pure-Python packages and,
    this being the same interpreter, numpy and isal too."""
    python = tmp_path / "bare" / "bin" / "python"
    await anyio.run_process([sys.executable, "-m", "venv", "--without-pip", str(python.parent.parent)])
    before = _pushed_dirs()
    code, result, process, _ = await _cli("connect", "127.0.0.1", *server.cli_flags(str(python)), "--push", "--size",
                                          "1048576", "--json")
    assert code == 0 and result["verified"] and result["pushed"], process.stderr.decode()[-3000:]
    await assert_no_new_pushed_dirs(before)
    await assert_no_leftovers(server.port)


def _python_with_an_old_typing_extensions(directory: Path) -> str:
    """A remote `python` with aiofabric's dependencies but anyio, and a typing_extensions 4.1.0 (as far as anyio can
    tell: without `sentinel`, which anyio 4.16 imports): a push used to copy anyio there but keep that
    typing_extensions, and the remote endpoint failed importing anyio."""
    import site
    mirror = directory / "site-packages-old-typing-extensions"
    mirror.mkdir(exist_ok=True)
    for packages in map(Path, site.getsitepackages()):
        for entry in packages.iterdir():
            if not entry.name.lower().startswith(("aiofabric", "__editable__", "anyio", "typing_extensions")) and \
                    not (mirror / entry.name).exists():
                (mirror / entry.name).symlink_to(entry)
    (mirror / "typing_extensions.py").write_text('"""An old typing_extensions: no sentinel."""\n')
    info = mirror / "typing_extensions-4.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: typing_extensions\nVersion: 4.1.0\n")
    (info / "RECORD").write_text("typing_extensions.py,,\n")
    return _python_with(directory, str(mirror))


@ASYNCIO_ONLY
async def test_push_ships_the_versions_installed_here_where_the_remote_has_others(server, caplog):
    """The remote lacks anyio and has an older typing_extensions than anyio needs: both are copied (the versions
    here), and what the remote has in the same version (numpy, idna, ...) is not."""
    import importlib.metadata
    python = _python_with_an_old_typing_extensions(server.directory)
    caplog.set_level(logging.INFO, logger="aiofabric.peer")
    before = _pushed_dirs()
    from aiofabric import connect_peer
    async with connect_peer("127.0.0.1", server.port, **server.options(python=python, push=True)) as peer:
        nic = await peer.open_nic()
        mr = await peer.register_mr(nic, 4096)
        assert await peer.fill(mr, seed=1, length=4096) == protocol.sha256_hex(protocol.pattern(1, 4096))
    version = importlib.metadata.version
    assert f"127.0.0.1:{server.port}: push: aiofabric, anyio {version('anyio')} (remote: none), typing_extensions " \
           f"{version('typing_extensions')} (remote: 4.1.0)" in caplog.messages
    await assert_no_new_pushed_dirs(before)
    await assert_no_leftovers(server.port, [os.getpid()])


@ASYNCIO_ONLY
async def test_push_to_another_platform_says_what_to_install_there(server, monkeypatch):
    """Compiled packages are not copied to another ABI or platform (faked here: this side claims another)."""
    import sysconfig
    monkeypatch.setattr(sysconfig, "get_platform", lambda: "elsewhere-arm")
    python = _python_with(server.directory)
    before = _pushed_dirs()
    error = await _expect_peer_error(server, 20, [f"127.0.0.1:{server.port}: push: the remote python ({python}: ",
                                                  "lacks compiled packages built here for ", " elsewhere-arm: install "
                                                  f"them there: {python} -m pip install 'numpy>=1.24' 'isal>=1.6'"],
                                     python=python, push=True)
    assert "anyio" not in str(error)  # pure Python: it would be copied
    await assert_no_new_pushed_dirs(before)


@ASYNCIO_ONLY
async def test_remote_with_aiofabric_but_not_its_dependencies_says_what_to_install(server):
    python = _python_with(server.directory, str(CHECKOUT))  # the checkout, no more
    error = await _expect_peer_error(server, 20, f"127.0.0.1:{server.port}: the remote endpoint exited before it "
                                                 f"was ready: the remote python ({python}) has no module named anyio: "
                                                 f"install it there ({python} -m pip install anyio) or use push=True",
                                     python=python)
    assert "\n" not in str(error) and "Traceback" not in str(error)


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_remote_endpoint_that_exits_before_it_is_ready(server):
    await _expect_peer_error(server, 10, ["exited before it was ready", "exit status 3", "gone early"],
                             python=[sys.executable, "-c", "import sys; sys.stderr.write('gone early\\n'); "
                                                           "sys.exit(3)"])


async def test_remote_endpoint_killed_mid_request_fails_what_was_in_flight(server):
    from aiofabric import connect_peer

    # the block's own task group wraps the failed post: connect_peer hands that group back as it is
    with pytest.raises(BaseExceptionGroup) as caught:
        async with connect_peer("127.0.0.1", server.port, **server.options()) as peer:
            nic = await peer.open_nic()
            cq = await peer.create_cq(nic)
            qp = await peer.create_qp(nic, cq)
            mr = await peer.register_mr(nic, 4096)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(peer.post, qp, "recv", mr)  # never completes: nobody sends
                with anyio.fail_after(5):
                    while "post" not in peer.state.in_flight.values():
                        await anyio.lowlevel.checkpoint()
                started = time.monotonic()
                os.kill(peer.remote_pid, signal.SIGKILL)
    assert time.monotonic() - started < 5
    _, rest = caught.value.split(PeerError)
    assert rest is None  # every error in it is the peer's
    matched, _ = caught.value.split(lambda error: isinstance(error, PeerError)
                                    and "exited after it started" in str(error) and "(while post" in str(error))
    assert matched is not None, caught.value
    await assert_no_leftovers(server.port, [os.getpid()])


@ASYNCIO_ONLY
async def test_a_flood_on_the_remote_stderr_is_all_logged_but_only_its_tail_kept(server, caplog):
    """8 MiB without a newline, a last line, an exit before the ready: every byte reaches logging in records of
    bounded size, and the error keeps only the last lines (a bounded tail, whatever the remote writes)."""
    flood = 8 << 20
    code = f"import sys; sys.stderr.write('x' * {flood} + '\\nthe last words\\n'); sys.exit(3)"
    with caplog.at_level(logging.WARNING, logger="aiofabric.peer"):
        error = await _expect_peer_error(server, 20, ["exit status 3", "the last words"],
                                         python=[sys.executable, "-c", code])
    assert len(str(error)) < 16 << 10
    messages = [record.getMessage() for record in caplog.records if record.name == "aiofabric.peer"]
    assert sum(message.count("x") for message in messages) == flood
    assert max(len(message) for message in messages) < 2 << 10


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
@BOTH_SERVERS  # OpenSSH leaves it running when the channel closes: the client kills it by pid
async def test_endpoint_that_never_starts_fails_within_the_connect_timeout(server):
    await _expect_peer_error(server, 6, "did not start within 2 s", connect_timeout=2,
                             python=[sys.executable, "-c", "import time; time.sleep(600)"])


@BOTH_SERVERS
async def test_request_past_the_command_timeout_fails_and_stops_the_endpoint(server):
    from aiofabric import connect_peer
    async with connect_peer("127.0.0.1", server.port, **server.options(command_timeout=1.5)) as peer:
        nic = await peer.open_nic(timeout=20)
        cq = await peer.create_cq(nic)
        qp = await peer.create_qp(nic, cq)
        mr = await peer.register_mr(nic, 4096)
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"post \(request \d+\) got no answer within 1.5 s"):
            await peer.post(qp, "recv", mr)  # nobody sends: it hangs
        assert time.monotonic() - started < 3
        with pytest.raises(PeerError, match="got no answer"):
            await peer.ping()  # the peer failed as a whole
    await assert_no_leftovers(server.port, [os.getpid()])


@BOTH_SERVERS
async def test_local_cancellation_mid_transfer_leaves_nothing(server):
    from aiofabric import connect_peer, open_nic
    started = time.monotonic()
    with anyio.move_on_after(4) as scope:
        async with connect_peer("127.0.0.1", server.port, **server.options()) as peer, open_nic("sim") as local:
            remote = await peer.open_nic()
            cq, remote_cq = await local.create_cq(64), await peer.create_cq(remote)
            qp, remote_qp = await local.create_qp(cq), await peer.create_qp(remote, remote_cq)
            await qp.connect(remote_qp.info, mtu=4096)
            await peer.connect_qp(remote_qp, qp.info())
            source, target = await local.register_mr(4 << 20), await peer.register_mr(remote, 4 << 20)
            while True:  # transfers until cancelled: local writes, remote hashing
                await qp.write(source, target.remote())
                await peer.sha256(target)
    assert scope.cancelled_caught and time.monotonic() - started < 20
    await assert_no_leftovers(server.port, [os.getpid()])


@ASYNCIO_ONLY  # the loop-specific paths run on uvloop in the tests around
async def test_shell_metacharacters_are_never_executed(server):
    marker = server.directory / "home" / "pwned"
    for python in (f"{sys.executable}; touch {marker}", [sys.executable, f"$(touch {marker})"]):
        await _expect_peer_error(server, 20, "exited before it was ready", python=python)
    from aiofabric import connect_peer
    async with connect_peer("127.0.0.1", server.port, **server.options()) as peer:
        for spec, ip in ((f"sim; touch {marker}", None), ("sim", f"$(touch {marker})"),
                         ("sim", f"`touch {marker}`")):
            with pytest.raises(PeerError, match="open_nic .* failed on the remote host"):
                await peer.open_nic(spec, ip=ip)
        with pytest.raises(PeerError, match="open_nic .* failed on the remote host"):
            await peer.open_nic("sim", netns=f"x; touch {marker}")
    assert not marker.exists()
    await assert_no_leftovers(server.port, [os.getpid()])


# -- trio ---------------------------------------------------------------------------------------------------------

@on("trio")
async def test_connect_peer_on_trio_says_it_needs_asyncio(anyio_backend):
    from aiofabric import connect_peer
    with pytest.raises(PeerError, match="needs asyncio or uvloop .*asyncio-only.*not trio"):
        async with connect_peer("127.0.0.1", 1):
            pass


def test_trio_users_never_import_asyncssh():
    code = ("import sys, trio, aiofabric\n"
            "async def main():\n"
            "    try:\n"
            "        async with aiofabric.connect_peer('127.0.0.1'):\n"
            "            pass\n"
            "    except aiofabric.PeerError as exc:\n"
            "        print(exc)\n"
            "trio.run(main)\n"
            "assert 'asyncssh' not in sys.modules, 'asyncssh imported'\n")
    import subprocess
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr
    assert "asyncio-only" in process.stdout
