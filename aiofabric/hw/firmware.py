"""The two firmware command channels and function-level facts.

HWRM (the ChiMP channel in BAR0, bindings hwrm_*): a request starts with `hwrm_cmd_hdr` (`HWRM_REQUEST_HEADER`), the
answer the firmware DMAs to `resp_addr` with `hwrm_resp_hdr` (`HWRM_RESPONSE_HEADER`), its last byte the valid key
written last. A request whose `cmpl_ring` is `NO_COMPLETION_RING`, as Linux's every polled one is (__hwrm_req_init),
gets no completion and no interrupt: the driver polls the answer. Firmware whose VER_GET asks for short commands
(`short_commands_required`) takes the request from host memory instead: the window then holds only `hwrm_short_input`
(`HWRM_SHORT_REQUEST`, signed `SHORT_REQUEST_SIGNATURE`) naming its address and length (Linux bnxt_hwrm.c
__hwrm_send).

RCFW (the RoCE channel): the driver latches `cmdq_init` (`CMDQ_INIT`) through the BAR0 mailbox at
RCFW_COMM_BASE_OFFSET, then writes commands of `CMDQ_SLOT`-byte slots into the CMDQ ring, each starting with
`cmdq_base` (`CMDQ_HEADER`: opcode, cmd_size in slots, flags, cookie, side-buffer size and address); its first
producer write after cmdq_init carries `CMDQ_FIRST_PRODUCER` (FIRMWARE_FIRST_FLAG). Answers come back on the CREQ
(cqe.py).

Function-level: the chips by generation (`THOR_CHIPS`, P5; `THOR2_CHIPS`, P7), backing-store context types
(`BackingStoreType`; `CONFIGURED_CONTEXT_TYPES` are the ones a driver sizes, `TRACE_CONTEXT_TYPES` hold firmware
logs), QUERY_FUNC's retransmission and MR capabilities (`hw_retx_supported`, `host_msn_table`, `mr_register_alloc`),
the statistics block's length (`ring_stats_size`), where the RoCE doorbells are (`roce_doorbell_offset`), the
page-size codes of page-table fields (`PAGE_SIZE_CODES`), PORT_PHY_QCFG's link speed codes in Mb/s
(`LINK_SPEED_MBPS`), the entry size of each HWRM ring type (`RING_ENTRY_SIZES`), and page tables: arrays of
`PTE_SIZE`-byte entries (`ptu_pte`, `ptu_pde`) holding a page address with flag bits below it (`PTE_FLAGS`:
PTU_PTE_VALID, _LAST, _NEXT_TO_LAST), packed and read by `pack_ptes` / `unpack_ptes`.
"""
from __future__ import annotations

import ctypes
import enum
import struct
from typing import Sequence

from .layout import Layout
from .names import constant_names, constants
from ..autogen import bnxt

HWRM_REQUEST_HEADER = Layout.of(bnxt.hwrm_cmd_hdr, "req_type", "cmpl_ring", "seq_id", "target_id", "resp_addr")
HWRM_RESPONSE_HEADER = Layout.of(bnxt.hwrm_resp_hdr, "error_code", "req_type", "seq_id", "resp_len")
HWRM_SHORT_REQUEST = Layout.of(bnxt.hwrm_short_input, "req_type", "signature", "target_id", "size", "req_addr")
SHORT_REQUEST_SIGNATURE = bnxt.SHORT_REQ_SIGNATURE_SHORT_CMD
_SHORT_COMMANDS = bnxt.VER_GET_RESP_DEV_CAPS_CFG_SHORT_CMD_SUPPORTED | bnxt.VER_GET_RESP_DEV_CAPS_CFG_SHORT_CMD_REQUIRED
HWRM_ERROR_NAMES = constant_names("HWRM_ERR_CODE_")
NO_COMPLETION_RING = 0xFFFF  # Linux BNXT_HWRM_NO_CMPL_RING

CMDQ_SLOT = ctypes.sizeof(bnxt.cmdq_base)  # a command is a whole number of these (Linux: struct bnxt_qplib_cmdqe)
CMDQ_HEADER = Layout.of(bnxt.cmdq_base, "opcode", "cmd_size", "flags", "cookie", "resp_size", "resp_addr")
CMDQ_INIT = Layout.of(bnxt.cmdq_init, "cmdq_pbl", "cmdq_size_cmdq_lvl", "creq_ring_id", "prod_idx")
CMDQ_FIRST_PRODUCER = 1 << bnxt.FIRMWARE_FIRST_FLAG
RCFW_STATUS_NAMES = constant_names("CREQ_QP_EVENT_STATUS_")

THOR_CHIPS = frozenset({bnxt.CHIP_NUM_57508, bnxt.CHIP_NUM_57504, bnxt.CHIP_NUM_57502})  # bnxt_qplib_is_chip_gen_p5
THOR2_CHIPS = frozenset({bnxt.CHIP_NUM_57608, bnxt.CHIP_NUM_58818})  # bnxt_qplib_is_chip_gen_p7
_HW_RETX = (bnxt.CREQ_QUERY_FUNC_RESP_SB_HW_REQUESTER_RETX_ENABLED
            | bnxt.CREQ_QUERY_FUNC_RESP_SB_HW_RESPONDER_RETX_ENABLED)
_RETX_TABLE = bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_MASK


def short_commands_required(dev_caps_cfg: int) -> bool:
    """VER_GET's dev_caps_cfg asks for the short command format: SUPPORTED and REQUIRED both set (bnxt_en
    bnxt_hwrm_ver_get, BNXT_FW_CAP_SHORT_CMD)."""
    return dev_caps_cfg & _SHORT_COMMANDS == _SHORT_COMMANDS


def hw_retx_supported(dev_cap_flags: int) -> bool:
    """QUERY_FUNC's dev_cap_flags offer hardware retransmission, which INITIALIZE_FW then asks for with
    HW_REQUESTER_RETX_SUPPORTED (Linux bnxt_re _is_hw_retx_supported, bnxt_qplib_init_rcfw)."""
    return bool(dev_cap_flags & _HW_RETX)


def mr_register_alloc(dev_cap_flags: int) -> bool:
    """QUERY_FUNC's dev_cap_flags let REGISTER_MR allocate the MR's key itself (ALLOC_MR, the key field carrying the
    PD); without MR_REGISTER_ALLOC, ALLOCATE_MRW makes the key first (Linux bnxt_re _is_alloc_mr_unified)."""
    return bool(dev_cap_flags & bnxt.CREQ_QUERY_FUNC_RESP_SB_MR_REGISTER_ALLOC)


def host_msn_table(dev_cap_ext_flags_2: int) -> bool:
    """QUERY_FUNC's dev_cap_ext_flags_2 want the host MSN table after each SQ (sq_msn_search); otherwise the PSN
    search table (sq_psn_search_ext) (Linux bnxt_re _is_host_msn_table)."""
    return dev_cap_ext_flags_2 & _RETX_TABLE == bnxt.CREQ_QUERY_FUNC_RESP_SB_REQ_RETRANSMISSION_SUPPORT_HOST_MSN_TABLE


class BackingStoreType(enum.IntEnum):
    """FUNC_BACKING_STORE_QCAPS_V2 / CFG_V2 context types (FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_*) used here."""
    QP = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_QP
    SRQ = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_SRQ
    CQ = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_CQ
    VNIC = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_VNIC
    STAT = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_STAT
    SP_TQM_RING = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_SP_TQM_RING
    FP_TQM_RING = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_FP_TQM_RING
    MRAV = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_MRAV
    TIM = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_TIM
    TX_CK = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_TX_CK
    INVALID = bnxt.FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_INVALID  # ends the next_valid_type walk


# What bnxt_en's bnxt_alloc_ctx_mem sizes for a RoCE function: QP through TIM (below BNXT_CTX_MAX). It configures the
# trace types only to collect firmware logs (bnxt_backing_store_cfg_v2, bnxt_bs_trace_avail), and none of the rest.
CONFIGURED_CONTEXT_TYPES = frozenset(kind for kind in BackingStoreType if kind <= BackingStoreType.TIM)
TRACE_CONTEXT_TYPES = frozenset(kind for name, kind in constants("FUNC_BACKING_STORE_QCAPS_V2_REQ_TYPE_").items()
                                if name.endswith("_TRACE"))


def ring_stats_size(chip_num: int, max_aggs_supported: int) -> int:
    """STAT_CTX_ALLOC's stats_dma_length: the counters of `ctx_hw_stats` (160 bytes), or, when VNIC_QCAPS reports
    TPA v2 (`max_aggs_supported`), the chip's longer block: 168 bytes on Thor (BNXT_RING_STATS_SIZE_P5), 176 on Thor2
    (BNXT_RING_STATS_SIZE_P7, ctx_hw_stats_ext) (Linux bnxt_hwrm_vnic_qcaps; bnxt_re uses the same length)."""
    tpa = bnxt.BNXT_NUM_TPA_RING_STATS
    if max_aggs_supported:
        tpa = bnxt.BNXT_NUM_TPA_RING_STATS_P5 if chip_num in THOR_CHIPS else bnxt.BNXT_NUM_TPA_RING_STATS_P7
    return (bnxt.BNXT_NUM_RX_RING_STATS + bnxt.BNXT_NUM_TX_RING_STATS + tpa) * 8


def roce_doorbell_offset(chip_num: int, legacy_l2_db_size_kb: int, page_size: int) -> int:
    """Where BAR2's RoCE doorbell page starts for a PF: on Thor at BNXT_QPLIB_DBR_PF_DB_OFFSET (0x10000) whatever
    FUNC_QCFG says; on Thor2 after the legacy L2 doorbells, FUNC_QCFG's legacy_l2_db_size_kb rounded up to a page
    (Linux bnxt_re_set_db_offset, bnxt_en bnxt_hwrm_func_qcfg)."""
    if chip_num in THOR_CHIPS:
        return bnxt.BNXT_QPLIB_DBR_PF_DB_OFFSET
    return -(-legacy_l2_db_size_kb * 1024 // page_size) * page_size


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
PAGE_SIZE_CODES = {  # page-size code (after the field's shift) -> bytes: CMDQ_CREATE_QP_SQ_PG_SIZE_PG_4K is 4 KiB
    code >> bnxt.CMDQ_CREATE_QP_SQ_PG_SIZE_SFT: int(name[3:-1]) * _UNITS[name[-1]]
    for name, code in constants("CMDQ_CREATE_QP_SQ_PG_SIZE_").items() if name.startswith("PG_")}

LINK_SPEED_MBPS = {  # PORT_PHY_QCFG link_speed code -> Mb/s: PORT_PHY_QCFG_RESP_LINK_SPEED_400GB is 400000
    code: int(float(name[:-2].replace("_", ".")) * (1000 if name.endswith("GB") else 1))
    for name, code in constants("PORT_PHY_QCFG_RESP_LINK_SPEED_").items() if name[0].isdigit()}

L2_RING_ENTRY = 16  # tx_bd, rx_prod_pkt_bd and cmpl_base (hsi.h) are all 16 bytes; the bindings do not carry them
RING_ENTRY_SIZES = {  # HWRM RING_ALLOC ring type -> bytes per entry
    bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL: L2_RING_ENTRY, bnxt.RING_ALLOC_REQ_RING_TYPE_TX: L2_RING_ENTRY,
    bnxt.RING_ALLOC_REQ_RING_TYPE_RX: L2_RING_ENTRY, bnxt.RING_ALLOC_REQ_RING_TYPE_RX_AGG: L2_RING_ENTRY,
    bnxt.RING_ALLOC_REQ_RING_TYPE_ROCE_CMPL: ctypes.sizeof(bnxt.cq_base),
    bnxt.RING_ALLOC_REQ_RING_TYPE_NQ: ctypes.sizeof(bnxt.nq_base)}

PTE_SIZE = ctypes.sizeof(bnxt.ptu_pte)  # two little-endian dwords, low first: one little-endian 64-bit entry
PTE_FLAGS = (1 << bnxt.PTU_PTE_PAGE_SFT) - 1  # PTU_PTE_PAGE_MASK masks only the low dword; the address goes on above
_PTE_CODE = "Q"


def add_gid_fields(gid: bytes, mac: bytes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """ADD_GID's `gid` and `src_mac` fields for a GID and a MAC: the GID's 16 bytes fully reversed (Linux:
    gid[i] = cpu_to_be32(dw[3 - i])) as four little-endian words, the MAC's three 16-bit words byte-swapped
    (cpu_to_be16). MODIFY_QP's dgid and dest_mac, unlike these, carry the bytes as they are."""
    return (tuple(int.from_bytes(gid[::-1][i:i + 4], "little") for i in range(0, 16, 4)),
            tuple(int.from_bytes(mac[i:i + 2], "big") for i in range(0, 6, 2)))


def add_gid_values(gid_field: bytes, mac_field: bytes) -> tuple[bytes, bytes]:
    """The GID and MAC an ADD_GID names, from its fields' bytes (the inverse of `add_gid_fields`)."""
    return gid_field[::-1], bytes(mac_field[i ^ 1] for i in range(6))


def pack_ptes(entries: Sequence[int]) -> bytes:
    """A page table (or directory) of `entries`: page addresses with their PTU_PTE_* / PTU_PDE_* flags."""
    return struct.pack(f"<{len(entries)}{_PTE_CODE}", *entries)


def unpack_ptes(buffer: bytes | bytearray | memoryview, count: int) -> tuple[int, ...]:
    """The first `count` entries of a page table."""
    return struct.unpack_from(f"<{count}{_PTE_CODE}", buffer)
