"""What Linux gives a userspace driver for memory: pages, locked and huge mappings, the virtual address of a mapping
and its physical address through /proc/self/pagemap (root only)."""
from __future__ import annotations

import ctypes
import mmap
import os

from ..errors import PCIError

PAGE_SIZE = 0x1000
HUGE_PAGE_SIZE = 2 << 20
MAP_LOCKED = getattr(mmap, "MAP_LOCKED", 0x2000)
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
PFN_MASK = (1 << 55) - 1



def virt_addr(m: mmap.mmap) -> int:
    """Virtual address of an mmap; the ctypes object holds a buffer export, so drop it at once (else close() fails)."""
    c = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def phys_addr(pagemap_fd: int, virt: int) -> int:
    """Translate one virtual address through /proc/<pid>/pagemap (8 bytes per page: bit 63 present, 0-54 PFN)."""
    raw = os.pread(pagemap_fd, 8, virt // PAGE_SIZE * 8)
    if len(raw) != 8:
        raise PCIError(f"short read from pagemap for virtual address {virt:#x}")
    entry = int.from_bytes(raw, "little")
    if not entry >> 63:
        raise PCIError(f"page at virtual address {virt:#x} is not present in memory")
    pfn = entry & PFN_MASK
    if pfn == 0:  # the kernel hides PFNs from processes without CAP_SYS_ADMIN
        raise PCIError("pagemap gives no physical addresses: run as root")
    return pfn * PAGE_SIZE + virt % PAGE_SIZE


def release_mapping(view: memoryview, m: mmap.mmap) -> None:
    try:
        view.release()
        m.close()
    except BufferError:  # someone still holds a slice or an export of the view: the memory goes when they do
        pass


MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def map_at(address: int, length: int, flags: int, fd: int, offset: int = 0) -> None:
    """mmap(2) with MAP_FIXED: replace whatever is mapped at [address, address + length) by `fd` from `offset`."""
    got = libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags | MAP_FIXED, fd, offset)
    if got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {address:#x}: {os.strerror(err)}")
