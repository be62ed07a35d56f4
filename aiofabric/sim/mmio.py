"""The function's registers as the device decodes the driver's writes to them: each write goes, in the order the
driver made it, to the object that serves it.

The driver's MMIO writes reach the emulator process as kick records (kick.py) on one stream socket, so they arrive in
program order, like posted PCIe writes. `Mmio` decodes them:
- BAR2, the doorbells (`Doorbells`, sans-IO): an SQ or RQ doorbell moves the QP's producer and rings the data path
  (Datapath.ring_sq / ring_rq), a CQ doorbell goes to its CompletionQueue, an NQ doorbell to its NotificationQueue
  (the CREQ's lets the RoCE channel post what waited for room). Legacy L2 doorbells below the RoCE page, L2-path,
  invalid and unknown ones are counted in the firmware's stats and ignored;
- BAR0: the RCFW mailbox and trigger go to the RoCE channel (cmdq.py), the HWRM trigger to the shell's runner;
- config space (CONFIG_SPACE): the command register's bus master bit and DEVCTL2's AtomicOp Requester Enable
  (pcie.py); the DMA map records (freed.py) and a function-level reset.
"""
from __future__ import annotations

import socket
from typing import Callable

from .datapath import Datapath
from .freed import FreedMemory
from .hwrm import Firmware
from .kick import CONFIG_SPACE, DMA_MAP, DMA_UNMAP, FUNCTION_RESET, KICK, PUNCHED
from .objects import NotificationQueue
from .pcie import DEVCTL2
from ..autogen import bnxt
from ..hw.doorbell import decode
from ..hw.firmware import CMDQ_INIT
from ..hw.pci import PCI_COMMAND, PCI_COMMAND_MASTER

BAR2 = 2  # a kick's space for BAR2
HWRM_TRIGGER = bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER
RCFW_BASE = bnxt.RCFW_COMM_BASE_OFFSET
RCFW_TRIGGER = RCFW_BASE + bnxt.RCFW_COMM_TRIG_OFFSET
NQ_DOORBELLS = {bnxt.DBC_DBC_TYPE_NQ: None, bnxt.DBC_DBC_TYPE_NQ_ARM: True, bnxt.DBC_DBC_TYPE_NQ_MASK: False}
CQ_DOORBELLS = {bnxt.DBC_DBC_TYPE_CQ, bnxt.DBC_DBC_TYPE_CQ_ARMALL, bnxt.DBC_DBC_TYPE_CQ_ARMSE,
                bnxt.DBC_DBC_TYPE_CQ_ARMENA}
SQ, RQ, ROCE = bnxt.DBC_DBC_TYPE_SQ, bnxt.DBC_DBC_TYPE_RQ, bnxt.DBC_DBC_PATH_ROCE


class Doorbells:
    """BAR2 of one function: doorbell values decoded (hw/doorbell.py) and handed to what serves each."""

    def __init__(self, fw: Firmware, datapath: Datapath) -> None:
        self.fw, self.datapath = fw, datapath  # the shell hands a new data path in after a function-level reset
        self.roce_page = fw.roce_db_offset  # the firmware's configuration never changes
        self.stats, self.rings, self.qps, self.cqs = fw.stats, fw.rings, fw.rcfw.qps, fw.rcfw.cqs

    def doorbell(self, offset: int, value: int) -> None:
        """A 64-bit write to BAR2. Below the RoCE doorbell page are legacy L2 doorbells: counted, ignored. On a Thor
        that page is at 0x10000, so RoCE doorbells at Thor2's place (after legacy_l2_db_size_kb) land there too."""
        stats = self.stats
        if offset < self.roce_page:
            stats["legacy_doorbells"] += 1
            self.fw.last_error = (f"doorbell at BAR2 + {offset:#x}: below the RoCE doorbell page at "
                                  f"{self.roce_page:#x}, ignored")
            return
        xid, kind, index, epoch, toggle, path, valid = decode(value)
        if not valid:
            stats["doorbells_without_valid"] += 1
        elif kind in NQ_DOORBELLS:  # NQs are HWRM rings, whatever the path
            nq = self.rings.get(xid)
            if isinstance(nq, NotificationQueue):
                nq.consumer_doorbell(index, epoch, arm=NQ_DOORBELLS[kind])
                rcfw = self.fw.rcfw
                if nq is rcfw.creq:
                    rcfw.flush_events()
            else:
                stats["ignored_doorbells"] += 1
        elif path != ROCE:
            stats["l2_doorbells"] += 1
        elif kind in CQ_DOORBELLS and xid in self.cqs:
            if not self.cqs[xid].doorbell(kind, index, epoch, toggle):
                stats["cq_doorbells_ignored"] += 1  # an arm without CQ_ARMENA, or CQ_ARMENA with a stale toggle
        elif kind == SQ and xid in self.qps:
            self.datapath.ring_sq(self.qps[xid], index, epoch)
        elif kind == RQ and xid in self.qps:
            self.datapath.ring_rq(self.qps[xid], index, epoch)
        else:
            stats["ignored_doorbells"] += 1
        if self.fw.async_events:  # any RoCE doorbell lets events waiting for the event ring try again
            self.fw.flush_async_events()


class Mmio(Doorbells):
    """All the driver writes to one function, read off its kick socket: config space, BAR0, BAR2 (Doorbells), the
    DMA map records and the function-level reset. What the shell does with a HWRM trigger or a reset (it paces the
    firmware and owns the NIC's parts) it hands in as `run_hwrm` and `function_reset`."""

    def __init__(self, kick: socket.socket, fw: Firmware, datapath: Datapath, freed: FreedMemory,
                 counters: dict[str, int], run_hwrm: Callable[[], None], function_reset: Callable[[], None]) -> None:
        super().__init__(fw, datapath)
        self.kick, self.freed, self.counters = kick, freed, counters  # the shell's counters: "kicks" is ours
        self.run_hwrm, self.function_reset = run_hwrm, function_reset
        self.bus_master = False  # the command register's bit: without it the device does no DMA
        self.partial = b""  # the start of a record the socket has not delivered whole yet

    def receive(self, blocking: bool = True) -> bool:
        """Decode the kick records waiting on the socket (waiting for some unless not `blocking`); False once the
        driver closed it (it closed the device, or died)."""
        try:
            data = self.kick.recv(1 << 16) if blocking else self.kick.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        if not data:
            return False
        if self.partial:
            data = self.partial + data
        usable = len(data) - len(data) % KICK.size
        self.partial = data[usable:]
        records = KICK.iter_unpack(data[:usable] if usable < len(data) else data)
        self.counters["kicks"] += usable // KICK.size
        doorbell, write = self.doorbell, self.write
        for space, offset, value in records:
            if space == BAR2:
                doorbell(offset, value)
            else:
                write(space, offset, value)
        return True

    def write(self, space: int, offset: int, value: int) -> None:
        """One write anywhere but BAR2."""
        if space == CONFIG_SPACE:
            if offset == PCI_COMMAND:
                self.bus_master = bool(value & PCI_COMMAND_MASTER)
            elif offset == DEVCTL2:
                self.fw.pcie.write_devctl2(value)
        elif space == DMA_MAP:
            self.freed.mapped(offset, value)
        elif space == DMA_UNMAP:
            if value & PUNCHED:
                self.freed.unmapped(offset, value & ~PUNCHED)
        elif space == FUNCTION_RESET:
            self.function_reset()
        elif offset == HWRM_TRIGGER:
            self.run_hwrm()
        elif offset == RCFW_TRIGGER:
            self.fw.rcfw.trigger()
        elif RCFW_BASE <= offset < RCFW_BASE + CMDQ_INIT.size:
            self.fw.rcfw.mailbox_write(offset - RCFW_BASE, value)
