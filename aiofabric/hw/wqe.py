"""Work-queue entries: what the driver writes into send and receive queues, and the SQ's MSN table.

Send queue: 16-byte slots (`SQ_SLOT`, the size of `sq_sge`). A WQE is a 32-byte header (`SQ_WQE_HEADER_SLOTS` slots:
`sq_rdma_hdr` for WRITE, WRITE_W_IMMEAD and READ, `sq_send_hdr` for SEND and SEND_W_IMMEAD, `sq_atomic_hdr` for
ATOMIC_CS and ATOMIC_FA) followed by `wqe_size - 2` SGE slots (`sq_sge`) or inline data. In variable-WQE mode
(CMDQ_CREATE_QP_QP_FLAGS_VARIABLE_SIZED_WQE_ENABLED) WQEs are packed slot by slot, every slot wrapping on its own, and
the SQ doorbell names a slot; in static mode every WQE takes `SQ_STATIC_WQE_SLOTS` (the size of `sq_send`, 128
bytes: room for `STATIC_WQE_SGES` SGEs; RQ WQEs are as large) and the doorbell names a WQE. The RDMA and SEND headers
keep wqe_type, flags, wqe_size, the immediate and the length at the same offsets (tests/unit/test_hw.py holds them to
it), so a device reads any WQE's first three slots with `SQ_RDMA_HEADER_AND_SGE` and lets wqe_type say which fields
count. An atomic WQE is its header and one SGE of
`ATOMIC_SIZE` bytes, where the original remote value lands; its header keeps wqe_type, flags and wqe_size there too,
then the remote key and address, the swap (or add) value and the compare value (`SQ_ATOMIC_HEADER`).

Search table: right after the ring's last slot, where the chip finds the message it retransmits. Firmware that wants
the host MSN table (hw.firmware.host_msn_table) takes one `sq_msn_search` per message, indexed by a message count
(`msn_entry` packs it); other firmware takes the PSN search table, one `sq_psn_search_ext` (the P5/P7 form) per WQE
at the WQE's start (`psn_search_values` packs it). `SqGeometry` sizes and indexes both as Linux does.

Receive queue: `rq_wqe_hdr` (32 bytes) then the SGEs; the driver's `wr_id[0]` comes back in
`cq_res_rc.srq_or_rq_wr_id` (masked by CQ_RES_RC_SRQ_OR_RQ_WR_ID_MASK).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct

from .layout import Layout
from .ring import power_of_two
from ..autogen import bnxt

SQ_SLOT = ctypes.sizeof(bnxt.sq_sge)
SQ_WQE_HEADER_SLOTS = ctypes.sizeof(bnxt.sq_rdma_hdr) // SQ_SLOT
SQ_STATIC_WQE_SLOTS = ctypes.sizeof(bnxt.sq_send) // SQ_SLOT
STATIC_WQE_SGES = SQ_STATIC_WQE_SLOTS - SQ_WQE_HEADER_SLOTS  # 6 (Linux BNXT_STATIC_MAX_SGE): SQ and RQ WQEs alike
STATIC_SQ_RESERVED_WQES = 128  # kept free in a static SQ beyond what is posted (Linux BNXT_QPLIB_RESERVED_QP_WRS)
RQ_WQE_HEADER_SLOTS = ctypes.sizeof(bnxt.rq_wqe_hdr) // SQ_SLOT
RDMA_WQE_TYPES = frozenset({bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_WQE, bnxt.SQ_RDMA_HDR_WQE_TYPE_WRITE_W_IMMEAD,
                            bnxt.SQ_RDMA_HDR_WQE_TYPE_READ_WQE})  # the WQE types whose header is sq_rdma_hdr
ATOMIC_WQE_TYPES = frozenset({bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_CS, bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_FA})
ATOMIC_SIZE = bnxt.sq_atomic_hdr.swap_data.size  # bytes an atomic reads and writes, at either end

SGE = Layout.of(bnxt.sq_sge, "va_or_pa", "l_key", "size")
SQ_RDMA_HEADER = Layout.of(bnxt.sq_rdma_hdr, "wqe_type", "flags", "wqe_size", "imm_data", "length", "remote_va",
                           "remote_key", "timestamp")
SQ_SEND_HEADER = Layout.of(bnxt.sq_send_hdr, "wqe_type", "flags", "wqe_size", "inv_key_or_imm_data", "length",
                           "q_key", "dst_qp", "avid", "timestamp")
SQ_RDMA_HEADER_AND_SGE = SQ_RDMA_HEADER + SGE
# reserved16's first byte is where every other header keeps wqe_size: rdma-core's bnxt_re writes the atomic WQE's size
# there too (bnxt_re_build_send_sqe), and a device that steps over WQEs by their size reads it there. FETCH_ADD's
# addend goes in swap_data (rdma-core's bnxt_re_build_fna_sqe): AtomicETH's Swap/Add field.
SQ_ATOMIC_HEADER = Layout.of(bnxt.sq_atomic_hdr, "wqe_type", "flags", "reserved16", "remote_key", "remote_va",
                             "swap_data", "cmp_data")
RQ_WQE_HEADER = Layout.of(bnxt.rq_wqe_hdr, "wqe_type", "flags", "wqe_size", "wr_id")  # wr_id unpacks as 2 values
MSN_ENTRY = Layout.of(bnxt.sq_msn_search, "start_idx_next_psn_start_psn")
PSN_SEARCH_ENTRY = Layout.of(bnxt.sq_psn_search_ext, "opcode_start_psn", "flags_next_psn", "start_slot_idx")


@functools.lru_cache(maxsize=64)
def repeated(layout: Layout, count: int) -> struct.Struct:
    """`count` entries of `layout` back to back: a run of WQEs (or of MSN entries) packed in one call."""
    return struct.Struct("<" + layout.format.lstrip("<") * count)


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


_OPCODE = bnxt.SQ_PSN_SEARCH_EXT_OPCODE_SFT, bnxt.SQ_PSN_SEARCH_EXT_OPCODE_MASK
_SEARCH_START_PSN = bnxt.SQ_PSN_SEARCH_EXT_START_PSN_SFT, bnxt.SQ_PSN_SEARCH_EXT_START_PSN_MASK
_SEARCH_NEXT_PSN = bnxt.SQ_PSN_SEARCH_EXT_NEXT_PSN_SFT, bnxt.SQ_PSN_SEARCH_EXT_NEXT_PSN_MASK


def psn_search_values(wqe_type: int, start_psn: int, next_psn: int, start_slot: int) -> tuple[int, int, int]:
    """PSN_SEARCH_ENTRY's values for one WQE: its type and first PSN, the PSN after its last (flags 0), the slot it
    starts at (Linux bnxt_qplib_fill_psn_search, P5/P7)."""
    return (wqe_type << _OPCODE[0] & _OPCODE[1] | start_psn << _SEARCH_START_PSN[0] & _SEARCH_START_PSN[1],
            next_psn << _SEARCH_NEXT_PSN[0] & _SEARCH_NEXT_PSN[1], start_slot)


def psn_search_fields(opcode_start_psn: int, flags_next_psn: int, start_slot: int) -> tuple[int, int, int]:
    """(start_psn, next_psn, start_slot) of PSN_SEARCH_ENTRY's values: what `msn_fields` gives for an MSN entry."""
    return ((opcode_start_psn & _SEARCH_START_PSN[1]) >> _SEARCH_START_PSN[0],
            (flags_next_psn & _SEARCH_NEXT_PSN[1]) >> _SEARCH_NEXT_PSN[0], start_slot)


@dataclasses.dataclass(frozen=True)
class SqGeometry:
    """One send queue as CREATE_QP names it: `size` is its sq_size, slots with `variable` WQEs or WQEs without;
    `host_msn` says which search table follows the ring. Linux: bnxt_qplib_create_qp, bnxt_re_set_sq_size,
    bnxt_qplib_pull_psn_buff."""
    variable: bool
    size: int
    host_msn: bool

    @property
    def slot_unit(self) -> int:
        """Slots per unit of the doorbell index: 1, or a whole static WQE (Linux _set_sq_max_slot)."""
        return 1 if self.variable else SQ_STATIC_WQE_SLOTS

    @property
    def slots(self) -> int:
        return self.size * self.slot_unit

    @property
    def table_offset(self) -> int:
        """Bytes from the start of the ring to the search table."""
        return self.slots * SQ_SLOT

    @property
    def table_entry(self) -> Layout:
        return MSN_ENTRY if self.host_msn else PSN_SEARCH_ENTRY

    @property
    def table_entries(self) -> int:
        """The MSN table: sq_size rounded up to a power of two, halved with variable WQEs (msn_tbl_sz); the PSN search
        table: one entry per sq_size unit."""
        if self.host_msn:
            return power_of_two(self.size) // (2 if self.variable else 1)
        return self.size

    def table_index(self, message: int, start_slot: int) -> int:
        """The entry of the message numbered `message` (from 0 at RESET) whose WQE starts at ring slot `start_slot`."""
        return (message if self.host_msn else start_slot // self.slot_unit) % self.table_entries

    def entry_fields(self, values: tuple[int, ...]) -> tuple[int, int, int]:
        """(start_psn, next_psn, start_slot) of an entry unpacked with `table_entry`."""
        return msn_fields(values[0]) if self.host_msn else psn_search_fields(*values)
