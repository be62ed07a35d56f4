"""Awaitable counters: a queue's signal within one run, and a device's timeline across runs (`timeline_of`: one per
device, shared by every batch that uses it).

Every wait is an anyio Event, so it is cancellable on asyncio, uvloop and trio alike; a wait already satisfied
returns without a checkpoint (the replay hot path)."""
from __future__ import annotations

import weakref
from typing import Any

import anyio


class Counter:
    """A monotonic integer one can wait on: `await counter.wait_for(n)` returns once `value >= n`."""
    __slots__ = ("value", "_waiters")

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self._waiters: list[tuple[int, anyio.Event]] = []

    def set(self, value: int) -> None:
        if value <= self.value:
            return
        self.value = value
        if self._waiters:
            still = []
            for target, event in self._waiters:
                if target <= value:
                    event.set()
                else:
                    still.append((target, event))
            self._waiters = still

    async def wait_for(self, target: int) -> None:
        if self.value >= target:
            return
        entry = (target, anyio.Event())
        self._waiters.append(entry)
        try:
            await entry[1].wait()
        finally:
            if entry in self._waiters:  # cancelled: leave nothing behind
                self._waiters.remove(entry)


class Timeline(Counter):
    """A device's epochs: each run takes a ticket; its value is the highest ticket below which every ticket was
    completed. A run completes its ticket even when it fails or is cancelled, so later runs never wait forever,
    yet a later run never passes an earlier one still running on the device."""
    __slots__ = ("issued", "_done")

    def __init__(self) -> None:
        super().__init__()
        self.issued = 0
        self._done: set[int] = set()

    def take(self) -> int:
        self.issued += 1
        return self.issued

    def complete(self, ticket: int) -> None:
        if ticket <= self.value or ticket in self._done:
            return
        self._done.add(ticket)
        value = self.value
        while value + 1 in self._done:
            value += 1
            self._done.discard(value)
        self.set(value)


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
