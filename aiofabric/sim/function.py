"""The emulated function's firmware state, shared by its two command channels (sans-IO).

HWRM (hwrm.py) and the RoCE channel (rcfw.py) are two doors into one PCI function. What both need lives here: host
memory and the configuration, the rings HWRM allocates (the CREQ and the NQs the RoCE side posts to are HWRM rings),
statistics contexts, the backing store and how many objects it holds, the MSI-X vectors the I/O shell is to fire,
injected errors and error accounting. `hwrm.Firmware` is this
state plus the HWRM commands, and owns the `rcfw.Rcfw` that is handed this state: neither channel imports the other
for it.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from .memory import PAGE, BusMemory, DmaFault
from .objects import BackingStoreArea, CommandError, L2Filter, PageTableError, Ring, StatContext, Vnic
from .pcie import DEFAULT_PCIE_PATH, PcieFunction
from .profiles import DEFAULT_PROFILE, PROFILES, FirmwareProfile
from ..autogen import bnxt
from ..hw.firmware import THOR_CHIPS
from ..hw.firmware import BackingStoreType as BS

TYPE_VALID = bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_TYPE_VALID
CTX_INIT = bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_ENABLE_CTX_KIND_INIT
FW_TRACE = bnxt.FUNC_BACKING_STORE_QCAPS_V2_RESP_FLAGS_FW_DBG_TRACE  # a log buffer: a driver may leave it out
SRT_TRACE = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_SRT_TRACE


@dataclass
class FirmwareConfig:
    mac: bytes  # 6 bytes
    port_id: int = 0
    fw_version: tuple[int, int, int, int] = (230, 0, 150, 0)  # major, minor, build, reserved
    profile: FirmwareProfile = PROFILES[DEFAULT_PROFILE]  # the chip and what its firmware offers (profiles.py)
    pcie_path: str = DEFAULT_PCIE_PATH  # the path to the root complex (pcie.py): whether atomics reach memory


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

    @property
    def required(self) -> bool:
        """RoCE needs it configured: valid, and not a firmware log buffer."""
        return bool(self.flags & TYPE_VALID) and not self.flags & FW_TRACE


# A Thor2-like set, sized so that bnxt_en's sizing (bnxt_alloc_ctx_mem) comes out at the plausible figures a review
# of Linux gave for a RoCE function (VNIC and statistics contexts 1024 each, slow-path TQM ring 2500, fast-path 2308
# entries): 1024 RoCE QPs beyond the firmware's L2 share (split 0: one per L2 ring) and QP1s (split 1), two CQs per QP
# beyond the L2 CQs, 1 Ki SRQs beyond the L2 share, 8 Ki MRs and 8 Ki address handles in MRAV, statistics contexts
# and VNICs (split 0: VNICs, the rest RSS ring tables) taken whole, timer contexts for every QP: about 6 MiB, where
# Linux's own caps (64 Ki extra QPs, 256 Ki MRs) on a larger function would make it ~150 MiB, touched at every open.
# Statistics contexts and the TQM rings have no splits. Only the TQM rings report a minimum: v1's QCAPS has a minimum
# for them alone (tqm_min_entries_per_ring), and Linux adds it to the slow-path ring. TX_CK is reported but not valid
# for this function; SRT_TRACE is a firmware log buffer, valid but optional (bnxt_en configures it only to collect
# logs). Inferred: the numbers themselves (no source gives a real Thor2's).
CONTEXT_TYPES = {ctx.kind: ctx for ctx in (
    #           type            size flags                 instances init  offset multiple min  max     splits
    ContextType(BS.QP,          704, TYPE_VALID | CTX_INIT, 0x00,     0xFF, 2,     64,      0,   1282,   (256, 2, 0)),
    ContextType(BS.SRQ,         192, TYPE_VALID | CTX_INIT, 0x00,     0xFF, 1,     64,      0,   1152,   (128,)),
    ContextType(BS.CQ,          128, TYPE_VALID | CTX_INIT, 0x00,     0xFF, 3,     64,      0,   131328, (256,)),
    ContextType(BS.VNIC,        256, TYPE_VALID,            0x00,     0,    0,     1,       0,   1024,   (128,)),
    ContextType(BS.STAT,        256, TYPE_VALID,            0x00,     0,    0,     1,       0,   1024),
    ContextType(BS.SP_TQM_RING, 64,  TYPE_VALID,            0x01,     0,    0,     64,      64,  262144),
    ContextType(BS.FP_TQM_RING, 32,  TYPE_VALID,            0xFF,     0,    0,     64,      64,  262144),  # per TC
    ContextType(BS.MRAV,        128, TYPE_VALID | CTX_INIT, 0x00,     0x80, 1,     64,      0,   16384),
    ContextType(BS.TIM,         16,  TYPE_VALID,            0x00,     0,    0,     1,       0,   1282),
    ContextType(BS.TX_CK,       0,   0,                     0x00,     0,    0,     0,       0,   0),
    ContextType(SRT_TRACE,      64,  TYPE_VALID | FW_TRACE, 0x00,     0,    0,     1,       16,  256),
)}
_kinds = sorted(CONTEXT_TYPES)
NEXT_CONTEXT_TYPE = dict(zip(_kinds, _kinds[1:] + [BS.INVALID]))


class FunctionState:
    """One function's firmware state: what HWRM and RCFW commands, doorbells and the data path all read and change."""

    def __init__(self, mem: BusMemory, config: FirmwareConfig) -> None:
        self.mem, self.config = mem, config
        self.interrupts: list[int] = []  # MSI-X vectors for the shell to fire
        self.injected_errors: dict[str, list[int]] = {}  # command name -> [status, remaining count]
        # counters for the debug channel: errors, internal_errors (emulator bugs), ctx_init_missing, legacy_doorbells,
        # l2_doorbells, ignored_doorbells, doorbells_without_valid, cq_doorbells_ignored, ignored_triggers,
        # creq_dropped, hwrm_unanswerable
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
        self.pcie = PcieFunction(config.pcie_path, self.note_error)  # DEVCTL2 lives on through FUNC_RESET

    def clear(self) -> None:
        """FUNC_RESET: the L2 objects and the backing store are gone."""
        for table in (self.rings, self.stat_ctxs, self.vnics, self.l2_filters, self.backing_store):
            table.clear()
        self.queried_context_types.clear()
        self.backing_store_done, self.driver = False, None

    # -- errors ------------------------------------------------------------------------------------------------------
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

    # -- what the function offers ------------------------------------------------------------------------------------
    @property
    def roce_db_offset(self) -> int:
        """Where BAR2's RoCE doorbell page starts: on Thor2 after the legacy L2 doorbells FUNC_QCFG sizes (page
        aligned), on Thor at 0x10000 for a PF (Linux bnxt_re_set_db_offset; this emulated function is a PF)."""
        if self.config.profile.chip_num in THOR_CHIPS:
            return bnxt.BNXT_QPLIB_DBR_PF_DB_OFFSET
        return -(-self.config.profile.legacy_l2_db_size_kb * 1024 // PAGE) * PAGE

    @property
    def stats_length(self) -> int:
        """The statistics block a STAT_CTX_ALLOC must make room for: ctx_hw_stats (160 bytes), or with TPA v2 the
        chip's longer one, 168 bytes on Thor and 176 (ctx_hw_stats_ext) on Thor2 (Linux bnxt_hwrm_vnic_qcaps)."""
        profile = self.config.profile
        if not profile.tpa_v2:
            return 160
        return 168 if profile.chip_num in THOR_CHIPS else 176

    @property
    def ctx_init_ok(self) -> bool:
        """False once any backing-store area arrived without the context initialisation the firmware asked for."""
        return not self.stats["ctx_init_missing"]

    def context_entries(self, kind: int) -> int:
        """Entries of a backing-store type: the fewest configured over its instances, or its maximum until then."""
        configured = [area.entries for (k, _), area in self.backing_store.items() if k == kind]
        return min(configured) if configured else CONTEXT_TYPES[kind].max_entries

    def context_capacity(self, kind: int) -> int:
        """How many objects of a type a driver may create: RoCE QPs (QP1 included), RoCE CQs and MRs through RCFW,
        statistics contexts and VNICs through HWRM, out of what the backing store holds (its maximum until
        configured). Not the firmware's own share: split 0 of QPs and CQs is for the L2 rings, of MRAV the address
        handles (as the driver split it), and only split 0 of the VNIC entries are VNICs (the rest RSS ring tables).
        Every QP also takes a timer context and TQM entries: the slow-path ring holds the VNICs, the L2 QPs, two per
        RoCE QP and the ring's minimum, each fast-path ring every QP (the HSI's tqm_max_entries_per_ring text).
        Inferred: that the firmware refuses the object past these (no source shows a real one at the boundary)."""
        entries = self.context_entries(kind)
        if kind == BS.VNIC:
            return min(entries, CONTEXT_TYPES[BS.VNIC].splits[0])
        if kind == BS.MRAV:
            split = [area.splits[:1] for (k, _), area in self.backing_store.items() if k == kind]
            return max(0, entries - sum(split[0] if split else ()))
        if kind != BS.QP:
            return max(0, entries - sum(CONTEXT_TYPES[kind].splits[:1]))
        l2_qps = CONTEXT_TYPES[BS.QP].splits[0]
        slow_path = (self.context_entries(BS.SP_TQM_RING) - self.context_capacity(BS.VNIC) - l2_qps
                     - CONTEXT_TYPES[BS.SP_TQM_RING].min_entries) // 2
        every_qp = min(entries, self.context_entries(BS.TIM), self.context_entries(BS.FP_TQM_RING))
        return max(0, min(every_qp - l2_qps, slow_path))

    def backing_store_report(self) -> list[dict[str, Any]]:
        """What the driver configured, type by type and instance by instance (the debug channel's "backing_store")."""
        return [{"type": area.kind, "instance": area.instance, "entries": area.entries,
                 "entry_size": area.entry_size, "level": area.level, "splits": list(area.splits)}
                for _, area in sorted(self.backing_store.items())]

    def backing_store_missing(self) -> str | None:
        """Why RoCE cannot start yet, or None: ALL_DONE seen and every valid type and instance configured."""
        if not self.backing_store_done:
            return "backing store not configured (no FUNC_BACKING_STORE_CFG_V2 with BS_CFG_ALL_DONE)"
        for ctx in CONTEXT_TYPES.values():
            missing = [i for i in ctx.instances if ctx.required and (ctx.kind, i) not in self.backing_store]
            if missing:
                return f"backing-store type {ctx.kind:#x} instances {missing} not configured"
        return None
