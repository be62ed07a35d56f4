"""A responder's RDMA WRITEs placed by the compiled core a run at a time (wirequeues.c `wc_place_writes`), straight from
the parsed datagrams (nativeio.Arrivals), without a Packet per packet.

The Python responder (responder.py) stays the reference: the core takes only in-sequence WRITE packets (FIRST, MIDDLE,
LAST, ONLY, no immediate) from the QP's peer while nothing is unusual, and leaves the first that is (a duplicate, a
gap, another opcode, a size the message does not allow, a region other than the one it knows) to the Python path,
which then answers it as always. It starts only when the responder is in its plain state: started, no NAK out, no
go-back awaited, no placement fault armed, no SEND half received, the WRITE in progress (if any) landing in one
piece of memory. Before a run it learns the region the head packet names (the region `map_remote` would find, while
it is one piece of host memory the QP's PD may write) and checks the one it knows still is. After the run it sets
the responder's state as the Python path would have left it: expected PSN, MSN, the WRITE half received and where it
lands, the counts placed, the ACK owed (tests/emulator/test_native.py holds the two paths to the same bytes, packets
and state).
"""
from __future__ import annotations

from typing import Any

from .dma import EMPTY
from .native import WRITE_RUN, Core, address
from .nativeio import Arrivals, ip_word
from .packets import MSN_MASK, WRITE_FIRST, WRITE_ONLY
from .placement import KnownRegion
from .responder import IN_WRITE, QP_REMOTE_WRITE, Responder


def place_run(core: Core, responder: Responder, batch: Arrivals, i: int, head: tuple[Any, ...]) -> int:
    """Place the WRITE packets from datagram i (its record `head`, a request to this responder's QP that passed the
    data path's checks) on; the index of the first datagram left (i: none taken, the Python path answers it)."""
    r = responder
    if not r.started or r.nak_sent or r.go_back_due or r.faults.armed or not r.placing:
        return i
    was_writing = r.in_msg == IN_WRITE
    if r.in_msg and not was_writing:
        return i
    target = 0
    if was_writing:
        if not isinstance(r.target, memoryview):
            return i  # a WRITE landing in pieces (ScatterGather): the Python path
        if len(r.target):
            target = address(r.target)
    qp, receiver = r.qp, batch.receiver
    known = r.known_region
    if known is not None and not known.holds(r.mrs):
        known = r.known_region = None
    op, rkey = head[0], head[9]
    if (op == WRITE_FIRST or op == WRITE_ONLY) and head[10] and (known is None or known.key != rkey):
        known = r.known_region = KnownRegion.learn(r.mrs, r.mem, rkey, qp.pd)
    state = receiver.run_state
    WRITE_RUN.pack_into(state, 0, qp.qpn, ip_word(r.port.peer_ip, receiver.words), qp.path_mtu,
                        qp.access & QP_REMOTE_WRITE != 0, known.key if known else 0, known.va if known else 0,
                        known.size if known else 0, known.at if known else 0, r.epsn, was_writing, target,
                        r.offset if was_writing else 0, r.msg_length if was_writing else 0, 0, 0, 0, False, 0)
    slots = receiver.receiver
    end = core.place_writes(receiver.run_state_at, receiver.records_at, i, batch.count, slots.slots_at,
                            slots.slot_size)
    if end == i:
        return i
    (*_, epsn, writing, _, offset, length, va, messages, placed_bytes, ack_owed, ack_psn) = WRITE_RUN.unpack(state)
    r.epsn, r.offset, r.msg_length = epsn, offset, length
    if writing:
        if messages or not was_writing:  # a WRITE begun in this run: it lands where its RETH says, in the region
            assert known is not None
            start = va - known.va
            r.target = known.whole[start:start + length]
        r.in_msg = IN_WRITE
    else:
        r.in_msg, r.target = 0, EMPTY
    if messages:
        r.msn = (r.msn + messages) & MSN_MASK
        placed = r.port.placed
        placed.write_messages += messages
        placed.write_bytes += placed_bytes
    if ack_owed:
        r.owe_ack(ack_psn)
    return end
