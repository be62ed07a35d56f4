"""The driver's side of a QP's send and receive queues, sans-IO: what to write into the rings, which doorbell to ring,
which work requests a completion retires.

`SendQueueCodec` owns the SQ ring's memory and its accounting: the producer and consumer in 16-byte slots
(free-running), the WQEs posted and retired (free-running; CQEs name them modulo the SQ's size, or by slot:
`retire`), the next PSN and message number, and the search-table entry of every message (hw.wqe.SqGeometry says which
table and where). Each posted WQE may carry a token (the caller's: a `Completion`); `retire` maps a requester CQE's
`sq_cons_idx` to the tokens it completes. WQEs without a token (unsignaled ones inside a `post_run`) cost no
bookkeeping beyond one list store: the slot a WQE ends at is kept by WQE number, so a CQE releases the ring up to any
WQE, signaled or not, and the slot a WQE starts at is where the one before it ends.

`RecvQueueCodec` does the same for the RQ: one WQE per receive, tagged with its producer count, and completions
matched in order.

Neither touches a doorbell, a CQ or a clock: `QueuePair` (qp.py, post.py) is the I/O around them, and the tests drive
them with plain memory (tests/unit/test_workqueue.py).
"""
from __future__ import annotations

import collections
import itertools
from typing import Any, Sequence

from .sq_runs import ADDRESS_MAX, RunWriter, addresses
from ..autogen import bnxt
from ..hw.verbs import PSN_MASK, psn_count
from ..hw.wqe import (ATOMIC_WQE_TYPES, MSN_ENTRY, PSN_SEARCH_ENTRY, RDMA_WQE_TYPES, RQ_WQE_HEADER, RQ_WQE_HEADER_SLOTS,
                      SGE, SQ_ATOMIC_HEADER, SQ_RDMA_HEADER, SQ_RDMA_HEADER_AND_SGE, SQ_SEND_HEADER, SQ_SLOT,
                      SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS, SqGeometry, msn_entry, psn_search_values)

SIGNAL = bnxt.SQ_SEND_FLAGS_SIGNAL_COMP
INLINE = bnxt.SQ_SEND_FLAGS_INLINE
SLOT_SHIFT = SQ_SLOT.bit_length() - 1
RECV_TAG_MASK = bnxt.CQ_RES_RC_SRQ_OR_RQ_WR_ID_MASK
Sge = tuple[int, int, int]  # (address, lkey, length): one scatter/gather element
KEY_MAX = (1 << 32) - 1  # a key, an SGE's length (ADDRESS_MAX: an SGE's and an RETH's address)

# The one-SGE paths inline msn_entry (a call per WQE is ~10% of a post; tests/unit/test_workqueue.py holds them to it)
_PACK_ONE = SQ_RDMA_HEADER_AND_SGE.pack_into
_PACK_MSN = MSN_ENTRY.pack_into
_PACK_PSN, _PSN_BYTES = PSN_SEARCH_ENTRY.pack_into, PSN_SEARCH_ENTRY.size
_ONE_BYTES = SQ_RDMA_HEADER_AND_SGE.size
_ONE_SLOTS = SQ_WQE_HEADER_SLOTS + 1
_MSN_SHIFT = MSN_ENTRY.size.bit_length() - 1
_SP, _NP = bnxt.SQ_MSN_SEARCH_START_PSN_SFT, bnxt.SQ_MSN_SEARCH_NEXT_PSN_SFT  # PSNs are already 24-bit
_SI_FROM_OFFSET, _SI_MASK = bnxt.SQ_MSN_SEARCH_START_IDX_SFT - SLOT_SHIFT, bnxt.SQ_MSN_SEARCH_START_IDX_MASK
VECTOR_RUN = 24  # WQEs from which a run is written at once (sq_runs.py), not one by one (bench/RESULTS.md)


class SendQueueCodec:
    """One SQ: `geometry` as CREATE_QP names it, `view` its ring memory followed by the search table.

    Posting writes WQEs at the producer and never checks room: the caller asks `room(slots, wqes)` first (and waits
    for completions when there is none). `max_unsignaled` bounds a run of unsignaled WQEs, so that completions keep
    releasing the ring however the caller signals. `reserved_wqes` of the ring are never filled (static WQEs: Linux
    keeps BNXT_QPLIB_RESERVED_QP_WRS + 1 free, q_full_delta)."""

    def __init__(self, geometry: SqGeometry, view: memoryview, *, max_unsignaled: int, reserved_wqes: int = 0) -> None:
        self.geometry, self.view = geometry, view
        self.slots = geometry.slots
        self.ring_bytes = self.slots * SQ_SLOT
        self.slot_mask = self.slots - 1
        self.static_slots = 0 if geometry.variable else SQ_STATIC_WQE_SLOTS  # what a static WQE takes, any size
        self.unit_shift = geometry.slot_unit.bit_length() - 1  # slot -> doorbell index and PSN search entry
        self.host_msn = geometry.host_msn
        self.table_mask = geometry.table_entries - 1
        self.max_unsignaled = max_unsignaled
        self.size, self.variable = geometry.size, geometry.variable  # what a CQE's sq_cons_idx counts modulo
        # fewer WQEs in flight than sq_size: a CQE that retires them all must not name the WQE retired last
        self.max_wqes = min(self.size - 1, self.slots // (self.static_slots or SQ_WQE_HEADER_SLOTS) - reserved_wqes)
        self.ends = [0] * (1 << self.max_wqes.bit_length())  # by WQE number: the slot after it
        self.ends_mask = len(self.ends) - 1
        self.mtu = 1024
        self.pending: collections.deque[tuple[int, Any]] = collections.deque()  # (WQE number + 1, token)
        self.runs: RunWriter | None = None  # made at the first run written at once
        self.reset(0)

    def reset(self, psn: int) -> None:
        """Start over (the QP went to RESET): an empty ring from slot 0, the first PSN `psn`. Tokens still pending are
        dropped: `drain` them first."""
        self.view[:] = bytes(len(self.view))
        self.producer = self.consumer = 0  # slots
        self.posted = self.retired = 0  # WQEs
        self.msn = self.unsignaled_run = 0
        self.psn = psn
        self.pending.clear()

    # -- room ------------------------------------------------------------------------------------------------------
    def wqe_slots(self, sges: int = 1, inline: int = 0) -> int:
        """Slots of a WQE with `sges` SGEs, or `inline` bytes of inline data (a zero-length WQE is its header)."""
        return SQ_WQE_HEADER_SLOTS + (-(-inline >> SLOT_SHIFT) if inline else sges)

    def taken(self, wqe_slots: int) -> int:
        """Ring slots a WQE of `wqe_slots` occupies: its own in variable mode, a whole static WQE otherwise."""
        return self.static_slots or wqe_slots

    def room(self, slots: int, wqes: int = 1) -> bool:
        """Whether `wqes` WQEs taking `slots` ring slots in all fit now."""
        return (self.slots - (self.producer - self.consumer) >= slots
                and self.posted - self.retired + wqes <= self.max_wqes)

    def fits(self, slots: int, wqes: int = 1) -> bool:
        """Whether they can always come to fit: in half the ring (the other half may hold unsignaled WQEs that no
        completion will retire until a signaled one follows them; `max_unsignaled` keeps them under half)."""
        return slots <= self.slots // 2 and wqes <= self.max_wqes // 2

    @property
    def outstanding(self) -> int:
        """WQEs posted and not yet retired."""
        return self.posted - self.retired

    # -- posting ---------------------------------------------------------------------------------------------------
    def post(self, wqe_type: int, sges: Sequence[Sge], length: int, remote_va: int, rkey: int, imm: int,
             signaled: bool, token: Any, inline: bytes | memoryview | None = None, swap: int = 0,
             compare: int = 0) -> None:
        """Any WQE: its header, then `sges` (or `inline` data, `length` bytes of it), wrapping slot by slot. An atomic
        carries `swap` (FETCH_ADD: the addend) and `compare`; its SGE takes the original value. A value the WQE
        cannot hold raises struct.error and changes nothing."""
        signaled = signaled or self.unsignaled_run >= self.max_unsignaled
        flags = (SIGNAL if signaled else 0) | (INLINE if inline is not None else 0)
        if inline is not None:
            body = bytes(inline).ljust(-(-len(inline) >> SLOT_SHIFT) << SLOT_SHIFT, b"\0")
        else:
            body = b"".join(SGE.pack(*sge) for sge in sges)
        size = SQ_WQE_HEADER_SLOTS + (len(body) >> SLOT_SHIFT)
        if wqe_type in RDMA_WQE_TYPES:
            wqe = SQ_RDMA_HEADER.pack(wqe_type, flags, size, imm, length, remote_va, rkey, 0) + body
        elif wqe_type in ATOMIC_WQE_TYPES:
            wqe = SQ_ATOMIC_HEADER.pack(wqe_type, flags, size, rkey, remote_va, swap, compare) + body
        else:
            wqe = SQ_SEND_HEADER.pack(wqe_type, flags, size, imm, length, 0, 0, 0, 0) + body
        start = self.producer
        offset = (start & self.slot_mask) << SLOT_SHIFT
        self._write(offset, wqe)
        self.unsignaled_run = 0 if signaled else self.unsignaled_run + 1
        self._publish(wqe_type, start, self.taken(size), length, flags, token)

    def _write(self, offset: int, wqe: bytes) -> None:
        view, ring_bytes, end = self.view, self.ring_bytes, offset + len(wqe)
        if end <= ring_bytes:
            view[offset:end] = wqe
        else:  # slots wrap one by one at the end of the ring
            first = ring_bytes - offset
            view[offset:ring_bytes] = wqe[:first]
            view[0:len(wqe) - first] = wqe[first:]

    def _publish(self, wqe_type: int, start: int, taken: int, length: int, flags: int, token: Any) -> None:
        """The bookkeeping after a WQE is in the ring: its search-table entry, PSNs, producer, token."""
        psn, start_slot, mtu = self.psn, start & self.slot_mask, self.mtu
        self.psn = next_psn = (psn + psn_count(length, mtu)) & PSN_MASK
        view, ring_bytes = self.view, self.ring_bytes
        if self.host_msn:  # Linux bnxt_qplib_fill_msn_search / bnxt_qplib_fill_psn_search
            _PACK_MSN(view, ring_bytes + (self.msn & self.table_mask) * MSN_ENTRY.size,
                      msn_entry(psn, next_psn, start_slot))
            self.msn += 1
        else:
            PSN_SEARCH_ENTRY.pack_into(view, ring_bytes + (start_slot >> self.unit_shift) * PSN_SEARCH_ENTRY.size,
                                       *psn_search_values(wqe_type, psn, next_psn, start_slot))
        self.producer = end = start + taken
        self.posted = number = self.posted + 1
        self.ends[(number - 1) & self.ends_mask] = end
        if token is not None:
            self.pending.append((number, token))

    def post_one(self, wqe_type: int, address: int, lkey: int, length: int, remote_va: int, rkey: int, imm: int,
                 signaled: bool, token: Any) -> bool:
        """The common WQE: one SGE of `length` > 0 bytes, packed straight into the ring (the per-operation path,
        room check included). False when there is no room for it."""
        start = self.producer
        taken = self.static_slots or _ONE_SLOTS
        if self.slots - (start - self.consumer) < taken or self.posted - self.retired >= self.max_wqes:
            return False
        offset = (start & self.slot_mask) << SLOT_SHIFT
        if offset > self.ring_bytes - _ONE_BYTES:  # it wraps
            self.post(wqe_type, ((address, lkey, length),), length, remote_va, rkey, imm, signaled, token)
            return True
        run = self.unsignaled_run
        flags = SIGNAL if signaled or run >= self.max_unsignaled else 0
        view, psn, mtu = self.view, self.psn, self.mtu
        _PACK_ONE(view, offset, wqe_type, flags, _ONE_SLOTS, imm, length, remote_va, rkey, 0, address, lkey, length)
        self.unsignaled_run = 0 if flags else run + 1
        self.psn = next_psn = (psn + (length + mtu - 1) // mtu) & PSN_MASK
        if self.host_msn:
            msn = self.msn
            _PACK_MSN(view, self.ring_bytes + ((msn & self.table_mask) << _MSN_SHIFT),
                      psn << _SP | next_psn << _NP | (offset << _SI_FROM_OFFSET & _SI_MASK))
            self.msn = msn + 1
        else:  # the PSN search table's entry, where the WQE's start slot says
            slot = offset >> SLOT_SHIFT
            _PACK_PSN(view, self.ring_bytes + (slot >> self.unit_shift) * _PSN_BYTES,
                      *psn_search_values(wqe_type, psn, next_psn, slot))
        self.producer = end = start + taken
        self.posted = number = self.posted + 1
        self.ends[(number - 1) & self.ends_mask] = end
        self.pending.append((number, token))
        return True

    def post_run(self, wqe_type: int, address: int, lkey: int, remote_va: int, rkey: int, length: int,
                 offsets: Sequence[int], remote_offsets: Sequence[int], imm: int, tokens: dict[int, Any]) -> None:
        """len(`offsets`) WQEs of one SGE each (none if `length` is 0) in one pass: the i-th moves `length` bytes at
        `address + offsets[i]` (to or from `remote_va + remote_offsets[i]` for RDMA types). WQE i is signaled, with
        token `tokens[i]`, when `tokens` has it (give the last one a token: its CQE retires the run); the others only
        when the unsignaled run reaches its bound. The caller checked `room`. A value a WQE cannot hold raises
        struct.error and posts none of them. Short runs are packed one by one, longer ones written at once
        (`VECTOR_RUN`, sq_runs.py)."""
        rdma = wqe_type in RDMA_WQE_TYPES
        if len(offsets) >= VECTOR_RUN or not length or not self.host_msn:
            self._post_run_at_once(wqe_type, address, lkey, remote_va, rkey, length, offsets, remote_offsets, imm,
                                  tokens, rdma)
            return
        view, slot_mask, table_mask, cap = self.view, self.slot_mask, self.table_mask, self.max_unsignaled
        table, limit, entries = self.ring_bytes, self.ring_bytes - _ONE_BYTES, []
        taken = self.static_slots or _ONE_SLOTS
        npsn = psn_count(length, self.mtu)
        first, psn, msn, number, run = self.producer, self.psn, self.msn, self.posted, self.unsignaled_run
        if not rdma:
            remote_va, rkey, remote_offsets = 0, 0, itertools.repeat(0)  # type: ignore[assignment]
        marks = iter(sorted(tokens))
        mark = next(marks)
        start = first
        for i, (local, remote) in enumerate(zip(offsets, remote_offsets)):
            if i == mark or run >= cap:
                run, flags = 0, SIGNAL
            else:
                run, flags = run + 1, 0
            offset = (start & slot_mask) << SLOT_SHIFT
            if offset <= limit:
                _PACK_ONE(view, offset, wqe_type, flags, _ONE_SLOTS, imm, length, remote_va + remote, rkey, 0,
                          address + local, lkey, length)
            else:
                self._write(offset, SQ_RDMA_HEADER_AND_SGE.pack(wqe_type, flags, _ONE_SLOTS, imm, length,
                                                                remote_va + remote, rkey, 0, address + local, lkey,
                                                                length))
            next_psn = (psn + npsn) & PSN_MASK
            _PACK_MSN(view, table + ((msn & table_mask) << _MSN_SHIFT),
                      psn << _SP | next_psn << _NP | (offset << _SI_FROM_OFFSET & _SI_MASK))
            psn, msn, start = next_psn, msn + 1, start + taken
            if i == mark:
                entries.append((number + i + 1, tokens[i]))
                mark = next(marks, -1)
        self.pending.extend(entries)  # only now: a WQE that could not be packed left the codec as it was
        count = (start - first) // taken
        self._ends(number, first, taken, count)
        self.producer, self.psn, self.msn, self.posted, self.unsignaled_run = start, psn, msn, number + count, run

    def _post_run_at_once(self, wqe_type: int, address: int, lkey: int, remote_va: int, rkey: int, length: int,
                         offsets: Sequence[int], remote_offsets: Sequence[int], imm: int, tokens: dict[int, Any],
                         rdma: bool) -> None:
        """post_run in one step (sq_runs.py): the run's WQEs, then their search-table entries."""
        runs = self.runs
        if runs is None:
            runs = self.runs = RunWriter(self.geometry, self.view)
        count = len(offsets)
        template = runs.template(wqe_type, imm, length, rkey if rdma else 0, lkey if length else 0)
        local = addresses("offset", offsets, address) if length else None
        remote = addresses("remote offset", remote_offsets, remote_va) if rdma else None
        marks = sorted(tokens)
        signaled, run = _signaled(marks, count, self.unsignaled_run, self.max_unsignaled)
        taken = self.static_slots or SQ_WQE_HEADER_SLOTS + (1 if length else 0)
        first, psn, npsn = self.producer, self.psn, psn_count(length, self.mtu)
        start = first & self.slot_mask
        runs.wqes(template, count, local, remote, signaled, start, taken)
        runs.search_entries(wqe_type, count, psn, npsn, self.msn, start, taken)
        number = self.posted
        self.pending.extend([(number + i + 1, tokens[i]) for i in marks])
        self._ends(number, first, taken, count)
        self.producer, self.posted = first + taken * count, number + count
        if self.host_msn:
            self.msn += count
        self.psn, self.unsignaled_run = (psn + npsn * count) & PSN_MASK, run

    def close(self) -> None:
        """Drop the numpy arrays over the ring's memory (before it is freed: they hold it mapped)."""
        if self.runs is not None:
            self.runs.close()
            self.runs = None

    def _ends(self, number: int, first: int, taken: int, count: int) -> None:
        """Record the end slots of `count` WQEs of `taken` slots each, numbered from `number`, starting at `first`."""
        ends, size = self.ends, len(self.ends)
        at = number & self.ends_mask
        head = min(count, size - at)
        ends[at:at + head] = range(first + taken, first + taken * (head + 1), taken)
        if head < count:
            ends[:count - head] = range(first + taken * (head + 1), first + taken * (count + 1), taken)

    def doorbell(self) -> tuple[int, int]:
        """(index, epoch) of the SQ doorbell that publishes everything posted: a slot, or a static WQE."""
        producer = self.producer
        return (producer & self.slot_mask) >> self.unit_shift, producer // self.slots & 1

    # -- completions -----------------------------------------------------------------------------------------------
    def retire(self, sq_cons_idx: int, status: int) -> tuple[list[Any], Any]:
        """A requester CQE: every WQE up to the one `sq_cons_idx` names is done, that one with `status`.
        Returns (the tokens completed without error, the token `status` belongs to or None). A CQE that names no
        outstanding WQE (stale, duplicated, after a drain) retires nothing.

        As Linux's bnxt_qplib_cq_process_req reads it: the index of the WQE after the last completed one, modulo
        CREATE_QP's sq_size (WQEs, or slots with variable WQEs: either way one count per WQE); but an error CQE of a
        variable-WQE QP names the slot the failed WQE starts at (bnxt_qplib_get_cqe_sq_cons).
        The status belongs to the named WQE's token; when that WQE had none (an unsignaled WQE that failed), it
        belongs to the next token, which a run always has after it."""
        if status and self.variable:
            target = self._starting_at(sq_cons_idx)
            if not target:
                return [], None
        else:
            distance = (sq_cons_idx - self.retired) % self.size
            if distance == 0 or distance > self.posted - self.retired:
                return [], None
            target = self.retired + distance
        self.retired = target
        self.consumer = self.ends[(target - 1) & self.ends_mask]
        done, pending = [], self.pending
        while pending and pending[0][0] < target:
            done.append(pending.popleft()[1])
        named = None
        if pending and (pending[0][0] == target or status):
            named = pending.popleft()[1]
        return done, named

    def _starting_at(self, slot: int) -> int:
        """The number (from 1) of the outstanding WQE that starts at ring slot `slot`, 0 if none does."""
        ends, mask, start = self.ends, self.ends_mask, self.consumer
        for number in range(self.retired + 1, self.posted + 1):
            if start % self.slots == slot:
                return number
            start = ends[(number - 1) & mask]
        return 0

    def drain(self) -> list[Any]:
        """Everything outstanding, as if completed: the tokens still pending, in order (to flush them)."""
        tokens = [token for _, token in self.pending]
        self.pending.clear()
        self.retired, self.consumer = self.posted, self.producer
        return tokens


def _signaled(marks: list[int], count: int, run: int, cap: int) -> tuple[list[int], int]:
    """Which of `count` WQEs are signaled: the marked ones, and one whenever `cap` unsignaled ones ran (the rule
    post_one and post apply one by one); and the unsignaled run after the last."""
    signaled, i = [], 0
    for mark in [*marks, count]:
        while i + max(0, cap - run) < mark:  # the run reaches its bound before the mark
            forced = i + max(0, cap - run)
            signaled.append(forced)
            run, i = 0, forced + 1
        run += mark - i
        if mark < count:
            signaled.append(mark)
            run, i = 0, mark + 1
    return signaled, run


class RecvQueueCodec:
    """One RQ of `depth` WQEs of `wqe_size` bytes in `view` (RQ_WQE_HEADER, then the SGEs the slot has room for)."""

    def __init__(self, view: memoryview, depth: int, wqe_size: int) -> None:
        self.view, self.depth, self.wqe_size = view, depth, wqe_size
        self.pending: collections.deque[tuple[int, Any]] = collections.deque()  # (tag, token)
        self.reset()

    def reset(self) -> None:
        self.view[:] = bytes(len(self.view))
        self.producer = 0
        self.pending.clear()

    def room(self, wqes: int = 1) -> bool:
        return len(self.pending) + wqes <= self.depth

    def post(self, sges: Sequence[Sge], token: Any) -> None:
        """A receive WQE into `sges` (none: a receive for a WRITE_WITH_IMM's immediate, which carries one zero-length
        SGE, as Linux's bnxt_re posts it); the caller checked `room`. Its wqe_size counts the SGEs it has, so the NIC
        never reads a slot's SGEs left from an earlier receive."""
        tag = self.producer & RECV_TAG_MASK
        body = b"".join(SGE.pack(*sge) for sge in sges) or SGE.pack(0, 0, 0)
        wqe = RQ_WQE_HEADER.pack(bnxt.RQ_WQE_HDR_WQE_TYPE_RCV, 0, RQ_WQE_HEADER_SLOTS + (len(body) >> SLOT_SHIFT),
                                 tag, 0) + body
        offset = (self.producer % self.depth) * self.wqe_size
        self.view[offset:offset + len(wqe)] = wqe
        self.pending.append((tag, token))
        self.producer += 1

    def doorbell(self) -> tuple[int, int]:
        """(slot, epoch) of the RQ doorbell that publishes every receive posted."""
        return self.producer % self.depth, self.producer // self.depth & 1

    def complete(self, wr_id: int) -> tuple[Any, bool]:
        """A responder CQE for the oldest receive: (its token, whether the CQE's wr_id is that receive's tag), or
        (None, False) when none is outstanding."""
        if not self.pending:
            return None, False
        tag, token = self.pending.popleft()
        return token, tag == wr_id & RECV_TAG_MASK

    def drain(self) -> list[Any]:
        tokens = [token for _, token in self.pending]
        self.pending.clear()
        return tokens
