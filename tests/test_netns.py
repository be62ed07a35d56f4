"""Two emulated NICs on two 'hosts': network namespaces joined by a veth pair, RoCEv2 crossing a real link.

The test creates its own namespaces and addresses (10.77.0.0/24 lives only inside them) and removes them after.
Skipped with the reason where `ip netns` is unavailable (needs root and iproute2).
"""
import os
import random
import shutil
import subprocess

import anyio
import pytest

from aiofabric import open_nic

pytestmark = pytest.mark.anyio
NS = (f"aiofab-a{os.getpid()}", f"aiofab-b{os.getpid()}")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
VETH = (f"afa{os.getpid() % 100000}", f"afb{os.getpid() % 100000}")  # interface names: at most 15 characters


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    try:
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
