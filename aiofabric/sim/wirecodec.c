/* The emulator's compiled codec: RoCEv2 packets encoded straight into sendmmsg slots (from Packets, Segments and
 * the requester's bursts of WQE rows) and received datagrams checked and parsed into records, as codec.py and icrc.py
 * encode and decode them (wirecore.h says what the halves share). */
#include "wirecore.h"

typedef uint32_t (*crc32_fn)(uint32_t crc, const uint8_t *data, uint64_t length);

static crc32_fn given_crc; /* ISA-L's crc32_gzip_refl (zlib's crc32), when the caller has it */
static uint32_t crc_table[8][256]; /* slice-by-8, otherwise */
HIDDEN uint8_t wc_layout[256], wc_header_size[256];
HIDDEN uint8_t wc_write_opcodes[4];

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
    memcpy(wc_write_opcodes, writes, 4);
    for (int op = 0; op < 256; op++) {
        wc_layout[op] = layouts[op];
        wc_header_size[op] = sizes[op];
        if ((layouts[op] & L_KNOWN) && sizes[op] != BTH_SIZE + extension_size(layouts[op]))
            return -1 - op;
    }
    return 0;
}

uint32_t wc_crc32(uint32_t crc, const uint8_t *p, uint64_t n) { return crc32(crc, p, n); }

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
    uint8_t l = wc_layout[f->opcode];
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
    return wc_header_size[opcode] + size + 3 + ICRC_SIZE <= o->slot_size;
}

/* Packets of a Segments from its packet *done on, as codec.encode_segments_into makes them; 0, or -1 if refused. */
static int encode_segments(const struct segments *s, int32_t *done, struct out *o) {
    for (; *done < (int32_t)s->count && o->filled < o->capacity; ++*done) {
        uint32_t k = s->start + *done;
        int first = k == 0, last = k == s->npkts - 1;
        /* a packet past the message's bytes (the path MTU grew since they were counted) is the codec's to slice */
        uint64_t begin = (uint64_t)k * s->mtu, end = last ? s->dma_length : begin + s->mtu;
        struct fields f = {0};
        f.opcode = s->opcodes[first << 1 | last];
        uint8_t l = wc_layout[f.opcode];
        if (!(l & L_KNOWN) || end < begin || end > s->dma_length || (end > begin && !(l & L_PAYLOAD))
            || !fits(o, f.opcode, end - begin))
            return -1;
        f.flags = last && s->solicited ? 0x80 : 0;
        f.pkey = s->pkey;
        f.qpn_word = s->dest_qp & QPN_MASK;
        f.psn_word = (uint32_t)(*done < 64 && (s->acks >> *done) & 1) << 31 | ((s->first_psn + k) & PSN_MASK);
        f.remote_addr = s->remote_addr, f.rkey = s->rkey, f.dma_length = s->dma_length, f.immediate = s->immediate;
        filled(o, put_packet(next_slot(o), &f, (const uint8_t *)(uintptr_t)s->data + begin, end - begin, s->src_ip,
                             s->dst_ip, s->src_port, s->dst_port, s->ip_id), s->name);
    }
    return 0;
}

/* One Packet, as codec.encode_into makes it; 0, or -1 if refused. */
static int encode_packet(const struct packet *p, int32_t *done, struct out *o) {
    uint8_t l = wc_layout[p->opcode];
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
        uint64_t begin = (uint64_t)k * b->mtu, end = last ? w->length : begin + b->mtu; /* as in encode_segments */
        struct fields f = {0};
        f.opcode = wc_sq.opcodes[w->type][first << 1 | last];
        if (end < begin || end > w->length || !fits(o, f.opcode, end - begin))
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
 * not carry, a packet longer than a slot or past its message's bytes) stops it with cursor[2] = 1, at the packet
 * refused. */
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
        uint8_t opcode = v[0], flags = v[1], l = wc_layout[opcode];
        if (!(l & L_KNOWN)) {
            r->status = OPCODE;
            continue;
        }
        if (flags & 0x0F) {
            r->status = VERSION;
            continue;
        }
        uint32_t pad = flags >> 4 & 3, header_end = wc_header_size[opcode];
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
