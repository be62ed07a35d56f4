"""Reduce to a root along the ring: a chain that starts at the rank after the root, each rank adding its x to what
arrived (`mine OP arrived`, the ring's order) and passing it on, piece by piece, so the hops pipeline; the root's is
the last reduction. Each piece lands in its own place of the next rank's landing MR."""
from __future__ import annotations

import numpy as np

from . import layout
from .steps import Ring, Steps
from .. import sched


def reduce_calls(comm: Ring, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                 root: int) -> list[sched.Call]:
    rank, size = comm.rank, comm.size
    first = (root + 1) % size  # starts the chain: receives nothing
    run = Steps(comm, "reduce", count, x.dtype, op, root, sends=rank != root, receives=rank != first)
    assert comm.next is not None
    w, lands, isz = run.w[:count], run.lands[:count], run.isz
    piece = run.piece(count, 1)
    run.copy_in(w, x)
    run.start()
    for at in layout.pieces(layout.Piece(0, count), isz, piece * isz):
        part = slice(at.start, at.start + at.length)
        if run.receives:
            run.wait(lands[part], f"reduce landed {at.start}")
            run.reduce(w[part], lands[part], f"reduce {at.start}")
        if rank != root:
            run.write(comm.next.landing, at, at.start * isz, f"reduce send {at.start}")
    if rank == root:
        run.average(w)
        run.copy_out(out, w)
    return run.calls
