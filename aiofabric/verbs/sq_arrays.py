"""A send queue's memory as numpy arrays: a run of WQEs of one shape (post_many's: one verb, one size, one SGE or none)
and their search-table entries written in one vectorised step, byte for byte what `SendQueueCodec.post` writes one
WQE at a time (tests/unit/test_workqueue.py holds them to it). Every geometry: variable WQEs (packed slot by slot,
a WQE may straddle the ring's end) or static ones (a 128-byte WQE each; the bytes past a WQE's SGE are left as they
were, as `post` leaves them), the MSN table or the PSN search table."""
from __future__ import annotations

import struct
from typing import Sequence, Union

import numpy as np

from ..autogen import bnxt
from ..hw.verbs import PSN_MASK
from ..hw.wqe import (PSN_SEARCH_ENTRY, SQ_RDMA_HEADER_AND_SGE, SQ_SLOT, SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS,
                      SqGeometry, psn_search_values)

WORD = np.dtype("<u8")
SLOT_WORDS = SQ_SLOT // WORD.itemsize
ADDRESS_MAX = (1 << 64) - 1
# Where the two addresses and the flags byte sit in a WQE's words, read off the layout by packing probes
_PROBE = np.frombuffer(SQ_RDMA_HEADER_AND_SGE.pack(0, 0, 0, 0, 0, 1, 0, 0, 2, 0, 0), WORD)
REMOTE_WORD, LOCAL_WORD = int(np.flatnonzero(_PROBE == 1)[0]), int(np.flatnonzero(_PROBE == 2)[0])
_FLAGS_PROBE = np.frombuffer(SQ_RDMA_HEADER_AND_SGE.pack(0, bnxt.SQ_SEND_FLAGS_SIGNAL_COMP, 0, 0, 0, 0, 0, 0, 0, 0,
                                                         0), WORD)
FLAGS_WORD = int(np.flatnonzero(_FLAGS_PROBE)[0])
SIGNAL_BITS = _FLAGS_PROBE[FLAGS_WORD]
# The MSN entry's fields (PSNs are 24-bit already; a start slot is below 2^16: qp.py's MAX_SQ_SLOTS)
_SP, _NP, _SI = (bnxt.SQ_MSN_SEARCH_START_PSN_SFT, bnxt.SQ_MSN_SEARCH_NEXT_PSN_SFT,
                 bnxt.SQ_MSN_SEARCH_START_IDX_SFT)
# The PSN search entry as 64-bit words: (word, bit shift) of its fields, the opcode and first PSN, the next PSN, the
# start slot (all but the opcode in their fields' low bits; its padding is zeros, as pack_into writes it)
_SEARCH_WORDS = PSN_SEARCH_ENTRY.size // WORD.itemsize
_SEARCH_FIELDS = [(field.offset // WORD.itemsize, field.offset % WORD.itemsize * 8) for field in PSN_SEARCH_ENTRY.fields]


Column = Union[np.ndarray, tuple[int, int]]  # one word of a run's WQEs: a value each, or (first, step) of a linear run


def addresses(name: str, offsets: Sequence[int], base: int) -> Column:
    """`base + offsets` as a Column (a range's as first and step); struct.error (what packing them would raise) when
    one does not fit 64 bits."""
    low, high = span(offsets)
    if base + low < 0 or base + high > ADDRESS_MAX:
        raise struct.error(f"an address ({name} {low} or {high} from {base:#x}) does not fit 64 bits")
    if isinstance(offsets, range):
        return base + offsets.start, offsets.step
    return np.array([base + offset for offset in offsets], WORD)


def span(values: Sequence[int]) -> tuple[int, int]:
    """(smallest, largest) of a non-empty sequence; a range's without walking it."""
    if isinstance(values, range):
        return (values[0], values[-1]) if values.step > 0 else (values[-1], values[0])
    return min(values), max(values)


_IOTA = np.arange(64, dtype=WORD)
_IOTA.flags.writeable = False
_STEPS: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}  # a few shapes of run repeat: post lists of one length


def iota(count: int) -> np.ndarray:
    """0, 1, ... count - 1 as 64-bit words (read only: shared). Linear runs are `first + iota * step`, modulo 2^64
    (a negative step too); not np.arange, which sizes its result in floating point and loses 64-bit values' low
    bits."""
    global _IOTA
    if count > len(_IOTA):
        _IOTA = np.arange(1 << (count - 1).bit_length(), dtype=WORD)
        _IOTA.flags.writeable = False
    return _IOTA[:count]


def steps(count: int, step: tuple[int, ...]) -> np.ndarray:
    """iota(count) times each of `step` (64-bit words): a (count, len(step)) array, read only, kept for the next run
    of this shape (then a run's words are one add)."""
    key = (count, step)
    block = _STEPS.get(key)
    if block is None:
        if len(_STEPS) >= 64:
            _STEPS.clear()
        block = _STEPS[key] = np.multiply.outer(iota(count), np.array(step, WORD))
        block.flags.writeable = False
    return block


def copy_wrapping(ring: np.ndarray, at: int, values: np.ndarray) -> None:
    """Copy `values` into `ring` from index `at`, going on at 0 past the end."""
    head = min(len(values), len(ring) - at)
    ring[at:at + head] = values[:head]
    ring[:len(values) - head] = values[head:]


class SqArrays:
    """One SQ's ring and search table in `view` (as SendQueueCodec holds it), as arrays. They export the view:
    `close` them before the memory is freed."""

    def __init__(self, geometry: SqGeometry, view: memoryview) -> None:
        self.geometry, self.slots = geometry, geometry.slots
        self.static_slots = 0 if geometry.variable else SQ_STATIC_WQE_SLOTS
        self.unit_shift = geometry.slot_unit.bit_length() - 1  # slot -> PSN search entry
        self.ring: np.ndarray | None = np.frombuffer(view, WORD, self.slots * SLOT_WORDS)
        entries = geometry.table_entries
        self.table: np.ndarray | None = (
            np.frombuffer(view, WORD, entries, geometry.table_offset) if geometry.host_msn else
            np.frombuffer(view, WORD, entries * _SEARCH_WORDS, geometry.table_offset).reshape(entries, -1))
        self.templates: dict[tuple[int, int, int, int, int], np.ndarray] = {}  # the last shapes' words

    def close(self) -> None:
        self.ring = self.table = None

    def template(self, wqe_type: int, imm: int, length: int, rkey: int, lkey: int) -> np.ndarray:
        """The words of a WQE of this shape, unsignaled, its addresses 0 (struct.error for a value it cannot hold)."""
        key = (wqe_type, imm, length, rkey, lkey)
        words = self.templates.get(key)
        if words is None:
            sge_slots = 1 if length else 0
            packed = SQ_RDMA_HEADER_AND_SGE.pack(wqe_type, 0, SQ_WQE_HEADER_SLOTS + sge_slots, imm, length, 0, rkey,
                                                 0, 0, lkey, length)
            words = np.frombuffer(packed, WORD)[:(SQ_WQE_HEADER_SLOTS + sge_slots) * SLOT_WORDS]
            if len(self.templates) >= 8:
                self.templates.clear()
            self.templates[key] = words
        return words

    def write(self, template: np.ndarray, count: int, columns: list[tuple[int, Column]], signaled: list[int],
              start: int, taken: int) -> None:
        """`count` WQEs of `template`'s words from ring slot `start` (below `slots`), `taken` slots apart, the words
        `columns` name set to their values (LOCAL_WORD, REMOTE_WORD), WQE i signaled if i is in `signaled`."""
        ring = self.ring
        assert ring is not None, "the send queue's memory was freed"
        width, stride = len(template), taken * SLOT_WORDS
        first = start * SLOT_WORDS
        wraps = first + count * stride > len(ring)
        if wraps:
            rows = np.empty((count, width), WORD)
        else:
            rows = ring[first:first + count * stride].reshape(count, stride)
            if width < stride:
                rows = rows[:, :width]
        base, step = template, None
        for word, column in columns:
            if isinstance(column, tuple):  # first + i * step: every linear word in one add
                if step is None:
                    base, step = template.copy(), [0] * width
                base[word], step[word] = column[0], column[1] & ADDRESS_MAX
        if step is None:
            rows[:] = base
        else:
            np.add(steps(count, tuple(step)), base, out=rows)
        for word, column in columns:
            if not isinstance(column, tuple):
                rows[:, word] = column
        for i in signaled:  # a few: cheaper one by one than by a fancy index
            rows[i, FLAGS_WORD] |= SIGNAL_BITS
        if not wraps:
            return
        if self.static_slots:  # whole WQEs wrap: the first rows at the end, the rest from slot 0
            wqes = ring.reshape(-1, stride)
            head = len(wqes) - start // taken
            wqes[start // taken:, :width] = rows[:head]
            wqes[:count - head, :width] = rows[head:]
        else:  # slots wrap one by one
            copy_wrapping(ring, first, rows.reshape(-1))

    def search_entries(self, wqe_type: int, count: int, psn: int, npsn: int, msn: int, start: int,
                       taken: int) -> None:
        """The search-table entries of `count` messages of `npsn` PSNs each, the first starting at `psn`, numbered
        from `msn`, their WQEs `taken` slots apart from ring slot `start`. Between the points where the ring's slots
        or the MSN table's index wrap, the entries are a linear run (first + i * step): one add each, in place. Only
        a run whose PSNs wrap (once in 2^24 PSNs) takes the general path."""
        table = self.table
        assert table is not None, "the send queue's memory was freed"
        msn_table = self.geometry.host_msn
        if psn + count * npsn > PSN_MASK:
            self._wrapping(table, wqe_type, count, psn, npsn, msn, start, taken)
            return
        wrap = -(-(self.slots - start) // taken)  # the WQEs that start before the ring's end
        if msn_table:
            delta = steps(count, (npsn << _SP | npsn << _NP | taken << _SI,))[:, 0]
            head = len(table) - msn % len(table)  # the entries before the table's end
        else:
            words = [0] * _SEARCH_WORDS
            for (word, shift), step in zip(_SEARCH_FIELDS, (npsn, npsn, taken)):
                words[word] += step << shift
            delta, head = steps(count, tuple(words)), count
        if wrap >= count and head >= count:
            self._linear(table, delta, wqe_type, psn, npsn, msn, start, taken)
            return
        first = 0
        for end in sorted({count, min(wrap, count), min(head, count)}):
            if end > first:
                self._linear(table, delta[:end - first], wqe_type, psn + first * npsn, npsn, msn + first,
                             (start + first * taken) % self.slots, taken)
                first = end

    def _linear(self, table: np.ndarray, delta: np.ndarray, wqe_type: int, psn: int, npsn: int, msn: int, start: int,
                taken: int) -> None:
        """len(delta) entries in a row of the table (no field, slot or index wraps among them), `delta` their
        distances from the first (search_entries)."""
        count = len(delta)
        if self.geometry.host_msn:
            index = msn % len(table)
            np.add(delta, psn << _SP | (psn + npsn) << _NP | start << _SI, out=table[index:index + count])
            return
        words = [0] * _SEARCH_WORDS
        for (word, shift), value in zip(_SEARCH_FIELDS, (self._opcode(wqe_type) | psn, psn + npsn, start)):
            words[word] |= value << shift
        index, stride = start >> self.unit_shift, taken >> self.unit_shift
        np.add(delta, np.array(words, WORD), out=table[index:index + (count - 1) * stride + 1:stride])

    def _wrapping(self, table: np.ndarray, wqe_type: int, count: int, psn: int, npsn: int, msn: int, start: int,
                  taken: int) -> None:
        """search_entries of a run whose PSNs wrap: every field computed and wrapped on its own."""
        numbers = iota(count)
        psns = (numbers * np.uint64(npsn) + np.uint64(psn)) & np.uint64(PSN_MASK)
        nexts = (psns + np.uint64(npsn)) & np.uint64(PSN_MASK)
        starts = (numbers * np.uint64(taken) + np.uint64(start)) & np.uint64(self.slots - 1)
        if self.geometry.host_msn:
            copy_wrapping(table, msn % len(table), psns << _SP | nexts << _NP | starts << _SI)
            return
        rows = np.zeros((count, _SEARCH_WORDS), WORD)
        for (word, shift), values in zip(_SEARCH_FIELDS, (psns | self._opcode(wqe_type), nexts, starts)):
            rows[:, word] |= values << np.uint64(shift)
        table[starts >> np.uint64(self.unit_shift)] = rows

    @staticmethod
    def _opcode(wqe_type: int) -> int:
        """The bits a PSN search entry's first field has for `wqe_type`, besides the PSN."""
        return psn_search_values(wqe_type, 0, 0, 0)[0]
