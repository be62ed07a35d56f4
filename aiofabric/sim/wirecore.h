/* What the two halves of the emulator's compiled core share (native.py builds them into one library): the opcode
 * table and the send queue's format it is told, byte order helpers, and the rows and records both read. The Python
 * codec (codec.py, icrc.py) and data path are the reference these loops must match byte for byte, and the path taken
 * when no C compiler is at hand. Nothing here allocates, keeps a pointer past a call, or calls back into Python. */
#ifndef WIRECORE_H
#define WIRECORE_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PSN_MASK 0xFFFFFFu
#define QPN_MASK 0xFFFFFFu
#define ROCE_PORT 4791
#define BTH_SIZE 12
#define ICRC_SIZE 4
#define HIDDEN __attribute__((visibility("hidden")))

/* What follows the BTH, per opcode (native.py passes the table packets.py defines). */
enum { L_RETH = 1, L_AETH = 2, L_IMM = 4, L_ATOMIC = 8, L_ATOMIC_ACK = 16, L_PAYLOAD = 32, L_CNP = 64, L_KNOWN = 128 };

extern HIDDEN uint8_t wc_layout[256], wc_header_size[256]; /* wirecodec.c's, set by wc_init */
extern HIDDEN uint8_t wc_write_opcodes[4]; /* RDMA WRITE FIRST, MIDDLE, LAST, ONLY (without immediate) */

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
extern HIDDEN struct sq_format wc_sq; /* wirequeues.c's, set by wc_sq_format */

static inline void put16(uint8_t *p, uint32_t v) { p[0] = v >> 8; p[1] = v; }
static inline void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }
static inline void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }
static inline uint32_t get16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static inline uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

static inline uint32_t le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline int32_t psn_diff(uint32_t a, uint32_t b) {
    return (int32_t)((a - b + 0x800000u) & PSN_MASK) - 0x800000;
}

/* AckReq of the packet after `*noack` packets without one: every ack_every-th, and a message's last (requester's
 * _ack_requests, one packet at a time). */
static inline int ack_request(uint32_t *noack, int last, uint32_t ack_every) {
    int asked = *noack == ack_every - 1 || last;
    *noack = asked ? 0 : *noack + 1;
    return asked;
}

/* A WQE fetched into a block (wqeblock.py `ROW`): what sendqueue.SendWqe holds of a one-SGE WRITE or SEND. */
#pragma pack(push, 1)
struct row {
    uint64_t index, data, remote_va, va; /* data: the message's bytes here; va: its SGE's, in the local region */
    uint32_t slot, length, rkey, imm, first_psn, npkts, sge_size;
    uint8_t type, signaled, solicited, fence, region, pad[3];
};
#pragma pack(pop)

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

#endif
