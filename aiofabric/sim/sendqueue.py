"""The send queue as the device reads it: WQEs taken off the driver's SQ ring, sans-IO.

The WQE format is hw/wqe.py's. Variable-WQE mode (what the driver uses): the ring is `sq_slots` slots, a WQE is a
header plus `wqe_size - 2` SGE (or inline data) slots, every slot wrapping on its own, and the doorbell names the
producer slot. Static mode: every WQE takes SQ_STATIC_WQE_SLOTS slots and the doorbell names the producer WQE. Each
WQE becomes a `SendWqe` with its local memory already mapped (a memoryview, or a ScatterGather) and its PSN range
assigned; a WQE the device cannot use carries the completion status it will fail with. An atomic WQE's header is read
again as SQ_ATOMIC_HEADER; its SGE is where the original value will land (at least ATOMIC_SIZE bytes). After the ring
comes the search table the driver fills (hw.wqe.SqGeometry): `search_entry` reads a WQE's entry, `parse_at` reads
again the WQE an entry names, as hardware retransmission does.
"""
from __future__ import annotations

from typing import Protocol

from . import packets as pk
from .dma import ACCESS_ERRORS, EMPTY, Buffer, gather, map_sges
from .memory import BusMemory
from .objects import MemoryProtectionError, MemoryRegion, QueuePair
from ..autogen import bnxt
from ..hw.cqe import RequesterErrorReason
from ..hw.ring import producer_from_doorbell
from ..hw.verbs import PSN_MASK, MRAccess, psn_count
from ..hw.wqe import (ATOMIC_SIZE, SGE, SQ_ATOMIC_HEADER, SQ_RDMA_HEADER_AND_SGE, SQ_SLOT, SQ_STATIC_WQE_SLOTS,
                      SQ_WQE_HEADER_SLOTS)

MAX_SGES = 30
SLOT_SHIFT = SQ_SLOT.bit_length() - 1
LOCAL_WRITE = int(MRAccess.LOCAL_WRITE)  # a plain int: IntFlag arithmetic is slow on the per-WQE path
TX_MEMORY_ERROR = RequesterErrorReason.REQ_TX_MEMORY_ERROR
WQE_FORMAT_ERROR = RequesterErrorReason.REQ_WQE_FORMAT_ERROR
HEADER_SLOTS = SQ_WQE_HEADER_SLOTS
UNREADABLE = (0xFF,) * sum(field.count for field in SQ_RDMA_HEADER_AND_SGE.fields)  # wqe_size 0xFF: malformed
S = bnxt
O = pk.Op
# opcodes by position in the message: index (first << 1) | last -> middle, last, first, only
SEND_OPS = (O.SEND_MIDDLE, O.SEND_LAST, O.SEND_FIRST, O.SEND_ONLY)
SEND_IMM_OPS = (O.SEND_MIDDLE, O.SEND_LAST_WITH_IMMEDIATE, O.SEND_FIRST, O.SEND_ONLY_WITH_IMMEDIATE)
WRITE_OPS = (O.RDMA_WRITE_MIDDLE, O.RDMA_WRITE_LAST, O.RDMA_WRITE_FIRST, O.RDMA_WRITE_ONLY)
WRITE_IMM_OPS = (O.RDMA_WRITE_MIDDLE, O.RDMA_WRITE_LAST_WITH_IMMEDIATE, O.RDMA_WRITE_FIRST,
                 O.RDMA_WRITE_ONLY_WITH_IMMEDIATE)

def _opcodes(ops: tuple[pk.Op, pk.Op, pk.Op, pk.Op]) -> pk.Opcodes:
    middle, last, first, only = ops
    return int(middle), int(last), int(first), int(only)


# WQE type -> (opcodes, or None for READ; carries an immediate; has an RETH)
KINDS: dict[int, tuple[pk.Opcodes | None, bool, bool]] = {
    S.SQ_BASE_WQE_TYPE_SEND: (_opcodes(SEND_OPS), False, False),
    S.SQ_BASE_WQE_TYPE_SEND_W_IMMEAD: (_opcodes(SEND_IMM_OPS), True, False),
    S.SQ_BASE_WQE_TYPE_WRITE_WQE: (_opcodes(WRITE_OPS), False, True),
    S.SQ_BASE_WQE_TYPE_WRITE_W_IMMEAD: (_opcodes(WRITE_IMM_OPS), True, True),
    S.SQ_BASE_WQE_TYPE_READ_WQE: (None, False, True)}
ATOMICS = {S.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_CS: pk.COMPARE_SWAP,  # WQE type -> request opcode
           S.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_FA: pk.FETCH_ADD}
SIGNAL, FENCE, SOLICIT, INLINE = (S.SQ_SEND_FLAGS_SIGNAL_COMP, S.SQ_SEND_FLAGS_RD_OR_ATOMIC_FENCE,
                                  S.SQ_SEND_FLAGS_SE, S.SQ_SEND_FLAGS_INLINE)


class PsnAllocator(Protocol):
    next_psn: int  # the PSN the next WQE starts at; fetch advances it


class SendWqe:
    """One fetched SQ WQE and its progress."""

    __slots__ = ("index", "slot", "ops", "read", "signaled", "solicited", "fence", "length", "remote_va", "rkey",
                 "imm", "data", "first_psn", "last_psn", "npkts", "received", "requested", "status", "reason",
                 "atomic", "swap_add", "compare")

    def __init__(self, index: int, ops: pk.Opcodes | None = None, read: bool = False, signaled: bool = False,
                 solicited: bool = False, fence: bool = False, length: int = 0, remote_va: int = 0, rkey: int = 0,
                 imm: int = 0, data: Buffer = EMPTY, first_psn: int = 0, npkts: int = 1,
                 status: int | None = None, reason: int = 0, slot: int = 0, atomic: int = 0, swap_add: int = 0,
                 compare: int = 0) -> None:
        self.index = index  # free-running WQE count: its CQE names index + 1 (mod sq_size); its message number
        self.slot = slot  # the ring slot it starts at (an error CQE names it with variable WQEs)
        # read: a READ or an atomic, completed by its responses (not by ACKs) and holding an ORRQ entry
        self.ops, self.read, self.signaled, self.solicited, self.fence = ops, read, signaled, solicited, fence
        self.length, self.remote_va, self.rkey, self.imm, self.data = length, remote_va, rkey, imm, data
        self.first_psn, self.npkts = first_psn, npkts
        self.last_psn = (first_psn + npkts - 1) & PSN_MASK
        self.received, self.requested = 0, 0  # READ: response packets landed; asked for (at least once)
        self.status, self.reason = status, reason  # a local error found at fetch: reported once all before it are
        self.atomic, self.swap_add, self.compare = atomic, swap_add, compare  # its opcode (0: not one) and AtomicETH


class SendQueue:
    """Reads one QP's SQ ring: where the device's consumer is, and the WQEs between it and the producer."""

    def __init__(self, qp: QueuePair, mem: BusMemory, mrs: dict[int, MemoryRegion]) -> None:
        self.qp, self.mem, self.mrs = qp, mem, mrs
        self.fetched_slots = 0  # free-running SQ slots taken off the ring
        self.fetched = 0  # free-running WQEs taken off the ring
        self._ring_views: tuple[list[memoryview], int, int] | None = None
        self.force_completion = qp.force_completion

    def ring(self) -> tuple[list[memoryview], int, int]:
        """The SQ ring as memoryviews and how to find slot s in them: views[s >> shift], offset (s << SLOT_SHIFT) &
        mask."""
        if self._ring_views is None:
            qp = self.qp
            pages = qp.sq
            if pages.contiguous:
                self._ring_views = ([self.mem.view(pages.pages[0], qp.sq_slots * SQ_SLOT)], 62, (1 << 62) - 1)
            else:
                per_page = pages.page_size // SQ_SLOT
                count = -(-qp.sq_slots // per_page)
                self._ring_views = ([self.mem.view(page, pages.page_size) for page in pages.pages[:count]],
                                    per_page.bit_length() - 1, pages.page_size - 1)
        return self._ring_views

    def slot(self, slot: int) -> bytes:
        views, shift, mask = self.ring()
        offset = (slot << SLOT_SHIFT) & mask
        return bytes(views[slot >> shift][offset:offset + SQ_SLOT])

    def produced(self) -> int | None:
        """The free-running slot count the driver's last doorbell published (None: an impossible producer)."""
        qp = self.qp
        unit = qp.sq_geometry.slot_unit
        produced = producer_from_doorbell(self.fetched_slots // unit, qp.sq_producer, qp.sq_producer_epoch,
                                          qp.sq_slots // unit)
        return None if produced is None else produced * unit

    def fetch(self, psns: PsnAllocator, flush: bool = False, limit: int | None = None) -> list[SendWqe] | None:
        """Every WQE the driver published since the last call (or the first `limit` of them), in order (bare ones
        when `flush`: they only need their index); PSN ranges come from `psns.next_psn`. None when the doorbell named
        an impossible producer."""
        qp, wqes = self.qp, list[SendWqe]()
        unit = qp.sq_geometry.slot_unit
        ring = qp.sq_slots
        produced = self.produced()
        if produced is None:
            return None
        try:
            views, shift, mask = self.ring()
        except ACCESS_ERRORS:
            views, shift, mask = [], 0, 0
        largest = self.largest_wqe()
        unpack, append = SQ_RDMA_HEADER_AND_SGE.unpack_from, wqes.append
        while self.fetched_slots < produced and (limit is None or len(wqes) < limit):
            available = produced - self.fetched_slots
            first = self.fetched_slots % ring
            third = first + HEADER_SLOTS  # the first SGE's slot; ignored unless the header says it is one
            try:
                if third < ring and third >> shift == first >> shift:
                    fields = unpack(views[first >> shift], (first << SLOT_SHIFT) & mask)
                else:
                    fields = unpack(self.slot(first) + self.slot((first + 1) % ring) + self.slot(third % ring))
            except (*ACCESS_ERRORS, IndexError):
                fields = UNREADABLE
            size = fields[2]
            if HEADER_SLOTS <= size <= available and size <= largest:
                stride = size if unit == 1 else SQ_STATIC_WQE_SLOTS
                if flush:
                    w = SendWqe(self.fetched, slot=first)
                else:
                    w = self._parse(psns.next_psn, first, fields, self.fetched)
                    if w.status is None:
                        psns.next_psn = (w.last_psn + 1) & PSN_MASK
            else:  # nothing after a malformed WQE can be parsed: it takes the rest of what was published
                stride = available
                w = SendWqe(self.fetched, status=S.CQ_REQ_STATUS_LOCAL_QP_OPERATION_ERR, reason=WQE_FORMAT_ERROR,
                            slot=first)
            self.fetched_slots += stride
            self.fetched += 1
            append(w)
        return wqes

    def largest_wqe(self) -> int:
        """Slots the largest WQE this SQ can hold takes."""
        qp = self.qp
        return min(SQ_WQE_HEADER_SLOTS + MAX_SGES, qp.sq_slots if qp.variable_wqe else SQ_STATIC_WQE_SLOTS)

    def search_entry(self, w: SendWqe) -> tuple[int, int, int]:
        """(start_psn, next_psn, start_slot) the search table holds for WQE `w` (DmaFault or IndexError if the table
        cannot be read)."""
        geometry = self.qp.sq_geometry
        entry = geometry.table_entry
        address = self.qp.sq.address(geometry.table_offset + geometry.table_index(w.index, w.slot) * entry.size)
        return geometry.entry_fields(entry.unpack(self.mem.read(address, entry.size)))

    def parse_at(self, first: int, first_psn: int, index: int) -> SendWqe:
        """The WQE starting at ring slot `first` read again, numbered `index`, its PSNs from `first_psn` on."""
        ring = self.qp.sq_slots
        try:
            fields = SQ_RDMA_HEADER_AND_SGE.unpack(self.slot(first) + self.slot((first + 1) % ring)
                                                   + self.slot((first + HEADER_SLOTS) % ring))
        except (*ACCESS_ERRORS, IndexError):
            fields = UNREADABLE
        if not HEADER_SLOTS <= fields[2] <= self.largest_wqe():
            return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_QP_OPERATION_ERR, reason=WQE_FORMAT_ERROR, slot=first)
        return self._parse(first_psn, first, fields, index)

    def _parse(self, first_psn: int, first: int, fields: tuple[int, ...], index: int) -> SendWqe:
        """A SendWqe from its header and first SGE slot (SQ_RDMA_HEADER_AND_SGE: a SEND's header keeps the fields read
        here at the same offsets), with its local memory mapped and its PSNs from `first_psn` on (or the local error
        found)."""
        kind, flags, size, imm, length, remote_va, rkey, _, va, key, sge_size = fields
        qp = self.qp
        if kind in ATOMICS:
            return self._parse_atomic(first_psn, first, index, size, (va, key, sge_size))
        known = KINDS.get(kind)
        if known is None:
            return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_QP_OPERATION_ERR, reason=WQE_FORMAT_ERROR, slot=first)
        ops, _, rdma = known
        read = ops is None
        ring = qp.sq_slots
        try:
            if flags & INLINE and not read:
                body = b"".join(self.slot((first + HEADER_SLOTS + i) % ring) for i in range(size - HEADER_SLOTS))
                if length > len(body):
                    return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_LENGTH_ERR, reason=WQE_FORMAT_ERROR,
                                   slot=first)
                data: Buffer = memoryview(bytearray(body[:length]))
            else:
                data = self._local_memory(first, size, (va, key, sge_size), LOCAL_WRITE if read else 0)
                if len(data) < length:
                    return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_LENGTH_ERR, reason=TX_MEMORY_ERROR,
                                   slot=first)
        except ACCESS_ERRORS:
            return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR, reason=TX_MEMORY_ERROR, slot=first)
        return SendWqe(index, ops, read, flags & SIGNAL != 0 or self.force_completion, flags & SOLICIT != 0,
                       flags & FENCE != 0, length, remote_va if rdma else 0, rkey if rdma else 0, imm, data, first_psn,
                       psn_count(length, qp.path_mtu), slot=first)

    def _parse_atomic(self, first_psn: int, first: int, index: int, size: int,
                      sge: tuple[int, int, int]) -> SendWqe:
        """An atomic WQE: its own header, one PSN, its local memory's first ATOMIC_SIZE bytes for the result."""
        ring = self.qp.sq_slots
        kind, flags, _, rkey, remote_va, swap, compare = SQ_ATOMIC_HEADER.unpack(
            self.slot(first) + self.slot((first + 1) % ring))
        try:
            data = self._local_memory(first, size, sge, LOCAL_WRITE)
        except ACCESS_ERRORS:
            return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR, reason=TX_MEMORY_ERROR, slot=first)
        if len(data) < ATOMIC_SIZE:
            return SendWqe(index, status=S.CQ_REQ_STATUS_LOCAL_LENGTH_ERR, reason=TX_MEMORY_ERROR, slot=first)
        return SendWqe(index, None, True, flags & SIGNAL != 0 or self.force_completion, False, flags & FENCE != 0,
                       ATOMIC_SIZE, remote_va, rkey, 0, data, first_psn, 1, slot=first,
                       atomic=ATOMICS[kind], swap_add=swap, compare=compare)

    def _local_memory(self, first: int, size: int, sge: tuple[int, int, int], access: int) -> Buffer:
        """The memory of the SGEs of the `size`-slot WQE at slot `first` (`sge`: its first one, already read);
        MemoryProtectionError or DmaFault when one is bad."""
        qp = self.qp
        if size == HEADER_SLOTS + 1:  # one SGE, the common case: no list, no ScatterGather
            va, key, sge_size = sge
            region = self.mrs.get(key)
            if region is None:
                raise MemoryProtectionError(f"lkey {key:#x} does not exist")
            whole = region.view(va, sge_size, access, qp.pd) if sge_size else EMPTY
            return whole if whole is not None else gather(region.views(self.mem, va, sge_size, access, qp.pd))
        views, shift, mask = self.ring()
        ring, sges = qp.sq_slots, []
        for i in range(size - HEADER_SLOTS):
            slot = (first + HEADER_SLOTS + i) % ring
            sges.append(SGE.unpack_from(views[slot >> shift], (slot << SLOT_SHIFT) & mask))
        return map_sges(self.mem, self.mrs, sges, qp.pd, access)
