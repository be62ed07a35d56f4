"""Two emulated NICs on two 'hosts': network namespaces joined by a veth pair, RoCEv2 crossing a real link.

The test creates its own namespaces and addresses (10.77.0.0/24 lives only inside them) and removes them after. A run
that was killed cannot: the names carry the creating pid, and the next run sweeps those whose creator is gone.
Skipped with the reason where `ip netns` is unavailable (needs root and iproute2).
"""
import os
import random
import re
import shutil
import socket
import subprocess
import sys

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.pci import PCIError
from aiofabric.pci.emulated import SimPCIDevice
from aiofabric.sim.packets import ROCE_PORT
from tests.support import netns
from tests.support.netns import ip
from tests.support.nics import connected_qps

pytestmark = pytest.mark.anyio
NS = (f"aiofab-a{os.getpid()}", f"aiofab-b{os.getpid()}")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
VETH_MODULUS = netns.VETH_MODULUS
VETH = (f"afa{os.getpid() % VETH_MODULUS}", f"afb{os.getpid() % VETH_MODULUS}")
STALE_NS = re.compile(r"aiofab-[ab](\d+)")
STALE_VETH = re.compile(r"af[ab](\d+)")


# Holds 0.0.0.0:4791 in its namespace, says its pid, and lets go when stdin closes.
WILDCARD_HOLDER = ("import os, socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                   "s.bind(('0.0.0.0', 4791)); print(os.getpid(), flush=True); sys.stdin.read()")


def sweep_stale_runs() -> list[str]:
    return netns.sweep_stale_runs(STALE_NS, STALE_VETH)


@pytest.fixture(scope="module")
def two_hosts():
    with netns.two_hosts(NS, VETH, ADDRESSES, (STALE_NS, STALE_VETH)):
        yield


async def test_rdma_between_two_namespaces(two_hosts):
    async with open_nic("sim:host-a", ip=ADDRESSES[0], netns=NS[0]) as a, \
            open_nic("sim:host-b", ip=ADDRESSES[1], netns=NS[1]) as b:
        qa, qb = await connected_qps(a, b, 64, mtu=4096)
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        source.view[:] = random.randbytes(1 << 16)
        with anyio.fail_after(20):
            await qa.write(source, target, 1 << 16)
            await qa.read(source, target, 4096, local_offset=8192, remote_offset=8192)
        assert bytes(target.view) == bytes(source.view)
        assert a.pci.debug({"op": "stats"})["stats"]["packets_sent"] >= 16


async def test_emulator_without_an_address_picks_one_inside_its_namespace(two_hosts):
    device = SimPCIDevice(f"ns-auto{os.getpid()}", netns=NS[0])
    try:
        assert device.ip.startswith("127.0.0.")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as here:  # not bound out here: it lives in NS[0]
            here.bind((device.ip, ROCE_PORT))
        assert device.debug({"op": "ping"}) == {"pid": device.pid, "name": f"ns-auto{os.getpid()}", "netns": NS[0]}
        assert device.netns == NS[0]
    finally:
        device.close()


def test_a_given_namespace_whose_port_is_taken_is_not_left(two_hosts):
    holder = subprocess.Popen(["ip", "netns", "exec", NS[0], sys.executable, "-c", WILDCARD_HOLDER],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        holder_pid = int(holder.stdout.readline())
        with open(f"/proc/{holder_pid}/comm") as f:
            command = f.read().strip()
        name = f"ns-taken{os.getpid()}"
        with pytest.raises(PCIError) as raised:
            SimPCIDevice(name, netns=NS[0])
    finally:
        holder.stdin.close()
        holder.wait(timeout=20)
    assert re.fullmatch(
        rf"sim:{name}: emulator failed to start: cannot open the udp transport: UDP 4791 is taken on every 127\.0\.0\.x "
        rf"in network namespace {NS[0]} \(on 127\.0\.0\.\d+ by {command} \(pid {holder_pid}, user root\)\); netns= "
        r"was given, so the NIC does not move to another namespace", str(raised.value)), str(raised.value)


def _dead_pid() -> int:
    live = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    tags = {pid % VETH_MODULUS for pid in live}
    return next(pid for pid in range(VETH_MODULUS - 1, 2, -1) if pid not in live and pid % VETH_MODULUS not in tags)


def test_sweep_removes_what_killed_runs_left_and_nothing_live():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    dead = _dead_pid()
    leftovers = [f"aiofab-a{dead}", f"aiofab-b{dead}"]
    alive = "aiofab-a1"  # pid 1 always runs
    try:
        for name in (*leftovers, alive):
            ip("netns", "add", name)
        ip("link", "add", f"afa{dead}", "type", "veth", "peer", "name", f"afb{dead}")
        deleted = sweep_stale_runs()
        assert set(leftovers) <= set(deleted) and alive not in deleted
        namespaces = ip("netns", "list")
        assert not any(name in namespaces.split() for name in leftovers) and alive in namespaces
        assert f"afa{dead}" not in ip("link", "show")
    finally:
        for name in (*leftovers, alive):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", f"afa{dead}"], capture_output=True, timeout=20)
