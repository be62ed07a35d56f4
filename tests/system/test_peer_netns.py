"""Remote peers across network namespaces: each namespace is a host, the SSH server (tests/support/sshd.py, a separate
process) runs inside the remote ones, `aiofabric connect` runs inside namespace A, and RoCEv2 crosses veth links.

Layout: namespace A holds a bridge; each remote namespace (B, C, D) is joined to it by a veth pair. Addresses
(10.78.0.0/24) exist only inside these namespaces and go with them. Names carry the creating pid; a run that was
killed is swept by the next one (as in tests/system/test_netns.py). Skipped with the reason where `ip netns` is
unavailable.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from tests.support import netns, sshd
from tests.support.netns import ip

PID = os.getpid()
TAG = PID % 100000
NS = {name: f"aiopeer-{name.lower()}{PID}" for name in "ABCD"}
ADDRESS = {"A": "10.78.0.1", "B": "10.78.0.2", "C": "10.78.0.3", "D": "10.78.0.4"}
STALE_NS = re.compile(r"aiopeer-[abcd](\d+)")
STALE_VETH = re.compile(r"ap[bcd][xy](\d+)")


def sweep_stale_runs() -> None:
    netns.sweep_stale_runs(STALE_NS, STALE_VETH)


def _teardown() -> None:
    for name in NS.values():  # deleting a namespace deletes the veth ends inside it, and with them the pairs
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    for host in "BCD":
        subprocess.run(["ip", "link", "del", f"ap{host.lower()}x{TAG}"], capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Namespaces A..D, a bridge in A, an SSH server in each of B, C, D: {host: port}, and the key directory."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    try:
        sweep_stale_runs()
        ip("netns", "add", NS["A"])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns unavailable here: {exc.stderr.strip()}")
    servers: list[subprocess.Popen] = []
    try:
        ip("-n", NS["A"], "link", "add", "br0", "type", "bridge")
        ip("-n", NS["A"], "addr", "add", f"{ADDRESS['A']}/24", "dev", "br0")
        ip("-n", NS["A"], "link", "set", "br0", "mtu", "9000", "up")
        ip("-n", NS["A"], "link", "set", "lo", "up")
        for host in "BCD":
            near, far = f"ap{host.lower()}x{TAG}", f"ap{host.lower()}y{TAG}"
            ip("netns", "add", NS[host])
            ip("link", "add", near, "type", "veth", "peer", "name", far)
            ip("link", "set", near, "netns", NS["A"])
            ip("link", "set", far, "netns", NS[host])
            ip("-n", NS["A"], "link", "set", near, "mtu", "9000")  # RoCE frames at MTU 4096 fit
            ip("-n", NS["A"], "link", "set", near, "master", "br0", "up")
            ip("-n", NS[host], "addr", "add", f"{ADDRESS[host]}/24", "dev", far)
            ip("-n", NS[host], "link", "set", far, "mtu", "9000", "up")
            ip("-n", NS[host], "link", "set", "lo", "up")
        keys_dir = tmp_path_factory.mktemp("peer-netns")
        keys = sshd.make_keys(str(keys_dir))
        home = keys_dir / "home"
        home.mkdir()
        ports = {}
        for host in "BCD":
            server = subprocess.Popen(
                ["ip", "netns", "exec", NS[host], sys.executable, sshd.__file__, "--host", ADDRESS[host], "--port", "0",
                 "--host-key", keys["host"], "--authorized-key", keys["client"] + ".pub", "--cwd", str(home)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            servers.append(server)
            line = server.stdout.readline()  # "listening PORT" (or EOF if it failed)
            assert line.startswith("listening "), f"SSH server in {NS[host]} failed to start"
            ports[host] = int(line.split()[1])
        known_hosts = keys_dir / "known_hosts"
        known_hosts.write_text("".join(sshd.known_hosts_line(ADDRESS[h], ports[h], keys["host"]) for h in "BCD"))
        yield {"ports": ports, "keys": keys, "known_hosts": str(known_hosts)}
    finally:
        for server in servers:
            server.stdin.close()  # its stdin closing stops it (and its commands)
        for server in servers:
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        _teardown()


def connect_in_a(hosts, *args, timeout=120):
    """`aiofabric connect ... --json` run inside namespace A (host A); (exit code, JSON, stderr)."""
    process = subprocess.run(
        ["ip", "netns", "exec", NS["A"], sys.executable, "-m", "aiofabric", "connect", *args, "--identity",
         hosts["keys"]["client"], "--known-hosts", hosts["known_hosts"], "--python", sys.executable, "--json"],
        capture_output=True, text=True, timeout=timeout)
    last = process.stdout.strip().splitlines()[-1] if process.stdout.strip() else ""
    return process.returncode, json.loads(last) if last.startswith("{") else None, process.stderr


def test_two_hosts_over_ssh_across_a_veth(hosts):
    code, result, stderr = connect_in_a(hosts, ADDRESS["B"], "--port", str(hosts["ports"]["B"]), "--local-ip",
                                        ADDRESS["A"], "--remote-ip", ADDRESS["B"], "--size", "1000000")
    assert code == 0, stderr
    assert result["verified"] and result["bytes"] == 1000000
    assert (result["local_ip"], result["remote_ip"]) == (ADDRESS["A"], ADDRESS["B"])  # RoCEv2 crossed the veth
    assert result["remote_host"] == f"{ADDRESS['B']}:{hosts['ports']['B']}"


def test_ring_of_three_namespaces(hosts):
    """Host B writes to C, C to D, D back to B: each through its own SSH server, addresses on the bridge."""
    ring = ",".join(f"{ADDRESS[h]}:{hosts['ports'][h]}" for h in "BCD")
    code, result, stderr = connect_in_a(hosts, "--hosts", ring, "--remote-ip", "ssh", "--size", "200000")
    assert code == 0, stderr
    assert result["verified"] and result["remote_ips"] == [ADDRESS[h] for h in "BCD"]


def collective_in_a(hosts, command, *args, timeout=180):
    """`aiofabric COMMAND --hosts ... --json` run inside namespace A, the launcher; (exit code, JSON, stderr)."""
    ring = ",".join(f"{ADDRESS[h]}:{hosts['ports'][h]}" for h in "BCD")
    process = subprocess.run(
        ["ip", "netns", "exec", NS["A"], sys.executable, "-m", "aiofabric", command, "--hosts", ring, "--remote-ip",
         "ssh", "--identity", hosts["keys"]["client"], "--known-hosts", hosts["known_hosts"], "--python",
         sys.executable, *args, "--json"], capture_output=True, text=True, timeout=timeout)
    last = process.stdout.strip().splitlines()[-1] if process.stdout.strip() else ""
    return process.returncode, json.loads(last) if last.startswith("{") else None, process.stderr


def test_allreduce_with_one_rank_per_namespace_over_ssh(hosts):
    """The launcher in A starts a rank on B, C and D over SSH and relays the rendezvous over each SSH connection
    (B, C and D have no route to it but SSH); RoCEv2 crosses the veths, every element is checked."""
    code, result, stderr = collective_in_a(hosts, "allreduce", "-b", "4K", "-e", "256K", "-f", "8", "-n", "3")
    assert code == 0, stderr
    assert result["ranks"] == 3 and result["wrong"] == 0 and result["launcher"] == "torchrun"
    assert result["hosts"] == [f"{ADDRESS[h]}:{hosts['ports'][h]}" for h in "BCD"]
    assert [row["size"] for row in result["rows"]] == [4096, 4096, 32768, 32768, 262144, 262144]


def test_a_host_whose_rank_cannot_start_is_named(hosts):
    """Every rank gets a NIC address that is not its host's: the emulated NICs cannot bind it, and the launcher
    names the rank and host that failed."""
    code, result, stderr = collective_in_a(hosts, "broadcast", "--size", "4K", "--rendezvous-timeout", "5",
                                           "--remote-ip", "10.78.0.99")
    assert code == 1 and re.search(r"rank \d on 10\.78\.0\.\d:\d+ failed", result["error"]), (result, stderr)
