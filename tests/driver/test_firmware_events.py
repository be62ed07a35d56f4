"""Firmware events (README: firmware events, link and MTU): the async event ring and its reader, link changes as
DeviceEvents, reset notices and fatal errors as a lost device at once, the port's link and MTU, and the engines
clamping the path MTU to the port's. The reader's tests run on every backend: it sleeps on an interrupt."""
import re
import time

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import firmware_events
from aiofabric.driver.device import Device
from aiofabric.driver.link import IF_CHANGE_RETRY_INTERVAL, IF_CHANGE_TRIES, PortLink, phy_settings
from aiofabric.errors import CompletionError, DeviceLostError, FirmwareError, LinkDownError
from aiofabric.hw.firmware import LINK_SPEED_MBPS
from aiofabric.hw.async_event import (ASYNC_EVENT, ASYNC_EVENT_ENTRY, ASYNC_EVENT_TYPE, EventId, ResetReason,
                                      forwarding, reset_reason)
from aiofabric.sim.packets import Op, Packet
from aiofabric.sim.port import Port, frame_size
from aiofabric.sim.profiles import PROFILES
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.perftest import run_bench
from aiofabric.tools.runs import wait_for_links
from tests.support.firmware import NQ, Driver
from tests.support.nics import connected_pair, connected_qps, count_wakeups

pytestmark = pytest.mark.anyio


async def wait_for(condition, seconds=5.0):
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.sleep(0.01)


# -- the emulated firmware, without I/O ---------------------------------------------------------------------------
def registered(driver, events=EventId, name=True):
    """A driver registered for `events`, with an event ring (an NQ, named to the firmware with FUNC_CFG
    async_event_cr unless not `name`): its ring id."""
    driver.hwrm("func_drv_rgtr", enables=bnxt.FUNC_DRV_RGTR_REQ_ENABLES_OS_TYPE
                | bnxt.FUNC_DRV_RGTR_REQ_ENABLES_ASYNC_EVENT_FWD, os_type=bnxt.FUNC_DRV_RGTR_REQ_OS_TYPE_LINUX,
                async_event_fwd=forwarding(events))
    ring_id = driver.ring(NQ, 4, logical_id=firmware_events.EVENT_VECTOR)
    if name:
        driver.hwrm("func_cfg", fid=0xFFFF, enables=bnxt.FUNC_CFG_REQ_ENABLES_ASYNC_EVENT_CR, async_event_cr=ring_id)
    return ring_id


def ring_entries(driver, ring_id, count):
    pages = driver.fw.rings[ring_id].pages
    return [driver.mem.read(pages.address(i * ASYNC_EVENT_ENTRY.size), ASYNC_EVENT_ENTRY.size) for i in range(count)]


def test_the_firmware_sends_only_the_events_the_driver_registered():
    driver = Driver()
    driver.hwrm("func_drv_rgtr", enables=bnxt.FUNC_DRV_RGTR_REQ_ENABLES_OS_TYPE)  # no forwarding asked for
    quiet = driver.ring(NQ, 4)
    driver.fw.post_event("link_down")
    assert driver.fw.stats["async_events_not_forwarded"] == 1 and driver.fw.rings[quiet].produced == 0
    ring_id = registered(driver, [EventId.RESET_NOTIFY])
    driver.fw.post_event("link_up")
    driver.fw.post_event("fatal")
    assert driver.fw.stats["async_events_not_forwarded"] == 2
    entry = ring_entries(driver, ring_id, 1)[0]
    assert ASYNC_EVENT_ENTRY.is_new(entry, 0, 0, 4)
    kind, event_id, _, data1 = ASYNC_EVENT.unpack(entry)
    assert (kind, event_id, reset_reason(data1)) == (ASYNC_EVENT_TYPE, EventId.RESET_NOTIFY,
                                                     ResetReason.FW_EXCEPTION_FATAL)


def test_events_wait_for_room_and_interrupt_only_an_armed_ring():
    driver = Driver()
    ring_id = registered(driver)
    ring = driver.fw.rings[ring_id]
    for _ in range(6):  # two more than the ring holds
        driver.fw.post_event("link_down")
    assert ring.produced == 4 and len(driver.fw.async_events) == 2 and driver.fw.interrupts == []
    driver.doorbell(ring_id, bnxt.DBC_DBC_TYPE_NQ_ARM, 2, 0)  # two read, and armed: the waiting ones land
    assert ring.produced == 6 and not driver.fw.async_events
    assert driver.fw.interrupts == [firmware_events.EVENT_VECTOR]  # once: firing disarms it
    assert [ASYNC_EVENT_ENTRY.is_new(entry, 0, 4 + i, 4) for i, entry in enumerate(ring_entries(driver, ring_id, 2))] \
        == [True, True]  # the second lap's valid bit


def test_events_go_to_the_creq_until_func_cfg_names_the_event_ring():
    """The HSI's default completion ring, taken to be the CREQ (where bnxt_qplib_service_creq accepts HWRM async
    event completions), until async_event_cr names a ring (bnxt_hwrm_set_async_event_cr); an event waits while
    neither is there. FUNC_CFG refuses to name a ring that is no NQ, and FUNC_RESET forgets the name."""
    driver = Driver()
    ring_id = registered(driver, name=False)
    driver.fw.post_event("link_down")
    assert len(driver.fw.async_events) == 1  # no CREQ yet: it waits
    driver.open_rcfw()
    driver.post("query_version")  # the first command latches the CREQ
    driver.fw.post_event("link_up")  # the first event lands with it
    entries = driver.drain()
    assert [ASYNC_EVENT.unpack(entry)[:2] for entry in entries] == [(ASYNC_EVENT_TYPE, EventId.LINK_STATUS_CHANGE)] * 2
    assert driver.fw.rings[ring_id].produced == 0
    cmpl = driver.ring(bnxt.RING_ALLOC_REQ_RING_TYPE_L2_CMPL, 64,
                       enables=bnxt.RING_ALLOC_REQ_ENABLES_NQ_RING_ID_VALID, nq_ring_id=ring_id)
    driver.hwrm("func_cfg", expect=bnxt.HWRM_ERR_CODE_INVALID_PARAMS, fid=0xFFFF,
                enables=bnxt.FUNC_CFG_REQ_ENABLES_ASYNC_EVENT_CR, async_event_cr=cmpl)
    assert f"async_event_cr {cmpl} is not an allocated NQ ring" in driver.fw.last_error
    driver.hwrm("func_cfg", fid=0xFFFF, enables=bnxt.FUNC_CFG_REQ_ENABLES_ASYNC_EVENT_CR, async_event_cr=ring_id)
    driver.fw.post_event("link_down")
    assert driver.fw.rings[ring_id].produced == 1 and not driver.drain()
    driver.hwrm("func_reset")
    assert driver.fw.async_event_cr is None


def test_the_link_and_mtu_as_the_firmware_reports_them():
    driver = Driver()
    driver.fw.port.mtu = 1500
    assert driver.hwrm("func_qcfg", fid=0xFFFF).admin_mtu == 1500
    assert driver.hwrm("port_phy_qcfg", port_id=0).link == bnxt.PORT_PHY_QCFG_RESP_LINK_NO_LINK  # as bnxt_en left it
    registered(driver)
    driver.link_up()
    phy = driver.hwrm("port_phy_qcfg", port_id=0)
    assert (phy.link, phy.link_speed) == (bnxt.PORT_PHY_QCFG_RESP_LINK_LINK, bnxt.PORT_PHY_QCFG_RESP_LINK_SPEED_400GB)
    driver.fw.post_event("link_down")
    phy = driver.hwrm("port_phy_qcfg", port_id=0)
    assert (phy.link, phy.link_speed) == (bnxt.PORT_PHY_QCFG_RESP_LINK_NO_LINK, 0)
    driver.fw.post_event("mtu", mtu=4200)
    assert driver.hwrm("func_qcfg", fid=0xFFFF).admin_mtu == 4200
    with pytest.raises(ValueError, match=r"mtu=100: must be an integer in \[576, 9500\]"):
        driver.fw.post_event("mtu", mtu=100)


def test_a_port_carries_nothing_while_down_and_no_frame_longer_than_its_mtu():
    packets = [Packet(Op.RDMA_WRITE_ONLY, 1, 0, payload=bytes(size)) for size in (1024, 1412, 1413, 4096)]
    assert [frame_size(p) for p in packets] == [1084, 1472, 1476, 4156]  # IP 20, UDP 8, BTH 12, RETH 16, pad, ICRC 4
    port = Port(mtu=1472, up=True)
    assert port.carried(packets) == packets[:2] and port.stats["dropped_oversize"] == 2
    port.up = False
    assert port.carried(packets) == [] and port.stats["dropped_link_down"] == 4
    assert Port(up=True).carried(packets) == packets  # the default jumbo MTU carries any path MTU


@pytest.mark.parametrize("profile", ["thor2", "thor"])
@pytest.mark.parametrize("forced", [False, True], ids=["autoneg", "forced"])
def test_the_drivers_phy_settings_from_each_phys_own_qcfg_bring_its_link_up(profile, forced):
    """link.phy_settings (bnxt_init_ethtool_link_settings, bnxt_hwrm_set_link_common) from PORT_PHY_QCFG: the
    firmware's autoneg, or its forced speed, in the fields of the PHY's generation (PORT_PHY_QCAPS SPEEDS2)."""
    driver = Driver(profile=PROFILES[profile])
    registered(driver)
    phy = driver.fw.phy
    if forced:  # a forced speed the firmware was left with: the slowest this PHY has
        phy.forced = min((s for family in phy.families for s in family.speeds), key=lambda s: s.link_speed)
    driver.hwrm("func_drv_if_change", flags=bnxt.FUNC_DRV_IF_CHANGE_REQ_FLAGS_UP)
    qcfg = driver.hwrm("port_phy_qcfg", port_id=0)
    speeds2 = bool(driver.hwrm("port_phy_qcaps", port_id=0).flags2 & bnxt.PORT_PHY_QCAPS_RESP_FLAGS2_SPEEDS2_SUPPORTED)
    driver.hwrm("port_phy_cfg", port_id=0, **phy_settings(qcfg, speeds2))
    phy.tick(0.0)
    phy.tick(phy.delay)
    assert driver.fw.port.up and not driver.fw.stats["errors"], driver.fw.last_error
    mbps = LINK_SPEED_MBPS[driver.hwrm("port_phy_qcfg", port_id=0).link_speed]
    assert mbps == (100_000 if forced and profile == "thor2" else 50_000 if forced else
                    400_000 if profile == "thor2" else 200_000)


# -- the driver ---------------------------------------------------------------------------------------------------
async def test_the_driver_brings_up_the_link_bnxt_ens_unbind_left_forced_down():
    """The emulated port starts as unbinding bnxt_en leaves it (bnxt_close: FORCE_LINK_DWN, IF_CHANGE down): data
    moves only because the boot sent FUNC_DRV_IF_CHANGE(UP) and PORT_PHY_CFG (bnxt_update_phy_setting). The open
    does not wait for the link, as Linux's does not; `wait_for_link` does."""
    async with open_nic("sim:forced-a") as a, open_nic("sim:forced-b") as b:
        qa, qb = await connected_qps(a, b, 64)
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = bytes(range(256)) * 16
        with anyio.fail_after(5):  # a link left down: the write fails after its retries (RETRY_EXC_ERR)
            await qa.write(source, target, 4096)
        assert bytes(target.view) == bytes(source.view)
        for nic in (a, b):
            assert await nic.wait_for_link(5) == firmware_events.Link(up=True, speed_mbps=400000)
            assert nic.info()["link"] == "up" and nic.event_log[0].kind == "link" and nic.event_log[0].detail["up"]
            assert not (await nic.pci.debug_client().stats())["errors"]


async def test_the_close_says_the_interface_is_down_after_every_free_and_before_unregistering(monkeypatch):
    """bnxt_close: its frees, then FUNC_DRV_IF_CHANGE(down); then FUNC_DRV_UNRGTR (bnxt_remove_one). The link is
    not forced down: the next driver finds the port as it was (link.py says why)."""
    async with open_nic("sim:if-down") as nic:
        await nic.wait_for_link()
        channel, sent, seen = nic.device.hwrm_channel, [], {}
        original = channel.command

        async def recording(name, **fields):
            sent.append((name, fields.get("flags")))
            if name != "func_drv_unrgtr":
                return await original(name, **fields)
            seen.update(nic.pci.debug({"op": "objects"})["objects"])  # what the driver left when it leaves
            answer = await original(name, **fields)
            seen["errors"] = nic.pci.debug({"op": "stats"})["stats"].get("errors", 0)  # what the firmware noted
            return answer
        monkeypatch.setattr(channel, "command", recording)
    assert seen["errors"] == 0  # the firmware saw IF_CHANGE(down): it notes an unregister with the interface up
    assert (seen["rings"], seen["vnics"], seen["stat_ctxs"], seen["l2_filters"]) == (0, 0, 0, 0)
    names = [name for name, _ in sent]
    assert sent[-3:] == [("func_drv_if_change", 0), ("func_drv_unrgtr", None), ("func_reset", None)], sent
    assert "port_phy_cfg" not in names and names.count("func_drv_if_change") == 1


async def test_interface_up_retries_a_busy_firmware_as_linux_does():
    """bnxt_hwrm_if_change: BUSY or HOT_RESET_PROGRESS is retried, BNXT_FW_IF_RETRY (10) tries 50 ms apart; the
    tenth busy answer fails the open."""
    async with open_nic("sim:if-busy") as nic:
        link = nic.device.port_link
        busy = bnxt.HWRM_ERR_CODE_BUSY
        nic.pci.debug({"op": "inject", "command": "func_drv_if_change", "status": busy, "count": IF_CHANGE_TRIES - 1})
        started = time.monotonic()
        await link.interface_up()  # the last try answers
        assert time.monotonic() - started >= (IF_CHANGE_TRIES - 1) * IF_CHANGE_RETRY_INTERVAL
        nic.pci.debug({"op": "inject", "command": "func_drv_if_change", "status": busy, "count": IF_CHANGE_TRIES})
        with pytest.raises(FirmwareError, match="HWRM func_drv_if_change failed: BUSY"):
            await link.interface_up()
        nic.pci.debug({"op": "inject", "command": "func_drv_if_change", "status": bnxt.HWRM_ERR_CODE_FAIL})
        started = time.monotonic()
        with pytest.raises(FirmwareError, match="FAIL"):  # any other error at once
            await link.interface_up()
        assert time.monotonic() - started < IF_CHANGE_RETRY_INTERVAL


class IfChangeAnswers:
    """An HWRM channel whose every answer is a FUNC_DRV_IF_CHANGE with `flags` (the emulator never reports them)."""

    def __init__(self, flags):
        self.flags, self.sent = flags, []

    async def command(self, name, **fields):
        self.sent.append((name, fields))
        return bnxt.hwrm_func_drv_if_change_output(flags=self.flags)


@pytest.mark.parametrize("flags, names", [
    (bnxt.FUNC_DRV_IF_CHANGE_RESP_FLAGS_RESC_CHANGE, "RESC_CHANGE"),
    (bnxt.FUNC_DRV_IF_CHANGE_RESP_FLAGS_HOT_FW_RESET_DONE | bnxt.FUNC_DRV_IF_CHANGE_RESP_FLAGS_CAPS_CHANGE,
     "HOT_FW_RESET_DONE|CAPS_CHANGE")])
async def test_an_if_change_answer_saying_the_firmware_changed_stops_the_boot_naming_it(flags, names):
    """Linux queries and reserves again (RESC_CHANGE) or starts over (HOT_FW_RESET_DONE, CAPS_CHANGE); this boot
    stops naming the flags, and its close still says DOWN. Without IF_CHANGE_SUPPORTED nothing is sent."""
    channel = IfChangeAnswers(flags)
    link = PortLink(channel, "0000:41:00.0")
    link.registered(0, 0)
    await link.interface_up()
    await link.interface_down()
    assert channel.sent == []
    link.registered(bnxt.FUNC_DRV_RGTR_RESP_FLAGS_IF_CHANGE_SUPPORTED, 0)
    with pytest.raises(FirmwareError, match=rf"HWRM func_drv_if_change failed: {re.escape(names)} \(0x0\): "
                                            r"0000:41:00.0: .*open the NIC again"):
        await link.interface_up()
    await link.interface_down()
    up = bnxt.FUNC_DRV_IF_CHANGE_REQ_FLAGS_UP
    assert channel.sent == [("func_drv_if_change", {"flags": up}), ("func_drv_if_change", {"flags": 0})]


async def test_waiting_for_a_link_that_stays_down_says_what_the_phy_reports():
    async with open_nic("sim:no-cable") as nic:
        await nic.wait_for_link()
        nic.pci.debug({"op": "event", "event": {"kind": "link_down"}})  # the cable pulled
        await wait_for(lambda: not nic.device.link.up)  # its event is heard
        started = time.monotonic()
        with pytest.raises(LinkDownError, match=r"sim:no-cable: the link is still down after 0.3 s \(PORT_PHY_QCFG "
                                                r"link NO_LINK, link_down_reason CABLE_REMOVED\): check the cable"):
            await nic.wait_for_link(0.3)
        assert 0.3 <= time.monotonic() - started < 2
        assert nic.info()["link"] == "down"
        nic.pci.debug({"op": "event", "event": {"kind": "link_up"}})
        assert (await nic.wait_for_link(5)).up


async def test_link_down_and_up_arrive_as_events_and_the_port_drops_packets_meanwhile():
    async with open_nic("sim:link-a") as a, open_nic("sim:link-b") as b:
        qa, qb = await connected_qps(a, b, 64, timeout=14)  # 67 ms per retry: retries outlast the link's 0.2 s down
        assert await a.wait_for_link() == firmware_events.Link(up=True, speed_mbps=400000)
        await b.wait_for_link()
        assert (a.info()["link"], a.info()["link_speed_mbps"], a.info()["port_mtu"]) == ("up", 400000, 9000)
        heard = []
        a.device.function_handlers.append(heard.append)
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = bytes(range(256)) * 16

        a.pci.debug({"op": "event", "event": {"kind": "link_down"}})
        await wait_for(lambda: heard)
        assert heard[0].kind == "link" and heard[0].xid == EventId.LINK_STATUS_CHANGE and not heard[0].detail["up"]
        assert a.device.link == firmware_events.Link(up=False, speed_mbps=0) and a.info()["link"] == "down"
        assert a.event_log[-1] is heard[0]
        write = await qa.post_write(source, target, 4096)
        await anyio.sleep(0.2)  # retransmissions go nowhere while the link is down
        assert not write.done and (await a.pci.debug_client().stats())["dropped_link_down"] > 0

        a.pci.debug({"op": "event", "event": {"kind": "link_up"}})
        await wait_for(lambda: len(heard) == 2)
        assert heard[1].detail["up"] and a.device.link.up and a.device.link.speed_mbps == 400000
        with anyio.fail_after(5):  # the next retransmission gets through
            await write
        assert bytes(target.view) == bytes(source.view)


@pytest.mark.loop_agnostic
async def test_an_mtu_change_arrives_as_an_event_and_port_mtu_follows():
    async with open_nic("sim:mtu-change") as nic:
        assert nic.device.port_mtu == 9000
        await nic.wait_for_link()  # its event comes first
        nic.pci.debug({"op": "event", "event": {"kind": "mtu", "mtu": 1500}})
        await wait_for(lambda: nic.event_log[-1].kind == "mtu")
        event = nic.event_log[-1]
        assert (event.kind, event.xid, event.detail["port_mtu"]) == ("mtu", EventId.LINK_MTU_CHANGE, 1500)
        assert nic.device.port_mtu == 1500 and nic.info()["port_mtu"] == 1500


@pytest.mark.parametrize("kind,reason", [("reset_notify", "MANAGEMENT_RESET_REQUEST"),
                                         ("fatal", "FW_EXCEPTION_FATAL")])
async def test_reset_notice_and_fatal_error_fail_everything_at_once_naming_the_event(kind, reason):
    async with open_nic("sim:reset", hwrm_timeout=30) as nic:
        await nic.wait_for_link()  # its event is read before the firmware stalls
        cq = await nic.create_cq(64)
        qp = await nic.create_qp(cq)
        receive = await qp.post_recv(await nic.register_mr(4096), 64)  # nothing will ever arrive
        nic.pci.debug({"op": "stall", "channel": "rcfw"})
        nic.pci.debug({"op": "stall", "channel": "hwrm"})
        failures = []

        async def fails(run):
            try:
                await run()
            except DeviceLostError as exc:
                failures.append(exc)

        with anyio.fail_after(15):  # without the event's effect the receive would wait forever
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(fails, lambda: nic.rcfw("query_version"))  # 20 s to its timeout
                tasks.start_soon(fails, lambda: nic.hwrm("func_qcfg", fid=0xFFFF))  # 30 s to its timeout
                tasks.start_soon(fails, lambda: receive)
                await anyio.wait_all_tasks_blocked()
                sent = time.monotonic()
                nic.pci.debug({"op": "event", "event": {"kind": kind}})
        # Timed from the event (not from before the waits began, which a loaded machine stretches), and far from the
        # other clock: the commands' own timeouts are 20 and 30 s; the errors below also name the event as the cause.
        assert time.monotonic() - sent < 10 and len(failures) == 3
        for failure in failures:
            assert f"RESET_NOTIFY ({reason})" in str(failure), failure
        with pytest.raises(DeviceLostError, match=reason):
            await nic.create_cq(64)
        assert nic.event_log[-1].kind == ("fatal" if kind == "fatal" else "reset")


@pytest.mark.loop_agnostic
@pytest.mark.parametrize("kind", ["reset_notify", "link_down"])
async def test_an_event_before_the_event_ring_is_named_comes_on_the_creq_and_is_handled(kind, monkeypatch):
    """Until FUNC_CFG names the event ring, the firmware sends events to the CREQ: a reset notice there loses the device
    at once, failing the boot's stalled command with its name (not after its 30 s timeout), and a link change is
    handled as one from the event ring."""
    open_events = Device._open_events

    async def event_first(self, task_group):
        self.pci.debug({"op": "event", "event": {"kind": kind}})
        if kind == "reset_notify":
            self.pci.debug({"op": "stall", "channel": "hwrm"})  # the event ring's RING_ALLOC goes unanswered
        await open_events(self, task_group)
    monkeypatch.setattr(Device, "_open_events", event_first)
    started = time.monotonic()
    if kind == "reset_notify":
        with pytest.raises(DeviceLostError, match=r"RESET_NOTIFY \(MANAGEMENT_RESET_REQUEST\)"):
            async with open_nic("sim:creq-event", hwrm_timeout=30):
                pass
        assert time.monotonic() - started < 10
        return
    async with open_nic("sim:creq-event") as nic:
        await wait_for(lambda: nic.event_log)
        assert nic.event_log[0].kind == "link" and not nic.device.link.up


async def test_an_idle_nic_with_the_event_reader_wakes_nobody(monkeypatch):
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        with anyio.fail_after(5):
            await qa.write(source, target, 64)
        reader_waits = []
        original = firmware_events.wait_for_interrupt

        async def counting(fd, timeout):
            reader_waits.append(timeout)
            return await original(fd, timeout)
        monkeypatch.setattr(firmware_events, "wait_for_interrupt", counting)
        counts = count_wakeups(monkeypatch, a, b)
        await anyio.sleep(0.5)
        before = counts(), len(reader_waits)
        await anyio.sleep(1.0)
        assert (counts(), len(reader_waits)) == before  # no timer anywhere, the event reader's included
        heard = len(a.event_log)  # the link's coming up, at the open
        a.pci.debug({"op": "event", "event": {"kind": "link_up"}})
        await wait_for(lambda: len(a.event_log) == heard + 1)  # its interrupt is heard: one wake-up, then sleep again
        assert reader_waits[before[1]:] == [None]


# -- the engines ----------------------------------------------------------------------------------------------------
@pytest.mark.loop_agnostic
async def test_bench_on_a_1500_byte_port_uses_path_mtu_1024_and_says_so(capsys):
    async with open_nic("sim:mtu0", port_mtu=1500) as a, open_nic("sim:mtu1", port_mtu=1500) as b:
        assert a.info()["port_mtu"] == 1500
        result = await run_bench(BenchConfig(size=8192, iters=64), [a, b])
    assert result["verified"] and (result["mtu"], result["mtu_requested"]) == (1024, 4096)
    assert result["retransmits"] == 0
    assert "path MTU 4096 does not fit the port MTU 1500 of sim:mtu0" in capsys.readouterr().err


@pytest.mark.loop_agnostic
async def test_path_mtu_4096_on_a_1500_byte_port_is_lost_until_retries_run_out():
    """What the bench's clamp avoids: the port drops every full packet, as a 1500-byte fabric would."""
    async with connected_pair(mtu=4096, port_mtu=1500) as (a, b, qa, qb):
        source, target = await a.register_mr(8192), await b.register_mr(8192)
        with anyio.fail_after(10), pytest.raises(CompletionError, match="TRANSPORT_RETRY_CNT_ERR"):
            await qa.write(source, target, 8192)
        assert (await a.pci.debug_client().stats())["dropped_oversize"] > 0


async def test_bench_waits_for_the_links_and_a_run_over_a_dead_link_names_it():
    """The open does not wait for the link; a run does (runs.wait_for_links, in open_nics), so its first packets are
    not lost; a run whose packets went nowhere says which NIC's link is down, not only what the QP saw."""
    async with open_nic("sim:slow-link-a", link_delay_ms=300) as a, open_nic("sim:slow-link-b", link_delay_ms=300) as b:
        assert not b.device.link.up  # still training (a's may be up: b took a while to open)
        started = time.monotonic()
        await wait_for_links([a, b])
        assert a.device.link.up and b.device.link.up and time.monotonic() - started < 5
        result = await run_bench(BenchConfig(size=4096, iters=64), [a, b])
        assert result["verified"] and result["retransmits"] == 0
        b.pci.debug({"op": "event", "event": {"kind": "link_down"}})
        await wait_for(lambda: not b.device.link.up)
        with pytest.raises(LinkDownError, match=r"sim:slow-link-b: the link is still down after 0.2 s"):
            await wait_for_links([a, b], 0.2)
        with pytest.raises(LinkDownError, match=r"sim:slow-link-b's link is down \(PORT_PHY_QCFG link NO_LINK, "
                                                r"link_down_reason CABLE_REMOVED\); what the run saw: CompletionError"):
            await run_bench(BenchConfig(size=4096, iters=8), [a, b])


@pytest.mark.loop_agnostic
async def test_a_reset_notice_behind_a_link_change_whose_query_the_firmware_leaves_unanswered_is_heard_at_once():
    """A link change is followed by a PORT_PHY_QCFG, which a resetting firmware never answers: the reset notice that
    comes next still loses the device at once, not after that query's timeout."""
    async with open_nic("sim:reset-behind-link", hwrm_timeout=30) as nic:
        await nic.wait_for_link()
        nic.pci.debug({"op": "stall", "channel": "hwrm", "count": 10})
        nic.pci.debug({"op": "stall", "channel": "rcfw"})
        nic.pci.debug({"op": "event", "event": {"kind": "link_down"}})
        failures = []

        async def command():
            try:
                await nic.rcfw("query_version")  # 20 s to its timeout
            except DeviceLostError as exc:
                failures.append(exc)

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(command)
                await anyio.sleep(0.2)  # the link event's query is waiting for its answer by now
                sent = time.monotonic()
                nic.pci.debug({"op": "event", "event": {"kind": "reset_notify"}})
        assert time.monotonic() - sent < 10 and len(failures) == 1
        assert "RESET_NOTIFY (MANAGEMENT_RESET_REQUEST)" in str(failures[0])
