"""The emulated NIC's RC data path in-process, without any I/O: `Host` is one firmware instance with its own host
memory (a bytearray), objects created through the real RCFW commands, WQEs written into SQ memory the way a driver
writes them (with the search table after the SQ: MSN or PSN entries, as the firmware profile wants) and doorbells
rung; `Wire` carries packets between hosts through the real codec (with seeded loss, duplication and reordering when
a test asks), on a fake clock that jumps to the engines' next deadline; `pair` is two connected hosts and their wire."""
import random
from typing import Any

from aiofabric.autogen import bnxt
from aiofabric.hw import doorbell
from aiofabric.hw.cqe import (CQ_ENTRY, CQE_REQ, CQE_RES_RC, CQE_TYPE_OFFSET, CREQ_ENTRY, CREQ_EVENT_OFFSET, NQ_ENTRY,
                              cqe_type)
from aiofabric.hw.layout import field_type
from aiofabric.hw.ring import position, slot
from aiofabric.hw.verbs import PATH_MTU_CODES, PSN_MASK, MRAccess, QPAccess, QPState, psn_count
from aiofabric.hw.wqe import (ATOMIC_WQE_TYPES, RDMA_WQE_TYPES, RQ_WQE_HEADER, SGE, SQ_ATOMIC_HEADER, SQ_RDMA_HEADER,
                              SQ_SEND_HEADER, SQ_SLOT,
                              SQ_STATIC_WQE_SLOTS, SQ_WQE_HEADER_SLOTS, STATIC_WQE_SGES, SqGeometry, msn_entry,
                              psn_search_values)
from aiofabric.sim import codec
from aiofabric.sim import packets as pk
from aiofabric.sim.cmdq import PendingCommand
from aiofabric.sim.datapath import Datapath
from aiofabric.sim.function import FirmwareConfig
from aiofabric.sim.hwrm import NQ, Firmware
from aiofabric.sim.memory import BUS_BASE, PAGE, BusMemory
from aiofabric.sim.mmio import Doorbells
from aiofabric.sim.objects import NotificationQueue, PageList
from aiofabric.sim.profiles import DEFAULT_PROFILE, PROFILES

SUCCESS = bnxt.CREQ_QP_EVENT_STATUS_SUCCESS
Q = "CMDQ_MODIFY_QP_MODIFY_MASK_"
MASK = {name: getattr(bnxt, Q + name) for name in (
    "STATE", "ACCESS", "PKEY", "DGID", "PATH_MTU", "RQ_PSN", "DEST_QP_ID", "MAX_DEST_RD_ATOMIC", "MIN_RNR_TIMER",
    "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "SQ_PSN", "MAX_RD_ATOMIC")}
READ, WRITE, WRITE_IMM, SEND, SEND_IMM = (bnxt.SQ_BASE_WQE_TYPE_READ_WQE, bnxt.SQ_BASE_WQE_TYPE_WRITE_WQE,
                                          bnxt.SQ_BASE_WQE_TYPE_WRITE_W_IMMEAD, bnxt.SQ_BASE_WQE_TYPE_SEND,
                                          bnxt.SQ_BASE_WQE_TYPE_SEND_W_IMMEAD)
ALL_MR_ACCESS = MRAccess.LOCAL_WRITE | MRAccess.REMOTE_READ | MRAccess.REMOTE_WRITE
ALL_QP_ACCESS = QPAccess.LOCAL_WRITE | QPAccess.REMOTE_WRITE | QPAccess.REMOTE_READ
REQ_OK, FLUSHED = bnxt.CQ_REQ_STATUS_OK, bnxt.CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR
RES_FLUSHED = bnxt.CQ_RES_RC_STATUS_WORK_REQUEST_FLUSHED_ERR


class Host:
    """One emulated NIC driven like a driver would, plus the bookkeeping a test needs to check it."""

    def __init__(self, ip: str, memory: int = 8 << 20, profile: str = DEFAULT_PROFILE, hw_retx: bool = False) -> None:
        self.ip, self.mem = ip, BusMemory(bytearray(memory))
        self.next_page = BUS_BASE
        self.fw = Firmware(self.mem, FirmwareConfig(mac=bytes(6), profile=PROFILES[profile]))
        self.fw.rcfw.initialized, self.fw.rcfw.hw_retx = True, hw_retx  # what INITIALIZE_FW would have granted
        self.fw.pcie.atomic_requests = True  # DEVCTL2 as the driver's AtomicOps walk leaves it on the default path
        self.dp = Datapath(self.fw, ip)
        self.bar2 = Doorbells(self.fw, self.dp)
        self.cookie = 0
        self.creq = self.nq(4096, logical_id=0)  # long enough that tests need not return credits
        self.fw.rcfw.creq = self.creq
        self.cq_nq = self.nq(4096, logical_id=1)
        self.cqs: dict[int, list] = {}  # cq id -> [pages, size, consumed]

    def alloc(self, size: int) -> int:
        start = self.next_page
        self.next_page += -(-max(size, 1) // PAGE) * PAGE
        return start

    def nq(self, length: int, logical_id: int) -> NotificationQueue:
        ring_id = max(self.fw.rings, default=0) + 1
        nq = NotificationQueue(ring_id, NQ, self.mem, PageList([self.alloc(length * NQ_ENTRY.size)], contiguous=True),
                               length, logical_id, interrupts=self.fw.interrupts)
        self.fw.rings[ring_id] = nq
        return nq

    def command(self, name: str, **fields) -> int:
        self.cookie += 1
        request = getattr(bnxt, f"cmdq_{name}")(opcode=getattr(bnxt, f"CMDQ_BASE_OPCODE_{name.upper()}"),
                                                 cookie=self.cookie, **fields)
        answer = self.fw.rcfw.execute(PendingCommand(request.opcode, self.cookie, 0, 0, bytes(request), True))
        reply = getattr(bnxt, f"creq_{name}_resp").from_buffer_copy(answer)
        assert reply.status == SUCCESS, f"{name}: {self.fw.last_error}"
        return reply.xid

    # -- objects -----------------------------------------------------------------------------------------------------
    def create_cq(self, size: int = 1024) -> int:
        pages = self.alloc(size * CQ_ENTRY.size)
        cq = self.command("create_cq", cq_handle=0xC0 + len(self.cqs), cq_size=size, cq_fco_cnq_id=self.cq_nq.ring_id,
                          pg_size_lvl=0, pbl=pages)
        self.bar2.doorbell(self.fw.roce_db_offset, doorbell.arm_enable(cq, 0))  # as Linux's bnxt_qplib_create_cq
        self.cqs[cq] = [pages, size, 0]
        return cq

    def register(self, size: int, access: int = ALL_MR_ACCESS) -> tuple[int, int]:
        """A registered region: (address = its va, key)."""
        address = self.alloc(size)
        key = self.command("register_mr", flags=bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR, key=1, access=access,
                           log2_pg_size_lvl=12 << bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT, log2_pbl_pg_size=12,
                           pbl=address, va=address, mr_size=size)
        return address, key

    def create_qp(self, cq: int, sq_slots: int = 256, rq_size: int = 64, rq_sge: int = 2,
                  variable: bool = True) -> int:
        """An RC QP of `sq_slots` slots: variable WQEs, or static ones (sq_slots / SQ_STATIC_WQE_SLOTS of them, and
        128-byte receive WQEs of STATIC_WQE_SGES SGEs)."""
        rq_sge = rq_sge if variable else STATIC_WQE_SGES
        self.geometry = geometry = SqGeometry(variable, sq_slots if variable else sq_slots // SQ_STATIC_WQE_SLOTS,
                                              self.fw.config.profile.host_msn_table)
        self.sq_slots, self.rq_size, self.rq_sge = sq_slots, rq_size, rq_sge
        self.sq = self.alloc(geometry.table_offset + geometry.table_entries * geometry.table_entry.size)
        self.rq_stride = RQ_WQE_HEADER.size + SGE.size * rq_sge
        self.rq = self.alloc(rq_size * self.rq_stride)
        qpn = self.command("create_qp", type=bnxt.CMDQ_CREATE_QP_TYPE_RC, qp_handle=0xAB00 + sq_slots,
                           qp_flags=bnxt.CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_ENABLED if variable else 0,
                           sq_size=geometry.size, sq_fwo_sq_sge=6, sq_pg_size_sq_lvl=0, sq_pbl=self.sq,
                           rq_size=rq_size, rq_fwo_rq_sge=rq_sge, rq_pg_size_rq_lvl=0, rq_pbl=self.rq, scq_cid=cq,
                           rcq_cid=cq, pd_id=1)
        self.qpn, self.cq = qpn, cq
        self.sq_producer = self.wqe_count = self.rq_producer = 0
        self.starts: list[int] = []  # the ring slot each WQE posted starts at
        self.psn, self.mtu = 0, 256  # the next message's first PSN and the path MTU, from connect() on
        return qpn

    def modify(self, state: QPState, mask: int = 0, **fields) -> None:
        self.command("modify_qp", qp_cid=self.qpn, modify_mask=MASK["STATE"] | mask,
                     network_type_en_sqd_async_notify_new_state=state | bnxt.CMDQ_MODIFY_QP_NETWORK_TYPE_ROCEV2_IPV4,
                     **fields)

    def connect(self, peer: "Host", *, mtu: int = 1024, sq_psn: int = 0x1000, rq_psn: int = 0x2000,
                timeout: int = 10, retry_cnt: int = 7, rnr_retry: int = 7, rts: bool = True) -> None:
        m = MASK
        self.modify(QPState.INIT, m["ACCESS"] | m["PKEY"], access=ALL_QP_ACCESS, pkey=0xFFFF)
        self.mtu = mtu
        gid = bytes(10) + b"\xff\xff" + bytes(map(int, peer.ip.split(".")))
        self.modify(QPState.RTR, m["DGID"] | m["PATH_MTU"] | m["RQ_PSN"] | m["DEST_QP_ID"] | m["MAX_DEST_RD_ATOMIC"]
                    | m["MIN_RNR_TIMER"], dgid=field_type(bnxt.cmdq_modify_qp, "dgid").from_buffer_copy(gid),
                    dest_qp_id=peer.qpn, rq_psn=rq_psn, path_mtu_pingpong_push_enable=PATH_MTU_CODES[mtu],
                    max_dest_rd_atomic=4, min_rnr_timer=1)
        if rts:
            self.rts(sq_psn, timeout, retry_cnt, rnr_retry)

    def rts(self, sq_psn: int = 0x1000, timeout: int = 10, retry_cnt: int = 7, rnr_retry: int = 7) -> None:
        m = MASK
        self.psn = sq_psn
        self.modify(QPState.RTS, m["TIMEOUT"] | m["RETRY_CNT"] | m["RNR_RETRY"] | m["SQ_PSN"] | m["MAX_RD_ATOMIC"],
                    timeout=timeout, retry_cnt=retry_cnt, rnr_retry=rnr_retry, sq_psn=sq_psn, max_rd_atomic=4)

    # -- work requests -----------------------------------------------------------------------------------------------
    def post(self, kind: int, sges: list[tuple[int, int, int]], *, remote: int = 0, rkey: int = 0, imm: int = 0,
             signaled: bool = True, length: int | None = None, ring: bool = True, swap: int = 0,
             compare: int = 0) -> int:
        """Write one WQE (header + SGE slots, each slot wrapping on its own), its search-table entry, and ring the SQ
        doorbell. An atomic's one SGE is where its original value lands (`swap` and `compare` its AtomicETH's)."""
        length = sum(size for _, _, size in sges) if length is None else length
        slots = SQ_WQE_HEADER_SLOTS + len(sges)
        flags = bnxt.SQ_SEND_FLAGS_SIGNAL_COMP if signaled else 0
        if kind in ATOMIC_WQE_TYPES:
            header, length = SQ_ATOMIC_HEADER.pack(kind, flags, slots, rkey, remote, swap, compare), 1
        elif kind in RDMA_WQE_TYPES:
            header = SQ_RDMA_HEADER.pack(kind, flags, slots, imm, length, remote, rkey, 0)
        else:
            header = SQ_SEND_HEADER.pack(kind, flags, slots, imm, length, 0, 0, 0, 0)
        data = header + b"".join(SGE.pack(*sge) for sge in sges)
        for i in range(slots):
            self.mem.write(self.sq + slot(self.sq_producer + i, self.sq_slots) * SQ_SLOT,
                           data[i * SQ_SLOT:(i + 1) * SQ_SLOT])
        geometry, start = self.geometry, slot(self.sq_producer, self.sq_slots)
        next_psn = (self.psn + psn_count(length, self.mtu)) & PSN_MASK
        values = ((msn_entry(self.psn, next_psn, start),) if geometry.host_msn
                  else psn_search_values(kind, self.psn, next_psn, start))
        self.mem.write(self.sq + geometry.table_offset + geometry.table_index(self.wqe_count, start)
                       * geometry.table_entry.size, geometry.table_entry.pack(*values))
        self.psn = next_psn
        self.starts.append(start)
        self.sq_producer += slots if geometry.variable else SQ_STATIC_WQE_SLOTS
        self.wqe_count += 1
        if ring:
            self.ring_sq()
        return self.wqe_count

    def sq_cons_idx(self, number: int, status: int = REQ_OK) -> int:
        """The sq_cons_idx of the CQE completing WQE `number` (from 1) with `status`: the next WQE's index modulo
        sq_size, or (an error with variable WQEs) the slot WQE `number` starts at (Linux bnxt_qplib_cq_process_req)."""
        if status != REQ_OK and self.geometry.variable:
            return self.starts[number - 1]
        return number % self.geometry.size

    def ring_sq(self) -> None:
        unit = self.geometry.slot_unit  # the doorbell names a slot, or a static WQE
        self.doorbell(bnxt.DBC_DBC_TYPE_SQ, *position(self.sq_producer // unit, self.sq_slots // unit))

    def post_recv(self, sges: list[tuple[int, int, int]], tag: int) -> None:
        wqe = RQ_WQE_HEADER.pack(bnxt.RQ_WQE_HDR_WQE_TYPE_RCV, 0, self.rq_stride // SQ_SLOT, tag, 0)
        wqe += b"".join(SGE.pack(*sge) for sge in sges)
        self.mem.write(self.rq + slot(self.rq_producer, self.rq_size) * self.rq_stride,
                       wqe.ljust(self.rq_stride, b"\0"))
        self.rq_producer += 1
        self.doorbell(bnxt.DBC_DBC_TYPE_RQ, *position(self.rq_producer, self.rq_size))

    def doorbell(self, kind: int, index: int, epoch: int) -> None:
        self.bar2.doorbell(self.fw.roce_db_offset, doorbell.encode(self.qpn, kind, index, epoch))

    def poll(self) -> list[tuple]:
        """New CQEs: ("req", status, sq_cons_idx, handle) or ("res", status, length, imm, flags, wr_id)."""
        found = []
        for cq_id, entry in self.cqs.items():
            pages, size, consumed = entry
            while True:
                cqe = self.mem.read(pages + slot(consumed, size) * CQ_ENTRY.size, CQ_ENTRY.size)
                if not CQ_ENTRY.is_new(cqe, 0, consumed, size):
                    break
                consumed += 1
                if cqe_type(cqe[CQE_TYPE_OFFSET]) == bnxt.CQ_BASE_CQE_TYPE_REQ:
                    handle, index, _, status = CQE_REQ.unpack(cqe)
                    found.append(("req", status, index, handle))
                else:
                    length, imm, handle, _, _, status, flags, wr_id = CQE_RES_RC.unpack(cqe)
                    found.append(("res", status, length, imm, flags, wr_id))
            entry[2] = consumed
            self.fw.rcfw.cqs[cq_id].consumed = consumed
        return found

    def creq_events(self) -> list[bytes]:
        entries = [self.mem.read(self.creq.pages.address(slot(i, self.creq.length) * CREQ_ENTRY.size),
                                 CREQ_ENTRY.size) for i in range(self.creq.produced)]
        return [e for e in entries if e[CREQ_EVENT_OFFSET] == bnxt.CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION]


class Wire:
    """Carries packets between hosts through the real codec, with seeded faults; a fake clock drives the engines."""

    def __init__(self, *hosts: Host, loss: float = 0.0, dup: float = 0.0, reorder: float = 0.0, seed: int = 0,
                 black_hole: bool = False) -> None:
        self.hosts = {host.ip: host for host in hosts}
        self.loss, self.dup, self.reorder, self.black_hole = loss, dup, reorder, black_hole
        self.random = random.Random(seed)
        self.now = 0.0
        self.log: list[pk.Packet] = []  # every packet put on the wire

    def engines(self) -> None:
        """Every host's doorbells, timers and send turns at the current time."""
        for host in self.hosts.values():
            host.dp.doorbells(self.now)
            host.dp.advance(self.now)
            host.dp.pump(self.now)

    def copies(self) -> int:
        """How many copies of the next packet arrive (0: lost, 2: duplicated), drawn from the seeded faults."""
        if self.black_hole or self.random.random() < self.loss:
            return 0
        return 2 if self.random.random() < self.dup else 1

    def reordered(self, arriving: list[Any]) -> list[Any]:
        """`arriving`, neighbours swapped with the seeded reorder probability (in place)."""
        if self.reorder:
            for i in range(len(arriving) - 1):
                if self.random.random() < self.reorder:
                    arriving[i], arriving[i + 1] = arriving[i + 1], arriving[i]
        return arriving

    def step(self) -> bool:
        """One round: doorbells, timers, transmission, delivery. False when nothing happened."""
        busy = False
        self.engines()
        for host in self.hosts.values():
            batch = {}
            for packet in pk.expand(host.dp.take_outbox()):
                busy = True
                self.log.append(packet)
                copies = self.copies()
                if not copies:
                    continue
                wire = codec.encode(packet)
                for _ in range(copies):
                    batch.setdefault(packet.dst_ip, []).append(
                        codec.decode(wire, packet.src_ip, packet.dst_ip, packet.src_port))
            for ip, packets in batch.items():
                self.hosts[ip].dp.receive(self.reordered(packets), self.now)
        return busy

    def run(self, until=None, max_time: float = 60.0, max_steps: int = 100_000) -> None:
        """Step until `until()` is true or nothing is left to do; the clock jumps to the next deadline when idle."""
        for _ in range(max_steps):
            if until is not None and until():
                return
            if self.step():
                continue
            deadlines = [d for host in self.hosts.values() if (d := host.dp.next_deadline()) is not None]
            if not deadlines:
                return
            self.now = max(self.now, min(deadlines))
            if self.now > max_time:
                return
        raise AssertionError("the wire did not settle")


def pair(mtu: int = 1024, loss: float = 0.0, dup: float = 0.0, reorder: float = 0.0, seed: int = 0,
         sq_slots: int = 256, sq_psn: int = 0x1000, rq_psn: int = 0x2000, profile: str = DEFAULT_PROFILE,
         hw_retx: bool = False, variable: bool = True, **connect):
    a, b = Host("127.0.0.2", profile=profile, hw_retx=hw_retx), Host("127.0.0.3", profile=profile, hw_retx=hw_retx)
    for host in (a, b):
        host.create_qp(host.create_cq(), sq_slots=sq_slots, variable=variable)
    a.connect(b, mtu=mtu, sq_psn=sq_psn, rq_psn=rq_psn, **connect)
    b.connect(a, mtu=mtu, sq_psn=rq_psn, rq_psn=sq_psn, **connect)
    return a, b, Wire(a, b, loss=loss, dup=dup, reorder=reorder, seed=seed)


def fill(host: Host, address: int, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    host.mem.write(address, data)
    return data
