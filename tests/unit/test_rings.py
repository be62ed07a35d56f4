"""Ring arithmetic, page tables and the backing store's sizes (pure logic; the seam is a bytearray-backed fake). The
doorbell and entry formats are hw/'s, checked against the bindings in tests/unit/test_hw.py."""
import dataclasses
import mmap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.driver import mr_pages
from aiofabric.driver.context_sizes import TypeCaps, TypePlan, plan
from aiofabric.driver.rings import Ring, page_table
from aiofabric.hw.firmware import BackingStoreType as BS
from aiofabric.hw.firmware import PTE_FLAGS, PTE_SIZE, unpack_ptes
from aiofabric.pci import PAGE_SIZE, DmaBuffer, PCIDevice
from aiofabric.sim.memory import PageAllocator


class FakeSeam(PCIDevice):
    """Host memory as a bytearray with bus address = offset + base: the hardware seam, nothing of ours."""
    address, base = "fake", 0x4000_0000

    def __init__(self):
        self.memory = bytearray(64 << 20)
        self.pages = PageAllocator(len(self.memory))

    def _alloc_dma(self, size, contiguous=False):
        start = self.pages.alloc(size)
        length = -(-size // PAGE_SIZE) * PAGE_SIZE
        view = memoryview(self.memory)[start:start + length]
        return DmaBuffer(view, [self.base + start + i for i in range(0, length, PAGE_SIZE)], True,
                         lambda: self.pages.free(start))

    def read_entry(self, addr):
        """The page-table entry at bus address `addr`."""
        offset = addr - self.base
        return unpack_ptes(self.memory[offset:offset + PTE_SIZE], 1)[0]

    map_bar = read_config = write_config = interrupt_fd = close = None
    num_vectors = 0


def test_page_table_levels_and_queue_flags():
    seam = FakeSeam()
    one = page_table(seam, [0x1000], queue=True)
    assert (one.level, one.base) == (0, 0x1000)
    pages = [0x10_0000 + i * PAGE_SIZE for i in range(5)]
    level1 = page_table(seam, pages, queue=True)
    ptes = [seam.read_entry(level1.base + PTE_SIZE * i) for i in range(5)]
    assert level1.level == 1
    assert [p & ~PTE_FLAGS for p in ptes] == pages
    assert ptes[0] & PTE_FLAGS == bnxt.PTU_PTE_VALID
    assert ptes[3] & PTE_FLAGS == bnxt.PTU_PTE_VALID | bnxt.PTU_PTE_NEXT_TO_LAST
    assert ptes[4] & PTE_FLAGS == bnxt.PTU_PTE_VALID | bnxt.PTU_PTE_LAST
    many = [0x100_0000 + i * PAGE_SIZE for i in range(1000)]
    level2 = page_table(seam, many, queue=False)
    assert level2.level == 2
    second_leaf = seam.read_entry(level2.base + PTE_SIZE) & ~PTE_FLAGS
    per_leaf = PAGE_SIZE // PTE_SIZE
    assert seam.read_entry(second_leaf + PTE_SIZE * 10) == many[per_leaf + 10] | bnxt.PTU_PTE_VALID


def test_context_memory_page_tables_are_never_below_the_level_linux_asks_for():
    """bnxt_alloc_ctx_pg_tbls: context memory is always indirect; depth 2 asked gives a directory even for one page."""
    seam = FakeSeam()
    one = page_table(seam, [0x1000], queue=False, min_level=1)
    assert one.level == 1 and seam.read_entry(one.base) == 0x1000 | bnxt.PTU_PTE_VALID
    deep = page_table(seam, [0x1000, 0x3000], queue=False, min_level=2)
    leaf = seam.read_entry(deep.base)
    assert deep.level == 2 and leaf & PTE_FLAGS == bnxt.PTU_PTE_VALID
    assert [seam.read_entry((leaf & ~PTE_FLAGS) + PTE_SIZE * i) for i in range(2)] == [0x1001, 0x3001]


# Thor2-like capabilities (the emulator's, written out here): entry size, multiple, min, max, splits
THOR2 = {BS.QP: TypeCaps(704, 64, 0, 65794, (256, 2, 0)), BS.SRQ: TypeCaps(192, 64, 0, 8320, (128,)),
         BS.CQ: TypeCaps(128, 64, 0, 131328, (256,)), BS.VNIC: TypeCaps(256, 1, 0, 1024, (128,)),
         BS.STAT: TypeCaps(256, 1, 0, 1024), BS.SP_TQM_RING: TypeCaps(64, 64, 64, 262144),
         BS.FP_TQM_RING: TypeCaps(32, 64, 64, 262144), BS.MRAV: TypeCaps(128, 64, 0, 524288),
         BS.TIM: TypeCaps(16, 1, 0, 65794)}


def test_backing_store_sizes_follow_bnxt_alloc_ctx_mem():
    """64 Ki RoCE QPs beyond the L2 share and QP1s (rounded to 64, then held to the maximum); 8 Ki extra SRQs; two CQs
    per RoCE QP; VNICs and statistics contexts at their maximum; MRAV half the maximum for MRs (at most 256 Ki) and
    128 Ki address handles, split 0 saying so; TIM as many as QPs; the slow-path TQM ring VNICs + L2 QPs + 2 x (extra
    + QP1) + its minimum, each fast-path ring the same without VNICs and minimum, both rounded up to 64. Depth 2 where
    Linux asks for it, else depth 1 up to 512 pages."""
    assert plan(THOR2, sw_max_limits=False) == {
        BS.QP: TypePlan(65794, 2, (256, 2, 0)), BS.SRQ: TypePlan(8320, 2, (128,)),
        BS.CQ: TypePlan(256 + 2 * 65536, 2, (256,)), BS.VNIC: TypePlan(1024, 1, (128,)),
        BS.STAT: TypePlan(1024, 1, ()), BS.MRAV: TypePlan(256 * 1024 + 128 * 1024, 2, (128 * 1024,)),
        BS.TIM: TypePlan(65794, 1, ()),
        BS.SP_TQM_RING: TypePlan(131584, 2, ()),  # 128 + 256 + 2 * (65536 + 2) + 64 = 131524, rounded up
        BS.FP_TQM_RING: TypePlan(131392, 2, ())}  # 256 + 2 * (65536 + 2) = 131332, rounded up


def test_backing_store_sizes_with_sw_max_resource_limits_take_every_qp_and_the_firmwares_mrav_split():
    caps = THOR2 | {BS.QP: TypeCaps(704, 64, 0, 200_000, (256, 2, 8)), BS.TIM: TypeCaps(16, 1, 0, 200_000),
                    BS.MRAV: TypeCaps(128, 64, 0, 524288, (1000,)), BS.CQ: TypeCaps(128, 64, 0, 1 << 20, (256,))}
    limited = plan(caps, sw_max_limits=True)  # every QP the firmware allows; split 2 (fast destroy) is not added
    assert (limited[BS.QP].entries, limited[BS.CQ].entries) == (200_000, -(-(256 + 2 * (200_000 - 258)) // 64) * 64)
    assert limited[BS.MRAV] == TypePlan(524288, 2, (1000,))  # MRs are the rest of the maximum
    unlimited = plan(caps, sw_max_limits=False)  # at most 64 Ki extra, plus the fast-destroy entries (split 2)
    assert unlimited[BS.QP].entries == -(-(258 + 65536 + 8) // 64) * 64
    assert unlimited[BS.MRAV] == TypePlan(256 * 1024 + 128 * 1024, 2, (1000,))  # the firmware's smaller split stays


def test_a_small_type_still_gets_the_page_table_depth_linux_asks_for():
    caps = THOR2 | {BS.QP: TypeCaps(704, 1, 0, 260, (256, 2, 0)), BS.TIM: TypeCaps(16, 1, 0, 65794 * 8)}
    sizes = plan(caps, sw_max_limits=False)
    assert (sizes[BS.QP].entries, sizes[BS.QP].level) == (260, 2)  # 45 pages, depth 2 asked
    assert sizes[BS.TIM].level == 1 and sizes[BS.VNIC].level == 1  # depth 1 asked, within 512 pages
    assert plan(THOR2 | {BS.TIM: TypeCaps(4096, 1, 0, 65794)}, False)[BS.TIM].level == 2  # past 512 pages


@pytest.mark.parametrize("kind, caps, reason", [
    (BS.STAT, TypeCaps(256, 1, 0, 0), "has max_num_entries 0"),
    (BS.VNIC, TypeCaps(0, 1, 0, 1024, (128,)), "has entry_size 0"),
    (BS.MRAV, None, "is not offered"),
    (BS.CQ, TypeCaps(128, 64, 0, 131328), "comes to 0 entries"),  # no L2 split and no RoCE QPs: 0 + 2 x 0
])
def test_a_type_bnxt_en_cannot_size_fails_naming_it(kind, caps, reason):
    offered = {k: v for k, v in (THOR2 | {kind: caps}).items() if v is not None}
    if kind == BS.CQ:
        offered[BS.QP] = dataclasses.replace(THOR2[BS.QP], max_entries=258)
    with pytest.raises(ValueError, match=rf"^backing-store type {kind.name} \({kind:#x}\) {reason}.*-EINVAL\)$"):
        plan(offered, sw_max_limits=False)


@given(depth_log=st.integers(0, 12), laps=st.integers(0, 40), step=st.integers(1, 17))
def test_ring_slot_and_epoch_over_many_laps(depth_log, laps, step):
    depth = 1 << depth_log
    ring = Ring.__new__(Ring)
    ring.depth, ring.stride = depth, 16
    count = 0
    expected_slot = expected_epoch = 0
    while count < laps * depth:
        assert ring.offset(count) == expected_slot * 16
        assert ring.epoch(count) == expected_epoch
        count += step
        expected_slot += step
        while expected_slot >= depth:  # every wrap flips the epoch
            expected_slot -= depth
            expected_epoch ^= 1


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * PAGE_SIZE), st.sampled_from([1, 2, 8, 64])),
                max_size=60))
def test_page_allocator_never_overlaps_and_coalesces(ops):
    pages = PageAllocator(256 * PAGE_SIZE)
    live = {}
    for is_free, size, align in ops:
        if is_free and live:
            start = next(iter(live))
            pages.free(start)
            del live[start]
        else:
            try:
                start = pages.alloc(size, align * PAGE_SIZE)
            except MemoryError:
                continue
            assert start % (align * PAGE_SIZE) == 0
            live[start] = -(-size // PAGE_SIZE) * PAGE_SIZE
        spans = sorted(live.items())
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    for start in list(live):
        pages.free(start)
    assert pages.starts == [0] and pages.lengths == [256 * PAGE_SIZE]


# -- a memory region's pages (driver/mr_pages.py) ---------------------------------------------------------------------
GIB, MIB2 = 1 << 30, 2 << 20


def region(bus_addrs: list[int], contiguous: bool = False) -> DmaBuffer:
    """A DMA buffer with these 4 KiB pages on the bus (its view untouched anonymous memory: never read here)."""
    return DmaBuffer(memoryview(mmap.mmap(-1, len(bus_addrs) * PAGE_SIZE)), bus_addrs, contiguous)


def run(start: int, size: int) -> list[int]:
    return list(range(start, start + size, PAGE_SIZE))


@pytest.mark.parametrize("start, size, page, count", [
    (0x40_0000_0000, GIB, GIB, 1),  # exactly 1 GiB, aligned: one page, level 0
    (0x40_0000_0000, GIB + PAGE_SIZE, GIB, 2),  # 4 KiB past: the largest page still, two of them
    (0x40_4000_0000, GIB + PAGE_SIZE, GIB, 2),  # ... wherever the 1 GiB boundary falls
    (0x40_0000_4000, 3 * PAGE_SIZE, 4 * PAGE_SIZE, 1),  # no larger than the one page that holds it
    (0x40_0000_3000, 2 * PAGE_SIZE, 8 * PAGE_SIZE, 1),  # which may start before the region
    (0x40_0000_0000, PAGE_SIZE, PAGE_SIZE, 1),
])
def test_memory_contiguous_on_the_bus_is_registered_in_the_fewest_largest_pages(start, size, page, count):
    """ib_umem_find_best_pgsz over 4 KiB..1 GiB (BNXT_RE_PAGE_SIZE_SUPPORTED), as bnxt_re_reg_user_mr calls it."""
    buffer = region(run(start, size), contiguous=True)
    assert mr_pages.page_size(buffer) == page
    assert mr_pages.pages(buffer, page) == [(start & -page) + i * page for i in range(count)]


def test_hugepages_give_2_mib_pages_where_every_jump_is_2_mib_aligned_on_both_sides():
    first, second = 0x7_0000_0000, 0x3_0020_0000  # two hugepages, far apart
    misaligned_start = region(run(first + PAGE_SIZE, MIB2 - PAGE_SIZE) + run(second, MIB2))
    assert mr_pages.page_size(misaligned_start) == MIB2  # the first page starts before the region
    assert mr_pages.pages(misaligned_start, MIB2) == [first, second]
    misaligned_jump = region(run(first, MIB2) + run(second + PAGE_SIZE, MIB2))
    assert mr_pages.page_size(misaligned_jump) == PAGE_SIZE
    half = region(run(first, MIB2) + run(second + MIB2 // 2, MIB2 // 2))
    assert mr_pages.page_size(half) == MIB2 // 2
    assert mr_pages.pages(half, MIB2 // 2) == [first, first + MIB2 // 2, second + MIB2 // 2]


def test_scattered_4_kib_pages_list_up_to_what_two_levels_hold_and_say_so_past_it():
    scattered = [0x10_0000_0000 + 2 * i * PAGE_SIZE for i in range(mr_pages.MAX_PAGES + 1)]
    exactly = region(scattered[:-1])  # 1 GiB
    assert mr_pages.page_size(exactly) == PAGE_SIZE and mr_pages.pages(exactly, PAGE_SIZE) == scattered[:-1]
    with pytest.raises(ValueError, match=r"contiguous on the bus only in 0x1000-byte pages needs 262145 page-table "
                                         r"entries, more than a 2-level table holds \(262144\)"):
        mr_pages.pages(region(scattered), PAGE_SIZE)
