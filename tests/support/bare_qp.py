"""A QueuePair on a bare device: host memory as a bytearray, doorbells recorded, no emulator, no firmware, no poller.

The post paths (aiofabric/verbs/post.py) run as they do on a NIC; completions come only when a test hands them in
(`complete`), as the CQ's poll would. What the device would have seen is the SQ ring's bytes (`sq_bytes`) and the
doorbells rung (`doorbells`)."""
from __future__ import annotations

from typing import Any

from aiofabric.autogen import bnxt
from aiofabric.hw import doorbell
from aiofabric.pci import PAGE_SIZE, DmaBuffer, PCIDevice
from aiofabric.sim.memory import PageAllocator
from aiofabric.verbs.mr import MemoryRegion
from aiofabric.verbs.post import QueuePair
from aiofabric.verbs.types import ALL_ACCESS, QPState

# the chips' send queues: variable WQEs (Thor2) or static ones (Thor), the MSN table or the PSN search table
MODES = {"thor2": (True, True), "thor": (False, False), "psn-table": (True, False), "static+msn": (False, True)}


class Memory(PCIDevice):
    """DMA memory as a bytearray (bus address = offset + base)."""
    address, base = "bare", 0x4000_0000
    map_bar = read_config = write_config = interrupt_fd = close = None  # type: ignore[assignment]
    num_vectors = 0

    def __init__(self, size: int = 16 << 20) -> None:
        self.memory = bytearray(size)
        self.pages = PageAllocator(size)

    def _alloc_dma(self, size: int, contiguous: bool = False) -> DmaBuffer:
        start = self.pages.alloc(size)
        length = -(-size // PAGE_SIZE) * PAGE_SIZE
        return DmaBuffer(memoryview(self.memory)[start:start + length],
                         [self.base + start + i for i in range(0, length, PAGE_SIZE)], True,
                         lambda: self.pages.free(start))


class Doorbells:
    def __init__(self) -> None:
        self.written: list[int] = []

    def write64_doorbell(self, offset: int, value: int) -> None:
        self.written.append(value)

    def write64_doorbells(self, offset: int, values: list[int]) -> None:
        self.written.extend(values)


class Device:
    """What a QueuePair asks of its device when it posts."""

    def __init__(self, variable: bool, host_msn: bool) -> None:
        self.pci = Memory()
        self.variable_wqes, self.host_msn_table = variable, host_msn
        self.doorbells, self.db_offset = Doorbells(), 0
        self.lost = None

    def check_alive(self) -> None:
        pass


class Poller:
    sleeping = False


class CompletionQueue:
    def __init__(self) -> None:
        self.outstanding, self.qps, self.id = 0, {}, 1


def bare_qp(mode: str = "thor2", *, sq_depth: int = 64, psn: int = 0xFFFF00, mtu: int = 1024,
            **options: Any) -> QueuePair:
    """A QP in RTS on its own bare device, its first PSN `psn` (near the top: PSNs wrap soon)."""
    variable, host_msn = MODES[mode]
    device, cq = Device(variable, host_msn), CompletionQueue()
    qp = QueuePair(device, Poller(), cq, cq, sq_depth=sq_depth, rq_depth=16,  # type: ignore[arg-type]
                   max_send_sge=options.pop("max_send_sge", 1), max_recv_sge=1, **options)
    qp.qpn, qp.state = 0x11, QPState.RTS
    qp.send_queue.psn, qp.send_queue.mtu = psn, mtu
    return qp


def region(qp: QueuePair, size: int = 1 << 16, key: int = 0x77) -> MemoryRegion:
    """A registered region on the QP's device (its key as given)."""
    mr = MemoryRegion(qp.device, qp.device.pci.alloc_dma(size), ALL_ACCESS, owns_buffer=True)  # type: ignore[arg-type]
    mr.lkey = mr.rkey = key
    return mr


def sq_bytes(qp: QueuePair) -> bytes:
    """The SQ ring and its search table, as the device reads them."""
    return bytes(qp.sq.view)


def doorbells(qp: QueuePair) -> list[tuple[int, int]]:
    """(index, epoch) of every SQ doorbell rung so far."""
    return [doorbell.decode(value)[2:] for value in qp.device.doorbells.written  # type: ignore[attr-defined]
            if doorbell.decode(value)[1] == bnxt.DBC_DBC_TYPE_SQ]


def complete(qp: QueuePair) -> None:
    """A CQE retiring everything posted, as the poll hands it in."""
    sq = qp.send_queue
    if sq.outstanding:
        qp.send_completed(sq.posted % sq.geometry.size, 0)


def run(coroutine: Any) -> Any:
    """Drive a post that does not wait (room in the ring) to its end, outside any event loop."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise AssertionError("the post waited")
