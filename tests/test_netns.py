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

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.sim.host import SimPCIDevice
from aiofabric.sim.packets import ROCE_PORT

pytestmark = pytest.mark.anyio
NS = (f"aiofab-a{os.getpid()}", f"aiofab-b{os.getpid()}")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
VETH_MODULUS = 100000  # interface names: at most 15 characters
VETH = (f"afa{os.getpid() % VETH_MODULUS}", f"afb{os.getpid() % VETH_MODULUS}")
STALE_NS = re.compile(r"aiofab-[ab](\d+)")
STALE_VETH = re.compile(r"af[ab](\d+)")


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20, text=True).stdout


def _live_pids() -> set[int]:
    return {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}


def sweep_stale_runs() -> list[str]:
    """Delete the namespaces and veths of earlier runs whose creating process is gone; what was deleted.

    A namespace is stale when the pid in its name is not running. A veth that never moved into a namespace names its
    creator's pid modulo VETH_MODULUS: stale when no running process matches that. Deleting a namespace takes the
    veth end inside it along, and with it the pair.
    """
    live = _live_pids()
    live_tags = {pid % VETH_MODULUS for pid in live}
    deleted = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = STALE_NS.fullmatch(name)
        if match and int(match.group(1)) not in live:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
            deleted.append(name)
    for line in ip("-o", "link", "show", "type", "veth").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = STALE_VETH.fullmatch(name)
        if match and int(match.group(1)) not in live_tags:
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=20)
            deleted.append(name)
    return deleted


def _require_netns() -> None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")


@pytest.fixture(scope="module")
def two_hosts():
    _require_netns()
    try:
        sweep_stale_runs()
        ip("netns", "add", NS[0])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns unavailable here: {exc.stderr.decode().strip()}")
    try:
        ip("netns", "add", NS[1])
        ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for i in (0, 1):
            ip("link", "set", VETH[i], "netns", NS[i])
            ip("-n", NS[i], "addr", "add", f"{ADDRESSES[i]}/24", "dev", VETH[i])
            ip("-n", NS[i], "link", "set", VETH[i], "mtu", "9000", "up")
            ip("-n", NS[i], "link", "set", "lo", "up")
        yield
    finally:
        for name in NS:  # deleting a namespace deletes the veth end inside it, and with it the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", VETH[0]], capture_output=True, timeout=20)  # if it never moved


async def test_rdma_between_two_namespaces(two_hosts):
    async with open_nic("sim:host-a", ip=ADDRESSES[0], netns=NS[0]) as a, \
            open_nic("sim:host-b", ip=ADDRESSES[1], netns=NS[1]) as b:
        cq_a, cq_b = await a.create_cq(64), await b.create_cq(64)
        qa, qb = await a.create_qp(cq_a), await b.create_qp(cq_b)
        await qa.connect(qb.info(), mtu=4096)
        await qb.connect(qa.info(), mtu=4096)
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
        assert device.debug({"op": "ping"})["pid"] == device.pid
    finally:
        device.close()


def _dead_pid() -> int:
    live = _live_pids()
    tags = {pid % VETH_MODULUS for pid in live}
    return next(pid for pid in range(VETH_MODULUS - 1, 2, -1) if pid not in live and pid % VETH_MODULUS not in tags)


def test_sweep_removes_what_killed_runs_left_and_nothing_live():
    _require_netns()
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
