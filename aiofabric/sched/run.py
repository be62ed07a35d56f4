"""Compiled batches: planned once, replayed from one event loop with one async worker per queue.

A host queue (compute, copy) runs its calls one at a time; a QP queue posts its calls in order and a second task
retires their completions in order, so RDMA work pipelines on the wire while waits and fences still hold. Signals
are `Counter`s, device timelines are `Timeline`s (tickets taken in one synchronous step per run, so batches that
share a device run in a total order and never deadlock), and a per-batch `Timeline` is the reuse fence: run N+1
starts only after run N finished, failed or was cancelled.
"""
from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import math
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import anyio
import anyio.lowlevel
import numpy as np

from .calls import RECEIVE, Call, QPQueue, Scalar, host_address, qp_name, queue_name
from .kernels import c_scalar
from .plan import Plan, Submission, plan
from .pool import NO_SGE, pool_of
from .timeline import Counter, Timeline
from .trace import CallTrace, write_chrome_trace
from ..errors import BatchTimeoutError, BindingError, CallError, ImmediateMismatchError
from ..verbs import MemoryRegion, QPState, QueuePair, RemoteRegion

log = logging.getLogger("aiofabric.sched")

COPY_IN_THREAD_BYTES = 256 << 10  # below this a memcpy is cheaper than the hop to a worker thread
YIELD_EVERY = 32  # inline calls a host worker runs before it lets the rest of the loop in
DRAIN_TIMEOUT = 5.0  # seconds an aborted QP worker waits for work it already posted
RECEIVE_GRACE = 1.0  # ... and for its receives, whose matching sends may still be on the wire
RECEIVES = ("recv", "wait_imm")

_timelines: weakref.WeakKeyDictionary[Any, Timeline] = weakref.WeakKeyDictionary()
_named_timelines: dict[Any, Timeline] = {}


def timeline_of(device: Any) -> Timeline:
    """The device's timeline, shared by every batch that uses the device."""
    try:
        timeline = _timelines.get(device)
        if timeline is None:
            timeline = _timelines[device] = Timeline()
    except TypeError:  # a device named by a plain value (str, tuple): not weakly referenceable
        timeline = _named_timelines.setdefault(device, Timeline())
    return timeline


class _Containing:
    """Which of some byte extents contain a given one, in O(log n) for extents that do not nest (each is checked
    from the nearest start down, only while an extent that far back could still reach)."""

    def __init__(self, extents: list[tuple[tuple[int, int], int]]) -> None:
        extents = sorted(extents)
        self.starts = [start for (start, _), _ in extents]
        self.stops = [stop for (_, stop), _ in extents]
        self.labels = [label for _, label in extents]
        self.reach = list(itertools.accumulate(self.stops, max))  # the furthest stop among extents up to here

    def first(self, start: int, stop: int, accept: Callable[[int], bool]) -> int:
        """The lowest label whose extent holds [start, stop) and that `accept`s, or -1."""
        best = -1
        j = bisect.bisect_right(self.starts, start) - 1
        while j >= 0 and self.reach[j] >= stop:
            label = self.labels[j]
            if self.stops[j] >= stop and (best < 0 or label < best) and accept(label):
                best = label
            j -= 1
        return best


class _View(NamedTuple):
    """An array view of an input: where it starts in the input's bytes, and its layout."""
    offset: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, view: np.ndarray, base: int) -> _View:
        return cls(view.__array_interface__["data"][0] - base, view.dtype, view.shape, view.strides)


class _Slot:
    """Where an input reaches a call argument: the whole object, or an array view into it."""
    __slots__ = ("call", "arg", "input", "view")

    def __init__(self, call: int, arg: int, input: int, view: _View | None) -> None:
        self.call, self.arg, self.input, self.view = call, arg, input, view

    def resolve(self, value: Any) -> Any:
        view = self.view
        if view is None:
            return value
        return np.ndarray(view.shape, view.dtype, buffer=_bytes_of(value), offset=view.offset, strides=view.strides)


class Batch:
    """A compiled batch. `await batch.run(bindings)` replays it; `describe()`, `to_dot()` and `trace(path)` show
    the plan and the last run. Build one with `sched.compile(calls, inputs=...)`."""

    def __init__(self, calls: Iterable[Call], inputs: Mapping[str, Any] | Sequence[Any] | None = None) -> None:
        self.calls = list(calls)
        if not self.calls:
            raise ValueError("a batch needs at least one call")
        _check_order(self.calls)
        self.plan: Plan = plan(call.access() for call in self.calls)
        self._queue_submissions = self.plan.queue_submissions()
        self._queues, self._devices = list(self.plan.queues), list(self.plan.devices)  # QP inputs replace entries
        self._fence = Timeline()
        self._args = [call.args for call in self.calls]
        # per call, the immediate its completion must carry (wait_imm(imm=)), looked up by the QP workers
        self._expected_imm = [call.options.get("imm") if call.kind == "wait_imm" else None for call in self.calls]
        self._collect_scalars()
        self._prepared: list[Any] = [None] * len(self.calls)
        for index in range(len(self.calls)):
            self._prepare(index)
        self._compile_inputs(inputs)
        self._records: list[tuple[int, int]] = []
        self._active = 0  # runs started and not finished (waiting at the fence included)
        self.runs = 0

    # -- input table --------------------------------------------------------------------------------------------
    def _collect_scalars(self) -> None:
        """The Scalars the calls use, by name: their current values, the calls to prepare again when one is
        rebound, and the most an RDMA size may become (its compiled value: the bytes the plan covers)."""
        self._scalar_values: dict[str, int | float] = {}
        self._scalar_calls: dict[str, list[int]] = {}
        self._scalar_limits: dict[str, int] = {}
        for index, call in enumerate(self.calls):
            size = call.options.get("size")
            for scalar in (*call.options.get("scalars", ()), size):
                if not isinstance(scalar, Scalar):
                    continue
                known = self._scalar_values.setdefault(scalar.name, scalar.value)
                if known != scalar.value or type(known) is not type(scalar.value):
                    raise ValueError(f"two Scalars named {scalar.name!r} with different values ({known!r} and "
                                     f"{scalar.value!r}): a name is one value")
                self._scalar_calls.setdefault(scalar.name, []).append(index)
            if isinstance(size, Scalar):
                self._scalar_limits[size.name] = int(size.value)

    def _check_scalar(self, name: str, value: Any) -> None:
        compiled = self._scalar_values[name]
        if isinstance(value, bool) or type(value) is not type(compiled):
            raise BindingError(f"scalar {name!r} is {type(compiled).__name__} (as compiled); got "
                               f"{type(value).__name__} {value!r}")
        limit = self._scalar_limits.get(name)
        if limit is not None and not 0 <= value <= limit:
            raise BindingError(f"scalar {name!r} sizes an RDMA call: it must be in [0, {limit}] (the compiled size, "
                               f"whose bytes the plan ordered), not {value}; compile with the largest size")

    def _compile_inputs(self, inputs: Mapping[str, Any] | Sequence[Any] | None) -> None:
        if inputs is None:
            inputs = {}
        elif not isinstance(inputs, Mapping):
            inputs = {str(i): value for i, value in enumerate(inputs)}
        self.input_names = list(inputs)
        self._inputs = list(inputs.values())
        clash = sorted(set(self.input_names) & set(self._scalar_values))
        if clash:
            raise BindingError(f"inputs {clash} are also names of Scalars of the batch: a name is one thing")
        bases: list[np.ndarray | None] = []  # the bytes of each host input, to find the views of it the calls use
        for name, value in inputs.items():
            if isinstance(value, np.ndarray):
                if not value.flags.c_contiguous:
                    raise BindingError(f"input {name!r} must be C-contiguous")
                bases.append(value)
            elif isinstance(value, MemoryRegion):
                bases.append(_bytes_of(value))
            elif isinstance(value, RemoteRegion):
                bases.append(None)
            elif isinstance(value, QueuePair):
                if value not in self._qps():
                    raise BindingError(f"input {name!r}: {queue_name(value)} is not a queue of the batch")
                bases.append(None)
            else:
                raise BindingError(f"input {name!r} is a {type(value).__name__}; inputs are numpy arrays, "
                                   "MemoryRegions, RemoteRegions or QueuePairs")
        ranges = [_extent(base) if base is not None else None for base in bases]
        by_identity: dict[int, int] = {}
        for ii, value in enumerate(self._inputs):
            by_identity.setdefault(id(value), ii)
        containing = _Containing([(extent, ii) for ii, extent in enumerate(ranges) if extent is not None])
        def classify(arg: Any) -> tuple[int, Any]:
            """(the input it is or views, its _View or None) or (-1, the host extent of a constant, or None)."""
            ii = by_identity.get(id(arg), -1)
            if ii >= 0:
                extent = ranges[ii]
                return ii, _View.of(arg, extent[0]) if isinstance(arg, np.ndarray) and extent else None
            if isinstance(arg, np.ndarray):  # a view of a host input: the first input holding it
                start, stop = _extent(arg)
                ii = containing.first(start, stop, lambda i: bool(np.shares_memory(arg, bases[i])))
                if ii >= 0:
                    return ii, _View.of(arg, ranges[ii][0])  # type: ignore[index]
                return -1, (start, stop)
            return -1, _extent(arg) if isinstance(arg, MemoryRegion) else None

        self._slots: list[_Slot] = []
        constants: list[tuple[int, int, int, int]] = []  # host memory of every other argument: (start, stop, call, arg)
        known: dict[int, tuple[int, Any]] = {}  # id(arg) -> classify(arg): calls share buffers; args outlive this
        for ci, args in enumerate(self._args):
            for ai, arg in enumerate(args):
                kind = known.get(id(arg))
                if kind is None:
                    kind = known[id(arg)] = classify(arg)
                ii, what = kind
                if ii >= 0:
                    self._slots.append(_Slot(ci, ai, ii, what))
                elif what is not None:
                    constants.append((what[0], what[1], ci, ai))
        self._slot_of = {(slot.call, slot.arg): slot.input for slot in self._slots}
        extents = np.array([c[:2] for c in constants], dtype=np.uint64).reshape(-1, 2)
        self._constant_starts, self._constant_stops = extents[:, 0], extents[:, 1]
        self._constants = [c[2:] for c in constants]
        # an input whose memory other (constant) arguments share cannot be rebound: they would stay behind
        self._entangled: list[str | None] = []
        for ii, extent in enumerate(ranges):
            hit = self._overlapping_constant(extent) if extent is not None else None
            self._entangled.append(None if hit is None else self._argument_text(*hit))
        used = {slot.input for slot in self._slots} | {i for i, v in enumerate(self._inputs)
                                                       if isinstance(v, QueuePair)}
        self._peers = {id(q.qp): q.qp.peer.gid for q in self.plan.queues  # remote memory was keyed by these peers
                       if isinstance(q, QPQueue) and q.qp.peer is not None}
        unused = [name for i, name in enumerate(self.input_names) if i not in used]
        if unused:
            raise BindingError(f"inputs {unused} are not arguments of any call of the batch")

    def _qps(self, queues: Sequence[Any] | None = None) -> list[QueuePair]:
        """The QPs the batch's queues are sides of, each once, in plan order."""
        seen: dict[int, QueuePair] = {}
        for queue in self._queues if queues is None else queues:
            if isinstance(queue, QPQueue):
                seen.setdefault(id(queue.qp), queue.qp)
        return list(seen.values())

    def _overlapping_constant(self, extent: tuple[int, int]) -> tuple[int, int] | None:
        start, stop = extent
        if stop <= start:
            return None
        hits = np.flatnonzero((self._constant_starts < stop) & (self._constant_stops > start))
        return self._constants[hits[0]] if len(hits) else None

    def _argument_text(self, ci: int, ai: int) -> str:
        return f"argument {ai} of call {ci} ({self.calls[ci].name})"

    def bind(self, bindings: Mapping[str, Any] | Sequence[Any]) -> None:
        """Rebind inputs (all or some, by name or position) without planning again: same size and dtype, the same
        NIC for QPs and MRs, and no memory shared with the batch's other buffers that the plan did not order. All
        or nothing: a refused binding changes nothing. Not while a run is in progress (pass them to `run()`)."""
        if self._active:
            raise BindingError("a run of this batch is in progress; pass the bindings to run(), which waits for it")
        self._bind(bindings)

    def _bind(self, bindings: Mapping[str, Any] | Sequence[Any]) -> None:
        if not isinstance(bindings, Mapping):
            if len(bindings) != len(self._inputs):
                raise BindingError(f"run() got {len(bindings)} positional bindings for {len(self._inputs)} inputs "
                                   f"{self.input_names}")
            bindings = dict(zip(self.input_names, bindings))
        scalars = {name: value for name, value in bindings.items() if name in self._scalar_values}
        for name, value in scalars.items():
            self._check_scalar(name, value)
        inputs, queues = list(self._inputs), list(self._queues)
        changed = set()
        for name, value in bindings.items():
            if name in scalars:
                continue
            if name not in self.input_names:
                raise BindingError(f"no input named {name!r}; the inputs are {self.input_names} and the scalars "
                                   f"{sorted(self._scalar_values)}")
            index = self.input_names.index(name)
            old = inputs[index]
            if value is old:
                continue
            _check_binding(name, old, value)
            if self._entangled[index]:
                raise BindingError(f"input {name!r} cannot be rebound: {self._entangled[index]} shares its memory "
                                   "and is not an input (it would keep the old memory); make that one an input too")
            if isinstance(old, QueuePair):
                if value in self._qps(queues):
                    raise BindingError(f"input {name!r}: {queue_name(value)} is already a queue of the batch")
                compiled_peer = self._peers.get(id(self._compiled_qp(old)))
                if compiled_peer is not None and value.peer is not None and value.peer.gid != compiled_peer:
                    raise BindingError(f"input {name!r}: {queue_name(value)} is connected to another peer (GID "
                                       f"{value.peer.gid.hex()}) than the QP compiled (GID {compiled_peer.hex()}), "
                                       "whose remote memory the plan ordered; compile the batch again")
                queues = [QPQueue(value, q.side) if isinstance(q, QPQueue) and q.qp is old else q for q in queues]
            inputs[index] = value
            changed.add(index)
        if not changed:
            self._apply_scalars(scalars)  # checked above: all or nothing
            return
        args: dict[int, list[Any]] = {}
        for slot in self._slots:
            if slot.input in changed:
                call_args = args.setdefault(slot.call, list(self._args[slot.call]))
                call_args[slot.arg] = view = slot.resolve(inputs[slot.input])
                if isinstance(view, np.ndarray) and not view.flags.writeable and self._writes_to(slot.call, slot.arg):
                    raise BindingError(f"input {self.input_names[slot.input]!r} is read-only, and "
                                       f"{self._argument_text(slot.call, slot.arg)} writes it")
        self._check_no_new_sharing(inputs, changed)
        self._inputs, self._queues = inputs, queues
        # a QP's device (its timeline) is the QP: it follows a rebinding
        now = {id(compiled.qp): queue.qp for compiled, queue in zip(self.plan.queues, queues)
               if isinstance(compiled, QPQueue) and isinstance(queue, QPQueue)}
        self._devices = [now.get(id(d), d) for d in self.plan.devices]
        for index, call_args in args.items():
            self._args[index] = tuple(call_args)
            self._prepare(index)
        self._apply_scalars(scalars)

    def _apply_scalars(self, scalars: dict[str, Any]) -> None:
        self._scalar_values.update(scalars)
        for index in sorted({i for name in scalars for i in self._scalar_calls[name]}):
            self._prepare(index)

    def _compiled_qp(self, current: QueuePair) -> QueuePair | None:
        """The QP compiled in the place `current` is bound to now."""
        return next((c.qp for c, q in zip(self.plan.queues, self._queues)
                     if isinstance(c, QPQueue) and isinstance(q, QPQueue) and q.qp is current), None)

    def _writes_to(self, ci: int, ai: int) -> bool:
        call = self.calls[ci]
        return (call.kind == "kernel" and ai < call.options["outs"]) or (call.kind == "copy" and ai == 0) \
            or (call.kind in ("read", "recv") and ai == 0)

    def _check_no_new_sharing(self, inputs: list[Any], changed: set[int]) -> None:
        """The plan ordered calls by the memory they touched when compiled: a rebound input that now shares memory
        with another buffer of the batch would race it."""
        extents = [_extent(_bytes_of(v)) if isinstance(v, (np.ndarray, MemoryRegion)) else None for v in inputs]
        for index in changed:
            extent = extents[index]
            if extent is None or extent[1] <= extent[0]:
                continue
            hit = self._overlapping_constant(extent)
            other: str | None
            if hit is not None:
                other = self._argument_text(*hit)
            else:
                other = next((f"input {self.input_names[j]!r}" for j, e in enumerate(extents)
                              if j != index and e is not None and e[0] < extent[1] and extent[0] < e[1]), None)
            if other is not None:
                raise BindingError(f"input {self.input_names[index]!r}: its new memory overlaps {other}, which the "
                                   "plan did not order against it; bind separate memory, or compile the batch again")

    def _prepare(self, index: int) -> None:
        """What the worker needs to run call `index` with its current arguments, computed once per binding."""
        call, args = self.calls[index], self._args[index]
        if call.kind == "kernel":
            options = call.options
            values = [self._scalar_values[s.name] if isinstance(s, Scalar) else s for s in options["scalars"]]
            if options["c"]:
                self._prepared[index] = (options["fn"], (*(ctypes.c_void_p(a.__array_interface__["data"][0])
                                                            for a in args),
                                                          *(c_scalar(v, call.name, i) for i, v in enumerate(values))))
            else:
                self._prepared[index] = (options["fn"], (*args, *values))
        elif call.kind == "copy":
            dst, src = (np.frombuffer(a.view, np.uint8) if isinstance(a, MemoryRegion) else a.reshape(-1).view(np.uint8)
                        for a in args)
            self._prepared[index] = (dst, src)
        else:
            size = call.options["size"]
            self._prepared[index] = (*args, self._scalar_values[size.name] if isinstance(size, Scalar) else size)

    # -- running ------------------------------------------------------------------------------------------------
    async def run(self, bindings: Mapping[str, Any] | Sequence[Any] | None = None, *,
                  timeout: float | None = None) -> None:
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
                self._bind(bindings)  # after the previous run ended: its calls keep their arguments
            for device in self._devices:  # one synchronous step: a total order of runs on every device
                tickets[device] = timeline_of(device).take()
            await self._execute(tickets, timeout)
            self.runs += 1
        finally:
            self._active -= 1
            for device, ticket in tickets.items():
                timeline_of(device).complete(ticket)
            self._fence.complete(number)

    async def _execute(self, tickets: dict[Any, int], timeout: float | None) -> None:
        queues, plan_ = self._queues, self.plan
        signals = [Counter() for _ in queues]
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
        queues, devices, plan_ = self._queues, self._devices, self.plan
        # A device with one queue in this batch (the usual case) is finalised by that queue's worker when it ends:
        # a task less per device and run, and the epoch published as early
        finish_by = {f.waits[0].queue: devices[f.device] for f in plan_.finalisers if len(f.waits) == 1}

        async def work(worker: Any, qi: int, *args: Any) -> None:
            await worker(qi, *args)
            device = finish_by.get(qi)
            if device is not None and not failures:
                timeline_of(device).complete(tickets[device])

        async with anyio.create_task_group() as group:
            def fail(submission: Submission | None, error: BaseException) -> None:
                failures.append((submission.call if submission else -1, error))
                group.cancel_scope.cancel()

            for qi, submissions in enumerate(self._queue_submissions):
                queue = queues[qi]
                device = devices[plan_.device_of_queue[qi]]
                ticket, timeline = tickets[device], timeline_of(device)
                worker = self._qp_worker if isinstance(queue, QPQueue) else self._host_worker
                group.start_soon(work, worker, qi, submissions, signals, timeline, ticket, records, fail)
            for finaliser in plan_.finalisers:
                if len(finaliser.waits) > 1:
                    group.start_soon(self._finalise, finaliser.waits, signals, devices[finaliser.device], tickets)

    def _broken_note(self) -> str:
        """The QPs an abort left in ERR, and what to do about them."""
        names = self.qp_names()
        broken = [names[id(qp)] for qp in self._qps() if qp.state is QPState.ERR]
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

    async def _finalise(self, waits: Sequence[Any], signals: list[Counter], device: Any,
                        tickets: dict[Any, int]) -> None:
        for wait in waits:
            await signals[wait.queue].wait_for(wait.value)
        timeline_of(device).complete(tickets[device])  # publish the epoch: later runs on the device may start

    async def _host_worker(self, qi: int, submissions: list[Submission], signals: list[Counter], timeline: Timeline,
                           ticket: int, records: list[tuple[int, int]], fail: Any) -> None:
        signal, prepared, calls = signals[qi], self._prepared, self.calls
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

    async def _qp_worker(self, qi: int, submissions: list[Submission], signals: list[Counter], timeline: Timeline,
                         ticket: int, records: list[tuple[int, int]], fail: Any) -> None:
        """Post in order (waits, fences), retire completions in order (end times, signals) in a second task."""
        side = self._queues[qi]
        assert isinstance(side, QPQueue)
        qp = side.qp
        signal, clock = signals[qi], time.perf_counter_ns
        completions: list[Any] = [None] * len(submissions)
        starts = [0] * len(submissions)
        posted, retired = Counter(), Counter()
        expected = self._expected_imm

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
                                completions[k] = await self._post(qp, self.calls[submission.call],
                                                                  self._prepared[submission.call])
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
            outstanding = [(self.calls[submissions[k].call].kind, completions[k])
                           for k in range(retired.value, len(completions)) if completions[k] is not None]
            if outstanding:  # aborted: let the NIC finish what it was given before the buffers are handed back
                await _drain(qp, outstanding)

    @staticmethod
    async def _post(qp: QueuePair, call: Call, args: tuple[Any, ...]) -> Any:
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
        qps = self._qps()
        base = [qp_name(qp) for qp in qps]
        return {id(qp): name + (f" ({qp.device.pci.address})" if base.count(name) > 1 else "")
                for name, qp in zip(base, qps)}

    def queue_names(self) -> list[str]:
        """The batch's queues as errors, describe() and traces name them, in plan order: `qp 0x2` (its send side),
        `qp 0x2 recv` (its receive side), `compute`..."""
        qps = self.qp_names()
        base = [qps[id(q.qp)] + (" recv" if q.side == RECEIVE else "") if isinstance(q, QPQueue) else queue_name(q)
                for q in self._queues]
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
        await settle([c for kind, c in outstanding if kind not in RECEIVES], DRAIN_TIMEOUT)
        receives = [c for kind, c in outstanding if kind in RECEIVES]
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


def _bytes_of(value: np.ndarray | MemoryRegion) -> np.ndarray:
    """The bytes of a host buffer as a flat uint8 array (an MR: its mapped memory)."""
    if isinstance(value, MemoryRegion):
        return np.frombuffer(value.view, np.uint8)
    return value.reshape(-1).view(np.uint8)


def _extent(buffer: np.ndarray | MemoryRegion) -> tuple[int, int]:
    start, length = host_address(buffer)
    return start, start + length


def _check_binding(name: str, old: Any, new: Any) -> None:
    if isinstance(old, np.ndarray):
        if not isinstance(new, np.ndarray):
            raise BindingError(f"input {name!r} is a numpy array; got a {type(new).__name__}")
        if new.dtype != old.dtype or new.shape != old.shape:
            raise BindingError(f"input {name!r} must be {old.dtype} with shape {old.shape} (as compiled); got "
                               f"{new.dtype} with shape {new.shape}")
        if not new.flags.c_contiguous:
            raise BindingError(f"input {name!r} must be C-contiguous")
    elif isinstance(old, MemoryRegion):
        if not isinstance(new, MemoryRegion) or new.length != old.length:
            raise BindingError(f"input {name!r} must be a MemoryRegion of {old.length} bytes (as compiled); got "
                               f"{getattr(new, 'length', type(new).__name__)}")
        if new.device is not old.device:  # keys are per NIC: another NIC's MR would name a stranger's memory
            raise BindingError(f"input {name!r} must be an MR of {old.device.pci.address} (as compiled); got one "
                               f"of {new.device.pci.address}")
    elif isinstance(old, QueuePair):
        if not isinstance(new, QueuePair):
            raise BindingError(f"input {name!r} is a QueuePair; got a {type(new).__name__}")
        if new.device is not old.device:  # the calls' MRs are registered on the old QP's NIC
            raise BindingError(f"input {name!r} must be a QP of {old.device.pci.address} (as compiled), whose MRs "
                               f"the calls use; got one of {new.device.pci.address}")
    elif isinstance(old, RemoteRegion):
        if not isinstance(new, RemoteRegion) or new.length != old.length:
            raise BindingError(f"input {name!r} must be a RemoteRegion of {old.length} bytes (as compiled); got "
                               f"{getattr(new, 'length', type(new).__name__)}")


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


def compile(calls: Iterable[Call], inputs: Mapping[str, Any] | Sequence[Any] | None = None) -> Batch:
    """Plan `calls` once. `inputs` (a name -> buffer mapping, or a list named "0", "1", ...) are the buffers
    `run(bindings)` may replace; a numpy input also rebinds every view of it the calls use."""
    return Batch(calls, inputs)
