"""Gather to a root along the ring: the rank after the root sends its x to the next, each later rank sends its own
and then passes on what arrived, in arrival order, until the rank before the root hands the root every other
rank's part. Every part lands at its final offset of the next rank's work buffer (no memory reused in a run)."""
from __future__ import annotations

import numpy as np

from . import layout
from .steps import Ring, Steps
from .. import sched


def gather_calls(comm: Ring, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                 root: int) -> list[sched.Call]:
    rank, size = comm.rank, comm.size
    position = (rank - root) % size or size  # hops from the root along the ring; the root is the last, `size`
    run = Steps(comm, "gather", count, x.dtype, None, root, sends=rank != root, receives=position != 1)
    assert comm.next is not None
    w, isz = run.w[:count * size], run.isz
    piece = run.piece(count, size - 1)  # a link carries at most size - 1 parts

    def part(of: int) -> layout.Piece:
        return layout.Piece(of * count, count)

    run.copy_in(w[rank * count:(rank + 1) * count], x)
    run.start()
    if rank != root:
        for at in layout.pieces(part(rank), isz, piece * isz):
            run.write(comm.next.work, at, at.start * isz, f"gather {rank}")
    for hops in range(position - 1, 0, -1):  # the previous rank sent its own first, then what it passed on
        origin = (root + hops) % size
        for at in layout.pieces(part(origin), isz, piece * isz):
            run.wait(w[at.start:at.start + at.length], f"gather landed {origin}")
            if rank != root:
                run.write(comm.next.work, at, at.start * isz, f"gather pass {origin}")
    if rank == root:
        run.copy_out(out, w)
    return run.calls
