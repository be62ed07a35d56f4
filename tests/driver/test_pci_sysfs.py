"""SysfsPCIDevice against a fake sysfs tree (tests/support/sysfs.py); DMA against the real pagemap (root only); the
PCIe AtomicOps walk over the bridges a fake tree nests the function below, each of its rules at its boundary."""
from __future__ import annotations

import os
import platform
import shutil
import struct
import subprocess

import pytest

from aiofabric.errors import FabricError
from aiofabric.pci import PAGE_SIZE, PCI_COMMAND, PCI_COMMAND_MASTER, DmaBuffer, PCIError, barrier
from aiofabric.hw.pci import (PCI_EXP_DEVCAP2_ATOMIC_COMP32, PCI_EXP_DEVCAP2_ATOMIC_COMP64,
                              PCI_EXP_DEVCAP2_ATOMIC_ROUTE, PCI_EXP_DEVCTL2, PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK,
                              PCI_EXP_DEVCTL2_ATOMIC_REQ)
from aiofabric.pci.atomic_ops import determine_atomics
from aiofabric.pci.linux import phys_addr
from aiofabric.pci.sysfs import SysfsPCIDevice
from tests.support.sysfs import ADDR, BAR_SIZE, CAPABILITY, DOWN, ROOT, UP, make_path, make_tree

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="pagemap only gives physical addresses to root")


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "devices")


@pytest.fixture
def pci(tree):
    dev = SysfsPCIDevice(ADDR, sysfs_root=str(tree.parent))
    yield dev
    dev.close()


def test_open_and_interfaces(pci):
    assert pci.address == ADDR
    assert pci.num_vectors == 0
    assert pci.removal_fd() is None
    with pytest.raises(PCIError, match="polls"):
        pci.interrupt_fd(0)


def test_bar_accesses_land_in_file(pci, tree):
    bar = pci.map_bar(0)
    assert bar.size == BAR_SIZE
    assert pci.map_bar(0) is bar
    bar.write32(0x10, 0xDEADBEEF)
    bar.write64(0x2008, 0x0123456789ABCDEF)
    bar.write_block(0x100, struct.pack("<2I", 1, 2))
    assert bar.read32(0x10) == 0xDEADBEEF
    assert bar.read64(0x2008) == 0x0123456789ABCDEF
    data = (tree / "resource0").read_bytes()
    assert struct.unpack_from("<I", data, 0x10)[0] == 0xDEADBEEF
    assert struct.unpack_from("<Q", data, 0x2008)[0] == 0x0123456789ABCDEF
    assert struct.unpack_from("<2I", data, 0x100) == (1, 2)
    pci.map_bar(2).write32(0, 7)
    assert (tree / "resource2").read_bytes()[:4] == b"\x07\0\0\0"
    assert (tree / "resource0").read_bytes()[:4] == bytes(4)


@pytest.mark.parametrize("op, offset", [
    ("read32", 2), ("write32", 6), ("read64", 4), ("write64", 12),
    ("read32", BAR_SIZE), ("read64", BAR_SIZE - 4), ("write32", -4),
])
def test_bad_bar_access(pci, op, offset):
    bar = pci.map_bar(0)
    args = (offset,) if op.startswith("read") else (offset, 1)
    with pytest.raises(ValueError, match="BAR0"):
        getattr(bar, op)(*args)


def test_missing_bar(pci):
    with pytest.raises(PCIError, match="BAR1"):
        pci.map_bar(1)


@pytest.mark.parametrize("size, value", [(1, 0xAB), (2, 0xBEEF), (4, 0xCAFEF00D)])
def test_config_roundtrip(pci, tree, size, value):
    pci.write_config(0x40, value, size)
    assert pci.read_config(0x40, size) == value
    assert (tree / "config").read_bytes()[0x40:0x40 + size] == value.to_bytes(size, "little")


def test_enable_bus_master(pci):
    pci.write_config(PCI_COMMAND, 0x0400, 2)
    pci.enable_bus_master()
    assert pci.read_config(PCI_COMMAND, 2) == 0x0406


def test_missing_device(tmp_path):
    with pytest.raises(PCIError, match=f"no PCI device {ADDR}"):
        SysfsPCIDevice(ADDR, sysfs_root=str(tmp_path))


def test_bound_driver(tree, tmp_path):
    drv = tmp_path / "drivers" / "bnxt_en"
    drv.mkdir(parents=True)
    (tree / "driver").symlink_to(drv)
    with pytest.raises(PCIError, match="bound to bnxt_en.*unbind") as exc:
        SysfsPCIDevice(ADDR, sysfs_root=str(tree.parent))
    assert f"echo {ADDR} > {drv}/unbind" in str(exc.value)


def test_wrong_vendor(tmp_path):
    root = tmp_path / "devices"
    make_tree(root, vendor="0x8086\n")
    with pytest.raises(PCIError, match="0x8086"):
        SysfsPCIDevice(ADDR, sysfs_root=str(root))


@pytest.mark.parametrize("address", ["41:00.0", "0000:41:00", "0000:4g:00.0", "0000:41:00.8", ""])
def test_bad_address(tmp_path, address):
    with pytest.raises(PCIError, match="bad PCI address"):
        SysfsPCIDevice(address, sysfs_root=str(tmp_path))


def test_phys_addr_from_fake_pagemap(tmp_path):
    entries = [(1 << 63) | 0x1234, 0, 1 << 63]  # present with PFN, absent, present but PFN hidden
    path = tmp_path / "pagemap"
    path.write_bytes(b"".join(e.to_bytes(8, "little") for e in entries))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert phys_addr(fd, 0x123) == 0x1234 * PAGE_SIZE + 0x123
        with pytest.raises(PCIError, match="not present"):
            phys_addr(fd, PAGE_SIZE)
        with pytest.raises(PCIError, match="run as root"):
            phys_addr(fd, 2 * PAGE_SIZE)
    finally:
        os.close(fd)


@needs_root
def test_alloc_dma_pages(pci):
    buf = pci.alloc_dma(3 * PAGE_SIZE - 100)
    assert buf.size == 3 * PAGE_SIZE and not buf.contiguous
    assert len(buf.bus_addrs) == 3
    assert all(a and a % PAGE_SIZE == 0 for a in buf.bus_addrs)
    assert len(set(buf.bus_addrs)) == 3
    assert bytes(buf.view) == bytes(buf.size)
    buf.view[PAGE_SIZE + 5] = 0x5A
    assert buf.view[PAGE_SIZE + 5] == 0x5A
    assert buf.bus_address_of(PAGE_SIZE + 5) == buf.bus_addrs[1] + 5
    other = pci.alloc_dma(PAGE_SIZE)
    assert other.bus_addr not in buf.bus_addrs
    buf.free()
    buf.free()  # idempotent
    other.free()


@needs_root
def test_close_stops_the_device_before_it_frees_its_dma(tree, monkeypatch):
    """Bus mastering off and the sysfs reset written, then the memory freed: a device still running would write
    into pages given back to the kernel. Without a `reset` file the close still turns bus mastering off."""
    (tree / "reset").write_text("")
    pci = SysfsPCIDevice(ADDR, sysfs_root=str(tree.parent))
    pci.enable_bus_master()
    pci.alloc_dma(PAGE_SIZE), pci.alloc_dma(2 * PAGE_SIZE)
    seen = []
    free = DmaBuffer.free

    def watched(buffer):  # the device's state as each buffer is freed
        seen.append(((tree / "reset").read_text(), command(tree)))
        free(buffer)

    monkeypatch.setattr(DmaBuffer, "free", watched)
    pci.close()
    assert len(seen) == 2 and all(reset == "1" and not cmd & PCI_COMMAND_MASTER for reset, cmd in seen), seen
    (tree / "reset").unlink()
    pci = SysfsPCIDevice(ADDR, sysfs_root=str(tree.parent))
    pci.enable_bus_master()
    assert pci.reset() is False
    pci.close()
    assert not command(tree) & PCI_COMMAND_MASTER


def command(tree) -> int:
    return struct.unpack_from("<H", (tree / "config").read_bytes(), PCI_COMMAND)[0]


@needs_root
def test_close_frees_live_dma(tree):
    pci = SysfsPCIDevice(ADDR, sysfs_root=str(tree.parent))
    buf = pci.alloc_dma(PAGE_SIZE)
    bar = pci.map_bar(0)
    pci.close()
    pci.close()
    with pytest.raises(ValueError):
        buf.view[0]
    with pytest.raises(ValueError):
        bar.read32(0)
    with pytest.raises(PCIError, match="closed"):
        pci.alloc_dma(PAGE_SIZE)


@pytest.fixture
def hugepages():
    """Make sure a few 2 MiB hugepages are reserved, reserving (and afterwards releasing) them ourselves if allowed."""
    path = "/proc/sys/vm/nr_hugepages"
    with open(path) as f:
        before = int(f.read())
    if before >= 2:
        yield
        return
    if not IS_ROOT or not os.access(path, os.W_OK):
        pytest.skip(f"no hugepages reserved and {path} is not writable")
    with open(path, "w") as f:
        f.write(str(before + 4))
    try:
        yield
    finally:
        with open(path, "w") as f:
            f.write(str(before))


@needs_root
def test_alloc_dma_contiguous(pci, hugepages):
    buf = pci.alloc_dma(5 * PAGE_SIZE, contiguous=True)
    try:
        assert buf.contiguous and buf.size == 5 * PAGE_SIZE
        assert buf.bus_addr and buf.bus_addr % PAGE_SIZE == 0
        assert buf.bus_addrs == [buf.bus_addr + i * PAGE_SIZE for i in range(5)]
        buf.view[-1] = 1
        assert buf.view[-1] == 1
    finally:
        buf.free()


def test_contiguous_limit(pci):
    with pytest.raises(PCIError, match="2 MiB"):
        pci.alloc_dma((2 << 20) + 1, contiguous=True)


def test_pci_error_is_a_fabric_error():
    with pytest.raises(FabricError):
        SysfsPCIDevice("bogus")
    assert issubclass(PCIError, RuntimeError)  # callers that caught RuntimeError still do


def test_doorbell_write_lands_in_the_bar(pci, tree):
    pci.map_bar(2).write64_doorbell(0x40, 0x8000_0001_0000_0002)
    assert struct.unpack_from("<Q", (tree / "resource2").read_bytes(), 0x40)[0] == 0x8000_0001_0000_0002


def test_freed_buffer_refuses_its_view():
    released = []
    buffer = DmaBuffer(memoryview(bytearray(2 * PAGE_SIZE)), [0x1000, 0x2000], False, lambda: released.append(1))
    buffer.free()
    buffer.free()
    assert released == [1] and buffer.size == 2 * PAGE_SIZE
    with pytest.raises(ValueError):
        buffer.view[0]


def test_freeing_a_buffer_whose_view_is_exported_still_frees_it():
    import ctypes
    released = []
    buffer = DmaBuffer(memoryview(bytearray(PAGE_SIZE)), [0x1000], True, lambda: released.append(1))
    export = ctypes.c_char.from_buffer(buffer.view)  # like numpy.frombuffer: the view cannot be released now
    buffer.free()
    assert released == [1]
    del export


def test_memory_barrier_costs_nothing_on_x86():
    if platform.machine() not in ("x86_64", "amd64", "i386", "i686"):
        pytest.skip("x86 only")
    assert barrier.memory_barrier is barrier.read_barrier is barrier._no_barrier


@pytest.mark.skipif(platform.machine() not in barrier.BARRIER_CODE, reason="no barrier code for this CPU")
@pytest.mark.parametrize("codes", [barrier.BARRIER_CODE, barrier.READ_BARRIER_CODE], ids=["store", "read"])
def test_machine_code_barrier_runs(codes):
    fence = barrier.machine_code_barrier(platform.machine(), codes)
    for _ in range(3):
        assert fence() is None


@pytest.mark.skipif(not shutil.which("llvm-mc"), reason="llvm-mc (LLVM's assembler) is not installed")
@pytest.mark.parametrize("codes, machine, triple, source", [
    (barrier.BARRIER_CODE, "aarch64", "aarch64", "dsb st; ret"),
    (barrier.BARRIER_CODE, "ppc64le", "powerpc64le", "sync; blr"),
    (barrier.BARRIER_CODE, "riscv64", "riscv64", "fence iorw, iorw; ret"),
    (barrier.BARRIER_CODE, "x86_64", "x86_64", "mfence; ret"),
    (barrier.READ_BARRIER_CODE, "aarch64", "aarch64", "dmb oshld; ret"),  # rdma-core's udma_from_device_barrier
    (barrier.READ_BARRIER_CODE, "ppc64le", "powerpc64le", "lwsync; blr"),
    (barrier.READ_BARRIER_CODE, "riscv64", "riscv64", "fence ir, ir; ret"),
    (barrier.READ_BARRIER_CODE, "x86_64", "x86_64", "lfence; ret"),
])
def test_barrier_code_is_what_it_says(codes, machine, triple, source):
    listing = subprocess.run(["llvm-mc", f"-triple={triple}", "-show-encoding"], input=source.replace("; ", "\n"),
                             capture_output=True, text=True, check=True).stdout
    encoded = bytes(int(b, 16) for line in listing.splitlines() if "encoding: [" in line
                    for b in line.split("encoding: [")[1].rstrip("]").split(","))
    assert codes[machine] == encoded


# -- PCIe AtomicOps: Linux's pci_enable_atomic_ops_to_root over the bridges sysfs shows -------------------------------
ROUTE, COMP32, COMP64 = PCI_EXP_DEVCAP2_ATOMIC_ROUTE, PCI_EXP_DEVCAP2_ATOMIC_COMP32, PCI_EXP_DEVCAP2_ATOMIC_COMP64
BLOCK, REQ = PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK, PCI_EXP_DEVCTL2_ATOMIC_REQ
UP_BLOCKING = UP._replace(devctl2=BLOCK)


def devctl2(link) -> int:
    config = (link / "config").read_bytes()
    return int.from_bytes(config[CAPABILITY + PCI_EXP_DEVCTL2:CAPABILITY + PCI_EXP_DEVCTL2 + 2], "little")


def walked(tmp_path, ports, preset=0, virtfn=False):
    """Open ADDR through sysfs below `ports`, run the walk as the driver's boot does: (AtomicOps, DEVCTL2 after)."""
    link = make_path(tmp_path / "devices", ports, preset, virtfn)
    pci = SysfsPCIDevice(ADDR, sysfs_root=str(link.parent))
    try:
        return determine_atomics(pci, pci.upstream_path()), devctl2(link)
    finally:
        pci.close()


@pytest.mark.parametrize("ports, says", [
    ([ROOT], f"{ADDR} reaches root port {ROOT.address}, which completes its PCIe AtomicOps"),
    ([ROOT, UP, DOWN], f"reaches root port {ROOT.address} through {DOWN.address}, {UP.address}, which completes"),
    ([ROOT, UP, DOWN._replace(devctl2=BLOCK)], "which completes"),  # egress blocking is an upstream port's only
], ids=["root port", "switch", "downstream port's egress block ignored"])
def test_a_path_that_completes_atomicops_gets_atomic_req_set(tmp_path, ports, says):
    atomics, control = walked(tmp_path, ports)
    assert atomics.enabled and says in atomics.detail, atomics
    assert control == REQ


@pytest.mark.parametrize("ports, says", [
    ([ROOT._replace(devcap2=0)], f"root port {ROOT.address} does not complete 32-bit PCIe AtomicOps"),
    ([ROOT._replace(devcap2=COMP64)], f"root port {ROOT.address} does not complete 32-bit"),
    ([ROOT._replace(devcap2=COMP32)], f"root port {ROOT.address} does not complete 64-bit PCIe AtomicOps (its "
                                      "DEVCAP2 0x80 lacks 0x100)"),
    ([ROOT, UP, DOWN._replace(devcap2=0)], f"switch downstream port {DOWN.address} does not route PCIe AtomicOps"),
    ([ROOT, UP._replace(devcap2=0), DOWN], f"switch upstream port {UP.address} does not route PCIe AtomicOps"),
    ([ROOT, UP_BLOCKING, DOWN], f"switch upstream port {UP.address} blocks PCIe AtomicOps on egress"),
    ([UP, DOWN], f"no root port is visible above {ADDR} (bridges {DOWN.address}, {UP.address}: a virtual machine?)"),
    ([], f"no root port is visible above {ADDR} (no bridge"),
], ids=["no completer", "64-bit only", "32-bit only", "downstream port without routing",
        "upstream port without routing", "upstream port blocking egress", "switch without root port", "no bridge"])
def test_a_path_that_does_not_leaves_atomic_req_clear_and_names_the_port(tmp_path, ports, says):
    atomics, control = walked(tmp_path, ports)
    assert not atomics.enabled and says in atomics.detail, atomics
    assert control == 0  # the 32-bit-only root port too: Linux would have set the bit after the 32-bit check


def test_with_no_root_port_visible_a_preset_atomic_req_is_taken_and_left_alone(tmp_path):
    atomics, control = walked(tmp_path, [], preset=REQ | 0x1)
    assert atomics.enabled and "already set, by the hypervisor" in atomics.detail
    assert control == REQ | 0x1


def test_a_virtual_function_is_refused_whatever_its_path(tmp_path):
    atomics, control = walked(tmp_path, [ROOT], virtfn=True)
    assert not atomics.enabled and f"{ADDR} is a virtual function" in atomics.detail and control == 0


def test_a_bridge_read_short_without_privileges_says_to_run_as_root(tmp_path):
    link = make_path(tmp_path / "devices", [ROOT])
    root_config = link.resolve().parent / "config"
    root_config.write_bytes(root_config.read_bytes()[:64])  # what Linux shows a process without CAP_SYS_ADMIN
    pci = SysfsPCIDevice(ADDR, sysfs_root=str(link.parent))
    try:
        atomics = determine_atomics(pci, pci.upstream_path())
    finally:
        pci.close()
    assert not atomics.enabled and f"cannot read the config space of {ROOT.address} past byte 64" in atomics.detail
    assert "run as root" in atomics.detail and devctl2(link) == 0
