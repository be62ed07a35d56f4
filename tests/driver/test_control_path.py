"""The async control path against the emulated NIC process: bring-up, HWRM, RCFW, events, failures, close."""
import ipaddress
import os
import signal
import time

import anyio
import pytest

from aiofabric import Access, DeviceLostError, FirmwareError, FirmwareTimeoutError, QPState, open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import device, rcfw_channel
from aiofabric.driver.hwrm_channel import HwrmChannel
from aiofabric.driver.interrupts import CREQ_VECTOR
from aiofabric.driver.rings import Ring
from aiofabric.errors import PCIError
from aiofabric.hw.firmware import CMDQ_INIT
from aiofabric.pci import PAGE_SIZE, DmaBuffer
from aiofabric.pci.emulated import SimPCIDevice
from aiofabric.sim.profiles import PROFILES
from tests.support.nics import command_counters, connect, object_counts, until_posted

pytestmark = pytest.mark.anyio


@pytest.mark.loop_agnostic
async def test_boot_reports_identity_and_frees_everything_on_close():
    ip = f"127.1.{os.getpid() >> 8 & 255}.{os.getpid() & 255}"  # this process's own: concurrent runs never collide
    async with open_nic("sim:boot", ip=ip) as nic:
        info = nic.info()
        assert info["gid"] == ipaddress.IPv6Address(f"::ffff:{ip}").exploded
        assert len(info["mac"]) == 17 and info["fw_version"].count(".") == 3
        assert info["gid_index"] >= 0 and info["caps"]["max_qp"] > 0
        booted = object_counts(nic)
        assert booted["gids"] == 1 and booted["rings"] >= 4 and booted["vnics"] == 1 and booted["l2_filters"] == 1
        assert booted["backing_store"] > 0
        stats = nic.pci.debug({"op": "stats"})["stats"]
        assert stats.get("ctx_init_missing", 0) == 0  # context memory initialised where the firmware asked
        cq = await nic.create_cq(depth=256)
        await nic.create_qp(cq)
        await nic.register_mr(3 * 4096)
        assert {k: object_counts(nic)[k] for k in ("cqs", "qps", "mrs")} == {"cqs": 1, "qps": 1, "mrs": 1}
        await nic.close()
        left = {k: v for k, v in object_counts(nic).items() if isinstance(v, int) and v}
        assert left == {}, f"firmware objects leaked: {left}"
        assert nic.pci.dma_bytes_in_use == 0  # and every ring, page table and buffer went back


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("profile", ["thor2", "short-cmd"])
async def test_boot_reserves_what_it_allocates_before_the_first_ring_and_no_ring_more_is_granted(profile, monkeypatch):
    """Linux's order (bnxt_fw_init_one_p2, bnxt_set_dflt_rings): the backing store and FUNC_RESOURCE_QCAPS before
    FUNC_DRV_RGTR, FUNC_CFG's reservation before the first RING_ALLOC, read back from FUNC_QCFG. The reservation equals
    what boot allocates, so one more of anything is refused. FUNC_CFG's 160 bytes go in the short format where
    VER_GET's max_ext_req_len takes them (short-cmd), else cut to the 128-byte window (thor2)."""
    sent = []
    command = HwrmChannel.command

    async def recording(self, name, **fields):
        sent.append(name)
        return await command(self, name, **fields)
    monkeypatch.setattr(HwrmChannel, "command", recording)
    async with open_nic("sim:reserve", profile=profile) as nic:
        assert sent.index("func_backing_store_cfg_v2") < sent.index("func_resource_qcaps") < \
            sent.index("func_drv_rgtr") < sent.index("func_cfg") < sent.index("func_qcfg", sent.index("func_cfg")) \
            < sent.index("ring_alloc")
        qcfg = await nic.hwrm("func_qcfg", fid=0xFFFF)
        assert {name: getattr(qcfg, f"alloc_{field}") for name, field in (
            ("num_msix", "msix"), ("num_cmpl_rings", "cmpl_rings"), ("num_tx_rings", "tx_rings"),
            ("num_rx_rings", "rx_rings"), ("num_stat_ctxs", "stat_ctx"), ("num_vnics", "vnics"),
            ("num_rsscos_ctxs", "rsscos_ctx"))} == device.RESERVATION
        stats = nic.pci.debug({"op": "stats"})["stats"]
        assert bool(stats.get("short_commands")) == PROFILES[profile].short_commands  # thor2: FUNC_CFG cut, in BAR0
        ring = Ring(nic.pci, 64, 16)
        on_nq = dict(enables=bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID, nq_ring_id=nic.device.nq_id)
        try:
            for kind, fields in ((bnxt.RING_ALLOC_REQ_RING_TYPE_NQ, {}),
                                 (bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL, on_nq)):
                with pytest.raises(FirmwareError, match="RESOURCE_ALLOC_ERROR"):
                    await nic.hwrm("ring_alloc", ring_type=kind, page_tbl_addr=ring.base, length=64, **fields)
            with pytest.raises(FirmwareError, match="RESOURCE_ALLOC_ERROR"):
                await nic.hwrm("stat_ctx_alloc", stats_dma_length=nic.device.stats_length)
            with pytest.raises(FirmwareError, match="RESOURCE_ALLOC_ERROR"):
                await nic.hwrm("vnic_alloc")
        finally:
            ring.free()


@pytest.mark.loop_agnostic
async def test_a_reservation_past_the_firmwares_maximum_is_refused_naming_the_resource(monkeypatch):
    monkeypatch.setitem(device.RESERVATION, "num_msix", 65)
    with pytest.raises(PCIError, match=r"the driver needs 65 MSI-X vectors \(NQ rings\) \(FUNC_CFG num_msix\) and the "
                       r"firmware allows this function at most 64 \(FUNC_RESOURCE_QCAPS max_msix\)"):
        async with open_nic("sim:too-many"):
            pass


@pytest.mark.loop_agnostic
async def test_hwrm_bad_input_gets_clear_errors():
    async with open_nic("sim:hwrm") as nic:
        with pytest.raises(ValueError, match="unknown HWRM command 'no_such_thing'"):
            await nic.hwrm("no_such_thing")
        with pytest.raises(ValueError, match="has no field 'bogus'"):
            await nic.hwrm("func_qcfg", bogus=1)
        with pytest.raises(FirmwareError, match=r"HWRM ring_free failed: INVALID_PARAMS \(0x2\)") as error:
            await nic.hwrm("ring_free", ring_type=bnxt.RING_ALLOC_REQ_RING_TYPE_RX, ring_id=0x7777)
        assert error.value.status == bnxt.HWRM_ERR_CODE_INVALID_PARAMS
        nic.pci.debug({"op": "inject", "command": "func_qcfg", "status": bnxt.HWRM_ERR_CODE_BUSY})
        with pytest.raises(FirmwareError, match="HWRM func_qcfg failed: BUSY"):
            await nic.hwrm("func_qcfg", fid=0xFFFF)
        assert (await nic.hwrm("func_qcfg", fid=0xFFFF)).error_code == 0  # the injection was one-shot


async def test_hwrm_timeout_then_channel_recovers():
    async with open_nic("sim:stall", hwrm_timeout=0.3) as nic:
        await nic.wait_for_link()  # first: its event's PORT_PHY_QCFG would meet what follows
        nic.pci.debug({"op": "stall", "channel": "hwrm"})
        started = time.monotonic()
        with pytest.raises(FirmwareTimeoutError, match="HWRM func_qcfg: no answer"):
            await nic.hwrm("func_qcfg", fid=0xFFFF)
        assert time.monotonic() - started < 2
        qcfg = await nic.hwrm("func_qcfg", fid=0xFFFF)  # seq_id matching ignores nothing stale
        assert qcfg.legacy_l2_db_size_kb > 0


@pytest.mark.loop_agnostic
async def test_hwrm_answers_are_polled_the_firmware_raises_no_interrupt_for_them():
    """A request names no completion ring (cmpl_ring 0xFFFF, as each of Linux's does), so the firmware raises no
    interrupt: the driver polls the answer, as Linux's __hwrm_send does. One that waited for an interrupt would see
    each answer only at its next safety poll (50 ms)."""
    async with open_nic("sim:hwrm-poll") as nic:
        await nic.wait_for_link()  # first: its event's PORT_PHY_QCFG would meet what follows
        before = nic.pci.debug({"op": "stats"})["stats"]
        started = time.perf_counter()
        for _ in range(20):
            await nic.hwrm("func_qcfg", fid=0xFFFF)
        took = time.perf_counter() - started
        after = nic.pci.debug({"op": "stats"})["stats"]
    assert after["hwrm"] - before["hwrm"] == 20 and after["interrupts"] == before["interrupts"]
    assert took < 0.5, f"20 HWRM commands took {took:.2f} s: answers were not polled"


@pytest.mark.loop_agnostic
async def test_rcfw_many_in_flight_matched_by_cookie():
    async with open_nic("sim:many") as nic:
        cqs = []

        async def make():
            cqs.append(await nic.create_cq(depth=64))

        async with anyio.create_task_group() as tasks:
            for _ in range(40):
                tasks.start_soon(make)
        assert len({cq.id for cq in cqs}) == 40
        assert object_counts(nic)["cqs"] == 40
        stats = nic.pci.debug({"op": "stats"})["stats"]
        assert stats["rcfw"] >= 40


@pytest.mark.loop_agnostic
async def test_rcfw_errors_name_command_and_status():
    async with open_nic("sim:rcfw") as nic:
        with pytest.raises(ValueError, match="unknown RCFW command"):
            await nic.rcfw("make_coffee")
        cq = await nic.create_cq(depth=64)
        qp = await nic.create_qp(cq)
        with pytest.raises(FirmwareError, match="RCFW modify_qp failed: INVALID_PARAMETER"):
            await qp.modify(QPState.RTS)  # INIT -> RTS skips RTR: illegal
        nic.pci.debug({"op": "inject", "command": "create_cq", "status": bnxt.CREQ_QP_EVENT_STATUS_RESOURCES})
        with pytest.raises(FirmwareError, match="RCFW create_cq failed: RESOURCES"):
            await nic.create_cq(depth=64)
        assert object_counts(nic)["cqs"] == 1


async def test_rcfw_timeout_is_reported_and_later_commands_work():
    async with open_nic("sim:rstall") as nic:
        nic.rcfw_timeout = 0.3
        nic.pci.debug({"op": "stall", "channel": "rcfw"})
        with pytest.raises(FirmwareTimeoutError, match="RCFW query_version: no answer"):
            await nic.rcfw("query_version")
        version = await nic.rcfw("query_version")
        assert version.status == 0


async def test_the_creq_reader_polls_only_while_a_command_awaits_its_reply(monkeypatch):
    """Lost-interrupt insurance costs nothing on an idle NIC: the CREQ reader sleeps without a safety poll while no
    command waits, and a command posted then wakes it to re-read the CREQ every safety poll until its answer."""
    waits = []
    original = rcfw_channel.wait_for_interrupt

    async def recording(fd, timeout):
        waits.append((fd, timeout))
        return await original(fd, timeout)
    monkeypatch.setattr(rcfw_channel, "wait_for_interrupt", recording)
    async with open_nic("sim:creq") as nic:
        creq = nic.device.interrupt_fd(CREQ_VECTOR)
        await anyio.sleep(0.5)  # the reader's one safety poll after bring-up
        before = len(waits)
        await anyio.sleep(1.0)
        assert waits[before:] == []
        nic.rcfw_timeout = 1.0
        nic.pci.debug({"op": "stall", "channel": "rcfw"})  # no answer, no interrupt: only polling can look
        with pytest.raises(FirmwareTimeoutError):
            await nic.rcfw("query_version")
        assert len([timeout for fd, timeout in waits[before:] if fd == creq and timeout]) >= 3


@pytest.mark.loop_agnostic
async def test_qp_lifecycle_and_query():
    async with open_nic("sim:qp") as nic:
        cq = await nic.create_cq(depth=256)
        a, b = await nic.create_qp(cq, sq_depth=64), await nic.create_qp(cq, sq_depth=64)
        assert a.sq_slots % 256 == 0 and a.msn_entries == a.sq_slots // 2
        await connect(a, b, mtu=4096)
        state = await a.query()
        assert state.en_sqd_async_notify_state & 0xF == QPState.RTS
        assert state.dest_qp_id == b.qpn and bytes(state.dgid) == nic.gid
        with pytest.raises(FirmwareError, match="destroy_cq"):
            await cq.destroy()  # still used by the QPs
        await a.destroy()
        await b.destroy()
        await cq.destroy()
        assert object_counts(nic)["qps"] == 0 and object_counts(nic)["cqs"] == 0


def scattered(nic, pages: int) -> tuple[DmaBuffer, DmaBuffer]:
    """(a buffer of `pages` 4 KiB pages no two adjacent on the bus: the even pages of a new buffer twice its size,
    that new buffer). Its view is not its memory: read the other's even pages."""
    backing = nic.pci.alloc_dma(2 * pages * PAGE_SIZE)
    return DmaBuffer(backing.view[:pages * PAGE_SIZE], backing.bus_addrs[::2], False), backing


@pytest.mark.loop_agnostic
async def test_memory_regions_in_the_largest_pages_their_bus_addresses_allow_at_every_pbl_level():
    """As bnxt_re_reg_user_mr registers them (ib_umem_find_best_pgsz over 4 KiB..1 GiB): memory contiguous on the
    bus is one page at level 0 whatever its size; memory in scattered 4 KiB pages takes a PBL of 1 or 2 levels, and
    a WRITE into the last page lands where that PBL says."""
    async with open_nic("sim:mr") as nic:
        contiguous = [await nic.register_mr(size) for size in (4096, 64 << 10, 4 << 20)]
        assert [(mr.table.level, mr.page_size >= mr.length) for mr in contiguous] == [(0, True)] * 3
        assert contiguous[2].page_size == 4 << 20  # a buffer past a hugepage starts on a multiple of its size
        cq = await nic.create_cq(depth=64)
        qa, qb = await nic.create_qp(cq), await nic.create_qp(cq)
        await connect(qa, qb)
        source = contiguous[0]
        for pages, level in ((3, 1), (600, 2)):
            buffer, backing = scattered(nic, pages)
            mr = await nic.register_mr(buffer, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
            assert (mr.page_size, mr.table.level) == (PAGE_SIZE, level)
            source.view[:] = bytes([pages & 0xFF]) * PAGE_SIZE
            await qa.write(source, mr, PAGE_SIZE, remote_offset=(pages - 1) * PAGE_SIZE)
            last = 2 * (pages - 1) * PAGE_SIZE
            assert bytes(backing.view[last:last + PAGE_SIZE]) == bytes(source.view)
            await mr.deregister()
            backing.free()
        assert object_counts(nic)["mrs"] == 3
        for mr in contiguous:
            await mr.deregister()
        assert object_counts(nic)["mrs"] == 0


@pytest.mark.loop_agnostic
async def test_a_region_of_1_gib_is_one_page_and_4_kib_more_is_two():
    """The boundary of the 1 GiB page (BNXT_RE_PAGE_SIZE_SUPPORTED's largest): exactly 1 GiB is one page at level 0,
    1 GiB + 4 KiB two 1 GiB pages at level 1 (4 KiB pages and a 2-level PBL held 1 GiB at most); the NIC reaches its
    last 4 KiB through the second page. Past BNXT_RE_MAX_MR_SIZE (2^39) is refused before anything is allocated."""
    async with open_nic("sim:gib") as nic:
        cq = await nic.create_cq(depth=64)
        qa, qb = await nic.create_qp(cq), await nic.create_qp(cq)
        await connect(qa, qb)
        exact = await nic.register_mr(1 << 30)
        assert (exact.page_size, exact.table.level, exact.table.base) == (1 << 30, 0, exact.addr)
        await exact.deregister()
        past = await nic.register_mr((1 << 30) + PAGE_SIZE)
        assert (past.page_size, past.table.level) == (1 << 30, 1)
        source = await nic.register_mr(PAGE_SIZE)
        source.view[:] = b"\x5a" * PAGE_SIZE
        await qa.write(source, past, PAGE_SIZE, remote_offset=1 << 30)
        assert bytes(past.view[1 << 30:]) == bytes(source.view)
        await past.deregister()
        with pytest.raises(ValueError, match=r"^size must be an integer in \[1, 549755813888\], not 549755813889$"):
            await nic.register_mr((1 << 39) + 1)


@pytest.mark.loop_agnostic
async def test_the_cmdq_is_one_contiguous_level_0_area_of_8192_slots_as_linux_gives_it():
    """bnxt_qplib_alloc_rcfw_channel: 8192 slots of 16 bytes in one 128 KiB "page" (dma_alloc_coherent: contiguous,
    aligned to its size), cmdq_init naming size 8192 at level 0; commands go on past its first 4 KiB."""
    async with open_nic("sim:cmdq") as nic:
        channel = nic.device.rcfw_channel
        pbl, size_level, _, _ = CMDQ_INIT.unpack(channel.init_block())
        assert size_level == 8192 << bnxt.CMDQ_INIT_CMDQ_SIZE_SFT | 0
        memory = channel.cmdq.memory
        assert (pbl, memory.size, memory.contiguous, pbl % (128 << 10)) == (memory.bus_addr, 128 << 10, True, 0)
        async with anyio.create_task_group() as tasks:
            for _ in range(300):  # past slot 256, the end of the first 4 KiB
                tasks.start_soon(nic.rcfw, "query_version")
        assert channel.cmdq.producer > PAGE_SIZE // 16


@pytest.mark.loop_agnostic
async def test_without_contiguous_memory_the_cmdq_is_paged_as_older_linux_had_it(monkeypatch):
    """A platform with no contiguous 128 KiB (no IOMMU, no hugepage): the same 8192 slots in 4 KiB pages behind a
    level-1 PBL, which cmdq_init also names."""
    original = SimPCIDevice._alloc_dma

    def no_contiguous(self, size, contiguous):
        if contiguous:
            raise PCIError(f"{self.address}: no contiguous {size:#x} bytes")
        return original(self, size, contiguous)
    monkeypatch.setattr(SimPCIDevice, "_alloc_dma", no_contiguous)
    async with open_nic("sim:paged") as nic:
        channel = nic.device.rcfw_channel
        assert CMDQ_INIT.unpack(channel.init_block())[1] == 8192 << bnxt.CMDQ_INIT_CMDQ_SIZE_SFT | 1
        assert channel.cmdq.pages == 32
        await nic.rcfw("query_version")


@pytest.mark.loop_agnostic
async def test_error_notifications_are_routed_not_mistaken_for_replies():
    async with open_nic("sim:events") as nic:
        await nic.wait_for_link()  # first: its event's PORT_PHY_QCFG would meet what follows
        cq = await nic.create_cq(depth=64)
        qp = await nic.create_qp(cq)
        nic.pci.debug({"op": "latency", "us": 20000})
        counters = command_counters(nic)
        async with anyio.create_task_group() as tasks:
            results = []

            async def query():
                results.append(await nic.rcfw("query_version"))

            tasks.start_soon(query)
            await until_posted(nic, counters, rcfw=1)  # the events below arrive while its reply is due
            nic.pci.debug({"op": "event", "event": {"kind": "qp_error", "xid": qp.qpn}})
            nic.pci.debug({"op": "event", "event": {"kind": "cq_error", "xid": cq.id}})
            nic.pci.debug({"op": "event", "event": {"kind": "function", "event": 1}})
        assert results[0].status == 0
        with anyio.fail_after(2):
            while not (qp.errors and cq.errors and nic.event_log):
                await anyio.sleep(0.01)
        assert qp.state == QPState.ERR and qp.errors[0].xid == qp.qpn
        assert cq.errors[0].kind == "cq_error" and nic.event_log[-1].kind == "function"


async def test_emulator_killed_mid_command_fails_every_waiter_promptly():
    started = time.monotonic()
    async with open_nic("sim:doomed") as nic:
        nic.pci.debug({"op": "latency", "us": 10_000_000})  # no command finishes before the kill
        counters = command_counters(nic)
        errors = []

        async def command(run):
            try:
                await run()
            except DeviceLostError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tasks:
            for _ in range(8):
                tasks.start_soon(command, lambda: nic.rcfw("query_version"))
            tasks.start_soon(command, lambda: nic.hwrm("func_qcfg", fid=0xFFFF))
            await until_posted(nic, counters, rcfw=8, hwrm=1)  # every command posted
            os.kill(nic.pci.pid, signal.SIGKILL)
        assert len(errors) == 9
        assert "emulator exited with status -9" in str(errors[0])
        with pytest.raises(DeviceLostError):
            await nic.create_cq(depth=64)
    assert time.monotonic() - started < 5


@pytest.mark.loop_agnostic
async def test_several_nics_in_one_process():
    async with open_nic("sim:a") as a, open_nic("sim:b") as b, open_nic("sim:c") as c:
        assert len({a.mac, b.mac, c.mac}) == 3
        assert len({a.pci.pid, b.pci.pid, c.pci.pid}) == 3
        async with anyio.create_task_group() as tasks:
            for nic in (a, b, c):
                tasks.start_soon(nic.create_cq, 64)
        assert [object_counts(n)["cqs"] for n in (a, b, c)] == [1, 1, 1]


@pytest.mark.loop_agnostic
async def test_bad_spec_is_refused():
    with pytest.raises(Exception, match="bad NIC spec"):
        async with open_nic("eth0"):
            pass


def test_emulator_exits_when_the_driver_process_dies():
    """No orphans: SIGKILL the driver process and its emulator goes away by itself."""
    import subprocess
    import sys
    script = ("import anyio, aiofabric\n"
              "async def main():\n"
              "    async with aiofabric.open_nic('sim:orphan') as nic:\n"
              "        print(nic.pci.pid, flush=True)\n"
              "        await anyio.sleep(60)\n"
              "anyio.run(main)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        emulator = int(driver.stdout.readline())
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{emulator}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, waiting to be reaped
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        else:
            os.kill(emulator, signal.SIGKILL)
            pytest.fail("the emulator outlived its driver")
    finally:
        driver.kill()
