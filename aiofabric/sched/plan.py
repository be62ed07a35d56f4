"""Planning: a batch of calls, each on an in-order queue with the byte ranges it reads and writes -> one submission
per call (timeline wait, waits, the call, signal) plus one finaliser per device.

Pure (no anyio, no aiofabric imports), so it is tested in microseconds like h11's state machine. It is hcq2's
`_emit_submits` model:

- dependencies come from overlapping byte ranges (read-after-write, write-after-read, write-after-write);
- only the newest dependency per producer queue is kept (queues complete in order, so it implies the older ones);
- a dependency on the call's own queue needs no wait (in order) but marks the submission `fence`: a queue that
  pipelines its calls (a QP posts before earlier work completes) drains before it runs a fenced call;
- a wait the consumer queue already made at a newer point of the producer queue is dropped;
- a queue's first call waits for its device's timeline (earlier runs that used the device are done);
- a call signals its queue (counter := its 1-based position) only if a wait or a finaliser needs it;
- each device gets a finaliser that waits for the last call of each of its queues and then publishes the epoch.

Planning is linear in the number of calls: per buffer an interval map keeps the last writer and the newest reader
per queue of each byte range, and per (consumer, producer) queue pair the newest position already waited for. No
call ever scans earlier calls.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence

Position = tuple  # (queue index, 1-based position on that queue)


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """Bytes [start, stop) of the memory named `key` (two spans conflict only if their keys are equal)."""
    key: Hashable
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class Access:
    """What the planner needs of one call: where it runs and which spans it reads and writes."""
    queue: Hashable
    device: Hashable
    reads: tuple[Span, ...] = ()
    writes: tuple[Span, ...] = ()


class Wait(NamedTuple):
    """Wait until `queue`'s signal counter reaches `value` (that queue's call at that position completed).
    A named tuple: planning makes one per dependency, and tuples are the cheapest immutable records to build."""
    queue: int
    value: int


@dataclasses.dataclass(slots=True)
class Submission:
    """One call as its queue's worker runs it: [timeline wait], waits, [drain if fence], the call, [signal]."""
    call: int  # index of the call in the batch
    queue: int  # index into Plan.queues
    position: int  # 1-based position on its queue
    timeline_wait: bool  # first use of the queue in the batch
    waits: tuple[Wait, ...]
    fence: bool  # depends on an earlier call of its own queue
    signal: int | None = None  # value stored in the queue's counter once done, only if someone waits for it


@dataclasses.dataclass(frozen=True, slots=True)
class Finaliser:
    """Per device: wait for every queue of the device to finish the batch, then publish the epoch."""
    device: int  # index into Plan.devices
    waits: tuple[Wait, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    queues: tuple[Hashable, ...]
    devices: tuple[Hashable, ...]
    device_of_queue: tuple[int, ...]
    submissions: tuple[Submission, ...]  # in call order
    finalisers: tuple[Finaliser, ...]
    dependencies: int  # conflicts found (before the redundant ones were dropped), for describe()

    def queue_submissions(self) -> list[list[Submission]]:
        """Each queue's submissions in order: what its worker consumes."""
        per_queue: list[list[Submission]] = [[] for _ in self.queues]
        for submission in self.submissions:
            per_queue[submission.queue].append(submission)
        return per_queue

    @property
    def waits(self) -> int:
        return sum(len(s.waits) for s in self.submissions)

    @property
    def signals(self) -> int:
        return sum(s.signal is not None for s in self.submissions)

    def describe(self, names: Sequence[str] | None = None, queue_name: Callable[[Hashable], str] = str) -> str:
        """One line per submission (call, queue, waits, signal), then the finalisers."""
        qn = [queue_name(q) for q in self.queues]
        lines = [f"plan: {len(self.submissions)} calls on {len(self.queues)} queues of {len(self.devices)} devices, "
                 f"{self.dependencies} conflicts -> {self.waits} waits, {self.signals} signals"]
        for s in self.submissions:
            label = names[s.call] if names else f"call {s.call}"
            parts = [f"#{s.call:<4} {qn[s.queue]}[{s.position}] {label}"]
            if s.timeline_wait:
                parts.append("wait timeline")
            if s.waits:
                parts.append("wait " + ", ".join(f"{qn[w.queue]}>={w.value}" for w in s.waits))
            if s.fence:
                parts.append("fence")
            if s.signal is not None:
                parts.append(f"signal {qn[s.queue]}={s.signal}")
            lines.append("  " + "; ".join(parts))
        for f in self.finalisers:
            lines.append(f"  finaliser {queue_name(self.devices[f.device])}: wait "
                         + ", ".join(f"{qn[w.queue]}>={w.value}" for w in f.waits) + "; publish epoch")
        return "\n".join(lines)

    def to_dot(self, names: Sequence[str] | None = None, queue_name: Callable[[Hashable], str] = str) -> str:
        """Graphviz text: one cluster per queue (calls chained in order), an edge per wait."""
        qn = [queue_name(q) for q in self.queues]
        by_position = {(s.queue, s.position): s.call for s in self.submissions}
        out = ["digraph batch {", "  rankdir=LR; node [shape=box, fontsize=10];"]
        for qi, subs in enumerate(self.queue_submissions()):
            out.append(f'  subgraph cluster_q{qi} {{ label="{_dot(qn[qi])}";')
            for s in subs:
                label = names[s.call] if names else f"call {s.call}"
                out.append(f'    c{s.call} [label="{_dot(label)}"];')
            out.extend(f"    c{a.call} -> c{b.call} [style=dotted];" for a, b in zip(subs, subs[1:]))
            out.append("  }")
        for s in self.submissions:
            out.extend(f"  c{by_position[w.queue, w.value]} -> c{s.call};" for w in s.waits)
        for f in self.finalisers:
            out.append(f'  f{f.device} [label="finalise {_dot(queue_name(self.devices[f.device]))}", shape=oval];')
            out.extend(f"  c{by_position[w.queue, w.value]} -> f{f.device} [style=dashed];" for w in f.waits)
        out.append("}")
        return "\n".join(out)


def _dot(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


class _Segment:
    """One byte range of one buffer: its last writer and the newest reader per queue since that write."""
    __slots__ = ("writer", "readers")

    def __init__(self, writer: Position | None, readers: dict[int, int]) -> None:
        self.writer, self.readers = writer, readers


class _IntervalMap:
    """Sorted segment starts over [0, inf) of one buffer key; a write coalesces the range it covers into one."""
    __slots__ = ("starts", "segments")

    def __init__(self) -> None:
        self.starts: list[int] = [0]
        self.segments: list[_Segment] = [_Segment(None, {})]

    def _range(self, start: int, stop: int) -> tuple[int, int]:
        """Indices [first, last) of the segments covering [start, stop), splitting the ones that straddle an end."""
        starts = self.starts
        first = bisect.bisect_right(starts, start) - 1
        if starts[first] == start and first + 1 < len(starts) and starts[first + 1] == stop:
            return first, first + 1  # exactly one existing segment: the common case of reused slots
        if starts[first] != start:
            old = self.segments[first]
            first += 1
            starts.insert(first, start)
            self.segments.insert(first, _Segment(old.writer, dict(old.readers)))
        last = bisect.bisect_right(starts, stop, first) - 1
        if starts[last] != stop:
            old = self.segments[last]
            last += 1
            starts.insert(last, stop)
            self.segments.insert(last, _Segment(old.writer, dict(old.readers)))
        return first, last

    def conflicts(self, start: int, stop: int, writes: bool, deps: dict[int, int]) -> None:
        """Add to `deps` (queue -> newest position) the calls an access to [start, stop) must follow: the last
        writer, or for a write the newest reader per queue since that write (each of which followed the writer)."""
        first, last = self._range(start, stop)
        get, segments = deps.get, self.segments
        for index in range(first, last):
            segment = segments[index]
            if writes and segment.readers:  # every reader followed the writer: waiting for them implies it
                for q, p in segment.readers.items():
                    if get(q, 0) < p:
                        deps[q] = p
            elif segment.writer is not None:
                q, p = segment.writer
                if get(q, 0) < p:
                    deps[q] = p

    def record_read(self, start: int, stop: int, queue: int, position: int) -> None:
        first, last = self._range(start, stop)
        segments = self.segments
        for index in range(first, last):
            segments[index].readers[queue] = position  # positions grow per queue: this is the newest

    def record_write(self, start: int, stop: int, queue: int, position: int) -> None:
        first, last = self._range(start, stop)
        if last == first + 1:  # one segment: reuse it
            segment = self.segments[first]
            segment.writer, segment.readers = (queue, position), {}
            return
        self.starts[first:last] = [start]
        self.segments[first:last] = [_Segment((queue, position), {})]


def plan(calls: Iterable[Access]) -> Plan:
    """Plan `calls` (in program order: a call sees the effects of every earlier call it conflicts with)."""
    queue_index: dict[Hashable, int] = {}
    device_index: dict[Hashable, int] = {}
    device_of_queue: list[int] = []
    positions: list[int] = []  # calls so far per queue
    waited: list[dict[int, int]] = []  # per consumer queue: producer queue -> newest position already waited for
    per_queue: list[list[Submission]] = []
    memory: dict[Hashable, _IntervalMap] = {}
    submissions: list[Submission] = []
    conflicts = 0
    for index, call in enumerate(calls):
        qi = queue_index.get(call.queue)
        first_use = qi is None
        if first_use:
            qi = queue_index[call.queue] = len(positions)
            device_of_queue.append(device_index.setdefault(call.device, len(device_index)))
            positions.append(0)
            waited.append({})
            per_queue.append([])
        elif device_index.get(call.device) != device_of_queue[qi]:
            raise ValueError(f"call {index}: queue {call.queue!r} was used on device "
                             f"{list(device_index)[device_of_queue[qi]]!r}, not {call.device!r}")
        position = positions[qi] = positions[qi] + 1
        deps: dict[int, int] = {}
        for spans, writes in ((call.reads, False), (call.writes, True)):  # first every conflict, then the updates,
            for span in spans:                                              # so a call never depends on itself
                if span.stop > span.start:
                    area = memory.get(span.key)
                    if area is None:
                        area = memory[span.key] = _IntervalMap()
                    area.conflicts(span.start, span.stop, writes, deps)
        for span in call.reads:
            if span.stop > span.start:
                memory[span.key].record_read(span.start, span.stop, qi, position)
        for span in call.writes:
            if span.stop > span.start:
                memory[span.key].record_write(span.start, span.stop, qi, position)
        conflicts += len(deps)
        fence = False
        waits = []
        mine = waited[qi]
        for producer, value in deps.items():
            if producer == qi:
                fence = True
            elif mine.get(producer, 0) < value:
                mine[producer] = value
                waits.append(Wait(producer, value))
        submission = Submission(index, qi, position, first_use, tuple(waits), fence)
        submissions.append(submission)
        per_queue[qi].append(submission)
    for submission in submissions:
        for wait in submission.waits:
            per_queue[wait.queue][wait.value - 1].signal = wait.value
    finaliser_waits: list[list[Wait]] = [[] for _ in device_index]
    for qi, subs in enumerate(per_queue):
        last = subs[-1]
        last.signal = last.position
        finaliser_waits[device_of_queue[qi]].append(Wait(qi, last.position))
    return Plan(tuple(queue_index), tuple(device_index), tuple(device_of_queue), tuple(submissions),
                tuple(Finaliser(d, tuple(w)) for d, w in enumerate(finaliser_waits)), conflicts)
