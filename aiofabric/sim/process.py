"""The emulated NICs' process: the loop that serves them, each an `emulator.Emulator` with its debug server.

Started by `SimPCIDevice` (pci/emulated.py `EmulatorProcess`) as `python -m aiofabric.sim.process '{"control_fd": ...,
"driver_pid": ..., "label": ...}'`. It serves one NIC, or several that the driver opened with the same `process`
option: each comes as an attach message on the control socket (its config as JSON, its descriptors alongside). For
each NIC it reads MMIO kicks in order, and steps the NIC (emulator.py) when they, its wire or its timers ask. It
blocks in select() when there is nothing to do (it never spins: on a machine with fewer cores than busy processes,
polling costs the driver and the other NICs more than it saves), and runs as SCHED_BATCH so that its wake-ups do not
preempt them either. A NIC goes when the driver closes its kick socket; the process when the control socket has closed
and no NIC is left, or when the driver process exits (a pidfd in the selector).

NICs sharing a process share its CPU time, and a packet between two of them costs no process wake-up: the sender's
sendmmsg makes the receiver's socket readable and the same loop reads it next (bench/RESULTS.md, "one emulator
process"). On a machine with cores to spare, one process per NIC (the default) runs them in parallel.

Start-up: before serving, each NIC writes exactly one line on its debug socket: {"ready": true, "ip": ..., "pid":
..., "netns": ..., "moved": ...} or {"error": "<why, in one line>"} (its descriptors are then closed). SimPCIDevice
waits for that line. "netns" names the network namespace the NIC binds in (null: the one the driver is in), "moved"
says why, if the process moved to this user's private namespace because UDP 4791 was taken on every 127.0.0.x
(wire.open_wire). Then the socket carries the NIC's debug channel (debug.py). The log level comes from
AIOFABRIC_SIM_LOG (WARNING).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

from .debug import DebugServer
from .emulator import Emulator
from .kick import ATTACH_FDS, CONTROL_MESSAGE, NUM_VECTORS
from .wire import StartupError

PR_SET_TIMERSLACK = 29


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0)
    except (OSError, AttributeError):
        pass


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


class EmulatorLoop:
    """The emulator process: one loop serving every NIC the driver attached to it. Each attach is one message on the
    control socket (ATTACH_FDS: a NIC's config as JSON, its descriptors alongside); the NIC answers on its debug
    socket, ready or why not. A NIC goes when its kick socket closes; the process, once the control socket has
    closed and no NIC is left, or as soon as the driver process exits (its pidfd)."""

    def __init__(self, control: socket.socket, driver_fd: int | None) -> None:
        self.selector = selectors.DefaultSelector()
        self.control: socket.socket | None = control
        self.emulators: dict[Emulator, tuple[socket.socket, list[Any]]] = {}  # each NIC: its debug socket, and
        # the descriptors watched for it
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
        debug = socket.socket(fileno=config["debug_fd"])  # ours: it answers whether the NIC starts, then serves it
        try:
            emulator = Emulator(config)  # owns the other descriptors, closed if it cannot start
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
        for fileobj, handler in [*emulator.descriptors(), (debug, DebugServer(emulator, debug).on_debug)]:
            self.selector.register(fileobj, selectors.EVENT_READ, (emulator, handler))
            watched.append(fileobj)
        self.emulators[emulator] = (debug, watched)
        self.tell_alone()

    def tell_alone(self) -> None:
        for emulator in self.emulators:
            emulator.alone = len(self.emulators) == 1

    def remove(self, emulator: Emulator) -> None:
        debug, watched = self.emulators.pop(emulator)
        for fileobj in watched:
            self.selector.unregister(fileobj)
        emulator.close()
        debug.close()
        self.tell_alone()


def attach_config(message: bytes, fds: list[int]) -> dict[str, Any]:
    """An attach message's config with its descriptors in place of their indices (pci/emulated.py sends it);
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
