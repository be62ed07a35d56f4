"""The driver-side half of the emulated NIC: starts the emulator process and presents it through the seam.

BAR0 and the DMA arena are memfds mapped by both processes. MMIO writes that have side effects on a real NIC (the
HWRM trigger, the RCFW mailbox and producer, every doorbell, config-space writes) additionally travel to the emulator
as 16-byte "kick" records on a stream socket, so the device sees them in program order, like posted PCIe writes.
MSI-X vectors are eventfds the emulator writes. When the emulator dies, the kick socket reads EOF: that is the
removal fd. A second socket carries the debug channel (object counts, fault injection), never used by the driver.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import subprocess
import sys

from ..pci import PCI_COMMAND, PCI_VENDOR_ID, Bar, DmaBuffer, PCIDevice, PCIError
from .memory import ARENA_SIZE, BAR0_SIZE, BAR2_SIZE, BUS_BASE, PAGE, PageAllocator

KICK = struct.Struct("<BxxxIQ")  # space (0 = BAR0, 2 = BAR2, CONFIG_SPACE), offset, value
CONFIG_SPACE = 0xFF
BAR0_KICK_FROM = 0x100  # BAR0 below this is the HWRM request window: plain memory, read on the trigger
DEVICE_ID_BCM57608 = 0x1760
NUM_VECTORS = 8
START_TIMEOUT = 20.0


class SimBar(Bar):
    def __init__(self, index: int, memory: mmap.mmap | None, size: int, kick: socket.socket, kick_from: int) -> None:
        self.index, self.size, self._kick, self._kick_from = index, size, kick, kick_from
        self._words = memoryview(memory).cast("I") if memory is not None else None

    def _check(self, offset: int, width: int) -> None:
        if offset % width or not 0 <= offset <= self.size - width:
            raise ValueError(f"bad {width * 8}-bit MMIO access at {offset:#x} of BAR{self.index}")

    def read32(self, offset: int) -> int:
        self._check(offset, 4)
        return self._words[offset // 4] if self._words is not None else 0xFFFFFFFF

    def read64(self, offset: int) -> int:
        return self.read32(offset) | self.read32(offset + 4) << 32

    def write32(self, offset: int, value: int) -> None:
        self._check(offset, 4)
        if self._words is not None:
            self._words[offset // 4] = value & 0xFFFFFFFF
        if offset >= self._kick_from:
            self._send(offset, value & 0xFFFFFFFF)

    def write64(self, offset: int, value: int) -> None:
        self._check(offset, 8)
        if self._words is not None:
            self._words[offset // 4], self._words[offset // 4 + 1] = value & 0xFFFFFFFF, value >> 32
        if offset >= self._kick_from:
            self._send(offset, value)

    def _send(self, offset: int, value: int) -> None:
        try:
            self._kick.sendall(KICK.pack(self.index, offset, value))
        except OSError:
            pass  # the device is gone; writes to a dead device vanish, the removal fd tells the driver


class SimPCIDevice(PCIDevice):
    """An emulated BNXT NIC in its own OS process. `options` go to the emulator (ip, mac, fw_latency_us, ...);
    `netns` starts the process inside that network namespace, so its wire is the namespace's interfaces."""

    def __init__(self, name: str = "sim", **options) -> None:
        self.address, self.name = f"sim:{name}", name
        self._bar0_fd = os.memfd_create(f"aiofabric-{name}-bar0")
        self._arena_fd = os.memfd_create(f"aiofabric-{name}-dma")
        os.ftruncate(self._bar0_fd, BAR0_SIZE)
        os.ftruncate(self._arena_fd, ARENA_SIZE)
        self._bar0_mem = mmap.mmap(self._bar0_fd, BAR0_SIZE)
        self._arena = mmap.mmap(self._arena_fd, ARENA_SIZE)
        self._arena_view = memoryview(self._arena)
        self._allocator = PageAllocator(ARENA_SIZE)
        self._live: dict[int, DmaBuffer] = {}
        self._irqs = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(NUM_VECTORS)]
        self._kick, kick_peer = socket.socketpair()
        self._debug, debug_peer = socket.socketpair()
        self._config = bytearray(256)
        struct.pack_into("<HH", self._config, PCI_VENDOR_ID, 0x14E4, DEVICE_ID_BCM57608)
        config = {"name": name, "bar0_fd": self._bar0_fd, "arena_fd": self._arena_fd, "kick_fd": kick_peer.fileno(),
                  "debug_fd": debug_peer.fileno(), "irq_fds": self._irqs, **options}
        netns = options.get("netns")  # run the NIC inside a network namespace: another host on the same machine
        self.process = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", "aiofabric.sim.process",
             json.dumps(config)],
            pass_fds=[self._bar0_fd, self._arena_fd, kick_peer.fileno(), debug_peer.fileno(), *self._irqs],
            stdin=subprocess.DEVNULL)
        kick_peer.close()
        debug_peer.close()
        self._debug_file = self._debug.makefile("rwb", buffering=0)
        self._bars = {0: SimBar(0, self._bar0_mem, BAR0_SIZE, self._kick, BAR0_KICK_FROM),
                      2: SimBar(2, None, BAR2_SIZE, self._kick, 0)}
        self._closed = False
        try:
            self.debug({"op": "ping"}, timeout=START_TIMEOUT)
        except Exception:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    # -- the seam --------------------------------------------------------------------------------------------------
    def map_bar(self, index: int) -> Bar:
        if index not in self._bars:
            raise PCIError(f"{self.address} has no BAR{index}")
        return self._bars[index]

    def read_config(self, offset: int, size: int) -> int:
        return int.from_bytes(self._config[offset:offset + size], "little")

    def write_config(self, offset: int, value: int, size: int) -> None:
        self._config[offset:offset + size] = value.to_bytes(size, "little")
        if offset == PCI_COMMAND:
            self._kick.sendall(KICK.pack(CONFIG_SPACE, offset, value))

    def alloc_dma(self, size: int, contiguous: bool = False) -> DmaBuffer:
        length = -(-max(size, 1) // PAGE) * PAGE
        start = self._allocator.alloc(length)
        view = self._arena_view[start:start + length]
        view[:] = bytes(length)
        buffer = DmaBuffer(view, [BUS_BASE + start + i for i in range(0, length, PAGE)], True,
                           lambda: self._free(start))
        self._live[start] = buffer
        return buffer

    def _free(self, start: int) -> None:
        self._live.pop(start, None)
        self._allocator.free(start)

    @property
    def num_vectors(self) -> int:
        return NUM_VECTORS

    def interrupt_fd(self, vector: int) -> int:
        return self._irqs[vector]

    def removal_fd(self) -> int | None:
        return self._kick.fileno()

    def removal_reason(self) -> str:
        try:
            status = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "emulator stopped answering"
        return f"emulator exited with status {status}"

    @property
    def dma_bytes_in_use(self) -> int:
        return self._allocator.bytes_used

    # -- the debug channel (tests and tools only) -----------------------------------------------------------------
    def debug(self, request: dict, timeout: float = 5.0) -> dict:
        """One request/response on the emulator's debug channel: {"op": "objects"}, {"op": "inject", ...}, ..."""
        self._debug.settimeout(timeout)
        try:
            self._debug_file.write(json.dumps(request).encode() + b"\n")
            line = self._debug_file.readline()
        except (OSError, socket.timeout) as exc:
            raise PCIError(f"{self.address}: debug channel failed ({exc})") from exc
        if not line:
            raise PCIError(f"{self.address}: emulator exited (status {self.process.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise PCIError(f"{self.address}: debug request {request.get('op')!r} failed: {reply['error']}")
        return reply

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kick.close()  # EOF tells the emulator to exit
        self._debug.close()
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in self._irqs:
            os.close(fd)
        self._live.clear()
        self._arena_view.release()
        for m in (self._arena, self._bar0_mem):
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does
        os.close(self._bar0_fd)
        os.close(self._arena_fd)

