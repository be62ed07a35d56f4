"""The user-facing NIC: a booted `Device` that creates and tracks verbs objects, and `open_nic`."""
from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import re
from typing import Any, AsyncIterator

import anyio
import anyio.abc
import anyio.lowlevel

from .poller import Poller
from .cq import CompletionQueue
from .events import DEFAULT_BUFFER, EventHub, EventStream
from .mr import MemoryRegion
from .post import QueuePair
from .types import ALL_ACCESS, Access, check_range
from ..driver.close_budget import CLOSE_TIMEOUT
from ..driver.device import Device, DeviceObject
from ..driver.firmware_events import DeviceEvent, Link
from ..driver.link import LINK_UP_TIMEOUT
from ..hw.ring import power_of_two
from ..errors import ClosedError, PCIError
from ..hw.verbs import path_mtu_for_port
from ..pci import DmaBudget, DmaBuffer, PCIDevice
from ..pci.sysfs import SysfsPCIDevice
from ..pci.vfio import VfioPCIDevice
from ..util.taskgroups import own_task_group

__all__ = ["NIC", "DmaBudget", "PCI_ADDRESS", "open_nic", "open_pci"]  # DmaBudget: open_nic's, from the seam
PCI_ADDRESS = re.compile(r"(?:sysfs:)?[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")  # a PCI NIC's spec
_sim_numbers = itertools.count()


class NIC:
    """A booted NIC: its `device` (firmware channels, bring-up, events, close) and its completion `poller`, and the
    verbs objects made on it, destroyed (QPs first) when the NIC closes."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.poller = Poller(device)
        self._events = EventHub(device)

    async def boot(self, task_group: anyio.abc.TaskGroup) -> None:
        await self.device.boot(task_group)
        task_group.start_soon(self.device.in_background, self.poller.run)

    async def create_cq(self, depth: int = 4096) -> CompletionQueue:
        """A CQ with room for at least `depth` completions (rounded up to a power of two)."""
        self.device.check_open()
        check_range("depth", depth, 1, self.caps.get("max_cqe") or 1 << 22)
        return await CompletionQueue.create(self.device, self.poller, power_of_two(depth))

    async def create_qp(self, cq: CompletionQueue | None = None, *, send_cq: CompletionQueue | None = None,
                        recv_cq: CompletionQueue | None = None, sq_depth: int = 128, rq_depth: int = 128,
                        max_send_sge: int = 1, max_recv_sge: int = 1, max_inline_data: int = 0) -> QueuePair:
        """An RC QP in INIT. Pass one `cq` for both directions, or `send_cq` and `recv_cq`. A work request carries
        up to `max_send_sge`/`max_recv_sge` scatter/gather elements, or up to `max_inline_data` bytes inline (the
        device's limits are in `caps`: max_sge, max_inline_data); each raises the send queue's slots per WQE."""
        self.device.check_open()
        send_cq, recv_cq = send_cq or cq, recv_cq or cq
        if send_cq is None or recv_cq is None:
            raise ValueError("create_qp needs a completion queue: cq=, or send_cq= and recv_cq=")
        for queue in (send_cq, recv_cq):
            if queue.device is not self.device:
                raise ValueError(f"CQ {queue.id:#x} belongs to {queue.device.pci.address}, not {self.pci.address}")
            if queue.closed:
                raise ClosedError(f"CQ {queue.id:#x} was destroyed")
        max_wr = self.caps.get("max_qp_wr") or 0xFFFF
        check_range("sq_depth", sq_depth, 1, max_wr)
        check_range("rq_depth", rq_depth, 1, max_wr)
        max_sge = self.caps.get("max_sge") or 1
        check_range("max_send_sge", max_send_sge, 1, max_sge)
        check_range("max_recv_sge", max_recv_sge, 1, max_sge)
        check_range("max_inline_data", max_inline_data, 0, self.caps.get("max_inline_data") or 0)
        return await QueuePair.create(self.device, self.poller, send_cq, recv_cq, sq_depth=sq_depth,
                                      rq_depth=rq_depth, max_send_sge=max_send_sge, max_recv_sge=max_recv_sge,
                                      max_inline_data=max_inline_data)

    async def register_mr(self, memory: DmaBuffer | int, access: Access = ALL_ACCESS) -> MemoryRegion:
        """Register `memory` (a DMA buffer, or a size in bytes to allocate) for local and remote access. Remote
        atomics (Access.REMOTE_ATOMIC) raise UnsupportedError on a NIC without atomics (`info()["atomic_cap"]`)."""
        self.device.check_open()
        if Access.REMOTE_ATOMIC in Access(access):
            self.device.atomic_ops.check(f"{self.pci.address}: a region open to remote atomics")
        if not isinstance(memory, DmaBuffer):  # a size: an int, not a bool, a float or a string of digits
            check_range("size", memory, 1, self.caps.get("max_mr_size") or 1 << 40)
            return await MemoryRegion.register(self.device, self.pci.alloc_dma(memory), access, owns_buffer=True)
        return await MemoryRegion.register(self.device, memory, access)

    # -- the device's, for the NIC's users -------------------------------------------------------------------------
    async def hwrm(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run any HWRM command by name (see `Device.hwrm`)."""
        return await self.device.hwrm(name, command_timeout=command_timeout, **fields)

    async def rcfw(self, name: str, *, command_timeout: float | None = None, **fields: Any) -> ctypes.Structure:
        """Run any RoCE firmware command by name (see `Device.rcfw`)."""
        return await self.device.rcfw(name, command_timeout=command_timeout, **fields)

    async def set_loopback(self, mode: int) -> None:
        await self.device.set_loopback(mode)

    async def wait_for_link(self, timeout: float = LINK_UP_TIMEOUT) -> Link:
        """The port's link once it is up. The open brings the link up but does not wait for it, as Linux's does not
        (a real link trains for a second or more; an emulated one for its link_delay_ms): traffic sent before it is
        up is lost, and retried by the QPs. LinkDownError after `timeout` seconds, saying what the PHY reports."""
        self.device.check_open()
        return await self.device.port_link.wait_up(timeout)

    def events(self, buffer: int = DEFAULT_BUFFER) -> EventStream:
        """Every asynchronous event from now on (QP and CQ errors, link, MTU, reset, fatal and function events), as an
        async stream: `async for event in nic.events(): ...`. It holds up to `buffer` events for a reader that is
        behind, then drops the oldest and says how many (a `missed` event); it ends when the NIC closes, or after a
        `lost` event when the device is lost (events.py has the rules)."""
        self.device.check_open()
        return self._events.subscribe(buffer)

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Destroy every verbs object (QPs first), then free the device's own firmware objects (see `Device.close`).
        Event streams end first."""
        self._events.end()
        await self.device.close(timeout)

    @property
    def pci(self) -> PCIDevice:
        return self.device.pci

    @property
    def ip(self) -> str:
        return self.device.ip

    @property
    def gid(self) -> bytes:
        return self.device.gid

    @property
    def mac(self) -> str:
        return self.device.mac

    @property
    def caps(self) -> dict[str, int]:
        return self.device.caps

    @property
    def path_mtu(self) -> int:
        """The largest RoCE path MTU the port's MTU carries (4096 while the port MTU is not known)."""
        return path_mtu_for_port(self.device.port_mtu) if self.device.port_mtu else 4096

    @property
    def fw_version(self) -> str:
        return self.device.fw_version

    @property
    def hwrm_version(self) -> str:
        return self.device.hwrm_version

    @property
    def port_id(self) -> int:
        return self.device.port_id

    @property
    def gid_index(self) -> int:
        return self.device.gid_index

    @property
    def hw_retransmit(self) -> bool:
        """Whether the firmware retransmits from the host MSN table (QUERY_FUNC said it can)."""
        return self.device.hw_retransmit

    @property
    def alive(self) -> bool:
        return self.device.alive

    @property
    def event_log(self) -> collections.deque[DeviceEvent]:
        """The last 256 asynchronous events no handler took (function events, errors of objects gone), to look at
        after the fact; `events()` streams every event as it comes."""
        return self.device.events

    @property
    def objects(self) -> dict[int, DeviceObject]:
        """The live verbs objects, by id()."""
        return self.device.objects

    @property
    def rcfw_timeout(self) -> float:
        return self.device.rcfw_timeout

    @rcfw_timeout.setter
    def rcfw_timeout(self, seconds: float) -> None:
        self.device.rcfw_timeout = seconds

    def info(self) -> dict[str, Any]:
        link = self.device.link
        return {"nic": self.pci.address, "fw_version": self.fw_version, "hwrm_version": self.hwrm_version,
                "mac": self.mac, "port": self.port_id, "ip": self.ip, "gid": _gid_text(self.gid),
                "gid_index": self.gid_index, "hw_retransmit": self.hw_retransmit,
                "link": "up" if link.up else "down", "link_speed_mbps": link.speed_mbps,
                "port_mtu": self.device.port_mtu, "caps": dict(self.caps),
                "atomic_cap": "global" if self.device.atomic_ops.enabled else "none",
                "atomic_path": self.device.atomic_ops.detail}


def _gid_text(gid: bytes) -> str:
    return ":".join(gid[i:i + 2].hex() for i in range(0, 16, 2))


def open_pci(spec: str, **options: Any) -> PCIDevice:
    """The seam for a spec:

    - "sim", "sim:NAME": an emulated NIC in an emulator process (its own, or shared: the `process` option);
    - a PCI address like "0000:41:00.0": the function through VFIO (bound to vfio-pci; the IOMMU isolates it, or,
      in VFIO's no-IOMMU mode, nothing does and a warning says so);
    - "sysfs:" and a PCI address: the function through raw sysfs, unsafe: no isolation (the IOMMU must be off or
      in passthrough, and the device can write any memory), no interrupts (the driver polls), and nothing stops the
      device when the process is killed (VFIO's kernel side resets it when its files close).
    """
    if spec == "sim" or spec.startswith("sim:"):
        from ..pci.emulated import SimPCIDevice  # the only place the driver reaches into sim/
        return SimPCIDevice(spec.partition(":")[2] or f"sim{next(_sim_numbers)}", **options)
    if PCI_ADDRESS.fullmatch(spec):
        if options:
            raise PCIError(f"options {sorted(options)} apply only to emulated NICs")
        if spec.startswith("sysfs:"):
            return SysfsPCIDevice(spec.removeprefix("sysfs:"))
        return VfioPCIDevice(spec)
    raise PCIError(f"bad NIC spec {spec!r}: use 'sim', 'sim:NAME', a PCI address like 0000:41:00.0 (through VFIO) "
                   "or sysfs:0000:41:00.0 (raw sysfs, unsafe)")


@contextlib.asynccontextmanager
async def open_nic(spec: str = "sim", *, ip: str | None = None, hwrm_timeout: float | None = None,
                   dma_budget: DmaBudget | None = None, **options: Any) -> AsyncIterator[NIC]:
    """Boot the NIC named by `spec` and close it (freeing every firmware object) when the block exits.

    `ip` is the NIC's IPv4 address (its GID is ::ffff:ip); an emulated NIC without one picks a free 127.0.0.x.
    Extra `options` configure an emulated NIC (every one is in aiofabric/sim/options.py; docs/emulator.md says what
    each does): `mac`, `fw_latency_us`, `transport` ("udp" or "raw"), `loss`, `dup`, `reorder`, `corrupt`, `seed`
    (wire faults), `pcap` (a file to write every packet to) and `pcap_max_bytes`, `port_mtu`, `profile` (the chip
    and firmware it plays), `pcie_path` (the PCIe path to the root complex, which decides whether atomics work),
    `link_delay_ms` (how long its link trains), `netns` (a network namespace to run in) and `process` (a name: NICs
    opened with the same one share an emulator process). `dma_budget` caps the DMA memory (rings, registered memory,
    the NIC's own) this NIC and any others sharing the budget may hold: past it, what would allocate raises
    MemoryError.

    The open brings the port's link up but does not wait for it (`NIC.wait_for_link` does). An exception raised in
    the block leaves it as itself. The close runs even when the block is cancelled from outside, shielded and
    bounded (CLOSE_TIMEOUT); whatever it could not free goes with the emulator process.
    """
    if spec.startswith("sim"):
        options["ip"] = ip  # None: the emulator binds a free 127.0.0.x itself (race-free across processes)
    elif ip is None and PCI_ADDRESS.fullmatch(spec):
        raise PCIError(f"{spec}: give the NIC's IPv4 address (ip=...)")
    pci = await _start(spec, options)
    pci.dma_budget = dma_budget
    try:
        if ip is None:  # only an emulated NIC picks its own address (SimPCIDevice.ip); a PCI NIC's is the caller's
            ip = getattr(pci, "ip")
        nic = NIC(Device(pci, ip, **({"hwrm_timeout": hwrm_timeout} if hwrm_timeout else {})))
    except BaseException:
        await _close_seam(pci)
        raise
    try:
        async with own_task_group() as services:  # the CREQ reader, the poller, the removal watch
            try:
                await nic.boot(services)
                yield nic
            finally:
                services.cancel_scope.cancel()
    finally:
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT + 5):  # a backstop: close()
                await nic.close()                                                      # bounds its own waits
        finally:
            await _close_seam(pci)


async def _close_seam(pci: PCIDevice) -> None:
    """Release the device in a worker thread: an emulator's exit is waited for (~70 ms), which must not stall the
    loop's other tasks. Shielded: a cancelled block still releases it."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(pci.close)


async def _start(spec: str, options: dict[str, Any]) -> PCIDevice:
    """Open the seam in a worker thread (an emulator takes ~0.1 s to start). A cancel that arrives meanwhile is
    delivered after the device is open, so it is closed again rather than lost with its process and memory."""
    with anyio.CancelScope(shield=True):
        pci = await anyio.to_thread.run_sync(functools.partial(open_pci, spec, **options))
    try:
        await anyio.lowlevel.checkpoint()
    except BaseException:
        await _close_seam(pci)
        raise
    return pci
