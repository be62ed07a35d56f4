"""The HWRM channel: one command at a time, written into BAR0's mailbox window, answered by DMA into a host buffer
whose last byte turns valid, with an interrupt on the HWRM vector. Firmware that requires short commands takes each
request from a host buffer instead, the window naming only its address and length (Linux bnxt_hwrm.c)."""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, AsyncIterator, Callable

import anyio

from .close_budget import CloseBudget
from .commands import HWRM_HEADER_FIELDS, build, hwrm_types
from .interrupts import COMMAND_POLL, wait_for_interrupt
from .liveness import Liveness
from ..autogen import bnxt
from ..errors import FirmwareError, FirmwareTimeoutError
from ..hw.firmware import HWRM_RESPONSE_HEADER, HWRM_SHORT_REQUEST, SHORT_REQUEST_SIGNATURE
from ..pci import PAGE_SIZE, Bar, DmaBuffer, PCIDevice

HWRM_TIMEOUT = 2.0  # Linux: 500 ms default; generous for loaded CI machines
CMD_ERR_OFFSET = bnxt.hwrm_err_output.cmd_err.offset  # the firmware's detail, in an error answer of that size


class HwrmChannel:
    """Commands by name (`command`), each with its own timeout and bounded by a close's budget. Once posted, a
    command is waited for even if the caller is cancelled, so a cancelled allocation never leaves an object the
    driver does not know of."""

    def __init__(self, pci: PCIDevice, bar0: Bar, fd: int | None, liveness: Liveness, budget: CloseBudget,
                 timeout: float = HWRM_TIMEOUT) -> None:
        self.pci, self.bar0, self.fd, self.liveness, self.budget = pci, bar0, fd, liveness, budget
        self.timeout = timeout
        self.max_request = bnxt.HWRM_MAX_REQ_LEN  # until ver_get says what this firmware takes
        self._answers = pci.alloc_dma(PAGE_SIZE)
        self._requests: DmaBuffer | None = None  # with short commands: where each request is written
        self._lock = anyio.Lock()
        self._seq = 0
        self.answering = True  # False once a command went unanswered, True again at the next answer

    async def command(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run HWRM command `name` (e.g. "func_qcaps") with the given input fields; its output structure.
        FirmwareError with the decoded status, FirmwareTimeoutError past the timeout, DeviceLostError."""
        self.liveness.check()  # first: a lost device's destroy frees memory, whatever the budget
        self.budget.check(f"HWRM {name}")
        request_type, response_type, request_kind = hwrm_types(name)
        request = build(request_type, f"HWRM {name}", fields, HWRM_HEADER_FIELDS)
        timeout = self.budget.bounded(command_timeout or self.timeout)
        deadline = anyio.current_time() + timeout  # the whole command: its turn on the channel, then its answer
        async with self.exclusive(name, timeout):
            self.liveness.check()
            self.budget.check(f"HWRM {name}")
            self._seq = seq = (self._seq + 1) & 0xFFFF
            request.req_type, request.cmpl_ring, request.seq_id = request_kind, 0xFFFF, seq
            request.target_id, request.resp_addr = bnxt.BNXT_HWRM_TARGET, self._answers.bus_addr
            data = bytes(request)
            if len(data) > self.max_request:
                raise ValueError(f"HWRM {name}: {len(data)}-byte request exceeds the {self.max_request}-byte window")
            answer = self._answers.view
            answer[:HWRM_RESPONSE_HEADER.size] = bytes(HWRM_RESPONSE_HEADER.size)
            window = data.ljust(self.max_request, b"\0")
            if self._requests is not None:
                self._requests.view[:len(window)] = window
                window = HWRM_SHORT_REQUEST.pack(request_kind, SHORT_REQUEST_SIGNATURE,
                                                 bnxt.SHORT_REQ_TARGET_ID_DEFAULT, len(data), self._requests.bus_addr)
            self.bar0.write_block(bnxt.BNXT_GRCPF_REG_CHIMP_COMM, window)
            self.bar0.write32(bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER, 1)

            def answered() -> bool:  # the answer to this seq_id, its last byte (the valid key) written
                _, _, answered_seq, length = HWRM_RESPONSE_HEADER.unpack_from(answer)
                return HWRM_RESPONSE_HEADER.size <= length <= len(answer) and answered_seq == seq \
                    and answer[length - 1] != 0

            await self._wait(answered, max(0.0, deadline - anyio.current_time()), f"HWRM {name}")
            error, _, _, length = HWRM_RESPONSE_HEADER.unpack_from(answer)
            raw = bytes(answer[:length])
            answer[length - 1] = 0  # clear the valid byte, as Linux does, so a stale answer never looks new
        if error:
            cmd_err = raw[CMD_ERR_OFFSET] if length == ctypes.sizeof(bnxt.hwrm_err_output) else 0
            raise FirmwareError.hwrm(name, error, cmd_err)
        size = ctypes.sizeof(response_type)
        return response_type.from_buffer_copy(raw[:size].ljust(size, b"\0"))

    def use_short_commands(self, max_request: int) -> None:
        """From now on send every request in the short format (VER_GET said the firmware requires it), each up to
        `max_request` bytes (its max_ext_req_len)."""
        self._requests = self._requests or self.pci.alloc_dma(PAGE_SIZE)
        self.max_request = min(max_request, PAGE_SIZE)

    @contextlib.asynccontextmanager
    async def exclusive(self, name: str, timeout: float) -> AsyncIterator[None]:
        """The channel to oneself (the hardware takes one command at a time), waited for at most `timeout`: each
        command's turn, and a fuzzer's raw window."""
        try:
            with anyio.fail_after(timeout):
                await self._lock.acquire()
        except TimeoutError:
            raise FirmwareTimeoutError(f"HWRM {name}: the channel stayed busy for {timeout:g} s"
                                       + self.budget.note()) from None
        try:
            yield
        finally:
            self._lock.release()

    async def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Sleep on the interrupt fd until `ready()`; memory is re-checked on every wake and every COMMAND_POLL. A
        close that starts meanwhile ends the wait at its deadline too."""
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(timeout):
                while not ready():
                    await self.liveness.look()
                    if self.budget.spent():
                        raise TimeoutError
                    await wait_for_interrupt(self.fd, COMMAND_POLL)
            self.answering = True
        except TimeoutError:
            self.answering = False
            self.liveness.check()
            raise FirmwareTimeoutError(f"{what}: no answer from {self.pci.address} within {timeout:g} s"
                                       + self.budget.note()) from None

    async def close(self) -> None:
        """Free the answer and request buffers once no command is using them (one started before a close ends at the
        close's deadline, a poll later)."""
        with anyio.move_on_after(1.0):
            async with self._lock:
                self._answers.free()
                if self._requests is not None:
                    self._requests.free()
