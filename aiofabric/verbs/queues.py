"""Verbs objects on a NIC: completion queues, queue pairs, memory regions.

Names follow ibverbs/pyverbs (QP, CQ, MR, lkey, rkey, GID, PSN, MTU). Every object is created and destroyed through
RCFW commands on its `Device`; its host memory (rings, page tables) is freed only after the firmware let go of it.
"""
from __future__ import annotations

import contextvars
import dataclasses
import enum
import itertools
import operator
import secrets
import weakref
from typing import Any, Iterable, Sequence, Union

import anyio

from .completions import RECV_FLUSHED, SEND_FLUSHED, Completion, finished
from .poller import Poller
from .workqueue import RecvQueueCodec, SendQueueCodec, Sge, span
from ..autogen import bnxt
from ..driver.device import Device, DeviceEvent, log
from ..driver.rings import Ring, page_table
from ..errors import ClosedError, CompletionError, DeviceLostError, FabricError, QPStateError
from ..hw import doorbell
from ..hw.cqe import (CQ_ENTRY, CQE_REQ, CQE_RES_RC, CQE_TYPE_OFFSET, QP_ERROR_REASON_NAMES, RECV_STATUS_NAMES,
                      SEND_STATUS_NAMES, cqe_type)
from ..hw.layout import field_type
from ..hw.verbs import PATH_MTU_CODES, PSN_MASK, MRAccess, QPAccess, QPState
from ..hw.wqe import ATOMIC_SIZE, RQ_WQE_HEADER, SGE, SQ_SLOT, SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS, SqGeometry
from ..pci import DmaBuffer

__all__ = ["ALL_ACCESS", "Access", "CompletionQueue", "LocalBuffer", "MemoryRegion", "QPInfo", "QPState", "QueuePair",
           "RemoteRegion", "check_range"]  # QPState: the firmware's QP states (aiofabric.hw.verbs)
SQ_SLOT_ALIGN = 256  # Linux sizes variable-WQE send queues in slots aligned to 256 (BNXT_VAR_MAX_SLOT_ALIGN)
MAX_SQ_SLOTS = (bnxt.SQ_MSN_SEARCH_START_IDX_MASK >> bnxt.SQ_MSN_SEARCH_START_IDX_SFT) + 1  # start_idx: 16 bits
CQE_KIND_REQ, CQE_KIND_RES_RC = bnxt.CQ_BASE_CQE_TYPE_REQ, bnxt.CQ_BASE_CQE_TYPE_RES_RC
RTS = QPState.RTS  # a module global: an Enum member lookup costs ~70 ns on the per-operation path
WRITE, WRITE_IMM, READ = (bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE, bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_W_IMMEAD,
                          bnxt.SQ_RDMA_HDR_WQE_TYPE_READ_WQE)
SEND, SEND_IMM = bnxt.SQ_SEND_HDR_WQE_TYPE_SEND, bnxt.SQ_SEND_HDR_WQE_TYPE_SEND_W_IMMEAD
COMPARE_SWAP, FETCH_ADD = bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_CS, bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_FA
ATOMIC_MAX = (1 << 8 * ATOMIC_SIZE) - 1  # atomics take and give unsigned 64-bit values
VERBS = {"write": WRITE, "write_with_imm": WRITE_IMM, "read": READ, "send": SEND}  # post_many's; send with imm=
PATH_MTUS = {mtu: code for mtu, code in PATH_MTU_CODES.items() if mtu <= 4096}  # RoCE path MTUs: IB's, up to 4096
_handles = itertools.count(1)
ADDRESS_MAX, KEY_MAX = (1 << 64) - 1, (1 << 32) - 1  # an SGE's and an RETH's address; a key, an SGE's length
_batching: contextvars.ContextVar[tuple[QueuePair, ...]] = contextvars.ContextVar("aiofabric_batching", default=())


class Access(enum.IntFlag):
    """Access rights in ibverbs' bit order (IBV_ACCESS_*), converted to each firmware command's own order."""
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8

    def for_mr(self) -> int:
        """REGISTER_MR's bits (their order differs from MODIFY_QP's)."""
        return sum(MRAccess[str(flag.name)] for flag in Access if flag in self)

    def for_qp(self) -> int:
        """MODIFY_QP's bits."""
        return sum(QPAccess[str(flag.name)] for flag in Access if flag in self)


ALL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
ATOMIC_ACCESS = ALL_ACCESS | Access.REMOTE_ATOMIC  # a region or responder QP that atomics may also reach


RECV_STATES = frozenset((QPState.INIT, QPState.RTR, QPState.RTS))  # where ibverbs accepts receives


@dataclasses.dataclass(frozen=True)
class QPInfo:
    """What a peer needs to connect to a QP (what perftest exchanges out of band)."""
    qpn: int
    gid: bytes
    mac: str
    psn: int

    def __post_init__(self) -> None:
        check_qp_info(self)

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "gid": self.gid.hex(), "mac": self.mac, "psn": self.psn}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QPInfo:
        return cls(int(data["qpn"]), bytes.fromhex(data["gid"]), data["mac"], int(data["psn"]))


def check_qp_info(info: QPInfo) -> None:
    """Refuse what the wire cannot carry: BTH holds 24-bit QP numbers and PSNs, and a wider value would be
    truncated into another QP's number (or another PSN) instead of failing."""
    check_range("qpn", info.qpn, 0, 0xFFFFFF)
    check_range("psn", info.psn, 0, PSN_MASK)
    if not isinstance(info.gid, bytes) or len(info.gid) != 16:
        raise ValueError(f"gid must be 16 bytes, not {info.gid!r}")
    mac_bytes(info.mac)


def mac_bytes(mac: str) -> bytes:
    """The 6 bytes of a MAC address written as hex ("02:00:00:00:00:01", colons optional)."""
    try:
        raw = bytes.fromhex(mac.replace(":", ""))
    except (AttributeError, ValueError):
        raw = b""
    if len(raw) != 6:
        raise ValueError(f"mac must be 6 bytes in hex (02:00:00:00:00:01), not {mac!r}")
    return raw


@dataclasses.dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory as the wire names it: remote address, rkey, and (if known) its length."""
    addr: int
    rkey: int
    length: int | None = None

    def __post_init__(self) -> None:  # what a WQE can carry (a peer's dict may hold anything)
        check_range("addr", self.addr, 0, ADDRESS_MAX)
        check_range("rkey", self.rkey, 0, KEY_MAX)
        if self.length is not None:
            check_range("length", self.length, 0, ADDRESS_MAX)

    def to_dict(self) -> dict[str, Any]:
        return {"addr": self.addr, "rkey": self.rkey, "length": self.length}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RemoteRegion:
        return cls(int(data["addr"]), int(data["rkey"]), data.get("length"))


@dataclasses.dataclass(frozen=True)
class LocalBuffer:
    """A raw scatter/gather element (address, lkey, length): only what an SGE can hold is checked here, the rest
    the NIC validates, as hardware does."""
    addr: int
    lkey: int
    length: int

    def __post_init__(self) -> None:
        check_range("addr", self.addr, 0, ADDRESS_MAX)
        check_range("lkey", self.lkey, 0, KEY_MAX)
        check_range("length", self.length, 0, KEY_MAX)


class _Batch:
    """QueuePair.batch()'s block (a class, not a generator: it is entered once per batch of posts)."""

    __slots__ = ("qp", "outer", "token")

    def __init__(self, qp: QueuePair) -> None:
        self.qp = qp

    def __enter__(self) -> None:
        self.outer = _batching.get()
        self.token = _batching.set(self.outer + (self.qp,))

    def __exit__(self, *exc_info: object) -> None:
        _batching.reset(self.token)
        qp = self.qp
        if qp._doorbell_due and qp not in self.outer:
            qp._ring_sq()


class CompletionQueue:
    """A CQ of `depth` 32-byte CQEs (power of two), notified through the device's NQ, drained by the NIC's poller.
    Made by `NIC.create_cq` (`create`)."""

    release_order = 1  # at the NIC's close: after the QPs that use it

    def __init__(self, device: Device, poller: Poller, depth: int) -> None:
        self.device, self.poller, self.depth, self.handle = device, poller, depth, next(_handles)
        self.ring = Ring(device.pci, depth, CQ_ENTRY.size)
        self.id = -1
        self.closed = False
        self.errors: list[DeviceEvent] = []
        self.qps: dict[int, QueuePair] = {}  # by qp_handle, as CQEs name them
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
        self.device.route_events("cq_error", self.id, self.errors.append)
        self.device.attach(self)

    @property
    def busy(self) -> bool:
        return self.outstanding > 0

    def poll(self, budget: int = 512) -> int:
        """Consume up to `budget` new CQEs, completing their work requests; return the CQ credit to the NIC."""
        ring, view, depth = self.ring, self.ring.view, self.ring.depth
        count = 0
        while count < budget:
            offset = ring.offset(ring.consumer)
            if not CQ_ENTRY.is_new(view, offset, ring.consumer, depth):
                break
            kind = cqe_type(view[offset + CQE_TYPE_OFFSET])
            if kind == CQE_KIND_REQ:
                handle, consumer, _, status = CQE_REQ.unpack_from(view, offset)
                qp = self.qps.get(handle)
                if qp is not None:
                    qp._send_completed(consumer, status)
            elif kind == CQE_KIND_RES_RC:
                length, imm, handle, _, _, status, flags, wr_id = CQE_RES_RC.unpack_from(view, offset)
                qp = self.qps.get(handle)
                if qp is not None:
                    qp._recv_completed(wr_id, status, length, imm if flags & bnxt.CQ_RES_RC_FLAGS_IMM else None)
            ring.consumer += 1
            count += 1
        if count:
            self._doorbell(bnxt.DBC_DBC_TYPE_CQ)
        return count

    def arm(self) -> None:
        self.device.doorbells.write64_doorbell(self.device.db_offset, self.arm_doorbell())

    def arm_doorbell(self) -> int:
        """Mark the CQ armed; the CQ_ARMALL doorbell that does it, to ring (alone, or with others)."""
        self.armed = True
        return self._doorbell_value(bnxt.DBC_DBC_TYPE_CQ_ARMALL, self.toggle)

    def _doorbell(self, kind: int) -> None:
        self.device.doorbells.write64_doorbell(self.device.db_offset, self._doorbell_value(kind))

    def _doorbell_value(self, kind: int, toggle: int = 0) -> int:
        ring = self.ring
        return doorbell.encode(self.id, kind, ring.slot(ring.consumer), ring.epoch(ring.consumer), toggle)

    def fail_all(self, error: BaseException) -> None:
        for qp in list(self.qps.values()):
            qp._fail_outstanding(error)

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
        await _unless_lost(self.device.rcfw_release("destroy_cq", cq_cid=self.id))
        self.closed = True
        self.device.route_events("cq_error", self.id, None)
        self.poller.remove(self)
        self.device.detach(self)
        self.fail_all(ClosedError(f"CQ {self.id:#x} was destroyed"))
        self.ring.free()


class QueuePair:
    """An RC queue pair: a send queue of variable-size WQEs on Thor2 (static ones before it, as Linux's
    bnxt_re_set_drv_mode chooses), followed by the search table the firmware wants (the MSN table or the PSN search
    table, hw.wqe.SqGeometry), and an RQ. Made by `NIC.create_qp` (`create`)."""

    release_order = 0  # at the NIC's close: first (it holds its CQs)

    def __init__(self, device: Device, poller: Poller, send_cq: CompletionQueue, recv_cq: CompletionQueue, *,
                 sq_depth: int, rq_depth: int, max_send_sge: int, max_recv_sge: int,
                 max_inline_data: int = 0) -> None:
        self.device, self.send_cq, self.recv_cq = device, send_cq, recv_cq
        self.handle = next(_handles)
        self.max_send_sge, self.max_recv_sge, self.max_inline_data = max_send_sge, max_recv_sge, max_inline_data
        wqe_slots = SQ_WQE_HEADER_SLOTS + max(max_send_sge, -(-max_inline_data // SQ_SLOT))
        if device.variable_wqes:
            slots = -(-sq_depth * wqe_slots // SQ_SLOT_ALIGN) * SQ_SLOT_ALIGN
            size = 1 << (slots - 1).bit_length()
        else:
            size, wqe_slots = 1 << (sq_depth - 1).bit_length(), SQ_STATIC_WQE_SLOTS
        self.geometry = SqGeometry(device.variable_wqes, size, device.host_msn_table)
        if self.geometry.slots > MAX_SQ_SLOTS:
            most = MAX_SQ_SLOTS // wqe_slots
            raise ValueError(f"sq_depth {sq_depth} needs {self.geometry.slots} send-queue slots: the search table names "
                             f"a WQE's slot in 16 bits, so at most {MAX_SQ_SLOTS} ({most} work requests of "
                             f"{wqe_slots} slots)")
        self.sq_slots, entries = self.geometry.slots, self.geometry.table_entries
        self.msn_entries = entries if device.host_msn_table else 0  # the MSN table's; 0 with the PSN search table
        self.sq = Ring(device.pci, self.sq_slots, SQ_SLOT, extra=entries * self.geometry.table_entry.size)
        self.rq_wqe_size = RQ_WQE_HEADER.size + max_recv_sge * SGE.size
        self.rq = Ring(device.pci, 1 << (max(rq_depth, 1) - 1).bit_length(), self.rq_wqe_size)
        self.send_queue = SendQueueCodec(self.geometry, self.sq.view,
                                         max_unsignaled=max(1, self.sq_slots // wqe_slots // 2))
        self.recv_queue = RecvQueueCodec(self.rq.view, self.rq.depth, self.rq_wqe_size)
        # like perftest, a random initial PSN per QP; from `secrets`, since a program may seed `random`, and the PSN
        # is part of what a forged packet must guess
        self.send_queue.psn = secrets.randbits(24)
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
        self._doorbell_due = False

    @classmethod
    async def create(cls, device: Device, poller: Poller, send_cq: CompletionQueue, recv_cq: CompletionQueue, *,
                     sq_depth: int, rq_depth: int, max_send_sge: int, max_recv_sge: int,
                     max_inline_data: int = 0) -> QueuePair:
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
                sq_size=self.geometry.size, rq_size=self.rq.depth, sq_fwo_sq_sge=self.max_send_sge,
                rq_fwo_rq_sge=self.max_recv_sge, scq_cid=self.send_cq.id, rcq_cid=self.recv_cq.id,
                sq_pbl=self.sq.base, rq_pbl=self.rq.base, irrq_addr=irrq.bus_addr, orrq_addr=orrq.bus_addr)
        except BaseException:
            self._free_memory()
            raise
        self.qpn = reply.xid  # no checkpoint from the reply to here: a cancelled create still registers the QP
        self.device.route_events("qp_error", self.qpn, self._on_error)
        self.device.attach(self)
        self.send_cq.qps[self.handle] = self
        self.recv_cq.qps[self.handle] = self

    def _on_error(self, event: DeviceEvent) -> None:
        """QP error notification: completions already written are delivered first (a failed one's status is the
        root cause the flushed ones name; the notification's reason is the root only when no CQE said more)."""
        self.errors.append(event)
        self.state = QPState.ERR
        self.send_cq.poll()
        self.recv_cq.poll()
        if self.error is None:
            reasons = ", ".join(f"{name}={QP_ERROR_REASON_NAMES[name].get(value, value)}"
                                for name, value in event.detail.items() if name in QP_ERROR_REASON_NAMES and value)
            self.error = FabricError(f"QP {self.qpn:#x} moved to ERR by the firmware ({reasons or 'no reason given'})")
        self._flush()

    def _enter_error(self) -> None:
        self.state = QPState.ERR
        self.send_cq.poll()
        self.recv_cq.poll()
        self._flush()

    def _failed(self, error: CompletionError) -> None:
        """A work request failed with a real (non-flush) status: the QP is in ERR, everything after it flushes."""
        if self.error is None:
            self.error = error
        self.state = QPState.ERR
        self._flush()

    def _flush(self) -> None:
        self._fail_outstanding(None)

    def _flushed(self, verb: str) -> CompletionError:
        if verb == "recv":
            return CompletionError(verb, self.qpn, RECV_FLUSHED, RECV_STATUS_NAMES[RECV_FLUSHED], self.error)
        return CompletionError(verb, self.qpn, SEND_FLUSHED, SEND_STATUS_NAMES[SEND_FLUSHED], self.error)

    def _fail_outstanding(self, error: BaseException | None) -> None:
        """Complete every outstanding work request with `error` (None: the verbs FLUSHED status)."""
        for completion in self.send_queue.drain():
            self.send_cq.outstanding -= 1
            completion.finish(error or self._flushed(completion.verb))
        for completion in self.recv_queue.drain():
            self.recv_cq.outstanding -= 1
            completion.finish(error or self._flushed("recv"))
        self._wake_posters()

    def device_lost(self, error: DeviceLostError) -> None:
        self.state = QPState.ERR  # the post paths' slow branch raises the loss
        self._fail_outstanding(error)

    async def release(self) -> None:
        await self.destroy()

    def forget(self) -> None:
        if not self.closed:
            self.closed, self.state = True, QPState.RESET
            self._fail_outstanding(ClosedError(f"QP {self.qpn:#x} was closed with its NIC"))
            self._free_memory()

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

    def _wake_posters(self) -> None:
        if self._space_waiters:  # an event per wake-up only when someone waits: this runs once per CQE
            self._space.set()
            self._space = anyio.Event()

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
            self._enter_error()
        elif state == QPState.RESET:
            self._reset()

    def _reset(self) -> None:
        """RESET empties both queues (the NIC starts them over at index 0, as ibv_modify_qp to RESET does):
        outstanding work is flushed and the rings, indices and PSN start afresh, so the QP can connect again."""
        self.send_cq.poll()
        self.recv_cq.poll()
        self._fail_outstanding(None)
        self.send_queue.reset(secrets.randbits(24))
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


    # -- data verbs ------------------------------------------------------------------------------------------------
    def batch(self) -> _Batch:
        """`with qp.batch():` posts several work requests and rings the SQ doorbell once, when the block ends (the
        outermost, if nested). Only the posts of the task in the block wait for its end: another task's post to the
        QP rings at once (and announces everything posted before it), so no task waits on a doorbell held by a block
        it cannot see. (A task started inside the block inherits it.)"""
        return _Batch(self)

    async def post_write(self, local: Local, remote: RemoteRegion | MemoryRegion, size: int | None = None, *,
                         local_offset: int = 0, remote_offset: int = 0, signaled: bool = True,
                         inline: bool = False) -> Completion:
        """Post an RDMA WRITE of `size` bytes from `local` (a region, a raw SGE, or a list of SGEs: `mr.sge()`) to
        `remote`; returns once posted (waits for SQ space). `inline` copies the bytes into the WQE (at most
        `max_inline_data`): the buffer is free again as soon as this returns."""
        if not inline:
            completion = self._post_one("write", WRITE, local, remote, size, local_offset, remote_offset, 0, signaled)
            if completion is not None:
                return completion
        return await self._post("write", WRITE, local, remote, size, local_offset, remote_offset, 0, signaled, inline)

    async def post_write_with_imm(self, local: Local, remote: RemoteRegion | MemoryRegion, imm: int,
                                  size: int | None = None, *, local_offset: int = 0, remote_offset: int = 0,
                                  signaled: bool = True, inline: bool = False) -> Completion:
        """RDMA WRITE with immediate: the data lands at `remote`, `imm` completes a receive at the peer."""
        check_range("imm", imm, 0, 0xFFFFFFFF)
        return await self._post("write_with_imm", WRITE_IMM, local, remote, size, local_offset, remote_offset, imm,
                                signaled, inline)

    async def post_read(self, local: Local, remote: RemoteRegion | MemoryRegion, size: int | None = None, *,
                        local_offset: int = 0, remote_offset: int = 0, signaled: bool = True) -> Completion:
        """Post an RDMA READ of `size` bytes from `remote` into `local`."""
        completion = self._post_one("read", READ, local, remote, size, local_offset, remote_offset, 0, signaled)
        if completion is not None:
            return completion
        return await self._post("read", READ, local, remote, size, local_offset, remote_offset, 0, signaled, False)

    async def post_fetch_add(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion, add: int, *,
                             local_offset: int = 0, remote_offset: int = 0, signaled: bool = True) -> Completion:
        """Post an atomic FETCH_AND_ADD: `add` (unsigned 64-bit; the sum wraps at 2^64) is added to the 8 bytes at
        `remote`, and their value before the add lands in the 8 bytes of `local` (a region at `local_offset`, or a
        raw 8-byte SGE), in host byte order. The remote address must be 8-byte aligned: as on hardware, that is the
        responder's to check, and a misaligned one fails the completion with REMOTE_INVALID_REQUEST_ERR. The remote
        region and the peer's QP need Access.REMOTE_ATOMIC (else REMOTE_ACCESS_ERR). Like a READ, it holds one of
        the `max_rd_atomic` outstanding read/atomic slots until answered."""
        check_range("add", add, 0, ATOMIC_MAX)
        return await self._post_atomic("fetch_add", FETCH_ADD, local, remote, local_offset, remote_offset, signaled,
                                       add, 0)

    async def post_compare_swap(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion,
                                compare: int, swap: int, *, local_offset: int = 0, remote_offset: int = 0,
                                signaled: bool = True) -> Completion:
        """Post an atomic COMPARE_AND_SWAP: the 8 bytes at `remote` become `swap` if they equal `compare`; their value
        before lands in `local` either way (it equals `compare` when the swap happened). As post_fetch_add
        otherwise."""
        check_range("compare", compare, 0, ATOMIC_MAX)
        check_range("swap", swap, 0, ATOMIC_MAX)
        return await self._post_atomic("compare_swap", COMPARE_SWAP, local, remote, local_offset, remote_offset,
                                       signaled, swap, compare)

    async def post_send(self, local: Local, size: int | None = None, *, local_offset: int = 0, imm: int | None = None,
                        signaled: bool = True, inline: bool = False) -> Completion:
        """Post a SEND (with immediate if `imm` is given) into the peer's next posted receive."""
        if imm is not None:
            check_range("imm", imm, 0, 0xFFFFFFFF)
        kind = SEND if imm is None else SEND_IMM
        return await self._post("send", kind, local, None, size, local_offset, 0, imm or 0, signaled, inline)

    async def post_recv(self, local: Local, size: int | None = None, *, local_offset: int = 0) -> Completion:
        """Post a receive buffer (a region, a raw SGE, or a list of up to `max_recv_sge` SGEs); its completion carries
        `byte_len` and `imm`."""
        size, sges = self._sges(local, local_offset, size, self.max_recv_sge)
        rq = self.recv_queue
        while self.state not in RECV_STATES or not rq.room():
            if self.state not in RECV_STATES:
                return self._refused("recv", "receives need INIT, RTR or RTS")
            await self._wait_for_space("recv")
        completion = Completion("recv")
        rq.post(sges, completion)
        self.recv_cq.outstanding += 1
        index, epoch = rq.doorbell()
        self.device.doorbells.write64_doorbell(self.device.db_offset, doorbell.encode(
            self.qpn, bnxt.DBC_DBC_TYPE_RQ, index, epoch))
        if self._poller.sleeping:
            self._poller.work_posted(self.recv_cq)
        return completion

    async def post_many(self, verb: str, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion | None,
                        size: int, offsets: Sequence[int], *, remote_offsets: Sequence[int] | None = None,
                        imm: int | None = None, signal: Iterable[int] = ()) -> list[Completion]:
        """Post len(`offsets`) work requests of one kind at once (perftest's post list, ibverbs' chained WRs): the
        i-th moves `size` bytes at `local_offset` `offsets[i]` to (write, write_with_imm) or from (read)
        `remote` at `remote_offsets[i]` (default: `offsets`), or sends them (send, with `imm` if given). They are
        packed into the SQ in one pass and announced by one doorbell.

        Returns completions in posting order: one for each index in `signal`, then one for the last work request,
        which completes when all of them have (`completions[-1]`; a failure anywhere in the batch fails it). Waits
        for room for the whole batch; one larger than half the send queue is refused (the other half may hold
        unsignaled work requests that no completion retires yet)."""
        wqe_type = VERBS.get(verb)
        if wqe_type is None:
            raise ValueError(f"post_many: verb must be one of {sorted(VERBS)}, not {verb!r}")
        offsets = _integers("offsets", offsets)
        count = len(offsets)
        if remote_offsets is None:
            remote_offsets = offsets
        else:
            remote_offsets = _integers("remote_offsets", remote_offsets)
            if len(remote_offsets) != count:
                raise ValueError(f"post_many: {len(remote_offsets)} remote offsets for {count} work requests")
        if imm is not None:
            check_range("imm", imm, 0, 0xFFFFFFFF)
            wqe_type = {WRITE: WRITE_IMM, WRITE_IMM: WRITE_IMM, SEND: SEND_IMM}.get(wqe_type, -1)
            if wqe_type < 0:
                raise ValueError("post_many: imm goes with write_with_imm or send")
        elif wqe_type == WRITE_IMM:
            raise ValueError("post_many: write_with_imm needs imm=")
        if not count:
            return []
        check_range("size", size, 0, 1 << 31)
        if not isinstance(local, (MemoryRegion, LocalBuffer)):
            raise TypeError(f"post_many: local must be a MemoryRegion or a LocalBuffer, not {type(local).__name__}")
        if isinstance(local, MemoryRegion):
            local._check_open()
        lo, hi = span(offsets)
        if lo < 0 or hi + size > local.length:
            raise ValueError(f"post_many: {size} bytes at local offsets {lo}..{hi} exceed the {local.length}-byte "
                             f"{'memory region' if isinstance(local, MemoryRegion) else 'buffer'}")
        check_range("local address", local.addr + hi, 0, ADDRESS_MAX - size + 1)  # keys: checked where made
        address, rkey = 0, 0
        if wqe_type in (SEND, SEND_IMM):
            if remote is not None:
                raise ValueError("post_many: a send has no remote region")
        elif remote is None:
            raise ValueError(f"post_many: {verb} needs a remote region")
        else:
            lo, hi = span(remote_offsets)
            if lo < 0:
                raise ValueError(f"post_many: remote offset {lo} is negative")
            _remote(remote, hi, size)  # its length and the 64-bit address
            address, rkey = remote.addr, remote.rkey
        marks = sorted(set(_integers("signal", signal)))
        if marks and not 0 <= marks[0] <= marks[-1] < count:
            raise ValueError(f"post_many: signal indexes must be in [0, {count}), not {marks}")
        sq = self.send_queue
        taken = sq.taken(sq.wqe_slots(1 if size else 0)) * count
        if not sq.fits(taken, count):
            raise ValueError(f"post_many: {count} work requests do not fit QP {self.qpn:#x}'s send queue (a batch "
                             f"takes at most half its {sq.slots} slots and {sq.max_wqes} work requests)")
        while self.state is not RTS or not sq.room(taken, count):
            if self.state is not RTS:  # in ERR: as many flushed completions as it would have given
                return [self._refused(verb, "connect() it first")] * (len(marks) + (count - 1 not in marks))
            await self._wait_for_space(verb)
        tokens = {i: Completion(verb) for i in marks}
        if count - 1 not in tokens:
            tokens[count - 1] = Completion(verb)
        sq.post_run(wqe_type, local.addr, local.lkey, address, rkey, size, offsets, remote_offsets, imm or 0, tokens)
        self._posted(len(tokens))
        return list(tokens.values())  # in index order: the marks, then the last if it is not one

    async def write(self, local, remote, size=None, **kw) -> Completion:
        return await (await self.post_write(local, remote, size, **kw))

    async def write_with_imm(self, local, remote, imm, size=None, **kw) -> Completion:
        return await (await self.post_write_with_imm(local, remote, imm, size, **kw))

    async def read(self, local, remote, size=None, **kw) -> Completion:
        return await (await self.post_read(local, remote, size, **kw))

    async def send(self, local, size=None, **kw) -> Completion:
        return await (await self.post_send(local, size, **kw))

    async def recv(self, local, size=None, **kw) -> Completion:
        return await (await self.post_recv(local, size, **kw))

    async def fetch_add(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion, add: int, *,
                        local_offset: int = 0, remote_offset: int = 0) -> int:
        """post_fetch_add, awaited: the remote value before the add."""
        await (await self.post_fetch_add(local, remote, add, local_offset=local_offset, remote_offset=remote_offset))
        return self._fetched(local, local_offset)

    async def compare_swap(self, local: MemoryRegion | LocalBuffer, remote: RemoteRegion | MemoryRegion, compare: int,
                           swap: int, *, local_offset: int = 0, remote_offset: int = 0) -> int:
        """post_compare_swap, awaited: the remote value before (`compare` if it was swapped)."""
        await (await self.post_compare_swap(local, remote, compare, swap, local_offset=local_offset,
                                            remote_offset=remote_offset))
        return self._fetched(local, local_offset)

    def _post_one(self, verb: str, wqe_type: int, local: Any, remote: Any, size: int | None, local_offset: int,
                  remote_offset: int, imm: int, signaled: bool) -> Completion | None:
        """The per-operation hot path: one SGE from a live MemoryRegion, a QP in RTS with room. None when anything
        is otherwise: `_post` then checks and explains it."""
        if type(local) is not MemoryRegion or local.closed or self.state is not RTS:
            return None
        if type(local_offset) is not int or type(remote_offset) is not int:  # a float or a bool: refused by _post
            return None
        if size is None:
            size = local.length - local_offset
        elif type(size) is not int:
            return None
        if not 0 < size <= local.length - local_offset or local_offset < 0:
            return None
        kind = type(remote)
        if kind is MemoryRegion:
            if remote.closed:
                return None
        elif kind is not RemoteRegion:
            return None
        length = remote.length
        if length is not None and not 0 <= remote_offset <= length - size:
            return None
        completion = Completion(verb)
        if not self.send_queue.post_one(wqe_type, local.addr + local_offset, local.lkey, size,
                                        remote.addr + remote_offset, remote.rkey, imm, signaled, completion):
            return None
        self._posted(1)
        return completion

    async def _post(self, verb: str, wqe_type: int, local: Local, remote: RemoteRegion | MemoryRegion | None,
                    size: int | None, local_offset: int, remote_offset: int, imm: int, signaled: bool,
                    inline: bool, swap: int = 0, compare: int = 0) -> Completion:
        """Any send-queue work request, checked: its SGEs (or inline bytes), its remote range, room in the ring
        (an atomic's operands: `swap`, `compare`)."""
        size, sges = self._sges(local, local_offset, size, self.max_send_sge)
        if inline:
            if not isinstance(local, MemoryRegion):
                raise ValueError(f"{verb} inline: the data must come from a MemoryRegion (the CPU copies it)")
            if size > self.max_inline_data:
                raise ValueError(f"{verb} inline: {size} bytes exceed QP {self.qpn:#x}'s max_inline_data "
                                 f"({self.max_inline_data}; create_qp(max_inline_data=) sets it)")
        address, rkey = (0, 0) if remote is None else _remote(remote, remote_offset, size)
        sq = self.send_queue
        taken = sq.taken(sq.wqe_slots(len(sges), size if inline else 0))
        while self.state is not RTS or not sq.room(taken):
            if self.state is not RTS:
                return self._refused(verb, "connect() it first")
            await self._wait_for_space(verb)
        completion = Completion(verb)
        data = None  # read after the wait: the WQE carries the buffer's bytes as they are when it is posted
        if inline and isinstance(local, MemoryRegion):
            data = bytes(local.view[local_offset:local_offset + size])
        sq.post(wqe_type, sges, size, address, rkey, imm, signaled, completion, data, swap, compare)
        self._posted(1)
        return completion

    async def _post_atomic(self, verb: str, wqe_type: int, local: MemoryRegion | LocalBuffer,
                           remote: RemoteRegion | MemoryRegion, local_offset: int, remote_offset: int, signaled: bool,
                           swap: int, compare: int) -> Completion:
        """An atomic on the ATOMIC_SIZE bytes at `remote`: one local SGE of exactly that size takes the original
        value. The remote address's alignment is left to the responder, as hardware leaves it."""
        if not isinstance(local, (MemoryRegion, LocalBuffer)):
            raise TypeError(f"{verb}: local must be a MemoryRegion or a LocalBuffer (mr.sge()), not "
                            f"{type(local).__name__}")
        size = ATOMIC_SIZE if isinstance(local, MemoryRegion) else local.length - local_offset
        if size != ATOMIC_SIZE:
            raise ValueError(f"{verb}: the local buffer takes the {ATOMIC_SIZE}-byte original value, not {size} bytes")
        return await self._post(verb, wqe_type, local, remote, ATOMIC_SIZE, local_offset, remote_offset, 0, signaled,
                                False, swap, compare)

    def _fetched(self, local: MemoryRegion | LocalBuffer, offset: int) -> int:
        """The original value an atomic wrote at `offset` of `local`, in host byte order (little-endian here)."""
        if isinstance(local, LocalBuffer):  # a raw SGE: read through the region its lkey names (lkey == rkey)
            region = MemoryRegion.registered_here(self.device.gid, local.lkey)
            if region is None:
                raise ClosedError(f"lkey {local.lkey:#x}: no memory region of this NIC holds the result any more")
            local, offset = region, local.addr + offset - region.addr
        return int.from_bytes(local.view[offset:offset + ATOMIC_SIZE], "little")

    def _sges(self, local: Local, offset: int, size: int | None, limit: int) -> tuple[int, list[Sge]]:
        """(message size, its SGEs) of a region (`size` bytes at `offset`), a raw SGE, or a list of them."""
        if not isinstance(local, (MemoryRegion, LocalBuffer)):
            if offset or not 1 <= len(local) <= limit:
                raise ValueError(f"QP {self.qpn:#x} takes 1 to {limit} SGEs per work request (create_qp's "
                                 f"max_send_sge/max_recv_sge), not {len(local)}" if not offset else
                                 "local_offset goes with one region; an SGE list names its own addresses")
            sges = []
            for element in local:
                if not isinstance(element, LocalBuffer):
                    raise TypeError("an SGE list holds LocalBuffers (MemoryRegion.sge()), not "
                                    f"{type(element).__name__}")
                if element.length:
                    sges.append((element.addr, element.lkey, element.length))
            total = sum(sge[2] for sge in sges)
            if size is not None and size != total:
                raise ValueError(f"size {size} is not the {total} bytes the SGE list holds")
            return total, sges
        size, one = _local(local, offset, size)
        return size, [] if one is None else [one]

    def _posted(self, tokens: int) -> None:
        """After WQEs are in the ring: count their completions, ring the doorbell (or leave it to the batch), wake
        a sleeping poller."""
        self.send_cq.outstanding += tokens
        if self in _batching.get():
            self._doorbell_due = True
        else:
            self._ring_sq()
        if self._poller.sleeping:
            self._poller.work_posted(self.send_cq)

    def _ring_sq(self) -> None:
        self._doorbell_due = False
        index, epoch = self.send_queue.doorbell()  # names a slot, or a static WQE
        self.device.doorbells.write64_doorbell(self.device.db_offset, doorbell.encode(
            self.qpn, bnxt.DBC_DBC_TYPE_SQ, index, epoch))

    async def _wait_for_space(self, verb: str) -> None:
        if self._doorbell_due:
            self._ring_sq()  # the WQEs we wait on must reach the NIC first
        self._refuse(verb)
        self._space_waiters += 1
        try:
            await self._space.wait()
        finally:
            self._space_waiters -= 1
        self._refuse(verb)

    def _send_completed(self, consumer: int, status: int) -> None:
        """A requester CQE: every WQE before `consumer` (WQE units, mod 2^16) is done; the last one has `status`."""
        done, named = self.send_queue.retire(consumer, status)
        for completion in done:  # Completion.finish() without an error, inlined: this runs once per operation
            if not completion.done:
                completion.done = True
                if completion._waiters is not None:
                    completion.wake()
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

    def _recv_completed(self, wr_id: int, status: int, length: int, imm: int | None) -> None:
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

    async def query(self) -> Any:
        """QUERY_QP: the firmware's view of this QP (creq_query_qp_resp_sb)."""
        self._refuse("query")
        return await self.device.rcfw("query_qp", qp_cid=self.qpn)

    async def destroy(self) -> None:
        """DESTROY_QP, then fail what is still outstanding with ClosedError and free the rings. From the first call
        on, every use of the QP raises ClosedError; its memory is freed only once the firmware let go of it."""
        if self.closed:
            return
        self.closed, state = True, self.state
        self.state = QPState.RESET  # the post paths' slow branch raises ClosedError
        try:
            destroyed = await _unless_lost(self.device.rcfw_release("destroy_qp", qp_cid=self.qpn))
        except BaseException:  # refused, timed out or cancelled: the firmware kept the QP, so do we (a retry works)
            self.closed, self.state = False, state
            raise
        if destroyed:
            self.send_cq.poll()  # completions the NIC wrote before it let go are delivered as they are
            self.recv_cq.poll()
        self.device.route_events("qp_error", self.qpn, None)
        self.device.detach(self)
        self.send_cq.qps.pop(self.handle, None)
        self.recv_cq.qps.pop(self.handle, None)
        self._fail_outstanding(ClosedError(f"QP {self.qpn:#x} was destroyed with this work request outstanding"))
        self._free_memory()

    def _free_memory(self) -> None:
        self.sq.free()
        self.rq.free()
        for buffer in self.read_queues:
            buffer.free()


class MemoryRegion:
    """A registered range of DMA memory: `lkey` for local SGEs, `rkey` for peers, `addr` as the peer's remote VA.
    Made by `NIC.register_mr` (`register`)."""

    release_order = 1  # at the NIC's close: after the QPs that may still be reading or writing it

    def __init__(self, device: Device, buffer: DmaBuffer, access: Access, owns_buffer: bool = False) -> None:
        self.device, self.buffer, self.access, self.owns_buffer = device, buffer, access, owns_buffer
        self.addr, self.length = buffer.bus_addr, buffer.size
        self.table = page_table(device.pci, buffer.bus_addrs, queue=False)
        self.lkey = self.rkey = -1
        self.closed = False

    @classmethod
    async def register(cls, device: Device, buffer: DmaBuffer, access: Access,
                       owns_buffer: bool = False) -> MemoryRegion:
        """REGISTER_MR of `buffer` (freed with the region if `owns_buffer`)."""
        mr = cls(device, buffer, access, owns_buffer)
        await mr._register()
        return mr

    async def _register(self) -> None:
        try:
            reply = await self.device.rcfw(
                "register_mr", flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, access=self.access.for_mr(),
                log2_pg_size_lvl=self.table.level << bnxt.CMDQ_REGISTER_MR_LVL_SFT
                | 12 << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT, log2_pbl_pg_size=12,
                key=0, pbl=self.table.base, va=self.addr, mr_size=self.length)
        except BaseException:
            self.table.free()
            if self.owns_buffer:
                self.buffer.free()
            raise
        self.lkey = self.rkey = reply.xid  # no checkpoint from the reply to here (see QueuePair._create)
        self.device.attach(self)
        _registered[self.device.gid, self.rkey] = self

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"memory region (lkey {self.lkey:#x}) was deregistered")

    @property
    def view(self) -> memoryview:
        """The CPU's view of the region's memory (raises ClosedError once deregistered: it may be reused)."""
        self._check_open()
        return self.buffer.view

    def sge(self, offset: int = 0, length: int | None = None) -> LocalBuffer:
        """`length` bytes at `offset` of the region as one scatter/gather element (for SGE lists)."""
        length, _ = _local(self, offset, length)
        return LocalBuffer(self.addr + offset, self.lkey, length)

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteRegion:
        """How a peer names this region (send it over the out-of-band channel)."""
        self._check_open()
        return RemoteRegion(self.addr + offset, self.rkey, self.length - offset if length is None else length)

    def device_lost(self, error: DeviceLostError) -> None:
        pass  # nothing in flight belongs to an MR

    async def release(self) -> None:
        await self.deregister()

    def forget(self) -> None:
        if not self.closed:
            self.closed = True
            _registered.pop((self.device.gid, self.rkey), None)
            self.table.free()
            if self.owns_buffer:
                self.buffer.free()

    async def deregister(self) -> None:
        """DEREGISTER_MR and free what the registration allocated; every later use raises ClosedError."""
        if self.closed:
            return
        self.closed = True
        try:
            await _unless_lost(self.device.rcfw_release("deregister_mr", lkey=self.lkey))
        except BaseException:  # refused, timed out or cancelled: still registered, so still ours (a retry works)
            self.closed = False
            raise
        self.device.detach(self)
        _registered.pop((self.device.gid, self.rkey), None)
        self.table.free()
        if self.owns_buffer:
            self.buffer.free()

    @staticmethod
    def registered_here(gid: bytes, rkey: int) -> MemoryRegion | None:
        """The MR a peer at `gid` names by `rkey`, if a NIC of this process registered it (two ranks or a loopback
        pair in one process): the memory a remote access to it really touches."""
        return _registered.get((gid, rkey))


Local = Union[MemoryRegion, LocalBuffer, Sequence[LocalBuffer]]  # what a work request's local side may be
_registered: weakref.WeakValueDictionary[tuple[bytes, int], MemoryRegion] = weakref.WeakValueDictionary()


async def _unless_lost(command: Any) -> bool:
    """Run a destroy command; False (not run, or cut short) if the device is gone: then nothing holds the object's
    memory any more, and it is freed all the same."""
    try:
        await command
    except DeviceLostError:
        return False
    return True


def _local(local: MemoryRegion | LocalBuffer, offset: int, size: int | None) -> tuple[int, tuple[int, int, int] | None]:
    """The SGE for `size` bytes at `offset` of `local` (None for a zero-length transfer)."""
    check_range("local_offset", offset, 0, ADDRESS_MAX)
    if size is None:
        size = local.length - offset
    check_range("size", size, 0, KEY_MAX)  # an SGE's length field
    if isinstance(local, MemoryRegion):
        local._check_open()
        if offset < 0 or size < 0 or offset + size > local.length:
            raise ValueError(f"{size} bytes at offset {offset} exceed the {local.length}-byte memory region")
    check_range("local address", local.addr + offset, 0, ADDRESS_MAX - size + 1)
    return size, ((local.addr + offset, local.lkey, size) if size else None)


def _remote(remote: RemoteRegion | MemoryRegion, offset: int, size: int) -> tuple[int, int]:
    check_range("remote_offset", offset, 0, ADDRESS_MAX)
    if isinstance(remote, MemoryRegion):
        remote._check_open()
    if remote.length is not None and (offset < 0 or offset + size > remote.length):
        raise ValueError(f"{size} bytes at remote offset {offset} exceed the {remote.length}-byte remote region")
    check_range("remote address", remote.addr + offset, 0, ADDRESS_MAX - size + 1)
    return remote.addr + offset, remote.rkey


def _integers(name: str, values: Iterable[Any]) -> Sequence[int]:
    """`values` as a sequence of ints (a range as it is): anything else is refused, naming it."""
    if isinstance(values, range):
        return values
    result = []
    for value in values:
        if isinstance(value, bool):
            raise TypeError(f"post_many: {name} must be integers, not booleans")
        try:
            result.append(operator.index(value))
        except TypeError:
            raise TypeError(f"post_many: {name} must be integers, not {type(value).__name__}") from None
    return result


def check_range(name: str, value: int, low: int, high: int) -> None:
    """A ValueError naming `name` unless `value` is an int in [low, high]; a bool is not one (True is no size)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], not {value!r}")
