"""The requester and completer of one RC QP (sans-IO): SQ WQEs in, request packets out, ACKs, read responses and atomic
acknowledgements in, requester CQEs out.

WQEs are fetched from the SQ ring (sendqueue.py) when its doorbell moves the producer and get their PSN range at once
(one PSN per packet; a READ takes as many as its responses, an atomic one). `pump()` turns them into packets within the
128-PSN window and the ORRQ limit (`max_rd_atomic` READ and atomic requests in flight): a WRITE's or SEND's packets as
one `packets.Segments` per burst (the transport encodes them without a Packet each), a READ request or an atomic
(COMPARE_SWAP, FETCH_ADD with its AtomicETH) as a Packet. A READ is asked for READ_SEGMENT responses at a time, each a
READ request of its own (RETH VA and length advanced), sent only once its responses fit in the window: like a WRITE's
packets, a READ's responses in flight never exceed a window, which the receive buffer holds
(process.RECEIVE_WINDOW_PER_QP), however long the READ and however loaded the host. The completer retires WQEs in order
as ACKs arrive (an ACK for PSN n acknowledges every PSN up to n), lands read responses in the local SGEs, an
ATOMIC_ACKNOWLEDGE's original value (8 bytes, little-endian: host order) in the atomic's, and retransmits go-back-N from
the oldest unacknowledged PSN on a NAK-sequence, an implied NAK (an ACK or response past an unfinished READ or atomic, a
gap in read responses) or a timeout, once per loss: a NAK that names the PSN a go-back already restarted from (a
duplicate, or one slower than the timer) starts no second one (stat "go_backs" counts them). With hardware
retransmission on (INITIALIZE_FW), a go-back finds the message it resumes in the search table the driver wrote after the
SQ, as the chip does: the message's MSN table entry, or its PSN search entry (`_resume_from_search_table`). Behaviour
follows rxe (rxe_req.c, rxe_comp.c) except where the module docstring of `datapath` says otherwise. All it reaches of
the data path is its `QpPort` (qpport.py).
"""
from __future__ import annotations

from . import packets as pk
from .dma import ACCESS_ERRORS
from .packets import ROCE_PORT
from .qpport import QpPort
from .sendqueue import SendQueue, SendWqe
from ..autogen import bnxt
from ..hw.cqe import CQE_REQ, SQ_CONS_IDX_MASK, RequesterErrorReason
from ..hw.verbs import PSN_MASK, QPState, psn_diff
from ..hw.wqe import ATOMIC_SIZE

WINDOW = 128  # RXE_MAX_UNACKED_PSNS
READ_SEGMENT = 32  # response packets one READ request asks for at most (a quarter of the window)
ACK_EVERY = 64  # AckReq at least this often inside long messages (RXE_MAX_PKT_PER_ACK)
LOCAL_ACK_TIMEOUT_US = 4.096

S = bnxt
R = RequesterErrorReason
OK, FLUSHED = S.CQ_REQ_STATUS_OK, S.CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR
CQE_TYPE_REQ = S.CQ_BASE_CQE_TYPE_REQ  # with the valid bit 0: CompletionQueue.post sets it
NAK_STATUS = {pk.NAK_INVALID_REQUEST: S.CQ_REQ_STATUS_REMOTE_INVALID_REQUEST_ERR,
              pk.NAK_REMOTE_ACCESS: S.CQ_REQ_STATUS_REMOTE_ACCESS_ERR,
              pk.NAK_REMOTE_OPERATIONAL: S.CQ_REQ_STATUS_REMOTE_OPERATION_ERR}
O = pk.Op
READ_REQUEST = int(O.RDMA_READ_REQUEST)
RESPONSE_FIRST, RESPONSE_MIDDLE, RESPONSE_LAST, RESPONSE_ONLY = (
    int(O.RDMA_READ_RESPONSE_FIRST), int(O.RDMA_READ_RESPONSE_MIDDLE), int(O.RDMA_READ_RESPONSE_LAST),
    int(O.RDMA_READ_RESPONSE_ONLY))


def read_segment_end(k: int, npkts: int) -> int:
    """One past the last response packet of the READ request that asks for packet `k` of an `npkts`-packet READ.

    Requests split the READ at fixed multiples of READ_SEGMENT, so a go-back's request for the rest of a segment
    never reaches past what the responder was asked for before (it answers it as a duplicate)."""
    return min(npkts, (k // READ_SEGMENT + 1) * READ_SEGMENT)


class Requester:
    """Send side of one QP: fetch, segment, transmit, complete, retransmit."""

    def __init__(self, port: QpPort) -> None:
        self.port, self.qp, self.stats = port, port.qp, port.stats
        self.wqes: list[SendWqe] = []
        self.done = 0  # wqes[:done] are completed (trimmed now and then)
        self.send = 0  # wqes[send] is being transmitted, from packet send_pkt
        self.send_pkt = 0
        self.sq = SendQueue(port.qp, port.mem, port.mrs)
        self.started = False
        self.next_psn = self.una = self.sent_hi = 0  # next PSN to assign; oldest unacked; one past the highest sent
        self.reads = 0  # READ and atomic requests sent and not fully answered (ORRQ entries in use)
        self.noack = 0
        self.retry_left = self.rnr_left = 0
        self.started_retry = False
        self.rto_at: float | None = None
        self.rnr_until: float | None = None

    # -- state ---------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """The QP reached RTS: PSNs start at sq_psn."""
        qp = self.qp
        self.started = True
        self.next_psn = self.una = self.sent_hi = qp.sq_psn & PSN_MASK
        self.retry_left, self.rnr_left = qp.retry_cnt & 7, qp.rnr_retry & 7

    @property
    def interval(self) -> float | None:
        timeout = self.qp.timeout & 0x1F
        return LOCAL_ACK_TIMEOUT_US * 1e-6 * (1 << timeout) if timeout else None

    def deadline(self) -> float | None:
        rto, rnr = self.rto_at, self.rnr_until
        if rnr is not None:
            return rnr
        return rto

    def has_work(self) -> bool:
        return self.send < len(self.wqes) and self.rnr_until is None

    # -- fetching WQEs ---------------------------------------------------------------------------------------------
    def fetch(self, flush: bool = False) -> None:
        """Take every WQE the driver published off the SQ (completing each FLUSHED at once when `flush`)."""
        wqes = self.sq.fetch(self, flush)
        if wqes is None:
            self.stats["bad_doorbells"] += 1
        elif flush:
            for w in wqes:
                self._post(w, FLUSHED)
            self.qp.sq_consumer = self.sq.fetched
        else:
            self.wqes += wqes

    # -- transmitting ---------------------------------------------------------------------------------------------
    def pump(self, now: float, budget: int) -> int:
        """Queue up to `budget` packets on the outbox (a WRITE or SEND as Segments, a READ or atomic request as a
        Packet); the number queued."""
        if self.rnr_until is not None:
            return 0
        wqes, qp, port = self.wqes, self.qp, self.port
        out = port.outbox
        mtu, una, sent_hi = qp.path_mtu, self.una, self.sent_hi
        dest_qp, pkey, src_ip, dst_ip, sport, tos, ttl = port.address
        sent = retransmits = 0
        while self.send < len(wqes) and sent < budget:
            w = wqes[self.send]
            if w.status is not None:
                break  # a local error: it completes once every earlier WQE has
            if w.atomic:
                if not self._queue_atomic(w, una):
                    break
                psn, end, count = w.first_psn, (w.first_psn + 1) & PSN_MASK, 1
            elif w.read:
                k, stop = self.send_pkt, read_segment_end(self.send_pkt, w.npkts)
                new = k >= w.requested  # else a go-back asks again for responses asked for before
                if new and self.reads >= max(1, qp.max_rd_atomic):
                    break
                psn = (w.first_psn + k) & PSN_MASK
                end = (w.first_psn + stop) & PSN_MASK
                if psn_diff(end, una) > WINDOW:
                    break
                if new:
                    w.requested = stop
                    self.reads += 1
                offset = k * mtu
                out.append(pk.Packet(READ_REQUEST, dest_qp, psn, True, False, pkey, False, False,
                                     w.remote_va + offset, w.rkey, min(stop * mtu, w.length) - offset, 0, 0, 0, b"",
                                     src_ip, dst_ip, sport, ROCE_PORT, 0, tos, ttl))
                self.noack = 0
                if stop == w.npkts:
                    self.send += 1
                    self.send_pkt = 0
                else:
                    self.send_pkt = stop
                count = 1
            else:
                k = self.send_pkt
                if k == 0 and w.fence and self.reads:
                    break
                psn = (w.first_psn + k) & PSN_MASK
                room = WINDOW - psn_diff(psn, una)
                if room <= 0:
                    break
                npkts = w.npkts
                count = min(npkts - k, room, budget - sent)
                last = k + count == npkts
                if count == 1 and last:  # the usual small message: its one packet asks for an ACK
                    acks, self.noack = 1, 0
                else:
                    acks = self._ack_requests(count, last)
                assert w.ops is not None  # a WRITE or SEND (READs took the branch above)
                out.append(pk.Segments(w.ops, dest_qp, w.first_psn, npkts, mtu, w.data, w.length, w.remote_va,
                                       w.rkey, w.imm, w.solicited, k, count, acks, pkey, src_ip, dst_ip, sport,
                                       ROCE_PORT, 0, tos, ttl))
                if last:
                    self.send += 1
                    self.send_pkt = 0
                else:
                    self.send_pkt = k + count
                end = (psn + count) & PSN_MASK
            sent += count
            if psn == sent_hi:  # all new
                sent_hi = end
            else:
                behind = psn_diff(sent_hi, psn)  # this many of the packets just queued were sent before
                if behind > 0:
                    retransmits += min(behind, count)
                if psn_diff(end, sent_hi) > 0:
                    sent_hi = end
        self.sent_hi = sent_hi
        if sent:
            self.stats["packets_sent"] += sent
            if retransmits:
                self.stats["retransmits"] += retransmits
            if self.rto_at is None:
                interval = self.interval
                if interval is not None:
                    self.rto_at = now + interval
                    port.schedule(self.rto_at)
        return sent

    def _queue_atomic(self, w: SendWqe, una: int) -> bool:
        """Queue atomic `w`'s request (once more, after a go-back), if an ORRQ entry is free for a new one and its PSN
        is in the window; whether it was."""
        new = not w.requested
        if new and self.reads >= max(1, self.qp.max_rd_atomic) or psn_diff(w.first_psn, una) >= WINDOW:
            return False
        if new:
            w.requested = 1
            self.reads += 1
        dest_qp, pkey, src_ip, dst_ip, sport, tos, ttl = self.port.address
        self.port.outbox.append(pk.Packet(w.atomic, dest_qp, w.first_psn, True, False, pkey, False, False, w.remote_va,
                                          w.rkey, 0, 0, 0, 0, b"", src_ip, dst_ip, sport, ROCE_PORT, 0, tos, ttl,
                                          swap_add=w.swap_add, compare=w.compare))
        self.noack = 0
        self.send += 1
        self.send_pkt = 0
        return True

    def _ack_requests(self, count: int, ends_message: bool) -> int:
        """AckReq bits for `count` data packets about to go: every ACK_EVERY-th packet since the last AckReq (rxe's
        noack_pkts rule), and the message's last packet."""
        acks, i = 0, ACK_EVERY - 1 - self.noack
        while i < count:
            acks |= 1 << i
            i += ACK_EVERY
        if ends_message:
            acks |= 1 << (count - 1)
        self.noack = count - acks.bit_length() if acks else self.noack + count
        return acks

    # -- completing ------------------------------------------------------------------------------------------------
    def _post(self, w: SendWqe, status: int) -> None:
        if status or w.signaled:
            consumer = (w.index + 1) & SQ_CONS_IDX_MASK
            self.port.post_cqe(self.qp.scq, CQE_REQ.pack(self.qp.handle, consumer, CQE_TYPE_REQ, status))

    def _retire(self) -> None:
        """Complete wqes[done] successfully."""
        w = self.wqes[self.done]
        self.done += 1
        self._post(w, OK)
        self.qp.sq_consumer = w.index + 1

    def _trim(self) -> None:
        if self.done >= 256 and self.done * 2 >= len(self.wqes):
            del self.wqes[:self.done]
            self.send -= self.done
            self.done = 0

    def _progress(self, now: float) -> None:
        """Forward progress: fresh retry budgets, the retransmission timer restarted (or stopped when idle)."""
        qp = self.qp
        self.retry_left, self.rnr_left = qp.retry_cnt & 7, qp.rnr_retry & 7
        self.started_retry = False
        if psn_diff(self.sent_hi, self.una) > 0:
            interval = self.interval
            if interval is not None:
                armed = self.rto_at is not None
                self.rto_at = now + interval
                if not armed:
                    self.port.schedule(self.rto_at)
        else:
            self.rto_at = None

    def acked_through(self, psn: int, now: float) -> bool:
        """Everything up to `psn` was received by the responder: retire what that completes. False if the QP failed.

        An acknowledgement that reaches the last PSN of a READ still missing data means the READ or some of its
        responses were lost: an implied NAK, answered by going back to the READ.
        """
        wqes, progressed, implied = self.wqes, False, False
        done, fetched = self.done, len(wqes)
        while done < fetched:  # retire the WRITEs and SENDs it covers, the way _retire does
            w = wqes[done]
            if w.status is not None or w.read or psn_diff(w.last_psn, psn) > 0:
                break
            done += 1
            if w.signaled:
                self._post(w, OK)
        if done != self.done:
            self.done, progressed = done, True
            self.qp.sq_consumer = wqes[done - 1].index + 1
        if done < fetched:
            w = wqes[done]
            if w.status is not None:
                self.fail(w.status, w.reason)
                return False
            if w.read and psn_diff(w.last_psn, psn) <= 0:
                resume = (w.first_psn + w.received) & PSN_MASK
                if psn_diff(resume, self.una) > 0:
                    self.una, progressed = resume, True
                implied = True
        una = (psn + 1) & PSN_MASK
        if self.done < len(wqes) and wqes[self.done].read:  # inside a READ only its responses move una
            w = wqes[self.done]
            resume = (w.first_psn + w.received) & PSN_MASK
            if psn_diff(una, resume) > 0:
                una = resume
        if psn_diff(una, self.una) > 0:
            self.una, progressed = una, True
        if self.send < self.done:
            self.send, self.send_pkt = self.done, 0
        if self.send == self.done < len(wqes) and not wqes[self.send].read:  # skip segments already acknowledged
            self.send_pkt = max(self.send_pkt, psn_diff(self.una, wqes[self.send].first_psn))
        if progressed:
            self._progress(now)
            self._trim()
        if implied:
            self.stats["implied_naks"] += 1
            self._retry(now)
        return self.settle()

    def settle(self) -> bool:
        """Report a local error once every WQE before it has completed; False if the QP failed."""
        if self.qp.state == QPState.ERR:
            return False
        if self.done < len(self.wqes):
            w = self.wqes[self.done]
            if w.status is not None:
                self.fail(w.status, w.reason)
                return False
        return True

    def fail(self, status: int, reason: int) -> None:
        """Complete the oldest WQE with `status` and put the QP in ERR (which flushes everything else)."""
        if self.done < len(self.wqes):
            w = self.wqes[self.done]
            self.done += 1
            self._post(w, status)
            self.qp.sq_consumer = w.index + 1
        self.port.fail_qp(req_reason=reason)

    def flush(self) -> None:
        """The QP is in ERR: every WQE not yet completed, and every WQE still on the ring, completes FLUSHED."""
        for w in self.wqes[self.done:]:
            self._post(w, FLUSHED)
        if len(self.wqes) > self.done:
            self.qp.sq_consumer = self.wqes[-1].index + 1
        self.wqes, self.done, self.send, self.send_pkt, self.reads = [], 0, 0, 0, 0
        self.rto_at = self.rnr_until = None
        self.fetch(flush=True)

    # -- retransmission ---------------------------------------------------------------------------------------------
    def _rewind(self) -> None:
        """Go back to the packet carrying the oldest unacknowledged PSN (go-back-N)."""
        una, wqes = self.una, self.wqes
        for i in range(self.done, min(self.send + 1, len(wqes))):
            w = wqes[i]
            if w.status is not None or psn_diff(una, w.last_psn) <= 0:
                self.send = i
                self.send_pkt = max(0, psn_diff(una, w.first_psn))  # a READ's: its first response not received
                break
        if self.qp.hw_retx and self.send < len(wqes) and wqes[self.send].status is None:
            self._resume_from_search_table()
        self.noack = 0
        self.port.wake()

    def _resume_from_search_table(self) -> None:
        """Take the message a go-back resumes from the search table: re-read the WQE in the slot its entry names,
        number it from the entry's start PSN, complete it at the entry's next PSN, and number what follows on from it.
        An entry that says what the data path already knows changes nothing; a wrong one misleads the retransmission
        as it would mislead the chip."""
        wqes, i = self.wqes, self.send
        w = wqes[i]
        try:
            start_psn, next_psn, start_slot = self.sq.search_entry(w)
        except (*ACCESS_ERRORS, IndexError):
            self.fail(S.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR, R.REQ_TX_MEMORY_ERROR)
            return
        if start_psn == w.first_psn and next_psn == (w.last_psn + 1) & PSN_MASK and start_slot == w.slot:
            return
        self.stats["search_table_mismatches"] += 1
        resumed = wqes[i] = self.sq.parse_at(start_slot, start_psn, w.index)
        resumed.last_psn = (next_psn - 1) & PSN_MASK
        psn = (start_psn + resumed.npkts) & PSN_MASK
        for later in wqes[i + 1:]:
            later.first_psn, later.last_psn = psn, (psn + later.npkts - 1) & PSN_MASK
            psn = (psn + later.npkts) & PSN_MASK
        self.next_psn = psn
        self.send_pkt = min(max(0, psn_diff(self.una, start_psn)), resumed.npkts - 1)

    def _retry(self, now: float, timeout: bool = False) -> None:
        if self.started_retry and not timeout:
            return  # one retry per loss until something new is acknowledged (rxe's started_retry)
        if self.retry_left <= 0:
            self.fail(S.CQ_REQ_STATUS_TRANSPORT_RETRY_CNT_ERR, R.REQ_TIMEOUT_RETRY_LIMIT)
            return
        self.retry_left -= 1
        self.started_retry = True
        self.stats["go_backs"] += 1
        self.rto_at = None  # re-armed by the first retransmitted packet
        self._rewind()

    def on_timer(self, now: float) -> None:
        if self.rnr_until is not None:
            if now < self.rnr_until:
                return
            self.rnr_until = None
            self._rewind()
        if self.rto_at is not None and now >= self.rto_at:
            self.rto_at = None
            if self.done < len(self.wqes) and psn_diff(self.sent_hi, self.una) > 0:
                self.stats["timeouts"] += 1
                self._retry(now, timeout=True)

    # -- responses ---------------------------------------------------------------------------------------------------
    def on_acknowledge(self, p: pk.Packet, now: float) -> None:
        """An ACKNOWLEDGE: ACK, RNR NAK or NAK with the PSN it refers to."""
        psn, syndrome = p.psn, p.syndrome
        if psn_diff(psn, self.sent_hi) >= 0:
            self.stats["dropped_unexpected"] += 1  # acknowledges something never sent
            return
        kind = syndrome & pk.SYNDROME_TYPE_MASK
        if kind == pk.ACK:
            self.stats["acks_received"] += 1
            if psn_diff(psn, self.una) < 0:
                self.stats["stale_acks"] += 1
                return
            self.acked_through(psn, now)
            return
        self.stats["naks_received"] += 1
        if psn_diff(psn, self.una) < 0:
            self.stats["stale_acks"] += 1
            return
        if not self.acked_through((psn - 1) & PSN_MASK, now):  # a NAK acknowledges everything before its PSN
            return
        if kind == pk.RNR_NAK:
            self.stats["rnr_naks_received"] += 1
            if self.rnr_until is not None:
                return
            if self.rnr_left <= 0:
                self.fail(S.CQ_REQ_STATUS_RNR_NAK_RETRY_CNT_ERR, R.REQ_RNR_TIMEOUT_RETRY_LIMIT)
                return
            if self.qp.rnr_retry & 7 != 7:
                self.rnr_left -= 1
            self._rewind()
            self.rto_at = None
            self.rnr_until = now + pk.RNR_TIMER_US[syndrome & 0x1F] * 1e-6
            self.port.schedule(self.rnr_until)
        elif syndrome == pk.NAK_PSN_SEQ:
            if self.rnr_until is None and self.done < len(self.wqes):
                self._retry(now)
        else:
            self.fail(NAK_STATUS.get(syndrome, S.CQ_REQ_STATUS_REMOTE_OPERATION_ERR), R.REQ_NAK_ARRIVAL)

    def _answered(self, psn: int, now: float) -> SendWqe | None:
        """The oldest outstanding WQE a response at `psn` (READ data or an atomic's result) may answer, once the
        response has acknowledged every request before it; None (counted) when the response is stale or unexpected."""
        if psn_diff(psn, self.una) < 0:
            self.stats["duplicates"] += 1  # e.g. a replayed result for an atomic completed already
            return None
        if psn_diff(psn, self.sent_hi) >= 0:
            self.stats["dropped_unexpected"] += 1
            return None
        if not self.acked_through((psn - 1) & PSN_MASK, now) or self.done >= len(self.wqes):
            return None
        return self.wqes[self.done]

    def on_read_response(self, p: pk.Packet, now: float) -> None:
        psn = p.psn
        w = self._answered(psn, now)
        if w is None:
            return
        if not w.read or w.atomic or psn_diff(psn, w.last_psn) > 0:
            self.stats["dropped_unexpected"] += 1
            return
        expected = (w.first_psn + w.received) & PSN_MASK
        if psn != expected:
            self.stats["out_of_sequence"] += 1  # a response was lost: ask again from the gap
            self._retry(now)
            return
        mtu, k, op = self.qp.path_mtu, w.received, p.opcode
        last, answered = k == w.npkts - 1, read_segment_end(k, w.npkts) == k + 1  # ends the WQE; ends a request
        size = w.length - k * mtu if last else mtu
        payload = p.payload
        if len(payload) != size or answered != (op == RESPONSE_LAST or op == RESPONSE_ONLY) \
                or (op != RESPONSE_MIDDLE and p.syndrome & pk.SYNDROME_TYPE_MASK != pk.ACK):
            self.stats["dropped_malformed"] += 1
            return
        try:
            w.data[k * mtu:k * mtu + size] = payload
        except ACCESS_ERRORS:
            self.fail(S.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR, R.REQ_RX_MEMORY_ERROR)
            return
        w.received = k + 1
        if answered:
            self.reads -= 1  # its ORRQ entry is free
        self.una = (psn + 1) & PSN_MASK
        if last:
            placed = self.port.placed
            placed.read_messages += 1
            placed.read_bytes += w.length
            self._complete_answered()
        self._progress(now)
        self.settle()

    def _complete_answered(self) -> None:
        """The oldest WQE got its whole answer (READ data, an atomic's result): retire it; sending resumes past it."""
        self._retire()
        if self.send < self.done:
            self.send, self.send_pkt = self.done, 0
        self._trim()

    def on_atomic_acknowledge(self, p: pk.Packet, now: float) -> None:
        """An ATOMIC_ACKNOWLEDGE: the original value for the atomic at its PSN, which completes it (and acknowledges
        every request before it)."""
        psn = p.psn
        w = self._answered(psn, now)
        if w is None:
            return
        if not w.atomic or psn != w.first_psn:
            self.stats["dropped_unexpected"] += 1
            return
        if p.syndrome & pk.SYNDROME_TYPE_MASK != pk.ACK:
            self.stats["dropped_malformed"] += 1
            return
        try:
            w.data[0:ATOMIC_SIZE] = p.original.to_bytes(ATOMIC_SIZE, "little")
        except ACCESS_ERRORS:
            self.fail(S.CQ_REQ_STATUS_LOCAL_PROTECTION_ERR, R.REQ_RX_MEMORY_ERROR)
            return
        w.received = 1
        self.reads -= 1  # its ORRQ entry is free
        self.una = (psn + 1) & PSN_MASK
        self._complete_answered()
        self._progress(now)
        self.settle()
