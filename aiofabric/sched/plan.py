"""Planning: a batch of calls, each on an in-order queue with the byte ranges it reads and writes -> one submission
per call (timeline wait, waits, the call, signal) plus one finaliser per device.

Pure (no anyio, no aiofabric imports), so it is tested in microseconds like h11's state machine. The model is
that of tinygrad's hardware command queues (HCQ), whose batch submitter this scheduler grew from: in-order queues
that signal counters, and calls that wait for other queues' counters before they run:

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
import gc
import threading
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence

Position = tuple  # (queue index, 1-based position on that queue)


class Span(NamedTuple):
    """Bytes [start, stop) of the memory named `key` (two spans conflict only if their keys are equal). A named
    tuple: every call makes a few, and a tuple is built in a quarter of a frozen dataclass's time."""
    key: Hashable
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedCall:
    """What the planner needs of one call: where it runs and which spans it reads and writes."""
    queue: Hashable
    device: Hashable
    reads: tuple[Span, ...] = ()
    writes: tuple[Span, ...] = ()


class Wait(NamedTuple):
    """Wait until `queue`'s signal counter reaches `value` (that queue's call at that position completed).
    A named tuple: planning makes one per dependency, and tuples are the cheapest immutable records to build
    (through `_new_tuple(Wait, (queue, value))`, which skips the generated __new__: a third of the time)."""
    queue: int
    value: int


_new_tuple = tuple.__new__


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


_END = 1 << 64  # the stop of a buffer's last segment: past any byte a span can name


class _Segment:
    """One byte range of one buffer, up to `stop`: its last writer and the newest reader per queue since that write."""
    __slots__ = ("stop", "writer", "readers")

    def __init__(self, stop: int, writer: Position | None, readers: dict[int, int]) -> None:
        self.stop, self.writer, self.readers = stop, writer, readers


class _IntervalMap:
    """Sorted segment starts over [0, inf) of one buffer key; a write coalesces the range it covers into one.
    `by_start` finds a segment by its start in one dict look-up, so a span that is exactly one segment (reused
    slots, whole buffers: the common case) needs no bisect; only cutting and merging do."""
    __slots__ = ("starts", "segments", "by_start")

    def __init__(self) -> None:
        first = _Segment(_END, None, {})
        self.starts: list[int] = [0]
        self.segments: list[_Segment] = [first]
        self.by_start: dict[int, _Segment] = {0: first}

    def cut(self, at: int) -> None:
        """Make `at` (not yet one) a segment boundary: the segment around it splits, the upper part a copy of it."""
        index = bisect.bisect_right(self.starts, at)
        old = self.segments[index - 1]
        new = _Segment(old.stop, old.writer, dict(old.readers))
        old.stop = at
        self.starts.insert(index, at)
        self.segments.insert(index, new)
        self.by_start[at] = new

    def covering(self, start: int, stop: int) -> list[_Segment]:
        """The segments that make up [start, stop), whose ends are boundaries (cut)."""
        segment = self.by_start[start]
        if segment.stop == stop:
            return [segment]
        first = bisect.bisect_left(self.starts, start)
        return self.segments[first:bisect.bisect_left(self.starts, stop, first)]

    def write(self, start: int, stop: int, writer: Position) -> None:
        """[start, stop) becomes one segment written by `writer`, read by nobody since."""
        for end in (start, stop):  # again: an earlier write of the same call may have merged a boundary away
            if end not in self.by_start:
                self.cut(end)
        segment = self.by_start[start]
        segment.writer, segment.readers = writer, {}
        if segment.stop != stop:
            first = bisect.bisect_left(self.starts, start)
            last = bisect.bisect_left(self.starts, stop, first)
            for gone in self.starts[first + 1:last]:
                del self.by_start[gone]
            del self.starts[first + 1:last], self.segments[first + 1:last]
            segment.stop = stop


def _whole(memory: dict[Hashable, _IntervalMap], spans: tuple[Span, ...], found: list[_Segment]) -> bool:
    """Append to `found` the segment each span is exactly; False at the first span that is not one segment."""
    for span in spans:
        area = memory.get(span.key)
        segment = area.by_start.get(span.start) if area is not None else None
        if segment is None or segment.stop != span.stop:
            return False
        found.append(segment)
    return True


def _cut(memory: dict[Hashable, _IntervalMap], call: PlannedCall) -> tuple[list[_Segment], list[_Segment]]:
    """The general case: cut the buffers' segments at every end of the call's (non-empty) spans, and return the
    segments its reads and its writes cover."""
    for span in (*call.reads, *call.writes):
        if span.stop > span.start:
            area = memory.get(span.key)
            if area is None:
                area = memory[span.key] = _IntervalMap()
            if span.start not in area.by_start:
                area.cut(span.start)
            if span.stop not in area.by_start:
                area.cut(span.stop)
    found: tuple[list[_Segment], list[_Segment]] = ([], [])
    for spans, segments in ((call.reads, found[0]), (call.writes, found[1])):
        for span in spans:
            if span.stop > span.start:
                segments.extend(memory[span.key].covering(span.start, span.stop))
    return found


def plan(calls: Iterable[PlannedCall]) -> Plan:
    """Plan `calls` (in program order: a call sees the effects of every earlier call it conflicts with)."""
    with _cyclic_gc_paused:
        return _plan(calls)


class _CyclicGCPause:
    """Planning allocates only records that form no reference cycles, a few per call, all kept; the cyclic collector
    finds nothing to free in them but its passes, triggered by their count, rescan the whole heap (measured: up to 40%
    of planning time with a large heap). So it is paused while any thread plans, and resumed by the last planner out
    only if a planner paused it: a collector the program disabled before planning stays disabled (one it disables
    from another thread while a plan runs is turned back on: the planner cannot tell the two apart)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._planners = 0
        self._paused = False

    def __enter__(self) -> None:
        with self._lock:
            self._planners += 1
            if self._planners == 1 and gc.isenabled():
                gc.disable()
                self._paused = True

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._planners -= 1
            if self._planners == 0 and self._paused:
                self._paused = False
                gc.enable()


_cyclic_gc_paused = _CyclicGCPause()


def _plan(calls: Iterable[PlannedCall]) -> Plan:
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
        known = queue_index.get(call.queue)
        first_use = known is None
        if known is None:
            qi = queue_index[call.queue] = len(positions)
            device_of_queue.append(device_index.setdefault(call.device, len(device_index)))
            positions.append(0)
            waited.append({})
            per_queue.append([])
        else:
            qi = known
        if not first_use and device_index.get(call.device) != device_of_queue[qi]:
            raise ValueError(f"call {index}: queue {call.queue!r} was used on device "
                             f"{list(device_index)[device_of_queue[qi]]!r}, not {call.device!r}")
        position = positions[qi] = positions[qi] + 1
        # The common case, inline: every span is exactly one existing segment (reused slots, whole buffers), so
        # nothing is cut or merged. Otherwise the spans' ends are cut first (_cut) and writes merge afterwards.
        reads: list[_Segment] = []
        writes: list[_Segment] = []
        exact = _whole(memory, call.reads, reads) and _whole(memory, call.writes, writes)
        if not exact:
            reads, writes = _cut(memory, call)
        # Conflicts before updates, so a call never depends on itself.
        deps: dict[int, int] = {}
        get = deps.get
        for segment in reads:
            if segment.writer is not None:
                q, p = segment.writer
                if get(q, 0) < p:
                    deps[q] = p
        for segment in writes:
            if segment.readers:  # every reader followed the writer: waiting for them implies it
                for q, p in segment.readers.items():
                    if get(q, 0) < p:
                        deps[q] = p
            elif segment.writer is not None:
                q, p = segment.writer
                if get(q, 0) < p:
                    deps[q] = p
        for segment in reads:
            segment.readers[qi] = position  # positions grow per queue: this is the newest
        writer = (qi, position)
        if exact:
            for segment in writes:
                segment.writer, segment.readers = writer, {}
        else:
            for span in call.writes:
                if span.stop > span.start:
                    memory[span.key].write(span.start, span.stop, writer)
        conflicts += len(deps)
        fence = False
        waits = []
        mine = waited[qi]
        for producer, value in deps.items():
            if producer == qi:
                fence = True
            elif mine.get(producer, 0) < value:
                mine[producer] = value
                waits.append(_new_tuple(Wait, (producer, value)))
                per_queue[producer][value - 1].signal = value  # someone waits for it: it signals
        submission = Submission(index, qi, position, first_use, tuple(waits), fence)
        submissions.append(submission)
        per_queue[qi].append(submission)
    finaliser_waits: list[list[Wait]] = [[] for _ in device_index]
    for qi, subs in enumerate(per_queue):
        last = subs[-1]
        last.signal = last.position
        finaliser_waits[device_of_queue[qi]].append(Wait(qi, last.position))
    return Plan(tuple(queue_index), tuple(device_index), tuple(device_of_queue), tuple(submissions),
                tuple(Finaliser(d, tuple(w)) for d, w in enumerate(finaliser_waits)), conflicts)

