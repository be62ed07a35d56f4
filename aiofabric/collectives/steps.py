"""What every collective's run on a rank is made of, as scheduler calls: the run's input copied into the registered
work buffer, "our turn" and the ready message to the previous rank, the wait for the next rank's ready, writes of
pieces to the next rank (the first after its ready), waits for the pieces the previous rank writes, reductions, and
the averages' division. Each collective (communicator.py's ring, reduce.py, gather.py, scatter.py, sendrecv.py)
adds its own steps between them; the immediates are numbered per link in the order they are sent, which is the
order the receiver waits for them.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from . import layout
from .. import sched
from ..sched.calls import host_span
from ..sched.reduce import BFLOAT16
from ..verbs import MemoryRegion, QueuePair, RemoteRegion

MAX_PIECES = 32  # per chunk (the piece grows past the communicator's piece_bytes above this): a run's messages fit
# the receive pool, which holds 2 (size - 1) MAX_PIECES of them (launch.pool_depth)


class Link:
    """One direction of the ring as this rank sees it: the QP, and the peer's buffers as RemoteRegions."""

    def __init__(self, qp: QueuePair, peer_rank: int, work: RemoteRegion, landing: RemoteRegion) -> None:
        self.qp, self.peer_rank, self.work, self.landing = qp, peer_rank, work, landing


class Ring(Protocol):
    """What the steps need of a rank (a Communicator)."""
    rank: int
    size: int
    work: MemoryRegion | None
    landing: MemoryRegion | None
    next: Link | None
    prev: Link | None
    piece_bytes: int
    compute: sched.ComputeQueue
    copies: sched.CopyQueue


class Steps:
    """The calls of one run of collective `kind` at `comm`'s rank. `sends`/`receives`: whether this rank writes to
    the next rank / is written by the previous one in this run (a rank that does neither waits for no ready);
    `variant` names an algorithm other than the collective's first (oneshot.py's allreduce)."""

    def __init__(self, comm: Ring, kind: str, count: int, dtype: np.dtype[Any], op: str | None, root: int,
                 *, sends: bool = True, receives: bool = True, variant: str | None = None) -> None:
        assert comm.work is not None and comm.landing is not None and comm.next is not None and comm.prev is not None
        self.comm, self.kind, self.dtype, self.op = comm, kind, dtype, op
        self.isz = dtype.itemsize
        self.work, self.next, self.prev = comm.work, comm.next, comm.prev
        self.w = np.frombuffer(comm.work.view, dtype, comm.work.length // self.isz)
        self.lands = np.frombuffer(comm.landing.view, dtype, comm.landing.length // self.isz)
        # another algorithm for the same collective (`variant`) has its own digest: ranks that chose differently
        # fail at the ready message, before any data moves
        digest = layout.digest(kind, count, dtype.str, op, root, *([variant] if variant else []))
        self._send, self._receive = _Messages(kind, digest), _Messages(kind, digest)
        self.calls: list[sched.Call] = []
        self._first_write: sched.Call | None = None
        # our turn: a no-op on the copy queue that claims both buffers, so it runs after every earlier access to
        # them, in this batch (the planner) and in earlier runs of any batch (the copy queue's timeline: their copy
        # out is their last access); then the ready: the previous rank may write into our memory
        self.turn = sched.copy(self.w[:0], self.w[:0], queue=comm.copies, name="our turn")
        self.turn.writes = (host_span(comm.work), host_span(comm.landing))
        self._ready: sched.Call | None = None
        self.receives = receives
        self.wait_ready = sched.wait_imm(self.next.qp, imm=self._send.ready(), name="next is ready") if sends else None

    def piece(self, elements_per_message_group: int, groups: int) -> int:
        """Elements per message when a link carries `groups` stretches of at most `elements_per_message_group`
        elements: the communicator's piece, grown so no stretch is cut into more than 2 (size - 1) MAX_PIECES /
        groups messages (the receive pool's share)."""
        share = max(1, 2 * (self.comm.size - 1) * MAX_PIECES // max(groups, 1))
        return max(self.comm.piece_bytes // self.isz, -(-elements_per_message_group // share), 1)

    def copy_in(self, into: np.ndarray, x: np.ndarray) -> None:
        """The run's input into the work buffer (before our turn: it is the first access of this run)."""
        self.calls.append(sched.copy(into, x, queue=self.comm.copies, name="copy in"))

    def start(self) -> None:
        """Our turn, the ready to the previous rank (when it writes to us), the wait for the next rank's ready (when
        we write to it): after the copy in, before any transfer."""
        self.calls.append(self.turn)
        if self.receives:
            self.calls.append(sched.write_with_imm(self.prev.qp, self.work, self.prev.work, self._receive.ready(), 0,
                                                   name="ready to prev").after(self.turn))
        if self.wait_ready is not None:
            self.calls.append(self.wait_ready)

    def write(self, where: RemoteRegion, at: layout.Piece, remote_offset: int, label: str, *,
              local: MemoryRegion | None = None) -> None:
        """Elements `at` of our work buffer (or of `local`: the landing MR) into the next rank's `where` at
        `remote_offset` bytes."""
        assert self.wait_ready is not None, f"{self.kind}: a rank that sends nothing wrote"
        call = sched.write_with_imm(self.next.qp, local or self.work, where, self._send.next(), at.length * self.isz,
                                    local_offset=at.start * self.isz, remote_offset=remote_offset, name=label)
        if self._first_write is None:
            self._first_write = call.after(self.wait_ready)
        self.calls.append(call)

    def wait(self, landed: np.ndarray, label: str) -> None:
        """The previous rank's next message, which lands in `landed` (later readers of it wait for it)."""
        self.calls.append(sched.wait_imm(self.prev.qp, landed, imm=self._receive.next(), name=label))

    def reduce(self, acc: np.ndarray, landed: np.ndarray, label: str) -> None:
        """acc = acc OP landed (an average sums; `average` divides once at the end)."""
        op = "sum" if self.op == "avg" else self.op
        assert op is not None
        self.calls.append(sched.reduce.reduce(acc, acc, landed, op=op, queue=self.comm.compute, name=label))

    def average(self, acc: np.ndarray) -> None:
        """For op "avg": acc, fully summed, divided by the number of ranks (`divide`)."""
        if self.op == "avg" and acc.size:
            self.calls.append(sched.kernel(_divider(self.comm.size), [acc], [acc], queue=self.comm.compute,
                                           name=f"divide by {self.comm.size}"))

    def copy_out(self, out: np.ndarray, result: np.ndarray) -> None:
        self.calls.append(sched.copy(out, result, queue=self.comm.copies, name="copy out"))


def divide(x: np.ndarray, ranks: int) -> np.ndarray:
    """An average's last step, as NCCL's ncclAvg for each type: floating point divides (float16 and bfloat16 in
    float32, rounded once); integers divide truncating toward zero, as C does."""
    if floating(x.dtype):
        with np.errstate(all="ignore"):
            return np.asarray(x / x.dtype.type(ranks), x.dtype)
    quotient = x // ranks  # floors: one up for a negative x with a remainder
    if x.dtype.kind == "i":
        quotient += ((x % ranks) != 0) & (x < 0)
    return quotient.astype(x.dtype)


def floating(dtype: np.dtype[Any]) -> bool:
    """Whether `dtype` is a floating-point type (bfloat16, ml_dtypes', is not numpy's kind "f")."""
    return dtype.kind == "f" or dtype == BFLOAT16


def _divider(ranks: int) -> Any:
    def apply(out: np.ndarray, x: np.ndarray) -> None:
        out[...] = divide(x, ranks)
    apply.__name__ = f"divide_by_{ranks}"
    return apply


class _Messages:
    """The immediates of one link in one run: the ready message, then data messages numbered from 1."""

    def __init__(self, kind: str, digest: int) -> None:
        self.kind, self.digest, self.seq = kind, digest, 0

    def ready(self) -> int:
        return layout.ready_tag(self.kind, self.digest)

    def next(self) -> int:
        self.seq += 1
        return layout.tag(self.kind, self.digest, self.seq)
