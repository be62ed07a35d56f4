"""The responder of one RC QP (sans-IO): request packets in; DMA, RQ consumption, responder CQEs, ACKs, NAKs, read
responses and atomic acknowledgements out.

PSN check first (rxe_resp.c `check_psn`): the expected PSN is executed; a later PSN earns one NAK-sequence and then
silence until the gap closes (and, when a reordered packet closed it, until the go-back arrives: `_out_of_sequence`);
an earlier one is a duplicate, re-acknowledged (SEND/WRITE), answered again from memory (READ) or from the result
saved for it (atomic), never executed twice. ACKs are coalesced: a packet with AckReq only notes the PSN, and
`flush_ack()` (called by the data path at the end of every receive batch) sends one ACK for the highest; an atomic is
answered at once with its ATOMIC_ACKNOWLEDGE. Invalid requests and access violations answer with a NAK and put the QP
in ERR, as rxe's class C errors do. A SEND fills the RQ WQE at the consumer (receivequeue.py); atomics execute as
atomics.py says, only while the function may issue PCIe AtomicOps that its path completes (pcie.py), and their
results are kept for duplicates there. All it reaches of the data path is its `QpPort`
(qpport.py).
"""
from __future__ import annotations

from . import packets as pk
from .atomics import AtomicResults, execute
from .dma import ACCESS_ERRORS, EMPTY, Buffer, map_remote
from .packets import (ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE, COMPARE_SWAP, FETCH_ADD, MSN_MASK, READ_REQUEST, RESPONSE_FIRST,
                      RESPONSE_LAST, RESPONSE_MIDDLE, RESPONSE_ONLY, ROCE_PORT, SEND_FIRST, SEND_LAST_IMM, SEND_MIDDLE,
                      SEND_ONLY, SEND_ONLY_IMM, WRITE_FIRST, WRITE_LAST_IMM, WRITE_MIDDLE, WRITE_ONLY, WRITE_ONLY_IMM)
from .placement import KnownRegion, Target
from .qpport import QpPort
from .receivequeue import ReceiveQueue
from ..autogen import bnxt
from ..hw.cqe import CQE_RES_RC
from ..hw.verbs import PSN_MASK, MRAccess, QPAccess, psn_count, psn_diff
from ..hw.wqe import ATOMIC_SIZE

# plain ints: IntFlag arithmetic is slow on the per-message path
MR_REMOTE_READ, MR_REMOTE_WRITE, MR_REMOTE_ATOMIC = (
    int(MRAccess.REMOTE_READ), int(MRAccess.REMOTE_WRITE), int(MRAccess.REMOTE_ATOMIC))
QP_REMOTE_READ, QP_REMOTE_WRITE, QP_REMOTE_ATOMIC = (int(QPAccess.REMOTE_READ), int(QPAccess.REMOTE_WRITE),
                                                     int(QPAccess.REMOTE_ATOMIC))
R = "CREQ_QP_ERROR_NOTIFICATION_RES_ERR_STATE_REASON_RES_"
RES_RX_INVALID_R_KEY, RES_EXCEEDS_WQE, RES_OPCODE_ERROR, RES_MEMORY_ERROR, RES_UNALIGN_ATOMIC = (
    getattr(bnxt, R + name) for name in ("RX_INVALID_R_KEY", "EXCEEDS_WQE", "OPCODE_ERROR", "MEMORY_ERROR",
                                         "UNALIGN_ATOMIC"))
CQE_TYPE_RES_RC = bnxt.CQ_BASE_CQE_TYPE_RES_RC  # with the valid bit 0: CompletionQueue.post sets it
S = bnxt
OK, FLUSHED = S.CQ_RES_RC_STATUS_OK, S.CQ_RES_RC_STATUS_WORK_REQUEST_FLUSHED_ERR
IMM, RDMA = S.CQ_RES_RC_FLAGS_IMM, S.CQ_RES_RC_FLAGS_RDMA
WR_ID_MASK = S.CQ_RES_RC_SRQ_OR_RQ_WR_ID_MASK
IN_SEND, IN_WRITE = 1, 2
# WRITE opcodes WRITE_FIRST.. WRITE_ONLY_IMM -> (starts a message, ends it, carries an immediate)
WRITE_POSITIONS = tuple((op in (WRITE_FIRST, WRITE_ONLY, WRITE_ONLY_IMM), op not in (WRITE_FIRST, WRITE_MIDDLE),
                         op in (WRITE_LAST_IMM, WRITE_ONLY_IMM)) for op in range(WRITE_FIRST, WRITE_ONLY_IMM + 1))


class Responder:
    """Receive side of one QP."""

    def __init__(self, port: QpPort) -> None:
        self.port, self.qp = port, port.qp
        self.mem, self.mrs, self.stats, self.faults = port.mem, port.mrs, port.stats, port.faults
        self.post_cqe, self.acks_due = port.post_cqe, port.acks_due
        self.rq = ReceiveQueue(port.qp, port.mem, port.mrs)
        self.started = False
        self.epsn = self.msn = 0
        self.nak_sent = False  # a NAK (sequence or RNR) is out for epsn: drop later PSNs silently until it arrives
        # The go-back a NAK-sequence asks for has not reached us yet: nak_psn is the PSN it asked for, dropped_hi the
        # highest PSN dropped silently since. The go-back re-sends everything up to dropped_hi, so a gap there is not
        # a new loss while packets the requester sent before it saw the NAK are still arriving (see on_request).
        self.go_back_due = False
        self.nak_psn = self.dropped_hi = 0
        self.in_msg = 0  # IN_SEND / IN_WRITE while a multi-packet message is half received
        self.target: Target = EMPTY  # where the current message lands
        self.offset = self.msg_length = 0  # into the message; its length (WRITE: the RETH's; SEND: the buffer's)
        self.placing = True  # the current WRITE's payload really lands (False only under the skip_placement fault)
        self.wr_id = 0  # of the RQ WQE the current SEND fills
        self.ack_psn: int | None = None  # the coalesced ACK owed at the end of this receive batch
        self.atomics = AtomicResults()
        self.known_region: KnownRegion | None = None  # where the compiled core may place WRITEs (writeruns.py)

    def start(self) -> None:
        """The QP reached RTR: expect rq_psn."""
        self.started = True
        self.epsn, self.msn = self.qp.rq_psn & PSN_MASK, 0
        self.nak_sent, self.go_back_due, self.in_msg, self.ack_psn = False, False, 0, None
        self.atomics.clear()

    # -- packets out -----------------------------------------------------------------------------------------------
    def _acknowledge(self, psn: int, syndrome: int) -> None:
        dest_qp, pkey, src_ip, dst_ip, sport, tos, ttl = self.port.address
        self.port.outbox.append(pk.Packet(ACKNOWLEDGE, dest_qp, psn, False, False, pkey, False, False, 0, 0, 0,
                                        syndrome, self.msn, 0, b"", src_ip, dst_ip, sport, ROCE_PORT, 0, tos, ttl))
        self.stats["packets_sent"] += 1

    def flush_ack(self) -> None:
        if self.ack_psn is not None:
            self._acknowledge(self.ack_psn, pk.ACK_UNLIMITED)
            self.ack_psn = None
            self.stats["acks"] += 1

    def owe_ack(self, psn: int) -> None:
        if self.ack_psn is None:
            self.acks_due.append(self.flush_ack)
        self.ack_psn = psn

    def _nak(self, syndrome: int, psn: int) -> None:
        self.ack_psn = None  # a NAK acknowledges everything before its PSN
        self._acknowledge(psn, syndrome)
        self.stats["naks"] += 1

    def _atomic_acknowledge(self, psn: int, original: int) -> None:
        """The ATOMIC_ACKNOWLEDGE of the atomic at `psn`, carrying its original value."""
        dest_qp, pkey, src_ip, dst_ip, sport, tos, ttl = self.port.address
        self.port.outbox.append(pk.Packet(ATOMIC_ACKNOWLEDGE, dest_qp, psn, False, False, pkey, False, False, 0, 0, 0,
                                          pk.ACK_UNLIMITED, self.msn, 0, b"", src_ip, dst_ip, sport, ROCE_PORT, 0, tos,
                                          ttl, original=original))
        self.stats["packets_sent"] += 1

    def _respond(self, psn: int, source: Buffer, length: int) -> None:
        """READ responses for `length` bytes of `source` from PSN `psn` (AETH on FIRST, LAST and ONLY)."""
        mtu = self.qp.path_mtu
        count = psn_count(length, mtu)
        dest_qp, pkey, src_ip, dst_ip, sport, tos, ttl = self.port.address
        out, packet, msn = self.port.outbox, pk.Packet, self.msn
        for i in range(count):
            offset = i * mtu
            op = RESPONSE_ONLY if count == 1 else RESPONSE_FIRST if i == 0 else \
                RESPONSE_LAST if i == count - 1 else RESPONSE_MIDDLE
            out.append(packet(op, dest_qp, (psn + i) & PSN_MASK, False, False, pkey, False, False, 0, 0, 0,
                              pk.ACK_UNLIMITED, msn, 0, source[offset:offset + min(mtu, length - offset)], src_ip,
                              dst_ip, sport, ROCE_PORT, 0, tos, ttl))
        self.stats["packets_sent"] += count

    # -- completions and errors ------------------------------------------------------------------------------------
    def _complete(self, status: int, length: int = 0, imm: int = 0, flags: int = 0, solicited: bool = False) -> None:
        """Complete the RQ WQE at the consumer."""
        qp = self.qp
        self.post_cqe(qp.rcq, CQE_RES_RC.pack(length, imm, qp.handle, 0, CQE_TYPE_RES_RC, status, flags,
                                              self.wr_id & WR_ID_MASK), solicited)
        qp.rq_consumer += 1

    def _error(self, p: pk.Packet, syndrome: int, reason: int, status: int | None = None) -> None:
        """A class C error: NAK it, complete the RQ WQE involved with `status`, put the QP in ERR."""
        self._nak(syndrome, p.psn)
        self.stats["request_errors"] += 1
        if status is not None:
            self._complete(status)
        self.port.fail_qp(res_reason=reason)

    def flush(self) -> None:
        """The QP is in ERR: every posted receive completes FLUSHED."""
        self.in_msg, self.ack_psn = 0, None
        if not self.rq.exists:
            return
        qp, produced = self.qp, self.rq.produced()
        while produced is not None and qp.rq_consumer < produced:
            try:
                self.wr_id = self.rq.wqe()[1]
            except ACCESS_ERRORS:
                self.wr_id = 0
            self._complete(FLUSHED)

    def _take_rq(self, p: pk.Packet, scatter: bool) -> bool:
        """Hold the next RQ WQE for this message (its SGEs mapped when `scatter`); on False a NAK was sent."""
        qp, rq = self.qp, self.rq
        if not rq.exists:
            self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR)  # a QP without an RQ takes no SENDs
            return False
        produced = rq.produced()
        if produced is None or produced == qp.rq_consumer:
            self._nak(pk.RNR_NAK | qp.min_rnr_timer & 0x1F, p.psn)
            self.nak_sent = True  # what follows in flight is dropped quietly until the retry arrives
            self.stats["rnr_naks"] += 1
            return False
        try:
            wqe_size, self.wr_id, view = rq.wqe()
            if scatter:
                buffer = rq.buffer(wqe_size, view)
                self.target, self.msg_length = buffer, len(buffer)
        except ACCESS_ERRORS:
            self._error(p, pk.NAK_REMOTE_OPERATIONAL, RES_MEMORY_ERROR, S.CQ_RES_RC_STATUS_LOCAL_PROTECTION_ERR)
            return False
        return True

    # -- requests ----------------------------------------------------------------------------------------------------
    def on_requests(self, packets: list[pk.Packet], i: int, now: float) -> int:
        """Handle packets[i], then the MIDDLE packets right behind it that continue the same message in sequence;
        the index of the first packet left for the caller.

        A long message's MIDDLE packets are most of what a busy responder receives, and all that is left to do for
        one is a copy: that is done here in a tight loop. Anything unusual (another QP, opcode or source address, a
        PSN gap, AckReq, a size that does not fit) stops it, and that packet goes through the data path's checks and
        on_request like any other.
        """
        self.on_request(packets[i], now)
        i += 1
        if self.go_back_due:
            return i  # on_request watches for the go-back's arrival
        if self.in_msg == IN_WRITE:
            middle, room = WRITE_MIDDLE, self.msg_length
        elif self.in_msg == IN_SEND:
            middle, room = SEND_MIDDLE, self.msg_length
        else:
            return i
        qpn, mtu, target, offset, epsn = self.qp.qpn, self.qp.path_mtu, self.target, self.offset, self.epsn
        peer, local = self.port.peer_ip, packets[i - 1].dst_ip  # as the data path checked the first
        count = len(packets)
        while i < count:
            p = packets[i]
            if p.opcode != middle or p.dest_qp != qpn or p.psn != epsn or p.ack_req or offset + mtu > room \
                    or p.src_ip != peer or p.dst_ip != local:
                break
            payload = p.payload
            if len(payload) != mtu:
                break
            try:
                target[offset:offset + mtu] = payload
            except ACCESS_ERRORS:
                break  # on_request reports it
            offset += mtu
            epsn = (epsn + 1) & PSN_MASK
            i += 1
        self.offset, self.epsn = offset, epsn
        return i

    def on_request(self, p: pk.Packet, now: float) -> None:
        if not self.started:
            self.start()
        psn = p.psn
        if psn != self.epsn:
            if psn_diff(psn, self.epsn) < 0:
                if self.go_back_due and psn_diff(psn, self.nak_psn) >= 0:
                    self.go_back_due = False  # the go-back re-sends what we already have: it has reached us
                self._duplicate(p)
                return
            self._out_of_sequence(psn)
            return
        if self.go_back_due and psn != self.nak_psn:
            self.go_back_due = False  # a PSN we dropped is back: the go-back has reached us
        self.nak_sent = False
        op = p.opcode
        if WRITE_FIRST <= op <= WRITE_ONLY_IMM:
            self._write(p, op)
        elif op <= SEND_ONLY_IMM:
            self._send(p, op)
        elif op == READ_REQUEST:
            self._read(p)
        elif op == COMPARE_SWAP or op == FETCH_ADD:
            self._atomic(p, op)
        elif op == pk.Op.CNP:
            self.stats["cnps"] += 1
        else:  # SEND with invalidate: not emulated
            self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR)

    def _out_of_sequence(self, psn: int) -> None:
        """A PSN past the expected one: one NAK-sequence per gap, as the IBA and rxe do, then silence until the
        expected PSN arrives.

        Beyond rxe: once the NAKed PSN has arrived (a reordered packet, not a lost one), packets the requester sent
        before it saw the NAK may still follow, each past a PSN we dropped meanwhile. The go-back the NAK asked for
        re-sends those, so such a gap earns no second NAK (which would make the requester go back twice for one
        reordering). A packet we have seen before (PSN <= dropped_hi) is the go-back itself: a gap then is a new loss.
        """
        self.stats["out_of_sequence"] += 1
        racing = self.go_back_due and psn_diff(psn, self.dropped_hi) > 0
        if self.nak_sent or racing:
            self.stats["dropped"] += 1
            if self.go_back_due and psn_diff(psn, self.dropped_hi) > 0:
                self.dropped_hi = psn
            return
        self.nak_sent = self.go_back_due = True
        self.nak_psn, self.dropped_hi = self.epsn, psn
        self._nak(pk.NAK_PSN_SEQ, self.epsn)

    def _send(self, p: pk.Packet, op: int) -> None:
        first, last = op == SEND_FIRST or op >= SEND_ONLY, op > SEND_MIDDLE
        if first:
            if self.in_msg:
                self._inside_a_message(p)
                return
            if not self._take_rq(p, True):
                return
            self.in_msg, self.offset = IN_SEND, 0
        elif self.in_msg != IN_SEND:
            self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR,
                        S.CQ_RES_RC_STATUS_REMOTE_INVALID_REQUEST_ERR if self.in_msg else None)
            return
        payload = p.payload
        size, mtu = len(payload), self.qp.path_mtu
        if size > mtu or (not last and size != mtu):
            self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR, S.CQ_RES_RC_STATUS_REMOTE_INVALID_REQUEST_ERR)
            return
        if self.offset + size > self.msg_length:
            self._error(p, pk.NAK_INVALID_REQUEST, RES_EXCEEDS_WQE, S.CQ_RES_RC_STATUS_LOCAL_LENGTH_ERR)
            return
        try:
            self.target[self.offset:self.offset + size] = payload
        except ACCESS_ERRORS:
            self._error(p, pk.NAK_REMOTE_OPERATIONAL, RES_MEMORY_ERROR, S.CQ_RES_RC_STATUS_LOCAL_PROTECTION_ERR)
            return
        self.offset += size
        self.epsn = (p.psn + 1) & PSN_MASK
        if last:
            imm = op == SEND_LAST_IMM or op == SEND_ONLY_IMM
            self.in_msg, self.target = 0, EMPTY
            self.msn = (self.msn + 1) & MSN_MASK
            placed = self.port.placed
            placed.send_messages += 1
            placed.send_bytes += self.offset
            self._complete(OK, self.offset, p.immediate if imm else 0, IMM if imm else 0, p.solicited)
        if p.ack_req:
            self.owe_ack(p.psn)

    def _write(self, p: pk.Packet, op: int) -> None:
        first, last, imm = WRITE_POSITIONS[op - WRITE_FIRST]
        qp = self.qp
        if first:
            if self.in_msg:
                self._inside_a_message(p)
                return
        elif self.in_msg != IN_WRITE:
            self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR,
                        S.CQ_RES_RC_STATUS_REMOTE_INVALID_REQUEST_ERR if self.in_msg else None)
            return
        if imm and not self._take_rq(p, False):  # RNR before anything lands; the retry repeats this packet
            return
        if first:
            try:
                if not qp.access & QP_REMOTE_WRITE:
                    raise PermissionError
                self.target = map_remote(self.mem, self.mrs, p.remote_addr, p.rkey, p.dma_length, qp.pd,
                                         MR_REMOTE_WRITE)
            except (*ACCESS_ERRORS, PermissionError):
                self._error(p, pk.NAK_REMOTE_ACCESS, RES_RX_INVALID_R_KEY)
                return
            self.in_msg, self.offset, self.msg_length, self.placing = IN_WRITE, 0, p.dma_length, True
            if p.dma_length and self.faults.armed:
                self.target, self.placing = self.faults.target(p, self.target, self.mem, self.mrs, qp.pd)
        payload = p.payload
        size, mtu = len(payload), qp.path_mtu
        end = self.offset + size
        if size > mtu or (not last and size != mtu) or end > self.msg_length or (last and end != self.msg_length):
            self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR)
            return
        try:
            self.target[self.offset:self.offset + size] = payload
        except ACCESS_ERRORS:
            self._error(p, pk.NAK_REMOTE_ACCESS, RES_MEMORY_ERROR)
            return
        self.offset = end
        self.epsn = (p.psn + 1) & PSN_MASK
        if last:
            self.in_msg, self.target = 0, EMPTY
            self.msn = (self.msn + 1) & MSN_MASK
            if self.placing:
                placed = self.port.placed
                placed.write_messages += 1
                placed.write_bytes += self.msg_length
            if imm:
                self._complete(OK, self.msg_length, p.immediate, RDMA | IMM, p.solicited)
        if p.ack_req:
            self.owe_ack(p.psn)

    def _inside_a_message(self, p: pk.Packet) -> None:
        """A message starts while another is half received: an invalid request (a SEND's RQ WQE fails with it)."""
        self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR,
                    S.CQ_RES_RC_STATUS_REMOTE_INVALID_REQUEST_ERR if self.in_msg == IN_SEND else None)

    def _read_source(self, p: pk.Packet) -> Buffer:
        qp = self.qp
        if not qp.access & QP_REMOTE_READ:
            raise PermissionError
        return map_remote(self.mem, self.mrs, p.remote_addr, p.rkey, p.dma_length, qp.pd, MR_REMOTE_READ)

    def _read(self, p: pk.Packet) -> None:
        if self.in_msg:
            self._inside_a_message(p)
            return
        try:
            source = self._read_source(p)
        except (*ACCESS_ERRORS, PermissionError):
            self._error(p, pk.NAK_REMOTE_ACCESS, RES_RX_INVALID_R_KEY)
            return
        self.msn = (self.msn + 1) & MSN_MASK
        self._respond(p.psn, source, p.dma_length)
        self.epsn = (p.psn + psn_count(p.dma_length, self.qp.path_mtu)) & PSN_MASK

    def _atomic_target(self, p: pk.Packet) -> Buffer:
        """The ATOMIC_SIZE bytes an atomic request names (MemoryProtectionError, DmaFault or PermissionError when the
        QP, the rkey, the region's rights or its bounds refuse it)."""
        qp = self.qp
        if not qp.access & QP_REMOTE_ATOMIC:
            raise PermissionError
        return map_remote(self.mem, self.mrs, p.remote_addr, p.rkey, ATOMIC_SIZE, qp.pd, MR_REMOTE_ATOMIC)

    def _atomic(self, p: pk.Packet, op: int) -> None:
        if self.in_msg:
            self._inside_a_message(p)
            return
        try:
            target = self._atomic_target(p)
        except (*ACCESS_ERRORS, PermissionError):
            self._error(p, pk.NAK_REMOTE_ACCESS, RES_RX_INVALID_R_KEY)
            return
        if p.remote_addr % ATOMIC_SIZE:
            self._error(p, pk.NAK_INVALID_REQUEST, RES_UNALIGN_ATOMIC)
            return
        pcie = self.port.pcie
        if pcie.refusal() is not None:
            # Inferred: no driver shows what the chip does with an atomic it may not issue on PCIe. Without
            # ATOMIC_REQ it is taken as a responder without atomics takes one, an unsupported request (NAK invalid
            # request); on a path that does not complete AtomicOps the root port answers Unsupported Request, a host
            # memory error (NAK remote operational error). Either way nothing is written and the QP fails.
            self.stats["atomics_refused_pcie"] += 1
            if pcie.atomic_requests:
                self._error(p, pk.NAK_REMOTE_OPERATIONAL, RES_MEMORY_ERROR)
            else:
                self._error(p, pk.NAK_INVALID_REQUEST, RES_OPCODE_ERROR)
            return
        original = execute(target, op, p.swap_add, p.compare)
        self.msn = (self.msn + 1) & MSN_MASK
        self.epsn = (p.psn + 1) & PSN_MASK
        self.atomics.save(p.psn, original, self.qp.max_dest_rd_atomic)
        placed = self.port.placed
        placed.atomic_messages += 1
        placed.atomic_bytes += ATOMIC_SIZE
        self._atomic_acknowledge(p.psn, original)
        self.ack_psn = None  # the answer to the newest PSN acknowledges every one before it (not so a replayed one)

    def _duplicate_atomic(self, p: pk.Packet) -> None:
        """An atomic executed before: its saved result again, never a second execution. Once the result is given up
        (more atomics since than the requester may have unanswered, so not a retransmission the requester waits for)
        the request is dropped silently, as rxe's duplicate_request drops it (a class D error) rather than execute it
        again."""
        original = self.atomics.get(p.psn)
        if original is None:
            self.stats["dropped"] += 1
            self.stats["dropped_atomic_unsaved"] += 1
            return
        self.stats["atomic_replays"] += 1
        self._atomic_acknowledge(p.psn, original)

    def _duplicate(self, p: pk.Packet) -> None:
        """A request already executed: acknowledge again, answer a READ again from memory as it is now, an atomic
        from its saved result."""
        self.stats["duplicates"] += 1
        op = p.opcode
        if op == COMPARE_SWAP or op == FETCH_ADD:
            self._duplicate_atomic(p)
        elif op == READ_REQUEST:
            count = psn_count(p.dma_length, self.qp.path_mtu)
            if psn_diff((p.psn + count) & PSN_MASK, self.epsn) > 0:
                self.stats["dropped_malformed"] += 1  # claims responses beyond anything requested before
                return
            try:
                source = self._read_source(p)
            except (*ACCESS_ERRORS, PermissionError):
                self.stats["dropped"] += 1  # the region went away since: nothing sensible to answer
                return
            self._respond(p.psn, source, p.dma_length)
        elif op <= WRITE_ONLY_IMM:
            self.owe_ack((self.epsn - 1) & PSN_MASK)
        else:
            self.stats["dropped"] += 1
