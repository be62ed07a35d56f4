"""The user-facing NIC: a booted `Device` that creates and tracks verbs objects, and `open_nic`."""
from __future__ import annotations

import contextlib
import functools
import itertools
import re
from typing import Any, AsyncIterator

import anyio
import anyio.lowlevel

from .device import CLOSE_TIMEOUT, Device, log
from .errors import ClosedError
from .pci import DmaBudget, DmaBuffer, PCIDevice, PCIError, SysfsPCIDevice
from .poller import Poller
from .queues import ALL_ACCESS, Access, CompletionQueue, MemoryRegion, QueuePair, check_range
from .taskgroups import own_task_group

__all__ = ["NIC", "DmaBudget", "PCI_ADDRESS", "open_nic", "open_pci"]  # DmaBudget: open_nic's, from the seam
PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_sim_numbers = itertools.count()


class NIC(Device):
    """A booted NIC. Verbs objects created here are destroyed (QPs first) when the NIC closes."""

    async def boot(self, task_group: anyio.abc.TaskGroup) -> None:
        await super().boot(task_group)
        self.poller = Poller(self)
        task_group.start_soon(self.in_background, self.poller.run)

    async def create_cq(self, depth: int = 4096) -> CompletionQueue:
        """A CQ with room for at least `depth` completions (rounded up to a power of two)."""
        self.check_open()
        check_range("depth", depth, 1, self.caps.get("max_cqe") or 1 << 22)
        cq = CompletionQueue(self, 1 << (depth - 1).bit_length())
        await cq._create()
        self.poller.add(cq)
        return cq

    async def create_qp(self, cq: CompletionQueue | None = None, *, send_cq: CompletionQueue | None = None,
                        recv_cq: CompletionQueue | None = None, sq_depth: int = 128, rq_depth: int = 128,
                        max_send_sge: int = 1, max_recv_sge: int = 1) -> QueuePair:
        """An RC QP in INIT. Pass one `cq` for both directions, or `send_cq` and `recv_cq`."""
        self.check_open()
        send_cq, recv_cq = send_cq or cq, recv_cq or cq
        if send_cq is None or recv_cq is None:
            raise ValueError("create_qp needs a completion queue: cq=, or send_cq= and recv_cq=")
        for queue in (send_cq, recv_cq):
            if queue.device is not self:
                raise ValueError(f"CQ {queue.id:#x} belongs to {queue.device.pci.address}, not {self.pci.address}")
            if queue.closed:
                raise ClosedError(f"CQ {queue.id:#x} was destroyed")
        max_wr, max_sge = self.caps.get("max_qp_wr") or 0xFFFF, self.caps.get("max_sge") or 6
        check_range("sq_depth", sq_depth, 1, max_wr)
        check_range("rq_depth", rq_depth, 1, max_wr)
        check_range("max_send_sge", max_send_sge, 1, max_sge)
        check_range("max_recv_sge", max_recv_sge, 1, max_sge)
        qp = QueuePair(self, send_cq, recv_cq, sq_depth=sq_depth, rq_depth=rq_depth, max_send_sge=max_send_sge,
                       max_recv_sge=max_recv_sge)
        await qp._create()
        try:
            await qp.to_init()
        except BaseException:  # cancelled or refused: the caller never gets the QP, so it must not outlive this
            with anyio.CancelScope(shield=True):
                await qp.destroy()
            raise
        return qp

    async def register_mr(self, memory: DmaBuffer | int, access: Access = ALL_ACCESS) -> MemoryRegion:
        """Register `memory` (a DMA buffer, or a size in bytes to allocate) for local and remote access."""
        self.check_open()
        owned = isinstance(memory, int)
        if owned:
            check_range("size", memory, 1, self.caps.get("max_mr_size") or 1 << 40)
        mr = MemoryRegion(self, self.pci.alloc_dma(memory) if owned else memory, access, owns_buffer=owned)
        await mr._register()
        return mr

    async def _teardown_all(self) -> None:
        # QPs first (they hold CQs), then the rest, newest first; then the device's own objects
        for obj in sorted(reversed(list(self.objects.values())), key=lambda o: not isinstance(o, QueuePair)):
            try:
                await (obj.destroy() if isinstance(obj, (QueuePair, CompletionQueue)) else obj.deregister())
            except Exception as exc:  # still close the rest
                log.warning("%s: close: %s", self.pci.address, exc)
        self.objects.clear()
        await super()._teardown_all()

    def info(self) -> dict[str, Any]:
        return {"nic": self.pci.address, "fw_version": self.fw_version, "hwrm_version": self.hwrm_version,
                "mac": self.mac, "port": self.port_id, "ip": self.ip, "gid": _gid_text(self.gid),
                "gid_index": self.gid_index, "hw_retransmit": self.hw_retransmit, "caps": dict(self.caps)}


def _gid_text(gid: bytes) -> str:
    return ":".join(gid[i:i + 2].hex() for i in range(0, 16, 2))


def open_pci(spec: str, **options: Any) -> PCIDevice:
    """The seam for a spec: "sim", "sim:NAME" (emulated NIC process) or a PCI address like "0000:41:00.0"."""
    if spec == "sim" or spec.startswith("sim:"):
        from .sim.host import SimPCIDevice  # the only place the driver reaches into sim/
        return SimPCIDevice(spec.partition(":")[2] or f"sim{next(_sim_numbers)}", **options)
    if PCI_ADDRESS.fullmatch(spec):
        if options:
            raise PCIError(f"options {sorted(options)} apply only to emulated NICs")
        return SysfsPCIDevice(spec)
    raise PCIError(f"bad NIC spec {spec!r}: use 'sim', 'sim:NAME' or a PCI address like 0000:41:00.0")


@contextlib.asynccontextmanager
async def open_nic(spec: str = "sim", *, ip: str | None = None, hwrm_timeout: float | None = None,
                   dma_budget: DmaBudget | None = None, **options: Any) -> AsyncIterator[NIC]:
    """Boot the NIC named by `spec` and close it (freeing every firmware object) when the block exits.

    `ip` is the NIC's IPv4 address (its GID is ::ffff:ip); an emulated NIC without one picks a free 127.0.0.x.
    Extra `options` configure an emulated NIC: `fw_latency_us`, `transport` ("udp" or "raw"), `loss`, `dup`,
    `reorder`, `corrupt`, `seed` (wire faults), `pcap` (a file to write every packet to) and `netns` (a network
    namespace to run in). `dma_budget` caps the DMA memory (rings, registered memory, the NIC's own) this NIC
    and any others sharing the budget may hold: past it, what would allocate raises MemoryError.

    An exception raised in the block leaves it as itself. The close runs even when the block is cancelled from
    outside, shielded and bounded (CLOSE_TIMEOUT); whatever it could not free goes with the emulator process.
    """
    if spec.startswith("sim"):
        options["ip"] = ip  # None: the emulator binds a free 127.0.0.x itself (race-free across processes)
    elif ip is None and PCI_ADDRESS.fullmatch(spec):
        raise PCIError(f"{spec}: give the NIC's IPv4 address (ip=...)")
    pci = await _start(spec, options)
    pci.dma_budget = dma_budget
    try:
        nic = NIC(pci, ip or pci.ip, **({"hwrm_timeout": hwrm_timeout} if hwrm_timeout else {}))
    except BaseException:
        pci.close()
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
            pci.close()


async def _start(spec: str, options: dict[str, Any]) -> PCIDevice:
    """Open the seam in a worker thread (an emulator takes ~0.1 s to start). A cancel that arrives meanwhile is
    delivered after the device is open, so it is closed again rather than lost with its process and memory."""
    with anyio.CancelScope(shield=True):
        pci = await anyio.to_thread.run_sync(functools.partial(open_pci, spec, **options))
    try:
        await anyio.lowlevel.checkpoint()
    except BaseException:
        pci.close()
        raise
    return pci
