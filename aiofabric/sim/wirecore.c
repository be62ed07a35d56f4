/* The emulated NIC's per-packet loops, compiled: RoCEv2 packets encoded straight into sendmmsg slots and received
 * datagrams checked and parsed into fixed records. native.py builds this at first use and describes the records; the
 * Python codec (codec.py, icrc.py) is the reference these loops must match byte for byte, and the path taken when
 * no C compiler is at hand. Nothing here allocates, keeps a pointer past a call, or calls back into Python. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PSN_MASK 0xFFFFFFu
#define QPN_MASK 0xFFFFFFu
#define ROCE_PORT 4791
#define BTH_SIZE 12
#define ICRC_SIZE 4

/* What follows the BTH, per opcode (native.py passes the table packets.py defines). */
enum { L_RETH = 1, L_AETH = 2, L_IMM = 4, L_ATOMIC = 8, L_ATOMIC_ACK = 16, L_PAYLOAD = 32, L_CNP = 64, L_KNOWN = 128 };

typedef uint32_t (*crc32_fn)(uint32_t crc, const uint8_t *data, uint64_t length);

static crc32_fn given_crc; /* ISA-L's crc32_gzip_refl (zlib's crc32), when the caller has it */
static uint32_t crc_table[8][256]; /* slice-by-8, otherwise */
static uint8_t layout[256], header_size[256];
static uint8_t write_first, write_middle, write_last, write_only; /* RDMA WRITE opcodes without immediate */

/* The send queue's format (hw/wqe.py, sendqueue.py), as wqeblock.py tells wc_sq_format. */
#pragma pack(push, 1)
struct sq_format {
    uint32_t slot, header_slots, static_slots; /* SQ_SLOT, SQ_WQE_HEADER_SLOTS, SQ_STATIC_WQE_SLOTS */
    /* byte offsets in a WQE's first three slots: type, flags, size, immediate, length, remote VA and key, SGE */
    uint32_t type_at, flags_at, size_at, imm_at, length_at, remote_va_at, rkey_at, va_at, lkey_at, sge_size_at;
    uint8_t signal, fence, solicit, inline_data; /* flag bits */
    uint8_t rdma[256]; /* WQE type -> 1: a WRITE (has a remote address and key), 2: a SEND, 0: neither */
    uint8_t opcodes[256][4]; /* WQE type -> its packets' opcodes: middle, last, first, only */
};
#pragma pack(pop)
static struct sq_format sq;

static uint32_t table_crc(uint32_t crc, const uint8_t *p, uint64_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint32_t one = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t two = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = crc_table[7][one & 0xFF] ^ crc_table[6][(one >> 8) & 0xFF] ^ crc_table[5][(one >> 16) & 0xFF]
              ^ crc_table[4][one >> 24] ^ crc_table[3][two & 0xFF] ^ crc_table[2][(two >> 8) & 0xFF]
              ^ crc_table[1][(two >> 16) & 0xFF] ^ crc_table[0][two >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#define SHORT_CRC 256 /* below this many bytes the table beats ISA-L's set-up */

static uint32_t crc32(uint32_t crc, const uint8_t *p, uint64_t n) {
    return given_crc && n >= SHORT_CRC ? given_crc(crc, p, n) : table_crc(crc, p, n);
}

static size_t extension_size(uint8_t l) {
    return (l & (L_RETH | L_ATOMIC) ? 12 : 0) + (l & L_RETH ? 4 : 0) + (l & L_AETH ? 4 : 0) + (l & L_IMM ? 4 : 0)
           + (l & L_ATOMIC ? 16 : 0) + (l & L_ATOMIC_ACK ? 8 : 0) + (l & L_CNP ? 16 : 0);
}

/* The opcode table, the RDMA WRITE opcodes (FIRST, MIDDLE, LAST, ONLY) and the CRC: 0, or -1 - the first opcode
 * whose header size disagrees with the table's rule. */
void wc_sq_format(const struct sq_format *format) { sq = *format; }

int wc_init(crc32_fn crc, const uint8_t *layouts, const uint8_t *sizes, const uint8_t *writes) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
    given_crc = crc;
    write_first = writes[0], write_middle = writes[1], write_last = writes[2], write_only = writes[3];
    for (int op = 0; op < 256; op++) {
        layout[op] = layouts[op];
        header_size[op] = sizes[op];
        if ((layouts[op] & L_KNOWN) && sizes[op] != BTH_SIZE + extension_size(layouts[op]))
            return -1 - op;
    }
    return 0;
}

uint32_t wc_crc32(uint32_t crc, const uint8_t *p, uint64_t n) { return crc32(crc, p, n); }

static void put16(uint8_t *p, uint32_t v) { p[0] = v >> 8; p[1] = v; }
static void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }
static void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }
static uint32_t get16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

/* The ICRC of the `n` bytes at `packet` (BTH onwards, ICRC excluded) under an IPv4/UDP header with DF: the CRC-32 of
 * eight 0xFF bytes, that header with TOS, TTL and checksums all ones, and the packet with BTH byte 4 all ones
 * (icrc.icrc is the rule written plainly). */
static uint32_t icrc(const uint8_t *packet, uint32_t n, uint32_t src, uint32_t dst, uint32_t src_port,
                     uint32_t dst_port, uint32_t ip_id) {
    uint8_t head[8 + 20 + 8 + BTH_SIZE];
    uint32_t udp_length = 8 + n + ICRC_SIZE;
    memset(head, 0xFF, 8);
    uint8_t *ip = head + 8, *udp = head + 28;
    ip[0] = 0x45, ip[1] = 0xFF;
    put16(ip + 2, 20 + udp_length);
    put16(ip + 4, ip_id);
    put16(ip + 6, 0x4000);
    ip[8] = 0xFF, ip[9] = 17, ip[10] = ip[11] = 0xFF;
    put32(ip + 12, src);
    put32(ip + 16, dst);
    put16(udp, src_port);
    put16(udp + 2, dst_port);
    put16(udp + 4, udp_length);
    udp[6] = udp[7] = 0xFF;
    memcpy(head + 36, packet, BTH_SIZE);
    head[36 + 4] = 0xFF;
    return crc32(crc32(0, head, sizeof head), packet + BTH_SIZE, n - BTH_SIZE);
}

uint32_t wc_icrc(const uint8_t *packet, uint32_t n, uint32_t src, uint32_t dst, uint32_t src_port,
                 uint32_t dst_port, uint32_t ip_id) {
    return icrc(packet, n, src, dst, src_port, dst_port, ip_id);
}

static int32_t psn_diff(uint32_t a, uint32_t b) { return (int32_t)(((a - b + 0x800000u) & PSN_MASK)) - 0x800000; }

/* A WQE fetched into a block (wqeblock.py `ROW`): what sendqueue.SendWqe holds of a one-SGE WRITE or SEND. */
#pragma pack(push, 1)
struct row {
    uint64_t index, data, remote_va, va; /* data: the message's bytes here; va: its SGE's, in the local region */
    uint32_t slot, length, rkey, imm, first_psn, npkts, sge_size;
    uint8_t type, signaled, solicited, fence, region, pad[3];
};
#pragma pack(pop)

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
    return (const uint8_t *)(uintptr_t)pages[slot >> q->page_shift] + (((uint64_t)slot * sq.slot) & q->page_mask);
}

static uint32_t le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

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
        memcpy(wqe + 32, sq_slot(q, q->fetched + sq.header_slots), 16);
        uint8_t type = wqe[sq.type_at], flags = wqe[sq.flags_at], size = wqe[sq.size_at];
        if (size != sq.header_slots + 1 || size > available || size > q->largest || !sq.rdma[type]
            || flags & sq.inline_data)
            return;
        uint32_t length = le32(wqe + sq.length_at), lkey = le32(wqe + sq.lkey_at), sge_size = le32(wqe + sq.sge_size_at);
        uint64_t va = le64(wqe + sq.va_at), data = 0, within = va - q->region_va;
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
        w->length = length, w->imm = le32(wqe + sq.imm_at), w->sge_size = sge_size, w->type = type;
        if (sq.rdma[type] == 1)
            w->remote_va = le64(wqe + sq.remote_va_at), w->rkey = le32(wqe + sq.rkey_at);
        w->signaled = (flags & sq.signal) || q->force_completion;
        w->solicited = (flags & sq.solicit) != 0, w->fence = (flags & sq.fence) != 0;
        w->region = q->region;
        w->first_psn = q->next_psn;
        w->npkts = length ? (length + q->mtu - 1) / q->mtu : 1;
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

/* AckReq of the packet after `*noack` packets without one: every ack_every-th, and a message's last (requester's
 * _ack_requests, one packet at a time). */
static int ack_request(uint32_t *noack, int last, uint32_t ack_every) {
    int asked = *noack == ack_every - 1 || last;
    *noack = asked ? 0 : *noack + 1;
    return asked;
}

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

/* A transmit descriptor (native.TX_SEGMENTS, TX_PACKET, TX_BURST): packets.Segments, packets.Packet or
 * wqeblock.Burst, field for field, plus the sockaddr its datagrams go to. TX_SIZE bytes each, little-endian. */
#define TX_SIZE 128
#pragma pack(push, 1)
struct segments {
    uint8_t kind; /* 0 */
    uint8_t opcodes[4]; /* middle, last, first, only */
    uint32_t dest_qp, first_psn, npkts, mtu;
    uint64_t data; /* the message's bytes: an address in this process */
    uint32_t dma_length;
    uint64_t remote_addr;
    uint32_t rkey, immediate;
    uint8_t solicited;
    uint32_t start, count;
    uint64_t acks;
    uint16_t pkey;
    uint32_t src_ip, dst_ip;
    uint16_t src_port, dst_port, ip_id;
    uint64_t name;
};
struct packet {
    uint8_t kind; /* 1 */
    uint8_t opcode, ack_req, solicited, migreq, fecn, becn;
    uint32_t dest_qp, psn;
    uint16_t pkey;
    uint64_t remote_addr;
    uint32_t rkey, dma_length;
    uint8_t syndrome;
    uint32_t msn, immediate;
    uint64_t swap_add, compare, original;
    uint64_t payload;
    uint32_t payload_length;
    uint32_t src_ip, dst_ip;
    uint16_t src_port, dst_port, ip_id;
    uint64_t name;
};
struct burst {
    uint8_t kind; /* 2 */
    uint64_t rows; /* a copy of the rows the burst's packets come from */
    uint32_t pkt, count, noack, ack_every; /* the first row's first packet; packets; noack before the first */
    uint32_t mtu, dest_qp;
    uint16_t pkey;
    uint32_t src_ip, dst_ip;
    uint16_t src_port, dst_port, ip_id;
    uint64_t name;
};
#pragma pack(pop)

struct fields {
    uint32_t opcode, flags, pkey, qpn_word, psn_word;
    uint64_t remote_addr;
    uint32_t rkey, dma_length, aeth, immediate;
    uint64_t swap_add, compare, original;
};

/* BTH and the extension headers `f.opcode` carries at `out`; their size. */
static size_t put_headers(uint8_t *out, const struct fields *f) {
    uint8_t l = layout[f->opcode];
    uint8_t *p = out + BTH_SIZE;
    out[0] = f->opcode, out[1] = f->flags;
    put16(out + 2, f->pkey);
    put32(out + 4, f->qpn_word);
    put32(out + 8, f->psn_word);
    if (l & (L_RETH | L_ATOMIC))
        put64(p, f->remote_addr), put32(p + 8, f->rkey), p += 12;
    if (l & L_RETH)
        put32(p, f->dma_length), p += 4;
    if (l & L_AETH)
        put32(p, f->aeth), p += 4;
    if (l & L_IMM)
        put32(p, f->immediate), p += 4;
    if (l & L_ATOMIC)
        put64(p, f->swap_add), put64(p + 8, f->compare), p += 16;
    if (l & L_ATOMIC_ACK)
        put64(p, f->original), p += 8;
    if (l & L_CNP)
        memset(p, 0, 16), p += 16;
    return p - out;
}

/* Headers, payload, pad and ICRC of one packet at `out`; its UDP payload length. */
static uint32_t put_packet(uint8_t *out, struct fields *f, const uint8_t *payload, uint32_t size, uint32_t src,
                           uint32_t dst, uint32_t src_port, uint32_t dst_port, uint32_t ip_id) {
    uint32_t pad = -size & 3;
    f->flags |= pad << 4;
    size_t at = put_headers(out, f);
    if (size)
        memcpy(out + at, payload, size);
    memset(out + at + size, 0, pad);
    uint32_t n = at + size + pad;
    uint32_t crc = icrc(out, n, src, dst, src_port, dst_port, ip_id);
    out[n] = crc, out[n + 1] = crc >> 8, out[n + 2] = crc >> 16, out[n + 3] = crc >> 24; /* little-endian, as rxe */
    return n + ICRC_SIZE;
}

/* Where packet `filled` of a call goes: its slot, and its iovec's length and mmsghdr's destination once written. */
struct out {
    uint8_t *slots, *messages, *iovecs;
    uint32_t slot_size, message_size, name_at;
    int filled, capacity;
};

static uint8_t *next_slot(const struct out *o) { return o->slots + (size_t)o->filled * o->slot_size; }

static void filled(struct out *o, uint32_t length, uint64_t name) {
    *(size_t *)(o->iovecs + (size_t)o->filled * 2 * sizeof(size_t) + sizeof(size_t)) = length;
    *(uint64_t *)(o->messages + (size_t)o->filled * o->message_size + o->name_at) = name;
    o->filled++;
}

static int fits(const struct out *o, uint8_t opcode, uint64_t size) {
    return header_size[opcode] + size + 3 + ICRC_SIZE <= o->slot_size;
}

/* Packets of a Segments from its packet *done on, as codec.encode_segments_into makes them; 0, or -1 if refused. */
static int encode_segments(const struct segments *s, int32_t *done, struct out *o) {
    for (; *done < (int32_t)s->count && o->filled < o->capacity; ++*done) {
        uint32_t k = s->start + *done;
        int first = k == 0, last = k == s->npkts - 1;
        uint32_t begin = k * s->mtu, end = last ? s->dma_length : begin + s->mtu;
        struct fields f = {0};
        f.opcode = s->opcodes[first << 1 | last];
        uint8_t l = layout[f.opcode];
        if (!(l & L_KNOWN) || end < begin || (end > begin && !(l & L_PAYLOAD)) || !fits(o, f.opcode, end - begin))
            return -1;
        f.flags = last && s->solicited ? 0x80 : 0;
        f.pkey = s->pkey;
        f.qpn_word = s->dest_qp & QPN_MASK;
        f.psn_word = (uint32_t)((s->acks >> *done) & 1) << 31 | ((s->first_psn + k) & PSN_MASK);
        f.remote_addr = s->remote_addr, f.rkey = s->rkey, f.dma_length = s->dma_length, f.immediate = s->immediate;
        filled(o, put_packet(next_slot(o), &f, (const uint8_t *)(uintptr_t)s->data + begin, end - begin, s->src_ip,
                             s->dst_ip, s->src_port, s->dst_port, s->ip_id), s->name);
    }
    return 0;
}

/* One Packet, as codec.encode_into makes it; 0, or -1 if refused. */
static int encode_packet(const struct packet *p, int32_t *done, struct out *o) {
    uint8_t l = layout[p->opcode];
    if (!(l & L_KNOWN) || (p->payload_length && !(l & L_PAYLOAD)) || !fits(o, p->opcode, p->payload_length))
        return -1;
    struct fields f = {0};
    f.opcode = p->opcode;
    f.flags = p->solicited << 7 | p->migreq << 6;
    f.pkey = p->pkey;
    f.qpn_word = (uint32_t)p->fecn << 31 | (uint32_t)p->becn << 30 | (p->dest_qp & QPN_MASK);
    f.psn_word = (uint32_t)p->ack_req << 31 | (p->psn & PSN_MASK);
    f.remote_addr = p->remote_addr, f.rkey = p->rkey, f.dma_length = p->dma_length;
    f.aeth = (uint32_t)p->syndrome << 24 | (p->msn & 0xFFFFFFu);
    f.immediate = p->immediate;
    f.swap_add = p->swap_add, f.compare = p->compare, f.original = p->original;
    filled(o, put_packet(next_slot(o), &f, (const uint8_t *)(uintptr_t)p->payload, p->payload_length, p->src_ip,
                         p->dst_ip, p->src_port, p->dst_port, p->ip_id), p->name);
    *done = 1;
    return 0;
}

/* Packets of a Burst from its packet *done on, as the Segments its rows stand for (wqeblock.Burst.segments). */
static int encode_burst(const struct burst *b, int32_t *done, struct out *o) {
    const struct row *rows = (const struct row *)(uintptr_t)b->rows;
    uint32_t row = 0, k = b->pkt, noack = b->noack;
    for (int32_t skip = *done; skip > 0; skip--) { /* to packet *done of the burst */
        ack_request(&noack, k == rows[row].npkts - 1, b->ack_every);
        if (++k == rows[row].npkts)
            row++, k = 0;
    }
    for (; *done < (int32_t)b->count && o->filled < o->capacity; ++*done) {
        const struct row *w = rows + row;
        int first = k == 0, last = k == w->npkts - 1;
        uint32_t begin = k * b->mtu, end = last ? w->length : begin + b->mtu;
        struct fields f = {0};
        f.opcode = sq.opcodes[w->type][first << 1 | last];
        if (!fits(o, f.opcode, end - begin))
            return -1;
        f.flags = last && w->solicited ? 0x80 : 0;
        f.pkey = b->pkey;
        f.qpn_word = b->dest_qp & QPN_MASK;
        f.psn_word = (uint32_t)ack_request(&noack, last, b->ack_every) << 31 | ((w->first_psn + k) & PSN_MASK);
        f.remote_addr = w->remote_va, f.rkey = w->rkey, f.dma_length = w->length, f.immediate = w->imm;
        filled(o, put_packet(next_slot(o), &f, (const uint8_t *)(uintptr_t)w->data + begin, end - begin, b->src_ip,
                             b->dst_ip, b->src_port, b->dst_port, b->ip_id), b->name);
        if (++k == w->npkts)
            row++, k = 0;
    }
    return 0;
}

/* Encode the packets the descriptors stand for, from cursor[0] (descriptor) and cursor[1] (its packet, counted from
 * its first) on, into `slots` (slot i at slots + i * slot_size), at most `capacity` of them; for each, set its iovec's
 * length and its mmsghdr's destination (`name_at` bytes into each `message_size`-byte message). Moves the cursor;
 * the number of slots filled. A descriptor this cannot encode (an opcode outside the table, a payload its opcode does
 * not carry, a packet longer than a slot) stops it with cursor[2] = 1, at the packet refused. */
int wc_encode(const uint8_t *descriptors, int count, int32_t *cursor, uint8_t *slots, uint32_t slot_size, int capacity,
              uint8_t *messages, uint32_t message_size, uint32_t name_at, uint8_t *iovecs) {
    struct out o = {slots, messages, iovecs, slot_size, message_size, name_at, 0, capacity};
    cursor[2] = 0;
    while (cursor[0] < count && o.filled < capacity) {
        const uint8_t *d = descriptors + (size_t)cursor[0] * TX_SIZE;
        int refused, total;
        if (d[0] == 0)
            refused = encode_segments((const struct segments *)d, &cursor[1], &o),
            total = ((const struct segments *)d)->count;
        else if (d[0] == 1)
            refused = encode_packet((const struct packet *)d, &cursor[1], &o), total = 1;
        else
            refused = encode_burst((const struct burst *)d, &cursor[1], &o), total = ((const struct burst *)d)->count;
        if (refused) {
            cursor[2] = 1;
            break;
        }
        if (cursor[1] >= total)
            cursor[0]++, cursor[1] = 0;
    }
    return o.filled;
}

/* A received datagram, checked and parsed (native.RECORD): the fields of packets.Packet in its order, then what the
 * Python side needs to make one. status is 0, or why the datagram is dropped: RX_DROPS in native.py. */
#pragma pack(push, 1)
struct record {
    uint8_t opcode;
    uint32_t dest_qp, psn;
    uint8_t ack_req, solicited;
    uint16_t pkey;
    uint8_t fecn, becn;
    uint64_t remote_addr;
    uint32_t rkey, dma_length;
    uint8_t syndrome;
    uint32_t msn, immediate;
    uint8_t migreq;
    uint64_t swap_add, compare, original;
    uint8_t status;
    uint32_t src_ip;
    uint16_t src_port;
    uint32_t payload_at, payload_length;
};
#pragma pack(pop)

enum { OK, FOREIGN, SHORT, ICRC, OPCODE, VERSION, LENGTH, RX_STATUSES };

/* Check and parse `count` received datagrams: datagram i is in slots + i * slot_size, its length the u32 `length_at`
 * bytes into message i (`message_size` bytes each), its source the sockaddr_in at names + 16 i. Fills records[i] and
 * counts them by status in `counted` (RX_STATUSES entries). */
void wc_parse(const uint8_t *slots, uint32_t slot_size, const uint8_t *messages, uint32_t message_size,
              uint32_t length_at, const uint8_t *names, int count, uint32_t local_ip, struct record *records,
              uint32_t *counted) {
    memset(counted, 0, RX_STATUSES * sizeof *counted);
    for (int i = 0; i < count; i++) {
        const uint8_t *v = slots + (size_t)i * slot_size, *name = names + (size_t)i * 16;
        uint32_t size = *(const uint32_t *)(messages + (size_t)i * message_size + length_at);
        struct record *r = records + i;
        memset(r, 0, sizeof *r);
        r->src_port = get16(name + 2);
        r->src_ip = get32(name + 4);
        if (r->src_port != ROCE_PORT && name[4] == 127) {
            r->status = FOREIGN;
            continue;
        }
        if (size < BTH_SIZE + ICRC_SIZE) {
            r->status = SHORT;
            continue;
        }
        uint32_t crc = icrc(v, size - ICRC_SIZE, r->src_ip, local_ip, r->src_port, ROCE_PORT, 0);
        const uint8_t *got = v + size - ICRC_SIZE;
        if (crc != ((uint32_t)got[0] | (uint32_t)got[1] << 8 | (uint32_t)got[2] << 16 | (uint32_t)got[3] << 24)) {
            r->status = ICRC;
            continue;
        }
        uint8_t opcode = v[0], flags = v[1], l = layout[opcode];
        if (!(l & L_KNOWN)) {
            r->status = OPCODE;
            continue;
        }
        if (flags & 0x0F) {
            r->status = VERSION;
            continue;
        }
        uint32_t pad = flags >> 4 & 3, header_end = header_size[opcode];
        int64_t payload_end = (int64_t)size - ICRC_SIZE - pad;
        if (!(l & L_PAYLOAD) ? pad || size != header_end + ICRC_SIZE
                             : payload_end < header_end || (size - header_end) % 4) {
            r->status = LENGTH;
            continue;
        }
        uint32_t qpn_word = get32(v + 4), psn_word = get32(v + 8);
        r->opcode = opcode;
        r->dest_qp = qpn_word & QPN_MASK;
        r->psn = psn_word & PSN_MASK;
        r->ack_req = psn_word >> 31;
        r->solicited = flags >> 7;
        r->pkey = get16(v + 2);
        r->fecn = qpn_word >> 31;
        r->becn = qpn_word >> 30 & 1;
        r->migreq = flags >> 6 & 1;
        const uint8_t *p = v + BTH_SIZE;
        if (l & (L_RETH | L_ATOMIC))
            r->remote_addr = get64(p), r->rkey = get32(p + 8), p += 12;
        if (l & L_RETH)
            r->dma_length = get32(p), p += 4;
        if (l & L_AETH)
            r->syndrome = p[0], r->msn = get32(p) & 0xFFFFFFu, p += 4;
        if (l & L_IMM)
            r->immediate = get32(p), p += 4;
        if (l & L_ATOMIC)
            r->swap_add = get64(p), r->compare = get64(p + 8), p += 16;
        if (l & L_ATOMIC_ACK)
            r->original = get64(p);
        r->payload_at = header_end;
        r->payload_length = (l & L_PAYLOAD) ? (uint32_t)(payload_end - header_end) : 0;
    }
    for (int i = 0; i < count; i++)
        counted[records[i].status]++;
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
        int first = op == write_first || op == write_only, last = op == write_last || op == write_only;
        if (p->dest_qp != r->qpn || p->src_ip != r->peer || p->psn != r->epsn
            || !(first || last || op == write_middle))
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
