"""Chip and capability gating, end to end on emulated NICs playing each firmware profile (aiofabric/sim/profiles.py):
the driver uses each feature only where Linux finds it (bnxt_en: VER_GET chip_num and dev_caps_cfg, FUNC_QCAPS
flags_ext; bnxt_re: QUERY_FUNC dev_cap_flags and dev_cap_ext_flags_2) and refuses in one line what it does not
support; the emulator's go-backs retransmit from the search table the driver writes, so a wrong entry fails a
transfer under loss. Atomics are offered only where the PCIe path to the root port completes AtomicOps (bnxt_re:
bnxt_qplib_determine_atomics, bnxt_qplib_is_atomic_cap), on each path the emulator can play (its pcie_path)."""
import contextlib
import dataclasses
import random
from types import SimpleNamespace

import anyio
import pytest

from aiofabric import PCIError, open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import backing_store, device
from aiofabric.hw.firmware import CONFIGURED_CONTEXT_TYPES, THOR2_CHIPS
from aiofabric.hw.firmware import BackingStoreType as BS
from aiofabric.hw.pci import PCI_EXP_DEVCTL2_ATOMIC_REQ
from aiofabric.pci import PAGE_SIZE, DmaBuffer
from aiofabric.sim.function import CONTEXT_TYPES
from aiofabric.sim.pcie import DEVCTL2, PCIE_PATHS
from aiofabric.sim.profiles import PROFILES
from aiofabric.verbs import ATOMIC_ACCESS, workqueue
from aiofabric.errors import CompletionError, FirmwareError, UnsupportedError
from tests.support.firmware import Driver
from tests.support.nics import connect, connected_qps, stats, tag

pytestmark = pytest.mark.anyio
BOOTING = [name for name, profile in PROFILES.items() if profile.backing_store_v2]


@contextlib.asynccontextmanager
async def pair(profile, sq_depth=64, loss=0.0, timeout=14, cq_depth=256):
    """Two emulated NICs of `profile`, one connected RC QP each (ACK timeout exponent `timeout`: 14 is 67 ms, long
    enough that a loaded machine's pauses are no loss) on a CQ of `cq_depth`; `a` loses `loss` of what it sends
    (seeded)."""
    name = tag()
    async with open_nic(f"sim:a{name}", profile=profile, loss=loss, seed=11) as a, \
            open_nic(f"sim:b{name}", profile=profile) as b:
        qa, qb = await connected_qps(a, b, cq_depth, qp={"sq_depth": sq_depth, "rq_depth": 64}, mtu=1024,
                                     timeout=timeout)
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
    with pytest.raises(PCIError, match=r"the firmware offers only backing store v1 \(FUNC_QCAPS flags_ext has no "
                                       r"BS_V2_SUPPORTED: older Thor firmware\), which this driver does not speak; "
                                       r"update the NIC firmware to one with backing store v2$"):
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



@pytest.mark.loop_agnostic
async def test_the_backing_store_is_sized_as_bnxt_en_sizes_it():
    """bnxt_alloc_ctx_mem on the emulated Thor2's capabilities (sim/function.py): the L2 share 256 + QP1s 2 + 1024
    RoCE QPs (1282, rounded up to 64 and held to the maximum 1282); SRQs 128 + 1024; CQs 256 + 2 x 1024; VNICs and
    statistics contexts at their maximum; MRAV 8 Ki MRs (half the maximum) + as many address handles (split 0);
    timers as many as QPs; the slow-path TQM ring 128 VNICs + 256 + 2 x (1024 + 2) + its minimum 64 = 2500 and each of
    the 8 fast-path ones 256 + 2 x (1024 + 2) = 2308, rounded up to 64. PBL depth 2 where Linux asks for it, else 1."""
    expected = {BS.QP: (1282, 2, [256, 2, 0]), BS.SRQ: (1152, 2, [128]), BS.CQ: (2304, 2, [256]),
                BS.VNIC: (1024, 1, [128]), BS.STAT: (1024, 1, []), BS.SP_TQM_RING: (2560, 2, []),
                BS.FP_TQM_RING: (2368, 2, []), BS.MRAV: (16384, 2, [8192]), BS.TIM: (1282, 1, [])}
    async with open_nic("sim") as nic:
        configured = nic.pci.debug({"op": "backing_store"})["backing_store"]
        assert nic.caps["max_qp"] == 1026  # QP1s and RoCE QPs: what bnxt_re gets (min(64 Ki, max_qp) there)
    assert {(area["type"], area["instance"]): (area["entries"], area["level"], area["splits"])
            for area in configured} == {(kind, instance): expected[kind]
                                        for kind in expected for instance in CONTEXT_TYPES[kind].instances}


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("kind, change, reason", [
    (BS.STAT, dict(max_entries=0), "has max_num_entries 0"),
    (BS.MRAV, dict(flags=0), r"is not offered \(no TYPE_VALID type in the FUNC_BACKING_STORE_QCAPS_V2 walk\)"),
])
async def test_a_type_the_firmware_gives_nothing_of_fails_the_boot_naming_it(kind, change, reason, monkeypatch):
    """Linux cannot size it and fails its probe (bnxt_setup_ctxm_pg_tbls: -EINVAL); so does the driver, before it
    configures anything. Against the firmware in-process: the emulated NIC's own offers every type."""
    monkeypatch.setitem(CONTEXT_TYPES, kind, dataclasses.replace(CONTEXT_TYPES[kind], **change))
    host = Driver(memory=64 << 20)

    async def hwrm(name, **fields):
        return host.hwrm(name, **fields)

    def alloc_dma(size):
        pages = -(-size // PAGE_SIZE)
        start = host.alloc(pages)
        return DmaBuffer(host.mem.view(start, pages * PAGE_SIZE), [start + i * PAGE_SIZE for i in range(pages)], True)

    flags_ext = bnxt.FUNC_QCAPS_RESP_FLAGS_EXT_BS_V2_SUPPORTED
    with pytest.raises(PCIError, match=rf"^in-process: backing-store type {kind.name} \({kind:#x}\) {reason}: "
                                       r"bnxt_en cannot size it either and fails its probe \(bnxt_setup_ctxm_pg_tbls: "
                                       r"-EINVAL\)$"):
        await backing_store.configure(SimpleNamespace(address="in-process", alloc_dma=alloc_dma), hwrm, flags_ext, 0,
                                      lambda free: None)
    assert not host.fw.backing_store

SIZES = [random.Random(5).randrange(1, 12000) for _ in range(32)]  # unequal: a misnumbered message cannot pass


async def writes_under_loss(profile):
    """Thirty-two WRITEs of 1 B .. 12 KB from a NIC losing 5% of what it sends: True if all land intact. The ACK
    timeout (~67 ms) is long enough that only a loss sends the requester back, never a slow ACK."""
    async with pair(profile, loss=0.05) as (a, b, qa, qb):
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


# -- PCIe AtomicOps: bnxt_qplib_determine_atomics, then what bnxt_qplib_is_atomic_cap offers -------------------------
def atomic_req(nic) -> bool:
    return bool(nic.pci.read_config(DEVCTL2, 2) & PCI_EXP_DEVCTL2_ATOMIC_REQ)


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("path", PCIE_PATHS)
async def test_atomics_are_offered_exactly_where_the_pcie_path_completes_them(path):
    """Each emulated path to the root complex (the pcie_path option): ATOMIC_REQ set and atomics offered where the
    walk passes; elsewhere neither, and the info names the port that lacks them."""
    completes = PCIE_PATHS[path].completes
    async with open_nic("sim", pcie_path=path) as nic:
        info = nic.info()
        assert (atomic_req(nic), nic.device.atomic_ops.enabled) == (completes, completes), info["atomic_path"]
        assert info["atomic_cap"] == ("global" if completes else "none")
        lacking = {"no-completer": "root port 0000:00:01.0 does not complete 32-bit",
                   "comp32-only": "root port 0000:00:01.0 does not complete 64-bit",
                   "no-routing": "switch downstream port 0000:02:00.0 does not route",
                   "egress-blocked": "switch upstream port 0000:01:00.0 blocks PCIe AtomicOps on egress",
                   "hidden": "no root port is visible above"}
        assert lacking.get(path, "reaches root port" if not PCIE_PATHS[path].preset else "by the hypervisor") in \
            info["atomic_path"]


@pytest.mark.loop_agnostic
async def test_on_a_path_that_completes_atomicops_atomic_req_is_set_and_atomics_work():
    name = tag()
    async with open_nic(f"sim:a{name}") as a, open_nic(f"sim:b{name}") as b:
        assert atomic_req(a) and atomic_req(b)
        qa, qb = await a.create_qp(await a.create_cq(64)), await b.create_qp(await b.create_cq(64))
        await qb.to_init(ATOMIC_ACCESS)
        await connect(qa, qb, timeout=14)
        source, counter = await a.register_mr(4096), await b.register_mr(4096, ATOMIC_ACCESS)
        with anyio.fail_after(20):
            assert await qa.fetch_add(source, counter, 5) == 0
            assert await qa.compare_swap(source, counter, 5, 9) == 5
        assert int.from_bytes(counter.view[:8], "little") == 9


@pytest.mark.loop_agnostic
async def test_without_atomicops_on_the_path_atomics_fail_at_once_naming_the_root_port():
    """The requester's path lacks completer support: its fetch-add and compare-swap fail before anything is posted
    (bnxt_re would report IB_ATOMIC_NONE); a region open to remote atomics is refused where the responder's does."""
    name = tag()
    async with open_nic(f"sim:a{name}", pcie_path="no-completer") as a, open_nic(f"sim:b{name}") as b:
        qa, qb = await connected_qps(a, b, mtu=1024, timeout=14)
        counter, source = await b.register_mr(4096, ATOMIC_ACCESS), await a.register_mr(4096)
        producer, sent = qa.send_queue.producer, stats(a).get("packets_sent", 0)
        why = "this NIC offers no atomics .*: root port 0000:00:01.0 does not complete 32-bit PCIe AtomicOps"
        with pytest.raises(UnsupportedError, match=f"^fetch_add on QP {qa.qpn:#x} of {a.pci.address}: {why}"):
            await qa.post_fetch_add(source, counter, 1)
        with pytest.raises(UnsupportedError, match=f"^compare_swap on QP {qa.qpn:#x} of {a.pci.address}: {why}"):
            await qa.compare_swap(source, counter, 0, 1)
        assert (qa.send_queue.producer, stats(a).get("packets_sent", 0)) == (producer, sent)
        with pytest.raises(UnsupportedError, match=f"^{a.pci.address}: a region open to remote atomics: {why}"):
            await a.register_mr(4096, ATOMIC_ACCESS)
        await qa.write(source, counter, 8)  # the rest of the NIC works


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
    as bnxt_re_init_depth does for user QPs), and the driver never fills those. The CQ holds a completion for each
    of the 383 writes: on one of 256 the NIC may complete them all before the poller drains any (a loaded machine),
    overflowing it (test_cq_errors.py); the ACK timeout is perftest's, as the wire loses nothing."""
    async with pair(THOR, sq_depth=200, cq_depth=512) as (a, b, qa, qb):
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
