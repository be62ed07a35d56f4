"""`aiofabric bench --server` against hostile clients: a live server process (its own limits, on 127.0.0.1), raw
JSON-lines clients that try what an attacker on the network would (every case of the probe, then hypothesis-drawn
sequences of random and malformed requests), and an honest `aiofabric bench` client afterwards.

What must hold: the server never crashes, opens no file or device a client names, answers every request line
exactly once (a drop answers what was in flight), stays within its limits, and then serves the next honest client.
"""
import ipaddress
import json
import re
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiofabric.peer import operations, serve
from tests.support.processes import CLI, IDLE, LIMITS, ServerProcess


HONEST = ("--iters", "50", "--size", "4K")  # the honest client's run: the server's own flags (perftest's symmetric)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = ServerProcess(tmp_path_factory.mktemp("bench-server"), *LIMITS, *HONEST, "--forever")
    yield running
    assert running.process.poll() is None, "the server died: " + running.log.read_text()[-3000:]
    assert running.stop() == 130


class Client:
    """A raw protocol client: lines out, answers in. A busy server (still closing the last client's NICs) is
    tried again for up to 20 s."""

    def __init__(self, port: int, timeout: float = 15, busy_for: float = 20) -> None:
        deadline = time.monotonic() + busy_for
        while True:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            self.file = self.sock.makefile("rb")
            first = json.loads(self.file.readline())
            if first.get("ready"):
                self.ready = first
                return
            self.close()
            assert first["error"]["type"] == "Busy" and time.monotonic() < deadline, first
            time.sleep(0.1)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, request_id: int, op: str, **args) -> dict:
        self.send(json.dumps({"id": request_id, "op": op, "args": args}).encode() + b"\n")
        return self.answer()

    def answer(self) -> dict:
        line = self.file.readline()
        assert line, "the server closed the connection"
        return json.loads(line)

    def answers_until_closed(self) -> list[dict]:
        answers = []
        while line := self.file.readline():
            answers.append(json.loads(line))
        return answers

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def _gid(ip: str) -> str:
    return "00000000000000000000ffff" + ipaddress.IPv4Address(ip).packed.hex()


def _refused(answer: dict, *words: str) -> None:
    assert not answer["ok"] and answer["error"]["type"] == "NotAllowed", answer
    for word in words:
        assert word in answer["error"]["message"], answer


def test_nothing_a_client_names_touches_the_host(server):
    planted = server.workdir / "planted"
    client = Client(server.port)
    try:
        assert client.ready["idle_timeout"] == IDLE
        _refused(client.request(1, "open_nic", options={"pcap": str(planted)}), "'pcap'", "server's to choose")
        _refused(client.request(2, "open_nic", spec="0000:41:00.0"), "'spec'", "the server chooses its NIC")
        _refused(client.request(3, "open_nic", options={"transport": "raw"}), "'transport'")
        _refused(client.request(4, "open_nic", ip="127.0.0.99"), "'ip'")
        _refused(client.request(5, "open_nic", options={"netns": "../../etc"}), "'netns'")
        _refused(client.request(6, "post", qp=1, verb="send", mr=2), "op 'post' is not allowed")
        nic = client.request(7, "open_nic", options={"loss": 0.0, "seed": 4})
        assert nic["ok"] and nic["result"]["ip"].startswith("127.0.0."), nic  # reached over loopback: a free one
        cq = client.request(8, "create_cq", nic=1, depth=64)["result"]["cq"]
        qp = client.request(9, "create_qp", nic=1, cq=cq)["result"]["qp"]
        for target in ("127.0.0.99", "10.0.0.1"):  # reflection: the server's packets would go elsewhere
            _refused(client.request(10, "connect_qp", qp=qp, peer={"qpn": 2, "psn": 0, "gid": _gid(target),
                                                                   "mac": "02:00:00:00:00:01"}),
                     f"address {target}", "talks only to the client that asked")
        ok = client.request(11, "connect_qp", qp=qp, peer={"qpn": 2, "psn": 0, "gid": _gid("127.0.0.1"),
                                                           "mac": "02:00:00:00:00:01"})
        assert ok["ok"], ok  # its own address is fine
        shown = client.request(12, "report", result={"fw_version": "\x1b[2J\x1b]0;pwned\x07", "test": "write",
                                                     "error": "x\nverified: yes", "rows": []})
        assert not shown["ok"] and "not a bench result" in shown["error"]["message"]  # no rows: not printed
    finally:
        client.close()
    time.sleep(0.5)
    assert not planted.exists() and not list(server.workdir.glob("*.pcap*"))
    log = server.log.read_text()
    for word in ("'pcap'", "'spec'", "'transport'", "'ip'", "'netns'", "'post'", "127.0.0.99"):
        assert re.search(rf"client 127\.0\.0\.1:\d+: refused request \d+: .*{re.escape(word)}", log), word


def test_a_nesting_bomb_an_overlong_line_and_garbage_are_answered_then_dropped(server):
    for data, error in ((b'{"x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}\n", "nested deeper than 16 levels"),
                        (b'{"id": 1, "op": "ping", "pad": "' + b"x" * (70 << 10) + b'"}\n', "line longer than 65536"),
                        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n", "not JSON")):
        client = Client(server.port)
        try:
            assert client.request(1, "ping")["ok"]
            client.send(data)
            answers = client.answers_until_closed()  # then the server closes the connection
        finally:
            client.close()
        assert answers == [{"id": None, "ok": False, "error": {"type": "ProtocolError", "message": answers[0][
            "error"]["message"]}}] and error in answers[0]["error"]["message"], answers
    assert "sent non-protocol bytes (JSON nested deeper than 16 levels); dropped it" in server.log.read_text()


def test_a_client_stays_within_its_limits(server):
    client = Client(server.port)
    try:
        assert client.request(1, "open_nic")["ok"]
        second = client.request(2, "open_nic")
        assert second["error"]["type"] == "LimitError" and "--max-nics" in second["error"]["message"]
        huge = client.request(3, "register_mr", nic=1, size=1 << 30)
        assert huge["error"]["type"] == "MemoryError" and "--max-memory" in huge["error"]["message"], huge
        rings = client.request(4, "create_cq", nic=1, depth=1 << 21)  # rings count too: 64 MiB of CQEs past the
        # ~5 MiB the NIC holds of its own (mostly its backing store)
        assert rings["error"]["type"] == "MemoryError", rings
        cq = client.request(5, "create_cq", nic=1, depth=64)["result"]["cq"]
        qp = client.request(6, "create_qp", nic=1, cq=cq, rq_depth=1)["result"]["qp"]
        mr = client.request(7, "register_mr", nic=1, size=4096)["result"]["mr"]
        assert len(server.children()) == 1
        blocked = [json.dumps({"id": 100 + i, "op": "post_recvs", "args": {"qp": qp, "mr": mr, "count": 4,
                                                                           "size": 64}}) for i in range(12)]
        client.send("\n".join(blocked).encode() + b"\n")  # each waits for receive-queue space that never comes
        over = [client.answer() for _ in range(4)]  # 12 sent, 8 in flight: 4 refused at once
        assert sorted(a["id"] for a in over) == [108, 109, 110, 111]
        assert all(a["error"]["type"] == "LimitError" and "--max-requests" in a["error"]["message"] for a in over)
        client.sock.shutdown(socket.SHUT_WR)  # leaving: the 8 in flight are answered, not forgotten
        rest = client.answers_until_closed()
    finally:
        client.close()
    assert sorted(a["id"] for a in rest) == list(range(100, 108))
    assert all(a["error"]["type"] == "Cancelled" for a in rest), rest


def test_an_idle_client_is_dropped_and_the_next_one_served(server):
    idle = Client(server.port)
    try:
        started = time.monotonic()
        with pytest.raises(AssertionError, match="Busy"):  # meanwhile the server is taken...
            Client(server.port, busy_for=0)
        assert idle.answers_until_closed() == []  # ... until the idle one is dropped
        assert IDLE - 0.1 < time.monotonic() - started < IDLE + 10  # the server's clock, not ours (15 s)
    finally:
        idle.close()
    dripping = Client(server.port)  # bytes that never end a line do not count as requests
    try:
        started = time.monotonic()
        while not select.select([dripping.sock], [], [], 0.25)[0]:  # until the server closes (no fixed count of
            assert time.monotonic() - started < IDLE + 10  # drips, which a loaded machine stretches past a bound)
            try:
                dripping.send(b" ")
            except OSError:
                break
        assert dripping.answers_until_closed() == [] and time.monotonic() - started > IDLE - 0.1
    finally:
        dripping.close()
    assert Client(server.port).request(1, "ping")["ok"]
    log = server.log.read_text()
    assert re.search(rf"client 127\.0\.0\.1:\d+ sent no request for {IDLE:g} s; dropped it", log)


def _buffers_bound() -> int:
    """More than the kernel's socket buffers on both sides can hold (their autotuning maxima), plus slack: what a
    client can send to a server that has stopped reading it."""
    try:
        most = [int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2]) for name in ("tcp_rmem", "tcp_wmem")]
    except (OSError, IndexError, ValueError):
        most = [32 << 20, 32 << 20]
    return 2 * sum(most) + (16 << 20)


def test_a_client_that_reads_no_answers_is_dropped(server):
    """A client sends pings as fast as it can from the moment it connects and reads nothing. The server stops reading
    it once its answers fill the connection, and after --idle-timeout drops it ("read no answer", the only clock that
    runs while an answer waits to be written) and resets the connection: the client's send fails with
    ECONNRESET/EPIPE before it has sent more than the kernel's buffers hold. An accepted connection that read into
    memory whatever arrived (anyio's asyncio accept leaves it reading until a receive first waits, which a flood
    from the first moment never lets happen) took gigabytes and never blocked the client.
    One clock decides: the server's. The pings are made before connecting, the client's socket timeout is far past
    the server's, and a timeout fails the test (it does not pass as "the server dropped us"). The log is read for this
    client's port only: an earlier client's lines cannot satisfy it."""
    pings = b"".join(json.dumps({"id": i, "op": "ping", "args": {}}).encode() + b"\n" for i in range(50_000))
    bound = _buffers_bound()
    deadline = time.monotonic() + 20
    while True:  # the first chunk leaves before the ready line is read: the server's first read finds bytes waiting
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=IDLE + 60)
        sent = sock.send(pings[:1 << 16])
        with sock.makefile("rb") as first_line:
            first = json.loads(first_line.readline())
        if first.get("ready"):
            break
        sock.close()  # still busy with the last client
        assert first["error"]["type"] == "Busy" and time.monotonic() < deadline, first
        time.sleep(0.1)
    me = sock.getsockname()[1]
    try:
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # not TimeoutError: that is our clock
            while sent < bound:
                sent += sock.send(pings[sent % len(pings):sent % len(pings) + (1 << 16)])
        deadline = time.monotonic() + 30
        while not re.search(rf"client 127\.0\.0\.1:{me} read no answer for {IDLE:g} s; dropped it",
                            server.log.read_text()):
            assert time.monotonic() < deadline, server.log.read_text()[-2000:]
            time.sleep(0.1)
    finally:
        sock.close()
    assert Client(server.port).request(1, "ping")["ok"]
    mine = re.findall(rf"client 127\.0\.0\.1:{me}: refused request .*", server.log.read_text())
    assert len(mine) == serve.LOGGED_REFUSALS, mine[-3:]  # past --max-requests: the first few logged, then counted
    assert mine[-1].endswith("; further refusals are counted, not logged"), mine[-1]
    assert f"client 127.0.0.1:{me}: cannot answer" not in server.log.read_text()


KINDS = ("ping", "open_nic", "create_cq", "create_qp", "register_mr", "fill", "sha256", "connect_qp",
         "post_recvs", "close", "report", "post", "bogus", "pong")
LAT_KINDS = ("ping", "open_nic", "create_cq", "create_qp", "register_mr", "connect_qp", "lat_params", "pong",
             "pong_wait", "close", "post", "bogus")
hostile_int = st.one_of(st.integers(-3, 8), st.sampled_from([1 << 24, 1 << 40, 2**64, -2**63]), st.floats(), st.text(max_size=3),
                        st.none(), st.booleans())
scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
json_value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                          max_leaves=10)
peer_info = st.fixed_dictionaries({"qpn": hostile_int, "psn": hostile_int, "mac": st.just("02:00:00:00:00:01"),
                                   "gid": st.sampled_from([_gid("127.0.0.1"), _gid("127.0.0.99"), "zz", "00" * 16])})
args_of = {
    "open_nic": st.fixed_dictionaries({}, optional={"options": st.dictionaries(
        st.sampled_from(["loss", "seed", "pcap", "netns", "transport", "ip"]),
        st.one_of(st.floats(0, 0.5), st.integers(0, 9), st.just("/tmp/x")), max_size=2),
        "spec": st.sampled_from(["sim", "0000:41:00.0"])}),
    "create_cq": st.fixed_dictionaries({"nic": hostile_int}, optional={"depth": hostile_int}),
    "create_qp": st.fixed_dictionaries({"nic": hostile_int, "cq": hostile_int},
                                       optional={"sq_depth": hostile_int, "rq_depth": hostile_int}),
    "register_mr": st.fixed_dictionaries({"nic": hostile_int, "size": hostile_int},
                                         optional={"atomic": st.one_of(st.booleans(), hostile_int)}),
    "fill": st.fixed_dictionaries({"mr": hostile_int}, optional={"seed": hostile_int, "byte": hostile_int,
                                                                 "offset": hostile_int, "length": hostile_int}),
    "sha256": st.fixed_dictionaries({"mr": hostile_int}, optional={"offset": hostile_int, "length": hostile_int}),
    "connect_qp": st.fixed_dictionaries({"qp": hostile_int, "peer": peer_info},
                                        optional={"mtu": hostile_int, "timeout": hostile_int,
                                                  "atomic": st.one_of(st.booleans(), hostile_int)}),
    "lat_params": st.fixed_dictionaries({"test": st.sampled_from(["write", "read", "x", "write\x1b[2J\x1b[31m"]),
                                         "size": st.one_of(hostile_int, st.just(2)),
                                         "mtu": hostile_int, "iters": hostile_int}),
    "pong": st.fixed_dictionaries({"qp": hostile_int, "mr": hostile_int, "test": st.sampled_from(["write", "send",
                                                                                                  "read"]),
                                   "size": hostile_int, "iters": hostile_int, "wait": st.one_of(
                                       st.floats(0, 0.3), hostile_int)},
                                  optional={"rx_slots": hostile_int, "warmup": hostile_int, "inline": hostile_int,
                                            "remote": st.fixed_dictionaries({"addr": hostile_int,
                                                                             "rkey": hostile_int})}),
    "pong_wait": st.fixed_dictionaries({"pong": hostile_int}),
    "post_recvs": st.fixed_dictionaries({"qp": hostile_int, "mr": hostile_int, "count": st.integers(0, 3),
                                         "size": hostile_int}),
    "close": st.fixed_dictionaries({"handle": hostile_int}),
    "report": st.fixed_dictionaries({"result": st.dictionaries(st.text(max_size=8), json_value, max_size=4)}),
}
request_line = st.one_of(
    st.sampled_from(KINDS).flatmap(lambda op: st.tuples(st.just(op), args_of.get(op, json_value))),
    st.tuples(st.just("raw"), json_value),  # any JSON value at all, as the whole line
)
ending = st.sampled_from(["eof", "eof", "eof", "nesting", "garbage", "long line"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(request_line, max_size=10), ending)
def test_random_and_malformed_request_sequences_are_each_answered(server, lines, end):
    client = Client(server.port)
    expected_ids, anonymous, dropped = [], 0, False
    try:
        for number, (op, args) in enumerate(lines, 1):
            if op == "raw":
                if isinstance(args, dict):
                    args.pop("id", None)  # an id we did not choose could collide with ours: keep ours unique
                dropped = not isinstance(args, dict)  # not even an object: not protocol, the client is dropped
                data = json.dumps(args)
                anonymous += 1
            else:
                data = json.dumps({"id": 1000 + number, "op": op, "args": args})
                expected_ids.append(1000 + number)
            client.send(data.encode() + b"\n")
            if dropped:
                break
        if end == "eof" and not dropped:
            client.sock.shutdown(socket.SHUT_WR)
        elif not dropped:
            anonymous += 1
            client.send({"nesting": b"[" * 5000 + b"]" * 5000, "garbage": b"\x00\xffGET /\r",
                         "long line": b"x" * (66 << 10)}[end] + b"\n")
        assert len(server.children()) <= 1 and server.rss_mb() < 400
        answers = client.answers_until_closed()
    finally:
        client.close()
    ids = [answer["id"] for answer in answers]
    assert sorted(i for i in ids if i is not None) == expected_ids, answers  # each request: exactly one answer
    assert ids.count(None) == anonymous, answers
    by_id = {answer["id"]: answer for answer in answers}
    for number, (op, args) in enumerate(lines, 1):
        answer = by_id.get(1000 + number)
        if answer is None:
            continue
        if op in ("post", "bogus", "pong"):  # pong: the latency exchange, which a bench server does not run
            assert not answer["ok"]
        if op == "open_nic" and ("spec" in args or set(args.get("options", {})) - {"loss", "seed"}):
            assert answer["error"]["type"] == "NotAllowed", answer
    assert server.process.poll() is None


def test_the_next_honest_client_runs_a_verified_bench_and_the_server_shows_it_escaped(server):
    deadline = time.monotonic() + 30
    while True:
        run = subprocess.run([*CLI, "bench", "write", "127.0.0.1", "--port", str(server.port), *HONEST, "--json"],
                             capture_output=True, text=True, timeout=90)
        result = json.loads(run.stdout.strip().splitlines()[-1])
        if result["ok"] or "busy" not in result["error"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert run.returncode == 0 and result["verified"] and result["ops"] == 50, run.stderr[-3000:]
    time.sleep(0.5)
    out = server.out.read_text()
    assert re.search(r"the report of client 127\.0\.0\.\d+:\d+ \(its own measurements\)", out) and \
        "verified: yes" in out
    assert "\x1b" not in out and "\x07" not in out  # every earlier client's text was escaped
    deadline = time.monotonic() + 10
    while server.children():  # its NIC went with it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert server.rss_mb() < 400


def test_an_honest_run_longer_than_the_idle_timeout_is_kept_alive(tmp_path):
    timed = ("-D", str(IDLE * 2.5), "--size", "4K")
    server = ServerProcess(tmp_path, *LIMITS, *timed)
    run = subprocess.run([*CLI, "bench", "write", "127.0.0.1", "--port", str(server.port), *timed, "--json"],
                         capture_output=True, text=True, timeout=90)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0 and result["verified"] and result["seconds"] > IDLE * 1.5, run.stderr[-3000:]
    assert server.process.wait(30) == 0


def test_ctrl_c_of_a_client_mid_run_ends_it_within_seconds_and_frees_the_server_side(tmp_path):
    server = ServerProcess(tmp_path, *LIMITS, "-D", "60", "--forever")
    client = subprocess.Popen([*CLI, "bench", "write", "127.0.0.1", "--port", str(server.port), "-D", "60", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not server.children():  # the server's NIC is up: the run is on
            assert client.poll() is None and time.monotonic() < deadline, client.communicate()
            time.sleep(0.05)
        time.sleep(1)
        client.send_signal(signal.SIGINT)
        started = time.monotonic()
        stdout, stderr = client.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        client.kill()
        client.wait()
    assert client.returncode == 130 and json.loads(stdout.strip().splitlines()[-1])["error"] == \
        "interrupted by SIGINT", stderr[-2000:]
    assert took < 8, took  # its clean-up closed the server's objects through answers it still read
    deadline = time.monotonic() + 10
    while server.children():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert server.stop() == 130


def test_a_single_shot_server_whose_client_fails_fails_too(tmp_path):
    single = ServerProcess(tmp_path, *LIMITS, "--json")
    client = Client(single.port)
    try:
        client.send(b'{"x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}\n")
        assert "nested deeper" in client.answers_until_closed()[0]["error"]["message"]
    finally:
        client.close()
    assert single.process.wait(30) == 1
    result = json.loads(single.out.read_text().strip().splitlines()[-1])
    assert not result["ok"] and result["error"].startswith("the client's session failed: client 127.0.0.1:")


def test_the_servers_own_capture_file_records_its_clients_test(tmp_path):
    capture = tmp_path / "server.pcap"
    pcap_server = ServerProcess(tmp_path, *LIMITS, "--pcap", str(capture), "--iters", "20", "--size", "4K",
                                test="read")
    run = subprocess.run([*CLI, "bench", "read", "127.0.0.1", "--port", str(pcap_server.port), "--iters", "20",
                          "--size", "4K", "--json"], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    assert pcap_server.process.wait(30) == 0
    assert capture.stat().st_size > 20 * 4096  # the read responses the server's NIC sent
    assert capture.read_bytes()[:4] in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1")  # pcap's magic (us, ns)


@pytest.fixture(scope="module")
def lat_server(tmp_path_factory):
    running = ServerProcess(tmp_path_factory.mktemp("lat-server"), *LIMITS, "--forever", command="lat")
    yield running
    assert running.process.poll() is None, "the server died: " + running.log.read_text()[-3000:]
    assert running.stop() == 130


def _mismatch(op, args):
    """A well-formed lat_params naming another test, size or MTU than the server's (write, 2, 4096): it ends the
    session after its answer."""
    if op != "lat_params":
        return False
    try:
        checked = operations.check_args(op, args, operations.LAT)
    except ValueError:
        return False
    return (checked["test"], checked["size"], checked["mtu"]) != ("write", 2, 4096)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(LAT_KINDS).flatmap(lambda op: st.tuples(st.just(op), args_of.get(op, json_value))),
                max_size=8))
def test_random_latency_exchanges_are_each_answered_and_the_lat_server_lives(lat_server, lines):
    client = Client(lat_server.port)
    try:
        for number, (op, args) in enumerate(lines, 1):
            client.send(json.dumps({"id": 1000 + number, "op": op, "args": args}).encode() + b"\n")
        client.sock.shutdown(socket.SHUT_WR)
        assert len(lat_server.children()) <= 1 and lat_server.rss_mb() < 400
        answers = client.answers_until_closed()
    finally:
        client.close()
    ends = next((number for number, line in enumerate(lines, 1) if _mismatch(*line)), len(lines))
    ids = sorted(answer["id"] for answer in answers)
    assert ids[:ends] == [1000 + n for n in range(1, ends + 1)] and len(ids) <= len(lines), answers
    for answer in answers:
        op, args = lines[answer["id"] - 1001]
        if op in ("post", "bogus") or _mismatch(op, args):
            assert not answer["ok"] and (op != "post" or answer["error"]["type"] == "NotAllowed"), answer
    assert lat_server.process.poll() is None
    assert "\x1b" not in lat_server.log.read_text() + lat_server.out.read_text()  # escaped, whatever it printed


def test_after_hostile_clients_an_honest_lat_client_runs_verified(lat_server):
    run = subprocess.run([*CLI, "lat", "write", "127.0.0.1", "--port", str(lat_server.port), "-n", "50", "--json"],
                         capture_output=True, text=True, timeout=90)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0 and result["ok"] and result["verified"], run.stderr[-2000:]
