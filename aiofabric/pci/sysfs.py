"""Real hardware through sysfs: BARs via resource<N> mmaps, config space via the `config` file, DMA memory translated to
physical addresses through /proc/self/pagemap. Needs root, an unbound device and an IOMMU in passthrough/off mode
(bus address == physical address)."""
from __future__ import annotations

import contextlib
import errno
import mmap
import os

from .device_lock import claim
from .linux import (HUGE_PAGE_SIZE, MAP_HUGETLB, MAP_LOCKED, MAP_POPULATE, PAGE_SIZE, phys_addr, release_mapping,
                    virt_addr)
from .preflight import Host
from .seam import Bar, DmaBuffer, PCIDevice, check_address, check_bar_index, check_config_access, config_value
from .upstream import UpstreamPath, sysfs_upstream
from ..errors import PCIError

NEED_ROOT = "run as root (CAP_SYS_ADMIN is needed for BARs, config space and physical addresses)"


class SysfsBar(Bar):
    """A BAR mapped through `/sys/bus/pci/devices/<addr>/resource<N>`.

    Accesses go through memoryviews cast to 'I'/'Q', so each is one aligned load or store of that width (CPython
    copies a fixed-size item with memcpy, which compiles to a single move); the host is assumed little-endian.
    """

    def __init__(self, path: str, index: int, size: int | None = None) -> None:
        self.index = index
        try:
            fd = os.open(path, os.O_RDWR | os.O_SYNC)
        except PermissionError as e:
            raise PCIError(f"cannot open {path}: {NEED_ROOT}") from e
        except FileNotFoundError as e:
            raise PCIError(f"BAR{index} does not exist ({path})") from e
        try:
            self.size = size or os.fstat(fd).st_size or resource_size(os.path.dirname(path), index)
            if self.size <= 0:
                raise PCIError(f"BAR{index} is empty ({path})")
            self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise PCIError(f"cannot mmap BAR{index} ({path}): {e}") from e
        finally:
            os.close(fd)  # the mapping keeps its own reference
        raw = memoryview(self._mmap)
        self._u32 = raw[: self.size & ~3].cast("I")
        self._u64 = raw[: self.size & ~7].cast("Q")
        raw.release()

    def _slot(self, offset: int, width: int) -> int:
        if self._mmap.closed:
            raise ValueError(f"BAR{self.index} is closed")
        if offset % width:
            raise ValueError(f"misaligned {8 * width}-bit access at offset {offset:#x} of BAR{self.index}")
        if not 0 <= offset <= self.size - width:
            raise ValueError(f"offset {offset:#x} outside BAR{self.index} ({self.size:#x} bytes)")
        return offset // width

    def read32(self, offset: int) -> int:
        return self._u32[self._slot(offset, 4)]

    def write32(self, offset: int, value: int) -> None:
        self._u32[self._slot(offset, 4)] = value

    def read64(self, offset: int) -> int:
        return self._u64[self._slot(offset, 8)]

    def write64(self, offset: int, value: int) -> None:
        self._u64[self._slot(offset, 8)] = value

    def close(self) -> None:
        if not self._mmap.closed:
            self._u32.release()
            self._u64.release()
            self._mmap.close()


def resource_size(device_dir: str, index: int) -> int:
    """BAR size from line `index` of the `resource` file ("start end flags", hex), 0 if unknown."""
    try:
        with open(os.path.join(device_dir, "resource")) as f:
            start, end, _flags = (int(x, 16) for x in f.read().splitlines()[index].split())
    except (OSError, IndexError, ValueError):
        return 0
    return end - start + 1 if end > start else 0


class SysfsPCIDevice(PCIDevice):
    """A real NIC driven from userspace through sysfs, with no kernel driver bound.

    Plain sysfs cannot deliver MSI-X interrupts (that needs VFIO), so `num_vectors` is 0 and the driver polls its
    completion rings. DMA memory is mlocked anonymous memory whose physical pages are read from pagemap; this assumes
    the IOMMU is off or in passthrough, and that the kernel does not migrate locked pages (hugepages never move).
    """

    def __init__(
        self, address: str, sysfs_root: str = "/sys/bus/pci/devices", pagemap: str = "/proc/self/pagemap"
    ) -> None:
        self.address = check_address(address)
        self._root = sysfs_root
        self._dir = os.path.join(sysfs_root, self.address)
        self._pagemap = pagemap
        self._bars: dict[int, SysfsBar] = {}
        self._dma: set[DmaBuffer] = set()
        self._config_fd = -1
        # present, a supported chip, no kernel driver, nobody else's (the lock, held until close); warns of the rest
        self._lock = claim(self.address, Host.with_devices(sysfs_root), "sysfs")
        try:
            self._config_fd = os.open(os.path.join(self._dir, "config"), os.O_RDWR)
        except PermissionError as e:
            self._lock.release()
            raise PCIError(f"cannot open config space of {self.address}: {NEED_ROOT}") from e

    def _check_open(self) -> None:
        if self._config_fd < 0:
            raise PCIError(f"{self.address} is closed")

    # -- BARs and config space --

    def map_bar(self, index: int) -> Bar:
        self._check_open()
        check_bar_index(index)
        if index not in self._bars:
            self._bars[index] = SysfsBar(os.path.join(self._dir, f"resource{index}"), index)
        return self._bars[index]

    def _check_config(self, offset: int, size: int) -> None:
        self._check_open()
        check_config_access(offset, size, 4096)

    def read_config(self, offset: int, size: int) -> int:
        self._check_config(offset, size)
        return config_value(os.pread(self._config_fd, size, offset), offset, size, self.address)

    def write_config(self, offset: int, value: int, size: int) -> None:
        self._check_config(offset, size)
        if os.pwrite(self._config_fd, value.to_bytes(size, "little"), offset) != size:
            raise PCIError(f"short config write at {offset:#x} of {self.address}")

    def upstream_path(self) -> UpstreamPath:
        return sysfs_upstream(self._root, self.address)

    # -- DMA memory --

    def _alloc_dma(self, size: int, contiguous: bool) -> DmaBuffer:
        self._check_open()
        if size <= 0:
            raise ValueError(f"DMA size must be positive, not {size}")
        size = -(-size // PAGE_SIZE) * PAGE_SIZE
        huge = contiguous and size > PAGE_SIZE  # one 4 KiB page is contiguous by itself
        if huge and size > HUGE_PAGE_SIZE:
            raise PCIError(f"contiguous DMA buffers are limited to one 2 MiB hugepage ({size:#x} bytes asked)")
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | MAP_LOCKED | MAP_POPULATE | (MAP_HUGETLB if huge else 0)
        try:
            m = mmap.mmap(-1, HUGE_PAGE_SIZE if huge else size, flags=flags)
        except OSError as e:
            if huge:
                raise PCIError(f"no 2 MiB hugepage for a contiguous DMA buffer ({e.strerror}): reserve some with "
                               "`echo 64 > /proc/sys/vm/nr_hugepages`") from e
            locked = e.errno in (errno.EAGAIN, errno.EPERM)
            hint = ": raise the memlock limit (ulimit -l) or run as root" if locked else ""
            raise PCIError(f"cannot allocate {size:#x} bytes of locked DMA memory ({e.strerror}){hint}") from e
        try:
            for off in range(0, size, PAGE_SIZE):
                m[off] = 0  # fault every page in so pagemap has a frame for it
            virt = virt_addr(m)
            try:
                fd = os.open(self._pagemap, os.O_RDONLY)
            except PermissionError as e:
                raise PCIError(f"cannot open {self._pagemap}: {NEED_ROOT}") from e
            try:
                if huge:
                    base = phys_addr(fd, virt)
                    bus_addrs = [base + off for off in range(0, size, PAGE_SIZE)]
                else:
                    bus_addrs = [phys_addr(fd, virt + off) for off in range(0, size, PAGE_SIZE)]
            finally:
                os.close(fd)
        except BaseException:
            m.close()
            raise
        view = memoryview(m)[:size]
        buf = DmaBuffer(view=view, bus_addrs=bus_addrs, contiguous=contiguous)

        def release() -> None:
            self._dma.discard(buf)
            release_mapping(view, m)

        buf._release = release
        self._dma.add(buf)
        return buf

    # -- interrupts (none through sysfs) --

    @property
    def num_vectors(self) -> int:
        return 0

    def interrupt_fd(self, vector: int) -> int:
        raise PCIError("no interrupts through sysfs; the driver polls")

    def reset(self) -> bool:
        """A function-level reset through the kernel (sysfs `reset`, which saves and restores config space)."""
        path = os.path.join(self._dir, "reset")
        if not os.path.exists(path):
            return False
        try:
            with open(path, "w") as f:
                f.write("1")
        except OSError as e:
            raise PCIError(f"cannot reset {self.address} ({path}: {e.strerror})") from e
        return True

    def close(self) -> None:
        if self._config_fd >= 0:  # the device must not write what is freed below: stop its DMA first
            for step in (self.disable_bus_master, self.reset):  # each on its own: one failing must not skip the other
                with contextlib.suppress(OSError, PCIError):
                    step()
        for buf in list(self._dma):
            buf.free()
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
        if self._config_fd >= 0:
            os.close(self._config_fd)
            self._config_fd = -1
        self._lock.release()
