"""One emulated NIC in the emulator process (process.py): the I/O shell around its sans-IO firmware and data path.

An `Emulator` maps the NIC's BAR0 and DMA arena, opens its wire (wire.py), and then, as the process's loop steps it:
decodes the driver's MMIO writes (mmio.py), runs firmware commands one at a time at the configured latency and writes
their answers into host memory, runs the RoCE data path (datapath.py) between doorbells, the wire and its timers, and
fires MSI-X eventfds. Its debug channel is debug.py's.

A NIC's config keys (JSON): name, and bar0_fd, arena_fd, kick_fd, debug_fd, irq_fds (process.attach_config); mac;
fw_latency_us; ip (the NIC's IPv4 address; when null the emulator binds the first free 127.0.0.x from a pid-derived
start and reports it); netns (the namespace `ip netns exec` started the process in: it never moves from there);
transport ("udp" default, or "raw"); the wire fault probabilities (options.FAULTS) and seed; pcap (a file that gets
every packet sent and received) and pcap_max_bytes; port_mtu (the port's MTU, port.py: longer packets are dropped);
profile (profiles.py); pcie_path (pcie.py: the path to the root complex, which decides whether atomics reach host
memory); link_delay_ms (how long the link trains before it comes up, phy.py). While port_phy_cfg selects LPBK_LOCAL,
packets go through an in-process loopback transport instead of the wire; while the link is down (until a driver
brings it up, and from a debug "event" link_down to link_up) the port carries nothing.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from typing import Any, Callable

from .datapath import Datapath
from .faults import Faults
from .freed import FreedMemory
from .function import FirmwareConfig
from .hwrm import Firmware
from .memory import ARENA_SIZE, BAR0_SIZE, BusMemory
from .mmio import Mmio
from .options import FAULTS
from .pcap import PcapWriter
from .pcie import DEFAULT_PCIE_PATH
from .phy import DEFAULT_LINK_DELAY_MS
from .port import DEFAULT_MTU as DEFAULT_PORT_MTU
from .profiles import DEFAULT_PROFILE, PROFILES
from .requester import WINDOW
from .transport import Transport
from .wire import StartupError, open_transport, open_wire
from ..autogen import bnxt

DEFAULT_LATENCY_US = 30.0
RX_BUDGET = 128  # packets taken off a transport per round
TX_BUDGET = 128  # request packets generated per round
SERVICE_SLICE = 0.0005  # seconds of receive/transmit rounds before the loop looks at kicks (doorbells) again
# Receive buffer per QP: its peer's full window (128 PSNs) of path-MTU-4096 packets (requests at a responder, READ
# responses at a requester, which asks for no more than a window of them), each costing the kernel twice its size on
# loopback (skb truesize: 8448 bytes for a 4200-byte datagram). A clean wire then never overflows the socket however
# many QPs send at once (up to udp.MAX_RECEIVE_BUFFER; beyond it drops are counted as rx_overflow).
RECEIVE_WINDOW_PER_QP = WINDOW * 2 * (4096 + 128)


def mac_for(name: str) -> bytes:
    """A stable, locally administered MAC per emulated NIC name."""
    digest = sum((i + 1) * b for i, b in enumerate(name.encode())) & 0xFFFFFF
    return bytes([0x02, 0x0A, 0xF0]) + digest.to_bytes(3, "big")


class Emulator:
    """One emulated NIC: its firmware, data path and wire, and the descriptors the driver shares with it (`config`
    names them: BAR0 and the DMA arena, mapped here; the kick and MSI-X descriptors, owned from here on; the debug
    socket stays the loop's)."""

    def __init__(self, config: dict) -> None:
        self.name = config["name"]
        self.irq_fds: list[int] = config["irq_fds"]
        self.kick = socket.socket(fileno=config["kick_fd"])
        self.pcap: PcapWriter | None = None
        self.wire: Transport | None = None
        try:
            try:
                self.bar0_map = mmap.mmap(config["bar0_fd"], BAR0_SIZE)
                self.arena_map = mmap.mmap(config["arena_fd"], ARENA_SIZE)
            finally:
                for name in ("bar0_fd", "arena_fd"):
                    os.close(config[name])  # a map holds its own descriptor
            self._start(config)
        except BaseException:
            self.close()
            raise

    def _start(self, config: dict) -> None:
        self.bar0 = memoryview(self.bar0_map)
        self.mem = BusMemory(self.arena_map)
        self.freed = FreedMemory(self.arena_map)
        mac = bytes.fromhex(config["mac"].replace(":", "")) if config.get("mac") else mac_for(self.name)
        self.fw = Firmware(self.mem, FirmwareConfig(mac=mac, profile=PROFILES[config.get("profile", DEFAULT_PROFILE)],
                                                    pcie_path=config.get("pcie_path", DEFAULT_PCIE_PATH)))
        self.fw.port.mtu = config.get("port_mtu", DEFAULT_PORT_MTU)
        self.fw.phy.delay = config.get("link_delay_ms", DEFAULT_LINK_DELAY_MS) / 1000
        self.latency = config.get("fw_latency_us", DEFAULT_LATENCY_US) * 1e-6
        self.stall = {"hwrm": 0, "rcfw": 0}  # drop this many responses: firmware timeouts on demand
        self.hang = {"hwrm": 0, "rcfw": 0}  # neither execute nor answer this many commands: a hung firmware
        self.stats = {"hwrm": 0, "rcfw": 0, "kicks": 0, "interrupts": 0, "dropped_no_bus_master": 0}
        self.creq_backlog: list[bytes] = []
        self.running = True
        self.alone = True  # the only NIC of its process (EmulatorLoop keeps this up to date)
        self.wire_readable = False  # select() said so since service() last looked
        faults = {name: config.get(name, 0.0) for name in FAULTS}
        Faults(**faults)  # a bad probability fails here, before anything is opened
        if config.get("pcap"):
            try:
                self.pcap = PcapWriter(config["pcap"], max_bytes=config.get("pcap_max_bytes"))
            except OSError as exc:
                raise StartupError(f"cannot write pcap {config['pcap']}: [Errno {exc.errno}] {exc.strerror}") from exc
        kind = config.get("transport", "udp")
        seed = config.get("seed", 0)
        wire_options = {"pcap": self.pcap, "faults": Faults(**faults, seed=seed)}
        try:
            self.wire, self.netns, self.moved = open_wire(kind, config.get("ip"), config.get("netns"), wire_options)
        except (OSError, StartupError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise StartupError(f"cannot open the {kind} transport: {why}") from exc
        self.ip = self.wire.ip
        self.window_qps = 0  # the QP count the receive buffer was last sized for
        self.datapath = Datapath(self.fw, self.ip)
        self.loopback = open_transport("loopback", self.ip, pcap=self.pcap, faults=Faults(**faults, seed=seed))
        self.mmio = Mmio(self.kick, self.fw, self.datapath, self.freed, self.stats, self.run_hwrm,
                         self.function_reset)

    # -- the process's loop calls these ------------------------------------------------------------------------------
    def descriptors(self) -> list[tuple[Any, Callable[[], None]]]:
        """What the loop watches for this NIC but its debug socket, and what to call when it is readable (the wire
        only says so: service() reads it)."""
        watched: list[tuple[Any, Callable[[], None]]] = [(self.kick, self.on_kick)]
        wire_fd = self.wire.fileno() if self.wire is not None else None
        if wire_fd is not None:
            watched.append((wire_fd, self.on_wire))
        return watched

    def step(self) -> None:
        """Everything the last events and the timers due asked for: the link's training, RoCE commands, doorbells,
        packets, interrupts."""
        self.fw.phy.tick(time.monotonic())
        self.run_rcfw()
        self.size_receive_window()
        self.service()
        self.fire_interrupts()

    def close(self) -> None:
        """Release the NIC's transports, maps and descriptors but the debug socket (the emulator process may serve
        other NICs on). Views of the maps that data-path objects still hold keep their pages until collected."""
        for transport in (self.wire, getattr(self, "loopback", None)):
            if transport is not None:
                transport.close()
        if self.pcap is not None:
            self.pcap.close()
        self.kick.close()
        for fd in self.irq_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.irq_fds = []
        if hasattr(self, "bar0"):
            self.bar0.release()
        for name in ("bar0_map", "arena_map"):
            with contextlib.suppress(AttributeError, BufferError):
                getattr(self, name).close()

    def on_kick(self, blocking: bool = True) -> None:
        if not self.mmio.receive(blocking):
            self.running = False  # the driver closed the device or died

    def on_wire(self) -> None:
        self.wire_readable = True

    # -- firmware ------------------------------------------------------------------------------------------------------
    def firmware_delay(self, started: float) -> None:
        remaining = self.latency - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)

    def run_hwrm(self) -> None:
        """The HWRM trigger: execute the request in the BAR0 window and answer in host memory (valid byte last) after
        the configured latency (not while bus mastering is off: the answer is a DMA write). No interrupt: a request
        with cmpl_ring 0xFFFF gets none, and a HWRM_DONE completion on a named ring is not emulated (no driver here
        names one; Linux does only for RING_FREE on its close path)."""
        started = time.perf_counter()
        request = bytes(self.bar0[:bnxt.HWRM_MAX_REQ_LEN])
        if not self.mmio.bus_master:
            self.stats["dropped_no_bus_master"] += 1  # a device without bus mastering cannot DMA its answer
            return
        if self.hang["hwrm"]:
            self.hang["hwrm"] -= 1
            return
        result = self.fw.hwrm(request)
        self.stats["hwrm"] += 1
        self.firmware_delay(started)
        if result is None:
            return
        if self.stall["hwrm"]:
            self.stall["hwrm"] -= 1
            return
        addr, response = result
        self.mem.write(addr, response[:-1])
        self.mem.write(addr + len(response) - 1, response[-1:])  # the valid byte lands last

    def run_rcfw(self) -> None:
        """Execute pending RoCE commands one at a time, answering each on the CREQ as it finishes (not while bus
        mastering is off: a device without it cannot read a command or write its answer)."""
        rcfw = self.fw.rcfw
        while self.running and self.mmio.bus_master:
            while self.creq_backlog:
                if not rcfw.post_creq(self.creq_backlog[0]):
                    return  # CREQ full: wait for the driver's consumer doorbell
                self.creq_backlog.pop(0)
                self.fire_interrupts()
            started = time.perf_counter()
            command = rcfw.next_command()
            if command is None:
                return
            if self.hang["rcfw"]:
                self.hang["rcfw"] -= 1
                continue
            entry = rcfw.execute(command)
            self.stats["rcfw"] += 1
            self.firmware_delay(started)
            if self.stall["rcfw"]:
                self.stall["rcfw"] -= 1
            else:
                self.creq_backlog.append(entry)
            self.on_kick(blocking=False)  # doorbells and new commands keep flowing while we work

    def function_reset(self) -> None:
        """A function-level reset: every firmware object, queue and pending answer is gone, DMA stops until the driver
        enables bus mastering again, and the data path starts empty."""
        self.fw.reset()
        self.datapath = self.mmio.datapath = Datapath(self.fw, self.ip)
        self.mmio.bus_master = False
        self.creq_backlog.clear()
        self.fw.interrupts.clear()
        self.stall = {"hwrm": 0, "rcfw": 0}
        self.hang = {"hwrm": 0, "rcfw": 0}
        self.stats["function_resets"] = self.stats.get("function_resets", 0) + 1

    def fire_interrupts(self) -> None:
        if not self.mmio.bus_master:  # an MSI-X message is a DMA write too
            self.fw.interrupts.clear()
            return
        for vector in self.fw.interrupts:
            if 0 <= vector < len(self.irq_fds):
                os.eventfd_write(self.irq_fds[vector], 1)
                self.stats["interrupts"] += 1
        self.fw.interrupts.clear()

    # -- data path -------------------------------------------------------------------------------------------------
    @property
    def port(self) -> Transport:
        """Where packets go: the PHY loopback while port_phy_cfg asks for it (or without an address), else the wire."""
        if self.wire is None or self.fw.loopback == bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL:
            return self.loopback
        return self.wire

    def deadline(self) -> float | None:
        """When this NIC needs a step without an event (time.monotonic()): the data path's next timer, a held
        (reordered) packet or the end of the link's training; at once while the loopback holds packets (no
        descriptor announces them); None: not before an event."""
        if self.loopback.pending:
            return 0.0
        deadline = self.datapath.next_deadline()
        for transport in (self.wire, self.loopback):
            held = transport.flush_deadline if transport is not None else None
            if held is not None and (deadline is None or held < deadline):
                deadline = held
        trained = self.fw.phy.due
        return trained if trained is not None and (deadline is None or trained < deadline) else deadline

    def size_receive_window(self) -> None:
        """Grow the wire's receive buffer with the number of QPs, so that their windows in flight fit in it."""
        count = len(self.fw.rcfw.qps)
        if count > self.window_qps and self.wire is not None:
            self.window_qps = count
            self.wire.receive_window(count * RECEIVE_WINDOW_PER_QP)

    def service(self) -> None:
        """Doorbells, received packets, timers and transmission, round after round until nothing moves.

        The wire is read when select() found it readable and then every round while the pass keeps moving packets
        (more arrive meanwhile); a wake-up for doorbells alone costs no empty receive.
        """
        dp, port, wire, loopback = self.datapath, self.port, self.wire, self.loopback
        transports = [t for t in (wire, loopback) if t is not None]
        wire_idle = not self.wire_readable and wire is not None and wire.fileno() is not None
        self.wire_readable = False
        if not self.mmio.bus_master:  # no DMA: arrivals are dropped, and nothing is placed, posted or completed
            for transport in transports:
                dropped = len(transport.receive(RX_BUDGET))
                self.stats["dropped_no_bus_master"] += dropped
            return
        until = time.monotonic() + SERVICE_SLICE
        while True:
            now = time.monotonic()
            dp.doorbells(now)
            received = 0
            backlog = False
            for transport in transports:
                # the wire when select() found it readable or packets are flowing; the PHY loopback when it holds some
                if wire_idle if transport is wire else not loopback.pending:
                    continue
                if transport is wire and wire.parsed:  # the compiled core parsed the datagrams: no Packets yet
                    arrivals = wire.receive_arrivals(RX_BUDGET)
                    if arrivals is None or not arrivals.good:
                        continue
                    received += arrivals.good
                    backlog |= arrivals.good == RX_BUDGET
                    if self.fw.port.carries_all:
                        dp.receive_arrivals(arrivals, now)
                        continue
                    packets = arrivals.packets()
                else:
                    packets = transport.receive(RX_BUDGET)
                    if not packets:
                        continue
                    received += len(packets)
                    backlog |= len(packets) == RX_BUDGET
                # before the next receive(), which may reuse the packets' buffers
                dp.receive(self.fw.port.carried(packets), now)
            if not backlog:
                # Timers fire once the arrivals queued before them are processed: a NIC keeps up with its wire, so
                # an ACK waiting in our receive queue never loses the race against a timeout (a spurious go-back).
                dp.advance(now)
            dp.pump(now, TX_BUDGET)
            outbox = dp.take_outbox()
            if outbox:
                port.send_all(self.fw.port.carried(outbox))
            # Another round while packets move. A NIC sharing its process stops after a send alone: select() says
            # whether anything came meanwhile, and the loop moves on to the other NICs (the receiver, often).
            if not (received or dp.ready or outbox and self.alone) or now > until:
                break
            wire_idle = False
        for transport in transports:
            deadline = transport.flush_deadline
            if deadline is not None and deadline <= time.monotonic():
                transport.flush()
