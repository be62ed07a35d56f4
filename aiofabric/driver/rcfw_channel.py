"""The RCFW channel: RoCE firmware commands posted on the CMDQ ring, many in flight, answered on the CREQ ring and
matched by cookie. The CREQ also carries asynchronous events, handed to whoever the owner named (`on_event`)."""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Callable

import anyio

from . import log
from .close_budget import CloseBudget
from .commands import CMDQ_HEADER_FIELDS, build, rcfw_types
from .interrupts import COMMAND_POLL, wait_for_interrupt, wake
from .liveness import Liveness
from .rings import Ring
from ..autogen import bnxt
from ..errors import DeviceLostError, FirmwareError, FirmwareTimeoutError, PCIError
from ..hw.cqe import CREQ_COMMAND_EVENT, CREQ_ENTRY, CREQ_EVENT_OFFSET, CREQ_TYPE_OFFSET, creq_type
from ..hw.firmware import CMDQ_FIRST_PRODUCER, CMDQ_HEADER, CMDQ_INIT, CMDQ_SLOT
from ..pci import Bar, DmaBuffer, PCIDevice, memory_barrier, read_barrier

RCFW_TIMEOUT = 20.0  # Linux RCFW_CMD_WAIT_TIME_MS
CMDQ_DEPTH = 8192  # slots of 16 bytes: 128 KiB, Linux's BNXT_QPLIB_CMDQE_MAX_CNT
CREQ_DEPTH = 4096
CREQ_POLL = 4 * COMMAND_POLL  # the reader's safety poll while a command awaits its reply
QP_EVENT = bnxt.CREQ_BASE_TYPE_QP_EVENT  # the CREQ entry type of replies, and of a QP's or CQ's error notification
QP_ERROR = bnxt.CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION
CQ_ERROR = bnxt.CREQ_QP_EVENT_EVENT_CQ_ERROR_NOTIFICATION
REPLY_NOT = frozenset((QP_ERROR, CQ_ERROR))  # QP-event entries that are not replies


def command_queue(pci: PCIDevice) -> Ring:
    """The CMDQ as current Linux allocates it (bnxt_qplib_alloc_rcfw_channel): one contiguous area at level 0. Where
    the platform has no contiguous 128 KiB (no IOMMU and no hugepage), 4 KiB pages behind a page table, as older
    Linux gave it: cmdq_init names either."""
    try:
        return Ring(pci, CMDQ_DEPTH, CMDQ_SLOT, contiguous=True)
    except PCIError as exc:
        log.info("%s: %s; the CMDQ is paged instead", pci.address, exc)
        return Ring(pci, CMDQ_DEPTH, CMDQ_SLOT)


@dataclasses.dataclass
class PendingCommand:
    name: str
    slots: int
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    entry: bytes | None = None
    error: BaseException | None = None


class RcfwChannel:
    """Commands by name (`command`); the CREQ is read by one task at a time (`serve`): the NIC's background reader,
    or, while there is none (its task was cancelled), a command waiting for its own reply. Like HWRM, a posted
    command is waited for even if the caller is cancelled (bounded by its timeout and a close's budget)."""

    def __init__(self, pci: PCIDevice, bar0: Bar, doorbells: Bar, db_offset: int, fd: int | None, creq: Ring,
                 creq_id: int, liveness: Liveness, budget: CloseBudget, on_event: Callable[[bytes], None],
                 timeout: float = RCFW_TIMEOUT) -> None:
        self.pci, self.bar0, self.doorbells, self.db_offset, self.fd = pci, bar0, doorbells, db_offset, fd
        self.creq, self.creq_id, self.liveness, self.budget = creq, creq_id, liveness, budget
        self.on_event, self.timeout = on_event, timeout
        self.cmdq = command_queue(pci)
        self.pending: dict[int, PendingCommand] = {}
        self.reading = False  # a task is serving the CREQ (only one may wait on its interrupt fd)
        self._idle = False  # ... and sleeps without a safety poll: no command awaits a reply
        self._cookie = 0
        self._space = anyio.Event()
        self._first_command = True

    def init_block(self) -> bytes:
        """The CMDQ_INIT mailbox the device writes to BAR0 to hand the firmware this channel's rings."""
        size_level = CMDQ_DEPTH << bnxt.CMDQ_INIT_CMDQ_SIZE_SFT & bnxt.CMDQ_INIT_CMDQ_SIZE_MASK \
            | self.cmdq.level & bnxt.CMDQ_INIT_CMDQ_LVL_MASK
        return CMDQ_INIT.pack(self.cmdq.base, size_level, self.creq_id, 0)

    async def command(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run RoCE firmware command `name` (e.g. "create_qp"); the side-buffer result or the CREQ reply.
        FirmwareError with the decoded status, FirmwareTimeoutError past the timeout, DeviceLostError."""
        self.liveness.check()  # first: a lost device's destroy frees memory, whatever the budget
        self.budget.check(f"RCFW {name}")
        request_type, response_type, side_type, opcode = rcfw_types(name)
        request = build(request_type, f"RCFW {name}", fields, CMDQ_HEADER_FIELDS)
        slots = -(-ctypes.sizeof(request_type) // CMDQ_SLOT)
        timeout = self.budget.bounded(command_timeout or self.timeout)
        deadline = anyio.current_time() + timeout  # the whole command: queue space, then its answer
        await self._wait_for_space(f"RCFW {name}", slots, timeout)
        side: DmaBuffer | None = self.pci.alloc_dma(ctypes.sizeof(side_type)) if side_type else None
        cookie = self._next_cookie()
        request.opcode, request.cmd_size, request.cookie = opcode, slots, cookie
        if side is not None and side_type is not None:
            request.resp_addr, request.resp_size = side.bus_addr, -(-ctypes.sizeof(side_type) // CMDQ_SLOT)
        pending = self.pending[cookie] = PendingCommand(name, slots)
        self._post(bytes(request).ljust(slots * CMDQ_SLOT, b"\0"))
        await self._await_reply(pending, max(0.0, deadline - anyio.current_time()))
        if pending.error is not None:
            if side is not None:
                side.free()
            raise pending.error
        if pending.entry is None:  # the side buffer stays allocated: a late answer may still be DMA'd into it
            self._forget(cookie, slots)
            raise FirmwareTimeoutError(f"RCFW {name}: no answer from {self.pci.address} within {timeout:g} s"
                                       + self.budget.note())
        result = None
        if side is not None and side_type is not None:
            result = side_type.from_buffer_copy(side.view)
            side.free()
        status = CREQ_COMMAND_EVENT.unpack_from(pending.entry)[1]
        if status:
            raise FirmwareError.rcfw(name, status)
        return result if result is not None else response_type.from_buffer_copy(pending.entry)

    async def raw(self, data: bytes, timeout: float) -> bytes | None:
        """Post a CMDQ command built elsewhere (any opcode and body: a firmware fuzzer's), whole 16-byte slots with
        its cookie field (bytes 4-5) set here; its CREQ entry, or None if none came within `timeout`."""
        slots = len(data) // CMDQ_SLOT
        await self._wait_for_space("raw RCFW command", slots, timeout)
        cookie = self._next_cookie()
        pending = self.pending[cookie] = PendingCommand("raw", slots)
        command = bytearray(data[:slots * CMDQ_SLOT])
        opcode, cmd_size, flags, _, resp_size, resp_addr = CMDQ_HEADER.unpack_from(command)
        CMDQ_HEADER.pack_into(command, 0, opcode, cmd_size, flags, cookie, resp_size, resp_addr)
        self._post(bytes(command))
        await self._await_reply(pending, timeout)
        if pending.error is not None:
            raise pending.error
        if pending.entry is None:
            self._forget(cookie, slots)
        return pending.entry

    async def _wait_for_space(self, what: str, slots: int, timeout: float) -> None:
        """Until the CMDQ has room for `slots` (Linux's rule: never fill the last free slot) and a cookie is free."""
        try:
            with anyio.fail_after(timeout):
                while slots >= self.cmdq.free_entries() or len(self.pending) >= bnxt.RCFW_MAX_COOKIE_VALUE:
                    self.liveness.check()
                    await self._space.wait()
        except TimeoutError:
            raise FirmwareTimeoutError(f"{what}: no command queue space within {timeout:g} s"
                                       + self.budget.note()) from None
        self.liveness.check()
        self.budget.check(what)

    def _forget(self, cookie: int, slots: int) -> None:
        """A command that got no answer: assume the firmware consumed its slots; a late reply is dropped."""
        self.pending.pop(cookie, None)
        self.cmdq.consumer += slots
        self._signal_space()

    async def _await_reply(self, pending: PendingCommand, timeout: float) -> None:
        """Wait (shielded, at most `timeout`) until the CREQ answers `pending` or the device is lost."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            while pending.entry is None and pending.error is None and not self.budget.spent():
                if self.reading:
                    await pending.done.wait()
                    pending.done = anyio.Event()  # woken because the reader left: look again
                else:  # no reader (its task was cancelled, or none started yet): serve the CREQ until answered
                    await self.serve(until=pending)

    def _next_cookie(self) -> int:
        while True:
            self._cookie = (self._cookie + 1) & bnxt.RCFW_MAX_COOKIE_VALUE
            if self._cookie not in self.pending:
                return self._cookie

    def _post(self, data: bytes) -> None:
        cmdq = self.cmdq
        for i in range(0, len(data), CMDQ_SLOT):
            offset = cmdq.offset(cmdq.producer)
            cmdq.view[offset:offset + CMDQ_SLOT] = data[i:i + CMDQ_SLOT]
            cmdq.producer += 1
        producer = cmdq.producer & 0xFFFF
        if self._first_command:  # tells the firmware to reset its CMDQ/CREQ pointers
            producer |= CMDQ_FIRST_PRODUCER
            self._first_command = False
        memory_barrier()  # the command's slots in host memory before the producer the firmware reads them by
        self.bar0.write32(bnxt.RCFW_COMM_BASE_OFFSET + bnxt.RCFW_PF_VF_COMM_PROD_OFFSET, producer)
        self.bar0.write32(bnxt.RCFW_COMM_BASE_OFFSET + bnxt.RCFW_COMM_TRIG_OFFSET, bnxt.RCFW_CMDQ_TRIG_VAL)
        if self._idle:  # wake the reader, so a lost reply interrupt costs a safety poll, not the timeout
            self._idle = False
            wake(self.fd)

    def _signal_space(self) -> None:
        self._space.set()
        self._space = anyio.Event()

    async def serve(self, until: PendingCommand | None = None) -> None:
        """Read the CREQ: replies go to their waiters by cookie, events to `on_event`. Whoever leaves wakes the
        waiters, so another takes over."""
        self.reading = True
        quiet = False  # the last sleep ended by its safety poll
        try:
            while until is None or until.entry is None:
                self._drain()
                if until is not None and until.entry is None:
                    await self.liveness.look(raising=False)  # no watch task: a dead device fails `until` here
                    if self.budget.spent():
                        return
                if self.liveness.lost or (until is not None and until.entry is not None):
                    return
                # quiet with no command waiting: only events can arrive, each with its interrupt, so no periodic
                # wake-up (one safety poll first, so a run of commands does not wake the reader for each)
                self._idle = quiet and not self.pending
                try:
                    quiet = not await wait_for_interrupt(self.fd, None if self._idle else CREQ_POLL)
                finally:
                    self._idle = False
        finally:
            self.reading = False
            for waiter in self.pending.values():
                waiter.done.set()

    def _drain(self) -> None:
        creq, view = self.creq, self.creq.view
        freed = 0
        while True:
            offset = creq.offset(creq.consumer)
            if not CREQ_ENTRY.is_new(view, offset, creq.consumer, creq.depth):
                break
            read_barrier()  # the entry's body after its valid bit (Linux dma_rmb in bnxt_qplib_service_creq)
            entry = bytes(view[offset:offset + CREQ_ENTRY.size])
            creq.consumer += 1
            freed += self._dispatch(entry)
        self.doorbells.write64_doorbell(self.db_offset, creq.doorbell(self.creq_id, bnxt.DBC_DBC_TYPE_NQ_ARM))
        if freed:
            self._signal_space()

    def _dispatch(self, entry: bytes) -> int:
        """A reply completes its command and gives back its CMDQ slots (how many: the return); anything else is
        an event for the owner."""
        if creq_type(entry[CREQ_TYPE_OFFSET]) != QP_EVENT or entry[CREQ_EVENT_OFFSET] in REPLY_NOT:
            self.on_event(entry)
            return 0
        _, status, cookie, _, event = CREQ_COMMAND_EVENT.unpack_from(entry)
        pending = self.pending.pop(cookie, None)
        if pending is None:
            log.warning("%s: CREQ reply with unknown cookie %#x (event %#x) dropped", self.pci.address, cookie, event)
            return 0
        pending.entry = entry
        pending.done.set()
        self.cmdq.consumer += pending.slots
        return pending.slots

    def fail_all(self, error: DeviceLostError) -> None:
        """The device is gone: every command waiting for a reply fails with `error`, and waiters for space wake."""
        for pending in self.pending.values():
            pending.error = error
            pending.done.set()
        self.pending.clear()
        self._signal_space()
