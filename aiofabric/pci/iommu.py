"""DMA windows in the IOMMU: IOVAs (`IovaSpace`) and the DMA pool's slabs mapped at them through a VFIO container
(`IommuWindows`), so the device reaches each slab as one contiguous range and nothing else.
"""
from __future__ import annotations

import errno

from .dma_pool import SLAB_SIZE
from .linux import PAGE_SIZE
from .vfio_api import VfioApi
from ..errors import PCIError

# Where IOVAs go when the kernel reports no valid ranges (before Linux 5.4): above 4 GiB, clear of x86's MSI window
# at 0xfee00000, and below 2^39, the narrowest IOMMU address width in common use (3-level VT-d tables).
DEFAULT_IOVA_RANGES = [(1 << 32, (1 << 39) - 1)]


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
