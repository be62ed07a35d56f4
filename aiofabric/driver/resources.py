"""The function's share of the NIC: the rings, contexts and MSI-X vectors the driver will allocate, reserved with
FUNC_CFG before the first RING_ALLOC, as Linux's bnxt_en does on firmware that answers FUNC_RESOURCE_QCAPS
(__bnxt_reserve_rings, __bnxt_hwrm_reserve_pf_rings): each count with its enable bit, and only when it is not 0. What
is asked is first checked against FUNC_RESOURCE_QCAPS's maxima (bnxt_hwrm_func_resc_qcaps), and the grant is read back
from FUNC_QCFG's alloc_* fields (bnxt_hwrm_get_rings). Without a reservation such firmware lets nothing be allocated.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Awaitable, Callable

from .commands import OWN_FID
from ..autogen import bnxt
from ..errors import PCIError

Hwrm = Callable[..., Awaitable[ctypes.Structure]]  # Device.hwrm: a command by name, its fields as keywords


@dataclasses.dataclass(frozen=True)
class Resource:
    """One kind of resource by its FUNC_CFG count field, with the names FUNC_RESOURCE_QCAPS and FUNC_QCFG give it."""
    enable: int  # FUNC_CFG's enable bit
    maximum: str  # FUNC_RESOURCE_QCAPS's field
    granted: str  # FUNC_QCFG's field
    what: str


RESOURCES = {
    "num_msix": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_MSIX, "max_msix", "alloc_msix", "MSI-X vectors (NQ rings)"),
    "num_cmpl_rings": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_CMPL_RINGS, "max_cmpl_rings", "alloc_cmpl_rings",
                               "completion rings"),
    "num_tx_rings": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_TX_RINGS, "max_tx_rings", "alloc_tx_rings", "TX rings"),
    "num_rx_rings": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_RX_RINGS, "max_rx_rings", "alloc_rx_rings", "RX rings"),
    "num_stat_ctxs": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_STAT_CTXS, "max_stat_ctx", "alloc_stat_ctx",
                              "statistics contexts"),
    "num_vnics": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_VNICS, "max_vnics", "alloc_vnics", "VNICs"),
    "num_rsscos_ctxs": Resource(bnxt.FUNC_CFG_REQ_ENABLES_NUM_RSSCOS_CTXS, "max_rsscos_ctx", "alloc_rsscos_ctx",
                                "RSS contexts"),
}


def request(needs: dict[str, int]) -> dict[str, int]:
    """FUNC_CFG's fields for `needs` (counts by FUNC_CFG field name): each non-zero count and its enable bit."""
    asked = {name: count for name, count in needs.items() if count}
    return {"fid": OWN_FID, "enables": sum(RESOURCES[name].enable for name in asked), **asked}


def shortfall(needs: dict[str, int], answer: ctypes.Structure, field: Callable[[Resource], str]
              ) -> tuple[str, int, int] | None:
    """The first resource `answer` has fewer of than `needs` asks, as (FUNC_CFG field, needed, had), or None;
    `field` names the answer's field for a resource."""
    for name, count in needs.items():
        have = getattr(answer, field(RESOURCES[name]))
        if have < count:
            return name, count, have
    return None


async def reserve(address: str, hwrm: Hwrm, needs: dict[str, int], limits: ctypes.Structure) -> None:
    """Reserve `needs` with FUNC_CFG, after checking them against FUNC_RESOURCE_QCAPS's answer `limits`, and make sure
    FUNC_QCFG reports them all granted. PCIError names a resource the function cannot have enough of."""
    if short := shortfall(needs, limits, lambda r: r.maximum):
        name, count, have = short
        raise PCIError(f"{address}: the driver needs {count} {RESOURCES[name].what} (FUNC_CFG {name}) and the "
                       f"firmware allows this function at most {have} (FUNC_RESOURCE_QCAPS {RESOURCES[name].maximum})")
    await hwrm("func_cfg", **request(needs))
    if short := shortfall(needs, await hwrm("func_qcfg", fid=OWN_FID), lambda r: r.granted):
        name, count, have = short
        raise PCIError(f"{address}: the firmware granted {have} {RESOURCES[name].what} of the {count} FUNC_CFG "
                       f"reserved ({name}; FUNC_QCFG {RESOURCES[name].granted})")
