"""Firmware events: the async event ring and its reader, what each event means, the port's link, and who hears of
every asynchronous event (`EventRouter`: these, and the error notifications and function events of the CREQ).

Linux's bnxt_en (bnxt.c) registers the events it handles with FUNC_DRV_RGTR (bnxt_hwrm_func_drv_rgtr: the
async_event_fwd bitmap of bnxt_async_events_arr) and names the ring they arrive on with FUNC_CFG's async_event_cr
(bnxt_hwrm_set_async_event_cr): on P5 chips its first NQ, whose poll hands every entry that is not a CQ notification
to bnxt_hwrm_handler and bnxt_async_event_process. Link changes make it re-read PORT_PHY_QCFG (bnxt_link_sp,
bnxt_update_link); RESET_NOTIFY stops the device (bnxt_fw_reset, and bnxt_re's stop marks its command queue detached
and reports IB_EVENT_DEVICE_FATAL): everything must be re-initialised, which here is a lost device.

Here the events get an NQ of their own (`EventRing`) on MSI-X vector EVENT_VECTOR, named with FUNC_CFG's
async_event_cr as soon as it exists, and read by one of the NIC's background tasks that sleeps on that interrupt
without a timeout (docs/api.md: an idle NIC wakes nothing). Until it is named, the firmware sends events to the
function's default completion ring, the CREQ, where Linux's bnxt_qplib_service_creq accepts HWRM async event
completions too: the CREQ's reader hands them over (`EventRouter.creq_event`), and a task of their own handles them
(`EventInbox`).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Awaitable, Callable, Mapping

import anyio

from . import log
from .interrupts import wait_for_interrupt
from .liveness import Liveness
from .rcfw_channel import CQ_ERROR, QP_ERROR, QP_EVENT
from .rings import Ring
from ..autogen import bnxt
from ..hw.async_event import ASYNC_EVENT, ASYNC_EVENT_ENTRY, ASYNC_EVENT_TYPE, EventId, ResetReason, reset_reason
from ..hw.cqe import CREQ_EVENT_OFFSET, CREQ_TYPE_OFFSET, creq_type
from ..pci import Bar, read_barrier

EVENT_VECTOR = 2  # RING_ALLOC's logical_id for the event ring (interrupts.py has the others)
EVENT_RING_DEPTH = 64
LINK_EVENTS = frozenset({EventId.LINK_STATUS_CHANGE, EventId.LINK_SPEED_CHANGE, EventId.PORT_PHY_CFG_CHANGE})


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """An asynchronous event the firmware reported: on the CREQ ("qp_error", "cq_error", "function") or on the event
    ring (`event_kind`: "link", "mtu", "reset", "fatal", ...)."""
    kind: str
    xid: int  # QP number / CQ id; the event code for function and firmware events
    detail: Mapping[str, int]

    def __post_init__(self) -> None:  # every stream's subscriber gets this one object: none may change it for others
        object.__setattr__(self, "detail", Detail(self.detail))


class Detail(dict[str, int]):
    """An event's detail: a dict (JSON, pickle and copies take it as one) that refuses to be changed; dict(detail)
    is a copy to change."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("an event's detail is shared by every subscriber: change a copy (dict(event.detail))")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type, tuple[dict[str, int]]]:
        return Detail, (dict(self),)


Handler = Callable[[DeviceEvent], None]
FirmwareEvent = Callable[[int, int, int], None]  # (event_id, data1, data2) of an HWRM async event


class EventRouter:
    """Who hears of each event: a QP's or CQ's error notification goes to the handler its object named (`route`), a
    function-wide event to every one of `function_handlers`, an HWRM async event that came on the CREQ to
    `firmware_event`; what no handler takes is logged and kept in `events`. Every one of `taps` hears every QP, CQ
    and function-wide event, taken or not (the NIC's event streams: they must not block)."""

    def __init__(self, address: str, firmware_event: FirmwareEvent) -> None:
        self.address = address  # the device's, for the log
        self.firmware_event = firmware_event
        self.handlers: dict[str, dict[int, Handler]] = {"qp_error": {}, "cq_error": {}}
        self.function_handlers: list[Handler] = []
        self.taps: list[Handler] = []
        self.events: collections.deque[DeviceEvent] = collections.deque(maxlen=256)

    def route(self, kind: str, xid: int, handler: Handler | None) -> None:
        """Send QP ("qp_error") or CQ ("cq_error") error notifications for object `xid` to `handler` (None: stop)."""
        table = self.handlers[kind]
        if handler is None:
            table.pop(xid, None)
        else:
            table[xid] = handler

    def creq_event(self, entry: bytes) -> None:
        """A CREQ entry that is not a command's reply: an error notification for a QP or CQ, a function event, or an
        HWRM async event (the firmware's before the event ring is named)."""
        kind, event = creq_type(entry[CREQ_TYPE_OFFSET]), entry[CREQ_EVENT_OFFSET]
        if kind == QP_EVENT and event in (QP_ERROR, CQ_ERROR):
            layout = bnxt.creq_qp_error_notification if event == QP_ERROR else bnxt.creq_cq_error_notification
            notice = layout.from_buffer_copy(entry)
            detail = {name: getattr(notice, name) for name, *_ in layout._fields_
                      if not name.startswith(("reserved", "type", "v", "event"))}
            routed = DeviceEvent("qp_error" if event == QP_ERROR else "cq_error", notice.xid, detail)
            self.tap(routed)
            self.deliver(routed, self.handlers[routed.kind].get(notice.xid))
        elif kind == bnxt.CREQ_BASE_TYPE_FUNC_EVENT:
            self.announce(DeviceEvent("function", event, {}))
        elif kind == ASYNC_EVENT_TYPE:
            _, event_id, data2, data1 = ASYNC_EVENT.unpack_from(entry)
            self.firmware_event(event_id, data1, data2)
        else:
            log.warning("%s: unexpected CREQ entry type %#x dropped", self.address, kind)

    def announce(self, event: DeviceEvent) -> None:
        """A function-wide event: to the taps, to `events` and to every function handler."""
        self.tap(event)
        for handler in [None, *self.function_handlers]:
            self.deliver(event, handler)

    def tap(self, event: DeviceEvent) -> None:
        for handler in list(self.taps):
            self.deliver(event, handler)

    def deliver(self, event: DeviceEvent, handler: Handler | None) -> None:
        if handler is None:
            self.events.append(event)
            log.info("%s: %s", self.address, event)
            return
        try:
            handler(event)
        except Exception:
            log.exception("%s: handler for %s failed", self.address, event)


class EventInbox:
    """Firmware events heard where they cannot be handled at once (the CREQ's and the event ring's readers, which
    must not wait for the HWRM commands a link change needs): they wait here, in order, for `serve`. It holds as many
    as the event ring, and the steps (`then`) to run between them."""

    def __init__(self, address: str) -> None:
        self.address = address  # the device's, for the log
        self.waiting: collections.deque[tuple[int, int, int] | Callable[[], None]] = collections.deque()
        self.arrived = anyio.Event()

    def put(self, event_id: int, data1: int, data2: int) -> None:
        if len(self.waiting) >= EVENT_RING_DEPTH:
            log.warning("%s: firmware event %#x dropped: %d wait to be handled", self.address, event_id,
                        len(self.waiting))
            return
        self.waiting.append((event_id, data1, data2))
        self.arrived.set()

    def then(self, step: Callable[[], None]) -> None:
        """Run `step` once every event put before it has been handled (not counted against the bound)."""
        self.waiting.append(step)
        self.arrived.set()

    async def serve(self, handle: Callable[[int, int, int], Awaitable[None]]) -> None:
        """Hand every event to `handle`, in order; between events, sleep until one is put (no timeout)."""
        while True:
            while self.waiting:
                item = self.waiting.popleft()
                if isinstance(item, tuple):
                    await handle(*item)
                else:
                    item()
            await self.arrived.wait()
            self.arrived = anyio.Event()


@dataclasses.dataclass(frozen=True)
class Link:
    """The port's link as PORT_PHY_QCFG reports it."""
    up: bool
    speed_mbps: int  # 0 while down


def event_kind(event_id: int, data1: int) -> str:
    """A DeviceEvent's kind for a firmware event: "link" (its state or speed changed: re-read it), "mtu", "reset" (a
    reset notice), "fatal" (RESET_NOTIFY for a fatal firmware exception), or the event's name in lower case."""
    if event_id in LINK_EVENTS:
        return "link"
    if event_id == EventId.LINK_MTU_CHANGE:
        return "mtu"
    if event_id == EventId.RESET_NOTIFY:
        return "fatal" if reset_reason(data1) == ResetReason.FW_EXCEPTION_FATAL else "reset"
    try:
        return EventId(event_id).name.lower()
    except ValueError:
        return f"event_{event_id:#x}"


def reset_text(data1: int) -> str:
    """RESET_NOTIFY's reason, by name."""
    reason = reset_reason(data1)
    try:
        return ResetReason(reason).name
    except ValueError:
        return f"reason {reason:#x}"


class EventRing:
    """The NQ the firmware writes hwrm_async_event_cmpl entries to, and its reader (`serve`)."""

    def __init__(self, ring: Ring, ring_id: int, doorbells: Bar, db_offset: int, fd: int | None,
                 liveness: Liveness) -> None:
        self.ring, self.ring_id, self.doorbells, self.db_offset, self.fd = ring, ring_id, doorbells, db_offset, fd
        self.liveness = liveness
        self.armed = False

    def take(self) -> list[tuple[int, int, int]]:
        """The events written since the last call, as (event_id, data1, data2); the ring is armed again after any
        (an NQ that fired is disarmed)."""
        ring, view, events = self.ring, self.ring.view, []
        while ASYNC_EVENT_ENTRY.is_new(view, ring.offset(ring.consumer), ring.consumer, ring.depth):
            read_barrier()  # the entry's body after its valid bit (Linux dma_rmb in bnxt_poll_p5)
            kind, event_id, data2, data1 = ASYNC_EVENT.unpack_from(view, ring.offset(ring.consumer))
            if kind & bnxt.ASYNC_EVENT_CMPL_TYPE_MASK == ASYNC_EVENT_TYPE:
                events.append((event_id, data1, data2))
            else:
                log.warning("event ring %d: entry of type %#x is no async event: dropped", self.ring_id, kind)
            ring.consumer += 1
        if events or not self.armed:
            self.doorbells.write64_doorbell(self.db_offset, ring.doorbell(self.ring_id, bnxt.DBC_DBC_TYPE_NQ_ARM))
            self.armed = True
        return events

    async def serve(self, handle: Callable[[int, int, int], Awaitable[None]]) -> None:
        """Hand every event to `handle`, in order, until the device is lost; between events, sleep on the ring's
        interrupt with no timeout: arming after the last entry read closes the race (the NQ fires at once when
        entries wait)."""
        while self.liveness.alive:
            for event in self.take():
                await handle(*event)
            if self.liveness.alive:
                await wait_for_interrupt(self.fd, None)
