"""The HWRM channel: one command at a time, written into BAR0's mailbox window, answered by DMA into a zeroed host
buffer: the length and sequence id first, the last byte (the valid key) last. Requests name no completion ring
(cmpl_ring 0xFFFF), so the firmware raises nothing: the answer is polled, as Linux's __hwrm_send does. A request in
the short format is taken from a host buffer instead, the window naming only its address and length: every request
where the firmware requires short commands, else one longer than the window (Linux bnxt_hwrm.c). A request longer than
the firmware takes either way (VER_GET max_ext_req_len) is cut to that length when only zeros are cut off, as Linux
cuts FUNC_CFG's 160 bytes (bnxt_hwrm_func_cfg_short_req_init)."""
from __future__ import annotations

import contextlib
import ctypes
import time
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.lowlevel

from .close_budget import CloseBudget
from .commands import HWRM_HEADER_FIELDS, build, hwrm_types
from .interrupts import COMMAND_POLL, POLL_INTERVAL
from .liveness import Liveness
from ..autogen import bnxt
from ..errors import FirmwareError, FirmwareTimeoutError
from ..hw.firmware import HWRM_RESPONSE_HEADER, HWRM_SHORT_REQUEST, NO_COMPLETION_RING, SHORT_REQUEST_SIGNATURE
from ..pci import PAGE_SIZE, Bar, DmaBuffer, PCIDevice, read_barrier

HWRM_TIMEOUT = 2.0  # Linux: 500 ms default; generous for loaded CI machines
CMD_ERR_OFFSET = bnxt.hwrm_err_output.cmd_err.offset  # the firmware's detail, in an error answer of that size
# How an answer is polled (Linux __hwrm_send): between looks the thread sleeps 25 us, as Linux's does 25-40 us (its
# first five 3-10 us sleeps are below a thread's default timer slack here). A sleeping thread is what gives the CPU to
# whoever answers: an emulator sharing the CPU never preempts the driver, and yielding to the event loop does not give
# the CPU away, while the loop's own timers are no finer than a millisecond. The loop runs its other tasks between
# looks. Past FINE_POLL seconds the loop's timer takes over, from POLL_INTERVAL doubling up to COMMAND_POLL: a slow
# answer (FUNC_RESET) is seen within twice its time, a stalled one costs few wake-ups, and a loss ends the sleep.
SLEEP = 25e-6
FINE_POLL = 0.002
VALID_DELAY = 0.05  # how long the valid byte may trail the length (Linux HWRM_VALID_BIT_DELAY_USEC)


class HwrmChannel:
    """Commands by name (`command`), each with its own timeout and bounded by a close's budget. Once posted, a
    command is waited for even if the caller is cancelled, so a cancelled allocation never leaves an object the
    driver does not know of."""

    def __init__(self, pci: PCIDevice, bar0: Bar, liveness: Liveness, budget: CloseBudget,
                 timeout: float = HWRM_TIMEOUT) -> None:
        self.pci, self.bar0, self.liveness, self.budget = pci, bar0, liveness, budget
        self.timeout = timeout
        self.max_request = bnxt.HWRM_MAX_REQ_LEN  # the window; until ver_get says what this firmware takes
        self.max_ext_request = bnxt.HWRM_MAX_REQ_LEN  # in the short format (ver_get max_ext_req_len, at least 128)
        self.short_required = False  # every request in the short format
        self._answers = pci.alloc_dma(PAGE_SIZE)
        self._requests: DmaBuffer | None = None  # where requests in the short format are written, from the first on
        self._lock = anyio.Lock()
        self._lost = anyio.Event()  # set when the device is lost: a waiting command looks at once
        liveness.on_lost(lambda _: self._lost.set())
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
            request.req_type, request.cmpl_ring, request.seq_id = request_kind, NO_COMPLETION_RING, seq
            request.target_id, request.resp_addr = bnxt.BNXT_HWRM_TARGET, self._answers.bus_addr
            data = self._fit(name, bytes(request))
            answer = self._answers.view
            answer[:] = bytes(len(answer))  # Linux's answers come zeroed: a length that is not 0 is the new answer's
            window = data.ljust(self.max_request, b"\0")
            if self.short_required or len(data) > self.max_request:
                self._requests = self._requests or self.pci.alloc_dma(PAGE_SIZE)
                self._requests.view[:len(data)] = data
                window = HWRM_SHORT_REQUEST.pack(request_kind, SHORT_REQUEST_SIGNATURE,
                                                 bnxt.SHORT_REQ_TARGET_ID_DEFAULT, len(data), self._requests.bus_addr)
            self.bar0.write_block(bnxt.BNXT_GRCPF_REG_CHIMP_COMM, window)
            self.bar0.write32(bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER, 1)

            def landed() -> bool:  # the answer to this seq_id has its length (another seq_id's is stale: wait on)
                _, _, answered_seq, length = HWRM_RESPONSE_HEADER.unpack_from(answer)
                return HWRM_RESPONSE_HEADER.size <= length <= len(answer) and answered_seq == seq

            timeout = max(0.0, deadline - anyio.current_time())
            if not await self._poll(landed, timeout):
                raise self._unanswered(f"HWRM {name}: no answer from {self.pci.address} within {timeout:g} s")
            error, _, _, length = HWRM_RESPONSE_HEADER.unpack_from(answer)
            if not await self._poll(lambda: answer[length - 1] != 0, self.budget.bounded(VALID_DELAY)):
                raise self._unanswered(f"HWRM {name}: the answer's valid byte stayed 0 for {VALID_DELAY:g} s after "
                                       "its length landed")
            self.answering = True
            read_barrier()  # the answer's body after its valid byte (Linux dma_rmb in __hwrm_send)
            raw = bytes(answer[:length])
            answer[length - 1] = 0  # clear the valid byte, as Linux does, so a stale answer never looks new
        if error:
            cmd_err = raw[CMD_ERR_OFFSET] if length == ctypes.sizeof(bnxt.hwrm_err_output) else 0
            raise FirmwareError.hwrm(name, error, cmd_err)
        size = ctypes.sizeof(response_type)
        return response_type.from_buffer_copy(raw[:size].ljust(size, b"\0"))

    def configure(self, window: int, max_ext_request: int, short_required: bool) -> None:
        """What VER_GET says the firmware takes: `window` bytes in BAR0 (max_req_win_len), `max_ext_request` in the
        short format (max_ext_req_len), and whether it requires the short format for every request."""
        self.max_request = min(window, 0x100)
        self.max_ext_request = min(max(max_ext_request, bnxt.HWRM_MAX_REQ_LEN), PAGE_SIZE)
        self.short_required = short_required

    def _fit(self, name: str, data: bytes) -> bytes:
        """The request as the firmware takes it: cut to the longest it takes when only zeros are cut off."""
        longest = max(self.max_request, self.max_ext_request)
        if len(data) > longest:
            if any(data[longest:]):
                raise ValueError(f"HWRM {name}: {len(data)}-byte request with fields set past the {longest} bytes "
                                 "this firmware takes (VER_GET max_req_win_len, max_ext_req_len)")
            data = data[:longest]
        return data

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

    async def _poll(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Look at the answer until `ready()` (True) or for `timeout` seconds (False), ever less often (see SLEEP).
        A device lost meanwhile is raised at once; a close that starts meanwhile ends the wait at its deadline."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            fine, pause = anyio.current_time() + FINE_POLL, POLL_INTERVAL
            while not ready():
                await self.liveness.look()
                if self.budget.spent():
                    break
                if anyio.current_time() < fine:
                    time.sleep(SLEEP)
                    await anyio.lowlevel.checkpoint()
                else:
                    with anyio.move_on_after(pause):
                        await self._lost.wait()
                    pause = min(2 * pause, COMMAND_POLL)
        return ready()

    def _unanswered(self, message: str) -> FirmwareTimeoutError:
        """The error of a command the firmware left unanswered (unless the device is gone: that is raised)."""
        self.answering = False
        self.liveness.check()
        return FirmwareTimeoutError(message + self.budget.note())

    async def close(self) -> None:
        """Free the answer and request buffers once no command is using them (one started before a close ends at the
        close's deadline, a poll later)."""
        with anyio.move_on_after(1.0):
            async with self._lock:
                self._answers.free()
                if self._requests is not None:
                    self._requests.free()
