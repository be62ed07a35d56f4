"""A run's timeline as Chrome trace JSON (chrome://tracing, Perfetto): one track per queue, one slice per call."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class CallTrace:
    """When one call ran, in time.perf_counter_ns() (start: started or posted, end: completed)."""
    call: int
    name: str
    queue: str
    start_ns: int
    end_ns: int


def chrome_trace(records: Sequence[CallTrace], queues: Sequence[str]) -> dict[str, Any]:
    track = {name: i for i, name in enumerate(queues)}
    origin = min((r.start_ns for r in records), default=0)
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "aiofabric batch"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": name}}
               for name, i in track.items()]
    events += [{"name": r.name, "ph": "X", "pid": 1, "tid": track[r.queue], "ts": (r.start_ns - origin) / 1000,
                "dur": max(r.end_ns - r.start_ns, 0) / 1000, "args": {"call": r.call}} for r in records]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], records: Sequence[CallTrace], queues: Sequence[str]) -> None:
    with open(path, "w") as out:
        json.dump(chrome_trace(records, queues), out)
