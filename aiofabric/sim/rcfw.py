"""The emulated firmware's RoCE channel (RCFW): its commands and the RoCE object tables they change (sans-IO).

The channel's queues are cmdq.py's: on a trigger the shell drains `next_command()`, `execute()`s each (latency is the
shell's business) and `post_creq()`s the 16-byte answer. Request and answer layouts are the bindings' `cmdq_<name>`
and `creq_<name>_resp`; behaviour follows Linux's qplib_rcfw.c. The function's state shared with the HWRM side (its
rings, statistics contexts, backing store) is the `function.FunctionState` handed in.
"""
from __future__ import annotations

import ctypes
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from .cmdq import OPCODE_NAMES, CommandQueue, PendingCommand
from .function import FunctionState
from .memory import BAR2_SIZE, PAGE
from .objects import (CommandError, CompletionQueue, Gid, MemoryRegion, NotificationQueue, PageList, QueuePair,
                      lowest_free_id, map_memory)
from ..autogen import bnxt
from ..hw.cqe import CQ_ENTRY, SQ_CONS_IDX_MASK
from ..hw.firmware import CMDQ_SLOT, PAGE_SIZE_CODES
from ..hw.firmware import BackingStoreType as BS
from ..hw.firmware import add_gid_values
from ..hw.layout import field_type
from ..hw.verbs import PATH_MTU_BYTES, QUERY_QP_PATH_MTU_CODES, QPState, legal_transition
from ..hw.wqe import RQ_WQE_HEADER_SLOTS, SQ_SLOT, SQ_STATIC_WQE_SLOTS, STATIC_WQE_SGES, SqGeometry

QP_EVENT = bnxt.CREQ_BASE_TYPE_QP_EVENT
SUCCESS, FAIL, RESOURCES, INVALID_CMD, NOT_IMPLEMENTED, INVALID_PARAMETER = (
    getattr(bnxt, f"CREQ_QP_EVENT_STATUS_{name}") for name in
    ("SUCCESS", "FAIL", "RESOURCES", "INVALID_CMD", "NOT_IMPLEMENTED", "INVALID_PARAMETER"))
BEFORE_INITIALIZE_FW = {"query_func", "query_version", "initialize_fw", "deinitialize_fw"}
QP_TYPES = {bnxt.CMDQ_CREATE_QP_TYPE_RC, bnxt.CMDQ_CREATE_QP_TYPE_UD, bnxt.CMDQ_CREATE_QP_TYPE_RAW_ETHERTYPE,
            bnxt.CMDQ_CREATE_QP_TYPE_GSI}
MAX_GIDS, MAX_CQES, MAX_MR_SIZE, MAX_SGES = 256, (1 << 22) - 1, 1 << 40, 6
STATIC_WQE_BYTES = SQ_STATIC_WQE_SLOTS * SQ_SLOT  # a static QP's SQ and RQ WQEs (bnxt_re_setup_swqe_size, _rwqe_size)
M = "CMDQ_MODIFY_QP_MODIFY_MASK_"
# MODIFY_QP mask bits whose field is copied to the QueuePair attribute of the same name (lower case); VLAN_ID's field
# is vlan_pcp_vlan_dei_vlan_id. STATE and PATH_MTU are decoded separately.
MODIFY_FIELDS = tuple((getattr(bnxt, M + bit), bit.lower()) for bit in (
    "ACCESS", "PKEY", "QKEY", "DGID", "FLOW_LABEL", "SGID_INDEX", "HOP_LIMIT", "TRAFFIC_CLASS", "DEST_MAC", "TIMEOUT",
    "RETRY_CNT", "RNR_RETRY", "RQ_PSN", "SQ_PSN", "MAX_RD_ATOMIC", "MIN_RNR_TIMER", "MAX_DEST_RD_ATOMIC", "DEST_QP_ID",
    "SRC_MAC", "VLAN_ID"))
RTR_NEEDS = getattr(bnxt, M + "DGID") | getattr(bnxt, M + "DEST_QP_ID")  # a connected QP must know its peer


@dataclass(frozen=True)
class _Command:
    request: type[ctypes.Structure]
    response: type[ctypes.Structure]
    run: Callable[[Any, PendingCommand], dict[str, Any]]


class Rcfw(CommandQueue):
    """The RoCE command channel of one function (its queues: CommandQueue), and the RoCE objects it creates."""

    COMMANDS = ("initialize_fw", "deinitialize_fw", "query_func", "query_version", "add_gid", "delete_gid",
                "create_cq", "destroy_cq", "create_qp", "modify_qp", "query_qp", "destroy_qp", "allocate_mrw",
                "deallocate_key", "register_mr", "deregister_mr")

    def __init__(self, function: FunctionState) -> None:
        super().__init__(function)
        self.initialized = False
        self.hw_retx = False  # INITIALIZE_FW asked for hardware requester retransmission (the profile offers it)
        self.gids: dict[int, Gid] = {}
        self.cqs: dict[int, CompletionQueue] = {}
        self.qps: dict[int, QueuePair] = {}
        self.mrs: dict[int, MemoryRegion] = {}
        self._last_key_byte: dict[int, int] = {}  # MR context index -> the key byte it was last given
        self._commands = {getattr(bnxt, f"CMDQ_BASE_OPCODE_{name.upper()}"): _Command(
            getattr(bnxt, f"cmdq_{name}"), getattr(bnxt, f"creq_{name}_resp"), getattr(self, f"_{name}"))
            for name in self.COMMANDS}

    def objects(self) -> dict[str, int]:
        return {"gids": len(self.gids), "cqs": len(self.cqs), "qps": len(self.qps), "mrs": len(self.mrs)}

    def reset(self) -> None:
        """FUNC_RESET: all RoCE objects are gone and the channel waits for a new cmdq_init."""
        for table in (self.gids, self.cqs, self.qps, self.mrs):
            table.clear()
        self.stop()
        self.initialized = self.hw_retx = False

    # -- the commands --------------------------------------------------------------------------------------------------
    def execute(self, command: PendingCommand) -> bytes:
        """Run one command against the object tables; return its 16-byte CREQ answer (phase bit left 0)."""
        handler = self._commands.get(command.opcode)
        name, fields, status = command.name, {}, SUCCESS
        try:
            if not command.complete:
                raise CommandError(INVALID_PARAMETER, f"cmd_size {command.data[1]} does not match what was published")
            if handler is None:
                raise CommandError(NOT_IMPLEMENTED if command.opcode in OPCODE_NAMES else INVALID_CMD, "not emulated")
            if (injected := self.fw.take_injected_error(name)) is not None:
                status = injected
            elif not self.initialized and name not in BEFORE_INITIALIZE_FW:
                raise CommandError(FAIL, "the function is not initialized (INITIALIZE_FW first)")
            else:
                size = ctypes.sizeof(handler.request)
                fields = handler.run(handler.request.from_buffer_copy(command.data[:size].ljust(size, b"\0")), command)
        except Exception as exc:
            status = self.fw.failure(f"RCFW {name}", exc, INVALID_PARAMETER, bnxt.CREQ_QP_EVENT_STATUS_INTERNAL_ERROR)
        response = handler.response if handler else bnxt.creq_qp_event
        return bytes(response(type=QP_EVENT, status=status, cookie=command.cookie, event=command.opcode, **fields))

    # -- asynchronous events -----------------------------------------------------------------------------------------
    def post_event(self, kind: str, xid: int = 0, event: int = 0, reason: int = 0, res_reason: int = 0) -> bool:
        """Report an asynchronous event on the CREQ; True if it landed now, False if it waits for CREQ credit.

        "qp_error": QP `xid` went to error (`reason`/`res_reason`: requester/responder CREQ_QP_ERROR_NOTIFICATION
        reasons; the QP's consumer indices are filled in). "cq_error": CQ `xid`, `reason` CQ_ERR_REASON_*.
        "function": a function-level event, `event` CREQ_FUNC_EVENT_EVENT_*.
        """
        if kind == "qp_error":
            qp = self.qps.get(xid)
            entry: ctypes.Structure = bnxt.creq_qp_error_notification(
                type=QP_EVENT, event=bnxt.CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION, xid=xid,
                req_err_state_reason=reason, res_err_state_reason=res_reason,
                sq_cons_idx=qp.sq_consumer & SQ_CONS_IDX_MASK if qp else 0,
                rq_cons_idx=qp.rq_consumer & SQ_CONS_IDX_MASK if qp else 0)  # rq_cons_idx is as wide
        elif kind == "cq_error":
            entry = bnxt.creq_cq_error_notification(
                type=QP_EVENT, event=bnxt.CREQ_QP_EVENT_EVENT_CQ_ERROR_NOTIFICATION, xid=xid, cq_err_reason=reason)
        elif kind == "function":
            entry = bnxt.creq_func_event(type=bnxt.CREQ_BASE_TYPE_FUNC_EVENT, event=event)
        else:
            raise ValueError(f"unknown event kind {kind!r} (qp_error, cq_error, function)")
        self.events.append(bytes(entry))
        self.flush_events()
        return not self.events

    # -- function ----------------------------------------------------------------------------------------------------
    def _initialize_fw(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        missing = self.fw.backing_store_missing()
        if missing:
            raise CommandError(FAIL, missing)
        if request.stat_ctx_id not in self.fw.stat_ctxs:
            raise CommandError(INVALID_PARAMETER, f"stat_ctx_id {request.stat_ctx_id} is not allocated")
        hw_retx = bool(request.flags & bnxt.CMDQ_INITIALIZE_FW_FLAGS_HW_REQUESTER_RETX_SUPPORTED)
        if hw_retx and not self.fw.config.profile.hw_retx:  # strict: a driver asking for what is not offered fails
            raise CommandError(INVALID_PARAMETER, "HW_REQUESTER_RETX_SUPPORTED: QUERY_FUNC's dev_cap_flags do not "
                                                  "offer hardware retransmission")
        self.hw_retx = hw_retx
        self.initialized = True
        return {}

    def _deinitialize_fw(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        self.initialized = False
        return {}

    def _query_func(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        profile = self.fw.config.profile
        qps, cqs, mravs = (self.fw.context_capacity(kind) for kind in (BS.QP, BS.CQ, BS.MRAV))
        sb = bnxt.creq_query_func_resp_sb(
            max_mr_size=MAX_MR_SIZE, max_qp=qps, max_qp_wr=0xFFFF, max_cq=cqs, max_cqe=MAX_CQES, max_pd=1 << 16,
            max_sge=MAX_SGES, max_srq_sge=MAX_SGES, max_qp_rd_atom=16, max_qp_init_rd_atom=16, max_mr=mravs,
            max_mw=mravs, max_ah=self.fw.context_entries(BS.MRAV) - mravs, max_pkeys=1,
            max_inline_data=MAX_SGES * SQ_SLOT, max_gid=MAX_GIDS,
            l2_db_space_size=self.fw.roce_db_offset // PAGE - 1, max_dpi=(BAR2_SIZE - self.fw.roce_db_offset) // PAGE,
            max_sge_var_wqe=13, max_inline_data_var_wqe=13 * SQ_SLOT,
            dev_cap_flags=(bnxt.CREQ_QUERY_FUNC_RESP_SB_MR_REGISTER_ALLOC if profile.mr_register_alloc else 0)
            | (bnxt.CREQ_QUERY_FUNC_RESP_SB_HW_REQUESTER_RETX_ENABLED if profile.hw_retx else 0),
            dev_cap_ext_flags_2=bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_HOST_MSN_TABLE
            if profile.host_msn_table else bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_HOST_PSN_TABLE)
        return self._side_buffer(command, sb)

    def _side_buffer(self, command: PendingCommand, sb: ctypes.Structure) -> dict[str, Any]:
        """DMA a query's result to the command's side buffer; the CREQ answer carries its size in 16-byte units."""
        if not command.resp_addr or not command.resp_size:
            raise CommandError(INVALID_PARAMETER, "a query needs a side buffer (resp_addr and resp_size)")
        sb.opcode, sb.cookie, sb.resp_size = command.opcode, command.cookie, command.resp_size
        self.mem.write(command.resp_addr, bytes(sb)[:command.resp_size * CMDQ_SLOT])
        return {"size": -(-ctypes.sizeof(sb) // CMDQ_SLOT)}

    def _query_version(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        major, minor, build, reserved = self.fw.config.fw_version
        interface = (int(part) for part in bnxt.HWRM_INTERFACE_VERSION.split("."))
        return {"fw_maj": major, "fw_minor": minor, "fw_bld": build, "fw_rsvd": reserved,
                **dict(zip(("intf_maj", "intf_minor", "intf_bld", "intf_rsvd"), interface))}

    def _add_gid(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        index = lowest_free_id(self.gids, 0, MAX_GIDS)
        if index is None:
            raise CommandError(RESOURCES, f"all {MAX_GIDS} GID table entries are in use")
        self.gids[index] = Gid(index, *add_gid_values(bytes(request.gid), bytes(request.src_mac)), request.vlan,
                               request.stats_ctx)
        return {"xid": index}

    def _delete_gid(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        self._remove(self.gids, request.gid_index, "GID index")
        return {"xid": request.gid_index}

    # -- completion queues and queue pairs ---------------------------------------------------------------------------
    def _create_cq(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        nq_id = request.cq_fco_cnq_id & bnxt.CMDQ_CREATE_CQ_CNQ_ID_MASK
        nq = self.fw.rings.get(nq_id)
        if not isinstance(nq, NotificationQueue):
            raise CommandError(INVALID_PARAMETER, f"cnq id {nq_id} is not an NQ ring")
        if not 1 <= request.cq_size <= MAX_CQES:
            raise CommandError(INVALID_PARAMETER, f"cq_size {request.cq_size}")
        lvl = request.pg_size_lvl & bnxt.CMDQ_CREATE_CQ_LVL_MASK
        page_code = (request.pg_size_lvl & bnxt.CMDQ_CREATE_CQ_PG_SIZE_MASK) >> bnxt.CMDQ_CREATE_CQ_PG_SIZE_SFT
        pages = self._queue_pages("CQ", lvl, page_code, request.pbl, request.cq_size * CQ_ENTRY.size)
        cq_id = self._new_id(self.cqs, self.fw.context_capacity(BS.CQ), "CQ")
        self.cqs[cq_id] = CompletionQueue(cq_id, request.cq_handle, pages, request.cq_size, nq, self.mem)
        return {"xid": cq_id}

    def _destroy_cq(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        cq = self._find(self.cqs, request.cq_cid, "CQ")
        users = [qp.qpn for qp in self.qps.values() if cq in (qp.scq, qp.rcq)]
        if users:
            raise CommandError(INVALID_PARAMETER, f"CQ {cq.cq_id} is still used by QPs {users}")
        del self.cqs[cq.cq_id]
        return {"xid": cq.cq_id, "total_cnq_events": cq.notifications & 0xFFFF}

    def _queue_pages(self, what: str, level: int, page_code: int, base: int, size: int) -> PageList:
        if level > 2 or page_code not in PAGE_SIZE_CODES:
            raise CommandError(INVALID_PARAMETER, f"{what} page table level {level}, page size code {page_code}")
        return map_memory(self.mem, level, base, size, PAGE_SIZE_CODES[page_code], queue=True)

    def _create_qp(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        if request.type not in QP_TYPES:
            raise CommandError(INVALID_PARAMETER, f"QP type {request.type}")
        scq, rcq = self.cqs.get(request.scq_cid), self.cqs.get(request.rcq_cid)
        if scq is None or rcq is None:
            raise CommandError(INVALID_PARAMETER, f"scq_cid {request.scq_cid} / rcq_cid {request.rcq_cid}: no such CQ")
        if request.qp_flags & bnxt.CMDQ_CREATE_QP_QP_FLAGS_SRQ_USED:
            raise CommandError(INVALID_PARAMETER, f"SRQ {request.srq_cid} does not exist (SRQs are not emulated)")
        if not request.sq_size:
            raise CommandError(INVALID_PARAMETER, "sq_size 0")
        geometry = SqGeometry(bool(request.qp_flags & bnxt.CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_ENABLED),
                              request.sq_size, self.fw.config.profile.host_msn_table)
        sq_sge = request.sq_fwo_sq_sge & bnxt.CMDQ_CREATE_QP_SQ_SGE_MASK
        rq_sge = request.rq_fwo_rq_sge & bnxt.CMDQ_CREATE_QP_RQ_SGE_MASK
        if not geometry.variable and (sq_sge != STATIC_WQE_SGES or request.rq_size and rq_sge != STATIC_WQE_SGES):
            raise CommandError(INVALID_PARAMETER, f"static WQEs are {STATIC_WQE_BYTES} bytes, {STATIC_WQE_SGES} SGEs: "
                                                  f"sq_sge {sq_sge}, rq_sge {rq_sge}")
        sq_pages = request.sq_pg_size_sq_lvl
        sq = self._queue_pages("SQ", sq_pages & bnxt.CMDQ_CREATE_QP_SQ_LVL_MASK,
                               (sq_pages & bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_MASK) >> bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_SFT,
                               request.sq_pbl, geometry.table_offset + geometry.table_entries
                               * geometry.table_entry.size)  # the ring, then the search table
        rq_wqe_size = (RQ_WQE_HEADER_SLOTS + rq_sge) * SQ_SLOT  # rq_wqe_hdr, then the SGEs
        rq_pages = request.rq_pg_size_rq_lvl
        rq = self._queue_pages("RQ", rq_pages & bnxt.CMDQ_CREATE_QP_RQ_LVL_MASK,
                               (rq_pages & bnxt.CMDQ_CREATE_QP_RQ_PG_SIZE_MASK) >> bnxt.CMDQ_CREATE_QP_RQ_PG_SIZE_SFT,
                               request.rq_pbl, request.rq_size * rq_wqe_size) if request.rq_size else None
        if request.type == bnxt.CMDQ_CREATE_QP_TYPE_GSI:
            if 1 in self.qps:
                raise CommandError(RESOURCES, "the GSI QP (QP1) already exists")
            qpn = 1
        else:
            qpn = self._new_id(self.qps, self.fw.context_capacity(BS.QP), "QP", first=2)
        self.qps[qpn] = QueuePair(
            qpn, request.qp_handle, request.type, request.qp_flags, request.pd_id, scq, rcq, sq, geometry,
            sq_sge, rq, request.rq_size, rq_wqe_size, rq_sge,
            request.irrq_addr, request.orrq_addr, hw_retx=self.hw_retx)
        return {"xid": qpn}

    def _modify_qp(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        qp, mask = self._find(self.qps, request.qp_cid, "QP"), request.modify_mask
        state_byte = request.network_type_en_sqd_async_notify_new_state
        new_state = qp.state
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_STATE:
            value = state_byte & bnxt.CMDQ_MODIFY_QP_NEW_STATE_MASK
            if value > QPState.ERR or not legal_transition(qp.state, QPState(value)):
                raise CommandError(INVALID_PARAMETER, f"QP {qp.qpn}: {qp.state.name} -> state {value} is not legal")
            new_state = QPState(value)
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_SGID_INDEX and request.sgid_index not in self.gids:
            raise CommandError(INVALID_PARAMETER, f"sgid_index {request.sgid_index} is not in the GID table")
        mtu_code = request.path_mtu_pingpong_push_enable & bnxt.CMDQ_MODIFY_QP_PATH_MTU_MASK
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_PATH_MTU and mtu_code not in PATH_MTU_BYTES:
            raise CommandError(INVALID_PARAMETER, f"path MTU code {mtu_code:#x}")
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_PATH_MTU and (qp.state, new_state) != (QPState.INIT, QPState.RTR):
            # ib_modify_qp_is_ok, which bnxt_re_modify_qp applies: a path MTU is set on INIT -> RTR only (packets
            # already counted at one MTU would be sent at another). Inferred: that the firmware refuses it too.
            raise CommandError(INVALID_PARAMETER, f"QP {qp.qpn}: the path MTU is set on INIT -> RTR only, not on "
                                                  f"{qp.state.name} -> {new_state.name}")
        missing = RTR_NEEDS & ~(qp.attributes_set | mask)
        if new_state == QPState.RTR != qp.state and qp.qp_type == bnxt.CMDQ_CREATE_QP_TYPE_RC and missing:
            raise CommandError(INVALID_PARAMETER, f"QP {qp.qpn}: RTR needs the destination (modify_mask {missing:#x})")
        for bit, attribute in MODIFY_FIELDS:
            if mask & bit:
                value = getattr(request, "vlan_pcp_vlan_dei_vlan_id" if attribute == "vlan_id" else attribute)
                setattr(qp, attribute, bytes(value) if isinstance(value, ctypes.Array) else value)
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_PATH_MTU:
            qp.path_mtu = PATH_MTU_BYTES[mtu_code]
        qp.sq_psn &= 0xFFFFFF
        qp.rq_psn &= 0xFFFFFF
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_DGID:  # the network type belongs to the address vector
            qp.network_type = state_byte & bnxt.CMDQ_MODIFY_QP_NETWORK_TYPE_MASK
        if mask & bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_STATE:
            if new_state == QPState.RESET:  # a reset QP starts over with empty queues
                qp.sq_producer = qp.sq_consumer = qp.rq_producer = qp.rq_consumer = 0
                qp.sq_producer_epoch = qp.rq_producer_epoch = 0
            qp.change_state(new_state)
        qp.attributes_set |= mask
        return {"xid": qp.qpn}

    def _query_qp(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        qp = self._find(self.qps, request.qp_cid, "QP")
        sb_type = bnxt.creq_query_qp_resp_sb
        sb = sb_type(
            xid=qp.qpn, en_sqd_async_notify_state=qp.state, access=qp.access, pkey=qp.pkey, qkey=qp.qkey,
            dgid=field_type(sb_type, "dgid").from_buffer_copy(qp.dgid), flow_label=qp.flow_label,
            sgid_index=qp.sgid_index, hop_limit=qp.hop_limit, traffic_class=qp.traffic_class,
            dest_mac=field_type(sb_type, "dest_mac").from_buffer_copy(qp.dest_mac),
            path_mtu_dest_vlan_id=QUERY_QP_PATH_MTU_CODES[qp.path_mtu],
            timeout=qp.timeout, retry_cnt=qp.retry_cnt, rnr_retry=qp.rnr_retry, min_rnr_timer=qp.min_rnr_timer,
            rq_psn=qp.rq_psn, sq_psn=qp.sq_psn, max_rd_atomic=qp.max_rd_atomic,
            max_dest_rd_atomic=qp.max_dest_rd_atomic, sq_size=qp.sq_size, rq_size=qp.rq_size, sq_sge=qp.sq_sge,
            rq_sge=qp.rq_sge, dest_qp_id=qp.dest_qp_id, port_id=self.fw.config.port_id,
            src_mac=field_type(sb_type, "src_mac").from_buffer_copy(qp.src_mac), vlan_pcp_vlan_dei_vlan_id=qp.vlan_id)
        return self._side_buffer(command, sb)

    def _destroy_qp(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        return {"xid": self._remove(self.qps, request.qp_cid, "QP").qpn}

    # -- memory regions -------------------------------------------------------------------------
    def _new_key(self, pd: int, kind: int) -> MemoryRegion:
        """A key is (context index << 8) | key byte. The index is the lowest free context (not secret: it depends on
        what else is allocated); the byte is drawn at random, as rxe's rxe_get_next_key does (rxe_mr.c), so an rkey
        cannot be predicted from one run to the next, and differs from the last one given at that index, so a stale
        key to a reused index does not match. `secrets`, not `random`: the latter may be seeded by the host program."""
        index = self._new_id({key >> 8: mr for key, mr in self.mrs.items()}, self.fw.context_capacity(BS.MRAV), "MR")
        last = self._last_key_byte.get(index)
        byte = secrets.randbits(8)
        while byte == last:
            byte = secrets.randbits(8)
        self._last_key_byte[index] = byte
        mr = self.mrs[index << 8 | byte] = MemoryRegion(index << 8 | byte, pd, kind)
        return mr

    def _allocate_mrw(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        mr = self._new_key(request.pd_id, request.mrw_flags & bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MASK)
        mr.access = request.access
        return {"xid": mr.key}

    def _deallocate_key(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        return {"xid": self._remove(self.mrs, request.key, "key").key}

    def _register_mr(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        level = request.log2_pg_size_lvl & bnxt.CMDQ_REGISTER_MR_LVL_MASK
        page_shift = (request.log2_pg_size_lvl & bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_MASK) \
            >> bnxt.CMDQ_REGISTER_MR_LOG2_PG_SIZE_SFT
        if level > 2 or not 12 <= page_shift <= 30 or request.log2_pbl_pg_size not in (0, 12):
            raise CommandError(INVALID_PARAMETER, f"level {level}, page size 2^{page_shift}, PBL page size "
                                               f"2^{request.log2_pbl_pg_size} (PBL pages are 4 KiB)")
        if request.mr_size > MAX_MR_SIZE:
            raise CommandError(INVALID_PARAMETER, f"mr_size {request.mr_size:#x} exceeds {MAX_MR_SIZE:#x}")
        page_size = 1 << page_shift
        offset = request.va & page_size - 1  # the region's start within its first page
        pages = map_memory(self.mem, level, request.pbl, offset + request.mr_size, page_size, start=offset)
        misaligned = next((page for page in pages.pages if page & page_size - 1), None)
        # Linux lists whole pages of the size it names (bnxt_qplib_reg_mr). Inferred: the refusal; what the chip does
        # with a page off its size's alignment (drop the low bits, or add them) no source says
        if misaligned is not None:
            raise CommandError(INVALID_PARAMETER, f"page {misaligned:#x} of the PBL is not aligned to the "
                                                  f"{page_size:#x}-byte pages log2_pg_size names")
        if request.flags & bnxt.CMDQ_REGISTER_MR_FLAGS_ALLOC_MR:  # unified MR: `key` carries the PD
            if not self.fw.config.profile.mr_register_alloc:  # Linux asks for it only where offered
                raise CommandError(INVALID_PARAMETER, "ALLOC_MR: QUERY_FUNC's dev_cap_flags do not offer "
                                                      "MR_REGISTER_ALLOC (ALLOCATE_MRW the key first)")
            mr = self._new_key(request.key, bnxt.CMDQ_ALLOCATE_MRW_MRW_FLAGS_MR)
            mr.allocated_by_register = True
        else:
            existing = self.mrs.get(request.key)
            if existing is None or existing.registered:
                raise CommandError(INVALID_PARAMETER, f"key {request.key:#x} is not an allocated, unregistered MR")
            mr = existing
        mr.access, mr.va, mr.size, mr.pages = request.access, request.va, request.mr_size, pages
        return {"xid": mr.key}

    def _deregister_mr(self, request: Any, command: PendingCommand) -> dict[str, Any]:
        mr = self._find(self.mrs, request.lkey, "key")
        if not mr.registered:
            raise CommandError(INVALID_PARAMETER, f"lkey {request.lkey:#x} is not registered")
        if mr.allocated_by_register:
            del self.mrs[mr.key]
        mr.pages = None
        return {"xid": mr.key}

    # -- id tables ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _new_id(table: dict[int, Any], capacity: int, what: str, first: int = 1) -> int:
        new = lowest_free_id(table, first) if len(table) < capacity else None
        if new is None:
            raise CommandError(RESOURCES, f"the backing store holds {capacity} {what} contexts; all are in use")
        return new

    @staticmethod
    def _find(table: dict[int, Any], key: int, what: str) -> Any:
        if key not in table:
            raise CommandError(INVALID_PARAMETER, f"no {what} {key:#x}")
        return table[key]

    def _remove(self, table: dict[int, Any], key: int, what: str) -> Any:
        found = self._find(table, key, what)
        del table[key]
        return found

