/* The emulator's compiled send and receive queues: a send queue's plain WQEs fetched into rows, sent a turn at a
 * time and retired a run at a time (wqeblock.py), and runs of in-sequence RDMA WRITE packets placed (writeruns.py),
 * as the Python requester and responder do it (wirecore.h says what the halves share). */
#include "wirecore.h"

HIDDEN struct sq_format wc_sq;

void wc_sq_format(const struct sq_format *format) { wc_sq = *format; }

/* One SQ's fetch into a block (wqeblock.py `SQ_PARSE`). */
#pragma pack(push, 1)
struct sq_parse {
    /* the send queue, as it stays: */
    uint64_t pages; /* the ring's pages (u64 addresses here); slot s is in page s >> page_shift */
    uint64_t page_mask;
    uint32_t page_shift, ring_slots, unit, largest; /* unit: slots per doorbell step (1, or static) */
    uint8_t force_completion;
    /* this fetch: */
    uint64_t fetched, produced, index; /* free-running slots fetched and published; the next WQE's number */
    uint32_t next_psn, mtu;
    uint32_t lkey; /* the local region known: key, VA, size, address here (0: none), and its number */
    uint64_t region_va, region_size, region_at;
    uint8_t region;
    uint64_t rows; /* where the rows go, and how many fit */
    uint32_t capacity, parsed; /* out: rows written */
    uint8_t stop; /* out: why it stopped: FETCHED_ALL, ROWS_FULL, OTHER_REGION, OTHER_WQE */
};
enum { FETCHED_ALL, ROWS_FULL, OTHER_REGION, OTHER_WQE };
#pragma pack(pop)

static const uint8_t *sq_slot(const struct sq_parse *q, uint64_t s) {
    uint32_t slot = (uint32_t)(s % q->ring_slots);
    const uint64_t *pages = (const uint64_t *)(uintptr_t)q->pages;
    return (const uint8_t *)(uintptr_t)pages[(uint64_t)slot >> q->page_shift] /* shift: 62 for one piece */
           + (((uint64_t)slot * wc_sq.slot) & q->page_mask);
}

/* Fetch the WQEs published after q->fetched as sendqueue.SendQueue fetches them, as long as each is a one-SGE WRITE or
 * SEND (with or without immediate, not inline) whose bytes are in the known region and fit its SGE: PSNs from
 * q->next_psn on, one row each. Stops at the end of what was published, when the rows are full, at a WQE naming
 * another local key than the region's (the caller may learn that region) or at any other WQE (the caller's Python
 * path takes it). */
void wc_sq_parse(struct sq_parse *q) {
    struct row *rows = (struct row *)(uintptr_t)q->rows;
    q->parsed = 0, q->stop = OTHER_WQE;
    for (;; q->parsed++) {
        if (q->fetched >= q->produced) {
            q->stop = FETCHED_ALL;
            return;
        }
        if (q->parsed == q->capacity) {
            q->stop = ROWS_FULL;
            return;
        }
        uint64_t available = q->produced - q->fetched;
        uint8_t wqe[48];
        memcpy(wqe, sq_slot(q, q->fetched), 16);
        memcpy(wqe + 16, sq_slot(q, q->fetched + 1), 16);
        memcpy(wqe + 32, sq_slot(q, q->fetched + wc_sq.header_slots), 16);
        uint8_t type = wqe[wc_sq.type_at], flags = wqe[wc_sq.flags_at], size = wqe[wc_sq.size_at];
        if (size != wc_sq.header_slots + 1 || size > available || size > q->largest || !wc_sq.rdma[type]
            || flags & wc_sq.inline_data)
            return;
        uint32_t length = le32(wqe + wc_sq.length_at), lkey = le32(wqe + wc_sq.lkey_at);
        uint32_t sge_size = le32(wqe + wc_sq.sge_size_at);
        uint64_t va = le64(wqe + wc_sq.va_at), data = 0, within = va - q->region_va;
        if (!q->region_at || lkey != q->lkey) {
            q->stop = OTHER_REGION;
            return;
        }
        if (sge_size) {
            if (va < q->region_va || within > q->region_size || sge_size > q->region_size - within)
                return;
            data = q->region_at + within;
        }
        if (sge_size < length)
            return;
        struct row *w = rows + q->parsed;
        memset(w, 0, sizeof *w);
        w->index = q->index, w->data = data, w->va = va, w->slot = (uint32_t)(q->fetched % q->ring_slots);
        w->length = length, w->imm = le32(wqe + wc_sq.imm_at), w->sge_size = sge_size, w->type = type;
        if (wc_sq.rdma[type] == 1)
            w->remote_va = le64(wqe + wc_sq.remote_va_at), w->rkey = le32(wqe + wc_sq.rkey_at);
        w->signaled = (flags & wc_sq.signal) || q->force_completion;
        w->solicited = (flags & wc_sq.solicit) != 0, w->fence = (flags & wc_sq.fence) != 0;
        w->region = q->region;
        w->first_psn = q->next_psn;
        w->npkts = length ? (uint32_t)(((uint64_t)length + q->mtu - 1) / q->mtu) : 1; /* 64 bits: no wrap */
        q->next_psn = (q->next_psn + w->npkts) & PSN_MASK;
        q->fetched += q->unit == 1 ? size : q->unit;
        q->index++;
    }
}

/* One requester turn over a block's rows (wqeblock.py `PUMP`), as requester.Requester.pump goes over WQEs. */
#pragma pack(push, 1)
struct pump {
    uint64_t rows;
    uint32_t send, send_pkt, count; /* the row being sent and its next packet; rows held */
    uint32_t una, budget, reads, noack, window, ack_every; /* window, ack_every: requester.WINDOW, ACK_EVERY */
    uint32_t sent, first_psn, first_noack; /* out: packets queued, the first one's PSN, noack before it */
};
#pragma pack(pop)

void wc_pump(struct pump *u) {
    const struct row *rows = (const struct row *)(uintptr_t)u->rows;
    u->sent = 0, u->first_noack = u->noack;
    while (u->send < u->count && u->sent < u->budget) {
        const struct row *w = rows + u->send;
        uint32_t k = u->send_pkt;
        if (k == 0 && w->fence && u->reads)
            break;
        uint32_t psn = (w->first_psn + k) & PSN_MASK;
        int32_t room = (int32_t)u->window - psn_diff(psn, u->una);
        if (room <= 0)
            break;
        uint32_t count = w->npkts - k;
        if ((int64_t)count > room)
            count = room;
        if (count > u->budget - u->sent)
            count = u->budget - u->sent;
        if (!u->sent)
            u->first_psn = psn;
        for (uint32_t j = 0; j < count; j++)
            ack_request(&u->noack, k + j == w->npkts - 1, u->ack_every);
        u->sent += count;
        if (k + count == w->npkts)
            u->send++, u->send_pkt = 0;
        else
            u->send_pkt = k + count;
    }
}

/* The rows from..count-1 an acknowledgement of `psn` retires (requester's acked_through: every WQE whose last PSN is
 * at or before it); the numbers of the signaled ones among them go to `signaled`. */
int wc_retire(const struct row *rows, int from, int count, uint32_t psn, uint32_t *signaled, int *signaled_count) {
    int i = from;
    *signaled_count = 0;
    for (; i < count; i++) {
        const struct row *w = rows + i;
        if (psn_diff((w->first_psn + w->npkts - 1) & PSN_MASK, psn) > 0)
            break;
        if (w->signaled)
            signaled[(*signaled_count)++] = i;
    }
    return i;
}

/* One QP's responder while it takes a run of in-sequence RDMA WRITE packets (writeruns.py packs and reads it). */
#pragma pack(push, 1)
struct write_run {
    uint32_t qpn, peer, mtu;
    uint8_t write_ok; /* the QP grants remote writes */
    uint32_t rkey; /* the region last written through: a FIRST or ONLY naming another goes back to Python */
    uint64_t region_va, region_size, region_at; /* region_at: where it is in this process (0: none known) */
    uint32_t epsn;
    uint8_t in_write; /* a WRITE is half received: its target, offset, length and RETH address follow */
    uint64_t target, offset, length, message_va;
    uint32_t messages; /* out: WRITEs completed */
    uint64_t bytes; /* out: their bytes */
    uint8_t ack_owed; /* out: a packet asked for an ACK; the last such PSN follows */
    uint32_t ack_psn;
};
#pragma pack(pop)

/* Place the RDMA WRITE packets of records[from..count) that continue QP r->qpn's expected PSN from its peer, as
 * responder.py places them, while nothing is unusual: another QP or source, a PSN out of sequence, another opcode,
 * a region other than the one known, a size the message does not allow. Those (and everything after) are the
 * caller's, whose Python path answers them; records dropped at parse are skipped. The index of the first record
 * not taken. */
int wc_place_writes(struct write_run *r, const struct record *records, int from, int count, const uint8_t *slots,
                    uint32_t slot_size) {
    int i = from;
    for (; i < count; i++) {
        const struct record *p = records + i;
        if (p->status)
            continue;
        uint8_t op = p->opcode;
        const uint8_t *w = wc_write_opcodes; /* FIRST, MIDDLE, LAST, ONLY */
        int first = op == w[0] || op == w[3], last = op == w[2] || op == w[3];
        if (p->dest_qp != r->qpn || p->src_ip != r->peer || p->psn != r->epsn
            || !(first || last || op == w[1]))
            break;
        uint64_t target = r->target, offset = r->offset, length = r->length, va = r->message_va;
        if (first) {
            if (r->in_write || !r->write_ok)
                break;
            va = p->remote_addr, length = p->dma_length, offset = 0, target = 0;
            if (length) {
                uint64_t within = va - r->region_va;
                if (!r->region_at || p->rkey != r->rkey || va < r->region_va || within > r->region_size
                    || length > r->region_size - within)
                    break;
                target = r->region_at + within;
            }
        } else if (!r->in_write) {
            break;
        }
        uint64_t size = p->payload_length, end = offset + size;
        if (size > r->mtu || (!last && size != r->mtu) || end > length || (last && end != length))
            break;
        if (size)
            memcpy((uint8_t *)(uintptr_t)target + offset, slots + (size_t)i * slot_size + p->payload_at, size);
        r->epsn = (p->psn + 1) & PSN_MASK;
        r->offset = end, r->length = length, r->message_va = va;
        if (last)
            r->in_write = 0, r->target = 0, r->messages++, r->bytes += length;
        else
            r->in_write = 1, r->target = target;
        if (p->ack_req)
            r->ack_owed = 1, r->ack_psn = p->psn;
    }
    return i;
}
