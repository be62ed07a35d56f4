"""A BNXT function's control path: bring-up, liveness, asynchronous events and teardown. It is composed of the two
firmware channels (`HwrmChannel`, `RcfwChannel`), the removal watch (`Liveness`), who hears of events (`EventRouter`)
and a close's time budget (`CloseBudget`); verbs objects attach to it through `DeviceObject`.

Bring-up follows Linux's bnxt_en and bnxt_re: the driver configures the backing store (backing_store.py) and asks
what it may reserve (FUNC_RESOURCE_QCAPS) before it registers with an OS type, reserves what it will allocate with
FUNC_CFG before the first ring (resources.py), names its event ring to the firmware and sizes every ring explicitly.
Each chip and firmware feature is used only where Linux finds it:
Thor and Thor2 chips only (VER_GET chip_num), variable-size WQEs on Thor2 only, short HWRM commands when VER_GET
requires them, backing store v2 when FUNC_QCAPS offers it (v1 is refused), hardware retransmission when QUERY_FUNC's
dev_cap_flags offer it, and the MSN or PSN search table its dev_cap_ext_flags_2 name (hw/firmware.py).
"""
from __future__ import annotations

import ctypes
import functools
import socket
from typing import Any, Callable, Protocol

import anyio
import anyio.abc

from . import backing_store, l2_receive, log, quiesce, resources
from .close_budget import CLOSE_TIMEOUT, CloseBudget
from .commands import OWN_FID
from .firmware_events import (EVENT_RING_DEPTH, EVENT_VECTOR, DeviceEvent, EventInbox, EventRing, EventRouter, Link,
                              event_kind, reset_text)
from .hwrm_channel import HWRM_TIMEOUT, HwrmChannel
from .interrupts import CREQ_VECTOR, NQ_VECTOR, wake
from .link import PortLink, single_pf
from .liveness import Liveness
from .mr_pages import MAX_MR_SIZE
from .rcfw_channel import CREQ_DEPTH, RCFW_TIMEOUT, RcfwChannel
from .rings import Ring
from .teardown import Teardown
from ..autogen import bnxt
from ..errors import ClosedError, DeviceLostError, FabricError, FirmwareError, PCIError
from ..hw.async_event import ASYNC_EVENT_ENTRY, EventId, forwarding
from ..hw.cqe import CREQ_ENTRY, NQ_ENTRY
from ..hw.firmware import (THOR2_CHIPS, THOR_CHIPS, add_gid_fields, host_msn_table, hw_retx_supported,
                           mr_register_alloc, ring_stats_size, roce_doorbell_offset, short_commands_required)
from ..hw.wqe import STATIC_WQE_SGES
from ..pci import PAGE_SIZE, PCIDevice
from ..pci.atomic_ops import AtomicOps, determine_atomics
from ..version import __version__

NQ_DEPTH = 4096
VECTORS = (CREQ_VECTOR, NQ_VECTOR, EVENT_VECTOR)  # every MSI-X vector the driver waits on
# What boot allocates, reserved with FUNC_CFG before the first ring (resources.py): an NQ-type ring per vector (the
# CREQ, the RoCE NQ, the event ring), the L2 receive path's completion ring, RX ring and VNIC (l2_receive.py) and the RoCE
# statistics context (_open_rcfw); no TX ring, no RSS context.
RESERVATION = {"num_msix": len(VECTORS), "num_cmpl_rings": 1, "num_tx_rings": 0, "num_rx_rings": 1,
               "num_stat_ctxs": 1, "num_vnics": 1, "num_rsscos_ctxs": 0}


def ipv4_gid(ip: str) -> bytes:
    """The RoCEv2 GID of an IPv4 address: ::ffff:a.b.c.d."""
    return bytes(10) + b"\xff\xff" + socket.inet_aton(ip)


class DeviceObject(Protocol):
    """A verbs object (CQ, QP, MR) attached to a device (`Device.attach`): told when the device is lost, released
    when it closes (lower `release_order` first: QPs before the CQs they use)."""
    release_order: int

    def device_lost(self, error: DeviceLostError) -> None: ...  # fail work in flight; new work raises at once

    async def release(self) -> None: ...  # destroy or deregister, as the user would

    def forget(self) -> None: ...  # the device is quiesced without having let go of it: free its host memory


class Device:
    """One BNXT function driven from userspace. Use `aiofabric.open_nic`, which boots and closes it."""

    port_mtu = 0  # the port's MTU (FUNC_QCFG admin_mtu), from boot on; 0: not known

    def __init__(self, pci: PCIDevice, ip: str, *, hwrm_timeout: float = HWRM_TIMEOUT,
                 rcfw_timeout: float = RCFW_TIMEOUT) -> None:
        self.pci, self.ip, self.gid = pci, ip, ipv4_gid(ip)
        self.bar0, self.doorbells = pci.map_bar(0), pci.map_bar(2)
        self._interrupts = {v: pci.interrupt_fd(v) if v < pci.num_vectors else None for v in VECTORS}
        self.liveness = Liveness(pci)
        self.liveness.on_lost(self._on_lost)
        self.budget = CloseBudget()
        self.hwrm_channel = HwrmChannel(pci, self.bar0, self.liveness, self.budget, hwrm_timeout)
        self.port_link = PortLink(self.hwrm_channel, pci.address)  # the interface's UP and the link (link.py)
        self._rcfw_channel: RcfwChannel | None = None  # from boot on: its rings need HWRM commands first
        self._rcfw_timeout = rcfw_timeout
        self.router = EventRouter(pci.address, self._firmware_event_heard)
        self._inbox = EventInbox(pci.address)  # firmware events heard on either ring, for a task to handle
        self.events = self.router.events  # what no handler took, and the handlers of function events: the NIC's
        self.function_handlers = self.router.function_handlers  # users read and add to them here
        self.teardown = Teardown(pci.address)
        self.objects: dict[int, DeviceObject] = {}  # attached verbs objects by id()
        self._closing = False  # close() started: the public API refuses, teardown still runs commands
        self._close_lock = anyio.Lock()
        self._closed = False  # close() ran to the end
        self._background: list[anyio.CancelScope] = []  # the NIC's own tasks: close() stops them first
        self.fw_version = self.hwrm_version = self.mac = ""  # mac: as text; mac_address: its 6 bytes
        self.mac_address = b""
        self.port_id = self.db_offset = self.nq_id = 0
        self.gid_index = -1
        self.caps: dict[str, int] = {}
        self.chip_num = 0  # VER_GET's
        self.stats_length = 0  # a statistics context's block, from VNIC_QCAPS on (hw.firmware.ring_stats_size)
        self.variable_wqes = self.hw_retransmit = self.host_msn_table = False  # what boot finds the device offers
        self.atomic_ops = AtomicOps(False, f"{pci.address} has not booted")  # whether its PCIe path takes atomics
        self.mr_register_alloc = False

    @property
    def link(self) -> Link:
        """PORT_PHY_QCFG's, from boot on; link events keep it current."""
        return self.port_link.link

    # -- what verbs objects and the poller use ------------------------------------------------------------------------
    def interrupt_fd(self, vector: int) -> int | None:
        """The eventfd of MSI-X `vector` (one of VECTORS); None on a platform without them."""
        return self._interrupts[vector]

    @property
    def rcfw_channel(self) -> RcfwChannel:
        if self._rcfw_channel is None:
            raise ClosedError(f"{self.pci.address}: the RCFW channel is not open (the device has not booted)")
        return self._rcfw_channel

    @property
    def rcfw_timeout(self) -> float:
        return self._rcfw_timeout

    @rcfw_timeout.setter
    def rcfw_timeout(self, seconds: float) -> None:
        self._rcfw_timeout = seconds
        if self._rcfw_channel is not None:
            self._rcfw_channel.timeout = seconds

    async def hwrm(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run HWRM command `name` (e.g. "func_qcaps") with the given input fields; return its output structure.

        `command_timeout` (seconds) overrides the channel's default; it is not called `timeout` because firmware
        structures have fields of that name. Once posted, a command is waited for even if the caller is cancelled
        (bounded by the timeout), so a cancelled allocation never leaves an object the driver does not know of."""
        self.check_open()
        return await self.hwrm_channel.command(name, command_timeout=command_timeout, **fields)

    async def rcfw(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run RoCE firmware command `name` (e.g. "create_qp"); return the side-buffer result or the CREQ reply.

        Like `hwrm`, a posted command is waited for even if the caller is cancelled (bounded by the timeout)."""
        self.check_open()
        return await self.rcfw_channel.command(name, command_timeout=command_timeout, **fields)

    async def rcfw_release(self, name: str, **fields: Any) -> bool:
        """An RCFW command that frees a firmware object (destroy_qp, deallocate_key, ...): unlike `rcfw`, it runs
        while the device closes too (bounded by the close's budget). False if the device is gone (the command not
        run, or cut short): then nothing holds the object's memory any more, and it is freed all the same."""
        try:
            await self.rcfw_channel.command(name, **fields)
        except DeviceLostError:
            return False
        return True

    def attach(self, obj: DeviceObject) -> None:
        self.objects[id(obj)] = obj

    def detach(self, obj: DeviceObject) -> None:
        self.objects.pop(id(obj), None)

    async def in_background(self, service: Callable[..., Any], *,
                            task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run one of the NIC's own tasks (CREQ reader, removal watch, poller) under a scope close() cancels: once the
        NIC closes they must not touch the rings it frees, even when close() runs inside the NIC's block."""
        with anyio.CancelScope() as scope:
            self._background.append(scope)
            if self._closing:
                scope.cancel()
            task_status.started()
            await service()

    # -- events --------------------------------------------------------------------------------------------------------
    async def _on_firmware_event(self, event_id: int, data1: int, data2: int) -> None:
        """An event from the event ring or the CREQ (firmware_events.py). Link and MTU changes are read again from
        the firmware, as bnxt_en does; a reset notice or a fatal firmware error loses the device at once: the firmware
        resets it and everything must be set up again."""
        kind = event_kind(event_id, data1)
        detail = {"data1": data1, "data2": data2}
        self._reset_notice(kind, data1)
        try:
            if kind == "link":
                await self._query_link()
                detail.update(up=self.link.up, speed_mbps=self.link.speed_mbps)
            elif kind == "mtu":
                await self._query_port_mtu()
                detail.update(port_mtu=self.port_mtu)
        except FabricError as exc:  # the event still counts; what it changed stays unknown
            log.warning("%s: %s event %#x: the port could not be queried: %s", self.pci.address, kind, event_id, exc)
        self.router.announce(DeviceEvent(kind, event_id, detail))

    def _firmware_event_heard(self, event_id: int, data1: int, data2: int) -> None:
        """A firmware event, from the event ring or the CREQ (where the firmware sends them until FUNC_CFG names the
        event ring, _open_events): a reset notice loses the device at once, and the event then waits for the inbox's
        task. Neither reader waits for the HWRM commands a link change needs: a reset notice that follows a link
        change is heard while the firmware, already resetting, leaves the link query unanswered. The event is put
        first: what the loss's listeners ask of the inbox (`after_events`) comes after it."""
        self._inbox.put(event_id, data1, data2)
        self._reset_notice(event_kind(event_id, data1), data1)

    def after_events(self, step: Callable[[], None]) -> None:
        """Run `step` once every firmware event heard so far has been handled and announced (by the inbox's task,
        which a close stops: then never)."""
        self._inbox.then(step)

    async def _event_ring_heard(self, event_id: int, data1: int, data2: int) -> None:
        self._firmware_event_heard(event_id, data1, data2)

    def _reset_notice(self, kind: str, data1: int) -> None:
        """A reset notice or a fatal firmware error loses the device, unless it is lost already."""
        if kind in ("reset", "fatal") and self.liveness.alive:
            self.liveness.declare(DeviceLostError(
                f"{self.pci.address}: firmware event RESET_NOTIFY ({reset_text(data1)}): the firmware resets the "
                "device, which must be opened again"))

    # -- liveness ----------------------------------------------------------------------------------------------------
    @property
    def lost(self) -> DeviceLostError | None:
        return self.liveness.lost

    @property
    def alive(self) -> bool:
        return self.liveness.alive

    def check_alive(self) -> None:
        """Raise DeviceLostError at once if the device is gone."""
        self.liveness.check()

    def check_open(self) -> None:
        """Raise at once if the NIC is lost (DeviceLostError) or closed (ClosedError): the public API's guard."""
        self.liveness.check()
        if self._closing:
            raise ClosedError(f"{self.pci.address} is closed")

    def _on_lost(self, error: DeviceLostError) -> None:
        if self._rcfw_channel is not None:
            self._rcfw_channel.fail_all(error)
        for obj in list(self.objects.values()):  # work in flight fails now; new work raises at once
            obj.device_lost(error)
        for fd in self._interrupts.values():  # wake every interrupt waiter so it notices
            wake(fd)

    # -- bring-up ------------------------------------------------------------------------------------------------------
    async def boot(self, task_group: anyio.abc.TaskGroup) -> None:
        self.pci.reset()  # first: whatever a previous holder (a crashed driver) left running stops here
        quiesce.track(self)
        self.pci.enable_bus_master()
        task_group.start_soon(self.in_background, self.liveness.watch)
        major, minor, update = (int(x) for x in bnxt.HWRM_INTERFACE_VERSION.split(".")[:3])
        ver = await self.hwrm("ver_get", hwrm_intf_maj=major, hwrm_intf_min=minor, hwrm_intf_upd=update)
        self.fw_version = f"{ver.hwrm_fw_maj_8b}.{ver.hwrm_fw_min_8b}.{ver.hwrm_fw_bld_8b}.{ver.hwrm_fw_rsvd_8b}"
        self.hwrm_version = f"{ver.hwrm_intf_maj_8b}.{ver.hwrm_intf_min_8b}.{ver.hwrm_intf_upd_8b}"
        self.chip_num = ver.chip_num
        if self.chip_num not in THOR_CHIPS | THOR2_CHIPS:
            raise PCIError(f"{self.pci.address}: chip {self.chip_num:#06x} is not supported: only Thor (P5) and Thor2 "
                           "(P7) chips are (VER_GET chip_num)")
        self.variable_wqes = self.chip_num in THOR2_CHIPS  # Linux bnxt_re_set_drv_mode
        self.hwrm_channel.configure(ver.max_req_win_len or bnxt.HWRM_MAX_REQ_LEN, ver.max_ext_req_len,
                                    short_commands_required(ver.dev_caps_cfg))
        if ver.def_req_timeout:
            self.hwrm_channel.timeout = max(self.hwrm_channel.timeout, ver.def_req_timeout / 1000)
        await self.hwrm("func_reset", command_timeout=4 * self.hwrm_channel.timeout)
        caps = await self.hwrm("func_qcaps", fid=OWN_FID)  # then, as inside Linux's bnxt_hwrm_func_qcaps, the
        # backing store and FUNC_RESOURCE_QCAPS, all before FUNC_DRV_RGTR (bnxt_fw_init_one_p2)
        if not caps.flags & bnxt.FUNC_QCAPS_RESP_FLAGS_ROCE_V2_SUPPORTED:
            raise FirmwareError("HWRM func_qcaps", 0, "NO_ROCE", f"{self.pci.address} does not support RoCE v2")
        self.mac_address, self.port_id = bytes(caps.mac_address), caps.port_id
        self.mac = self.mac_address.hex(":")
        self.caps = {"max_rsscos_ctx": caps.max_rsscos_ctx, "max_cmpl_rings": caps.max_cmpl_rings,
                     "max_tx_rings": caps.max_tx_rings, "max_rx_rings": caps.max_rx_rings,
                     "max_stat_ctx": caps.max_stat_ctx, "flags": caps.flags, "flags_ext": caps.flags_ext,
                     "flags_ext2": caps.flags_ext2}
        await backing_store.configure(self.pci, self.hwrm, self.caps["flags_ext"], self.caps["flags_ext2"],
                                      self.teardown.on_quiesced)
        limits = await self.hwrm("func_resource_qcaps", fid=OWN_FID)
        registered = await self.hwrm("func_drv_rgtr", enables=bnxt.FUNC_DRV_RGTR_REQ_ENABLES_OS_TYPE
                                     | bnxt.FUNC_DRV_RGTR_REQ_ENABLES_VER
                                     | bnxt.FUNC_DRV_RGTR_REQ_ENABLES_ASYNC_EVENT_FWD,
                                     async_event_fwd=forwarding(EventId), os_type=bnxt.FUNC_DRV_RGTR_REQ_OS_TYPE_LINUX,
                                     **dict(zip(("ver_maj_8b", "ver_min_8b", "ver_upd_8b"),
                                                (int(x) for x in __version__.split(".")))))
        self.teardown.on_close("HWRM func_drv_unrgtr", lambda: self.hwrm_channel.command("func_drv_unrgtr"))
        self.port_link.registered(registered.flags, self.port_id)
        self.teardown.on_close("HWRM func_drv_if_change (down)", self.port_link.interface_down)  # after every free
        qcfg = await self.hwrm("func_qcfg", fid=OWN_FID)
        self.db_offset = roce_doorbell_offset(self.chip_num, qcfg.legacy_l2_db_size_kb, PAGE_SIZE)
        self.stats_length = ring_stats_size(self.chip_num, (await self.hwrm("vnic_qcaps")).max_aggs_supported)
        await resources.reserve(self.pci.address, self.hwrm, RESERVATION, limits)  # Linux bnxt_set_dflt_rings
        self.atomic_ops = determine_atomics(self.pci, self.pci.upstream_path())  # bnxt_re, before its RCFW channel
        log.info("%s: atomics %s: %s", self.pci.address, "on" if self.atomic_ops.enabled else "off",
                 self.atomic_ops.detail)
        await self.port_link.interface_up()  # before the first ring, as bnxt_en's open (link.py)
        await self._open_rcfw(task_group)
        await l2_receive.open_path(self.pci, self.hwrm, self.hwrm_channel.command, self._alloc_ring,
                                   self.teardown, self.nq_id, self.mac_address)
        await self._open_events(task_group)
        await self.port_link.update_phy_setting(single_pf(qcfg))  # the link comes up later: its event says so
        gid_field, mac_field = add_gid_fields(self.gid, self.mac_address)
        gid = await self.rcfw("add_gid", gid=gid_field, src_mac=mac_field)
        self.gid_index = gid.xid
        self.teardown.on_close("RCFW delete_gid",
                               lambda: self.rcfw_channel.command("delete_gid", gid_index=self.gid_index))
        log.info("%s: booted fw %s mac %s gid %s", self.pci.address, self.fw_version, self.mac, self.ip)

    async def _open_rcfw(self, task_group: anyio.abc.TaskGroup) -> None:
        creq = Ring(self.pci, CREQ_DEPTH, CREQ_ENTRY.size)
        creq_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_NQ, creq, CREQ_VECTOR)
        channel = self._rcfw_channel = RcfwChannel(
            self.pci, self.bar0, self.doorbells, self.db_offset, self.interrupt_fd(CREQ_VECTOR), creq, creq_id,
            self.liveness, self.budget, self.router.creq_event, self._rcfw_timeout)
        self.teardown.on_quiesced(channel.cmdq.free)
        self.bar0.write_block(bnxt.RCFW_COMM_BASE_OFFSET, channel.init_block())
        await task_group.start(self.in_background, functools.partial(self._inbox.serve, self._on_firmware_event))
        channel.reading = True  # before the reader runs: no command may find the CREQ unserved and read it too
        await task_group.start(self.in_background, channel.serve)

        function = await self.rcfw("query_func")
        self.hw_retransmit = hw_retx_supported(function.dev_cap_flags)
        self.host_msn_table = host_msn_table(function.dev_cap_ext_flags_2)
        self.mr_register_alloc = mr_register_alloc(function.dev_cap_flags)  # else ALLOCATE_MRW first (verbs/mr.py)
        self.caps.update(max_qp=function.max_qp, max_cq=function.max_cq, max_mr=function.max_mr,
                         max_qp_wr=function.max_qp_wr, max_cqe=function.max_cqe,
                         max_sge=function.max_sge if self.variable_wqes else STATIC_WQE_SGES,
                         max_qp_rd_atom=function.max_qp_rd_atom, max_inline_data=function.max_inline_data,
                         max_mr_size=MAX_MR_SIZE)  # Linux's, not the firmware's (bnxt_re_query_device)
        self._stats = self.pci.alloc_dma(PAGE_SIZE)
        self.teardown.on_quiesced(self._stats.free)
        stat = await self.hwrm("stat_ctx_alloc", stats_dma_addr=self._stats.bus_addr,
                               stats_dma_length=self.stats_length, update_period_ms=1000,
                               stat_ctx_flags=bnxt.STAT_CTX_ALLOC_REQ_STAT_CTX_FLAGS_ROCE)
        self._stat_ctx_id = stat.stat_ctx_id
        self.teardown.on_close("HWRM stat_ctx_free",
                               lambda: self.hwrm_channel.command("stat_ctx_free", stat_ctx_id=self._stat_ctx_id))
        flags = bnxt.CMDQ_INITIALIZE_FW_FLAGS_HW_REQUESTER_RETX_SUPPORTED if self.hw_retransmit else 0
        await self.rcfw("initialize_fw", stat_ctx_id=self._stat_ctx_id, log2_dbr_pg_size=0, flags=flags)
        self.teardown.on_close("RCFW deinitialize_fw", lambda: self.rcfw_channel.command("deinitialize_fw"))
        self.nq = Ring(self.pci, NQ_DEPTH, NQ_ENTRY.size)
        self.nq_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_NQ, self.nq, NQ_VECTOR)

    async def _alloc_ring(self, ring_type: int, ring: Ring, logical_id: int = 0, **fields: Any) -> int:
        self.teardown.on_quiesced(ring.free)  # even if the firmware refuses it: it is ours to free, after the close
        reply = await self.hwrm("ring_alloc", ring_type=ring_type, page_tbl_addr=ring.base, page_size=12,
                                page_tbl_depth=ring.level, length=ring.depth, logical_id=logical_id,
                                int_mode=bnxt.RING_ALLOC_REQ_INT_MODE_MSIX, **fields)
        ring_id = reply.ring_id
        self.teardown.on_close(f"HWRM ring_free {ring_id}",
                               lambda: self.hwrm_channel.command("ring_free", ring_type=ring_type, ring_id=ring_id))
        return ring_id

    async def _open_events(self, task_group: anyio.abc.TaskGroup) -> None:
        """The event ring and its reader (firmware_events.py), then the MTU as it is now."""
        ring = Ring(self.pci, EVENT_RING_DEPTH, ASYNC_EVENT_ENTRY.size)
        ring_id = await self._alloc_ring(bnxt.RING_ALLOC_REQ_RING_TYPE_NQ, ring, EVENT_VECTOR)
        try:  # right after the ring, as Linux's bnxt_hwrm_set_async_event_cr; till then events come on the CREQ
            await self.hwrm("func_cfg", fid=OWN_FID, enables=bnxt.FUNC_CFG_REQ_ENABLES_ASYNC_EVENT_CR,
                            async_event_cr=ring_id)
        except FirmwareError as exc:  # Linux only warns: the events keep coming on the CREQ
            log.warning("%s: HWRM func_cfg async_event_cr %d: %s", self.pci.address, ring_id, exc)
        reader = EventRing(ring, ring_id, self.doorbells, self.db_offset, self.interrupt_fd(EVENT_VECTOR),
                           self.liveness)  # it sleeps without a timeout: a loss wakes it (_on_lost)
        await task_group.start(self.in_background, functools.partial(reader.serve, self._event_ring_heard))
        await self._query_port_mtu()

    async def _query_link(self) -> None:
        """The link, from PORT_PHY_QCFG (bnxt_en's bnxt_update_link)."""
        await self.port_link.query()

    async def _query_port_mtu(self) -> None:
        """The port's MTU: FUNC_QCFG's admin_mtu, as DPDK's bnxt_hwrm_func_qcfg reads it (bnxt_en takes
        max_mtu_configured as the ceiling of its netdev's MTU: the fallback)."""
        qcfg = await self.hwrm_channel.command("func_qcfg", fid=OWN_FID)
        self.port_mtu = qcfg.admin_mtu or qcfg.max_mtu_configured

    async def set_loopback(self, mode: int) -> None:
        """PHY loopback: bnxt PORT_PHY_CFG_REQ_LPBK_NONE / _LOCAL / _REMOTE / _EXTERNAL."""
        await self.hwrm("port_phy_cfg", port_id=self.port_id, enables=bnxt.PORT_PHY_CFG_REQ_ENABLES_LPBK, lpbk=mode)

    # -- close -----------------------------------------------------------------------------------------------------
    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Free every firmware object in reverse order of creation, quiesce the device (FUNC_RESET, bus mastering
        off, a function-level reset), and only then free the host memory it could write: rings, context and
        statistics memory, and the memory of objects the firmware did not let go of. Memory is freed even when the
        firmware is gone.

        From the first call on, the public API raises ClosedError. It works without the NIC's background tasks (a
        cancelled block has lost them): each command then reads its own reply, and notices a device that died.
        The firmware gets at most `timeout` seconds in all: once spent, the remaining commands are not sent (the
        function reset that ends the close frees what they would have)."""
        if not self._closing:
            self._closing = True
            for scope in self._background:  # the poller and the CREQ reader stop here; commands read their own replies
                scope.cancel()
        if self._closed:
            return
        self.budget.start(timeout)  # each call's own budget: a cancelled close resumes
        async with self._close_lock:  # a second close waits for the first, and takes over if that one is cancelled
            if self._closed:  # the first finished meanwhile
                return
            await self._release_objects()
            await self.teardown.run_commands()
            await self._quiesce()
            await self._free_memory()
            self._closed = True
            quiesce.untrack(self)

    async def _release_objects(self) -> None:
        """Destroy the attached verbs objects, QPs first (they hold CQs), then the rest, newest first. One the
        firmware did not let go of stays attached: its memory is freed after the quiesce."""
        for obj in sorted(reversed(list(self.objects.values())), key=lambda o: o.release_order):
            try:
                await obj.release()
            except Exception as exc:  # still close the rest
                log.warning("%s: close: %s", self.pci.address, exc)

    async def _quiesce(self) -> None:
        """Stop the device from touching host memory before any is freed, as Linux's bnxt_en does before it frees
        its rings: FUNC_RESET through the firmware (within the close's budget), then bus mastering off and a
        function-level reset, which stop its DMA whatever the firmware did (the FUNC_RESET is skipped when the
        firmware left the last HWRM command unanswered)."""
        if self.alive and self.hwrm_channel.answering and not self.budget.spent():
            try:
                await self.hwrm_channel.command("func_reset")
            except FabricError as exc:  # a firmware that does not answer is stopped below all the same
                log.info("%s: close: HWRM func_reset: %s", self.pci.address, exc)
        quiesce.stop_dma(self.pci)

    async def _free_memory(self) -> None:
        for obj in list(self.objects.values()):  # what the firmware kept: the device is stopped, it is ours again
            obj.forget()
        self.objects.clear()
        self.teardown.free_memory()
        await self.hwrm_channel.close()
