"""The VFIO user ABI the seam uses, as Linux's include/uapi/linux/vfio.h defines it: ioctl numbers, flags, the
vfio-pci region and interrupt indexes, and the argument structures as ctypes Structures.

Names are the header's, so tests/driver/test_vfio.py can compile a C program against the installed header and compare
every constant, size and field offset here with the kernel's.
"""
from __future__ import annotations

import ctypes

# Every VFIO ioctl is _IO(VFIO_TYPE, VFIO_BASE + n): no size or direction bits, the argument's `argsz` says its size.
VFIO_TYPE, VFIO_BASE = ord(";"), 100


def _io(number: int) -> int:
    return VFIO_TYPE << 8 | VFIO_BASE + number  # _IO(type, nr) of asm-generic/ioctl.h


VFIO_API_VERSION = 0
VFIO_TYPE1_IOMMU, VFIO_TYPE1v2_IOMMU, VFIO_NOIOMMU_IOMMU = 1, 3, 8

# on the container (/dev/vfio/vfio)
VFIO_GET_API_VERSION = _io(0)
VFIO_CHECK_EXTENSION = _io(1)
VFIO_SET_IOMMU = _io(2)
VFIO_IOMMU_GET_INFO = _io(12)
VFIO_IOMMU_MAP_DMA = _io(13)
VFIO_IOMMU_UNMAP_DMA = _io(14)
# on a group (/dev/vfio/N)
VFIO_GROUP_GET_STATUS = _io(3)
VFIO_GROUP_SET_CONTAINER = _io(4)
VFIO_GROUP_GET_DEVICE_FD = _io(6)
# on a device
VFIO_DEVICE_GET_INFO = _io(7)
VFIO_DEVICE_GET_REGION_INFO = _io(8)
VFIO_DEVICE_GET_IRQ_INFO = _io(9)
VFIO_DEVICE_SET_IRQS = _io(10)
VFIO_DEVICE_RESET = _io(11)

VFIO_GROUP_FLAGS_VIABLE = 1 << 0
VFIO_DEVICE_FLAGS_RESET, VFIO_DEVICE_FLAGS_PCI = 1 << 0, 1 << 1
VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE, VFIO_REGION_INFO_FLAG_MMAP = 1 << 0, 1 << 1, 1 << 2
VFIO_IRQ_INFO_EVENTFD = 1 << 0
VFIO_IRQ_SET_DATA_NONE, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_ACTION_TRIGGER = 1 << 0, 1 << 2, 1 << 5
VFIO_IOMMU_INFO_CAPS = 1 << 1
VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE = 1
VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE = 1 << 0, 1 << 1

# vfio-pci's fixed indexes (the header's anonymous enums)
VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX = 0, 7
VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_REQ_IRQ_INDEX = 2, 3, 4

u16, u32, u64 = ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class vfio_info_cap_header(ctypes.Structure):
    _fields_ = [("id", u16), ("version", u16), ("next", u32)]


class vfio_group_status(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32)]


class vfio_device_info(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32), ("num_regions", u32), ("num_irqs", u32), ("cap_offset", u32)]


class vfio_region_info(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32), ("index", u32), ("cap_offset", u32), ("size", u64), ("offset", u64)]


class vfio_irq_info(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32), ("index", u32), ("count", u32)]


class vfio_irq_set(ctypes.Structure):
    """Followed by `count` __s32 eventfds (DATA_EVENTFD) or nothing (DATA_NONE)."""
    _fields_ = [("argsz", u32), ("flags", u32), ("index", u32), ("start", u32), ("count", u32)]


class vfio_iommu_type1_info(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32), ("iova_pgsizes", u64), ("cap_offset", u32)]


class vfio_iova_range(ctypes.Structure):
    _fields_ = [("start", u64), ("end", u64)]  # end inclusive


class vfio_iommu_type1_info_cap_iova_range(ctypes.Structure):
    """Followed by `nr_iovas` vfio_iova_range."""
    _fields_ = [("header", vfio_info_cap_header), ("nr_iovas", u32), ("reserved", u32)]


class vfio_iommu_type1_dma_map(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32), ("vaddr", u64), ("iova", u64), ("size", u64)]


class vfio_iommu_type1_dma_unmap(ctypes.Structure):
    _fields_ = [("argsz", u32), ("flags", u32), ("iova", u64), ("size", u64)]


STRUCTS: tuple[type[ctypes.Structure], ...] = (
    vfio_info_cap_header, vfio_group_status, vfio_device_info, vfio_region_info, vfio_irq_info, vfio_irq_set,
    vfio_iommu_type1_info, vfio_iova_range, vfio_iommu_type1_info_cap_iova_range, vfio_iommu_type1_dma_map,
    vfio_iommu_type1_dma_unmap)
