"""Host-memory rings and their page tables.

A ring counts its producer and consumer as free-running integers; which slot and lap a count names, and how a
device-written entry says it is new, is the hardware's rule (aiofabric/hw/ring.py).
"""
from __future__ import annotations

import dataclasses

from ..autogen import bnxt
from ..hw import doorbell, ring
from ..hw.firmware import PTE_SIZE, pack_ptes
from ..pci import PAGE_SIZE, DmaBuffer, PCIDevice

PTES_PER_PAGE = PAGE_SIZE // PTE_SIZE


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


def page_table(pci: PCIDevice, pages: list[int], *, queue: bool, min_level: int = 0) -> PageTable:
    """Build the PBL for `pages` (bus addresses of pages of one size: 4 KiB, or a memory region's larger ones), at
    the lowest level that holds them but not below `min_level` (context memory: Linux asks for 1 or 2,
    bnxt_alloc_ctx_pg_tbls). The tables themselves are 4 KiB pages. Queues mark the last PTEs (LAST, NEXT_TO_LAST)."""
    if len(pages) == 1 and not min_level:
        return PageTable(0, pages[0], [])
    ptes = [p | bnxt.PTU_PTE_VALID for p in pages]
    if queue:
        ptes[-1] |= bnxt.PTU_PTE_LAST
        ptes[-2] |= bnxt.PTU_PTE_NEXT_TO_LAST
    leaf_pages = -(-len(ptes) // PTES_PER_PAGE)
    leaves = pci.alloc_dma(leaf_pages * PAGE_SIZE)
    leaves.view[:len(ptes) * PTE_SIZE] = pack_ptes(ptes)
    if leaf_pages == 1 and min_level < 2:
        return PageTable(1, leaves.bus_addr, [leaves])
    if leaf_pages > PTES_PER_PAGE:
        raise ValueError(f"{len(pages)} pages need more than a 2-level page table")
    directory = pci.alloc_dma(PAGE_SIZE)
    pdes = [leaves.bus_addrs[i] | bnxt.PTU_PDE_VALID for i in range(leaf_pages)]
    directory.view[:leaf_pages * PTE_SIZE] = pack_ptes(pdes)
    return PageTable(2, directory.bus_addr, [leaves, directory])


class Ring:
    """`depth` entries of `stride` bytes in DMA memory (plus `extra` bytes after the ring), with its page table.
    `contiguous`: one area consecutive on the bus, named at level 0 whatever its size (the CMDQ, whose cmdq_init
    carries no page size: Linux's is one 128 KiB "page", bnxt_qplib_alloc_rcfw_channel); PCIError where the platform
    has no such memory."""

    def __init__(self, pci: PCIDevice, depth: int, stride: int, *, extra: int = 0, queue: bool = True,
                 contiguous: bool = False) -> None:
        if depth <= 0 or depth & (depth - 1):
            raise ValueError(f"ring depth must be a power of two, not {depth}")
        self.depth, self.stride = depth, stride
        self.memory = pci.alloc_dma(depth * stride + extra, contiguous)
        self.view = self.memory.view
        self.table = PageTable(0, self.memory.bus_addr, []) if contiguous \
            else page_table(pci, self.memory.bus_addrs, queue=queue)
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

    def slot(self, count: int) -> int:
        return ring.slot(count, self.depth)

    def offset(self, count: int) -> int:
        """Byte offset of the slot free-running `count` lands in."""
        return ring.slot(count, self.depth) * self.stride

    def epoch(self, count: int) -> int:
        return ring.epoch(count, self.depth)

    def doorbell(self, xid: int, kind: int, toggle: int = 0) -> int:
        """The doorbell of kind `kind` (DBC_DBC_TYPE_*) that tells the device object `xid` how far this ring is
        consumed (`toggle`: CQ arm doorbells only)."""
        return doorbell.encode(xid, kind, self.slot(self.consumer), self.epoch(self.consumer), toggle)

    def free_entries(self) -> int:
        return self.depth - (self.producer - self.consumer)

    def free(self) -> None:
        self.table.free()
        self.memory.free()
