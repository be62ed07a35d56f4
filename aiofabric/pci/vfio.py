"""The seam over Linux's VFIO: a PCI function bound to vfio-pci, with the IOMMU between it and memory.

`VfioPCIDevice` drives the function as DPDK and SPDK do:

- its IOMMU group (/dev/vfio/N) joins a container (/dev/vfio/vfio) set to the type-1 IOMMU, and the group hands
  out the device's fd (VFIO_GROUP_GET_DEVICE_FD);
- BARs are regions of the device fd (VFIO_DEVICE_GET_REGION_INFO), mmapped where the kernel allows it, else read
  and written through the fd; config space is the config region, through the fd (the kernel virtualizes parts);
- DMA memory comes from a `DmaPool` whose slabs are mapped once each with VFIO_IOMMU_MAP_DMA, at IOVAs chosen here
  within the IOMMU's valid ranges (`iommu.IommuWindows`): a bus address is an IOVA, and the device can reach no page
  it was not given;
- MSI-X vectors are eventfds (VFIO_DEVICE_SET_IRQS); so are the device request (the kernel wants the device back:
  unbind, hot-unplug) and the error interrupt (AER), which one epoll fd turns into the removal fd;
- `reset()` is VFIO_DEVICE_RESET; closing the device fd also makes vfio-pci clear bus mastering and reset the
  function, before any DMA window is unmapped.

Without an IOMMU, vfio's `enable_unsafe_noiommu_mode` offers /dev/vfio/noiommu-N: the same interface with no
isolation, DMA at physical addresses (pagemap, root only); a warning says so. iommufd (/dev/iommu and the device's
cdev, Linux 6.2+) is not used: what it adds (nested translation, dirty tracking, PASIDs) this driver does not need,
and the container interface works on every kernel with VFIO, on the newest through iommufd's compatibility layer.

The kernel is reached only through a `VfioApi` (`vfio_api`), so tests fake it: aiofabric/pci/emulated_vfio.py puts
an emulated NIC behind one.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import select
from typing import Any, Callable, TypeVar

from . import vfio_abi as abi
from .device_lock import DeviceLock, claim
from .dma_pool import DmaPool, DmaWindows, PhysicalWindows
from .iommu import IommuWindows
from .preflight import Host, Target, check_iommu, check_iommu_group, check_present, refusal
from .seam import Bar, DmaBuffer, PCIDevice, check_address, check_bar_index, check_config_access, config_value
from .sysfs import SysfsBar
from .upstream import UpstreamPath, sysfs_upstream
from .vfio_api import LinuxVfio, VfioApi
from ..errors import PCIError

log = logging.getLogger(__name__)
T = TypeVar("T")
MSIX_VECTORS = 8  # enabled together at open (vfio-pci enables MSI-X as one block); the driver uses the first three
REMOVAL_REASONS = {abi.VFIO_PCI_REQ_IRQ_INDEX: "the kernel asked for it back (VFIO device request: unbind or unplug)",
                   abi.VFIO_PCI_ERR_IRQ_INDEX: "it reported an uncorrectable error (VFIO error interrupt, AER)"}


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
        self.address = check_address(address)
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
        check_config_access(offset, size, self._config.size)
        return int(self._config.offset) + offset

    def read_config(self, offset: int, size: int) -> int:
        at = self._config_offset(offset, size)
        return config_value(self._vfio("config read", self.api.read, self._device, at, size), offset, size,
                            self.address)

    def write_config(self, offset: int, value: int, size: int) -> None:
        at = self._config_offset(offset, size)
        self._vfio("config write", self.api.write, self._device, at, value.to_bytes(size, "little"))

    def upstream_path(self) -> UpstreamPath:
        """The bridges above, from sysfs (VFIO gives only the function itself)."""
        return sysfs_upstream(self._target.host.devices, self.address)

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
