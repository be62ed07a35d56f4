"""The driver's reservation (driver/resources.py), against answers a firmware could give: FUNC_CFG carries each
count that is not 0 with its enable bit (Linux __bnxt_hwrm_reserve_pf_rings), and a maximum or a grant short of the
need stops the boot naming the resource (bnxt_hwrm_func_resc_qcaps, bnxt_hwrm_get_rings)."""
import pytest

from aiofabric.autogen import bnxt
from aiofabric.driver import resources
from aiofabric.errors import PCIError

pytestmark = pytest.mark.anyio
NEEDS = {"num_msix": 3, "num_cmpl_rings": 1, "num_tx_rings": 0, "num_rx_rings": 1, "num_stat_ctxs": 1,
         "num_vnics": 1, "num_rsscos_ctxs": 0}


def answers(limit: int = 8, grant: dict | None = None):
    """A FUNC_RESOURCE_QCAPS answer allowing `limit` of everything, and an HWRM stand-in that records FUNC_CFG and
    answers FUNC_QCFG with what it reserved, less `grant`'s shortfalls."""
    limits = bnxt.hwrm_func_resource_qcaps_output(**{r.maximum: limit for r in resources.RESOURCES.values()})
    sent = []

    async def hwrm(name, **fields):
        sent.append((name, fields))
        if name == "func_qcfg":
            reserved = {**sent[0][1], **(grant or {})}
            return bnxt.hwrm_func_qcfg_output(**{r.granted: reserved.get(n, 0) for n, r in resources.RESOURCES.items()})
        return bnxt.hwrm_func_cfg_output()
    return limits, hwrm, sent


def test_func_cfg_carries_each_count_that_is_not_0_with_its_enable_bit():
    fields = resources.request(NEEDS)
    assert fields == {"fid": 0xFFFF, "num_msix": 3, "num_cmpl_rings": 1, "num_rx_rings": 1, "num_stat_ctxs": 1,
                      "num_vnics": 1, "enables": bnxt.FUNC_CFG_REQ_ENABLES_NUM_MSIX
                      | bnxt.FUNC_CFG_REQ_ENABLES_NUM_CMPL_RINGS | bnxt.FUNC_CFG_REQ_ENABLES_NUM_RX_RINGS
                      | bnxt.FUNC_CFG_REQ_ENABLES_NUM_STAT_CTXS | bnxt.FUNC_CFG_REQ_ENABLES_NUM_VNICS}


@pytest.mark.loop_agnostic
async def test_a_need_equal_to_the_maximum_and_granted_in_full_boots():
    limits, hwrm, sent = answers(limit=3)
    await resources.reserve("nic", hwrm, NEEDS, limits)
    assert [name for name, _ in sent] == ["func_cfg", "func_qcfg"]


@pytest.mark.loop_agnostic
async def test_a_need_past_the_maximum_is_refused_before_asking():
    limits, hwrm, sent = answers(limit=2)
    with pytest.raises(PCIError, match=r"nic: the driver needs 3 MSI-X vectors \(NQ rings\) \(FUNC_CFG num_msix\) and "
                       r"the firmware allows this function at most 2 \(FUNC_RESOURCE_QCAPS max_msix\)"):
        await resources.reserve("nic", hwrm, NEEDS, limits)
    assert sent == []


@pytest.mark.loop_agnostic
async def test_a_grant_short_of_the_reservation_is_refused():
    limits, hwrm, _ = answers(grant={"num_vnics": 0})
    with pytest.raises(PCIError, match=r"nic: the firmware granted 0 VNICs of the 1 FUNC_CFG reserved \(num_vnics; "
                       r"FUNC_QCFG alloc_vnics\)"):
        await resources.reserve("nic", hwrm, NEEDS, limits)
