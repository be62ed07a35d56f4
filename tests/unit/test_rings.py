"""Ring arithmetic and page tables (pure logic; the seam is a bytearray-backed fake). The doorbell and entry formats
are hw/'s, checked against the bindings in tests/unit/test_hw.py."""
from hypothesis import given
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.driver.rings import Ring, page_table
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


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * PAGE_SIZE)), max_size=60))
def test_page_allocator_never_overlaps_and_coalesces(ops):
    pages = PageAllocator(256 * PAGE_SIZE)
    live = {}
    for is_free, size in ops:
        if is_free and live:
            start = next(iter(live))
            pages.free(start)
            del live[start]
        else:
            try:
                start = pages.alloc(size)
            except MemoryError:
                continue
            live[start] = -(-size // PAGE_SIZE) * PAGE_SIZE
        spans = sorted(live.items())
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    for start in list(live):
        pages.free(start)
    assert pages.starts == [0] and pages.lengths == [256 * PAGE_SIZE]
