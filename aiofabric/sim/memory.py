"""Memory shared between the driver process and the emulated NIC: the DMA arena and the BAR0 register file.

The arena is one memfd mapped by both processes. A bus address is an arena offset plus `BUS_BASE`, the way an IOMMU
would present the pages: the driver hands the device bus addresses, the device never sees a driver pointer. The base
is deliberately far from zero so an arena offset passed by mistake faults instead of silently landing somewhere.
"""
from __future__ import annotations

import bisect

PAGE = 0x1000
BUS_BASE = 0x10_0000_0000
# Sparse: only allocated pages cost memory (freed ones go back to the host, pci/emulated.py). 4 GiB: two 1 GiB buffers
# (a loopback message's source and target on one NIC) and the rings fit.
ARENA_SIZE = 4 << 30
BAR0_SIZE = 0x10000
BAR2_SIZE = 0x100000


class DmaFault(Exception):
    """The device tried to reach a bus address outside the host memory it was given."""


class BusMemory:
    """The device's view of host memory, addressed by bus address; every access is range-checked."""

    def __init__(self, buffer, base: int = BUS_BASE) -> None:
        self.buffer = memoryview(buffer).cast("B")
        self.base, self.end = base, base + len(self.buffer)

    def _offset(self, addr: int, length: int) -> int:
        if not (self.base <= addr and addr + length <= self.end and length >= 0):
            raise DmaFault(f"DMA to {addr:#x}+{length:#x} outside host memory [{self.base:#x}, {self.end:#x})")
        return addr - self.base

    def view(self, addr: int, length: int) -> memoryview:
        off = self._offset(addr, length)
        return self.buffer[off:off + length]

    def read(self, addr: int, length: int) -> bytes:
        return bytes(self.view(addr, length))

    def write(self, addr: int, data: bytes | memoryview) -> None:
        off = self._offset(addr, len(data))
        self.buffer[off:off + len(data)] = data

    def write_u8(self, addr: int, value: int) -> None:
        self.buffer[self._offset(addr, 1)] = value


class PageAllocator:
    """First-fit allocator of whole pages in the arena (driver side). Frees coalesce with their neighbours."""

    def __init__(self, size: int, page: int = PAGE) -> None:
        self.page = page
        self.starts, self.lengths = [0], [size]  # free extents sorted by start
        self.used: dict[int, int] = {}

    def alloc(self, size: int, align: int = PAGE) -> int:
        """The offset of `size` bytes (whole pages) starting at a multiple of `align` (a power of two)."""
        length = -(-max(size, 1) // self.page) * self.page
        for i, free in enumerate(self.lengths):
            extent = self.starts[i]
            start = -(-extent // align) * align
            if start + length > extent + free:
                continue
            after = extent + free - start - length
            del self.starts[i], self.lengths[i]
            for piece, piece_length in ((start + length, after), (extent, start - extent)):  # what stays free
                if piece_length:
                    self.starts.insert(i, piece)
                    self.lengths.insert(i, piece_length)
            self.used[start] = length
            return start
        raise MemoryError(f"DMA arena exhausted: no {length:#x} bytes free")

    def free(self, start: int) -> None:
        length = self.used.pop(start)
        i = bisect.bisect(self.starts, start)
        self.starts.insert(i, start)
        self.lengths.insert(i, length)
        if i + 1 < len(self.starts) and start + length == self.starts[i + 1]:  # merge with the next extent
            self.lengths[i] += self.lengths.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:  # merge with the previous one
            self.lengths[i - 1] += self.lengths.pop(i)
            self.starts.pop(i)

    @property
    def bytes_used(self) -> int:
        return sum(self.used.values())
