"""Compiled batches: planned once, replayed from one event loop with one async worker per queue.

`Batch` holds the plan (`plan`), the inputs and each call's prepared work (`binding`), and runs them: a run takes
a ticket on every device's timeline in one synchronous step (so batches that share a device run in a total order and
never deadlock), starts a worker per queue (`workers`) and names the first call that failed. A per-batch `Timeline`
is the reuse fence: run N+1 starts only after run N finished, failed or was cancelled.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import anyio

from .binding import Bindings, Inputs
from .calls import RECEIVE, Call, QPQueue, qp_name, queue_name
from .plan import Plan, Submission, plan
from .timeline import Counter, Timeline, timeline_of
from .trace import CallTrace, write_chrome_trace
from .workers import RunState, finalise, host_worker, post_call, qp_worker
from ..errors import BatchTimeoutError, BindingError, CallError
from ..verbs import QPState


class Batch:
    """A compiled batch. `await batch.run(bindings)` replays it; `describe()`, `to_dot()` and `trace(path)` show
    the plan and the last run. Build one with `sched.compile(calls, inputs=...)`."""

    _post = staticmethod(post_call)  # how its QP workers post a call: an attribute, so one batch's can be wrapped

    def __init__(self, calls: Iterable[Call], inputs: Inputs | None = None) -> None:
        self.calls = list(calls)
        if not self.calls:
            raise ValueError("a batch needs at least one call")
        _check_order(self.calls)
        self.plan: Plan = plan(call.access() for call in self.calls)
        self._queue_submissions = self.plan.queue_submissions()
        self._fence = Timeline()
        # per call, the immediate its completion must carry (wait_imm(imm=)), looked up by the QP workers
        self._expected_imm = [call.options.get("imm") if call.kind == "wait_imm" else None for call in self.calls]
        self.bindings = Bindings(self.calls, self.plan, inputs)
        self.input_names = self.bindings.input_names
        self._records: list[tuple[int, int]] = []
        self._active = 0  # runs started and not finished (waiting at the fence included)
        self.runs = 0

    def bind(self, bindings: Inputs) -> None:
        """Rebind inputs (all or some, by name or position) without planning again: same size and dtype, the same
        NIC for QPs and MRs, and no memory shared with the batch's other buffers that the plan did not order. All
        or nothing: a refused binding changes nothing. Not while a run is in progress (pass them to `run()`)."""
        if self._active:
            raise BindingError("a run of this batch is in progress; pass the bindings to run(), which waits for it")
        self.bindings.bind(bindings)

    # -- running ------------------------------------------------------------------------------------------------
    async def run(self, bindings: Inputs | None = None, *, timeout: float | None = None) -> None:
        """Run the batch once (after rebinding `bindings`); raises `CallError` naming the first call that failed.
        A call raising SystemExit or KeyboardInterrupt (any BaseException but a cancellation) aborts the batch the
        same way, then that exception leaves as itself, with a note naming the call (Python >= 3.11). With
        `timeout`, a run that has not finished that many seconds after it started (its turn after the previous run)
        is aborted the same way and raises `BatchTimeoutError` naming the calls still pending."""
        number = self._fence.take()
        tickets: dict[Any, int] = {}
        self._active += 1
        try:
            await self._fence.wait_for(number - 1)  # the reuse fence: never overlap our own previous run
            if bindings is not None:
                self.bindings.bind(bindings)  # after the previous run ended: its calls keep their arguments
            for device in self.bindings.devices:  # one synchronous step: a total order of runs on every device
                tickets[device] = timeline_of(device).take()
            await self._execute(tickets, timeout)
            self.runs += 1
        finally:
            self._active -= 1
            for device, ticket in tickets.items():
                timeline_of(device).complete(ticket)
            self._fence.complete(number)

    async def _execute(self, tickets: dict[Any, int], timeout: float | None) -> None:
        signals = [Counter() for _ in self.bindings.queues]
        plan_ = self.plan
        records: list[tuple[int, int]] = [(0, 0)] * len(self.calls)
        failures: list[tuple[int, BaseException]] = []
        with anyio.move_on_after(math.inf if timeout is None else timeout) as deadline:
            await self._work(tickets, signals, records, failures)
        self._records = records
        if deadline.cancelled_caught and not failures:
            pending = [i for i, (_, end) in enumerate(records) if not end]
            names = self.queue_names()
            listed = ", ".join(f"call {i} ({self.calls[i].name}) on {names[plan_.submissions[i].queue]}"
                               for i in pending[:8]) + (f" and {len(pending) - 8} more" if len(pending) > 8 else "")
            error = BatchTimeoutError(f"the batch did not finish within {timeout:g} s and was aborted; "
                                      f"{len(pending)} of {len(self.calls)} calls pending: {listed}"
                                      + self._broken_note())
            error.pending_queues = [names[plan_.submissions[i].queue] for i in pending]
            raise error
        self._raise_failure(failures)

    async def _work(self, tickets: dict[Any, int], signals: list[Counter], records: list[tuple[int, int]],
                    failures: list[tuple[int, BaseException]]) -> None:
        bindings, plan_ = self.bindings, self.plan
        queues, devices = bindings.queues, bindings.devices
        # A device with one queue in this batch (the usual case) is finalised by that queue's worker when it ends:
        # a task less per device and run, and the epoch published as early
        finish_by = {f.waits[0].queue: devices[f.device] for f in plan_.finalisers if len(f.waits) == 1}

        async def work(worker: Any, state: RunState, qi: int, *args: Any) -> None:
            await worker(state, qi, *args)
            device = finish_by.get(qi)
            if device is not None and not failures:
                timeline_of(device).complete(tickets[device])

        async with anyio.create_task_group() as group:
            def fail(submission: Submission | None, error: BaseException) -> None:
                failures.append((submission.call if submission else -1, error))
                group.cancel_scope.cancel()

            state = RunState(self.calls, bindings.prepared, self._expected_imm, self._post, signals, records, fail)
            for qi, submissions in enumerate(self._queue_submissions):
                queue = queues[qi]
                device = devices[plan_.device_of_queue[qi]]
                ticket, timeline = tickets[device], timeline_of(device)
                if isinstance(queue, QPQueue):
                    group.start_soon(work, qp_worker, state, qi, submissions, timeline, ticket, queue.qp)
                else:
                    group.start_soon(work, host_worker, state, qi, submissions, timeline, ticket)
            for finaliser in plan_.finalisers:
                if len(finaliser.waits) > 1:
                    device = devices[finaliser.device]
                    group.start_soon(finalise, finaliser.waits, signals, timeline_of(device), tickets[device])

    def _broken_note(self) -> str:
        """The QPs an abort left in ERR, and what to do about them."""
        names = self.qp_names()
        broken = [names[id(qp)] for qp in self.bindings.qps() if qp.state is QPState.ERR]
        if not broken:
            return ""
        return ("; " + ", ".join(broken) + " left in ERR (its outstanding work was flushed): reset and reconnect both "
                "ends (qp.modify(QPState.RESET), then connect), or connect new QPs and rebind them (a QueuePair "
                "input), before the next run")

    def _raise_failure(self, failures: list[tuple[int, BaseException]]) -> None:
        if failures:
            plan_ = self.plan
            # the first failure names the abort, but a SystemExit or KeyboardInterrupt among them must not be lost
            index, error = next((f for f in failures if not isinstance(f[1], Exception)), failures[0])
            names = self.queue_names()
            note = self._broken_note()
            queue = names[plan_.submissions[index].queue] if index >= 0 else None
            if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt: not a call's failure to catch
                if hasattr(error, "add_note"):  # Python >= 3.11
                    error.add_note(f"raised by call {index} ({self.calls[index].name}) on queue {queue}; the batch "
                                   f"was aborted{note}")
                raise error
            raise CallError(index, self.calls[index].name, queue if queue is not None else
                            queue_name(self.calls[index].queue), error, note) from error

    # -- looking at it ------------------------------------------------------------------------------------------
    def describe(self) -> str:
        """The plan, one line per call: queue[position], name, waits, fence, signal; then the finalisers."""
        return self.plan.describe([c.name for c in self.calls], self._namer())

    def to_dot(self) -> str:
        """The plan as Graphviz text (`dot -Tsvg`)."""
        return self.plan.to_dot([c.name for c in self.calls], self._namer())

    def qp_names(self) -> dict[int, str]:
        """The batch's QPs by id(): `qp 0x2`, with the NIC added where two QPs of different NICs share a number
        (each NIC numbers its own QPs)."""
        qps = self.bindings.qps()
        base = [qp_name(qp) for qp in qps]
        return {id(qp): name + (f" ({qp.device.pci.address})" if base.count(name) > 1 else "")
                for name, qp in zip(base, qps)}

    def queue_names(self) -> list[str]:
        """The batch's queues as errors, describe() and traces name them, in plan order: `qp 0x2` (its send side),
        `qp 0x2 recv` (its receive side), `compute`..."""
        qps = self.qp_names()
        base = [qps[id(q.qp)] + (" recv" if q.side == RECEIVE else "") if isinstance(q, QPQueue) else queue_name(q)
                for q in self.bindings.queues]
        return [name + f" #{i}" if base.count(name) > 1 else name for i, name in enumerate(base)]

    def _namer(self) -> Any:
        """Name a compiled queue (or device) by what it is bound to now (a QP input may have been rebound)."""
        names = {id(compiled): name for compiled, name in zip(self.plan.queues, self.queue_names())}
        return lambda queue: names.get(id(queue)) or queue_name(queue)

    @property
    def last_trace(self) -> list[CallTrace]:
        """Per call of the last run: its queue, its start and its end (time.perf_counter_ns())."""
        names = self.queue_names()
        return [CallTrace(i, call.name, names[submission.queue], start, end)
                for i, (call, submission, (start, end)) in enumerate(zip(self.calls, self.plan.submissions,
                                                                           self._records))]

    def trace(self, path: Any) -> None:
        """Write the last run as Chrome trace JSON (Perfetto, chrome://tracing): one track per queue."""
        write_chrome_trace(path, self.last_trace, self.queue_names())


def _check_order(calls: list[Call]) -> None:
    """A call's after() targets come earlier in the batch: planned later, the planner would order them the other
    way round (a write after a read of its token)."""
    position = {id(call): i for i, call in enumerate(calls)}
    for i, call in enumerate(calls):
        for earlier in call.earlier:
            at = position.get(id(earlier))
            if at is None or at > i:
                where = "is not in the batch" if at is None else f"comes later (call {at})"
                raise ValueError(f"call {i} ({call.name}) runs after {earlier.name!r}, which {where}: list it first")


def compile(calls: Iterable[Call], inputs: Inputs | None = None) -> Batch:
    """Plan `calls` once. `inputs` (a name -> buffer mapping, or a list named "0", "1", ...) are the buffers
    `run(bindings)` may replace; a numpy input also rebinds every view of it the calls use."""
    return Batch(calls, inputs)
