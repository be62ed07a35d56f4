"""The function's share of the NIC (sans-IO): what FUNC_RESOURCE_QCAPS offers, what FUNC_CFG reserved, and the
allocations that count against the reservation.

Linux's bnxt_en reserves before it allocates, on every firmware that answers FUNC_RESOURCE_QCAPS (its "new resource
manager", BNXT_NEW_RM): __bnxt_hwrm_reserve_pf_rings sends FUNC_CFG with a count and its enable bit for MSI-X vectors
(NQs), completion, TX and RX rings, statistics contexts, VNICs and RSS contexts, and bnxt_hwrm_get_rings reads the
grant back from FUNC_QCFG's alloc_* fields. bnxt_re only uses what bnxt_en reserved, the CREQ and its NQs among the
MSI-X vectors. Linux forgets its reservation after every FUNC_RESET (bnxt_clear_reservations in bnxt_resume and the
slot reset) and keeps it across a close, so a reservation lasts until FUNC_RESET here.

Inferred (no source says what real firmware answers): an allocation past the reservation, and a FUNC_CFG asking more
than FUNC_RESOURCE_QCAPS's maximum, fail with RESOURCE_ALLOC_ERROR (Linux maps it to ENOSPC; the HSI says the
*_ASSETS_TEST flags make the firmware "return an error if the requested assets are not available"); a ring of type NQ
counts against num_msix, L2_CMPL and ROCE_CMPL against num_cmpl_rings (pre-P5 Linux counts RoCE rings there), RX_AGG
against num_rx_rings (Linux reserves twice the RX rings with aggregation rings); the minima are 0 (a PF is guaranteed
nothing it did not reserve); an NQ's logical_id, which the HSI says picks its MSI-X vector, must be one of the
num_msix reserved (Linux numbers its vectors 0..n-1 within its grant, bnxt_re's CREQ first), else INVALID_PARAMS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .function import CONTEXT_TYPES
from .objects import CommandError
from ..autogen import bnxt
from ..hw.firmware import BackingStoreType as BS

RESOURCE_ALLOC_ERROR = bnxt.HWRM_ERR_CODE_RESOURCE_ALLOC_ERROR
ASSETS_TEST = sum(getattr(bnxt, f"FUNC_CFG_REQ_FLAGS_{name}_ASSETS_TEST") for name in
                  ("TX", "RX", "CMPL", "RSSCOS_CTX", "RING_GRP", "STAT_CTX", "VNIC", "L2_CTX", "NQ"))
MAX_L2_CTXS = 1024


@dataclass(frozen=True)
class Resource:
    """One kind of resource, by its FUNC_CFG count field, with the names the other commands give it."""
    count: str  # FUNC_CFG's num_* field
    enable: int  # its FUNC_CFG enable bit
    qcaps: str  # FUNC_RESOURCE_QCAPS's max_* and min_* suffix (FUNC_QCAPS has the same max_* where it has one)
    qcfg: str  # FUNC_QCFG's alloc_* field: the grant
    maximum: int
    what: str  # for errors


RESOURCES = {r.count: r for r in (
    Resource("num_msix", bnxt.FUNC_CFG_REQ_ENABLES_NUM_MSIX, "msix", "alloc_msix", 64, "MSI-X vectors (NQ rings)"),
    Resource("num_cmpl_rings", bnxt.FUNC_CFG_REQ_ENABLES_NUM_CMPL_RINGS, "cmpl_rings", "alloc_cmpl_rings", 128,
             "completion rings"),
    Resource("num_tx_rings", bnxt.FUNC_CFG_REQ_ENABLES_NUM_TX_RINGS, "tx_rings", "alloc_tx_rings", 128, "TX rings"),
    Resource("num_rx_rings", bnxt.FUNC_CFG_REQ_ENABLES_NUM_RX_RINGS, "rx_rings", "alloc_rx_rings", 128, "RX rings"),
    Resource("num_stat_ctxs", bnxt.FUNC_CFG_REQ_ENABLES_NUM_STAT_CTXS, "stat_ctx", "alloc_stat_ctx",
             CONTEXT_TYPES[BS.STAT].max_entries, "statistics contexts"),
    Resource("num_vnics", bnxt.FUNC_CFG_REQ_ENABLES_NUM_VNICS, "vnics", "alloc_vnics",
             CONTEXT_TYPES[BS.VNIC].splits[0], "VNICs"),  # the rest of the VNIC entries are RSS ring tables
    Resource("num_rsscos_ctxs", bnxt.FUNC_CFG_REQ_ENABLES_NUM_RSSCOS_CTXS, "rsscos_ctx", "alloc_rsscos_ctx", 64,
             "RSS contexts"),
)}
RING_RESOURCE = {bnxt.RING_ALLOC_REQ_RING_TYPE_NQ: "num_msix", bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL: "num_cmpl_rings",
                 bnxt.RING_ALLOC_REQ_RING_TYPE_ROCE_CMPL: "num_cmpl_rings", bnxt.RING_ALLOC_REQ_RING_TYPE_TX:
                 "num_tx_rings", bnxt.RING_ALLOC_REQ_RING_TYPE_RX: "num_rx_rings",
                 bnxt.RING_ALLOC_REQ_RING_TYPE_RX_AGG: "num_rx_rings"}


def maxima() -> dict[str, int]:
    """FUNC_RESOURCE_QCAPS's maxima for this PF (its minima stay 0; it has no VFs). FUNC_QCAPS has the same fields
    but max_msix."""
    return {**{f"max_{r.qcaps}": r.maximum for r in RESOURCES.values()}, "max_l2_ctxs": MAX_L2_CTXS,
            "max_hw_ring_grps": RESOURCES["num_rx_rings"].maximum}


class Reservation:
    """What FUNC_CFG reserved for the function: nothing until it asks, and nothing again after FUNC_RESET."""

    def __init__(self) -> None:
        self.granted = dict.fromkeys(RESOURCES, 0)

    def clear(self) -> None:
        self.granted = dict.fromkeys(RESOURCES, 0)

    def configure(self, request: Any) -> None:
        """FUNC_CFG's counts whose enable bit is set; all or none (a count past its maximum fails them all). With an
        *_ASSETS_TEST flag the counts are only checked (Linux bnxt_hwrm_check_rings)."""
        asked = {name: getattr(request, name) for name, r in RESOURCES.items() if request.enables & r.enable}
        for name, count in asked.items():
            if count > RESOURCES[name].maximum:
                raise CommandError(RESOURCE_ALLOC_ERROR, f"{name} {count}: this function may reserve at most "
                                   f"{RESOURCES[name].maximum} {RESOURCES[name].what} (FUNC_RESOURCE_QCAPS "
                                   f"max_{RESOURCES[name].qcaps})")
        if not request.flags & ASSETS_TEST:
            self.granted.update(asked)

    def qcfg(self) -> dict[str, int]:
        """FUNC_QCFG's alloc_* fields: the grant."""
        return {r.qcfg: self.granted[name] for name, r in RESOURCES.items()}

    def check(self, name: str, in_use: int, command: str) -> None:
        """Refuse one more of resource `name` when `in_use` of them already fill the reservation."""
        granted = self.granted[name]
        if in_use >= granted:
            raise CommandError(RESOURCE_ALLOC_ERROR, f"{command}: {in_use} {RESOURCES[name].what} in use and FUNC_CFG "
                               f"{name} reserved {granted}: reserve them with FUNC_CFG first")
