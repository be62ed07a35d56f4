"""A send queue's memory written a run at a time: post_many's work requests (one verb, one size, one SGE or none) and
their search-table entries in one step, byte for byte what `SendQueueCodec.post` writes one WQE at a time
(tests/unit/test_workqueue.py and test_post_bulk.py hold them to it), in every geometry.

Where a run's bytes follow each other (variable WQEs, slot after slot, a WQE straddling the ring's end as its slots
wrap; MSN entries, message after message) one struct packs the whole run (hw.wqe.repeated). Where they do not (static
128-byte WQEs, whose bytes past the SGE stay as they were, as `post` leaves them; the PSN search table, an entry per
WQE start) numpy writes them as rows over the ring's memory, each linear stretch in one add. In the benchmark's
process one pack costs less than numpy's handful of calls, whose cost grows most with cold caches (bench/RESULTS.md).
"""
from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from ..autogen import bnxt
from ..hw.verbs import PSN_MASK
from ..hw.wqe import (MSN_ENTRY, PSN_SEARCH_ENTRY, SQ_RDMA_HEADER, SQ_RDMA_HEADER_AND_SGE, SQ_SLOT,
                      SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS, SqGeometry, msn_entry, psn_search_values, repeated)

WORD = np.dtype("<u8")
SLOT_WORDS = SQ_SLOT // WORD.itemsize
ADDRESS_MAX = (1 << 64) - 1
SIGNAL = bnxt.SQ_SEND_FLAGS_SIGNAL_COMP
# Where a WQE's flags and its two addresses are among the values the layout packs, and among its 64-bit words (read
# off the layout by packing probes)
_VALUES = [field.name for field in SQ_RDMA_HEADER_AND_SGE.fields]
_FLAGS, _REMOTE, _LOCAL = _VALUES.index("flags"), _VALUES.index("remote_va"), _VALUES.index("va_or_pa")
_PROBE = np.frombuffer(SQ_RDMA_HEADER_AND_SGE.pack(0, 0, 0, 0, 0, 1, 0, 0, 2, 0, 0), WORD)
REMOTE_WORD, LOCAL_WORD = int(np.flatnonzero(_PROBE == 1)[0]), int(np.flatnonzero(_PROBE == 2)[0])
_FLAGS_PROBE = np.frombuffer(SQ_RDMA_HEADER_AND_SGE.pack(0, SIGNAL, 0, 0, 0, 0, 0, 0, 0, 0, 0), WORD)
FLAGS_WORD = int(np.flatnonzero(_FLAGS_PROBE)[0])
SIGNAL_BITS = int(_FLAGS_PROBE[FLAGS_WORD])
# The MSN entry's fields (PSNs are 24-bit already; a start slot is below 2^16: qp.py's MAX_SQ_SLOTS)
_SP, _NP, _SI = (bnxt.SQ_MSN_SEARCH_START_PSN_SFT, bnxt.SQ_MSN_SEARCH_NEXT_PSN_SFT,
                 bnxt.SQ_MSN_SEARCH_START_IDX_SFT)
# The PSN search entry as 64-bit words: (word, bit shift) of each field packed (the opcode and first PSN, the next PSN,
# the start slot); the rest is padding, zeros, as pack_into writes it
_SEARCH_WORDS = PSN_SEARCH_ENTRY.size // WORD.itemsize
_SEARCH_FIELDS = [(field.offset // WORD.itemsize, field.offset % WORD.itemsize * 8) for field in PSN_SEARCH_ENTRY.fields]


def addresses(name: str, offsets: Sequence[int], base: int) -> Sequence[int]:
    """`base + offsets` (a range stays a range); struct.error (what packing them would raise) when one does not fit
    64 bits."""
    low, high = span(offsets)
    if base + low < 0 or base + high > ADDRESS_MAX:
        raise struct.error(f"an address ({name} {low} or {high} from {base:#x}) does not fit 64 bits")
    if isinstance(offsets, range):
        return range(base + offsets.start, base + offsets.stop, offsets.step)
    return [base + offset for offset in offsets]


def span(values: Sequence[int]) -> tuple[int, int]:
    """(smallest, largest) of a non-empty sequence; a range's without walking it."""
    if isinstance(values, range):
        return (values[0], values[-1]) if values.step > 0 else (values[-1], values[0])
    return min(values), max(values)


_IOTA = np.arange(64, dtype=WORD)
_IOTA.flags.writeable = False
_STEPS: dict[tuple[int, tuple[int, ...], tuple[int, ...]], np.ndarray] = {}  # a few shapes of run repeat


def iota(count: int) -> np.ndarray:
    """0, 1, ... count - 1 as 64-bit words (read only: shared). Linear runs are `first + iota * step`, modulo 2^64
    (a negative step too); not np.arange, which sizes its result in floating point and loses 64-bit values' low
    bits."""
    global _IOTA
    if count > len(_IOTA):
        _IOTA = np.arange(1 << (count - 1).bit_length(), dtype=WORD)
        _IOTA.flags.writeable = False
    return _IOTA[:count]


def steps(count: int, step: tuple[int, ...], signal: tuple[int, ...] = ()) -> np.ndarray:
    """iota(count) times each of `step` (64-bit words), plus a WQE's signal flag in the rows `signal` names: a
    (count, len(step)) array, read only, kept for the next run of this shape (post lists of one length and one
    signal pattern: then a run's words are one add)."""
    key = (count, step, signal)
    block = _STEPS.get(key)
    if block is None:
        if len(_STEPS) >= 64:
            _STEPS.clear()
        block = _STEPS[key] = np.multiply.outer(iota(count), np.array(step, WORD))
        block[list(signal), FLAGS_WORD] += SIGNAL_BITS
        block.flags.writeable = False
    return block


class RunWriter:
    """One SQ's ring and search table in `view` (as SendQueueCodec holds it). The numpy arrays over it hold its
    memory mapped: `close` them before it is freed."""

    def __init__(self, geometry: SqGeometry, view: memoryview) -> None:
        self.geometry, self.view, self.slots = geometry, view, geometry.slots
        self.ring_bytes = self.slots * SQ_SLOT
        self.static_slots = 0 if geometry.variable else SQ_STATIC_WQE_SLOTS
        self.unit_shift = geometry.slot_unit.bit_length() - 1  # slot -> PSN search entry
        self.entries = geometry.table_entries
        self.ring: np.ndarray | None = None if geometry.variable else np.frombuffer(view, WORD, self.slots * SLOT_WORDS)
        self.table: np.ndarray | None = None if geometry.host_msn else np.frombuffer(
            view, WORD, self.entries * _SEARCH_WORDS, geometry.table_offset).reshape(self.entries, -1)
        self.templates: dict[tuple[int, ...], list[int]] = {}  # the last shapes' values

    def close(self) -> None:
        self.ring = self.table = None

    def template(self, wqe_type: int, imm: int, length: int, rkey: int, lkey: int) -> list[int]:
        """The values a WQE of this shape packs, unsignaled, its addresses 0 (its layout: SQ_RDMA_HEADER_AND_SGE, or
        SQ_RDMA_HEADER alone for a zero-length message); struct.error for a value it cannot hold."""
        key = (wqe_type, imm, length, rkey, lkey)
        values = self.templates.get(key)
        if values is None:
            values = [wqe_type, 0, SQ_WQE_HEADER_SLOTS + (1 if length else 0), imm, length, 0, rkey, 0, 0, lkey,
                      length][:len(_VALUES) if length else len(SQ_RDMA_HEADER.fields)]
            (SQ_RDMA_HEADER_AND_SGE if length else SQ_RDMA_HEADER).pack(*values)
            if len(self.templates) >= 8:
                self.templates.clear()
            self.templates[key] = values
        return values

    def wqes(self, template: list[int], count: int, local: Sequence[int] | None, remote: Sequence[int] | None,
             signaled: list[int], start: int, taken: int) -> None:
        """`count` WQEs of `template`'s values from ring slot `start` (below `slots`), `taken` slots apart: the i-th
        with `local[i]` in its SGE and `remote[i]` as its remote address (None: the template's), signaled if i is in
        `signaled`."""
        if self.static_slots:
            self._rows(template, count, local, remote, signaled, start, taken)
            return
        width = len(template)
        values = template * count
        if local is not None:
            values[_LOCAL::width] = local
        if remote is not None:
            values[_REMOTE::width] = remote
        for i in signaled:
            values[i * width + _FLAGS] = SIGNAL
        run = repeated(SQ_RDMA_HEADER_AND_SGE if width == len(_VALUES) else SQ_RDMA_HEADER, count)
        offset = start * SQ_SLOT
        if offset + run.size <= self.ring_bytes:
            run.pack_into(self.view, offset, *values)
            return
        packed, head = run.pack(*values), self.ring_bytes - offset  # slots wrap one by one at the ring's end
        self.view[offset:self.ring_bytes] = packed[:head]
        self.view[:run.size - head] = packed[head:]

    def _rows(self, template: list[int], count: int, local: Sequence[int] | None, remote: Sequence[int] | None,
              signaled: list[int], start: int, taken: int) -> None:
        """wqes() for static WQEs: rows of 64-bit words, one per WQE, the ring's words past each SGE untouched."""
        ring = self.ring
        assert ring is not None, "the send queue's memory was freed"
        layout = SQ_RDMA_HEADER_AND_SGE if len(template) == len(_VALUES) else SQ_RDMA_HEADER
        words = np.frombuffer(layout.pack(*template), WORD)[:layout.size // WORD.itemsize]
        base, step = words.copy(), [0] * len(words)
        columns = [(LOCAL_WORD, local), (REMOTE_WORD, remote)]
        for word, column in columns:  # first + i * step: every linear word, and the signal flags, in one add
            if isinstance(column, range):
                base[word], step[word] = column.start, column.step & ADDRESS_MAX
        wqes = ring.reshape(-1, taken * SLOT_WORDS)
        first = start // taken
        rows = wqes[first:first + count, :len(words)]
        wraps = len(rows) < count
        if wraps:
            rows = np.empty((count, len(words)), WORD)
        np.add(steps(count, tuple(step), tuple(signaled)), base, out=rows)
        for word, column in columns:
            if column is not None and not isinstance(column, range):
                rows[:, word] = np.array(column, WORD)
        if wraps:  # whole WQEs wrap: the first rows at the end, the rest from slot 0
            head = len(wqes) - first
            wqes[first:, :len(words)] = rows[:head]
            wqes[:count - head, :len(words)] = rows[head:]

    def search_entries(self, wqe_type: int, count: int, psn: int, npsn: int, msn: int, start: int,
                       taken: int) -> None:
        """The search-table entries of `count` messages of `npsn` PSNs each, the first starting at `psn`, numbered
        from `msn`, their WQEs `taken` slots apart from ring slot `start`. Between the points where the ring's slots
        or the MSN table's index wrap, the entries are a linear run (first + i * step); only a run whose PSNs wrap
        (once in 2^24 PSNs) takes the general path."""
        if psn + count * npsn > PSN_MASK:
            self._wrapping(wqe_type, count, psn, npsn, msn, start, taken)
            return
        wrap = -(-(self.slots - start) // taken)  # the WQEs that start before the ring's end
        head = self.entries - msn % self.entries if self.geometry.host_msn else count  # entries before the end
        first = 0
        for end in sorted({count, min(wrap, count), min(head, count)}):
            if end > first:
                self._linear(wqe_type, end - first, psn + first * npsn, npsn, msn + first,
                             (start + first * taken) % self.slots, taken)
                first = end

    def _linear(self, wqe_type: int, count: int, psn: int, npsn: int, msn: int, start: int, taken: int) -> None:
        """`count` entries in a row of the table: no field, slot or index wraps among them (search_entries)."""
        if self.geometry.host_msn:
            first = psn << _SP | (psn + npsn) << _NP | start << _SI
            delta = npsn << _SP | npsn << _NP | taken << _SI
            repeated(MSN_ENTRY, count).pack_into(self.view, self.geometry.table_offset + msn % self.entries
                                                 * MSN_ENTRY.size, *range(first, first + count * delta, delta))
            return
        table = self.table
        assert table is not None, "the send queue's memory was freed"
        base, step = [0] * _SEARCH_WORDS, [0] * _SEARCH_WORDS
        for (word, shift), value, delta in zip(_SEARCH_FIELDS, (self._opcode(wqe_type) | psn, psn + npsn, start),
                                               (npsn, npsn, taken)):
            base[word] |= value << shift
            step[word] += delta << shift
        index, stride = start >> self.unit_shift, taken >> self.unit_shift
        np.add(steps(count, tuple(step)), np.array(base, WORD),
               out=table[index:index + (count - 1) * stride + 1:stride])

    def _wrapping(self, wqe_type: int, count: int, psn: int, npsn: int, msn: int, start: int, taken: int) -> None:
        """search_entries of a run whose PSNs wrap: each entry on its own."""
        for i in range(count):
            next_psn = (psn + npsn) & PSN_MASK
            if self.geometry.host_msn:
                MSN_ENTRY.pack_into(self.view, self.geometry.table_offset + (msn + i) % self.entries * MSN_ENTRY.size,
                                    msn_entry(psn, next_psn, start))
            else:
                PSN_SEARCH_ENTRY.pack_into(self.view, self.geometry.table_offset + (start >> self.unit_shift)
                                           * PSN_SEARCH_ENTRY.size, *psn_search_values(wqe_type, psn, next_psn, start))
            psn, start = next_psn, (start + taken) % self.slots

    @staticmethod
    def _opcode(wqe_type: int) -> int:
        """The bits a PSN search entry's first field has for `wqe_type`, besides the PSN."""
        return psn_search_values(wqe_type, 0, 0, 0)[0]
