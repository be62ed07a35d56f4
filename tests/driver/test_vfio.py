"""The VFIO seam (`VfioPCIDevice`) without hardware: the kernel's VFIO interface faked by an emulated NIC
(aiofabric/pci/emulated_vfio.py: its BARs and config space as regions, its DMA arena as the IOMMU's address space, device
accesses outside every mapped window logged as IOMMU faults) over a fake sysfs tree; the DMA pool and its IOVAs; the
ioctl encodings; and the ABI's structs and numbers against the kernel's own linux/vfio.h.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import select
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import pytest

from aiofabric.errors import PCIError
from aiofabric.pci import PAGE_SIZE, PCI_COMMAND, PCI_COMMAND_MASTER
from aiofabric.pci import vfio_api as vfio_module
from aiofabric.pci import vfio_abi as abi
from aiofabric.hw.pci import PCI_EXP_DEVCTL2_ATOMIC_REQ
from aiofabric.pci.atomic_ops import determine_atomics
from aiofabric.pci.dma_pool import SLAB_SIZE, DmaPool
from aiofabric.pci.emulated_vfio import EmulatedVfio, IommuFault
from aiofabric.pci.iommu import IovaSpace
from aiofabric.pci.preflight import Host
from aiofabric.pci.sysfs import SysfsPCIDevice
from aiofabric.pci.vfio import MappedBar, RegionBar, VfioPCIDevice
from aiofabric.pci.vfio_api import LinuxVfio
from aiofabric.sim.memory import BUS_BASE
from aiofabric.sim.pcie import DEVCTL2
from aiofabric.verbs import nic as nic_module
from tests.support.backends import on
from tests.support.nics import connected_qps
from tests.support.sysfs import ADDR, PEER, ROOT, Port, make_path

GROUP = "7"
MSIX = abi.VFIO_PCI_MSIX_IRQ_INDEX
ONE_BACKEND = on("asyncio")
VFIO_H = "/usr/include/linux/vfio.h"


def make_machine(root: Path, driver: str | None = "vfio-pci", group: str | None = GROUP,
                 others: dict[str, str | None] | None = None, ports: list[Port] | None = None) -> Host:
    """A fake machine under `root`: ADDR (a BCM57608, bound to `driver`, in IOMMU `group`; nested below `ports`,
    the root port first, when they are given) and `others` (address: driver) in the same group; no /dev/vfio."""
    host = Host.under(str(root))
    for address, bound in {ADDR: driver, **(others or {})}.items():
        device = Path(host.devices) / address
        if address == ADDR and ports is not None:
            make_path(Path(host.devices), ports)
        else:
            device.mkdir(parents=True)
        (device / "vendor").write_text("0x14e4\n")
        (device / "device").write_text("0x1760\n")
        if bound:
            (Path(host.devices).parent / "drivers" / bound).mkdir(parents=True, exist_ok=True)
            (device / "driver").symlink_to(Path(host.devices).parent / "drivers" / bound)
        if group:
            members = Path(host.iommu_groups) / group / "devices"
            members.mkdir(parents=True, exist_ok=True)
            (device / "iommu_group").symlink_to(members.parent)
            (members / address).symlink_to(device)
    return host


@pytest.fixture
def machine(tmp_path):
    return make_machine(tmp_path)


@pytest.fixture
def emulated():
    """make(**options) -> an EmulatedVfio for ADDR; its emulator is stopped at the end of the test."""
    made: list[EmulatedVfio] = []

    def make(**options) -> EmulatedVfio:
        made.append(EmulatedVfio(ADDR, int(GROUP), **options))
        return made[-1]

    yield make
    for fake in made:
        fake.shutdown()


@pytest.fixture
def through_vfio(monkeypatch, machine, emulated):
    """open_nic(ADDR) opens VfioPCIDevice over an emulated NIC (returned: its fake VFIO)."""
    fake = emulated()
    monkeypatch.setattr(nic_module, "VfioPCIDevice", functools.partial(VfioPCIDevice, host=machine, api=fake))
    return fake


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


# -- the driver over VFIO ----------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_the_driver_runs_over_vfio_and_its_device_reaches_only_mapped_windows(through_vfio):
    """Boot, QPs, RDMA WRITEs both ways with a plain emulated NIC, close: every device access lands in a window the
    driver mapped; MSI-X is wired to the eventfds the driver waits on; the windows are unmapped after the function
    is reset, and everything is released in order."""
    fake = through_vfio
    with anyio.fail_after(30):
        async with nic_module.open_nic(ADDR, ip=fake.ip) as a, nic_module.open_nic("sim") as b:
            assert isinstance(a.pci, VfioPCIDevice) and a.pci.num_vectors == 8
            assert fake.irqs[MSIX] == [a.pci.interrupt_fd(v) for v in range(8)]
            qa, qb = await connected_qps(a, b, 64, mtu=4096)
            mine, theirs = await a.register_mr(64 << 10), await b.register_mr(64 << 10)
            mine.view[:] = os.urandom(64 << 10)
            await qa.write(mine, theirs.remote(), 64 << 10)  # the device reads the window
            assert bytes(theirs.view) == bytes(mine.view)
            theirs.view[:100] = b"x" * 100
            await qb.write(theirs, mine.remote(), 100)  # the device writes it
            assert bytes(mine.view[:100]) == b"x" * 100
            assert any(w.iova <= mine.buffer.bus_addr < w.iova + w.size for w in fake.windows.values())
            assert fake.iommu_faults() == []
    assert fake.iommu_faults() == [] and fake.windows == {} and fake.left_at_close == []
    names = [call[:2] for call in fake.calls]
    maps = sorted(call[1:] for call in fake.calls if call[0] == "map_dma")
    assert maps and maps == sorted(call[1:] for call in fake.calls if call[0] == "unmap_dma")
    first_unmap = next(i for i, call in enumerate(fake.calls) if call[0] == "unmap_dma")
    assert max(i for i, name in enumerate(names) if name == ("reset",)) < first_unmap  # quiesced, then unmapped
    assert names.index(("set_irqs", MSIX)) < names.index(("close", "device")) < names.index(("close", "container"))
    assert ("set_irqs", MSIX, []) in fake.calls and fake.open_fds == {}


@pytest.mark.anyio
@ONE_BACKEND
async def test_a_device_write_outside_every_window_is_an_iommu_fault(through_vfio, anyio_backend):
    """The IOMMU forgets an MR's window behind the driver's back: the peer's WRITE into it lands outside every
    window, and the fake logs it there (on silicon the IOMMU would block it)."""
    fake = through_vfio
    with anyio.fail_after(30):
        async with nic_module.open_nic(ADDR, ip=fake.ip) as a, nic_module.open_nic("sim") as b:
            qa, qb = await connected_qps(a, b, 64, mtu=4096)
            target, source = await a.register_mr(2 * SLAB_SIZE), await b.register_mr(4096)
            window = fake.windows[target.buffer.bus_addr]  # larger than a slab: a window of its own
            assert window.size == 2 * SLAB_SIZE and fake.unmap_dma(0, window.iova, window.size) == window.size
            assert fake.iommu_faults() == []
            await qb.write(source, target.remote(offset=PAGE_SIZE), 4096)
            assert fake.iommu_faults() == [IommuFault(window.iova + PAGE_SIZE, PAGE_SIZE)]
    assert len(fake.iommu_faults()) == 1  # logged once


# -- the seam's parts, on the fake -------------------------------------------------------------------------------------
@pytest.fixture
def device(machine, emulated):
    fake = emulated()
    opened = VfioPCIDevice(ADDR, host=machine, api=fake)
    yield opened, fake
    opened.close()


def test_bars_and_config_go_through_the_device_fd(device):
    pci, fake = device
    bar0 = pci.map_bar(0)
    assert isinstance(bar0, RegionBar) and pci.map_bar(0) is bar0 and bar0.size == fake.sim.map_bar(0).size
    bar0.write32(0x100, 0xDEADBEEF)
    assert bar0.read32(0x100) == fake.sim.map_bar(0).read32(0x100) == 0xDEADBEEF
    assert pci.read_config(0, 2) == 0x14E4 and pci.read_config(2, 2) == fake.sim.read_config(2, 2)
    with pytest.raises(PCIError, match="has no BAR1"):
        pci.map_bar(1)
    with pytest.raises(ValueError, match="BAR0"):
        bar0.read32(2)


@pytest.mark.parametrize("ports", [[ROOT], None], ids=["below a root port", "no root port visible"])
def test_the_atomicops_walk_reads_the_bridges_from_sysfs_and_sets_devctl2_through_the_config_region(
        tmp_path, emulated, ports):
    fake = emulated()  # its own path (pcie_path) is not read: VFIO shows the function, sysfs the bridges
    pci = VfioPCIDevice(ADDR, host=make_machine(tmp_path, ports=ports), api=fake)
    try:
        atomics = determine_atomics(pci, pci.upstream_path())
    finally:
        pci.close()
    enabled = ports is not None
    assert atomics.enabled is enabled and (f"reaches root port {ROOT.address}" in atomics.detail) is enabled
    assert bool(fake.sim.read_config(DEVCTL2, 2) & PCI_EXP_DEVCTL2_ATOMIC_REQ) is enabled


def test_msix_vectors_and_the_device_request_are_wired_to_the_emulator(device):
    pci, fake = device
    os.eventfd_write(fake.sim.interrupt_fd(2), 1)  # the emulator fires vector 2
    assert select.select([pci.interrupt_fd(2)], [], [], 5)[0] and os.eventfd_read(pci.interrupt_fd(2)) == 1
    assert not select.select([pci.interrupt_fd(1)], [], [], 0)[0]
    removal = pci.removal_fd()
    assert removal is not None and not select.select([removal], [], [], 0)[0]
    os.kill(fake.sim.pid, signal.SIGKILL)  # a device gone is the kernel asking for it back
    assert select.select([removal], [], [], 5)[0]
    assert pci.removal_reason() == "the kernel asked for it back (VFIO device request: unbind or unplug)"


def test_close_releases_the_device_before_it_unmaps_what_the_device_could_write(device):
    pci, fake = device
    held = [pci.alloc_dma(PAGE_SIZE), pci.alloc_dma(3 * SLAB_SIZE)]  # still held at close: freed by it
    pci.close()
    order = [call[:2] for call in fake.calls[fake.calls.index(("set_irqs", MSIX, [])):]]
    assert order[:4] == [("set_irqs", MSIX), ("set_irqs", abi.VFIO_PCI_REQ_IRQ_INDEX),
                         ("set_irqs", abi.VFIO_PCI_ERR_IRQ_INDEX), ("close", "device")]
    assert sorted(order[4:6]) == [("unmap_dma", held[0].bus_addr), ("unmap_dma", held[1].bus_addr)]
    assert order[6:] == [("close", "group"), ("close", "container")] and fake.left_at_close == []
    assert fake.sim.read_config(PCI_COMMAND, 2) & PCI_COMMAND_MASTER == 0
    with pytest.raises(ValueError):
        held[0].view[0]
    with pytest.raises(PCIError, match="closed"):
        pci.alloc_dma(PAGE_SIZE)


@pytest.mark.parametrize("resettable", [True, False])
def test_reset_is_vfio_device_reset_when_the_function_has_one(machine, emulated, resettable):
    fake = emulated(resettable=resettable)
    pci = VfioPCIDevice(ADDR, host=machine, api=fake)
    try:
        assert pci.reset() is resettable
        assert (("reset",) in fake.calls) is resettable
    finally:
        pci.close()
    with pytest.raises(PCIError, match="closed"):
        pci.reset()


def test_a_second_open_of_the_function_is_refused_until_the_first_closes(device, machine, emulated):
    with pytest.raises(PCIError, match=f"^pre-flight lock: {ADDR} is in use by pid {os.getpid()}"):
        VfioPCIDevice(ADDR, host=machine, api=emulated())
    device[0].close()
    VfioPCIDevice(ADDR, host=machine, api=emulated()).close()


def test_no_iommu_mode_warns_and_maps_nothing(machine, emulated, caplog):
    fake = emulated(noiommu=True)
    with caplog.at_level(logging.WARNING, "aiofabric.pci.vfio"):
        pci = VfioPCIDevice(ADDR, host=machine, api=fake)
    try:
        assert f"VFIO without an IOMMU ({fake.dev_dir}/noiommu-{GROUP}): no isolation" in caplog.text
        assert ("set_iommu", abi.VFIO_NOIOMMU_IOMMU) in fake.calls
        if os.geteuid() == 0:  # physical addresses from pagemap
            buffer = pci.alloc_dma(PAGE_SIZE)
            assert buffer.bus_addr and not buffer.bus_addr % PAGE_SIZE
            buffer.free()
        assert not any(call[0] == "map_dma" for call in fake.calls)
    finally:
        pci.close()


def test_a_bar_the_kernel_lets_us_mmap_is_mapped_at_its_region_offset(machine, emulated):
    """BAR0 mmappable (VFIO_REGION_INFO_FLAG_MMAP): mapped from the device fd at the region's offset."""
    memfd = os.memfd_create("device-fd")
    offset, size = abi.VFIO_PCI_BAR0_REGION_INDEX + (1 << 40), 0x10000
    os.ftruncate(memfd, offset + size)

    class Mmappable(EmulatedVfio):
        def region_info(self, device, index):
            info = super().region_info(device, index)
            if index == 0:
                info.flags, info.offset = info.flags | abi.VFIO_REGION_INFO_FLAG_MMAP, offset
            return info

        def mmap(self, device, at, length):
            return LinuxVfio().mmap(memfd, at, length)

    fake = Mmappable(ADDR, int(GROUP))
    pci = VfioPCIDevice(ADDR, host=machine, api=fake)
    try:
        bar0 = pci.map_bar(0)
        assert isinstance(bar0, MappedBar) and bar0.size == size
        bar0.write64(0x18, 0x0123456789ABCDEF)
        assert os.pread(memfd, 8, offset + 0x18) == (0x0123456789ABCDEF).to_bytes(8, "little")
    finally:
        pci.close()
        fake.shutdown()
        os.close(memfd)
    with pytest.raises(ValueError, match="closed"):
        bar0.read32(0)


def test_a_bar_that_will_not_mmap_whole_is_read_and_written_through_the_fd(machine, emulated):
    class PartlyMmappable(EmulatedVfio):  # what a kernel before 4.16 says of a BAR holding the MSI-X table
        def region_info(self, device, index):
            info = super().region_info(device, index)
            info.flags |= abi.VFIO_REGION_INFO_FLAG_MMAP
            return info

    fake = PartlyMmappable(ADDR, int(GROUP))
    pci = VfioPCIDevice(ADDR, host=machine, api=fake)
    try:
        bar0 = pci.map_bar(0)
        assert isinstance(bar0, RegionBar)
        bar0.write32(0x40, 7)
        assert fake.sim.map_bar(0).read32(0x40) == 7
    finally:
        pci.close()
        fake.shutdown()


# -- errors: one line each, naming what to run -------------------------------------------------------------------------
def test_without_dev_vfio_it_says_to_load_vfio(machine):
    with pytest.raises(PCIError) as error:
        VfioPCIDevice(ADDR, host=machine)  # the real kernel interface, on a machine with no /dev/vfio
    assert one_line(error) == (f"{ADDR}: no {machine.vfio}/vfio: load VFIO (`modprobe vfio-pci`); in a container, "
                               f"pass {machine.vfio} through")


@pytest.mark.parametrize("errno_, says", [
    (None, "no {dev}/7 for its IOMMU group 7: in a container, pass {dev}/7 through"),
    (13, "cannot open {dev}/7 (Permission denied): run as root, or give this user the file: `chown $USER {dev}/7`"),
    (16, "{dev}/7 is busy: another process has its IOMMU group open (VFIO gives a group to one process at a time)")])
def test_a_group_file_that_will_not_open_says_why(machine, errno_, says):
    class Kernel(LinuxVfio):
        def open_group(self, name):
            if errno_ is None:
                return super().open_group(name)  # neither /dev/vfio/7 nor /dev/vfio/noiommu-7 is there
            raise OSError(errno_, os.strerror(errno_))

    os.makedirs(machine.vfio)
    Path(machine.vfio, "vfio").touch()
    with pytest.raises(PCIError) as error:
        VfioPCIDevice(ADDR, host=machine, api=Kernel(machine.vfio))
    assert one_line(error) == f"{ADDR}: " + says.format(dev=machine.vfio)


def test_a_group_that_is_not_viable_names_the_device_to_unbind(tmp_path, emulated):
    host = make_machine(tmp_path, others={PEER: "bnxt_en"})
    with pytest.raises(PCIError) as error:
        VfioPCIDevice(ADDR, host=host, api=emulated(viable=False))
    assert one_line(error).startswith(f"pre-flight iommu_group: IOMMU group {GROUP} also holds {PEER} (bound to "
                                      "bnxt_en)")
    assert str(error.value).endswith(f"; fix: echo {PEER} > {host.devices[:-len('devices')]}drivers/bnxt_en/unbind")


@pytest.mark.parametrize("driver", ["bnxt_en", None])
def test_a_function_not_bound_to_vfio_pci_says_how_to_bind_it(tmp_path, emulated, driver):
    host = make_machine(tmp_path, driver=driver)
    with pytest.raises(PCIError) as error:
        VfioPCIDevice(ADDR, host=host, api=emulated())
    bind = (f"modprobe vfio-pci && echo vfio-pci > {host.devices}/{ADDR}/driver_override && echo {ADDR} > "
            f"{os.path.dirname(host.devices)}/drivers_probe")
    unbind = f"echo {ADDR} > {os.path.dirname(host.devices)}/drivers/bnxt_en/unbind && " if driver else ""
    assert one_line(error).startswith("pre-flight driver: ")
    assert str(error.value).endswith(f"; fix: {unbind}{bind}")


def test_a_function_without_an_iommu_group_says_how_to_get_one(tmp_path, emulated):
    with pytest.raises(PCIError) as error:
        VfioPCIDevice(ADDR, host=make_machine(tmp_path, group=None), api=emulated())
    assert "intel_iommu=on" in one_line(error) and "enable_unsafe_noiommu_mode" in str(error.value)


def test_open_pci_takes_vfio_for_an_address_and_raw_sysfs_only_when_asked(monkeypatch):
    opened = []
    monkeypatch.setattr(nic_module, "VfioPCIDevice", lambda address: opened.append(("vfio", address)))
    monkeypatch.setattr(nic_module, "SysfsPCIDevice", lambda address: opened.append(("sysfs", address)))
    nic_module.open_pci(ADDR)
    nic_module.open_pci(f"sysfs:{ADDR}")
    assert opened == [("vfio", ADDR), ("sysfs", ADDR)]
    with pytest.raises(PCIError, match="sysfs:0000:41:00.0 \\(raw sysfs, unsafe\\)"):
        nic_module.open_pci("sysfs:41:00.0")
    assert SysfsPCIDevice is not nic_module.VfioPCIDevice


# -- the DMA pool and IOVAs --------------------------------------------------------------------------------------------
class Windows:
    """DmaWindows that record what they map: IOVAs as an IOMMU would give, or scattered pages without one."""

    def __init__(self, contiguous: bool = True) -> None:
        self.pins, self.contiguous, self.mapped, self.unmapped = True, contiguous, [], []
        self.space = IovaSpace([(BUS_BASE, BUS_BASE + (1 << 40))])

    def map(self, address: int, size: int) -> list[int]:
        base = self.space.alloc(size)
        self.mapped.append((base, size))
        pages = range(base, base + size, PAGE_SIZE)
        return list(pages) if self.contiguous else list(reversed(pages))

    def unmap(self, bus_address: int, size: int) -> None:
        self.unmapped.append((bus_address if self.contiguous else bus_address - size + PAGE_SIZE, size))


def test_small_buffers_share_a_slab_mapped_once_and_unmapped_when_empty():
    windows = Windows()
    pool = DmaPool(windows, "test")
    buffers = [pool.alloc(PAGE_SIZE * n, False) for n in (1, 3, 1)]
    assert len(windows.mapped) == 1 and windows.mapped[0][1] == SLAB_SIZE
    assert [b.bus_addr for b in buffers] == [BUS_BASE, BUS_BASE + PAGE_SIZE, BUS_BASE + 4 * PAGE_SIZE]
    assert all(b.contiguous for b in buffers)
    buffers[1].view[:] = b"\xff" * buffers[1].size
    buffers[1].free()
    again = pool.alloc(2 * PAGE_SIZE, False)  # the freed pages, zeroed
    assert again.bus_addr == BUS_BASE + PAGE_SIZE and bytes(again.view) == bytes(again.size)
    for buffer in (buffers[0], buffers[2], again):
        assert windows.unmapped == []
        buffer.free()
    assert windows.unmapped == windows.mapped and pool.slabs == []


def test_a_buffer_larger_than_a_slab_has_its_own_window_and_close_frees_everything():
    windows = Windows()
    pool = DmaPool(windows, "test")
    small, large = pool.alloc(100, False), pool.alloc(SLAB_SIZE + 1, False)
    assert large.size == SLAB_SIZE + PAGE_SIZE and len(windows.mapped) == 2
    assert windows.mapped[1] == (large.bus_addr, large.size) and large.bus_addr % (2 * SLAB_SIZE) == 0
    pool.close()
    assert sorted(windows.unmapped) == sorted(windows.mapped)
    with pytest.raises(ValueError):
        small.view[0]


def test_a_contiguous_buffer_starts_on_a_multiple_of_its_size_rounded_up_to_a_power_of_two():
    """What dma_alloc_coherent gives Linux's drivers (the CMDQ's 128 KiB area): first fit skips to the next such
    multiple, and the pages skipped serve other buffers."""
    pool = DmaPool(Windows(), "test")
    pool.alloc(PAGE_SIZE, False)
    cmdq, odd = pool.alloc(32 * PAGE_SIZE, True), pool.alloc(3 * PAGE_SIZE, True)
    assert (cmdq.bus_addr - BUS_BASE, odd.bus_addr - BUS_BASE) == (32 * PAGE_SIZE, 4 * PAGE_SIZE)
    assert cmdq.contiguous and pool.alloc(2 * PAGE_SIZE, False).bus_addr == BUS_BASE + PAGE_SIZE


def test_contiguous_is_refused_where_the_pages_are_not():
    pool = DmaPool(Windows(contiguous=False), "nic0")
    assert not pool.alloc(2 * PAGE_SIZE, False).contiguous
    assert pool.alloc(PAGE_SIZE, True).contiguous
    with pytest.raises(PCIError, match="^nic0: no physically contiguous 0x2000 bytes.*nr_hugepages"):
        pool.alloc(2 * PAGE_SIZE, True)


def test_iovas_are_aligned_blocks_within_the_valid_ranges_reused_by_size_and_never_zero():
    space = IovaSpace([(0, 0xFEDFFFFF), (0xFEF00000, (1 << 32) - 1), (1 << 33, (1 << 34) - 1)])
    first = space.alloc(PAGE_SIZE)
    assert first == SLAB_SIZE  # never 0
    odd = space.alloc(3 * SLAB_SIZE)  # a 4-slab block, aligned to its size
    assert odd == 4 * SLAB_SIZE
    big = space.alloc(1 << 31)  # no aligned 2 GiB block below 4 GiB (the MSI hole): the next range that holds it
    assert big == 1 << 33
    space.free(odd, 3 * SLAB_SIZE)
    assert space.alloc(4 * SLAB_SIZE) == odd  # reused by size
    assert space.alloc(SLAB_SIZE) == big + (1 << 31)  # new blocks follow the last
    with pytest.raises(PCIError, match="no IOVA space left"):
        space.alloc(1 << 34)


# -- the ioctls' encoding, against a kernel that answers like Linux's --------------------------------------------------
def test_iova_ranges_read_from_the_capability_chain(monkeypatch):
    info_size = ctypes.sizeof(abi.vfio_iommu_type1_info)
    cap_size = ctypes.sizeof(abi.vfio_iommu_type1_info_cap_iova_range)
    needed = info_size + cap_size + 2 * ctypes.sizeof(abi.vfio_iova_range)

    def ioctl(fd, request, arg=0):
        assert request == abi.VFIO_IOMMU_GET_INFO
        info = abi.vfio_iommu_type1_info.from_buffer(arg)
        if info.argsz < needed:  # too small: the kernel says how much it needs
            info.flags, info.argsz = abi.VFIO_IOMMU_INFO_CAPS, needed
            return 0
        info.flags, info.cap_offset = abi.VFIO_IOMMU_INFO_CAPS, info_size
        cap = abi.vfio_iommu_type1_info_cap_iova_range.from_buffer(arg, info_size)
        cap.header.id, cap.header.next, cap.nr_iovas = abi.VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE, 0, 2
        ranges = (abi.vfio_iova_range * 2).from_buffer(arg, info_size + cap_size)
        ranges[0].start, ranges[0].end, ranges[1].start, ranges[1].end = 0, 0xFEDFFFFF, 0xFEF00000, (1 << 48) - 1
        return 0

    monkeypatch.setattr(vfio_module.fcntl, "ioctl", ioctl)
    assert LinuxVfio().iova_ranges(3) == [(0, 0xFEDFFFFF), (0xFEF00000, (1 << 48) - 1)]


def test_set_irqs_passes_the_eventfds_after_the_header(monkeypatch):
    seen = []
    monkeypatch.setattr(vfio_module.fcntl, "ioctl", lambda fd, request, arg=0: seen.append((request, bytes(arg))) or 0)
    LinuxVfio().set_irqs(3, MSIX, [10, 11])
    LinuxVfio().set_irqs(3, MSIX, [])
    header = ctypes.sizeof(abi.vfio_irq_set)
    on, off = (abi.vfio_irq_set.from_buffer_copy(raw[:header]) for _, raw in seen)
    assert seen[0][0] == abi.VFIO_DEVICE_SET_IRQS and seen[0][1][header:] == b"\x0a\0\0\0\x0b\0\0\0"
    assert (on.argsz, on.index, on.start, on.count) == (header + 8, MSIX, 0, 2)
    assert on.flags == abi.VFIO_IRQ_SET_DATA_EVENTFD | abi.VFIO_IRQ_SET_ACTION_TRIGGER
    assert (off.argsz, off.count) == (header, 0)
    assert off.flags == abi.VFIO_IRQ_SET_DATA_NONE | abi.VFIO_IRQ_SET_ACTION_TRIGGER


# -- the ABI against the kernel's header -------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists(VFIO_H), reason=f"no {VFIO_H} (install the Linux UAPI headers)")
@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler (cc) to read linux/vfio.h with")
def test_structs_and_numbers_match_linux_vfio_h(tmp_path):
    """A C program compiled against the installed header prints every size, field offset and constant the ABI
    module defines; each must be the kernel's."""
    ours: dict[str, int] = {}
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/vfio.h>", "int main(void) {"]
    for struct in abi.STRUCTS:
        name = struct.__name__
        ours[name] = ctypes.sizeof(struct)
        lines.append(f'printf("{name} %zu\\n", sizeof(struct {name}));')
        for field, *_ in struct._fields_:
            ours[f"{name}.{field}"] = getattr(struct, field).offset
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof(struct {name}, {field}));')
    for name in (n for n in dir(abi) if n.startswith("VFIO_")):
        ours[name] = getattr(abi, name)
        lines.append(f'printf("{name} %lld\\n", (long long)({name}));')
    source, program = tmp_path / "vfio_abi.c", tmp_path / "vfio_abi"
    source.write_text("\n".join(lines + ["return 0; }"]))
    subprocess.run(["cc", "-o", str(program), str(source)], check=True, capture_output=True)
    kernel = {name: int(value) for name, value in
              (line.split() for line in subprocess.run([str(program)], check=True, capture_output=True,
                                                       text=True).stdout.splitlines())}
    assert len(ours) > 80 and kernel == ours
