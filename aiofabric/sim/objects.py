"""The emulated firmware's object tables: rings, notification and completion queues, QPs, memory regions, GIDs.

Plain state plus the ring arithmetic every queue shares (hw/ring.py): free-running producer and consumer counts, the
valid bit written per lap, and consumer doorbells that name a count by (index, epoch). Firmware command handlers
create and destroy these objects; the data path reads and advances them per packet, so the hot methods
(`PageList.address`, `CompletionQueue.post`, `MemoryRegion.translate`) use struct and memoryviews, never ctypes
objects.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Container, Literal

from .memory import PAGE, BusMemory, DmaFault
from ..autogen import bnxt
from ..hw.cqe import CQ_ENTRY, NQ_ENTRY, cq_notification
from ..hw.firmware import PTE_FLAGS, PTE_SIZE, unpack_ptes
from ..hw.ring import consumer_from_doorbell
from ..hw.verbs import QPState
from ..hw.wqe import SqGeometry

PTES_PER_PAGE = PAGE // PTE_SIZE
MAX_PBL_PAGES = PTES_PER_PAGE ** 2  # what a level-2 table of 4 KiB pages can describe


class CommandError(Exception):
    """A firmware command fails with `status`: an HWRM_ERR_CODE_* on the HWRM channel, a CREQ status on the RoCE one."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class PageTableError(ValueError):
    """A page table (PBL) the driver handed over cannot be walked: bad level, absurd page count."""


class MemoryProtectionError(Exception):
    """An access outside a memory region's bounds, or without the rights it was registered with."""


def walk_pbl(mem: BusMemory, level: int, base: int, npages: int, page_size: int = PAGE, *,
             through_last: bool = False) -> list[int]:
    """Bus addresses of the `npages` pages a level 0/1/2 page table describes (Linux qplib_res.c).

    Level 0: `base` is the first page and the memory is contiguous. Level 1: `base` holds PTEs. Level 2: `base` holds
    PDEs, each pointing at a 4 KiB page of PTEs. Flag bits (VALID, LAST, NEXT_TO_LAST) are masked off.
    `through_last` also takes the PTEs after the first `npages` while they are VALID and the LAST flag has not been
    seen: queues keep auxiliary tables (the MSN/PSN search area) in pages right after the ring.
    """
    if not 0 <= npages <= MAX_PBL_PAGES:
        raise PageTableError(f"{npages} pages is more than a page table can describe")
    if level == 0:
        return [base + i * page_size for i in range(npages)]
    if level not in (1, 2):
        raise PageTableError(f"page table level {level} (only 0, 1 and 2 exist)")

    def entries(address: int, count: int) -> tuple[int, ...]:
        return unpack_ptes(mem.view(address, count * PTE_SIZE), count)

    def pte_address(i: int) -> int:
        if level == 1:
            return base + PTE_SIZE * i
        return (entries(base + PTE_SIZE * (i // PTES_PER_PAGE), 1)[0] & ~PTE_FLAGS) + PTE_SIZE * (i % PTES_PER_PAGE)

    if level == 1:
        ptes = list(entries(base, npages))
    else:
        ptes = []
        for start in range(0, npages, PTES_PER_PAGE):
            ptes += entries(pte_address(start), min(PTES_PER_PAGE, npages - start))
    while through_last and ptes and not ptes[-1] & bnxt.PTU_PTE_LAST and len(ptes) < MAX_PBL_PAGES:
        try:
            entry = entries(pte_address(len(ptes)), 1)[0]
        except DmaFault:  # past the end of host memory: the table simply ends here
            break
        if not entry & bnxt.PTU_PTE_VALID:
            break
        ptes.append(entry)
    return [pte & ~PTE_FLAGS for pte in ptes]


@dataclass
class PageList:
    """Where a queue or region lives: page addresses, or one contiguous range when the table was level 0."""
    pages: list[int]
    page_size: int = PAGE
    contiguous: bool = False

    def __post_init__(self) -> None:
        self.page_shift = self.page_size.bit_length() - 1
        self.page_mask = self.page_size - 1

    def address(self, offset: int) -> int:
        """Bus address of byte `offset` (IndexError past the last page)."""
        if self.contiguous:
            return self.pages[0] + offset
        return self.pages[offset >> self.page_shift] + (offset & self.page_mask)


def map_memory(mem: BusMemory, level: int, base: int, size: int, page_size: int = PAGE, *,
               queue: bool = False, start: int = 0) -> PageList:
    """The pages holding `size` bytes behind a page table, the bytes from `start` on checked to exist in host memory
    (DmaFault if not): a memory region starts `start` bytes into its first page, and its last page may run past host
    memory where the region does not (an IOMMU faults only what is reached).

    Level 0 means one contiguous range at `base`. Queues (`queue=True`) also keep the trailing pages their PBL marks
    VALID up to the LAST entry, where drivers put auxiliary tables such as the MSN/PSN search area.
    """
    if level == 0:
        mem.view(base + start, size - start)
        return PageList([base], page_size, contiguous=True)
    count = max(1, -(-size // page_size))
    pages = walk_pbl(mem, level, base, count, page_size, through_last=queue)
    ends = [page + page_size for page in pages]
    ends[count - 1] = pages[count - 1] + size - (count - 1) * page_size
    low = min(pages[0] + start, min(pages[1:], default=pages[0] + start))
    mem.view(low, max(ends) - low)  # host memory is one range: the lowest and highest byte reached bound the rest
    return PageList(pages, page_size)


@dataclass(eq=False)
class Ring:
    """A ring allocated by HWRM RING_ALLOC (L2 completion, TX, RX, RX aggregation, RoCE completion or NQ)."""
    ring_id: int
    ring_type: int
    mem: BusMemory
    pages: PageList
    length: int  # entries
    logical_id: int  # the MSI-X vector, for rings that interrupt
    entry_size: int = NQ_ENTRY.size
    nq_ring_id: int | None = None


@dataclass(eq=False)
class NotificationQueue(Ring):
    """An NQ-type ring: the CREQ of the RoCE command channel, or a RoCE NQ carrying CQ notifications.

    Entries are `nq_base`/`creq_base` sized (hw.cqe.NQ_ENTRY, CREQ_ENTRY: the same size and valid bit). Posting needs
    consumer credit (from NQ/NQ_ARM doorbells); an armed queue raises its MSI-X vector on the next post and disarms.
    """
    interrupts: list[int] = field(default_factory=list)  # the firmware's outbox of vectors to fire
    produced: int = 0
    consumed: int = 0
    armed: bool = False

    @property
    def pending(self) -> int:
        return self.produced - self.consumed

    def post(self, entry: bytes) -> bool:
        """Write one entry with this lap's valid bit, valid byte last; False (nothing written) when full."""
        if self.produced - self.consumed >= self.length:
            return False
        size = NQ_ENTRY.size
        NQ_ENTRY.publish(self.mem.view(self.pages.address(self.produced % self.length * size), size), entry,
                         self.produced, self.length)
        self.produced += 1
        if self.armed:
            self.armed = False
            self.interrupts.append(self.logical_id)
        return True

    def consumer_doorbell(self, index: int, epoch: int, *, arm: bool | None) -> None:
        """NQ (arm None), NQ_ARM (True) or NQ_MASK (False): return credit; an arm with entries waiting fires at once."""
        self.consumed = consumer_from_doorbell(self.produced, self.consumed, index, epoch, self.length)
        if arm is not None:
            self.armed = arm
        if self.armed and self.pending:  # the driver re-armed after entries landed: no lost wake-up
            self.armed = False
            self.interrupts.append(self.logical_id)

    def reset(self) -> None:
        self.produced = self.consumed = 0


class CqArm(enum.IntEnum):
    NONE = 0
    NEXT = 1  # CQ_ARMALL: notify on the next CQE
    SOLICITED = 2  # CQ_ARMSE: notify on the next solicited CQE


@dataclass(eq=False)
class CompletionQueue:
    """A RoCE CQ: CQEs with a valid (toggle) bit per lap (hw.cqe.CQ_ENTRY), notifications through its NQ when armed.
    An arm counts only after a CQ_ARMENA with the last notification's toggle (0 before any); a notification uses it up.
    Inferred, no source says so: Linux rings CQ_ARMENA after CREATE_CQ and with each notification's toggle
    (bnxt_qplib_create_cq, bnxt_qplib_service_nq)."""
    cq_id: int
    handle: int  # the driver's cq_handle, echoed in NQ notifications
    pages: PageList
    size: int  # entries
    nq: NotificationQueue
    mem: BusMemory
    produced: int = 0
    consumed: int = 0
    armed: CqArm = CqArm.NONE
    enabled: bool = False  # a CQ_ARMENA came since the last notification
    toggle: int = 0  # 2-bit notification count, sent in nq_cn (CQ_ARMENA echoes it)
    notifications: int = 0  # reported by DESTROY_CQ (total_cnq_events) so the driver can drain its NQ

    def post(self, cqe: bytes, solicited: bool = False) -> bool:
        """Write one CQE with this lap's toggle, the type/toggle byte last; False (nothing written) when full."""
        if self.produced - self.consumed >= self.size:
            return False
        size = CQ_ENTRY.size
        CQ_ENTRY.publish(self.mem.view(self.pages.address(self.produced % self.size * size), size), cqe, self.produced,
                         self.size)
        self.produced += 1
        if self.armed and (solicited or self.armed == CqArm.NEXT):
            self.notify()
        return True

    def notify(self) -> bool:
        """Post a CQ_NOTIFICATION to the NQ (disarming the CQ until the next CQ_ARMENA); False if the NQ had no room."""
        self.armed = CqArm.NONE
        toggle = (self.toggle + 1) & 3
        if not self.nq.post(cq_notification(self.handle, toggle)):
            return False  # the NQ overflowed: this notification is lost, as on hardware
        self.toggle, self.notifications, self.enabled = toggle, self.notifications + 1, False
        return True

    def doorbell(self, kind: int, index: int, epoch: int, toggle: int) -> bool:
        """CQ (credit only), CQ_ARMALL, CQ_ARMSE, CQ_ARMENA (no index); False if ignored (see the class)."""
        if kind == bnxt.DBC_DBC_TYPE_CQ_ARMENA:
            self.enabled |= toggle == self.toggle
            return toggle == self.toggle
        self.consumed = consumer_from_doorbell(self.produced, self.consumed, index, epoch, self.size)
        if kind != bnxt.DBC_DBC_TYPE_CQ and not self.enabled:
            return False
        if kind == bnxt.DBC_DBC_TYPE_CQ_ARMALL:
            self.armed = CqArm.NEXT
            if self.produced > self.consumed:  # CQEs landed after the driver's last poll
                self.notify()
        elif kind == bnxt.DBC_DBC_TYPE_CQ_ARMSE:
            self.armed = CqArm.SOLICITED
        return True


@dataclass(eq=False)
class QueuePair:
    """A QP as CREATE_QP/MODIFY_QP left it, plus the queue positions the doorbells and the data path move."""
    qpn: int
    handle: int  # the driver's qp_handle, echoed in every CQE
    qp_type: int  # CMDQ_CREATE_QP_TYPE_*
    flags: int  # CMDQ_CREATE_QP_QP_FLAGS_*
    pd: int
    scq: CompletionQueue
    rcq: CompletionQueue
    sq: PageList
    sq_geometry: SqGeometry  # as created: its size (WQEs, or slots with variable WQEs) and search table
    sq_sge: int
    rq: PageList | None
    rq_size: int  # WQEs
    rq_wqe_size: int  # bytes
    rq_sge: int
    irrq_addr: int
    orrq_addr: int
    state: QPState = QPState.RESET  # read freely; changed only through change_state
    access: int = 0  # QP access bits: LOCAL_WRITE 1, REMOTE_WRITE 2, REMOTE_READ 4, REMOTE_ATOMIC 8
    pkey: int = 0xFFFF
    qkey: int = 0
    network_type: int = 0  # CMDQ_MODIFY_QP_NETWORK_TYPE_*
    dgid: bytes = bytes(16)
    sgid_index: int = 0
    flow_label: int = 0
    hop_limit: int = 0
    traffic_class: int = 0
    dest_mac: bytes = bytes(6)
    src_mac: bytes = bytes(6)
    vlan_id: int = 0  # VLAN_ID field: pcp, dei and id
    path_mtu: int = 256  # bytes; a context nobody set says 256
    timeout: int = 0
    retry_cnt: int = 0
    rnr_retry: int = 0
    min_rnr_timer: int = 0
    sq_psn: int = 0
    rq_psn: int = 0
    max_rd_atomic: int = 0
    max_dest_rd_atomic: int = 0
    dest_qp_id: int = 0
    hw_retx: bool = False  # INITIALIZE_FW asked for hardware retransmission: a go-back reads the SQ's search table
    attributes_set: int = 0  # union of every MODIFY_QP mask applied so far
    sq_producer: int = 0  # last SQ doorbell index (WQEs in static mode, slots in variable mode) and its epoch
    sq_producer_epoch: int = 0
    sq_consumer: int = 0  # advanced by the data path
    rq_producer: int = 0
    rq_producer_epoch: int = 0
    rq_consumer: int = 0
    # Called as observer(qp, old_state, new_state) by change_state (MODIFY_QP, or the data path moving the QP to ERR):
    # the data path uses it to flush on ERR, start on RTS and forget its context on RESET.
    observer: Callable[[QueuePair, QPState, QPState], None] | None = field(default=None, repr=False)

    def change_state(self, new: QPState) -> None:
        """Move the QP to `new` and tell the observer."""
        old, self.state = self.state, new
        if self.observer is not None:
            self.observer(self, old, new)

    @property
    def variable_wqe(self) -> bool:
        return self.sq_geometry.variable

    @property
    def sq_size(self) -> int:
        return self.sq_geometry.size

    @property
    def sq_slots(self) -> int:
        """16-byte slots in the ring."""
        return self.sq_geometry.slots

    @property
    def force_completion(self) -> bool:
        return bool(self.flags & bnxt.CMDQ_CREATE_QP_QP_FLAGS_FORCE_COMPLETION)


@dataclass(eq=False)
class MemoryRegion:
    """An MR or MW key. A key from ALLOCATE_MRW exists unregistered until REGISTER_MR gives it memory.

    `access` uses REGISTER_MR's bit order (hw.verbs.MRAccess), which differs from the QP's (QPAccess): pass MRAccess
    bits to `translate`.
    """
    key: int
    pd: int
    kind: int  # CMDQ_ALLOCATE_MRW_MRW_FLAGS_*: MR, PMR or a memory window type
    access: int = 0
    va: int = 0
    size: int = 0
    pages: PageList | None = None  # None until registered
    allocated_by_register: bool = False  # REGISTER_MR with ALLOC_MR made the key; DEREGISTER_MR frees it again
    # the whole region as one memoryview when its pages are physically contiguous (False when they are not), and the
    # PageList that was computed for: the data path slices it instead of translating page by page
    _whole: memoryview | Literal[False] | None = field(default=None, init=False, repr=False, compare=False)
    _whole_pages: PageList | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def registered(self) -> bool:
        return self.pages is not None

    def view(self, va: int, length: int, need_access: int = 0, pd: int | None = None) -> memoryview | None:
        """[va, va + length) as one slice of the cached view of the whole region, when there is one and the access is
        allowed; None otherwise (then `views` tells what is wrong, or gives the pieces)."""
        whole = self._whole
        if whole and self.pages is self._whole_pages and (pd is None or pd == self.pd) \
                and not need_access & ~self.access:
            offset = va - self.va
            if 0 <= offset and 0 < length and offset + length <= self.size:
                return whole[offset:offset + length]
        return None

    def views(self, mem: BusMemory, va: int, length: int, need_access: int = 0,
              pd: int | None = None) -> list[memoryview]:
        """Like `translate`, as memoryviews of host memory: one slice of a cached view when the region is contiguous."""
        pages, whole = self.pages, self._whole
        if pages is not None and pages is self._whole_pages and whole is not None and whole is not False \
                and (pd is None or pd == self.pd) and not need_access & ~self.access:
            offset = va - self.va
            if 0 <= offset and 0 <= length and offset + length <= self.size:
                return [whole[offset:offset + length]] if length else []
        if pages is not None and pages is not self._whole_pages:
            self._whole_pages = pages
            first = pages.pages[0] + (self.va & pages.page_mask) if pages.pages else 0
            span = (self.va & pages.page_mask) + self.size
            contiguous = pages.contiguous or all(page == pages.pages[0] + i * pages.page_size
                                                 for i, page in enumerate(pages.pages[:-(-span // pages.page_size)]))
            try:
                self._whole = mem.view(first, self.size) if contiguous and self.size else False
            except DmaFault:
                self._whole = False
            return self.views(mem, va, length, need_access, pd)
        return [mem.view(address, size) for address, size in self.translate(va, length, need_access, pd)]

    def translate(self, va: int, length: int, need_access: int = 0, pd: int | None = None) -> list[tuple[int, int]]:
        """Bus (address, length) chunks for [va, va+length), merging physically contiguous pages.

        Raises MemoryProtectionError when the key is not registered, belongs to another PD, lacks `need_access`, or
        the range leaves the region. Local reads need no access bit.
        """
        pages = self.pages
        if pages is None:
            raise MemoryProtectionError(f"key {self.key:#x} has no registered memory")
        if pd is not None and pd != self.pd:
            raise MemoryProtectionError(f"key {self.key:#x} belongs to PD {self.pd}, not {pd}")
        if need_access & ~self.access:
            raise MemoryProtectionError(f"key {self.key:#x} lacks access {need_access & ~self.access:#x} "
                                        f"(registered with {self.access:#x})")
        offset = va - self.va
        if offset < 0 or length < 0 or offset + length > self.size:
            raise MemoryProtectionError(f"[{va:#x}, +{length:#x}) is outside key {self.key:#x} "
                                        f"[{self.va:#x}, +{self.size:#x})")
        position = (self.va & pages.page_mask) + offset  # byte position in the page list
        if pages.contiguous:
            return [(pages.pages[0] + position, length)] if length else []
        chunks: list[tuple[int, int]] = []
        while length:
            within = position & pages.page_mask
            size = min(length, pages.page_size - within)
            address = pages.pages[position >> pages.page_shift] + within
            if chunks and chunks[-1][0] + chunks[-1][1] == address:
                chunks[-1] = (chunks[-1][0], chunks[-1][1] + size)
            else:
                chunks.append((address, size))
            position += size
            length -= size
        return chunks


@dataclass(eq=False)
class Gid:
    """A source GID table entry (ADD_GID), stored in plain byte order."""
    index: int
    gid: bytes
    src_mac: bytes
    vlan: int
    stats_ctx: int


@dataclass(eq=False)
class StatContext:
    ctx_id: int
    dma_addr: int
    length: int
    flags: int


@dataclass(eq=False)
class Vnic:
    vnic_id: int
    mru: int = 0
    rx_ring_id: int | None = None
    cmpl_ring_id: int | None = None


@dataclass(eq=False)
class L2Filter:
    filter_id: int
    mac: bytes
    mask: bytes
    vnic_id: int | None


@dataclass(eq=False)
class BackingStoreArea:
    """One FUNC_BACKING_STORE_CFG_V2: context memory of one type and instance, its PBL level and the split values the
    driver sent with it."""
    kind: int
    instance: int
    entries: int
    entry_size: int
    pages: PageList
    level: int = 0
    splits: tuple[int, ...] = ()


def lowest_free_id(table: Container[int], first: int = 1, limit: int = 1 << 20) -> int | None:
    """Ids are reused lowest-first, as hardware context tables do; None when all of [first, limit) are taken."""
    for candidate in range(first, limit):
        if candidate not in table:
            return candidate
    return None
