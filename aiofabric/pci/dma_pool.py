"""DMA memory in slabs, for a seam where making memory reachable by the device costs a system call and an IOMMU
update: each slab is mapped for the device once (`DmaWindows`) and carved into buffers of whole 4 KiB pages, so a
firmware command's answer buffer costs no mapping of its own. A slab is unmapped and given back once it is empty.

Slabs are 2 MiB hugepages while the system has some reserved (one IOTLB entry each, and physically contiguous),
else ordinary 4 KiB pages. A request larger than a slab gets a slab of its own, sized to it. The memory is shared
anonymous memory: a fork (a subprocess started meanwhile) cannot leave this process writing a copy-on-write copy
of a page while the device reads the original.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from typing import Protocol

from .linux import HUGE_PAGE_SIZE, MAP_HUGETLB, MAP_LOCKED, MAP_POPULATE, PAGE_SIZE, phys_addr, virt_addr
from .seam import DmaBuffer
from ..errors import PCIError

log = logging.getLogger(__name__)
SLAB_SIZE = HUGE_PAGE_SIZE
RESERVE_HUGEPAGES = "echo 64 > /proc/sys/vm/nr_hugepages"


class DmaWindows(Protocol):
    """How a slab becomes reachable by the device, and stops being so."""

    pins: bool  # whether mapping pins the pages itself; if not, the pool locks them

    def map(self, address: int, size: int) -> list[int]:
        """Make [address, address + size) reachable; the bus address of each of its 4 KiB pages."""

    def unmap(self, bus_address: int, size: int) -> None:
        """The device must no longer reach the slab mapped at `bus_address` (its first page's)."""


class PhysicalWindows:
    """No IOMMU: the device reaches physical addresses, read from /proc/self/pagemap (root only). Nothing pins the
    pages, so the pool locks them; only hugepages are also safe from compaction moving them."""

    pins = False

    def __init__(self, pagemap: str = "/proc/self/pagemap") -> None:
        self.pagemap = pagemap

    def map(self, address: int, size: int) -> list[int]:
        try:
            fd = os.open(self.pagemap, os.O_RDONLY)
        except PermissionError as e:
            raise PCIError(f"cannot open {self.pagemap}: run as root (physical addresses need CAP_SYS_ADMIN)") from e
        try:
            return [phys_addr(fd, address + offset) for offset in range(0, size, PAGE_SIZE)]
        finally:
            os.close(fd)

    def unmap(self, bus_address: int, size: int) -> None:
        pass  # nothing to undo: physical addresses are always reachable, which is why this path isolates nothing


class Slab:
    """One mapped slab: its memory, each page's bus address, and which pages buffers hold."""

    def __init__(self, memory: mmap.mmap, address: int, bus_addrs: list[int]) -> None:
        self.memory, self.address, self.bus_addrs = memory, address, bus_addrs
        self.used = bytearray(len(bus_addrs))  # 1 per page a buffer holds
        self.pages_in_use = 0

    def take(self, pages: int, align: int = 1) -> int | None:
        """The first page of a free run of `pages` starting at a multiple of `align` pages (first fit), marked used;
        None if there is no such run."""
        run = bytes(pages)
        start = self.used.find(run)
        while start > 0 and start % align:
            start = self.used.find(run, start + align - start % align)
        if start < 0:
            return None
        self.used[start:start + pages] = b"\1" * pages
        self.pages_in_use += pages
        return start

    def give(self, start: int, pages: int) -> None:
        self.used[start:start + pages] = bytes(pages)
        self.pages_in_use -= pages


class DmaPool:
    """Zeroed DMA buffers carved from mapped slabs (see the module docstring); `owner` names the device in errors."""

    def __init__(self, windows: DmaWindows, owner: str) -> None:
        self.windows, self.owner = windows, owner
        self.slabs: list[Slab] = []  # the shared slabs, for requests up to SLAB_SIZE
        self._buffers: set[DmaBuffer] = set()
        self._stuck: list[mmap.mmap] = []  # slabs the device may still reach (an unmap failed): never given back
        self._hugepages = True  # until the system has none to give

    def alloc(self, size: int, contiguous: bool) -> DmaBuffer:
        """`size` rounded up to whole pages, zeroed. `contiguous`: its pages consecutive on the bus, the first aligned
        to the size rounded up to a power of two (slabs are aligned to theirs); PCIError where they are not (only
        without an IOMMU, past one hugepage)."""
        if size <= 0:
            raise ValueError(f"DMA size must be positive, not {size}")
        pages = -(-size // PAGE_SIZE)
        align = 1 << (pages - 1).bit_length() if contiguous else 1
        slab, start = self._place(pages, align)
        bus_addrs = slab.bus_addrs[start:start + pages]
        is_contiguous = all(b - a == PAGE_SIZE for a, b in zip(bus_addrs, bus_addrs[1:]))
        if contiguous and (not is_contiguous or bus_addrs[0] % (align * PAGE_SIZE)):
            self._give(slab, start, pages)
            raise PCIError(f"{self.owner}: no physically contiguous {pages * PAGE_SIZE:#x} bytes (aligned to their "
                           f"size) for a DMA buffer (one 2 MiB hugepage at most, without an IOMMU): reserve some with "
                           f"`{RESERVE_HUGEPAGES}`")
        offset, length = start * PAGE_SIZE, pages * PAGE_SIZE
        buffer = DmaBuffer(view=memoryview(slab.memory)[offset:offset + length], bus_addrs=bus_addrs,
                           contiguous=is_contiguous)

        def release() -> None:
            self._buffers.discard(buffer)
            self._give(slab, start, pages)

        buffer._release = release
        self._buffers.add(buffer)
        return buffer

    def close(self) -> None:
        """Free every buffer still held: every slab is unmapped and given back."""
        for buffer in list(self._buffers):
            buffer.free()

    def _place(self, pages: int, align: int) -> tuple[Slab, int]:
        if pages * PAGE_SIZE > SLAB_SIZE:
            slab = self._new_slab(pages * PAGE_SIZE)
        else:
            for slab in self.slabs:
                start = slab.take(pages, align)
                if start is not None:  # pages a buffer had: they hold its bytes (a new slab's are the kernel's zeros)
                    ctypes.memset(slab.address + start * PAGE_SIZE, 0, pages * PAGE_SIZE)
                    return slab, start
            slab = self._new_slab(SLAB_SIZE)
            self.slabs.append(slab)
        start = slab.take(pages)
        assert start == 0  # a new slab has room for what it was made for
        return slab, start

    def _new_slab(self, size: int) -> Slab:
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | MAP_POPULATE | (0 if self.windows.pins else MAP_LOCKED)
        memory = None
        if self._hugepages:
            try:
                memory = mmap.mmap(-1, -(-size // HUGE_PAGE_SIZE) * HUGE_PAGE_SIZE, flags=flags | MAP_HUGETLB)
            except OSError as e:
                self._hugepages = False
                self._say_no_hugepages(e)
        if memory is None:
            try:
                memory = mmap.mmap(-1, size, flags=flags)
            except OSError as e:
                locked = e.errno in (errno.EAGAIN, errno.EPERM, errno.ENOMEM) and not self.windows.pins
                hint = ": raise the locked-memory limit (ulimit -l) or run as root" if locked else ""
                raise PCIError(f"{self.owner}: cannot allocate {size:#x} bytes of DMA memory ({e.strerror}){hint}") \
                    from e
        address = virt_addr(memory)
        try:
            return Slab(memory, address, self.windows.map(address, len(memory)))
        except BaseException:
            memory.close()
            raise

    def _say_no_hugepages(self, error: OSError) -> None:
        if self.windows.pins:
            log.info("%s: no 2 MiB hugepages (%s): DMA slabs use 4 KiB pages (more IOTLB misses); reserve some with "
                     "`%s`", self.owner, error.strerror, RESERVE_HUGEPAGES)
        else:
            log.warning("%s: no 2 MiB hugepages (%s): DMA uses locked 4 KiB pages, which memory compaction may move "
                        "under the device: reserve hugepages (`%s`) or `echo 0 > /proc/sys/vm/compact_unevictable_"
                        "allowed`", self.owner, error.strerror, RESERVE_HUGEPAGES)

    def _give(self, slab: Slab, start: int, pages: int) -> None:
        slab.give(start, pages)
        if slab.pages_in_use:
            return
        if slab in self.slabs:
            self.slabs.remove(slab)
        try:
            self.windows.unmap(slab.bus_addrs[0], len(slab.memory))
        except PCIError as e:
            log.warning("%s: %s; its memory is kept, as the device may still reach it", self.owner, e)
            self._stuck.append(slab.memory)
            return
        try:
            slab.memory.close()
        except BufferError:  # a caller still holds an export of a buffer's view: the pages go when it does
            pass
