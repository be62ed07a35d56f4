"""The VFIO kernel interface, as the seam calls it: `VfioApi`, one method per call (the files under /dev/vfio, their
ioctls, and I/O on a device fd's regions), and `LinuxVfio`, the real one. Tests fake it: aiofabric/pci/emulated_vfio.py
puts an emulated NIC behind one. The structures and request numbers are `vfio_abi`'s.
"""
from __future__ import annotations

import abc
import array
import ctypes
import fcntl
import mmap
import os

from . import vfio_abi as abi


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
