"""Allreduce of small arrays in size - 1 hops: every rank's whole x travels the ring (each rank passes on what
arrived, piece by piece, as soon as it landed), and each rank reduces all of them itself, chunk c in the ring's
order (from rank c + 1 to rank c, `mine OP arrived`), so the result is the ring allreduce's bit for bit.

The ring's reduce-scatter and allgather take 2 (size - 1) hops, each a message through both NICs; here a link carries
size - 1 whole arrays instead of 2 (size - 1) / size of one, which costs less than the hops it saves up to
ONESHOT_BYTES (a 4-rank allreduce of 1-64 KiB takes half the time; at 256 KiB the two are even: bench/RESULTS.md,
"Collectives without dead time"). Rank j's array lands in slot j of every rank's landing MR (its own is copied in),
so the landing MR holds size arrays (launch sizes it so up to ONESHOT_BYTES).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from . import layout
from .steps import Ring, Steps, divide
from .. import sched
from ..sched.reduce import check_arguments, reduction

ONESHOT_BYTES = 64 << 10  # the largest array (bytes) an allreduce sends whole along the ring


def fits(comm: Ring, count: int, itemsize: int, landing_capacity: int, limit: int = ONESHOT_BYTES) -> bool:
    """Whether an allreduce of `count` elements of `itemsize` bytes goes one-shot: small enough, and every rank's
    array fits the landing MR."""
    return 0 < count * itemsize <= limit and comm.size * count * itemsize <= landing_capacity


def oneshot_calls(comm: Ring, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                  root: int) -> list[sched.Call]:
    rank, size = comm.rank, comm.size
    run = Steps(comm, "allreduce", count, x.dtype, op, root, variant="oneshot")
    assert comm.next is not None and comm.landing is not None and op is not None
    isz = run.isz
    slots = run.lands[:size * count]
    pieces = layout.pieces(layout.Piece(0, count), isz, run.piece(count, size - 1) * isz)
    run.copy_in(slots[rank * count:(rank + 1) * count], x)
    run.start()
    for step in range(size - 1):
        sent, got = (rank - step) % size, (rank - step - 1) % size  # ours first, then what arrived last
        for at in pieces:
            start = sent * count + at.start
            run.write(comm.next.landing, layout.Piece(start, at.length), start * isz, f"os {step} array {sent}",
                      local=comm.landing)
        for at in pieces:
            start = got * count + at.start
            run.wait(slots[start:start + at.length], f"os {step} landed {got}")
    result = run.w[:count]
    check_arguments(result, slots[:count], result, "one-shot allreduce")
    run.calls.append(sched.kernel(ring_order(size, count, x.dtype, op), [result], [slots], queue=comm.compute,
                                  name=f"reduce {size} arrays"))
    run.copy_out(out, result)
    return run.calls


def ring_order(size: int, count: int, dtype: np.dtype[Any], op: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """A kernel `(out, slots)`: out = the arrays in `slots` (size x count elements, rank j's in slot j) reduced as
    the ring reduces them: chunk c is rank c + 1's, then each later rank's applied as `mine OP arrived`, ending with
    rank c's (divided by size for "avg"), as reference.ring_reference computes it. Each step gathers its operands
    (rank (c + k) % size's chunk c, for every c) into one array and applies the ring's reduction to it whole."""
    found = reduction("sum" if op == "avg" else op, dtype)
    chunk_of = np.repeat(np.arange(size), [piece.length for piece in layout.chunks(count, size)])
    element = np.arange(count)
    first, *later = [((chunk_of + k) % size) * count + element for k in range(1, size + 1)]
    operand = np.empty(count, dtype)
    # the reduction's own function, called without its argument checks: the arrays are the communicator's, checked
    # by reduce() when compiled (a kernel of a few µs would spend most of its time checking)
    if found.kernel is not None:
        function, length = found.kernel.function, ctypes.c_int64(count)
        source = ctypes.c_void_p(operand.ctypes.data)
        seen: list[Any] = [None, None]  # the out array of the last call and its address (reading one costs ~2 µs)

        def apply(out: np.ndarray) -> None:
            if seen[0] is not out:
                seen[:] = out, ctypes.c_void_p(out.ctypes.data)
            function(seen[1], source, seen[1], length)  # out = operand OP out
    else:
        ufunc = found.ufunc

        def apply(out: np.ndarray) -> None:
            with np.errstate(all="ignore"):
                ufunc(operand, out, out=out)

    def reduce_in_ring_order(out: np.ndarray, slots: np.ndarray) -> None:
        slots.take(first, out=out)
        for index in later:
            slots.take(index, out=operand)
            apply(out)  # mine OP arrived
        if op == "avg":
            out[...] = divide(out, size)
    reduce_in_ring_order.__name__ = f"reduce_{size}_in_ring_order"
    return reduce_in_ring_order
