"""Firmware profiles: which chip the emulated NIC is and what its firmware offers, reported where Linux reads it.

    chip_num           VER_GET chip_num (bnxt_en bp->chip_num; bnxt_re's P5/P7 gates: variable WQEs on P7 only)
    backing_store_v2   FUNC_QCAPS flags_ext BS_V2_SUPPORTED | BS_V2_REQUIRED (bnxt_en BNXT_FW_CAP_BACKING_STORE_V2);
                       without it FUNC_BACKING_STORE_QCAPS_V2/CFG_V2 are not supported
    hw_retx            QUERY_FUNC dev_cap_flags HW_REQUESTER_RETX_ENABLED (bnxt_re _is_hw_retx_supported); without it
                       INITIALIZE_FW refuses HW_REQUESTER_RETX_SUPPORTED
    host_msn_table     QUERY_FUNC dev_cap_ext_flags_2 REQ_RETRANSMISSION_SUPPORT: HOST_MSN_TABLE, else HOST_PSN_TABLE
                       (bnxt_re _is_host_msn_table): the table hardware retransmission reads after each SQ
    short_commands     VER_GET dev_caps_cfg SHORT_CMD_SUPPORTED | SHORT_CMD_REQUIRED (bnxt_en BNXT_FW_CAP_SHORT_CMD);
                       then every request but VER_GET must come in the short format
    max_ext_req_len    VER_GET max_ext_req_len: the longest request in the short format (bnxt_en
                       hwrm_max_ext_req_len); Linux sends a longer one, FUNC_CFG's 160 bytes, in the short format when
                       it fits (bnxt_hwrm_func_cfg_short_req_init, __hwrm_send), else cut to this length
    mr_register_alloc  QUERY_FUNC dev_cap_flags MR_REGISTER_ALLOC (bnxt_re _is_alloc_mr_unified): REGISTER_MR may
                       allocate its key (ALLOC_MR); without it ALLOCATE_MRW must come first
    tpa_v2             VNIC_QCAPS max_aggs_supported is not 0 (bnxt_en bnxt_hwrm_vnic_qcaps): statistics contexts are
                       then the chip's extended size (168 bytes on Thor, 176 on Thor2), else 160
    legacy_l2_db_size_kb  FUNC_QCFG's: on Thor2 the RoCE doorbell page is at BAR2 + this, page aligned; Thor's is at
                       0x10000 whatever it says (bnxt_re_set_db_offset)

The default, "thor2", is a Thor2 (BCM57608) with current firmware. Pure data: hwrm.py and rcfw.py read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..autogen import bnxt


@dataclass(frozen=True)
class FirmwareProfile:
    name: str
    summary: str  # one line, for option errors and docs/emulator.md
    chip_num: int = bnxt.CHIP_NUM_57608
    backing_store_v2: bool = True
    hw_retx: bool = True
    host_msn_table: bool = True
    short_commands: bool = False
    max_ext_req_len: int = bnxt.HWRM_MAX_REQ_LEN
    mr_register_alloc: bool = True
    tpa_v2: bool = True
    legacy_l2_db_size_kb: int = 64


# What every Thor profile's firmware does unlike Thor2's: no MR_REGISTER_ALLOC (ALLOCATE_MRW first), and FUNC_QCFG's
# legacy_l2_db_size_kb left 0. Inferred: Linux ignores that field on P5 (bnxt_re_set_db_offset), so no source says what
# Thor firmware reports; 0, as firmware that predates the field would, puts a driver that reads it below 0x10000.
THOR: dict[str, Any] = {"mr_register_alloc": False, "legacy_l2_db_size_kb": 0}

PROFILES = {profile.name: profile for profile in (
    FirmwareProfile("thor2", "Thor2 (BCM57608): backing store v2, hardware retransmission from the host MSN table"),
    FirmwareProfile("thor", "Thor (BCM57508) firmware: backing store v1 only, no hardware retransmission, the PSN "
                    "search table", chip_num=bnxt.CHIP_NUM_57508, backing_store_v2=False, hw_retx=False,
                    host_msn_table=False, **THOR),
    FirmwareProfile("thor-bs-v2", "Thor (BCM57508) whose firmware offers backing store v2: RoCE doorbells at 0x10000, "
                    "static WQEs, ALLOCATE_MRW before REGISTER_MR, no hardware retransmission, the PSN search table",
                    chip_num=bnxt.CHIP_NUM_57508, hw_retx=False, host_msn_table=False, **THOR),
    FirmwareProfile("psn-table", "Thor2 firmware that wants the PSN search table for hardware retransmission",
                    host_msn_table=False),
    FirmwareProfile("no-hw-retx", "Thor2 firmware without hardware requester retransmission", hw_retx=False),
    FirmwareProfile("short-cmd", "Thor2 firmware that requires short HWRM commands, of up to 256 bytes",
                    short_commands=True, max_ext_req_len=256),
)}
DEFAULT_PROFILE = "thor2"
