"""A queue pair's life: its rings, CREATE_QP, the states it moves through (INIT, connect's RTR and RTS, ERR, RESET),
its completions as its CQs deliver them, and its destruction. `QueuePair` (post.py) adds the work requests it posts."""
from __future__ import annotations

import secrets
from typing import Any, TypeVar

import anyio

from .completions import RECV_FLUSHED, SEND_FLUSHED, Completion, finished
from .cq import CompletionQueue, handles
from .poller import Poller
from .types import ALL_ACCESS, Access, QPInfo, QPState, check_qp_info, check_range, mac_bytes
from .workqueue import RecvQueueCodec, SendQueueCodec
from ..autogen import bnxt
from ..driver import log
from ..driver.device import Device
from ..driver.firmware_events import DeviceEvent
from ..driver.rings import Ring
from ..hw.ring import power_of_two
from ..errors import ClosedError, CompletionError, DeviceLostError, FabricError, QPStateError
from ..hw.cqe import QP_ERROR_REASON_NAMES, RECV_STATUS_NAMES, SEND_STATUS_NAMES
from ..hw.layout import field_type
from ..hw.verbs import PATH_MTU_CODES, PSN_MASK
from ..hw.wqe import (RQ_WQE_HEADER, SGE, SQ_SLOT, SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS, STATIC_SQ_RESERVED_WQES,
                      STATIC_WQE_SGES, SqGeometry)
from ..pci import DmaBuffer

__all__ = ["QueuePairLife"]
SQ_SLOT_ALIGN = 256  # Linux sizes variable-WQE send queues in slots aligned to 256 (BNXT_VAR_MAX_SLOT_ALIGN)
MAX_SQ_SLOTS = (bnxt.SQ_MSN_SEARCH_START_IDX_MASK >> bnxt.SQ_MSN_SEARCH_START_IDX_SFT) + 1  # start_idx: 16 bits
PATH_MTUS = {mtu: code for mtu, code in PATH_MTU_CODES.items() if mtu <= 4096}  # RoCE path MTUs: IB's, up to 4096
QP = TypeVar("QP", bound="QueuePairLife")


def random_psn() -> int:
    """A QP's initial PSN: random, like perftest's; from `secrets`, since a program may seed `random`, and the PSN
    is part of what a forged packet must guess."""
    return secrets.randbelow(PSN_MASK + 1)


class QueuePairLife:
    """An RC queue pair: a send queue of variable-size WQEs on Thor2 (static ones before it, as Linux's
    bnxt_re_set_drv_mode chooses), followed by the search table the firmware wants (the MSN table or the PSN search
    table, hw.wqe.SqGeometry), and an RQ. Made by `NIC.create_qp` (`create`)."""

    release_order = 0  # at the NIC's close: first (it holds its CQs)

    def __init__(self, device: Device, poller: Poller, send_cq: CompletionQueue, recv_cq: CompletionQueue, *,
                 sq_depth: int, rq_depth: int, max_send_sge: int, max_recv_sge: int,
                 max_inline_data: int = 0) -> None:
        self.device, self.send_cq, self.recv_cq = device, send_cq, recv_cq
        self.handle = next(handles)
        self.max_send_sge, self.max_recv_sge, self.max_inline_data = max_send_sge, max_recv_sge, max_inline_data
        wqe_slots = SQ_WQE_HEADER_SLOTS + max(max_send_sge, -(-max_inline_data // SQ_SLOT))
        if device.variable_wqes:
            size, reserved = power_of_two(-(-sq_depth * wqe_slots // SQ_SLOT_ALIGN) * SQ_SLOT_ALIGN), 0
        else:  # 128-byte WQEs of 6 SGEs, 128 + 1 more than asked for (Linux bnxt_re_init_sq_attr, in powers of two)
            reserved, wqe_slots = STATIC_SQ_RESERVED_WQES + 1, SQ_STATIC_WQE_SLOTS
            size = power_of_two(sq_depth + reserved)
        self.geometry = SqGeometry(device.variable_wqes, size, device.host_msn_table)
        if self.geometry.slots > MAX_SQ_SLOTS:
            most = MAX_SQ_SLOTS // wqe_slots - reserved
            raise ValueError(f"sq_depth {sq_depth} needs {self.geometry.slots} send-queue slots: the search table names "
                             f"a WQE's slot in 16 bits, so at most {MAX_SQ_SLOTS} ({most} work requests of "
                             f"{wqe_slots} slots)")
        self.sq_slots, entries = self.geometry.slots, self.geometry.table_entries
        self.msn_entries = entries if device.host_msn_table else 0  # the MSN table's; 0 with the PSN search table
        self.sq = Ring(device.pci, self.sq_slots, SQ_SLOT, extra=entries * self.geometry.table_entry.size)
        self.rq_sges = max_recv_sge if device.variable_wqes else STATIC_WQE_SGES  # what CREATE_QP names
        self.rq_wqe_size = RQ_WQE_HEADER.size + self.rq_sges * SGE.size  # static: 128 bytes (bnxt_re_setup_rwqe_size)
        self.rq = Ring(device.pci, power_of_two(rq_depth), self.rq_wqe_size)
        self.send_queue = SendQueueCodec(self.geometry, self.sq.view, reserved_wqes=reserved,
                                         max_unsignaled=max(1, (self.sq_slots // wqe_slots - reserved) // 2))
        self.recv_queue = RecvQueueCodec(self.rq.view, self.rq.depth, self.rq_wqe_size)
        self.send_queue.psn = random_psn()
        self.read_queues: list[DmaBuffer] = [device.pci.alloc_dma(0x1000), device.pci.alloc_dma(0x1000)]
        self.qpn = -1
        self.state = QPState.RESET
        self.closed = False
        self.error: BaseException | None = None  # what moved the QP to ERR; flushed work requests name it
        self.peer: QPInfo | None = None  # whom connect() pointed it at
        self.errors: list[DeviceEvent] = []
        self._space = anyio.Event()
        self._space_waiters = 0
        self._poller = poller
        self._doorbell_due = False  # WQEs posted inside a batch() wait for its end to be announced

    @classmethod
    async def create(cls: type[QP], device: Device, poller: Poller, send_cq: CompletionQueue,
                     recv_cq: CompletionQueue, *, sq_depth: int, rq_depth: int, max_send_sge: int, max_recv_sge: int,
                     max_inline_data: int = 0) -> QP:
        """CREATE_QP, then INIT: an RC QP ready to `connect`."""
        qp = cls(device, poller, send_cq, recv_cq, sq_depth=sq_depth, rq_depth=rq_depth, max_send_sge=max_send_sge,
                 max_recv_sge=max_recv_sge, max_inline_data=max_inline_data)
        await qp._create()
        try:
            await qp.to_init()
        except BaseException:  # cancelled or refused: the caller never gets the QP, so it must not outlive this
            with anyio.CancelScope(shield=True):
                await qp.destroy()
            raise
        return qp

    async def _create(self) -> None:
        irrq, orrq = self.read_queues
        try:
            reply = await self.device.rcfw(
                "create_qp", qp_handle=self.handle, type=bnxt.CMDQ_CREATE_QP_TYPE_RC,
                qp_flags=bnxt.CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_ENABLED if self.geometry.variable else 0,
                sq_pg_size_sq_lvl=self.sq.level | bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_PG_4K,
                rq_pg_size_rq_lvl=self.rq.level | bnxt.CMDQ_CREATE_QP_RQ_PG_SIZE_PG_4K,
                sq_size=self.geometry.size, rq_size=self.rq.depth,
                sq_fwo_sq_sge=self.max_send_sge if self.geometry.variable else STATIC_WQE_SGES,
                rq_fwo_rq_sge=self.rq_sges, scq_cid=self.send_cq.id, rcq_cid=self.recv_cq.id,
                sq_pbl=self.sq.base, rq_pbl=self.rq.base, irrq_addr=irrq.bus_addr, orrq_addr=orrq.bus_addr)
        except BaseException:
            self._free_memory()
            raise
        self.qpn = reply.xid  # no checkpoint from the reply to here: a cancelled create still registers the QP
        self.device.router.route("qp_error", self.qpn, self._on_error)
        self.device.attach(self)
        self.send_cq.qps[self.handle] = self
        self.recv_cq.qps[self.handle] = self

    # -- state -------------------------------------------------------------------------------------------------------
    def info(self) -> QPInfo:
        return QPInfo(self.qpn, self.device.gid, self.device.mac, self.psn)

    @property
    def psn(self) -> int:
        """The PSN the next message starts at (before connect(): the initial one the peer expects)."""
        return self.send_queue.psn

    @property
    def mtu(self) -> int:
        """The path MTU connect() set (1024 before)."""
        return self.send_queue.mtu

    async def modify(self, state: QPState, mask: int = 0, **fields: Any) -> None:
        """MODIFY_QP to `state`; `mask` selects which of `fields` the firmware applies (CMDQ_MODIFY_QP_MODIFY_MASK_*)."""
        self._refuse("modify")
        await self.device.rcfw(
            "modify_qp", qp_cid=self.qpn, qp_type=bnxt.CMDQ_MODIFY_QP_QP_TYPE_RC,
            modify_mask=mask | bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_STATE,
            network_type_en_sqd_async_notify_new_state=int(state) | bnxt.CMDQ_MODIFY_QP_NETWORK_TYPE_ROCEV2_IPV4,
            **fields)
        self.state = state
        if state == QPState.ERR:
            self._poll_cqs()
            self._flush()
        elif state == QPState.RESET:
            self._reset()

    def _reset(self) -> None:
        """RESET empties both queues (the NIC starts them over at index 0, as ibv_modify_qp to RESET does):
        outstanding work is flushed and the rings, indices and PSN start afresh, so the QP can connect again."""
        self._poll_cqs()
        self.fail_outstanding(None)
        self.send_queue.reset(random_psn())
        self.recv_queue.reset()
        self.error = None

    async def to_init(self, access: Access = ALL_ACCESS) -> None:
        await self.modify(QPState.INIT, bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_ACCESS | bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_PKEY,
                          access=access.for_qp(), pkey=0xFFFF)

    async def connect(self, peer: QPInfo, *, mtu: int = 1024, timeout: int = 14, retry_cnt: int = 7,
                      rnr_retry: int = 7, min_rnr_timer: int = 12, max_rd_atomic: int = 16) -> None:
        """INIT (if needed) → RTR → RTS towards `peer`. Defaults follow perftest (timeout 14 ≈ 67 ms, retries 7).

        `timeout` is the local ACK timeout exponent (4.096 us * 2^timeout; 0 waits forever), `retry_cnt` and
        `rnr_retry` count retransmissions (rnr_retry 7 retries forever), `min_rnr_timer` is the IB RNR timer code."""
        if mtu not in PATH_MTUS:
            raise ValueError(f"path MTU must be one of {sorted(PATH_MTUS)}, not {mtu}")
        check_qp_info(peer)  # again: a QPInfo's fields can be swapped (object.__setattr__) or a look-alike passed
        check_range("timeout", timeout, 0, 31)
        check_range("retry_cnt", retry_cnt, 0, 7)
        check_range("rnr_retry", rnr_retry, 0, 7)
        check_range("min_rnr_timer", min_rnr_timer, 0, 31)
        check_range("max_rd_atomic", max_rd_atomic, 1, self.device.caps.get("max_qp_rd_atom") or 255)
        if self.state == QPState.RESET:
            await self.to_init()
        m = bnxt
        await self.modify(
            QPState.RTR, m.CMDQ_MODIFY_QP_MODIFY_MASK_DGID | m.CMDQ_MODIFY_QP_MODIFY_MASK_SGID_INDEX
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_HOP_LIMIT | m.CMDQ_MODIFY_QP_MODIFY_MASK_DEST_MAC
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_PATH_MTU | m.CMDQ_MODIFY_QP_MODIFY_MASK_RQ_PSN
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_MIN_RNR_TIMER | m.CMDQ_MODIFY_QP_MODIFY_MASK_MAX_DEST_RD_ATOMIC
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_DEST_QP_ID,
            dgid=field_type(bnxt.cmdq_modify_qp, "dgid").from_buffer_copy(peer.gid),
            sgid_index=self.device.gid_index, hop_limit=64, path_mtu_pingpong_push_enable=PATH_MTUS[mtu],
            dest_mac=field_type(bnxt.cmdq_modify_qp, "dest_mac").from_buffer_copy(mac_bytes(peer.mac)),
            rq_psn=peer.psn, min_rnr_timer=min_rnr_timer, max_dest_rd_atomic=max(max_rd_atomic, 1),
            dest_qp_id=peer.qpn)
        await self.modify(
            QPState.RTS, m.CMDQ_MODIFY_QP_MODIFY_MASK_TIMEOUT | m.CMDQ_MODIFY_QP_MODIFY_MASK_RETRY_CNT
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_RNR_RETRY | m.CMDQ_MODIFY_QP_MODIFY_MASK_SQ_PSN
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_MAX_RD_ATOMIC,
            timeout=timeout, retry_cnt=retry_cnt, rnr_retry=rnr_retry, sq_psn=self.psn, max_rd_atomic=max_rd_atomic)
        self.send_queue.mtu, self.peer = mtu, peer

    async def query(self) -> Any:
        """QUERY_QP: the firmware's view of this QP (creq_query_qp_resp_sb)."""
        self._refuse("query")
        return await self.device.rcfw("query_qp", qp_cid=self.qpn)

    # -- completions (from the CQs' poll) ------------------------------------------------------------------------------
    def send_completed(self, consumer: int, status: int) -> None:
        """A requester CQE: every WQE up to the one `consumer` names (SendQueueCodec.retire) is done; the last one
        has `status`."""
        done, named = self.send_queue.retire(consumer, status)
        if done:
            Completion.finish_many(done)
        cq = self.send_cq
        cq.outstanding -= len(done)
        if named is not None:
            cq.outstanding -= 1
            if not status:
                named.finish()
            elif status == SEND_FLUSHED:
                named.finish(self._flushed(named.verb))
            else:
                error = CompletionError(named.verb, self.qpn, status, SEND_STATUS_NAMES.get(status, "UNKNOWN"))
                named.finish(error)
                self._failed(error)
        if self._space_waiters:
            self._wake_posters()

    def recv_completed(self, wr_id: int, status: int, length: int, imm: int | None) -> None:
        """A responder CQE: the oldest receive is done."""
        completion, matched = self.recv_queue.complete(wr_id)
        if completion is None:
            return
        self.recv_cq.outstanding -= 1
        if not matched:
            log.warning("QP %#x: receive completion for wr_id %#x does not match the oldest receive", self.qpn, wr_id)
        if status == RECV_FLUSHED:
            completion.finish(self._flushed("recv"))
        elif status:
            error = CompletionError("recv", self.qpn, status, RECV_STATUS_NAMES.get(status, "UNKNOWN"))
            completion.finish(error)
            self._failed(error)
        else:
            completion.finish(None, length, imm)
        self._wake_posters()

    def _poll_cqs(self) -> None:
        """Deliver every completion the NIC wrote already, before the state changes what later ones mean (a CQ
        holds at most its depth: one poll of that budget reads them all)."""
        self.send_cq.poll(self.send_cq.ring.depth)
        self.recv_cq.poll(self.recv_cq.ring.depth)

    def _wake_posters(self) -> None:
        if self._space_waiters:  # an event per wake-up only when someone waits: this runs once per CQE
            self._space.set()
            self._space = anyio.Event()

    # -- errors ------------------------------------------------------------------------------------------------------
    def _on_error(self, event: DeviceEvent) -> None:
        """QP error notification: completions already written are delivered first (a failed one's status is the
        root cause the flushed ones name; the notification's reason is the root only when no CQE said more)."""
        self.errors.append(event)
        self.state = QPState.ERR
        self._poll_cqs()
        if self.error is None:
            reasons = ", ".join(f"{name}={QP_ERROR_REASON_NAMES[name].get(value, value)}"
                                for name, value in event.detail.items() if name in QP_ERROR_REASON_NAMES and value)
            self.error = FabricError(f"QP {self.qpn:#x} moved to ERR by the firmware ({reasons or 'no reason given'})")
        self._flush()

    def cq_failed(self, error: FabricError) -> None:
        """A CQ this QP uses reported an error (CompletionQueue._on_error): completions were lost, so the QP is in
        ERR, what is outstanding flushes naming `error`, and nothing more is written to its rings (the NIC may still
        be reading them) until it is reset or destroyed."""
        self._poll_cqs()
        if self.error is None:
            self.error = error
        self.state = QPState.ERR
        self._flush()

    def _failed(self, error: CompletionError) -> None:
        """A work request failed with a real (non-flush) status: the QP is in ERR, everything after it flushes."""
        if self.error is None:
            self.error = error
        self.state = QPState.ERR
        self._flush()

    def _flush(self) -> None:
        self.fail_outstanding(None)

    def _flushed(self, verb: str) -> CompletionError:
        if verb == "recv":
            return CompletionError(verb, self.qpn, RECV_FLUSHED, RECV_STATUS_NAMES[RECV_FLUSHED], self.error)
        return CompletionError(verb, self.qpn, SEND_FLUSHED, SEND_STATUS_NAMES[SEND_FLUSHED], self.error)

    def fail_outstanding(self, error: BaseException | None) -> None:
        """Complete every outstanding work request with `error` (None: the verbs FLUSHED status)."""
        for completion in self.send_queue.drain():
            self.send_cq.outstanding -= 1
            completion.finish(error or self._flushed(completion.verb))
        for completion in self.recv_queue.drain():
            self.recv_cq.outstanding -= 1
            completion.finish(error or self._flushed("recv"))
        self._wake_posters()

    def _refuse(self, verb: str) -> None:
        """Raise if the QP cannot be used at all: the device is lost, or the QP is destroyed."""
        self.device.check_alive()
        if self.closed:
            raise ClosedError(f"{verb} on QP {self.qpn:#x}: the QP was destroyed")

    def _refused(self, verb: str, hint: str) -> Completion:
        """The slow branch of posting to a QP in the wrong state: raise, or complete at once as flushed (ERR)."""
        self._refuse(verb)
        if self.state is QPState.ERR:
            return finished(verb, self._flushed(verb))
        raise QPStateError(f"{verb} on QP {self.qpn:#x} in state {self.state.name}: {hint}")

    # -- the end -----------------------------------------------------------------------------------------------------
    def device_lost(self, error: DeviceLostError) -> None:
        self.state = QPState.ERR  # the post paths' slow branch raises the loss
        self.fail_outstanding(error)

    async def release(self) -> None:
        await self.destroy()

    def forget(self) -> None:
        if not self.closed:
            self.closed, self.state = True, QPState.RESET
            self.fail_outstanding(ClosedError(f"QP {self.qpn:#x} was closed with its NIC"))
            self._free_memory()

    async def destroy(self) -> None:
        """DESTROY_QP, then fail what is still outstanding with ClosedError and free the rings. From the first call
        on, every use of the QP raises ClosedError; its memory is freed only once the firmware let go of it."""
        if self.closed:
            return
        self.closed, state = True, self.state
        self.state = QPState.RESET  # the post paths' slow branch raises ClosedError
        try:
            destroyed = await self.device.rcfw_release("destroy_qp", qp_cid=self.qpn)
        except BaseException:  # refused, timed out or cancelled: the firmware kept the QP, so do we (a retry works)
            self.closed, self.state = False, state
            raise
        if destroyed:
            self._poll_cqs()  # completions the NIC wrote before it let go are delivered as they are
        self.device.router.route("qp_error", self.qpn, None)
        self.device.detach(self)
        self.send_cq.qps.pop(self.handle, None)
        self.recv_cq.qps.pop(self.handle, None)
        self.fail_outstanding(ClosedError(f"QP {self.qpn:#x} was destroyed with this work request outstanding"))
        self._free_memory()

    def _free_memory(self) -> None:
        self.send_queue.close()  # its numpy arrays over the ring hold the memory mapped
        self.sq.free()
        self.rq.free()
        for buffer in self.read_queues:
            buffer.free()
