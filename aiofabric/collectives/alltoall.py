"""Alltoall along the ring: part d of rank r's x goes to rank d, which keeps it as part r of its out. Each rank sends
the parts for every other rank to the next rank (the nearest first); each rank keeps the part for itself out of
what arrives and passes the rest on at the next step, so the part for the rank h hops on travels h hops. A run's
landing memory is never reused: a slot for the part from each origin, and one for each part passing through at each
hop (layout.alltoall_landing), so the landing MR must hold that (launch's landing_bytes)."""
from __future__ import annotations

import numpy as np

from . import layout
from .steps import Ring, Steps
from .. import sched


def alltoall_calls(comm: Ring, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                   root: int) -> list[sched.Call]:
    rank, size, c = comm.rank, comm.size, count
    run = Steps(comm, "alltoall", count, x.dtype, None, 0)
    next_link, landing = comm.next, comm.landing
    assert next_link is not None and landing is not None
    w, lands, isz = run.w[:c * size], run.lands, run.isz
    piece = run.piece(c, size * (size - 1) // 2)  # every part's hops on a link

    def slot(hop: int, beyond: int, origin: int) -> int:
        """Element offset, in the landing memory of the rank `hop` hops from `origin`, of the part for the rank
        `beyond` hops further on: the rank's own part lands in its origin's slot, the others in the hop's."""
        if beyond == 0:
            return origin * c
        return c * (size + sum(size - 1 - k for k in range(1, hop)) + beyond - 1)

    def send(start: int, hop: int, beyond: int, origin: int, label: str, passing: bool) -> None:
        """The part at element `start` of our work memory (`passing`: of our landing memory, each piece once it has
        landed) to the next rank, `hop` hops from its origin, for the rank `beyond` hops past it."""
        remote = slot(hop, beyond, origin)
        for at in layout.pieces(layout.Piece(start, c), isz, piece * isz):
            if passing:
                run.wait(lands[at.start:at.start + at.length], f"{label} landed")
            run.write(next_link.landing, at, (remote + at.start - start) * isz, label,
                      local=landing if passing else None)

    run.copy_in(w, x)
    run.start()
    for ahead in range(1, size):  # our own parts, the nearest rank's first
        destination = (rank + ahead) % size
        send(destination * c, 1, ahead - 1, rank, f"a2a {rank}->{destination}", False)
    for hop in range(1, size):  # what the previous rank sent, in its order: its own parts, then what it passed on
        origin = (rank - hop) % size
        mine = slot(hop, 0, origin)
        for at in layout.pieces(layout.Piece(mine, c), isz, piece * isz):
            run.wait(lands[at.start:at.start + at.length], f"a2a {origin}->{rank} landed")
        for beyond in range(1, size - hop):
            send(slot(hop, beyond, origin), hop + 1, beyond - 1, origin,
                 f"a2a {origin}->{(rank + beyond) % size} via {rank}", True)
    for origin in range(size):
        source = w[rank * c:(rank + 1) * c] if origin == rank else lands[origin * c:(origin + 1) * c]
        run.copy_out(out[origin * c:(origin + 1) * c], source)
    return run.calls
