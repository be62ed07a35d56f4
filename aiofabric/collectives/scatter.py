"""Scatter from a root along the ring: the root sends every other rank's part to the next rank, the farthest
first; each rank passes on the parts for ranks after it as they arrive and keeps the last, its own. Every part lands
at its final offset of the next rank's work buffer (no memory reused in a run)."""
from __future__ import annotations

import numpy as np

from . import layout
from .steps import Ring, Steps
from .. import sched


def scatter_calls(comm: Ring, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                  root: int) -> list[sched.Call]:
    rank, size = comm.rank, comm.size
    position = (rank - root) % size  # hops from the root along the ring
    run = Steps(comm, "scatter", count, x.dtype, None, root, sends=position != size - 1, receives=rank != root)
    assert comm.next is not None
    w, isz = run.w[:count * size], run.isz
    piece = run.piece(count, size - 1)  # a link carries at most size - 1 parts
    if rank == root:
        run.copy_in(w, x)
    run.start()
    for hops in range(size - 1, position - 1 if rank != root else 0, -1):
        destination = (root + hops) % size
        for at in layout.pieces(layout.Piece(destination * count, count), isz, piece * isz):
            if rank != root:
                run.wait(w[at.start:at.start + at.length], f"scatter landed {destination}")
            if hops != position:
                run.write(comm.next.work, at, at.start * isz, f"scatter {destination}")
    run.copy_out(out, w[rank * count:(rank + 1) * count])
    return run.calls
