"""The user-facing NIC: a booted `Device` that creates and tracks verbs objects, and `open_nic`."""
from __future__ import annotations

import contextlib
import itertools
import re
import socket
from typing import Any, AsyncIterator

import anyio

from .device import Device, log
from .pci import DmaBuffer, PCIDevice, PCIError, SysfsPCIDevice
from .poller import Poller
from .queues import ALL_ACCESS, Access, CompletionQueue, MemoryRegion, QueuePair

PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_sim_numbers = itertools.count()
_loopback_hosts = itertools.count(2)
ROCE_PORT = 4791


def free_loopback_ip() -> str:
    """A 127.0.0.x address whose RoCE port is free, for an emulated NIC that was given no address."""
    for _ in range(250):
        ip = f"127.0.0.{2 + (next(_loopback_hosts) - 2) % 250}"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((ip, ROCE_PORT))
            except OSError:
                continue
        return ip
    raise PCIError("no free 127.0.0.x address with UDP port 4791 available for an emulated NIC")


class NIC(Device):
    """A booted NIC. Verbs objects created here are destroyed (QPs first) when the NIC closes."""

    async def boot(self, task_group: anyio.abc.TaskGroup) -> None:
        await super().boot(task_group)
        self.poller = Poller(self)
        task_group.start_soon(self.poller.run)

    async def create_cq(self, depth: int = 4096) -> CompletionQueue:
        cq = CompletionQueue(self, depth)
        await cq._create()
        self.poller.add(cq)
        return cq

    async def create_qp(self, cq: CompletionQueue | None = None, *, send_cq: CompletionQueue | None = None,
                        recv_cq: CompletionQueue | None = None, sq_depth: int = 128, rq_depth: int = 128,
                        max_send_sge: int = 1, max_recv_sge: int = 1) -> QueuePair:
        """An RC QP in INIT. Pass one `cq` for both directions, or `send_cq` and `recv_cq`."""
        send_cq, recv_cq = send_cq or cq, recv_cq or cq
        if send_cq is None or recv_cq is None:
            raise ValueError("create_qp needs a completion queue: cq=, or send_cq= and recv_cq=")
        qp = QueuePair(self, send_cq, recv_cq, sq_depth=sq_depth, rq_depth=rq_depth, max_send_sge=max_send_sge,
                       max_recv_sge=max_recv_sge)
        await qp._create()
        await qp.to_init()
        return qp

    async def register_mr(self, memory: DmaBuffer | int, access: Access = ALL_ACCESS) -> MemoryRegion:
        """Register `memory` (a DMA buffer, or a size to allocate) for local and remote access."""
        owned = isinstance(memory, int)
        mr = MemoryRegion(self, self.pci.alloc_dma(memory) if owned else memory, access, owns_buffer=owned)
        await mr._register()
        return mr

    async def close(self) -> None:
        # QPs first (they hold CQs), then the rest, newest first
        for obj in sorted(reversed(list(self.objects.values())), key=lambda o: not isinstance(o, QueuePair)):
            try:
                if self.alive:
                    await (obj.destroy() if isinstance(obj, (QueuePair, CompletionQueue)) else obj.deregister())
            except Exception as exc:  # still close the rest
                log.warning("%s: close: %s", self.pci.address, exc)
        self.objects.clear()
        await super().close()

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
                   **options: Any) -> AsyncIterator[NIC]:
    """Boot the NIC named by `spec` and close it (freeing every firmware object) when the block exits.

    `ip` is the NIC's IPv4 address (its GID is ::ffff:ip); an emulated NIC without one gets a free 127.0.0.x.
    Extra `options` configure an emulated NIC: `fw_latency_us`, `transport` ("udp" or "raw"), `loss`, `dup`,
    `reorder`, `corrupt`, `seed` (wire faults) and `pcap` (a file to write every packet to).
    """
    if spec.startswith("sim"):
        ip = ip or free_loopback_ip()
        options["ip"] = ip  # the emulated NIC owns this address on the wire
    elif ip is None and PCI_ADDRESS.fullmatch(spec):
        raise PCIError(f"{spec}: give the NIC's IPv4 address (ip=...)")
    pci = await anyio.to_thread.run_sync(lambda: open_pci(spec, **options))
    try:
        async with anyio.create_task_group() as tasks:
            nic = NIC(pci, ip, **({"hwrm_timeout": hwrm_timeout} if hwrm_timeout else {}))
            try:
                await nic.boot(tasks)
                yield nic
            finally:
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(30):
                        await nic.close()
                tasks.cancel_scope.cancel()
    finally:
        pci.close()
