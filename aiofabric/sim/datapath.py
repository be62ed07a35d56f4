"""The emulated NIC's RoCE data path (sans-IO): doorbells, packets and time in; packets, CQEs and events out.

One `Datapath` per NIC, beside its `Firmware`. The MMIO decoder (mmio.py) rings it, the I/O shell (emulator.py)
feeds it:

    dp.ring_sq(qp, index, epoch), dp.ring_rq(...)   an SQ or RQ doorbell: the producer moves at once (in program
                               order with the driver's other writes), the QP acts on it at the next doorbells()
    dp.doorbells(now)          the QPs whose SQ or RQ doorbell rang since the last call fetch what was posted
    dp.receive(packets, now)   a batch of decoded packets from the wire; ACKs owed are sent once, at the batch end
    dp.receive_arrivals(batch, now)   the same for a batch the compiled core parsed (nativeio.Arrivals): runs of RDMA
                               WRITE packets are placed by the core (writeruns.py), the rest made Packets
    dp.advance(now)            fire due timers (retransmission, RNR waits)
    dp.pump(now, budget)       turn posted work into request packets (round-robin over QPs, window permitting)
    dp.take_outbox()           the packets to transmit (`Packet`s, `Segments` for WRITE/SEND data, and a requester's
                               `wqeblock.Burst`s), taken off the outbox
    dp.next_deadline()         when to call advance() again: None (nothing pending), or a time (<= now: at once)

    dp.placed_report()         per QP, the messages and bytes placed in memory, the atomics executed (debug "placed")
    dp.faults.inject(kind, count, offset)   deliberately wrong WRITE placement (debug "fault")

CQEs land in host memory through `post_cqe` (`CompletionQueue.post`, and a CQ overflow reported once), which the
requester and responder call directly; interrupts collect in fw.interrupts; QP errors reach the CREQ through
`rcfw.post_event("qp_error")`. Per QP a `QpContext` holds the `Requester` (requester.py, its answers taken by
completer.py) and `Responder` (responder.py) and is their `QpPort` (qpport.py): all they reach of the data path. It is created on first use and
watches the QP's state (`QueuePair.observer`, called by `QueuePair.change_state`): ERR flushes, RTS starts the send
queue, RESET forgets everything.

Deviations from rxe/hardware, on purpose:
- retry_cnt 7 means 7 retries (rxe: infinite); rnr_retry 7 is infinite, as everywhere.
- ACKs are coalesced per receive batch (one ACK for the last AckReq PSN), where rxe answers every AckReq packet.
- A gap in READ responses re-requests the rest at once (rxe waits for the timeout); it counts as a retry.
- A READ of more than READ_SEGMENT (32) packets goes out as one READ request per 32 responses, each sent once its
  responses fit in the 128-PSN window and an ORRQ entry is free (requester.py); each is a message to the responder.
  rxe and hardware ask for the whole READ at once, and hardware has link-level flow control (PFC, IB credits) to keep
  the responses from overrunning the requester: UDP between processes has none, so the requester paces them itself.
- After an RNR NAK the responder drops later PSNs quietly until the retried one arrives (no NAK-sequence on top).
- When a reordered packet closes a NAKed gap, later packets that raced the requester's go-back are dropped without a
  second NAK-sequence (rxe sends one; the requester would go back twice for one reordering): see responder.py.
- A duplicate READ is answered from its own RETH (rkey checked again, memory read again); responder READ resources
  (max_dest_rd_atomic, the IRRQ) are not limited, and the ORRQ/IRRQ memory is not used: the engine keeps that state
  itself. Atomics' saved results do take max_dest_rd_atomic entries (READs take none of them), so a duplicate atomic
  is answered from its result, never executed again, for as long as the requester may retransmit it (atomics.py).
  The SQ's search table (MSN or PSN entries) is read only by a go-back with hardware retransmission on, to find the
  message it resumes (completer.py); without it the engine retransmits from its own state, as firmware keeps it in
  the QP context. `max_rd_atomic` 0 is treated as 1.
- No P_Key check on received packets. The source address is checked as rxe's check_addr does (rxe_recv.c): a QP
  takes packets only from the IPv4 address of the GID it was connected to, addressed to this NIC's; others are
  dropped silently and counted as dropped_bad_source. The UDP source port is not part of this check (RoCEv2 stacks
  pick it per flow); the UDP transport drops a loopback sender not on 4791 before a packet gets here (udp.py).
- SEND with invalidate, SRQs, UD and UC are not emulated.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import socket
from typing import Any, Callable

from . import packets as pk
from .hwrm import Firmware
from .objects import CompletionQueue, QueuePair
from .native import core
from .nativeio import Arrivals
from .packets import ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE, RESPONSE_FIRST, WRITE_FIRST, WRITE_ONLY, Outgoing
from .placement import PlacedCounts, PlacementFaults
from .qpport import Address
from .requester import Requester
from .responder import Responder
from .writeruns import place_run
from ..autogen import bnxt
from ..hw.cqe import CQE_TYPE_OFFSET, cqe_type
from ..hw.verbs import QPState

QUANTUM = 32  # packets one QP may send before the next ready QP gets its turn
RTS, RTR, SQD, ERR, RESET = QPState.RTS, QPState.RTR, QPState.SQD, QPState.ERR, QPState.RESET
CQ_OVERFLOW = {True: bnxt.CREQ_CQ_ERROR_NOTIFICATION_CQ_ERR_REASON_REQ_CQ_OVERFLOW_ERROR,
               False: bnxt.CREQ_CQ_ERROR_NOTIFICATION_CQ_ERR_REASON_RES_CQ_OVERFLOW_ERROR}


class QpContext:
    """The data path's state for one QP: requester, responder, the addressing of its packets, scheduling marks; the
    `QpPort` its requester and responder work through."""

    def __init__(self, dp: Datapath, qp: QueuePair) -> None:
        self.dp, self.qp = dp, qp
        self.mem, self.mrs, self.stats, self.outbox, self.faults = dp.mem, dp.mrs, dp.stats, dp.outbox, dp.faults
        self.pcie = dp.pcie
        self.post_cqe, self.acks_due, self.core = dp.post_cqe, dp.acks_due, dp.core
        self.address: Address = (0, 0, "", "", 0, 0, 0)
        self.peer_ip = ""  # the only source address this QP accepts packets from (receive(): check_addr)
        self.refresh()
        placed = dp.placed.get(qp.qpn)
        if placed is None or placed.qp is not qp:  # a context is remade after RESET: the counts last as long as the QP
            placed = dp.placed[qp.qpn] = PlacedCounts(qp)
        self.placed = placed
        self.queued = False  # in dp.ready
        self.timer_at: float | None = None  # earliest entry of ours in dp's timer heap
        self.error_reasons: tuple[int, int] | None = None  # set before the data path moves the QP to ERR
        self.requester = Requester(self)
        self.responder = Responder(self)
        qp.observer = dp.on_state

    def refresh(self) -> None:
        """Recompute what every packet of this QP carries (after MODIFY_QP changed the path)."""
        qp = self.qp
        self.peer_ip = socket.inet_ntoa(bytes(qp.dgid[12:16]))  # RoCEv2 over IPv4: the GID is IPv4-mapped
        self.address = (qp.dest_qp_id, qp.pkey, self.dp.ip, self.peer_ip, pk.udp_source_port(qp.qpn, qp.dest_qp_id),
                        qp.traffic_class, qp.hop_limit or 64)

    @property
    def alive(self) -> bool:
        """False once DESTROY_QP (or FUNC_RESET) took the QP away: its timers and queued work must not run."""
        return self.dp.rcfw.qps.get(self.qp.qpn) is self.qp

    def wake(self) -> None:
        if not self.queued and self.requester.has_work():
            self.queued = True
            self.dp.ready.append(self)

    def schedule(self, when: float) -> None:
        """Make sure advance() looks at this QP no later than `when` (its own deadlines may since have moved later)."""
        if self.timer_at is None or when < self.timer_at:
            self.timer_at = when
            heapq.heappush(self.dp.timers, (when, next(self.dp.timer_sequence), self))

    def fail_qp(self, req_reason: int = 0, res_reason: int = 0) -> None:
        if self.qp.state != ERR:
            self.error_reasons = (req_reason, res_reason)
            self.qp.change_state(ERR)  # on_state flushes and reports

    def sq_doorbell(self) -> None:
        state = self.qp.state
        if state == ERR:
            self.requester.fetch(flush=True)
        elif state == RTS:
            if not self.requester.started:
                self.requester.start()
            self.requester.fetch()
            if self.requester.settle():
                self.wake()


class Datapath:
    """The RC engine of one NIC."""

    def __init__(self, fw: Firmware, ip: str = "0.0.0.0") -> None:
        self.rcfw, self.mem, self.mrs = fw.rcfw, fw.mem, fw.rcfw.mrs
        self.pcie = fw.pcie  # whether atomics reach host memory
        self.ip = ip
        # packets_sent, packets_received, retransmits, go_backs, acks, naks, rnr_naks, duplicates, out_of_sequence,
        # timeouts,
        # implied_naks, acks_received, naks_received, rnr_naks_received, stale_acks, dropped (+ dropped_* reasons:
        # no_qp, qp_state, bad_source),
        # atomic_replays, request_errors, qp_errors, cqes, cq_overflows, bad_doorbells, internal_errors
        self.stats: collections.Counter[str] = collections.Counter()
        self.outbox: list[Outgoing] = []  # one list for good: the QP contexts hold it
        self.contexts: dict[int, QpContext] = {}
        self.ready: collections.deque[QpContext] = collections.deque()
        self.acks_due: list[Callable[[], None]] = []  # responders' flush_ack: a coalesced ACK owed at this batch's end
        self.timers: list[tuple[float, int, QpContext]] = []  # a heap: (when, its order, QP)
        self.timer_sequence = itertools.count()
        self.sq_rung: list[QueuePair] = []  # QPs whose SQ / RQ doorbell rang since doorbells() last looked
        self.rq_rung: list[QueuePair] = []
        self._overflowed: set[int] = set()
        self.last_error = ""
        self.placed: dict[int, PlacedCounts] = {}  # by QPN; an entry whose qp is not the live one is stale
        self.faults = PlacementFaults(self.stats)  # deliberate bugs for tests that prove a verification can fail
        self.core = core()  # the compiled core receive_arrivals places WRITE runs with, if it can be had

    # -- contexts ----------------------------------------------------------------------------------------------------
    def context(self, qpn: int) -> QpContext | None:
        qp = self.rcfw.qps.get(qpn)
        if qp is None or qp.qp_type != bnxt.CMDQ_CREATE_QP_TYPE_RC:
            return None
        ctx = self.contexts.get(qpn)
        if ctx is None or ctx.qp is not qp:
            ctx = self.contexts[qpn] = QpContext(self, qp)
        return ctx

    def on_state(self, qp: QueuePair, old: QPState, new: QPState) -> None:
        """QueuePair.observer: MODIFY_QP (or a QP's own failure) changed a QP's state."""
        ctx = self.contexts.get(qp.qpn)
        if ctx is None or ctx.qp is not qp:
            return
        if new == ERR:
            if old != ERR:
                ctx.requester.flush()
                ctx.responder.flush()
                if ctx.error_reasons is not None:
                    self.stats["qp_errors"] += 1
                    self.rcfw.post_event("qp_error", xid=qp.qpn, reason=ctx.error_reasons[0],
                                         res_reason=ctx.error_reasons[1])
                ctx.error_reasons = None
        elif new == RESET:
            del self.contexts[qp.qpn]
            qp.observer = None
        elif new == RTR:
            ctx.refresh()
            if not ctx.responder.started:
                ctx.responder.start()
        elif new == RTS:
            ctx.refresh()
            if not ctx.responder.started:
                ctx.responder.start()
            ctx.sq_doorbell()  # WQEs posted before RTS waited for it

    def post_cqe(self, cq: CompletionQueue, cqe: bytes, solicited: bool = False) -> None:
        if cq.post(cqe, solicited):
            self.stats["cqes"] += 1
            return
        self.stats["cq_overflows"] += 1  # the driver sized its CQ too small: the CQE is lost, as on hardware
        if cq.cq_id not in self._overflowed:
            self._overflowed.add(cq.cq_id)
            requester = cqe_type(cqe[CQE_TYPE_OFFSET]) == bnxt.CQ_BASE_CQE_TYPE_REQ
            self.rcfw.post_event("cq_error", xid=cq.cq_id, reason=CQ_OVERFLOW[requester])

    # -- placement accounting -------------------------------------------------------------------------------------
    def placed_report(self) -> dict[str, dict[str, int]]:
        """{QPN as a string: PlacedCounts.as_dict()} for every live RC QP (zeros for one that never moved data)."""
        report = {}
        for qpn, qp in self.rcfw.qps.items():
            if qp.qp_type != bnxt.CMDQ_CREATE_QP_TYPE_RC:
                continue
            placed = self.placed.get(qpn)
            report[str(qpn)] = (placed if placed is not None and placed.qp is qp else PlacedCounts()).as_dict()
        for qpn in [qpn for qpn, placed in self.placed.items() if self.rcfw.qps.get(qpn) is not placed.qp]:
            del self.placed[qpn]  # destroyed QPs: forget them here rather than on every DESTROY_QP
        return report

    # -- inputs ------------------------------------------------------------------------------------------------------
    def ring_sq(self, qp: QueuePair, index: int, epoch: int) -> None:
        """An SQ doorbell: the producer (index, epoch) is the QP's now; its WQEs are fetched at doorbells()."""
        qp.sq_producer, qp.sq_producer_epoch = index, epoch
        self.sq_rung.append(qp)

    def ring_rq(self, qp: QueuePair, index: int, epoch: int) -> None:
        """An RQ doorbell: the producer (index, epoch) is the QP's now; doorbells() flushes it if the QP is in ERR."""
        qp.rq_producer, qp.rq_producer_epoch = index, epoch
        self.rq_rung.append(qp)

    def doorbells(self, now: float) -> None:
        """Act on the SQ and RQ doorbells rung since the last call, once per QP (one gone since, or reset by a
        FUNC_RESET, is not acted on)."""
        if self.sq_rung:
            qps = dict.fromkeys(self.sq_rung)
            self.sq_rung.clear()
            for qp in qps:
                self._guarded(self._sq_doorbell, qp)
        if self.rq_rung:
            qps = dict.fromkeys(self.rq_rung)
            self.rq_rung.clear()
            for qp in qps:
                self._guarded(self._rq_doorbell, qp)

    def _sq_doorbell(self, qp: QueuePair) -> None:
        ctx = self.context(qp.qpn) if self.rcfw.qps.get(qp.qpn) is qp else None
        if ctx is not None:
            ctx.sq_doorbell()

    def _rq_doorbell(self, qp: QueuePair) -> None:
        ctx = self.context(qp.qpn) if self.rcfw.qps.get(qp.qpn) is qp else None
        if ctx is not None and ctx.qp.state == ERR:
            ctx.responder.flush()  # receives posted to a QP in ERR complete FLUSHED at once

    def _guarded(self, action: Callable[..., None], *args: Any) -> None:
        try:
            action(*args)
        except Exception as exc:  # an emulator bug must not take the device down: count it, keep going
            self._internal_error(exc)

    def _internal_error(self, exc: Exception) -> None:
        self.stats["internal_errors"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def receive(self, packets: list[pk.Packet], now: float) -> None:
        """Process a batch of received packets, then send the ACKs it earned (one per QP)."""
        self.stats["packets_received"] += len(packets)
        i, count = 0, len(packets)
        while i < count:
            p = packets[i]
            i += 1
            try:
                ctx = self._addressed(p.dest_qp, p.opcode, p.src_ip, p.dst_ip)
                if ctx is None:
                    continue
                op = p.opcode
                if not RESPONSE_FIRST <= op <= ATOMIC_ACKNOWLEDGE:
                    i = ctx.responder.on_requests(packets, i - 1, now)
                else:
                    self._answer(ctx, p, op, now)
            except Exception as exc:
                self._internal_error(exc)
        self.flush_acks()

    def receive_arrivals(self, batch: Arrivals, now: float) -> None:
        """receive() for datagrams as the compiled core parsed them: runs of RDMA WRITE packets are placed by the
        core (writeruns.py), every other packet as receive() handles it, made a Packet first."""
        self.stats["packets_received"] += batch.good
        core, ip, i, count = self.core, self.ip, 0, batch.count
        while i < count:
            r = batch.record(i)
            if r[18]:  # dropped by the transport's checks
                i += 1
                continue
            try:
                op = r[0]
                ctx = self._addressed(r[1], op, batch.receiver.source(r[19]), ip)
                if ctx is None:
                    i += 1
                    continue
                if not RESPONSE_FIRST <= op <= ATOMIC_ACKNOWLEDGE:
                    if core is not None and WRITE_FIRST <= op <= WRITE_ONLY and i + 1 < count:  # a run, not one
                        end = place_run(core, ctx.responder, batch, i, r)
                        if end > i:
                            i = end
                            continue
                    ctx.responder.on_request(batch.packet(i, r), now)
                elif op == ACKNOWLEDGE:  # all an ACK says is its PSN and syndrome: no Packet needed
                    ctx.requester.on_acknowledge(r[2], r[11], now)
                    ctx.wake()
                else:
                    self._answer(ctx, batch.packet(i, r), op, now)
            except Exception as exc:
                self._internal_error(exc)
            i += 1
        self.flush_acks()

    def _addressed(self, qpn: int, op: int, src_ip: str, dst_ip: str) -> QpContext | None:
        """The context of the QP a packet is for, if it may take the packet (else the drop is counted)."""
        ctx = self.contexts.get(qpn)
        if ctx is None or ctx.qp is not self.rcfw.qps.get(qpn):
            ctx = self.context(qpn)
            if ctx is None:
                self.stats["dropped"] += 1
                self.stats["dropped_no_qp"] += 1
                return None
        state = ctx.qp.state
        request = not RESPONSE_FIRST <= op <= ATOMIC_ACKNOWLEDGE  # for the responder; else the requester
        # rxe_recv.c check_type_state: requests need a receiving QP (RTR, RTS, SQD), responses a sending one
        if not (state == RTS or state == SQD or request and state == RTR):
            self.stats["dropped"] += 1
            self.stats["dropped_qp_state"] += 1
            return None
        # check_addr: a connected QP takes packets only from the peer it was connected to (the DGID of MODIFY_QP),
        # addressed to us; anything else is dropped without an answer, before its PSN is looked at
        if src_ip != ctx.peer_ip or dst_ip != self.ip:
            self.stats["dropped"] += 1
            self.stats["dropped_bad_source"] += 1
            return None
        return ctx

    @staticmethod
    def _answer(ctx: QpContext, p: pk.Packet, op: int, now: float) -> None:
        """A response to the QP's requester: an ACK or NAK, an atomic's acknowledgement, READ data."""
        if op == ACKNOWLEDGE:
            ctx.requester.on_acknowledge(p.psn, p.syndrome, now)
        elif op == ATOMIC_ACKNOWLEDGE:
            ctx.requester.on_atomic_acknowledge(p, now)
        else:
            ctx.requester.on_read_response(p, now)
        ctx.wake()

    def flush_acks(self) -> None:
        for flush_ack in self.acks_due:
            flush_ack()
        self.acks_due.clear()

    # -- time and transmission ---------------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, ctx = heapq.heappop(timers)
            ctx.timer_at = None
            if self.contexts.get(ctx.qp.qpn) is not ctx or not ctx.alive or ctx.qp.state == ERR:
                continue
            try:
                ctx.requester.on_timer(now)
            except Exception as exc:
                self._internal_error(exc)
            deadline = ctx.requester.deadline()
            if deadline is not None:
                ctx.schedule(max(deadline, now + 1e-6))
            ctx.wake()

    def pump(self, now: float, budget: int = 1 << 30) -> int:
        """Queue request packets from QPs with work, round-robin; the number queued."""
        ready = self.ready
        queued = 0
        while ready and queued < budget:
            ctx = ready.popleft()
            ctx.queued = False
            if ctx.qp.state != RTS or not ctx.alive:
                continue
            quantum = min(QUANTUM, budget - queued)
            try:
                sent = ctx.requester.pump(now, quantum)
            except Exception as exc:
                self._internal_error(exc)
                continue
            queued += sent
            if sent >= quantum and ctx.requester.has_work():  # it stopped only because its turn ended
                ctx.queued = True
                ready.append(ctx)
        return queued

    def next_deadline(self) -> float | None:
        """When advance()/pump() next have something to do: 0.0 for "now", None for "only on new input"."""
        if self.ready:
            return 0.0
        timers = self.timers
        return timers[0][0] if timers else None

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per-QP protocol state, for the debug channel."""
        report = {}
        for qpn, ctx in self.contexts.items():
            r, s = ctx.requester, ctx.responder
            r.materialise()  # the block's WQEs counted as the SendWqes they stand for
            report[str(qpn)] = {
                "state": ctx.qp.state.name, "timeout": ctx.qp.timeout, "retry_cnt": ctx.qp.retry_cnt,
                "wqes_outstanding": len(r.wqes) - r.done, "unsent": len(r.wqes) - r.send,
                "next_psn": r.next_psn, "una": r.una, "sent_hi": r.sent_hi, "reads": r.reads,
                "retry_left": r.retry_left, "rnr_left": r.rnr_left, "rto_at": r.rto_at, "rnr_until": r.rnr_until,
                "epsn": s.epsn, "msn": s.msn, "nak_sent": s.nak_sent, "queued": ctx.queued, "timer_at": ctx.timer_at}
        return report

    def take_outbox(self) -> list[Outgoing]:
        packets = self.outbox[:]
        self.outbox.clear()
        return packets
