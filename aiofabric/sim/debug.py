"""The debug channel of one emulated NIC: JSON requests, one a line, on the debug socket the driver holds
(pci/emulated_debug.py is its client); each gets one JSON line back, {"error": ...} if it failed. A bad request never
takes the device down.

Requests ({"op": OP, ...}): "ping"; "objects" (live firmware objects); "backing_store" (what the driver configured:
type, instance, entries, entry_size, PBL level, splits); "stats"; "datapath" (per-QP protocol state);
"inject" (the next `count` commands named `command` fail with `status`); "stall" and "hang" (the next `count` answers
on `channel`, "hwrm" or "rcfw", are dropped, or their commands neither executed nor answered); "latency" (`us` per
firmware command from now on); "placed"; "fault"; "event".

"stats" reply: the shell's counters (hwrm, rcfw, kicks, interrupts, ...), the firmware's, the data path's
(packets_sent, packets_received, retransmits, acks, naks, rnr_naks, duplicates, out_of_sequence, timeouts, ...; see
Datapath.stats, among them `dropped_bad_source` and `dropped_qp_state`: a packet not from the QP's peer, or for a QP
that does not receive), `dropped` = every packet dropped on receive (bad ICRC, malformed datagrams and loopback
senders not on 4791 included), `dropped_icrc`, `dropped_source_port` (see udp.UdpTransport), `rx_overflow` =
datagrams the kernel dropped because the port's receive buffer was full (not part of `dropped`: the protocol never saw
them; the buffer grows with the QP count, see emulator.RECEIVE_WINDOW_PER_QP), and the transports' own counters
prefixed with "wire_" (wire_sent, wire_lost, wire_corrupted, ...).

"placed" reply: {"qps": {QPN as a string: {write_messages, write_bytes, send_messages, send_bytes, read_messages,
read_bytes, atomic_messages, atomic_bytes}}} for every live RC QP: what it placed in memory since it was created, each
message counted once, when its last packet landed (duplicates and retransmissions never count twice). WRITE (with or
without immediate), SEND and atomics (executed, 8 bytes each) are counted by the responder, READ (the response payload
placed locally) by the requester.

"fault" request: deliberate data-path bugs, so that tests can prove a verification fails when it should.
{"op": "fault", "kind": "skip_placement", "count": N}: the next N incoming WRITE messages that carry data
(FIRST..LAST or ONLY, with or without immediate) are acknowledged and completed as usual, but their payload is not
placed (nor counted by "placed"). {"op": "fault", "kind": "misplace", "count": N, "offset": K}: their payload lands
K bytes away from the RETH's address, clamped to stay inside the MR (it never faults); counted as placed. A request
replaces the pending count of its kind (count 0 cancels it).

"event" request: {"op": "event", "event": {"kind": K, ...}} reports what the firmware would (hwrm.Firmware.
post_event): "link_down", "link_up", "reset_notify" and "fatal" on the ring FUNC_CFG named for them (the CREQ until
then), if the driver registered for them; "qp_error", "cq_error" and "function" on the CREQ. The port's drops are the
firmware's counters dropped_link_down and dropped_oversize.
"""
from __future__ import annotations

import json
import os
import socket
import time

from .emulator import Emulator


class DebugServer:
    """Answers the requests on one NIC's debug socket (the process's loop owns the socket and calls on_debug)."""

    def __init__(self, emulator: Emulator, sock: socket.socket) -> None:
        self.emulator, self.sock = emulator, sock
        self.buffer = b""

    def on_debug(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                reply = self.request(json.loads(line))
            except Exception as exc:  # a bad debug request must not take the device down
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.sock.sendall(json.dumps(reply).encode() + b"\n")

    def request(self, request: dict) -> dict:
        nic = self.emulator
        op = request["op"]
        if op == "ping":
            return {"pid": os.getpid(), "name": nic.name, "netns": nic.netns}
        if op == "objects":
            return {"objects": nic.fw.objects()}
        if op == "backing_store":
            return {"backing_store": nic.fw.backing_store_report()}
        if op == "stats":
            return {"stats": {**nic.stats, **nic.fw.stats, **wire_stats(nic),
                              "writes_after_free": nic.freed.written_pages(),
                              "fw_internal_errors": nic.fw.stats.get("internal_errors", 0)}}
        if op == "datapath":
            return {"qps": nic.datapath.describe(), "now": time.monotonic(), "timers": len(nic.datapath.timers),
                    "last_error": nic.datapath.last_error}
        if op == "inject":
            nic.fw.inject_error(request["command"], request["status"], request.get("count", 1))
            return {}
        if op in ("stall", "hang"):
            getattr(nic, op)[request["channel"]] += request.get("count", 1)
            return {}
        if op == "latency":
            nic.latency = request["us"] * 1e-6
            return {}
        if op == "placed":
            return {"qps": nic.datapath.placed_report()}
        if op == "fault":
            nic.datapath.faults.inject(request["kind"], request.get("count", 1), request.get("offset", 0))
            return {}
        if op == "event":
            nic.fw.post_event(**request["event"])
            nic.fire_interrupts()
            return {}
        raise ValueError(f"unknown debug op {op!r}")


def wire_stats(nic: Emulator) -> dict[str, int]:
    """The data path's and the transports' counters, as the "stats" reply has them."""
    dp = nic.datapath.stats
    stats = {name: dp[name] for name in ("packets_sent", "packets_received", "retransmits", "acks", "naks",
                                         "duplicates", "timeouts", "rnr_naks", "out_of_sequence")}
    transports = [t for t in (nic.wire, nic.loopback) if t is not None]
    counters = [t.counters for t in transports]
    icrc = sum(c["dropped_icrc"] for c in counters)
    source_port = sum(c["dropped_source_port"] for c in counters)
    stats.update(dp, dropped=dp["dropped"] + icrc + source_port + sum(c["dropped_malformed"] for c in counters),
                 dropped_icrc=icrc, dropped_source_port=source_port, rx_overflow=sum(t.rx_overflow for t in transports))
    for c in counters:
        for name, value in c.items():
            stats[f"wire_{name}"] = stats.get(f"wire_{name}", 0) + value
    return stats
