"""`NIC.events()`: the NIC's asynchronous events as an async stream per subscriber, as users of rdma-core's
ibv_get_async_event expect them (every QP and CQ error, port and device event), without polling.

Each stream gets every event the NIC hears from its subscription on, in order, once. The driver's side never waits
for a subscriber: an event is appended to each stream's buffer and wakes its reader. A stream whose reader falls
behind by more than its `buffer` loses its oldest events; its reader then gets one `missed` event counting them
(DeviceEvent("missed", 0, {"count": N})) where they were. The stream ends (StopAsyncIteration) when the NIC closes,
after what it holds; when the device is lost, after every event heard before the loss (a reset notice's own `reset`
or `fatal` event among them) and a last `lost` event. A stream is unsubscribed when it ends, when it is closed
(`close`, `aclose`, or leaving `with nic.events() as events:`), or when nothing refers to it any more (a loop left
with `break`): the NIC holds its streams weakly.
"""
from __future__ import annotations

import collections
import types
import weakref

import anyio

from .types import check_range
from ..driver.device import Device
from ..driver.firmware_events import DeviceEvent

__all__ = ["DeviceEvent", "EventStream"]  # DeviceEvent: what a stream yields, from the driver

DEFAULT_BUFFER = 256  # events a stream holds for a reader that is behind (the NIC's event log holds as many)
MAX_BUFFER = 1 << 20


class EventStream:
    """One subscriber's events (`NIC.events()`): `async for event in stream`. One reader at a time is meant: readers
    sharing a stream share its events (each event goes to one of them)."""

    def __init__(self, hub: EventHub, buffer: int) -> None:
        self._hub = hub
        self._held: collections.deque[DeviceEvent] = collections.deque()
        self._buffer = buffer
        self._missing = 0  # dropped since the last `missed` event the reader got
        self.missed = 0  # dropped in all, for its reader's statistics
        self._ended = False  # nothing more is put: the reader ends once `_held` is empty
        self._wake: anyio.Event | None = None

    def put(self, event: DeviceEvent) -> None:
        """Never blocks: a full stream drops its oldest event, counted."""
        if self._ended:
            return
        if len(self._held) >= self._buffer:
            self._held.popleft()
            self._missing += 1
            self.missed += 1
        self._held.append(event)
        self._signal()

    def end(self) -> None:
        """No more events: the reader gets what is held, then StopAsyncIteration."""
        self._ended = True
        self._hub.streams.discard(self)
        self._signal()

    def close(self) -> None:
        """Unsubscribe now: what is held is dropped, and a reader waiting or to come ends."""
        self._held.clear()
        self._missing = 0
        self.end()

    async def aclose(self) -> None:
        self.close()

    def _signal(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> DeviceEvent:
        while True:
            if self._missing:
                count, self._missing = self._missing, 0
                return DeviceEvent("missed", 0, {"count": count})
            if self._held:
                return self._held.popleft()
            if self._ended:
                raise StopAsyncIteration
            if self._wake is None or self._wake.is_set():
                self._wake = anyio.Event()
            await self._wake.wait()  # a cancel leaves the stream as it was: nothing is lost

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: types.TracebackType | None) -> None:
        self.close()


class EventHub:
    """A NIC's event streams: it taps the device's event router, ends them when the device is lost (after the
    events heard before) and when the NIC closes."""

    def __init__(self, device: Device) -> None:
        self.streams: weakref.WeakSet[EventStream] = weakref.WeakSet()
        self.ended = False
        device.router.taps.append(self.publish)
        device.liveness.on_lost(lambda _: device.after_events(self._lost))

    def subscribe(self, buffer: int) -> EventStream:
        check_range("buffer", buffer, 1, MAX_BUFFER)
        stream = EventStream(self, buffer)
        if self.ended:
            stream.end()
        else:
            self.streams.add(stream)
        return stream

    def publish(self, event: DeviceEvent) -> None:
        for stream in list(self.streams):
            stream.put(event)

    def end(self) -> None:
        """The NIC closes: every stream ends after what it holds."""
        self.ended = True
        for stream in list(self.streams):
            stream.end()

    def _lost(self) -> None:
        if not self.ended:
            self.publish(DeviceEvent("lost", 0, {}))
            self.end()
