"""The L2 receive path a RoCE function needs for ingress: a completion ring on the RoCE NQ, an RX ring, a VNIC and
the MAC's filter, allocated as Linux's bnxt_en allocates them on P5 and later chips (bnxt_hwrm_ring_alloc,
bnxt_hwrm_vnic_cfg, bnxt_hwrm_set_vnic_filter). Each is freed at close, in the reverse order (teardown.py).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from .rings import Ring
from .teardown import Teardown
from ..autogen import bnxt
from ..hw.firmware import RING_ENTRY_SIZES
from ..pci import PCIDevice

Command = Callable[..., Awaitable[Any]]
RING_DEPTH = 64
RX_BUF_SIZE = 2048
MRU = 9018


async def open_path(pci: PCIDevice, hwrm: Command, hwrm_at_close: Command, alloc_ring: Callable[..., Awaitable[int]],
                    teardown: Teardown, nq_id: int, mac_address: bytes) -> None:
    """Allocate the path; `hwrm` runs a command now, `hwrm_at_close` is what a close's frees go through."""
    nq_enable = bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID
    completion = Ring(pci, RING_DEPTH, RING_ENTRY_SIZES[bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL], queue=False)
    cmpl_id = await alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL, completion, enables=nq_enable, nq_ring_id=nq_id)
    receive = Ring(pci, RING_DEPTH, RING_ENTRY_SIZES[bnxt.RING_ALLOC_REQ_RING_TYPE_RX])
    rx_id = await alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_RX, receive, rx_buf_size=RX_BUF_SIZE,
                             enables=nq_enable | bnxt.RING_ALLOC_REQ_ENABLES_RX_BUF_SIZE_VALID, nq_ring_id=nq_id)
    vnic = (await hwrm("vnic_alloc")).vnic_id
    teardown.on_close("HWRM vnic_free", lambda: hwrm_at_close("vnic_free", vnic_id=vnic))
    await hwrm("vnic_cfg", vnic_id=vnic, mru=MRU, default_rx_ring_id=rx_id, default_cmpl_ring_id=cmpl_id,
               enables=bnxt.VNIC_CFG_REQ_ENABLES_DEFAULT_RX_RING_ID  # and the mru without its enable:
               | bnxt.VNIC_CFG_REQ_ENABLES_DEFAULT_CMPL_RING_ID)  # Linux bnxt_hwrm_vnic_cfg on P5+
    l2_filter = await hwrm(
        "cfa_l2_filter_alloc", l2_addr=tuple(mac_address),
        flags=bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_PATH_RX | bnxt.CFA_L2_FILTER_ALLOC_REQ_FLAGS_OUTERMOST,
        l2_addr_mask=(0xFF,) * 6, dst_id=vnic,
        enables=bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_L2_ADDR | bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_L2_ADDR_MASK
        | bnxt.CFA_L2_FILTER_ALLOC_REQ_ENABLES_DST_ID)
    filter_id = l2_filter.l2_filter_id
    teardown.on_close("HWRM cfa_l2_filter_free", lambda: hwrm_at_close("cfa_l2_filter_free", l2_filter_id=filter_id))
