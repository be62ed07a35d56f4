"""The driver-side half of the emulated NIC: starts the emulator process and presents it through the seam.

BAR0 and the DMA arena are memfds mapped by both processes. MMIO writes that have side effects on a real NIC (the HWRM
trigger, the RCFW mailbox and producer, every doorbell, config-space writes) additionally travel to the emulator as
16-byte "kick" records on a stream socket, so the device sees them in program order, like posted PCIe writes; a write
that finds the socket full waits for the emulator to drain it (`send_kicks`), as a posted write stalls the CPU when the
link's buffers are full. MSI-X vectors are eventfds the emulator writes. When the emulator dies, the kick socket reads
EOF: that is the removal fd. A second socket carries the debug channel (object counts, fault injection), never used by
the driver; its first line is the emulator's start-up answer: ready (with the address it bound) or why it could not
start.

The emulator process (`EmulatorProcess`: one per NIC, or one for the NICs opened with the same `process` option) lives
as long as the driver *process* (it watches the driver's pidfd, see aiofabric/sim/process.py) or until its last NIC's
close(). close() releases everything at once, even while a caller still holds a view of DMA memory: such views are left
pointing at private zero pages, never at the memfd.
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

from .linux import HUGE_PAGE_SIZE, MAP_NORESERVE, map_at, virt_addr
from .seam import Bar, DmaBuffer, PCIDevice
from .upstream import ConfigImage, UpstreamPath
from ..errors import PCIError
from ..sim.kick import (ATTACH_FDS, BAR0_KICK_FROM, CONFIG_SPACE, DMA_MAP, DMA_UNMAP, FUNCTION_RESET, KICK, NUM_VECTORS,
                        PUNCHED, send_kicks)
from ..sim.memory import ARENA_SIZE, BAR0_SIZE, BAR2_SIZE, BUS_BASE, PAGE, PageAllocator
from ..sim.netns import NETNS_DIR
from ..sim.options import check_options
from ..sim.options import FAULTS as FAULTS  # the wire faults, for the tools (which do not import sim/)
from ..sim.pcie import DEFAULT_PCIE_PATH, function_config, port_configs
from ..sim.profiles import DEFAULT_PROFILE as DEFAULT_PROFILE, PROFILES as PROFILES  # and for the tools' --profile

if TYPE_CHECKING:
    from .emulated_debug import DebugClient

START_TIMEOUT = 20.0
# Buffers are placed as the VFIO pool's IOVAs are (pci/dma_pool.py, iommu.py): one past a hugepage, or asked contiguous,
# starts at a multiple of its size rounded up to a power of two, so a memory region gets the large pages it would get
# through VFIO. Up to 1 GiB, the largest page a region has: beyond, alignment buys nothing but arena.
ALIGNED_FROM, MAX_ALIGNMENT = HUGE_PAGE_SIZE, 1 << 30
PLACEMENT = ("netns", "process")  # options the driver side keeps

log = logging.getLogger("aiofabric.sim")
_told: set[str | None] = set()  # the namespaces our emulators moved to that this process has logged: each is said once

def _map_shared(fd: int, length: int) -> tuple[mmap.mmap, int]:
    """Map a memfd shared, as an mmap object that holds no descriptor of its own.

    mmap.mmap(fd) keeps a dup of fd for its whole life, which a still-exported mapping stretches until GC. So the
    object maps anonymous memory and the memfd is mapped over it in place; the object unmaps that range when closed.
    """
    m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
    address = virt_addr(m)
    try:
        map_at(address, length, mmap.MAP_SHARED, fd)
    except BaseException:
        m.close()
        raise
    return m, address


def _unmap(m: mmap.mmap, address: int, length: int) -> None:
    """Close a mapping from _map_shared now. If a caller still holds a view of it, the range becomes private zero
    pages instead: the view stays safe to touch, and the memfd's pages are no longer mapped here."""
    try:
        m.close()
    except BufferError:
        map_at(address, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1)


class EmulatorProcess:
    """An emulator process (aiofabric/sim/process.py) and its control socket: NICs attach to it, and it exits once the
    last one has closed and `release()` has closed the control socket.

    `acquire` gives each SimPCIDevice opened with the option process=NAME the one process of that name (and
    namespace) in this driver process while it has NICs; a NIC without it gets a process of its own."""

    _shared: dict[tuple[str, str | None], EmulatorProcess] = {}
    _lock = threading.Lock()

    def __init__(self, label: str, netns: str | None = None, key: tuple[str, str | None] | None = None) -> None:
        self.key, self.users = key, 0
        self.control, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"control_fd": peer.fileno(), "driver_pid": os.getpid(), "label": label}
        try:
            self.popen = subprocess.Popen(
                [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", "aiofabric.sim.process",
                 json.dumps(config)], pass_fds=[peer.fileno()], stdin=subprocess.DEVNULL)
        except BaseException:
            self.control.close()
            raise
        finally:
            peer.close()

    @classmethod
    def acquire(cls, label: str, netns: str | None, name: str | None) -> EmulatorProcess:
        """A process for one more NIC: the shared one called `name` (started if it is not running), or a new one."""
        if name is None:
            process = cls(label, netns)
            process.users = 1
            return process
        with cls._lock:
            key = (name, netns)
            running = cls._shared.get(key)
            if running is None or running.popen.poll() is not None:
                running = cls._shared[key] = cls(name, netns, key)
            running.users += 1
            return running

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def attach(self, config: dict[str, Any], fds: list[int]) -> None:
        """Send a NIC's config and descriptors (config["fds"] names their places in `fds`); OSError if the process
        is gone."""
        socket.send_fds(self.control, [json.dumps(config).encode()], fds)

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout=timeout)

    def release(self) -> None:
        """One NIC fewer. After the last one the control socket closes and the process is waited for (killed if it
        has not exited within 2 s)."""
        with self._lock:
            self.users -= 1
            if self.users > 0:
                return
            if self.key is not None and self._shared.get(self.key) is self:
                del self._shared[self.key]
            self.control.close()
        try:
            self.popen.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


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
            self._send(KICK.pack(self.index, offset, value & 0xFFFFFFFF))

    def write64(self, offset: int, value: int) -> None:
        self._check(offset, 8)
        if self._words is not None:
            self._words[offset // 4], self._words[offset // 4 + 1] = value & 0xFFFFFFFF, value >> 32
        if offset >= self._kick_from:
            self._send(KICK.pack(self.index, offset, value))

    def write64_doorbells(self, offset: int, values: list[int]) -> None:
        """One kick message for all of them: the emulator reads them in order, with one wake-up."""
        self._check(offset, 8)
        if offset < self._kick_from or self._words is not None:
            super().write64_doorbells(offset, values)
            return
        self._send(b"".join(KICK.pack(self.index, offset, value) for value in values))

    def close(self) -> None:
        """Drop the register view; later reads see a removed device (all ones), writes vanish."""
        if self._words is not None:
            self._words.release()
            self._words = None

    def _send(self, records: bytes) -> None:
        try:
            send_kicks(self._kick, records)
        except OSError:
            pass  # the device is gone; writes to a dead device vanish, the removal fd tells the driver


class SimPCIDevice(PCIDevice):
    """An emulated BNXT NIC in an emulator process: its own, or one it shares with the NICs opened with the same
    `process` option.

    `options` go to the emulator; see aiofabric/sim/options.py and docs/emulator.md: `ip` (without one the emulator
    binds a free 127.0.0.x itself, race-free across processes; `self.ip` says which, and `self.netns` if UDP 4791 was
    taken on every one of the host's and it moved to this user's private network namespace), `mac`, `fw_latency_us`,
    `transport`, the wire faults `loss`/`dup`/`reorder`/`corrupt` with `seed`, `pcap` and `pcap_max_bytes` (the capture
    and its bound), `port_mtu`, `profile` (the chip and firmware it plays), `pcie_path` (the PCIe path to the root
    complex, which decides whether atomics work), `netns`, which starts the process inside that network namespace,
    so its wire is the namespace's interfaces, and `process`, a name: the NICs this process opens with the same name
    (and namespace) share one emulator process. Bad options raise ValueError before anything
    starts; an emulator that cannot start raises PCIError with its reason.
    """

    ip: str
    netns: str | None  # where its wire is: netns=, or this user's private namespace if 4791 was unusable on the host

    def __init__(self, name: str = "sim", **options: Any) -> None:
        options = check_options(options)
        self.address, self.name = f"sim:{name}", name
        netns = options.get("netns")  # run the NIC inside a network namespace: another host on the same machine
        if netns and not os.path.exists(os.path.join(NETNS_DIR, netns)):
            raise PCIError(f"{self.address}: no network namespace {netns!r} (see `ip netns list`)")
        self._closed = True  # until there is something to close
        self._bar0_fd = os.memfd_create(f"aiofabric-{name}-bar0")
        self._arena_fd = os.memfd_create(f"aiofabric-{name}-dma")
        os.ftruncate(self._bar0_fd, BAR0_SIZE)
        os.ftruncate(self._arena_fd, ARENA_SIZE)
        self._bar0_mem, self._bar0_address = _map_shared(self._bar0_fd, BAR0_SIZE)
        self._arena, self._arena_address = _map_shared(self._arena_fd, ARENA_SIZE)
        self._arena_view = memoryview(self._arena)
        self._allocator = PageAllocator(ARENA_SIZE)
        self._live: dict[int, DmaBuffer] = {}
        self._irqs = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(NUM_VECTORS)]
        self._kick, kick_peer = socket.socketpair()
        self._debug, debug_peer = socket.socketpair()
        self._debug_file = self._debug.makefile("rwb", buffering=0)
        pcie_path = options.get("pcie_path", DEFAULT_PCIE_PATH)
        self._config = function_config(PROFILES[options.get("profile", DEFAULT_PROFILE)].chip_num, pcie_path)
        self._upstream = UpstreamPath(tuple(ConfigImage(address, config)
                                            for address, config in port_configs(pcie_path)))
        fds = [self._bar0_fd, self._arena_fd, kick_peer.fileno(), debug_peer.fileno(), *self._irqs]
        config = {"name": name, "fds": {**{key: i for i, key in enumerate(ATTACH_FDS)},
                                        "irq_fds": list(range(len(ATTACH_FDS), len(fds)))},
                  **{key: value for key, value in options.items() if key not in PLACEMENT}, "netns": netns}
        self._bars = {0: SimBar(0, self._bar0_mem, BAR0_SIZE, self._kick, BAR0_KICK_FROM),
                      2: SimBar(2, None, BAR2_SIZE, self._kick, 0)}
        try:
            self.process = EmulatorProcess.acquire(name, netns, options.get("process"))
            self.process.attach(config, fds)
        except BaseException:  # close() releases the rest (and the process, if there is one)
            self._closed = False
            self.close()
            raise
        finally:
            kick_peer.close()
            debug_peer.close()
        self._closed = False
        try:
            self.ip, self.netns = self._wait_until_started()
        except BaseException:
            self.close()
            raise
        from .emulated_debug import \
            DebugClient  # here, not at the top: the emulator process imports this module, never anyio
        self._debug_client = DebugClient(self._debug, self.address, self.process.poll)

    def _wait_until_started(self) -> tuple[str, str | None]:
        """The emulator's one start-up line: its address and network namespace, or PCIError with the reason it gives
        (or its exit). If it had to move to this user's private namespace, that is logged once per process."""
        self._debug.settimeout(START_TIMEOUT)
        try:
            line = self._debug_file.readline()
        except (OSError, socket.timeout) as exc:
            reason = f"no answer in {START_TIMEOUT:g} s ({exc or type(exc).__name__})"
        else:
            reply = json.loads(line) if line.startswith(b"{") else {}
            if reply.get("ready"):
                moved, netns = reply.get("moved"), reply.get("netns")
                if moved and netns not in _told:
                    _told.add(netns)
                    log.warning("%s", moved)
                return reply["ip"], reply.get("netns")
            reason = reply.get("error") or self._exit_reason()
        raise PCIError(f"{self.address}: emulator failed to start: {reason}")

    def _exit_reason(self) -> str:
        try:
            return f"it exited with status {self.process.wait(timeout=2)} (its stderr may say why)"
        except subprocess.TimeoutExpired:
            return "it closed its debug channel without an answer"

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
        send_kicks(self._kick, KICK.pack(CONFIG_SPACE, offset, value))

    def upstream_path(self) -> UpstreamPath:
        """The ports the `pcie_path` option puts above the function."""
        return self._upstream

    def _alloc_dma(self, size: int, contiguous: bool) -> DmaBuffer:
        if self._closed:
            raise PCIError(f"{self.address} is closed")
        length = -(-max(size, 1) // PAGE) * PAGE
        aligned = contiguous or length > ALIGNED_FROM
        start = self._allocator.alloc(length, min(1 << (length - 1).bit_length(), MAX_ALIGNMENT) if aligned else PAGE)
        view = self._arena_view[start:start + length]
        try:  # zeroed by punching a hole (free for pages already punched), then one byte per page touches it all
            self._arena.madvise(mmap.MADV_REMOVE, start, length)
            view[::PAGE] = bytes(length // PAGE)
        except OSError:  # a kernel without MADV_REMOVE for shmem: zero every byte (twice the cost)
            view[:] = bytes(length)
        buffer = DmaBuffer(view, [BUS_BASE + start + i for i in range(0, length, PAGE)], True,
                           lambda: self._free(start))
        self._live[start] = buffer
        self._tell(DMA_MAP, start, length)
        return buffer

    def _free(self, start: int) -> None:
        """Give a buffer's pages back to the host at once (MADV_REMOVE punches a hole in the memfd, for the emulator's
        mapping too): a NIC holds the memory of what is allocated now, not the most it ever had. (Allocating touches
        every page, as pinning a real MR does, so transfers do not fault pages in.)"""
        if self._live.pop(start, None) is not None:
            length, punched = self._allocator.used[start], PUNCHED
            try:
                self._arena.madvise(mmap.MADV_REMOVE, start, length)
            except OSError:  # a kernel without it for shmem: the pages stay until the NIC closes, nothing worse
                punched = 0
            self._tell(DMA_UNMAP, start, length | punched)
            self._allocator.free(start)

    def _tell(self, space: int, offset: int, value: int) -> None:
        """A record for the emulator outside the BARs (DMA mapping, reset): in order with the MMIO kicks."""
        if not self._closed:
            with contextlib.suppress(OSError):  # a dead emulator: the removal fd tells the driver
                send_kicks(self._kick, KICK.pack(space, offset, value))

    def reset(self) -> bool:
        """A function-level reset: the emulated function drops every object and stops its DMA."""
        self._tell(FUNCTION_RESET, 0, 0)
        return True

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
    def debug_client(self) -> DebugClient:
        """The emulator's debug channel, for async code: counters, placement counts, faults (see emulated_debug.py)."""
        return self._debug_client

    def debug(self, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """One request/response on the debug channel, blocking: {"op": "objects"}, {"op": "inject", ...}, ...
        For tests and tools; async code awaits `debug_client()` instead."""
        return self._debug_client.request_blocking(request, timeout)

    def close(self) -> None:
        """Stop the emulator and release every descriptor and mapping now, whatever views callers still hold."""
        if self._closed:
            return
        self._closed = True
        self._debug_file.close()  # a makefile holds the socket's descriptor open past socket.close()
        self._kick.close()  # EOF tells the emulator to exit
        self._debug.close()
        process: EmulatorProcess | None = getattr(self, "process", None)  # unset if it never started
        if process is not None:
            process.release()
        for fd in self._irqs:
            os.close(fd)
        for buffer in self._live.values():  # the driver's own views first; callers' slices are handled by _unmap
            buffer.release_view()
        self._live.clear()
        self._arena_view.release()
        self._bars[0].close()
        _unmap(self._arena, self._arena_address, ARENA_SIZE)
        _unmap(self._bar0_mem, self._bar0_address, BAR0_SIZE)
        os.close(self._bar0_fd)
        os.close(self._arena_fd)
