"""The RoCE command channel's queues (sans-IO): the CMDQ the driver writes commands into, the CREQ the answers and
events go out on.

The driver latches `cmdq_init` through the BAR0 mailbox (`mailbox_write`), writes commands into its CMDQ ring and
publishes the producer; on a trigger (`trigger`) the commands up to it are the firmware's. The shell takes them one at a
time (`next_command`), has rcfw.Rcfw execute each and posts the 16-byte answer (`post_creq`), retrying after doorbells
while the CREQ is full; asynchronous events wait in `events` for CREQ room (`flush_events`). Behaviour follows Linux's
qplib_rcfw.c.
"""
from __future__ import annotations

import collections
import struct
from dataclasses import dataclass

from .function import FunctionState
from .memory import DmaFault
from .objects import CommandError, NotificationQueue, PageList, PageTableError, map_memory
from ..autogen import bnxt
from ..hw.firmware import CMDQ_FIRST_PRODUCER, CMDQ_HEADER, CMDQ_INIT, CMDQ_SLOT

OPCODE_NAMES = {value: name.removeprefix("CMDQ_BASE_OPCODE_").lower() for name, value in vars(bnxt).items()
                if name.startswith("CMDQ_BASE_OPCODE_") and name != "CMDQ_BASE_OPCODE_LAST"}


@dataclass(frozen=True)
class PendingCommand:
    """One command taken off the CMDQ: its header fields and all its slots."""
    opcode: int
    cookie: int
    resp_size: int  # side buffer, in 16-byte units
    resp_addr: int
    data: bytes
    complete: bool  # False when cmd_size was 0 or claimed more slots than were published

    @property
    def name(self) -> str:
        return OPCODE_NAMES.get(self.opcode, f"opcode {self.opcode:#x}")


class CommandQueue:
    """The CMDQ and CREQ of one function's RoCE channel; rcfw.Rcfw adds the commands and the objects they create."""

    def __init__(self, function: FunctionState) -> None:
        self.fw, self.mem = function, function.mem
        self.mailbox = bytearray(CMDQ_INIT.size)
        self.cmdq: PageList | None = None  # None: no cmdq_init latched (or its CREQ is gone): commands are ignored
        self.cmdq_depth = 0
        self.creq: NotificationQueue | None = None
        self.producer = self.published = self.consumer = 0  # 16-bit free-running slot counts
        self.consumer_slot = 0
        self.events: collections.deque[bytes] = collections.deque()  # asynchronous events waiting for CREQ room

    def stop(self) -> None:
        self.cmdq, self.creq, self.cmdq_depth = None, None, 0
        self.events.clear()

    def mailbox_write(self, offset: int, value: int) -> None:
        """A 32-bit write to BAR0 + 0x600 + offset: the cmdq_init dwords; 0xC is also the producer register."""
        if offset not in range(0, CMDQ_INIT.size, 4):
            self.fw.stats["mailbox_ignored"] += 1
            return
        struct.pack_into("<I", self.mailbox, offset, value & 0xFFFFFFFF)
        if offset == bnxt.RCFW_PF_VF_COMM_PROD_OFFSET:
            if value & CMDQ_FIRST_PRODUCER:
                self._start()
            self.producer = value & 0xFFFF

    def _start(self) -> None:
        """The first producer write after cmdq_init: latch the CMDQ geometry and reset the CMDQ/CREQ pointers."""
        self.stop()
        pbl, size_level, creq_ring_id, _ = CMDQ_INIT.unpack(self.mailbox)
        depth = (size_level & bnxt.CMDQ_INIT_CMDQ_SIZE_MASK) >> bnxt.CMDQ_INIT_CMDQ_SIZE_SFT
        creq, fail = self.fw.rings.get(creq_ring_id), bnxt.CREQ_QP_EVENT_STATUS_FAIL
        try:
            if not isinstance(creq, NotificationQueue):
                raise CommandError(fail, f"creq_ring_id {creq_ring_id} is not an allocated NQ ring")
            if not depth:
                raise CommandError(fail, "CMDQ depth 0")
            # level 0: one area of depth slots consecutive on the bus (current Linux: 8192 in 128 KiB), levels 1-2:
            # 4 KiB pages behind a PBL (older Linux). Inferred: the area need not be aligned (Linux's is aligned to
            # its size, by dma_alloc_coherent; no source says the firmware needs that)
            self.cmdq = map_memory(self.mem, size_level & bnxt.CMDQ_INIT_CMDQ_LVL_MASK, pbl, depth * CMDQ_SLOT,
                                   queue=True)
        except (CommandError, DmaFault, PageTableError) as exc:
            self.fw.note_error("RCFW cmdq_init", f"{exc}; commands are ignored until the next FIRST producer write")
            return
        self.cmdq_depth, self.creq = depth, creq
        creq.reset()
        self.published = self.consumer = self.consumer_slot = 0

    def trigger(self) -> None:
        """The driver wrote the trigger register: commands up to the producer are now ours."""
        if self.cmdq is None:
            self.fw.stats["ignored_triggers"] += 1
        else:
            self.published = self.producer

    def next_command(self) -> PendingCommand | None:
        """Take the next published command off the CMDQ (wrapping slot by slot), or None."""
        pending = (self.published - self.consumer) & 0xFFFF
        if self.cmdq is None or not pending:
            return None
        if pending > self.cmdq_depth:
            self.fw.note_error("RCFW", f"producer is {pending} slots ahead, beyond the {self.cmdq_depth}-slot CMDQ")
            self.consumer = self.published
            return None
        size = self._slot(self.consumer_slot)[1]
        slots = min(max(size, 1), pending)
        data = b"".join(self._slot((self.consumer_slot + i) % self.cmdq_depth) for i in range(slots))
        self.consumer = (self.consumer + slots) & 0xFFFF
        self.consumer_slot = (self.consumer_slot + slots) % self.cmdq_depth
        opcode, _, _, cookie, resp_size, resp_addr = CMDQ_HEADER.unpack_from(data)
        return PendingCommand(opcode, cookie, resp_size, resp_addr, data, complete=slots == size)

    def _slot(self, slot: int) -> bytes:
        assert self.cmdq is not None
        return self.mem.read(self.cmdq.address(slot * CMDQ_SLOT), CMDQ_SLOT)

    def post_creq(self, entry: bytes) -> bool:
        """Post an answer on the CREQ; False (nothing posted) when full. Without a CREQ the answer is dropped."""
        if self.creq is None:
            self.fw.stats["creq_dropped"] += 1
            return True
        return self.creq.post(entry)

    def flush_events(self) -> None:
        while self.events and self.creq is not None and self.creq.post(self.events[0]):
            self.events.popleft()
