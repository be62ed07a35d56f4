"""The receive queue as the device reads it: the RQ WQE at the consumer, sans-IO.

The WQE format is hw/wqe.py's: every WQE takes rq_wqe_size bytes, an rq_wqe_hdr (its size in 16-byte slots and the
driver's wr_id) and then the SGEs a SEND's payload is scattered to. The doorbell names the producer WQE; the responder
moves the consumer (QueuePair.rq_consumer) as it completes WQEs.
"""
from __future__ import annotations

from .dma import Buffer, map_sges
from .memory import BusMemory
from .objects import MemoryRegion, QueuePair
from ..hw.ring import producer_from_doorbell
from ..hw.verbs import MRAccess
from ..hw.wqe import RQ_WQE_HEADER, RQ_WQE_HEADER_SLOTS, SGE, SQ_SLOT

LOCAL_WRITE = int(MRAccess.LOCAL_WRITE)  # a plain int: IntFlag arithmetic is slow on the per-message path


class ReceiveQueue:
    """Reads one QP's RQ ring."""

    def __init__(self, qp: QueuePair, mem: BusMemory, mrs: dict[int, MemoryRegion]) -> None:
        self.qp, self.mem, self.mrs = qp, mem, mrs

    @property
    def exists(self) -> bool:
        """The QP was created with an RQ (else it takes no SENDs)."""
        return self.qp.rq is not None and bool(self.qp.rq_size)

    def produced(self) -> int | None:
        """The free-running count of WQEs the driver posted, as its last RQ doorbell names it (None: a producer the
        ring cannot hold)."""
        qp = self.qp
        return producer_from_doorbell(qp.rq_consumer, qp.rq_producer, qp.rq_producer_epoch, qp.rq_size)

    def wqe(self) -> tuple[int, int, memoryview | bytes]:
        """(wqe_size in slots, wr_id, its bytes) of the WQE at the consumer (DmaFault if the ring cannot be read)."""
        qp = self.qp
        size, pages = qp.rq_wqe_size, qp.rq
        assert pages is not None
        offset = qp.rq_consumer % qp.rq_size * size
        view: memoryview | bytes
        if pages.contiguous or (offset & pages.page_mask) + size <= pages.page_size:
            view = self.mem.view(pages.address(offset), size)
        else:
            view = b"".join(self.mem.view(pages.address(offset + i), SQ_SLOT) for i in range(0, size, SQ_SLOT))
        _, _, wqe_size, wr_id, _ = RQ_WQE_HEADER.unpack_from(view)
        return wqe_size, wr_id, view

    def buffer(self, wqe_size: int, view: memoryview | bytes) -> Buffer:
        """The memory the SGEs of a WQE (`wqe()`'s size and bytes) name, mapped for the device to write
        (MemoryProtectionError or DmaFault when one is bad)."""
        qp = self.qp
        count = min(max(wqe_size - RQ_WQE_HEADER_SLOTS, 0), qp.rq_sge, qp.rq_wqe_size // SQ_SLOT - RQ_WQE_HEADER_SLOTS)
        return map_sges(self.mem, self.mrs, [SGE.unpack_from(view, RQ_WQE_HEADER.size + i * SGE.size)
                                             for i in range(count)], qp.pd, LOCAL_WRITE)
