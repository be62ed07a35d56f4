"""Host memory the driver gave back, as the emulated device sees it: the arena ranges it freed (its DMA_UNMAP
records, see kick.py) and has not allocated again, and the device writes that landed there afterwards.

The driver punches freed pages out of the shared memfd (MADV_REMOVE), so they are not resident until someone writes
them. A page of a freed range that is resident again and not all zero was written by the device after the free: a
NIC writing into memory it was told is gone (on silicon, memory the process no longer owns). Only punched ranges
are watched: without MADV_REMOVE a freed page keeps its old bytes and tells nothing. Counting happens when asked
(the debug "stats"), so the device's own writes pay nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


class FreedMemory:
    def __init__(self, arena: mmap.mmap) -> None:
        self._view = memoryview(arena)
        anchor = ctypes.c_char.from_buffer(arena)  # the mapping's address (the anchor is dropped at once)
        self._address = ctypes.addressof(anchor)
        del anchor
        self._ranges: list[tuple[int, int]] = []  # [start, end) arena offsets, sorted, disjoint

    def unmapped(self, offset: int, length: int) -> None:
        """The driver freed [offset, offset + length) and punched it out."""
        self.mapped(offset, length)
        self._ranges.append((offset, offset + length))
        self._ranges.sort()

    def mapped(self, offset: int, length: int) -> None:
        """The driver allocated [offset, offset + length): its content is the driver's again."""
        end, kept = offset + length, []
        for start, stop in self._ranges:
            if stop <= offset or end <= start:
                kept.append((start, stop))
                continue
            if start < offset:
                kept.append((start, offset))
            if end < stop:
                kept.append((end, stop))
        self._ranges = kept

    def written_pages(self) -> int:
        """Pages of freed ranges the device wrote after their free (resident again, not all zero)."""
        written, zero = 0, bytes(PAGE)
        for start, stop in self._ranges:
            pages = (stop - start) // PAGE
            residency = (ctypes.c_ubyte * pages)()
            if _libc.mincore(self._address + start, stop - start, residency) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed on the DMA arena")
            for index in range(pages):
                if residency[index] & 1:
                    page = start + index * PAGE
                    written += self._view[page:page + PAGE] != zero
        return written
