"""How many entries of each backing-store type a RoCE function gives the firmware, and how deep its page table is, as
Linux's bnxt_en decides on P5 and later chips (bnxt.c bnxt_alloc_ctx_mem, bnxt_setup_ctxm_pg_tbls,
bnxt_alloc_ctx_pg_tbls). Pure: `plan` takes what FUNC_BACKING_STORE_QCAPS_V2 reported per type.

Linux sizes nine types. QPs are the firmware's L2 share (split 0) and QP1s (split 1) plus the RoCE QPs ("extra":
every QP the firmware allows with SW_MAX_RESOURCE_LIMITS, else at most 64 Ki plus the fast-destroy entries, split 2);
SRQs likewise (at most 8 Ki extra); CQs are the L2 share plus two per RoCE QP; VNICs and statistics contexts are
taken at the maximum; MRAV splits between memory regions and address handles; the timer contexts match the QPs; the
slow-path TQM ring holds the VNICs, the L2 QPs, two entries per RoCE QP and QP1, and the ring's minimum; each
fast-path TQM ring the same without the VNICs and the minimum. Each count is rounded up to the type's multiple, then
held to its [min, max]. A type Linux cannot size (not offered, entry size 0, maximum 0, or 0 entries in the end)
fails the probe with -EINVAL: `plan` raises ValueError naming it."""
from __future__ import annotations

from dataclasses import dataclass

from ..hw.firmware import CONFIGURED_CONTEXT_TYPES
from ..hw.firmware import BackingStoreType as BS

PAGE = 4096  # BNXT_PAGE_SIZE: context memory is always cut into 4 KiB pages
PTES_PER_PAGE = PAGE // 8  # MAX_CTX_PAGES
MAX_CTX_PAGES = PTES_PER_PAGE * PTES_PER_PAGE  # MAX_CTX_TOTAL_PAGES: what a two-level table reaches (1 GiB)
MAX_EXTRA_QPS, MAX_EXTRA_SRQS = 65536, 8192  # the RoCE share without SW_MAX_RESOURCE_LIMITS
MAX_MRS, MAX_AHS = 256 * 1024, 128 * 1024  # MRAV without it ("128K extra ... for static AH context allocation")
U32 = 0xFFFFFFFF  # Linux computes the counts in u32


@dataclass(frozen=True)
class TypeCaps:
    """One type as FUNC_BACKING_STORE_QCAPS_V2 reported it (only what the sizing reads)."""
    entry_size: int
    entry_multiple: int
    min_entries: int
    max_entries: int
    splits: tuple[int, ...] = ()  # split_entry_0.. (subtype_valid_cnt of them, at most 4)

    def split(self, index: int) -> int:
        return self.splits[index] if index < len(self.splits) else 0


@dataclass(frozen=True)
class TypePlan:
    """What to configure for one type: entries per instance, PBL level (1 or 2) and the split values to echo."""
    entries: int
    level: int
    splits: tuple[int, ...]


def plan(caps: dict[int, TypeCaps], sw_max_limits: bool) -> dict[int, TypePlan]:
    """Entries, PBL level and splits for each of the nine types a RoCE function configures (bnxt_alloc_ctx_mem).
    `caps` holds the valid types only; `sw_max_limits` is FUNC_QCAPS flags_ext2 SW_MAX_RESOURCE_LIMITS_SUPPORTED."""
    for kind in sorted(CONFIGURED_CONTEXT_TYPES):
        reason = ("is not offered (no TYPE_VALID type in the FUNC_BACKING_STORE_QCAPS_V2 walk)" if kind not in caps
                  else "has entry_size 0" if not caps[kind].entry_size
                  else "has max_num_entries 0" if not caps[kind].max_entries else None)
        if reason:
            raise ValueError(f"backing-store type {BS(kind).name} ({kind:#x}) {reason}: bnxt_en cannot size it "
                             "either and fails its probe (bnxt_setup_ctxm_pg_tbls: -EINVAL)")
    qp, srq = caps[BS.QP], caps[BS.SRQ]
    l2_qps, qp1_qps, fast_qps = qp.split(0), qp.split(1), qp.split(2)
    if sw_max_limits:
        extra_qps = (qp.max_entries - l2_qps - qp1_qps) & U32
        extra_srqs = (srq.max_entries - srq.split(0)) & U32
    else:
        extra_qps = (min(MAX_EXTRA_QPS, (qp.max_entries - l2_qps - qp1_qps) & U32) + fast_qps) & U32
        extra_srqs = min(MAX_EXTRA_SRQS, (srq.max_entries - srq.split(0)) & U32)
    mrav = caps[BS.MRAV]
    if sw_max_limits and len(mrav.splits) == 1:  # the firmware split MRAV itself
        ahs = mrav.split(0)
        mrs, mrav_splits = (mrav.max_entries - ahs) & U32, mrav.splits
    else:
        mrs = min(mrav.max_entries // 2, MAX_MRS)
        ahs = min(mrs, MAX_AHS)
        mrav_splits = (ahs if not mrav.split(0) or mrav.split(0) > ahs else mrav.split(0),)
    qps = l2_qps + qp1_qps + extra_qps
    roce_tqm = 2 * (extra_qps + qp1_qps)
    wanted = {  # per type: (entries asked, PBL depth asked, splits echoed)
        BS.QP: (qps, 2, qp.splits), BS.SRQ: (srq.split(0) + extra_srqs, 2, srq.splits),
        BS.CQ: (caps[BS.CQ].split(0) + 2 * extra_qps, 2, caps[BS.CQ].splits),
        BS.VNIC: (caps[BS.VNIC].max_entries, 1, caps[BS.VNIC].splits),
        BS.STAT: (caps[BS.STAT].max_entries, 1, caps[BS.STAT].splits),
        BS.MRAV: (mrs + ahs, 2, mrav_splits), BS.TIM: (qps, 1, caps[BS.TIM].splits),
        BS.SP_TQM_RING: (caps[BS.VNIC].split(0) + l2_qps + roce_tqm + caps[BS.SP_TQM_RING].min_entries, 2,
                         caps[BS.SP_TQM_RING].splits),
        BS.FP_TQM_RING: (l2_qps + roce_tqm, 2, caps[BS.FP_TQM_RING].splits)}
    return {kind: _held(BS(kind), caps[kind], entries & U32, depth, splits)
            for kind, (entries, depth, splits) in wanted.items()}


def _held(kind: BS, caps: TypeCaps, entries: int, depth: int, splits: tuple[int, ...]) -> TypePlan:
    """Round up to the multiple, hold to [min, max], pick the PBL level (bnxt_setup_ctxm_pg_tbls and
    bnxt_alloc_ctx_pg_tbls)."""
    if caps.entry_multiple:
        entries = -(-entries // caps.entry_multiple) * caps.entry_multiple
    entries = min(max(entries, caps.min_entries), caps.max_entries)
    pages = -(-entries * caps.entry_size // PAGE)
    if not pages:
        raise ValueError(f"backing-store type {kind.name} ({kind:#x}) comes to 0 entries (min_num_entries 0): "
                         "bnxt_en fails its probe on 0 bytes (bnxt_alloc_ctx_pg_tbls: -EINVAL)")
    if pages > MAX_CTX_PAGES:
        raise ValueError(f"backing-store type {kind.name} ({kind:#x}): {entries} entries of {caps.entry_size} bytes "
                         "need more than a two-level page table reaches (bnxt_alloc_ctx_pg_tbls: -EINVAL)")
    return TypePlan(entries, 2 if pages > PTES_PER_PAGE or depth > 1 else 1, splits)
