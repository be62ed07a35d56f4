"""The emulated NIC's firmware, HWRM side: the ChiMP command channel, doorbells and fault injection (sans-IO).

`Firmware.hwrm(request)` executes one request window and returns where to DMA the answer and its bytes; the I/O
shell writes them (valid byte last) and fires interrupts from `Firmware.interrupts`. The RoCE command channel is
`rcfw.Rcfw`, created here and sharing these tables. Behaviour follows reference/bnxt-host-interface.md §2; where the
reference is silent, what Linux's bnxt_en expects of real firmware. Bad input never raises: it gets an error code.
"""
from __future__ import annotations

import collections
import ctypes
import struct
from dataclasses import dataclass
from typing import Any, Callable

from ..autogen import bnxt
from .memory import PAGE, BusMemory, DmaFault
from .objects import (PAGE_SIZES, BackingStoreArea, CommandError, L2Filter, NotificationQueue, PageTableError, Ring,
                      StatContext, Vnic, lowest_free_id, map_memory)
from .rcfw import Rcfw

HWRM_HEADER = struct.Struct("<HHHHQ")  # req_type, cmpl_ring, seq_id, target_id, resp_addr
INVALID_PARAMS, RESOURCE_ALLOC_ERROR = bnxt.HWRM_ERR_CODE_INVALID_PARAMS, bnxt.HWRM_ERR_CODE_RESOURCE_ALLOC_ERROR
INTERFACE_VERSION = tuple(int(part) for part in bnxt.HWRM_INTERFACE_VERSION.split("."))  # 1.10.3.151
CHIP_NUM_57608 = 0x1760  # Thor2 (bnxt.h)
FUNCTION_ID = 0  # this PF's fid; requests may also say 0xFFFF for "myself"
DEFAULT_REQUEST_TIMEOUT_MS = 500
MTU = 9000
MAX_RING_LENGTH = 1 << 24  # doorbell indices are 24 bits
ALL_DONE = bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_FLAGS_BS_CFG_ALL_DONE
TYPE_VALID = bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID
CTX_INIT = bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_ENABLE_CTX_KIND_INIT

L2_CMPL, TX, RX, ROCE_CMPL, RX_AGG, NQ = (getattr(bnxt, f"RING_ALLOC_REQ_RING_TYPE_{name}") for name in
                                          ("L2_CMPL", "TX", "RX", "ROCE_CMPL", "RX_AGG", "NQ"))
RING_ENTRY_SIZES = {L2_CMPL: 16, TX: 16, RX: 16, ROCE_CMPL: 32, RX_AGG: 16, NQ: 16}
RING_LIMITS = {L2_CMPL: 128, TX: 128, RX: 128, ROCE_CMPL: 128, RX_AGG: 128, NQ: 64}
MAX_L2_FILTERS, MAX_RSS_CONTEXTS = 1024, 64


@dataclass
class FirmwareConfig:
    mac: bytes  # 6 bytes
    port_id: int = 0
    fw_version: tuple[int, int, int, int] = (230, 0, 150, 0)  # major, minor, build, reserved
    roce_db_page_kb: int = 64  # func_qcfg.legacy_l2_db_size_kb: the RoCE doorbell page is at BAR2 + this * 1024
    hw_retx: bool = True  # QUERY_FUNC reports the host MSN table (hardware requester retransmission)


@dataclass(frozen=True)
class ContextType:
    """What FUNC_BACKING_STORE_QCAPS_V2 reports for one type of context memory."""
    kind: int
    entry_size: int
    flags: int
    instance_bit_map: int  # one CFG_V2 per set bit; 0 means a single instance 0
    init_value: int  # with ENABLE_CTX_KIND_INIT: this byte at init_offset * 4 of every entry
    init_offset: int
    entry_multiple: int
    min_entries: int
    max_entries: int
    splits: tuple[int, ...] = ()

    @property
    def instances(self) -> list[int]:
        return [i for i in range(32) if self.instance_bit_map >> i & 1] or [0]


# A Thor2-like set, small enough for an emulator's arena: Linux sizes QPs as split0 (L2) + split1 (QP1) + extra RoCE
# QPs, CQs as split0 + 2 * extra QPs, TIM like QPs. TX_CK is reported but not valid for this function.
CONTEXT_TYPES = {ctx.kind: ctx for ctx in (
    #           type  size flags                 instances init  offset multiple min  max    splits
    ContextType(0x00, 704, TYPE_VALID | CTX_INIT, 0x00,     0xFF, 2,     64,      256, 2048,  (128, 2, 0)),  # QP
    ContextType(0x01, 192, TYPE_VALID | CTX_INIT, 0x00,     0xFF, 1,     64,      64,  1024,  (128,)),  # SRQ
    ContextType(0x02, 128, TYPE_VALID | CTX_INIT, 0x00,     0xFF, 3,     64,      256, 8192,  (256,)),  # CQ
    ContextType(0x03, 256, TYPE_VALID,            0x00,     0,    0,     1,       1,   128,   (128,)),  # VNIC
    ContextType(0x04, 256, TYPE_VALID,            0x00,     0,    0,     1,       1,   512),  # STAT
    ContextType(0x05, 64,  TYPE_VALID,            0x01,     0,    0,     64,      64,  16384),  # SP_TQM_RING
    ContextType(0x06, 32,  TYPE_VALID,            0xFF,     0,    0,     64,      64,  16384),  # FP_TQM_RING, per TC
    ContextType(0x0E, 128, TYPE_VALID | CTX_INIT, 0x00,     0x80, 1,     64,      64,  8192),  # MRAV
    ContextType(0x0F, 16,  TYPE_VALID,            0x00,     0,    0,     1,       1,   2048),  # TIM
    ContextType(0x13, 0,   0,                     0x00,     0,    0,     0,       0,   0),  # TX_CK
)}
_kinds = sorted(CONTEXT_TYPES)
NEXT_CONTEXT_TYPE = dict(zip(_kinds, _kinds[1:] + [bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_TYPE_INVALID]))
MAX_VNICS, MAX_STAT_CTXS = CONTEXT_TYPES[0x03].max_entries, CONTEXT_TYPES[0x04].max_entries


@dataclass(frozen=True)
class _Command:
    name: str
    request: type
    response: type
    run: Callable[[Any], dict[str, Any]]


class Firmware:
    """The function's firmware: HWRM commands, the object tables, doorbells; `rcfw` is its RoCE channel."""

    COMMANDS = ("ver_get", "func_reset", "func_qcaps", "func_qcfg", "func_drv_rgtr", "func_drv_unrgtr",
                "func_backing_store_qcaps_v2", "func_backing_store_cfg_v2", "stat_ctx_alloc", "stat_ctx_free",
                "ring_alloc", "ring_free", "vnic_alloc", "vnic_cfg", "vnic_free", "cfa_l2_filter_alloc",
                "cfa_l2_filter_free", "port_phy_cfg", "port_phy_qcfg")

    def __init__(self, mem: BusMemory, config: FirmwareConfig) -> None:
        self.mem, self.config = mem, config
        self.interrupts: list[int] = []  # MSI-X vectors for the shell to fire
        self.sq_doorbells: list[int] = []  # QP numbers whose SQ / RQ producer moved, for the data path
        self.rq_doorbells: list[int] = []
        self.injected_errors: dict[str, list[int]] = {}  # command name -> [status, remaining count]
        # counters for the debug channel: errors, internal_errors (emulator bugs), ctx_init_missing, legacy_doorbells,
        # l2_doorbells, ignored_doorbells, doorbells_without_valid, ignored_triggers, creq_dropped, hwrm_unanswerable
        self.stats: collections.Counter[str] = collections.Counter()
        self.last_error = ""  # why the last command failed or was ignored
        self.rings: dict[int, Ring] = {}
        self.stat_ctxs: dict[int, StatContext] = {}
        self.vnics: dict[int, Vnic] = {}
        self.l2_filters: dict[int, L2Filter] = {}
        self.backing_store: dict[tuple[int, int], BackingStoreArea] = {}
        self.queried_context_types: set[int] = set()
        self.backing_store_done = False
        self.driver: dict[str, Any] | None = None  # what FUNC_DRV_RGTR said; drivers may skip registering
        self.loopback = bnxt.PORT_PHY_CFG_REQ_LPBK_NONE
        self.rcfw = Rcfw(self)
        self._commands = {getattr(bnxt, f"HWRM_{name.upper()}"): _Command(
            name, getattr(bnxt, f"hwrm_{name}_input"), getattr(bnxt, f"hwrm_{name}_output"), getattr(self, f"_{name}"))
            for name in self.COMMANDS}

    # -- the channel -------------------------------------------------------------------------------------------------
    def hwrm(self, request: bytes) -> tuple[int, bytes] | None:
        """Execute one request window; (resp_addr, response with valid=1 last) or None if it cannot be answered."""
        if len(request) < HWRM_HEADER.size:
            self.stats["hwrm_unanswerable"] += 1
            return None
        req_type, _, seq_id, _, resp_addr = HWRM_HEADER.unpack_from(request)
        command = self._commands.get(req_type)
        output: ctypes.Structure = bnxt.hwrm_err_output()
        try:
            if command is None:
                raise CommandError(bnxt.HWRM_ERR_CODE_CMD_NOT_SUPPORTED, "command not supported")
            if (injected := self.take_injected_error(command.name)) is not None:
                output.error_code = injected
            else:
                size = ctypes.sizeof(command.request)
                output = command.response(**command.run(command.request.from_buffer_copy(
                    request[:size].ljust(size, b"\0"))))
        except Exception as exc:
            output.error_code = self.failure(f"HWRM {command.name if command else hex(req_type)}", exc,
                                             INVALID_PARAMS, bnxt.HWRM_ERR_CODE_FAIL)
        output.req_type, output.seq_id, output.resp_len = req_type, seq_id, ctypes.sizeof(output)
        output.valid = bnxt.HWRM_RESP_VALID_KEY
        response = bytes(output)
        try:
            self.mem.view(resp_addr, len(response))
        except DmaFault:
            self.stats["hwrm_unanswerable"] += 1
            return None
        return resp_addr, response

    def failure(self, what: str, exc: Exception, invalid: int, internal: int) -> int:
        """The status a failed command answers with, and why it failed (`last_error`, for tests and the debug channel).

        A CommandError carries its status; a page table or address outside host memory is an invalid parameter;
        anything else is an emulator bug, answered with `internal` so the device keeps running.
        """
        self.note_error(what, exc)
        if isinstance(exc, CommandError):
            return exc.status
        if isinstance(exc, (DmaFault, PageTableError)):
            return invalid
        self.stats["internal_errors"] += 1
        return internal

    def note_error(self, what: str, reason: object) -> None:
        self.last_error = f"{what}: {reason}"
        self.stats["errors"] += 1

    def inject_error(self, command: str, status: int, count: int = 1) -> None:
        """Make the next `count` commands named `command` (HWRM or RCFW, e.g. "func_qcfg", "create_qp") fail."""
        if count > 0:
            self.injected_errors[command] = [status, count]
        else:
            self.injected_errors.pop(command, None)

    def take_injected_error(self, command: str) -> int | None:
        injected = self.injected_errors.get(command)
        if injected is None:
            return None
        injected[1] -= 1
        if injected[1] <= 0:
            del self.injected_errors[command]
        self.last_error = f"{command}: injected status {injected[0]:#x}"
        return injected[0]

    def doorbell(self, offset: int, value: int) -> None:
        """A 64-bit write to BAR2. Below the RoCE doorbell page are legacy L2 doorbells: counted, ignored."""
        if offset < self.roce_db_offset:
            self.stats["legacy_doorbells"] += 1
        else:
            self.rcfw.doorbell(value)

    @property
    def roce_db_offset(self) -> int:
        return -(-self.config.roce_db_page_kb * 1024 // PAGE) * PAGE

    def objects(self) -> dict[str, int]:
        """Live object counts, for the debug channel (a clean shutdown brings every one back to zero)."""
        return {"rings": len(self.rings), "stat_ctxs": len(self.stat_ctxs), "vnics": len(self.vnics),
                "l2_filters": len(self.l2_filters), "backing_store": len(self.backing_store), **self.rcfw.objects()}

    @property
    def ctx_init_ok(self) -> bool:
        """False once any backing-store area arrived without the context initialisation the firmware asked for."""
        return not self.stats["ctx_init_missing"]

    def context_capacity(self, kind: int) -> int:
        """How many objects of a backing-store type fit: the configured entries, or the maximum until configured."""
        configured = [area.entries for (k, _), area in self.backing_store.items() if k == kind]
        return min(configured) if configured else CONTEXT_TYPES[kind].max_entries

    def backing_store_missing(self) -> str | None:
        """Why RoCE cannot start yet, or None: ALL_DONE seen and every valid type and instance configured."""
        if not self.backing_store_done:
            return "backing store not configured (no FUNC_BACKING_STORE_CFG_V2 with BS_CFG_ALL_DONE)"
        for ctx in CONTEXT_TYPES.values():
            missing = [i for i in ctx.instances if ctx.flags & TYPE_VALID and (ctx.kind, i) not in self.backing_store]
            if missing:
                return f"backing-store type {ctx.kind:#x} instances {missing} not configured"
        return None

    def reset(self) -> None:
        """FUNC_RESET: every L2 and RoCE object and the backing store are gone; the RoCE channel starts over."""
        self.rcfw.reset()
        for table in (self.rings, self.stat_ctxs, self.vnics, self.l2_filters, self.backing_store):
            table.clear()
        self.queried_context_types.clear()
        self.backing_store_done, self.driver = False, None
        self.sq_doorbells.clear()
        self.rq_doorbells.clear()

    # -- function ----------------------------------------------------------------------------------------------------
    def _ver_get(self, request: Any) -> dict[str, Any]:
        version, name = self.config.fw_version, ".".join(map(str, self.config.fw_version)).encode()
        fields: dict[str, Any] = {f"hwrm_intf_{part}": value for part, value in
                                  zip(("maj_8b", "min_8b", "upd_8b", "rsvd_8b"), INTERFACE_VERSION)}
        fields.update({f"hwrm_intf_{part}": value for part, value in
                       zip(("major", "minor", "build", "patch"), INTERFACE_VERSION)})
        for component in ("hwrm_fw", "mgmt_fw", "netctrl_fw", "roce_fw"):
            fields.update(zip((f"{component}_{part}" for part in ("maj_8b", "min_8b", "bld_8b", "rsvd_8b")), version))
            fields.update(zip((f"{component}_{part}" for part in ("major", "minor", "build", "patch")), version))
            fields[f"{component}_name"] = name
        return {**fields, "active_pkg_name": name, "chip_num": CHIP_NUM_57608, "max_req_win_len": bnxt.HWRM_MAX_REQ_LEN,
                "max_resp_len": bnxt.HWRM_MAX_RESP_LEN, "def_req_timeout": DEFAULT_REQUEST_TIMEOUT_MS,
                "max_ext_req_len": bnxt.HWRM_MAX_REQ_LEN, "flags": bnxt.VER_GET_RESP_FLAGS_EXT_VER_AVAIL,
                "always_1": 1}

    def _func_reset(self, request: Any) -> dict[str, Any]:
        self.reset()
        return {}

    def _own_function(self, fid: int) -> None:
        if fid not in (0xFFFF, FUNCTION_ID):
            raise CommandError(INVALID_PARAMS, f"fid {fid:#x}: this emulated PF has no VFs")

    def _func_qcaps(self, request: Any) -> dict[str, Any]:
        self._own_function(request.fid)
        return {"fid": FUNCTION_ID, "port_id": self.config.port_id, "mac_address": tuple(self.config.mac),
                "flags": bnxt.FUNC_QCAPS_RESP_FLAGS_ROCE_V2_SUPPORTED,
                "flags_ext": bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_SUPPORTED
                | bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_REQUIRED,
                "max_rsscos_ctx": MAX_RSS_CONTEXTS, "max_cmpl_rings": RING_LIMITS[L2_CMPL],
                "max_tx_rings": RING_LIMITS[TX], "max_rx_rings": RING_LIMITS[RX], "max_l2_ctxs": MAX_L2_FILTERS,
                "max_vnics": MAX_VNICS, "max_stat_ctx": MAX_STAT_CTXS, "max_hw_ring_grps": RING_LIMITS[RX]}

    def _func_qcfg(self, request: Any) -> dict[str, Any]:
        self._own_function(request.fid)
        return {"fid": FUNCTION_ID, "port_id": self.config.port_id, "mac_address": tuple(self.config.mac),
                "admin_mtu": MTU, "mru": MTU, "max_mtu_configured": MTU, "host_mtu": MTU, "port_pf_cnt": 1,
                "alloc_vnics": len(self.vnics), "alloc_stat_ctx": len(self.stat_ctxs),
                "legacy_l2_db_size_kb": self.config.roce_db_page_kb,
                "l2_doorbell_bar_size_kb": 2 * self.config.roce_db_page_kb,
                "db_page_size": bnxt.FUNC_QCFG_RESP_DB_PAGE_SIZE_4KB, "always_1": 1}

    def _func_drv_rgtr(self, request: Any) -> dict[str, Any]:
        self.driver = {"enables": request.enables, "os_type": request.os_type,
                       "version": (request.ver_maj_8b, request.ver_min_8b, request.ver_upd_8b)}
        return {}

    def _func_drv_unrgtr(self, request: Any) -> dict[str, Any]:
        """The driver is leaving and will free its memory: stop using its context memory (Linux frees it next)."""
        self.driver = None
        self.backing_store.clear()
        self.backing_store_done = False
        return {}

    # -- backing store (reference §2.2) ------------------------------------------------------------------------------
    def _func_backing_store_qcaps_v2(self, request: Any) -> dict[str, Any]:
        ctx = CONTEXT_TYPES.get(request.type)
        if ctx is None:
            raise CommandError(INVALID_PARAMS, f"backing-store type {request.type:#x} does not exist")
        self.queried_context_types.add(ctx.kind)
        return {"type": ctx.kind, "entry_size": ctx.entry_size, "flags": ctx.flags,
                "instance_bit_map": ctx.instance_bit_map, "ctx_init_value": ctx.init_value,
                "ctx_init_offset": ctx.init_offset, "entry_multiple": ctx.entry_multiple,
                "max_num_entries": ctx.max_entries, "min_num_entries": ctx.min_entries,
                "next_valid_type": NEXT_CONTEXT_TYPE[ctx.kind], "subtype_valid_cnt": len(ctx.splits),
                "max_instance_count": len(ctx.instances),
                **{f"split_entry_{i}": entries for i, entries in enumerate(ctx.splits)}}

    def _func_backing_store_cfg_v2(self, request: Any) -> dict[str, Any]:
        ctx = CONTEXT_TYPES.get(request.type)
        if ctx is None or not ctx.flags & TYPE_VALID:
            raise CommandError(INVALID_PARAMS, f"backing-store type {request.type:#x} cannot be configured")
        if ctx.kind not in self.queried_context_types:
            raise CommandError(INVALID_PARAMS, f"backing-store type {ctx.kind:#x} configured before its QCAPS_V2")
        if request.instance not in ctx.instances:
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x} has no instance {request.instance} "
                                            f"(instance_bit_map {ctx.instance_bit_map:#x})")
        if request.entry_size != ctx.entry_size:
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x} entries are {ctx.entry_size} bytes, "
                                            f"not {request.entry_size}")
        if not ctx.min_entries <= request.num_entries <= ctx.max_entries:
            raise CommandError(INVALID_PARAMS, f"type {ctx.kind:#x}: {request.num_entries} entries is outside "
                                            f"[{ctx.min_entries}, {ctx.max_entries}]")
        level = request.page_size_pbl_level & bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_PBL_LEVEL_MASK
        page_code = request.page_size_pbl_level >> bnxt.FUNC_BACKING_STORE_CFG_V2_REQ_PAGE_SIZE_SFT
        if level > 2 or page_code not in PAGE_SIZES:
            raise CommandError(INVALID_PARAMS, f"page_size_pbl_level {request.page_size_pbl_level:#x}")
        pages = map_memory(self.mem, level, request.page_dir, request.num_entries * ctx.entry_size,
                           PAGE_SIZES[page_code])
        if ctx.flags & CTX_INIT and ctx.init_value and not self._contexts_initialised(ctx, pages, request.num_entries):
            self.stats["ctx_init_missing"] += 1  # real firmware would run on garbage contexts; we only note it
        self.backing_store[ctx.kind, request.instance] = BackingStoreArea(
            ctx.kind, request.instance, request.num_entries, ctx.entry_size, pages)
        if request.flags & ALL_DONE:
            self.backing_store_done = True
        return {}

    def _contexts_initialised(self, ctx: ContextType, pages: Any, entries: int) -> bool:
        offset = ctx.init_offset * 4  # units of 4 bytes (bnxt.c bnxt_init_ctx_initializer)
        return all(self.mem.view(pages.address(i * ctx.entry_size + offset), 1)[0] == ctx.init_value
                   for i in range(entries))

    # -- statistics contexts, rings, VNICs, filters, port ------------------------------------------------------------
    def _stat_ctx_alloc(self, request: Any) -> dict[str, Any]:
        if request.stats_dma_addr:  # where the firmware would DMA the counters: it must exist
            self.mem.view(request.stats_dma_addr, request.stats_dma_length)
        ctx_id = self._new_id(self.stat_ctxs, MAX_STAT_CTXS, "statistics contexts")
        self.stat_ctxs[ctx_id] = StatContext(ctx_id, request.stats_dma_addr, request.stats_dma_length,
                                             request.stat_ctx_flags)
        return {"stat_ctx_id": ctx_id}

    def _stat_ctx_free(self, request: Any) -> dict[str, Any]:
        self._take(self.stat_ctxs, request.stat_ctx_id, "statistics context")
        return {"stat_ctx_id": request.stat_ctx_id}

    def _ring_alloc(self, request: Any) -> dict[str, Any]:
        kind = request.ring_type
        if kind not in RING_ENTRY_SIZES:
            raise CommandError(INVALID_PARAMS, f"ring_type {kind}")
        if not 1 <= request.length <= MAX_RING_LENGTH or request.page_tbl_depth > 2:
            raise CommandError(INVALID_PARAMS, f"length {request.length}, page_tbl_depth {request.page_tbl_depth}")
        if request.page_size and not 12 <= request.page_size <= 30:
            raise CommandError(INVALID_PARAMS, f"page_size 2^{request.page_size}")
        if sum(ring.ring_type == kind for ring in self.rings.values()) >= RING_LIMITS[kind]:
            raise CommandError(RESOURCE_ALLOC_ERROR, f"all {RING_LIMITS[kind]} rings of type {kind} are allocated")
        nq_ring_id = None
        if request.enables & bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID:
            nq_ring_id = request.nq_ring_id
            if not isinstance(self.rings.get(nq_ring_id), NotificationQueue):
                raise CommandError(INVALID_PARAMS, f"nq_ring_id {nq_ring_id} is not an NQ ring")
        elif kind in (L2_CMPL, RX, RX_AGG):  # on P5+ these hang off an NQ (bnxt.c hwrm_ring_alloc_send_msg)
            raise CommandError(INVALID_PARAMS, f"a ring of type {kind} needs an NQ: set NQ_RING_ID_VALID")
        pages = map_memory(self.mem, request.page_tbl_depth, request.page_tbl_addr,
                           request.length * RING_ENTRY_SIZES[kind], 1 << (request.page_size or 12), queue=True)
        ring_id = self._new_id(self.rings, 0xFFFE, "rings")  # 0xFFFF means "no ring"
        ring = (ring_id, kind, self.mem, pages, request.length, request.logical_id, RING_ENTRY_SIZES[kind], nq_ring_id)
        self.rings[ring_id] = NotificationQueue(*ring, interrupts=self.interrupts) if kind == NQ else Ring(*ring)
        return {"ring_id": ring_id, "logical_ring_id": request.logical_id}

    def _ring_free(self, request: Any) -> dict[str, Any]:
        ring = self.rings.get(request.ring_id)
        if ring is None or ring.ring_type != request.ring_type:
            raise CommandError(INVALID_PARAMS, f"no ring {request.ring_id} of type {request.ring_type}")
        users = [f"CQ {cq.cq_id}" for cq in self.rcfw.cqs.values() if cq.nq is ring] + \
                [f"ring {other.ring_id}" for other in self.rings.values() if other.nq_ring_id == ring.ring_id]
        if users:
            raise CommandError(INVALID_PARAMS, f"ring {ring.ring_id} is still used by {', '.join(users)}")
        if ring is self.rcfw.creq:
            self.rcfw.stop()
        del self.rings[ring.ring_id]
        return {}

    def _vnic_alloc(self, request: Any) -> dict[str, Any]:
        vnic_id = self._new_id(self.vnics, MAX_VNICS, "VNICs")
        self.vnics[vnic_id] = Vnic(vnic_id)
        return {"vnic_id": vnic_id}

    def _vnic_cfg(self, request: Any) -> dict[str, Any]:
        vnic = self.vnics.get(request.vnic_id)
        if vnic is None:
            raise CommandError(INVALID_PARAMS, f"no VNIC {request.vnic_id}")
        enables = request.enables
        if enables & bnxt.VNIC_CFG_REQ_ENABLES_DEFAULT_RX_RING_ID:
            vnic.rx_ring_id = self._ring_of_type(request.default_rx_ring_id, RX)
        if enables & bnxt.VNIC_CFG_REQ_ENABLES_DEFAULT_CMPL_RING_ID:
            vnic.cmpl_ring_id = self._ring_of_type(request.default_cmpl_ring_id, L2_CMPL)
        if enables & bnxt.VNIC_CFG_REQ_ENABLES_MRU:
            vnic.mru = request.mru
        return {}

    def _ring_of_type(self, ring_id: int, kind: int) -> int:
        ring = self.rings.get(ring_id)
        if ring is None or ring.ring_type != kind:
            raise CommandError(INVALID_PARAMS, f"ring {ring_id} is not an allocated ring of type {kind}")
        return ring_id

    def _vnic_free(self, request: Any) -> dict[str, Any]:
        self._take(self.vnics, request.vnic_id, "VNIC")
        return {}

    def _cfa_l2_filter_alloc(self, request: Any) -> dict[str, Any]:
        vnic_id = None
        if request.enables & bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_DST_ID:
            vnic_id = request.dst_id
            if vnic_id not in self.vnics:
                raise CommandError(INVALID_PARAMS, f"dst_id {vnic_id} is not a VNIC")
        filter_id = self._new_id(self.l2_filters, MAX_L2_FILTERS, "L2 filters")
        self.l2_filters[filter_id] = L2Filter(filter_id, bytes(request.l2_addr), bytes(request.l2_addr_mask), vnic_id)
        return {"l2_filter_id": filter_id, "flow_id": filter_id}

    def _cfa_l2_filter_free(self, request: Any) -> dict[str, Any]:
        self._take(self.l2_filters, request.l2_filter_id, "L2 filter")
        return {}

    def _own_port(self, port_id: int) -> None:
        if port_id != self.config.port_id:
            raise CommandError(INVALID_PARAMS, f"port {port_id}: this function owns port {self.config.port_id}")

    def _port_phy_cfg(self, request: Any) -> dict[str, Any]:
        self._own_port(request.port_id)
        if request.enables & bnxt.PORT_PHY_CFG_REQ_ENABLES_LPBK:
            if request.lpbk > bnxt.PORT_PHY_CFG_REQ_LPBK_EXTERNAL:
                raise CommandError(INVALID_PARAMS, f"lpbk {request.lpbk} (0 none, 1 local, 2 remote, 3 external)")
            self.loopback = request.lpbk
        return {}

    def _port_phy_qcfg(self, request: Any) -> dict[str, Any]:
        self._own_port(request.port_id)
        return {"link": bnxt.PORT_PHY_QCFG_RESP_LINK_LINK, "link_speed": bnxt.PORT_PHY_QCFG_RESP_LINK_SPEED_400GB,
                "duplex_state": bnxt.PORT_PHY_QCFG_RESP_DUPLEX_STATE_FULL, "lpbk": self.loopback}

    # -- id tables ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _new_id(table: dict[int, Any], limit: int, what: str) -> int:
        new = lowest_free_id(table, 1, limit + 1) if len(table) < limit else None
        if new is None:
            raise CommandError(RESOURCE_ALLOC_ERROR, f"all {limit} {what} are allocated")
        return new

    @staticmethod
    def _take(table: dict[int, Any], key: int, what: str) -> Any:
        if key not in table:
            raise CommandError(INVALID_PARAMS, f"no {what} {key}")
        return table.pop(key)
