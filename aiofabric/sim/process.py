"""The emulated NIC's process: the I/O shell around the sans-IO firmware and data path.

Started by `SimPCIDevice` as `python -m aiofabric.sim.process CONFIG_JSON`. It reads MMIO kicks in order, runs
firmware commands one at a time at the configured latency, writes responses into host memory, runs the RoCE data
path (datapath.py) between doorbells, the wire and its timers, and fires MSI-X eventfds. It blocks in select() when
there is nothing to do (it never spins: on a machine with fewer cores than busy processes, polling costs the driver
and the other NIC more than it saves), and runs as SCHED_BATCH so that its wake-ups do not preempt them either. It
exits when the driver closes the kick socket, and (PR_SET_PDEATHSIG) when the driver process dies.

Config keys (JSON): name, bar0_fd, arena_fd, kick_fd, debug_fd, irq_fds (from SimPCIDevice); mac; fw_latency_us;
ip (the NIC's IPv4 address; without one the NIC only has its PHY loopback); transport ("udp" default, or "raw");
loss, dup, reorder, corrupt (wire fault probabilities) and seed; pcap (a file that gets every packet sent).
While port_phy_cfg selects LPBK_LOCAL, packets go through an in-process loopback transport instead of the wire.

Debug "stats" reply: the shell's counters (hwrm, rcfw, kicks, interrupts, ...), the firmware's, the data path's
(packets_sent, packets_received, retransmits, acks, naks, rnr_naks, duplicates, out_of_sequence, timeouts, ...; see
Datapath.stats), `dropped` = every packet dropped on receive (bad ICRC and malformed datagrams included),
`dropped_icrc`, and the transports' own counters prefixed with "wire_" (wire_sent, wire_lost, wire_corrupted, ...).
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import selectors
import signal
import socket
import sys
import time

from ..autogen import bnxt
from .datapath import Datapath
from .host import CONFIG_SPACE, KICK
from .hwrm import Firmware, FirmwareConfig
from .memory import ARENA_SIZE, BAR0_SIZE, BusMemory
from .pcap import PcapWriter
from .wire import Faults, Transport, open_transport

HWRM_VECTOR = 0
HWRM_TRIGGER = bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER
RCFW_BASE = bnxt.RCFW_COMM_BASE_OFFSET
RCFW_TRIGGER = RCFW_BASE + bnxt.RCFW_COMM_TRIG_OFFSET
PR_SET_PDEATHSIG, PR_SET_TIMERSLACK = 1, 29
DEFAULT_LATENCY_US = 30.0
RX_BUDGET = 128  # packets taken off a transport per round
TX_BUDGET = 128  # request packets generated per round
SERVICE_SLICE = 0.0005  # seconds of receive/transmit rounds before the loop looks at kicks (doorbells) again


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def mac_for(name: str) -> bytes:
    """A stable, locally administered MAC per emulated NIC name."""
    digest = sum((i + 1) * b for i, b in enumerate(name.encode())) & 0xFFFFFF
    return bytes([0x02, 0x0A, 0xF0]) + digest.to_bytes(3, "big")


class Emulator:
    def __init__(self, config: dict) -> None:
        self.name = config["name"]
        self.bar0_map = mmap.mmap(config["bar0_fd"], BAR0_SIZE)
        self.arena_map = mmap.mmap(config["arena_fd"], ARENA_SIZE)
        self.bar0 = memoryview(self.bar0_map)
        self.mem = BusMemory(self.arena_map)
        self.kick = socket.socket(fileno=config["kick_fd"])
        self.debug = socket.socket(fileno=config["debug_fd"])
        self.irq_fds: list[int] = config["irq_fds"]
        mac = bytes.fromhex(config["mac"].replace(":", "")) if config.get("mac") else mac_for(self.name)
        self.fw = Firmware(self.mem, FirmwareConfig(mac=mac))
        self.latency = config.get("fw_latency_us", DEFAULT_LATENCY_US) * 1e-6
        self.bus_master = False
        self.stall = {"hwrm": 0, "rcfw": 0}  # drop this many responses: firmware timeouts on demand
        self.stats = {"hwrm": 0, "rcfw": 0, "kicks": 0, "interrupts": 0, "dropped_no_bus_master": 0}
        self.creq_backlog: list[bytes] = []
        self.partial = b""
        self.debug_buffer = b""
        self.running = True
        self.wire_readable = False  # select() said so since service() last looked
        self.ip = config.get("ip")
        self.datapath = Datapath(self.fw, self.ip or "0.0.0.0")
        faults = {name: config.get(name, 0.0) for name in ("loss", "dup", "reorder", "corrupt")}
        self.pcap = PcapWriter(config["pcap"]) if config.get("pcap") else None
        self.wire: Transport | None = None
        if self.ip:
            self.wire = open_transport(config.get("transport", "udp"), self.ip, pcap=self.pcap,
                                       faults=Faults(**faults, seed=config.get("seed", 0)))
        self.loopback = open_transport("loopback", self.ip or "127.0.0.1", pcap=self.pcap,
                                       faults=Faults(**faults, seed=config.get("seed", 0)))

    # -- main loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.kick, selectors.EVENT_READ, self.on_kick)
        selector.register(self.debug, selectors.EVENT_READ, self.on_debug)
        if self.wire is not None and self.wire.fileno() is not None:
            selector.register(self.wire.fileno(), selectors.EVENT_READ, self.on_wire)  # service() reads it
        try:
            while self.running:
                for key, _ in selector.select(self.timeout()):
                    key.data()
                    if not self.running:
                        break
                self.run_rcfw()
                self.service()
                self.fire_interrupts()
        finally:
            self.close()

    def close(self) -> None:
        for transport in (self.wire, self.loopback):
            if transport is not None:
                transport.close()
        if self.pcap is not None:
            self.pcap.close()

    # -- data path -------------------------------------------------------------------------------------------------
    @property
    def port(self) -> Transport:
        """Where packets go: the PHY loopback while port_phy_cfg asks for it (or without an address), else the wire."""
        if self.wire is None or self.fw.loopback == bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL:
            return self.loopback
        return self.wire

    def timeout(self) -> float | None:
        """How long select() may block: until the data path's next timer or a held (reordered) packet is due."""
        deadlines = [self.datapath.next_deadline()]
        deadlines += [transport.flush_deadline for transport in (self.wire, self.loopback) if transport is not None]
        deadlines = [d for d in deadlines if d is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def on_wire(self) -> None:
        self.wire_readable = True

    def service(self) -> None:
        """Doorbells, received packets, timers and transmission, round after round until nothing moves.

        The wire is read when select() found it readable and then every round while the pass keeps moving packets
        (more arrive meanwhile); a wake-up for doorbells alone costs no empty receive.
        """
        dp, port = self.datapath, self.port
        transports = [t for t in (self.wire, self.loopback) if t is not None]
        wire_idle = not self.wire_readable and self.wire is not None and self.wire.fileno() is not None
        self.wire_readable = False
        until = time.monotonic() + SERVICE_SLICE
        while True:
            now = time.monotonic()
            dp.doorbells(now)
            moved = 0
            for transport in transports:
                if wire_idle and transport is self.wire:
                    continue
                packets = transport.receive(RX_BUDGET)
                if packets:
                    moved += len(packets)
                    dp.receive(packets, now)  # before the next receive(), which may reuse the packets' buffers
            dp.advance(now)
            dp.pump(now, TX_BUDGET)
            outbox = dp.take_outbox()
            if outbox:
                moved += len(outbox)
                port.send_all(outbox)
            if not moved or now > until:
                break
            wire_idle = False
        for transport in transports:
            deadline = transport.flush_deadline
            if deadline is not None and deadline <= time.monotonic():
                transport.flush()

    def wire_stats(self) -> dict[str, int]:
        dp = self.datapath.stats
        stats = {name: dp[name] for name in ("packets_sent", "packets_received", "retransmits", "acks", "naks",
                                             "duplicates", "timeouts", "rnr_naks", "out_of_sequence")}
        counters = [t.counters for t in (self.wire, self.loopback) if t is not None]
        icrc = sum(c["dropped_icrc"] for c in counters)
        stats.update(dp, dropped=dp["dropped"] + icrc + sum(c["dropped_malformed"] for c in counters),
                     dropped_icrc=icrc)
        for c in counters:
            for name, value in c.items():
                stats[f"wire_{name}"] = stats.get(f"wire_{name}", 0) + value
        return stats

    def on_kick(self, blocking: bool = True) -> None:
        try:
            data = self.kick.recv(1 << 16) if blocking else self.kick.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if not data:
            self.running = False  # the driver closed the device or died
            return
        data = self.partial + data
        usable = len(data) - len(data) % KICK.size
        self.partial = data[usable:]
        for space, offset, value in KICK.iter_unpack(data[:usable]):
            self.stats["kicks"] += 1
            self.mmio_write(space, offset, value)

    def mmio_write(self, space: int, offset: int, value: int) -> None:
        if space == CONFIG_SPACE:
            self.bus_master = bool(value & 0x4)
        elif space == 2:
            self.fw.doorbell(offset, value)
        elif offset == HWRM_TRIGGER:
            self.run_hwrm()
        elif offset == RCFW_TRIGGER:
            self.fw.rcfw.trigger()
        elif RCFW_BASE <= offset < RCFW_BASE + 0x10:
            self.fw.rcfw.mailbox_write(offset - RCFW_BASE, value)

    def firmware_delay(self, started: float) -> None:
        remaining = self.latency - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)

    def run_hwrm(self) -> None:
        started = time.perf_counter()
        request = bytes(self.bar0[:bnxt.HWRM_MAX_REQ_LEN])
        if not self.bus_master:
            self.stats["dropped_no_bus_master"] += 1  # a device without bus mastering cannot DMA its answer
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
        self.fw.interrupts.append(HWRM_VECTOR)
        self.fire_interrupts()

    def run_rcfw(self) -> None:
        """Execute pending RoCE commands one at a time, answering each on the CREQ as it finishes."""
        while self.running:
            while self.creq_backlog:
                if not self.fw.rcfw.post_creq(self.creq_backlog[0]):
                    return  # CREQ full: wait for the driver's consumer doorbell
                self.creq_backlog.pop(0)
                self.fire_interrupts()
            started = time.perf_counter()
            command = self.fw.rcfw.next_command()
            if command is None:
                return
            entry = self.fw.rcfw.execute(command)
            self.stats["rcfw"] += 1
            self.firmware_delay(started)
            if self.stall["rcfw"]:
                self.stall["rcfw"] -= 1
            else:
                self.creq_backlog.append(entry)
            self.on_kick(blocking=False)  # doorbells and new commands keep flowing while we work

    def fire_interrupts(self) -> None:
        for vector in self.fw.interrupts:
            if 0 <= vector < len(self.irq_fds):
                os.eventfd_write(self.irq_fds[vector], 1)
                self.stats["interrupts"] += 1
        self.fw.interrupts.clear()

    # -- debug channel ---------------------------------------------------------------------------------------------
    def on_debug(self) -> None:
        data = self.debug.recv(1 << 16)
        if not data:
            return
        self.debug_buffer += data
        while b"\n" in self.debug_buffer:
            line, self.debug_buffer = self.debug_buffer.split(b"\n", 1)
            try:
                reply = self.debug_request(json.loads(line))
            except Exception as exc:  # a bad debug request must not take the device down
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.debug.sendall(json.dumps(reply).encode() + b"\n")

    def debug_request(self, request: dict) -> dict:
        op = request["op"]
        if op == "ping":
            return {"pid": os.getpid(), "name": self.name}
        if op == "objects":
            return {"objects": self.fw.objects()}
        if op == "stats":
            return {"stats": {**self.stats, **self.fw.stats, **self.wire_stats()}}
        if op == "datapath":
            return {"qps": self.datapath.describe(), "now": time.monotonic(), "timers": len(self.datapath._timers),
                    "last_error": self.datapath.last_error}
        if op == "inject":
            self.fw.inject_error(request["command"], request["status"], request.get("count", 1))
            return {}
        if op == "stall":
            self.stall[request["channel"]] += request.get("count", 1)
            return {}
        if op == "latency":
            self.latency = request["us"] * 1e-6
            return {}
        if op == "event":
            self.fw.rcfw.post_event(**request["event"])
            self.fire_interrupts()
            return {}
        raise ValueError(f"unknown debug op {op!r}")


def _batch_scheduling() -> None:
    """SCHED_BATCH: when a packet or a doorbell wakes the emulator, it does not preempt the process on that CPU (the
    driver, or the other end's emulator) but waits for an idle CPU or the end of that slice, as a device with its own
    silicon never takes the CPU from the host. On a machine with fewer cores than busy processes, wake-up preemption
    otherwise costs a context switch (and the caches) per packet burst: on 2 cores a busy requester was preempted
    ~20x more often, and 64 B message rates were lower and less steady (bench/datapath.py ratio_write64_vs_raw_sendto
    0.19-0.24 without, 0.23-0.27 with)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux, or not allowed: the default policy works, only less smoothly
        pass


def main() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no orphans if the driver process dies
    _prctl(PR_SET_TIMERSLACK, 1)  # microsecond firmware latencies need precise sleeps
    _batch_scheduling()
    logging.basicConfig(level=os.environ.get("AIOFABRIC_SIM_LOG", "WARNING"), stream=sys.stderr,
                        format="sim %(name)s: %(message)s")
    config = json.loads(sys.argv[1])
    if os.getppid() == 1:
        return  # the driver died before we got here
    emulator = Emulator(config)
    profile = os.environ.get("AIOFABRIC_SIM_PROFILE")  # a path: cProfile the emulator, dump stats there at exit
    if profile:
        import cProfile
        cProfile.runctx("emulator.run()", globals(), {"emulator": emulator},
                        profile.replace("%p", str(os.getpid())).replace("%n", emulator.name))
    else:
        emulator.run()


if __name__ == "__main__":
    main()
