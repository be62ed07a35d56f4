"""Emulated NICs sharing one emulator process (SimPCIDevice's `process` option, `lat`'s default): they move
verified bytes between them, each comes and goes on its own, and one that cannot start or a hostile attach message
leaves the others serving."""
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import anyio
import pytest

from aiofabric import DeviceLostError, open_nic
from aiofabric.pci import PCIError
from aiofabric.pci.emulated import EmulatorProcess, SimPCIDevice
from tests.support.nics import connected_qps, tag

pytestmark = pytest.mark.anyio
connected = functools.partial(connected_qps, cq_depth=64, qp={"sq_depth": 16, "rq_depth": 16}, timeout=8)


async def write_verified(a, b, qa, size=10000):
    source, target = await a.register_mr(size), await b.register_mr(size)
    source.view[:size] = random.Random(size).randbytes(size)
    with anyio.fail_after(10):
        await qa.write(source, target, size)
    assert bytes(target.view[:size]) == bytes(source.view[:size])


def mappings(pid: int, needle: str) -> int:
    return sum(needle in line for line in open(f"/proc/{pid}/maps"))


@pytest.mark.loop_agnostic
async def test_nics_of_one_process_name_share_it_and_move_verified_bytes():
    name = tag()
    async with open_nic(f"sim:a{name}", process=name) as a, open_nic(f"sim:b{name}", process=name) as b, \
            open_nic(f"sim:c{name}") as c:
        assert a.pci.pid == b.pci.pid != c.pci.pid  # the same name shares; no name: a process of its own
        assert a.ip != b.ip
        qa, qb = await connected(a, b)
        await write_verified(a, b, qa)
        qb2, qc = await connected(b, c)  # and across processes
        await write_verified(c, b, qc)
        stats = (await a.pci.debug_client().stats(), await b.pci.debug_client().stats())
        assert stats[0]["packets_sent"] > 0 and stats[1]["packets_received"] > 0  # each NIC counts its own
        assert (await b.pci.debug_client().ping()).name == f"b{name}"
    assert _exited(a.pci.pid)


@pytest.mark.loop_agnostic
async def test_nics_opened_at_once_with_one_process_name_all_attach_to_one_process():
    """open_nic starts each emulator from its own worker thread: four at once must not start two processes of one
    name, nor lose an attach message."""
    name, nics = tag(), {}

    async def open_one(i, started):
        async with open_nic(f"sim:c{i}{name}", process=name) as nic:
            nics[i] = nic
            started.set()
            await done.wait()

    done = anyio.Event()
    async with anyio.create_task_group() as tasks:
        events = [anyio.Event() for _ in range(4)]
        for i, started in enumerate(events):
            tasks.start_soon(open_one, i, started)
        with anyio.fail_after(30):
            for started in events:
                await started.wait()
        assert len({nic.pci.pid for nic in nics.values()}) == 1
        qa, qb = await connected(nics[0], nics[3])
        await write_verified(nics[0], nics[3], qa)
        done.set()
    assert _exited(nics[0].pci.pid)


def _exited(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


async def test_a_nic_leaves_a_shared_process_alone_and_gives_back_its_memory_and_descriptors():
    """NICs come and go while another keeps the process alive: each one's maps and descriptors go with it (a
    leak here would grow a long-lived shared process without bound), and the others keep serving."""
    name = tag()
    async with open_nic(f"sim:keep{name}", process=name) as keeper:
        pid = keeper.pci.pid
        fds, maps = len(os.listdir(f"/proc/{pid}/fd")), mappings(pid, "aiofabric-")
        for i in range(6):
            async with open_nic(f"sim:x{i}{name}", process=name) as guest:
                assert guest.pci.pid == pid
                qk, qg = await connected(keeper, guest)
                await write_verified(guest, keeper, qg, 4096 * (i + 1))
            deadline = time.monotonic() + 5
            while (len(os.listdir(f"/proc/{pid}/fd")), mappings(pid, "aiofabric-")) != (fds, maps):
                assert time.monotonic() < deadline, (os.listdir(f"/proc/{pid}/fd"), fds, maps)
                await anyio.sleep(0.02)
        assert (await keeper.hwrm("func_qcfg", fid=0xFFFF)).legacy_l2_db_size_kb > 0


def test_a_nic_that_cannot_start_leaves_the_shared_process_serving(tmp_path):
    name = tag()
    first = SimPCIDevice(f"ok{name}", process=name)
    try:
        with pytest.raises(PCIError, match=r"sim:bad.*emulator failed to start: cannot write pcap"):
            SimPCIDevice(f"bad{name}", process=name, pcap=str(tmp_path / "missing" / "x.pcap"))
        with pytest.raises(PCIError, match=rf"emulator failed to start: .*UDP {first.ip}:4791 is taken"):
            SimPCIDevice(f"taken{name}", process=name, ip=first.ip)
        second = SimPCIDevice(f"ok2{name}", process=name)
        try:
            assert second.pid == first.pid
            assert first.debug({"op": "ping"})["name"] == f"ok{name}"
            assert second.debug({"op": "ping"})["name"] == f"ok2{name}"
        finally:
            second.close()
        assert first.debug({"op": "ping"})["pid"] == first.pid
    finally:
        first.close()
    assert _exited(first.pid)


def test_hostile_attach_messages_are_dropped_and_the_process_serves_on():
    """The control socket is the driver's own socketpair; still, a message that is not an attach (bad JSON, missing
    keys, descriptor indices out of range or not naming each descriptor once) is dropped with its descriptors."""
    name = tag()
    device = SimPCIDevice(f"h{name}", process=name)
    try:
        process = device.process
        pid = device.pid
        before = len(os.listdir(f"/proc/{pid}/fd"))
        r, w = os.pipe()
        try:
            for message in (b"not json", b"{}", json.dumps({"name": "x", "fds": {"kick_fd": 7}}).encode(),
                            json.dumps({"name": "x", "fds": {"kick_fd": [0, 9]}}).encode(), b"[1, 2]",
                            # indices in range, but not a whole NIC's descriptors, or one named twice
                            json.dumps({"name": "x", "fds": {"kick_fd": 0, "bar0_fd": 1}}).encode(),
                            json.dumps({"name": "x", "fds": {"bar0_fd": 0, "arena_fd": 0, "kick_fd": 1,
                                                             "debug_fd": 1, "irq_fds": []}}).encode(),
                            json.dumps({"fds": {"bar0_fd": 0, "arena_fd": 1, "kick_fd": 0, "debug_fd": 1,
                                                "irq_fds": [True]}}).encode()):
                socket.send_fds(process.control, [message], [r, w])
        finally:
            os.close(r)
            os.close(w)
        deadline = time.monotonic() + 5
        while len(os.listdir(f"/proc/{pid}/fd")) != before:  # every descriptor sent was closed there
            assert time.monotonic() < deadline, os.listdir(f"/proc/{pid}/fd")
            time.sleep(0.02)
        assert device.debug({"op": "ping"})["name"] == f"h{name}"
        other = SimPCIDevice(f"h2{name}", process=name)  # it still attaches NICs
        try:
            assert other.pid == pid
        finally:
            other.close()
    finally:
        device.close()


async def test_killing_the_shared_process_is_seen_by_each_of_its_nics():
    name = tag()
    async with open_nic(f"sim:a{name}", process=name) as a, open_nic(f"sim:b{name}", process=name) as b:
        os.kill(a.pci.pid, signal.SIGKILL)
        for nic in (a, b):
            with anyio.fail_after(10), pytest.raises(DeviceLostError, match=r"emulator exited with status -9"):
                while True:
                    await nic.hwrm("func_qcfg", fid=0xFFFF)
                    await anyio.sleep(0.01)


def test_a_shared_process_exits_with_its_driver():
    """A driver killed with two NICs in one emulator process: the process notices (the driver's pidfd) and exits."""
    code = ("import sys\n"
            "from aiofabric.pci.emulated import SimPCIDevice\n"
            "a = SimPCIDevice('da', process='p'); b = SimPCIDevice('db', process='p')\n"
            "print(a.pid, b.pid, flush=True)\n"
            "sys.stdin.read()\n")
    driver = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first, second = map(int, driver.stdout.readline().split())
        assert first == second
        driver.kill()
        driver.wait()
        assert _exited(first)
    finally:
        driver.kill()
        driver.wait()


def test_a_bad_process_name_is_refused_and_no_shared_process_outlives_its_nics():
    with pytest.raises(ValueError, match="process=3: must be a string"):
        SimPCIDevice(f"n{tag()}", process=3)
    assert EmulatorProcess._shared == {}  # nothing was left registered by the tests above in this worker


@pytest.mark.parametrize("argv,processes", [(["lat", "write", "-n", "50"], 1),
                                            (["lat", "write", "-n", "50", "--no-shared-emulator"], 2),
                                            (["bench", "write", "-n", "50", "--shared-emulator", "--nics", "4"], 1),
                                            (["bench", "write", "-n", "50"], 2)])
def test_the_commands_say_how_many_emulator_processes_ran_their_nics(argv, processes):
    """lat shares one by default (a hop wakes one emulator process, not two), bench does not (NICs in parallel);
    each run verifies its bytes either way and reports the processes its NICs' debug channels named."""
    run = subprocess.run([sys.executable, "-m", "aiofabric", *argv, "--json"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["verified"] and result["emulator_processes"] == processes


@pytest.mark.loop_agnostic
async def test_each_run_shares_a_process_of_its_own():
    """Two runs with --shared-emulator in one driver process: each run's NICs share a process, not the other's."""
    from aiofabric.tools.bench_config import BenchConfig
    from aiofabric.tools.perftest import open_bench_nics
    config = BenchConfig(shared_emulator=True)
    async with open_bench_nics(config) as first, open_bench_nics(config) as second:
        assert first[0].pci.pid == first[1].pci.pid
        assert second[0].pci.pid == second[1].pci.pid
        assert first[0].pci.pid != second[0].pci.pid
