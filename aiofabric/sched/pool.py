"""Receive pools: memoryless receives kept posted on a QP, so a peer's WRITE_WITH_IMM never meets an RNR NAK.

A batch's `wait_imm` posts its receive when its turn comes; a peer that runs ahead (its next run, or the next
collective) would find none posted and be told to retry (RNR NAK, then a retransmission after the RNR timer). With a
pool the receives are posted before anything is sent and one is re-posted for every one taken, so up to `depth`
immediates may arrive before anyone waits for them; they wait, completed, in the pool. A protocol that never lets a
peer get more than `depth` messages ahead of its reader (a ready message per run, credits) never meets one.

RC receives complete in the order they were posted, so every receive on a pooled QP must come from the pool: a
`recv` with memory on such a QP is refused (it would take a pooled message).
"""
from __future__ import annotations

import collections
import weakref

from ..verbs import Completion, LocalBuffer, QPState, QueuePair

NO_SGE = LocalBuffer(0, 0, 0)  # a receive without memory: WRITE_WITH_IMM consumes it (its data went elsewhere)
_pools: weakref.WeakKeyDictionary[QueuePair, ReceivePool] = weakref.WeakKeyDictionary()


class ReceivePool:
    """`depth` memoryless receives posted on `qp`, handed out in order by `take()`."""

    def __init__(self, qp: QueuePair, depth: int) -> None:
        self.qp, self.depth = qp, depth
        self.posted: collections.deque[Completion] = collections.deque()  # posted, not yet taken

    async def fill(self) -> None:
        while len(self.posted) < self.depth:
            self.posted.append(await self.qp.post_recv(NO_SGE, 0))

    async def take(self) -> Completion:
        """The oldest posted receive (complete, or completing when the next immediate arrives); a new one is posted
        in its place first, so the pool keeps `depth` receives ahead of its reader. Receives an earlier failure
        flushed are dropped once the QP was reset (left ERR): the pool posts afresh on the reconnected QP."""
        if self.qp.state is not QPState.ERR:
            while self.posted and self.posted[0].done and self.posted[0].error is not None:
                self.posted.popleft()
        await self.fill()
        self.posted.append(await self.qp.post_recv(NO_SGE, 0))
        return self.posted.popleft()


async def receive_pool(qp: QueuePair, depth: int) -> ReceivePool:
    """Keep `depth` memoryless receives posted on `qp` (INIT, RTR or RTS) from now on: `wait_imm` calls on it take
    theirs from the pool. The QP's receive queue needs room for `depth` plus the receives a run holds at once
    (`create_qp(rq_depth=...)`). Calling it again grows the pool, never shrinks it."""
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth < qp.rq.depth:
        raise ValueError(f"receive_pool: depth must be an integer in [1, {qp.rq.depth - 1}] (the QP's receive queue "
                         f"holds {qp.rq.depth}), not {depth!r}")
    pool = _pools.get(qp)
    if pool is None:
        pool = _pools[qp] = ReceivePool(qp, depth)
    pool.depth = max(pool.depth, depth)
    await pool.fill()
    return pool


def pool_of(qp: QueuePair) -> ReceivePool | None:
    return _pools.get(qp)
