"""The requester's plain WQEs in bulk: a `WqeBlock` holds consecutive one-SGE WRITEs and SENDs of one send queue as
rows the compiled core parsed off the ring (wirequeues.c `wc_sq_parse`), sends them a turn at a time as one `Burst`
(`wc_pump`; the transport's core encodes a Burst's packets straight from its rows) and retires them a run at a time
(`wc_retire`), without a SendWqe or a Segments per message.

The requester (requester.py, completer.py) stays the reference. A block is only ever the tail of its queue of WQEs:
after every SendWqe it holds, sent only once all of those are sent and retired only once all of those are. Whatever
else the requester does (a READ or an atomic, a local error, a go-back, a NAK, a timeout, a flush) it does on
SendWqes: `WqeBlock.materialise` first turns the rows not yet retired into the very SendWqes the Python fetch would
have made, and the reference code goes on from there. So a block changes when work is done, never what is done:
tests/emulator/test_native.py holds the two paths to the same packets, CQEs, memory and counters.
"""
from __future__ import annotations

import array
import ctypes
import struct

from . import packets as pk
from .dma import EMPTY
from .native import Core, address
from .placement import KnownRegion
from .sendqueue import FENCE, INLINE, KINDS, SIGNAL, SOLICIT, PsnAllocator, SendQueue, SendWqe
from ..hw.wqe import SQ_RDMA_HEADER_AND_SGE, SQ_SLOT, SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS

# A WQE as wirecore.h's `struct row`: index, data address, remote VA, SGE VA; slot, length, rkey, immediate, first
# PSN, packets, SGE size; WQE type, signaled, solicited, fence, local region (its number in the block).
ROW = struct.Struct("<4Q7I5B3x")
NUMBER = struct.Struct("<Q")  # a row's first field: its WQE's number
# wirequeues.c `struct sq_parse`: what stays of the send queue (SQ_FIXED: the ring's page table, page mask, shift,
# slots, slots per doorbell step, largest WQE, force completion), then this fetch's (SQ_FETCH: slots fetched, slots
# published, next WQE number, next PSN, path MTU; the local region known (key, VA, size, address, number); rows and
# room; out: rows parsed, why it stopped).
SQ_FIXED = struct.Struct("<QQIIII?")
SQ_FETCH = struct.Struct("<QQQIIIQQQBQIIB")
FETCHED_ALL, ROWS_FULL, OTHER_REGION, OTHER_WQE = range(4)
# wirequeues.c `struct pump`: rows, row being sent, its next packet, rows held; una, budget, ORRQ entries in use, noack,
# window, ACK_EVERY; out: packets, the first one's PSN, noack before it.
PUMP = struct.Struct("<Q12I")
WRITE_KIND, SEND_KIND = 1, 2  # what the core's table says a WQE type is


def sq_format() -> bytes:
    """wirecore.h `struct sq_format`: where a WQE's fields are (hw/wqe.py), its flag bits and which types a block
    takes, with their opcodes (sendqueue.py)."""
    at = {field.name: field.offset for field in SQ_RDMA_HEADER_AND_SGE.fields}
    kinds, opcodes = bytearray(256), bytearray(256 * 4)
    for wqe_type, (ops, _, rdma) in KINDS.items():
        if ops is not None:  # READ is not a block's
            kinds[wqe_type] = WRITE_KIND if rdma else SEND_KIND
            opcodes[wqe_type * 4:wqe_type * 4 + 4] = bytes(ops)
    return struct.pack("<13I4B", SQ_SLOT, SQ_WQE_HEADER_SLOTS, SQ_STATIC_WQE_SLOTS, at["wqe_type"], at["flags"],
                       at["wqe_size"], at["imm_data"], at["length"], at["remote_va"], at["remote_key"],
                       at["va_or_pa"], at["l_key"], at["size"], SIGNAL, FENCE, SOLICIT, INLINE) \
        + bytes(kinds) + bytes(opcodes)


_told: list[Core] = []  # the cores told the send queue's format


class WqeBlock:
    """One send queue's plain WQEs not yet retired, as rows: [done, count) held, [done, send) sent (send_pkt packets
    of row `send` too). `regions` are the local regions the rows' bytes are in: a list only ever appended to (a new
    one replaces it), which the bursts out share."""

    def __init__(self, core: Core, sq: SendQueue) -> None:
        if core not in _told:
            core.sq_format(sq_format())
            _told.append(core)
        self.core, self.sq = core, sq
        self.rows = bytearray(ROW.size * 64)
        self.rows_at = address(self.rows)
        self.signaled = (ctypes.c_uint32 * 64)()  # wc_retire's output
        self.signaled_count = ctypes.c_int()
        self.signaled_at = ctypes.addressof(self.signaled)
        self.signaled_count_at = ctypes.addressof(self.signaled_count)
        self.count = self.done = self.send = self.send_pkt = 0
        self.regions: list[KnownRegion] = []
        self.known: KnownRegion | None = None  # the region the next WQEs are expected in
        self.parse = bytearray(SQ_FIXED.size + SQ_FETCH.size)
        self.parse_at = address(self.parse)
        self.state = bytearray(PUMP.size)
        self.state_at = address(self.state)
        self.pages: array.array[int] | None = None  # the ring's page addresses, once known
        unit = sq.qp.sq_geometry.slot_unit
        self.one_wqe = SQ_WQE_HEADER_SLOTS + 1 if unit == 1 else unit  # the slots of one WQE the block takes

    @property
    def unsent(self) -> bool:
        return self.send < self.count

    @property
    def unretired(self) -> bool:
        return self.done < self.count

    def row(self, i: int) -> tuple[int, ...]:
        return ROW.unpack_from(self.rows, i * ROW.size)

    # -- fetching ----------------------------------------------------------------------------------------------------
    def fetch(self, psns: PsnAllocator, produced: int) -> bool:
        """Parse the WQEs published up to slot `produced` into rows, PSNs from psns.next_psn on, while each is one the
        block takes; False when the next is not (the caller's Python fetch takes it), True once all are fetched."""
        sq = self.sq
        qp = sq.qp
        if self.pages is None:  # the ring and its geometry stay as CREATE_QP made them
            views, shift, mask = sq.ring()
            self.pages = array.array("Q", [address(view) for view in views])
            SQ_FIXED.pack_into(self.parse, 0, self.pages.buffer_info()[0], mask, shift, qp.sq_slots,
                               qp.sq_geometry.slot_unit, sq.largest_wqe(), sq.force_completion)
        while True:
            known = self.known
            if known is not None and not known.holds(sq.mrs):
                known = self.known = None
            if self.count == len(self.rows) // ROW.size:
                self._grow()
            if known is not None and (not self.regions or self.regions[-1] is not known):
                self.regions.append(known)
            SQ_FETCH.pack_into(self.parse, SQ_FIXED.size, sq.fetched_slots, produced, sq.fetched, psns.next_psn,
                               qp.path_mtu, known.key if known else 0, known.va if known else 0,
                               known.size if known else 0, known.at if known else 0,
                               len(self.regions) - 1 if known else 0, self.rows_at + self.count * ROW.size,
                               len(self.rows) // ROW.size - self.count, 0, 0)
            self.core.sq_parse(self.parse_at)
            (fetched_slots, _, fetched, next_psn, _, _, _, _, _, _, _, _, parsed,
             stop) = SQ_FETCH.unpack_from(self.parse, SQ_FIXED.size)
            sq.fetched_slots, sq.fetched, psns.next_psn = fetched_slots, fetched, next_psn
            self.count += parsed
            if stop == FETCHED_ALL:
                return True
            if stop == ROWS_FULL:
                continue
            if stop == OTHER_REGION:  # a WQE in a region not known: learn it, if the core may read it
                first, ring = sq.fetched_slots % qp.sq_slots, qp.sq_slots
                key = SQ_RDMA_HEADER_AND_SGE.unpack(sq.slot(first) + sq.slot((first + 1) % ring)
                                                    + sq.slot((first + SQ_WQE_HEADER_SLOTS) % ring))[9]
                learned = KnownRegion.learn(sq.mrs, sq.mem, key, qp.pd, 0)
                if learned is not None and (known is None or learned.key != known.key):
                    self.known = learned
                    continue
            return False

    def _grow(self) -> None:
        """Room for as many rows again: the retired ones dropped, or the rows doubled."""
        live = self.count - self.done
        if self.done:
            self.rows[:live * ROW.size] = self.rows[self.done * ROW.size:self.count * ROW.size]
            self.count, self.send, self.done = live, self.send - self.done, 0
        if self.count * 2 > len(self.rows) // ROW.size:
            self.rows.extend(bytes(len(self.rows)))
            self.rows_at = address(self.rows)
            self.signaled = (ctypes.c_uint32 * (len(self.rows) // ROW.size))()
            self.signaled_at = ctypes.addressof(self.signaled)

    # -- sending -----------------------------------------------------------------------------------------------------
    def pump(self, una: int, budget: int, reads: int, noack: int, window: int, ack_every: int,
             address_fields: tuple[int, int, str, str, int, int, int], mtu: int) -> tuple[Burst | None, int, int]:
        """The packets the requester may send from the rows now, as `pump` would send their WQEs: (the Burst, its
        first PSN, the noack after it); (None, 0, noack) when none may go."""
        PUMP.pack_into(self.state, 0, self.rows_at, self.send, self.send_pkt, self.count, una, budget, reads, noack,
                       window, ack_every, 0, 0, 0)
        self.core.pump(self.state_at)
        (_, send, send_pkt, _, _, _, _, noack_after, _, _, sent, first_psn, first_noack) = PUMP.unpack(self.state)
        if not sent:
            return None, 0, noack
        last = send + 1 if send_pkt else send  # one past the last row the burst takes packets from
        burst = Burst(self.rows[self.send * ROW.size:last * ROW.size], self.regions, self.send_pkt, sent,
                      first_noack, ack_every, mtu, address_fields)
        self.send, self.send_pkt = send, send_pkt
        return burst, first_psn, noack_after

    # -- retiring ----------------------------------------------------------------------------------------------------
    def retire(self, psn: int) -> list[int]:
        """Retire the rows an acknowledgement of `psn` covers; the WQE numbers of the signaled ones among them, and
        the last one's (the new consumer), or [] when it covers none."""
        end = self.core.retire(self.rows_at, self.done, self.count, psn, self.signaled_at, self.signaled_count_at)
        if end == self.done:
            return []
        rows, signaled = self.rows, self.signaled_count.value
        numbers = [NUMBER.unpack_from(rows, i * ROW.size)[0] for i in self.signaled[:signaled]] if signaled else []
        numbers.append(NUMBER.unpack_from(rows, (end - 1) * ROW.size)[0])
        self.done = end
        if end == self.count and self.send == end:  # all retired: start over at the first row
            self.count = self.done = self.send = 0
            self.regions = self.regions[-1:]  # a new list: bursts still out keep theirs
        return numbers

    def first_psn(self, i: int) -> int:
        return ROW.unpack_from(self.rows, i * ROW.size)[8]

    # -- back to SendWqes --------------------------------------------------------------------------------------------
    def materialise(self) -> list[SendWqe]:
        """The rows not retired as the SendWqes the Python fetch would have made of their WQEs; the block is then
        empty."""
        wqes = [wqe(ROW.unpack_from(self.rows, i * ROW.size), self.regions) for i in range(self.done, self.count)]
        self.count = self.done = self.send = self.send_pkt = 0
        self.regions = [self.known] if self.known is not None else []
        return wqes


def wqe(row: tuple[int, ...], regions: list[KnownRegion]) -> SendWqe:
    """The SendWqe of a row, as SendQueue._parse makes it (its memory the slice region.view gives)."""
    (index, _, remote_va, va, slot, length, rkey, imm, first_psn, npkts, sge_size, wqe_type, signaled, solicited,
     fence, region) = row
    ops, _, _ = KINDS[wqe_type]
    if sge_size:
        known = regions[region]
        data = known.whole[va - known.va:va - known.va + sge_size]
    else:
        data = EMPTY
    return SendWqe(index, ops, False, bool(signaled), bool(solicited), bool(fence), length, remote_va, rkey, imm, data,
                   first_psn, npkts, slot=slot)


class Burst:
    """Packets of consecutive plain WQEs the requester sends in one turn, straight from their rows: from packet `pkt`
    of the first row, `count` packets, AckReq as `noack` and ack_every say. `segments()` spells them out as the
    Segments the requester's per-WQE pump would have queued, `packets()` as Packets; the UDP transport's core encodes
    the rows themselves."""

    __slots__ = ("rows", "regions", "pkt", "count", "noack", "ack_every", "mtu", "dest_qp", "pkey", "src_ip",
                 "dst_ip", "src_port", "dst_port", "ip_id", "tos", "ttl")

    def __init__(self, rows: bytearray, regions: list[KnownRegion], pkt: int, count: int, noack: int, ack_every: int,
                 mtu: int, address_fields: tuple[int, int, str, str, int, int, int]) -> None:
        self.rows, self.regions, self.pkt, self.count, self.noack = rows, regions, pkt, count, noack
        self.ack_every, self.mtu = ack_every, mtu
        self.dest_qp, self.pkey, self.src_ip, self.dst_ip, self.src_port, self.tos, self.ttl = address_fields
        self.dst_port, self.ip_id = pk.ROCE_PORT, 0

    def segments(self) -> list[pk.Segments]:
        out, k, left, noack, i = [], self.pkt, self.count, self.noack, 0
        while left:
            w = wqe(ROW.unpack_from(self.rows, i * ROW.size), self.regions)
            count = min(w.npkts - k, left)
            last = k + count == w.npkts
            acks = 0
            for j in range(count):  # requester._ack_requests, one packet at a time
                if noack == self.ack_every - 1 or (last and j == count - 1):
                    acks, noack = acks | 1 << j, 0
                else:
                    noack += 1
            assert w.ops is not None
            out.append(pk.Segments(w.ops, self.dest_qp, w.first_psn, w.npkts, self.mtu, w.data, w.length,
                                   w.remote_va, w.rkey, w.imm, w.solicited, k, count, acks, self.pkey, self.src_ip,
                                   self.dst_ip, self.src_port, self.dst_port, self.ip_id, self.tos, self.ttl))
            left -= count
            k, i = 0, i + 1
        return out

    def packets(self) -> list[pk.Packet]:
        return [p for s in self.segments() for p in s.packets()]
