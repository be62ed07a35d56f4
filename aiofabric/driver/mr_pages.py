"""The pages a memory region is registered in: the largest size from 4 KiB to 1 GiB its bus addresses allow, as Linux's
bnxt_re_reg_user_mr picks it (ib_umem_find_best_pgsz over BNXT_RE_PAGE_SIZE_SUPPORTED), and where each such page
starts on the bus, what its PBL lists (bnxt_qplib_reg_mr). A large region's PBL is small: a 1 GiB region contiguous on
the bus is one page, at level 0.

A region's VA is the bus address of its first byte (verbs/mr.py), so a page of size P holds the region's bytes that
share their address's bits above log2(P). The first page may start before the region and the last end after it: the
NIC reaches only [va, va + size).
"""
from __future__ import annotations

from ..hw.firmware import PTE_SIZE
from ..pci import PAGE_SIZE, DmaBuffer

PAGE_SIZES = 0x7FFFF000  # a bit per page size the NIC takes, 4 KiB..1 GiB (Linux BNXT_RE_PAGE_SIZE_SUPPORTED)
MAX_MR_SIZE = 1 << 39  # Linux BNXT_RE_MAX_MR_SIZE
MAX_PAGES = (PAGE_SIZE // PTE_SIZE) ** 2  # what a 2-level table of 4 KiB tables lists


def page_size(buffer: DmaBuffer) -> int:
    """The largest page size the NIC takes for which `buffer`, registered at its own bus address, is whole pages
    consecutive on the bus: wherever its bus addresses jump, both sides of the jump are multiples of it."""
    va = buffer.bus_addr
    # no larger than the smallest page that holds the whole region (larger ones buy nothing)
    mask = PAGE_SIZES & -(1 << ((va + buffer.size - 1) ^ va).bit_length())
    if not buffer.contiguous:
        addrs = buffer.bus_addrs
        for i in range(1, len(addrs)):
            if addrs[i] != addrs[i - 1] + PAGE_SIZE:
                mask |= (va + i * PAGE_SIZE) | addrs[i]
    allowed = PAGE_SIZES & ((mask & -mask) * 2 - 1) if mask else PAGE_SIZES
    return 1 << (allowed.bit_length() - 1)


def pages(buffer: DmaBuffer, size: int) -> list[int]:
    """The bus address of each `size`-byte page (`page_size`'s, or a smaller power of two) `buffer` lies in.
    ValueError when a 2-level PBL cannot list them (memory scattered in small pages, past 1 GiB at 4 KiB)."""
    if buffer.size > MAX_MR_SIZE:
        raise ValueError(f"a memory region of {buffer.size:#x} bytes: Linux's bnxt_re registers at most "
                         f"{MAX_MR_SIZE:#x} (BNXT_RE_MAX_MR_SIZE)")
    va = buffer.bus_addr
    first = va & -size  # where the first page starts: on the bus as in VAs (they agree below `size`)
    count = -(-(va + buffer.size - first) // size)
    if count > MAX_PAGES:
        raise ValueError(f"a memory region of {buffer.size:#x} bytes contiguous on the bus only in {size:#x}-byte "
                         f"pages needs {count} page-table entries, more than a 2-level table holds ({MAX_PAGES}): "
                         f"give it memory contiguous on the bus (an IOMMU, or hugepages)")
    if buffer.contiguous:
        return [first + i * size for i in range(count)]
    step, head = size // PAGE_SIZE, (va - first) // PAGE_SIZE
    return [first] + [buffer.bus_addrs[i * step - head] for i in range(1, count)]
