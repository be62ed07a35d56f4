"""Atomics at the responder (rxe_resp.c `atomic_reply`), sans-IO: executing one, and keeping its result for duplicates.

The responder checks the rkey, the region's and the QP's REMOTE_ATOMIC access and the bounds first (NAK remote access
error), then the 8-byte alignment of the address (NAK invalid request). Then the 64-bit value in host memory
(little-endian) is replaced, wrapping mod 2^64 (`execute`), and the original goes back in the AtomicAckETH. The
original is also kept, by PSN, among the QP's responder resources (`AtomicResults`): at most max_dest_rd_atomic
results, the oldest given up first (rxe recycles its resources the same way), which is as many atomics as the
requester may have unanswered. A duplicate is answered from there, never executed again.
"""
from __future__ import annotations

import collections

from .dma import Buffer
from .packets import FETCH_ADD
from ..hw.wqe import ATOMIC_SIZE

ATOMIC_MASK = (1 << 8 * ATOMIC_SIZE) - 1


def execute(target: Buffer, op: int, swap_add: int, compare: int) -> int:
    """Apply the atomic `op` (FETCH_ADD, or else COMPARE_SWAP) to the 64-bit little-endian value in `target`; the value
    before."""
    original = int.from_bytes(target[0:ATOMIC_SIZE], "little")
    if op == FETCH_ADD:
        target[0:ATOMIC_SIZE] = ((original + swap_add) & ATOMIC_MASK).to_bytes(ATOMIC_SIZE, "little")
    elif original == compare:
        target[0:ATOMIC_SIZE] = swap_add.to_bytes(ATOMIC_SIZE, "little")
    return original


class AtomicResults:
    """The originals of the atomics one QP's responder executed, by PSN, oldest first."""

    def __init__(self) -> None:
        self.originals: collections.OrderedDict[int, int] = collections.OrderedDict()

    def save(self, psn: int, original: int, max_dest_rd_atomic: int) -> None:
        """Keep an atomic's result, giving up the oldest beyond max_dest_rd_atomic (0 counts as 1)."""
        originals = self.originals
        originals[psn] = original
        while len(originals) > max(1, max_dest_rd_atomic):
            originals.popitem(last=False)

    def get(self, psn: int) -> int | None:
        return self.originals.get(psn)

    def clear(self) -> None:
        self.originals.clear()
