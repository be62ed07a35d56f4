"""Sendrecv as nccl-tests' sendrecv_perf runs it: every rank sends its x to the next rank and receives the previous
rank's into out, at once. The data lands in the next rank's landing MR, apart from the work buffer it sends from."""
from __future__ import annotations

import numpy as np

from . import layout
from .steps import Ring, Steps
from .. import sched


def sendrecv_calls(comm: Ring, x: np.ndarray, out: np.ndarray, count: int, op: str | None,
                   root: int) -> list[sched.Call]:
    run = Steps(comm, "sendrecv", count, x.dtype, None, 0)
    assert comm.next is not None
    w, lands, isz = run.w[:count], run.lands[:count], run.isz
    pieces = layout.pieces(layout.Piece(0, count), isz, run.piece(count, 1) * isz)
    run.copy_in(w, x)
    run.start()
    for at in pieces:
        run.write(comm.next.landing, at, at.start * isz, f"send {at.start}")
    for at in pieces:
        run.wait(lands[at.start:at.start + at.length], f"received {at.start}")
    run.copy_out(out, lands)
    return run.calls
