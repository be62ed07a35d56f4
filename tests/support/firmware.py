"""Just enough of a driver to drive the emulated firmware in-process, without any I/O (`Driver`): host memory and
page tables in a bytearray, the HWRM window, a CMDQ and a CREQ, requests built with the bindings."""
import ctypes

from aiofabric.autogen import bnxt
from aiofabric.hw import doorbell
from aiofabric.hw.cqe import CQ_ENTRY, CREQ_COMMAND_EVENT, CREQ_ENTRY
from aiofabric.hw.firmware import (CMDQ_FIRST_PRODUCER, CMDQ_INIT, CMDQ_SLOT, CONFIGURED_CONTEXT_TYPES,
                                   HWRM_RESPONSE_HEADER, HWRM_SHORT_REQUEST, RING_ENTRY_SIZES, SHORT_REQUEST_SIGNATURE,
                                   TRACE_CONTEXT_TYPES, BackingStoreType, pack_ptes, ring_stats_size,
                                   short_commands_required)
from aiofabric.hw.layout import field_type
from aiofabric.hw.ring import position, slot
from aiofabric.hw.verbs import QPAccess, QPState
from aiofabric.hw.wqe import RQ_WQE_HEADER, SGE, SQ_SLOT
from aiofabric.sim.datapath import Datapath
from aiofabric.sim.function import FirmwareConfig
from aiofabric.sim.hwrm import Firmware
from aiofabric.sim.memory import BUS_BASE, PAGE, BusMemory
from aiofabric.sim.mmio import Doorbells
from aiofabric.sim.objects import PageList
from aiofabric.sim.resources import RESOURCES

MAC = bytes.fromhex("020af0123456")
GID = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 7])
NQ, L2_CMPL, RX = (getattr(bnxt, f"RING_ALLOC_REQ_RING_TYPE_{kind}") for kind in ("NQ", "L2_CMPL", "RX"))
Q = "CMDQ_MODIFY_QP_MODIFY_MASK_"
INIT_MASK = sum(getattr(bnxt, Q + f) for f in ("STATE", "ACCESS", "PKEY"))
RTR_MASK = sum(getattr(bnxt, Q + f) for f in ("STATE", "DGID", "SGID_INDEX", "DEST_MAC", "PATH_MTU", "RQ_PSN",
                                              "DEST_QP_ID", "MAX_DEST_RD_ATOMIC", "MIN_RNR_TIMER"))
RTS_MASK = sum(getattr(bnxt, Q + f) for f in ("STATE", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "SQ_PSN", "MAX_RD_ATOMIC"))
SUCCESS, FAIL = bnxt.CREQ_QP_EVENT_STATUS_SUCCESS, bnxt.CREQ_QP_EVENT_STATUS_FAIL
INVALID_PARAMETER = bnxt.CREQ_QP_EVENT_STATUS_INVALID_PARAMETER
VALID, LAST, NEXT_TO_LAST = bnxt.PTU_PTE_VALID, bnxt.PTU_PTE_LAST, bnxt.PTU_PTE_NEXT_TO_LAST
ALL_QP_ACCESS = QPAccess.LOCAL_WRITE | QPAccess.REMOTE_WRITE | QPAccess.REMOTE_READ
RQ_WQE_SIZE = RQ_WQE_HEADER.size + 2 * SGE.size  # the QPs here take two receive SGEs
ALLOCATIONS = {"ring_alloc", "stat_ctx_alloc", "vnic_alloc"}  # what counts against FUNC_CFG's reservation


def dbc(xid: int, kind: int, index: int, epoch: int = 0, path: int = bnxt.DBC_DBC_PATH_ROCE, valid: bool = True,
        toggle: int = 0) -> int:
    """A doorbell as the driver writes it, or with the path or valid bit spoilt."""
    value = doorbell.encode(xid, kind, index, epoch, toggle) | path << doorbell.HIGH_SHIFT
    return value if valid else value & ~(doorbell.VALID << doorbell.HIGH_SHIFT)


def cookie_of(entry: bytes) -> int:
    return CREQ_COMMAND_EVENT.unpack(entry)[2]


class Driver:
    """Just enough of a driver: host memory, page tables, the HWRM window, a CMDQ and a CREQ. Like Linux's bnxt_en it
    reserves (FUNC_CFG, `reserve`) before its first allocation, here every resource at its maximum, unless `reserve`
    is False; a FUNC_RESET forgets the reservation."""

    def __init__(self, memory: int = 16 << 20, reserve: bool = True, **config) -> None:
        self.mem = BusMemory(bytearray(memory))
        self.next_page = BUS_BASE
        self.fw = Firmware(self.mem, FirmwareConfig(mac=MAC, **config))
        self.bar2 = Doorbells(self.fw, Datapath(self.fw))
        self.seq = self.cookie = 0
        self.response, self.requests = self.alloc(), self.alloc()
        self.short_commands = False  # what VER_GET asks for
        self.auto_reserve, self.reserved = reserve, False
        self.side_buffers: dict[int, int] = {}  # cookie -> where a query's result lands

    def alloc(self, pages: int = 1) -> int:
        start, self.next_page = self.next_page, self.next_page + pages * PAGE
        return start

    def scattered(self, count: int) -> list[int]:
        """`count` pages that are not physically contiguous (every other page)."""
        return [self.alloc(2) for _ in range(count)]

    def page_table(self, pages: list[int], level: int, queue: bool = False) -> int:
        if level == 0:
            return pages[0]
        ptes = [page | VALID for page in pages]
        if queue:
            ptes[-1] |= LAST
            if len(ptes) > 1:
                ptes[-2] |= NEXT_TO_LAST
        chunks = [ptes[i:i + 512] for i in range(0, len(ptes), 512)]
        tables = [self.alloc() for _ in chunks]
        for table, chunk in zip(tables, chunks):
            self.mem.write(table, pack_ptes(chunk))
        if level == 1:
            assert len(tables) == 1
            return tables[0]
        directory = self.alloc()
        self.mem.write(directory, pack_ptes([t | VALID for t in tables]))
        return directory

    # -- HWRM -------------------------------------------------------------------------------------------------------
    def hwrm(self, name: str, expect: int = 0, **fields) -> ctypes.Structure:
        if name in ALLOCATIONS and self.auto_reserve and not self.reserved:
            self.reserve()
        self.reserved &= name != "func_reset"
        self.seq = (self.seq + 1) & 0xFFFF
        request = getattr(bnxt, f"hwrm_{name}_input")(
            req_type=getattr(bnxt, f"HWRM_{name.upper()}"), cmpl_ring=0xFFFF, seq_id=self.seq, target_id=0xFFFF,
            resp_addr=self.response, **fields)
        window = bytes(request)[:self.fw.config.profile.max_ext_req_len]  # FUNC_CFG as Linux cuts it to fit
        if self.short_commands:
            self.mem.write(self.requests, window)
            window = HWRM_SHORT_REQUEST.pack(request.req_type, SHORT_REQUEST_SIGNATURE, 0, len(window), self.requests)
        addr, data = self.fw.hwrm(window.ljust(bnxt.HWRM_MAX_REQ_LEN, b"\0"))
        assert addr == self.response and data[-1] == 1
        error = HWRM_RESPONSE_HEADER.unpack_from(data)[0]
        assert error == expect, f"{name}: error {error:#x} ({self.fw.last_error})"
        output = getattr(bnxt, f"hwrm_{name}_output") if not error else bnxt.hwrm_err_output
        assert len(data) == ctypes.sizeof(output)
        return output.from_buffer_copy(data)

    def link_up(self) -> None:
        """What bnxt_en's open does to the link of a registered driver: FUNC_DRV_IF_CHANGE(UP), then PORT_PHY_CFG
        restarting autoneg with RESET_PHY; then the link's training time passes."""
        self.hwrm("func_drv_if_change", flags=bnxt.FUNC_DRV_IF_CHANGE_REQ_FLAGS_UP)
        self.hwrm("port_phy_cfg", port_id=0, enables=bnxt.PORT_PHY_CFG_REQ_ENABLES_AUTO_MODE,
                  auto_mode=bnxt.PORT_PHY_CFG_REQ_AUTO_MODE_SPEED_MASK,
                  flags=bnxt.PORT_PHY_CFG_REQ_FLAGS_RESET_PHY | bnxt.PORT_PHY_CFG_REQ_FLAGS_RESTART_AUTONEG)
        self.fw.phy.tick(0.0)
        self.fw.phy.tick(self.fw.phy.delay)
        assert self.fw.port.up, self.fw.last_error

    def reserve(self, **counts: int) -> None:
        """FUNC_CFG reserving `counts` (FUNC_CFG field names; default: every resource at its maximum), each with its
        enable bit."""
        counts = counts or {name: r.maximum for name, r in RESOURCES.items()}
        self.hwrm("func_cfg", fid=0xFFFF, enables=sum(RESOURCES[name].enable for name in counts), **counts)
        self.reserved = True

    def ring(self, kind: int, length: int, logical_id: int = 0, level: int | None = None, **fields) -> int:
        pages = self.scattered(max(1, -(-length * RING_ENTRY_SIZES[kind] // PAGE)))
        level = (0 if len(pages) == 1 else 1) if level is None else level
        if level == 0:
            pages = [self.alloc(len(pages))]
        return self.hwrm("ring_alloc", ring_type=kind, page_tbl_addr=self.page_table(pages, level, queue=True),
                         page_size=12, page_tbl_depth=level, length=length, logical_id=logical_id,
                         int_mode=bnxt.RING_ALLOC_REQ_INT_MODE_MSIX, **fields).ring_id

    def backing_store(self, init_offset_units: int = 4, all_done: bool = True, trace: bool = False,
                      extra_qps: int = 64, sizes: dict[int, int] | None = None,
                      leave_out: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """Linux's walk: next_valid_type, skip invalid types, one CFG_V2 per instance of the types bnxt_en sizes (and
        the trace buffers when `trace`), but those in `leave_out`, ALL_DONE on the very last. Sized as bnxt_en sizes
        them (bnxt_alloc_ctx_mem) but for `extra_qps` RoCE QPs, not 64 Ki: the firmware's L2 share and QP1s, then the
        RoCE QPs and what they need of CQs, timers and TQM rings; VNICs and statistics contexts whole; `sizes`
        overrides the entries of a type."""
        steps, kind, offered = [], 0, {}
        while kind != BackingStoreType.INVALID:
            caps = self.hwrm("func_backing_store_qcaps_v2", type=kind)
            wanted = kind in CONFIGURED_CONTEXT_TYPES or trace and kind in TRACE_CONTEXT_TYPES
            if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID and wanted and kind not in leave_out:
                offered[kind] = caps
                instances = [i for i in range(32) if caps.instance_bit_map >> i & 1] or [0]
                steps += [(caps, instance) for instance in instances]
            kind = caps.next_valid_type
        bs = BackingStoreType
        offered |= {kind: self.hwrm("func_backing_store_qcaps_v2", type=kind) for kind in leave_out}
        qp = offered[bs.QP]
        l2, roce = qp.split_entry_0, extra_qps + qp.split_entry_1
        asked = {bs.QP: l2 + roce, bs.SRQ: offered[bs.SRQ].split_entry_0 + extra_qps,
                 bs.CQ: offered[bs.CQ].split_entry_0 + 2 * extra_qps, bs.VNIC: offered[bs.VNIC].max_num_entries,
                 bs.STAT: offered[bs.STAT].max_num_entries, bs.MRAV: 4 * extra_qps, bs.TIM: l2 + roce,
                 bs.SP_TQM_RING: offered[bs.VNIC].split_entry_0 + l2 + 2 * roce
                 + offered[bs.SP_TQM_RING].min_num_entries, bs.FP_TQM_RING: l2 + 2 * roce} | (sizes or {})
        for number, (caps, instance) in enumerate(steps):
            entries = min(max(caps.min_num_entries, asked.get(caps.type, 100)), caps.max_num_entries)
            size = entries * caps.entry_size
            npages = -(-size // PAGE)
            level = 0 if npages == 1 else 1 if npages <= 512 else 2
            pages = [self.alloc(npages)] if level == 0 else self.scattered(npages)
            if caps.flags & bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_ENABLE_CTX_KIND_INIT and caps.ctx_init_value:
                for entry in range(entries):
                    offset = entry * caps.entry_size + caps.ctx_init_offset * init_offset_units
                    page = pages[0] + offset if level == 0 else pages[offset // PAGE] + offset % PAGE
                    self.mem.write_u8(page, caps.ctx_init_value)
            last = all_done and number == len(steps) - 1
            self.hwrm("func_backing_store_cfg_v2", type=caps.type, instance=instance, entry_size=caps.entry_size,
                      num_entries=entries, page_dir=self.page_table(pages, level), page_size_pbl_level=level,
                      flags=bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_FLAGS_BS_CFG_ALL_DONE if last else 0)
        return [(caps.type, instance) for caps, instance in steps]

    # -- RCFW -------------------------------------------------------------------------------------------------------
    def open_rcfw(self, cmdq_depth: int = 64, cmdq_level: int = 1, creq_length: int = 64) -> None:
        self.creq_id = self.ring(NQ, creq_length, logical_id=1)
        self.creq_length, self.creq_consumer = creq_length, 0
        self.doorbell(self.creq_id, bnxt.DBC_DBC_TYPE_NQ_ARM, 0)
        npages = max(1, cmdq_depth * CMDQ_SLOT // PAGE)
        self.cmdq_pages = [self.alloc(npages)] if cmdq_level == 0 else self.scattered(npages)
        self.cmdq = PageList(self.cmdq_pages, contiguous=cmdq_level == 0)
        self.cmdq_depth, self.cmdq_producer, self.first = cmdq_depth, 0, True
        init = bnxt.cmdq_init(cmdq_pbl=self.page_table(self.cmdq_pages, cmdq_level, queue=True),
                              cmdq_size_cmdq_lvl=cmdq_depth << bnxt.CMDQ_INIT_CMDQ_SIZE_SFT | cmdq_level,
                              creq_ring_id=self.creq_id)
        for offset in range(0, CMDQ_INIT.size, 4):  # as the driver writes the mailbox: dword by dword
            self.fw.rcfw.mailbox_write(offset, int.from_bytes(bytes(init)[offset:offset + 4], "little"))

    def post(self, name: str, opcode: int | None = None, cmd_size: int | None = None, **fields) -> int:
        """Write one command into the CMDQ and publish the producer (no trigger yet); returns its cookie."""
        request = getattr(bnxt, f"cmdq_{name}")
        slots = -(-ctypes.sizeof(request) // CMDQ_SLOT)
        self.cookie += 1
        side = getattr(bnxt, f"creq_{name}_resp_sb", None)
        if side is not None:
            fields.update(resp_addr=self.alloc(), resp_size=-(-ctypes.sizeof(side) // CMDQ_SLOT))
            self.side_buffers[self.cookie] = fields["resp_addr"]
        data = bytes(request(opcode=getattr(bnxt, f"CMDQ_BASE_OPCODE_{name.upper()}") if opcode is None else opcode,
                             cmd_size=slots if cmd_size is None else cmd_size, cookie=self.cookie,
                             **fields))
        self.publish(data.ljust(slots * CMDQ_SLOT, b"\0"))
        return self.cookie

    def publish(self, data: bytes) -> None:
        """Write `data` (whole slots) into the CMDQ at the producer, slot by slot, and publish the new producer."""
        slots = len(data) // CMDQ_SLOT
        for i in range(slots):
            self.mem.write(self.cmdq.address(slot(self.cmdq_producer + i, self.cmdq_depth) * CMDQ_SLOT),
                           data[i * CMDQ_SLOT:(i + 1) * CMDQ_SLOT])
        self.cmdq_producer += slots
        self.fw.rcfw.mailbox_write(bnxt.RCFW_PF_VF_COMM_PROD_OFFSET,
                                   self.cmdq_producer & 0xFFFF | (CMDQ_FIRST_PRODUCER if self.first else 0))
        self.first = False

    def run(self) -> int:
        """Trigger and let the firmware answer everything published; returns how many answers it posted."""
        self.fw.rcfw.trigger()
        answered = 0
        while (command := self.fw.rcfw.next_command()) is not None:
            assert self.fw.rcfw.post_creq(self.fw.rcfw.execute(command))
            answered += 1
        return answered

    def drain(self, arm: bool = True) -> list[bytes]:
        """Read new CREQ entries by phase, then return the credit with an NQ(_ARM) doorbell."""
        entries, pages = [], self.fw.rings[self.creq_id].pages
        while True:
            entry = self.mem.read(pages.address(slot(self.creq_consumer, self.creq_length) * CREQ_ENTRY.size),
                                  CREQ_ENTRY.size)
            if not CREQ_ENTRY.is_new(entry, 0, self.creq_consumer, self.creq_length):
                break
            entries.append(entry)
            self.creq_consumer += 1
        self.doorbell(self.creq_id, bnxt.DBC_DBC_TYPE_NQ_ARM if arm else bnxt.DBC_DBC_TYPE_NQ,
                      *position(self.creq_consumer, self.creq_length))
        return entries

    def rcfw(self, name: str, expect: int = SUCCESS, **fields) -> ctypes.Structure:
        cookie = self.post(name, **fields)
        self.run()
        entry = next(e for e in self.drain() if cookie_of(e) == cookie)
        kind, status, _, _, event = CREQ_COMMAND_EVENT.unpack(entry)
        assert (kind, event) == (bnxt.CREQ_BASE_TYPE_QP_EVENT, getattr(bnxt, f"CMDQ_BASE_OPCODE_{name.upper()}"))
        assert status == expect, f"{name}: status {status} ({self.fw.last_error})"
        side, address = getattr(bnxt, f"creq_{name}_resp_sb", None), self.side_buffers.pop(cookie, None)
        if side is not None and status == SUCCESS:
            return side.from_buffer_copy(self.mem.read(address, ctypes.sizeof(side)))
        return getattr(bnxt, f"creq_{name}_resp").from_buffer_copy(entry)

    def doorbell(self, xid: int, kind: int, index: int, epoch: int = 0, toggle: int = 0) -> None:
        self.bar2.doorbell(self.fw.roce_db_offset, dbc(xid, kind, index, epoch, toggle=toggle))

    def boot(self, store: dict | None = None, **rcfw) -> None:
        """Linux's bring-up, the backing store configured as `backing_store(**store)` says."""
        ver = self.hwrm("ver_get")
        self.short_commands = short_commands_required(ver.dev_caps_cfg)
        self.hwrm("func_reset")
        self.hwrm("func_qcaps", fid=0xFFFF)
        self.hwrm("func_drv_rgtr", enables=bnxt.FUNC_DRV_RGTR_REQ_ENABLES_OS_TYPE,
                  os_type=bnxt.FUNC_DRV_RGTR_REQ_OS_TYPE_LINUX)
        self.stats_length = ring_stats_size(ver.chip_num, self.hwrm("vnic_qcaps").max_aggs_supported)
        self.backing_store(**(store or {}))
        self.open_rcfw(**rcfw)
        self.stat_ctx = self.hwrm("stat_ctx_alloc", stats_dma_addr=self.alloc(),
                                  stats_dma_length=self.stats_length).stat_ctx_id
        self.rcfw("initialize_fw", stat_ctx_id=self.stat_ctx)
        self.nq_id = self.ring(NQ, 64, logical_id=2)
        # ADD_GID wants the GID fully byte-reversed and the MAC byte-swapped within each 16-bit word
        self.gid_index = self.rcfw(
            "add_gid", gid=field_type(bnxt.cmdq_add_gid, "gid").from_buffer_copy(GID[::-1]),
            src_mac=field_type(bnxt.cmdq_add_gid, "src_mac").from_buffer_copy(bytes(MAC[i ^ 1] for i in range(6)))).xid

    # -- verbs objects ----------------------------------------------------------------------------------------------
    def create_cq(self, size: int = 64, handle: int = 0xC0FFEE_0000_0001, arm_enable: bool = True) -> int:
        """CREATE_CQ, then CQ_ARMENA as Linux's bnxt_qplib_create_cq rings it (unless not `arm_enable`)."""
        pages = self.scattered(max(1, size * CQ_ENTRY.size // PAGE))
        level = 0 if len(pages) == 1 else 1
        cq = self.rcfw("create_cq", cq_handle=handle, cq_size=size, cq_fco_cnq_id=self.nq_id, pg_size_lvl=level,
                       pbl=self.page_table(pages, level, queue=True)).xid
        if arm_enable:
            self.bar2.doorbell(self.fw.roce_db_offset, doorbell.arm_enable(cq, 0))
        return cq

    def create_qp(self, cq: int, sq_slots: int = 256, rq_size: int = 16, **fields) -> int:
        sq, rq = self.scattered(sq_slots * SQ_SLOT // PAGE + 1), self.scattered(rq_size * RQ_WQE_SIZE // PAGE or 1)
        return self.rcfw("create_qp", type=bnxt.CMDQ_CREATE_QP_TYPE_RC, qp_handle=0x1234,
                         qp_flags=bnxt.CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_ENABLED, sq_size=sq_slots,
                         sq_fwo_sq_sge=2, sq_pg_size_sq_lvl=1, sq_pbl=self.page_table(sq, 1, queue=True),
                         rq_size=rq_size, rq_fwo_rq_sge=2, rq_pg_size_rq_lvl=1,
                         rq_pbl=self.page_table(rq, 1, queue=True),
                         scq_cid=cq, rcq_cid=cq, **fields).xid

    def connect(self, qpn: int, peer: int) -> None:
        modify = bnxt.cmdq_modify_qp
        self.rcfw("modify_qp", qp_cid=qpn, modify_mask=INIT_MASK, access=ALL_QP_ACCESS, pkey=0xFFFF,
                  network_type_en_sqd_async_notify_new_state=QPState.INIT)
        self.rcfw("modify_qp", qp_cid=qpn, modify_mask=RTR_MASK, dgid=field_type(modify, "dgid").from_buffer_copy(GID),
                  network_type_en_sqd_async_notify_new_state=QPState.RTR | bnxt.CMDQ_MODIFY_QP_NETWORK_TYPE_ROCEV2_IPV4,
                  sgid_index=self.gid_index, dest_mac=field_type(modify, "dest_mac").from_buffer_copy(MAC),
                  dest_qp_id=peer, rq_psn=0x123456,
                  path_mtu_pingpong_push_enable=bnxt.CMDQ_MODIFY_QP_PATH_MTU_MTU_4096, max_dest_rd_atomic=4)
        self.rcfw("modify_qp", qp_cid=qpn, modify_mask=RTS_MASK, network_type_en_sqd_async_notify_new_state=QPState.RTS,
                  timeout=14, retry_cnt=7, rnr_retry=7, sq_psn=0x654321, max_rd_atomic=4)
