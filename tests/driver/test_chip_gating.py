"""Chip and capability gating, end to end on emulated NICs playing each firmware profile (aiofabric/sim/profiles.py):
the driver uses each feature only where Linux finds it (bnxt_en: VER_GET chip_num and dev_caps_cfg, FUNC_QCAPS
flags_ext; bnxt_re: QUERY_FUNC dev_cap_flags and dev_cap_ext_flags_2) and refuses in one line what it does not
support; the emulator's go-backs retransmit from the search table the driver writes, so a wrong entry fails a
transfer under loss."""
import contextlib
import random

import anyio
import pytest

from aiofabric import PCIError, open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import device
from aiofabric.hw.firmware import CONFIGURED_CONTEXT_TYPES, THOR2_CHIPS
from aiofabric.sim.function import CONTEXT_TYPES
from aiofabric.sim.profiles import PROFILES
from aiofabric.verbs import workqueue
from aiofabric.errors import CompletionError, FirmwareError
from tests.support.nics import connected_qps, tag

pytestmark = pytest.mark.anyio
BOOTING = [name for name, profile in PROFILES.items() if profile.backing_store_v2]


@contextlib.asynccontextmanager
async def pair(profile, sq_depth=64, loss=0.0, timeout=8):
    """Two emulated NICs of `profile`, one connected RC QP each (ACK timeout exponent `timeout`); `a` loses `loss`
    of what it sends (seeded)."""
    name = tag()
    async with open_nic(f"sim:a{name}", profile=profile, loss=loss, seed=11) as a, \
            open_nic(f"sim:b{name}", profile=profile) as b:
        qa, qb = await connected_qps(a, b, qp={"sq_depth": sq_depth, "rq_depth": 64}, mtu=1024, timeout=timeout)
        yield a, b, qa, qb


@pytest.mark.loop_agnostic
async def test_an_unknown_profile_is_refused_in_one_line_naming_the_valid_ones():
    with pytest.raises(ValueError, match="^profile='thor3': choose one of thor2, thor, thor-bs-v2, psn-table"):
        async with open_nic("sim", profile="thor3"):
            pass


@pytest.mark.loop_agnostic
async def test_a_chip_that_is_neither_thor_nor_thor2_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(device, "THOR2_CHIPS", frozenset())  # the emulated Thor2 (0x1760) is then unknown
    with pytest.raises(PCIError, match=r"chip 0x1760 is not supported: only Thor \(P5\) and Thor2 \(P7\) chips are "
                                       r"\(VER_GET chip_num\)$"):
        async with open_nic("sim"):
            pass


@pytest.mark.loop_agnostic
async def test_backing_store_v1_firmware_is_refused_in_one_line():
    with pytest.raises(PCIError, match=r"backing store v1 \(pre-Thor2 firmware\) is not supported \(FUNC_QCAPS "
                                       r"flags_ext has no BS_V2_SUPPORTED\)$"):
        async with open_nic("sim", profile="thor"):
            pass


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", BOOTING)
async def test_each_feature_is_used_where_the_firmware_offers_it(profile):
    """Variable WQEs on Thor2 only (bnxt_re_set_drv_mode), hardware retransmission from dev_cap_flags, the MSN or PSN
    search table from dev_cap_ext_flags_2, short commands where VER_GET requires them (a driver that missed any of
    these would fail to boot or to move data here); WRITE, READ and SEND all work."""
    firmware = PROFILES[profile]
    async with pair(profile) as (a, b, qa, qb):
        device = a.device
        assert (device.variable_wqes, device.hw_retransmit, device.host_msn_table) == \
            (firmware.chip_num in THOR2_CHIPS, firmware.hw_retx, firmware.host_msn_table)
        assert (qa.geometry.variable, qa.geometry.host_msn, bool(qa.msn_entries)) == \
            (device.variable_wqes, firmware.host_msn_table, firmware.host_msn_table)
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        source.view[:] = random.Random(3).randbytes(1 << 16)
        with anyio.fail_after(20):
            await qa.write(source, target, 20000)
            await qa.read(source, target, 5000, local_offset=30000, remote_offset=100)
            receive = await qb.post_recv(target, 4096, local_offset=40000)
            await qa.send(source, 3000, local_offset=50000, imm=9)
            assert ((await receive).byte_len, (await receive).imm) == (3000, 9)
        view, remote = bytes(source.view), bytes(target.view)
        assert remote[:20000] == view[:20000] and view[30000:35000] == remote[100:5100]
        assert remote[40000:43000] == view[50000:53000]
        stats = a.pci.debug({"op": "stats"})["stats"]
        assert bool(stats.get("short_commands")) == firmware.short_commands


@pytest.mark.loop_agnostic
async def test_the_backing_store_leaves_the_firmware_trace_buffers_out():
    """bnxt_en configures QP through TIM for a RoCE function, and the trace types only to collect firmware logs."""
    configured = sum(len(ctx.instances) for ctx in CONTEXT_TYPES.values()
                     if ctx.required and ctx.kind in CONFIGURED_CONTEXT_TYPES)
    assert any(not ctx.required and ctx.entry_size for ctx in CONTEXT_TYPES.values())  # a trace buffer is offered
    async with open_nic("sim") as nic:
        assert nic.pci.debug({"op": "objects"})["objects"]["backing_store"] == configured


SIZES = [random.Random(5).randrange(1, 12000) for _ in range(32)]  # unequal: a misnumbered message cannot pass


async def writes_under_loss(profile):
    """Thirty-two WRITEs of 1 B .. 12 KB from a NIC losing 5% of what it sends: True if all land intact. The ACK
    timeout (~67 ms) is long enough that only a loss sends the requester back, never a slow ACK."""
    async with pair(profile, loss=0.05, timeout=14) as (a, b, qa, qb):
        source, target = await a.register_mr(1 << 19), await b.register_mr(1 << 19)
        source.view[:] = random.Random(7).randbytes(1 << 19)
        writes = [await qa.post_write(source, target, size, local_offset=16384 * i, remote_offset=16384 * i)
                  for i, size in enumerate(SIZES)]
        try:
            with anyio.fail_after(30):
                for write in writes:
                    await write
        except CompletionError:
            return False
        assert a.pci.debug({"op": "stats"})["stats"]["go_backs"] > 0  # the loss was recovered by retransmission
        return all(target.view[16384 * i:16384 * i + size] == source.view[16384 * i:16384 * i + size]
                   for i, size in enumerate(SIZES))


RETRANSMITTING = ["thor2", "psn-table", "no-hw-retx", "thor-bs-v2"]


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", RETRANSMITTING)
async def test_writes_under_loss_are_retransmitted_intact(profile):
    assert await writes_under_loss(profile)


def swapped_msn_entry(start_psn, next_psn, start_slot):
    return swapped_msn_entry.correct(next_psn, start_psn, start_slot)


def swapped_psn_search_values(wqe_type, start_psn, next_psn, start_slot):
    return swapped_psn_search_values.correct(wqe_type, next_psn, start_psn, start_slot)


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile,packer", [("thor2", "msn_entry"), ("psn-table", "psn_search_values")])
async def test_a_driver_that_swaps_the_search_entrys_psns_fails_under_loss(profile, packer, monkeypatch):
    """With hardware retransmission the chip resumes from the table the driver writes: with an entry's start and next
    PSN swapped, a go-back resumes at the wrong PSNs and the writes fail. (The one-SGE paths pack MSN entries inline,
    from the shifts swapped here too.)"""
    swapped = {"msn_entry": swapped_msn_entry, "psn_search_values": swapped_psn_search_values}[packer]
    swapped.correct = getattr(workqueue, packer)
    monkeypatch.setattr(workqueue, packer, swapped)
    start_shift, next_shift = workqueue._SP, workqueue._NP
    monkeypatch.setattr(workqueue, "_SP", next_shift)
    monkeypatch.setattr(workqueue, "_NP", start_shift)
    assert not await writes_under_loss(profile)


THOR = "thor-bs-v2"  # the Thor (P5) profile the driver boots


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile, stats_length", [("thor2", 176), (THOR, 168)])
async def test_thor_rings_its_roce_doorbells_at_0x10000_and_sizes_statistics_by_chip(profile, stats_length):
    """bnxt_re_set_db_offset: on P5 the RoCE doorbells are at BAR2 + 0x10000 whatever FUNC_QCFG's
    legacy_l2_db_size_kb says (the Thor profile says 0); bnxt_hwrm_vnic_qcaps: with TPA v2 a statistics context is
    176 bytes on Thor2, 168 on Thor (the emulated firmware refuses any other length)."""
    async with pair(profile) as (a, b, qa, qb):
        for nic in (a, b):  # the CREQ's, NQs' and CQs' doorbells so far all reached the RoCE doorbell page
            assert nic.pci.debug({"op": "stats"})["stats"].get("legacy_doorbells", 0) == 0
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = random.Random(1).randbytes(4096)
        with anyio.fail_after(10):
            await qa.write(source, target, 4096)
        assert bytes(target.view) == bytes(source.view)
        assert (a.device.db_offset, a.device.stats_length) == (0x10000, stats_length)


@pytest.mark.loop_agnostic
async def test_a_thor_qp_has_static_128_byte_wqes_and_128_spare_send_entries():
    """bnxt_re_setup_swqe_size / _rwqe_size: static WQEs are 128 bytes, 6 SGEs, in the SQ and the RQ, whatever the
    QP asked for; bnxt_re_init_sq_attr: the SQ holds 128 + 1 more than asked for (rounded up to a power of two here,
    as bnxt_re_init_depth does for user QPs), and the driver never fills those."""
    async with pair(THOR, sq_depth=200) as (a, b, qa, qb):
        sq_size = 512  # 200 + 129, rounded up
        query = await qa.query()
        assert (query.sq_size, query.sq_sge, query.rq_sge) == (sq_size, 6, 6)
        assert (qa.rq_wqe_size, qa.send_queue.max_wqes) == (128, sq_size - 129)
        sq = qa.send_queue
        assert sq.room(8 * (sq_size - 129), sq_size - 129) and not sq.room(8 * (sq_size - 128), sq_size - 128)
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        source.view[:] = random.Random(2).randbytes(1 << 16)
        with anyio.fail_after(20):
            writes = [await qa.post_write(source, target, 64, local_offset=64 * i, remote_offset=64 * i)
                      for i in range(sq_size - 129)]
            for write in writes:
                await write
        assert bytes(target.view[:64 * (sq_size - 129)]) == bytes(source.view[:64 * (sq_size - 129)])


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", ["thor2", THOR])
async def test_an_mr_key_is_allocated_as_query_func_says_and_freed_with_deallocate_key(profile):
    """bnxt_re_reg_user_mr: REGISTER_MR allocates the key itself only where QUERY_FUNC has MR_REGISTER_ALLOC (Thor2);
    elsewhere ALLOCATE_MRW makes it first. bnxt_re_dereg_mr frees either with DEALLOCATE_KEY: nothing is left."""
    async with open_nic(f"sim:{tag()}", profile=profile) as nic:
        assert nic.device.mr_register_alloc == (profile == "thor2")
        mr = await nic.register_mr(8192)
        assert nic.pci.debug({"op": "objects"})["objects"]["mrs"] == 1
        await mr.deregister()
        assert nic.pci.debug({"op": "objects"})["objects"]["mrs"] == 0


@pytest.mark.loop_agnostic
async def test_a_refused_registration_frees_the_key_allocate_mrw_made():
    async with open_nic(f"sim:{tag()}", profile=THOR) as nic:
        nic.pci.debug({"op": "inject", "command": "register_mr", "status": bnxt.CREQ_QP_EVENT_STATUS_RESOURCES})
        with pytest.raises(FirmwareError, match="register_mr"):
            await nic.register_mr(8192)
        assert nic.pci.debug({"op": "objects"})["objects"]["mrs"] == 0


@pytest.mark.loop_agnostic
async def test_the_l2_filter_asks_for_the_outermost_header_as_linux_does():
    """bnxt_hwrm_l2_filter_alloc asks for PATH_RX | OUTERMOST on these chips; the emulated firmware refuses a filter
    without OUTERMOST (inferred: docs/hardware-conformance.md)."""
    async with open_nic(f"sim:{tag()}") as nic:
        objects = nic.pci.debug({"op": "objects"})["objects"]
        assert (objects["vnics"], objects["l2_filters"]) == (1, 1)
