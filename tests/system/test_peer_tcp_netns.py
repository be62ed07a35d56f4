"""bench's server/client mode across two network namespaces: `aiofabric bench --server` runs in namespace A, the
client (`aiofabric bench TEST A_ADDRESS`) in namespace B; both the TCP connection and RoCEv2 cross the veth pair between them.

Names carry the creating pid and stale ones are swept (as in tests/system/test_netns.py); addresses (10.79.0.0/24)
live only inside the namespaces. Skipped with the reason where `ip netns` is unavailable (needs root and iproute2).
"""
import json
import os
import re
import subprocess
import sys

import pytest
from tests.support import netns

PID = os.getpid()
TAG = PID % 100000
NS = (f"aiotcp-a{PID}", f"aiotcp-b{PID}")
VETH = (f"ata{TAG}", f"atb{TAG}")
ADDRESSES = ("10.79.0.1", "10.79.0.2")
STALE_NS = re.compile(r"aiotcp-[ab](\d+)")
STALE_VETH = re.compile(r"at[ab](\d+)")


@pytest.fixture(scope="module")
def two_hosts():
    with netns.two_hosts(NS, VETH, ADDRESSES, (STALE_NS, STALE_VETH)):
        yield


def _cli(namespace: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, "-m", "aiofabric", *args]


FLAGS = ("--qps", "2", "--iters", "200", "--size", "4K")  # both sides' (the server checks its client's)


@pytest.mark.parametrize("test, ip", [("write", ["--ip", ADDRESSES[1]]), ("send", [])])
def test_bench_server_in_one_namespace_client_in_another(two_hosts, test, ip):
    """perftest's two commands: `aiofabric bench TEST --server` on host A, `aiofabric bench TEST A` on host B (its
    NIC at --ip, or at the address that routes to A: the server's QPs talk only to the client's address)."""
    server = subprocess.Popen(_cli(NS[0], "bench", test, "--server", "--bind", ADDRESSES[0], *FLAGS), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()  # "aiofabric bench server: waiting ..." (or EOF if it failed)
        assert "waiting for a client" in line, line + server.stderr.read()
        client = subprocess.run(_cli(NS[1], "bench", test, ADDRESSES[0], *ip, *FLAGS, "--json"),
                                capture_output=True, text=True, timeout=90)
        assert client.returncode == 0, client.stderr[-3000:]
        result = json.loads(client.stdout.strip().splitlines()[-1])
        assert result["ok"] and result["verified"] and result["test"] == test and result["ops"] == 400
        assert result["packets"] > 0  # RoCEv2 from B's NIC (10.79.0.2, reachable only over the veth) to A's
        assert result["remote_host"] == f"{ADDRESSES[0]}:18515"
        out, err = server.communicate(timeout=30)
        assert server.returncode == 0, err[-3000:]
        assert "#bytes" in out and "BW average[MiB/sec]" in out and " 4096 " in out  # the same table on the server
        assert "verified: yes" in out
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
