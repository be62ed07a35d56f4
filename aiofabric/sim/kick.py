"""The kick protocol: how MMIO writes and DMA mappings reach the emulator process, and how a NIC attaches to it.

The device side defines it (process.py attaches NICs by it, mmio.py decodes the kicks); the driver side's emulated
backend (aiofabric/pci/emulated.py) writes it. A kick is a 16-byte record on a stream socket, so the device sees
writes in program order, like posted PCIe writes."""
from __future__ import annotations

import select
import socket
import struct

from ..autogen import bnxt

KICK = struct.Struct("<BxxxIQ")  # space (0 = BAR0, 2 = BAR2, or one of those below), offset, value
CONFIG_SPACE = 0xFF
DMA_MAP, DMA_UNMAP = 0xFE, 0xFD  # arena offset, length: what the driver allocates and frees, as an IOMMU is told
PUNCHED = 1 << 63  # in DMA_UNMAP's value: the freed pages were punched out, so any later content is the device's
FUNCTION_RESET = 0xFC  # a function-level reset
BAR0_KICK_FROM = bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER  # below: the HWRM request window, memory read on the trigger
NUM_VECTORS = 8
ATTACH_FDS = ("bar0_fd", "arena_fd", "kick_fd", "debug_fd")  # an attach message's descriptors, then the MSI-X ones
CONTROL_MESSAGE = 1 << 16  # the largest attach message


def send_kicks(kick: socket.socket, records: bytes) -> None:
    """Send kick records whole, in order, waiting while the socket is full: an event loop watching the kick socket
    (it is the removal fd) may have made it non-blocking (uvloop does), and a record dropped there is a lost
    doorbell. OSError means the emulator is gone (the removal fd tells the driver)."""
    view = memoryview(records)
    while view:
        try:
            view = view[kick.send(view):]
        except BlockingIOError:
            select.select([], [kick], [])
