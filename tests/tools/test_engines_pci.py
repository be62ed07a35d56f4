"""The engines on a PCI NIC: `bench --peer HOST --nic PCI`, `lat` and `loopback` reach the device and never the
emulator's debug channel, which only an emulated NIC has (`PCIDevice.debug_client()`); and that channel's async
client never blocks the event loop, even when the emulator stops answering.

Two kinds of PCI NIC:
- the real sysfs seam (`SysfsPCIDevice`, spec "sysfs:ADDRESS") over tests/support/sysfs.py's fake sysfs tree: its
  BAR and config files record what the driver wrote; no firmware answers, so each engine stops at the first
  firmware command, having reached the device;
- an emulator behind a seam that presents it as sysfs presents a PCI NIC (no debug channel, no interrupts, no
  removal fd): the firmware answers, so every engine path runs to its end as it would on a PCI NIC.
"""
import functools
import os
import signal
import struct
import threading
from pathlib import Path

import anyio
import pytest

from aiofabric.autogen import bnxt
from aiofabric.errors import FirmwareTimeoutError, PCIError
from aiofabric.pci import PCI_COMMAND, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY, PCIDevice, sysfs
from aiofabric.pci.emulated import SimPCIDevice
from aiofabric.pci.emulated_debug import DebugClient, Placed
from aiofabric.pci.sysfs import SysfsPCIDevice
from aiofabric.peer.policy import ServerPolicy
from aiofabric.peer.tcp import connect_tcp, serve_tcp
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.bench_report import format_table
from aiofabric.tools.introspect import NOT_COUNTED
from aiofabric.tools.lat_config import LatConfig
from aiofabric.tools.lat_report import format_latency_table
from aiofabric.tools.latency import run_latency
from aiofabric.tools.perftest import open_bench_nics, run_bench, run_loopback
from aiofabric.verbs import nic as nic_module
from tests.support.backends import on
from tests.support.sysfs import ADDR, make_tree

pytestmark = pytest.mark.anyio
OTHER = "0000:42:00.0"  # the bench server's PCI NIC
SYSFS = f"sysfs:{ADDR}"  # ADDR through the raw sysfs seam
ONE_BACKEND = {name: on(name) for name in ("asyncio", "uvloop", "trio")}


@pytest.fixture
def debug_uses(monkeypatch):
    """Every use of an emulator's debug channel (the async client or the blocking `debug()`), recorded and refused."""
    uses = []

    def refuse(client, request, *args, **kwargs):
        uses.append((client.address, request))
        raise AssertionError(f"{client.address}: the debug channel was used: {request!r}")

    monkeypatch.setattr(DebugClient, "request", refuse)
    monkeypatch.setattr(DebugClient, "request_blocking", refuse)
    return uses


# -- the real seam over a fake sysfs tree ------------------------------------------------------------------------------
@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """open_nic(SYSFS) opens SysfsPCIDevice over a fake sysfs tree (returned: ADDR's directory)."""
    device = make_tree(tmp_path / "devices")
    monkeypatch.setattr(nic_module, "SysfsPCIDevice", functools.partial(SysfsPCIDevice, sysfs_root=str(device.parent)))
    # a fake device has no bus: its bus addresses are the virtual ones (pagemap gives physical ones only to root)
    monkeypatch.setattr(sysfs, "phys_addr", lambda pagemap_fd, virt: virt)
    return device


def reached_the_device(device: Path) -> None:
    """The driver enabled the function, posted its first firmware command (HWRM_VER_GET) through BAR0, and (the
    seam closed) turned bus mastering off again."""
    command = int.from_bytes((device / "config").read_bytes()[PCI_COMMAND:PCI_COMMAND + 2], "little")
    assert command & (PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER) == PCI_COMMAND_MEMORY
    bar0 = (device / "resource0").read_bytes()
    request = bnxt.hwrm_ver_get_input.from_buffer_copy(bar0, bnxt.BNXT_GRCPF_REG_CHIMP_COMM)
    assert request.req_type == bnxt.HWRM_VER_GET and request.target_id == 0xFFFF and request.resp_addr
    assert struct.unpack_from("<I", bar0, bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER)[0] == 1


@ONE_BACKEND["asyncio"]
@pytest.mark.parametrize("engine", ["bench write --peer", "lat write", "loopback"])
async def test_each_engine_reaches_the_fake_sysfs_device_and_not_the_debug_channel(fake_tree, debug_uses, engine,
                                                                                   anyio_backend):
    ip = "10.0.0.1"
    runs = {"bench write --peer": lambda: run_bench(BenchConfig(test="write", nic=SYSFS, ip=ip, remote=object())),
            "lat write": lambda: run_latency(LatConfig(test="write", nic=SYSFS, ip=ip, iters=5)),
            "loopback": lambda: run_loopback(SYSFS, 4096, ip)}
    with anyio.fail_after(30), pytest.raises(FirmwareTimeoutError, match=f"^HWRM ver_get: no answer from {ADDR}"):
        await runs[engine]()  # no firmware behind the files: the first command times out
    reached_the_device(fake_tree)
    assert debug_uses == []


def test_a_sysfs_nic_has_no_debug_channel(fake_tree):
    device = SysfsPCIDevice(ADDR, sysfs_root=str(fake_tree.parent))
    try:
        assert device.debug_client() is None
    finally:
        device.close()


# -- an emulator behind a PCI NIC's seam -------------------------------------------------------------------------------
class AsPCI(PCIDevice):
    """An emulated NIC presented as sysfs presents a PCI NIC: no debug channel, no interrupts (the driver polls), no
    removal fd. Its BARs, config space and DMA memory are the emulator's, so the firmware answers."""

    def __init__(self, address: str, sim: SimPCIDevice) -> None:
        self.address, self.sim = address, sim

    def map_bar(self, index):
        return self.sim.map_bar(index)

    def read_config(self, offset, size):
        return self.sim.read_config(offset, size)

    def write_config(self, offset, value, size):
        self.sim.write_config(offset, value, size)

    def _alloc_dma(self, size, contiguous):
        return self.sim._alloc_dma(size, contiguous)

    @property
    def num_vectors(self):
        return 0

    def interrupt_fd(self, vector):
        raise PCIError("no interrupts through sysfs; the driver polls")

    def close(self):
        self.sim.close()


@pytest.fixture
def pci_nics(monkeypatch, debug_uses):
    """add(address) -> ip: from then on open_nic(address, ip=ip) opens that PCI NIC (each time a new emulator at that
    address, behind AsPCI). Whatever ran, the debug channel must not have been used."""
    ips: dict[str, str] = {}
    first: dict[str, AsPCI] = {}
    started: list[SimPCIDevice] = []
    real = nic_module.open_pci

    def start(address: str, **options) -> AsPCI:
        started.append(SimPCIDevice(f"pci{len(started)}-{os.getpid()}", **options))
        return AsPCI(address, started[-1])

    def open_pci(spec: str, **options) -> PCIDevice:
        if spec not in ips:
            return real(spec, **options)
        return first.pop(spec, None) or start(spec, ip=ips[spec])

    def add(address: str) -> str:
        first[address] = start(address)  # it picks a free 127.0.0.x, which the later ones bind again
        ips[address] = first[address].sim.ip
        return ips[address]

    monkeypatch.setattr(nic_module, "open_pci", open_pci)
    yield add
    for sim in started:
        sim.close()
    assert debug_uses == []


@ONE_BACKEND["asyncio"]
async def test_bench_with_a_peer_runs_on_pci_nics_on_both_sides_without_the_debug_channel(pci_nics, anyio_backend):
    """`bench {write,read,send} --peer HOST --nic PCI`, the peer an in-process server whose NIC is a PCI NIC too."""
    local_ip, server_ip = pci_nics(ADDR), pci_nics(OTHER)
    results = []
    async with anyio.create_task_group() as tasks:
        policy = ServerPolicy(nic=OTHER, ip=server_ip)
        port = await tasks.start(functools.partial(serve_tcp, "127.0.0.1", 0, policy=policy))
        with anyio.fail_after(60):
            async with open_bench_nics(BenchConfig(nic=ADDR, ip=local_ip, server_host="127.0.0.1")) as nics, \
                    connect_tcp("127.0.0.1", port, local_host=nics[0].ip) as peer:
                assert nics[0].pci.address == ADDR and nics[0].ip == local_ip
                for test in ("write", "read", "send"):
                    config = BenchConfig(test=test, nic=ADDR, ip=local_ip, remote=peer, qps=2, iters=100, size=4096)
                    results.append((config, await run_bench(config, nics)))
    for config, result in results:
        assert result["verified"] and "error" not in result, result
        assert result["ops"] == 200 and result["remote_host"] == peer.host
        assert {result[key] for key in ("packets", "retransmits", "dropped", "rx_overflow")} == {None}
        # the client places a READ's data: its counts would be checked, and the JSON says they were not available
        assert result["verification"] == ("every operation's bytes" + (f" ({NOT_COUNTED})" if config.test == "read"
                                                                       else ""))
        assert "packets: n/a   retransmits: n/a" in format_table(result, config)


@ONE_BACKEND["trio"]
@pytest.mark.parametrize("test", ["write", "read", "send"])
async def test_lat_runs_on_one_pci_nic_in_phy_loopback_without_the_debug_channel(pci_nics, test, anyio_backend):
    config = LatConfig(test=test, nic=ADDR, ip=pci_nics(ADDR), iters=30)
    with anyio.fail_after(60):
        result = await run_latency(config)
    assert result["verified"] and "error" not in result and result["iterations"] == 30, result
    assert 0 < result["t_min_us"] <= result["t_max_us"]
    assert (result["packets"], result["retransmits"], result["dropped"]) == (None, None, None)
    assert result["verification"].endswith(f"({NOT_COUNTED})")
    table = format_latency_table(result, config)
    assert f" aiofabric       : {ADDR}, its port in PHY loopback" in table and "packets: n/a" in table


@ONE_BACKEND["uvloop"]
async def test_loopback_runs_on_a_pci_nic_without_the_debug_channel(pci_nics, anyio_backend):
    ip = pci_nics(ADDR)
    with anyio.fail_after(30):
        result = await run_loopback(ADDR, 64 << 10, ip)
    assert result["verified"] and result["bytes"] == 64 << 10 and result["packets"] is None, result


@ONE_BACKEND["asyncio"]
async def test_inject_fault_on_a_nic_without_a_debug_channel_is_refused_naming_it(pci_nics, anyio_backend):
    needs = "needs the emulator's debug channel, which"
    with pytest.raises(ValueError, match=f"^--inject-fault skip_placement:1: {needs} the PCI NIC {ADDR} does not"):
        LatConfig(nic=ADDR, ip="10.0.0.1", inject_fault="skip_placement:1").check()
    with pytest.raises(ValueError, match=f"^--loss 0.1: --loss, --pcap apply to the emulated wire only, not to the "
                                         f"PCI NIC {ADDR}"):
        LatConfig(nic=ADDR, ip="10.0.0.1", loss=0.1, pcap="x.pcap").check()
    with pytest.raises(ValueError, match=f"{needs} a peer"):
        BenchConfig(nic=ADDR, ip="10.0.0.1", remote=object(), inject_fault="skip_placement:1").check()
    ips = [pci_nics(ADDR), pci_nics(OTHER)]  # NICs handed to the engine: the refusal comes from the NIC itself
    config = BenchConfig(iters=10, size=4096, inject_fault="skip_placement:1")
    async with nic_module.open_nic(ADDR, ip=ips[0]) as a, nic_module.open_nic(OTHER, ip=ips[1]) as b:
        with pytest.raises(ValueError, match=f"--inject-fault {needs} {OTHER} does not have"):
            await run_bench(config, [a, b])


@ONE_BACKEND["asyncio"]
async def test_on_emulated_nics_the_engines_await_the_client_and_never_the_blocking_debug(monkeypatch, anyio_backend):
    asked = []
    request = DebugClient.request

    async def recorded(client, op, *args, **kwargs):
        asked.append(op)
        return await request(client, op, *args, **kwargs)

    def blocking(device, request, *args, **kwargs):
        raise AssertionError(f"{device.address}: the blocking debug() was called from the event loop: {request!r}")

    monkeypatch.setattr(DebugClient, "request", recorded)
    monkeypatch.setattr(SimPCIDevice, "debug", blocking)
    with anyio.fail_after(60):
        bench = await run_bench(BenchConfig(iters=50, size=4096, inject_fault="skip_placement:1"))
        lat = await run_latency(LatConfig(iters=10))
        loopback = await run_loopback("sim", 4096)
    assert not bench["verified"] and bench["packets"] > 0  # the fault went through the client, and was caught
    assert lat["verified"] and lat["packets"] > 0 and loopback["packets"] > 0
    assert set(asked) == {"fault", "stats", "placed", "ping"}  # ping: which emulator process runs each NIC
    assert bench["emulator_processes"] == 2 and lat["emulator_processes"] == 1


# -- the debug channel's client ----------------------------------------------------------------------------------------
@pytest.fixture
def emulator():
    device = SimPCIDevice(f"debug-{os.getpid()}")
    yield device
    if device.process.poll() is None:
        os.kill(device.pid, signal.SIGCONT)  # in case a test left it stopped
    device.close()


async def test_the_debug_client_answers_typed(emulator):
    client = emulator.debug_client()
    with anyio.fail_after(10):
        ping = await client.ping()
        assert (ping.pid, ping.name) == (emulator.pid, emulator.name)
        assert (await client.objects())["qps"] == 0
        stats = await client.stats()
        assert stats["packets_sent"] == 0 and stats["no_such_counter"] == 0 and stats["kicks"] >= 0
        placed = await client.placed()
        assert placed == {} and placed[7] == Placed() and placed[7].of("write") == (0, 0)
        await client.inject("func_qcfg", bnxt.HWRM_ERR_CODE_BUSY)
        await client.fault("skip_placement", 0)
        with pytest.raises(PCIError, match=rf"^{emulator.address}: debug request 'fault' failed: .*unknown fault kind"):
            await client.fault("melt")
    assert emulator.debug({"op": "ping"})["pid"] == emulator.pid  # the blocking path shares the channel's state


async def test_a_stalled_emulator_never_blocks_the_loop_and_the_channel_stays_in_step(emulator):
    """The emulator stops (SIGSTOP) mid-channel: a request times out, naming the NIC and the request, while another
    task keeps ticking; once it runs again, the late reply is skipped and the next request gets its own."""
    client, ticks = emulator.debug_client(), []

    async def tick():
        while True:
            ticks.append(anyio.current_time())
            await anyio.sleep(0.01)

    os.kill(emulator.pid, signal.SIGSTOP)
    # a client that blocked the loop could not time out: resumed from a thread, it gets an answer and fails the test
    resume = threading.Timer(5.0, os.kill, (emulator.pid, signal.SIGCONT))
    resume.start()
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(tick)
            await anyio.sleep(0.05)
            before = len(ticks)
            with pytest.raises(PCIError, match=rf"^{emulator.address}: debug request 'stats': no answer within 0.5 s$"):
                await client.request("stats", timeout=0.5)
            assert len(ticks) - before >= 10  # 50 if nothing else ran: the loop turned while the request waited
            tasks.cancel_scope.cancel()
    finally:
        resume.cancel()
    os.kill(emulator.pid, signal.SIGCONT)
    with anyio.fail_after(10):
        assert (await client.ping()).pid == emulator.pid  # not the abandoned request's stats
        assert (await client.stats())["packets_sent"] == 0


async def test_a_request_to_an_emulator_that_exited_names_it(emulator):
    client = emulator.debug_client()
    os.kill(emulator.pid, signal.SIGKILL)
    emulator.process.wait()
    with anyio.fail_after(10), pytest.raises(PCIError, match=rf"^{emulator.address}: debug request 'placed': the "
                                                             r"emulator exited \(status -9\)"):
        await client.placed()
