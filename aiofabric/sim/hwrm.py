"""The emulated NIC's firmware, HWRM side: the ChiMP command channel, asynchronous events and fault injection
(sans-IO).

`Firmware.hwrm(request)` executes one request window and returns where to DMA the answer and its bytes; the I/O
shell writes them (valid byte last) and fires interrupts from `Firmware.interrupts`. A window holding a short request
(`hwrm_short_input`) names the request in host memory, read from there. What the firmware offers (its chip, backing
store v2, short commands) is its profile's (profiles.py). `Firmware` is the function's shared state (function.py)
plus the HWRM commands, the Ethernet port (port.py: link and MTU; phy.py: how the link comes up) and the
asynchronous events the driver registered for (`post_event`); its RoCE command channel is `rcfw.Rcfw`, created here
over that state. Doorbells do not pass through here: mmio.py decodes them for the NQs, CQs and the data path.
Behaviour follows what Linux's bnxt_en (bnxt_hwrm.c, bnxt.c) expects of real firmware. Bad input never raises: it gets
an error code.
"""
from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass
from typing import Any, Callable

from .backing_store import BackingStoreCommands
from .function import FirmwareConfig
from .memory import BusMemory, DmaFault
from .objects import CommandError, L2Filter, NotificationQueue, Ring, StatContext, Vnic, lowest_free_id, map_memory
from .phy import Phy
from .port import Port, check_mtu
from .rcfw import Rcfw
from .resources import MAX_L2_CTXS, RING_RESOURCE, Reservation, maxima
from ..autogen import bnxt
from ..hw.async_event import (NEW_MTU_MASK, EventId, ResetReason, async_event, forwarded, link_event_data,
                              reset_event_data)
from ..hw.doorbell import INDEX_MASK
from ..hw.firmware import (HWRM_REQUEST_HEADER, HWRM_SHORT_REQUEST, RING_ENTRY_SIZES,
                           SHORT_REQUEST_SIGNATURE, THOR2_CHIPS)
from ..hw.firmware import BackingStoreType as BS

INVALID_PARAMS, RESOURCE_ALLOC_ERROR = bnxt.HWRM_ERR_CODE_INVALID_PARAMS, bnxt.HWRM_ERR_CODE_RESOURCE_ALLOC_ERROR
INTERFACE_VERSION = tuple(int(part) for part in bnxt.HWRM_INTERFACE_VERSION.split("."))  # 1.10.3.151
FUNCTION_ID = 0  # this PF's fid; requests may also say 0xFFFF for "myself"
DEFAULT_REQUEST_TIMEOUT_MS = 500
MAX_RING_LENGTH = INDEX_MASK + 1  # a doorbell's index must reach every entry
BACKING_STORE_V2 = bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_SUPPORTED | bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_REQUIRED
SHORT_COMMANDS = bnxt.VER_GET_RESP_DEV_CAPS_CFG_SHORT_CMD_SUPPORTED | bnxt.VER_GET_RESP_DEV_CAPS_CFG_SHORT_CMD_REQUIRED
BACKING_STORE_V2_COMMANDS = {bnxt.HWRM_FUNC_BACKING_STORE_QCAPS_V2, bnxt.HWRM_FUNC_BACKING_STORE_CFG_V2}

L2_CMPL, TX, RX, ROCE_CMPL, RX_AGG, NQ = (getattr(bnxt, f"RING_ALLOC_REQ_RING_TYPE_{name}") for name in
                                          ("L2_CMPL", "TX", "RX", "ROCE_CMPL", "RX_AGG", "NQ"))
MAX_AGGS = 64  # VNIC_QCAPS max_aggs_supported with TPA v2 (Inferred: any non-zero value does)
L2_FILTER_FLAGS = bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_PATH_RX | bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_OUTERMOST
PORT_EVENTS: dict[str, tuple[EventId, Callable[[Firmware], int]]] = {  # post_event's: (event id, its event_data1)
    "link_down": (EventId.LINK_STATUS_CHANGE, lambda fw: link_event_data(fw.port.up, fw.config.port_id)),
    "link_up": (EventId.LINK_STATUS_CHANGE, lambda fw: link_event_data(fw.port.up, fw.config.port_id)),
    "mtu": (EventId.LINK_MTU_CHANGE, lambda fw: fw.port.mtu & NEW_MTU_MASK),
    "reset_notify": (EventId.RESET_NOTIFY, lambda _: reset_event_data(ResetReason.MANAGEMENT_RESET_REQUEST)),
    "fatal": (EventId.RESET_NOTIFY, lambda _: reset_event_data(ResetReason.FW_EXCEPTION_FATAL)),
}


@dataclass(frozen=True)
class _Command:
    name: str
    request: type[ctypes.Structure]
    response: type[ctypes.Structure]
    run: Callable[[Any], dict[str, Any]]


class Firmware(BackingStoreCommands):
    """The function's firmware: its shared state (function.py) and the HWRM commands (the backing store's in
    backing_store.py); `rcfw` is its RoCE channel."""

    COMMANDS = ("ver_get", "func_reset", "func_qcaps", "func_qcfg", "func_drv_rgtr", "func_drv_unrgtr",
                "func_backing_store_qcaps_v2", "func_backing_store_cfg_v2", "stat_ctx_alloc", "stat_ctx_free",
                "ring_alloc", "ring_free", "vnic_alloc", "vnic_cfg", "vnic_free", "vnic_qcaps",
                "cfa_l2_filter_alloc", "cfa_l2_filter_free", "port_phy_cfg", "port_phy_qcfg", "func_resource_qcaps",
                "func_cfg", "port_phy_qcaps", "func_drv_if_change")

    def __init__(self, mem: BusMemory, config: FirmwareConfig) -> None:
        super().__init__(mem, config)
        self.rcfw = Rcfw(self)
        self.port: Port = Port(self.stats)  # annotated: PORT_EVENTS, above, reads it
        self.phy = Phy(self.port, config.profile.chip_num in THOR2_CHIPS, self._link_changed)
        self.async_events: collections.deque[bytes] = collections.deque()  # waiting for room on the event ring
        self.reservation = Reservation()  # what FUNC_CFG reserved (resources.py)
        self.async_event_cr: int | None = None  # the ring FUNC_CFG named for events; None: the CREQ
        self._commands = {getattr(bnxt, f"HWRM_{name.upper()}"): _Command(
            name, getattr(bnxt, f"hwrm_{name}_input"), getattr(bnxt, f"hwrm_{name}_output"), getattr(self, f"_{name}"))
            for name in self.COMMANDS}

    # -- the channel -------------------------------------------------------------------------------------------------
    def hwrm(self, request: bytes) -> tuple[int, bytes] | None:
        """Execute one request window; (resp_addr, response with valid=1 last) or None if it cannot be answered."""
        if len(request) < HWRM_REQUEST_HEADER.size:
            self.stats["hwrm_unanswerable"] += 1
            return None
        short = HWRM_SHORT_REQUEST.unpack_from(request)[1] == SHORT_REQUEST_SIGNATURE
        if short:
            named = self._short_request(request)
            if named is None:
                self.stats["hwrm_unanswerable"] += 1
                return None
            request = named
        req_type, _, seq_id, _, resp_addr = HWRM_REQUEST_HEADER.unpack_from(request)
        command = self._commands.get(req_type)
        output: ctypes.Structure = bnxt.hwrm_err_output()
        profile = self.config.profile
        try:
            if command is None or req_type in BACKING_STORE_V2_COMMANDS and not profile.backing_store_v2:
                raise CommandError(bnxt.HWRM_ERR_CODE_CMD_NOT_SUPPORTED, "command not supported")
            if profile.short_commands and not short and req_type != bnxt.HWRM_VER_GET:
                raise CommandError(INVALID_PARAMS, "a request in the window: this firmware requires short commands")
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

    def _short_request(self, window: bytes) -> bytes | None:
        """The request a short one names (hwrm_short_input: its bus address and length), or None if it names
        none that exists."""
        _, _, _, size, address = HWRM_SHORT_REQUEST.unpack_from(window)
        if not HWRM_REQUEST_HEADER.size <= size <= self.config.profile.max_ext_req_len:
            return None
        self.stats["short_commands"] += 1
        try:
            return self.mem.read(address, size)
        except DmaFault:
            return None

    def objects(self) -> dict[str, int]:
        """Live object counts, for the debug channel (a clean shutdown brings every one back to zero)."""
        return {"rings": len(self.rings), "stat_ctxs": len(self.stat_ctxs), "vnics": len(self.vnics),
                "l2_filters": len(self.l2_filters), "backing_store": len(self.backing_store), **self.rcfw.objects()}

    def reset(self) -> None:
        """FUNC_RESET: every L2 and RoCE object and the backing store are gone; the RoCE channel starts over. The
        port's link stays as it is (phy.py)."""
        self.rcfw.reset()
        self.clear()
        self.phy.interface(False)
        self.async_events.clear()
        self.reservation.clear()
        self.async_event_cr = None

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
        profile = self.config.profile
        return {**fields, "active_pkg_name": name, "chip_num": profile.chip_num,
                "dev_caps_cfg": SHORT_COMMANDS if profile.short_commands else 0,
                "max_req_win_len": bnxt.HWRM_MAX_REQ_LEN, "max_resp_len": bnxt.HWRM_MAX_RESP_LEN,
                "def_req_timeout": DEFAULT_REQUEST_TIMEOUT_MS, "max_ext_req_len": profile.max_ext_req_len,
                "flags": bnxt.VER_GET_RESP_FLAGS_EXT_VER_AVAIL, "always_1": 1}

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
                "flags_ext": BACKING_STORE_V2 if self.config.profile.backing_store_v2 else 0,
                **{name: value for name, value in maxima().items() if name != "max_msix"}}

    def _func_qcfg(self, request: Any) -> dict[str, Any]:
        self._own_function(request.fid)
        return {"fid": FUNCTION_ID, "port_id": self.config.port_id, "mac_address": tuple(self.config.mac),
                "admin_mtu": self.port.mtu, "mru": self.port.mtu, "max_mtu_configured": self.port.mtu,
                "host_mtu": self.port.mtu, "port_pf_cnt": 1,
                **self.reservation.qcfg(),
                "legacy_l2_db_size_kb": self.config.profile.legacy_l2_db_size_kb,
                "l2_doorbell_bar_size_kb": 2 * self.config.profile.legacy_l2_db_size_kb,
                "db_page_size": bnxt.FUNC_QCFG_RESP_DB_PAGE_SIZE_4KB, "always_1": 1}

    def _func_resource_qcaps(self, request: Any) -> dict[str, Any]:
        self._own_function(request.fid)
        return maxima()

    def _func_cfg(self, request: Any) -> dict[str, Any]:
        """The reservation (resources.py) and the ring events go to (ASYNC_EVENT_CR); the other settings (MTU,
        bandwidth, cache line, ...) are not emulated: accepted and ignored."""
        self._own_function(request.fid)
        cr = None
        if request.enables & bnxt.FUNC_CFG_REQ_ENABLES_ASYNC_EVENT_CR:
            cr = request.async_event_cr  # Inferred: on P5+ it must be an NQ (Linux names its first NQ)
            if not isinstance(self.rings.get(cr), NotificationQueue):
                raise CommandError(INVALID_PARAMS, f"async_event_cr {cr} is not an allocated NQ ring")
        self.reservation.configure(request)
        if cr is not None:
            self.async_event_cr = cr
            self.flush_async_events()
        return {}

    def _func_drv_rgtr(self, request: Any) -> dict[str, Any]:
        forward = request.enables & bnxt.FUNC_DRV_RGTR_REQ_ENABLES_ASYNC_EVENT_FWD
        self.driver = {"enables": request.enables, "os_type": request.os_type,
                       "version": (request.ver_maj_8b, request.ver_min_8b, request.ver_upd_8b),
                       "async_event_fwd": tuple(request.async_event_fwd) if forward else ()}
        return {"flags": bnxt.FUNC_DRV_RGTR_RESP_FLAGS_IF_CHANGE_SUPPORTED}  # Linux sends IF_CHANGE only then

    def _func_drv_unrgtr(self, request: Any) -> dict[str, Any]:
        """The driver is leaving and will free its memory: stop using its context memory (Linux frees it next). One
        whose interface is still up skipped FUNC_DRV_IF_CHANGE(down): noted (bnxt_close sends it after its frees)."""
        if self.phy.interface_up:
            self.note_error("HWRM func_drv_unrgtr", "the interface is still up: FUNC_DRV_IF_CHANGE(down) comes first")
        self.driver = None
        self.backing_store.clear()
        self.backing_store_done = False
        self.phy.interface(False)
        return {}

    def _func_drv_if_change(self, request: Any) -> dict[str, Any]:
        """The driver's interface goes up (flags UP) or down; this firmware never reports RESC_CHANGE,
        HOT_FW_RESET_DONE or CAPS_CHANGE (it has no hot reset, and nothing changes a reservation)."""
        if self.driver is None:
            raise CommandError(INVALID_PARAMS, "no driver is registered: FUNC_DRV_RGTR comes first")
        self.phy.interface(bool(request.flags & bnxt.FUNC_DRV_IF_CHANGE_REQ_FLAGS_UP))
        return {"flags": 0}

    # -- statistics contexts, rings, VNICs, filters, port ------------------------------------------------------------
    def _stat_ctx_alloc(self, request: Any) -> dict[str, Any]:
        if request.stats_dma_length != self.stats_length:  # the block the chip DMAs: a shorter buffer would overflow
            raise CommandError(INVALID_PARAMS, f"stats_dma_length {request.stats_dma_length}: this chip's statistics "
                                               f"block is {self.stats_length} bytes (see VNIC_QCAPS)")
        if request.stats_dma_addr:  # where the firmware would DMA the counters: it must exist
            self.mem.view(request.stats_dma_addr, request.stats_dma_length)
        self.reservation.check("num_stat_ctxs", len(self.stat_ctxs), "STAT_CTX_ALLOC")
        ctx_id = self._new_id(self.stat_ctxs, self.context_capacity(BS.STAT), "statistics contexts")
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
        resource = RING_RESOURCE[kind]
        self.reservation.check(resource, sum(RING_RESOURCE[ring.ring_type] == resource for ring in self.rings.values()),
                               f"RING_ALLOC type {kind}")
        if kind == NQ and request.logical_id >= self.reservation.granted["num_msix"]:  # Inferred (resources.py)
            raise CommandError(INVALID_PARAMS, f"RING_ALLOC NQ logical_id {request.logical_id}: the vector is not "
                               f"among the {self.reservation.granted['num_msix']} FUNC_CFG num_msix reserved")
        nq_ring_id = None
        if request.enables & bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID:
            nq_ring_id = request.nq_ring_id
            if not isinstance(self.rings.get(nq_ring_id), NotificationQueue):
                raise CommandError(INVALID_PARAMS, f"nq_ring_id {nq_ring_id} is not an NQ ring")
        elif kind == L2_CMPL:  # on P5+ a completion ring hangs off an NQ (bnxt.c hwrm_ring_alloc_send_msg)
            raise CommandError(INVALID_PARAMS, f"a ring of type {kind} needs an NQ: set NQ_RING_ID_VALID")
        # An RX ring's NQ is optional: Linux has named it since 2025 (bnxt_set_rx_ring_params_p5), older Linux and
        # DPDK do not, and firmware takes both; its buffer size it always names.
        if kind in (RX, RX_AGG) and not request.enables & bnxt.RING_ALLOC_REQ_ENABLES_RX_BUF_SIZE_VALID:
            raise CommandError(INVALID_PARAMS, f"a ring of type {kind} needs its buffer size: set RX_BUF_SIZE_VALID")
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
        ring_id = ring.ring_id
        users = [f"CQ {cq.cq_id}" for cq in self.rcfw.cqs.values() if cq.nq is ring] + \
                [f"ring {other.ring_id}" for other in self.rings.values() if other.nq_ring_id == ring_id]
        if users:
            raise CommandError(INVALID_PARAMS, f"ring {ring.ring_id} is still used by {', '.join(users)}")
        if ring is self.rcfw.creq:
            self.rcfw.stop()
        del self.rings[ring_id]
        return {}

    def _vnic_alloc(self, request: Any) -> dict[str, Any]:
        self.reservation.check("num_vnics", len(self.vnics), "VNIC_ALLOC")
        vnic_id = self._new_id(self.vnics, self.context_capacity(BS.VNIC), "VNICs")
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

    def _vnic_qcaps(self, request: Any) -> dict[str, Any]:
        return {"mru": self.port.mtu, "max_aggs_supported": MAX_AGGS if self.config.profile.tpa_v2 else 0}

    def _ring_of_type(self, ring_id: int, kind: int) -> int:
        ring = self.rings.get(ring_id)
        if ring is None or ring.ring_type != kind:
            raise CommandError(INVALID_PARAMS, f"ring {ring_id} is not an allocated ring of type {kind}")
        return ring_id

    def _vnic_free(self, request: Any) -> dict[str, Any]:
        self._take(self.vnics, request.vnic_id, "VNIC")
        return {}

    def _cfa_l2_filter_alloc(self, request: Any) -> dict[str, Any]:
        missing = L2_FILTER_FLAGS & ~request.flags
        if missing:  # Inferred: Linux and DPDK always ask for both on these chips; what firmware does without, unknown
            raise CommandError(INVALID_PARAMS, f"flags {request.flags:#x} lack {missing:#x}: an RX filter on the "
                                               "outermost L2 header (PATH_RX | OUTERMOST)")
        vnic_id = None
        if request.enables & bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_DST_ID:
            vnic_id = request.dst_id
            if vnic_id not in self.vnics:
                raise CommandError(INVALID_PARAMS, f"dst_id {vnic_id} is not a VNIC")
        filter_id = self._new_id(self.l2_filters, MAX_L2_CTXS, "L2 filters")
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
        self.phy.configure(request, lambda why: self.note_error("HWRM port_phy_cfg", why))
        if request.enables & bnxt.PORT_PHY_CFG_REQ_ENABLES_LPBK:
            self.loopback = request.lpbk
        return {}

    def _port_phy_qcfg(self, request: Any) -> dict[str, Any]:
        self._own_port(request.port_id)
        return {**self.phy.qcfg(), "lpbk": self.loopback}

    def _port_phy_qcaps(self, request: Any) -> dict[str, Any]:
        self._own_port(request.port_id)
        return self.phy.qcaps()

    def _link_changed(self) -> None:
        """The PHY took the link up or down: LINK_STATUS_CHANGE, as firmware reports it (bnxt_async_event_process)."""
        self.post_async_event(EventId.LINK_STATUS_CHANGE, link_event_data(self.port.up, self.config.port_id))

    # -- asynchronous events (Linux bnxt.c: bnxt_hwrm_func_drv_rgtr, bnxt_async_event_process) ----------------------
    def post_event(self, kind: str, **fields: int) -> None:
        """Report an asynchronous event. The port's and the firmware's (`PORT_EVENTS`) go where async events go
        (`_async_event_ring`): "link_down" / "link_up" pull and plug the cable (phy.py: a configured link is up again
        at once, a forced-down one stays down; the port drops packets while down) and LINK_STATUS_CHANGE says what the
        link is now; "mtu" (field `mtu`) changes the port's MTU and LINK_MTU_CHANGE says so; "reset_notify" is
        RESET_NOTIFY for a management reset, "fatal" RESET_NOTIFY for a fatal firmware exception. The RoCE ones go to
        the CREQ (rcfw.Rcfw.post_event)."""
        if kind not in PORT_EVENTS:
            self.rcfw.post_event(kind, **fields)
            return
        if kind.startswith("link_"):
            self.phy.plug(kind == "link_up")
        elif kind == "mtu":
            self.port.mtu = check_mtu(fields.get("mtu"), "mtu")
        event_id, data1 = PORT_EVENTS[kind]
        self.post_async_event(event_id, data1(self))

    def post_async_event(self, event_id: int, data1: int = 0, data2: int = 0) -> None:
        """Write one event to the async event ring if the driver registered for it (FUNC_DRV_RGTR's
        async_event_fwd); it waits while the ring is full or not there yet."""
        if self.driver is None or not forwarded(self.driver["async_event_fwd"], event_id):
            self.stats["async_events_not_forwarded"] += 1
            return
        self.async_events.append(async_event(event_id, data1, data2))
        self.flush_async_events()

    def flush_async_events(self) -> None:
        """Post the events waiting for room on the event ring, as many as fit."""
        ring = self._async_event_ring()
        while self.async_events and ring is not None and ring.post(self.async_events[0]):
            self.async_events.popleft()

    def _async_event_ring(self) -> NotificationQueue | None:
        """Where events go: the ring FUNC_CFG's async_event_cr named (Linux: bnxt_hwrm_set_async_event_cr, its first
        NQ on P5+ chips) while it exists; until one is named, the HSI's "default completion ring of the function".
        Inferred: that is the CREQ, the one ring bnxt_re's bnxt_qplib_service_creq accepts HWRM async event
        completions on; without a CREQ either, events wait."""
        if self.async_event_cr is not None:
            ring = self.rings.get(self.async_event_cr)
            return ring if isinstance(ring, NotificationQueue) else None
        return self.rcfw.creq

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
