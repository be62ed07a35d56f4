"""The NIC's control path: HWRM and RCFW command channels, bring-up, asynchronous events, close.

Bring-up follows the seed's BNXTDev, corrected where Linux (bnxt_en/bnxt_re) differs: the driver registers with an OS
type, walks backing-store types by `next_valid_type`, initialises context memory at `ctx_init_offset * 4` only when
the firmware asks (ENABLE_CTX_KIND_INIT), sizes every ring explicitly, and asks for hardware retransmission only
when QUERY_FUNC says the firmware supports the host MSN table.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import select
import socket
from typing import Any, AsyncIterator, Callable

import anyio

from . import __version__
from .autogen import bnxt
from .errors import ClosedError, DeviceLostError, FirmwareError, FirmwareTimeoutError
from .pci import PAGE_SIZE, PCI_VENDOR_ID, DmaBuffer, PCIDevice, memory_barrier
from .rings import Ring, doorbell, page_table

log = logging.getLogger("aiofabric.device")

HWRM_TIMEOUT = 2.0  # Linux: 500 ms default; generous for loaded CI machines
RCFW_TIMEOUT = 20.0  # Linux RCFW_CMD_WAIT_TIME_MS
SAFETY_POLL = 0.05  # re-check memory this often even without an interrupt (lost-interrupt insurance)
CLOSE_TIMEOUT = 10.0  # seconds a close may spend on the firmware before it leaves the rest to the device's reset
POLL_INTERVAL = 0.001  # how often to look at memory on a platform without interrupts
HWRM_VECTOR, CREQ_VECTOR, NQ_VECTOR = 0, 1, 2
CMDQ_DEPTH = 4096  # 16-byte slots; Linux uses 8192 (256 on old firmware)
CREQ_DEPTH = 4096
NQ_DEPTH = 4096
CMDQ_SLOT = 16
QP_EVENT = bnxt.CREQ_BASE_TYPE_QP_EVENT
FUNC_EVENT = bnxt.CREQ_BASE_TYPE_FUNC_EVENT
QP_ERROR = bnxt.CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION
CQ_ERROR = bnxt.CREQ_QP_EVENT_EVENT_CQ_ERROR_NOTIFICATION
HOST_MSN_TABLE = 1 << 4  # CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT, in dev_cap_ext_flags2 (reference §7)
BS_TYPE_INVALID = 0xFFFF
BS_QP, BS_SRQ, BS_CQ, BS_MRAV, BS_TIM = 0, 1, 2, 0xE, 0xF
EXTRA_QPS, EXTRA_MRS = 1024, 4096  # RoCE objects the backing store is sized for, beyond the firmware's L2 needs


def ipv4_gid(ip: str) -> bytes:
    """The RoCEv2 GID of an IPv4 address: ::ffff:a.b.c.d."""
    return bytes(10) + b"\xff\xff" + socket.inet_aton(ip)


@functools.cache
def _hwrm_types(name: str) -> tuple[type, type, int]:
    try:
        return (getattr(bnxt, f"hwrm_{name}_input"), getattr(bnxt, f"hwrm_{name}_output"),
                getattr(bnxt, f"HWRM_{name.upper()}"))
    except AttributeError:
        raise ValueError(f"unknown HWRM command {name!r}") from None


@functools.cache
def _rcfw_types(name: str) -> tuple[type, type, type | None, int]:
    try:
        request, response = getattr(bnxt, f"cmdq_{name}"), getattr(bnxt, f"creq_{name}_resp")
        opcode = getattr(bnxt, f"CMDQ_BASE_OPCODE_{name.upper()}")
    except AttributeError:
        raise ValueError(f"unknown RCFW command {name!r}") from None
    return request, response, getattr(bnxt, f"creq_{name}_resp_sb", None), opcode


def build(struct_type: type, what: str, fields: dict[str, Any], reserved: set[str]) -> ctypes.Structure:
    """Instantiate a binding, refusing field names it does not have (ctypes would silently accept them)."""
    known = {name for name, *_ in struct_type._fields_}
    for name in fields:
        if name not in known or name in reserved:
            raise ValueError(f"{what} has no field {name!r} (fields: {', '.join(sorted(known - reserved))})")
    try:
        return struct_type(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: bad field value ({exc})") from None


HWRM_HEADER = {"req_type", "cmpl_ring", "seq_id", "target_id", "resp_addr"}
CMDQ_HEADER = {"opcode", "cmd_size", "cookie", "resp_size", "resp_addr"}


@dataclasses.dataclass
class _Pending:
    name: str
    slots: int
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    entry: bytes | None = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """An asynchronous event the firmware reported on the CREQ."""
    kind: str  # "qp_error", "cq_error" or "function"
    xid: int  # QP number / CQ id; the event code for function events
    detail: dict[str, int]


class Device:
    """One BNXT function driven from userspace. Use `aiofabric.open_nic`, which boots and closes it."""

    def __init__(self, pci: PCIDevice, ip: str, *, hwrm_timeout: float = HWRM_TIMEOUT,
                 rcfw_timeout: float = RCFW_TIMEOUT) -> None:
        self.pci, self.ip, self.gid = pci, ip, ipv4_gid(ip)
        self.hwrm_timeout, self.rcfw_timeout = hwrm_timeout, rcfw_timeout
        self.bar0, self.doorbells = pci.map_bar(0), pci.map_bar(2)
        self._irq = [pci.interrupt_fd(v) if v < pci.num_vectors else None for v in range(3)]
        self._hwrm_lock = anyio.Lock()
        self._hwrm_resp = pci.alloc_dma(PAGE_SIZE)
        self._seq = 0
        self._max_request = bnxt.HWRM_MAX_REQ_LEN
        self._lost: DeviceLostError | None = None
        self._pending: dict[int, _Pending] = {}
        self._cookie = 0
        self._cmdq_space = anyio.Event()
        self._first_command = True
        self._qp_handlers: dict[int, Callable[[DeviceEvent], None]] = {}
        self._cq_handlers: dict[int, Callable[[DeviceEvent], None]] = {}
        self.function_handlers: list[Callable[[DeviceEvent], None]] = []
        self.events: collections.deque[DeviceEvent] = collections.deque(maxlen=256)
        self._teardown: list[tuple[str, Callable[[], Any]]] = []  # firmware objects, freed in reverse order
        self.objects: dict[int, Any] = {}  # live verbs objects (CQs, QPs, MRs) by id()
        self._closing = False  # close() started: the public API refuses, teardown still runs commands
        self._close_deadline: float | None = None  # close(): every firmware wait ends by then
        self._close_lock = anyio.Lock()
        self._closed = False  # close() ran to the end
        self._watching_removal = False  # the removal watch task runs; else command waits look themselves
        self._creq_reader = False  # a task is serving the CREQ (only one may wait on its interrupt fd)
        self._creq_idle = False  # ... and sleeps without a safety poll: no command awaits a reply
        self._background: list[anyio.CancelScope] = []  # the NIC's own tasks: close() stops them first
        self.fw_version = self.hwrm_version = self.mac = ""
        self.port_id = self.db_offset = 0
        self.gid_index = -1
        self.caps: dict[str, int] = {}
        self.hw_retransmit = False

    # -- HWRM: one command in flight -------------------------------------------------------------------------------
    async def hwrm(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run HWRM command `name` (e.g. "func_qcaps") with the given input fields; return its output structure.

        `command_timeout` (seconds) overrides the channel's default; it is not called `timeout` because firmware
        structures have fields of that name. Once posted, a command is waited for even if the caller is cancelled
        (bounded by the timeout), so a cancelled allocation never leaves an object the driver does not know of."""
        self.check_open()
        return await self._hwrm(name, command_timeout=command_timeout, **fields)

    async def _hwrm(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        self._check_alive()  # first: a lost device's destroy frees memory, whatever the budget
        self._check_budget(f"HWRM {name}")
        request_type, response_type, opcode = _hwrm_types(name)
        request = build(request_type, f"HWRM {name}", fields, HWRM_HEADER)
        timeout = self._bounded(command_timeout or self.hwrm_timeout)
        deadline = anyio.current_time() + timeout  # the whole command: its turn on the channel, then its answer
        async with self._hwrm_turn(name, timeout):
            self._check_alive()
            self._check_budget(f"HWRM {name}")
            self._seq = seq = (self._seq + 1) & 0xFFFF
            request.req_type, request.cmpl_ring, request.seq_id = opcode, 0xFFFF, seq
            request.target_id, request.resp_addr = bnxt.BNXT_HWRM_TARGET, self._hwrm_resp.bus_addr
            data = bytes(request)
            if len(data) > self._max_request:
                raise ValueError(f"HWRM {name}: {len(data)}-byte request exceeds the {self._max_request}-byte window")
            resp = self._hwrm_resp.view
            resp[:8] = bytes(8)
            self.bar0.write_block(bnxt.BNXT_GRCPF_REG_CHIMP_COMM, data.ljust(self._max_request, b"\0"))
            self.bar0.write32(bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER, 1)

            def answered() -> bool:
                length = int.from_bytes(resp[6:8], "little")
                return 8 <= length <= len(resp) and int.from_bytes(resp[4:6], "little") == seq \
                    and resp[length - 1] != 0

            await self._wait(answered, self._irq[HWRM_VECTOR], max(0.0, deadline - anyio.current_time()),
                             f"HWRM {name}")
            length = int.from_bytes(resp[6:8], "little")
            raw = bytes(resp[:length])
            resp[length - 1] = 0  # clear the valid byte, as Linux does, so a stale answer never looks new
        error = int.from_bytes(raw[0:2], "little")
        if error:
            cmd_err = raw[14] if length == ctypes.sizeof(bnxt.hwrm_err_output) else 0
            raise FirmwareError.hwrm(name, error, cmd_err)
        return response_type.from_buffer_copy(raw[:ctypes.sizeof(response_type)].ljust(
            ctypes.sizeof(response_type), b"\0"))

    @contextlib.asynccontextmanager
    async def _hwrm_turn(self, name: str, timeout: float) -> AsyncIterator[None]:
        """The HWRM channel (one command at a time), waited for at most `timeout`."""
        try:
            with anyio.fail_after(timeout):
                await self._hwrm_lock.acquire()
        except TimeoutError:
            raise FirmwareTimeoutError(f"HWRM {name}: the channel stayed busy for {timeout:g} s"
                                       + self._budget_note()) from None
        try:
            yield
        finally:
            self._hwrm_lock.release()

    async def _wait(self, ready: Callable[[], bool], fd: int | None, timeout: float, what: str) -> None:
        """Sleep on an interrupt fd until `ready()`; memory is re-checked on every wake and every SAFETY_POLL. A
        close that starts meanwhile ends the wait at its deadline too."""
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(timeout):
                while not ready():
                    await self._check_removed()
                    if self._close_spent():
                        raise TimeoutError
                    await wait_for_interrupt(fd, SAFETY_POLL)
        except TimeoutError:
            self._check_alive()
            raise FirmwareTimeoutError(f"{what}: no answer from {self.pci.address} within {timeout:g} s"
                                       + self._budget_note()) from None

    # -- RCFW: many commands in flight, matched by cookie ------------------------------------------------------------
    async def rcfw(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run RoCE firmware command `name` (e.g. "create_qp"); return the side-buffer result or the CREQ reply.

        Like `hwrm`, a posted command is waited for even if the caller is cancelled (bounded by the timeout)."""
        self.check_open()
        return await self._rcfw(name, command_timeout=command_timeout, **fields)

    async def _rcfw(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        self._check_alive()  # first: a lost device's destroy frees memory, whatever the budget
        self._check_budget(f"RCFW {name}")
        request_type, response_type, side_type, opcode = _rcfw_types(name)
        request = build(request_type, f"RCFW {name}", fields, CMDQ_HEADER)
        slots = -(-ctypes.sizeof(request_type) // CMDQ_SLOT)
        timeout = self._bounded(command_timeout or self.rcfw_timeout)
        deadline = anyio.current_time() + timeout  # the whole command: queue space, then its answer
        try:
            with anyio.fail_after(timeout):
                while slots >= self._cmdq.free_entries() or len(self._pending) >= bnxt.RCFW_MAX_COOKIE_VALUE:
                    self._check_alive()  # Linux's rule: never fill the last free slot
                    await self._cmdq_space.wait()
        except TimeoutError:
            raise FirmwareTimeoutError(f"RCFW {name}: no command queue space within {timeout:g} s"
                                       + self._budget_note()) from None
        self._check_alive()
        self._check_budget(f"RCFW {name}")
        side: DmaBuffer | None = self.pci.alloc_dma(ctypes.sizeof(side_type)) if side_type else None
        cookie = self._next_cookie()
        request.opcode, request.cmd_size, request.cookie = opcode, slots, cookie
        if side is not None:
            request.resp_addr, request.resp_size = side.bus_addr, -(-ctypes.sizeof(side_type) // CMDQ_SLOT)
        pending = self._pending[cookie] = _Pending(name, slots)
        self._post_command(bytes(request).ljust(slots * CMDQ_SLOT, b"\0"))
        await self._await_reply(pending, max(0.0, deadline - anyio.current_time()))
        if pending.error is not None:
            if side is not None:
                side.free()
            raise pending.error
        if pending.entry is None:  # the side buffer stays allocated: a late answer may still be DMA'd into it
            self._pending.pop(cookie, None)
            self._cmdq.consumer += slots  # assume the firmware consumed the slots; a late reply is dropped
            self._signal_space()
            raise FirmwareTimeoutError(f"RCFW {name}: no answer from {self.pci.address} within {timeout:g} s"
                                       + self._budget_note())
        result = None
        if side is not None:
            result = side_type.from_buffer_copy(side.view)
            side.free()
        status = pending.entry[1]
        if status:
            raise FirmwareError.rcfw(name, status)
        return result if result is not None else response_type.from_buffer_copy(pending.entry)

    async def _await_reply(self, pending: _Pending, timeout: float) -> None:
        """Wait (shielded, at most `timeout`) until the CREQ answers `pending` or the device is lost."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            while pending.entry is None and pending.error is None and not self._close_spent():
                if self._creq_reader:
                    await pending.done.wait()
                    pending.done = anyio.Event()  # woken because the reader left: look again
                else:  # no reader (its task was cancelled, or none started yet): serve the CREQ until answered
                    await self._serve_creq(until=pending)

    def _next_cookie(self) -> int:
        while True:
            self._cookie = (self._cookie + 1) & bnxt.RCFW_MAX_COOKIE_VALUE
            if self._cookie not in self._pending:
                return self._cookie

    def _post_command(self, data: bytes) -> None:
        cmdq = self._cmdq
        for i in range(0, len(data), CMDQ_SLOT):
            offset = cmdq.offset(cmdq.producer)
            cmdq.view[offset:offset + CMDQ_SLOT] = data[i:i + CMDQ_SLOT]
            cmdq.producer += 1
        producer = cmdq.producer & 0xFFFF
        if self._first_command:  # tells the firmware to reset its CMDQ/CREQ pointers
            producer |= 1 << bnxt.FIRMWARE_FIRST_FLAG
            self._first_command = False
        memory_barrier()  # the command's slots in host memory before the producer the firmware reads them by
        self.bar0.write32(bnxt.RCFW_COMM_BASE_OFFSET + bnxt.RCFW_PF_VF_COMM_PROD_OFFSET, producer)
        self.bar0.write32(bnxt.RCFW_COMM_BASE_OFFSET + bnxt.RCFW_COMM_TRIG_OFFSET, bnxt.RCFW_CMDQ_TRIG_VAL)
        if self._creq_idle:  # wake the reader, so a lost reply interrupt costs a safety poll, not the timeout
            self._creq_idle = False
            wake(self._irq[CREQ_VECTOR])

    def _signal_space(self) -> None:
        self._cmdq_space.set()
        self._cmdq_space = anyio.Event()

    async def in_background(self, service: Callable[..., Any], *,
                            task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run one of the NIC's own tasks (CREQ reader, removal watch, poller) under a scope close() cancels: once the
        NIC closes they must not touch the rings it frees, even when close() runs inside the NIC's block."""
        with anyio.CancelScope() as scope:
            self._background.append(scope)
            if self._closing:
                scope.cancel()
            task_status.started()
            await service()

    async def _serve_creq(self, until: _Pending | None = None) -> None:
        """Read the CREQ: replies go to their waiters by cookie, events to their handlers.

        One task at a time may do this (it waits on the CREQ's interrupt fd): the NIC's background reader, or, while
        there is none, a command waiting for its own reply (`until`). Whoever leaves wakes the waiters, so another
        takes over."""
        fd = self._irq[CREQ_VECTOR]
        self._creq_reader = True
        quiet = False  # the last sleep ended by its safety poll
        try:
            while until is None or until.entry is None:
                self._drain_creq()
                if until is not None and until.entry is None:
                    await self._check_removed(raising=False)  # no watch task: a dead device fails `until` here
                    if self._close_spent():
                        return
                if self._lost or (until is not None and until.entry is not None):
                    return
                # quiet with no command waiting: only events can arrive, each with its interrupt, so no periodic
                # wake-up (one safety poll first, so a run of commands does not wake the reader for each)
                self._creq_idle = quiet and not self._pending
                try:
                    quiet = not await wait_for_interrupt(fd, None if self._creq_idle else SAFETY_POLL * 4)
                finally:
                    self._creq_idle = False
        finally:
            self._creq_reader = False
            for waiter in self._pending.values():
                waiter.done.set()

    def _drain_creq(self) -> None:
        creq, view = self._creq, self._creq.view
        freed = 0
        while True:
            offset = creq.offset(creq.consumer)
            if (view[offset + 8] & 1) != 1 - creq.epoch(creq.consumer):
                break
            entry = bytes(view[offset:offset + 16])
            creq.consumer += 1
            freed += self._dispatch(entry)
        self.doorbells.write64_doorbell(self.db_offset, doorbell(self._creq_id, bnxt.DBC_DBC_TYPE_NQ_ARM,
                                                        creq.offset(creq.consumer) // 16, creq.epoch(creq.consumer)))
        if freed:
            self._signal_space()

    def _dispatch(self, entry: bytes) -> int:
        kind, event = entry[0] & 0x3F, entry[9]
        if kind == QP_EVENT and event in (QP_ERROR, CQ_ERROR):
            layout = bnxt.creq_qp_error_notification if event == QP_ERROR else bnxt.creq_cq_error_notification
            notice = layout.from_buffer_copy(entry)
            detail = {name: getattr(notice, name) for name, *_ in layout._fields_
                      if not name.startswith(("reserved", "type", "v", "event"))}
            routed = DeviceEvent("qp_error" if event == QP_ERROR else "cq_error", notice.xid, detail)
            handlers = self._qp_handlers if event == QP_ERROR else self._cq_handlers
            self._deliver(routed, handlers.get(notice.xid))
            return 0
        if kind == QP_EVENT:
            cookie = int.from_bytes(entry[2:4], "little")
            pending = self._pending.pop(cookie, None)
            if pending is None:
                log.warning("%s: CREQ reply with unknown cookie %#x (event %#x) dropped", self.pci.address, cookie,
                            event)
                return 0
            pending.entry = entry
            pending.done.set()
            self._cmdq.consumer += pending.slots
            return pending.slots
        if kind == FUNC_EVENT:
            for handler in [None, *self.function_handlers]:
                self._deliver(DeviceEvent("function", event, {}), handler)
            return 0
        log.warning("%s: unexpected CREQ entry type %#x dropped", self.pci.address, kind)
        return 0

    def _deliver(self, event: DeviceEvent, handler: Callable[[DeviceEvent], None] | None) -> None:
        if handler is None:
            self.events.append(event)
            log.info("%s: %s", self.pci.address, event)
            return
        try:
            handler(event)
        except Exception:
            log.exception("%s: handler for %s failed", self.pci.address, event)

    def route_events(self, kind: str, xid: int, handler: Callable[[DeviceEvent], None] | None) -> None:
        """Send QP ("qp_error") or CQ ("cq_error") error notifications for object `xid` to `handler` (None: stop)."""
        table = self._qp_handlers if kind == "qp_error" else self._cq_handlers
        if handler is None:
            table.pop(xid, None)
        else:
            table[xid] = handler

    # -- liveness ----------------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._lost is not None:
            raise self._lost

    def check_open(self) -> None:
        """Raise at once if the NIC is lost (DeviceLostError) or closed (ClosedError): the public API's guard."""
        if self._lost is not None:
            raise self._lost
        if self._closing:
            raise ClosedError(f"{self.pci.address} is closed")

    async def _watch_removal(self) -> None:
        fd = self.pci.removal_fd()
        self._watching_removal = True
        try:
            while self._lost is None:
                if fd is not None:
                    await anyio.wait_readable(fd)
                else:
                    await anyio.sleep(1.0)
                    if self.pci.read_config(PCI_VENDOR_ID, 2) != 0xFFFF:
                        continue
                await self._declare_removed()
        finally:
            self._watching_removal = False

    async def _check_removed(self, raising: bool = True) -> None:
        """For a command waiting on the firmware: while no watch task runs (a cancelled block has lost it), look
        whether the device is gone, so the wait ends now rather than at its timeout. Raises the loss if `raising`."""
        if self._lost is None and not self._watching_removal:
            fd = self.pci.removal_fd()
            if (_readable(fd) if fd is not None else self.pci.read_config(PCI_VENDOR_ID, 2) == 0xFFFF):
                await self._declare_removed()
        if raising:
            self._check_alive()

    async def _declare_removed(self) -> None:
        with anyio.CancelScope(shield=True):  # the reason (an exit status) is read once, in a worker thread
            reason = await anyio.to_thread.run_sync(self.pci.removal_reason)
        if self._lost is None:
            self._device_lost(DeviceLostError(f"{self.pci.address} is gone" + (f" ({reason})" if reason else "")))

    def _bounded(self, timeout: float) -> float:
        """A command's timeout, cut to what is left of close()'s budget while closing."""
        if self._close_deadline is None:
            return timeout
        return max(0.0, min(timeout, self._close_deadline - anyio.current_time()))

    def _close_spent(self) -> bool:
        return self._close_deadline is not None and anyio.current_time() >= self._close_deadline

    def _check_budget(self, what: str) -> None:
        if self._close_spent():
            raise FirmwareTimeoutError(f"{what}: not sent: close() spent its budget on the firmware already (the "
                                       "device's reset frees what it would have)")

    def _budget_note(self) -> str:
        return " (close() spends at most its budget on the firmware)" if self._close_deadline is not None else ""

    def _device_lost(self, error: DeviceLostError) -> None:
        self._lost = error
        log.error("%s", error)
        for pending in self._pending.values():
            pending.error = error
            pending.done.set()
        self._pending.clear()
        self._signal_space()
        for obj in list(self.objects.values()):  # work in flight fails now; new work raises at once
            obj._device_lost(error)
        for fd in self._irq:  # wake every interrupt waiter so it notices
            wake(fd)

    @property
    def alive(self) -> bool:
        return self._lost is None

    # -- bring-up ------------------------------------------------------------------------------------------------------
    async def boot(self, task_group: anyio.abc.TaskGroup) -> None:
        self.pci.enable_bus_master()
        task_group.start_soon(self.in_background, self._watch_removal)
        major, minor, update = (int(x) for x in bnxt.HWRM_INTERFACE_VERSION.split(".")[:3])
        ver = await self.hwrm("ver_get", hwrm_intf_maj=major, hwrm_intf_min=minor, hwrm_intf_upd=update)
        self.fw_version = f"{ver.hwrm_fw_maj_8b}.{ver.hwrm_fw_min_8b}.{ver.hwrm_fw_bld_8b}.{ver.hwrm_fw_rsvd_8b}"
        self.hwrm_version = f"{ver.hwrm_intf_maj_8b}.{ver.hwrm_intf_min_8b}.{ver.hwrm_intf_upd_8b}"
        if ver.max_req_win_len:
            self._max_request = min(ver.max_req_win_len, 0x100)
        if ver.def_req_timeout:
            self.hwrm_timeout = max(self.hwrm_timeout, ver.def_req_timeout / 1000)
        await self.hwrm("func_reset", command_timeout=4 * self.hwrm_timeout)
        caps = await self.hwrm("func_qcaps", fid=0xFFFF)
        if not caps.flags & bnxt.FUNC_QCAPS_RESP_FLAGS_ROCE_V2_SUPPORTED:
            raise FirmwareError("HWRM func_qcaps", 0, "NO_ROCE", f"{self.pci.address} does not support RoCE v2")
        self.mac, self.port_id = bytes(caps.mac_address).hex(":"), caps.port_id
        self.caps = {"max_rsscos_ctx": caps.max_rsscos_ctx, "max_cmpl_rings": caps.max_cmpl_rings,
                     "max_tx_rings": caps.max_tx_rings, "max_rx_rings": caps.max_rx_rings,
                     "max_stat_ctx": caps.max_stat_ctx, "flags": caps.flags, "flags_ext": caps.flags_ext}
        await self.hwrm("func_drv_rgtr", enables=bnxt.FUNC_DRV_RGTR_REQ_ENABLES_OS_TYPE
                        | bnxt.FUNC_DRV_RGTR_REQ_ENABLES_VER, os_type=bnxt.FUNC_DRV_RGTR_REQ_OS_TYPE_LINUX,
                        **dict(zip(("ver_maj_8b", "ver_min_8b", "ver_upd_8b"),
                                   (int(x) for x in __version__.split(".")))))
        self._on_close("HWRM func_drv_unrgtr", lambda: self._hwrm("func_drv_unrgtr"))
        qcfg = await self.hwrm("func_qcfg", fid=0xFFFF)
        self.db_offset = -(-qcfg.legacy_l2_db_size_kb * 1024 // PAGE_SIZE) * PAGE_SIZE
        await self._configure_backing_store()
        await self._open_rcfw(task_group)
        await self._open_l2()
        gid = await self.rcfw("add_gid", gid=_gid_words(self.gid), src_mac=_mac_words(bytes.fromhex(
            self.mac.replace(":", ""))))
        self.gid_index = gid.xid
        self._on_close("RCFW delete_gid", lambda: self._rcfw("delete_gid", gid_index=self.gid_index))
        log.info("%s: booted fw %s mac %s gid %s", self.pci.address, self.fw_version, self.mac, self.ip)

    def _on_close(self, what: str, action: Callable[[], Any]) -> None:
        self._teardown.append((what, action))

    async def _configure_backing_store(self) -> None:
        """Backing store v2 (bnxt.c bnxt_backing_store_cfg_v2): one CFG_V2 per valid type and instance."""
        plan, kind, seen = [], 0, set()
        while kind != BS_TYPE_INVALID and kind not in seen:
            seen.add(kind)
            caps = await self.hwrm("func_backing_store_qcaps_v2", type=kind)
            if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID and caps.entry_size:
                plan.append((kind, caps))
            kind = caps.next_valid_type
        counts: dict[int, int] = {}
        steps = [(kind, caps, instance) for kind, caps in plan
                 for instance in ([i for i in range(32) if caps.instance_bit_map >> i & 1] or [0])]
        for number, (kind, caps, instance) in enumerate(steps):
            splits = [getattr(caps, f"split_entry_{j}") for j in range(min(caps.subtype_valid_cnt, 4))]
            entries = counts.setdefault(kind, _backing_entries(kind, caps, splits, counts))
            memory = self.pci.alloc_dma(max(entries * caps.entry_size, 1))
            if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_ENABLE_CTX_KIND_INIT and caps.ctx_init_value:
                start = caps.ctx_init_offset * 4  # units of 4 bytes (bnxt_init_ctx_initializer)
                memory.view[start:entries * caps.entry_size:caps.entry_size] = \
                    bytes([caps.ctx_init_value]) * len(range(start, entries * caps.entry_size, caps.entry_size))
            table = page_table(self.pci, memory.bus_addrs, queue=False)
            last = number == len(steps) - 1
            await self.hwrm("func_backing_store_cfg_v2", type=kind, instance=instance, entry_size=caps.entry_size,
                            num_entries=entries, page_dir=table.base, page_size_pbl_level=table.level,
                            subtype_valid_cnt=len(splits),
                            flags=bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_FLAGS_BS_CFG_ALL_DONE if last else 0,
                            **{f"split_entry_{j}": v for j, v in enumerate(splits)})
            self._on_close("backing store memory", functools.partial(_free_all, table, memory))

    async def _open_rcfw(self, task_group: anyio.abc.TaskGroup) -> None:
        self._creq = Ring(self.pci, CREQ_DEPTH, 16)
        self._creq_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_NQ, self._creq, CREQ_VECTOR)
        self._cmdq = Ring(self.pci, CMDQ_DEPTH, CMDQ_SLOT)
        self._on_close("CMDQ memory", self._cmdq.free)
        init = bnxt.cmdq_init(cmdq_pbl=self._cmdq.base, creq_ring_id=self._creq_id, prod_idx=0,
                              cmdq_size_cmdq_lvl=(CMDQ_DEPTH << bnxt.CMDQ_INIT_CMDQ_SIZE_SFT)
                              & bnxt.CMDQ_INIT_CMDQ_SIZE_MASK | self._cmdq.level & bnxt.CMDQ_INIT_CMDQ_LVL_MASK)
        self.bar0.write_block(bnxt.RCFW_COMM_BASE_OFFSET, bytes(init))
        self._creq_reader = True  # before the reader runs: no command may find the CREQ unserved and read it too
        await task_group.start(self.in_background, self._serve_creq)

        function = await self.rcfw("query_func")
        self.hw_retransmit = bool(function.dev_cap_ext_flags_2 & HOST_MSN_TABLE)
        self.caps.update(max_qp=function.max_qp, max_cq=function.max_cq, max_mr=function.max_mr,
                         max_qp_wr=function.max_qp_wr, max_sge=function.max_sge, max_cqe=function.max_cqe,
                         max_qp_rd_atom=function.max_qp_rd_atom, max_inline_data=function.max_inline_data)
        self._stats = self.pci.alloc_dma(PAGE_SIZE)
        self._on_close("statistics memory", self._stats.free)
        stat = await self.hwrm("stat_ctx_alloc", stats_dma_addr=self._stats.bus_addr, stats_dma_length=176,
                               update_period_ms=1000, stat_ctx_flags=bnxt.STAT_CTX_ALLOC_REQ_STAT_CTX_FLAGS_ROCE)
        self._stat_ctx_id = stat.stat_ctx_id
        self._on_close("HWRM stat_ctx_free", lambda: self._hwrm("stat_ctx_free", stat_ctx_id=self._stat_ctx_id))
        flags = bnxt.CMDQ_INITIALIZE_FW_FLAGS_HW_REQUESTER_RETX_SUPPORTED if self.hw_retransmit else 0
        await self.rcfw("initialize_fw", stat_ctx_id=self._stat_ctx_id, log2_dbr_pg_size=0, flags=flags)
        self._on_close("RCFW deinitialize_fw", lambda: self._rcfw("deinitialize_fw"))
        self.nq = Ring(self.pci, NQ_DEPTH, 16)
        self.nq_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_NQ, self.nq, NQ_VECTOR)

    async def _alloc_ring(self, ring_type: int, ring: Ring, logical_id: int = 0, **fields: Any) -> int:
        reply = await self.hwrm("ring_alloc", ring_type=ring_type, page_tbl_addr=ring.base, page_size=12,
                                page_tbl_depth=ring.level, length=ring.depth, logical_id=logical_id,
                                int_mode=bnxt.RING_ALLOC_REQ_INT_MODE_MSIX, **fields)
        ring_id = reply.ring_id
        self._on_close(f"HWRM ring_free {ring_id}", functools.partial(self._free_ring, ring_type, ring_id, ring))
        return ring_id

    async def _free_ring(self, ring_type: int, ring_id: int, ring: Ring) -> None:
        try:
            await self._hwrm("ring_free", ring_type=ring_type, ring_id=ring_id)
        finally:
            ring.free()

    async def _open_l2(self) -> None:
        """The L2 receive path (completion ring, RX ring, VNIC, MAC filter) that RoCE ingress needs."""
        nq_enable = bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID
        completion = Ring(self.pci, 64, 16, queue=False)
        cmpl_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL, completion, enables=nq_enable,
                                         nq_ring_id=self.nq_id)
        receive = Ring(self.pci, 64, 16)
        rx_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_RX, receive, rx_buf_size=2048,
                                       enables=nq_enable | bnxt.RING_ALLOC_REQ_ENABLES_RX_BUF_SIZE_VALID,
                                       nq_ring_id=self.nq_id)
        vnic = (await self.hwrm("vnic_alloc")).vnic_id
        self._on_close("HWRM vnic_free", lambda: self._hwrm("vnic_free", vnic_id=vnic))
        await self.hwrm("vnic_cfg", vnic_id=vnic, mru=9018, default_rx_ring_id=rx_id, default_cmpl_ring_id=cmpl_id,
                        enables=bnxt.VNIC_CFG_REQ_ENABLES_MRU | bnxt.VNIC_CFG_REQ_ENABLES_DEFAULT_RX_RING_ID
                        | bnxt.VNIC_CFG_REQ_ENABLES_DEFAULT_CMPL_RING_ID)
        mac = tuple(bytes.fromhex(self.mac.replace(":", "")))
        l2_filter = await self.hwrm(
            "cfa_l2_filter_alloc", flags=bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_PATH_RX, l2_addr=mac,
            l2_addr_mask=(0xFF,) * 6, dst_id=vnic,
            enables=bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_L2_ADDR | bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_L2_ADDR_MASK
            | bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_DST_ID)
        filter_id = l2_filter.l2_filter_id
        self._on_close("HWRM cfa_l2_filter_free", lambda: self._hwrm("cfa_l2_filter_free", l2_filter_id=filter_id))

    async def set_loopback(self, mode: int) -> None:
        """PHY loopback: bnxt PORT_PHY_CFG_REQ_LPBK_NONE / _LOCAL / _REMOTE / _EXTERNAL."""
        await self.hwrm("port_phy_cfg", port_id=self.port_id, enables=bnxt.PORT_PHY_CFG_REQ_ENABLES_LPBK, lpbk=mode)

    # -- close -----------------------------------------------------------------------------------------------------
    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Free every firmware object in reverse order of creation; memory is freed even when the firmware is gone.

        From the first call on, the public API raises ClosedError. It works without the NIC's background tasks (a
        cancelled block has lost them): each command then reads its own reply, and notices a device that died.
        The firmware gets at most `timeout` seconds in all: once spent, the remaining commands are not sent (the
        device's reset frees what they would have)."""
        if not self._closing:
            self._closing = True
            for scope in self._background:  # the poller and the CREQ reader stop here; commands read their own replies
                scope.cancel()
        if self._closed:
            return
        self._close_deadline = anyio.current_time() + timeout  # each call's own budget: a cancelled close resumes
        async with self._close_lock:  # a second close waits for the first, and takes over if that one is cancelled
            await self._teardown_all()
            self._closed = True

    async def _teardown_all(self) -> None:
        failures = []
        while self._teardown:
            what, action = self._teardown[-1]  # popped once done: a cancel in the middle leaves it for the resume
            try:
                result = action()  # with the device lost, its commands raise at once and memory is still freed
                if result is not None:
                    await result
            except DeviceLostError:
                pass  # the device is gone, and its objects with it
            except Exception as exc:  # keep freeing the rest; report at the end
                failures.append(f"{what}: {exc}")
            self._teardown.pop()
        with anyio.move_on_after(1.0):  # a command started before the close ends at its deadline (<= 50 ms later):
            async with self._hwrm_lock:  # its answer buffer is freed only once it is done reading it
                self._hwrm_resp.free()
        if failures:
            log.warning("%s: close: %s", self.pci.address, "; ".join(failures))


def _backing_entries(kind: int, caps: ctypes.Structure, splits: list[int], counts: dict[int, int]) -> int:
    """Entries for one backing-store type, as bnxt_en sizes them for a RoCE-capable function."""
    base = sum(splits)
    extra = {BS_QP: EXTRA_QPS, BS_SRQ: EXTRA_QPS // 2, BS_CQ: 2 * EXTRA_QPS, BS_MRAV: EXTRA_MRS}.get(kind, 0)
    entries = counts.get(BS_QP, base + EXTRA_QPS) if kind == BS_TIM else base + extra
    multiple = max(caps.entry_multiple, 1)
    entries = -(-entries // multiple) * multiple
    return max(caps.min_num_entries, min(entries, caps.max_num_entries or entries))


def _free_all(*items: Any) -> None:
    for item in items:
        item.free()


def _readable(fd: int) -> bool:
    """Whether `fd` is readable now (a removal fd: the device is gone)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def wake(fd: int | None) -> None:
    """Signal an interrupt fd from the host, waking whoever sleeps on it (no-op without interrupts)."""
    if fd is not None:
        os.eventfd_write(fd, 1)


async def wait_for_interrupt(fd: int | None, timeout: float | None) -> bool:
    """Sleep until the MSI-X vector behind `fd` fires, or `timeout` passes (insurance against a lost interrupt;
    None: no timeout), and acknowledge it; whether it fired. Without interrupts (`fd` None: plain sysfs) this is a
    short poll interval, and never fires."""
    if fd is None:
        await anyio.sleep(POLL_INTERVAL if timeout is None else min(timeout, POLL_INTERVAL))
        return False
    with anyio.move_on_after(timeout) as scope:
        await anyio.wait_readable(fd)
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass
    return not scope.cancelled_caught


def _gid_words(gid: bytes) -> tuple[int, ...]:
    """ADD_GID's gid field: the 16 bytes fully reversed (Linux: gid[i] = cpu_to_be32(dw[3-i]))."""
    return tuple(int.from_bytes(gid[::-1][i:i + 4], "little") for i in range(0, 16, 4))


def _mac_words(mac: bytes) -> tuple[int, ...]:
    """ADD_GID's src_mac: three 16-bit words with the bytes of each swapped (cpu_to_be16)."""
    return tuple(int.from_bytes(mac[i:i + 2], "big") for i in range(0, 6, 2))
