"""The requester of one RC QP (sans-IO): SQ WQEs in, request packets out. Its `Completer` base (completer.py) takes
the answers: ACKs, read responses and atomic acknowledgements in, requester CQEs out, retransmission.

WQEs are fetched from the SQ ring (sendqueue.py) when its doorbell moves the producer and get their PSN range at once
(one PSN per packet; a READ takes as many as its responses, an atomic one). `pump()` turns them into packets within the
128-PSN window and the ORRQ limit (`max_rd_atomic` READ and atomic requests in flight): a WRITE's or SEND's packets as
one `packets.Segments` per burst (the transport encodes them without a Packet each), a READ request or an atomic
(COMPARE_SWAP, FETCH_ADD with its AtomicETH) as a Packet. A READ is asked for READ_SEGMENT responses at a time, each a
READ request of its own (RETH VA and length advanced), sent only once its responses fit in the window: like a WRITE's
packets, a READ's responses in flight never exceed a window, which the receive buffer holds
(emulator.RECEIVE_WINDOW_PER_QP), however long the READ and however loaded the host. Behaviour follows rxe's rxe_req.c
except where the module docstring of `datapath` says otherwise. All it reaches of the data path is its `QpPort`
(qpport.py). With the compiled core (native.py), plain WRITEs and SENDs fetched two or more at a time wait after the
SendWqes in a `WqeBlock` (wqeblock.py): fetched, sent (one `Burst` per turn) and retired a run at a time, and turned
into the SendWqes they stand for before anything else is done with them.
"""
from __future__ import annotations

from . import packets as pk
from .completer import FLUSHED, Completer, read_segment_end
from .packets import READ_REQUEST, ROCE_PORT
from .qpport import QpPort
from .sendqueue import SendWqe
from ..hw.verbs import PSN_MASK, psn_diff

WINDOW = 128  # RXE_MAX_UNACKED_PSNS
ACK_EVERY = 64  # AckReq at least this often inside long messages (RXE_MAX_PKT_PER_ACK)


class Requester(Completer):
    """Send side of one QP: fetch, segment, transmit; the Completer completes and retransmits."""

    def __init__(self, port: QpPort) -> None:
        super().__init__(port)
        self.started = False

    # -- state ---------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """The QP reached RTS: PSNs start at sq_psn."""
        qp = self.qp
        self.started = True
        self.next_psn = self.una = self.sent_hi = qp.sq_psn & PSN_MASK
        self.retry_left, self.rnr_left = qp.retry_cnt & 7, qp.rnr_retry & 7

    def has_work(self) -> bool:
        block = self.block
        return (self.send < len(self.wqes) or block is not None and block.unsent) and self.rnr_until is None

    # -- fetching WQEs ---------------------------------------------------------------------------------------------
    def fetch(self, flush: bool = False) -> None:
        """Take every WQE the driver published off the SQ (completing each FLUSHED at once when `flush`): plain ones
        into the block while there is one, the others (and all, without a block) as SendWqes."""
        block, sq = self.block, self.sq
        if block is not None and not flush:
            produced = sq.produced()
            if produced is None:
                self.stats["bad_doorbells"] += 1
                return
            # One WQE alone (lat's ping) is cheaper as a SendWqe; a block pays off from two on
            if block.unretired or produced - sq.fetched_slots > block.one_wqe:
                while not block.fetch(self, produced):  # the next WQE is not a block's: the Python fetch takes it
                    self.materialise()
                    self.wqes += sq.fetch(self, limit=1) or []
                return
        wqes = sq.fetch(self, flush)
        if wqes is None:
            self.stats["bad_doorbells"] += 1
        elif flush:
            for w in wqes:
                self.post_completion(w, FLUSHED)
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
            sent_hi, retransmits = _account(psn, end, count, sent_hi, retransmits)
        block = self.block
        if block is not None and self.send == len(wqes) and sent < budget and block.unsent:
            burst, psn, self.noack = block.pump(una, budget - sent, self.reads, self.noack, WINDOW, ACK_EVERY,
                                                port.address, mtu)
            if burst is not None:
                out.append(burst)
                sent += burst.count
                sent_hi, retransmits = _account(psn, (psn + burst.count) & PSN_MASK, burst.count, sent_hi, retransmits)
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
                                          False, w.swap_add, w.compare))
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

    def flush(self) -> None:
        """The QP is in ERR: every WQE not yet completed, and every WQE still on the ring, completes FLUSHED."""
        self.materialise()
        for w in self.wqes[self.done:]:
            self.post_completion(w, FLUSHED)
        if len(self.wqes) > self.done:
            self.qp.sq_consumer = self.wqes[-1].index + 1
        self.wqes, self.done, self.send, self.send_pkt, self.reads = [], 0, 0, 0, 0
        self.rto_at = self.rnr_until = None
        self.fetch(flush=True)


def _account(psn: int, end: int, count: int, sent_hi: int, retransmits: int) -> tuple[int, int]:
    """The highest PSN sent and the retransmissions counted, after `count` packets from `psn` to `end`."""
    if psn == sent_hi:  # all new
        return end, retransmits
    behind = psn_diff(sent_hi, psn)  # this many of the packets just queued were sent before
    if behind > 0:
        retransmits += min(behind, count)
    return (end if psn_diff(end, sent_hi) > 0 else sent_hi), retransmits
