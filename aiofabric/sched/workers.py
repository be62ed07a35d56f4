"""The workers that run a compiled batch, one task per queue of its plan.

A host queue (compute, copy) runs its calls one at a time; a QP queue posts its calls in order (those that need not
wait behind one doorbell) and a second task retires their completions in order, so RDMA work pipelines on the wire
while waits and fences still hold. Each call waits for its submission's waits (other queues' signals) and, first on
its queue, for its device's timeline; it signals its queue when something waits for it. A worker that fails records
the failure and aborts the run (`RunState.fail`); an aborted QP worker first lets the NIC finish what it was given.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable, Sequence

import anyio
import anyio.lowlevel
import numpy as np

from .calls import RECEIVE_VERBS, Call, qp_name, queue_name
from .plan import Submission, Wait
from .pool import NO_SGE, pool_of
from .timeline import Counter, Timeline
from ..errors import ImmediateMismatchError
from ..verbs import QPState, QueuePair

log = logging.getLogger("aiofabric.sched")

COPY_IN_THREAD_BYTES = 256 << 10  # below this a memcpy is cheaper than the hop to a worker thread
YIELD_EVERY = 32  # inline calls a host worker runs before it lets the rest of the loop in
DRAIN_TIMEOUT = 5.0  # seconds an aborted QP worker waits for work it already posted
RECEIVE_GRACE = 1.0  # ... and for its receives, whose matching sends may still be on the wire


@dataclasses.dataclass(frozen=True)
class RunState:
    """One run of a batch as its workers share it: the calls and their prepared work (this binding's), the immediate
    each call's completion must carry (wait_imm(imm=)), how a call is posted on its QP, each queue's signal, each
    call's (start, end) in perf_counter_ns, and `fail`, which records a worker's failure and aborts the run."""
    calls: list[Call]
    prepared: list[Any]
    expected_imm: list[int | None]
    post: Callable[[QueuePair, Call, tuple[Any, ...]], Awaitable[Any]]
    signals: list[Counter]
    records: list[tuple[int, int]]
    fail: Callable[[Submission | None, BaseException], None]


async def host_worker(state: RunState, qi: int, submissions: list[Submission], timeline: Timeline, ticket: int) -> None:
    """Run a compute or copy queue's calls one at a time, each after its waits; kernels and small copies inline
    (letting the loop in every YIELD_EVERY), threaded kernels and large copies in a worker thread."""
    signals, records, fail = state.signals, state.records, state.fail
    signal, prepared, calls = signals[qi], state.prepared, state.calls
    clock, checkpoint, to_thread = time.perf_counter_ns, anyio.lowlevel.checkpoint, anyio.to_thread.run_sync
    submission = None
    try:
        inline = 0
        for submission in submissions:
            if submission.timeline_wait:
                await timeline.wait_for(ticket - 1)
            for wait in submission.waits:
                await signals[wait.queue].wait_for(wait.value)
            index = submission.call
            call, work = calls[index], prepared[index]
            start = clock()
            if call.kind == "kernel":
                fn, args = work
                if call.options["threaded"]:
                    await to_thread(fn, *args)  # cancellation waits for the thread: nothing runs behind us
                else:
                    fn(*args)
                    inline += 1
            else:
                dst, src = work
                if dst.nbytes >= COPY_IN_THREAD_BYTES:
                    await to_thread(np.copyto, dst, src)
                else:
                    np.copyto(dst, src)
                    inline += 1
            records[index] = (start, clock())
            if submission.signal is not None:
                signal.set(submission.signal)
            if inline >= YIELD_EVERY:
                inline = 0
                await checkpoint()
    except BaseException as error:
        if _cancelled(error):
            raise
        fail(submission, error)


async def qp_worker(state: RunState, qi: int, submissions: list[Submission], timeline: Timeline, ticket: int,
                    qp: QueuePair) -> None:
    """Post in order (waits, fences), retire completions in order (end times, signals) in a second task."""
    signals, records, fail = state.signals, state.records, state.fail
    calls, prepared, post = state.calls, state.prepared, state.post
    signal, clock = signals[qi], time.perf_counter_ns
    completions: list[Any] = [None] * len(submissions)
    starts = [0] * len(submissions)
    posted, retired = Counter(), Counter()
    expected = state.expected_imm

    async def retire() -> None:
        submission = None
        try:
            for k, submission in enumerate(submissions):
                await posted.wait_for(k + 1)
                done = await completions[k]
                want = expected[submission.call]
                if want is not None and done.imm != want:
                    raise ImmediateMismatchError(want, done.imm)
                records[submission.call] = (starts[k], clock())
                retired.set(k + 1)
                if submission.signal is not None:
                    signal.set(submission.signal)
        except BaseException as error:
            if _cancelled(error):
                raise
            fail(submission, error)

    submission = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(retire)
            try:
                k, count = 0, len(submissions)
                while k < count:
                    submission = submissions[k]
                    if submission.timeline_wait:
                        await timeline.wait_for(ticket - 1)
                    for wait in submission.waits:
                        await signals[wait.queue].wait_for(wait.value)
                    if submission.fence:
                        await retired.wait_for(k)  # an earlier call on this QP touches our memory: drain it
                    with qp.batch():  # this post and the ones after it that need not wait: one doorbell
                        while True:
                            starts[k] = clock()
                            completions[k] = await post(qp, calls[submission.call], prepared[submission.call])
                            k += 1
                            posted.set(k)
                            if k == count or not _ready(submissions[k], k, timeline, ticket, signals, retired):
                                break
                            submission = submissions[k]
            except BaseException as error:
                if _cancelled(error):
                    raise
                fail(submission, error)
    finally:
        outstanding = [(calls[submissions[k].call].kind, completions[k])
                       for k in range(retired.value, len(completions)) if completions[k] is not None]
        if outstanding:  # aborted: let the NIC finish what it was given before the buffers are handed back
            await _drain(qp, outstanding)


async def post_call(qp: QueuePair, call: Call, args: tuple[Any, ...]) -> Any:
    """Post RDMA call `call` on `qp` with its prepared `args` (local, remote, size); its completion, to await."""
    local, remote, size = args
    o = call.options
    if call.kind == "write":
        return await qp.post_write(local, remote, size, local_offset=o["local_offset"],
                                   remote_offset=o["remote_offset"])
    if call.kind == "write_with_imm":
        return await qp.post_write_with_imm(local, remote, o["imm"], size, local_offset=o["local_offset"],
                                            remote_offset=o["remote_offset"])
    if call.kind == "read":
        return await qp.post_read(local, remote, size, local_offset=o["local_offset"],
                                  remote_offset=o["remote_offset"])
    if call.kind == "send":
        return await qp.post_send(local, size, local_offset=o["local_offset"])
    pool = pool_of(qp)
    if call.kind == "recv":
        if pool is not None:  # receives complete in posting order: this one would take a pooled message
            raise ValueError(f"{call.name}: {qp_name(qp)} has a receive pool (sched.receive_pool), whose "
                             "receives come first; receive into memory on another QP, or use write_with_imm "
                             "and wait_imm")
        return await qp.post_recv(local, size, local_offset=o["local_offset"])
    if pool is not None:
        return await pool.take()
    return await qp.post_recv(NO_SGE, 0)  # wait_imm: a receive without memory, consumed by WRITE_WITH_IMM


async def finalise(waits: Sequence[Wait], signals: list[Counter], timeline: Timeline, ticket: int) -> None:
    """A device's finaliser: once the last call of each of its queues in the batch completed, publish the epoch
    (later runs on the device may start)."""
    for wait in waits:
        await signals[wait.queue].wait_for(wait.value)
    timeline.complete(ticket)


def _cancelled(error: BaseException) -> bool:
    """Whether a worker must let `error` pass: cancellation, or its coroutine being closed. Anything else a call
    raises aborts the batch through `fail`, SystemExit and KeyboardInterrupt included: left to escape a worker, they
    stopped the asyncio loop with the batch's other tasks never run, and came out of trio in an exception group."""
    return isinstance(error, (anyio.get_cancelled_exc_class(), GeneratorExit))


def _ready(submission: Submission, k: int, timeline: Timeline, ticket: int, signals: list[Counter],
           retired: Counter) -> bool:
    """Whether submission `k` of a QP worker may be posted without waiting for anything (a batch of posts never
    spans a wait: other tasks' posts to the QP would be held back with ours)."""
    return ((not submission.timeline_wait or timeline.value >= ticket - 1)
            and all(signals[wait.queue].value >= wait.value for wait in submission.waits)
            and (not submission.fence or retired.value >= k))


async def _drain(qp: QueuePair, outstanding: list[tuple[str, Any]]) -> None:
    """After an abort: wait for the work a QP worker posted. Sends, writes and reads finish by themselves; a
    receive finishes only when a peer sends, and left posted it would take the next message meant for someone
    else (the next run's). So receives get a short grace, then the QP goes to ERR, which flushes them (the run's
    error says so, and how to reset it)."""
    async def settle(completions: list[Any], seconds: float) -> None:
        with anyio.move_on_after(seconds):
            for completion in completions:
                try:
                    await completion
                except Exception:
                    pass

    with anyio.CancelScope(shield=True):
        await settle([c for kind, c in outstanding if kind not in RECEIVE_VERBS], DRAIN_TIMEOUT)
        receives = [c for kind, c in outstanding if kind in RECEIVE_VERBS]
        await settle(receives, RECEIVE_GRACE)
        if any(not c.done for c in receives) and not qp.closed and qp.state is not QPState.ERR:
            log.warning("%s: a batch run ended with receives still posted; moving the QP to ERR to flush them",
                        queue_name(qp))
            try:
                with anyio.move_on_after(DRAIN_TIMEOUT):
                    await qp.modify(QPState.ERR)
            except Exception as error:  # the device is gone or refused: the receives fail with it, or stay
                log.warning("%s: could not move to ERR: %s", queue_name(qp), error)
            await settle(receives, DRAIN_TIMEOUT)
