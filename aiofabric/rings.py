"""Host-memory rings and their page tables, and the 64-bit doorbell format (reference §3, §5).

A ring counts its producer and consumer as free-running integers; the slot is `count % depth` and the epoch (phase)
is the lap parity `count // depth & 1`. Hardware writes the valid/toggle bit as 1 on lap 0, 0 on lap 1, and so on,
so an entry at consumer count `c` is new when its bit equals `1 - epoch(c)`.
"""
from __future__ import annotations

import dataclasses
import struct

from .autogen import bnxt
from .pci import PAGE_SIZE, DmaBuffer, PCIDevice

PTES_PER_PAGE = PAGE_SIZE // 8


def doorbell(xid: int, kind: int, index: int, epoch: int = 0, toggle: int = 0) -> int:
    """The 64-bit doorbell value: `kind` is a DBC_DBC_TYPE_* constant (already shifted into the upper dword)."""
    high = (xid & bnxt.DBC_DBC_XID_MASK) | bnxt.DBC_DBC_PATH_ROCE | kind | bnxt.BNXT_QPLIB_DBR_VALID
    low = (index & bnxt.DBC_DBC_INDEX_MASK) | (epoch & 1) << bnxt.BNXT_QPLIB_DBR_EPOCH_SHIFT \
        | (toggle & 3) << bnxt.BNXT_QPLIB_DBR_TOGGLE_SHIFT
    return high << 32 | low


@dataclasses.dataclass
class PageTable:
    """What a firmware command needs to find memory: PBL level (0, 1, 2) and the base address at that level."""
    level: int
    base: int
    tables: list[DmaBuffer]

    def free(self) -> None:
        for table in self.tables:
            table.free()
        self.tables.clear()


def page_table(pci: PCIDevice, pages: list[int], *, queue: bool) -> PageTable:
    """Build the PBL for `pages` (bus addresses of 4 KiB pages). Queues mark the last PTEs (LAST, NEXT_TO_LAST)."""
    if len(pages) == 1:
        return PageTable(0, pages[0], [])
    ptes = [p | bnxt.PTU_PTE_VALID for p in pages]
    if queue:
        ptes[-1] |= bnxt.PTU_PTE_LAST
        ptes[-2] |= bnxt.PTU_PTE_NEXT_TO_LAST
    leaf_pages = -(-len(ptes) // PTES_PER_PAGE)
    leaves = pci.alloc_dma(leaf_pages * PAGE_SIZE)
    struct.pack_into(f"<{len(ptes)}Q", leaves.view, 0, *ptes)
    if leaf_pages == 1:
        return PageTable(1, leaves.bus_addr, [leaves])
    if leaf_pages > PTES_PER_PAGE:
        raise ValueError(f"{len(pages)} pages need more than a 2-level page table")
    directory = pci.alloc_dma(PAGE_SIZE)
    pdes = [leaves.bus_addrs[i] | bnxt.PTU_PDE_VALID for i in range(leaf_pages)]
    struct.pack_into(f"<{leaf_pages}Q", directory.view, 0, *pdes)
    return PageTable(2, directory.bus_addr, [leaves, directory])


class Ring:
    """`depth` entries of `stride` bytes in DMA memory (plus `extra` bytes after the ring), with its page table."""

    def __init__(self, pci: PCIDevice, depth: int, stride: int, *, extra: int = 0, queue: bool = True) -> None:
        if depth <= 0 or depth & (depth - 1):
            raise ValueError(f"ring depth must be a power of two, not {depth}")
        self.depth, self.stride = depth, stride
        self.memory = pci.alloc_dma(depth * stride + extra)
        self.view = self.memory.view
        self.table = page_table(pci, self.memory.bus_addrs, queue=queue)
        self.producer = self.consumer = 0

    @property
    def level(self) -> int:
        return self.table.level

    @property
    def base(self) -> int:
        return self.table.base

    @property
    def pages(self) -> int:
        return len(self.memory.bus_addrs)

    def offset(self, count: int) -> int:
        return (count & (self.depth - 1)) * self.stride

    def epoch(self, count: int) -> int:
        return (count // self.depth) & 1

    def free_entries(self) -> int:
        return self.depth - (self.producer - self.consumer)

    def free(self) -> None:
        self.table.free()
        self.memory.free()
