"""The completer of one RC QP (sans-IO), the half of its requester that listens: ACKs, NAKs, read responses and
atomic acknowledgements in; WQEs retired, requester CQEs out, go-back-N retransmission.

WQEs are retired in order as ACKs arrive (an ACK for PSN n acknowledges every PSN up to n); read responses land in
the local SGEs, an ATOMIC_ACKNOWLEDGE's original value (8 bytes, little-endian: host order) in the atomic's. Requests
are retransmitted go-back-N from the oldest unacknowledged PSN on a NAK-sequence, an implied NAK (an ACK or response
past an unfinished READ or atomic, a gap in read responses) or a timeout, once per loss: a NAK that names the PSN a
go-back already restarted from (a duplicate, or one slower than the timer) starts no second one (stat "go_backs"
counts them). With hardware retransmission on (INITIALIZE_FW), a go-back finds the message it resumes in the search
table the driver wrote after the SQ, as the chip does: the message's MSN table entry, or its PSN search entry
(`_resume_from_search_table`). Behaviour follows rxe's rxe_comp.c except where the module docstring of `datapath`
says otherwise. `requester.Requester` extends it with the side that sends (one object per QP); all it reaches of the
data path is its `QpPort` (qpport.py).
"""
from __future__ import annotations

from . import packets as pk
from .dma import ACCESS_ERRORS
from .packets import RESPONSE_LAST, RESPONSE_MIDDLE, RESPONSE_ONLY
from .qpport import QpPort
from .sendqueue import SendQueue, SendWqe
from .wqeblock import WqeBlock
from ..autogen import bnxt
from ..hw.cqe import CQE_REQ, RequesterErrorReason
from ..hw.verbs import PSN_MASK, QPState, psn_diff
from ..hw.wqe import ATOMIC_SIZE

READ_SEGMENT = 32  # response packets one READ request asks for at most (a quarter of the window)
LOCAL_ACK_TIMEOUT_US = 4.096

S = bnxt
R = RequesterErrorReason
OK, FLUSHED = S.CQ_REQ_STATUS_OK, S.CQ_REQ_STATUS_WORK_REQUEST_FLUSHED_ERR
CQE_TYPE_REQ = S.CQ_BASE_CQE_TYPE_REQ  # with the valid bit 0: CompletionQueue.post sets it
NAK_STATUS = {pk.NAK_INVALID_REQUEST: S.CQ_REQ_STATUS_REMOTE_INVALID_REQUEST_ERR,
              pk.NAK_REMOTE_ACCESS: S.CQ_REQ_STATUS_REMOTE_ACCESS_ERR,
              pk.NAK_REMOTE_OPERATIONAL: S.CQ_REQ_STATUS_REMOTE_OPERATION_ERR}


def read_segment_end(k: int, npkts: int) -> int:
    """One past the last response packet of the READ request that asks for packet `k` of an `npkts`-packet READ.

    Requests split the READ at fixed multiples of READ_SEGMENT, so a go-back's request for the rest of a segment
    never reaches past what the responder was asked for before (it answers it as a duplicate)."""
    return min(npkts, (k // READ_SEGMENT + 1) * READ_SEGMENT)


class Completer:
    """Completion side of one QP's requester, and the state both sides share."""

    def __init__(self, port: QpPort) -> None:
        self.port, self.qp, self.stats = port, port.qp, port.stats
        self.wqes: list[SendWqe] = []
        self.done = 0  # wqes[:done] are completed (trimmed now and then)
        self.send = 0  # wqes[send] is being transmitted, from packet send_pkt
        self.send_pkt = 0
        self.sq = SendQueue(port.qp, port.mem, port.mrs)
        self.next_psn = self.una = self.sent_hi = 0  # next PSN to assign; oldest unacked; one past the highest sent
        self.reads = 0  # READ and atomic requests sent and not fully answered (ORRQ entries in use)
        self.noack = 0
        self.retry_left = self.rnr_left = 0
        self.started_retry = False
        self.rto_at: float | None = None
        self.rnr_until: float | None = None
        self.post_cqe = port.post_cqe
        # plain WQEs after wqes, as rows the compiled core parsed (wqeblock.py), when there is a core
        self.block = WqeBlock(port.core, self.sq) if port.core is not None else None

    # -- state ---------------------------------------------------------------------------------------------------------
    @property
    def interval(self) -> float | None:
        timeout = self.qp.timeout & 0x1F
        return LOCAL_ACK_TIMEOUT_US * 1e-6 * (1 << timeout) if timeout else None

    def deadline(self) -> float | None:
        rto, rnr = self.rto_at, self.rnr_until
        if rnr is not None:
            return rnr
        return rto

    # -- completing ------------------------------------------------------------------------------------------------
    def post_completion(self, w: SendWqe, status: int) -> None:
        """w's CQE, if it asked for one (a signaled WQE) or failed. Its sq_cons_idx names the WQE after w, modulo
        CREATE_QP's sq_size (WQEs; slots with variable WQEs, still one count per WQE), as Linux's
        bnxt_qplib_cq_process_req reduces it; an error CQE of a variable-WQE QP names the slot w starts at instead
        (bnxt_qplib_get_cqe_sq_cons). Inferred: that the chip reduces the index itself (Linux's own `%` could not
        undo a 16-bit wrap when sq_size does not divide 2^16)."""
        if status or w.signaled:
            self._post(w.index, w.slot, status)

    def _post(self, index: int, slot: int, status: int) -> None:
        """The CQE of WQE number `index` (starting at `slot`), as post_completion says."""
        qp = self.qp
        geometry = qp.sq_geometry
        consumer = slot if status and geometry.variable else (index + 1) % geometry.size
        self.post_cqe(qp.scq, CQE_REQ.pack(qp.handle, consumer, CQE_TYPE_REQ, status))

    def materialise(self) -> None:
        """Turn the block's WQEs not yet retired into SendWqes after wqes, where the reference code handles them."""
        block = self.block
        if block is None or not block.unretired:
            return
        if self.send == len(self.wqes):  # every SendWqe sent: the block's sending carries on where it was
            self.send, self.send_pkt = len(self.wqes) + block.send - block.done, block.send_pkt
        self.wqes += block.materialise()

    def _retire(self) -> None:
        """Complete wqes[done] successfully."""
        w = self.wqes[self.done]
        self.done += 1
        self.post_completion(w, OK)
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
                self.post_completion(w, OK)
        if done != self.done:
            self.done, progressed = done, True
            self.qp.sq_consumer = wqes[done - 1].index + 1
        block = self.block
        if done == fetched and block is not None and block.unretired:  # on into the block's rows
            numbers = block.retire(psn)
            if numbers:
                consumer = numbers.pop()
                for index in numbers:
                    self._post(index, 0, OK)
                self.qp.sq_consumer, progressed = consumer + 1, True
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
        if block is not None and self.send == self.done == len(wqes) and block.unretired:  # the same in the block
            if block.send < block.done:
                block.send, block.send_pkt = block.done, 0
            if block.send == block.done:
                block.send_pkt = max(block.send_pkt, psn_diff(self.una, block.first_psn(block.send)))
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
        self.materialise()
        if self.done < len(self.wqes):
            w = self.wqes[self.done]
            self.done += 1
            self.post_completion(w, status)
            self.qp.sq_consumer = w.index + 1
        self.port.fail_qp(req_reason=reason)

    # -- retransmission ---------------------------------------------------------------------------------------------
    def _rewind(self) -> None:
        """Go back to the packet carrying the oldest unacknowledged PSN (go-back-N)."""
        self.materialise()
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
            self.materialise()
            if self.done < len(self.wqes) and psn_diff(self.sent_hi, self.una) > 0:
                self.stats["timeouts"] += 1
                self._retry(now, timeout=True)

    # -- responses ---------------------------------------------------------------------------------------------------
    def on_acknowledge(self, psn: int, syndrome: int, now: float) -> None:
        """An ACKNOWLEDGE: ACK, RNR NAK or NAK (its AETH syndrome) with the PSN it refers to."""
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
        self.materialise()
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
        self.materialise()
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
