"""Ring arithmetic both sides of the host interface share: slots, lap parity, the valid bit, doorbell counts.

Producer and consumer are free-running counts. The slot of count `c` in a ring of `depth` entries is `c % depth` and
its epoch is the lap parity `c // depth & 1`. Doorbells carry (slot, epoch), never the count (`position`); the side
that reads a doorbell recovers the count from what it already knows (`producer_from_doorbell`,
`consumer_from_doorbell`).

Rings the device writes (CQs, NQs, the CREQ) mark each entry with a valid bit the device sets to 1 on lap 0, 0 on
lap 1, and so on (bindings: CQ_BASE_TOGGLE, NQ_CN_V, CREQ_BASE_V), so the entry at consumer count `c` is new when its
bit equals `phase(c, depth)`. `RingEntry` knows where that bit lives in one kind of entry: the driver asks
`is_new`, the emulator writes entries with `publish` (valid byte last, as the drivers rely on).
"""
from __future__ import annotations

import dataclasses
import functools


def slot(count: int, depth: int) -> int:
    """The slot free-running `count` lands in."""
    return count % depth


def epoch(count: int, depth: int) -> int:
    """The lap parity of `count`: what a doorbell's epoch bit carries."""
    return count // depth & 1


def phase(count: int, depth: int) -> int:
    """The valid bit the device writes into the entry at `count`: 1 on even laps, 0 on odd ones."""
    return count // depth & 1 ^ 1


def position(count: int, depth: int) -> tuple[int, int]:
    """(slot, epoch) of `count`: the index and epoch of a doorbell that names it."""
    lap, index = divmod(count, depth)
    return index, lap & 1


def producer_from_doorbell(consumed: int, index: int, epoch: int, depth: int) -> int | None:
    """The free-running producer count a producer doorbell (SQ, RQ) names, given what the device already consumed.

    The producer is at most one ring ahead of the consumer: of the counts in [consumed, consumed + depth] with that
    slot, the epoch picks one. None when the doorbell names nothing plausible (a stale or corrupt index).
    """
    if not 0 <= index < depth:
        return None
    count = consumed + (index - consumed) % depth
    if (count // depth) & 1 != epoch:
        if count != consumed:
            return None
        count += depth  # the driver filled the whole ring
    return count


def consumer_from_doorbell(produced: int, consumed: int, index: int, epoch: int, depth: int) -> int:
    """The free-running consumer count a consumer doorbell (CQ, NQ, CREQ) names, given what the device produced.

    Of the counts in [produced - depth, produced] with that slot, the epoch picks one; a doorbell naming an older
    count than `consumed` (stale, or reordered) leaves the consumer where it is.
    """
    if not 0 <= index < depth:
        return consumed
    candidate = produced - (produced - index) % depth
    if (candidate // depth) & 1 != epoch:
        candidate -= depth
    return max(consumed, candidate)


@dataclasses.dataclass(frozen=True)
class RingEntry:
    """One kind of device-written ring entry: its size and where its valid bit is (byte `valid_offset`, mask
    `valid_bit`)."""
    size: int
    valid_offset: int
    valid_bit: int

    def is_new(self, view: memoryview | bytearray | bytes, offset: int, count: int, depth: int) -> bool:
        """Driver side: whether the entry at byte `offset` of `view`, the ring's entry at `count`, was written on
        this lap (read its body only after this says so)."""
        return view[offset + self.valid_offset] & self.valid_bit == (self.valid_bit if count // depth & 1 == 0 else 0)

    def new_entries(self, view: memoryview, count: int, depth: int, limit: int) -> int:
        """Driver side: how many entries from `count` on were written on their lap, at most `limit`: each one's own
        valid bit is read (all at once, up to the ring's end and then from slot 0), none of their bodies (read them
        after a read barrier)."""
        found, window = 0, 16  # looked at in growing windows: a strided copy costs per byte, and most polls find few
        while found < limit:
            slot, lap = (count + found) % depth, (count + found) // depth
            last = min(depth, slot + limit - found, slot + window)
            bits = view[slot * self.size + self.valid_offset:last * self.size:self.size].tobytes()
            stale = bits.translate(self._set).find(lap & 1)  # the bit is set on even laps, clear on odd ones
            if stale >= 0:
                return found + stale
            found, window = found + last - slot, window * 4
        return found

    @functools.cached_property
    def _set(self) -> bytes:
        """A translation table: 1 for a valid byte with the valid bit set, else 0."""
        return bytes(1 if value & self.valid_bit else 0 for value in range(256))

    def publish(self, view: memoryview, entry: bytes, count: int, depth: int) -> None:
        """Device side: write `entry` into `view` (the entry's `size` bytes of ring memory) with the valid bit of
        `count`'s lap, the byte holding it last."""
        valid = self.valid_offset
        view[:valid] = entry[:valid]
        view[valid + 1:self.size] = entry[valid + 1:self.size]
        view[valid] = entry[valid] & ~self.valid_bit | (self.valid_bit if count // depth & 1 == 0 else 0)


def power_of_two(count: int) -> int:
    """The smallest power of two >= `count`: what a ring's depth must be."""
    return 1 << max(count - 1, 0).bit_length()
