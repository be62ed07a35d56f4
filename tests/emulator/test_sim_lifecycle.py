"""The emulated NIC's life: who ends it, which address it takes, how it fails to start, what close() releases, and
what importing the emulator loads."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import pytest

import aiofabric
from aiofabric.pci import PCIError
from aiofabric.pci.emulated import SimPCIDevice
from aiofabric.sim.options import OPTIONS
from aiofabric.sim.packets import ROCE_PORT
from aiofabric.sim.wire import open_on_free_loopback

pytestmark = pytest.mark.anyio


# -- 1. the emulator lives as long as the driver process, not the thread that started it -----------------------------

async def test_nic_outlives_the_worker_thread_that_started_it():
    """open_nic starts the emulator from a worker thread; trio retires idle workers after 10 s and anyio's asyncio
    backend prunes workers idle for 10 s on a later to_thread call. The NIC must not die with that thread."""
    async with aiofabric.open_nic("sim") as nic:
        async with anyio.create_task_group() as tasks:  # the starter thread (idle) and a second one get work
            tasks.start_soon(anyio.to_thread.run_sync, time.sleep, 1.0)
            tasks.start_soon(anyio.to_thread.run_sync, time.sleep, 1.5)
        await anyio.sleep(10.3)  # both idle > 10 s: trio's exit by themselves
        await anyio.to_thread.run_sync(time.sleep, 0.01)  # asyncio: this call retires the starter thread
        await anyio.sleep(0.3)  # a parent-death signal would have killed the emulator by now
        assert (await nic.hwrm("func_qcfg", fid=0xFFFF)).legacy_l2_db_size_kb > 0


def test_emulator_outlives_a_plain_thread_that_started_it():
    devices = []
    starter = threading.Thread(target=lambda: devices.append(SimPCIDevice(f"thread{os.getpid()}")))
    starter.start()
    starter.join()
    device = devices[0]
    try:
        time.sleep(0.3)
        assert device.debug({"op": "ping"})["pid"] == device.pid
    finally:
        device.close()


def _wait_exited(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, waiting to be reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_emulator_exits_when_the_driver_dies_while_a_child_holds_its_socket():
    """The kick socket's EOF cannot tell the emulator here (a forked child of the driver keeps the socket open): the
    driver's pidfd does."""
    script = textwrap.dedent("""
        import os, sys, time
        from aiofabric.pci.emulated import SimPCIDevice
        device = SimPCIDevice(f"forked{os.getpid()}")
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(device.pid, child, flush=True)
        time.sleep(60)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    emulator = child = None
    try:
        emulator, child = map(int, driver.stdout.readline().split())
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        assert _wait_exited(emulator, 10), "the emulator outlived its driver"
    finally:
        driver.kill()
        for pid in (emulator, child):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# -- 2. the emulator picks its own loopback address, race-free across processes --------------------------------------

def test_concurrent_emulators_in_several_processes_get_distinct_addresses():
    script = textwrap.dedent("""
        import json, sys, threading
        from aiofabric.pci.emulated import SimPCIDevice
        sys.stdin.readline()  # all processes start together
        devices, errors = [], []
        def start(i):
            try:
                devices.append(SimPCIDevice(f"race{i}"))
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps({"ips": [d.ip for d in devices], "errors": errors}), flush=True)
        sys.stdin.readline()  # hold the addresses until every process has reported
        for d in devices: d.close()
    """)
    drivers = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True) for _ in range(4)]
    try:
        for driver in drivers:
            driver.stdin.write("go\n")
            driver.stdin.flush()
        reports = [json.loads(driver.stdout.readline()) for driver in drivers]
        for driver in drivers:
            driver.stdin.close()
        assert [r["errors"] for r in reports] == [[]] * 4
        ips = [ip for report in reports for ip in report["ips"]]
        assert len(ips) == 8 and len(set(ips)) == 8, ips
        assert all(ip.startswith("127.0.0.") for ip in ips)
        for driver in drivers:
            assert driver.wait(timeout=20) == 0
    finally:
        for driver in drivers:
            driver.kill()


def test_free_loopback_search_skips_a_taken_address():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        for host in range(200, 255):  # one we can take ourselves
            try:
                squatter.bind((f"127.0.0.{host}", ROCE_PORT))
                break
            except OSError:
                continue
        transport = open_on_free_loopback("udp", host)
        try:
            assert transport.ip.startswith("127.0.0.") and transport.ip != f"127.0.0.{host}"
        finally:
            transport.close()


def test_explicit_address_is_reported_and_a_taken_one_fails_clearly():
    first = SimPCIDevice(f"own{os.getpid()}")
    try:
        assert first.ip.startswith("127.0.0.")
        with pytest.raises(PCIError, match=rf"emulator failed to start: .*UDP {first.ip}:4791 is taken"):
            SimPCIDevice(f"clash{os.getpid()}", ip=first.ip)
    finally:
        first.close()
    second = SimPCIDevice(f"again{os.getpid()}", ip=first.ip)  # free again once the first closed
    try:
        assert second.ip == first.ip
    finally:
        second.close()


# -- 3. start-up errors carry the emulator's reason ------------------------------------------------------------------

def _children() -> set[int]:
    """Our child processes, zombies included (a failed start must reap the emulator)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid():
                found.add(int(entry))
    return found


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("options, error, message", [
    ({"pcap": "/nonexistent/dir/x.pcap"}, PCIError,
     "sim:bad: emulator failed to start: cannot write pcap /nonexistent/dir/x.pcap: [Errno 2] No such file or "
     "directory"),
    ({"ip": "8.8.8.8"}, PCIError,
     "sim:bad: emulator failed to start: cannot open the udp transport: 8.8.8.8 is not an address of this host"),
    ({"ip": "300.1.1.1"}, ValueError, "ip='300.1.1.1' is not an IPv4 address"),
    ({"transport": "bogus"}, ValueError, "transport='bogus': choose one of udp, raw"),
    ({"loss": 1.5}, ValueError, "loss=1.5: a fault probability must be a number in [0, 1)"),
    ({"corrupt": 1.0}, ValueError, "corrupt=1.0: a fault probability must be a number in [0, 1)"),
    ({"lossy": 0.5}, ValueError, "unknown emulated-NIC option lossy; valid options: " + ", ".join(OPTIONS)),
    ({"fw_latency_us": -1}, ValueError, "fw_latency_us=-1: must be a number >= 0"),
    ({"link_delay_ms": float("inf")}, ValueError, "link_delay_ms=inf: must be a number >= 0, at most 60000"),
    ({"seed": "7"}, ValueError, "seed='7': must be an int"),
    ({"netns": f"aiofab-none{os.getpid()}"}, PCIError, "no network namespace"),
], ids=["pcap", "unbindable-ip", "bad-ip", "transport", "loss", "corrupt", "unknown-option", "latency", "link-delay",
        "seed", "netns"])
def test_start_up_errors_name_the_reason_and_leave_nothing_behind(options, error, message):
    fds_before, children_before = _open_fds(), _children()
    with pytest.raises(error) as raised:
        SimPCIDevice("bad", **options)
    text = str(raised.value)
    assert message in text and "\n" not in text
    assert "debug channel" not in text
    assert _children() <= children_before  # the emulator was reaped
    assert _open_fds() <= fds_before | {str(n) for n in range(3)}
    assert not any("aiofabric-bad-" in line for line in open("/proc/self/maps"))


# -- 5. close() releases everything, even while the caller holds views ---------------------------------------------

def _memfd_descriptors(tag: str) -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            pass
    return [link for link in links if f"aiofabric-{tag}" in link]


async def test_close_releases_memory_and_descriptors_while_views_are_held():
    tag = f"held{os.getpid()}"
    async with aiofabric.open_nic(f"sim:{tag}") as nic:
        mr = await nic.register_mr(3 * 4096)
        view = mr.view
        view[:] = b"\xab" * len(view)
        piece = view[4096:8192]
        assert _memfd_descriptors(tag) and any(f"memfd:aiofabric-{tag}" in line for line in open("/proc/self/maps"))
    assert _memfd_descriptors(tag) == []
    assert not any(f"memfd:aiofabric-{tag}" in line for line in open("/proc/self/maps"))
    assert bytes(piece) == bytes(4096)  # harmless private zeros now, not the freed arena
    piece[0] = 1  # and writable without harming anyone
    with pytest.raises(ValueError):  # the MR's own view was released with it
        view[0]


def test_freed_dma_buffer_view_refuses_use():
    device = SimPCIDevice(f"free{os.getpid()}")
    try:
        buffer = device.alloc_dma(4096)
        buffer.free()
        assert buffer.size == 4096
        with pytest.raises(ValueError):
            buffer.view[0]
        assert device.dma_bytes_in_use == 0
    finally:
        device.close()
    with pytest.raises(PCIError, match="closed"):
        device.alloc_dma(4096)


def test_a_burst_of_kicks_larger_than_the_socket_buffer_reaches_the_emulator_whole():
    """An event loop watching the kick socket (the removal fd) may make it non-blocking: uvloop does. A burst of
    doorbells that fills the socket's buffer must then wait for the emulator to drain it, not lose the rest."""
    device = SimPCIDevice(f"burst{os.getpid()}")
    try:
        os.set_blocking(device.removal_fd(), False)
        before = device.debug({"op": "stats"})["stats"]["kicks"]
        doorbells = device.map_bar(2)
        for _ in range(5000):  # 16-byte kicks: a few hundred fill the buffer
            doorbells.write64(0, 0)
        deadline = time.monotonic() + 10
        while device.debug({"op": "stats"})["stats"]["kicks"] - before < 5000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert device.debug({"op": "stats"})["stats"]["kicks"] - before == 5000
    finally:
        device.close()


# -- 6. the package face is lazy --------------------------------------------------------------------------------------

def test_emulator_import_loads_neither_the_driver_nor_anyio():
    check = textwrap.dedent("""
        import sys
        import aiofabric.sim.process
        loaded = [m for m in ("anyio", "trio", "aiofabric.driver.device", "aiofabric.verbs.nic", "aiofabric.verbs.types")
                  if m in sys.modules]
        assert not loaded, loaded
        import aiofabric
        assert aiofabric.CompletionError.__module__ == "aiofabric.errors"  # every exception lives there
        assert aiofabric.RemoteRegion.__module__ == "aiofabric.verbs.types"
        assert issubclass(aiofabric.ClosedError, aiofabric.FabricError)
        assert issubclass(aiofabric.PCIError, aiofabric.FabricError)
        assert {"CompletionError", "RemoteRegion", "ClosedError", "open_nic", "LocalBuffer"} <= set(dir(aiofabric))
        for name in aiofabric.__all__:
            getattr(aiofabric, name)
        try:
            aiofabric.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("no AttributeError")
    """)
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_taken_port_error_keeps_its_errno():
    """The address search relies on the transport re-raising EADDRINUSE with its errno."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.bind(("127.0.0.1", ROCE_PORT))
        from aiofabric.sim.wire import open_transport
        with pytest.raises(OSError) as raised:
            open_transport("udp", "127.0.0.1")
        assert raised.value.errno == errno.EADDRINUSE
