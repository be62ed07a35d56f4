"""The seam over Linux's VFIO: a PCI function bound to vfio-pci, with the IOMMU between it and memory.

`VfioPCIDevice` drives the function as DPDK and SPDK do:

- its IOMMU group (/dev/vfio/N) joins a container (/dev/vfio/vfio) set to the type-1 IOMMU, and the group hands
  out the device's fd (VFIO_GROUP_GET_DEVICE_FD);
- BARs are regions of the device fd (VFIO_DEVICE_GET_REGION_INFO), mmapped where the kernel allows it, else read
  and written through the fd; config space is the config region, through the fd (the kernel virtualizes parts);
- DMA memory comes from a `DmaPool` whose slabs are mapped once each with VFIO_IOMMU_MAP_DMA, at IOVAs chosen here
  within the IOMMU's valid ranges: a bus address is an IOVA, and the device can reach no page it was not given;
- MSI-X vectors are eventfds (VFIO_DEVICE_SET_IRQS); so are the device request (the kernel wants the device back:
  unbind, hot-unplug) and the error interrupt (AER), which one epoll fd turns into the removal fd;
- `reset()` is VFIO_DEVICE_RESET; closing the device fd also makes vfio-pci clear bus mastering and reset the
  function, before any DMA window is unmapped.

Without an IOMMU, vfio's `enable_unsafe_noiommu_mode` offers /dev/vfio/noiommu-N: the same interface with no
isolation, DMA at physical addresses (pagemap, root only); a warning says so. iommufd (/dev/iommu and the device's
cdev, Linux 6.2+) is not used: what it adds (nested translation, dirty tracking, PASIDs) this driver does not need,
and the container interface works on every kernel with VFIO, on the newest through iommufd's compatibility layer.

The kernel is reached only through a `VfioApi`, so tests fake it: aiofabric/pci/emulated_vfio.py puts an emulated NIC behind
one.
"""
from __future__ import annotations

import abc
import array
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import select
from typing import Any, Callable, TypeVar

from . import vfio_abi as abi
from .dma_pool import SLAB_SIZE, DmaPool, DmaWindows, PhysicalWindows
from .linux import PAGE_SIZE
from .preflight import DeviceLock, Host, Target, check_iommu, check_iommu_group, check_present, claim, refusal
from .seam import ADDRESS, Bar, DmaBuffer, PCIDevice, check_bar_index
from .sysfs import SysfsBar
from ..errors import PCIError

log = logging.getLogger(__name__)
T = TypeVar("T")
MSIX_VECTORS = 8  # enabled together at open (vfio-pci enables MSI-X as one block); the driver uses the first three
# Where IOVAs go when the kernel reports no valid ranges (before Linux 5.4): above 4 GiB, clear of x86's MSI window
# at 0xfee00000, and below 2^39, the narrowest IOMMU address width in common use (3-level VT-d tables).
DEFAULT_IOVA_RANGES = [(1 << 32, (1 << 39) - 1)]
REMOVAL_REASONS = {abi.VFIO_PCI_REQ_IRQ_INDEX: "the kernel asked for it back (VFIO device request: unbind or unplug)",
                   abi.VFIO_PCI_ERR_IRQ_INDEX: "it reported an uncorrectable error (VFIO error interrupt, AER)"}


class VfioApi(abc.ABC):
    """The VFIO kernel interface, one method per call the seam makes: the files under /dev/vfio, their ioctls, and
    I/O on a device fd's regions. Failures raise OSError, as the system calls do."""

    dev_dir = "/dev/vfio"

    @abc.abstractmethod
    def open_container(self) -> int:
        """Open /dev/vfio/vfio."""

    @abc.abstractmethod
    def open_group(self, name: str) -> int:
        """Open /dev/vfio/NAME: an IOMMU group's number, or noiommu-N."""

    @abc.abstractmethod
    def api_version(self, container: int) -> int: ...

    @abc.abstractmethod
    def check_extension(self, container: int, extension: int) -> bool: ...

    @abc.abstractmethod
    def set_iommu(self, container: int, iommu_type: int) -> None: ...

    @abc.abstractmethod
    def iova_ranges(self, container: int) -> list[tuple[int, int]]:
        """The IOMMU's valid IOVA ranges as (first, last) (VFIO_IOMMU_GET_INFO); [] if the kernel does not say."""

    @abc.abstractmethod
    def map_dma(self, container: int, vaddr: int, iova: int, size: int) -> None:
        """Let the device read and write [vaddr, vaddr + size) of this process at [iova, iova + size); pins it."""

    @abc.abstractmethod
    def unmap_dma(self, container: int, iova: int, size: int) -> int:
        """Remove the mappings within [iova, iova + size); the bytes unmapped."""

    @abc.abstractmethod
    def group_status(self, group: int) -> int:
        """VFIO_GROUP_GET_STATUS's flags."""

    @abc.abstractmethod
    def set_container(self, group: int, container: int) -> None: ...

    @abc.abstractmethod
    def get_device_fd(self, group: int, address: str) -> int: ...

    @abc.abstractmethod
    def device_info(self, device: int) -> abi.vfio_device_info: ...

    @abc.abstractmethod
    def region_info(self, device: int, index: int) -> abi.vfio_region_info: ...

    @abc.abstractmethod
    def irq_info(self, device: int, index: int) -> abi.vfio_irq_info: ...

    @abc.abstractmethod
    def set_irqs(self, device: int, index: int, fds: list[int]) -> None:
        """Interrupt i of `index` signals eventfd fds[i]; [] disables the index."""

    @abc.abstractmethod
    def reset(self, device: int) -> None: ...

    @abc.abstractmethod
    def read(self, device: int, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` of the device fd (a region's offset plus the offset within it)."""

    @abc.abstractmethod
    def write(self, device: int, offset: int, data: bytes) -> None: ...

    @abc.abstractmethod
    def mmap(self, device: int, offset: int, size: int) -> mmap.mmap: ...

    @abc.abstractmethod
    def close(self, fd: int) -> None: ...


def _ioctl(fd: int, request: int, arg: ctypes.Structure | bytearray | int = 0) -> int:
    """ioctl(2): a buffer argument is passed by address and filled in place; the call's result is returned."""
    return int(fcntl.ioctl(fd, request, arg))


class LinuxVfio(VfioApi):
    """The real one: the device files under `dev_dir` and their ioctls."""

    def __init__(self, dev_dir: str = "/dev/vfio") -> None:
        self.dev_dir = dev_dir

    def open_container(self) -> int:
        return os.open(os.path.join(self.dev_dir, "vfio"), os.O_RDWR | os.O_CLOEXEC)

    def open_group(self, name: str) -> int:
        return os.open(os.path.join(self.dev_dir, name), os.O_RDWR | os.O_CLOEXEC)

    def api_version(self, container: int) -> int:
        return _ioctl(container, abi.VFIO_GET_API_VERSION)

    def check_extension(self, container: int, extension: int) -> bool:
        return _ioctl(container, abi.VFIO_CHECK_EXTENSION, extension) > 0

    def set_iommu(self, container: int, iommu_type: int) -> None:
        _ioctl(container, abi.VFIO_SET_IOMMU, iommu_type)

    def iova_ranges(self, container: int) -> list[tuple[int, int]]:
        info = abi.vfio_iommu_type1_info(argsz=ctypes.sizeof(abi.vfio_iommu_type1_info))
        _ioctl(container, abi.VFIO_IOMMU_GET_INFO, info)
        if not info.flags & abi.VFIO_IOMMU_INFO_CAPS or info.argsz <= ctypes.sizeof(info):
            return []
        buffer = bytearray(info.argsz)  # again, with room for the capability chain the first call sized
        abi.vfio_iommu_type1_info.from_buffer(buffer).argsz = info.argsz
        _ioctl(container, abi.VFIO_IOMMU_GET_INFO, buffer)
        offset = abi.vfio_iommu_type1_info.from_buffer(buffer).cap_offset
        while offset:
            header = abi.vfio_info_cap_header.from_buffer(buffer, offset)
            if header.id == abi.VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE:
                cap = abi.vfio_iommu_type1_info_cap_iova_range.from_buffer(buffer, offset)
                ranges = (abi.vfio_iova_range * cap.nr_iovas).from_buffer(buffer, offset + ctypes.sizeof(cap))
                return [(r.start, r.end) for r in ranges]
            offset = header.next
        return []

    def map_dma(self, container: int, vaddr: int, iova: int, size: int) -> None:
        _ioctl(container, abi.VFIO_IOMMU_MAP_DMA, abi.vfio_iommu_type1_dma_map(
            argsz=ctypes.sizeof(abi.vfio_iommu_type1_dma_map), vaddr=vaddr, iova=iova, size=size,
            flags=abi.VFIO_DMA_MAP_FLAG_READ | abi.VFIO_DMA_MAP_FLAG_WRITE))

    def unmap_dma(self, container: int, iova: int, size: int) -> int:
        unmap = abi.vfio_iommu_type1_dma_unmap(argsz=ctypes.sizeof(abi.vfio_iommu_type1_dma_unmap), iova=iova,
                                               size=size)
        _ioctl(container, abi.VFIO_IOMMU_UNMAP_DMA, unmap)
        return int(unmap.size)

    def group_status(self, group: int) -> int:
        status = abi.vfio_group_status(argsz=ctypes.sizeof(abi.vfio_group_status))
        _ioctl(group, abi.VFIO_GROUP_GET_STATUS, status)
        return int(status.flags)

    def set_container(self, group: int, container: int) -> None:
        _ioctl(group, abi.VFIO_GROUP_SET_CONTAINER, bytearray(container.to_bytes(4, "little", signed=True)))

    def get_device_fd(self, group: int, address: str) -> int:
        return _ioctl(group, abi.VFIO_GROUP_GET_DEVICE_FD, bytearray(address.encode() + b"\0"))

    def device_info(self, device: int) -> abi.vfio_device_info:
        info = abi.vfio_device_info(argsz=ctypes.sizeof(abi.vfio_device_info))
        _ioctl(device, abi.VFIO_DEVICE_GET_INFO, info)
        return info

    def region_info(self, device: int, index: int) -> abi.vfio_region_info:
        info = abi.vfio_region_info(argsz=ctypes.sizeof(abi.vfio_region_info), index=index)
        _ioctl(device, abi.VFIO_DEVICE_GET_REGION_INFO, info)
        return info

    def irq_info(self, device: int, index: int) -> abi.vfio_irq_info:
        info = abi.vfio_irq_info(argsz=ctypes.sizeof(abi.vfio_irq_info), index=index)
        _ioctl(device, abi.VFIO_DEVICE_GET_IRQ_INFO, info)
        return info

    def set_irqs(self, device: int, index: int, fds: list[int]) -> None:
        data = array.array("i", fds).tobytes()
        header = abi.vfio_irq_set(argsz=ctypes.sizeof(abi.vfio_irq_set) + len(data), index=index, start=0,
                                  count=len(fds), flags=abi.VFIO_IRQ_SET_ACTION_TRIGGER
                                  | (abi.VFIO_IRQ_SET_DATA_EVENTFD if fds else abi.VFIO_IRQ_SET_DATA_NONE))
        _ioctl(device, abi.VFIO_DEVICE_SET_IRQS, bytearray(bytes(header) + data))

    def reset(self, device: int) -> None:
        _ioctl(device, abi.VFIO_DEVICE_RESET)

    def read(self, device: int, offset: int, size: int) -> bytes:
        return os.pread(device, size, offset)

    def write(self, device: int, offset: int, data: bytes) -> None:
        os.pwrite(device, data, offset)

    def mmap(self, device: int, offset: int, size: int) -> mmap.mmap:
        return mmap.mmap(device, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)

    def close(self, fd: int) -> None:
        os.close(fd)


# -- DMA windows in the IOMMU ------------------------------------------------------------------------------------------
class IovaSpace:
    """IOVAs for DMA windows: blocks of a power-of-two size (a slab's at least), aligned to it, so the IOMMU can map
    each with its largest pages; a freed block serves the next window of its size. Blocks are taken from the valid
    ranges in order, never at IOVA 0."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self._ranges = sorted(ranges)
        self._next = 0  # below it every block is handed out or in `_free`
        self._free: dict[int, list[int]] = {}

    def alloc(self, size: int) -> int:
        block = _block(size)
        if self._free.get(block):
            return self._free[block].pop()
        for first, last in self._ranges:
            start = -(-max(self._next, first, block) // block) * block
            if start + block - 1 <= last:
                self._next = start + block
                return start
        raise PCIError(f"no IOVA space left for a {size:#x}-byte DMA window")

    def free(self, iova: int, size: int) -> None:
        self._free.setdefault(_block(size), []).append(iova)


def _block(size: int) -> int:
    return max(SLAB_SIZE, 1 << (size - 1).bit_length())


class IommuWindows:
    """Slabs mapped into the container's IOMMU at IOVAs from an `IovaSpace`: the device sees each slab as one
    contiguous range at its IOVA, and nothing else. VFIO pins mapped pages (they cannot be swapped or migrated)
    and counts them against RLIMIT_MEMLOCK, once: the pool does not lock them as well."""

    pins = True

    def __init__(self, api: VfioApi, container: int, ranges: list[tuple[int, int]], owner: str) -> None:
        self.api, self.container, self.owner = api, container, owner
        self.space = IovaSpace(ranges or DEFAULT_IOVA_RANGES)

    def map(self, address: int, size: int) -> list[int]:
        iova = self.space.alloc(size)
        try:
            self.api.map_dma(self.container, address, iova, size)
        except OSError as e:
            self.space.free(iova, size)
            hint = (": raise the locked-memory limit (`ulimit -l unlimited`; LimitMEMLOCK=infinity for a service)"
                    if e.errno == errno.ENOMEM else "")
            raise PCIError(f"{self.owner}: VFIO_IOMMU_MAP_DMA of {size:#x} bytes at IOVA {iova:#x} failed "
                           f"({e.strerror}){hint}") from e
        return list(range(iova, iova + size, PAGE_SIZE))

    def unmap(self, bus_address: int, size: int) -> None:
        try:
            self.api.unmap_dma(self.container, bus_address, size)
        except OSError as e:
            raise PCIError(f"VFIO_IOMMU_UNMAP_DMA of {size:#x} bytes at IOVA {bus_address:#x} failed "
                           f"({e.strerror})") from e
        self.space.free(bus_address, size)


# -- BARs --------------------------------------------------------------------------------------------------------------
class MappedBar(SysfsBar):
    """A BAR mmapped from the device fd: SysfsBar's accesses (one aligned load or store each) over that mapping."""

    def __init__(self, mapping: mmap.mmap, index: int) -> None:  # not SysfsBar's, which opens a resource file
        self.index, self.size, self._mmap = index, len(mapping), mapping
        raw = memoryview(mapping)
        self._u32 = raw[: self.size & ~3].cast("I")
        self._u64 = raw[: self.size & ~7].cast("Q")
        raw.release()


class RegionBar(Bar):
    """A BAR the kernel does not let us mmap: each access is a read or write of the device fd at the region."""

    def __init__(self, api: VfioApi, device: int, region: abi.vfio_region_info, index: int) -> None:
        self.api, self.device, self.index = api, device, index
        self.base, self.size = int(region.offset), int(region.size)
        self.closed = False

    def _at(self, offset: int, width: int) -> int:
        if self.closed:
            raise ValueError(f"BAR{self.index} is closed")
        if offset % width or not 0 <= offset <= self.size - width:
            raise ValueError(f"bad {8 * width}-bit access at offset {offset:#x} of BAR{self.index} ({self.size:#x} "
                             "bytes)")
        return self.base + offset

    def read32(self, offset: int) -> int:
        return int.from_bytes(self.api.read(self.device, self._at(offset, 4), 4), "little")

    def write32(self, offset: int, value: int) -> None:
        self.api.write(self.device, self._at(offset, 4), value.to_bytes(4, "little"))

    def read64(self, offset: int) -> int:
        return int.from_bytes(self.api.read(self.device, self._at(offset, 8), 8), "little")

    def write64(self, offset: int, value: int) -> None:
        self.api.write(self.device, self._at(offset, 8), value.to_bytes(8, "little"))

    def close(self) -> None:
        self.closed = True


# -- the device --------------------------------------------------------------------------------------------------------
class VfioPCIDevice(PCIDevice):
    """A PCI function bound to vfio-pci (see the module docstring). `host` is where the machine is read (sysfs,
    /dev/vfio: a fake tree's in tests); `api` is the kernel (by default the device files under `host.vfio`; a fake in
    tests); `pagemap` serves physical addresses in no-IOMMU mode. Every error is a PCIError whose one line says what
    to run."""

    def __init__(self, address: str, *, host: Host = Host(), api: VfioApi | None = None,
                 pagemap: str = "/proc/self/pagemap") -> None:
        self.address = address.lower()
        if not ADDRESS.fullmatch(self.address):
            raise PCIError(f"bad PCI address {address!r}: expected domain:bus:device.function, e.g. 0000:41:00.0")
        self.api = api or LinuxVfio(host.vfio)
        self._target = Target.of(self.address, host, "vfio")
        self._lock: DeviceLock | None = None
        self._container = self._group = self._device = -1
        self._closed = False
        self._bars: dict[int, MappedBar | RegionBar] = {}
        self._config: abi.vfio_region_info | None = None
        self._resettable = False
        self._pool: DmaPool | None = None
        self._wired: list[int] = []  # IRQ indexes whose eventfds are set
        self._eventfds: list[int] = []  # every eventfd made, closed last
        self._vectors: list[int] = []  # MSI-X eventfds
        self._removal: dict[int, int] = {}  # REQ/ERR index -> eventfd
        self._epoll: select.epoll | None = None
        for check in (check_present, check_iommu):  # first: without an IOMMU group, vfio-pci cannot be bound
            finding = check(self._target)
            if not finding.ok:
                raise refusal(finding)
        group = self._target.group()
        assert group is not None  # check_iommu said so
        try:
            # a supported chip, bound to vfio-pci, nobody else's (the lock, held until close); warns of the rest
            self._lock = claim(self.address, host, "vfio")
            self._open(group, pagemap)
        except BaseException:
            self.close()
            raise

    # -- open ----------------------------------------------------------------------------------------------------------
    def _not_viable(self, group: str) -> PCIError:
        """The pre-flight's finding on the group's other devices (which to unbind), else what VFIO said."""
        finding = check_iommu_group(self._target)
        if not finding.ok:
            return refusal(finding)
        return PCIError(f"{self.address}: VFIO says IOMMU group {group} is not viable: bind every device in "
                        f"{self._target.host.iommu_groups}/{group}/devices to vfio-pci, or unbind it")

    def _open(self, group: str, pagemap: str) -> None:
        api, where = self.api, self.api.dev_dir
        try:
            self._container = api.open_container()
        except FileNotFoundError as e:
            raise PCIError(f"{self.address}: no {where}/vfio: load VFIO (`modprobe vfio-pci`); in a container, "
                           f"pass {where} through") from e
        except OSError as e:
            raise self._open_error("vfio", e) from e
        noiommu = False
        try:
            self._group = api.open_group(group)
        except FileNotFoundError:
            try:
                self._group, noiommu = api.open_group(f"noiommu-{group}"), True
            except FileNotFoundError as e:
                raise PCIError(f"{self.address}: no {where}/{group} for its IOMMU group {group}: in a container, pass "
                               f"{where}/{group} through") from e
            except OSError as e:
                raise self._open_error(f"noiommu-{group}", e) from e
        except OSError as e:
            raise self._open_error(group, e) from e
        if noiommu:
            log.warning("%s: VFIO without an IOMMU (%s/noiommu-%s): no isolation, the device can reach all memory "
                        "and DMA uses physical addresses", self.address, where, group)
        version = self._vfio("VFIO_GET_API_VERSION", api.api_version, self._container)
        self._check(version == abi.VFIO_API_VERSION, f"VFIO API version {version}, not {abi.VFIO_API_VERSION}")
        if not self._vfio("VFIO_GROUP_GET_STATUS", api.group_status, self._group) & abi.VFIO_GROUP_FLAGS_VIABLE:
            raise self._not_viable(group)
        self._vfio("VFIO_GROUP_SET_CONTAINER", api.set_container, self._group, self._container)
        self._vfio("VFIO_SET_IOMMU", api.set_iommu, self._container, self._iommu_type(noiommu))
        windows: DmaWindows = PhysicalWindows(pagemap) if noiommu else IommuWindows(
            api, self._container, self._vfio("VFIO_IOMMU_GET_INFO", api.iova_ranges, self._container), self.address)
        self._device = self._vfio("VFIO_GROUP_GET_DEVICE_FD", api.get_device_fd, self._group, self.address,
                                  hint="no-IOMMU VFIO needs CAP_SYS_RAWIO: run as root" if noiommu else "")
        info = self._vfio("VFIO_DEVICE_GET_INFO", api.device_info, self._device)
        self._check(info.flags & abi.VFIO_DEVICE_FLAGS_PCI and info.num_regions > abi.VFIO_PCI_CONFIG_REGION_INDEX,
                    "VFIO does not present it as a PCI function")
        self._resettable = bool(info.flags & abi.VFIO_DEVICE_FLAGS_RESET)
        self._config = self._vfio("the config region's info", api.region_info, self._device,
                                  abi.VFIO_PCI_CONFIG_REGION_INDEX)
        self._pool = DmaPool(windows, self.address)
        self._wire_interrupts(info.num_irqs)

    def _open_error(self, name: str, error: OSError) -> PCIError:
        """Why /dev/vfio/NAME (the container or a group) would not open, and what to run."""
        path = os.path.join(self.api.dev_dir, name)
        if isinstance(error, PermissionError):
            return PCIError(f"{self.address}: cannot open {path} ({error.strerror}): run as root, or give this user "
                            f"the file: `chown $USER {path}`")
        if error.errno == errno.EBUSY:
            return PCIError(f"{self.address}: {path} is busy: another process has its IOMMU group open (VFIO gives a "
                            "group to one process at a time)")
        return PCIError(f"{self.address}: cannot open {path} ({error.strerror})")

    def _iommu_type(self, noiommu: bool) -> int:
        wanted = [abi.VFIO_NOIOMMU_IOMMU] if noiommu else [abi.VFIO_TYPE1v2_IOMMU, abi.VFIO_TYPE1_IOMMU]
        for iommu_type in wanted:
            if self._vfio("VFIO_CHECK_EXTENSION", self.api.check_extension, self._container, iommu_type):
                return iommu_type
        raise PCIError(f"{self.address}: the VFIO container offers no " + (
            "no-IOMMU mode" if noiommu else "type-1 IOMMU (the kernel's VFIO_IOMMU_TYPE1 driver is missing)"))

    def _vfio(self, what: str, call: Callable[..., T], *args: Any, hint: str = "") -> T:
        """call(*args), a failure as a PCIError naming `what` (the ioctl) and why."""
        try:
            return call(*args)
        except OSError as e:
            raise PCIError(f"{self.address}: {what} failed ({e.strerror or e})" + (f": {hint}" if hint else "")) \
                from e

    def _check(self, condition: object, problem: str) -> None:
        if not condition:
            raise PCIError(f"{self.address}: {problem}")

    def _wire_interrupts(self, num_irqs: int) -> None:
        """MSI-X vectors and the removal notifications as eventfds; the driver polls if there are no vectors."""
        def eventfds(index: int, most: int) -> list[int]:
            if index >= num_irqs:
                return []
            info = self._vfio("VFIO_DEVICE_GET_IRQ_INFO", self.api.irq_info, self._device, index)
            count = min(info.count, most) if info.flags & abi.VFIO_IRQ_INFO_EVENTFD else 0
            fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(count)]
            self._eventfds += fds
            if fds:
                self._wired.append(index)
                self._vfio("VFIO_DEVICE_SET_IRQS", self.api.set_irqs, self._device, index, fds)
            return fds

        self._vectors = eventfds(abi.VFIO_PCI_MSIX_IRQ_INDEX, MSIX_VECTORS)
        for index in REMOVAL_REASONS:
            for fd in eventfds(index, 1):
                self._removal[index] = fd
        if self._removal:
            self._epoll = select.epoll()
            for fd in self._removal.values():
                self._epoll.register(fd, select.EPOLLIN)

    # -- the seam ------------------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._device < 0:
            raise PCIError(f"{self.address} is closed")

    def map_bar(self, index: int) -> Bar:
        self._check_open()
        check_bar_index(index)
        if index not in self._bars:
            region = self._vfio(f"BAR{index}'s region info", self.api.region_info, self._device, index)
            if not region.size:
                raise PCIError(f"{self.address} has no BAR{index}")
            self._bars[index] = RegionBar(self.api, self._device, region, index)
            if region.flags & abi.VFIO_REGION_INFO_FLAG_MMAP:
                try:
                    self._bars[index] = MappedBar(self.api.mmap(self._device, region.offset, region.size), index)
                except OSError as e:  # before Linux 4.16 a BAR holding the MSI-X table maps only in parts
                    log.info("%s: BAR%d cannot be mmapped whole (%s): accessed through the device fd", self.address,
                             index, e.strerror)
        return self._bars[index]

    def _config_offset(self, offset: int, size: int) -> int:
        self._check_open()
        assert self._config is not None  # set before the device fd is
        if size not in (1, 2, 4) or offset % size or not 0 <= offset <= self._config.size - size:
            raise ValueError(f"bad config access: {size} bytes at offset {offset:#x}")
        return int(self._config.offset) + offset

    def read_config(self, offset: int, size: int) -> int:
        at = self._config_offset(offset, size)
        raw = self._vfio("config read", self.api.read, self._device, at, size)
        if len(raw) != size:
            raise PCIError(f"short config read at {offset:#x} of {self.address} (only {len(raw)} bytes)")
        return int.from_bytes(raw, "little")

    def write_config(self, offset: int, value: int, size: int) -> None:
        at = self._config_offset(offset, size)
        self._vfio("config write", self.api.write, self._device, at, value.to_bytes(size, "little"))

    def _alloc_dma(self, size: int, contiguous: bool) -> DmaBuffer:
        self._check_open()
        assert self._pool is not None  # made before the device fd is kept
        return self._pool.alloc(size, contiguous)

    @property
    def num_vectors(self) -> int:
        return len(self._vectors)

    def interrupt_fd(self, vector: int) -> int:
        if not 0 <= vector < len(self._vectors):
            raise PCIError(f"{self.address}: MSI-X vector {vector} is not enabled (0..{len(self._vectors) - 1})")
        return self._vectors[vector]

    def removal_fd(self) -> int | None:
        """Readable once the kernel asks for the device back or it reports an uncorrectable error."""
        return self._epoll.fileno() if self._epoll is not None else None

    def removal_reason(self) -> str:
        ready = select.select(list(self._removal.values()), [], [], 0)[0]
        return "; ".join(REMOVAL_REASONS[index] for index, fd in self._removal.items() if fd in ready)

    def reset(self) -> bool:
        """VFIO_DEVICE_RESET: a function-level reset (or the PM or bus reset the kernel picks for this function):
        its queues, contexts and DMA stop; vfio-pci restores config space around it. For the driver to call before
        it frees memory the function could write (closing resets too). False, doing nothing, if the function has
        no reset."""
        self._check_open()
        if not self._resettable:
            return False
        self._vfio("VFIO_DEVICE_RESET", self.api.reset, self._device)
        return True

    def close(self) -> None:
        """Release everything, the device first: its interrupts off, bus mastering off, BARs unmapped and its fd
        closed (vfio-pci then resets the function, when it can); only then are the DMA windows unmapped and their
        memory freed, so the device cannot write a page after it is given back; then the group and the container
        (the kernel drops whatever mapping is left with it)."""
        if self._closed:
            return
        self._closed = True
        if self._device >= 0:
            for index in self._wired:
                with contextlib.suppress(OSError):
                    self.api.set_irqs(self._device, index, [])
            with contextlib.suppress(OSError, PCIError):
                self.disable_bus_master()
            for bar in self._bars.values():
                bar.close()
            self._bars.clear()
            self.api.close(self._device)
            self._device = -1
        if self._pool is not None:
            self._pool.close()
        for fd in (self._group, self._container):
            if fd >= 0:
                self.api.close(fd)
        self._group = self._container = -1
        for fd in self._eventfds:
            os.close(fd)
        if self._epoll is not None:
            self._epoll.close()
        if self._lock is not None:
            self._lock.release()
