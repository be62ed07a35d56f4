"""The emulated NICs' process: the I/O shell around the sans-IO firmware and data path.

Started by `SimPCIDevice` (host.py `EmulatorProcess`) as `python -m aiofabric.sim.process '{"control_fd": ...,
"driver_pid": ..., "label": ...}'`. It serves one NIC, or several that the driver opened with the same `process`
option: each comes as an attach message on the control socket (its config as JSON, its descriptors alongside). For
each NIC it reads MMIO kicks in order, runs firmware commands one at a time at the configured latency, writes
responses into host memory, runs the RoCE data path (datapath.py) between doorbells, the wire and its timers, and
fires MSI-X eventfds. It blocks in select() when there is nothing to do (it never spins: on a machine with fewer
cores than busy processes, polling costs the driver and the other NICs more than it saves), and runs as SCHED_BATCH
so that its wake-ups do not preempt them either. A NIC goes when the driver closes its kick socket; the process when
the control socket has closed and no NIC is left, or when the driver process exits (a pidfd in the selector).

NICs sharing a process share its CPU time, and a packet between two of them costs no process wake-up: the sender's
sendmmsg makes the receiver's socket readable and the same loop reads it next (bench/RESULTS.md, "one emulator
process"). On a machine with cores to spare, one process per NIC (the default) runs them in parallel.

Start-up: before serving, each NIC writes exactly one line on its debug socket: {"ready": true, "ip": ..., "pid":
..., "netns": ..., "moved": ...} or {"error": "<why, in one line>"} (its descriptors are then closed). SimPCIDevice
waits for that line. "netns" names the network namespace the NIC binds in (null: the one the driver is in), "moved"
says why, if the process moved to this user's private namespace because UDP 4791 was taken on every 127.0.0.x
(open_wire).

A NIC's config keys (JSON): name, and bar0_fd, arena_fd, kick_fd, debug_fd, irq_fds (attach_config); mac;
fw_latency_us; ip (the NIC's IPv4 address; when null the emulator binds the first free 127.0.0.x from a pid-derived
start and reports it); netns (the namespace `ip netns exec` started the process in: it never moves from there);
transport ("udp" default, or "raw"); loss, dup, reorder, corrupt (wire fault probabilities) and seed; pcap (a file
that gets every packet sent and received); port_mtu (the port's MTU, port.py: longer packets are dropped). While
port_phy_cfg selects LPBK_LOCAL, packets go through an in-process loopback transport instead of the wire; while the
link is down (debug "event" link_down, until link_up) the port carries nothing. The log level comes from
AIOFABRIC_SIM_LOG (WARNING).

Debug "stats" reply: the shell's counters (hwrm, rcfw, kicks, interrupts, ...), the firmware's, the data path's
(packets_sent, packets_received, retransmits, acks, naks, rnr_naks, duplicates, out_of_sequence, timeouts, ...; see
Datapath.stats, among them `dropped_bad_source` and `dropped_qp_state`: a packet not from the QP's peer, or for a QP
that does not receive), `dropped` = every packet dropped on receive (bad ICRC, malformed datagrams and loopback
senders not on 4791 included), `dropped_icrc`, `dropped_source_port` (see wire.UdpTransport), `rx_overflow` = datagrams the kernel dropped because the port's receive buffer was full (not part of
`dropped`: the protocol never saw them; the buffer grows with the QP count, see RECEIVE_WINDOW_PER_QP), and the
transports' own counters prefixed with "wire_" (wire_sent, wire_lost, wire_corrupted, ...).

Debug "placed" reply: {"qps": {QPN as a string: {write_messages, write_bytes, send_messages, send_bytes,
read_messages, read_bytes, atomic_messages, atomic_bytes}}} for every live RC QP: what it placed in memory since it was
created, each message counted once, when its last packet landed (duplicates and retransmissions never count twice).
WRITE (with or without immediate), SEND and atomics (executed, 8 bytes each) are counted by the responder, READ (the
response payload placed locally) by the requester.

Debug "fault" request: deliberate data-path bugs, so that tests can prove a verification fails when it should.
{"op": "fault", "kind": "skip_placement", "count": N}: the next N incoming WRITE messages that carry data (FIRST..LAST or
ONLY, with or without immediate) are acknowledged and completed as usual, but their payload is not placed (nor counted
by "placed"). {"op": "fault", "kind": "misplace", "count": N, "offset": K}: their payload lands K bytes away from the
RETH's address, clamped to stay inside the MR (it never faults); counted as placed. A request replaces the pending
count of its kind (count 0 cancels it).

Debug "event" request: {"op": "event", "event": {"kind": K, ...}} reports what the firmware would (hwrm.Firmware.
post_event): "link_down", "link_up", "reset_notify" and "fatal" on the async event ring, if the driver registered for
them; "qp_error", "cq_error" and "function" on the CREQ. The port's drops are the firmware's counters
dropped_link_down and dropped_oversize.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import logging
import mmap
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterator

from .datapath import Datapath
from .freed import FreedMemory
from .function import FirmwareConfig
from .hwrm import Firmware
from .kick import (ATTACH_FDS, CONFIG_SPACE, CONTROL_MESSAGE, DMA_MAP, DMA_UNMAP, FUNCTION_RESET, KICK, NUM_VECTORS,
                   PUNCHED)
from .memory import ARENA_SIZE, BAR0_SIZE, BusMemory
from .options import FAULTS
from .pcap import PcapWriter
from .port import DEFAULT_MTU as DEFAULT_PORT_MTU
from .profiles import DEFAULT_PROFILE, PROFILES
from .requester import WINDOW
from .wire import (CLONE_NEWNET, LOOPBACK_HOSTS, ROCE_PORT, Faults, NoPrivateNetns, PortTaken, Transport,
                   join_private_netns, open_on_free_loopback, open_transport, port_holder, private_netns_name, setns)
from ..autogen import bnxt
from ..hw.firmware import CMDQ_INIT, HWRM_VECTOR
from ..hw.pci import PCI_COMMAND_MASTER

HWRM_TRIGGER = bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER
RCFW_BASE = bnxt.RCFW_COMM_BASE_OFFSET
RCFW_TRIGGER = RCFW_BASE + bnxt.RCFW_COMM_TRIG_OFFSET
PR_SET_TIMERSLACK = 29
DEFAULT_LATENCY_US = 30.0
RX_BUDGET = 128  # packets taken off a transport per round
TX_BUDGET = 128  # request packets generated per round
SERVICE_SLICE = 0.0005  # seconds of receive/transmit rounds before the loop looks at kicks (doorbells) again
# Receive buffer per QP: its peer's full window (128 PSNs) of path-MTU-4096 packets (requests at a responder, READ
# responses at a requester, which asks for no more than a window of them), each costing the kernel twice its size on
# loopback (skb truesize: 8448 bytes for a 4200-byte datagram). A clean wire then never overflows the socket however
# many QPs send at once (up to wire.MAX_RECEIVE_BUFFER; beyond it drops are counted as rx_overflow).
RECEIVE_WINDOW_PER_QP = WINDOW * 2 * (4096 + 128)


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def mac_for(name: str) -> bytes:
    """A stable, locally administered MAC per emulated NIC name."""
    digest = sum((i + 1) * b for i, b in enumerate(name.encode())) & 0xFFFFFF
    return bytes([0x02, 0x0A, 0xF0]) + digest.to_bytes(3, "big")


class StartupError(Exception):
    """The emulator cannot start as configured; the message goes to the driver as the reason."""


class DriverGone(Exception):
    """The driver process exited before the emulator started: nobody is left to serve."""


def watch_driver(driver_pid: int) -> int | None:
    """A pidfd that becomes readable when the driver process exits (None on kernels before 5.3, which have none).
    Raises DriverGone if it has exited already.

    Not PR_SET_PDEATHSIG: that fires when the *thread* that forked us exits, and drivers start emulators from worker
    threads that come and go (trio retires idle ones after 10 s). The kick socket's EOF is the normal way out; the
    pidfd also covers a driver that dies while a forked child of it still holds the socket.
    """
    try:
        pidfd = os.pidfd_open(driver_pid)
    except ProcessLookupError:
        raise DriverGone() from None
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        logging.getLogger("aiofabric.sim").warning("no pidfd_open on this kernel: the kick socket alone ends the "
                                                   "emulator, so a forked child of the driver may keep it alive")
        return None
    # The driver may have died between forking us and pidfd_open, and its pid been reused: while it is still our
    # parent the pidfd names the right process (`ip netns exec` execs, so the parent is the driver there too). A
    # parent other than the driver with the driver's pid alive means a launcher in between: trust the pidfd.
    if os.getppid() != driver_pid and not os.path.exists(f"/proc/{driver_pid}"):
        os.close(pidfd)
        raise DriverGone()
    return pidfd


class Moved:
    """Where this process went when UDP 4791 was unusable on its loopback: every NIC without ip= it serves from then on
    binds in that namespace too (they stay together; an unprivileged process could not move back anyway)."""

    name: str | None = None  # the namespace, once moved
    notice: str | None = None  # what happened and why, in one line
    home: int | None = None  # the network namespace the process started in, and the one it moved to (descriptors)
    away: int | None = None


def open_wire(kind: str, ip: str | None, netns: str | None,
              options: dict[str, Any]) -> tuple[Transport, str | None, str | None]:
    """The NIC's transport, the network namespace it binds in (None: the host's) and the notice if this process had
    to move there. An address the user gave (ip=) is bound where the process started or not at all; without one, the
    first free 127.0.0.x from a pid-derived start (concurrent NICs do not collide), or, when the port is taken on
    all of them (a wildcard socket, rdma_rxe), one in this user's private namespace (wire.join_private_netns)."""
    if ip:
        with _at_home(ip):
            try:
                return open_transport(kind, ip, **options), netns, None
            except PortTaken as exc:
                raise StartupError(f"{exc.strerror} by {port_holder(ip) or 'another socket'}; the NIC was given this "
                                   "address (ip=), so it does not move to another (leave ip= out to let it pick "
                                   "one)") from exc
    first = LOOPBACK_HOSTS.start + os.getpid() % len(LOOPBACK_HOSTS)
    if Moved.name is not None:
        return open_on_free_loopback(kind, first, **options), Moved.name, Moved.notice
    try:
        return open_on_free_loopback(kind, first, **options), netns, None
    except PortTaken as exc:
        holder = port_holder(exc.ip) or "another socket"
        everywhere = f"UDP {ROCE_PORT} is taken on every 127.0.0.x"
        if netns is not None:  # the user's choice of place: not ours to change
            raise StartupError(f"{everywhere} in network namespace {netns} (on {exc.ip} by {holder}); netns= was "
                               "given, so the NIC does not move to another namespace") from exc
        home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            where = join_private_netns()
        except (NoPrivateNetns, OSError) as why:
            os.close(home)
            raise StartupError(f"{everywhere} (on {exc.ip} by {holder}), and no private network namespace can be had "
                               f"instead: {why}. Free the port (rdma_rxe: `modprobe -r rdma_rxe`), run as root, or "
                               "give netns=NAME") from exc
        taken = f"UDP {ROCE_PORT} on {exc.ip} is held by {holder}"
        Moved.name, Moved.home = private_netns_name(), home
        Moved.away = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        Moved.notice = f"{taken}; the emulated NICs of this user run in {where} instead"
        logging.getLogger("aiofabric.sim").info("%s", Moved.notice)
        return open_on_free_loopback(kind, first, **options), Moved.name, Moved.notice


@contextlib.contextmanager
def _at_home(ip: str) -> Iterator[None]:
    """Bind in the network namespace this process started in, back from the private one if it moved there."""
    if Moved.home is None or Moved.away is None:
        yield
        return
    try:
        setns(Moved.home, CLONE_NEWNET)
    except OSError as exc:  # a user namespace's member has no rights over the host's network namespace
        why = (Moved.notice or "").split(";")[0]
        raise StartupError(f"ip={ip}: this emulator process runs its NICs in {Moved.name} ({why}) and cannot bind on "
                           f"the host from there ({exc.strerror}); open this NIC in a process of its own (without "
                           "process=)") from exc
    try:
        yield
    finally:
        setns(Moved.away, CLONE_NEWNET)


class Emulator:
    """One emulated NIC: its firmware, data path and wire, and the descriptors the driver shares with it (`config`
    names them: BAR0 and the DMA arena, mapped here; the kick, debug and MSI-X descriptors, owned from here on)."""

    def __init__(self, config: dict, debug: socket.socket) -> None:
        self.name = config["name"]
        self.debug = debug  # the loop's: it answers there whether this NIC starts or not, and closes it
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
        self.fw = Firmware(self.mem, FirmwareConfig(mac=mac, profile=PROFILES[config.get("profile", DEFAULT_PROFILE)]))
        self.fw.port.mtu = config.get("port_mtu", DEFAULT_PORT_MTU)
        self.latency = config.get("fw_latency_us", DEFAULT_LATENCY_US) * 1e-6
        self.bus_master = False
        self.stall = {"hwrm": 0, "rcfw": 0}  # drop this many responses: firmware timeouts on demand
        self.hang = {"hwrm": 0, "rcfw": 0}  # neither execute nor answer this many commands: a hung firmware
        self.stats = {"hwrm": 0, "rcfw": 0, "kicks": 0, "interrupts": 0, "dropped_no_bus_master": 0}
        self.creq_backlog: list[bytes] = []
        self.partial = b""
        self.debug_buffer = b""
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

    # -- the process's loop calls these ------------------------------------------------------------------------------
    def descriptors(self) -> list[tuple[Any, Callable[[], None]]]:
        """What the loop watches for this NIC, and what to call when it is readable (the wire only says so: service()
        reads it)."""
        watched: list[tuple[Any, Callable[[], None]]] = [(self.kick, self.on_kick), (self.debug, self.on_debug)]
        wire_fd = self.wire.fileno() if self.wire is not None else None
        if wire_fd is not None:
            watched.append((wire_fd, self.on_wire))
        return watched

    def step(self) -> None:
        """Everything the last events and the timers due asked for: RoCE commands, doorbells, packets, interrupts."""
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

    # -- data path -------------------------------------------------------------------------------------------------
    @property
    def port(self) -> Transport:
        """Where packets go: the PHY loopback while port_phy_cfg asks for it (or without an address), else the wire."""
        if self.wire is None or self.fw.loopback == bnxt.PORT_PHY_CFG_REQ_LPBK_LOCAL:
            return self.loopback
        return self.wire

    def deadline(self) -> float | None:
        """When this NIC needs a step without an event (time.monotonic()): the data path's next timer or a held
        (reordered) packet; at once while the loopback holds packets (no descriptor announces them); None: not
        before an event."""
        if self.loopback.pending:
            return 0.0
        deadline = self.datapath.next_deadline()
        for transport in (self.wire, self.loopback):
            held = transport.flush_deadline if transport is not None else None
            if held is not None and (deadline is None or held < deadline):
                deadline = held
        return deadline

    def size_receive_window(self) -> None:
        """Grow the wire's receive buffer with the number of QPs, so that their windows in flight fit in it."""
        count = len(self.fw.rcfw.qps)
        if count > self.window_qps and self.wire is not None:
            self.window_qps = count
            self.wire.receive_window(count * RECEIVE_WINDOW_PER_QP)

    def on_wire(self) -> None:
        self.wire_readable = True

    def service(self) -> None:
        """Doorbells, received packets, timers and transmission, round after round until nothing moves.

        The wire is read when select() found it readable and then every round while the pass keeps moving packets
        (more arrive meanwhile); a wake-up for doorbells alone costs no empty receive.
        """
        dp, port, wire, loopback = self.datapath, self.port, self.wire, self.loopback
        transports = [t for t in (wire, loopback) if t is not None]
        wire_idle = not self.wire_readable and wire is not None and wire.fileno() is not None
        self.wire_readable = False
        if not self.bus_master:  # no DMA: arrivals are dropped, and nothing is placed, posted or completed
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
                packets = transport.receive(RX_BUDGET)
                if packets:
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

    def wire_stats(self) -> dict[str, int]:
        dp = self.datapath.stats
        stats = {name: dp[name] for name in ("packets_sent", "packets_received", "retransmits", "acks", "naks",
                                             "duplicates", "timeouts", "rnr_naks", "out_of_sequence")}
        counters = [t.counters for t in (self.wire, self.loopback) if t is not None]
        icrc = sum(c["dropped_icrc"] for c in counters)
        source_port = sum(c["dropped_source_port"] for c in counters)
        stats.update(dp, dropped=dp["dropped"] + icrc + source_port + sum(c["dropped_malformed"] for c in counters),
                     dropped_icrc=icrc, dropped_source_port=source_port,
                     rx_overflow=sum(t.rx_overflow for t in (self.wire, self.loopback) if t))
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
        if self.partial:
            data = self.partial + data
        usable = len(data) - len(data) % KICK.size
        self.partial = data[usable:]
        records = KICK.iter_unpack(data[:usable] if usable < len(data) else data)
        self.stats["kicks"] += usable // KICK.size
        for space, offset, value in records:
            self.mmio_write(space, offset, value)

    def mmio_write(self, space: int, offset: int, value: int) -> None:
        if space == 2:  # doorbells: the data path's
            self.fw.doorbell(offset, value)
        elif space == CONFIG_SPACE:
            self.bus_master = bool(value & PCI_COMMAND_MASTER)
        elif space == DMA_MAP:
            self.freed.mapped(offset, value)
        elif space == DMA_UNMAP:
            if value & PUNCHED:
                self.freed.unmapped(offset, value & ~PUNCHED)
        elif space == FUNCTION_RESET:
            self.function_reset()
        elif offset == HWRM_TRIGGER:
            self.run_hwrm()
        elif offset == RCFW_TRIGGER:
            self.fw.rcfw.trigger()
        elif RCFW_BASE <= offset < RCFW_BASE + CMDQ_INIT.size:
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
        self.fw.interrupts.append(HWRM_VECTOR)
        self.fire_interrupts()

    def run_rcfw(self) -> None:
        """Execute pending RoCE commands one at a time, answering each on the CREQ as it finishes (not while bus
        mastering is off: a device without it cannot read a command or write its answer)."""
        while self.running and self.bus_master:
            while self.creq_backlog:
                if not self.fw.rcfw.post_creq(self.creq_backlog[0]):
                    return  # CREQ full: wait for the driver's consumer doorbell
                self.creq_backlog.pop(0)
                self.fire_interrupts()
            started = time.perf_counter()
            command = self.fw.rcfw.next_command()
            if command is None:
                return
            if self.hang["rcfw"]:
                self.hang["rcfw"] -= 1
                continue
            entry = self.fw.rcfw.execute(command)
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
        self.datapath = Datapath(self.fw, self.ip)
        self.bus_master = False
        self.creq_backlog.clear()
        self.fw.interrupts.clear()
        self.stall = {"hwrm": 0, "rcfw": 0}
        self.hang = {"hwrm": 0, "rcfw": 0}
        self.stats["function_resets"] = self.stats.get("function_resets", 0) + 1

    def fire_interrupts(self) -> None:
        if not self.bus_master:  # an MSI-X message is a DMA write too
            self.fw.interrupts.clear()
            return
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
            return {"pid": os.getpid(), "name": self.name, "netns": self.netns}
        if op == "objects":
            return {"objects": self.fw.objects()}
        if op == "stats":
            return {"stats": {**self.stats, **self.fw.stats, **self.wire_stats(),
                              "writes_after_free": self.freed.written_pages(),
                              "fw_internal_errors": self.fw.stats.get("internal_errors", 0)}}
        if op == "datapath":
            return {"qps": self.datapath.describe(), "now": time.monotonic(), "timers": len(self.datapath._timers),
                    "last_error": self.datapath.last_error}
        if op == "inject":
            self.fw.inject_error(request["command"], request["status"], request.get("count", 1))
            return {}
        if op in ("stall", "hang"):
            getattr(self, op)[request["channel"]] += request.get("count", 1)
            return {}
        if op == "latency":
            self.latency = request["us"] * 1e-6
            return {}
        if op == "placed":
            return {"qps": self.datapath.placed_report()}
        if op == "fault":
            self.datapath.faults.inject(request["kind"], request.get("count", 1), request.get("offset", 0))
            return {}
        if op == "event":
            self.fw.post_event(**request["event"])
            self.fire_interrupts()
            return {}
        raise ValueError(f"unknown debug op {op!r}")


class EmulatorLoop:
    """The emulator process: one loop serving every NIC the driver attached to it. Each attach is one message on the
    control socket (ATTACH_FDS: a NIC's config as JSON, its descriptors alongside); the NIC answers on its debug
    socket, ready or why not. A NIC goes when its kick socket closes; the process, once the control socket has
    closed and no NIC is left, or as soon as the driver process exits (its pidfd)."""

    def __init__(self, control: socket.socket, driver_fd: int | None) -> None:
        self.selector = selectors.DefaultSelector()
        self.control: socket.socket | None = control
        self.emulators: dict[Emulator, list[Any]] = {}  # each NIC and the descriptors watched for it
        self.driver_gone = False
        self.selector.register(control, selectors.EVENT_READ, (None, self.on_control))
        if driver_fd is not None:
            self.selector.register(driver_fd, selectors.EVENT_READ, (None, self.on_driver_exit))

    def run(self) -> None:
        try:
            while not self.driver_gone and (self.control is not None or self.emulators):
                if self.iteration():  # a NIC left: its maps go once the cycles holding views of them do, now
                    gc.collect()
        finally:
            for emulator in list(self.emulators):
                self.remove(emulator)

    def iteration(self) -> bool:
        """Wait for events or the next timer, then step the NICs they concern; whether a NIC left."""
        deadlines = [(emulator, emulator.deadline()) for emulator in self.emulators]
        soonest = min((d for _, d in deadlines if d is not None), default=None)
        events = self.selector.select(None if soonest is None else max(0.0, soonest - time.monotonic()))
        touched = set()
        for key, _ in events:
            owner, handler = key.data
            if owner is None or owner.running:
                handler()
                touched.add(owner)
        now = time.monotonic() if soonest is not None else 0.0
        removed = False
        for emulator, deadline in deadlines:  # a NIC attached just now starts on its first event
            if emulator.running and (emulator in touched or deadline is not None and deadline <= now):
                emulator.step()
            if not emulator.running:
                self.remove(emulator)
                removed = True
        return removed

    def on_driver_exit(self) -> None:
        self.driver_gone = True  # the driver process is gone: no one will ever close its devices

    def on_control(self) -> None:
        assert self.control is not None
        message, fds, flags, _ = socket.recv_fds(self.control, CONTROL_MESSAGE, len(ATTACH_FDS) + NUM_VECTORS)
        if not message and not fds:  # the driver will attach no more NICs
            self.selector.unregister(self.control)
            self.control.close()
            self.control = None
            return
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("the attach message was cut short")
            config = attach_config(message, fds)
        except (ValueError, TypeError) as exc:  # not from our driver: drop it and its fds
            logging.getLogger("aiofabric.sim").warning("bad attach message: %s", exc)
            for fd in fds:
                os.close(fd)
            return
        self.attach(config)

    def attach(self, config: dict) -> None:
        debug = socket.socket(fileno=config["debug_fd"])
        try:
            emulator = Emulator(config, debug)  # owns the other descriptors, closed if it cannot start
        except Exception as exc:  # the driver raises this reason; nothing else needs to see a traceback
            logging.getLogger("aiofabric.sim").debug("start-up of %s failed", config.get("name"), exc_info=True)
            with contextlib.suppress(OSError):
                debug.sendall(json.dumps({"error": _one_line(exc)}).encode() + b"\n")
            debug.close()
            return
        try:
            debug.sendall(json.dumps({"ready": True, "ip": emulator.ip, "pid": os.getpid(), "netns": emulator.netns,
                                      "moved": emulator.moved}).encode() + b"\n")
        except OSError:  # the driver gave up waiting
            emulator.close()
            debug.close()
            return
        watched = []
        for fileobj, handler in emulator.descriptors():
            self.selector.register(fileobj, selectors.EVENT_READ, (emulator, handler))
            watched.append(fileobj)
        self.emulators[emulator] = watched
        self.tell_alone()

    def tell_alone(self) -> None:
        for emulator in self.emulators:
            emulator.alone = len(self.emulators) == 1

    def remove(self, emulator: Emulator) -> None:
        for fileobj in self.emulators.pop(emulator, []):
            self.selector.unregister(fileobj)
        emulator.close()
        emulator.debug.close()
        self.tell_alone()


def attach_config(message: bytes, fds: list[int]) -> dict[str, Any]:
    """An attach message's config with its descriptors in place of their indices (host.py SimPCIDevice sends it);
    ValueError or TypeError unless it names a NIC and each of ATTACH_FDS and irq_fds, every descriptor received
    exactly once (a descriptor named twice would be closed twice)."""
    config = json.loads(message)
    places = config["fds"] if isinstance(config, dict) and isinstance(config.get("name"), str) else None
    if not isinstance(places, dict) or set(places) != {*ATTACH_FDS, "irq_fds"} \
            or not isinstance(places["irq_fds"], list):
        raise ValueError("it names no NIC and its descriptors")
    order = [places[key] for key in ATTACH_FDS] + places["irq_fds"]
    if any(type(i) is not int for i in order) or sorted(order) != list(range(len(fds))):
        raise ValueError(f"its descriptor indices {order} do not name each of the {len(fds)} received once")
    config.update({key: fds[places[key]] for key in ATTACH_FDS}, irq_fds=[fds[i] for i in places["irq_fds"]])
    return config


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, (StartupError, ValueError)) and text else f"{type(exc).__name__}: {text}"


def main() -> None:
    # Ctrl-C in a terminal signals the whole foreground process group, us included: the driver decides when its
    # NIC goes away (it closes the kick socket after freeing every firmware object), so the device ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _prctl(PR_SET_TIMERSLACK, 1)  # microsecond firmware latencies need precise sleeps
    _batch_scheduling()
    logging.basicConfig(level=os.environ.get("AIOFABRIC_SIM_LOG", "WARNING"), stream=sys.stderr,
                        format="sim %(name)s: %(message)s")
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=config["control_fd"])
    try:
        loop = EmulatorLoop(control, watch_driver(config["driver_pid"]))
    except DriverGone:
        return
    profile = os.environ.get("AIOFABRIC_SIM_PROFILE")  # a path: cProfile the emulator, dump stats there at exit
    if profile:
        import cProfile
        cProfile.runctx("loop.run()", globals(), {"loop": loop},
                        profile.replace("%p", str(os.getpid())).replace("%n", config["label"]))
    else:
        loop.run()


if __name__ == "__main__":
    main()
