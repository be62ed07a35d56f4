"""Work-queue entries: what the driver writes into send and receive queues, and the SQ's MSN table.

Send queue: 16-byte slots (`SQ_SLOT`, the size of `sq_sge`). A WQE is a 32-byte header (`SQ_WQE_HEADER_SLOTS` slots:
`sq_rdma_hdr` for WRITE, WRITE_W_IMMEAD and READ, `sq_send_hdr` for SEND and SEND_W_IMMEAD) followed by
`wqe_size - 2` SGE slots (`sq_sge`) or inline data. In variable-WQE mode (CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_
ENABLED) WQEs are packed slot by slot, every slot wrapping on its own, and the SQ doorbell names a slot; in static
mode every WQE takes `SQ_STATIC_WQE_SLOTS` (the size of `sq_send`) and the doorbell names a WQE. Both headers keep
wqe_type, flags, wqe_size, the immediate and the length at the same offsets (tests/test_hw.py holds them to it), so a
device reads any WQE's first three slots with `SQ_RDMA_HEADER_AND_SGE` and lets wqe_type say which fields count.

MSN table (`sq_msn_search`, hardware retransmission): one 8-byte entry per message right after the ring's last slot,
indexed by a message count modulo `msn_table_entries(slots)`; `msn_entry` packs it.

Receive queue: `rq_wqe_hdr` (32 bytes) then the SGEs; the driver's `wr_id[0]` comes back in
`cq_res_rc.srq_or_rq_wr_id` (masked by CQ_RES_RC_SRQ_OR_RQ_WR_ID_MASK).
"""
from __future__ import annotations

import ctypes

from ..autogen import bnxt
from .layout import Layout

SQ_SLOT = ctypes.sizeof(bnxt.sq_sge)
SQ_WQE_HEADER_SLOTS = ctypes.sizeof(bnxt.sq_rdma_hdr) // SQ_SLOT
SQ_STATIC_WQE_SLOTS = ctypes.sizeof(bnxt.sq_send) // SQ_SLOT
RQ_WQE_HEADER_SLOTS = ctypes.sizeof(bnxt.rq_wqe_hdr) // SQ_SLOT
RDMA_WQE_TYPES = frozenset({bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE, bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_W_IMMEAD,
                            bnxt.SQ_RDMA_HDR_WQE_TYPE_READ_WQE})  # the WQE types whose header is sq_rdma_hdr

SGE = Layout.of(bnxt.sq_sge, "va_or_pa", "l_key", "size")
SQ_RDMA_HEADER = Layout.of(bnxt.sq_rdma_hdr, "wqe_type", "flags", "wqe_size", "imm_data", "length", "remote_va",
                           "remote_key", "timestamp")
SQ_SEND_HEADER = Layout.of(bnxt.sq_send_hdr, "wqe_type", "flags", "wqe_size", "inv_key_or_imm_data", "length",
                           "q_key", "dst_qp", "avid", "timestamp")
SQ_RDMA_HEADER_AND_SGE = SQ_RDMA_HEADER + SGE
RQ_WQE_HEADER = Layout.of(bnxt.rq_wqe_hdr, "wqe_type", "flags", "wqe_size", "wr_id")  # wr_id unpacks as 2 values
MSN_ENTRY = Layout.of(bnxt.sq_msn_search, "start_idx_next_psn_start_psn")

_START_PSN = bnxt.SQ_MSN_SEARCH_START_PSN_SFT, bnxt.SQ_MSN_SEARCH_START_PSN_MASK
_NEXT_PSN = bnxt.SQ_MSN_SEARCH_NEXT_PSN_SFT, bnxt.SQ_MSN_SEARCH_NEXT_PSN_MASK
_START_IDX = bnxt.SQ_MSN_SEARCH_START_IDX_SFT, bnxt.SQ_MSN_SEARCH_START_IDX_MASK


def msn_entry(start_psn: int, next_psn: int, start_idx: int) -> int:
    """The 64-bit MSN table entry of one message: its first PSN, the PSN after its last, and the SQ slot its WQE
    starts at (Linux bnxt_re_update_msn_tbl)."""
    return (start_psn << _START_PSN[0] & _START_PSN[1] | next_psn << _NEXT_PSN[0] & _NEXT_PSN[1]
            | start_idx << _START_IDX[0] & _START_IDX[1])


def msn_fields(entry: int) -> tuple[int, int, int]:
    """(start_psn, next_psn, start_idx) of a 64-bit MSN table entry."""
    return ((entry & _START_PSN[1]) >> _START_PSN[0], (entry & _NEXT_PSN[1]) >> _NEXT_PSN[0],
            (entry & _START_IDX[1]) >> _START_IDX[0])


def msn_table_entries(sq_slots: int) -> int:
    """Entries of the MSN table of a variable-WQE SQ of `sq_slots` slots: half its slot count rounded up to a power
    of two (Linux bnxt_qplib_create_qp, msn_tbl_sz)."""
    return (1 << (sq_slots - 1).bit_length()) // 2
