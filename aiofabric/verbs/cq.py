"""Completion queues: the ring of CQEs the NIC writes, drained by the NIC's poller, each CQE handed to the QP it
names."""
from __future__ import annotations

import itertools
from typing import Protocol

from .poller import Poller
from ..autogen import bnxt
from ..driver.device import Device
from ..driver.firmware_events import DeviceEvent
from ..driver.rings import Ring
from ..errors import ClosedError, DeviceLostError, FabricError
from ..hw.cqe import CQ_ENTRY, CQ_ERROR_REASON_NAMES, CQE_REQ, CQE_RES_RC
from ..hw.doorbell import arm_enable
from ..pci import read_barrier

__all__ = ["CompletionQueue", "CompletionTarget", "handles"]
CQE_KIND_REQ, CQE_KIND_RES_RC = bnxt.CQ_BASE_CQE_TYPE_REQ, bnxt.CQ_BASE_CQE_TYPE_RES_RC
CQE_TYPE_MASK = bnxt.CQ_BASE_CQE_TYPE_MASK
OVERFLOWS = (bnxt.CREQ_CQ_ERROR_NOTIFICATION_CQ_ERR_REASON_REQ_CQ_OVERFLOW_ERROR,
             bnxt.CREQ_CQ_ERROR_NOTIFICATION_CQ_ERR_REASON_RES_CQ_OVERFLOW_ERROR)
handles = itertools.count(1)  # cq_handle and qp_handle: how notifications and CQEs name our CQs and QPs


class CompletionTarget(Protocol):
    """What a CQ drives: a QP (qp.py) whose work requests complete here."""

    def send_completed(self, consumer: int, status: int) -> None: ...  # a requester CQE

    def recv_completed(self, wr_id: int, status: int, length: int, imm: int | None) -> None: ...  # a responder CQE

    def fail_outstanding(self, error: BaseException | None) -> None: ...

    def cq_failed(self, error: FabricError) -> None: ...  # a CQ it uses lost completions


class CompletionQueue:
    """A CQ of `depth` 32-byte CQEs (power of two), notified through the device's NQ, drained by the NIC's poller.
    Made by `NIC.create_cq` (`create`)."""

    release_order = 1  # at the NIC's close: after the QPs that use it

    def __init__(self, device: Device, poller: Poller, depth: int) -> None:
        self.device, self.poller, self.depth, self.handle = device, poller, depth, next(handles)
        self.ring = Ring(device.pci, depth, CQ_ENTRY.size)
        self.id = -1
        self.closed = False
        self.errors: list[DeviceEvent] = []
        self.qps: dict[int, CompletionTarget] = {}  # by qp_handle, as CQEs name them
        self.outstanding = 0  # work requests whose completion lands here
        self.armed, self.toggle = False, 0

    @classmethod
    async def create(cls, device: Device, poller: Poller, depth: int) -> CompletionQueue:
        """CREATE_CQ with room for `depth` CQEs (a power of two), drained by `poller`."""
        cq = cls(device, poller, depth)
        await cq._create()
        poller.add(cq)
        return cq

    async def _create(self) -> None:
        try:
            reply = await self.device.rcfw(
                "create_cq", cq_handle=self.handle, cq_size=self.depth, pbl=self.ring.base, dpi=0,
                pg_size_lvl=self.ring.level << bnxt.CMDQ_CREATE_CQ_LVL_SFT | bnxt.CMDQ_CREATE_CQ_PG_SIZE_PG_4K,
                cq_fco_cnq_id=self.device.nq_id)
        except BaseException:
            self.ring.free()
            raise
        self.id = reply.xid  # no checkpoint from the reply to here: a cancelled create still registers the CQ
        self.device.router.route("cq_error", self.id, self._on_error)
        self.device.attach(self)
        # without it the CQ never notifies (Linux bnxt_qplib_create_cq); db_offset is the privileged doorbell page
        self.device.doorbells.write64_doorbell(self.device.db_offset, arm_enable(self.id, self.toggle))

    @property
    def busy(self) -> bool:
        return self.outstanding > 0

    def poll(self, budget: int = 512) -> int:
        """Consume up to `budget` new CQEs, completing their work requests; return the CQ credit to the NIC (one
        doorbell). The CQEs are found and read in bulk: every new one's valid bit at once, a read barrier, then
        their bodies in one unpack per run up to the ring's end."""
        ring = self.ring
        view, depth, consumer = ring.view, ring.depth, ring.consumer
        if budget <= 0 or not CQ_ENTRY.is_new(view, ring.offset(consumer), consumer, depth):
            return 0  # the common case of a poll while spinning: one byte read
        following = consumer + 1  # a poll often finds one CQE: then the next one's bit is all there is to look at
        count = CQ_ENTRY.new_entries(view, consumer, depth, budget) if budget > 1 and CQ_ENTRY.is_new(
            view, ring.offset(following), following, depth) else 1
        read_barrier()  # the CQEs' bodies after their valid bits (Linux dma_rmb in bnxt_qplib_poll_cq)
        slot = consumer % depth
        head = min(count, depth - slot)
        runs = [(slot, head)] + ([(0, count - head)] if count > head else [])
        ring.consumer = consumer + count  # they are read: a poll from what they complete would not see them again
        qps, size = self.qps, CQ_ENTRY.size
        for first, entries in runs:
            offset = first * size
            for handle, consumed, kind, status in CQE_REQ.iter_unpack(view[offset:offset + entries * size]):
                kind &= CQE_TYPE_MASK
                if kind == CQE_KIND_REQ:
                    qp = qps.get(handle)
                    if qp is not None:
                        qp.send_completed(consumed, status)
                elif kind == CQE_KIND_RES_RC:
                    length, imm, handle, _, _, status, flags, wr_id = CQE_RES_RC.unpack_from(view, offset)
                    qp = qps.get(handle)
                    if qp is not None:
                        qp.recv_completed(wr_id, status, length, imm if flags & bnxt.CQ_RES_RC_FLAGS_IMM else None)
                offset += size
        self.device.doorbells.write64_doorbell(self.device.db_offset, ring.doorbell(self.id, bnxt.DBC_DBC_TYPE_CQ))
        return count

    def arm(self) -> None:
        self.device.doorbells.write64_doorbell(self.device.db_offset, self.arm_doorbell())

    def arm_doorbell(self) -> int:
        """Mark the CQ armed; the CQ_ARMALL doorbell that does it, to ring (alone, or with others)."""
        self.armed = True
        return self.ring.doorbell(self.id, bnxt.DBC_DBC_TYPE_CQ_ARMALL, self.toggle)

    def notified(self, toggle: int) -> int:
        """Its notification came, which disarmed it: take the notification's toggle; the CQ_ARMENA doorbell that lets
        it be armed again, to ring with others (Linux bnxt_qplib_service_nq)."""
        self.armed, self.toggle = False, toggle
        return arm_enable(self.id, toggle)

    def _on_error(self, event: DeviceEvent) -> None:
        """CQ error notification: the NIC found the CQ full (it drops the CQE: more completions were outstanding than
        the CQ holds) or could not use its context. Linux's bnxt_re_handle_cq_async_error reports each of these
        reasons as IB_EVENT_CQ_ERR and leaves the rest to the consumer; here, completions lost never come, so the CQEs
        already written are delivered and every QP using the CQ moves to ERR, flushing what is outstanding with this
        error as the cause rather than leaving it to wait forever."""
        self.errors.append(event)
        reason = event.detail.get("cq_err_reason", 0)
        name = CQ_ERROR_REASON_NAMES.get(reason, f"reason {reason}")
        hint = (f": more completions were outstanding than its {self.depth} entries hold" if reason in OVERFLOWS
                else "")
        error = FabricError(f"CQ {self.id:#x} lost completions ({name}){hint}")
        self.poll(self.depth)
        for qp in list(self.qps.values()):
            qp.cq_failed(error)

    def fail_all(self, error: BaseException) -> None:
        for qp in list(self.qps.values()):
            qp.fail_outstanding(error)

    def device_lost(self, error: DeviceLostError) -> None:
        self.fail_all(error)

    async def release(self) -> None:
        await self.destroy()

    def forget(self) -> None:
        if not self.closed:
            self.closed = True
            self.fail_all(ClosedError(f"CQ {self.id:#x} was closed with its NIC"))
            self.ring.free()

    async def destroy(self) -> None:
        """DESTROY_CQ and free the ring; the firmware refuses while QPs still use the CQ (FirmwareError)."""
        if self.closed:
            return
        await self.device.rcfw_release("destroy_cq", cq_cid=self.id)
        self.closed = True
        self.device.router.route("cq_error", self.id, None)
        self.poller.remove(self)
        self.device.detach(self)
        self.fail_all(ClosedError(f"CQ {self.id:#x} was destroyed"))
        self.ring.free()
