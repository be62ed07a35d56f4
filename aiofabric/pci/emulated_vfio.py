"""The VFIO kernel interface faked by an emulated NIC: `VfioPCIDevice(address, api=EmulatedVfio(address))` runs the
real VFIO seam, and the driver on it, without hardware.

- Regions: the emulator's BAR0, BAR2 and config space, at vfio-pci's offsets (index << 40) of the device "fd". They
  are not mmappable (no VFIO_REGION_INFO_FLAG_MMAP), so every access goes through `read`/`write` to the emulator's
  seam: an MMIO write with side effects must reach the emulator as a kick, in order.
- The IOMMU: the emulator's DMA arena is the IO virtual address space, one valid IOVA range [BUS_BASE, BUS_BASE +
  ARENA_SIZE). `map_dma(vaddr, iova, size)` moves the driver's pages there: their contents are copied to arena offset
  iova - BUS_BASE and the driver's range is remapped onto the arena memfd at that offset, so the CPU and the device
  share them, as an IOMMU makes them. `unmap_dma` gives the driver's range fresh private pages and punches the window
  out of the arena.
- IOMMU faults: the arena is sparse, so a page resident outside every window was touched by the device there (a
  write, or a read the kernel backed with a page): `iommu_faults()` finds such pages (SEEK_DATA on the memfd), at
  every map and unmap and when asked, logs each extent once and punches it out.
- Interrupts: the eventfds the driver hands VFIO_DEVICE_SET_IRQS are pointed (dup2) at the emulator's MSI-X eventfds,
  and the device request's at its removal fd, so the emulator's exit is a request for the device back, as a
  hot-unplug is. Disabling an index points them at fresh eventfds nothing signals. The error interrupt never fires.
- Closing the device fd is vfio-pci's release: bus mastering off and a function reset; closing the container drops
  what windows are left, as the kernel does. `calls` records every call, for tests to check what was asked and when.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import os
from typing import Any, NamedTuple

from .emulated import SimPCIDevice
from .linux import MAP_NORESERVE, map_at
from .vfio_api import VfioApi
from .vfio_abi import (VFIO_DEVICE_FLAGS_PCI, VFIO_DEVICE_FLAGS_RESET, VFIO_GROUP_FLAGS_VIABLE, VFIO_IRQ_INFO_EVENTFD,
                       VFIO_NOIOMMU_IOMMU, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_ERR_IRQ_INDEX,
                       VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_REQ_IRQ_INDEX, VFIO_REGION_INFO_FLAG_READ,
                       VFIO_REGION_INFO_FLAG_WRITE, VFIO_TYPE1_IOMMU, VFIO_TYPE1v2_IOMMU, vfio_device_info,
                       vfio_irq_info, vfio_region_info)
from ..errors import PCIError
from ..sim.kick import NUM_VECTORS
from ..sim.memory import ARENA_SIZE, BAR0_SIZE, BAR2_SIZE, BUS_BASE, PAGE

REGION_SHIFT = 40  # vfio-pci's VFIO_PCI_OFFSET_SHIFT: region i starts at offset i << 40 of the device fd
CONFIG_SIZE = 256
REGION_SIZES = {0: BAR0_SIZE, 2: BAR2_SIZE, VFIO_PCI_CONFIG_REGION_INDEX: CONFIG_SIZE}
IRQ_COUNTS = {VFIO_PCI_MSIX_IRQ_INDEX: NUM_VECTORS, VFIO_PCI_ERR_IRQ_INDEX: 1, VFIO_PCI_REQ_IRQ_INDEX: 1}
_names = itertools.count()


class Window(NamedTuple):
    iova: int
    vaddr: int
    size: int


class IommuFault(NamedTuple):
    """Device accesses outside every DMA window: [iova, iova + length)."""
    iova: int
    length: int


def _os_error(code: int, what: str) -> OSError:
    return OSError(code, f"{os.strerror(code)}: {what}")


class EmulatedVfio(VfioApi):
    """VFIO for one emulated function at PCI `address` in IOMMU `group`. `viable`, `resettable` and `noiommu` (the
    group is /dev/vfio/noiommu-N) make the kernel's other answers; `options` go to the emulator (SimPCIDevice)."""

    def __init__(self, address: str, group: int = 7, *, viable: bool = True, resettable: bool = True,
                 noiommu: bool = False, **options: Any) -> None:
        self.address, self.group, self.noiommu = address, group, noiommu
        self.viable, self.resettable = viable, resettable
        self.sim = SimPCIDevice(f"vfio{next(_names)}-{os.getpid()}", **options)
        self.ip = self.sim.ip
        self.calls: list[tuple[Any, ...]] = []
        self.windows: dict[int, Window] = {}  # by IOVA
        self.faults: list[IommuFault] = []
        self.left_at_close: list[Window] = []  # windows still mapped when the container closed
        self.irqs: dict[int, list[int]] = {}  # IRQ index -> the driver's eventfds wired to it
        self._tokens = itertools.count(1 << 20)  # the "fds" this kernel hands out
        self.open_fds: dict[int, str] = {}  # token -> what it is

    def _open(self, what: str) -> int:
        token = next(self._tokens)
        self.open_fds[token] = what
        return token

    def _record(self, *call: Any) -> None:
        self.calls.append(call)

    # -- container and group -------------------------------------------------------------------------------------------
    def open_container(self) -> int:
        self._record("open_container")
        return self._open("container")

    def open_group(self, name: str) -> int:
        self._record("open_group", name)
        if name != (f"noiommu-{self.group}" if self.noiommu else str(self.group)):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), f"{self.dev_dir}/{name}")
        return self._open("group")

    def api_version(self, container: int) -> int:
        return 0

    def check_extension(self, container: int, extension: int) -> bool:
        return extension in ((VFIO_NOIOMMU_IOMMU,) if self.noiommu else (VFIO_TYPE1v2_IOMMU, VFIO_TYPE1_IOMMU))

    def set_iommu(self, container: int, iommu_type: int) -> None:
        self._record("set_iommu", iommu_type)

    def iova_ranges(self, container: int) -> list[tuple[int, int]]:
        return [(BUS_BASE, BUS_BASE + ARENA_SIZE - 1)]

    def group_status(self, group: int) -> int:
        return VFIO_GROUP_FLAGS_VIABLE if self.viable else 0

    def set_container(self, group: int, container: int) -> None:
        self._record("set_container")

    def get_device_fd(self, group: int, address: str) -> int:
        self._record("get_device_fd", address)
        if address != self.address:
            raise _os_error(errno.ENODEV, f"{address} is not in IOMMU group {self.group}")
        return self._open("device")

    # -- the IOMMU -----------------------------------------------------------------------------------------------------
    def map_dma(self, container: int, vaddr: int, iova: int, size: int) -> None:
        self._record("map_dma", iova, size)
        if vaddr % PAGE or iova % PAGE or size % PAGE or not size:
            raise _os_error(errno.EINVAL, f"map_dma({vaddr:#x}, {iova:#x}, {size:#x}) is not page-aligned")
        if not BUS_BASE <= iova <= iova + size <= BUS_BASE + ARENA_SIZE:
            raise _os_error(errno.EINVAL, f"IOVA {iova:#x}+{size:#x} is outside the valid range")
        if any(w.iova < iova + size and iova < w.iova + w.size for w in self.windows.values()):
            raise _os_error(errno.EEXIST, f"IOVA {iova:#x}+{size:#x} overlaps a mapping")
        self.iommu_faults()  # what the device did there before, it did without a window
        offset = iova - BUS_BASE
        os.pwrite(self.sim._arena_fd, ctypes.string_at(vaddr, size), offset)
        try:
            map_at(vaddr, size, mmap.MAP_SHARED, self.sim._arena_fd, offset)
        except OSError as exc:
            raise PCIError(f"cannot remap {vaddr:#x}+{size:#x} onto the DMA arena") from exc
        self.windows[iova] = Window(iova, vaddr, size)

    def unmap_dma(self, container: int, iova: int, size: int) -> int:
        self._record("unmap_dma", iova, size)
        inside = [w for w in self.windows.values() if iova <= w.iova and w.iova + w.size <= iova + size]
        if any(w not in inside and w.iova < iova + size and iova < w.iova + w.size for w in self.windows.values()):
            raise _os_error(errno.EINVAL, f"unmap of {iova:#x}+{size:#x} would split a mapping")
        self._drop(inside)
        return sum(w.size for w in inside)

    def _drop(self, windows: list[Window]) -> None:
        self.iommu_faults()
        for window in windows:
            map_at(window.vaddr, window.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1)
            self._punch(window.iova - BUS_BASE, window.size)
            del self.windows[window.iova]

    def iommu_faults(self) -> list[IommuFault]:
        """Every extent of device accesses outside the windows so far (each logged once, then punched out)."""
        arena, position, windows = self.sim._arena_fd, 0, sorted(self.windows.values())
        while True:
            try:
                start = os.lseek(arena, position, os.SEEK_DATA)
            except OSError as e:  # ENXIO: no data past `position`
                if e.errno != errno.ENXIO:
                    raise
                return self.faults
            position = os.lseek(arena, start, os.SEEK_HOLE)
            for first, end in _outside(start, position, [(w.iova - BUS_BASE, w.iova - BUS_BASE + w.size)
                                                         for w in windows]):
                self.faults.append(IommuFault(BUS_BASE + first, end - first))
                self._punch(first, end - first)

    def _punch(self, offset: int, length: int) -> None:
        self.sim._arena.madvise(mmap.MADV_REMOVE, offset, length)

    # -- the device ----------------------------------------------------------------------------------------------------
    def device_info(self, device: int) -> vfio_device_info:
        return vfio_device_info(flags=VFIO_DEVICE_FLAGS_PCI | (VFIO_DEVICE_FLAGS_RESET if self.resettable else 0),
                                num_regions=9, num_irqs=5)

    def region_info(self, device: int, index: int) -> vfio_region_info:
        size = REGION_SIZES.get(index, 0)
        return vfio_region_info(index=index, size=size, offset=index << REGION_SHIFT,
                                flags=VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE if size else 0)

    def irq_info(self, device: int, index: int) -> vfio_irq_info:
        return vfio_irq_info(index=index, count=IRQ_COUNTS.get(index, 0), flags=VFIO_IRQ_INFO_EVENTFD)

    def set_irqs(self, device: int, index: int, fds: list[int]) -> None:
        self._record("set_irqs", index, list(fds))
        if len(fds) > IRQ_COUNTS.get(index, 0):
            raise _os_error(errno.EINVAL, f"{len(fds)} interrupts asked of index {index}")
        for fd in self.irqs.pop(index, []):  # disabled, or wired anew: the old fds no longer hear the device
            fresh = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            os.dup2(fresh, fd, inheritable=False)
            os.close(fresh)
        if fds:
            self.irqs[index] = list(fds)
        removal = self.sim.removal_fd()
        assert removal is not None  # an emulated NIC has one: its kick socket
        sources = ([self.sim.interrupt_fd(v) for v in range(len(fds))] if index == VFIO_PCI_MSIX_IRQ_INDEX
                   else [removal] if index == VFIO_PCI_REQ_IRQ_INDEX else [])  # no AER errors to signal
        for source, fd in zip(sources, fds):
            os.dup2(source, fd, inheritable=False)

    def reset(self, device: int) -> None:
        self._record("reset")
        if not self.resettable:
            raise _os_error(errno.ENOTTY, "the function has no reset")
        self.sim.reset()

    def _region(self, offset: int, size: int) -> tuple[int, int]:
        index, within = offset >> REGION_SHIFT, offset & ((1 << REGION_SHIFT) - 1)
        if within + size > REGION_SIZES.get(index, 0) or size not in ((1, 2, 4) if index == VFIO_PCI_CONFIG_REGION_INDEX
                                                                       else (4, 8)):
            raise _os_error(errno.EINVAL, f"{size}-byte access at {offset:#x} of the device")
        return index, within

    def read(self, device: int, offset: int, size: int) -> bytes:
        index, within = self._region(offset, size)
        if index == VFIO_PCI_CONFIG_REGION_INDEX:
            return self.sim.read_config(within, size).to_bytes(size, "little")
        bar = self.sim.map_bar(index)
        return (bar.read32(within) if size == 4 else bar.read64(within)).to_bytes(size, "little")

    def write(self, device: int, offset: int, data: bytes) -> None:
        index, within = self._region(offset, len(data))
        value = int.from_bytes(data, "little")
        if index == VFIO_PCI_CONFIG_REGION_INDEX:
            self.sim.write_config(within, value, len(data))
        elif len(data) == 4:
            self.sim.map_bar(index).write32(within, value)
        else:
            self.sim.map_bar(index).write64(within, value)

    def mmap(self, device: int, offset: int, size: int) -> mmap.mmap:
        raise _os_error(errno.EINVAL, "no region of the emulated function is mmappable")

    def close(self, fd: int) -> None:
        what = self.open_fds.pop(fd, None)
        self._record("close", what)
        if what == "device":  # vfio-pci's release: bus mastering off, then a reset
            with contextlib.suppress(OSError):  # an emulator that exited: a device gone takes neither
                self.sim.disable_bus_master()
            if self.resettable:
                self.sim.reset()
        elif what == "container":  # the kernel drops the mappings left
            self.left_at_close = list(self.windows.values())
            self._drop(self.left_at_close)

    def shutdown(self) -> None:
        """Stop the emulator (after the VfioPCIDevice closed: its interrupt fds may hold the emulator's)."""
        self.sim.close()


def _outside(start: int, end: int, windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) no (sorted, disjoint) window covers."""
    parts, position = [], start
    for first, last in windows:
        if last <= position or first >= end:
            continue
        if first > position:
            parts.append((position, first))
        position = max(position, last)
    if position < end:
        parts.append((position, end))
    return parts
