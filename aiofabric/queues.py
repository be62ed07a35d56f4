"""Verbs objects on a NIC: completion queues, queue pairs, memory regions.

Names follow ibverbs/pyverbs (QP, CQ, MR, lkey, rkey, GID, PSN, MTU). Every object is created and destroyed through
RCFW commands on its `Device`; its host memory (rings, page tables) is freed only after the firmware let go of it.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any

from .autogen import bnxt
from .device import Device, DeviceEvent
from .pci import DmaBuffer
from .rings import Ring, page_table

SQ_SLOT = 16
SQ_SLOT_ALIGN = 256  # Linux sizes variable-WQE send queues in slots aligned to 256 (BNXT_VAR_MAX_SLOT_ALIGN)
WQE_HEADER_SLOTS = 2
CQE_SIZE = 32
PATH_MTUS = {256: bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_256, 512: bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_512,
             1024: bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_1024, 2048: bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_2048,
             4096: bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_4096}
_handles = itertools.count(1)


class Access(enum.IntFlag):
    """Access rights in ibverbs' bit order (IBV_ACCESS_*), converted to each firmware command's own order."""
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8

    def for_mr(self) -> int:  # REGISTER_MR orders them LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC
        return ((self & Access.LOCAL_WRITE and bnxt.CMDQ_REGISTER_MR_ACCESS_LOCAL_WRITE)
                | (self & Access.REMOTE_READ and bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_READ)
                | (self & Access.REMOTE_WRITE and bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_WRITE)
                | (self & Access.REMOTE_ATOMIC and bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_ATOMIC))

    def for_qp(self) -> int:  # MODIFY_QP happens to use ibverbs' order
        return int(self)


ALL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class QPState(enum.IntEnum):
    RESET = bnxt.CMDQ_MODIFY_QP_NEW_STATE_RESET
    INIT = bnxt.CMDQ_MODIFY_QP_NEW_STATE_INIT
    RTR = bnxt.CMDQ_MODIFY_QP_NEW_STATE_RTR
    RTS = bnxt.CMDQ_MODIFY_QP_NEW_STATE_RTS
    SQD = bnxt.CMDQ_MODIFY_QP_NEW_STATE_SQD
    SQE = bnxt.CMDQ_MODIFY_QP_NEW_STATE_SQE
    ERR = bnxt.CMDQ_MODIFY_QP_NEW_STATE_ERR


@dataclasses.dataclass(frozen=True)
class QPInfo:
    """What a peer needs to connect to a QP (what perftest exchanges out of band)."""
    qpn: int
    gid: bytes
    mac: str
    psn: int

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "gid": self.gid.hex(), "mac": self.mac, "psn": self.psn}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QPInfo:
        return cls(int(data["qpn"]), bytes.fromhex(data["gid"]), data["mac"], int(data["psn"]))


class CompletionQueue:
    """A CQ of `depth` 32-byte CQEs (power of two), notified through the device's NQ."""

    def __init__(self, device: Device, depth: int) -> None:
        self.device, self.depth, self.handle = device, depth, next(_handles)
        self.ring = Ring(device.pci, depth, CQE_SIZE)
        self.id = -1
        self.errors: list[DeviceEvent] = []

    async def _create(self) -> None:
        try:
            reply = await self.device.rcfw(
                "create_cq", cq_handle=self.handle, cq_size=self.depth, pbl=self.ring.base, dpi=0,
                pg_size_lvl=self.ring.level << bnxt.CMDQ_CREATE_CQ_LVL_SFT | bnxt.CMDQ_CREATE_CQ_PG_SIZE_PG_4K,
                cq_fco_cnq_id=self.device.nq_id)
        except BaseException:
            self.ring.free()
            raise
        self.id = reply.xid
        self.device.route_events("cq_error", self.id, self.errors.append)
        self.device.objects[id(self)] = self

    async def destroy(self) -> None:
        if self.id < 0:
            return
        await self.device.rcfw("destroy_cq", cq_cid=self.id)
        self.device.route_events("cq_error", self.id, None)
        self.device.objects.pop(id(self), None)
        self.id = -1
        self.ring.free()


class QueuePair:
    """An RC queue pair with a variable-WQE send queue (P7 layout: MSN table right after the ring) and an RQ."""

    def __init__(self, device: Device, send_cq: CompletionQueue, recv_cq: CompletionQueue, *, sq_depth: int,
                 rq_depth: int, max_send_sge: int, max_recv_sge: int) -> None:
        self.device, self.send_cq, self.recv_cq = device, send_cq, recv_cq
        self.handle = next(_handles)
        self.max_send_sge, self.max_recv_sge = max_send_sge, max_recv_sge
        wqe_slots = WQE_HEADER_SLOTS + max_send_sge
        slots = -(-sq_depth * wqe_slots // SQ_SLOT_ALIGN) * SQ_SLOT_ALIGN
        self.sq_slots = 1 << (slots - 1).bit_length()
        self.msn_entries = self.sq_slots // 2  # roundup_pow2(slots) / 2 in variable-WQE mode
        self.sq = Ring(device.pci, self.sq_slots, SQ_SLOT, extra=self.msn_entries * 8)
        self.rq_wqe_size = (WQE_HEADER_SLOTS + max_recv_sge) * SQ_SLOT
        self.rq = Ring(device.pci, 1 << (max(rq_depth, 1) - 1).bit_length(), self.rq_wqe_size)
        self.read_queues: list[DmaBuffer] = [device.pci.alloc_dma(0x1000), device.pci.alloc_dma(0x1000)]
        self.qpn = -1
        self.state = QPState.RESET
        self.psn = 0
        self.errors: list[DeviceEvent] = []

    async def _create(self) -> None:
        irrq, orrq = self.read_queues
        try:
            reply = await self.device.rcfw(
                "create_qp", qp_handle=self.handle, type=bnxt.CMDQ_CREATE_QP_TYPE_RC,
                qp_flags=bnxt.CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_ENABLED,
                sq_pg_size_sq_lvl=self.sq.level | bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_PG_4K,
                rq_pg_size_rq_lvl=self.rq.level | bnxt.CMDQ_CREATE_QP_RQ_PG_SIZE_PG_4K,
                sq_size=self.sq_slots, rq_size=self.rq.depth, sq_fwo_sq_sge=self.max_send_sge,
                rq_fwo_rq_sge=self.max_recv_sge, scq_cid=self.send_cq.id, rcq_cid=self.recv_cq.id,
                sq_pbl=self.sq.base, rq_pbl=self.rq.base, irrq_addr=irrq.bus_addr, orrq_addr=orrq.bus_addr)
        except BaseException:
            self._free_memory()
            raise
        self.qpn = reply.xid
        self.device.route_events("qp_error", self.qpn, self._on_error)
        self.device.objects[id(self)] = self

    def _on_error(self, event: DeviceEvent) -> None:
        self.errors.append(event)
        self.state = QPState.ERR

    def info(self) -> QPInfo:
        return QPInfo(self.qpn, self.device.gid, self.device.mac, self.psn)

    async def modify(self, state: QPState, mask: int = 0, **fields: Any) -> None:
        """MODIFY_QP to `state`; `mask` selects which of `fields` the firmware applies (CMDQ_MODIFY_QP_MODIFY_MASK_*)."""
        await self.device.rcfw(
            "modify_qp", qp_cid=self.qpn, qp_type=bnxt.CMDQ_MODIFY_QP_QP_TYPE_RC,
            modify_mask=mask | bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_STATE,
            network_type_en_sqd_async_notify_new_state=int(state) | bnxt.CMDQ_MODIFY_QP_NETWORK_TYPE_ROCEV2_IPV4,
            **fields)
        self.state = state

    async def to_init(self, access: Access = ALL_ACCESS) -> None:
        await self.modify(QPState.INIT, bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_ACCESS | bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_PKEY,
                          access=access.for_qp(), pkey=0xFFFF)

    async def connect(self, peer: QPInfo, *, mtu: int = 1024, timeout: int = 14, retry_cnt: int = 7,
                      rnr_retry: int = 7, min_rnr_timer: int = 12, max_rd_atomic: int = 16) -> None:
        """INIT (if needed) → RTR → RTS towards `peer`. Defaults follow perftest (timeout 14 ≈ 67 ms, retries 7)."""
        if mtu not in PATH_MTUS:
            raise ValueError(f"path MTU must be one of {sorted(PATH_MTUS)}, not {mtu}")
        if self.state == QPState.RESET:
            await self.to_init()
        m = bnxt
        await self.modify(
            QPState.RTR, m.CMDQ_MODIFY_QP_MODIFY_MASK_DGID | m.CMDQ_MODIFY_QP_MODIFY_MASK_SGID_INDEX
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_HOP_LIMIT | m.CMDQ_MODIFY_QP_MODIFY_MASK_DEST_MAC
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_PATH_MTU | m.CMDQ_MODIFY_QP_MODIFY_MASK_RQ_PSN
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_MIN_RNR_TIMER | m.CMDQ_MODIFY_QP_MODIFY_MASK_MAX_DEST_RD_ATOMIC
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_DEST_QP_ID,
            dgid=tuple(int.from_bytes(peer.gid[i:i + 4], "little") for i in range(0, 16, 4)),
            sgid_index=self.device.gid_index, hop_limit=64, path_mtu_pingpong_push_enable=PATH_MTUS[mtu],
            dest_mac=tuple(int.from_bytes(bytes.fromhex(peer.mac.replace(":", ""))[i:i + 2], "little")
                           for i in range(0, 6, 2)),
            rq_psn=peer.psn, min_rnr_timer=min_rnr_timer, max_dest_rd_atomic=max(max_rd_atomic, 1),
            dest_qp_id=peer.qpn)
        await self.modify(
            QPState.RTS, m.CMDQ_MODIFY_QP_MODIFY_MASK_TIMEOUT | m.CMDQ_MODIFY_QP_MODIFY_MASK_RETRY_CNT
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_RNR_RETRY | m.CMDQ_MODIFY_QP_MODIFY_MASK_SQ_PSN
            | m.CMDQ_MODIFY_QP_MODIFY_MASK_MAX_RD_ATOMIC,
            timeout=timeout, retry_cnt=retry_cnt, rnr_retry=rnr_retry, sq_psn=self.psn, max_rd_atomic=max_rd_atomic)
        self.mtu, self.peer = mtu, peer

    async def query(self) -> Any:
        """QUERY_QP: the firmware's view of this QP (creq_query_qp_resp_sb)."""
        return await self.device.rcfw("query_qp", qp_cid=self.qpn)

    async def destroy(self) -> None:
        if self.qpn < 0:
            return
        await self.device.rcfw("destroy_qp", qp_cid=self.qpn)
        self.device.route_events("qp_error", self.qpn, None)
        self.device.objects.pop(id(self), None)
        self.qpn = -1
        self._free_memory()

    def _free_memory(self) -> None:
        self.sq.free()
        self.rq.free()
        for buffer in self.read_queues:
            buffer.free()


class MemoryRegion:
    """A registered range of DMA memory: `lkey` for local SGEs, `rkey` for peers, `addr` as the peer's remote VA."""

    def __init__(self, device: Device, buffer: DmaBuffer, access: Access) -> None:
        self.device, self.buffer, self.access = device, buffer, access
        self.addr, self.length = buffer.bus_addr, buffer.size
        self.table = page_table(device.pci, buffer.bus_addrs, queue=False)
        self.lkey = self.rkey = -1

    async def _register(self) -> None:
        try:
            reply = await self.device.rcfw(
                "register_mr", flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, access=self.access.for_mr(),
                log2_pg_size_lvl=self.table.level << bnxt.CMDQ_REGISTER_MR_LVL_SFT
                | 12 << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT, log2_pbl_pg_size=12,
                key=0, pbl=self.table.base, va=self.addr, mr_size=self.length)
        except BaseException:
            self.table.free()
            raise
        self.lkey = self.rkey = reply.xid
        self.device.objects[id(self)] = self

    @property
    def view(self) -> memoryview:
        return self.buffer.view

    async def deregister(self) -> None:
        if self.lkey < 0:
            return
        await self.device.rcfw("deregister_mr", lkey=self.lkey)
        self.device.objects.pop(id(self), None)
        self.lkey = self.rkey = -1
        self.table.free()
