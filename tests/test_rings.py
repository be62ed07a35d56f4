"""Ring arithmetic, page tables and doorbell encoding (pure logic; the seam is a bytearray-backed fake)."""
import struct

from hypothesis import given, strategies as st

from aiofabric.autogen import bnxt
from aiofabric.pci import PAGE_SIZE, DmaBuffer, PCIDevice
from aiofabric.rings import Ring, doorbell, page_table
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

    def read_qword(self, addr):
        return struct.unpack_from("<Q", self.memory, addr - self.base)[0]

    map_bar = read_config = write_config = interrupt_fd = close = None
    num_vectors = 0


def test_doorbell_layout_matches_reference():
    value = doorbell(0x12345, bnxt.DBC_DBC_TYPE_CQ_ARMALL, 0x456, epoch=1, toggle=2)
    assert value & 0xFFFFFF == 0x456
    assert value >> 24 & 1 == 1 and value >> 25 & 3 == 2
    assert value >> 32 & 0xFFFFF == 0x12345
    assert value >> 58 & 1 == 1  # valid
    assert value >> 60 == 6  # CQ_ARMALL


def test_page_table_levels_and_queue_flags():
    seam = FakeSeam()
    one = page_table(seam, [0x1000], queue=True)
    assert (one.level, one.base) == (0, 0x1000)
    pages = [0x10_0000 + i * PAGE_SIZE for i in range(5)]
    level1 = page_table(seam, pages, queue=True)
    ptes = [seam.read_qword(level1.base + 8 * i) for i in range(5)]
    assert level1.level == 1
    assert [p & ~0xFFF for p in ptes] == pages
    assert ptes[0] & 7 == bnxt.PTU_PTE_VALID
    assert ptes[3] & 7 == bnxt.PTU_PTE_VALID | bnxt.PTU_PTE_NEXT_TO_LAST
    assert ptes[4] & 7 == bnxt.PTU_PTE_VALID | bnxt.PTU_PTE_LAST
    many = [0x100_0000 + i * PAGE_SIZE for i in range(1000)]
    level2 = page_table(seam, many, queue=False)
    assert level2.level == 2
    second_leaf = seam.read_qword(level2.base + 8) & ~0xFFF
    assert seam.read_qword(second_leaf + 8 * 10) == many[512 + 10] | bnxt.PTU_PTE_VALID


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
