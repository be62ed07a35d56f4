"""bench's server/client mode across two network namespaces: `serve_tcp` runs in namespace A, the client (connect_tcp
+ run_bench) in namespace B; both the TCP connection and RoCEv2 cross the veth pair between them.

Names carry the creating pid and stale ones are swept (as in tests/test_netns.py); addresses (10.79.0.0/24) live only
inside the namespaces. Skipped with the reason where `ip netns` is unavailable (needs root and iproute2).
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PID = os.getpid()
TAG = PID % 100000
NS = (f"aiotcp-a{PID}", f"aiotcp-b{PID}")
VETH = (f"ata{TAG}", f"atb{TAG}")
ADDRESSES = ("10.79.0.1", "10.79.0.2")
STALE_NS = re.compile(r"aiotcp-[ab](\d+)")
STALE_VETH = re.compile(r"at[ab](\d+)")
HELPER = Path(__file__).parent / "tcp_peer_helper.py"
ROOT = Path(__file__).resolve().parent.parent


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20, text=True).stdout


def sweep_stale_runs() -> None:
    live = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = STALE_NS.fullmatch(name)
        if match and int(match.group(1)) not in live:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    tags = {pid % 100000 for pid in live}
    for line in ip("-o", "link", "show", "type", "veth").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = STALE_VETH.fullmatch(name)
        if match and int(match.group(1)) not in tags:
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    try:
        sweep_stale_runs()
        ip("netns", "add", NS[0])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns unavailable here: {exc.stderr.strip()}")
    try:
        ip("netns", "add", NS[1])
        ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for i in (0, 1):
            ip("link", "set", VETH[i], "netns", NS[i])
            ip("-n", NS[i], "addr", "add", f"{ADDRESSES[i]}/24", "dev", VETH[i])
            ip("-n", NS[i], "link", "set", VETH[i], "mtu", "9000", "up")  # RoCE frames at MTU 4096 fit
            ip("-n", NS[i], "link", "set", "lo", "up")
        yield
    finally:
        for name in NS:  # deleting a namespace deletes the veth end inside it, and with it the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", VETH[0]], capture_output=True, timeout=20)  # if it never moved


def _in(namespace: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, str(HELPER), *args]


@pytest.mark.parametrize("test", ["write", "send"])
def test_bench_server_in_one_namespace_client_in_another(two_hosts, test):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(_in(NS[0], "serve", ADDRESSES[0]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=environment)
    try:
        line = server.stdout.readline()  # "listening PORT" (or EOF if it failed)
        assert line.startswith("listening "), server.stderr.read()
        port = line.split()[1]
        client = subprocess.run(_in(NS[1], "bench", ADDRESSES[0], port, test, ADDRESSES[1]), capture_output=True,
                                text=True, timeout=60, env=environment)
        assert client.returncode == 0, client.stderr[-3000:]
        result = json.loads(client.stdout.strip().splitlines()[-1])
        assert result["verified"] and result["test"] == test and result["ops"] == 400
        assert result["packets"] > 0  # RoCEv2 from B's NIC (10.79.0.2, reachable only over the veth) to A's
        assert result["remote_host"] == f"{ADDRESSES[0]}:{port}"
        out, err = server.communicate(timeout=30)
        assert server.returncode == 0, err[-3000:]
        lines = out.splitlines()
        report = json.loads(next(x for x in lines if x.startswith("report "))[len("report "):])
        summary = json.loads(next(x for x in lines if x.startswith("summary "))[len("summary "):])
        assert report == result  # the server got the table's numbers
        assert summary["outcome"] == "end of input" and summary["objects_left"] == 0 and summary["reports"] == 1
        assert summary["client"].startswith(f"{ADDRESSES[1]}:")  # TCP crossed the veth from B
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
